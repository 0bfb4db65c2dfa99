//! Why a connection ended, split by whose fault it was.
//!
//! A peer that breaks the protocol ([`PeerMisbehaved`]) is worth an operator's attention in
//! aggregate (a scanner, a buggy client, an attack); a local failure ([`LocalError`]: socket
//! errors, timeouts) is the normal weather of the internet. Both are logged at debug level
//! only, since peers control how often they happen, and counted by class in
//! `derp_connection_errors{class,reason}`.

use std::io;

use derp_proto::{DecodeError, HandshakeError, ws::WsError};

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error("peer misbehaved: {0}")]
    Peer(#[from] PeerMisbehaved),
    #[error("{0}")]
    Local(#[from] LocalError),
}

/// The peer broke the protocol.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerMisbehaved {
    #[error("malformed frame: {0}")]
    MalformedFrame(#[from] DecodeError),
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    #[error("websocket: {0}")]
    WebSocket(#[from] WsError),
    #[error("frame type {0:#04x} requires mesh privileges")]
    NotMeshPeer(u8),
    #[error("frame {0:?} where ClientInfo was expected")]
    UnexpectedFrame(Option<derp_proto::FrameType>),
    #[error("DERP over QUIC stream did not start with the preamble")]
    Preamble,
}

/// Something failed on this side of the connection, or under it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LocalError {
    /// A socket error, including the peer hanging up in the middle of the handshake.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// Still unproven when newer connections needed its place in the budget.
    #[error("evicted from the unproven-connection budget")]
    Evicted,
    /// Writing to the client failed, or missed the write deadline, and ended the connection.
    #[error("write to the client {}", if *timed_out { "timed out" } else { "failed" })]
    Write { timed_out: bool },
}

impl ConnError {
    /// The `class` and `reason` labels this error is counted under.
    pub(crate) fn labels(&self) -> [&'static str; 2] {
        match self {
            Self::Peer(p) => [
                "peer_misbehaved",
                match p {
                    PeerMisbehaved::MalformedFrame(_) => "malformed_frame",
                    // Counted apart: a low-order key is an attack, not a broken client.
                    PeerMisbehaved::Handshake(HandshakeError::LowOrderKey) => "low_order_key",
                    PeerMisbehaved::Handshake(_) => "handshake",
                    PeerMisbehaved::WebSocket(_) => "websocket",
                    PeerMisbehaved::NotMeshPeer(_) => "not_mesh_peer",
                    PeerMisbehaved::UnexpectedFrame(_) => "malformed_frame",
                    PeerMisbehaved::Preamble => "handshake",
                },
            ],
            Self::Local(l) => [
                "local",
                match l {
                    LocalError::Io(_) => "io",
                    LocalError::HandshakeTimeout => "timeout",
                    LocalError::Evicted => "evicted",
                    LocalError::Write { timed_out: true } => "write_timeout",
                    LocalError::Write { timed_out: false } => "write",
                },
            ],
        }
    }
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> Self {
        Self::Local(LocalError::Io(e))
    }
}

impl From<DecodeError> for ConnError {
    fn from(e: DecodeError) -> Self {
        Self::Peer(e.into())
    }
}

impl From<HandshakeError> for ConnError {
    fn from(e: HandshakeError) -> Self {
        Self::Peer(e.into())
    }
}

impl From<WsError> for ConnError {
    fn from(e: WsError) -> Self {
        Self::Peer(e.into())
    }
}
