//! The read loop's work on what it read: every complete frame in the buffer handled in one
//! batch, with one batch context (`crate::route`) handed to each handler, and each packet
//! routed to its destination's queue (or a mesh peer's) as a `Bytes` slice of the read
//! buffer.

use std::time::Duration;

use bytes::Bytes;
use derp_proto::ClientToRelay;
use derp_proto::frame::FrameType;
use tokio::time::Instant;
use tracing::{debug, trace};

use super::ReadLoop;
use crate::conn::{ConnError, PeerMisbehaved};
use crate::metrics::PacketKind;
use crate::route::{BatchContext, Origin, Routing, with_batch};

impl<'a> ReadLoop<'a> {
    /// Handles every complete frame in the buffer, or as many as the rate limit allows, then
    /// has the idle destinations it queued packets for write them at once, and folds what it
    /// counted into the metrics. Returns whether a destination's queue was full.
    ///
    /// The batch's counts and the writers it takes along live in the worker thread, not in
    /// the connection: they exist only while a batch is handled (this is synchronous, so no
    /// other connection's batch runs on the thread meanwhile), and an idle connection should
    /// not carry them.
    pub(super) fn process_buffered(&mut self) -> Result<bool, ConnError> {
        let shared = self.shared;
        let (result, congested) = with_batch(shared, |cx| self.process_frames(cx));
        result.map(|()| congested)
    }

    /// Handles the frames. Synchronous: the lookup guard and the batch timestamp never cross
    /// an await.
    fn process_frames(&mut self, cx: &mut BatchContext<'_>) -> Result<(), ConnError> {
        let now = cx.now;
        if let Some(limiter) = &mut self.limiter {
            limiter.begin_batch(&self.shared.rate_limits, now);
        }
        let mut buffered = self.reader.buf.len();
        loop {
            if self.limiter.as_ref().is_some_and(|l| l.in_debt()) {
                break;
            }
            let frame = self.decoder.decode(&mut self.reader.buf)?;
            if let Some(limiter) = &mut self.limiter {
                // The bytes the frame took, header and any skipped body included.
                limiter.charge(buffered - self.reader.buf.len());
                buffered = self.reader.buf.len();
            }
            let Some(frame) = frame else { break };
            cx.counts.frames += 1;
            if self.handle.is_dup() {
                self.shared.registry.note_activity(self.handle);
            }
            match frame {
                ClientToRelay::SendPacket { dst, packet } => {
                    let packet = self.own_payload(packet);
                    self.routing().client_packet(cx, dst, packet);
                }
                ClientToRelay::ForwardPacket { src, dst, packet } => {
                    self.require_mesh(FrameType::ForwardPacket)?;
                    let packet = self.own_payload(packet);
                    let kind = PacketKind::of(&packet);
                    cx.counts.forwarded_in += 1;
                    self.routing()
                        .route(cx, Origin::Mesh, src, dst, packet, kind);
                }
                ClientToRelay::NotePreferred(preferred) => self.note_preferred(preferred, now),
                ClientToRelay::WatchConns => {
                    self.require_mesh(FrameType::WatchConns)?;
                    self.shared.registry.add_watcher(self.handle);
                }
                ClientToRelay::ClosePeer(key) => {
                    self.require_mesh(FrameType::ClosePeer)?;
                    if !self.shared.registry.close_peer(&key) {
                        debug!(peer = %key.short(), "close-peer for unknown key");
                    }
                }
                ClientToRelay::Ping(data) => {
                    cx.counts.got_ping += 1;
                    self.router.trim(now);
                    self.handle.queue.push_pong(data, cx.inline);
                }
                ClientToRelay::ClientInfo { .. }
                | ClientToRelay::Pong(_)
                | ClientToRelay::Unknown { .. } => {
                    trace!("skipping unhandled frame");
                    cx.counts.unknown_frames += 1;
                }
            }
        }
        if let Some(mut datagrams) = self.reader.take_datagrams() {
            self.handle_datagrams(cx, &mut datagrams);
            self.reader.keep_datagrams(datagrams);
        }
        let misses = std::mem::take(&mut self.router.misses);
        cx.counts.mirror_misses += misses.mirror;
        cx.counts.cache_misses += misses.cache;
        Ok(())
    }

    /// The parts of the loop that routing borrows.
    fn routing(&mut self) -> Routing<'_, 'a> {
        Routing {
            shared: self.shared,
            handle: self.handle,
            router: &mut self.router,
            not_here: &mut self.not_here,
        }
    }

    /// QUIC datagrams: each one SendPacket frame, routed like one from the stream. Anything
    /// else is dropped and counted; a datagram is never a reason to close the connection.
    /// Datagrams count against the receive rate limit like stream bytes: those left when the
    /// bucket runs into debt stay in `datagrams` for a later batch.
    fn handle_datagrams(&mut self, cx: &mut BatchContext<'_>, datagrams: &mut Vec<Bytes>) {
        let mut handled = 0;
        while handled < datagrams.len() {
            if self.limiter.as_ref().is_some_and(|l| l.in_debt()) {
                break;
            }
            let datagram = std::mem::take(&mut datagrams[handled]);
            handled += 1;
            if let Some(limiter) = &mut self.limiter {
                limiter.charge(datagram.len());
            }
            self.routing().datagram(cx, &datagram);
        }
        datagrams.drain(..handled);
    }

    /// The payload as it will be queued: the slice itself, or a copy after a tiny read.
    fn own_payload(&self, packet: Bytes) -> Bytes {
        if self.copy_payloads {
            Bytes::copy_from_slice(&packet)
        } else {
            packet
        }
    }

    fn require_mesh(&self, ty: FrameType) -> Result<(), ConnError> {
        if self.handle.can_mesh {
            Ok(())
        } else {
            Err(PeerMisbehaved::NotMeshPeer(ty as u8).into())
        }
    }

    fn note_preferred(&mut self, preferred: bool, now: Instant) {
        let was = self.handle.swap_preferred(preferred);
        if was == preferred {
            return;
        }
        let m = &self.shared.metrics;
        if preferred {
            m.current_home_connections.inc();
        } else {
            m.current_home_connections.dec();
        }
        // Flips right after connecting are a client announcing its state, not a move.
        if now.saturating_duration_since(self.connected_at) > HOME_MOVE_GRACE {
            if preferred {
                m.home_moves_in.inc();
            } else {
                m.home_moves_out.inc();
            }
        }
    }
}

/// NotePreferred flips within this long of connecting do not count as home moves.
const HOME_MOVE_GRACE: Duration = Duration::from_secs(5);
