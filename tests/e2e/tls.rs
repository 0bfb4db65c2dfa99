//! TLS end to end: manual certificates and their rotation, the self-signed IP certificate and
//! its pin, fast start from the meta certificate (and its absence on TLS 1.2), WebSocket over
//! TLS, handshake limits, the port-80 listener, and ACME against a local Pebble server.

use std::net::{SocketAddr, TcpListener as StdTcpListener, UdpSocket as StdUdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use derp_client::rustls::pki_types::{CertificateDer, ServerName};
use derp_client::rustls::{self, RootCertStore};
use derp_client::{Client, ClientConfig, ConnectError, ReceivedFrame, TransportKind};
use derp_proto::SecretKey;
use derp_server::{ConnLimits, Server, ServerConfig};
use derp_testkit::child::LoggedChild;
use derp_tls::{
    AcmeConfig, AcmeManager, CertInfo, CertOrigin, ChallengeKind, ManualCerts, TlsFront,
    TlsOptions, cert_pin, load_certs_pem,
};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

use crate::harness::{STEP, connect_from, flood_source, read_until_closed};

pub(crate) const HOST: &str = "derp.test";

pub(crate) async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "derpd-tls-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A throwaway certificate authority.
struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
}

impl TestCa {
    fn new() -> Self {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "derpd test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("ca key");
        let cert = params.self_signed(&key).expect("ca cert").der().clone();
        Self {
            issuer: Issuer::new(params, key),
            cert,
        }
    }

    /// A leaf for `names` (DNS names or IP literals): (cert PEM, key PEM, DER).
    fn issue(&self, names: &[&str]) -> (String, String, CertificateDer<'static>) {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let params = CertificateParams::new(names).expect("params");
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem(), cert.der().clone())
    }
}

/// A relay behind a [`TlsFront`] on 127.0.0.1, with no certificate until one is installed.
pub(crate) struct TlsRelay {
    pub(crate) server: Server,
    pub(crate) front: TlsFront,
    pub(crate) addr: SocketAddr,
    registry: prometheus::Registry,
    task: JoinHandle<()>,
}

impl TlsRelay {
    async fn start(hostname: &str) -> Self {
        Self::start_with(TlsOptions::new(hostname), None).await
    }

    pub(crate) async fn start_with(options: TlsOptions, listener: Option<TcpListener>) -> Self {
        Self::start_limited(options, listener, ConnLimits::default()).await
    }

    async fn start_limited(
        options: TlsOptions,
        listener: Option<TcpListener>,
        limits: ConnLimits,
    ) -> Self {
        derp_testkit::init_tracing();
        let registry = prometheus::Registry::new();
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let config = ServerConfig {
            limits,
            ..ServerConfig::new(secret)
        };
        let server = Server::new(config, &registry).expect("server");
        let front = TlsFront::new(&server.public_key(), options, &registry).expect("front");
        let listener = match listener {
            Some(l) => l,
            None => TcpListener::bind("127.0.0.1:0").await.expect("bind"),
        };
        let addr = listener.local_addr().expect("addr");
        let (f, s) = (front.clone(), server.clone());
        let task = tokio::spawn(async move {
            f.serve(&s, listener).await.expect("tls serve");
        });
        Self {
            server,
            front,
            addr,
            registry,
            task,
        }
    }

    /// A client config for `https://<host>:<port>/derp` that dials this relay.
    pub(crate) fn client(&self, host: &str) -> ClientConfig {
        let url = format!("https://{host}:{}/derp", self.addr.port());
        ClientConfig::new(&url, SecretKey::generate(&mut rand::rngs::OsRng))
            .expect("config")
            .with_dial_addr(self.addr)
            .with_connect_timeout(STEP)
    }

    pub(crate) fn counter(&self, name: &str, label: (&str, &str)) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == label.0 && l.value() == label.1)
            })
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    /// A counter without labels.
    pub(crate) fn unlabelled_counter(&self, name: &str) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    pub(crate) async fn stop(self) {
        self.server.shutdown().await;
        let _ = self.task.await;
    }
}

async fn connect(cfg: &ClientConfig) -> Client {
    within("client connect", Client::connect(cfg))
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", cfg.url))
}

/// Sends a packet each way between two clients and checks both arrive with the right source.
async fn exchange(
    a: &mut Client,
    a_key: derp_proto::PublicKey,
    b: &mut Client,
    b_key: derp_proto::PublicKey,
) {
    one_way(a, a_key, b, b_key).await;
    one_way(b, b_key, a, a_key).await;
}

async fn one_way(
    from: &mut Client,
    from_key: derp_proto::PublicKey,
    to: &mut Client,
    to_key: derp_proto::PublicKey,
) {
    from.send_packet(to_key, b"over tls").await.expect("send");
    loop {
        match within("packet delivery", to.recv()).await.expect("recv") {
            ReceivedFrame::RecvPacket { src, packet } => {
                assert_eq!(src, from_key);
                assert_eq!(&packet[..], b"over tls");
                return;
            }
            ReceivedFrame::KeepAlive | ReceivedFrame::Ping(_) => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
}

pub(crate) async fn connect_pair(relay: &TlsRelay, cfg: impl Fn() -> ClientConfig) {
    let (ca, cb) = (cfg(), cfg());
    let (ka, kb) = (ca.secret_key.public_key(), cb.secret_key.public_key());
    let mut a = connect(&ca).await;
    let mut b = connect(&cb).await;
    assert_eq!(a.server_key(), relay.server.public_key());
    exchange(&mut a, ka, &mut b, kb).await;
}

fn write_pair(dir: &Path, cert_pem: &str, key_pem: &str) {
    std::fs::write(dir.join(format!("{HOST}.crt")), cert_pem).expect("write crt");
    std::fs::write(dir.join(format!("{HOST}.key")), key_pem).expect("write key");
}

async fn wait_generation(rx: &mut watch::Receiver<CertInfo>, at_least: u64) -> CertInfo {
    within(
        "certificate update",
        rx.wait_for(|i| i.generation >= at_least),
    )
    .await
    .expect("front dropped")
    .clone()
}

#[tokio::test]
async fn manual_certificate_rotation_reaches_new_connections_and_spares_old_ones() {
    let dir = TempDir::new("rotate");
    let ca = TestCa::new();
    let (crt_a, key_a, der_a) = ca.issue(&[HOST]);
    write_pair(&dir.0, &crt_a, &key_a);

    let relay = TlsRelay::start(HOST).await;
    let manual = Arc::new(ManualCerts::new(relay.front.clone(), &dir.0));
    assert!(manual.load_or_generate().expect("load").is_none());
    let mut updates = relay.front.cert_updates();
    assert_eq!(updates.borrow().origin, CertOrigin::Manual);
    let shutdown = relay.server.shutdown_token();
    let watcher = {
        let manual = manual.clone();
        tokio::spawn(async move { manual.watch(Duration::from_millis(20), shutdown).await })
    };

    // Old connection, verified against the CA and pinned to certificate A.
    let old_cfg = relay
        .client(HOST)
        .with_extra_root(ca.cert.clone())
        .with_cert_name(cert_pin(&der_a));
    let old_key = old_cfg.secret_key.public_key();
    let mut old = connect(&old_cfg).await;

    // Rotate: the key first, then the certificate, the way an operator's script might. The
    // half-written state (new key, old certificate) must be refused, not served.
    let (crt_b, key_b, der_b) = ca.issue(&[HOST]);
    std::fs::write(dir.0.join(format!("{HOST}.key")), &key_b).expect("write key");
    assert!(
        manual.reload_if_changed().is_err(),
        "mismatched pair accepted"
    );
    std::fs::write(dir.0.join(format!("{HOST}.crt")), &crt_b).expect("write crt");
    let info = wait_generation(&mut updates, 2).await;
    assert_eq!(info.pin(), cert_pin(&der_b));

    // New connections get B: pinning A now fails, pinning B works.
    let err = within("pinned to old cert", Client::connect(&old_cfg))
        .await
        .expect_err("old pin must fail after rotation");
    // Refused by the pin, not for any other TLS failure.
    assert_eq!(
        err.certificate_error(),
        Some(&rustls::CertificateError::ApplicationVerificationFailure),
        "{err:?}"
    );
    let new_cfg = relay
        .client(HOST)
        .with_extra_root(ca.cert.clone())
        .with_cert_name(cert_pin(&der_b));
    let new_key = new_cfg.secret_key.public_key();
    let mut new = connect(&new_cfg).await;

    // The connection made before the rotation is still up and relays both ways.
    exchange(&mut old, old_key, &mut new, new_key).await;

    relay.stop().await;
    watcher.await.expect("watcher");
}

#[tokio::test]
async fn ip_hostname_gets_a_self_signed_certificate_whose_pin_works() {
    let dir = TempDir::new("ip");
    let relay = TlsRelay::start("127.0.0.1").await;
    let manual = ManualCerts::new(relay.front.clone(), &dir.0);
    let generated = manual
        .load_or_generate()
        .expect("generate")
        .expect("a self-signed certificate for an IP hostname");
    assert!(generated.cert_path.ends_with("127.0.0.1.crt"));
    assert!(generated.key_path.exists());
    let on_disk = load_certs_pem(&std::fs::read(&generated.cert_path).expect("read")).expect("pem");
    assert_eq!(generated.pin, cert_pin(&on_disk[0]));
    assert_eq!(
        relay.front.cert_updates().borrow().origin,
        CertOrigin::SelfSigned
    );

    // Clients connect by address (no SNI) and pin the certificate, as a DERP map node with
    // CertName "sha256-raw:..." does. The meta certificate gives them fast start.
    let pinned = || {
        relay
            .client("127.0.0.1")
            .with_cert_name(generated.pin.clone())
    };
    let client = connect(&pinned()).await;
    assert!(client.used_fast_start());
    connect_pair(&relay, pinned).await;

    // Without the pin the self-signed certificate is not trusted.
    let err = within("unpinned", Client::connect(&relay.client("127.0.0.1")))
        .await
        .expect_err("self-signed cert must not verify without the pin");
    assert_eq!(
        err.certificate_error(),
        Some(&rustls::CertificateError::UnknownIssuer),
        "{err:?}"
    );

    // A restart reuses the files instead of generating a new certificate.
    let again = ManualCerts::new(relay.front.clone(), &dir.0);
    assert!(again.load_or_generate().expect("reload").is_none());
    assert_eq!(relay.front.cert_updates().borrow().pin(), generated.pin);
    relay.stop().await;
}

/// A rustls client config trusting `root`, limited to `versions`.
fn raw_tls(
    root: &CertificateDer<'static>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(root.clone()).expect("root");
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

async fn raw_connect(
    relay: &TlsRelay,
    tls: Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(relay.addr).await.expect("tcp");
    within(
        "raw tls handshake",
        TlsConnector::from(tls).connect(ServerName::try_from(HOST).expect("name"), tcp),
    )
    .await
    .expect("tls handshake")
}

async fn relay_with_ca_cert(ca: &TestCa) -> TlsRelay {
    let relay = TlsRelay::start(HOST).await;
    let (crt, key, _) = ca.issue(&[HOST]);
    relay
        .front
        .install(
            load_certs_pem(crt.as_bytes()).expect("crt"),
            derp_tls::load_key_pem(key.as_bytes()).expect("key"),
            CertOrigin::Other,
        )
        .expect("install");
    relay
}

#[tokio::test]
async fn tls13_clients_fast_start_from_the_meta_certificate_and_tls12_clients_get_the_101() {
    let ca = TestCa::new();
    let relay = relay_with_ca_cert(&ca).await;

    // The served chain is the provider's chain followed by the meta certificate.
    let chain = relay.front.served_chain().expect("chain");
    assert_eq!(chain.len(), 2);
    assert_eq!(&chain[1], relay.front.meta_certificate());
    assert_eq!(
        derp_client::tls::meta_certificate_key(&chain[1..]),
        Some(relay.server.public_key())
    );

    // The full client over TLS 1.3: fast start, and the session works.
    let tls13 = || relay.client(HOST).with_extra_root(ca.cert.clone());
    let client = connect(&tls13()).await;
    assert!(
        client.used_fast_start(),
        "TLS 1.3 client did not use fast start"
    );
    drop(client);
    connect_pair(&relay, tls13).await;

    // Over TLS 1.3 on the wire: with Derp-Fast-Start the first bytes are the ServerKey frame.
    // (The raw connections are closed before the relay stops, which would otherwise wait for
    // their handshake deadline.)
    let mut s = raw_connect(&relay, raw_tls(&ca.cert, &[&rustls::version::TLS13])).await;
    assert_eq!(
        s.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    assert_eq!(
        derp_client::tls::fast_start_key(s.get_ref().1),
        Some(relay.server.public_key())
    );
    s.write_all(
        format!(
            "GET /derp HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\
             Derp-Fast-Start: 1\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut first = [0u8; 5];
    within("server key frame", s.read_exact(&mut first))
        .await
        .expect("read");
    assert_eq!(
        first,
        [0x01, 0, 0, 0, 40],
        "expected a ServerKey frame header"
    );
    drop(s);

    // TLS 1.2: the meta certificate is still in the chain, but it must not be used.
    let mut s = raw_connect(&relay, raw_tls(&ca.cert, &[&rustls::version::TLS12])).await;
    let conn = s.get_ref().1;
    assert_eq!(
        conn.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_2)
    );
    let peer = conn.peer_certificates().expect("peer chain");
    assert_eq!(
        derp_client::tls::meta_certificate_key(peer),
        Some(relay.server.public_key())
    );
    assert_eq!(derp_client::tls::fast_start_key(conn), None);
    s.write_all(
        format!(
            "GET /derp HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut head = vec![0u8; 34];
    within("101 head", s.read_exact(&mut head))
        .await
        .expect("read");
    assert_eq!(&head[..], b"HTTP/1.1 101 Switching Protocols\r\n");
    drop(s);

    // The full client limited to TLS 1.2 takes the 101 path and works.
    let tls12 = || {
        relay
            .client(HOST)
            .with_tls_config(raw_tls(&ca.cert, &[&rustls::version::TLS12]))
    };
    let client = connect(&tls12()).await;
    assert!(!client.used_fast_start(), "TLS 1.2 client used fast start");
    drop(client);
    connect_pair(&relay, tls12).await;

    // WebSocket over TLS (wss).
    let wss = || {
        let url = format!("wss://{HOST}:{}/derp", relay.addr.port());
        ClientConfig::new(&url, SecretKey::generate(&mut rand::rngs::OsRng))
            .expect("config")
            .with_dial_addr(relay.addr)
            .with_extra_root(ca.cert.clone())
    };
    assert_eq!(wss().transport, TransportKind::WebSocket);
    let client = connect(&wss()).await;
    assert!(!client.used_fast_start());
    drop(client);
    connect_pair(&relay, wss).await;

    assert!(relay.counter("derp_tls_connections_by_version", ("version", "1.2")) >= 2);
    relay.stop().await;
}

/// Over TLS, a later request on a kept-alive connection (served by hyper, not by the HTTP
/// front that reads the first) is held to the first request's head limit: hyper's default
/// buffer, about 400 KB, would have taken this head in whole and answered it.
#[tokio::test]
async fn a_keep_alive_request_over_tls_gets_the_first_requests_head_limit() {
    let ca = TestCa::new();
    let relay = relay_with_ca_cert(&ca).await;
    let mut s = raw_connect(&relay, raw_tls(&ca.cert, &[&rustls::version::TLS13])).await;
    s.write_all(format!("HEAD /derp/probe HTTP/1.1\r\nHost: {HOST}\r\n\r\n").as_bytes())
        .await
        .expect("probe");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        within("probe answer", s.read_exact(&mut byte))
            .await
            .expect("read");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");

    let mut big = format!("GET /derp/probe HTTP/1.1\r\nHost: {HOST}\r\nX-Pad: ").into_bytes();
    big.resize(4 * derp_proto::upgrade::MAX_HEAD_LEN - 4, b'a');
    big.extend_from_slice(b"\r\n\r\n");
    // The server stops reading partway: the write may fail, and the close may overtake the
    // answer.
    let _ = s.write_all(&big).await;
    let _ = s.flush().await;
    let mut answer = Vec::new();
    let closed = async {
        while let Ok(n) = s.read_buf(&mut answer).await {
            if n == 0 {
                break;
            }
        }
    };
    within("the connection closed", closed).await;
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 431"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    relay.stop().await;
}

#[tokio::test]
async fn wrong_sni_is_refused_for_a_dns_hostname() {
    let ca = TestCa::new();
    let relay = relay_with_ca_cert(&ca).await;
    // SNI "other.test": no certificate is offered for it.
    let cfg = relay.client("other.test").with_extra_root(ca.cert.clone());
    let err = within("wrong sni", Client::connect(&cfg))
        .await
        .expect_err("wrong SNI must be refused");
    assert!(matches!(err, ConnectError::TlsHandshake(_)), "{err:?}");
    // No SNI at all (connecting by address) is refused too.
    let cfg = relay
        .client("127.0.0.1")
        .with_extra_root(ca.cert.clone())
        .with_cert_name(HOST);
    let err = within("no sni", Client::connect(&cfg))
        .await
        .expect_err("no SNI must be refused");
    assert!(matches!(err, ConnectError::TlsHandshake(_)), "{err:?}");
    // The right name works.
    connect(&relay.client(HOST).with_extra_root(ca.cert.clone())).await;
    relay.stop().await;
}

/// A relay with a certificate from `ca` installed, and the given limits.
async fn limited_relay(ca: &TestCa, options: TlsOptions, limits: ConnLimits) -> TlsRelay {
    let relay = TlsRelay::start_limited(options, None, limits).await;
    let (crt, key, _) = ca.issue(&[HOST]);
    relay
        .front
        .install(
            load_certs_pem(crt.as_bytes()).expect("crt"),
            derp_tls::load_key_pem(key.as_bytes()).expect("key"),
            CertOrigin::Other,
        )
        .expect("install");
    relay
}

#[tokio::test]
async fn stalled_handshakes_are_cut_off_by_the_deadline() {
    let ca = TestCa::new();
    let mut options = TlsOptions::new(HOST);
    options.handshake_timeout = Duration::from_millis(300);
    let relay = limited_relay(&ca, options, ConnLimits::default()).await;
    // Two connections that never send a ClientHello are cut off by the deadline...
    let mut buf = [0u8; 1];
    for _ in 0..2 {
        let mut s = TcpStream::connect(relay.addr).await.expect("connect");
        let n = within("stalled handshake cut off", s.read(&mut buf)).await;
        assert!(matches!(n, Ok(0) | Err(_)));
    }
    assert_eq!(
        relay.counter("derp_tls_handshakes", ("result", "timeout")),
        2
    );
    // ...and real clients get through.
    connect(&relay.client(HOST).with_extra_root(ca.cert.clone())).await;
    relay.stop().await;
}

/// Unproven budget of the flood tests, and how many connections each round opens from as
/// many loopback addresses.
const BUDGET: usize = 64;
const FLOOD: usize = 150;

/// A good client completes its handshake during each round of a flood of connections that
/// never send a ClientHello, while the flood provably still holds the whole budget: its
/// admission evicts one of the round's connections. The flood's deadlines are beyond the
/// test's, so the flood only ends when the test ends it; how long the good client takes is
/// measured by `scripts/bench-limits`.
#[tokio::test]
async fn stalled_client_hellos_from_many_sources_never_lock_out_a_good_client() {
    let ca = TestCa::new();
    let mut options = TlsOptions::new(HOST);
    options.client_hello_timeout = Duration::from_secs(3600);
    options.handshake_timeout = Duration::from_secs(3600);
    let relay = limited_relay(
        &ca,
        options,
        ConnLimits {
            max_unproven: BUDGET,
            ..ConnLimits::default()
        },
    )
    .await;
    let evicted = || relay.counter("derp_unproven_evicted", ("cause", "budget"));
    let good = relay.client(HOST).with_extra_root(ca.cert.clone());
    let mut stalled = Vec::new();
    for round in 0..5u8 {
        // Each from its own address, none ever sending a ClientHello.
        let mut flood = Vec::new();
        for i in 0..FLOOD {
            flood.push(connect_from(relay.addr, flood_source(round, i)).await);
        }
        // The budget holds the newest; the oldest of this round were evicted to make room,
        // which also shows the server has admitted the whole round.
        for s in &mut flood[..FLOOD - BUDGET] {
            within("evicted handshake closed", read_until_closed(s)).await;
        }
        let before = evicted();
        within("the good client's handshake", Client::connect(&good))
            .await
            .unwrap_or_else(|e| panic!("round {round}: the good client was refused: {e}"));
        assert_eq!(
            evicted(),
            before + 1,
            "round {round}: the good client got in, but not past a full budget"
        );
        stalled.extend(flood);
    }
    assert!(
        relay.counter("derp_tls_handshakes", ("result", "evicted")) >= 5 * (FLOOD - BUDGET) as u64
    );
    assert_eq!(
        relay.counter("derp_tls_handshakes", ("result", "timeout")),
        0
    );
    // Closed by the test, the stalled connections end at once instead of at their deadline.
    drop(stalled);
    relay.stop().await;
}

/// The same for the port-80 listener and a good request: its admission evicts one of the
/// round's idle connections, which are held for the listener's 10 s header deadline.
#[tokio::test]
async fn idle_port_80_connections_from_many_sources_never_lock_out_a_good_request() {
    let mut options = TlsOptions::new(HOST);
    options.http_port_max_connections = BUDGET;
    let relay = TlsRelay::start_with(options, None).await;
    let evicted = || relay.counter("derp_http_port_unproven_evicted", ("cause", "budget"));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (front, server) = (relay.front.clone(), relay.server.clone());
    let task = tokio::spawn(async move { front.serve_http_port(&server, listener, 443).await });
    let mut idle = Vec::new();
    for round in 0..5u8 {
        let mut flood = Vec::new();
        for i in 0..FLOOD {
            flood.push(connect_from(addr, flood_source(round, i)).await);
        }
        for s in &mut flood[..FLOOD - BUDGET] {
            within("evicted connection closed", read_until_closed(s)).await;
        }
        let before = evicted();
        let resp = http_request(
            addr,
            "GET /generate_204 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 204 "), "round {round}: {resp}");
        assert_eq!(
            evicted(),
            before + 1,
            "round {round}: the good request got in, but not past a full budget"
        );
        idle.extend(flood);
    }
    assert!(evicted() >= 5 * (FLOOD - BUDGET) as u64);
    drop(idle);
    relay.stop().await;
    task.await.expect("join").expect("serve");
}

/// One HTTP/1.1 request over plain TCP; returns the whole response (the server closes).
async fn http_request(addr: SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    within("http response", s.read_to_end(&mut out))
        .await
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn port_80_listener_redirects_answers_204_and_never_serves_derp() {
    let relay = TlsRelay::start(HOST).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (front, server) = (relay.front.clone(), relay.server.clone());
    let task = tokio::spawn(async move { front.serve_http_port(&server, listener, 8443).await });

    let resp = http_request(
        addr,
        "GET /generate_204 HTTP/1.1\r\nHost: x\r\nX-Tailscale-Challenge: abc\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 204 "), "{resp}");
    assert!(
        resp.to_ascii_lowercase()
            .contains("x-tailscale-response: response abc"),
        "{resp}"
    );

    let resp = http_request(
        addr,
        "GET /some/path?q=1 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 302 "), "{resp}");
    assert!(
        resp.to_ascii_lowercase()
            .contains(&format!("location: https://{HOST}:8443/some/path?q=1")),
        "{resp}"
    );

    let resp = http_request(
        addr,
        "GET /derp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nUpgrade: DERP\r\n\r\n",
    )
    .await;
    assert!(
        resp.starts_with("HTTP/1.1 302 "),
        "DERP must not be served here: {resp}"
    );

    let resp = http_request(
        addr,
        "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400 "), "{resp}");
    assert!(resp.ends_with("Use HTTPS\n"), "{resp}");

    let resp = http_request(
        addr,
        "GET /.well-known/acme-challenge/unknown HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 404 "), "{resp}");

    relay.stop().await;
    task.await.expect("join").expect("serve");
}

// ---------------------------------------------------------------------------------------------
// ACME against Pebble.

/// A free loopback port for TCP and UDP alike (for a DNS server, which wants both).
pub(crate) fn free_port() -> u16 {
    loop {
        let tcp = StdTcpListener::bind("127.0.0.1:0").expect("bind");
        let port = tcp.local_addr().expect("addr").port();
        if StdUdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Pebble plus pebble-challtestsrv (as its DNS server, answering 127.0.0.1 for every name),
/// all on loopback.
pub(crate) struct Pebble {
    pub(crate) pebble: LoggedChild,
    _dns: LoggedChild,
    ca: TestCa,
    directory_url: String,
    management: SocketAddr,
}

fn pebble_installed() -> bool {
    let found = |bin: &str| {
        Command::new(bin)
            .arg("-h")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    found("pebble") && found("pebble-challtestsrv")
}

/// Fails the test unless Pebble is installed: an ACME test that cannot run must not pass.
pub(crate) fn require_pebble() {
    assert!(
        pebble_installed(),
        "pebble and pebble-challtestsrv are not installed: `apt-get install pebble`, or run \
         `scripts/test-tools install` (scripts/test does it when it can)"
    );
}

async fn wait_for_port(addr: SocketAddr, proc: &LoggedChild) {
    let deadline = tokio::time::Instant::now() + STEP;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while TcpStream::connect(addr).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{addr} never came up; log:\n{}",
            proc.log()
        );
        tick.tick().await;
    }
}

impl Pebble {
    /// Asserts that Pebble has validated at least one challenge, with its log if not.
    pub(crate) fn assert_validated(&self) {
        let log = self.pebble.log();
        assert!(log.contains("set VALID by completed challenge"), "{log}");
    }

    /// Starts Pebble validating HTTP-01 on `http_port` and TLS-ALPN-01 on `tls_port`.
    pub(crate) async fn start(dir: &Path, http_port: u16, tls_port: u16) -> Self {
        Self::start_with(dir, http_port, tls_port, serde_json::json!({})).await
    }

    /// [`Pebble::start`] with more settings for its config (`extra`'s keys are added).
    pub(crate) async fn start_with(
        dir: &Path,
        http_port: u16,
        tls_port: u16,
        extra: serde_json::Value,
    ) -> Self {
        let ca = TestCa::new();
        let (crt, key, _) = ca.issue(&["localhost", "127.0.0.1"]);
        std::fs::write(dir.join("pebble.crt"), crt).expect("write");
        std::fs::write(dir.join("pebble.key"), key).expect("write");

        let dns_port = free_port();
        let dns = LoggedChild::spawn(
            Command::new("pebble-challtestsrv")
                .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
                .args(["-dns01", &format!("127.0.0.1:{dns_port}")])
                .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
                .args(["-management", &format!("127.0.0.1:{}", free_port())]),
            dir.join("challtestsrv.log"),
        );
        wait_for_port(SocketAddr::from(([127, 0, 0, 1], dns_port)), &dns).await;

        let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let management = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = serde_json::json!({
            "pebble": {
                "listenAddress": listen.to_string(),
                "managementListenAddress": management.to_string(),
                "certificate": dir.join("pebble.crt"),
                "privateKey": dir.join("pebble.key"),
                "httpPort": http_port,
                "tlsPort": tls_port,
                "ocspResponderURL": "",
                "externalAccountBindingRequired": false
            }
        });
        let mut config = config;
        if let Some(extra) = extra.as_object() {
            for (k, v) in extra {
                config["pebble"][k] = v.clone();
            }
        }
        std::fs::write(dir.join("pebble.json"), config.to_string()).expect("write");
        let pebble = LoggedChild::spawn(
            Command::new("pebble")
                .arg("-config")
                .arg(dir.join("pebble.json"))
                .args([
                    "-dnsserver",
                    &format!("127.0.0.1:{dns_port}"),
                    "-strict=false",
                ])
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", "0")
                .env("PEBBLE_AUTHZREUSE", "0"),
            dir.join("pebble.log"),
        );
        wait_for_port(listen, &pebble).await;
        wait_for_port(management, &pebble).await;
        Self {
            pebble,
            _dns: dns,
            ca,
            directory_url: format!("https://{listen}/dir"),
            management,
        }
    }

    /// The root Pebble issues under (it is new on every start).
    pub(crate) async fn root(&self) -> CertificateDer<'static> {
        let tls = raw_tls(
            &self.ca.cert,
            &[&rustls::version::TLS13, &rustls::version::TLS12],
        );
        let tcp = TcpStream::connect(self.management).await.expect("connect");
        let mut s = within(
            "pebble management tls",
            TlsConnector::from(tls).connect(ServerName::try_from("localhost").expect("name"), tcp),
        )
        .await
        .expect("tls");
        s.write_all(b"GET /roots/0 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = Vec::new();
        // Go may end the TLS stream without close_notify; whatever arrived is enough.
        let _ = within("pebble root", s.read_to_end(&mut out)).await;
        load_certs_pem(&out)
            .unwrap_or_else(|e| panic!("no root in {:?}: {e}", String::from_utf8_lossy(&out)))
            .remove(0)
    }

    pub(crate) fn acme_config(&self, cache_dir: &Path, challenge: ChallengeKind) -> AcmeConfig {
        let mut config = AcmeConfig::new(cache_dir);
        config.directory_url = self.directory_url.clone();
        config.contact_email = Some("ops@derp.test".into());
        config.extra_roots = vec![self.ca.cert.clone()];
        config.challenges = vec![challenge];
        config.initial_backoff = Duration::from_millis(200);
        config
    }
}

/// Runs an [`AcmeManager`] for `relay` until the relay shuts down.
fn run_acme(relay: &TlsRelay, config: AcmeConfig) -> (Arc<AcmeManager>, JoinHandle<()>) {
    let manager = Arc::new(AcmeManager::new(relay.front.clone(), config).expect("acme"));
    let m = manager.clone();
    let shutdown = relay.server.shutdown_token();
    (manager, tokio::spawn(async move { m.run(shutdown).await }))
}

async fn wait_cert(relay: &TlsRelay, pebble: &Pebble) -> CertInfo {
    let mut updates = relay.front.cert_updates();
    // Issuance takes a handful of round trips to Pebble; allow more than one STEP.
    let waited = tokio::time::timeout(STEP * 6, updates.wait_for(|i| i.generation >= 1)).await;
    match waited {
        Ok(Ok(info)) => info.clone(),
        _ => panic!(
            "no certificate from pebble; pebble log:\n{}",
            pebble.pebble.log()
        ),
    }
}

#[tokio::test]
async fn acme_tls_alpn_01_issues_verifies_and_restarts_from_the_cache() {
    require_pebble();
    let dir = TempDir::new("acme-alpn");
    let cache = dir.0.join("certs");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let tls_port = listener.local_addr().expect("addr").port();
    let mut pebble = Pebble::start(&dir.0, free_port(), tls_port).await;

    let relay = TlsRelay::start_with(TlsOptions::new(HOST), Some(listener)).await;
    let (manager, task) = run_acme(&relay, pebble.acme_config(&cache, ChallengeKind::TlsAlpn01));
    let issued = wait_cert(&relay, &pebble).await;
    assert_eq!(issued.origin, CertOrigin::AcmeIssued);
    assert_eq!(manager.orders_placed(), 1);
    pebble.assert_validated();
    assert!(relay.counter("derp_tls_handshakes", ("result", "acme_validation")) >= 1);
    assert!(manager.cert_path().exists() && manager.key_path().exists());

    // A client verifies the certificate against Pebble's root and relays.
    let root = pebble.root().await;
    let client = || relay.client(HOST).with_extra_root(root.clone());
    assert!(connect(&client()).await.used_fast_start());
    connect_pair(&relay, client).await;
    relay.stop().await;
    task.await.expect("acme task");

    // Restart with Pebble gone: the cached certificate is served and no order is placed.
    pebble.pebble.stop();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay = TlsRelay::start_with(TlsOptions::new(HOST), Some(listener)).await;
    let (manager, task) = run_acme(&relay, pebble.acme_config(&cache, ChallengeKind::TlsAlpn01));
    let cached = wait_cert(&relay, &pebble).await;
    assert_eq!(cached.origin, CertOrigin::AcmeCache);
    assert_eq!(cached.leaf_sha256, issued.leaf_sha256);
    let client = || relay.client(HOST).with_extra_root(root.clone());
    connect_pair(&relay, client).await;
    assert_eq!(manager.orders_placed(), 0, "a restart must not order again");
    relay.stop().await;
    task.await.expect("acme task");
}

#[tokio::test]
async fn acme_http_01_is_answered_on_the_port_80_listener() {
    require_pebble();
    let dir = TempDir::new("acme-http");
    let http_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let http_port = http_listener.local_addr().expect("addr").port();
    let pebble = Pebble::start(&dir.0, http_port, free_port()).await;

    let relay = TlsRelay::start(HOST).await;
    let (front, server) = (relay.front.clone(), relay.server.clone());
    let port = relay.addr.port();
    let http_task =
        tokio::spawn(async move { front.serve_http_port(&server, http_listener, port).await });
    let (manager, task) = run_acme(&relay, pebble.acme_config(&dir.0, ChallengeKind::Http01));
    let issued = wait_cert(&relay, &pebble).await;
    assert_eq!(issued.origin, CertOrigin::AcmeIssued);
    assert_eq!(manager.orders_placed(), 1);
    // Pebble's TLS-ALPN-01 port is a closed one here, so only the port-80 answer can have
    // validated the order.
    pebble.assert_validated();

    let root = pebble.root().await;
    connect_pair(&relay, || relay.client(HOST).with_extra_root(root.clone())).await;
    relay.stop().await;
    task.await.expect("acme task");
    http_task.await.expect("join").expect("http port");
}

/// A certificate cache that cannot be written (here: its directory cannot be created; a full
/// disk fails the same write) does not cost the certificate: it is served, a client
/// verifies it, and no second order is placed.
#[tokio::test]
async fn acme_certificate_stays_in_service_when_the_cache_cannot_be_written() {
    require_pebble();
    let dir = TempDir::new("acme-unwritable");
    let blocker = dir.0.join("not-a-directory");
    std::fs::write(&blocker, b"a file where the cache directory should be").expect("write");
    let cache = blocker.join("certs");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let tls_port = listener.local_addr().expect("addr").port();
    let pebble = Pebble::start(&dir.0, free_port(), tls_port).await;

    let relay = TlsRelay::start_with(TlsOptions::new(HOST), Some(listener)).await;
    let (manager, task) = run_acme(&relay, pebble.acme_config(&cache, ChallengeKind::TlsAlpn01));
    let issued = wait_cert(&relay, &pebble).await;
    assert_eq!(issued.origin, CertOrigin::AcmeIssued);
    assert!(!manager.cert_path().exists() && !manager.key_path().exists());
    let root = pebble.root().await;
    let client = || relay.client(HOST).with_extra_root(root.clone());
    connect_pair(&relay, client).await;
    assert_eq!(manager.orders_placed(), 1);
    relay.stop().await;
    task.await.expect("acme task");
}
