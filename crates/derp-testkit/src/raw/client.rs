//! The async client for tests.

use std::io;
use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use derp_proto::frame::FRAME_HEADER_LEN;
use derp_proto::{ClientInfo, ClientToRelay, PublicKey, RelayToClient, SecretKey, ServerInfo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{FrameBuf, Handshake, STEP, Step, UpgradeRequest, decode_frame, plain_info};

/// A DERP client over plain TCP for tests: every step either does what it says or fails the
/// test with a message, and no read waits longer than [`STEP`].
#[derive(Debug)]
pub struct RawClient {
    /// The socket, for writing malformed bytes or shutting it down.
    pub stream: TcpStream,
    /// What was read from the socket and not taken yet.
    pub buf: FrameBuf,
    /// The client's key.
    pub secret: SecretKey,
    /// Its public half.
    pub key: PublicKey,
    /// What the server said in its ServerInfo, once the handshake is done.
    pub server_info: Option<ServerInfo>,
}

/// How a read ended.
enum Read {
    Bytes,
    Closed,
}

impl RawClient {
    /// A client on `stream` that has done nothing yet: no upgrade, no handshake.
    pub fn on_stream(stream: TcpStream, secret: SecretKey) -> Self {
        Self {
            stream,
            buf: FrameBuf::new(),
            key: secret.public_key(),
            secret,
            server_info: None,
        }
    }

    /// Connects to `addr` with a fresh random key.
    pub async fn connect(addr: SocketAddr) -> Self {
        Self::connect_with(addr, SecretKey::generate(&mut rand::rngs::OsRng)).await
    }

    /// Upgrades over plain HTTP and completes the handshake with `secret` and
    /// [`plain_info`].
    pub async fn connect_with(addr: SocketAddr, secret: SecretKey) -> Self {
        let mut c = Self::upgrade(addr, secret, "").await;
        c.handshake(plain_info()).await;
        c
    }

    /// Like [`RawClient::connect_with`], on a stream the caller opened (for example one with
    /// a small receive buffer).
    pub async fn connect_on(stream: TcpStream, secret: SecretKey) -> Self {
        let mut c = Self::upgrade_on(stream, secret, "").await;
        c.handshake(plain_info()).await;
        c
    }

    /// Connects with `secret` and `info`; `None` when the server refused the client after
    /// its ClientInfo.
    pub async fn try_connect(
        addr: SocketAddr,
        secret: SecretKey,
        info: ClientInfo,
    ) -> Option<Self> {
        let mut c = Self::upgrade(addr, secret, "").await;
        c.try_handshake(info).await.then_some(c)
    }

    /// Sends the upgrade request (with `extra_headers`, each ending in CRLF) and reads the
    /// 101 response head, without starting the DERP handshake.
    pub async fn upgrade(addr: SocketAddr, secret: SecretKey, extra_headers: &str) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        Self::upgrade_on(stream, secret, extra_headers).await
    }

    /// Like [`RawClient::upgrade`], on a stream the caller opened.
    pub async fn upgrade_on(stream: TcpStream, secret: SecretKey, extra_headers: &str) -> Self {
        Self::try_upgrade_on(stream, secret, extra_headers)
            .await
            .expect("the server closed the connection instead of answering the upgrade")
    }

    /// Like [`RawClient::upgrade`] with a fresh key, but `None` when the server closes the
    /// connection instead of answering (refused at accept).
    pub async fn try_upgrade(addr: SocketAddr) -> Option<Self> {
        let stream = TcpStream::connect(addr).await.ok()?;
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        Self::try_upgrade_on(stream, secret, "").await
    }

    async fn try_upgrade_on(
        stream: TcpStream,
        secret: SecretKey,
        extra_headers: &str,
    ) -> Option<Self> {
        stream.set_nodelay(true).expect("nodelay");
        let host = stream.peer_addr().expect("peer addr").to_string();
        let mut c = Self::on_stream(stream, secret);
        let request = UpgradeRequest {
            host: &host,
            path: "/derp",
            extra_headers,
        };
        c.stream.write_all(&request.to_bytes()).await.ok()?;
        let head = c.try_read_http_head().await?;
        assert!(
            head.starts_with("HTTP/1.1 101 "),
            "expected 101, got {head:?}"
        );
        Some(c)
    }

    /// Reads an HTTP response head, leaving what follows it in [`RawClient::buf`].
    pub async fn read_http_head(&mut self) -> String {
        self.try_read_http_head()
            .await
            .expect("the server closed the connection before a response head")
    }

    async fn try_read_http_head(&mut self) -> Option<String> {
        loop {
            if let Some(head) = self.buf.take_http_head() {
                return Some(head);
            }
            if let Read::Closed = self.read().await {
                return None;
            }
        }
    }

    /// Runs the client side of the handshake: ServerKey, ClientInfo, ServerInfo.
    pub async fn handshake(&mut self, info: ClientInfo) {
        assert!(
            self.try_handshake(info).await,
            "the server closed the connection after ClientInfo"
        );
    }

    /// Runs the handshake like [`RawClient::handshake`], but tells whether the server let the
    /// client in (answered with ServerInfo) or closed the connection after ClientInfo with
    /// nothing else said.
    pub async fn try_handshake(&mut self, info: ClientInfo) -> bool {
        let mut hs = Handshake::new(self.secret.clone(), info);
        loop {
            let Some(frame) = self.try_recv_any().await else {
                assert!(
                    hs.sent_client_info(),
                    "the server closed the connection before ServerKey"
                );
                return false;
            };
            match hs.step(frame).expect("handshake") {
                Step::Send(out) => self.send_raw(&out).await,
                Step::Read => {}
                Step::Done(info) => {
                    self.server_info = Some(info);
                    return true;
                }
            }
        }
    }

    /// Reads whatever arrives next into [`RawClient::buf`]; fails if the server closes the
    /// connection.
    pub async fn read_more(&mut self) {
        if let Read::Closed = self.read().await {
            panic!("server closed the connection");
        }
    }

    /// One read: EOF and a reset both count as closed. Fails the test after [`STEP`].
    async fn read(&mut self) -> Read {
        let spare = self.buf.spare();
        // An empty buffer would read 0 bytes, which looks like a close.
        assert!(!spare.is_empty(), "more unread bytes than a frame can hold");
        match tokio::time::timeout(STEP, self.stream.read(spare)).await {
            Ok(Ok(0) | Err(_)) => Read::Closed,
            Ok(Ok(n)) => {
                self.buf.filled(n);
                Read::Bytes
            }
            Err(_) => panic!("timed out reading"),
        }
    }

    /// Sends one frame.
    pub async fn send(&mut self, msg: ClientToRelay) {
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        self.send_raw(&out).await;
    }

    /// Sends `packet` to `dst`.
    pub async fn send_packet(&mut self, dst: PublicKey, packet: &[u8]) {
        self.send(ClientToRelay::SendPacket {
            dst,
            packet: Bytes::copy_from_slice(packet),
        })
        .await;
    }

    /// Writes bytes as they are, for malformed frames.
    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("send");
    }

    /// The next frame from the server, keepalives included; `None` when the server closes
    /// the connection.
    async fn try_recv_any(&mut self) -> Option<RelayToClient> {
        loop {
            if let Some((_, range)) = self.buf.next_frame().expect("frame") {
                return Some(decode_frame(&self.buf[range]).expect("decode"));
            }
            if let Read::Closed = self.read().await {
                return None;
            }
        }
    }

    /// The next frame from the server, keepalives included.
    pub async fn recv_any(&mut self) -> RelayToClient {
        self.try_recv_any()
            .await
            .expect("server closed the connection")
    }

    /// The next frame from the server, skipping keepalives.
    pub async fn recv(&mut self) -> RelayToClient {
        loop {
            match self.recv_any().await {
                RelayToClient::KeepAlive => continue,
                frame => return frame,
            }
        }
    }

    /// The next RecvPacket, as (source, bytes).
    pub async fn recv_packet(&mut self) -> (PublicKey, Vec<u8>) {
        match self.recv().await {
            RelayToClient::RecvPacket { src, packet } => (src, packet.to_vec()),
            other => panic!("expected RecvPacket, got {other:?}"),
        }
    }

    /// Reads until the server closes the connection (EOF or reset), whatever comes before;
    /// fails if it has not within [`STEP`].
    pub async fn expect_closed(&mut self) {
        let closed = async {
            loop {
                self.buf.consume(self.buf.unread().len());
                if let Read::Closed = self.read().await {
                    return;
                }
            }
        };
        tokio::time::timeout(STEP, closed)
            .await
            .expect("the server did not close the connection");
    }

    /// Fails unless the server closes the connection (EOF or reset) with nothing more said,
    /// within [`STEP`]: a refusal. Bytes that arrive before the close are not one. `what`
    /// names the case in the failure.
    pub async fn expect_refused(&mut self, what: &str) {
        assert!(
            self.buf.unread().is_empty(),
            "{what}: the server said {:?} before",
            String::from_utf8_lossy(self.buf.unread())
        );
        let read = tokio::time::timeout(STEP, self.stream.read(self.buf.spare())).await;
        match read {
            Ok(Ok(0)) => {}
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Ok(Ok(n)) => {
                self.buf.filled(n);
                panic!(
                    "{what}: the server said {:?} instead of closing the connection",
                    String::from_utf8_lossy(self.buf.unread())
                );
            }
            Ok(Err(e)) => panic!("{what}: reading: {e}"),
            Err(_) => panic!("{what}: the connection is still open after {STEP:?}"),
        }
    }

    /// Every whole frame the server sends until it closes the connection (EOF or reset), as
    /// (type, body), and how many bytes of a last frame were cut short by the close; fails if
    /// the connection is still open after [`STEP`].
    pub async fn frames_until_closed(&mut self) -> (Vec<(u8, Vec<u8>)>, usize) {
        let mut frames = Vec::new();
        let closed = async {
            loop {
                while let Some((ty, range)) = self.buf.next_frame().expect("frame") {
                    frames.push((ty, self.buf[range][FRAME_HEADER_LEN..].to_vec()));
                }
                if let Read::Closed = self.read().await {
                    return self.buf.unread().len();
                }
            }
        };
        let cut_short = tokio::time::timeout(STEP, closed)
            .await
            .expect("the server did not close the connection");
        (frames, cut_short)
    }

    /// Returns every frame (keepalives excepted) that the server had queued for this client
    /// before the call: pings twice and collects what arrives before each pong.
    ///
    /// Two round trips because the server may write a pong ahead of packets taken in the same
    /// batch; everything queued before the first ping was handled is written before the
    /// second pong. Also proves the connection is alive and the server has handled every
    /// frame this client sent before.
    pub async fn barrier(&mut self) -> Vec<RelayToClient> {
        let mut seen = Vec::new();
        let pongs = async {
            for _ in 0..2 {
                let tag: [u8; 8] = rand::random();
                self.send(ClientToRelay::Ping(tag)).await;
                loop {
                    match self.recv().await {
                        RelayToClient::Pong(p) if p == tag => break,
                        other => seen.push(other),
                    }
                }
            }
        };
        tokio::time::timeout(STEP, pongs)
            .await
            .expect("no pong within the deadline");
        seen
    }

    /// Fails unless the server queued nothing for this client (see [`RawClient::barrier`]).
    pub async fn expect_quiet(&mut self) {
        let seen = self.barrier().await;
        assert!(seen.is_empty(), "expected no frames, got {seen:?}");
    }
}
