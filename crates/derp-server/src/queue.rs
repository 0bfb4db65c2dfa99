//! A connection's outbound side as other connections see it: its bounded send queues.
//! (The connection's identity and flags are in [`crate::handle`].)
//!
//! Senders run on other connections' read loops and must never block on a slow receiver, so
//! an enqueue is a short critical section that either appends or drops. The receiver's writer
//! takes everything queued in one swap and writes it as one batch.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;

use bytes::Bytes;
use derp_proto::{PeerGoneReason, PublicKey};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::metrics::{DropReason, PacketKind, ReaderCounts};

/// A packet waiting to be written to its destination.
#[derive(Debug)]
pub(crate) struct Packet {
    pub(crate) src: PublicKey,
    pub(crate) data: Bytes,
    pub(crate) enqueued: Instant,
    /// It came from a mesh peer (ForwardPacket): its source is on a sibling node, whose
    /// PeerPresent may not have reached this node yet.
    pub(crate) forwarded: bool,
}

/// Frames other than packets that a writer sends on another task's behalf.
#[derive(Clone, Debug)]
pub(crate) enum Control {
    PeerGone(PublicKey, PeerGoneReason),
    PeerPresent {
        peer: PublicKey,
        addr: SocketAddr,
        flags: u8,
    },
    /// A WebSocket pong answering a client's ping.
    WsPong(Bytes),
    /// The periodic keepalive, timed by the read loop so a parked writer needs no timer.
    KeepAlive,
    /// The server is shutting down: reconnect after this many milliseconds, keep trying
    /// for that many.
    Restarting {
        reconnect_in_ms: u32,
        try_for_ms: u32,
    },
    /// DERP over QUIC: the client's validated UDP address.
    ObservedAddr(SocketAddr),
}

/// A writer parked while its connection has nothing to write. Enqueuing work resumes it.
pub(crate) trait Resume: Send + std::fmt::Debug {
    /// Starts the writer again (spawns its task).
    fn resume(self: Box<Self>);
}

/// What the writer takes in one swap.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    pub(crate) disco: VecDeque<Packet>,
    pub(crate) other: VecDeque<Packet>,
    pub(crate) control: VecDeque<Control>,
    pub(crate) pong: Option<[u8; 8]>,
}

impl Batch {
    pub(crate) fn is_empty(&self) -> bool {
        self.disco.is_empty()
            && self.other.is_empty()
            && self.control.is_empty()
            && self.pong.is_none()
    }
}

#[derive(Debug, Default)]
struct State {
    pending: Batch,
    closed: bool,
    /// The connection's writer while it has no task (nothing to write).
    parked: Option<Box<dyn Resume>>,
    /// Set when the writer has been woken and has not yet taken the batch; senders skip the
    /// wake-up then, so a burst costs one notification rather than one per packet.
    woken: bool,
    /// The writer holds a batch it has not finished writing.
    writing: bool,
}

/// A connection's outbound queues: two bounded packet queues (disco and other), control
/// frames, the pending pong, and the parked writer.
#[derive(Debug)]
pub(crate) struct SendQueue {
    depth: usize,
    state: Mutex<State>,
    notify: Notify,
}

impl SendQueue {
    /// Queues of `depth` packets each (at least one).
    pub(crate) fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            state: Mutex::new(State::default()),
            notify: Notify::new(),
        }
    }

    /// Queues a packet, dropping by the reference's policy when full: up to three times the
    /// oldest packet is dropped to make room, then the new one is. Drops are counted into
    /// the sender's local `counts`.
    pub(crate) fn push_packet(
        &self,
        src: PublicKey,
        data: Bytes,
        kind: PacketKind,
        forwarded: bool,
        now: Instant,
        counts: &mut ReaderCounts,
    ) {
        let len = data.len();
        let mut state = self.lock();
        if state.closed {
            counts.drop(DropReason::GoneDisconnected, kind, len);
            return;
        }
        let queue = match kind {
            PacketKind::Disco => &mut state.pending.disco,
            PacketKind::Other => &mut state.pending.other,
        };
        let mut packet = Some(Packet {
            src,
            data,
            enqueued: now,
            forwarded,
        });
        for _ in 0..3 {
            if queue.len() < self.depth {
                if let Some(p) = packet.take() {
                    queue.push_back(p);
                }
                break;
            }
            if let Some(old) = queue.pop_front() {
                counts.drop(DropReason::QueueHead, kind, old.data.len());
            }
        }
        if packet.is_some() {
            counts.drop(DropReason::QueueTail, kind, len);
            return;
        }
        self.wake(state);
    }

    /// Queues a control frame. These are rare and bounded by their producers (rate-limited
    /// NotHere replies, one PeerGone per departed peer), so they are never dropped, with two
    /// exceptions: a WebSocket pong or a keepalive replaces one still pending, so a client
    /// that pings without reading (or a stalled one) cannot grow the queue.
    pub(crate) fn push_control(&self, control: Control) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        let queue = &mut state.pending.control;
        if matches!(control, Control::WsPong(_) | Control::KeepAlive)
            && let Some(pending) = queue
                .iter_mut()
                .find(|c| std::mem::discriminant(*c) == std::mem::discriminant(&control))
        {
            *pending = control;
            return;
        }
        queue.push_back(control);
        self.wake(state);
    }

    /// Offers a pong; ignored while one is already pending ("pinging too fast").
    pub(crate) fn push_pong(&self, data: [u8; 8]) {
        let mut state = self.lock();
        if state.closed || state.pending.pong.is_some() {
            return;
        }
        state.pending.pong = Some(data);
        self.wake(state);
    }

    /// Swaps everything pending into `batch` (which must be empty). Returns false once the
    /// queue is closed and nothing more will come.
    pub(crate) fn take(&self, batch: &mut Batch) -> bool {
        let mut state = self.lock();
        state.woken = false;
        std::mem::swap(&mut state.pending, batch);
        // The writer takes again once it has written a batch, so an empty take means the
        // previous batch is out.
        state.writing = !batch.is_empty();
        !state.closed
    }

    /// Nothing is queued and the writer is not in the middle of a batch: everything queued
    /// so far has been handed to the socket (or the queue is closed).
    pub(crate) fn is_drained(&self) -> bool {
        let state = self.lock();
        state.closed || (state.pending.is_empty() && !state.writing)
    }

    /// Like [`SendQueue::take`], but leaves the packets queued: only control frames and the
    /// pending pong are taken. For a QUIC connection whose client address is not validated
    /// yet, whose packets must wait (see `quic::gate`).
    pub(crate) fn take_control(&self, batch: &mut Batch) -> bool {
        let mut state = self.lock();
        state.woken = false;
        std::mem::swap(&mut state.pending.control, &mut batch.control);
        batch.pong = state.pending.pong.take();
        state.writing = !batch.is_empty();
        !state.closed
    }

    /// Marks the queue closed: later pushes are dropped as `gone_disconnected`. Returns what
    /// is still queued, so the caller can count it, and the parked writer, if any, which the
    /// caller must resume so it can close the socket.
    pub(crate) fn close(&self) -> (Batch, Option<Box<dyn Resume>>) {
        let mut state = self.lock();
        state.closed = true;
        state.writing = false;
        let rest = std::mem::take(&mut state.pending);
        let parked = state.parked.take();
        drop(state);
        self.notify.notify_one();
        (rest, parked)
    }

    /// Parks an idle writer in the queue, unless work is pending or the queue is closed, in
    /// which case the writer is handed back to keep running. Checked and stored under the
    /// queue lock, so no enqueue can slip between the check and the park.
    pub(crate) fn park<W: Resume + 'static>(&self, writer: Box<W>) -> Result<(), Box<W>> {
        let mut state = self.lock();
        if state.closed || !state.pending.is_empty() {
            return Err(writer);
        }
        state.parked = Some(writer);
        Ok(())
    }

    /// Waits until something is queued (or the queue closes).
    pub(crate) async fn wait(&self) {
        self.notify.notified().await;
    }

    fn wake(&self, mut state: std::sync::MutexGuard<'_, State>) {
        if let Some(writer) = state.parked.take() {
            drop(state);
            writer.resume();
            return;
        }
        if !state.woken {
            state.woken = true;
            drop(state);
            self.notify.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the queues inconsistent (every critical
        // section is a push, pop or swap), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(depth: usize) -> SendQueue {
        SendQueue::new(depth)
    }

    fn pkt(b: u8) -> Bytes {
        Bytes::from(vec![b; 10])
    }

    #[test]
    fn full_queue_drops_oldest_and_keeps_newest() {
        let h = handle(2);
        let mut counts = ReaderCounts::default();
        let now = Instant::now();
        let src = PublicKey::from_bytes([9; 32]);
        for b in 0..5 {
            h.push_packet(src, pkt(b), PacketKind::Other, false, now, &mut counts);
        }
        let mut batch = Batch::default();
        assert!(h.take(&mut batch));
        let kept: Vec<u8> = batch.other.iter().map(|p| p.data[0]).collect();
        assert_eq!(kept, vec![3, 4]);
        assert_eq!(
            counts.dropped[DropReason::QueueHead as usize][PacketKind::Other as usize],
            3
        );
        assert_eq!(
            counts.dropped_bytes[DropReason::QueueHead as usize][PacketKind::Other as usize],
            30
        );
    }

    #[test]
    fn disco_and_other_queues_do_not_crowd_each_other_out() {
        let h = handle(1);
        let mut counts = ReaderCounts::default();
        let now = Instant::now();
        let src = PublicKey::from_bytes([9; 32]);
        h.push_packet(src, pkt(1), PacketKind::Disco, false, now, &mut counts);
        h.push_packet(src, pkt(2), PacketKind::Other, false, now, &mut counts);
        let mut batch = Batch::default();
        h.take(&mut batch);
        assert_eq!(batch.disco.len(), 1);
        assert_eq!(batch.other.len(), 1);
        assert_eq!(counts.dropped, [[0; 2]; 7]);
    }

    #[test]
    fn closed_connection_drops_as_gone() {
        let h = handle(4);
        let mut counts = ReaderCounts::default();
        let src = PublicKey::from_bytes([9; 32]);
        h.push_packet(
            src,
            pkt(1),
            PacketKind::Other,
            false,
            Instant::now(),
            &mut counts,
        );
        let (rest, parked) = h.close();
        assert!(parked.is_none());
        assert_eq!(rest.other.len(), 1);
        h.push_packet(
            src,
            pkt(2),
            PacketKind::Other,
            false,
            Instant::now(),
            &mut counts,
        );
        assert_eq!(
            counts.dropped[DropReason::GoneDisconnected as usize][PacketKind::Other as usize],
            1
        );
        let mut batch = Batch::default();
        assert!(!h.take(&mut batch));
        assert!(batch.is_empty());
    }

    #[test]
    fn websocket_pongs_do_not_pile_up() {
        let h = handle(4);
        for i in 0..100u8 {
            h.push_control(Control::WsPong(Bytes::from(vec![i])));
        }
        h.push_control(Control::PeerGone(
            PublicKey::from_bytes([3; 32]),
            PeerGoneReason::NotHere,
        ));
        let mut batch = Batch::default();
        h.take(&mut batch);
        assert_eq!(batch.control.len(), 2);
        assert!(matches!(&batch.control[0], Control::WsPong(b) if b[..] == [99]));
    }

    #[test]
    fn take_control_leaves_packets_queued() {
        let h = handle(4);
        let mut counts = ReaderCounts::default();
        let src = PublicKey::from_bytes([9; 32]);
        h.push_packet(
            src,
            pkt(1),
            PacketKind::Other,
            false,
            Instant::now(),
            &mut counts,
        );
        h.push_control(Control::KeepAlive);
        h.push_pong([3; 8]);
        let mut batch = Batch::default();
        assert!(h.take_control(&mut batch));
        assert_eq!(batch.control.len(), 1);
        assert_eq!(batch.pong, Some([3; 8]));
        assert!(batch.other.is_empty());
        let mut rest = Batch::default();
        h.take(&mut rest);
        assert_eq!(rest.other.len(), 1);
        assert!(rest.control.is_empty() && rest.pong.is_none());
    }

    #[test]
    fn second_pong_is_ignored_while_one_is_pending() {
        let h = handle(4);
        h.push_pong([1; 8]);
        h.push_pong([2; 8]);
        let mut batch = Batch::default();
        h.take(&mut batch);
        assert_eq!(batch.pong, Some([1; 8]));
    }
}
