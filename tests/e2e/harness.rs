//! Shared test scaffolding: a real server on 127.0.0.1:0 and a byte-level DERP client.
//!
//! The raw client is built straight on `derp-proto` so tests can check exact bytes and send
//! malformed input; higher-level tests use `derp-client`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, PublicKey, RelayToClient, SecretKey,
    ServerInfo,
};
use derp_server::{Server, ServerConfig};
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// How long any single expected event may take before the test fails.
pub(crate) const STEP: Duration = Duration::from_secs(10);

pub(crate) struct TestServer {
    pub(crate) server: Server,
    pub(crate) addr: SocketAddr,
    pub(crate) registry: prometheus::Registry,
    task: JoinHandle<()>,
}

impl TestServer {
    pub(crate) async fn start(config: ServerConfig) -> Self {
        derp_testkit::init_tracing();
        let registry = prometheus::Registry::new();
        let server = Server::new(config, &registry).expect("server");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s = server.clone();
        let task = tokio::spawn(async move {
            s.serve(listener).await.expect("serve");
        });
        Self {
            server,
            addr,
            registry,
            task,
        }
    }

    /// A server with the reference vectors' key and default settings.
    pub(crate) async fn start_default() -> Self {
        Self::start(ServerConfig::new(derp_testkit::server_secret())).await
    }

    /// Value of a metric sample, e.g. `metric("derp_packets_dropped", &[("reason","queue_head"),("kind","other")])`.
    pub(crate) fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        for family in self.registry.gather() {
            if family.name() != name {
                continue;
            }
            for m in family.get_metric() {
                let matches = labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                });
                if !matches {
                    continue;
                }
                return match family.get_field_type() {
                    prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                    prometheus::proto::MetricType::GAUGE => m.get_gauge().get_value(),
                    other => panic!("metric {name} has unsupported type {other:?}"),
                };
            }
        }
        panic!("metric {name} {labels:?} not found");
    }

    /// Like [`TestServer::metric`], but 0 for a labelled counter not created yet.
    pub(crate) fn metric_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let exists = self.registry.gather().iter().any(|f| {
            f.name() == name
                && f.get_metric().iter().any(|m| {
                    labels.iter().all(|(k, v)| {
                        m.get_label()
                            .iter()
                            .any(|l| l.name() == *k && l.value() == *v)
                    })
                })
        });
        if exists {
            self.metric(name, labels)
        } else {
            0.0
        }
    }

    /// Waits until `cond` holds, polling the server's state; fails the test after [`STEP`].
    pub(crate) async fn eventually(&self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + STEP;
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        while !cond(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tick.tick().await;
        }
    }

    pub(crate) async fn stop(self) {
        self.server.shutdown().await;
        self.task.abort();
    }
}

/// A DERP client that speaks the wire format directly.
pub(crate) struct RawClient {
    pub(crate) stream: TcpStream,
    pub(crate) buf: BytesMut,
    pub(crate) decoder: ClientDecoder,
    pub(crate) secret: SecretKey,
    pub(crate) key: PublicKey,
    pub(crate) server_info: Option<ServerInfo>,
}

impl RawClient {
    /// A client on `stream` that has done nothing yet: no upgrade, no handshake.
    pub(crate) fn on_stream(stream: TcpStream, secret: SecretKey) -> Self {
        Self {
            stream,
            buf: BytesMut::new(),
            decoder: ClientDecoder::new(),
            key: secret.public_key(),
            secret,
            server_info: None,
        }
    }

    /// Connects with a fresh random key.
    pub(crate) async fn connect(addr: SocketAddr) -> Self {
        Self::connect_with(addr, SecretKey::generate(&mut rand::rngs::OsRng)).await
    }

    /// Upgrades over plain HTTP and completes the handshake with `secret`.
    pub(crate) async fn connect_with(addr: SocketAddr, secret: SecretKey) -> Self {
        let mut c = Self::upgrade(addr, secret, "").await;
        c.handshake(ClientInfo {
            version: 2,
            can_ack_pings: true,
            ..ClientInfo::default()
        })
        .await;
        c
    }

    /// Sends the upgrade request (with `extra_headers`, each ending in CRLF) and reads the
    /// 101 response head, without starting the DERP handshake.
    pub(crate) async fn upgrade(addr: SocketAddr, secret: SecretKey, extra_headers: &str) -> Self {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let req = format!(
            "GET /derp HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n{extra_headers}\r\n"
        );
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut c = Self::on_stream(stream, secret);
        let head = c.read_http_head().await;
        assert!(
            head.starts_with("HTTP/1.1 101 "),
            "expected 101, got {head:?}"
        );
        c
    }

    /// Reads an HTTP response head from the stream, leaving later bytes in `buf`.
    pub(crate) async fn read_http_head(&mut self) -> String {
        loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = self.buf.split_to(i + 4);
                return String::from_utf8_lossy(&head).into_owned();
            }
            self.read_some().await;
        }
    }

    /// Runs the client side of the handshake: ServerKey, ClientInfo, ServerInfo.
    pub(crate) async fn handshake(&mut self, info: ClientInfo) {
        let mut hs = ClientHandshake::new(self.secret.clone(), info);
        match self.recv().await {
            RelayToClient::ServerKey(k) => hs.handle_server_key(k).expect("server key"),
            other => panic!("expected ServerKey, got {other:?}"),
        }
        let mut nonce = [0u8; 24];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let mut out = BytesMut::new();
        hs.client_info_frame(nonce, &mut out).expect("client info");
        self.stream
            .write_all(&out)
            .await
            .expect("write client info");
        match self.recv().await {
            RelayToClient::ServerInfo { sealed } => {
                self.server_info = Some(hs.handle_server_info(&sealed).expect("server info"));
            }
            other => panic!("expected ServerInfo, got {other:?}"),
        }
    }

    /// Reads whatever arrives next into `buf`.
    pub(crate) async fn read_more(&mut self) {
        self.read_some().await;
    }

    async fn read_some(&mut self) {
        self.buf.reserve(64 * 1024);
        let n = tokio::time::timeout(STEP, self.stream.read_buf(&mut self.buf))
            .await
            .expect("timed out reading")
            .expect("read");
        assert!(n > 0, "server closed the connection");
    }

    pub(crate) async fn send(&mut self, msg: ClientToRelay) {
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        self.stream.write_all(&out).await.expect("send");
    }

    pub(crate) async fn send_packet(&mut self, dst: PublicKey, packet: &[u8]) {
        self.send(ClientToRelay::SendPacket {
            dst,
            packet: bytes::Bytes::copy_from_slice(packet),
        })
        .await;
    }

    /// The next frame from the server, skipping keepalives.
    pub(crate) async fn recv(&mut self) -> RelayToClient {
        loop {
            match self.decoder.decode(&mut self.buf).expect("decode") {
                Some(RelayToClient::KeepAlive) => continue,
                Some(frame) => return frame,
                None => self.read_some().await,
            }
        }
    }

    /// The next RecvPacket, as (source, bytes).
    pub(crate) async fn recv_packet(&mut self) -> (PublicKey, Vec<u8>) {
        match self.recv().await {
            RelayToClient::RecvPacket { src, packet } => (src, packet.to_vec()),
            other => panic!("expected RecvPacket, got {other:?}"),
        }
    }

    /// Reads until the server closes the connection; fails if it does not within [`STEP`].
    pub(crate) async fn expect_closed(&mut self) {
        let mut scratch = [0u8; 4096];
        loop {
            match tokio::time::timeout(STEP, self.stream.read(&mut scratch)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(_)) => continue,
                Err(_) => panic!("server did not close the connection"),
            }
        }
    }
}

/// A packet that looks like a disco message to the server (magic + at least 62 bytes).
pub(crate) fn disco_packet() -> Vec<u8> {
    let mut p = "TS💬".as_bytes().to_vec();
    p.resize(62, 7);
    p
}

impl RawClient {
    /// Like [`RawClient::connect_with`], on a stream the caller opened (for example one with
    /// a small receive buffer).
    pub(crate) async fn connect_on(stream: TcpStream, secret: SecretKey) -> Self {
        let mut c = Self::upgrade_on(stream, secret, "").await;
        c.handshake(ClientInfo {
            version: 2,
            can_ack_pings: true,
            ..ClientInfo::default()
        })
        .await;
        c
    }

    /// Like [`RawClient::upgrade`], on a stream the caller opened.
    pub(crate) async fn upgrade_on(
        mut stream: TcpStream,
        secret: SecretKey,
        extra_headers: &str,
    ) -> Self {
        stream.set_nodelay(true).expect("nodelay");
        let addr = stream.peer_addr().expect("peer addr");
        let req = format!(
            "GET /derp HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n{extra_headers}\r\n"
        );
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut c = Self::on_stream(stream, secret);
        let head = c.read_http_head().await;
        assert!(
            head.starts_with("HTTP/1.1 101 "),
            "expected 101, got {head:?}"
        );
        c
    }

    /// The next frame from the server, keepalives included.
    pub(crate) async fn recv_any(&mut self) -> RelayToClient {
        loop {
            match self.decoder.decode(&mut self.buf).expect("decode") {
                Some(frame) => return frame,
                None => self.read_some().await,
            }
        }
    }

    /// Writes bytes as they are, for malformed frames.
    pub(crate) async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send raw");
    }

    /// Returns every frame (keepalives excepted) that the server had queued for this client
    /// before the call: pings twice and collects what arrives before each pong.
    ///
    /// Two round trips because the server may write a pong ahead of packets taken in the same
    /// batch; everything queued before the first ping was handled is written before the
    /// second pong. Also proves the connection is alive and the server has handled every
    /// frame this client sent before.
    pub(crate) async fn barrier(&mut self) -> Vec<RelayToClient> {
        let mut seen = Vec::new();
        for _ in 0..2 {
            let mut tag = [0u8; 8];
            rand::rngs::OsRng.fill_bytes(&mut tag);
            self.send(ClientToRelay::Ping(tag)).await;
            loop {
                match self.recv().await {
                    RelayToClient::Pong(p) if p == tag => break,
                    other => seen.push(other),
                }
            }
        }
        seen
    }

    /// Fails unless the server queued nothing for this client (see [`RawClient::barrier`]).
    pub(crate) async fn expect_quiet(&mut self) {
        let seen = self.barrier().await;
        assert!(seen.is_empty(), "expected no frames, got {seen:?}");
    }
}

/// A complete frame: 5-byte header for type `ty` and `body`.
pub(crate) fn raw_frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(ty);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// A parsed HTTP response.
#[derive(Debug)]
pub(crate) struct HttpResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `request` verbatim on a new connection and reads the response until the server
/// closes (requests should carry `Connection: close`). Bodies are read by Content-Length
/// when given, so HEAD and 204 responses work too.
pub(crate) async fn http_exchange(addr: SocketAddr, request: &str) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(STEP, stream.read_to_end(&mut raw))
        .await
        .expect("timed out reading response")
        .expect("read response");
    parse_http_response(&raw)
}

/// Parses one HTTP/1.1 response from `raw` (head and the rest as body).
pub(crate) fn parse_http_response(raw: &[u8]) -> HttpResponse {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    HttpResponse {
        status,
        headers,
        body: raw[end + 4..].to_vec(),
    }
}

/// Opens a TCP connection to `addr` from `source` (any 127.0.0.0/8 address works on
/// loopback), so that tests can play many distinct hosts.
pub(crate) async fn connect_from(addr: SocketAddr, source: std::net::Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from((source, 0)))
        .expect("bind to a loopback source");
    socket.connect(addr).await.expect("connect")
}

/// The `i`th of a round of flood sources: 127.<round+1>.<i / 250>.<i % 250 + 2>, never
/// 127.0.0.1, which the good clients use.
pub(crate) fn flood_source(round: u8, i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, round + 1, (i / 250) as u8, (i % 250) as u8 + 2)
}

/// Reads until EOF or reset; fails if the server keeps the connection open past [`STEP`].
pub(crate) async fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout(STEP, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("server kept the connection open"),
        }
    }
}

impl RawClient {
    /// Runs the handshake like [`RawClient::handshake`], but tells whether the server let the
    /// client in (answered with ServerInfo) or closed the connection after ClientInfo with
    /// nothing else said.
    pub(crate) async fn try_handshake(&mut self, info: ClientInfo) -> bool {
        let mut hs = ClientHandshake::new(self.secret.clone(), info);
        match self.recv().await {
            RelayToClient::ServerKey(k) => hs.handle_server_key(k).expect("server key"),
            other => panic!("expected ServerKey, got {other:?}"),
        }
        let mut nonce = [0u8; 24];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let mut out = BytesMut::new();
        hs.client_info_frame(nonce, &mut out).expect("client info");
        self.stream
            .write_all(&out)
            .await
            .expect("write client info");
        loop {
            match self.decoder.decode(&mut self.buf).expect("decode") {
                Some(RelayToClient::ServerInfo { sealed }) => {
                    self.server_info = Some(hs.handle_server_info(&sealed).expect("server info"));
                    return true;
                }
                Some(other) => panic!("expected ServerInfo or a close, got {other:?}"),
                None => {}
            }
            self.buf.reserve(4096);
            match tokio::time::timeout(STEP, self.stream.read_buf(&mut self.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return false,
                Ok(Ok(_)) => {}
                Err(_) => panic!("server neither admitted nor closed the client"),
            }
        }
    }

    /// Connects with `secret` and `info`; `None` when the server refused the client after
    /// its ClientInfo.
    pub(crate) async fn try_connect(
        addr: SocketAddr,
        secret: SecretKey,
        info: ClientInfo,
    ) -> Option<Self> {
        let mut c = Self::upgrade(addr, secret, "").await;
        c.try_handshake(info).await.then_some(c)
    }
}

/// The ClientInfo ordinary test clients send.
pub(crate) fn plain_info() -> ClientInfo {
    ClientInfo {
        version: 2,
        can_ack_pings: true,
        ..ClientInfo::default()
    }
}

impl RawClient {
    /// Like [`RawClient::upgrade`] with a fresh key, but `None` when the server closes the
    /// connection instead of answering (refused at accept).
    pub(crate) async fn try_upgrade(addr: SocketAddr) -> Option<Self> {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        stream.set_nodelay(true).ok()?;
        let req = format!(
            "GET /derp HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await.ok()?;
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let mut c = Self::on_stream(stream, secret);
        loop {
            if let Some(i) = c.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = c.buf.split_to(i + 4);
                assert!(head.starts_with(b"HTTP/1.1 101 "), "{head:?}");
                return Some(c);
            }
            c.buf.reserve(4096);
            match tokio::time::timeout(STEP, c.stream.read_buf(&mut c.buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return None,
                Ok(Ok(_)) => {}
                Err(_) => panic!("no answer to the upgrade"),
            }
        }
    }
}
