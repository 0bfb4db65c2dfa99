//! The write half of a connection: it drains the connection's queues in batches and writes
//! each batch with one vectored write, flushing only when nothing else is ready.
//!
//! An idle connection's writer is parked in its queue. A sender that queues a packet for it
//! takes it along and, at the end of its read batch, has it write right away on the sender's
//! task ([`Writer::try_write_now`], polled once with a no-op waker, so it never waits). Only
//! when the socket cannot take everything at once does the writer get a task of its own, which
//! finishes the batch under the write deadline and parks again when the queue is empty. A lone
//! packet thus goes from one client's socket to another's without a task switch.
//!
//! A batch goes through three steps: [`Writer::begin_batch`] lays out the frame headers and
//! the order of the pieces, the write ([`Writer::write_stream`] in the task,
//! [`Writer::try_write_now`] inline) hands them to the transport from where the last attempt
//! stopped, and [`Writer::account`] counts what was sent and, after a failed write,
//! [`Writer::account_failed`] what was dropped: a packet whose frame was handed to the
//! transport in full before the failure (or went out in a QUIC datagram) counts as sent,
//! since the peer may well read it; the rest as `write_error`.

use std::collections::HashSet;
use std::io::{self, IoSlice};
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::BytesMut;
use derp_io::WriteHalf;
use derp_proto::{PeerGoneReason, PublicKey, RelayToClient, frame, ws};
use quinn::SendDatagramError;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tracing::debug;

use super::{Framing, count_gone};
use crate::handle::ConnHandle;
use crate::metrics::{DropReason, FallbackReason, PacketKind};
use crate::queue::{Batch, Control, Resume};
use crate::quic::QuicLink;
use crate::state::ServerState;

/// A connection's writer. It runs as a task only while the socket pushes back; otherwise it
/// is parked in its queue and senders have it write inline, so idle connections cost one
/// task, not two, and a lone packet costs no task switch.
pub(super) struct Writer {
    shared: Arc<ServerState>,
    handle: Arc<ConnHandle>,
    w: WriteHalf,
    framing: Framing,
    write_timeout: Option<Duration>,
    batch: Batch,
    /// Frame headers for the current batch; the payloads are written from their own buffers.
    headers: Vec<u8>,
    /// Sources this connection has received from; each is registered once for PeerGone.
    sent_from: HashSet<PublicKey, foldhash::fast::RandomState>,
    /// A QUIC connection's datagram side and migration gate.
    quic: Option<Arc<QuicLink>>,
    /// Packets of the current batch that go in QUIC datagrams rather than on the stream.
    datagrams: Vec<(PacketKind, usize)>,
    /// Those of them sent so far.
    datagrams_sent: Vec<(PacketKind, usize)>,
    /// The pieces of the current batch in write order, while one is being written.
    segs: Vec<Seg>,
    /// What the current batch holds, for its accounting.
    framed: Framed,
    /// A batch is framed and not yet all handed to the transport.
    in_batch: bool,
    /// Bytes of the current batch's stream pieces the transport has taken.
    progress: usize,
    /// The last take found the queue still open.
    open: bool,
    /// An inline write failed; the task reports it when it starts.
    failed: Option<io::Error>,
    /// QUIC: the last take left the packets queued, the client's address not being
    /// validated yet.
    held_back: bool,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("id", &self.handle.id)
            .finish()
    }
}

/// How a writer's run ended.
enum Step {
    /// Nothing to write for a while: park.
    Idle,
    /// The connection is closing.
    Closed,
}

impl Resume for Writer {
    /// Gives back what a burst grew the batch and the scratch buffers to, so an idle
    /// connection holds only small ones.
    fn shrink_idle(&mut self) {
        self.batch.shrink_idle();
        self.w.shrink_idle();
        if self.headers.capacity() > MAX_IDLE_HEADER_CAPACITY {
            self.headers = Vec::new();
        }
        if self.segs.capacity() > MAX_IDLE_SEGS {
            self.segs = Vec::new();
        }
        if self.datagrams.capacity() > MAX_IDLE_SEGS {
            self.datagrams = Vec::new();
            self.datagrams_sent = Vec::new();
        }
    }

    fn resume(self: Box<Self>) {
        let tasks = self.shared.tasks.clone();
        tasks.spawn(self.run());
    }

    fn can_write_inline(&self) -> bool {
        // QUIC datagrams are sent by awaiting quinn; everything else is a byte stream that
        // can be polled once.
        self.quic.is_none()
    }

    fn write_inline(mut self: Box<Self>) {
        match self.try_write_now() {
            Poll::Ready(Ok(())) => {
                let handle = self.handle.clone();
                if let Err(back) = handle.queue.park(self) {
                    // More arrived, or the connection is closing: the task takes over.
                    back.resume();
                }
            }
            Poll::Ready(Err(e)) => {
                self.failed = Some(e);
                self.resume();
            }
            // The socket pushed back: the task finishes the batch, waiting for it.
            Poll::Pending => self.resume(),
        }
    }
}

impl Writer {
    /// Starts the writer for a connection whose ServerInfo has been written.
    pub(super) fn start(
        shared: Arc<ServerState>,
        handle: Arc<ConnHandle>,
        w: WriteHalf,
        framing: Framing,
        write_timeout: Option<Duration>,
        quic: Option<Arc<QuicLink>>,
    ) {
        let writer = Box::new(Self {
            shared,
            handle: handle.clone(),
            w,
            framing,
            write_timeout,
            batch: Batch::default(),
            headers: Vec::new(),
            sent_from: HashSet::default(),
            quic,
            datagrams: Vec::new(),
            datagrams_sent: Vec::new(),
            segs: Vec::new(),
            framed: Framed::default(),
            in_batch: false,
            progress: 0,
            open: true,
            failed: None,
            held_back: false,
        });
        if let Err(writer) = handle.queue.park(writer) {
            writer.resume();
        }
    }

    async fn run(mut self: Box<Self>) {
        loop {
            match self.serve().await {
                Ok(Step::Idle) => {
                    let handle = self.handle.clone();
                    match handle.queue.park(self) {
                        Ok(()) => return,
                        // Work arrived between the drain and the park.
                        Err(back) => self = back,
                    }
                }
                Ok(Step::Closed) => return self.finish(None).await,
                Err(e) => return self.finish(Some(e)).await,
            }
        }
    }

    /// Writes until the queue is empty (then the writer parks, and senders write inline
    /// again) or the connection closes.
    async fn serve(&mut self) -> io::Result<Step> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        loop {
            if !self.drain().await? {
                return Ok(Step::Closed);
            }
            if !self.held_back {
                return Ok(Step::Idle);
            }
            // QUIC packets held back until the client's new address is validated: the path
            // watcher queues a probe, which wakes this writer, until it is.
            let handle = self.handle.clone();
            tokio::select! {
                biased;
                _ = handle.cancel.cancelled() => return Ok(Step::Closed),
                _ = handle.queue.wait() => {}
            }
        }
    }

    /// Ends the connection's writing side: counts what is left, drops PeerGone watches and
    /// closes the socket, each bounded in time.
    async fn finish(mut self: Box<Self>, error: Option<io::Error>) {
        let (shared, handle) = (&self.shared, &self.handle);
        if let Some(e) = error {
            if e.kind() == io::ErrorKind::TimedOut {
                shared.metrics.write_timeouts.inc();
                if let Some(link) = &self.quic {
                    link.note_write_timeout();
                }
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

/// Where one piece of a vectored write comes from.
enum Seg {
    /// A range of the header scratch buffer (frame headers and whole control frames).
    Header(Range<usize>),
    /// The payload of the packet at this index of one of the batch's packet queues.
    Payload(PacketKind, usize),
}

/// What a framed batch holds, for the accounting after the write.
#[derive(Default)]
struct Framed {
    frames: usize,
    packets: u64,
    packet_bytes: u64,
    pongs: u64,
    /// PeerGone frames, indexed by `[Disconnected, NotHere]`.
    gone: [u64; 2],
    /// The moving average of queueing time with this batch's packets folded in.
    average_wait_ms: f64,
    /// Packets sent in QUIC datagrams.
    datagrams: u64,
    /// Packets to QUIC clients that went on the stream, indexed by [`FallbackReason`].
    fallbacks: [u64; 2],
}

impl Writer {
    /// Writes batches until nothing is pending, starting with the one an inline write left
    /// unfinished. Returns false once the connection is closed.
    async fn drain(&mut self) -> io::Result<bool> {
        loop {
            if !self.in_batch {
                self.take_batch();
                if self.batch.is_empty() {
                    return Ok(self.open);
                }
                self.begin_batch();
            }
            let frames = self.write_batch().await?;
            self.shared
                .metrics
                .buffered_write_frames
                .observe(frames as f64);
            if !self.open {
                return Ok(false);
            }
        }
    }

    /// Takes what is queued into the batch: everything, or for a QUIC client whose address
    /// is not validated only the control frames.
    fn take_batch(&mut self) {
        self.held_back = false;
        self.open = match &self.quic {
            None => self.handle.queue.take(&mut self.batch),
            Some(link) => {
                if link.check_path(&self.handle, &self.shared.metrics) {
                    self.handle.queue.take(&mut self.batch)
                } else {
                    self.held_back = true;
                    // The client's address is not validated: its packets wait in the queue
                    // (the path watcher wakes this writer until it is).
                    self.handle.queue.take_control(&mut self.batch)
                }
            }
        };
    }

    /// Writes what is queued without waiting, with a no-op waker: on the task of a sender
    /// that found this writer parked. `Ready(Ok)` when the transport took everything (and
    /// another sender's packets that arrived meanwhile, up to [`INLINE_BATCHES`] batches);
    /// `Pending` when it pushed back, with the batch's progress kept for the task to finish.
    fn try_write_now(&mut self) -> Poll<io::Result<()>> {
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..INLINE_BATCHES {
            if !self.in_batch {
                self.take_batch();
                if self.batch.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                self.begin_batch();
            }
            let total = self.stream_len();
            while self.progress < total {
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let n = gather(
                    &self.segs,
                    &self.headers,
                    &self.batch,
                    self.progress,
                    &mut iov,
                );
                match Pin::new(&mut self.w).poll_write_vectored(&mut cx, &iov[..n]) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(self.fail(io::ErrorKind::WriteZero.into()));
                    }
                    Poll::Ready(Ok(written)) => self.progress += written,
                    Poll::Ready(Err(e)) => return Poll::Ready(self.fail(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            match Pin::new(&mut self.w).poll_flush(&mut cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => {
                    // What a layer above the socket (TLS) still buffered is lost.
                    self.progress = 0;
                    return Poll::Ready(self.fail(e));
                }
                Poll::Pending => return Poll::Pending,
            }
            let frames = self.framed.frames;
            self.end_batch(true);
            self.shared
                .metrics
                .buffered_write_frames
                .observe(frames as f64);
            if !self.open {
                // Closing: the park fails and the task closes the socket.
                return Poll::Ready(Ok(()));
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Accounts the current batch as failed and returns the error.
    fn fail(&mut self, e: io::Error) -> io::Result<()> {
        self.end_batch(false);
        Err(e)
    }

    /// Writes the current batch (from where an inline attempt stopped), then flushes once.
    /// Returns the number of frames written.
    async fn write_batch(&mut self) -> io::Result<usize> {
        let mut result = Ok(());
        if !self.datagrams.is_empty() {
            result = self.send_datagrams().await;
        }
        if result.is_ok() {
            result = self.write_stream().await;
        }
        let frames = self.framed.frames;
        self.end_batch(result.is_ok());
        result.map(|()| frames)
    }

    /// Accounts the current batch, sent or failed, and makes ready for the next.
    fn end_batch(&mut self, written: bool) {
        let framed = std::mem::take(&mut self.framed);
        if written {
            self.account(&framed);
        } else {
            self.account_failed(self.progress);
        }
        self.in_batch = false;
        self.progress = 0;
        self.recycle();
    }

    /// Sends the batch's datagram packets, each under the write deadline. A frame that no
    /// longer fits (the path MTU shrank since it was framed) goes on the stream instead.
    async fn send_datagrams(&mut self) -> io::Result<()> {
        let Some(link) = self.quic.clone() else {
            return Ok(());
        };
        let cancel = self.handle.cancel.clone();
        let far = Duration::from_secs(86_400);
        let deadline = tokio::time::sleep(self.write_timeout.unwrap_or(far));
        tokio::pin!(deadline);
        for n in 0..self.datagrams.len() {
            let (kind, i) = self.datagrams[n];
            let p = match kind {
                PacketKind::Disco => &self.batch.disco[i],
                PacketKind::Other => &self.batch.other[i],
            };
            let mut out = BytesMut::with_capacity(frame::FRAME_HEADER_LEN + 32 + p.data.len());
            out.extend_from_slice(&frame::recv_packet_header(&p.src, p.data.len()));
            out.extend_from_slice(&p.data);
            let sent = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "connection closed while writing",
                )),
                _ = &mut deadline => return Err(io::ErrorKind::TimedOut.into()),
                r = link.send_datagram(out.freeze()) => r,
            };
            match sent {
                Ok(()) => {
                    self.framed.datagrams += 1;
                    self.datagrams_sent.push((kind, i));
                }
                Err(SendDatagramError::TooLarge) => {
                    let start = self.headers.len();
                    self.headers
                        .extend_from_slice(&frame::recv_packet_header(&p.src, p.data.len()));
                    self.segs.push(Seg::Header(start..self.headers.len()));
                    self.segs.push(Seg::Payload(kind, i));
                    self.framed.fallbacks[FallbackReason::TooLarge as usize] += 1;
                }
                Err(e) => return Err(io::Error::other(e)),
            }
            if let Some(t) = self.write_timeout {
                deadline.as_mut().reset(Instant::now() + t);
            }
        }
        Ok(())
    }

    /// Lays the batch out as frames: control frames and headers go into the scratch buffer,
    /// payloads stay where they are, and `segs` lists the pieces in write order.
    fn begin_batch(&mut self) {
        self.headers.clear();
        self.segs.clear();
        self.in_batch = true;
        self.progress = 0;
        let segs = &mut self.segs;
        let framing = self.framing;
        let mut framed = Framed {
            average_wait_ms: self.shared.metrics.average_queue_duration_ms.get(),
            ..Framed::default()
        };
        for control in self.batch.control.drain(..) {
            let start = self.headers.len();
            match control {
                Control::PeerGone(peer, reason) => {
                    match reason {
                        PeerGoneReason::NotHere => framed.gone[1] += 1,
                        _ => {
                            framed.gone[0] += 1;
                            // If the peer comes back and sends again, watch it again.
                            self.sent_from.remove(&peer);
                        }
                    }
                    push_frame(
                        &mut self.headers,
                        framing,
                        &RelayToClient::PeerGone { peer, reason },
                    );
                }
                Control::PeerPresent { peer, addr, flags } => push_frame(
                    &mut self.headers,
                    framing,
                    &RelayToClient::PeerPresent { peer, addr, flags },
                ),
                Control::KeepAlive => {
                    push_frame(&mut self.headers, framing, &RelayToClient::KeepAlive)
                }
                Control::Restarting {
                    reconnect_in_ms,
                    try_for_ms,
                } => push_frame(
                    &mut self.headers,
                    framing,
                    &RelayToClient::Restarting {
                        reconnect_in_ms,
                        try_for_ms,
                    },
                ),
                Control::WsPong(payload) => {
                    self.headers
                        .extend_from_slice(&ws::control_frame(ws::Opcode::Pong, &payload));
                }
                Control::ObservedAddr(addr) => push_frame(
                    &mut self.headers,
                    framing,
                    &RelayToClient::ObservedAddr(addr),
                ),
            }
            segs.push(Seg::Header(start..self.headers.len()));
            framed.frames += 1;
        }
        if let Some(data) = self.batch.pong.take() {
            let start = self.headers.len();
            push_frame(&mut self.headers, framing, &RelayToClient::Pong(data));
            segs.push(Seg::Header(start..self.headers.len()));
            framed.frames += 1;
            framed.pongs += 1;
        }
        let now = Instant::now();
        // QUIC: `Some(limit)`, where the limit is `None` when the client takes no datagrams.
        let datagram_limit = self.quic.as_ref().map(|link| link.max_datagram_frame());
        self.datagrams.clear();
        self.datagrams_sent.clear();
        for (kind, queue) in [
            (PacketKind::Disco, &self.batch.disco),
            (PacketKind::Other, &self.batch.other),
        ] {
            for (i, p) in queue.iter().enumerate() {
                let waited = now.saturating_duration_since(p.enqueued).as_secs_f64() * 1000.0;
                framed.average_wait_ms = framed.average_wait_ms * 0.9 + waited * 0.1;
                framed.packets += 1;
                framed.packet_bytes += p.data.len() as u64;
                framed.frames += 1;
                if let Some(limit) = datagram_limit {
                    match limit {
                        Some(max) if frame::FRAME_HEADER_LEN + 32 + p.data.len() <= max => {
                            self.datagrams.push((kind, i));
                            continue;
                        }
                        Some(_) => framed.fallbacks[FallbackReason::TooLarge as usize] += 1,
                        None => framed.fallbacks[FallbackReason::NoDatagrams as usize] += 1,
                    }
                }
                let start = self.headers.len();
                if framing == Framing::WebSocket {
                    let (hdr, n) = ws::binary_header(frame::FRAME_HEADER_LEN + 32 + p.data.len());
                    self.headers.extend_from_slice(&hdr[..n]);
                }
                self.headers
                    .extend_from_slice(&frame::recv_packet_header(&p.src, p.data.len()));
                segs.push(Seg::Header(start..self.headers.len()));
                segs.push(Seg::Payload(kind, i));
            }
        }
        self.framed = framed;
    }

    /// Bytes of the current batch that go on the stream.
    fn stream_len(&self) -> usize {
        self.segs
            .iter()
            .map(|s| match s {
                Seg::Header(range) => range.len(),
                Seg::Payload(PacketKind::Disco, i) => self.batch.disco[*i].data.len(),
                Seg::Payload(PacketKind::Other, i) => self.batch.other[*i].data.len(),
            })
            .sum()
    }

    /// Writes the pieces in order from where the last attempt stopped, with as few `writev`
    /// calls as the socket allows, then flushes. Each write call has the deadline, and a
    /// write blocked on a peer that does not read still ends when the connection is closed
    /// (shutdown, ClosePeer, the read side ending). After a failed flush `progress` is 0:
    /// what a layer above the socket (TLS) still buffered is lost.
    async fn write_stream(&mut self) -> io::Result<()> {
        let total = self.stream_len();
        let timeout = self.write_timeout;
        while self.progress < total {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let n = gather(
                &self.segs,
                &self.headers,
                &self.batch,
                self.progress,
                &mut iov,
            );
            let write = timed(timeout, self.w.write_vectored(&iov[..n]));
            let written = tokio::select! {
                biased;
                _ = self.handle.cancel.cancelled() => Err(aborted()),
                r = write => r,
            }?;
            if written == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            self.progress += written;
        }
        let flush = timed(timeout, self.w.flush());
        let flushed = tokio::select! {
            biased;
            _ = self.handle.cancel.cancelled() => Err(aborted()),
            r = flush => r,
        };
        if flushed.is_err() {
            self.progress = 0;
        }
        flushed
    }

    /// After a failed write: the packets sent in QUIC datagrams and those whose frames lay
    /// entirely within the first `handed_over` bytes of the stream count as sent, the others
    /// as dropped (`write_error`).
    fn account_failed(&self, handed_over: usize) {
        let segs = &self.segs;
        let m = &self.shared.metrics;
        let mut sent = [
            vec![false; self.batch.disco.len()],
            vec![false; self.batch.other.len()],
        ];
        for &(kind, i) in &self.datagrams_sent {
            sent[kind as usize][i] = true;
        }
        let mut offset = 0;
        for seg in segs {
            match seg {
                Seg::Header(range) => offset += range.len(),
                Seg::Payload(kind, i) => {
                    let queue = match kind {
                        PacketKind::Disco => &self.batch.disco,
                        PacketKind::Other => &self.batch.other,
                    };
                    offset += queue[*i].data.len();
                    if offset <= handed_over {
                        sent[*kind as usize][*i] = true;
                    }
                }
            }
        }
        let (mut packets, mut bytes) = (0, 0);
        for (queue, kind) in [
            (&self.batch.disco, PacketKind::Disco),
            (&self.batch.other, PacketKind::Other),
        ] {
            for (p, sent) in queue.iter().zip(&sent[kind as usize]) {
                if *sent {
                    packets += 1;
                    bytes += p.data.len() as u64;
                } else {
                    m.drop_one(DropReason::WriteError, kind, p.data.len());
                }
            }
        }
        if packets > 0 && self.shared.config.packet_metrics {
            m.packets_sent.inc_by(packets);
            m.bytes_sent.inc_by(bytes);
        }
        if !self.datagrams_sent.is_empty() {
            m.quic_datagrams_sent
                .inc_by(self.datagrams_sent.len() as u64);
        }
    }

    /// Counts a written batch into the metrics and watches its sources for PeerGone.
    fn account(&mut self, framed: &Framed) {
        let shared = self.shared.clone();
        let m = &shared.metrics;
        if framed.packets > 0 {
            self.note_sources();
            if shared.config.packet_metrics {
                m.packets_sent.inc_by(framed.packets);
                m.bytes_sent.inc_by(framed.packet_bytes);
                m.average_queue_duration_ms.set(framed.average_wait_ms);
            }
        }
        if framed.pongs > 0 {
            m.sent_pong.inc_by(framed.pongs);
        }
        if framed.datagrams > 0 {
            m.quic_datagrams_sent.inc_by(framed.datagrams);
        }
        for (counter, n) in m.quic_stream_fallbacks.iter().zip(framed.fallbacks) {
            if n > 0 {
                counter.inc_by(n);
            }
        }
        if framed.gone[0] > 0 {
            m.peer_gone_disconnected_frames.inc_by(framed.gone[0]);
        }
        if framed.gone[1] > 0 {
            m.peer_gone_not_here_frames.inc_by(framed.gone[1]);
        }
    }

    /// Registers this connection as a PeerGone watcher of every new source in the batch.
    fn note_sources(&mut self) {
        for p in self.batch.disco.iter().chain(self.batch.other.iter()) {
            if !self.sent_from.contains(&p.src) {
                self.sent_from.insert(p.src);
                self.shared
                    .registry
                    .watch_peer_gone(p.src, p.forwarded, &self.handle);
            }
        }
    }

    /// Empties the batch but keeps its queues' capacity for the next swap.
    fn recycle(&mut self) {
        self.batch.disco.clear();
        self.batch.other.clear();
        self.batch.control.clear();
    }
}

fn push_frame(out: &mut Vec<u8>, framing: Framing, frame: &RelayToClient) {
    if framing == Framing::WebSocket {
        let (hdr, n) = ws::binary_header(frame.encoded_len());
        out.extend_from_slice(&hdr[..n]);
    }
    frame.encode(out);
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

/// Fills `iov` with the pieces of the batch from byte `progress` on; returns how many it
/// filled (at most [`MAX_IOV`]; the rest go in the next call).
fn gather<'a>(
    segs: &[Seg],
    headers: &'a [u8],
    batch: &'a Batch,
    progress: usize,
    iov: &mut [IoSlice<'a>; MAX_IOV],
) -> usize {
    let mut skip = progress;
    let mut n = 0;
    for seg in segs {
        let bytes: &[u8] = match seg {
            Seg::Header(range) => &headers[range.clone()],
            Seg::Payload(PacketKind::Disco, i) => &batch.disco[*i].data,
            Seg::Payload(PacketKind::Other, i) => &batch.other[*i].data,
        };
        if skip >= bytes.len() {
            skip -= bytes.len();
            continue;
        }
        iov[n] = IoSlice::new(&bytes[skip..]);
        skip = 0;
        n += 1;
        if n == MAX_IOV {
            break;
        }
    }
    n
}

/// A write under the deadline, if there is one.
async fn timed<T>(
    timeout: Option<Duration>,
    write: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match timeout {
        Some(t) => tokio::time::timeout(t, write)
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
        None => write.await,
    }
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed while writing",
    )
}

/// Most pieces handed to one `writev`; a batch with more takes several calls.
const MAX_IOV: usize = 64;
/// Most batches a sender writes inline for one destination before leaving the rest to the
/// destination's own task: a sender does others' work only briefly.
const INLINE_BATCHES: usize = 2;
/// Header scratch above this size is released when the writer parks (a few packets' worth
/// is kept, so a steady trickle allocates nothing).
const MAX_IDLE_HEADER_CAPACITY: usize = 512;
/// Piece lists longer than this are released when the writer parks.
const MAX_IDLE_SEGS: usize = 16;
/// How long a closing connection may take to accept its last bytes (a WebSocket close frame,
/// a TLS close_notify).
const WS_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
