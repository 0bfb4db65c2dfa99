//! The read loop's work on what it read: every complete frame in the buffer handled in one
//! batch, with one batch context (the lookup guard, the clock, the counts, the writers taken
//! along) handed to each handler, and each packet routed to its destination's queue (or a
//! mesh peer's) as a `Bytes` slice of the read buffer.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use derp_proto::frame::FrameType;
use derp_proto::{ClientToRelay, PeerGoneReason, PublicKey};
use tokio::time::Instant;
use tracing::{debug, trace};

use super::ReadLoop;
use crate::conn::{ConnError, PeerMisbehaved};
use crate::lookup::Route;
use crate::metrics::{DropReason, PacketKind, ReaderCounts};
use crate::queue::{Control, Inline, Packet};

/// Where a packet entered this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// SendPacket from a client connected here.
    Client,
    /// ForwardPacket from a mesh peer.
    Mesh,
}

/// Token bucket limiting PeerGone(NotHere) replies to one per second, burst three.
#[derive(Debug)]
pub(super) struct NotHereLimiter {
    tokens: f64,
    last: Instant,
}

impl NotHereLimiter {
    fn new(now: Instant) -> Self {
        Self {
            tokens: NOT_HERE_BURST,
            last: now,
        }
    }

    fn allow(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * NOT_HERE_PER_SEC).min(NOT_HERE_BURST);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl ReadLoop<'_> {
    /// Handles every complete frame in the buffer, or as many as the rate limit allows, then
    /// has the idle destinations it queued packets for write them at once, and folds what it
    /// counted into the metrics. Returns whether a destination's queue was full.
    ///
    /// The batch's counts and the writers it takes along live in the worker thread, not in
    /// the connection: they exist only while a batch is handled (this is synchronous, so no
    /// other connection's batch runs on the thread meanwhile), and an idle connection should
    /// not carry them.
    pub(super) fn process_buffered(&mut self) -> Result<bool, ConnError> {
        BATCH.with_borrow_mut(|BatchScratch { counts, inline }| {
            // Flushed when dropped, on unwinding too: a writer taken along must never be
            // left behind in the thread's list.
            let inline = FlushOnDrop(inline);
            let mut cx = BatchContext {
                guard: self.shared.registry.mirror().guard(),
                now: Instant::now(),
                counts,
                inline: inline.0,
            };
            let result = self.process_frames(&mut cx);
            drop(cx);
            drop(inline);
            let congested = counts.queue_drops() > 0;
            self.shared.fold(counts);
            result.map(|()| congested)
        })
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
            if self.handle.is_dup.load(Ordering::Relaxed) {
                self.shared.registry.note_activity(self.handle);
            }
            match frame {
                ClientToRelay::SendPacket { dst, packet } => {
                    let packet = self.own_payload(packet);
                    self.client_packet(cx, dst, packet);
                }
                ClientToRelay::ForwardPacket { src, dst, packet } => {
                    self.require_mesh(FrameType::ForwardPacket)?;
                    let packet = self.own_payload(packet);
                    let kind = PacketKind::of(&packet);
                    cx.counts.forwarded_in += 1;
                    self.route(cx, Origin::Mesh, src, dst, packet, kind);
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

    /// A packet the client sent, on the stream or in a datagram.
    fn client_packet(&mut self, cx: &mut BatchContext<'_>, dst: PublicKey, packet: Bytes) {
        let kind = PacketKind::of(&packet);
        let counts = &mut *cx.counts;
        counts.packets_received += 1;
        counts.bytes_received += packet.len() as u64;
        counts.packets_received_kind[kind as usize] += 1;
        let src = self.handle.key;
        self.route(cx, Origin::Client, src, dst, packet, kind);
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
            cx.counts.frames += 1;
            if self.handle.is_dup.load(Ordering::Relaxed) {
                self.shared.registry.note_activity(self.handle);
            }
            match derp_proto::decode_send_packet_datagram(&datagram) {
                Some((dst, packet)) => {
                    cx.counts.datagrams_in += 1;
                    self.client_packet(cx, dst, packet);
                }
                None => cx.counts.garbage_datagrams += 1,
            }
        }
        datagrams.drain(..handled);
    }

    /// Hands one packet to where its destination is: a local connection's queue, or (for a
    /// packet from a client) the mesh peer that has it. Packets that came from a mesh peer
    /// are delivered locally or dropped: forwarding is exactly one hop. A disco packet for a
    /// destination nobody has is answered with PeerGone(NotHere).
    fn route(
        &mut self,
        cx: &mut BatchContext<'_>,
        origin: Origin,
        src: PublicKey,
        dst: PublicKey,
        packet: Bytes,
        kind: PacketKind,
    ) {
        let BatchContext {
            guard,
            now,
            counts,
            inline,
        } = cx;
        let now = *now;
        let registry = &self.shared.registry;
        let len = packet.len();
        let missing = self.router.route_with(registry, guard, &dst, now, |route| {
            match (route, origin) {
                (Route::Local(conn), _) => conn.queue.push_packet(
                    Packet {
                        src,
                        data: packet,
                        enqueued: now,
                        forwarded: origin == Origin::Mesh,
                    },
                    kind,
                    counts,
                    inline,
                ),
                (Route::Forward(route), Origin::Client) => {
                    counts.forwarded_out += 1;
                    route.forwarder.forward_packet(src, dst, packet);
                }
                (Route::Dup, _) => counts.drop(DropReason::DupClient, kind, len),
                (Route::Missing, Origin::Client) => {
                    counts.drop(DropReason::UnknownDest, kind, len);
                    return true;
                }
                (Route::Forward(_) | Route::Missing, Origin::Mesh) => {
                    counts.drop(DropReason::UnknownDestOnFwd, kind, len);
                    return true;
                }
            }
            false
        });
        if missing {
            self.maybe_not_here(dst, kind, now);
        }
    }

    /// The payload as it will be queued: the slice itself, or a copy after a tiny read.
    fn own_payload(&self, packet: Bytes) -> Bytes {
        if self.copy_payloads {
            Bytes::copy_from_slice(&packet)
        } else {
            packet
        }
    }

    /// Answers a disco packet to an unknown key with PeerGone(NotHere), rate-limited.
    fn maybe_not_here(&mut self, dst: PublicKey, kind: PacketKind, now: Instant) {
        if kind != PacketKind::Disco {
            return;
        }
        // A bucket created now starts full, as one created on connecting would be by now.
        let limiter = self
            .not_here
            .get_or_insert_with(|| Box::new(NotHereLimiter::new(now)));
        if limiter.allow(now) {
            self.handle
                .queue
                .push_control(Control::PeerGone(dst, PeerGoneReason::NotHere));
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
        let was = self.handle.preferred.swap(preferred, Ordering::Relaxed);
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

/// What every frame of one read batch is handled with, passed by reference to each handler:
/// the lookup guard and the timestamp taken once for the batch, what the batch counts, and
/// the idle destinations' writers it takes along.
struct BatchContext<'b> {
    /// Pins the mirror's entries for the batch: a hit borrows its connection without moving
    /// a reference count.
    guard: papaya::LocalGuard<'b>,
    now: Instant,
    counts: &'b mut ReaderCounts,
    inline: &'b mut Inline,
}

/// What the batch being handled on a thread gathers (see `ReadLoop::process_buffered`).
#[derive(Default)]
struct BatchScratch {
    /// What the batch counted; folded into the metrics at its end.
    counts: ReaderCounts,
    /// Idle destinations' writers taken along, to write inline at the batch's end. Kept
    /// here, emptied after every batch, so its vector is allocated once per thread.
    inline: Inline,
}

/// Flushes the writers taken along when dropped.
struct FlushOnDrop<'a>(&'a mut Inline);

impl Drop for FlushOnDrop<'_> {
    fn drop(&mut self) {
        self.0.flush();
    }
}

thread_local! {
    static BATCH: std::cell::RefCell<BatchScratch> =
        std::cell::RefCell::new(BatchScratch::default());
}

const NOT_HERE_PER_SEC: f64 = 1.0;
const NOT_HERE_BURST: f64 = 3.0;
/// NotePreferred flips within this long of connecting do not count as home moves.
const HOME_MOVE_GRACE: Duration = Duration::from_secs(5);
