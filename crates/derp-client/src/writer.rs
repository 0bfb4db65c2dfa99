//! The sending half of a connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use derp_proto::frame::MAX_PACKET_SIZE;
use derp_proto::{ClientToRelay, PublicKey};
use tokio::time::Instant;

use crate::error::ClientError;
use crate::path::QuicPath;
use crate::ping::{PendingPing, PingTracker};
use crate::transport::FrameWriter;

/// The sending half of a connection, from [`Client::split`](crate::Client::split).
///
/// Frames are encoded into one reusable buffer. The `queue_*` methods only buffer;
/// [`flush`](Self::flush) writes everything queued with as few writes as the socket allows.
/// The other sending methods queue and flush in one call. Nothing is written until a flush, so
/// callers that queue must flush.
///
/// A write error is sticky: the stream position is unknown afterwards, so every later call
/// fails with the same error.
#[derive(Debug)]
pub struct ClientWriter {
    frames: FrameWriter,
    pings: Arc<PingTracker>,
    server_key: PublicKey,
    local_addr: Option<SocketAddr>,
    quic: Option<QuicPath>,
}

impl ClientWriter {
    pub(crate) fn new(
        frames: FrameWriter,
        pings: Arc<PingTracker>,
        server_key: PublicKey,
        local_addr: Option<SocketAddr>,
        quic: Option<QuicPath>,
    ) -> Self {
        Self {
            frames,
            pings,
            server_key,
            local_addr,
            quic,
        }
    }

    /// The QUIC path, for a client connected over QUIC.
    pub fn quic_path(&self) -> Option<&QuicPath> {
        self.quic.as_ref()
    }

    /// The server's public key.
    pub fn server_key(&self) -> PublicKey {
        self.server_key
    }

    /// The local socket address, or `None` over a caller-supplied stream.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// Queues a packet for `dst` without writing it.
    ///
    /// Packets over 64 KiB are refused with [`ClientError::PacketTooLarge`], as the Go client
    /// does; the connection stays usable.
    pub fn queue_packet(
        &mut self,
        dst: PublicKey,
        packet: impl AsRef<[u8]>,
    ) -> Result<(), ClientError> {
        let packet = packet.as_ref();
        check_packet_len(packet.len())?;
        self.frames.queue_send_packet(&dst, packet)
    }

    /// Queues any client frame without writing it. Packet size limits apply as in
    /// [`queue_packet`](Self::queue_packet); `ClientToRelay::Unknown` queues nothing.
    pub fn queue_frame(&mut self, frame: &ClientToRelay) -> Result<(), ClientError> {
        match frame {
            ClientToRelay::SendPacket { packet, .. }
            | ClientToRelay::ForwardPacket { packet, .. } => check_packet_len(packet.len())?,
            _ => {}
        }
        self.frames.queue_frame(frame)
    }

    /// Writes every queued frame.
    ///
    /// Cancel safe: if the future is dropped, bytes not yet written stay queued for the next
    /// flush.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        self.frames.flush().await
    }

    /// Bytes queued and not yet written.
    pub fn buffered_len(&self) -> usize {
        self.frames.buffered_len()
    }

    /// Sends a packet to `dst` (queue plus flush). Packets over 64 KiB are refused.
    pub async fn send_packet(
        &mut self,
        dst: PublicKey,
        packet: impl AsRef<[u8]>,
    ) -> Result<(), ClientError> {
        self.queue_packet(dst, packet)?;
        self.flush().await
    }

    /// Tells the server whether this is the client's home (preferred) DERP server.
    pub async fn note_preferred(&mut self, preferred: bool) -> Result<(), ClientError> {
        self.send(&ClientToRelay::NotePreferred(preferred)).await
    }

    /// Subscribes to PeerPresent/PeerGone for every client of the server (mesh peers only; the
    /// server closes the connection of anyone else).
    pub async fn watch_conns(&mut self) -> Result<(), ClientError> {
        self.send(&ClientToRelay::WatchConns).await
    }

    /// Asks the server to close every connection of `peer` (mesh peers only).
    pub async fn close_peer(&mut self, peer: PublicKey) -> Result<(), ClientError> {
        self.send(&ClientToRelay::ClosePeer(peer)).await
    }

    /// Forwards a packet from `src` (on another server of the mesh) to `dst` on this server
    /// (mesh peers only). Packets over 64 KiB are refused.
    pub async fn forward_packet(
        &mut self,
        src: PublicKey,
        dst: PublicKey,
        packet: Bytes,
    ) -> Result<(), ClientError> {
        self.send(&ClientToRelay::ForwardPacket { src, dst, packet })
            .await
    }

    /// Answers a server ping ([`ReceivedFrame::Ping`](crate::ReceivedFrame::Ping)).
    pub async fn send_pong(&mut self, data: [u8; 8]) -> Result<(), ClientError> {
        self.send(&ClientToRelay::Pong(data)).await
    }

    /// Sends a ping with the given data without tracking it; its pong is surfaced by the
    /// reader as [`ReceivedFrame::Pong`](crate::ReceivedFrame::Pong).
    pub async fn send_ping(&mut self, data: [u8; 8]) -> Result<(), ClientError> {
        self.send(&ClientToRelay::Ping(data)).await
    }

    /// Sends a ping with 8 random bytes and returns a handle to await its pong, so the writer
    /// stays free for sending while the pong travels.
    pub async fn start_ping(&mut self) -> Result<PendingPing, ClientError> {
        let data: [u8; 8] = rand::random();
        let rx = self.pings.register(data).ok_or(ClientError::Closed)?;
        // Created before the send so that an error below unregisters the ping on drop.
        let pending = PendingPing::new(data, Instant::now(), rx, self.pings.clone());
        self.send(&ClientToRelay::Ping(data)).await?;
        Ok(pending)
    }

    /// Pings the server and waits up to 5 s for the pong; returns the round-trip time.
    ///
    /// The pong is recognised by the [`ClientReader`](crate::ClientReader), so another task
    /// must be calling its `recv` meanwhile. Without a split, use
    /// [`Client::ping`](crate::Client::ping), which drives the reader itself.
    pub async fn ping(&mut self) -> Result<Duration, ClientError> {
        self.start_ping().await?.wait().await
    }

    /// Flushes queued frames and closes the sending side (with a WebSocket close frame when
    /// running over WebSocket). The server then ends the connection.
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.frames.close().await
    }

    async fn send(&mut self, frame: &ClientToRelay) -> Result<(), ClientError> {
        self.queue_frame(frame)?;
        self.flush().await
    }
}

fn check_packet_len(len: usize) -> Result<(), ClientError> {
    if len > MAX_PACKET_SIZE {
        return Err(ClientError::PacketTooLarge { len });
    }
    Ok(())
}
