//! One client connection: the handshake, the read loop and the writer.
//!
//! The read loop runs on the connection's own task. It reads as much as the socket holds,
//! parses every complete frame in the buffer, and hands each packet to its destination's
//! queue as a `Bytes` slice of the read buffer (no copy between sockets, except after tiny
//! reads). The writer drains the connection's queues in batches and writes each batch with
//! one vectored write, flushing only when nothing else is ready; it runs as a second task
//! while there is work and is parked in the queue while the connection is idle.

use std::collections::HashSet;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_proto::frame::{self, FrameType, PEER_PRESENT_IS_MESH_PEER, PEER_PRESENT_IS_PROBER};
use derp_proto::frame::{PEER_PRESENT_IS_REGULAR, PEER_PRESENT_NOT_IDEAL};
use derp_proto::{
    ClientInfo, ClientToRelay, DecodeError, PeerGoneReason, PublicKey, RelayToClient,
    ServerDecoder, ServerHandshake,
};
use rand::{Rng, RngCore};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tracing::{debug, trace};

use crate::io::{ReadHalf, Transport, WriteHalf};
use crate::lookup::{Route, Router};
use crate::metrics::{DropReason, PacketKind, ReaderCounts};
use crate::queue::{Batch, ConnHandle, Control, Resume};
use crate::server::Shared;
use crate::ws;

/// How a connection arrived, as decided by the HTTP layer.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub(crate) transport: Transport,
    /// Bytes that arrived after the HTTP request head; they belong to the DERP stream.
    pub(crate) initial: BytesMut,
    pub(crate) remote: SocketAddr,
    /// Bytes to send before the ServerKey frame (the 101 response), if any. Sent in the same
    /// write as ServerKey, as the reference does.
    pub(crate) preamble: Vec<u8>,
    /// DERP frames travel inside WebSocket binary messages.
    pub(crate) websocket: bool,
    /// The request carried a non-empty `Ideal-Node` header.
    pub(crate) not_ideal: bool,
}

/// Why a connection ended; logged at debug level, since peers control how often it happens.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("handshake timed out")]
    HandshakeTimeout,
    #[error("handshake: {0}")]
    Handshake(#[from] derp_proto::HandshakeError),
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    #[error("websocket: {0}")]
    WebSocket(#[from] ws::WsError),
    #[error("frame type {0:#04x} requires mesh privileges")]
    NotMeshPeer(u8),
    #[error("connection closed during handshake")]
    ClosedDuringHandshake,
}

/// Runs a DERP connection to completion. Never panics on peer input; every error closes only
/// this connection.
pub(crate) async fn serve(shared: Arc<Shared>, accepted: Accepted) {
    shared.metrics.accepts.inc();
    if accepted.websocket {
        shared.metrics.websocket_accepts.inc();
    }
    let remote = accepted.remote;
    if let Err(e) = run(shared, accepted).await {
        debug!(%remote, error = %e, "derp connection ended");
    }
}

async fn run(shared: Arc<Shared>, accepted: Accepted) -> Result<(), ConnError> {
    let Accepted {
        transport,
        initial,
        remote,
        preamble,
        websocket,
        not_ideal,
    } = accepted;
    let (read_half, mut write_half) = transport.split();
    let mut reader = FrameReader::new(read_half, websocket, initial);
    let framing = Framing { websocket };
    let config = &shared.config;
    let mut hs = ServerHandshake::new(config.secret_key.clone());
    let (client_key, info) = match handshake(
        &mut hs,
        &mut reader,
        &mut write_half,
        framing,
        &preamble,
        config.handshake_timeout,
    )
    .await
    {
        Ok(done) => done,
        Err(e) => {
            if matches!(e, ConnError::Handshake(_)) {
                shared.metrics.handshake_failures.inc();
            }
            return Err(e);
        }
    };
    drop(preamble);
    let can_mesh = is_mesh_peer(&shared, &info);
    let flags = presence_flags(&info, can_mesh, not_ideal);
    let id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
    let handle = Arc::new(ConnHandle::new(
        id,
        client_key,
        remote,
        flags,
        can_mesh,
        config.send_queue_depth,
        shared.shutdown.child_token(),
    ));

    let registration = Registration::new(&shared, &handle, not_ideal);
    let write_timeout = if can_mesh {
        config.mesh_write_timeout
    } else {
        config.write_timeout
    };

    // ServerInfo must be the first frame after ServerKey, so it is written before the writer
    // task starts draining whatever other clients have queued meanwhile. The handshake state
    // and its buffers are dropped here rather than held for the connection's lifetime.
    let server_info = {
        let mut nonce = [0u8; 24];
        rand::thread_rng().fill_bytes(&mut nonce);
        let mut out = BytesMut::new();
        let mut sealed_ok = Ok(());
        framing.frame(&mut out, |b| sealed_ok = hs.server_info_frame(nonce, b));
        drop(hs);
        sealed_ok.map(|()| out)
    };
    let result = match server_info {
        Ok(out) => {
            match write_with_timeout(&mut write_half, &out, Some(config.handshake_timeout)).await {
                Ok(()) => {
                    debug!(%remote, key = %client_key.short(), id, "client connected");
                    Writer::start(
                        shared.clone(),
                        handle.clone(),
                        write_half,
                        framing,
                        write_timeout,
                    );
                    let mut read_loop = ReadLoop::new(&shared, &handle, reader);
                    let result = read_loop.run().await;
                    if let Some(code) = read_loop.reader.ws_close {
                        handle.ws_close_code.store(code, Ordering::Relaxed);
                    }
                    // Leaving the registry closes the queues; the writer (running, or
                    // resumed from its parked state by the close) then finishes the socket.
                    drop(registration);
                    result
                }
                Err(e) => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    };

    debug!(%remote, key = %client_key.short(), id, "client disconnected");
    result
}

/// A registered connection. Dropping it (on every path: normal end, error, panic, or the
/// connection's future being dropped by an embedder) unregisters the connection, closes its
/// queues and counts what they still held.
struct Registration<'a> {
    shared: &'a Shared,
    handle: &'a Arc<ConnHandle>,
    not_ideal: bool,
}

impl<'a> Registration<'a> {
    fn new(shared: &'a Shared, handle: &'a Arc<ConnHandle>, not_ideal: bool) -> Self {
        shared.registry.register(handle);
        if not_ideal {
            shared.metrics.current_notideal_connections.inc();
        }
        Self {
            shared,
            handle,
            not_ideal,
        }
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.handle.cancel.cancel();
        self.shared.registry.unregister(self.handle);
        self.shared.registry.remove_watcher(self.handle.id);
        if self.not_ideal {
            self.shared.metrics.current_notideal_connections.dec();
        }
        count_gone(self.shared, self.handle.close());
    }
}

/// Sends ServerKey (after the 101 head, if any, in the same write) and reads and opens the
/// client's ClientInfo, each step within its own deadline. Everything it buffered for that is
/// released when it returns, so an idle connection does not keep it.
async fn handshake(
    hs: &mut ServerHandshake,
    reader: &mut FrameReader,
    write_half: &mut WriteHalf,
    framing: Framing,
    preamble: &[u8],
    timeout: Duration,
) -> Result<(PublicKey, ClientInfo), ConnError> {
    let mut out = BytesMut::with_capacity(preamble.len() + 64);
    out.extend_from_slice(preamble);
    framing.frame(&mut out, |b| hs.server_key_frame(b));
    tokio::time::timeout(timeout, write_half.write_all(&out))
        .await
        .map_err(|_| ConnError::HandshakeTimeout)??;

    // The ClientInfo must arrive within its own deadline, counted from after ServerKey.
    let deadline = Instant::now() + timeout;
    let mut decoder = ServerDecoder::new();
    loop {
        match decoder.decode(&mut reader.buf)? {
            Some(ClientToRelay::ClientInfo { key, sealed }) => {
                let info = hs.handle_client_info(key, &sealed)?;
                return Ok((key, info));
            }
            // The decoder refuses anything but ClientInfo as the first frame.
            Some(_) => return Err(ConnError::ClosedDuringHandshake),
            None => {
                let n = tokio::time::timeout_at(deadline, reader.read_more(None, HANDSHAKE_READ))
                    .await
                    .map_err(|_| ConnError::HandshakeTimeout)??;
                if n == 0 {
                    return Err(ConnError::ClosedDuringHandshake);
                }
            }
        }
    }
}

fn is_mesh_peer(shared: &Shared, info: &ClientInfo) -> bool {
    match (&shared.config.mesh_key, &info.mesh_key) {
        (Some(ours), Some(theirs)) => !theirs.is_zero() && ours.ct_eq(theirs),
        _ => false,
    }
}

fn presence_flags(info: &ClientInfo, can_mesh: bool, not_ideal: bool) -> u8 {
    let mut flags = 0;
    if can_mesh {
        flags |= PEER_PRESENT_IS_MESH_PEER;
    }
    if info.is_prober {
        flags |= PEER_PRESENT_IS_PROBER;
    }
    if not_ideal {
        flags |= PEER_PRESENT_NOT_IDEAL;
    }
    if flags == 0 {
        flags = PEER_PRESENT_IS_REGULAR;
    }
    flags
}

/// Counts packets left in a closed connection's queues as dropped because it went away.
fn count_gone(shared: &Shared, rest: Batch) {
    for (queue, kind) in [
        (&rest.disco, PacketKind::Disco),
        (&rest.other, PacketKind::Other),
    ] {
        for p in queue {
            shared
                .metrics
                .drop_one(DropReason::GoneDisconnected, kind, p.data.len());
        }
    }
}

/// Whether frames are written bare or each inside a WebSocket binary message.
#[derive(Clone, Copy, Debug)]
struct Framing {
    websocket: bool,
}

impl Framing {
    /// Appends one frame produced by `encode`, wrapped in a WebSocket header when needed.
    fn frame(self, out: &mut BytesMut, encode: impl FnOnce(&mut BytesMut)) {
        if !self.websocket {
            encode(out);
            return;
        }
        let mut frame = BytesMut::new();
        encode(&mut frame);
        let (hdr, n) = ws::binary_header(frame.len());
        out.extend_from_slice(&hdr[..n]);
        out.extend_from_slice(&frame);
    }
}

/// The read side: raw bytes from the socket, unwrapped from WebSocket messages when needed,
/// accumulate in `buf` as a DERP byte stream.
struct FrameReader {
    half: ReadHalf,
    buf: BytesMut,
    ws: Option<WsIn>,
    /// The close code to answer with, once the WebSocket layer has one.
    ws_close: Option<u16>,
}

struct WsIn {
    decoder: ws::WsDecoder,
    raw: BytesMut,
}

impl FrameReader {
    fn new(half: ReadHalf, websocket: bool, initial: BytesMut) -> Self {
        if websocket {
            Self {
                half,
                buf: BytesMut::new(),
                ws: Some(WsIn {
                    decoder: ws::WsDecoder::new(),
                    raw: initial,
                }),
                ws_close: None,
            }
        } else {
            Self {
                half,
                buf: initial,
                ws: None,
                ws_close: None,
            }
        }
    }

    /// Reads once from the socket and appends what it yields to `buf`. Returns 0 at EOF.
    /// WebSocket pings are answered through `handle` when one is given.
    async fn read_more(
        &mut self,
        handle: Option<&ConnHandle>,
        chunk: usize,
    ) -> Result<usize, ConnError> {
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
                ws::WsEvent::Ping(payload) => {
                    if let Some(h) = handle {
                        h.push_control(Control::WsPong(payload));
                    }
                    continue;
                }
                ws::WsEvent::Close { code } => {
                    // Echo the client's code, as the reference does. Data that came before
                    // the close is still handed over; the decoder repeats the close event on
                    // the next call.
                    self.ws_close = Some(code.unwrap_or(ws::close_code::NORMAL));
                    return Ok(self.buf.len() - before);
                }
                ws::WsEvent::NeedMore => {}
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

    /// Gives back an empty buffer's memory, so an idle connection holds no read buffer.
    /// Packets still queued elsewhere keep their slices of the old allocation alive.
    fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
        if let Some(ws_in) = &mut self.ws
            && ws_in.raw.is_empty()
            && ws_in.raw.capacity() > 0
        {
            ws_in.raw = BytesMut::new();
        }
    }
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

struct ReadLoop<'a> {
    shared: &'a Arc<Shared>,
    handle: &'a Arc<ConnHandle>,
    reader: FrameReader,
    decoder: ServerDecoder,
    counts: ReaderCounts,
    not_here: NotHereLimiter,
    router: Router,
    connected_at: Instant,
    /// Size of the next read (see `adapt_to_read`).
    chunk: usize,
    /// The last read was tiny: copy its payloads rather than pin the buffer.
    copy_payloads: bool,
    /// This connection's keepalive period: the base interval plus its own jitter, so
    /// connections that arrived together do not all send keepalives at once.
    keepalive_period: Duration,
    next_keepalive: Instant,
}

impl<'a> ReadLoop<'a> {
    fn new(shared: &'a Arc<Shared>, handle: &'a Arc<ConnHandle>, reader: FrameReader) -> Self {
        let now = Instant::now();
        let keepalive_period = shared.config.keepalive_interval
            + Duration::from_millis(rand::thread_rng().gen_range(0..KEEPALIVE_JITTER_MS));
        Self {
            shared,
            handle,
            reader,
            decoder: ServerDecoder::after_handshake(),
            counts: ReaderCounts::default(),
            not_here: NotHereLimiter::new(now),
            router: Router::new(&shared.config.lookup),
            connected_at: now,
            chunk: MIN_READ_CHUNK,
            // What arrived with the handshake is small.
            copy_payloads: true,
            keepalive_period,
            next_keepalive: now + keepalive_period,
        }
    }

    async fn run(&mut self) -> Result<(), ConnError> {
        let result = self.run_inner().await;
        self.shared.fold(&mut self.counts);
        result
    }

    async fn run_inner(&mut self) -> Result<(), ConnError> {
        loop {
            self.process_buffered()?;
            let congested = self.counts.queue_drops() > 0;
            self.shared.fold(&mut self.counts);
            self.reader.release_if_empty();
            if congested {
                // Destinations of this batch had full queues: let their writers run before
                // reading more from this sender. Past saturation this spends the CPU on
                // delivering queued packets rather than on reading packets that would only
                // be dropped, and lets TCP push back on the sender. A yield is not a wait:
                // the sender's other flows are not held up by one slow receiver.
                tokio::task::yield_now().await;
            }
            let cancel = self.handle.cancel.clone();
            let n = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep_until(self.next_keepalive) => {
                    // Timed here rather than by the writer, which may be parked.
                    self.next_keepalive = Instant::now() + self.keepalive_period;
                    self.handle.push_control(Control::KeepAlive);
                    continue;
                }
                n = self.reader.read_more(Some(self.handle), self.chunk) => n?,
            };
            if n == 0 {
                return Ok(());
            }
            self.adapt_to_read(n);
        }
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

    /// Handles every complete frame in the buffer. Synchronous: the lookup guard and the
    /// batch timestamp never cross an await.
    fn process_buffered(&mut self) -> Result<(), ConnError> {
        let now = Instant::now();
        let registry = &self.shared.registry;
        let guard = registry.mirror().guard();
        while let Some(frame) = self.decoder.decode(&mut self.reader.buf)? {
            self.counts.frames += 1;
            if self.handle.is_dup.load(Ordering::Relaxed) {
                self.shared.registry.note_activity(self.handle);
            }
            match frame {
                ClientToRelay::SendPacket { dst, packet } => {
                    let packet = self.own_payload(packet);
                    let len = packet.len();
                    let kind = PacketKind::of(&packet);
                    self.counts.packets_received += 1;
                    self.counts.bytes_received += len as u64;
                    self.counts.packets_received_kind[kind as usize] += 1;
                    let src = self.handle.key;
                    let counts = &mut self.counts;
                    let missing = self
                        .router
                        .route_with(registry, &guard, &dst, now, |route| {
                            match route {
                                Route::Local(conn) => {
                                    conn.push_packet(src, packet, kind, now, counts)
                                }
                                Route::Forward(route) => {
                                    counts.forwarded_out += 1;
                                    route.forwarder.forward_packet(src, dst, packet);
                                }
                                Route::Dup => counts.drop(DropReason::DupClient, kind, len),
                                Route::Missing => {
                                    counts.drop(DropReason::UnknownDest, kind, len);
                                    return true;
                                }
                            }
                            false
                        });
                    if missing {
                        self.maybe_not_here(dst, kind, now);
                    }
                }
                ClientToRelay::ForwardPacket { src, dst, packet } => {
                    self.require_mesh(FrameType::ForwardPacket)?;
                    let packet = self.own_payload(packet);
                    self.counts.forwarded_in += 1;
                    let len = packet.len();
                    let kind = PacketKind::of(&packet);
                    // Forwarded packets are delivered locally or dropped: exactly one hop.
                    let counts = &mut self.counts;
                    let missing = self
                        .router
                        .route_with(registry, &guard, &dst, now, |route| {
                            match route {
                                Route::Local(conn) => {
                                    conn.push_packet(src, packet, kind, now, counts)
                                }
                                Route::Dup => counts.drop(DropReason::DupClient, kind, len),
                                Route::Forward(_) | Route::Missing => {
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
                    self.counts.got_ping += 1;
                    self.router.trim(now);
                    self.handle.push_pong(data);
                }
                ClientToRelay::ClientInfo { .. }
                | ClientToRelay::Pong(_)
                | ClientToRelay::Unknown { .. } => {
                    trace!("skipping unhandled frame");
                    self.counts.unknown_frames += 1;
                }
            }
        }
        let misses = std::mem::take(&mut self.router.misses);
        self.counts.mirror_misses += misses.mirror;
        self.counts.cache_misses += misses.cache;
        Ok(())
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
        if kind == PacketKind::Disco && self.not_here.allow(now) {
            self.handle
                .push_control(Control::PeerGone(dst, PeerGoneReason::NotHere));
        }
    }

    fn require_mesh(&self, ty: FrameType) -> Result<(), ConnError> {
        if self.handle.can_mesh {
            Ok(())
        } else {
            Err(ConnError::NotMeshPeer(ty as u8))
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

/// A connection's writer. It runs as a task only while there is something to write (and
/// for a short linger after); an idle connection's writer is parked in its queue and a
/// sender's enqueue resumes it, so idle connections cost one task, not two.
struct Writer {
    shared: Arc<Shared>,
    handle: Arc<ConnHandle>,
    w: WriteHalf,
    framing: Framing,
    write_timeout: Option<Duration>,
    batch: Batch,
    /// Frame headers for the current batch; the payloads are written from their own buffers.
    headers: Vec<u8>,
    /// Sources this connection has received from; each is registered once for PeerGone.
    sent_from: HashSet<PublicKey, foldhash::fast::RandomState>,
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
    fn resume(self: Box<Self>) {
        let tasks = self.shared.tasks.clone();
        tasks.spawn(self.run());
    }
}

impl Writer {
    /// Starts the writer for a connection whose ServerInfo has been written.
    fn start(
        shared: Arc<Shared>,
        handle: Arc<ConnHandle>,
        w: WriteHalf,
        framing: Framing,
        write_timeout: Option<Duration>,
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
        });
        if let Err(writer) = handle.park(writer) {
            writer.resume();
        }
    }

    async fn run(mut self: Box<Self>) {
        loop {
            match self.serve().await {
                Ok(Step::Idle) => {
                    let handle = self.handle.clone();
                    match handle.park(self) {
                        Ok(()) => return,
                        // Work arrived between the linger and the park.
                        Err(back) => self = back,
                    }
                }
                Ok(Step::Closed) => return self.finish(None).await,
                Err(e) => return self.finish(Some(e)).await,
            }
        }
    }

    /// Writes until the connection closes or has been idle for the linger time.
    async fn serve(&mut self) -> io::Result<Step> {
        loop {
            if !self.drain().await? {
                return Ok(Step::Closed);
            }
            let handle = self.handle.clone();
            tokio::select! {
                biased;
                _ = handle.cancel.cancelled() => return Ok(Step::Closed),
                _ = handle.wait() => {}
                _ = tokio::time::sleep(WRITER_LINGER) => return Ok(Step::Idle),
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
            }
            debug!(id = handle.id, error = %e, "write failed");
        }
        handle.cancel.cancel();
        shared
            .registry
            .unwatch_peer_gone(&self.sent_from, handle.id);
        count_gone(shared, handle.close());
        if self.framing.websocket {
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
    Header(usize, usize),
    Payload(bool, usize),
}

impl Writer {
    /// Writes batches until nothing is pending. Returns false once the connection is closed.
    async fn drain(&mut self) -> io::Result<bool> {
        loop {
            let open = self.handle.take(&mut self.batch);
            if self.batch.is_empty() {
                return Ok(open);
            }
            let frames = self.write_batch().await;
            self.recycle();
            let frames = frames?;
            self.shared
                .metrics
                .buffered_write_frames
                .observe(frames as f64);
            if !open {
                return Ok(false);
            }
        }
    }

    /// Writes everything in the batch with vectored writes, then flushes once.
    async fn write_batch(&mut self) -> io::Result<usize> {
        self.headers.clear();
        let mut segs: Vec<Seg> = Vec::with_capacity(
            2 * (self.batch.disco.len() + self.batch.other.len()) + self.batch.control.len() + 2,
        );
        let framing = self.framing;
        let mut frames = 0;
        let mut pongs = 0;
        let mut gone = [0u64; 2];
        for control in self.batch.control.drain(..) {
            let start = self.headers.len();
            match control {
                Control::PeerGone(peer, reason) => {
                    match reason {
                        PeerGoneReason::NotHere => gone[1] += 1,
                        _ => {
                            gone[0] += 1;
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
                Control::WsPong(payload) => {
                    self.headers
                        .extend_from_slice(&ws::control_frame(ws::ControlOpcode::Pong, &payload));
                }
            }
            segs.push(Seg::Header(start, self.headers.len()));
            frames += 1;
        }
        if let Some(data) = self.batch.pong.take() {
            let start = self.headers.len();
            push_frame(&mut self.headers, framing, &RelayToClient::Pong(data));
            segs.push(Seg::Header(start, self.headers.len()));
            frames += 1;
            pongs += 1;
        }
        let now = Instant::now();
        let mut sent = 0u64;
        let mut sent_bytes = 0u64;
        let mut avg = self.shared.metrics.average_queue_duration_ms.get();
        for (disco, queue) in [(true, &self.batch.disco), (false, &self.batch.other)] {
            for (i, p) in queue.iter().enumerate() {
                let start = self.headers.len();
                if framing.websocket {
                    let (hdr, n) = ws::binary_header(frame::FRAME_HEADER_LEN + 32 + p.data.len());
                    self.headers.extend_from_slice(&hdr[..n]);
                }
                self.headers
                    .extend_from_slice(&frame::recv_packet_header(&p.src, p.data.len()));
                segs.push(Seg::Header(start, self.headers.len()));
                segs.push(Seg::Payload(disco, i));
                sent += 1;
                sent_bytes += p.data.len() as u64;
                let waited = now.saturating_duration_since(p.enqueued).as_secs_f64() * 1000.0;
                avg = avg * 0.9 + waited * 0.1;
                frames += 1;
            }
        }

        let mut slices: Vec<IoSlice<'_>> = segs
            .iter()
            .filter_map(|s| {
                let bytes: &[u8] = match *s {
                    Seg::Header(a, b) => &self.headers[a..b],
                    Seg::Payload(true, i) => &self.batch.disco[i].data,
                    Seg::Payload(false, i) => &self.batch.other[i].data,
                };
                (!bytes.is_empty()).then(|| IoSlice::new(bytes))
            })
            .collect();
        // A write blocked on a peer that does not read must still end when the connection
        // is closed (shutdown, ClosePeer, the read side ending), deadline or not.
        let cancel = &self.handle.cancel;
        let write_timeout = self.write_timeout;
        let w = &mut self.w;
        let write = async {
            write_vectored_all(w, &mut slices, write_timeout).await?;
            match write_timeout {
                Some(t) => tokio::time::timeout(t, w.flush())
                    .await
                    .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
                None => w.flush().await,
            }
        };
        let result = tokio::select! {
            biased;
            _ = cancel.cancelled() => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed while writing",
            )),
            r = write => r,
        };
        if let Err(e) = result {
            for (queue, kind) in [
                (&self.batch.disco, PacketKind::Disco),
                (&self.batch.other, PacketKind::Other),
            ] {
                for p in queue {
                    self.shared
                        .metrics
                        .drop_one(DropReason::WriteError, kind, p.data.len());
                }
            }
            return Err(e);
        }
        if sent > 0 {
            self.note_sources();
        }
        let m = &self.shared.metrics;
        if sent > 0 && self.shared.config.packet_metrics {
            m.packets_sent.inc_by(sent);
            m.bytes_sent.inc_by(sent_bytes);
            m.average_queue_duration_ms.set(avg);
        }
        if pongs > 0 {
            m.sent_pong.inc_by(pongs);
        }
        if gone[0] > 0 {
            m.peer_gone_disconnected_frames.inc_by(gone[0]);
        }
        if gone[1] > 0 {
            m.peer_gone_not_here_frames.inc_by(gone[1]);
        }
        Ok(frames)
    }

    /// Registers this connection as a PeerGone watcher of every new source in the batch.
    fn note_sources(&mut self) {
        for p in self.batch.disco.iter().chain(self.batch.other.iter()) {
            if !self.sent_from.contains(&p.src) {
                self.sent_from.insert(p.src);
                self.shared.registry.watch_peer_gone(p.src, &self.handle);
            }
        }
    }

    /// Empties the batch but keeps its queues' capacity for the next swap, unless a burst
    /// grew them beyond what an idle connection should hold.
    fn recycle(&mut self) {
        self.batch.disco.clear();
        self.batch.other.clear();
        self.batch.control.clear();
        if self.headers.capacity() > MAX_IDLE_HEADER_CAPACITY {
            self.headers = Vec::new();
        }
    }
}

fn push_frame(out: &mut Vec<u8>, framing: Framing, frame: &RelayToClient) {
    if framing.websocket {
        let (hdr, n) = ws::binary_header(frame.encoded_len());
        out.extend_from_slice(&hdr[..n]);
    }
    frame.encode(out);
}

/// Writes all slices, applying the deadline to each write call: a peer that accepts nothing
/// for that long is cut off, while a slow but moving one is not.
async fn write_vectored_all<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut slices: &mut [IoSlice<'_>],
    timeout: Option<Duration>,
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
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

async fn write_with_timeout<W: AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    timeout: Option<Duration>,
) -> io::Result<()> {
    let mut slices = [IoSlice::new(bytes)];
    write_vectored_all(w, &mut slices, timeout).await?;
    w.flush().await
}

/// The largest read; one read can carry many frames.
const READ_CHUNK: usize = 64 * 1024;
/// The smallest read, and the first after the handshake.
const MIN_READ_CHUNK: usize = 4 * 1024;
/// Payloads of a read smaller than this are copied out of the read buffer.
const COPY_READS_BELOW: usize = 1024;
/// Reads during the handshake are small: a ClientInfo is a few hundred bytes, and a buffer
/// allocated now must not stay with an idle connection.
const HANDSHAKE_READ: usize = 1024;
/// Below this much free space the read buffer is grown before reading.
const MIN_READ_SPACE: usize = 4 * 1024;
/// Header scratch above this size is released after a burst.
const MAX_IDLE_HEADER_CAPACITY: usize = 16 * 1024;
/// How long a closing connection may take to accept its last bytes (a WebSocket close frame,
/// a TLS close_notify).
const WS_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
const KEEPALIVE_JITTER_MS: u64 = 5000;
/// How long a writer waits for more work after draining before it parks.
const WRITER_LINGER: Duration = Duration::from_secs(1);
const NOT_HERE_PER_SEC: f64 = 1.0;
const NOT_HERE_BURST: f64 = 3.0;
/// NotePreferred flips within this long of connecting do not count as home moves.
const HOME_MOVE_GRACE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use derp_proto::SecretKey;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::ServerConfig;
    use crate::io::Transport;
    use crate::lookup::{LookupConfig, PeerCacheConfig};
    use crate::server::Server;

    const IDLE: Duration = Duration::from_secs(600);

    fn handle(id: u64, key: u8) -> Arc<ConnHandle> {
        Arc::new(ConnHandle::new(
            id,
            PublicKey::from_bytes([key; 32]),
            ([127, 0, 0, 1], 1).into(),
            0,
            false,
            32,
            CancellationToken::new(),
        ))
    }

    /// A read loop for a registered client, fed by pushing frames into its buffer.
    fn read_loop<'a>(shared: &'a Arc<Shared>, handle: &'a Arc<ConnHandle>) -> ReadLoop<'a> {
        let (_, server_side) = tokio::io::duplex(64);
        let (read_half, _) = Transport::Boxed(Box::new(server_side)).split();
        ReadLoop::new(
            shared,
            handle,
            FrameReader::new(read_half, false, BytesMut::new()),
        )
    }

    fn feed(rl: &mut ReadLoop<'_>, frame: ClientToRelay) -> u64 {
        frame.encode(&mut rl.reader.buf);
        rl.process_buffered().expect("valid frame");
        rl.counts.cache_misses
    }

    #[tokio::test]
    async fn reads_adapt_and_tiny_reads_do_not_pin_their_buffer() {
        let server = Server::new(
            ServerConfig::new(SecretKey::from_bytes([1; 32])),
            &prometheus::Registry::new(),
        )
        .expect("server");
        let shared = server.shared();
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
        dst.take(&mut batch);
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
        let server = Server::new(config, &prometheus::Registry::new()).expect("server");
        let shared = server.shared();
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
        assert_eq!(feed(&mut rl, send()), 1);
        tokio::time::advance(IDLE + Duration::from_secs(1)).await;
        feed(&mut rl, ClientToRelay::Ping([7; 8]));
        assert_eq!(feed(&mut rl, send()), 2, "the ping trimmed the idle entry");

        // A ping before the limit keeps a recently used entry.
        feed(&mut rl, ClientToRelay::Ping([8; 8]));
        assert_eq!(feed(&mut rl, send()), 2);
    }
}
