//! Async tokio client for DERP, Tailscale's packet relay protocol.
//!
//! What it does:
//! - **Dial**: resolves the server URL (`http://host:port/derp`, or `ws://` for WebSocket),
//!   connects over TCP within a time budget, optionally from a chosen local address, and
//!   optionally opens with a PROXY protocol header naming its own ends
//!   ([`ClientConfig::proxy_header`]).
//! - **DERP over QUIC** for `quic://host:port` URLs (or an `https://` URL with
//!   [`ClientConfig::quic_port`]): TLS 1.3 with the same verification options as https, ALPN
//!   `derp`, the DERP stream opened with its preamble, packets in QUIC datagrams when they
//!   fit (on by default), [`ReceivedFrame::ObservedAddr`] surfaced, and [`QuicPath::rebind`]
//!   to move the connection to a new local socket (migration). What the client sends runs
//!   under the congestion controller [`ClientConfig::quic_congestion`] names, by default
//!   derpd's own ([`QuicCongestion::LossFilter`]: CUBIC that does not take random loss for
//!   congestion, so a lossy path keeps its throughput); [`QuicPath::counts`] says how many
//!   packets went in datagrams and how many on the stream.
//! - **TLS** for `https://` and `wss://` URLs (module [`tls`] has the details): SNI, Mozilla's
//!   roots plus any extra ones, `sha256-raw:` pinning and expected-name overrides as in a DERP
//!   map's `CertName`, and fast start when a TLS 1.3 server presents the DERP meta certificate.
//!   Any other stream (e.g. TLS set up by the caller) can be passed to
//!   [`Client::connect_stream`].
//! - **Upgrade**: sends the HTTP/1.1 upgrade request the Go client sends (`Upgrade: DERP`, or
//!   `Upgrade: websocket` with subprotocol `derp`), requires `101 Switching Protocols`, and keeps
//!   any DERP bytes that arrived with the response. With a known server key it uses fast start
//!   (`Derp-Fast-Start: 1`): request and ClientInfo in one write, no HTTP response.
//! - **Handshake**: waits for ServerKey, sends ClientInfo sealed with a random nonce, and opens
//!   the ServerInfo that follows, using `derp_proto::ClientHandshake`.
//! - **Send and receive typed frames**: [`Client::send_packet`], [`Client::recv`] returning a
//!   [`ReceivedFrame`], and the mesh frames (`watch_conns`, `close_peer`, `forward_packet`).
//! - **Ping**: [`Client::ping`] measures the round trip; pongs that answer it are consumed
//!   internally and never surfaced.
//! - **Split**: [`Client::split`] gives a [`ClientReader`] and a [`ClientWriter`] for separate
//!   tasks. The writer batches: `queue_*` then one `flush` writes many frames at once. The
//!   reader reads in large chunks and hands out packets as slices of its buffer (no copy).
//!
//! What it does not do:
//! - **No reconnect loop**: errors on a connection are final (receive errors are sticky, as in
//!   the Go client). Callers reconnect with [`Client::connect`] and, if the client is preferred,
//!   send `note_preferred(true)` again.
//! - No client-side rate limiting from ServerInfo's token bucket fields, no HTTP proxies, and no
//!   racing of IPv4 against IPv6 dials (addresses are tried in resolver order).
//! - No OS certificate store: TLS trusts Mozilla's roots (`webpki-roots`) plus
//!   [`ClientConfig::extra_roots`], the same on every host (docs/adr/0001-tls-and-acme.md).
//!
//! The request's `User-Agent` is `derp-client/<crate version>` rather than Go's
//! `Go-http-client/1.1`; servers do not look at it.
//!
//! ```no_run
//! # async fn demo(peer: derp_proto::PublicKey) -> Result<(), Box<dyn std::error::Error>> {
//! use derp_client::{Client, ClientConfig, ReceivedFrame};
//!
//! let secret = derp_proto::SecretKey::generate(&mut rand::rngs::OsRng);
//! let config = ClientConfig::new("http://127.0.0.1:3340/derp", secret)?;
//! let mut client = Client::connect(&config).await?;
//! client.send_packet(peer, b"hello").await?;
//! if let ReceivedFrame::RecvPacket { src, packet } = client.recv().await? {
//!     println!("{} bytes from {src}", packet.len());
//! }
//! # Ok(()) }
//! ```

mod config;
mod connect;
mod error;
mod path;
mod ping;
mod quic;
mod reader;
#[cfg(test)]
mod tests;
pub mod tls;
mod transport;
mod writer;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use derp_proto::{ClientToRelay, PublicKey, ServerInfo};
use tokio::io::{AsyncRead, AsyncWrite};

pub use crate::config::{ClientConfig, Scheme, ServerUrl, TransportKind};
pub use crate::error::UrlError;
pub use crate::error::{ClientError, ConnectError};
pub use crate::path::{PREAMBLE as QUIC_PREAMBLE, QuicCounts, QuicPath};
pub use crate::ping::PendingPing;
pub use crate::reader::{ClientReader, ReceivedFrame};
pub use crate::tls::CertName;
pub use crate::writer::ClientWriter;
pub use derp_io::quic::Congestion as QuicCongestion;
pub use derp_proto::upgrade::UpgradeError;
pub use derp_proto::ws::WsError;
/// The quinn version this crate uses, whose errors the QUIC variants of [`ConnectError`] carry.
pub use quinn;
/// The rustls version this crate uses, for [`ClientConfig::tls_config`] and root certificates.
pub use rustls;

/// A connected, handshaken DERP client.
///
/// Every method takes `&mut self`; to receive in one task while sending from another, use
/// [`Client::split`].
#[derive(Debug)]
pub struct Client {
    reader: ClientReader,
    writer: ClientWriter,
    fast_start: bool,
}

impl Client {
    /// Dials `config.url`, upgrades the connection and completes the DERP handshake (up to and
    /// including ServerInfo), all within `config.connect_timeout`.
    pub async fn connect(config: &ClientConfig) -> Result<Self, ConnectError> {
        if config.uses_quic() {
            quic::connect(config).await
        } else {
            connect::connect(config).await
        }
    }

    /// Like [`Client::connect`] over a stream the caller already connected, for example a TLS
    /// stream or an in-memory pipe. `config.url` only supplies the `Host` header and path, so
    /// https and wss URLs are fine here. [`Client::local_addr`] is `None` for such clients.
    pub async fn connect_stream<S>(config: &ClientConfig, stream: S) -> Result<Self, ConnectError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        connect::connect_stream(config, derp_io::Transport::Boxed(Box::new(stream))).await
    }

    pub(crate) fn from_parts(fast_start: bool, reader: ClientReader, writer: ClientWriter) -> Self {
        Self {
            reader,
            writer,
            fast_start,
        }
    }

    /// Whether the connection used fast start (no 101 response, no wait for ServerKey), either
    /// because [`ClientConfig::fast_start_key`] was set or from the server's TLS meta
    /// certificate.
    pub fn used_fast_start(&self) -> bool {
        self.fast_start
    }

    /// The server's public key, learned in the handshake (or given for fast start).
    pub fn server_key(&self) -> PublicKey {
        self.reader.server_key()
    }

    /// The local socket address, or `None` for [`Client::connect_stream`] clients.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.reader.local_addr()
    }

    /// The QUIC path (datagram limit, addresses, [`QuicPath::rebind`]) of a client connected
    /// over QUIC; `None` over TCP.
    pub fn quic_path(&self) -> Option<&QuicPath> {
        self.reader.quic_path()
    }

    /// The ServerInfo from the handshake (or a later one the server sent).
    pub fn server_info(&self) -> ServerInfo {
        self.reader.server_info()
    }

    /// Receives the next frame; see [`ClientReader::recv`]. Errors are sticky.
    pub async fn recv(&mut self) -> Result<ReceivedFrame, ClientError> {
        self.reader.recv().await
    }

    /// Sends a packet to `dst`; packets over 64 KiB are refused with
    /// [`ClientError::PacketTooLarge`].
    pub async fn send_packet(
        &mut self,
        dst: PublicKey,
        packet: impl AsRef<[u8]>,
    ) -> Result<(), ClientError> {
        self.writer.send_packet(dst, packet).await
    }

    /// Queues a packet without writing it; see [`ClientWriter::queue_packet`].
    pub fn queue_packet(
        &mut self,
        dst: PublicKey,
        packet: impl AsRef<[u8]>,
    ) -> Result<(), ClientError> {
        self.writer.queue_packet(dst, packet)
    }

    /// Queues any client frame without writing it; see [`ClientWriter::queue_frame`].
    pub fn queue_frame(&mut self, frame: &ClientToRelay) -> Result<(), ClientError> {
        self.writer.queue_frame(frame)
    }

    /// Writes everything queued; see [`ClientWriter::flush`].
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        self.writer.flush().await
    }

    /// Bytes queued and not yet written.
    pub fn buffered_len(&self) -> usize {
        self.writer.buffered_len()
    }

    /// Tells the server whether it is this client's home DERP server.
    pub async fn note_preferred(&mut self, preferred: bool) -> Result<(), ClientError> {
        self.writer.note_preferred(preferred).await
    }

    /// Pings the server with 8 random bytes and waits up to 5 s for the pong.
    ///
    /// Frames that arrive meanwhile are kept and returned by later [`recv`](Self::recv) calls;
    /// the matching pong is consumed. Fails with [`ClientError::PingTimeout`] (connection still
    /// usable) or with the reader's error.
    pub async fn ping(&mut self) -> Result<Duration, ClientError> {
        let mut pending = self.writer.start_ping().await?;
        loop {
            tokio::select! {
                biased;
                result = pending.wait_ref() => return result,
                frame = self.reader.recv_direct() => self.reader.push_pending(frame?),
            }
        }
    }

    /// Sends an untracked ping; its pong comes back through [`recv`](Self::recv).
    pub async fn send_ping(&mut self, data: [u8; 8]) -> Result<(), ClientError> {
        self.writer.send_ping(data).await
    }

    /// Answers a server ping ([`ReceivedFrame::Ping`]).
    pub async fn send_pong(&mut self, data: [u8; 8]) -> Result<(), ClientError> {
        self.writer.send_pong(data).await
    }

    /// Subscribes to presence of every client of the server (mesh peers only).
    pub async fn watch_conns(&mut self) -> Result<(), ClientError> {
        self.writer.watch_conns().await
    }

    /// Asks the server to close every connection of `peer` (mesh peers only).
    pub async fn close_peer(&mut self, peer: PublicKey) -> Result<(), ClientError> {
        self.writer.close_peer(peer).await
    }

    /// Forwards a packet from `src` to `dst` (mesh peers only).
    pub async fn forward_packet(
        &mut self,
        src: PublicKey,
        dst: PublicKey,
        packet: Bytes,
    ) -> Result<(), ClientError> {
        self.writer.forward_packet(src, dst, packet).await
    }

    /// Flushes queued frames and closes the connection.
    pub async fn close(self) -> Result<(), ClientError> {
        self.writer.close().await
    }

    /// Splits into a receiving and a sending half for use from separate tasks. Frames that
    /// [`ping`](Self::ping) set aside are kept by the reader.
    pub fn split(self) -> (ClientReader, ClientWriter) {
        (self.reader, self.writer)
    }
}
