//! Routing a client's packets: each to its destination's queue, to the mesh peer that has
//! the destination, or dropped and counted, with PeerGone(NotHere) for a disco packet to a
//! key nobody has. What one batch of packets is routed with (the lookup guard, the clock,
//! the counts, the writers taken along) is a [`BatchContext`], one per batch on a thread.
//!
//! The read loop routes its stream frames and (under a rate limit) its QUIC datagrams
//! through here; the QUIC driver routes registered clients' datagrams through here too,
//! without the read loop.

use std::sync::Arc;

use bytes::Bytes;
use derp_proto::{PeerGoneReason, PublicKey};
use tokio::time::Instant;

use crate::handle::ConnHandle;
use crate::lookup::{Route, Router};
use crate::metrics::{DropReason, PacketKind, ReaderCounts};
use crate::queue::{Control, Inline, Packet};
use crate::state::ServerState;

/// Where a packet entered this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// SendPacket from a client connected here.
    Client,
    /// ForwardPacket from a mesh peer.
    Mesh,
}

/// Token bucket limiting PeerGone(NotHere) replies to one per second, burst three.
#[derive(Debug)]
pub(crate) struct NotHereLimiter {
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

/// What routing a client's packets borrows from its connection: the connection, its lookup
/// cache and its PeerGone(NotHere) limiter. The read loop routes through it, and for QUIC
/// datagrams so does the endpoint's driver ([`route_datagrams`]).
pub(crate) struct Routing<'r, 'a> {
    pub(crate) shared: &'r ServerState,
    pub(crate) handle: &'r Arc<ConnHandle>,
    pub(crate) router: &'r mut Router<'a>,
    pub(crate) not_here: &'r mut Option<Box<NotHereLimiter>>,
}

impl Routing<'_, '_> {
    /// One QUIC datagram: a SendPacket frame, or garbage to count.
    pub(crate) fn datagram(&mut self, cx: &mut BatchContext<'_>, datagram: &Bytes) {
        cx.counts.frames += 1;
        if self.handle.is_dup() {
            self.shared.registry.note_activity(self.handle);
        }
        match derp_proto::decode_send_packet_datagram(datagram) {
            Some((dst, packet)) => {
                cx.counts.datagrams_in += 1;
                self.client_packet(cx, dst, packet);
            }
            None => cx.counts.garbage_datagrams += 1,
        }
    }

    /// A packet the client sent, on the stream or in a datagram.
    pub(crate) fn client_packet(
        &mut self,
        cx: &mut BatchContext<'_>,
        dst: PublicKey,
        packet: Bytes,
    ) {
        let kind = PacketKind::of(&packet);
        let counts = &mut *cx.counts;
        counts.packets_received += 1;
        counts.bytes_received += packet.len() as u64;
        counts.packets_received_kind[kind as usize] += 1;
        let src = self.handle.key;
        self.route(cx, Origin::Client, src, dst, packet, kind);
    }

    /// Hands one packet to where its destination is: a local connection's queue, or (for a
    /// packet from a client) the mesh peer that has it. Packets that came from a mesh peer
    /// are delivered locally or dropped: forwarding is exactly one hop. A disco packet for a
    /// destination nobody has is answered with PeerGone(NotHere).
    pub(crate) fn route(
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
}

/// Routes QUIC datagrams a client sent, outside its read loop: the endpoint's driver does
/// this for connections without a receive rate limit, so that a datagram is relayed on the
/// task that received it. Writers of idle destinations are taken along and written here,
/// as a read loop's batch does.
pub(crate) fn route_datagrams(routing: &mut Routing<'_, '_>, datagrams: &mut Vec<Bytes>) {
    with_batch(routing.shared, |cx| {
        for datagram in datagrams.drain(..) {
            routing.datagram(cx, &datagram);
        }
        let misses = std::mem::take(&mut routing.router.misses);
        cx.counts.mirror_misses += misses.mirror;
        cx.counts.cache_misses += misses.cache;
    });
}

/// Runs `work` with a batch context (the thread's counts and list of writers taken along,
/// a lookup guard, the batch's timestamp), then writes the writers taken along and folds
/// the counts into the metrics. Returns `work`'s result and whether a destination's queue
/// was full.
pub(crate) fn with_batch<R>(
    shared: &ServerState,
    work: impl FnOnce(&mut BatchContext<'_>) -> R,
) -> (R, bool) {
    BATCH.with_borrow_mut(|BatchScratch { counts, inline }| {
        // Flushed when dropped, on unwinding too: a writer taken along must never be
        // left behind in the thread's list.
        let inline = FlushOnDrop(inline);
        let mut cx = BatchContext {
            guard: shared.registry.mirror().guard(),
            now: Instant::now(),
            counts,
            inline: inline.0,
        };
        let result = work(&mut cx);
        drop(cx);
        drop(inline);
        let congested = counts.queue_drops() > 0;
        shared.fold(counts);
        (result, congested)
    })
}

/// What every frame of one read batch is handled with, passed by reference to each handler:
/// the lookup guard and the timestamp taken once for the batch, what the batch counts, and
/// the idle destinations' writers it takes along.
pub(crate) struct BatchContext<'b> {
    /// Pins the mirror's entries for the batch: a hit borrows its connection without moving
    /// a reference count.
    guard: papaya::LocalGuard<'b>,
    pub(crate) now: Instant,
    pub(crate) counts: &'b mut ReaderCounts,
    pub(crate) inline: &'b mut Inline,
}

/// What the batch being handled on a thread gathers (see [`with_batch`]).
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
