//! Admission control end to end: a real relay, real clients, and a real local admission
//! server (plain and TLS), a LocalAPI server on a Unix socket, and an allow-keys file.
//!
//! Each refused client must be closed right after its ClientInfo with nothing relayed and
//! never registered (a mesh watcher sees no PeerPresent for it), and counted by reason.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use derp_admission::{
    AdmissionMetrics, AllowKeys, AllowKeysError, CacheConfig, LocalTailscaled, UrlOptions,
    VerifyUrl,
};
use derp_proto::{ClientInfo, MeshKey, PublicKey, RelayToClient, SecretKey};
use derp_server::{Admission, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::harness::{RawClient, STEP, TestServer, plain_info};

fn mesh_key() -> MeshKey {
    "5a".repeat(32).parse().expect("mesh key")
}

fn new_key() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

/// How the test admission server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `{"Allow": true}` for allowed keys, `{"Allow": false}` for the rest.
    Decide,
    Status500,
    Garbage,
    /// Reads the request and never answers.
    Silent,
    /// Sends the head and part of the body, then nothing.
    SlowBody,
    /// An allow padded past the 4 KiB cap.
    Huge,
    /// A 403 whose head is too large to read (as a proxy in front might send).
    HugeHead,
    /// Decides as `Decide`, but only once the test calls [`AdmissionServer::release`].
    Held,
}

#[derive(Debug)]
struct AdmissionState {
    mode: Mode,
    allowed: HashSet<String>,
    requests: Vec<serde_json::Value>,
    /// Signalled on every request that arrives.
    arrived: Arc<tokio::sync::Notify>,
    /// Lets the held answers go (mode `Held`).
    release: Arc<tokio::sync::Semaphore>,
}

/// A local HTTP(S) admission server speaking derper's admission request and response.
struct AdmissionServer {
    url: String,
    state: Arc<Mutex<AdmissionState>>,
    task: JoinHandle<()>,
}

impl AdmissionServer {
    async fn start(tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(AdmissionState {
            mode: Mode::Decide,
            allowed: HashSet::new(),
            requests: Vec::new(),
            arrived: Arc::new(tokio::sync::Notify::new()),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        }));
        let s = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (s, tls) = (s.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(tcp).await {
                                serve_admission(stream, s).await;
                            }
                        }
                        None => serve_admission(tcp, s).await,
                    }
                });
            }
        });
        Self {
            url: format!("http://{addr}/verify"),
            state,
            task,
        }
    }

    fn set_mode(&self, mode: Mode) {
        self.state.lock().expect("lock").mode = mode;
    }

    fn allow(&self, key: &PublicKey) {
        self.state
            .lock()
            .expect("lock")
            .allowed
            .insert(key.to_string());
    }

    fn disallow(&self, key: &PublicKey) {
        self.state
            .lock()
            .expect("lock")
            .allowed
            .remove(&key.to_string());
    }

    fn requests(&self) -> Vec<serde_json::Value> {
        self.state.lock().expect("lock").requests.clone()
    }

    /// Waits until `n` requests have arrived in all.
    async fn wait_requests(&self, n: usize) {
        loop {
            let arrived = {
                let st = self.state.lock().expect("lock");
                if st.requests.len() >= n {
                    return;
                }
                st.arrived.clone()
            };
            let notified = arrived.notified();
            if self.requests().len() >= n {
                return;
            }
            tokio::time::timeout(STEP, notified)
                .await
                .expect("the admission request never arrived");
        }
    }

    /// Lets one held answer go.
    fn release(&self) {
        self.state.lock().expect("lock").release.add_permits(1);
    }

    fn stop(self) {
        self.task.abort();
    }
}

/// Serves requests on one connection (keep-alive) until the client closes it.
async fn serve_admission<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    state: Arc<Mutex<AdmissionState>>,
) {
    let mut buf = Vec::new();
    loop {
        let Some(body) = read_request(&mut s, &mut buf).await else {
            return;
        };
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let (mode, allowed, release) = {
            let mut st = state.lock().expect("lock");
            st.requests.push(json.clone());
            st.arrived.notify_waiters();
            let key = json["NodePublic"].as_str().unwrap_or_default().to_owned();
            (st.mode, st.allowed.contains(&key), st.release.clone())
        };
        let reply = match mode {
            Mode::Decide => respond(200, &format!("{{\"Allow\": {allowed}}}")),
            Mode::Held => {
                let Ok(permit) = release.acquire().await else {
                    return;
                };
                permit.forget();
                respond(200, &format!("{{\"Allow\": {allowed}}}"))
            }
            Mode::Status500 => respond(500, "{\"Allow\": true}"),
            Mode::Garbage => respond(200, "<html>welcome</html>"),
            Mode::Huge => respond(
                200,
                &format!("{{\"Allow\": true, \"pad\": \"{}\"}}", "x".repeat(8192)),
            ),
            Mode::HugeHead => format!(
                "HTTP/1.1 403 Forbidden\r\nX-Pad: {}\r\nContent-Length: 0\r\n\r\n",
                "a".repeat(20_000)
            ),
            Mode::Silent => {
                // Hold the connection without a word until the client gives up.
                let mut sink = [0u8; 64];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
            Mode::SlowBody => {
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"Allow\"",
                    )
                    .await;
                let mut sink = [0u8; 64];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
        };
        if s.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn respond(status: u16, body: &str) -> String {
    format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads one request (head and Content-Length body); `None` at EOF.
async fn read_request<S: AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let body = buf[end + 4..end + 4 + len].to_vec();
                buf.drain(..end + 4 + len);
                return Some(body);
            }
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn url_check(url: &str, fail_open: bool, cache: CacheConfig) -> Arc<dyn Admission> {
    Arc::new(
        VerifyUrl::new(
            url,
            UrlOptions {
                fail_open,
                timeout: Duration::from_millis(300),
                cache,
                ..UrlOptions::default()
            },
            &AdmissionMetrics::unregistered(),
        )
        .expect("verify url"),
    )
}

fn no_cache() -> CacheConfig {
    CacheConfig {
        max_entries: 0,
        ..CacheConfig::default()
    }
}

async fn relay(checks: Vec<Arc<dyn Admission>>) -> TestServer {
    TestServer::start(ServerConfig {
        admission: checks,
        mesh_key: Some(mesh_key()),
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await
}

fn refused(srv: &TestServer, reason: &str) -> f64 {
    srv.metric_or_zero("derp_admission_refused", &[("reason", reason)])
}

/// A mesh peer subscribed to presence changes, with the initial flood read.
async fn watcher(srv: &TestServer) -> RawClient {
    let info = ClientInfo {
        mesh_key: Some(mesh_key()),
        ..plain_info()
    };
    let mut w = RawClient::try_connect(srv.addr, new_key(), info)
        .await
        .expect("mesh peers are admitted");
    w.send(derp_proto::ClientToRelay::WatchConns).await;
    w.barrier().await;
    w
}

async fn admitted(srv: &TestServer, key: &SecretKey) -> Option<RawClient> {
    RawClient::try_connect(srv.addr, key.clone(), plain_info()).await
}

#[tokio::test]
async fn the_admission_server_decides_and_refused_clients_are_never_registered() {
    let adm = AdmissionServer::start(None).await;
    let srv = relay(vec![url_check(&adm.url, false, no_cache())]).await;
    let mut w = watcher(&srv).await;
    assert!(
        adm.requests().is_empty(),
        "mesh peers are admitted without asking"
    );

    let (a, d) = (new_key(), new_key());
    adm.allow(&a.public_key());
    let b_key = new_key();
    adm.allow(&b_key.public_key());
    assert!(admitted(&srv, &d).await.is_none(), "denied client let in");
    let mut a_conn = admitted(&srv, &a).await.expect("allowed client refused");
    let mut b_conn = admitted(&srv, &b_key)
        .await
        .expect("allowed client refused");

    // The question carried the key and the source, as derper sends them.
    let reqs = adm.requests();
    assert_eq!(reqs.len(), 3);
    assert_eq!(reqs[0]["NodePublic"], d.public_key().to_string());
    assert_eq!(reqs[0]["Source"], "127.0.0.1");
    assert_eq!(refused(&srv, "denied"), 1.0);

    // The watcher heard of the admitted clients only.
    let seen = w.barrier().await;
    let present: Vec<PublicKey> = seen
        .iter()
        .filter_map(|f| match f {
            RelayToClient::PeerPresent { peer, .. } => Some(*peer),
            _ => None,
        })
        .collect();
    assert_eq!(
        present,
        vec![a.public_key(), b_key.public_key()],
        "{seen:?}"
    );
    assert_eq!(srv.metric("derp_current_connections", &[]), 3.0);

    // Packets to the refused key go nowhere; the admitted pair relays.
    a_conn.send_packet(b_key.public_key(), b"hello").await;
    assert_eq!(
        b_conn.recv_packet().await,
        (a.public_key(), b"hello".to_vec())
    );
    adm.stop();
    srv.stop().await;
}

#[tokio::test]
async fn a_pending_admission_holds_up_no_one_else() {
    let adm = AdmissionServer::start(None).await;
    let check = Arc::new(
        VerifyUrl::new(
            &adm.url,
            UrlOptions {
                timeout: Duration::from_secs(30),
                cache: no_cache(),
                ..UrlOptions::default()
            },
            &AdmissionMetrics::unregistered(),
        )
        .expect("verify url"),
    );
    let srv = relay(vec![check]).await;
    let (a, b, c) = (new_key(), new_key(), new_key());
    for k in [&a, &b, &c] {
        adm.allow(&k.public_key());
    }
    let mut a_conn = admitted(&srv, &a).await.expect("a admitted");
    let mut b_conn = admitted(&srv, &b).await.expect("b admitted");

    // C's admission is asked and not answered.
    adm.set_mode(Mode::Held);
    let addr = srv.addr;
    let c_key = c.clone();
    let pending =
        tokio::spawn(async move { RawClient::try_connect(addr, c_key, plain_info()).await });
    adm.wait_requests(3).await;

    // Meanwhile A and B relay as before.
    for i in 0..100u32 {
        a_conn.send_packet(b.public_key(), &i.to_be_bytes()).await;
    }
    for i in 0..100u32 {
        assert_eq!(
            b_conn.recv_packet().await,
            (a.public_key(), i.to_be_bytes().to_vec())
        );
    }
    assert!(
        !pending.is_finished(),
        "C's handshake ended before its answer"
    );

    // The answer comes: C is admitted and relays.
    adm.release();
    let mut c_conn = tokio::time::timeout(STEP, pending)
        .await
        .expect("C admitted within a step of its answer")
        .expect("join")
        .expect("C admitted");
    c_conn
        .send_packet(b.public_key(), b"late but welcome")
        .await;
    assert_eq!(
        b_conn.recv_packet().await,
        (c.public_key(), b"late but welcome".to_vec())
    );
    adm.stop();
    srv.stop().await;
}

#[tokio::test]
async fn failures_refuse_by_default_and_fail_open_admits_only_the_unreachable() {
    let adm = AdmissionServer::start(None).await;
    let dead = {
        // A port nothing listens on: connections are refused at once.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = l.local_addr().expect("addr");
        drop(l);
        format!("http://{a}/verify")
    };
    let closed = relay(vec![url_check(&adm.url, false, no_cache())]).await;
    let open = relay(vec![url_check(&adm.url, true, no_cache())]).await;
    let closed_dead = relay(vec![url_check(&dead, false, no_cache())]).await;
    let open_dead = relay(vec![url_check(&dead, true, no_cache())]).await;
    let key = new_key();
    adm.allow(&key.public_key());

    // (mode, fail-closed reason, admitted when failing open)
    let cases = [
        (Mode::Status500, "bad_response", false),
        (Mode::Garbage, "bad_response", false),
        (Mode::Huge, "bad_response", false),
        // A response arrived, even if derpd cannot read it: not an unreachable server.
        (Mode::HugeHead, "bad_response", false),
        (Mode::SlowBody, "bad_response", false),
        (Mode::Silent, "unavailable", true),
    ];
    for (mode, reason, open_admits) in cases {
        adm.set_mode(mode);
        let before = refused(&closed, reason);
        assert!(
            admitted(&closed, &key).await.is_none(),
            "{mode:?}: fail-closed relay admitted"
        );
        assert_eq!(refused(&closed, reason), before + 1.0, "{mode:?}");
        assert_eq!(
            admitted(&open, &key).await.is_some(),
            open_admits,
            "{mode:?} with fail-open"
        );
    }
    // An admission server that is down: refused when failing closed, admitted when open.
    assert!(admitted(&closed_dead, &key).await.is_none());
    assert_eq!(refused(&closed_dead, "unavailable"), 1.0);
    assert!(admitted(&open_dead, &key).await.is_some());

    // Failures are never cached: once the server answers again, the client is in.
    adm.set_mode(Mode::Decide);
    assert!(admitted(&closed, &key).await.is_some());
    for srv in [closed, open, closed_dead, open_dead] {
        srv.stop().await;
    }
    adm.stop();
}

#[tokio::test]
async fn decisions_are_cached_briefly() {
    let adm = AdmissionServer::start(None).await;
    let cache = CacheConfig {
        allow_ttl: Duration::from_millis(400),
        deny_ttl: Duration::from_millis(400),
        max_entries: 100,
    };
    let srv = relay(vec![url_check(&adm.url, false, cache)]).await;
    let (a, d) = (new_key(), new_key());
    adm.allow(&a.public_key());
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(admitted(&srv, &a).await.expect("allowed"));
        assert!(admitted(&srv, &d).await.is_none());
    }
    assert_eq!(adm.requests().len(), 2, "one question per key");
    assert_eq!(
        refused(&srv, "denied"),
        3.0,
        "cached denials are still counted"
    );

    // A revocation at the server reaches the relay once the allow expires.
    adm.disallow(&a.public_key());
    let deadline = tokio::time::Instant::now() + STEP;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        match admitted(&srv, &a).await {
            None => break,
            Some(c) => conns.push(c),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the allow never expired"
        );
        tick.tick().await;
    }
    assert!(adm.requests().len() >= 3);
    adm.stop();
    srv.stop().await;
}

static FILES: AtomicU32 = AtomicU32::new(0);

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "derpd-admission-{tag}-{}-{}",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Replaces `path`'s contents in one step, as an editor or config tool does.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[tokio::test]
async fn the_allow_keys_file_is_followed_while_running() {
    let path = temp_file("allow");
    let (a, b) = (new_key(), new_key());
    write_atomically(&path, &format!("# only a\n{}\n", a.public_key()));
    let metrics = AdmissionMetrics::unregistered();
    let list = Arc::new(AllowKeys::load(&path, &metrics).expect("load"));
    let srv = relay(vec![list.clone()]).await;
    let shutdown = srv.server.shutdown_token();
    tokio::spawn(list.clone().watch(Duration::from_millis(20), shutdown));

    let _a1 = admitted(&srv, &a).await.expect("listed");
    assert!(admitted(&srv, &b).await.is_none());
    assert_eq!(refused(&srv, "not_listed"), 1.0);

    // Edited while running: b in, a out.
    write_atomically(&path, &format!("{}  # b's laptop\n", b.public_key()));
    let deadline = tokio::time::Instant::now() + STEP;
    let _b1 = loop {
        if let Some(c) = admitted(&srv, &b).await {
            break c;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the edit was not picked up"
        );
    };
    assert!(admitted(&srv, &a).await.is_none());

    // A bad line is reported with its number, and the list in force stays.
    write_atomically(&path, &format!("{}\nnot-a-key\n", a.public_key()));
    match list.reload() {
        Err(AllowKeysError::Line { line, .. }) => assert_eq!(line, 2),
        other => panic!("expected a bad line 2, got {other:?}"),
    }
    let _b2 = admitted(&srv, &b)
        .await
        .expect("the old list stays in force");
    assert!(admitted(&srv, &a).await.is_none());
    srv.stop().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn mesh_peers_are_admitted_without_a_question() {
    let adm = AdmissionServer::start(None).await;
    let list_path = temp_file("empty");
    std::fs::write(&list_path, "").expect("write");
    let list = AllowKeys::load(&list_path, &AdmissionMetrics::unregistered()).expect("load");
    let srv = relay(vec![Arc::new(list), url_check(&adm.url, false, no_cache())]).await;
    // Nobody is listed and the server allows nobody, yet mesh peers get in.
    let _w = watcher(&srv).await;
    let _w2 = watcher(&srv).await;
    assert!(adm.requests().is_empty());
    assert!(admitted(&srv, &new_key()).await.is_none());
    assert_eq!(refused(&srv, "not_listed"), 1.0);
    adm.stop();
    srv.stop().await;
    let _ = std::fs::remove_file(&list_path);
}

/// A stand-in tailscaled LocalAPI on a Unix socket: `whois` by node key, 200 for its peers
/// and 404 for the rest, as tailscaled answers.
async fn local_api(path: &Path, peers: HashSet<String>, old: bool) -> JoinHandle<()> {
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).expect("bind unix socket");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            let peers = peers.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).into_owned();
                let target = head.split(' ').nth(1).unwrap_or_default().to_owned();
                let host_ok = head
                    .to_ascii_lowercase()
                    .contains("\r\nhost: local-tailscaled.sock\r\n");
                let key = target
                    .strip_prefix("/localapi/v0/whois?addr=")
                    .unwrap_or_default();
                let (status, body) = if !host_ok {
                    (403, "invalid localapi request\n".to_owned())
                } else if old {
                    (400, "invalid 'addr' parameter\n".to_owned())
                } else if peers.contains(key) {
                    (
                        200,
                        format!("{{\"Node\":{{\"ID\":7,\"Key\":\"{key}\"}},\"UserProfile\":{{}}}}"),
                    )
                } else {
                    (404, "peer not found\n".to_owned())
                };
                let _ = s.write_all(respond(status, &body).as_bytes()).await;
            });
        }
    })
}

#[tokio::test]
async fn verify_clients_admits_only_peers_of_the_local_tailscaled() {
    let sock = temp_file("tailscaled.sock");
    let (peer, stranger) = (new_key(), new_key());
    let api = local_api(&sock, HashSet::from([peer.public_key().to_string()]), false).await;
    let metrics = AdmissionMetrics::unregistered();
    let check = Arc::new(LocalTailscaled::new(
        &sock,
        CacheConfig::default(),
        &metrics,
    ));
    let srv = relay(vec![check]).await;
    let _w = watcher(&srv).await;
    let _p = admitted(&srv, &peer)
        .await
        .expect("a peer of the local node");
    assert!(admitted(&srv, &stranger).await.is_none());
    assert_eq!(refused(&srv, "not_a_peer"), 1.0);
    srv.stop().await;
    api.abort();

    // A tailscaled too old for node-key lookups, or none at all: refused.
    let api = local_api(&sock, HashSet::new(), true).await;
    let check = Arc::new(LocalTailscaled::new(
        &sock,
        CacheConfig::default(),
        &metrics,
    ));
    let srv = relay(vec![check]).await;
    assert!(admitted(&srv, &peer).await.is_none());
    api.abort();
    let _ = std::fs::remove_file(&sock);
    assert!(admitted(&srv, &new_key()).await.is_none());
    assert_eq!(refused(&srv, "tailscaled_error"), 2.0);
    srv.stop().await;
}

#[tokio::test]
async fn https_admission_urls_work() {
    let ca = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let cert_der = ca.cert.der().clone();
    let key_der = rustls_key(&ca.signing_key);
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(vec![cert_der.clone()], key_der)
    .expect("server config");
    let adm = AdmissionServer::start(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config)))).await;
    let url = adm.url.replace("http://127.0.0.1", "https://localhost");
    let check = VerifyUrl::new(
        &url,
        UrlOptions {
            extra_roots: vec![cert_der],
            ..UrlOptions::default()
        },
        &AdmissionMetrics::unregistered(),
    )
    .expect("verify url");
    let srv = relay(vec![Arc::new(check)]).await;
    let key = new_key();
    adm.allow(&key.public_key());
    let _c = admitted(&srv, &key).await.expect("allowed over https");
    assert!(admitted(&srv, &new_key()).await.is_none());
    assert_eq!(refused(&srv, "denied"), 1.0);
    // The same check without the CA refuses to trust the server: unavailable.
    let untrusted = relay(vec![url_check(&url, false, no_cache())]).await;
    assert!(admitted(&untrusted, &key).await.is_none());
    assert_eq!(refused(&untrusted, "unavailable"), 1.0);
    adm.stop();
    srv.stop().await;
    untrusted.stop().await;
}

fn rustls_key(key: &rcgen::KeyPair) -> tokio_rustls::rustls::pki_types::PrivateKeyDer<'static> {
    tokio_rustls::rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into())
}
