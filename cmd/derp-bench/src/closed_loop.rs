//! Closed-loop pairs for `pingpong`: A sends a timestamped packet to B through the relay, B
//! echoes it the moment it reads it, A times the round trip and sends the next one, keeping
//! `in_flight` packets outstanding.
//!
//! The client side bounds what can be measured, so it is kept lean: each side of each pair
//! has its own OS thread, with either a current-thread tokio runtime driving a
//! [`derp_client`] connection (`--client tokio`: every URL scheme) or a blocking socket
//! speaking DERP directly ([`derp_testkit::raw::BlockingClient`], `--client blocking`: plain
//! http:// only).
//! Neither side shares a runtime, a lock or a queue with anything else; TCP_NODELAY is on,
//! and each packet leaves in its own write as soon as it is made.

use std::io::{ErrorKind, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, bail};
use derp_client::{Client, ClientConfig, ClientReader, ClientWriter, ReceivedFrame, Scheme};
use derp_proto::frame::{FRAME_HEADER_LEN, FrameType, KEY_LEN, PROTOCOL_VERSION};
use derp_proto::{ClientInfo, ClientToRelay, PublicKey, SecretKey};
use derp_testkit::raw::{BlockingClient, UpgradeRequest};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::cli::ClientKind;
use crate::load::{Clock, RttHistogram, new_histogram};
use crate::packet::{HEADER_LEN, Header, Kind};
use crate::target::{Target, describe_connect_error};

/// A sender that hears nothing back for this long gives its outstanding packets up as lost
/// and starts again with new ones.
const STALL: Duration = Duration::from_secs(2);
/// The blocking client writes and reads on one thread, so everything in flight must fit in
/// the sockets' buffers or both ends could wait on each other's writes.
const BLOCKING_MAX_IN_FLIGHT_BYTES: usize = 64 << 10;
/// RecvPacket and SendPacket frames: header and key before the packet.
const PACKET_FRAME_HEAD: usize = FRAME_HEADER_LEN + KEY_LEN;

/// What each pair does.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoopSpec {
    pub(crate) size: usize,
    pub(crate) in_flight: u32,
    pub(crate) client: ClientKind,
}

impl LoopSpec {
    /// Refuses combinations the client cannot do.
    pub(crate) fn check(&self, target: &Target) -> anyhow::Result<()> {
        if self.client == ClientKind::Blocking {
            let plain = |s: Scheme| s == Scheme::Http;
            if !plain(target.url.scheme())
                || target.peer_url.as_ref().is_some_and(|p| !plain(p.scheme()))
            {
                bail!(
                    "--client blocking speaks plain http:// only; use --client tokio for TLS, \
                     WebSocket and QUIC"
                );
            }
            let bytes = self.in_flight as usize * (self.size + PACKET_FRAME_HEAD);
            if bytes > BLOCKING_MAX_IN_FLIGHT_BYTES {
                bail!(
                    "--client blocking keeps at most {} KiB in flight (--in-flight x --size); \
                     use --client tokio for more",
                    BLOCKING_MAX_IN_FLIGHT_BYTES >> 10
                );
            }
        }
        Ok(())
    }
}

/// One measured window, in the bench's clock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoopWindow {
    pub(crate) run: u32,
    pub(crate) start: Instant,
    pub(crate) warm_end: Instant,
    pub(crate) end: Instant,
}

/// What one pair did in a window. Round trips count when their packet left inside the
/// window.
#[derive(Debug)]
pub(crate) struct LoopResult {
    pub(crate) pair: u32,
    /// Packets sent in the window.
    pub(crate) sent: u64,
    /// Of those, packets that came back.
    pub(crate) round_trips: u64,
    /// Packets given up after [`STALL`] without an answer (any time in the run).
    pub(crate) lost: u64,
    pub(crate) rtt: RttHistogram,
    pub(crate) error: Option<String>,
}

impl LoopResult {
    fn new(pair: u32) -> Self {
        Self {
            pair,
            sent: 0,
            round_trips: 0,
            lost: 0,
            rtt: new_histogram(),
            error: None,
        }
    }

    fn failed(pair: u32, error: String) -> Self {
        Self {
            error: Some(error),
            ..Self::new(pair)
        }
    }
}

type Command = (LoopWindow, oneshot::Sender<LoopResult>);

#[derive(Debug)]
enum EchoStop {
    Signal(watch::Sender<bool>),
    Socket(TcpStream),
}

#[derive(Debug)]
struct LoopPair {
    id: u32,
    commands: Option<mpsc::Sender<Command>>,
    sender: Option<JoinHandle<()>>,
    echo_stop: EchoStop,
    echo_stopping: Arc<AtomicBool>,
    echo: Option<JoinHandle<()>>,
    echo_error: Arc<Mutex<Option<String>>>,
}

/// Connected closed-loop pairs, reused across windows.
#[derive(Debug)]
pub(crate) struct LoopPairs {
    pairs: Vec<LoopPair>,
}

impl Drop for LoopPairs {
    fn drop(&mut self) {
        for p in &mut self.pairs {
            // The sender's thread ends when its command channel closes; the echo's when told.
            p.commands = None;
            p.echo_stopping.store(true, Ordering::Relaxed);
            match &p.echo_stop {
                EchoStop::Signal(tx) => {
                    let _ = tx.send(true);
                }
                EchoStop::Socket(s) => {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        for p in &mut self.pairs {
            for t in [p.sender.take(), p.echo.take()].into_iter().flatten() {
                let _ = t.join();
            }
        }
    }
}

impl LoopPairs {
    /// Connects `pairs` pairs numbered from `first_pair`: the echoing sides first, then the
    /// senders.
    pub(crate) async fn connect(
        target: &Target,
        spec: LoopSpec,
        first_pair: u32,
        pairs: u32,
        clock: Clock,
    ) -> anyhow::Result<Self> {
        spec.check(target)?;
        let mut echoes = Vec::new();
        for i in 0..pairs {
            let secret = SecretKey::generate(&mut rand::rngs::OsRng);
            let public = secret.public_key();
            let config = target.peer_client_config(secret.clone(), None);
            let stopping = Arc::new(AtomicBool::new(false));
            let error = Arc::new(Mutex::new(None));
            let (ready_tx, ready_rx) = oneshot::channel();
            let (stop_tx, stop_rx) = watch::channel(false);
            let thread = {
                let (stopping, error) = (stopping.clone(), error.clone());
                let timeout = target.connect_timeout;
                spawn(&format!("echo {}", first_pair + i), move || {
                    match spec.client {
                        ClientKind::Tokio => tokio_echo(config, ready_tx, stop_rx, error),
                        ClientKind::Blocking => {
                            blocking_echo(config, secret, timeout, ready_tx, stopping, error)
                        }
                    }
                })?
            };
            echoes.push((public, stopping, error, thread, stop_tx, ready_rx));
        }
        let mut out = Vec::new();
        let mut failure = None;
        for (i, (public, stopping, error, thread, stop_tx, ready_rx)) in
            echoes.into_iter().enumerate()
        {
            let echo_stop = match ready_rx.await {
                Ok(Ok(Some(socket))) => EchoStop::Socket(socket),
                Ok(Ok(None)) => EchoStop::Signal(stop_tx),
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                    EchoStop::Signal(stop_tx)
                }
                Err(_) => {
                    failure.get_or_insert_with(|| "an echo thread stopped".to_owned());
                    EchoStop::Signal(stop_tx)
                }
            };
            out.push((
                first_pair + i as u32,
                public,
                stopping,
                error,
                thread,
                echo_stop,
            ));
        }
        // Built before checking for failures, so that dropping it stops every thread.
        let mut built = Self { pairs: Vec::new() };
        let mut senders = Vec::new();
        for (id, dst, stopping, error, thread, echo_stop) in out {
            let (cmd_tx, cmd_rx) = mpsc::channel::<Command>();
            let (ready_tx, ready_rx) = oneshot::channel();
            let sender = if failure.is_none() {
                let secret = SecretKey::generate(&mut rand::rngs::OsRng);
                let config = target.client_config(secret.clone(), None);
                let timeout = target.connect_timeout;
                Some(spawn(&format!("sender {id}"), move || {
                    let setup = Setup {
                        dst,
                        pair: id,
                        spec,
                        clock,
                        ready: ready_tx,
                        commands: cmd_rx,
                    };
                    match spec.client {
                        ClientKind::Tokio => tokio_sender(config, setup),
                        ClientKind::Blocking => blocking_sender(config, secret, timeout, setup),
                    }
                })?)
            } else {
                None
            };
            if sender.is_some() {
                senders.push(ready_rx);
            }
            built.pairs.push(LoopPair {
                id,
                commands: Some(cmd_tx),
                sender,
                echo_stop,
                echo_stopping: stopping,
                echo: Some(thread),
                echo_error: error,
            });
        }
        for ready in senders {
            match ready.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                }
                Err(_) => {
                    failure.get_or_insert_with(|| "a sender thread stopped".to_owned());
                }
            }
        }
        if let Some(e) = failure {
            return Err(anyhow!("connecting pingpong pairs to {}: {e}", target.url));
        }
        Ok(built)
    }

    /// Runs one window on every pair; one result per pair.
    pub(crate) async fn run_window(&mut self, window: LoopWindow) -> Vec<LoopResult> {
        let mut waiting = Vec::new();
        for p in &self.pairs {
            let (tx, rx) = oneshot::channel();
            let sent = p
                .commands
                .as_ref()
                .is_some_and(|c| c.send((window, tx)).is_ok());
            waiting.push((p, sent.then_some(rx)));
        }
        let mut out = Vec::new();
        for (p, rx) in waiting {
            let mut result = match rx {
                Some(rx) => rx.await.unwrap_or_else(|_| {
                    LoopResult::failed(p.id, "the sender's thread stopped".to_owned())
                }),
                None => LoopResult::failed(p.id, "the sender failed in an earlier run".to_owned()),
            };
            if let Some(e) = p
                .echo_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                let e = format!("echo: {e}");
                result.error = Some(match result.error.take() {
                    Some(s) => format!("{s}; {e}"),
                    None => e,
                });
            }
            out.push(result);
        }
        out
    }
}

fn spawn(what: &str, f: impl FnOnce() + Send + 'static) -> anyhow::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("derp-bench-loop".into())
        .spawn(f)
        .map_err(|e| anyhow!("starting the thread of pingpong {what}: {e}"))
}

fn current_thread_runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting a runtime: {e}"))
}

/// One side of a pair: a current-thread runtime of its own and a client connected on it.
fn connect_lean(
    config: &ClientConfig,
) -> Result<(tokio::runtime::Runtime, ClientReader, ClientWriter), String> {
    let rt = current_thread_runtime()?;
    let client = rt
        .block_on(Client::connect(config))
        .map_err(|e| describe_connect_error(&e))?;
    let (reader, writer) = client.split();
    Ok((rt, reader, writer))
}

/// What a sender's thread starts with.
struct Setup {
    dst: PublicKey,
    pair: u32,
    spec: LoopSpec,
    clock: Clock,
    ready: oneshot::Sender<Result<(), String>>,
    commands: mpsc::Receiver<Command>,
}

/// The sender's book-keeping within one window.
struct Books {
    result: LoopResult,
    run: u32,
    window_ns: (u64, u64),
    seq: u64,
    /// Packets with a lower sequence number were given up; their late echoes are ignored.
    floor: u64,
    outstanding: u32,
    last_progress: Instant,
}

impl Books {
    fn new(pair: u32, window: &LoopWindow, clock: Clock) -> Self {
        Self {
            result: LoopResult::new(pair),
            run: window.run,
            window_ns: (clock.ns(window.warm_end), clock.ns(window.end)),
            seq: 0,
            floor: 0,
            outstanding: 0,
            last_progress: Instant::now(),
        }
    }

    fn in_window(&self, ns: u64) -> bool {
        ns >= self.window_ns.0 && ns < self.window_ns.1
    }

    /// Stamps the next packet into `buf` and counts it.
    fn stamp(&mut self, buf: &mut [u8], clock: Clock) {
        let sent_ns = clock.ns(Instant::now());
        Header {
            run: self.run,
            pair: self.result.pair,
            kind: Kind::Probe,
            seq: self.seq,
            sent_ns,
        }
        .write(buf);
        self.seq += 1;
        self.outstanding += 1;
        if self.in_window(sent_ns) {
            self.result.sent += 1;
        }
    }

    /// Times an echo, if it is one of this window's.
    fn echoed(&mut self, packet: &[u8], clock: Clock) {
        let now = Instant::now();
        let Some(h) = Header::read(packet) else {
            return;
        };
        if h.run != self.run
            || h.pair != self.result.pair
            || h.kind != Kind::Probe
            || h.seq < self.floor
        {
            return;
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        self.last_progress = now;
        if self.in_window(h.sent_ns) {
            let rtt = clock.ns(now).saturating_sub(h.sent_ns).max(1);
            self.result.rtt.saturating_record(rtt);
            self.result.round_trips += 1;
        }
    }

    /// Nothing came back for [`STALL`]: what is outstanding is lost.
    fn stalled(&mut self) {
        self.result.lost += u64::from(self.outstanding);
        self.outstanding = 0;
        self.floor = self.seq;
        self.last_progress = Instant::now();
    }
}

fn tokio_sender(config: ClientConfig, setup: Setup) {
    let Setup {
        dst,
        pair,
        spec,
        clock,
        ready,
        commands,
    } = setup;
    let (rt, mut reader, mut writer) = match connect_lean(&config) {
        Ok(connected) => connected,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut buf = vec![0u8; spec.size.max(HEADER_LEN)];
    while let Ok((window, reply)) = commands.recv() {
        let mut books = Books::new(pair, &window, clock);
        let outcome = rt.block_on(tokio_window(
            &mut reader,
            &mut writer,
            dst,
            &spec,
            &window,
            clock,
            &mut books,
            &mut buf,
        ));
        let mut result = books.result;
        let failed = outcome.is_err();
        result.error = outcome.err();
        let _ = reply.send(result);
        if failed {
            return;
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn tokio_window(
    reader: &mut ClientReader,
    writer: &mut ClientWriter,
    dst: PublicKey,
    spec: &LoopSpec,
    window: &LoopWindow,
    clock: Clock,
    books: &mut Books,
    buf: &mut [u8],
) -> Result<(), String> {
    tokio::time::sleep_until(window.start).await;
    books.last_progress = Instant::now();
    loop {
        if Instant::now() < window.end {
            while books.outstanding < spec.in_flight {
                books.stamp(buf, clock);
                writer.queue_packet(dst, &*buf).map_err(|e| e.to_string())?;
            }
        } else if books.outstanding == 0 {
            return Ok(());
        }
        // Keep reading while a write waits, so neither end can block the other.
        while writer.buffered_len() > 0 {
            let frame = tokio::select! {
                biased;
                r = writer.flush() => {
                    r.map_err(|e| e.to_string())?;
                    break;
                }
                f = reader.recv() => f,
            };
            on_sender_frame(frame.map_err(|e| e.to_string())?, writer, books, clock)?;
        }
        match tokio::time::timeout_at(books.last_progress + STALL, reader.recv()).await {
            Ok(frame) => on_sender_frame(frame.map_err(|e| e.to_string())?, writer, books, clock)?,
            Err(_) => {
                books.stalled();
                if Instant::now() >= window.end {
                    return Ok(());
                }
            }
        }
    }
}

fn on_sender_frame(
    frame: ReceivedFrame,
    writer: &mut ClientWriter,
    books: &mut Books,
    clock: Clock,
) -> Result<(), String> {
    match frame {
        ReceivedFrame::RecvPacket { packet, .. } => books.echoed(&packet, clock),
        ReceivedFrame::Ping(data) => writer
            .queue_frame(&ClientToRelay::Pong(data))
            .map_err(|e| e.to_string())?,
        _ => {}
    }
    Ok(())
}

fn tokio_echo(
    config: ClientConfig,
    ready: oneshot::Sender<Result<Option<TcpStream>, String>>,
    mut stop: watch::Receiver<bool>,
    error: Arc<Mutex<Option<String>>>,
) {
    let (rt, mut reader, mut writer) = match connect_lean(&config) {
        Ok(connected) => connected,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(None));
    let outcome: Result<(), String> = rt.block_on(async {
        loop {
            let frame = tokio::select! {
                biased;
                _ = stop.changed() => return Ok(()),
                f = reader.recv() => f.map_err(|e| e.to_string())?,
            };
            echo(frame, &mut writer)?;
            while writer.buffered_len() > 0 {
                let frame = tokio::select! {
                    biased;
                    r = writer.flush() => {
                        r.map_err(|e| e.to_string())?;
                        break;
                    }
                    f = reader.recv() => f.map_err(|e| e.to_string())?,
                };
                echo(frame, &mut writer)?;
            }
        }
    });
    if let Err(e) = outcome
        && !*stop.borrow()
    {
        *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
    }
}

/// Queues the echo of a probe (or the answer to a ping).
fn echo(frame: ReceivedFrame, writer: &mut ClientWriter) -> Result<(), String> {
    match frame {
        ReceivedFrame::RecvPacket { src, packet }
            if Header::read(&packet).is_some_and(|h| h.kind == Kind::Probe) =>
        {
            writer
                .queue_packet(src, &packet)
                .map_err(|e| e.to_string())?;
        }
        ReceivedFrame::Ping(data) => writer
            .queue_frame(&ClientToRelay::Pong(data))
            .map_err(|e| e.to_string())?,
        _ => {}
    }
    Ok(())
}

fn raw_connect(
    config: &ClientConfig,
    secret: &SecretKey,
    timeout: Duration,
) -> Result<BlockingClient, String> {
    let (host, port) = (config.url.host(), config.url.port());
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("resolving {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} has no address"))?;
    let host_header = if port == 80 {
        host.to_owned()
    } else {
        format!("{host}:{port}")
    };
    let request = UpgradeRequest {
        host: &host_header,
        path: config.url.path(),
        extra_headers: "User-Agent: derp-bench\r\n",
    };
    let info = ClientInfo {
        version: i64::from(PROTOCOL_VERSION),
        app_name: "derp-bench".into(),
        ..ClientInfo::default()
    };
    BlockingClient::connect(addr, &request, secret, info, timeout)
        .map_err(|e| format!("connecting to {addr}: {e}"))
}

fn blocking_sender(config: ClientConfig, secret: SecretKey, timeout: Duration, setup: Setup) {
    let Setup {
        dst,
        pair,
        spec,
        clock,
        ready,
        commands,
    } = setup;
    let mut conn = match raw_connect(&config, &secret, timeout) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if let Err(e) = conn.stream.set_read_timeout(Some(STALL)) {
        let _ = ready.send(Err(e.to_string()));
        return;
    }
    let _ = ready.send(Ok(()));
    // One SendPacket frame, built once; only the bench header changes between packets.
    let size = spec.size.max(HEADER_LEN);
    let mut frame = vec![0u8; PACKET_FRAME_HEAD + size];
    frame[0] = FrameType::SendPacket as u8;
    frame[1..FRAME_HEADER_LEN].copy_from_slice(&((KEY_LEN + size) as u32).to_be_bytes());
    frame[FRAME_HEADER_LEN..PACKET_FRAME_HEAD].copy_from_slice(dst.as_bytes());
    while let Ok((window, reply)) = commands.recv() {
        let mut books = Books::new(pair, &window, clock);
        let outcome = blocking_window(&mut conn, &spec, &window, clock, &mut books, &mut frame);
        let mut result = books.result;
        let failed = outcome.is_err();
        result.error = outcome.err();
        let _ = reply.send(result);
        if failed {
            return;
        }
    }
}

fn blocking_window(
    conn: &mut BlockingClient,
    spec: &LoopSpec,
    window: &LoopWindow,
    clock: Clock,
    books: &mut Books,
    frame: &mut [u8],
) -> Result<(), String> {
    std::thread::sleep(window.start.saturating_duration_since(Instant::now()));
    books.last_progress = Instant::now();
    loop {
        if Instant::now() < window.end {
            while books.outstanding < spec.in_flight {
                books.stamp(&mut frame[PACKET_FRAME_HEAD..], clock);
                (&conn.stream).write_all(frame).map_err(|e| e.to_string())?;
            }
        } else if books.outstanding == 0 {
            return Ok(());
        }
        match conn.next_frame() {
            Ok((ty, range)) if ty == FrameType::RecvPacket as u8 => {
                if range.len() >= PACKET_FRAME_HEAD {
                    books.echoed(&conn.buf[range.start + PACKET_FRAME_HEAD..range.end], clock);
                }
            }
            Ok((ty, range)) if ty == FrameType::Ping as u8 => {
                conn.buf[range.start] = FrameType::Pong as u8;
                (&conn.stream)
                    .write_all(&conn.buf[range])
                    .map_err(|e| e.to_string())?;
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if books.last_progress.elapsed() >= STALL {
                    books.stalled();
                    if Instant::now() >= window.end {
                        return Ok(());
                    }
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn blocking_echo(
    config: ClientConfig,
    secret: SecretKey,
    timeout: Duration,
    ready: oneshot::Sender<Result<Option<TcpStream>, String>>,
    stopping: Arc<AtomicBool>,
    error: Arc<Mutex<Option<String>>>,
) {
    let mut conn = match raw_connect(&config, &secret, timeout) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    match conn.stream.try_clone() {
        Ok(s) => {
            let _ = ready.send(Ok(Some(s)));
        }
        Err(e) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    }
    let outcome: std::io::Result<()> = (|| {
        loop {
            let (ty, range) = conn.next_frame()?;
            // A RecvPacket from A becomes a SendPacket back to A by its type byte alone: the
            // key after the header is A's either way.
            let is_probe = ty == FrameType::RecvPacket as u8
                && range.len() >= PACKET_FRAME_HEAD
                && Header::read(&conn.buf[range.start + PACKET_FRAME_HEAD..range.end])
                    .is_some_and(|h| h.kind == Kind::Probe);
            let answer = if is_probe {
                conn.buf[range.start] = FrameType::SendPacket as u8;
                true
            } else if ty == FrameType::Ping as u8 {
                conn.buf[range.start] = FrameType::Pong as u8;
                true
            } else {
                false
            };
            if answer {
                (&conn.stream).write_all(&conn.buf[range])?;
            }
        }
    })();
    if let Err(e) = outcome
        && !stopping.load(Ordering::Relaxed)
    {
        *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
    }
}
