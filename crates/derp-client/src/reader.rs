//! The receiving half of a connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use derp_proto::{PeerGoneReason, PublicKey, RelayToClient, SecretKey, ServerInfo};

use crate::error::ClientError;
use crate::path::QuicPath;
use crate::ping::PingTracker;
use crate::transport::FrameReader;

/// A frame from the server, as [`ClientReader::recv`] hands it out.
///
/// ServerKey frames after the handshake and frames of unknown type are skipped, and so are pongs
/// that answer this client's own [`ping`](crate::Client::ping).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceivedFrame {
    /// A packet relayed from `src`. `packet` is a slice of the read buffer (no copy).
    RecvPacket {
        /// The sender's public key.
        src: PublicKey,
        /// The packet bytes.
        packet: Bytes,
    },
    /// `peer`, which this client sent to (or, for mesh watchers, which was present), is gone.
    PeerGone {
        /// The peer that left.
        peer: PublicKey,
        /// Why: disconnected, or never here.
        reason: PeerGoneReason,
    },
    /// A client connected to the server (only for mesh watchers after `watch_conns`).
    PeerPresent {
        /// The client's key.
        peer: PublicKey,
        /// Its remote address as the server saw it (`[::]:0` if unknown).
        addr: SocketAddr,
        /// `PEER_PRESENT_*` flags from `derp_proto::frame`.
        flags: u8,
    },
    /// Keepalive from the server (about every 60 s); needs no answer.
    KeepAlive,
    /// The server asks for a pong with the same data ([`ClientWriter::send_pong`](crate::ClientWriter::send_pong)).
    Ping([u8; 8]),
    /// A pong that matches none of this client's outstanding pings.
    Pong([u8; 8]),
    /// The server's health problem, or healthy again when `problem` is empty.
    Health {
        /// Problem text; empty means the problem cleared.
        problem: String,
    },
    /// The server is restarting: reconnect after `reconnect_in`, keep trying for `try_for`.
    Restarting {
        /// How long to wait before reconnecting.
        reconnect_in: Duration,
        /// How long to keep trying.
        try_for: Duration,
    },
    /// A further ServerInfo (the handshake's is in [`ClientReader::server_info`]).
    ServerInfo(ServerInfo),
    /// DERP over QUIC only: this client's UDP address as the server sees it, right after
    /// the handshake and again after each migration the server has validated. Use it as
    /// STUN's answer.
    ObservedAddr(SocketAddr),
}

/// The receiving half of a connection, from [`Client::split`](crate::Client::split).
///
/// It must be driven (by calling [`recv`](Self::recv) in a loop) for pings sent through the
/// [`ClientWriter`](crate::ClientWriter) to complete.
#[derive(Debug)]
pub struct ClientReader {
    frames: FrameReader,
    /// Frames read while [`Client::ping`](crate::Client::ping) waited for its pong.
    pending: VecDeque<ReceivedFrame>,
    sticky: Option<ClientError>,
    pings: Arc<PingTracker>,
    secret: SecretKey,
    server_key: PublicKey,
    server_info: ServerInfo,
    local_addr: Option<SocketAddr>,
    quic: Option<QuicPath>,
}

impl ClientReader {
    pub(crate) fn new(
        frames: FrameReader,
        pings: Arc<PingTracker>,
        secret: SecretKey,
        server_key: PublicKey,
        server_info: ServerInfo,
        local_addr: Option<SocketAddr>,
        quic: Option<QuicPath>,
    ) -> Self {
        Self {
            frames,
            pending: VecDeque::new(),
            sticky: None,
            pings,
            secret,
            server_key,
            server_info,
            local_addr,
            quic,
        }
    }

    /// The QUIC path, for a client connected over QUIC.
    pub fn quic_path(&self) -> Option<&QuicPath> {
        self.quic.as_ref()
    }

    /// Receives the next frame.
    ///
    /// Errors are sticky: once one is returned the connection is dead and every later call
    /// returns it again; reconnect with [`Client::connect`](crate::Client::connect). Cancel
    /// safe: a `recv` dropped before it completes loses no data.
    pub async fn recv(&mut self) -> Result<ReceivedFrame, ClientError> {
        if let Some(frame) = self.pending.pop_front() {
            return Ok(frame);
        }
        self.recv_direct().await
    }

    /// The server's public key.
    pub fn server_key(&self) -> PublicKey {
        self.server_key
    }

    /// The most recent ServerInfo (the handshake's, unless the server sent another).
    pub fn server_info(&self) -> ServerInfo {
        self.server_info
    }

    /// The local socket address (at connect time, for QUIC), or `None` over a
    /// caller-supplied stream.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// Receives from the socket, bypassing `pending`.
    pub(crate) async fn recv_direct(&mut self) -> Result<ReceivedFrame, ClientError> {
        if let Some(e) = &self.sticky {
            return Err(e.clone());
        }
        loop {
            let result = match self.frames.next_frame().await {
                Ok(frame) => self.convert(frame),
                Err(e) => Err(e),
            };
            match result {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => {
                    self.sticky = Some(e.clone());
                    self.pings.fail_all();
                    return Err(e);
                }
            }
        }
    }

    /// Queues a frame for the next [`recv`](Self::recv).
    pub(crate) fn push_pending(&mut self, frame: ReceivedFrame) {
        self.pending.push_back(frame);
    }

    /// Maps a wire frame to what the caller sees; `None` for frames handled or skipped here.
    fn convert(&mut self, frame: RelayToClient) -> Result<Option<ReceivedFrame>, ClientError> {
        Ok(Some(match frame {
            RelayToClient::RecvPacket { src, packet } => ReceivedFrame::RecvPacket { src, packet },
            RelayToClient::PeerGone { peer, reason } => ReceivedFrame::PeerGone { peer, reason },
            RelayToClient::PeerPresent { peer, addr, flags } => {
                ReceivedFrame::PeerPresent { peer, addr, flags }
            }
            RelayToClient::KeepAlive => ReceivedFrame::KeepAlive,
            RelayToClient::Ping(data) => ReceivedFrame::Ping(data),
            RelayToClient::Pong(data) => {
                if self.pings.complete(data) {
                    return Ok(None);
                }
                ReceivedFrame::Pong(data)
            }
            RelayToClient::Health(problem) => ReceivedFrame::Health { problem },
            RelayToClient::Restarting {
                reconnect_in_ms,
                try_for_ms,
            } => ReceivedFrame::Restarting {
                reconnect_in: Duration::from_millis(u64::from(reconnect_in_ms)),
                try_for: Duration::from_millis(u64::from(try_for_ms)),
            },
            RelayToClient::ServerInfo { sealed } => {
                let info = self
                    .secret
                    .open_from(&self.server_key, &sealed)
                    .ok()
                    .and_then(|json| ServerInfo::from_json(&json).ok())
                    .ok_or(ClientError::BadServerInfo)?;
                self.server_info = info;
                ReceivedFrame::ServerInfo(info)
            }
            RelayToClient::ObservedAddr(addr) => ReceivedFrame::ObservedAddr(addr),
            // A fast-start client never waited for ServerKey, so it arrives here; the Go client
            // skips it like any unknown frame.
            RelayToClient::ServerKey(_) | RelayToClient::Unknown { .. } => return Ok(None),
        }))
    }
}
