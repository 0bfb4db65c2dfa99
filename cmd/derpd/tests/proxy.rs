//! derpd behind the proxies operators put in front of it, each run for real on loopback with
//! the recipe of docs/operations.md (the files in deploy/proxy, which the docs quote and a
//! test here compares): HAProxy in TCP mode with a PROXY protocol v2 header, HAProxy sharing
//! one port with a web site by SNI, nginx terminating TLS with its stream module (PROXY
//! protocol v1) and with its http module (X-Forwarded-For). In each a DERP client relays
//! through the proxy and derpd knows it by its own address: clients connect from 127.0.0.2
//! and 127.0.0.3, the proxy from 127.0.0.1, and derpd's log and its per-source unproven cap
//! see the clients.
//!
//! The trust boundaries are tested here too, each against the condition it guards: forwarded
//! headers from a peer that is not a trusted proxy (also when the PROXY protocol names that
//! peer), a PROXY header a client sends behind the balancer's, the port-80 listener's peers,
//! and the proxied address reaching the admission request and PeerPresent.
//!
//! HAProxy and nginx come from `scripts/test-tools install`; a missing one fails the test
//! with that line.

use crate::support;
use crate::tools;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use derp_client::rustls::pki_types::{CertificateDer, ServerName};
use derp_client::{Client, ClientConfig, ReceivedFrame, TransportKind};
use derp_proto::proxy_protocol::{self, Addresses, Command as ProxyCommand};
use derp_proto::{MeshKey, PublicKey};
use derp_testkit::child::LoggedChild;
use derp_testkit::raw::{RawClient, plain_info};
use support::{
    DERPD, Node, STEP, TempDir, expect_packet, free_port, recv_until, secret, write_mesh_key,
};

const HOST: &str = "derp.example.com";
const WEB_HOST: &str = "www.example.com";
const CLIENT_A: &str = "127.0.0.2";
const CLIENT_B: &str = "127.0.0.3";

// ---------------------------------------------------------------------------------------
// The recipes

fn recipe(name: &str) -> String {
    let path = tools::repo().join("deploy/proxy").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `text` with each `(from, to)` replaced; each `from` must be there, so a recipe that
/// changes fails here rather than being tested with the wrong values.
fn substitute(text: &str, pairs: &[(&str, String)]) -> String {
    let mut out = text.to_owned();
    for (from, to) in pairs {
        assert!(out.contains(from), "the recipe lost {from:?}:\n{text}");
        out = out.replace(from, to);
    }
    out
}

/// The fenced blocks of docs/operations.md that follow `<!-- recipe: PATH -->`, by PATH.
fn documented_recipes() -> Vec<(String, String)> {
    let docs = std::fs::read_to_string(tools::repo().join("docs/operations.md")).expect("docs");
    let mut out = Vec::new();
    let mut rest = docs.as_str();
    while let Some(at) = rest.find("<!-- recipe: ") {
        rest = &rest[at + "<!-- recipe: ".len()..];
        let (path, after) = rest.split_once(" -->").expect("marker end");
        let block = after
            .trim_start()
            .strip_prefix("```")
            .and_then(|b| b.split_once('\n'))
            .map(|(_, b)| b)
            .expect("a fenced block after the marker");
        let (body, _) = block.split_once("\n```").expect("fence end");
        out.push((path.to_owned(), format!("{body}\n")));
        rest = after;
    }
    out
}

#[test]
fn the_documented_recipes_are_the_tested_files() {
    let documented = documented_recipes();
    let mut files: Vec<String> = std::fs::read_dir(tools::repo().join("deploy/proxy"))
        .expect("deploy/proxy")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "{files:?}");
    for name in &files {
        let path = format!("deploy/proxy/{name}");
        let block = documented
            .iter()
            .find(|(p, _)| *p == path)
            .unwrap_or_else(|| panic!("docs/operations.md does not quote {path}"));
        assert_eq!(block.1, recipe(name), "docs/operations.md's copy of {path}");
    }
    assert_eq!(documented.len(), files.len(), "{documented:?}");
}

// ---------------------------------------------------------------------------------------
// The proxies, as processes

fn haproxy(dir: &TempDir, config: &str) -> LoggedChild {
    let cfg = dir.write("haproxy.cfg", config);
    let mut cmd = Command::new(tools::debian("haproxy", "haproxy"));
    // -db: foreground, no daemon; the pid file in the test's directory.
    cmd.arg("-db")
        .arg("-f")
        .arg(&cfg)
        .arg("-p")
        .arg(dir.path("haproxy.pid"));
    LoggedChild::spawn(&mut cmd, dir.path("haproxy.log"))
}

/// nginx with `body` (stream or http blocks) in a main file that keeps everything in `dir`:
/// foreground, one process, pid, logs and temporary files there.
fn nginx(dir: &TempDir, body: &str) -> LoggedChild {
    let stream_module = "/usr/lib/nginx/modules/ngx_stream_module.so";
    if !Path::new(stream_module).exists() {
        panic!(
            "nginx's stream module is not installed: `apt-get install --no-install-recommends \
             libnginx-mod-stream`, or run `scripts/test-tools install`"
        );
    }
    let d = dir.0.display();
    let conf = format!(
        "load_module {stream_module};\n\
         daemon off;\nmaster_process off;\nworker_processes 1;\n\
         pid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
         events {{ worker_connections 256; }}\n\
         {body}"
    );
    let file = dir.write("nginx.conf", &conf);
    let mut cmd = Command::new(tools::debian("nginx", "nginx"));
    cmd.arg("-e")
        .arg(dir.path("error.log"))
        .arg("-p")
        .arg(&dir.0)
        .arg("-c")
        .arg(&file);
    LoggedChild::spawn(&mut cmd, dir.path("nginx.out"))
}

/// The http block's settings that keep nginx's files in `dir`.
fn nginx_http_paths(dir: &TempDir) -> String {
    let d = dir.0.display();
    format!(
        "access_log {d}/access.log;\n\
         client_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n"
    )
}

// ---------------------------------------------------------------------------------------
// Certificates and derpd

/// A self-signed certificate for `name`, written as `<dir>/<name>.crt` and `.key` (what
/// manual certificate mode reads, and what the proxies are given); its DER for clients.
fn certificate(dir: &Path, name: &str) -> CertificateDer<'static> {
    std::fs::create_dir_all(dir).expect("cert dir");
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("certificate");
    std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).expect("crt");
    std::fs::write(dir.join(format!("{name}.key")), signing_key.serialize_pem()).expect("key");
    cert.der().clone()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// derpd with debug logs from the relay and the TLS front, where connections are logged
/// with their address.
fn start_derpd(extra: &[String]) -> Node {
    let mut all = args(&["--dev", "-a", "127.0.0.1:0"]);
    all.extend_from_slice(extra);
    Node::start_with_env(
        &all,
        &[(
            "RUST_LOG".into(),
            "info,derp_server=debug,derp_tls=debug".into(),
        )],
    )
}

/// derpd serving TLS for HOST from `certs`, taking PROXY protocol from 127.0.0.1.
fn start_tls_derpd(certs: &Path, extra: &[&str]) -> Node {
    let mut a = args(&[
        "--certmode",
        "manual",
        "--hostname",
        HOST,
        "--certdir",
        &certs.display().to_string(),
        "--cert-reload-interval",
        "0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxy-protocol",
        "--proxy-protocol-from",
        "127.0.0.1/32",
    ]);
    a.extend(args(extra));
    start_derpd(&a)
}

/// The port of derpd's port-80 listener, as it logged it.
fn port_80(derpd: &Node) -> u16 {
    derpd
        .log_text()
        .lines()
        .filter(|l| l.contains("port-80 listener"))
        .find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            v["fields"]["addr"].as_str()?.parse::<SocketAddr>().ok()
        })
        .expect("the port-80 listener's address")
        .port()
}

/// Everything derpd answers on a connection from `source` to 127.0.0.1:`port` that sends
/// `bytes`, until it closes (nothing when it closes at once). A close may come as a reset
/// (derpd closing with our bytes unread) or cut our write short; a derpd that neither
/// answers nor closes within the step fails the test rather than reading as "nothing".
fn exchange(source: &str, port: u16, bytes: &[u8]) -> String {
    let mut s = stalled(source, port, 1).remove(0);
    s.set_read_timeout(Some(STEP)).expect("timeout");
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let read = s.read_to_end(&mut out);
    answered(read, &out, "derpd neither answered nor closed")
}

/// What a read until the close gave, as text, unless it timed out: a reset or an end
/// without close_notify is still the server's close, but a timeout is no answer at all.
fn answered(read: std::io::Result<usize>, out: &[u8], what: &str) -> String {
    if let Err(e) = read {
        assert!(
            !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{what} within {STEP:?}; read so far: {:?}",
            String::from_utf8_lossy(out)
        );
    }
    String::from_utf8_lossy(out).into_owned()
}

/// The address a log line of derpd's gave, as `field`, for messages starting with `message`.
fn logged_addresses(node: &Node, message: &str, field: &str) -> Vec<SocketAddr> {
    node.log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(message))
        })
        .filter_map(|v| v["fields"][field].as_str()?.parse().ok())
        .collect()
}

/// Waits for a log line `message` that names `ip` in `field`.
fn wait_logged(node: &mut Node, message: &str, field: &str, ip: &str) {
    let ip: std::net::IpAddr = ip.parse().expect("ip");
    if logged_addresses(node, message, field)
        .iter()
        .any(|a| a.ip() == ip)
    {
        return;
    }
    node.wait_log(&format!("{message} from {ip}"), |v| {
        let m = v["fields"]["message"].as_str()?;
        let a: SocketAddr = v["fields"][field].as_str()?.parse().ok()?;
        (m.starts_with(message) && a.ip() == ip).then_some(())
    });
}

/// The address derpd logged for the client `key` when it connected.
fn connected_from(node: &Node, key: &PublicKey) -> SocketAddr {
    let short = key.short();
    node.find_log("the client's connected line", |v| {
        let f = &v["fields"];
        (f["message"].as_str()? == "client connected" && f["key"].as_str()? == short)
            .then(|| f["remote"].as_str()?.parse().ok())?
    })
}

/// A TCP connection from `source` to `to`.
async fn connect_from(source: &str, to: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(source.parse().expect("ip"), 0))
        .expect("bind");
    socket.connect(to).await.expect("connect")
}

/// A DERP client speaking the wire format itself on `stream` (after whatever the caller
/// wrote on it): its upgrade request carries `extra_headers` (each line ending in CRLF), and
/// it is registered when this returns.
async fn raw_client_on(stream: tokio::net::TcpStream, extra_headers: &str) -> RawClient {
    let mut c = RawClient::upgrade_on(stream, secret(), extra_headers).await;
    c.handshake(plain_info()).await;
    c
}

/// A client of `url` (dialled at 127.0.0.1:`port`) from `source`, trusting `root`, and its
/// public key.
fn client_config(
    url: &str,
    port: u16,
    source: &str,
    root: &CertificateDer<'static>,
) -> (ClientConfig, PublicKey) {
    let key = secret();
    let public = key.public_key();
    let config = ClientConfig::new(url, key)
        .expect("client config")
        .with_dial_addr(SocketAddr::from(([127, 0, 0, 1], port)))
        .with_local_addr(SocketAddr::new(source.parse().expect("ip"), 0))
        .with_extra_root(root.clone())
        .with_connect_timeout(STEP);
    (config, public)
}

fn with_transport(c: (ClientConfig, PublicKey), t: TransportKind) -> (ClientConfig, PublicKey) {
    (c.0.with_transport(t), c.1)
}

/// Two clients, from CLIENT_A and CLIENT_B, relay a packet each way; returns whether the
/// first used fast start.
async fn relay_between(a: (ClientConfig, PublicKey), b: (ClientConfig, PublicKey)) -> bool {
    let (ka, kb) = (a.1, b.1);
    let mut a = Client::connect(&a.0).await.expect("client A connects");
    let mut b = Client::connect(&b.0).await.expect("client B connects");
    a.send_packet(kb, b"from A").await.expect("send");
    expect_packet(&mut b, ka, b"from A").await;
    b.send_packet(ka, b"from B").await.expect("send");
    expect_packet(&mut a, kb, b"from B").await;
    a.used_fast_start()
}

/// An HTTP/1.1 GET over TLS to 127.0.0.1:`port` with `sni`; the response.
fn https_get(port: u16, sni: &str, root: &CertificateDer<'static>, path: &str) -> String {
    use derp_client::rustls;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root.clone()).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = ServerName::try_from(sni.to_owned()).expect("name");
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).expect("tls");
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    tcp.set_read_timeout(Some(STEP)).expect("timeout");
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut out = Vec::new();
    // nginx may close without close_notify (an UnexpectedEof): what arrived is the answer.
    let read = tls.read_to_end(&mut out);
    answered(read, &out, &format!("no answer to GET {path}"))
}

/// Opens `n` TCP connections from `source` to 127.0.0.1:`port` that send nothing.
fn stalled(source: &str, port: u16, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                .expect("socket");
            let local: SocketAddr = format!("{source}:0").parse().expect("addr");
            socket.bind(&local.into()).expect("bind");
            let to: SocketAddr = ([127, 0, 0, 1], port).into();
            socket.connect(&to.into()).expect("connect");
            socket.into()
        })
        .collect()
}

/// Whether derpd has closed a stalled connection (the proxy then closes the client's side).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).expect("timeout");
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_)) && {
        // A timeout is not a close.
        s.set_nonblocking(true).expect("nonblocking");
        !matches!(s.read(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock)
    }
}

// ---------------------------------------------------------------------------------------
// The recipes, run

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_in_tcp_mode_passes_clients_with_their_addresses_and_fast_start() {
    let dir = TempDir::new("haproxy-tcp");
    let certs = dir.path("certs");
    let root = certificate(&certs, HOST);
    let mut derpd = start_tls_derpd(
        &certs,
        &["--http-port", "0", "--max-unproven-per-source", "2"],
    );
    let http_port = port_80(&derpd);
    let (tls_port, web_port) = (free_port(), free_port());
    let config = substitute(
        &recipe("haproxy-tcp.cfg"),
        &[
            ("bind :443", format!("bind 127.0.0.1:{tls_port}")),
            ("bind :80", format!("bind 127.0.0.1:{web_port}")),
            ("127.0.0.1:8443", derpd.addr.to_string()),
            ("127.0.0.1:8080", format!("127.0.0.1:{http_port}")),
        ],
    );
    let mut proxy = haproxy(&dir, &config);
    proxy.wait_listening(tls_port, STEP);
    proxy.wait_listening(web_port, STEP);

    // Two clients relay through HAProxy, with fast start (the meta certificate passes).
    let url = format!("https://{HOST}:{tls_port}/derp");
    let fast = relay_between(
        client_config(&url, tls_port, CLIENT_A, &root),
        client_config(&url, tls_port, CLIENT_B, &root),
    )
    .await;
    assert!(fast, "fast start through a TCP proxy");
    for ip in [CLIENT_A, CLIENT_B] {
        wait_logged(&mut derpd, "client connected", "remote", ip);
    }
    assert!(
        derpd
            .metric(
                "derp_proxy_protocol_headers",
                &[("listener", "main"), ("command", "proxy")]
            )
            .is_some_and(|n| n >= 2.0)
    );

    // The port-80 listener behind the same proxy.
    let mut s = TcpStream::connect(("127.0.0.1", web_port)).expect("connect");
    s.set_read_timeout(Some(STEP)).expect("timeout");
    write!(
        s,
        "GET /generate_204 HTTP/1.1\r\nHost: {HOST}\r\nX-Tailscale-Challenge: abc\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}");
    assert!(answer.contains("response abc"), "{answer}");
    // (The wait for HAProxy to listen also made connections through it.)
    derpd.wait_metric(
        "derp_proxy_protocol_headers",
        &[("listener", "http_port"), ("command", "proxy")],
        |n| n >= 1.0,
    );

    // The per-source cap (2) applies to each client, not to the proxy they share: three
    // stalled handshakes from A lose A's oldest, two from B lose nothing.
    let evicted = || {
        derpd
            .metric("derp_unproven_evicted", &[("cause", "per_source")])
            .unwrap_or(0.0)
    };
    let headers = |d: &Node| {
        d.metric(
            "derp_proxy_protocol_headers",
            &[("listener", "main"), ("command", "proxy")],
        )
        .unwrap_or(0.0)
    };
    let before = headers(&derpd);
    let mut a = stalled(CLIENT_A, tls_port, 2);
    let _b = stalled(CLIENT_B, tls_port, 2);
    // At least: a connection HAProxy opened for the listening probes above may reach derpd
    // after `before` was read.
    derpd.wait_metric(
        "derp_proxy_protocol_headers",
        &[("listener", "main"), ("command", "proxy")],
        |n| n >= before + 4.0,
    );
    assert_eq!(evicted(), 0.0, "four stalled, two per client");
    a.extend(stalled(CLIENT_A, tls_port, 1));
    derpd.wait_metric("derp_unproven_evicted", &[("cause", "per_source")], |n| {
        n == 1.0
    });
    assert!(closed_within(&mut a[0], STEP), "A's oldest was closed");
    wait_logged(&mut derpd, "tls handshake evicted", "remote", CLIENT_A);
    assert!(
        !logged_addresses(&derpd, "tls handshake evicted", "remote")
            .iter()
            .any(|r| r.ip().to_string() == CLIENT_B),
        "B lost nothing"
    );
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_port_shared_with_a_web_site_by_sni() {
    let dir = TempDir::new("haproxy-sni");
    let certs = dir.path("certs");
    let root = certificate(&certs, HOST);
    let web_root = certificate(&certs, WEB_HOST);
    let mut derpd = start_tls_derpd(&certs, &["--http-port", "-1"]);

    // The web site: nginx serving a page over its own TLS.
    let web_port = free_port();
    let c = certs.display();
    let site = format!(
        "http {{\n{}\
         server {{\n listen 127.0.0.1:{web_port} ssl;\n server_name {WEB_HOST};\n\
         ssl_certificate {c}/{WEB_HOST}.crt;\n ssl_certificate_key {c}/{WEB_HOST}.key;\n\
         location / {{ return 200 \"the web site\\n\"; }}\n }}\n}}\n",
        nginx_http_paths(&dir)
    );
    let web_dir = TempDir::new("haproxy-sni-web");
    let mut web = nginx(&web_dir, &site);
    web.wait_listening(web_port, STEP);

    let port = free_port();
    let config = substitute(
        &recipe("haproxy-sni.cfg"),
        &[
            ("bind :443", format!("bind 127.0.0.1:{port}")),
            ("127.0.0.1:8443", derpd.addr.to_string()),
            ("127.0.0.1:8444", format!("127.0.0.1:{web_port}")),
        ],
    );
    let mut proxy = haproxy(&dir, &config);
    proxy.wait_listening(port, STEP);

    // The site's name reaches the site...
    let page = tokio::task::spawn_blocking({
        let web_root = web_root.clone();
        move || https_get(port, WEB_HOST, &web_root, "/")
    })
    .await
    .expect("get");
    assert!(
        page.starts_with("HTTP/1.1 200") && page.ends_with("the web site\n"),
        "{page}"
    );
    // ...and the DERP name reaches derpd, with the clients' addresses.
    let url = format!("https://{HOST}:{port}/derp");
    let fast = relay_between(
        client_config(&url, port, CLIENT_A, &root),
        client_config(&url, port, CLIENT_B, &root),
    )
    .await;
    assert!(fast, "fast start through SNI routing");
    for ip in [CLIENT_A, CLIENT_B] {
        wait_logged(&mut derpd, "client connected", "remote", ip);
    }
    // derpd's connections carried a header (and so did the wait for HAProxy to listen,
    // which has no SNI and went to the site).
    derpd.wait_metric(
        "derp_proxy_protocol_headers",
        &[("listener", "main"), ("command", "proxy")],
        |n| n >= 2.0,
    );
    drop((proxy, web));
}

/// nginx terminating TLS for a plain-HTTP derpd, in front of it as `body`; then DERP and
/// WebSocket clients from CLIENT_A and CLIENT_B relay through it and derpd logs them by their
/// addresses. Fast start is lost: nginx serves its own certificate, without derpd's meta
/// certificate. Returns nginx, still running.
async fn relay_through_nginx(
    dir: &TempDir,
    body: &str,
    port: u16,
    root: &CertificateDer<'static>,
    derpd: &mut Node,
) -> LoggedChild {
    let mut proxy = nginx(dir, body);
    proxy.wait_listening(port, STEP);
    let url = format!("https://{HOST}:{port}/derp");
    for transport in [TransportKind::Upgrade, TransportKind::WebSocket] {
        let fast = relay_between(
            with_transport(client_config(&url, port, CLIENT_A, root), transport),
            with_transport(client_config(&url, port, CLIENT_B, root), transport),
        )
        .await;
        assert!(!fast, "no fast start through nginx's own certificate");
    }
    for ip in [CLIENT_A, CLIENT_B] {
        wait_logged(derpd, "client connected", "remote", ip);
    }
    // /debug is never served through the proxy, whoever it names.
    let varz = tokio::task::spawn_blocking({
        let root = root.clone();
        move || https_get(port, HOST, &root, "/debug/varz")
    })
    .await
    .expect("get");
    assert!(
        varz.starts_with("HTTP/1.1 403") || varz.starts_with("HTTP/1.1 404"),
        "{varz}"
    );
    proxy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_stream_terminates_tls_and_sends_proxy_protocol_to_plain_derpd() {
    let dir = TempDir::new("nginx-stream");
    let certs = dir.path("certs");
    let root = certificate(&certs, HOST);
    // Its main listener takes only the proxy: metrics come from their own listener.
    let mut derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxy-protocol",
        "--proxy-protocol-from",
        "127.0.0.1/32",
    ]));
    let port = free_port();
    let c = certs.display();
    let stream = substitute(
        &recipe("nginx-stream.conf"),
        &[
            ("listen 443 ssl", format!("listen 127.0.0.1:{port} ssl")),
            ("/etc/nginx/tls", c.to_string()),
            ("127.0.0.1:8080", derpd.addr.to_string()),
        ],
    );
    let _nginx = relay_through_nginx(&dir, &stream, port, &root, &mut derpd).await;
    derpd.wait_metric(
        "derp_proxy_protocol_headers",
        &[("listener", "main"), ("command", "proxy")],
        |n| n >= 4.0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_http_passes_upgrades_and_names_clients_in_forwarded_headers() {
    let dir = TempDir::new("nginx-http");
    let certs = dir.path("certs");
    let root = certificate(&certs, HOST);
    let site_root = dir.path("www");
    std::fs::create_dir_all(&site_root).expect("www");
    std::fs::write(site_root.join("index.html"), "the site\n").expect("page");
    let mut derpd = start_derpd(&args(&["--trust-forwarded-from", "127.0.0.1/32"]));
    let port = free_port();
    let c = certs.display();
    let server = substitute(
        &recipe("nginx-http.conf"),
        &[
            ("listen 443 ssl", format!("listen 127.0.0.1:{port} ssl")),
            ("/etc/nginx/tls", c.to_string()),
            ("/var/www/html", site_root.display().to_string()),
            ("127.0.0.1:8080", derpd.addr.to_string()),
        ],
    );
    let body = format!("http {{\n{}{server}}}\n", nginx_http_paths(&dir));
    let _nginx = relay_through_nginx(&dir, &body, port, &root, &mut derpd).await;
    // The site is still the site.
    let page = tokio::task::spawn_blocking(move || https_get(port, HOST, &root, "/"))
        .await
        .expect("get");
    assert!(page.ends_with("the site\n"), "{page}");
    // A connection from the trusted proxy's address is a proxy's: /debug is refused on it,
    // with or without a forwarded header naming loopback.
    for extra in ["", "X-Forwarded-For: 127.0.0.1\r\n"] {
        let mut s = TcpStream::connect(derpd.addr).expect("connect");
        s.set_read_timeout(Some(STEP)).expect("timeout");
        write!(
            s,
            "GET /debug/varz HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n"
        )
        .expect("write");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    }
}

/// nginx that sets only `X-Real-IP` passes on a client's own `X-Forwarded-For` as the client
/// wrote it: with `--forwarded-header x-real-ip` derpd reads the header nginx set, and
/// nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_sets_only_x_real_ip_is_read_by_that_header_alone() {
    let dir = TempDir::new("nginx-real-ip");
    let derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--trust-forwarded-from",
        "127.0.0.1/32",
        "--forwarded-header",
        "x-real-ip",
    ]));
    let port = free_port();
    let body = format!(
        "http {{\n{}server {{\n listen 127.0.0.1:{port};\n location /derp {{\n\
         proxy_pass http://{};\n proxy_http_version 1.1;\n\
         proxy_set_header Upgrade $http_upgrade;\n proxy_set_header Connection \"upgrade\";\n\
         proxy_set_header X-Real-IP $remote_addr;\n }}\n}}\n}}\n",
        nginx_http_paths(&dir),
        derpd.addr
    );
    let mut proxy = nginx(&dir, &body);
    proxy.wait_listening(port, STEP);

    let stream = connect_from(CLIENT_A, SocketAddr::from(([127, 0, 0, 1], port))).await;
    let forger = raw_client_on(stream, "X-Forwarded-For: 203.0.113.7\r\n").await;
    let seen = connected_from(&derpd, &forger.key);
    assert_eq!(seen.ip().to_string(), CLIENT_A, "the client forged {seen}");
}

#[test]
fn without_a_valid_header_or_from_an_unlisted_peer_a_connection_is_refused_and_counted() {
    let derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxy-protocol",
        "--proxy-protocol-from",
        "127.0.0.1/32",
    ]));
    let send = |source: &str, bytes: &[u8]| exchange(source, derpd.addr.port(), bytes);
    let probe = b"GET /derp/probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let refused = |reason: &str| {
        derpd
            .metric(
                "derp_proxy_protocol_refused",
                &[("listener", "main"), ("reason", reason)],
            )
            .unwrap_or(0.0)
    };
    // A header, then the request: served.
    let ok = send(
        "127.0.0.1",
        &[
            b"PROXY TCP4 203.0.113.9 127.0.0.1 4000 443\r\n".as_slice(),
            probe,
        ]
        .concat(),
    );
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    // No header: closed without an answer.
    assert_eq!(send("127.0.0.1", probe), "");
    assert_eq!(refused("no_header"), 1.0);
    // A malformed one (a leading zero).
    let bad = [
        b"PROXY TCP4 203.0.113.09 127.0.0.1 4000 443\r\n".as_slice(),
        probe,
    ]
    .concat();
    assert_eq!(send("127.0.0.1", &bad), "");
    assert_eq!(refused("malformed"), 1.0);
    // A valid header from a peer that is not a listed proxy.
    let from_elsewhere = [
        b"PROXY TCP4 203.0.113.9 127.0.0.1 4000 443\r\n".as_slice(),
        probe,
    ]
    .concat();
    assert_eq!(send(CLIENT_A, &from_elsewhere), "");
    assert_eq!(refused("not_allowed"), 1.0);
    assert_eq!(
        derpd.metric(
            "derp_proxy_protocol_headers",
            &[("listener", "main"), ("command", "proxy")]
        ),
        Some(1.0)
    );
}

// ---------------------------------------------------------------------------------------
// The trust boundaries

/// An admission server for `--verify-client-url` on loopback: admits every client and keeps
/// each question's key and source, so a test sees whose address derpd asked about. Stops
/// accepting when dropped.
struct AdmissionServer {
    url: String,
    asked: Arc<std::sync::Mutex<Vec<(String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AdmissionServer {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/verify", listener.local_addr().expect("addr"));
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let asked = asked.clone();
            async move {
                while let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(answer_admission(stream, asked.clone()));
                }
            }
        });
        Self { url, asked, task }
    }

    /// The source derpd gave when it asked about `key`. derpd asks before it answers the
    /// client's handshake, so once a client is registered its question is here.
    fn source_of(&self, key: &PublicKey) -> String {
        let key = key.to_string();
        self.asked
            .lock()
            .expect("questions")
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, source)| source.clone())
            .unwrap_or_else(|| panic!("derpd never asked about {key}"))
    }
}

impl Drop for AdmissionServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One question (a POST of `{"NodePublic":…,"Source":…}`), recorded and admitted.
async fn answer_admission(
    mut stream: tokio::net::TcpStream,
    asked: Arc<std::sync::Mutex<Vec<(String, String)>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut body_at = None;
    loop {
        if body_at.is_none() {
            body_at = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|end| {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                (end + 4, len)
            });
        }
        if let Some((at, len)) = body_at
            && buf.len() >= at + len
        {
            let question: serde_json::Value =
                serde_json::from_slice(&buf[at..at + len]).expect("a JSON question");
            let field = |name: &str| question[name].as_str().unwrap_or_default().to_owned();
            asked
                .lock()
                .expect("questions")
                .push((field("NodePublic"), field("Source")));
            let answer = r#"{"Allow":true}"#;
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{answer}",
                answer.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
            return;
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A keep-alive `/derp/probe` on `stream`, its answer read to the end and no further.
async fn probe(stream: &mut tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(b"GET /derp/probe HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("probe");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let byte = tokio::time::timeout(STEP, stream.read_u8()).await;
        head.push(byte.expect("in time").expect("the probe's answer"));
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-length: 0\r\n"), "{head}");
}

/// `n` DERP upgrades from `source` to `to` that never send their ClientInfo, each carrying
/// `extra_headers`: unproven connections, each past its request head (answered 101) when
/// this returns.
async fn stalled_upgrades(
    source: &str,
    to: SocketAddr,
    extra_headers: &str,
    n: usize,
) -> Vec<RawClient> {
    let mut out = Vec::new();
    for _ in 0..n {
        let stream = connect_from(source, to).await;
        out.push(RawClient::upgrade_on(stream, secret(), extra_headers).await);
    }
    out
}

/// A peer outside --trust-forwarded-from that sends X-Forwarded-For and X-Real-IP is its own
/// address to everything: the log, the admission server and the per-source budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_from_a_peer_that_is_no_trusted_proxy_name_nobody() {
    let admission = AdmissionServer::start().await;
    let derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--trust-forwarded-from",
        "127.0.0.1/32",
        "--verify-client-url",
        &admission.url,
        "--max-unproven-per-source",
        "2",
    ]));
    let forged = "X-Forwarded-For: 203.0.113.7\r\nX-Real-IP: 203.0.113.7\r\n";
    let c = raw_client_on(connect_from(CLIENT_A, derpd.addr).await, forged).await;
    assert_eq!(connected_from(&derpd, &c.key).ip().to_string(), CLIENT_A);
    assert_eq!(admission.source_of(&c.key), CLIENT_A);
    // The same upgrade as a connection's second request, which hyper reads instead.
    let mut stream = connect_from(CLIENT_A, derpd.addr).await;
    probe(&mut stream).await;
    let c = raw_client_on(stream, forged).await;
    assert_eq!(connected_from(&derpd, &c.key).ip().to_string(), CLIENT_A);
    assert_eq!(admission.source_of(&c.key), CLIENT_A);

    // The budget: loopback peers are not capped per source, a client a proxy names is. Three
    // handshakes that stall after their upgrades, from the untrusted peer, cost nobody
    // anything; from the trusted proxy, the third is over 203.0.113.7's cap of two.
    let per_source = || {
        derpd
            .metric("derp_unproven_evicted", &[("cause", "per_source")])
            .unwrap_or(0.0)
    };
    let _untrusted = stalled_upgrades(CLIENT_A, derpd.addr, forged, 3).await;
    assert_eq!(
        per_source(),
        0.0,
        "the untrusted peer's headers were believed"
    );
    let _trusted = stalled_upgrades("127.0.0.1", derpd.addr, forged, 3).await;
    derpd.wait_metric("derp_unproven_evicted", &[("cause", "per_source")], |n| {
        n == 1.0
    });
}

/// With a balancer's PROXY protocol and trusted HTTP proxies both on, whether a forwarded
/// header is believed is judged on the address the PROXY header names, never on the
/// balancer's socket (which is itself in --trust-forwarded-from here): a client behind the
/// balancer names nobody; an HTTP proxy behind it (nginx behind HAProxy) names its client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_balancer_trust_is_judged_on_the_address_its_header_names() {
    let admission = AdmissionServer::start().await;
    let derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxy-protocol",
        "--proxy-protocol-from",
        "127.0.0.1/32",
        "--trust-forwarded-from",
        "127.0.0.1/32",
        "--verify-client-url",
        &admission.url,
        "--max-unproven-per-source",
        "2",
    ]));
    let through_balancer = |client: &'static str| async move {
        let mut s = connect_from("127.0.0.1", derpd.addr).await;
        let header = format!("PROXY TCP4 {client} 127.0.0.1 4000 80\r\n");
        tokio::io::AsyncWriteExt::write_all(&mut s, header.as_bytes())
            .await
            .expect("header");
        s
    };
    let forged = |ip: &str| format!("X-Forwarded-For: {ip}\r\nX-Real-IP: {ip}\r\n");

    let c = raw_client_on(through_balancer(CLIENT_A).await, &forged("203.0.113.7")).await;
    assert_eq!(connected_from(&derpd, &c.key).to_string(), "127.0.0.2:4000");
    assert_eq!(admission.source_of(&c.key), CLIENT_A);
    let c = raw_client_on(through_balancer("127.0.0.1").await, &forged("203.0.113.9")).await;
    assert_eq!(connected_from(&derpd, &c.key).to_string(), "203.0.113.9:0");
    assert_eq!(admission.source_of(&c.key), "203.0.113.9");

    // The budget: the header puts each connection on the client's source, capped at two,
    // where headers naming three other addresses cannot take them out of it.
    let mut stalled = Vec::new();
    for ip in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let stream = through_balancer(CLIENT_A).await;
        stalled.push(RawClient::upgrade_on(stream, secret(), &forged(ip)).await);
    }
    assert_eq!(
        derpd.metric("derp_unproven_evicted", &[("cause", "per_source")]),
        Some(1.0),
        "the client behind the balancer moved itself to other sources"
    );
}

/// A client behind a listed balancer that sends a PROXY protocol header of its own after the
/// balancer's: one header opens a connection, and what follows is the client's request, which
/// a PROXY header is not. It is answered as the bad request it is, as nobody's connection.
#[test]
fn a_proxy_header_after_the_balancers_is_request_bytes() {
    let derpd = start_derpd(&args(&[
        "--metrics-addr",
        "127.0.0.1:0",
        "--proxy-protocol",
        "--proxy-protocol-from",
        "127.0.0.1/32",
    ]));
    let balancers = b"PROXY TCP4 127.0.0.2 127.0.0.1 4000 80\r\n";
    let forged_v1 = b"PROXY TCP4 203.0.113.9 127.0.0.1 5000 80\r\n".to_vec();
    let mut forged_v2 = Vec::new();
    let addresses = Addresses::Tcp {
        source: "203.0.113.9:5000".parse().expect("addr"),
        destination: "127.0.0.1:80".parse().expect("addr"),
    };
    proxy_protocol::write_v2(ProxyCommand::Proxy, &addresses, &[], &mut forged_v2).expect("fits");
    let upgrade = derp_testkit::raw::UpgradeRequest {
        host: "x",
        path: "/derp",
        extra_headers: "",
    }
    .to_bytes();
    for forged in [forged_v1, forged_v2] {
        let answer = exchange(
            "127.0.0.1",
            derpd.addr.port(),
            &[balancers.as_slice(), &forged, &upgrade].concat(),
        );
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    }
    assert_eq!(
        derpd.metric(
            "derp_proxy_protocol_headers",
            &[("listener", "main"), ("command", "proxy")]
        ),
        Some(2.0),
        "one header per connection"
    );
    assert!(
        logged_addresses(&derpd, "client connected", "remote").is_empty(),
        "{}",
        derpd.log_text()
    );
}

/// The port-80 listener, with the PROXY protocol on, takes nobody but the listed balancers,
/// whatever an unlisted peer's header or forwarded headers say; without it, a PROXY line is
/// request bytes there too.
#[test]
fn the_port_80_listener_takes_no_header_from_an_unlisted_peer() {
    let dir = TempDir::new("port-80-trust");
    let certs = dir.path("certs");
    certificate(&certs, HOST);
    let get = b"GET /generate_204 HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 127.0.0.1\r\n\
                X-Real-IP: 127.0.0.1\r\nConnection: close\r\n\r\n";
    let header = |client: &str| format!("PROXY TCP4 {client} 127.0.0.1 4000 80\r\n").into_bytes();

    let derpd = start_tls_derpd(
        &certs,
        &["--http-port", "0", "--trust-forwarded-from", "127.0.0.1/32"],
    );
    let port = port_80(&derpd);
    let not_allowed = || {
        derpd
            .metric(
                "derp_proxy_protocol_refused",
                &[("listener", "http_port"), ("reason", "not_allowed")],
            )
            .unwrap_or(0.0)
    };
    // From an unlisted peer, with a header naming a listed balancer or without one: closed
    // unanswered.
    let answer = exchange(
        CLIENT_A,
        port,
        &[header("127.0.0.1"), get.to_vec()].concat(),
    );
    assert_eq!(answer, "");
    assert_eq!(not_allowed(), 1.0);
    assert_eq!(exchange(CLIENT_A, port, get), "");
    assert_eq!(not_allowed(), 2.0);
    // A listed balancer is served.
    let answer = exchange(
        "127.0.0.1",
        port,
        &[header(CLIENT_A), get.to_vec()].concat(),
    );
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}");
    drop(derpd);

    let plain = start_derpd(&args(&[
        "--certmode",
        "manual",
        "--hostname",
        HOST,
        "--certdir",
        &certs.display().to_string(),
        "--cert-reload-interval",
        "0",
        "--http-port",
        "0",
    ]));
    let answer = exchange(
        CLIENT_A,
        port_80(&plain),
        &[header("203.0.113.9"), get.to_vec()].concat(),
    );
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
}

/// What the module docs of derp-server's proxy.rs claim: the client's address a proxy gives
/// takes the proxy's place in the admission request and in the PeerPresent a mesh watcher
/// gets, through a trusted HTTP proxy's X-Forwarded-For and through a balancer's PROXY
/// header alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxied_address_reaches_admission_and_peer_present() {
    let dir = TempDir::new("proxied-address");
    let key_file = dir.path("mesh.key");
    let mesh_key: MeshKey = write_mesh_key(&key_file).parse().expect("mesh key");
    let admission = AdmissionServer::start().await;
    for balancer in [false, true] {
        let mut flags = args(&[
            "--metrics-addr",
            "127.0.0.1:0",
            "--mesh-psk-file",
            &key_file.display().to_string(),
            "--verify-client-url",
            &admission.url,
        ]);
        flags.extend(args(if balancer {
            &["--proxy-protocol", "--proxy-protocol-from", "127.0.0.1/32"]
        } else {
            &["--trust-forwarded-from", "127.0.0.1/32"]
        }));
        let derpd = start_derpd(&flags);
        let watcher = ClientConfig::new(&format!("http://{}/derp", derpd.addr), secret())
            .expect("config")
            .with_mesh_key(mesh_key)
            .with_can_ack_pings(false)
            .with_proxy_header(balancer)
            .with_connect_timeout(STEP);
        let mut watcher = Client::connect(&watcher)
            .await
            .expect("the watcher connects");
        watcher.watch_conns().await.expect("watch");

        let mut stream = connect_from("127.0.0.1", derpd.addr).await;
        let (extra, want) = if balancer {
            let header = b"PROXY TCP4 198.51.100.4 127.0.0.1 5000 80\r\n";
            tokio::io::AsyncWriteExt::write_all(&mut stream, header)
                .await
                .expect("header");
            ("", "198.51.100.4:5000")
        } else {
            ("X-Forwarded-For: 198.51.100.4\r\n", "198.51.100.4:0")
        };
        let c = raw_client_on(stream, extra).await;
        let present = recv_until(&mut watcher, "the client's PeerPresent", |f| match f {
            ReceivedFrame::PeerPresent { peer, addr, .. } if *peer == c.key => Some(*addr),
            _ => None,
        })
        .await;
        assert_eq!(
            present.to_string(),
            want,
            "PeerPresent (balancer: {balancer})"
        );
        assert_eq!(admission.source_of(&c.key), "198.51.100.4");
        assert_eq!(connected_from(&derpd, &c.key).to_string(), want);
    }
}

#[test]
fn a_region_behind_balancers_meshes_with_links_that_send_a_header() {
    // Every node takes only PROXY protocol connections from loopback; the siblings' links
    // dial each other directly and open with a header of their own.
    let region = support::Region::start(
        2,
        &[
            "--metrics-addr",
            "127.0.0.1:0",
            "--proxy-protocol",
            "--proxy-protocol-from",
            "127.0.0.1/32",
        ],
    );
    region.wait_meshed();
    for node in &region.nodes {
        assert_eq!(
            node.metric(
                "derp_proxy_protocol_refused",
                &[("listener", "main"), ("reason", "no_header")]
            ),
            Some(0.0)
        );
    }
}

#[test]
fn derpd_refuses_to_start_with_proxy_protocol_but_no_list() {
    let out = Command::new(DERPD)
        .args(["--dev", "-a", "127.0.0.1:0", "--proxy-protocol"])
        .output()
        .expect("run derpd");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--proxy-protocol-from"), "{err}");
}

/// `derpd --check` with `args`: its report.
fn check(args: &[&str]) -> String {
    let out = Command::new(DERPD)
        .arg("--check")
        .args(args)
        .output()
        .expect("run derpd --check");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn check_warns_when_stun_or_quic_listen_where_no_client_reaches_them() {
    let proxied = ["--proxy-protocol", "--proxy-protocol-from", "127.0.0.1/32"];
    let with = |addr: &str, extra: &[&str]| {
        let mut a = vec!["--dev", "-a", addr];
        a.extend_from_slice(&proxied);
        a.extend_from_slice(extra);
        check(&a)
    };
    // On loopback: nobody else reaches STUN.
    let out = with("127.0.0.1:8080", &[]);
    assert!(
        out.lines().any(|l| l.starts_with("warn  proxy")
            && l.contains("STUN on 3478/udp listen on 127.0.0.1, which no client can reach")),
        "{out}"
    );
    // On a private address: only through a UDP forward. (TLS, for QUIC: a certificate
    // for the address would be generated.)
    let dir = TempDir::new("check-proxy");
    let certs = dir.path("certs").display().to_string();
    let tls = [
        "--quic-port",
        "0",
        "--certmode",
        "manual",
        "--hostname",
        "10.1.2.3",
        "--certdir",
        &certs,
    ];
    let out = with("10.1.2.3:8080", &tls);
    assert!(
        out.lines().any(|l| l.starts_with("warn  proxy")
            && l.contains("STUN on 3478/udp and QUIC listen on the private address 10.1.2.3")),
        "{out}"
    );
    // On all addresses: reachable, said as a note.
    let out = with(":8080", &[]);
    assert!(!out.contains("warn  proxy"), "{out}");
    assert!(
        out.contains("STUN on 3478/udp listen on [::] directly"),
        "{out}"
    );
    // With STUN off and no QUIC, nothing to say; without --proxy-protocol, nothing either.
    let out = with("127.0.0.1:8080", &["--stun=false"]);
    assert!(!out.contains("warn  proxy"), "{out}");
    let out = check(&["--dev", "-a", "127.0.0.1:8080"]);
    assert!(!out.contains("proxy"), "{out}");
}
