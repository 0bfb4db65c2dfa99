//! The read half of a connection: bytes off the socket ([`reader`]), frames out of the
//! bytes and each packet routed to its destination's queue ([`frames`]), and the loop that
//! runs them ([`ReadLoop`]).
//!
//! The read loop runs on the connection's own task. It reads as much as the socket holds,
//! parses every complete frame in the buffer, and hands each packet to its destination's
//! queue as a `Bytes` slice of the read buffer (no copy between sockets, except after tiny
//! reads).

mod frames;
mod reader;

use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use derp_proto::ServerDecoder;
use rand::Rng;
use tokio::time::{Instant, Sleep};

use super::ConnError;
use crate::handle::ConnHandle;
use crate::lookup::Router;
use crate::queue::Control;
use crate::ratelimit::ClientLimiter;
use crate::route::NotHereLimiter;
use crate::state::ServerState;
pub(super) use reader::FrameReader;

/// How a busy stretch of the read loop ended.
enum Stretch {
    /// The connection is to end.
    Ended,
    /// Nothing was read for a keepalive period: wait for traffic holding little.
    Quiet,
    /// The connection is being handed to another process: stop where it is.
    Parked,
}

/// How a [`QuietWait`] ended.
enum Quiet {
    /// The socket has something to read.
    Readable,
    /// The connection is to end (cancelled, or the server is draining).
    Ended,
    /// The connection is being handed to another process: stop where it is.
    Parked,
}

/// Why a busy stretch stops.
enum Halt {
    Cancelled,
    Drained,
    Parked,
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
        if shared.handover.is_begun() {
            return Poll::Ready(Ok(Quiet::Parked));
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

/// The busy read loop's waker, left with the connection's handle (see
/// [`crate::handle::Cancel::register_quiet`]) for as long as this lives: taken back when the
/// loop leaves its busy stretch, by any way, since the handle may outlive the task.
struct WakerLeft<'h>(&'h ConnHandle);

impl<'h> WakerLeft<'h> {
    async fn register(handle: &'h ConnHandle) -> WakerLeft<'h> {
        std::future::poll_fn(|cx| {
            handle.cancel.register_quiet(cx.waker());
            Poll::Ready(())
        })
        .await;
        WakerLeft(handle)
    }
}

impl Drop for WakerLeft<'_> {
    fn drop(&mut self) {
        self.0.cancel.clear_quiet();
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
        let mut read_loop = Self::fresh(shared, handle, reader);
        if handle.is_adopted()
            && let Some(resume) = shared.handover.take_resume(handle.id)
        {
            read_loop.resume(resume);
        }
        read_loop
    }

    fn fresh(
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
            let mut parked = false;
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
                    Ok(Quiet::Parked) => parked = true,
                    Err(e) => break Err(e),
                }
            }
            if !parked {
                match Box::pin(self.run_busy()).await {
                    Ok(Stretch::Quiet) => continue,
                    Ok(Stretch::Ended) => break Ok(()),
                    Ok(Stretch::Parked) => {}
                    Err(e) => break Err(e),
                }
            }
            // Boxed, like the busy loop: only a handover pays for its state.
            if !Box::pin(self.park()).await {
                // Handed over: the successor process serves the connection now.
                return Ok(());
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
        // The task's waker is left with the connection's handle once for the whole stretch,
        // as the quiet wait leaves it, so that a cancel or a drain beginning wakes the loop
        // and each wake-up reads two flags. Futures waiting on the connection's and the
        // server's cancellation instead would register and drop a waiter under a lock on
        // every read, the server's lock shared by every connection on every thread.
        let _waker = WakerLeft::register(handle).await;
        // QUIC connections are not handed over, and their datagrams are routed apart from
        // their read loop anyway: they go on through a handover.
        let parks = !self.reader.is_quic();
        let ended = || {
            std::future::poll_fn(|_| {
                if handle.cancel.is_cancelled() {
                    Poll::Ready(Halt::Cancelled)
                } else if shared.drain_begun.load(Ordering::Acquire) {
                    Poll::Ready(Halt::Drained)
                } else if parks && shared.handover.is_begun() {
                    Poll::Ready(Halt::Parked)
                } else {
                    Poll::Pending
                }
            })
        };
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
                    halt = ended() => return Ok(self.halt(halt)),
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
                // On a graceful shutdown nothing more is read, so what is queued can drain.
                halt = ended() => return Ok(self.halt(halt)),
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

    /// How a busy stretch ends for `halt`.
    fn halt(&mut self, halt: Halt) -> Stretch {
        match halt {
            Halt::Cancelled => Stretch::Ended,
            Halt::Drained => {
                self.drained = true;
                Stretch::Ended
            }
            Halt::Parked => Stretch::Parked,
        }
    }

    /// Parks the loop for a handover: leaves what a successor process needs to continue it
    /// with the handover, then waits for the verdict without reading. Returns true to go on
    /// (the handover was called off, or this connection was not handed), false when the
    /// connection was handed over and this process must let go of it.
    ///
    /// A cancel is not looked at while parked: ending the connection now would close a
    /// socket the successor may already hold. It is seen once the loop goes on.
    async fn park(&mut self) -> bool {
        let shared = self.shared;
        let handle = self.handle;
        let export = self.export();
        if let Some(socket) = shared.handover.deposit(handle.id, export) {
            // The freeze ended before this loop parked: nothing was lent.
            self.reader.restore(socket);
            return !handle.is_handed();
        }
        std::future::poll_fn(|cx| {
            handle.cancel.register_quiet(cx.waker());
            if shared.handover.is_begun() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        handle.cancel.clear_quiet();
        if let Some(socket) = shared.handover.take_back(handle.id) {
            self.reader.restore(socket);
        }
        !handle.is_handed()
    }

    /// What a successor process needs to continue this loop, if it can; the transport is
    /// lent with it (see [`FrameReader::export`]).
    fn export(&mut self) -> Option<crate::handed::ReadExport> {
        if self.drained {
            return None;
        }
        let reader = self.reader.export()?;
        let now = Instant::now();
        Some(crate::handed::ReadExport {
            socket: reader.socket,
            read_buf: reader.buf,
            tls_rx: reader.tls_rx,
            ws: reader.ws,
            resume: crate::handed::ReadResume {
                skip: self.decoder.skipping(),
                tokens: self.limiter.as_ref().map(|l| l.tokens_at(now)),
                age_ms: millis(now.saturating_duration_since(self.connected_at)),
                keepalive_in_ms: millis(self.next_keepalive.saturating_duration_since(now)),
            },
        })
    }

    /// Continues from where a predecessor process left this loop.
    fn resume(&mut self, resume: crate::handed::ReadResume) {
        let now = Instant::now();
        self.decoder = ServerDecoder::resume_skipping(resume.skip);
        self.connected_at = now
            .checked_sub(Duration::from_millis(resume.age_ms))
            .unwrap_or(now);
        self.next_keepalive = now
            + Duration::from_millis(resume.keepalive_in_ms)
                .min(Duration::from_millis(self.keepalive_period_ms.into()));
        if self.limiter.is_some()
            && let Some(tokens) = resume.tokens
        {
            self.limiter = Some(Box::new(ClientLimiter::resumed(
                &self.shared.rate_limits,
                tokens,
                now,
            )));
        }
        // Whatever was buffered may be several frames: handle it before waiting.
        self.copy_payloads = true;
    }

    /// Whether the client's input is under a receive rate limit (then its QUIC datagrams
    /// must be read here, where the limit is kept).
    pub(super) fn is_limited(&self) -> bool {
        self.limiter.is_some()
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
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The largest read; one read can carry many frames.
const READ_CHUNK: usize = 64 * 1024;
/// The smallest read, and the first after the handshake.
const MIN_READ_CHUNK: usize = 4 * 1024;
/// Payloads of a read smaller than this are copied out of the read buffer.
const COPY_READS_BELOW: usize = 1024;
const KEEPALIVE_JITTER_MS: u64 = 5000;

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};
    use derp_io::Transport;
    use derp_proto::{ClientToRelay, SecretKey};

    use super::*;
    use crate::config::ServerConfig;
    use crate::conn::Framing;
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

    /// A relay whose keepalives never wake a read loop within a test's guard against hangs.
    fn state_without_keepalives() -> Arc<ServerState> {
        state(ServerConfig {
            keepalive_interval: Duration::from_secs(24 * 3600),
            ..ServerConfig::new(SecretKey::from_bytes([1; 32]))
        })
    }

    /// Runs `fut`, failing the test with `what` if it has not ended after a minute. A guard
    /// against a hang, not a timing: a loop that misses its wake-up never ends.
    async fn guard_against_a_hang<T>(fut: impl Future<Output = T>, what: &str) -> T {
        tokio::time::timeout(Duration::from_secs(60), fut)
            .await
            .unwrap_or_else(|_| panic!("hung: {what}"))
    }

    /// Has the client send a Ping and waits until the loop has handled it (its pong is
    /// queued): the loop is then in its busy stretch, which it leaves only after a keepalive
    /// period without reads.
    async fn make_busy(conn: &ConnHandle, client: &mut tokio::net::TcpStream) {
        let mut ping = BytesMut::new();
        ClientToRelay::Ping([9; 8]).encode(&mut ping);
        tokio::io::AsyncWriteExt::write_all(client, &ping)
            .await
            .expect("write");
        until(|| !conn.queue.is_drained()).await;
    }

    #[tokio::test]
    async fn a_busy_read_loop_sees_a_drain_begin_and_the_shutdown_end_it() {
        let shared = &state_without_keepalives();
        let conn = handle(1, 3);
        shared.registry.register(&conn);
        shared.watch_lifecycle();
        let (mut rl, mut client) = tcp_read_loop(shared, &conn).await;
        let run = async {
            let (result, ()) = tokio::join!(rl.run(), async {
                make_busy(&conn, &mut client).await;
                assert!(
                    conn.cancel.holds_quiet_waker(),
                    "the busy loop left its waker"
                );
                // Only the server's lifecycle task, through the registry, tells the loop.
                shared.draining.cancel();
                until(|| !conn.cancel.holds_quiet_waker()).await;
                assert!(!conn.cancel.is_cancelled());
                tokio::io::AsyncWriteExt::write_all(&mut client, b"late")
                    .await
                    .expect("write");
                shared.shutdown.cancel();
            });
            result
        };
        guard_against_a_hang(run, "the busy loop saw the drain")
            .await
            .expect("a drained loop ends cleanly");
        assert!(rl.drained, "the loop stopped because the server drained");
        assert!(
            rl.reader.buf.is_empty(),
            "nothing was read after the drain began"
        );
    }

    #[tokio::test]
    async fn a_busy_read_loop_ends_on_cancel_and_leaves_no_waker_behind() {
        let shared = &state_without_keepalives();
        let conn = handle(1, 3);
        shared.registry.register(&conn);
        let (mut rl, mut client) = tcp_read_loop(shared, &conn).await;
        let run = async {
            let (result, ()) = tokio::join!(rl.run(), async {
                make_busy(&conn, &mut client).await;
                conn.cancel.cancel();
            });
            result
        };
        guard_against_a_hang(run, "the busy loop saw the cancel")
            .await
            .expect("a cancelled loop ends cleanly");
        assert!(!rl.drained);
        assert!(
            !conn.cancel.holds_quiet_waker(),
            "the handle, which may outlive the task in caches, keeps no waker"
        );
    }
}
