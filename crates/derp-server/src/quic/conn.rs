//! One QUIC connection as derpd's tasks use it: its handshake, its one DERP stream (as
//! `AsyncRead` and `AsyncWrite` halves), its datagrams and its close. The quinn-proto
//! connection lives behind a mutex shared with the endpoint's driver ([`super::driver`]):
//! a task calls into it directly and marks the connection for the driver, which does
//! everything that needs the socket or the clock (packets in, timers, packets out) for
//! every connection in one task.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use quinn_proto::{
    ConnectionError, ConnectionHandle, ConnectionStats, Dir, Event, ReadError, StreamEvent,
    StreamId, VarInt, WriteError,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use super::pace::Pacer;
use crate::handle::ConnHandle;
use crate::metrics::Metrics;

/// Why a datagram could not be handed over.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DatagramError {
    /// Larger than the path and the peer allow now.
    #[error("datagram too large")]
    TooLarge,
    /// The peer does not take datagrams.
    #[error("peer does not accept datagrams")]
    Unsupported,
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Lost(ConnectionError),
}

/// What the driver and the connection's tasks share.
#[derive(Debug)]
pub(crate) struct ConnShared {
    pub(super) handle: ConnectionHandle,
    pub(super) state: Mutex<ConnState>,
    pub(super) marks: Arc<Marks>,
    /// Already in the driver's list of connections to look at.
    pub(super) marked: AtomicBool,
}

/// The quinn-proto connection and who waits on it.
#[derive(Debug)]
pub(crate) struct ConnState {
    pub(super) proto: quinn_proto::Connection,
    stream: Option<StreamId>,
    connected: bool,
    /// Why the connection ended, once it has.
    lost: Option<ConnectionError>,
    /// Closed from this side (by [`Conn::close`] or by dropping every [`Conn`]).
    closed: bool,
    /// The close's code, until the driver has sent what was written before it (a
    /// CONNECTION_CLOSE drops whatever stream data is still unsent: the last frames, such as
    /// a graceful shutdown's Restarting, would be lost when a task closes before the driver
    /// had its turn).
    pub(super) close_pending: Option<u32>,
    handshake: Option<Waker>,
    accept: Option<Waker>,
    read: Option<Waker>,
    write: Option<Waker>,
    datagram_in: Option<Waker>,
    datagram_room: Option<Waker>,
    /// The registered client the driver routes this connection's datagrams as; `None`
    /// while they are for the read loop to take.
    pub(super) route_as: Option<Arc<ConnHandle>>,
    /// What the path's counts were when last added to the relay's metrics.
    reported: PathCounts,
    /// What the driver may send now.
    pub(super) pacer: Pacer,
}

/// A connection's path counts that the relay's metrics add up across connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PathCounts {
    /// QUIC packets sent.
    sent: u64,
    /// Sent packets declared lost.
    lost: u64,
    /// MTU black holes detected (each a fall back to the minimum MTU).
    black_holes: u64,
}

impl PathCounts {
    fn of(path: &quinn_proto::PathStats) -> Self {
        Self {
            sent: path.sent_packets,
            lost: path.lost_packets,
            black_holes: path.black_holes_detected,
        }
    }

    /// What was counted after `earlier`. quinn's counts only grow; one that went back adds
    /// nothing rather than wrapping.
    fn since(self, earlier: Self) -> Self {
        Self {
            sent: self.sent.saturating_sub(earlier.sent),
            lost: self.lost.saturating_sub(earlier.lost),
            black_holes: self.black_holes.saturating_sub(earlier.black_holes),
        }
    }
}

impl ConnState {
    pub(super) fn new(proto: quinn_proto::Connection) -> Self {
        Self {
            proto,
            stream: None,
            connected: false,
            lost: None,
            closed: false,
            close_pending: None,
            handshake: None,
            accept: None,
            read: None,
            write: None,
            datagram_in: None,
            datagram_room: None,
            route_as: None,
            reported: PathCounts::default(),
            pacer: Pacer::default(),
        }
    }

    /// Takes quinn-proto's application events and wakes whoever waits for them. Called by
    /// the driver after every change it made.
    pub(super) fn dispatch(&mut self) {
        while let Some(event) = self.proto.poll() {
            match event {
                Event::HandshakeDataReady => {}
                Event::Connected => {
                    self.connected = true;
                    wake(&mut self.handshake);
                }
                Event::ConnectionLost { reason } => {
                    self.lost.get_or_insert(reason);
                    self.wake_all();
                }
                Event::Stream(StreamEvent::Opened { dir: Dir::Bi }) => wake(&mut self.accept),
                Event::Stream(StreamEvent::Readable { .. }) => wake(&mut self.read),
                Event::Stream(
                    StreamEvent::Writable { .. }
                    | StreamEvent::Finished { .. }
                    | StreamEvent::Stopped { .. },
                ) => wake(&mut self.write),
                Event::Stream(_) => {}
                // The driver takes them itself when it routes them.
                Event::DatagramReceived if self.route_as.is_some() => {}
                Event::DatagramReceived => wake(&mut self.datagram_in),
                Event::DatagramsUnblocked => wake(&mut self.datagram_room),
            }
        }
    }

    fn wake_all(&mut self) {
        for w in [
            &mut self.handshake,
            &mut self.accept,
            &mut self.read,
            &mut self.write,
            &mut self.datagram_in,
            &mut self.datagram_room,
        ] {
            wake(w);
        }
    }

    fn error(&self) -> Option<ConnectionError> {
        self.lost.clone()
    }

    fn close(&mut self, code: u32) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.close_pending = Some(code);
        self.lost.get_or_insert(ConnectionError::LocallyClosed);
        self.wake_all();
    }
}

fn wake(slot: &mut Option<Waker>) {
    if let Some(w) = slot.take() {
        w.wake();
    }
}

fn park(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

impl ConnShared {
    pub(super) fn new(
        handle: ConnectionHandle,
        proto: quinn_proto::Connection,
        marks: Arc<Marks>,
    ) -> Self {
        Self {
            handle,
            state: Mutex::new(ConnState::new(proto)),
            marks,
            marked: AtomicBool::new(false),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, ConnState> {
        // quinn-proto's state is only changed by its own methods; a panic in one of them
        // is a bug that poisoning would turn into a panic in every other task.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes with an application `code` (the driver sends the CONNECTION_CLOSE).
    pub(super) fn close(self: &Arc<Self>, code: u32) {
        self.lock().close(code);
        self.mark();
    }

    /// Asks the driver to look at this connection: to send what was queued, or to act on
    /// a close.
    pub(super) fn mark(self: &Arc<Self>) {
        if !self.marked.swap(true, Ordering::AcqRel) {
            self.marks.push(self.clone());
        }
    }
}

/// Connections their tasks marked for the driver.
#[derive(Debug, Default)]
pub(crate) struct Marks {
    list: Mutex<Vec<Arc<ConnShared>>>,
    notify: Notify,
    /// The driver is in a pass and looks at the list before it waits: no need to wake
    /// it. Most marks come from the driver's own routing, for which a wake-up would be an
    /// empty round.
    busy: AtomicBool,
}

impl Marks {
    pub(super) fn push(&self, conn: Arc<ConnShared>) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        let first = list.is_empty();
        list.push(conn);
        drop(list);
        if first && !self.busy.load(Ordering::SeqCst) {
            self.notify.notify_one();
        }
    }

    /// Whether marks arrived since the driver last took them.
    pub(super) fn pending(&self) -> bool {
        !self
            .list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    pub(super) fn take(&self, into: &mut Vec<Arc<ConnShared>>) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        into.append(&mut list);
    }

    /// Waits for the first mark pushed while the driver is not busy.
    pub(super) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// Whether the driver is in a pass, and so needs no wake-up for a mark.
    pub(super) fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::SeqCst);
    }
}

/// A QUIC connection, held by the tasks that serve it. Dropping the last one closes the
/// connection (code 0) if it was not closed already.
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    owner: Arc<Owner>,
}

#[derive(Debug)]
struct Owner {
    shared: Arc<ConnShared>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        if !s.closed {
            s.close(0);
            drop(s);
            self.shared.mark();
        }
    }
}

impl Conn {
    pub(super) fn new(shared: Arc<ConnShared>) -> Self {
        Self {
            owner: Arc::new(Owner { shared }),
        }
    }

    fn shared(&self) -> &Arc<ConnShared> {
        &self.owner.shared
    }

    /// Completes when the QUIC handshake does.
    pub(crate) fn handshake(&self) -> impl Future<Output = Result<(), ConnectionError>> + '_ {
        std::future::poll_fn(move |cx| {
            let mut s = self.shared().lock();
            if s.connected {
                Poll::Ready(Ok(()))
            } else if let Some(e) = s.error() {
                Poll::Ready(Err(e))
            } else {
                park(&mut s.handshake, cx);
                Poll::Pending
            }
        })
    }

    /// Waits for the client's bidirectional stream.
    pub(crate) async fn accept_bi(&self) -> Result<(RecvHalf, SendHalf), ConnectionError> {
        let id = std::future::poll_fn(|cx| {
            let mut s = self.shared().lock();
            if let Some(id) = s.proto.streams().accept(Dir::Bi) {
                s.stream = Some(id);
                return Poll::Ready(Ok(id));
            }
            if let Some(e) = s.error() {
                return Poll::Ready(Err(e));
            }
            park(&mut s.accept, cx);
            Poll::Pending
        })
        .await?;
        Ok((
            RecvHalf {
                conn: self.clone(),
                id,
                done: false,
                reset: None,
            },
            SendHalf {
                conn: self.clone(),
                id,
            },
        ))
    }

    /// Where quinn-proto sends to now (validated or not).
    pub(crate) fn remote_address(&self) -> SocketAddr {
        self.shared().lock().proto.remote_address()
    }

    pub(crate) fn stats(&self) -> ConnectionStats {
        self.shared().lock().proto.stats()
    }

    /// Adds what the connection's path counted since the last call (packets sent and lost,
    /// MTU black holes) to the relay's QUIC path metrics.
    pub(crate) fn fold_path_counts(&self, metrics: &Metrics) {
        let mut s = self.shared().lock();
        let now = PathCounts::of(&s.proto.stats().path);
        let new = now.since(s.reported);
        s.reported = now;
        drop(s);
        metrics.quic_packets_sent.inc_by(new.sent);
        metrics.quic_packets_lost.inc_by(new.lost);
        metrics.quic_mtu_black_holes.inc_by(new.black_holes);
    }

    /// A copy of the connection's congestion controller when it is the loss filter: what it
    /// passed on to CUBIC and held back, for diagnostics.
    pub(crate) fn loss_filter(&self) -> Option<derp_io::quic::LossFilter> {
        let controller = self.shared().lock().proto.congestion_state().clone_box();
        controller.into_any().downcast().ok().map(|b| *b)
    }

    /// The largest datagram the peer and the path take now; `None` when the peer takes
    /// none.
    pub(crate) fn max_datagram_size(&self) -> Option<usize> {
        self.shared().lock().proto.datagrams().max_size()
    }

    /// A datagram already received, or a wait for one.
    pub(crate) fn poll_datagram(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Bytes, ConnectionError>> {
        let mut s = self.shared().lock();
        if let Some(d) = s.proto.datagrams().recv() {
            return Poll::Ready(Ok(d));
        }
        if let Some(e) = s.error() {
            return Poll::Ready(Err(e));
        }
        park(&mut s.datagram_in, cx);
        Poll::Pending
    }

    /// The datagrams already received, up to `max`, without waiting.
    pub(crate) fn take_datagrams(&self, out: &mut Vec<Bytes>, max: usize) -> usize {
        let mut s = self.shared().lock();
        let mut n = 0;
        while n < max {
            match s.proto.datagrams().recv() {
                Some(d) => {
                    out.push(d);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Queues `frame`'s datagram once quinn-proto's buffer has room for it, taking it out of
    /// `frame`; until then it stays there and the task waits (the congestion controller
    /// decides how fast the buffer drains).
    pub(crate) fn poll_send_datagram(
        &self,
        cx: &mut Context<'_>,
        frame: &mut Option<Bytes>,
    ) -> Poll<Result<(), DatagramError>> {
        let shared = self.shared();
        let mut s = shared.lock();
        if let Some(e) = s.error() {
            return Poll::Ready(Err(DatagramError::Lost(e)));
        }
        let datagram = frame.take().expect("polled again after it was sent");
        match queue_datagram(&mut s, datagram) {
            Ok(Ok(())) => {
                drop(s);
                shared.mark();
                Poll::Ready(Ok(()))
            }
            Ok(Err(datagram)) => {
                *frame = Some(datagram);
                park(&mut s.datagram_room, cx);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    /// Queues datagrams under one lock while quinn-proto's buffer has room, for a writer
    /// that has several to send at once; the driver is asked once, when the sender is
    /// dropped, to send them.
    pub(crate) fn datagram_sender(&self) -> DatagramSender<'_> {
        DatagramSender {
            shared: self.shared(),
            state: Some(self.shared().lock()),
            queued: false,
        }
    }

    /// Has the driver route this connection's datagrams as `handle`'s, or (`None`) leave
    /// them to the read loop again.
    pub(crate) fn route_in_driver(&self, handle: Option<Arc<ConnHandle>>) {
        let shared = self.shared();
        let mut s = shared.lock();
        s.route_as = handle;
        // Whatever is already buffered is for its new taker.
        wake(&mut s.datagram_in);
        drop(s);
        shared.mark();
    }

    /// Closes the connection with an application `code`; the driver sends the
    /// CONNECTION_CLOSE.
    pub(crate) fn close(&self, code: u32) {
        self.shared().close(code);
    }
}

/// Datagrams going into one connection under one lock ([`Conn::datagram_sender`]).
pub(crate) struct DatagramSender<'a> {
    shared: &'a Arc<ConnShared>,
    /// Always `Some` until dropped.
    state: Option<MutexGuard<'a, ConnState>>,
    queued: bool,
}

impl DatagramSender<'_> {
    /// Queues `frame` if quinn-proto's buffer has room now; `None` (the frame dropped) when
    /// it has not.
    pub(crate) fn try_send(&mut self, frame: Bytes) -> Option<Result<(), DatagramError>> {
        let s = self.state.as_mut().expect("held until dropped");
        if let Some(e) = s.error() {
            return Some(Err(DatagramError::Lost(e)));
        }
        match queue_datagram(s, frame) {
            Ok(Ok(())) => {
                self.queued = true;
                Some(Ok(()))
            }
            Ok(Err(_)) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// Puts one datagram in quinn-proto's buffer; `Ok(Err(frame))` when the buffer is full.
fn queue_datagram(s: &mut ConnState, frame: Bytes) -> Result<Result<(), Bytes>, DatagramError> {
    match s.proto.datagrams().send(frame, false) {
        Ok(()) => Ok(Ok(())),
        Err(quinn_proto::SendDatagramError::Blocked(frame)) => Ok(Err(frame)),
        Err(quinn_proto::SendDatagramError::TooLarge) => Err(DatagramError::TooLarge),
        Err(
            quinn_proto::SendDatagramError::UnsupportedByPeer
            | quinn_proto::SendDatagramError::Disabled,
        ) => Err(DatagramError::Unsupported),
    }
}

impl Drop for DatagramSender<'_> {
    fn drop(&mut self) {
        drop(self.state.take());
        if self.queued {
            self.shared.mark();
        }
    }
}

impl std::fmt::Debug for DatagramSender<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatagramSender").finish_non_exhaustive()
    }
}

fn reset_error(code: VarInt) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, ReadError::Reset(code))
}

fn lost(e: ConnectionError) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, e)
}

/// The receiving half of the DERP stream.
#[derive(Debug)]
pub(crate) struct RecvHalf {
    conn: Conn,
    id: StreamId,
    /// The stream ended (finished or reset): reads return 0 from now on.
    done: bool,
    /// The client reset the stream after bytes this read returned: the next read says so.
    reset: Option<VarInt>,
}

impl RecvHalf {
    /// Reads exactly `buf.len()` bytes.
    pub(crate) async fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        tokio::io::AsyncReadExt::read_exact(self, buf)
            .await
            .map(|_| ())
    }
}

impl AsyncRead for RecvHalf {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(code) = self.reset.take() {
            return Poll::Ready(Err(reset_error(code)));
        }
        if self.done || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let id = self.id;
        let shared = self.conn.shared().clone();
        let mut s = shared.lock();
        let mut stream = s.proto.recv_stream(id);
        let Ok(mut chunks) = stream.read(true) else {
            // Already finished and read to the end, or reset and reported.
            self.done = true;
            return Poll::Ready(Ok(()));
        };
        let mut got = 0;
        loop {
            if buf.remaining() == 0 {
                break;
            }
            match chunks.next(buf.remaining()) {
                Ok(Some(chunk)) => {
                    got += chunk.bytes.len();
                    buf.put_slice(&chunk.bytes);
                }
                Ok(None) => {
                    self.done = true;
                    break;
                }
                Err(ReadError::Blocked) => break,
                Err(ReadError::Reset(code)) => {
                    self.done = true;
                    self.reset = Some(code);
                    break;
                }
            }
        }
        let transmit = chunks.finalize().should_transmit();
        if got == 0 && !self.done {
            if let Some(e) = s.error() {
                return Poll::Ready(Err(lost(e)));
            }
            park(&mut s.read, cx);
            drop(s);
            if transmit {
                shared.mark();
            }
            return Poll::Pending;
        }
        drop(s);
        if transmit {
            shared.mark();
        }
        if got == 0
            && let Some(code) = self.reset.take()
        {
            return Poll::Ready(Err(reset_error(code)));
        }
        // A reset after bytes is reported by the next read.
        Poll::Ready(Ok(()))
    }
}

/// The sending half of the DERP stream. A vectored write goes in under one lock.
#[derive(Debug)]
pub(crate) struct SendHalf {
    conn: Conn,
    id: StreamId,
}

impl SendHalf {
    fn poll_write_slices(&self, cx: &mut Context<'_>, bufs: &[&[u8]]) -> Poll<io::Result<usize>> {
        let shared = self.conn.shared();
        let mut s = shared.lock();
        if let Some(e) = s.error() {
            return Poll::Ready(Err(lost(e)));
        }
        let mut total = 0;
        let mut stream = s.proto.send_stream(self.id);
        for b in bufs.iter().filter(|b| !b.is_empty()) {
            match stream.write(b) {
                Ok(n) => {
                    total += n;
                    if n < b.len() {
                        break;
                    }
                }
                Err(WriteError::Blocked) => break,
                Err(WriteError::Stopped(code)) => {
                    if total > 0 {
                        break;
                    }
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        WriteError::Stopped(code),
                    )));
                }
                Err(WriteError::ClosedStream) => {
                    if total > 0 {
                        break;
                    }
                    return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
                }
            }
        }
        if total == 0 && bufs.iter().any(|b| !b.is_empty()) {
            park(&mut s.write, cx);
            return Poll::Pending;
        }
        drop(s);
        shared.mark();
        Poll::Ready(Ok(total))
    }
}

impl AsyncWrite for SendHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_slices(cx, &[buf])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let parts = slices::Slices::new(bufs);
        self.poll_write_slices(cx, parts.as_slice())
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let shared = self.conn.shared();
        let _ = shared.lock().proto.send_stream(self.id).finish();
        shared.mark();
        Poll::Ready(Ok(()))
    }
}

mod slices {
    //! `&[IoSlice]` as `&[&[u8]]` without allocating for the usual few slices.
    use std::io::IoSlice;

    const INLINE: usize = 64;

    pub(super) struct Slices<'a> {
        inline: [&'a [u8]; INLINE],
        len: usize,
    }

    impl<'a> Slices<'a> {
        pub(super) fn new(bufs: &'a [IoSlice<'a>]) -> Self {
            let mut inline: [&'a [u8]; INLINE] = [&[]; INLINE];
            let len = bufs.len().min(INLINE);
            for (slot, b) in inline.iter_mut().zip(bufs) {
                *slot = b;
            }
            Self { inline, len }
        }

        pub(super) fn as_slice(&self) -> &[&'a [u8]] {
            &self.inline[..self.len]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PathCounts;

    fn counts(sent: u64, lost: u64, black_holes: u64) -> PathCounts {
        PathCounts {
            sent,
            lost,
            black_holes,
        }
    }

    /// Each fold adds only what came after the one before, so the metrics count every
    /// packet once however often a connection is folded.
    #[test]
    fn successive_folds_add_each_count_once() {
        let mut reported = PathCounts::default();
        let mut total = PathCounts::default();
        for now in [counts(10, 1, 0), counts(10, 1, 0), counts(25, 4, 1)] {
            let new = now.since(reported);
            reported = now;
            total.sent += new.sent;
            total.lost += new.lost;
            total.black_holes += new.black_holes;
        }
        assert_eq!(total, counts(25, 4, 1));
    }

    #[test]
    fn a_count_that_went_back_adds_nothing() {
        assert_eq!(counts(5, 2, 0).since(counts(7, 1, 1)), counts(0, 1, 0));
    }
}
