//! The write half of a connection: it drains the connection's queues in batches and writes
//! each batch with one vectored write, flushing only when nothing else is ready.
//!
//! An idle connection's writer is parked in its queue. A sender that queues a packet for it
//! takes it along and, at the end of its read batch, has it write right away on the sender's
//! task (polled once with a no-op waker, so it never waits). Only when the socket cannot take
//! everything at once does the writer get a task of its own, which finishes the batch under
//! the write deadline and parks again when the queue is empty. A lone packet thus goes from
//! one client's socket to another's without a task switch.
//!
//! Both run the same loop, [`Writer::poll_write`]: take what is queued, lay it out and hand
//! it to the transport from where the last attempt stopped, flush, account it ([`batch`]),
//! and take again. What the writer holds between polls is its [`State`]: nothing between
//! batches, the batch and its progress while one is being written. A parked writer thus
//! holds only what the connection needs between writes: its half of the socket and its
//! PeerGone watches.

mod batch;

use std::collections::HashSet;
use std::io::{self, IoSlice};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use derp_io::WriteHalf;
use derp_proto::{PublicKey, ws};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};
use tracing::debug;

use super::{Framing, count_gone};
use crate::handle::{Cancel, ConnHandle};
use crate::queue::{Resume, WriterExport};
use crate::quic::{DatagramError, QuicLink};
use crate::state::ServerState;
use batch::{MAX_IOV, Scratch};

/// A connection's writer. It runs as a task only while the socket pushes back; otherwise it
/// is parked in its queue and senders have it write inline, so idle connections cost one
/// task, not two, and a lone packet costs no task switch.
pub(super) struct Writer {
    shared: Arc<ServerState>,
    handle: Arc<ConnHandle>,
    w: WriteHalf,
    framing: Framing,
    /// Sources this connection has received from; each is registered once for PeerGone.
    sent_from: HashSet<PublicKey, foldhash::fast::RandomState>,
    /// A QUIC connection's datagram side and migration gate.
    quic: Option<Arc<QuicLink>>,
    state: State,
}

/// What a writer holds between polls of [`Writer::poll_write`].
enum State {
    /// No batch in hand and no scratch: how a writer parks, and where it takes the next
    /// batch from.
    Idle,
    /// A batch taken from the queue and laid out, not yet all handed to the transport: its
    /// QUIC datagrams go first (those left in [`Scratch::datagrams`]), then its stream
    /// pieces from [`Scratch::progress`] on.
    Writing(Box<Scratch>),
}

/// What [`Writer::poll_write`] leaves to the one driving it.
enum Next {
    /// Nothing more is queued, or a sender wrote its share: park, unless more arrived.
    Park,
    /// quinn's datagram buffer is full (its congestion controller holds them back): the
    /// batch's datagrams left are sent awaiting room; then poll again for the rest of the
    /// batch.
    SendDatagrams,
    /// QUIC: the packets wait in the queue until the client's new address is validated. The
    /// path watcher queues a probe, which wakes the writer, until it is.
    AwaitPath,
    /// The queue is closed: close the socket.
    Close,
    /// The connection is being handed to another process: park as it is, batch and all.
    Frozen,
}

/// One drive of [`Writer::poll_write`]: a sender's, or the writer's own task's.
struct Turn<'a> {
    /// Batches it may still write.
    batches: usize,
    /// The task's: no write call starts once the connection is cancelled. A sender's write
    /// never waits, so it needs none.
    cancel: Option<&'a Cancel>,
    /// Write and flush calls that returned; the task's deadline starts again when this moves.
    calls: u64,
}

impl Turn<'_> {
    /// A sender's turn: a few batches for another connection, then it leaves the rest.
    fn sender() -> Self {
        Self {
            batches: INLINE_BATCHES,
            cancel: None,
            calls: 0,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.is_some_and(Cancel::is_cancelled)
    }
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("id", &self.handle.id)
            .finish()
    }
}

impl Resume for Writer {
    /// Gives back what a burst grew the socket half's buffers to; a parked writer holds no
    /// scratch.
    fn shrink_idle(&mut self) {
        self.w.shrink_idle();
    }

    fn resume(self: Box<Self>) {
        let tasks = self.shared.tasks.clone();
        tasks.spawn(self.run());
    }

    fn can_write_inline(&self) -> bool {
        true
    }

    /// Polls the writer's loop once with a no-op waker, on the task of a sender that found
    /// it parked: when the transport took everything (and another sender's packets that
    /// arrived meanwhile, up to [`INLINE_BATCHES`] batches), the writer parks again; when it
    /// pushed back, the writer's task finishes the batch from where this stopped.
    fn write_inline(mut self: Box<Self>) {
        let mut cx = Context::from_waker(Waker::noop());
        match self.poll_write(&mut cx, &mut Turn::sender()) {
            Poll::Ready(Ok(Next::Park)) => {
                let handle = self.handle.clone();
                if let Err(back) = handle.queue.park(self) {
                    // More arrived, or the connection is closing: the task takes over.
                    back.resume();
                }
            }
            Poll::Ready(Ok(Next::Close)) => self.finish_on_task(None),
            Poll::Ready(Err(e)) => self.finish_on_task(Some(e)),
            // The socket pushed back (or the rest takes awaiting): the task finishes the
            // batch, waiting for it.
            Poll::Ready(Ok(Next::SendDatagrams | Next::AwaitPath)) | Poll::Pending => self.resume(),
            // Only the writer's own task looks for a freeze.
            Poll::Ready(Ok(Next::Frozen)) => self.resume(),
        }
    }

    fn export(&self) -> Option<WriterExport> {
        if self.quic.is_some() {
            return None;
        }
        let tls_tx = match &self.w {
            WriteHalf::Tcp(_) => None,
            WriteHalf::Tls(w) => Some(w.snapshot().ok()?),
            WriteHalf::Boxed(_) | WriteHalf::Halves(_) => return None,
        };
        let mut export = WriterExport {
            tail: Vec::new(),
            sent_from: self.sent_from.iter().copied().collect(),
            tls_tx,
        };
        if let State::Writing(s) = &self.state {
            if !s.datagrams.is_empty() {
                return None;
            }
            export.tail = s.unsent();
            // The batch's sources are noted once it is written; the successor writes it.
            for p in s.batch.disco.iter().chain(&s.batch.other) {
                if !self.sent_from.contains(&p.src) {
                    export.sent_from.push(p.src);
                }
            }
            export.sent_from.sort_unstable();
            export.sent_from.dedup();
        }
        Some(export)
    }

    fn forget(self: Box<Self>) {
        let Self { w, state, .. } = *self;
        if let State::Writing(mut s) = state {
            // Written by the successor, not accounted here.
            s.clear();
            s.give();
        }
        w.forget();
    }
}

impl Writer {
    /// Starts the writer for a connection whose ServerInfo has been written.
    pub(super) fn start(
        shared: Arc<ServerState>,
        handle: Arc<ConnHandle>,
        w: WriteHalf,
        framing: Framing,
        quic: Option<Arc<QuicLink>>,
    ) {
        let writer = Box::new(Self {
            shared,
            handle: handle.clone(),
            w,
            framing,
            sent_from: HashSet::default(),
            quic,
            state: State::Idle,
        });
        if let Err(writer) = handle.queue.park(writer) {
            writer.resume();
        }
    }

    /// Starts the writer of a connection taken over from a predecessor process: `tail`, the
    /// rest of a batch that process began, goes out first (after TLS records it had sealed,
    /// when `flush` says there are some), then what was queued.
    pub(super) fn adopt(
        shared: Arc<ServerState>,
        handle: Arc<ConnHandle>,
        w: WriteHalf,
        framing: Framing,
        tail: Vec<u8>,
        sent_from: Vec<PublicKey>,
        flush: bool,
    ) -> Box<Self> {
        // Sealed TLS records the predecessor had not written go out on a flush, which an
        // empty batch still makes.
        let state = if tail.is_empty() && !flush {
            State::Idle
        } else {
            let mut s = Scratch::take();
            s.raw(tail);
            State::Writing(s)
        };
        Box::new(Self {
            shared,
            handle,
            w,
            framing,
            sent_from: sent_from.into_iter().collect(),
            quic: None,
            state,
        })
    }

    /// Starts an adopted writer (see [`Writer::adopt`]): on its task if it has work, else
    /// parked in its queue.
    pub(super) fn start_adopted(self: Box<Self>) {
        let busy = matches!(self.state, State::Writing(_));
        let handle = self.handle.clone();
        if busy {
            self.resume();
        } else if let Err(writer) = handle.queue.park(self) {
            writer.resume();
        }
    }

    /// The writer's task: writes until the queue is empty (then the writer parks, and
    /// senders write inline again) or the connection closes.
    async fn run(mut self: Box<Self>) {
        let handle = self.handle.clone();
        let error = loop {
            match self.drain(&handle).await {
                Ok(Next::Park) => match handle.queue.park(self) {
                    Ok(()) => return,
                    // Work arrived between the drain and the park.
                    Err(back) => self = back,
                },
                // Parked with its batch; a thawed queue starts it again.
                Ok(Next::Frozen) => {
                    let shared = self.shared.clone();
                    match handle.queue.park_frozen(self) {
                        Ok(()) => {
                            shared.handover.note_still();
                            return;
                        }
                        Err(back) => self = back,
                    }
                }
                Ok(Next::AwaitPath) => tokio::select! {
                    biased;
                    _ = handle.cancel.cancelled() => break None,
                    _ = handle.queue.wait() => {}
                },
                Ok(Next::Close) => break None,
                // `drain` sends them itself and goes on.
                Ok(Next::SendDatagrams) => {}
                Err(e) => break Some(e),
            }
        };
        self.finish(error).await;
    }

    /// Drives [`Writer::poll_write`] on the writer's own task until it has nothing to write,
    /// starting with the batch an inline write left unfinished. It waits for the socket; a
    /// write call that takes longer than the deadline fails, and one blocked on a peer that
    /// does not read still ends when the connection is closed (shutdown, ClosePeer, the read
    /// side ending). It also sends the QUIC datagrams the loop asks for.
    async fn drain(&mut self, handle: &ConnHandle) -> io::Result<Next> {
        let write_timeout = self.write_timeout();
        let shared = self.shared.clone();
        let mut cancelled = pin!(handle.cancel.cancelled_or_nudged());
        // Armed only once the transport pushes back, and started again with each new call.
        let mut deadline = pin!(None::<Sleep>);
        let mut armed_at = 0;
        let mut turn = Turn {
            batches: usize::MAX,
            cancel: Some(&handle.cancel),
            calls: 0,
        };
        loop {
            let polled = std::future::poll_fn(|cx| {
                // Read before every write: a frozen connection's writer must not write.
                if shared.handover.is_begun() && handle.queue.is_frozen() {
                    return Poll::Ready(Ok(Next::Frozen));
                }
                if let Poll::Ready(r) = self.poll_write(cx, &mut turn) {
                    return Poll::Ready(r);
                }
                if cancelled.as_mut().poll(cx).is_ready() {
                    if handle.cancel.is_cancelled() {
                        return Poll::Ready(Err(aborted()));
                    }
                    // A nudge: look at the freeze again, waiting anew.
                    cancelled.set(handle.cancel.cancelled_or_nudged());
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                let Some(timeout) = write_timeout else {
                    return Poll::Pending;
                };
                match deadline.as_mut().as_pin_mut() {
                    None => deadline.set(Some(tokio::time::sleep(timeout))),
                    Some(d) if armed_at != turn.calls => d.reset(Instant::now() + timeout),
                    Some(_) => {}
                }
                armed_at = turn.calls;
                match deadline.as_mut().as_pin_mut().map(|d| d.poll(cx)) {
                    Some(Poll::Ready(())) => Poll::Ready(Err(io::ErrorKind::TimedOut.into())),
                    _ => Poll::Pending,
                }
            })
            .await;
            let result = match polled {
                Ok(Next::SendDatagrams) => self.send_datagrams(&handle.cancel).await,
                Ok(next) => return Ok(next),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                self.abandon_batch();
                return Err(e);
            }
        }
    }

    /// The deadline of one write call. Read from the configuration when the writer waits (on
    /// its own task, never inline), rather than kept in every parked writer, whose box it
    /// took from malloc's 112-byte chunks to 128-byte ones.
    fn write_timeout(&self) -> Option<Duration> {
        let config = &self.shared.config;
        if self.handle.can_mesh {
            config.mesh_write_timeout
        } else {
            config.write_timeout
        }
    }

    /// Ends the connection's writing side on a task of its own: for a sender whose inline
    /// write failed or found the queue closed.
    fn finish_on_task(self: Box<Self>, error: Option<io::Error>) {
        let tasks = self.shared.tasks.clone();
        tasks.spawn(self.finish(error));
    }

    /// Ends the connection's writing side: counts what is left, drops PeerGone watches and
    /// closes the socket, each bounded in time.
    async fn finish(mut self: Box<Self>, error: Option<io::Error>) {
        let (shared, handle) = (&self.shared, &self.handle);
        if let Some(e) = error {
            let timed_out = e.kind() == io::ErrorKind::TimedOut;
            if timed_out {
                shared.metrics.write_timeouts.inc();
                if let Some(link) = &self.quic {
                    link.note_write_timeout();
                }
            }
            // Not a failure of the write: the connection was ending for another reason.
            if e.kind() != io::ErrorKind::ConnectionAborted {
                handle.note_write_failure(timed_out);
            }
            debug!(id = handle.id, error = %e, "write failed");
        }
        handle.cancel.cancel();
        shared
            .registry
            .unwatch_peer_gone(&self.sent_from, handle.id);
        count_gone(shared, handle.close());
        if self.framing == Framing::WebSocket {
            let code = handle.ws_close_code.load(Ordering::Relaxed);
            let frame = ws::close_frame(code);
            let _ = write_with_timeout(&mut self.w, &frame, Some(WS_CLOSE_TIMEOUT)).await;
        }
        // Bounded: a TLS shutdown writes close_notify, which a peer that stopped reading would
        // never let through.
        let _ = tokio::time::timeout(WS_CLOSE_TIMEOUT, self.w.shutdown()).await;
    }
}

impl Writer {
    /// The writer's one loop: takes what is queued, lays it out, hands it to the transport and
    /// flushes, accounts it, and takes again, until the queue is empty, `turn` has written its
    /// share, or the transport pushes back (`Pending`, with the batch and its progress kept
    /// in [`State::Writing`] for the next poll). A sender polls it once with a no-op waker;
    /// the writer's task polls it until it is done ([`Writer::drain`]).
    fn poll_write(&mut self, cx: &mut Context<'_>, turn: &mut Turn<'_>) -> Poll<io::Result<Next>> {
        let mut s = match std::mem::replace(&mut self.state, State::Idle) {
            State::Writing(s) => s,
            State::Idle => match self.next_batch(Scratch::take()) {
                Ok(s) => s,
                Err(next) => return Poll::Ready(Ok(next)),
            },
        };
        loop {
            if !s.datagrams.is_empty() {
                if let Err(e) = self.send_datagrams_now(&mut s, turn) {
                    self.end_batch(&mut s, false);
                    s.give();
                    return Poll::Ready(Err(e));
                }
                if !s.datagrams.is_empty() {
                    self.state = State::Writing(s);
                    return Poll::Ready(Ok(Next::SendDatagrams));
                }
            }
            match poll_stream(&mut self.w, &mut s, cx, turn) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => {
                    self.end_batch(&mut s, false);
                    s.give();
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    self.state = State::Writing(s);
                    return Poll::Pending;
                }
            }
            let frames = self.end_batch(&mut s, true);
            self.shared
                .metrics
                .buffered_write_frames
                .observe(frames as f64);
            turn.batches -= 1;
            if turn.batches == 0 {
                s.give();
                return Poll::Ready(Ok(Next::Park));
            }
            s = match self.next_batch(s) {
                Ok(s) => s,
                Err(next) => return Poll::Ready(Ok(next)),
            };
        }
    }

    /// Takes what is queued into `s` (everything, or for a QUIC client whose address is not
    /// validated only the control frames) and lays it out. With nothing taken, gives the
    /// scratch back and says what to do instead.
    fn next_batch(&mut self, mut s: Box<Scratch>) -> Result<Box<Scratch>, Next> {
        let queue = &self.handle.queue;
        let (open, held_back) = match &self.quic {
            Some(link) if !link.check_path(&self.handle, &self.shared.metrics) => {
                // The client's address is not validated: its packets wait in the queue.
                (queue.take_control(&mut s.batch), true)
            }
            _ => (queue.take(&mut s.batch), false),
        };
        if s.batch.is_empty() {
            s.give();
            return Err(match (open, held_back) {
                (false, _) => Next::Close,
                (true, true) => Next::AwaitPath,
                (true, false) => Next::Park,
            });
        }
        self.begin_batch(&mut s);
        Ok(s)
    }

    /// Accounts a batch that will not be finished (the connection is ending) as failed.
    fn abandon_batch(&mut self) {
        if let State::Writing(mut s) = std::mem::replace(&mut self.state, State::Idle) {
            self.end_batch(&mut s, false);
            s.give();
        }
    }

    /// Hands the batch's datagram packets to quinn while its datagram buffer has room, without
    /// waiting (so a sender can do it inline); those left wait for [`Writer::send_datagrams`].
    /// A frame that no longer fits (the path MTU shrank since it was laid out) goes on the
    /// stream instead.
    fn send_datagrams_now(&self, s: &mut Scratch, turn: &mut Turn<'_>) -> io::Result<()> {
        let Some(link) = &self.quic else {
            s.datagrams.clear();
            return Ok(());
        };
        let mut sender = link.datagram_sender();
        let mut n = 0;
        while n < s.datagrams.len() {
            if turn.cancelled() {
                return Err(aborted());
            }
            match sender.try_send(s.datagram(n)) {
                None => break,
                Some(Ok(())) => s.datagram_sent(n),
                Some(Err(DatagramError::TooLarge)) => s.datagram_on_stream(n),
                Some(Err(e)) => return Err(io::Error::other(e)),
            }
            turn.calls += 1;
            n += 1;
        }
        drop(sender);
        s.datagrams_done(n);
        Ok(())
    }

    /// Sends the batch's datagram packets quinn had no room for, each under the write
    /// deadline. A frame that no longer fits (the path MTU shrank since it was laid out)
    /// goes on the stream instead.
    async fn send_datagrams(&mut self, cancel: &Cancel) -> io::Result<()> {
        let write_timeout = self.write_timeout();
        let (Some(link), State::Writing(s)) = (&self.quic, &mut self.state) else {
            return Ok(());
        };
        let far = Duration::from_secs(86_400);
        let deadline = tokio::time::sleep(write_timeout.unwrap_or(far));
        tokio::pin!(deadline);
        for n in 0..s.datagrams.len() {
            let sent = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(aborted()),
                _ = &mut deadline => return Err(io::ErrorKind::TimedOut.into()),
                r = link.send_datagram(s.datagram(n)) => r,
            };
            match sent {
                Ok(()) => s.datagram_sent(n),
                Err(DatagramError::TooLarge) => s.datagram_on_stream(n),
                Err(e) => return Err(io::Error::other(e)),
            }
            if let Some(t) = write_timeout {
                deadline.as_mut().reset(Instant::now() + t);
            }
        }
        // All sent or moved to the stream: the stream part is next.
        s.datagrams.clear();
        Ok(())
    }
}

/// Hands the batch's stream pieces to the transport from where the last call stopped, with as
/// few `writev` calls as it takes, then flushes. After a failed flush `progress` is 0: what a
/// layer above the socket (TLS) still buffered is lost.
fn poll_stream(
    w: &mut WriteHalf,
    s: &mut Scratch,
    cx: &mut Context<'_>,
    turn: &mut Turn<'_>,
) -> Poll<io::Result<()>> {
    let total = s.stream_len();
    while s.progress < total {
        if turn.cancelled() {
            return Poll::Ready(Err(aborted()));
        }
        let mut iov = [IoSlice::new(&[]); MAX_IOV];
        let n = s.gather(&mut iov);
        let written = ready!(Pin::new(&mut *w).poll_write_vectored(cx, &iov[..n]))?;
        turn.calls += 1;
        if written == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        s.progress += written;
    }
    if turn.cancelled() {
        return Poll::Ready(Err(aborted()));
    }
    let flushed = ready!(Pin::new(w).poll_flush(cx));
    turn.calls += 1;
    if flushed.is_err() {
        s.progress = 0;
    }
    Poll::Ready(flushed)
}

/// Writes all slices, applying the deadline to each write call: a peer that accepts nothing
/// for that long is cut off, while a slow but moving one is not.
/// `taken` counts the bytes the writer took, also when a later call fails.
async fn write_vectored_all<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut slices: &mut [IoSlice<'_>],
    timeout: Option<Duration>,
    taken: &mut usize,
) -> io::Result<()> {
    while !slices.is_empty() {
        let n = match timeout {
            Some(t) => tokio::time::timeout(t, w.write_vectored(slices))
                .await
                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))?,
            None => w.write_vectored(slices).await?,
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        *taken += n;
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Writes `bytes` and flushes, each write call under the deadline.
pub(super) async fn write_with_timeout<W: AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    timeout: Option<Duration>,
) -> io::Result<()> {
    let mut slices = [IoSlice::new(bytes)];
    write_vectored_all(w, &mut slices, timeout, &mut 0).await?;
    w.flush().await
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed while writing",
    )
}

/// Most batches a sender writes inline for one destination before leaving the rest to the
/// destination's own task: a sender does others' work only briefly.
const INLINE_BATCHES: usize = 2;
/// How long a closing connection may take to accept its last bytes (a WebSocket close frame,
/// a TLS close_notify).
const WS_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use derp_io::Transport;
    use derp_proto::frame;
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::queue::Control;

    fn writer(w: WriteHalf) -> Box<Writer> {
        let shared = ServerState::for_tests();
        let handle = ConnHandle::for_tests(1, 2);
        Box::new(Writer {
            shared,
            handle,
            w,
            framing: Framing::Raw,
            sent_from: HashSet::default(),
            quic: None,
            state: State::Idle,
        })
    }

    /// Every idle connection's writer is parked in its queue as one `Box<Writer>`, which
    /// glibc's malloc serves with an 8-byte header in 16-byte steps: at most 104 bytes take
    /// a 112-byte chunk, eight more a 128-byte one (docs/bench-log/2026-12.md, "Idle
    /// connections and RTT sampling").
    #[test]
    fn a_parked_writer_fits_a_112_byte_allocation() {
        let size = size_of::<Writer>();
        assert!(
            size <= 104,
            "a parked writer is {size} bytes; at most 104 fit a 112-byte malloc chunk"
        );
    }

    #[tokio::test]
    async fn a_parked_writer_holds_no_scratch_and_the_next_write_takes_it_back() {
        let (mut client, server_side) = tokio::io::duplex(1 << 16);
        let (_, w) = Transport::Boxed(Box::new(server_side)).split();
        let mut writer = writer(w);
        let keepalive = [frame::FrameType::KeepAlive as u8, 0, 0, 0, 0];
        let mut cx = Context::from_waker(Waker::noop());

        writer.handle.queue.push_control(Control::KeepAlive);
        let written = writer.poll_write(&mut cx, &mut Turn::sender());
        assert!(matches!(written, Poll::Ready(Ok(Next::Park))));
        // What a parked writer keeps: no scratch; it went back to the thread's pool.
        assert!(matches!(writer.state, State::Idle));
        let (first, pooled) = Scratch::pool_top();
        assert_eq!(pooled, 1);
        let mut got = [0u8; 5];
        client.read_exact(&mut got).await.expect("keepalive");
        assert_eq!(got, keepalive);

        // The next write on this thread takes the same scratch from the pool and gives it
        // back: no second one was made.
        writer.handle.queue.push_control(Control::KeepAlive);
        let written = writer.poll_write(&mut cx, &mut Turn::sender());
        assert!(matches!(written, Poll::Ready(Ok(Next::Park))));
        assert!(matches!(writer.state, State::Idle));
        assert_eq!(Scratch::pool_top(), (first, 1));
        client.read_exact(&mut got).await.expect("keepalive");
        assert_eq!(got, keepalive);
    }

    #[tokio::test]
    async fn a_writer_in_the_middle_of_a_batch_keeps_its_scratch_and_resumes_where_it_stopped() {
        // Room for three bytes: a keepalive (five) does not go out in one write.
        let (mut client, server_side) = tokio::io::duplex(3);
        let (_, w) = Transport::Boxed(Box::new(server_side)).split();
        let mut writer = writer(w);
        let mut cx = Context::from_waker(Waker::noop());

        writer.handle.queue.push_control(Control::KeepAlive);
        assert!(writer.poll_write(&mut cx, &mut Turn::sender()).is_pending());
        let State::Writing(s) = &writer.state else {
            panic!("a writer the transport pushed back keeps its batch");
        };
        assert_eq!(s.progress, 3);
        let mut got = [0u8; 5];
        client.read_exact(&mut got[..3]).await.expect("first part");

        // The rest of the frame, not the frame again.
        let written = writer.poll_write(&mut cx, &mut Turn::sender());
        assert!(matches!(written, Poll::Ready(Ok(Next::Park))));
        assert!(matches!(writer.state, State::Idle));
        client.read_exact(&mut got[3..]).await.expect("second part");
        assert_eq!(got, [frame::FrameType::KeepAlive as u8, 0, 0, 0, 0]);
    }
}
