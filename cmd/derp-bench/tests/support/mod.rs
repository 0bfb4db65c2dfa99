//! What the tests of derp-bench and derp-soak share: running a program and parsing its JSON
//! document (the envelope structs mirror docs/derp-bench.md and refuse unknown fields), and
//! relays served the ways the tests need. Each test crate uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde::Deserialize;
use serde::de::DeserializeOwned;

/// Runs the program at `exe` with `args`.
pub(crate) fn run(exe: &str, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {exe}: {e}"))
}

/// Runs the program with `--json` and parses its document; fails on a failed run.
pub(crate) fn run_json<T: DeserializeOwned>(exe: &str, args: &[&str]) -> Report<T> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = run(exe, &all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{exe} {all:?} failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "JSON does not match the schema: {e}\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A path in the temporary directory, unique to this test process.
pub(crate) fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("derp-bench-test-{}-{name}", std::process::id()))
}

// ---- The envelope of every document ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Report<T> {
    pub(crate) schema_version: u32,
    pub(crate) tool_version: String,
    pub(crate) mode: String,
    pub(crate) started_unix_s: u64,
    pub(crate) procs: usize,
    pub(crate) target: TargetInfo,
    pub(crate) machine: Machine,
    pub(crate) config: serde_json::Value,
    pub(crate) result: T,
    pub(crate) warnings: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TargetInfo {
    pub(crate) url: String,
    pub(crate) spawned_server: bool,
    pub(crate) metrics_source: Option<String>,
    pub(crate) server_pid: Option<u32>,
    #[serde(default)]
    pub(crate) server_pids: Vec<u32>,
    #[serde(default)]
    pub(crate) peer_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Machine {
    pub(crate) cores: usize,
    pub(crate) bench_release_build: bool,
}

/// The document's `config`, parsed into the mode's schema.
pub(crate) fn config<T: DeserializeOwned>(report: &Report<impl std::fmt::Debug>) -> T {
    serde_json::from_value(report.config.clone()).expect("config matches the schema")
}

// ---- Relays served over HTTP and TLS ----

/// Serves the registry in the Prometheus text format, chunked, on a loopback port.
pub(crate) async fn serve_metrics(registry: prometheus::Registry) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let registry = registry.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let text = prometheus::TextEncoder::new()
                    .encode_to_string(&registry.gather())
                    .unwrap();
                let (a, b) = text.split_at(text.len() / 2);
                let body = format!("{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len());
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

/// A relay with derpd's defaults and its TLS front for 127.0.0.1, with no certificate yet;
/// the relay's metrics registry.
pub(crate) fn tls_relay() -> (
    derp_server::Server,
    derp_tls::TlsFront,
    prometheus::Registry,
) {
    let registry = prometheus::Registry::new();
    let secret = derp_proto::SecretKey::generate(&mut rand::rngs::OsRng);
    let server =
        derp_server::Server::new(derp_server::ServerConfig::new(secret), &registry).unwrap();
    let front = derp_tls::TlsFront::new(
        &server.public_key(),
        derp_tls::TlsOptions::new("127.0.0.1"),
        &registry,
    )
    .unwrap();
    (server, front, registry)
}

/// A CA made for the test and a relay behind derpd's TLS front with a certificate for
/// 127.0.0.1 that this CA issued. Returns the server, the relay's address and the CA's PEM
/// file.
pub(crate) fn private_ca_relay(
    rt: &tokio::runtime::Runtime,
) -> (
    derp_server::Server,
    std::net::SocketAddr,
    PathBuf,
    prometheus::Registry,
) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let mut ca_params = CertificateParams::default();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "derp-bench test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let mut leaf_params = CertificateParams::default();
    leaf_params.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap())];
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    let ca_file = temp_path("ca.pem");
    std::fs::write(&ca_file, ca_cert.pem()).unwrap();

    let (server, front, registry) = tls_relay();
    front
        .install(
            derp_tls::load_certs_pem(leaf.pem().as_bytes()).unwrap(),
            derp_tls::load_key_pem(leaf_key.serialize_pem().as_bytes()).unwrap(),
            derp_tls::CertOrigin::Other,
        )
        .unwrap();
    let addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = server.clone();
        tokio::spawn(async move { front.serve(&serving, listener).await });
        addr
    });
    (server, addr, ca_file, registry)
}
