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
pub const STEP: Duration = Duration::from_secs(10);

pub struct TestServer {
    pub server: Server,
    pub addr: SocketAddr,
    pub registry: prometheus::Registry,
    task: JoinHandle<()>,
}

impl TestServer {
    pub async fn start(config: ServerConfig) -> Self {
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
    pub async fn start_default() -> Self {
        Self::start(ServerConfig::new(derp_testkit::server_secret())).await
    }

    pub fn url(&self) -> String {
        format!("http://{}/derp", self.addr)
    }

    /// Value of a metric sample, e.g. `metric("derp_packets_dropped", &[("reason","queue_head"),("kind","other")])`.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        for family in self.registry.gather() {
            if family.get_name() != name {
                continue;
            }
            for m in family.get_metric() {
                let matches = labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.get_name() == *k && l.get_value() == *v)
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

    /// Waits until `cond` holds, polling the server's state; fails the test after [`STEP`].
    pub async fn eventually(&self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
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

    pub async fn stop(self) {
        self.server.shutdown().await;
        self.task.abort();
    }
}

/// A DERP client that speaks the wire format directly.
pub struct RawClient {
    pub stream: TcpStream,
    pub buf: BytesMut,
    pub decoder: ClientDecoder,
    pub secret: SecretKey,
    pub key: PublicKey,
    pub server_info: Option<ServerInfo>,
}

impl RawClient {
    /// Connects with a fresh random key.
    pub async fn connect(addr: SocketAddr) -> Self {
        Self::connect_with(addr, SecretKey::generate(&mut rand::rngs::OsRng)).await
    }

    /// Upgrades over plain HTTP and completes the handshake with `secret`.
    pub async fn connect_with(addr: SocketAddr, secret: SecretKey) -> Self {
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
    pub async fn upgrade(addr: SocketAddr, secret: SecretKey, extra_headers: &str) -> Self {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let req = format!(
            "GET /derp HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n{extra_headers}\r\n"
        );
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut c = Self {
            stream,
            buf: BytesMut::new(),
            decoder: ClientDecoder::new(),
            key: secret.public_key(),
            secret,
            server_info: None,
        };
        let head = c.read_http_head().await;
        assert!(
            head.starts_with("HTTP/1.1 101 "),
            "expected 101, got {head:?}"
        );
        c
    }

    /// Reads an HTTP response head from the stream, leaving later bytes in `buf`.
    pub async fn read_http_head(&mut self) -> String {
        loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = self.buf.split_to(i + 4);
                return String::from_utf8_lossy(&head).into_owned();
            }
            self.read_some().await;
        }
    }

    /// Runs the client side of the handshake: ServerKey, ClientInfo, ServerInfo.
    pub async fn handshake(&mut self, info: ClientInfo) {
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

    async fn read_some(&mut self) {
        self.buf.reserve(64 * 1024);
        let n = tokio::time::timeout(STEP, self.stream.read_buf(&mut self.buf))
            .await
            .expect("timed out reading")
            .expect("read");
        assert!(n > 0, "server closed the connection");
    }

    pub async fn send(&mut self, msg: ClientToRelay) {
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        self.stream.write_all(&out).await.expect("send");
    }

    pub async fn send_packet(&mut self, dst: PublicKey, packet: &[u8]) {
        self.send(ClientToRelay::SendPacket {
            dst,
            packet: bytes::Bytes::copy_from_slice(packet),
        })
        .await;
    }

    /// The next frame from the server, skipping keepalives.
    pub async fn recv(&mut self) -> RelayToClient {
        loop {
            match self.decoder.decode(&mut self.buf).expect("decode") {
                Some(RelayToClient::KeepAlive) => continue,
                Some(frame) => return frame,
                None => self.read_some().await,
            }
        }
    }

    /// The next frame, or `None` if none arrives within `wait`.
    pub async fn try_recv(&mut self, wait: Duration) -> Option<RelayToClient> {
        tokio::time::timeout(wait, self.recv()).await.ok()
    }

    /// The next RecvPacket, as (source, bytes).
    pub async fn recv_packet(&mut self) -> (PublicKey, Vec<u8>) {
        match self.recv().await {
            RelayToClient::RecvPacket { src, packet } => (src, packet.to_vec()),
            other => panic!("expected RecvPacket, got {other:?}"),
        }
    }

    /// Reads until the server closes the connection; fails if it does not within [`STEP`].
    pub async fn expect_closed(&mut self) {
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
pub fn disco_packet() -> Vec<u8> {
    let mut p = "TS💬".as_bytes().to_vec();
    p.resize(62, 7);
    p
}
