//! A connection's outbound side as other connections see it: its bounded send queues.
//! (The connection's identity and flags are in [`crate::handle`].)
//!
//! Senders run on other connections' read loops and must never block on a slow receiver, so
//! an enqueue is a short critical section that either appends or drops. The receiver's writer
//! takes everything queued in one swap and writes it as one batch.
//!
//! An idle receiver's writer is parked here. A sender that finds it parked takes it along
//! ([`Inline`]) and, once it has handled its read batch, lets it try to write at once on the
//! sender's own task, without blocking: a lone packet then costs no task wake-up at all. Only
//! a write the socket cannot take right away starts the writer's own task.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

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
#[derive(Clone, Debug, PartialEq)]
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

    /// Whether [`Resume::write_inline`] can do its work without a task of its own.
    fn can_write_inline(&self) -> bool {
        false
    }

    /// Writes what is queued now, on the caller's task, without waiting: parks itself
    /// again when the socket took everything, and otherwise starts its task to finish
    /// (which then waits for the socket, under the write deadline).
    fn write_inline(self: Box<Self>) {
        self.resume();
    }

    /// Gives back what bursts grew its buffers to; called while it is parked.
    fn shrink_idle(&mut self) {}

    /// What a successor process needs to continue this writer, when it can: the bytes of a
    /// batch it has begun and not finished writing, and the sources it watches for PeerGone.
    /// Called while it is parked in a frozen queue.
    fn export(&self) -> Option<WriterExport> {
        None
    }

    /// Lets go of the connection without a word to the peer: no close frame, no TLS
    /// close_notify, no `shutdown(2)`. The socket lives on in the process it was handed to.
    fn forget(self: Box<Self>) {}
}

/// A parked writer's state as a successor process continues it.
#[derive(Debug, Default)]
pub(crate) struct WriterExport {
    /// Bytes of a batch already framed and partly written: they go out first, as they are.
    pub(crate) tail: Vec<u8>,
    /// Sources the connection has received from, to be told when they leave.
    pub(crate) sent_from: Vec<PublicKey>,
    /// The sending half of derpd's TLS 1.3 record layer, for a TLS connection.
    pub(crate) tls_tx: Option<derp_io::tls::TxSnapshot>,
}

/// A frozen queue's content and writer, copied for a successor process.
#[derive(Debug, Default)]
pub(crate) struct QueueExport {
    pub(crate) batch: Batch,
    pub(crate) writer: WriterExport,
}

/// Writers a sender took from their queues while handling one read batch, to be run with
/// [`Inline::flush`] once the batch is done (so several packets for one destination go out
/// in one write), or earlier when a destination's queue fills up. One per worker thread,
/// reused by every batch handled there, so it allocates once.
#[derive(Debug, Default)]
pub(crate) struct Inline {
    writers: Vec<Box<dyn Resume>>,
}

impl Inline {
    /// Lets every writer taken along write what is queued for it.
    pub(crate) fn flush(&mut self) {
        // One at a time rather than through a drain: should a write panic, the writers not
        // yet reached stay in the list for the next flush instead of being dropped with it.
        while let Some(writer) = self.writers.pop() {
            writer.write_inline();
        }
    }
}

impl Drop for Inline {
    fn drop(&mut self) {
        // A writer taken along must never be lost: its connection would never be written to
        // or closed.
        self.flush();
    }
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
    /// The packet queue for `kind`.
    fn queue(&self, kind: PacketKind) -> &VecDeque<Packet> {
        match kind {
            PacketKind::Disco => &self.disco,
            PacketKind::Other => &self.other,
        }
    }

    /// Gives back the memory a burst left in the (empty) queues, so an idle connection does
    /// not keep it; small queues are kept, so a steady trickle allocates nothing.
    pub(crate) fn shrink_idle(&mut self) {
        for queue in [&mut self.disco, &mut self.other] {
            if queue.is_empty() && queue.capacity() > IDLE_QUEUE_CAPACITY {
                *queue = VecDeque::new();
            }
        }
        if self.control.is_empty() && self.control.capacity() > IDLE_QUEUE_CAPACITY {
            self.control = VecDeque::new();
        }
    }

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
    writer: WriterState,
}

/// Where the connection's writer is, as its queue sees it.
#[derive(Debug)]
enum WriterState {
    /// Running, on its own task or taken along by a sender.
    Active {
        /// It holds a batch it has not finished writing.
        writing: bool,
        /// It has been woken and has not taken the batch since; senders skip the wake-up
        /// then, so a burst costs one notification rather than one per packet.
        woken: bool,
    },
    /// Parked here while the connection has nothing to write: the next sender takes it
    /// along or starts it.
    Parked(Box<dyn Resume>),
    /// The connection is closing: nothing more is queued and the writer is not parked again.
    Closed,
}

impl Default for WriterState {
    /// A new queue's writer is about to park, or to start if something is queued first.
    fn default() -> Self {
        Self::Active {
            writing: false,
            woken: false,
        }
    }
}

/// A connection's outbound queues: two bounded packet queues (disco and other), control
/// frames, the pending pong, and the parked writer.
#[derive(Debug)]
pub(crate) struct SendQueue {
    /// A `u32`, so that `frozen` takes no word of its own: every connection's handle holds
    /// this.
    depth: u32,
    /// The connection is being handed to another process: its writer parks with whatever
    /// it holds and nothing starts it until the queue is thawed (or forgotten). Changed
    /// only under the state's lock.
    frozen: AtomicBool,
    state: Mutex<State>,
    notify: Notify,
}

impl SendQueue {
    /// Queues of `depth` packets each (at least one).
    pub(crate) fn new(depth: usize) -> Self {
        Self {
            depth: u32::try_from(depth.max(1)).unwrap_or(u32::MAX),
            frozen: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            notify: Notify::new(),
        }
    }

    /// Queues a packet, dropping by the reference's policy when full: up to three times the
    /// oldest packet is dropped to make room, then the new one is. Drops are counted into
    /// the sender's local `counts`.
    pub(crate) fn push_packet(
        &self,
        packet: Packet,
        kind: PacketKind,
        counts: &mut ReaderCounts,
        inline: &mut Inline,
    ) {
        let len = packet.data.len();
        let enqueued = packet.enqueued;
        let mut state = self.lock();
        let depth = self.depth as usize;
        if state.pending.queue(kind).len() >= depth && !inline.writers.is_empty() {
            // Full within one read batch: a fast sender's read can carry more packets for
            // one destination than its queue holds. If this sender took the destination's
            // writer along, writing now makes room, so a receiver that keeps up never loses
            // packets to the depth limit; one that does not keeps its writer busy (not taken)
            // and the drop policy applies as before.
            drop(state);
            inline.flush();
            state = self.lock();
        }
        if matches!(state.writer, WriterState::Closed) {
            counts.drop(DropReason::GoneDisconnected, kind, len);
            return;
        }
        let queue = match kind {
            PacketKind::Disco => &mut state.pending.disco,
            PacketKind::Other => &mut state.pending.other,
        };
        let mut packet = Some(packet);
        for _ in 0..3 {
            if queue.len() < depth {
                if let Some(p) = packet.take() {
                    queue.push_back(p);
                }
                break;
            }
            if let Some(old) = queue.pop_front() {
                counts.drop(DropReason::QueueHead, kind, old.data.len());
                counts.head_dropped_after(enqueued.saturating_duration_since(old.enqueued));
            }
        }
        if packet.is_some() {
            counts.drop(DropReason::QueueTail, kind, len);
            return;
        }
        self.wake_inline(state, inline);
    }

    /// Queues a control frame. These are rare and bounded by their producers (rate-limited
    /// NotHere replies, one PeerGone per departed peer), so they are never dropped, with two
    /// exceptions: a WebSocket pong or a keepalive replaces one still pending, so a client
    /// that pings without reading (or a stalled one) cannot grow the queue.
    pub(crate) fn push_control(&self, control: Control) {
        let mut state = self.lock();
        if matches!(state.writer, WriterState::Closed) {
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
    pub(crate) fn push_pong(&self, data: [u8; 8], inline: &mut Inline) {
        let mut state = self.lock();
        if matches!(state.writer, WriterState::Closed) || state.pending.pong.is_some() {
            return;
        }
        state.pending.pong = Some(data);
        self.wake_inline(state, inline);
    }

    /// Swaps everything pending into `batch` (which must be empty). Returns false once the
    /// queue is closed and nothing more will come.
    pub(crate) fn take(&self, batch: &mut Batch) -> bool {
        let mut state = self.lock();
        std::mem::swap(&mut state.pending, batch);
        state.taken(batch)
    }

    /// Nothing is queued and the writer is not in the middle of a batch: everything queued
    /// so far has been handed to the socket (or the queue is closed).
    pub(crate) fn is_drained(&self) -> bool {
        let state = self.lock();
        match state.writer {
            WriterState::Closed => true,
            WriterState::Active { writing: true, .. } => false,
            WriterState::Active { writing: false, .. } | WriterState::Parked(_) => {
                state.pending.is_empty()
            }
        }
    }

    /// Like [`SendQueue::take`], but leaves the packets queued: only control frames and the
    /// pending pong are taken. For a QUIC connection whose client address is not validated
    /// yet, whose packets must wait (see `quic::gate`).
    pub(crate) fn take_control(&self, batch: &mut Batch) -> bool {
        let mut state = self.lock();
        std::mem::swap(&mut state.pending.control, &mut batch.control);
        batch.pong = state.pending.pong.take();
        state.taken(batch)
    }

    /// Marks the queue closed: later pushes are dropped as `gone_disconnected`. Returns what
    /// is still queued, so the caller can count it, and the parked writer, if any, which the
    /// caller must resume so it can close the socket.
    pub(crate) fn close(&self) -> (Batch, Option<Box<dyn Resume>>) {
        let mut state = self.lock();
        let parked = match std::mem::replace(&mut state.writer, WriterState::Closed) {
            WriterState::Parked(writer) => Some(writer),
            WriterState::Active { .. } | WriterState::Closed => None,
        };
        let rest = std::mem::take(&mut state.pending);
        drop(state);
        self.notify.notify_one();
        (rest, parked)
    }

    /// Parks an idle writer in the queue, unless work is pending or the queue is closed, in
    /// which case the writer is handed back to keep running. Checked and stored under the
    /// queue lock, so no enqueue can slip between the check and the park.
    pub(crate) fn park<W: Resume + 'static>(&self, writer: Box<W>) -> Result<(), Box<W>> {
        let mut state = self.lock();
        if matches!(state.writer, WriterState::Closed)
            || (!state.pending.is_empty() && !self.is_frozen())
        {
            return Err(writer);
        }
        // A writer parks only once what it took is out.
        state.writer = WriterState::Parked(writer);
        Ok(())
    }

    /// Parks a writer that stopped for a freeze, batch in hand; unless the queue was thawed
    /// meanwhile, in which case it is handed back to finish its batch.
    pub(crate) fn park_frozen<W: Resume + 'static>(&self, writer: Box<W>) -> Result<(), Box<W>> {
        let mut state = self.lock();
        if !self.is_frozen() || matches!(state.writer, WriterState::Closed) {
            return Err(writer);
        }
        state.writer = WriterState::Parked(writer);
        Ok(())
    }

    /// Gives back the memory bursts left in a parked writer and its empty queue. Called by
    /// the connection's read loop on its keepalive ticks, not on every park: a writer that
    /// parks between the batches of a busy stream keeps its buffers for the next one.
    pub(crate) fn shrink_if_parked(&self) {
        let mut state = self.lock();
        let state = &mut *state;
        if let WriterState::Parked(writer) = &mut state.writer
            && state.pending.is_empty()
        {
            state.pending.shrink_idle();
            writer.shrink_idle();
        }
    }

    /// Waits until something is queued (or the queue closes).
    pub(crate) async fn wait(&self) {
        self.notify.notified().await;
    }

    /// Like [`SendQueue::wake`], but a parked writer that can write inline is handed to the
    /// sender's `inline` list instead of being started as a task.
    fn wake_inline(&self, mut state: std::sync::MutexGuard<'_, State>, inline: &mut Inline) {
        if let WriterState::Parked(writer) = &state.writer
            && !self.is_frozen()
            && writer.can_write_inline()
            // Taken out under the lock: no other sender can take or start it meanwhile;
            // their packets are queued and go out with this write or the writer's task.
            && let Some(writer) = state.unpark(true)
        {
            drop(state);
            inline.writers.push(writer);
            return;
        }
        self.wake(state);
    }

    /// Starts a parked writer, or notifies a running one that has not been woken since its
    /// last take.
    fn wake(&self, mut state: std::sync::MutexGuard<'_, State>) {
        if self.is_frozen() {
            return;
        }
        if let Some(writer) = state.unpark(false) {
            drop(state);
            writer.resume();
            return;
        }
        if let WriterState::Active { woken, .. } = &mut state.writer
            && !*woken
        {
            *woken = true;
            drop(state);
            self.notify.notify_one();
        }
    }

    /// Freezes the queue for a handover: from now on its writer, once it parks (a running
    /// one is nudged to, see `Writer::drain`), stays parked whatever is queued.
    pub(crate) fn freeze(&self) {
        let _state = self.lock();
        self.frozen.store(true, Ordering::Release);
    }

    /// Whether the queue is frozen.
    pub(crate) fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
    }

    /// Whether the queue is frozen with its writer parked (or the connection closed): then
    /// nothing writes to the connection until it is thawed.
    pub(crate) fn is_still(&self) -> bool {
        let state = self.lock();
        self.is_frozen() && !matches!(state.writer, WriterState::Active { .. })
    }

    /// Copies what is queued and the parked writer's state, for a successor process. The
    /// queue stays as it is: a rollback thaws it and goes on.
    pub(crate) fn export(&self) -> Option<QueueExport> {
        let state = self.lock();
        let WriterState::Parked(writer) = &state.writer else {
            return None;
        };
        let copy = |q: &VecDeque<Packet>| {
            q.iter()
                .map(|p| Packet {
                    src: p.src,
                    data: p.data.clone(),
                    enqueued: p.enqueued,
                    forwarded: p.forwarded,
                })
                .collect()
        };
        Some(QueueExport {
            batch: Batch {
                disco: copy(&state.pending.disco),
                other: copy(&state.pending.other),
                control: state.pending.control.clone(),
                pong: state.pending.pong,
            },
            writer: writer.export()?,
        })
    }

    /// Thaws a frozen queue (the handover was called off): its writer starts again if there
    /// is work for it.
    pub(crate) fn thaw(&self) {
        let mut state = self.lock();
        self.frozen.store(false, Ordering::Release);
        if !matches!(state.writer, WriterState::Parked(_)) {
            return;
        }
        // A writer may hold a batch it began: it must finish it whether or not more is
        // queued, so it is always started; with nothing to do it parks again at once.
        if let Some(writer) = state.unpark(false) {
            drop(state);
            writer.resume();
        }
    }

    /// Closes the queue for a connection handed to a successor process, which now writes
    /// everything that was queued: nothing is counted as dropped, and the writer lets go of
    /// the socket without closing it.
    pub(crate) fn forget(&self) {
        let mut state = self.lock();
        let writer = std::mem::replace(&mut state.writer, WriterState::Closed);
        state.pending = Batch::default();
        drop(state);
        if let WriterState::Parked(writer) = writer {
            writer.forget();
        }
        self.notify.notify_one();
    }

    /// Fills a new queue with what a predecessor process had queued.
    pub(crate) fn restore(&self, batch: Batch) {
        self.lock().pending = batch;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the queues inconsistent (every critical
        // section is a push, pop or swap), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Takes the parked writer out, if it is parked, and marks it running (`writing`: taken
    /// along to write what is queued).
    fn unpark(&mut self, writing: bool) -> Option<Box<dyn Resume>> {
        if !matches!(self.writer, WriterState::Parked(_)) {
            return None;
        }
        let active = WriterState::Active {
            writing,
            woken: false,
        };
        match std::mem::replace(&mut self.writer, active) {
            WriterState::Parked(writer) => Some(writer),
            WriterState::Active { .. } | WriterState::Closed => None,
        }
    }

    /// The writer took `batch`: it is writing if that holds anything, and may be woken again.
    /// Returns false once the queue is closed.
    fn taken(&mut self, batch: &Batch) -> bool {
        match &mut self.writer {
            WriterState::Closed => false,
            // Only a running writer takes; a parked one is where it was.
            WriterState::Parked(_) => true,
            WriterState::Active { writing, woken } => {
                // The writer takes again once it has written a batch, so an empty take
                // means the previous batch is out.
                *writing = !batch.is_empty();
                *woken = false;
                true
            }
        }
    }
}

/// Packets (or control frames) an idle connection's empty queue may keep room for.
const IDLE_QUEUE_CAPACITY: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(depth: usize) -> SendQueue {
        SendQueue::new(depth)
    }

    fn pkt(b: u8) -> Bytes {
        Bytes::from(vec![b; 10])
    }

    /// A packet pushed out of a full queue counts in the queue-time average with the time
    /// it waited, as a written one does.
    #[test]
    fn a_head_drop_counts_its_wait_in_the_queue_time_average() {
        let h = handle(1);
        let mut counts = ReaderCounts::default();
        let now = Instant::now();
        let src = PublicKey::from_bytes([9; 32]);
        for enqueued in [now - std::time::Duration::from_secs(1), now] {
            h.push_packet(
                Packet {
                    src,
                    data: pkt(0),
                    enqueued,
                    forwarded: false,
                },
                PacketKind::Other,
                &mut counts,
                &mut Inline::default(),
            );
        }
        assert_eq!(counts.head_drop_waits, 1);
        counts.frames = 2;
        let m = crate::Metrics::new(&prometheus::Registry::new()).expect("metrics");
        m.fold(&mut counts);
        // 0.1 of the one second it waited.
        assert!((m.average_queue_duration_ms.get() - 100.0).abs() < 1e-6);
    }

    #[test]
    fn full_queue_drops_oldest_and_keeps_newest() {
        let h = handle(2);
        let mut counts = ReaderCounts::default();
        let now = Instant::now();
        let src = PublicKey::from_bytes([9; 32]);
        for b in 0..5 {
            h.push_packet(
                Packet {
                    src,
                    data: pkt(b),
                    enqueued: now,
                    forwarded: false,
                },
                PacketKind::Other,
                &mut counts,
                &mut Inline::default(),
            );
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
    fn a_parked_queue_gives_back_what_a_burst_grew() {
        let h = handle(256);
        let mut counts = ReaderCounts::default();
        let src = PublicKey::from_bytes([9; 32]);
        for b in 0..200 {
            let packet = Packet {
                src,
                data: pkt(b),
                enqueued: Instant::now(),
                forwarded: false,
            };
            h.push_packet(
                packet,
                PacketKind::Other,
                &mut counts,
                &mut Inline::default(),
            );
        }
        let mut batch = Batch::default();
        assert!(h.take(&mut batch));
        assert_eq!(batch.other.len(), 200);
        // The writer takes again with its emptied batch, which leaves the burst's capacity
        // in the pending queue.
        batch.other.clear();
        assert!(h.take(&mut batch));
        assert!(h.lock().pending.other.capacity() >= 200);
        let shrunk = std::sync::Arc::new(Mutex::new(Vec::new()));
        h.park(Box::new(Probe {
            log: shrunk.clone(),
            inline: false,
            queue: None,
        }))
        .expect("parks");
        // Parking keeps the buffers, for a busy stream's next batch; the keepalive chore
        // gives them back, the parked writer's included.
        assert!(h.lock().pending.other.capacity() >= 200);
        h.shrink_if_parked();
        assert!(h.lock().pending.other.capacity() <= IDLE_QUEUE_CAPACITY);
        assert_eq!(*shrunk.lock().expect("log"), vec!["shrunk"]);
    }

    #[test]
    fn disco_and_other_queues_do_not_crowd_each_other_out() {
        let h = handle(1);
        let mut counts = ReaderCounts::default();
        let now = Instant::now();
        let src = PublicKey::from_bytes([9; 32]);
        h.push_packet(
            Packet {
                src,
                data: pkt(1),
                enqueued: now,
                forwarded: false,
            },
            PacketKind::Disco,
            &mut counts,
            &mut Inline::default(),
        );
        h.push_packet(
            Packet {
                src,
                data: pkt(2),
                enqueued: now,
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut Inline::default(),
        );
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
            Packet {
                src,
                data: pkt(1),
                enqueued: Instant::now(),
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut Inline::default(),
        );
        let (rest, parked) = h.close();
        assert!(parked.is_none());
        assert_eq!(rest.other.len(), 1);
        h.push_packet(
            Packet {
                src,
                data: pkt(2),
                enqueued: Instant::now(),
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut Inline::default(),
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
            Packet {
                src,
                data: pkt(1),
                enqueued: Instant::now(),
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut Inline::default(),
        );
        h.push_control(Control::KeepAlive);
        h.push_pong([3; 8], &mut Inline::default());
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
        h.push_pong([1; 8], &mut Inline::default());
        h.push_pong([2; 8], &mut Inline::default());
        let mut batch = Batch::default();
        h.take(&mut batch);
        assert_eq!(batch.pong, Some([1; 8]));
    }

    /// A parked writer that records what is done with it; with a queue, writing inline
    /// takes everything queued, as a writer whose socket takes it all does.
    #[derive(Debug)]
    struct Probe {
        log: std::sync::Arc<Mutex<Vec<&'static str>>>,
        inline: bool,
        queue: Option<std::sync::Arc<SendQueue>>,
    }

    impl Resume for Probe {
        fn resume(self: Box<Self>) {
            self.log.lock().expect("log").push("resumed");
        }

        fn can_write_inline(&self) -> bool {
            self.inline
        }

        fn shrink_idle(&mut self) {
            self.log.lock().expect("log").push("shrunk");
        }

        fn write_inline(self: Box<Self>) {
            self.log.lock().expect("log").push("written inline");
            if let Some(q) = &self.queue {
                q.take(&mut Batch::default());
            }
        }
    }

    fn parked(q: &SendQueue, inline: bool) -> std::sync::Arc<Mutex<Vec<&'static str>>> {
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        q.park(Box::new(Probe {
            log: log.clone(),
            inline,
            queue: None,
        }))
        .expect("parks");
        log
    }

    #[test]
    fn a_sender_takes_an_idle_writer_along_and_runs_it_after_its_batch() {
        let q = handle(4);
        let log = parked(&q, true);
        let mut counts = ReaderCounts::default();
        let mut inline = Inline::default();
        let src = PublicKey::from_bytes([9; 32]);
        let now = Instant::now();
        q.push_packet(
            Packet {
                src,
                data: pkt(1),
                enqueued: now,
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut inline,
        );
        q.push_packet(
            Packet {
                src,
                data: pkt(2),
                enqueued: now,
                forwarded: false,
            },
            PacketKind::Other,
            &mut counts,
            &mut inline,
        );
        // Taken once, not started: both packets wait for the end of the batch.
        assert!(log.lock().expect("log").is_empty());
        assert_eq!(inline.writers.len(), 1);
        assert!(!q.is_drained(), "in the sender's hands, the writer is busy");
        inline.flush();
        assert_eq!(*log.lock().expect("log"), ["written inline"]);
        assert!(inline.writers.is_empty());
    }

    #[test]
    fn a_writer_that_cannot_write_inline_is_started_as_before() {
        let q = handle(4);
        let log = parked(&q, false);
        let mut inline = Inline::default();
        q.push_packet(
            Packet {
                src: PublicKey::from_bytes([9; 32]),
                data: pkt(1),
                enqueued: Instant::now(),
                forwarded: false,
            },
            PacketKind::Other,
            &mut ReaderCounts::default(),
            &mut inline,
        );
        assert_eq!(*log.lock().expect("log"), ["resumed"]);
        assert!(inline.writers.is_empty());
    }

    #[test]
    fn a_full_queue_is_written_out_before_anything_is_dropped() {
        let q = std::sync::Arc::new(handle(2));
        let log = std::sync::Arc::new(Mutex::new(Vec::new()));
        q.park(Box::new(Probe {
            log: log.clone(),
            inline: true,
            queue: Some(q.clone()),
        }))
        .expect("parks");
        let mut counts = ReaderCounts::default();
        let mut inline = Inline::default();
        let src = PublicKey::from_bytes([9; 32]);
        let now = Instant::now();
        for b in 0..3 {
            q.push_packet(
                Packet {
                    src,
                    data: pkt(b),
                    enqueued: now,
                    forwarded: false,
                },
                PacketKind::Other,
                &mut counts,
                &mut inline,
            );
        }
        // The third push found the queue full with the writer in hand: it was written first.
        assert_eq!(*log.lock().expect("log"), ["written inline"]);
        assert_eq!(counts.dropped, [[0; 2]; 7]);
    }

    #[test]
    fn a_writer_taken_along_is_never_lost() {
        let q = handle(4);
        let log = parked(&q, true);
        {
            let mut inline = Inline::default();
            q.push_pong([1; 8], &mut inline);
        }
        assert_eq!(*log.lock().expect("log"), ["written inline"]);
    }
}
