//! The read half of a connection: bytes off the socket, frames out of the bytes, and each
//! packet routed to its destination's queue.
//!
//! The read loop runs on the connection's own task. It reads as much as the socket holds,
//! parses every complete frame in the buffer, and hands each packet to its destination's
//! queue as a `Bytes` slice of the read buffer (no copy between sockets, except after tiny
//! reads).

use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_io::ReadHalf;
use derp_proto::frame::FrameType;
use derp_proto::ws::{self, Role, WsDecoder, WsEvent};
use derp_proto::{ClientToRelay, PeerGoneReason, PublicKey, ServerDecoder};
use rand::Rng;
use tokio::io::AsyncReadExt;
use tokio::time::{Instant, Sleep};
use tracing::{debug, trace};

use super::{ConnError, Framing, PeerMisbehaved};
use crate::handle::ConnHandle;
use crate::lookup::{Route, Router};
use crate::metrics::{DropReason, PacketKind, ReaderCounts};
use crate::queue::{Control, Inline, Packet};
use crate::quic::QuicLink;
use crate::ratelimit::ClientLimiter;
use crate::state::ServerState;

/// The read side: raw bytes from the socket, unwrapped from WebSocket messages when needed,
/// accumulate in `buf` as a DERP byte stream.
pub(super) struct FrameReader {
    half: ReadHalf,
    pub(super) buf: BytesMut,
    /// Boxed, like `quic`, so a plain TCP connection pays one pointer for each.
    ws: Option<Box<WsIn>>,
    /// The close code to answer with, once the WebSocket layer has one.
    pub(super) ws_close: Option<u16>,
    /// A QUIC connection's datagrams, once its handshake is done.
    quic: Option<Box<QuicIn>>,
}

struct QuicIn {
    link: Arc<QuicLink>,
    /// Datagrams read and not yet handled.
    datagrams: Vec<Bytes>,
}

struct WsIn {
    decoder: WsDecoder,
    raw: BytesMut,
}

impl FrameReader {
    pub(super) fn new(half: ReadHalf, framing: Framing, initial: BytesMut) -> Self {
        match framing {
            Framing::WebSocket => Self {
                half,
                buf: BytesMut::new(),
                ws: Some(Box::new(WsIn {
                    decoder: WsDecoder::new(Role::Server),
                    raw: initial,
                })),
                ws_close: None,
                quic: None,
            },
            Framing::Raw => Self {
                half,
                buf: initial,
                ws: None,
                ws_close: None,
                quic: None,
            },
        }
    }

    /// From now on, reads also take the QUIC connection's datagrams. Datagrams the client
    /// sent before its handshake completed are dropped; returns how many.
    pub(super) fn attach_quic(&mut self, link: Arc<QuicLink>) -> u64 {
        let early = link.registered();
        self.quic = Some(Box::new(QuicIn {
            link,
            datagrams: Vec::new(),
        }));
        early
    }

    /// The QUIC connection's link, for a connection over QUIC.
    pub(super) fn quic_link(&self) -> Option<Arc<QuicLink>> {
        self.quic.as_ref().map(|q| q.link.clone())
    }

    /// Datagrams read since the last call (QUIC only).
    fn take_datagrams(&mut self) -> Option<Vec<Bytes>> {
        let q = self.quic.as_mut()?;
        (!q.datagrams.is_empty()).then(|| std::mem::take(&mut q.datagrams))
    }

    /// Reads once from the socket and appends what it yields to `buf`. Returns 0 at EOF.
    /// WebSocket pings are answered through `handle` when one is given.
    pub(super) async fn read_more(
        &mut self,
        handle: Option<&ConnHandle>,
        chunk: usize,
    ) -> Result<usize, ConnError> {
        if let Some(q) = &mut self.quic {
            if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE {
                self.buf.reserve(chunk);
            }
            // Stream bytes or datagrams, whichever come first (unbiased: a busy stream must
            // not starve the datagrams).
            return tokio::select! {
                n = self.half.read_buf(&mut self.buf) => {
                    let n = n?;
                    if n == 0 {
                        q.link.note_client_finished();
                    }
                    Ok(n)
                }
                n = q.link.read_datagrams(&mut q.datagrams) => Ok(n?),
            };
        }
        let Some(ws_in) = &mut self.ws else {
            self.half.ready().await?;
            if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE {
                self.buf.reserve(chunk);
            }
            return Ok(self.half.read_buf(&mut self.buf).await?);
        };
        loop {
            // Drain frames already buffered before reading again.
            let before = self.buf.len();
            let event = ws_in.decoder.decode(&mut ws_in.raw, &mut self.buf);
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    self.ws_close = Some(e.close_code());
                    return Err(e.into());
                }
            };
            match event {
                WsEvent::Ping(payload) => {
                    if let Some(h) = handle {
                        h.queue.push_control(Control::WsPong(payload));
                    }
                    continue;
                }
                WsEvent::Close { code } => {
                    // Echo the client's code, as the reference does. Data that came before
                    // the close is still handed over; the decoder repeats the close event on
                    // the next call.
                    self.ws_close = Some(code.unwrap_or(ws::close_code::NORMAL));
                    return Ok(self.buf.len() - before);
                }
                WsEvent::NeedMore => {}
            }
            let produced = self.buf.len() - before;
            if produced > 0 {
                return Ok(produced);
            }
            self.half.ready().await?;
            if ws_in.raw.capacity() - ws_in.raw.len() < MIN_READ_SPACE {
                ws_in.raw.reserve(chunk);
            }
            if self.half.read_buf(&mut ws_in.raw).await? == 0 {
                return Ok(0);
            }
        }
    }

    /// Whether this reader can wait for the socket to become readable holding nothing:
    /// nothing is buffered, and the transport can tell readiness (plain TCP or TLS 1.3, with
    /// or without WebSocket framing; not rustls's TLS 1.2 stream, whose records may hold
    /// bytes the socket no longer does, nor QUIC, whose datagrams arrive apart from the
    /// stream).
    pub(super) fn can_wait_idle(&self) -> bool {
        self.quic.is_none()
            && self.half.tells_readiness()
            && self.buf.is_empty()
            && self.ws_close.is_none()
            && self
                .ws
                .as_ref()
                .is_none_or(|ws| ws.raw.is_empty() && ws.decoder.needs_input())
    }

    /// Whether the socket has bytes to read (see [`FrameReader::can_wait_idle`]).
    fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.half.poll_readable(cx)
    }

    /// Gives back an empty buffer's memory, so an idle connection holds no read buffer.
    /// Packets still queued elsewhere keep their slices of the old allocation alive.
    fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
        self.half.release_idle();
        if let Some(ws_in) = &mut self.ws
            && ws_in.raw.is_empty()
            && ws_in.raw.capacity() > 0
        {
            ws_in.raw = BytesMut::new();
        }
    }
}

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
struct NotHereLimiter {
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

/// How a busy stretch of the read loop ended.
enum Stretch {
    /// The connection is to end.
    Ended,
    /// Nothing was read for a keepalive period: wait for traffic holding little.
    Quiet,
}

/// How a [`QuietWait`] ended.
enum Quiet {
    /// The socket has something to read.
    Readable,
    /// The connection is to end (cancelled, or the server is draining).
    Ended,
}

/// The read loop's wait for traffic on a quiet connection, queueing keepalives meanwhile.
///
/// Every idle connection's task is parked here, so it is written by hand to hold as little
/// as possible: the loop and the keepalive timer. The socket keeps the waker for
/// readability and the connection's handle keeps it for cancellation; a graceful shutdown
/// beginning is seen through the same waker (the server wakes every quiet connection then),
/// not through a waiter of this task's own.
struct QuietWait<'l, 'a> {
    read_loop: &'l mut ReadLoop<'a>,
    keepalive: Pin<&'l mut Sleep>,
}

impl Future for QuietWait<'_, '_> {
    type Output = Result<Quiet, ConnError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let (handle, shared) = (this.read_loop.handle, this.read_loop.shared);
        if handle.cancel.register_quiet(cx.waker()) {
            return Poll::Ready(Ok(Quiet::Ended));
        }
        if shared.draining.is_cancelled() {
            this.read_loop.drained = true;
            return Poll::Ready(Ok(Quiet::Ended));
        }
        while this.keepalive.as_mut().poll(cx).is_ready() {
            this.read_loop.keepalive();
            this.keepalive.as_mut().reset(this.read_loop.next_keepalive);
        }
        match this.read_loop.reader.poll_readable(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(Quiet::Readable)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for QuietWait<'_, '_> {
    /// Takes the waker back out of the handle: it keeps the task's memory alive, and the
    /// handle may outlive the task in other connections' caches.
    fn drop(&mut self) {
        self.read_loop.handle.cancel.clear_quiet();
    }
}

pub(super) struct ReadLoop<'a> {
    shared: &'a Arc<ServerState>,
    handle: &'a Arc<ConnHandle>,
    /// Borrowed from the connection, so that the task running the loop does not hold the
    /// reader twice (once where it was, once here).
    pub(super) reader: &'a mut FrameReader,
    decoder: ServerDecoder,
    /// Created on the first disco packet for a key nobody has, and boxed, so the many
    /// connections that never send one pay one pointer for it.
    not_here: Option<Box<NotHereLimiter>>,
    router: Router<'a>,
    connected_at: Instant,
    /// Size of the next read (see `adapt_to_read`).
    chunk: usize,
    /// The last read was tiny: copy its payloads rather than pin the buffer.
    copy_payloads: bool,
    /// This connection's keepalive period in milliseconds: the base interval plus its own
    /// jitter, so connections that arrived together do not all send keepalives at once.
    /// Milliseconds in a `u32` rather than a `Duration`: it fits in the struct's padding, and
    /// every idle connection's task holds this struct.
    keepalive_period_ms: u32,
    next_keepalive: Instant,
    /// The loop stopped because the server is draining, not because the client left.
    pub(super) drained: bool,
    /// Something was read since the last keepalive: the connection is not quiet.
    read_since_keepalive: bool,
    /// The receive rate limit's bucket; `None` for mesh peers and when no limit is
    /// configured. Boxed, so connections without a limit pay one pointer for it.
    limiter: Option<Box<ClientLimiter>>,
}

impl<'a> ReadLoop<'a> {
    pub(super) fn new(
        shared: &'a Arc<ServerState>,
        handle: &'a Arc<ConnHandle>,
        reader: &'a mut FrameReader,
    ) -> Self {
        let now = Instant::now();
        // The jitter is at most the interval itself, which only matters for the short
        // intervals tests use.
        let interval = shared.config.keepalive_interval;
        let jitter_ms = (KEEPALIVE_JITTER_MS as u128).min(interval.as_millis().max(1)) as u64;
        let keepalive_period =
            interval + Duration::from_millis(rand::thread_rng().gen_range(0..jitter_ms));
        Self {
            shared,
            handle,
            reader,
            decoder: ServerDecoder::after_handshake(),
            not_here: None,
            router: Router::new(&shared.config.lookup),
            connected_at: now,
            chunk: MIN_READ_CHUNK,
            // What arrived with the handshake is small.
            copy_payloads: true,
            keepalive_period_ms: u32::try_from(keepalive_period.as_millis()).unwrap_or(u32::MAX),
            next_keepalive: now + keepalive_period,
            drained: false,
            read_since_keepalive: false,
            limiter: (shared.config.rate_limit.is_some() && !handle.can_mesh)
                .then(|| Box::new(ClientLimiter::new(&shared.rate_limits, now))),
        }
    }

    /// Reads and relays until the connection ends; after a graceful shutdown's drain, stays
    /// until the server ends the connection, so that it remains registered while its writer
    /// sends what is queued.
    ///
    /// A connection that has been quiet for a keepalive period waits for its next bytes in a
    /// [`QuietWait`], which holds little; the state of the loop that moves traffic (its
    /// reads, its timers, the rate limiter's wait) is several times larger and is boxed,
    /// allocated only while the connection is busy. A task is as large as its largest
    /// state, so this is what keeps an idle connection's task small: the loop is in this
    /// one function, the wait a future written by hand, to add no state of their own.
    pub(super) async fn run(&mut self) -> Result<(), ConnError> {
        let result = loop {
            // What the handshake left, or the last read, is not kept while waiting.
            self.reader.release_if_empty();
            if self.reader.can_wait_idle() {
                let keepalive = pin!(tokio::time::sleep_until(self.next_keepalive));
                match (QuietWait {
                    read_loop: self,
                    keepalive,
                })
                .await
                {
                    Ok(Quiet::Readable) => {}
                    Ok(Quiet::Ended) => break Ok(()),
                    Err(e) => break Err(e),
                }
            }
            match Box::pin(self.run_busy()).await {
                Ok(Stretch::Quiet) => {}
                Ok(Stretch::Ended) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if let Some(code) = self.reader.ws_close {
            self.handle.ws_close_code.store(code, Ordering::Relaxed);
        }
        // A drain ends the loop without an error, so nothing is held across this wait.
        result?;
        if self.drained {
            self.handle.cancel.cancelled().await;
        }
        Ok(())
    }

    /// The loop while traffic flows. Returns [`Stretch::Quiet`] when a whole keepalive
    /// period passed without a read and the connection can wait in
    /// a [`QuietWait`] instead.
    async fn run_busy(&mut self) -> Result<Stretch, ConnError> {
        // Borrowed for the connection's lifetime, not through `self`, so the select below
        // can poll them beside the reader without cloning a token on every read.
        let handle: &'a ConnHandle = self.handle;
        let shared: &'a ServerState = self.shared;
        // One timer for the connection's life, reset when it fires: not a timer registered
        // and cancelled on every read.
        let keepalive = tokio::time::sleep_until(self.next_keepalive);
        tokio::pin!(keepalive);
        loop {
            let congested = self.process_buffered()?;
            self.reader.release_if_empty();
            if congested {
                // Destinations of this batch had full queues: let their writers run before
                // reading more from this sender. Past saturation this spends the CPU on
                // delivering queued packets rather than on reading packets that would only
                // be dropped, and lets TCP push back on the sender. A yield is not a wait:
                // the sender's other flows are not held up by one slow receiver.
                tokio::task::yield_now().await;
            }
            // Over its rate: neither handle what is buffered nor read more until the bucket
            // has paid its debt; TCP pushes back on the sender meanwhile.
            let resume_at = self
                .limiter
                .as_ref()
                .and_then(|l| l.resume_at(&shared.rate_limits));
            if let Some(at) = resume_at {
                tokio::select! {
                    biased;
                    _ = handle.cancel.cancelled() => return Ok(Stretch::Ended),
                    _ = shared.draining.cancelled() => {
                        self.drained = true;
                        return Ok(Stretch::Ended);
                    }
                    _ = &mut keepalive => {
                        self.keepalive();
                        keepalive.as_mut().reset(self.next_keepalive);
                    }
                    _ = tokio::time::sleep_until(at) => {}
                }
                continue;
            }
            let n = tokio::select! {
                biased;
                _ = handle.cancel.cancelled() => return Ok(Stretch::Ended),
                _ = shared.draining.cancelled() => {
                    // Graceful shutdown: nothing more is read, so what is queued can drain.
                    self.drained = true;
                    return Ok(Stretch::Ended);
                }
                _ = &mut keepalive => {
                    self.keepalive();
                    keepalive.as_mut().reset(self.next_keepalive);
                    if !std::mem::take(&mut self.read_since_keepalive)
                        && self.reader.can_wait_idle()
                    {
                        return Ok(Stretch::Quiet);
                    }
                    continue;
                }
                n = self.reader.read_more(Some(handle), self.chunk) => n?,
            };
            if n == 0 {
                return Ok(Stretch::Ended);
            }
            self.read_since_keepalive = true;
            self.adapt_to_read(n);
        }
    }

    /// Queues a keepalive. Timed here rather than by the writer, which may be parked.
    /// Also the connection's periodic chore: a parked writer gives back what bursts grew
    /// its buffers to.
    fn keepalive(&mut self) {
        self.next_keepalive =
            Instant::now() + Duration::from_millis(self.keepalive_period_ms.into());
        self.handle.queue.shrink_if_parked();
        self.handle.queue.push_control(Control::KeepAlive);
    }

    /// Sizes reads to the traffic. Queued packets are slices of the buffer they were read
    /// into and keep all of it alive, so a sender of small, sparse frames must not make
    /// every frame pin a 64 KiB buffer at a slow receiver: reads shrink towards 4 KiB when
    /// they come back mostly empty and grow towards 64 KiB when they come back full, and the
    /// payloads of a tiny read are copied out instead of sliced.
    fn adapt_to_read(&mut self, n: usize) {
        if n >= self.chunk / 4 * 3 {
            self.chunk = (self.chunk * 2).min(READ_CHUNK);
        } else if n < self.chunk / 8 {
            self.chunk = (self.chunk / 2).max(MIN_READ_CHUNK);
        }
        self.copy_payloads = n < COPY_READS_BELOW;
    }

    /// Handles every complete frame in the buffer, or as many as the rate limit allows, then
    /// has the idle destinations it queued packets for write them at once, and folds what it
    /// counted into the metrics. Returns whether a destination's queue was full.
    ///
    /// The batch's counts and the writers it takes along live in the worker thread, not in
    /// the connection: they exist only while a batch is handled (this is synchronous, so no
    /// other connection's batch runs on the thread meanwhile), and an idle connection should
    /// not carry them.
    fn process_buffered(&mut self) -> Result<bool, ConnError> {
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
            if let Some(q) = &mut self.reader.quic {
                // Hand the vector back (emptied, or with what the rate limit held back) so
                // its capacity is reused.
                q.datagrams = datagrams;
            }
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

/// The largest read; one read can carry many frames.
const READ_CHUNK: usize = 64 * 1024;
/// The smallest read, and the first after the handshake.
const MIN_READ_CHUNK: usize = 4 * 1024;
/// Payloads of a read smaller than this are copied out of the read buffer.
const COPY_READS_BELOW: usize = 1024;
/// Below this much free space the read buffer is grown before reading.
const MIN_READ_SPACE: usize = 4 * 1024;
const KEEPALIVE_JITTER_MS: u64 = 5000;
const NOT_HERE_PER_SEC: f64 = 1.0;
const NOT_HERE_BURST: f64 = 3.0;
/// NotePreferred flips within this long of connecting do not count as home moves.
const HOME_MOVE_GRACE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use derp_io::Transport;
    use derp_proto::SecretKey;

    use super::*;
    use crate::config::ServerConfig;
    use crate::lookup::{LookupConfig, PeerCacheConfig};
    use crate::queue::Batch;

    const IDLE: Duration = Duration::from_secs(600);

    fn state(config: ServerConfig) -> Arc<ServerState> {
        Arc::new(ServerState::new(config, &prometheus::Registry::new()).expect("state"))
    }

    fn handle(id: u64, key: u8) -> Arc<ConnHandle> {
        ConnHandle::for_tests(id, key)
    }

    /// A read loop for a registered client, fed by pushing frames into its buffer.
    fn read_loop<'a>(shared: &'a Arc<ServerState>, handle: &'a Arc<ConnHandle>) -> ReadLoop<'a> {
        let (_, server_side) = tokio::io::duplex(64);
        let (read_half, _) = Transport::Boxed(Box::new(server_side)).split();
        // Leaked: the loop borrows its reader, and a test's reader is small and lives as long
        // as the test anyway.
        let reader = Box::leak(Box::new(FrameReader::new(
            read_half,
            Framing::Raw,
            BytesMut::new(),
        )));
        ReadLoop::new(shared, handle, reader)
    }

    /// Handles one frame; returns the server's LRU misses so far.
    fn feed(rl: &mut ReadLoop<'_>, frame: ClientToRelay) -> u64 {
        frame.encode(&mut rl.reader.buf);
        rl.process_buffered().expect("valid frame");
        rl.shared.metrics.peer_lookup_cache_misses.get()
    }

    #[tokio::test]
    async fn reads_adapt_and_tiny_reads_do_not_pin_their_buffer() {
        let shared = &state(ServerConfig::new(SecretKey::from_bytes([1; 32])));
        let src = handle(1, 3);
        let dst = handle(2, 2);
        shared.registry.register(&src);
        shared.registry.register(&dst);
        let mut rl = read_loop(shared, &src);
        assert_eq!(rl.chunk, MIN_READ_CHUNK);
        // Full reads grow the chunk to the maximum.
        for _ in 0..8 {
            let full = rl.chunk;
            rl.adapt_to_read(full);
        }
        assert_eq!(rl.chunk, READ_CHUNK);
        assert!(!rl.copy_payloads);
        // Sparse tiny reads shrink it back and switch to copying.
        for _ in 0..8 {
            rl.adapt_to_read(40);
        }
        assert_eq!(rl.chunk, MIN_READ_CHUNK);
        assert!(rl.copy_payloads);

        // A packet from a tiny read is queued as its own allocation, not a slice of the
        // read buffer: the buffer's spare capacity stays unshared and is reused.
        ClientToRelay::SendPacket {
            dst: dst.key,
            packet: Bytes::from_static(b"tiny"),
        }
        .encode(&mut rl.reader.buf);
        rl.reader.buf.reserve(1024);
        let buffer_start = rl.reader.buf.as_ptr() as usize;
        let buffer_end = buffer_start + rl.reader.buf.capacity();
        rl.process_buffered().expect("valid frame");
        let mut batch = Batch::default();
        dst.queue.take(&mut batch);
        let queued = batch.other.front().expect("queued").data.as_ptr() as usize;
        assert!(
            !(buffer_start..buffer_end).contains(&queued),
            "tiny payload still points into the read buffer"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ping_frames_trim_idle_lookup_cache_entries() {
        let config = ServerConfig {
            lookup: LookupConfig {
                mirror: false,
                peer_cache: Some(PeerCacheConfig {
                    max_entries: PeerCacheConfig::default().max_entries,
                    max_idle: IDLE,
                }),
            },
            ..ServerConfig::new(SecretKey::from_bytes([1; 32]))
        };
        let shared = &state(config);
        let dst = handle(1, 2);
        shared.registry.register(&dst);
        let send = || ClientToRelay::SendPacket {
            dst: dst.key,
            packet: Bytes::from_static(b"x"),
        };

        // Without a ping, an entry idle past the limit is still used (and refreshed).
        let quiet = handle(2, 3);
        shared.registry.register(&quiet);
        let mut rl = read_loop(shared, &quiet);
        assert_eq!(feed(&mut rl, send()), 1, "first lookup misses");
        tokio::time::advance(IDLE + Duration::from_secs(1)).await;
        assert_eq!(
            feed(&mut rl, send()),
            1,
            "no ping: the entry is still there"
        );

        // A ping after the idle limit removes it, so the next packet misses again.
        let pinger = handle(3, 4);
        shared.registry.register(&pinger);
        let mut rl = read_loop(shared, &pinger);
        assert_eq!(feed(&mut rl, send()), 2, "the pinger's first lookup misses");
        tokio::time::advance(IDLE + Duration::from_secs(1)).await;
        feed(&mut rl, ClientToRelay::Ping([7; 8]));
        assert_eq!(feed(&mut rl, send()), 3, "the ping trimmed the idle entry");

        // A ping before the limit keeps a recently used entry.
        feed(&mut rl, ClientToRelay::Ping([8; 8]));
        assert_eq!(feed(&mut rl, send()), 3);
    }

    /// A read loop on a real loopback socket, whose readiness the quiet wait waits for; also
    /// returns the client's end.
    async fn tcp_read_loop<'a>(
        shared: &'a Arc<ServerState>,
        handle: &'a Arc<ConnHandle>,
    ) -> (ReadLoop<'a>, tokio::net::TcpStream) {
        let (server, client) = super::super::loopback_pair().await;
        let (read_half, write_half) = Transport::Tcp(server).split();
        // Kept: dropping the write half would shut the socket's sending side down.
        Box::leak(Box::new(write_half));
        let reader = Box::leak(Box::new(FrameReader::new(
            read_half,
            Framing::Raw,
            BytesMut::new(),
        )));
        (ReadLoop::new(shared, handle, reader), client)
    }

    /// Yields until `cond` holds; the other side of a `join!` runs meanwhile.
    async fn until(cond: impl Fn() -> bool) {
        while !cond() {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_quiet_read_loop_ends_on_cancel_and_leaves_no_waker_behind() {
        let shared = &state(ServerConfig::new(SecretKey::from_bytes([1; 32])));
        let conn = handle(1, 3);
        shared.registry.register(&conn);
        let (mut rl, _client) = tcp_read_loop(shared, &conn).await;
        let result = {
            let mut run = pin!(rl.run());
            // A fresh connection with nothing to read parks in the quiet wait at once, even
            // though its socket's first readiness report says readable.
            let first = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
            assert!(first.is_pending());
            assert!(conn.cancel.holds_quiet_waker(), "parked in the quiet wait");
            conn.cancel.cancel();
            run.await
        };
        result.expect("a cancelled quiet loop ends cleanly");
        assert!(!rl.drained);
        assert!(
            !conn.cancel.holds_quiet_waker(),
            "the handle, which may outlive the task in caches, keeps no waker"
        );
    }

    #[tokio::test]
    async fn a_quiet_read_loop_sees_a_drain_begin_and_the_shutdown_end_it() {
        let shared = &state(ServerConfig::new(SecretKey::from_bytes([1; 32])));
        let conn = handle(1, 3);
        shared.registry.register(&conn);
        shared.watch_lifecycle();
        let (mut rl, mut client) = tcp_read_loop(shared, &conn).await;
        let (result, ()) = tokio::join!(rl.run(), async {
            until(|| conn.cancel.holds_quiet_waker()).await;
            // Only the server's lifecycle task, through the registry, tells the quiet loop.
            shared.draining.cancel();
            until(|| !conn.cancel.holds_quiet_waker()).await;
            assert!(
                !conn.cancel.is_cancelled(),
                "a drain does not end the connection"
            );
            // Stopped reading: bytes from the client now stay in the socket.
            tokio::io::AsyncWriteExt::write_all(&mut client, b"late")
                .await
                .expect("write");
            shared.shutdown.cancel();
        });
        result.expect("a drained loop ends cleanly");
        assert!(rl.drained, "the loop stopped because the server drained");
        assert!(
            conn.cancel.is_cancelled(),
            "the shutdown cancelled the connection"
        );
        assert!(
            rl.reader.buf.is_empty(),
            "nothing was read after the drain began"
        );
    }
}
