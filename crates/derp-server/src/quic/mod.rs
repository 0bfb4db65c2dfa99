//! DERP over QUIC: the UDP endpoint and its transport settings, and what a QUIC connection
//! adds to a DERP connection (datagrams, the migration gate). The mapping itself is in
//! `docs/protocol.md` ("DERP over QUIC").
//!
//! The caller binds the UDP socket and supplies the rustls server config (TLS 1.3, ALPN
//! `derp`; `derp-tls` builds it with the same certificates as the TCP listener). A QUIC
//! connection's one bidirectional stream runs the very same handshake, registration, read
//! loop and writer as a TCP connection; its datagrams enter the same routing and leave from
//! the same writer (`conn`).
//!
//! The endpoint runs on quinn-proto and quinn-udp under a driver of derpd's own
//! (`driver.rs`): one task for the socket and every connection, which also routes the
//! datagrams of registered clients, instead of quinn's task per connection, and paces each
//! connection in smaller bursts than quinn-proto's pacer does (`pace.rs`).

mod conn;
mod driver;
mod gate;
mod link;
mod pace;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

pub(crate) use conn::{Conn, DatagramError};
pub use derp_io::quic::Congestion;
pub(crate) use driver::Incoming;
pub(crate) use link::QuicLink;
use quinn::crypto::rustls::QuicServerConfig;
use quinn::{EndpointConfig, IdleTimeout, TransportConfig, VarInt};
use tokio::sync::Semaphore;

/// The ALPN protocol of DERP over QUIC.
pub const ALPN: &[u8] = b"derp";

/// The 8 bytes a client writes first on its DERP stream ("DERP🔑", the ServerKey magic):
/// a QUIC stream does not exist for the server until data arrives on it.
pub const PREAMBLE: [u8; 8] = derp_proto::frame::MAGIC;

/// Application error codes of DERP over QUIC (CONNECTION_CLOSE, RESET_STREAM, STOP_SENDING).
pub mod close_code {
    /// Normal end: the client finished or reset its stream.
    pub const NO_ERROR: u32 = 0x0;
    /// A frame broke its rule after the handshake (where TCP closes the connection).
    pub const PROTOCOL_ERROR: u32 = 0x1;
    /// Wrong preamble, bad ClientInfo, box or JSON failure, refused mesh key.
    pub const HANDSHAKE_FAILED: u32 = 0x2;
    /// Stream, preamble or ClientInfo not there in time.
    pub const HANDSHAKE_TIMEOUT: u32 = 0x3;
    /// A write to the client blocked past the write deadline.
    pub const WRITE_TIMEOUT: u32 = 0x4;
    /// Closed by server policy (a mesh peer's ClosePeer, a newer connection's takeover).
    pub const CLOSED: u32 = 0x5;
    /// The server is shutting down.
    pub const SHUTDOWN: u32 = 0x6;
}

/// Settings of the QUIC listener.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    /// Deadline for the QUIC (TLS) handshake and the DERP stream's preamble, from the
    /// client's first packet. ClientInfo then has
    /// [`ServerConfig::handshake_timeout`](crate::ServerConfig) from ServerKey, as over TCP.
    pub handshake_timeout: Duration,
    /// QUIC handshakes in progress at once; beyond it, a client whose address is not yet
    /// validated is sent a Retry, and one that is validated is refused.
    pub max_handshakes: usize,
    /// The idle timeout advertised (`max_idle_timeout`); the smaller of both sides' applies.
    pub idle_timeout: Duration,
    /// The server sends a PING after this long without hearing from the client, which keeps
    /// NAT bindings open and detects a vanished client.
    pub keep_alive: Duration,
    /// The congestion controller of what the server sends to each client.
    pub congestion: Congestion,
    /// What the endpoint's stateless-reset tokens are derived from. A client believes a
    /// reset only if its token matches the one the server gave it, so an endpoint that
    /// shares the secret with the one that served the client (the same node restarted, or
    /// the process that took its socket over) makes a client of the other drop its
    /// connection at once instead of waiting out the idle timeout. `None`: a random one,
    /// good for this endpoint only.
    pub reset_secret: Option<ResetSecret>,
}

/// The secret a QUIC endpoint's stateless-reset tokens are derived from.
#[derive(Clone)]
pub struct ResetSecret([u8; 32]);

impl ResetSecret {
    /// Derived from the node's private key (HMAC-SHA256 keyed with it, over a label of its
    /// own), so every process that serves as that node resets the same way, while the key
    /// itself cannot be learned from a reset token.
    pub fn from_node_key(key: &derp_proto::SecretKey) -> Self {
        let mac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key.to_bytes());
        let tag = ring::hmac::sign(&mac, RESET_SECRET_LABEL);
        let mut secret = [0u8; 32];
        secret.copy_from_slice(tag.as_ref());
        Self(secret)
    }

    fn hmac_key(&self) -> ring::hmac::Key {
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.0)
    }
}

impl std::fmt::Debug for ResetSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResetSecret(..)")
    }
}

/// Sets the reset secret apart from any other use of the node key.
const RESET_SECRET_LABEL: &[u8] = b"derpd QUIC stateless reset v1";

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: DEFAULT_QUIC_HANDSHAKE_TIMEOUT,
            max_handshakes: DEFAULT_MAX_QUIC_HANDSHAKES,
            idle_timeout: QUIC_IDLE_TIMEOUT,
            keep_alive: QUIC_KEEP_ALIVE,
            congestion: Congestion::default(),
            reset_secret: None,
        }
    }
}

/// Default deadline for a QUIC handshake and the DERP stream's preamble: the idle timeout,
/// since loss makes a QUIC handshake slow, not idle. Each lost flight doubles the wait before it is sent again, and
/// across a link that loses 10 to 20 % of packets each way handshakes took up to 15 s. The
/// server's wait also ends a flight after the client's (the client is done when it has the
/// server's Finished, the server when it has the client's), so a shorter deadline can close
/// a connection its client already uses. What slow handshakes can hold is bounded by
/// [`DEFAULT_MAX_QUIC_HANDSHAKES`] and the Retry beyond it, not by this deadline.
pub const DEFAULT_QUIC_HANDSHAKE_TIMEOUT: Duration = QUIC_IDLE_TIMEOUT;
/// Default cap on QUIC handshakes in progress.
pub const DEFAULT_MAX_QUIC_HANDSHAKES: usize = 1024;
/// Idle timeout the server advertises.
pub const QUIC_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The server's keep-alive interval.
pub const QUIC_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Why the QUIC listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    /// The TLS config's ALPN list is not exactly `derp`.
    #[error("tls config unusable for QUIC: ALPN must be exactly \"derp\"")]
    Alpn,
    /// The TLS config cannot serve QUIC (it needs TLS 1.3 and TLS13_AES_128_GCM_SHA256).
    #[error("tls config unusable for QUIC: {0}")]
    Tls(#[source] quinn::crypto::rustls::NoInitialCipherSuite),
    /// The idle timeout is longer than QUIC can advertise.
    #[error("invalid QUIC setting: idle timeout {timeout:?} out of range")]
    IdleTimeout {
        /// The timeout asked for.
        timeout: Duration,
        /// Why quinn refused it.
        source: quinn::VarIntBoundsExceeded,
    },
    /// Called outside a tokio runtime.
    #[error("no tokio runtime: {0}")]
    NoRuntime(#[source] tokio::runtime::TryCurrentError),
    /// The socket could not be used.
    #[error("udp socket: {0}")]
    Io(#[from] io::Error),
}

/// A bound QUIC endpoint ready for [`Server::serve_quic`](crate::Server::serve_quic).
#[derive(Debug)]
pub struct QuicListener {
    pub(crate) endpoint: driver::Endpoint,
    pub(crate) incoming: tokio::sync::mpsc::Receiver<Incoming>,
    pub(crate) config: QuicConfig,
    pub(crate) handshakes: Arc<Semaphore>,
}

impl QuicListener {
    /// Serves QUIC on `socket` with `tls` (whose ALPN list must be exactly `derp`: QUIC
    /// refuses clients that offer nothing in common). Must run inside a tokio runtime.
    pub fn bind(
        socket: std::net::UdpSocket,
        tls: Arc<rustls::ServerConfig>,
        config: QuicConfig,
    ) -> Result<Self, QuicError> {
        if tls.alpn_protocols != [ALPN] {
            return Err(QuicError::Alpn);
        }
        let crypto = QuicServerConfig::try_from(tls).map_err(QuicError::Tls)?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        // Path MTU discovery probes further over IPv4 (`derp_io::quic::mtu_upper_bound`):
        // the same config (and Retry token key) but for the transport settings.
        let v6: IpAddr = Ipv6Addr::UNSPECIFIED.into();
        let v4: IpAddr = Ipv4Addr::UNSPECIFIED.into();
        let mut server_v4 = server.clone();
        server.transport_config(Arc::new(transport_config(&config, v6)?));
        server_v4.transport_config(Arc::new(transport_config(&config, v4)?));
        let mut endpoint = match &config.reset_secret {
            Some(secret) => EndpointConfig::new(Arc::new(secret.hmac_key())),
            None => EndpointConfig::default(),
        };
        endpoint.supported_versions(vec![QUIC_V1]);
        endpoint.cid_generator(|| {
            Box::new(quinn_proto::RandomConnectionIdGenerator::new(
                derp_io::quic::SERVER_CID_LEN,
            ))
        });
        tokio::runtime::Handle::try_current().map_err(QuicError::NoRuntime)?;
        let (endpoint, incoming) =
            driver::Endpoint::new(socket, endpoint, Arc::new(server), Arc::new(server_v4))?;
        Ok(Self {
            endpoint,
            incoming,
            handshakes: Arc::new(Semaphore::new(config.max_handshakes.max(1))),
            config,
        })
    }

    /// The address the endpoint is bound to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.endpoint.local_addr())
    }
}

/// Binds the UDP socket for [`QuicListener::bind`], asking for large kernel buffers (best
/// effort; the kernel caps them at `net.core.rmem_max` / `wmem_max`): one socket carries
/// every QUIC client, and a burst that overflows it is lost.
pub fn bind_udp(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let domain = if addr.is_ipv4() {
        socket2::Domain::IPV4
    } else {
        socket2::Domain::IPV6
    };
    let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    if addr.is_ipv6() {
        // Both families on `[::]`, whatever the system's default.
        socket.set_only_v6(false)?;
    }
    let _ = socket.set_recv_buffer_size(UDP_BUFFER);
    let _ = socket.set_send_buffer_size(UDP_BUFFER);
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

const UDP_BUFFER: usize = 8 << 20;

/// QUIC version 1 (RFC 9000), the only one served.
const QUIC_V1: u32 = 1;

/// The transport parameters and timers of `docs/protocol.md`'s table, with the settings
/// derp-client shares (`derp_io::quic`); migration is allowed (quinn's default).
fn transport_config(config: &QuicConfig, peer: IpAddr) -> Result<TransportConfig, QuicError> {
    let mut t = TransportConfig::default();
    derp_io::quic::configure(&mut t, config.congestion, peer);
    // One DERP stream, opened by the client; the server never opens one.
    t.max_concurrent_bidi_streams(VarInt::from_u32(1));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    let idle =
        IdleTimeout::try_from(config.idle_timeout).map_err(|source| QuicError::IdleTimeout {
            timeout: config.idle_timeout,
            source,
        })?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(config.keep_alive));
    // quinn refuses (PROTOCOL_VIOLATION) any datagram larger than this buffer, and
    // advertises max_datagram_frame_size = min(this, 65535); keep it above 65535 + its
    // per-datagram overhead so the advertised limit is the real one.
    t.datagram_receive_buffer_size(Some(DATAGRAM_RECEIVE_BUFFER));
    // What one client can make the server buffer, and have in flight towards it.
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW));
    t.receive_window(VarInt::from_u32(STREAM_WINDOW));
    t.send_window(u64::from(STREAM_WINDOW));
    Ok(t)
}

const DATAGRAM_RECEIVE_BUFFER: usize = 128 * 1024;
const STREAM_WINDOW: u32 = 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use quinn_proto::crypto::HmacKey;

    fn tag(secret: &ResetSecret, cid: &[u8]) -> Vec<u8> {
        let key = secret.hmac_key();
        let mut out = vec![0u8; key.signature_len()];
        key.sign(cid, &mut out);
        out
    }

    #[test]
    fn the_reset_secret_is_the_nodes_and_not_its_key() {
        let node = derp_proto::SecretKey::from_bytes([7; 32]);
        let other = derp_proto::SecretKey::from_bytes([8; 32]);
        let cid = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let (a, b) = (
            ResetSecret::from_node_key(&node),
            ResetSecret::from_node_key(&node),
        );
        // Two processes of one node sign a connection ID alike; another node does not.
        assert_eq!(tag(&a, &cid), tag(&b, &cid));
        assert_ne!(
            tag(&a, &cid),
            tag(&ResetSecret::from_node_key(&other), &cid)
        );
        // Not the private key itself, and not hidden in what Debug shows.
        assert_ne!(a.0, node.to_bytes());
        assert_eq!(format!("{a:?}"), "ResetSecret(..)");
    }
}
