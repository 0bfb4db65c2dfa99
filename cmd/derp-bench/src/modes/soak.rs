//! `soak`: many clients for a long time, every kind of traffic at once, then a strict account.
//!
//! The clients play roles, each in its own loop until the run ends:
//!
//! - **closed-loop pairs**: A sends numbered packets to B, B echoes each one, A never has more
//!   than a few in flight; not one may be lost, reordered or late, and A pings every few
//!   seconds;
//! - **floods**: a sender writes open loop at a fixed rate to one receiver; half of the
//!   receivers read in bursts with long pauses (slow readers), so queues overflow and the
//!   write deadline cuts them off; they reconnect;
//! - **churn**: connect, send to other churners (some absent), sometimes open a second
//!   connection with the same key, leave gracefully or abruptly, come back with the same key
//!   or a new one;
//! - **hostile**: malformed frames, low-order keys, garbage requests, wrong methods, truncated
//!   frames, slowloris heads ([`hostile`]); the server must close each one;
//! - **idle**: connected, pinging now and then.
//!
//! At the end every client leaves after a ping barrier (so the server has read everything it
//! sent), and the run checks: the server's books balance (packets received = sent + dropped,
//! by reason), the server received exactly what the clients sent, no stable client lost its
//! connection or a packet, every ping was answered, every hostile connection was closed,
//! the connection gauges are back to 0, the server's descriptors back to where they started,
//! its memory within the stated bounds, and it still serves a new client. Any failure makes
//! the run fail.

mod hostile;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use derp_client::{Client, ClientError, ClientReader, ClientWriter, ReceivedFrame, Scheme};
use derp_proto::{PublicKey, SecretKey};
use rand::Rng;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use crate::cli::{SoakArgs, TargetArgs};
use crate::load::scrape;
use crate::packet::{HEADER_LEN, Header, Kind};
use crate::procfs;
use crate::prom::Scrape;
use crate::target::{ClientTemplate, ServerProbe, SourceAddrs, Target, connect_error_kind};
use crate::{Ctx, Outcome};

/// Packets a closed-loop sender may have in flight: far below the relay's queue depth (32),
/// so a correct relay never has a reason to drop one.
const WINDOW: u64 = 4;
/// A closed-loop packet not echoed within this long is lost.
const ECHO_DEADLINE: Duration = Duration::from_secs(10);
/// Size of closed-loop and churn packets.
const SMALL_PACKET: usize = 200;
/// Receive buffer of slow readers: small, so a pause fills it and the relay's queue quickly.
const SLOW_RCVBUF: u32 = 4096;
/// Size of flood packets.
const FLOOD_PACKET: usize = 1200;
/// Size of flood packets to slow readers: large enough that a pause of a few seconds fills
/// the relay's socket buffer (which grows to megabytes on loopback) and then its queue.
const SLOW_FLOOD_PACKET: usize = 8192;
/// How often resources are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Handshakes in flight at once while clients (re)connect.
const CONNECT_CONCURRENCY: usize = 64;
/// Violations kept verbatim for the report; the rest are only counted.
const MAX_VIOLATIONS_KEPT: usize = 30;

/// What the run counts as it goes.
#[derive(Debug, Default)]
struct Stats {
    /// SendPacket frames the clients wrote (counted once the write succeeded).
    sent: AtomicU64,
    /// RecvPacket frames the clients read.
    received: AtomicU64,
    closed_sent: AtomicU64,
    closed_echoed: AtomicU64,
    closed_lost: AtomicU64,
    pings: AtomicU64,
    pongs: AtomicU64,
    /// Pings outstanding on slow readers when the server cut them off (expected).
    pings_abandoned: AtomicU64,
    /// Pings not answered within 5 s on a connection that stayed up.
    ping_timeouts: AtomicU64,
    connects: AtomicU64,
    /// Slow readers the server cut off (expected: the write deadline at work).
    slow_cut_off: AtomicU64,
    churn_sessions: AtomicU64,
    churn_duplicates: AtomicU64,
    churn_abrupt: AtomicU64,
    hostile_failed: AtomicU64,
    violation_count: AtomicU64,
    violations: Mutex<Vec<String>>,
    connect_failures: Mutex<BTreeMap<String, u64>>,
    hostile: Mutex<BTreeMap<&'static str, u64>>,
}

impl Stats {
    fn violation(&self, what: String) {
        self.violation_count.fetch_add(1, Ordering::Relaxed);
        let mut kept = self.violations.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < MAX_VIOLATIONS_KEPT {
            kept.push(what);
        }
    }

    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// What every role task shares.
#[derive(Debug)]
struct Shared {
    template: ClientTemplate,
    sources: SourceAddrs,
    /// `host:port` of the relay, for the hostile clients' raw sockets.
    addr: String,
    /// For https:// and wss:// nodes: TLS over those sockets, checked as the clients check
    /// it, with the URL's host as SNI.
    tls: Option<(Arc<derp_client::rustls::ClientConfig>, String)>,
    stop: watch::Receiver<bool>,
    stats: Stats,
    connect_gate: Semaphore,
    /// Keys churners use most of the time; packets go to these whether their owner is
    /// connected or not.
    churn_keys: Vec<PublicKey>,
}

/// A socket, or TLS over one.
pub(super) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

impl Shared {
    /// TLS over a connected socket for a TLS node; the socket itself otherwise.
    async fn secure(&self, tcp: TcpStream) -> Result<Box<dyn Stream>, derp_client::ConnectError> {
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some((tls, host)) => {
                let (stream, _) = derp_client::tls::handshake(tls.clone(), host, tcp).await?;
                Ok(Box::new(stream))
            }
        }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    async fn stopped(&self) {
        let mut stop = self.stop.clone();
        let _ = stop.wait_for(|s| *s).await;
    }
}

type PingWait = Pin<Box<dyn Future<Output = Result<Duration, ClientError>> + Send>>;

/// One client connection, driven by a single task.
struct Conn {
    reader: ClientReader,
    writer: ClientWriter,
    key: PublicKey,
    ping: Option<PingWait>,
    pings: u64,
    pongs: u64,
    ping_timeouts: u64,
}

impl Conn {
    /// Connects, retrying (and counting failures) until it works or the run stops.
    async fn open(sh: &Shared, secret: &SecretKey, slot: usize) -> Option<Self> {
        Self::open_with(sh, secret, slot, None).await
    }

    /// Like [`Conn::open`], with the socket's receive buffer set to `rcvbuf` bytes when given
    /// (a slow reader then pushes back on the relay within a few kilobytes).
    async fn open_with(
        sh: &Shared,
        secret: &SecretKey,
        slot: usize,
        rcvbuf: Option<u32>,
    ) -> Option<Self> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if sh.stopping() {
                return None;
            }
            let local = sh.sources.for_index(slot);
            let config = sh.template.config(secret.clone(), local);
            let result = {
                let _permit = sh.connect_gate.acquire().await.ok()?;
                match rcvbuf {
                    None => Client::connect(&config).await,
                    Some(size) => connect_small_rcvbuf(sh, &config, local, size).await,
                }
            };
            match result {
                Ok(client) => {
                    Stats::add(&sh.stats.connects, 1);
                    let (reader, writer) = client.split();
                    return Some(Self {
                        reader,
                        writer,
                        key: secret.public_key(),
                        ping: None,
                        pings: 0,
                        pongs: 0,
                        ping_timeouts: 0,
                    });
                }
                Err(e) => {
                    *sh.stats
                        .connect_failures
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(connect_error_kind(&e))
                        .or_default() += 1;
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = sh.stopped() => return None,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Waits for the outstanding ping, if any, reading meanwhile; counts its pong.
    async fn finish_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        while self.ping.is_some() {
            tokio::select! {
                r = Self::ping_done(&mut self.ping) => self.ponged(sh, r)?,
                f = self.reader.recv() => count_frame(sh, &f?),
            }
        }
        Ok(())
    }

    /// Counts the outcome of a tracked ping.
    fn ponged(&mut self, sh: &Shared, r: Result<Duration, ClientError>) -> Result<(), ClientError> {
        match r {
            Ok(_) => {
                self.pongs += 1;
                Stats::add(&sh.stats.pongs, 1);
                Ok(())
            }
            Err(e) => {
                if matches!(e, ClientError::PingTimeout) {
                    self.ping_timeouts += 1;
                    Stats::add(&sh.stats.ping_timeouts, 1);
                }
                Err(e)
            }
        }
    }

    /// Pings of this connection that were never answered, for a connection whose loss is
    /// expected.
    fn abandon_pings(&self, sh: &Shared) {
        Stats::add(&sh.stats.pings_abandoned, self.pings - self.pongs);
        sh.stats
            .ping_timeouts
            .fetch_sub(self.ping_timeouts, Ordering::Relaxed);
    }

    /// Starts a tracked ping unless one is outstanding.
    async fn start_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        if self.ping.is_none() {
            let pending = self.writer.start_ping().await?;
            self.pings += 1;
            Stats::add(&sh.stats.pings, 1);
            self.ping = Some(Box::pin(pending.wait()));
        }
        Ok(())
    }

    /// Resolves when the outstanding ping (if any) is answered or fails.
    async fn ping_done(ping: &mut Option<PingWait>) -> Result<Duration, ClientError> {
        match ping {
            Some(wait) => {
                let result = wait.await;
                *ping = None;
                result
            }
            None => std::future::pending().await,
        }
    }

    /// Writes one packet to `dst` and counts it once written.
    async fn send(
        &mut self,
        sh: &Shared,
        dst: PublicKey,
        packet: &[u8],
    ) -> Result<(), ClientError> {
        self.writer.queue_packet(dst, packet)?;
        self.writer.flush().await?;
        Stats::add(&sh.stats.sent, 1);
        Ok(())
    }

    /// Pings and waits for the pong while reading whatever else arrives, so that once it
    /// returns the server has handled every frame this client sent. Three tries.
    async fn barrier(&mut self, sh: &Shared) -> Result<(), ClientError> {
        self.finish_ping(sh).await?;
        let mut last = ClientError::PingTimeout;
        for _ in 0..3 {
            self.ping = None;
            self.start_ping(sh).await?;
            loop {
                tokio::select! {
                    r = Self::ping_done(&mut self.ping) => match self.ponged(sh, r) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            last = e;
                            break;
                        }
                    },
                    f = self.reader.recv() => count_frame(sh, &f?),
                }
            }
        }
        Err(last)
    }
}

/// Dials with a small receive buffer, then upgrades and handshakes over that socket.
async fn connect_small_rcvbuf(
    sh: &Shared,
    config: &derp_client::ClientConfig,
    local: Option<std::net::SocketAddr>,
    size: u32,
) -> Result<Client, derp_client::ConnectError> {
    let addr: std::net::SocketAddr = sh.addr.parse().map_err(|_| {
        derp_client::ConnectError::Io(std::io::Error::other("the soak needs an IP address"))
    })?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_recv_buffer_size(size)?;
    if let Some(local) = local {
        socket.bind(local)?;
    }
    let timeout = Duration::from_secs(10);
    let work = async {
        let stream = sh.secure(socket.connect(addr).await?).await?;
        Client::connect_stream(config, stream).await
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| derp_client::ConnectError::Timeout(timeout))?
}

fn count_frame(sh: &Shared, frame: &ReceivedFrame) {
    if matches!(frame, ReceivedFrame::RecvPacket { .. }) {
        Stats::add(&sh.stats.received, 1);
    }
}

fn packet(flow: u32, seq: u64, size: usize) -> Vec<u8> {
    let mut p = vec![0u8; size.max(HEADER_LEN)];
    Header {
        run: 0,
        pair: flow,
        kind: Kind::Load,
        seq,
        sent_ns: 0,
    }
    .write(&mut p);
    p
}

fn new_key() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

/// A closed-loop pair: A sends, B echoes, A checks every echo comes back in order.
async fn closed_pair(sh: Arc<Shared>, flow: u32, slots: (usize, usize), rate: f64) {
    let (sa, sb) = (new_key(), new_key());
    let Some(mut a) = Conn::open(&sh, &sa, slots.0).await else {
        return;
    };
    let Some(mut b) = Conn::open(&sh, &sb, slots.1).await else {
        return;
    };
    let who = format!("closed pair {flow}");
    let mut send_tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.1)));
    send_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut ping_tick = tokio::time::interval(Duration::from_secs(5));
    ping_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut next_seq, mut next_echo) = (0u64, 0u64);
    let mut oldest_sent_at: Option<Instant> = None;
    let mut stopping = false;
    let mut drain_until = None;
    let outcome: Result<(), String> = loop {
        let in_flight = next_seq - next_echo;
        if stopping && in_flight == 0 {
            break Ok(());
        }
        if let Some(since) = oldest_sent_at
            && in_flight > 0
            && since.elapsed() > ECHO_DEADLINE
        {
            break Err(format!(
                "{who}: packet {next_echo} not echoed within {ECHO_DEADLINE:?}"
            ));
        }
        if drain_until.is_some_and(|d| Instant::now() >= d) {
            break Err(format!(
                "{who}: {in_flight} packets still in flight at the end"
            ));
        }
        tokio::select! {
            f = a.reader.recv() => match f {
                Ok(ReceivedFrame::RecvPacket { src, packet }) => {
                    Stats::add(&sh.stats.received, 1);
                    let seq = Header::read(&packet).map(|h| h.seq);
                    if src != b.key || seq != Some(next_echo) {
                        break Err(format!("{who}: expected echo {next_echo}, got {seq:?} from {src:?}"));
                    }
                    next_echo += 1;
                    Stats::add(&sh.stats.closed_echoed, 1);
                    oldest_sent_at = (next_echo < next_seq).then(Instant::now);
                }
                Ok(_) => {}
                Err(e) => break Err(format!("{who}: A lost its connection: {e}")),
            },
            f = b.reader.recv() => match f {
                Ok(ReceivedFrame::RecvPacket { src, packet }) => {
                    Stats::add(&sh.stats.received, 1);
                    if src != a.key {
                        break Err(format!("{who}: B got a packet from {src:?}"));
                    }
                    if let Err(e) = b.send(&sh, a.key, &packet).await {
                        break Err(format!("{who}: B could not echo: {e}"));
                    }
                }
                Ok(_) => {}
                Err(e) => break Err(format!("{who}: B lost its connection: {e}")),
            },
            _ = send_tick.tick(), if !stopping && in_flight < WINDOW => {
                if let Err(e) = a.send(&sh, b.key, &packet(flow, next_seq, SMALL_PACKET)).await {
                    break Err(format!("{who}: A could not send: {e}"));
                }
                Stats::add(&sh.stats.closed_sent, 1);
                if next_echo == next_seq {
                    oldest_sent_at = Some(Instant::now());
                }
                next_seq += 1;
            },
            _ = ping_tick.tick(), if !stopping => {
                if let Err(e) = a.start_ping(&sh).await {
                    break Err(format!("{who}: A could not ping: {e}"));
                }
            },
            r = Conn::ping_done(&mut a.ping) => {
                if let Err(e) = a.ponged(&sh, r) {
                    break Err(format!("{who}: ping unanswered: {e}"));
                }
            },
            _ = sh.stopped(), if !stopping => {
                stopping = true;
                drain_until = Some(Instant::now() + ECHO_DEADLINE);
            },
        }
    };
    if let Err(what) = outcome {
        Stats::add(&sh.stats.closed_lost, next_seq - next_echo);
        sh.stats.violation(what);
    }
    for (name, mut c) in [("A", a), ("B", b)] {
        if let Err(e) = c.barrier(&sh).await {
            sh.stats
                .violation(format!("{who}: {name}'s closing ping failed: {e}"));
        }
        let _ = c.writer.close().await;
    }
}

/// An idle client that pings now and then.
async fn idle(sh: Arc<Shared>, slot: usize) {
    let secret = new_key();
    let Some(mut c) = Conn::open(&sh, &secret, slot).await else {
        return;
    };
    let first = Duration::from_millis(rand::thread_rng().gen_range(0..10_000));
    let mut ping_at = Instant::now() + first;
    let result: Result<(), String> = loop {
        tokio::select! {
            f = c.reader.recv() => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(e) => break Err(format!("idle client {slot} lost its connection: {e}")),
            },
            _ = tokio::time::sleep_until(ping_at) => {
                if let Err(e) = c.start_ping(&sh).await {
                    break Err(format!("idle client {slot} could not ping: {e}"));
                }
                ping_at = Instant::now()
                    + Duration::from_millis(rand::thread_rng().gen_range(5_000..15_000));
            },
            r = Conn::ping_done(&mut c.ping) => {
                if let Err(e) = c.ponged(&sh, r) {
                    break Err(format!("idle client {slot}: ping unanswered: {e}"));
                }
            },
            _ = sh.stopped() => break Ok(()),
        }
    };
    if let Err(what) = result {
        sh.stats.violation(what);
    }
    if let Err(e) = c.barrier(&sh).await {
        sh.stats
            .violation(format!("idle client {slot}: closing ping failed: {e}"));
    }
    let _ = c.writer.close().await;
}

/// A client that keeps coming and going.
async fn churner(sh: Arc<Shared>, index: usize, slot: usize) {
    let own = SecretKey::generate(&mut rand::rngs::OsRng);
    let mut seq = 0u64;
    while !sh.stopping() {
        // Mostly the same key again (a client reconnecting), sometimes a new one.
        let secret = if rand::thread_rng().gen_bool(0.7) {
            own.clone()
        } else {
            new_key()
        };
        let Some(mut c) = Conn::open(&sh, &secret, slot).await else {
            return;
        };
        Stats::add(&sh.stats.churn_sessions, 1);
        let mut dup = if rand::thread_rng().gen_bool(0.1) {
            Stats::add(&sh.stats.churn_duplicates, 1);
            Conn::open(&sh, &secret, slot).await
        } else {
            None
        };
        let session = Duration::from_millis(rand::thread_rng().gen_range(1_000..8_000));
        let end = tokio::time::sleep(session);
        tokio::pin!(end);
        let mut send_tick = tokio::time::interval(Duration::from_millis(
            rand::thread_rng().gen_range(100..500),
        ));
        send_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let result: Result<(), String> = loop {
            tokio::select! {
                f = c.reader.recv() => match f {
                    Ok(f) => count_frame(&sh, &f),
                    Err(e) => break Err(format!("churner {index} lost its connection: {e}")),
                },
                f = async { match dup.as_mut() {
                    Some(d) => d.reader.recv().await,
                    None => std::future::pending().await,
                } } => match f {
                    Ok(f) => count_frame(&sh, &f),
                    Err(e) => break Err(format!("churner {index}'s duplicate lost its connection: {e}")),
                },
                _ = send_tick.tick() => {
                    let dst = sh.churn_keys[rand::thread_rng().gen_range(0..sh.churn_keys.len())];
                    seq += 1;
                    let from = match dup.as_mut() {
                        Some(d) if seq.is_multiple_of(2) => d,
                        _ => &mut c,
                    };
                    if let Err(e) = from.send(&sh, dst, &packet(u32::MAX - index as u32, seq, SMALL_PACKET)).await {
                        break Err(format!("churner {index} could not send: {e}"));
                    }
                },
                _ = &mut end => break Ok(()),
                _ = sh.stopped() => break Ok(()),
            }
        };
        if let Err(what) = result {
            sh.stats.violation(what);
        }
        let abrupt = rand::thread_rng().gen_bool(0.5);
        for mut conn in std::iter::once(c).chain(dup) {
            if let Err(e) = conn.barrier(&sh).await {
                sh.stats
                    .violation(format!("churner {index}: closing ping failed: {e}"));
            }
            if abrupt {
                // Gone without a goodbye, possibly with packets unread.
                Stats::add(&sh.stats.churn_abrupt, 1);
                drop(conn);
            } else {
                let _ = conn.writer.close().await;
            }
        }
    }
}

/// An open-loop sender and its receiver, which is a slow reader when `slow`.
async fn flood(sh: Arc<Shared>, flow: u32, slots: (usize, usize), rate: f64, slow: bool) {
    let (ss, rs) = (new_key(), new_key());
    let Some(mut s) = Conn::open(&sh, &ss, slots.0).await else {
        return;
    };
    let rcvbuf = slow.then_some(SLOW_RCVBUF);
    let Some(mut r) = Conn::open_with(&sh, &rs, slots.1, rcvbuf).await else {
        return;
    };
    let who = format!("flood {flow}");
    let ticks_per_s = 50.0;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / ticks_per_s));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let per_tick = (rate / ticks_per_s).max(1.0).round() as u64;
    let mut reading = true;
    let mut toggle_at = Instant::now() + Duration::from_millis(500);
    let mut seq = 0u64;
    let mut r_alive = true;
    loop {
        tokio::select! {
            f = s.reader.recv() => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(e) => {
                    sh.stats.violation(format!("{who}: the sender lost its connection: {e}"));
                    break;
                }
            },
            f = r.reader.recv(), if reading && r_alive => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(_) if slow => {
                    // The write deadline cut the paused reader off; it comes back.
                    Stats::add(&sh.stats.slow_cut_off, 1);
                    r_alive = false;
                }
                Err(e) => {
                    sh.stats.violation(format!("{who}: the receiver lost its connection: {e}"));
                    break;
                }
            },
            _ = tick.tick() => {
                if !r_alive {
                    match Conn::open_with(&sh, &rs, slots.1, rcvbuf).await {
                        Some(c) => { r = c; r_alive = true; reading = true; }
                        None => break,
                    }
                }
                for _ in 0..per_tick {
                    seq += 1;
                    let size = if slow { SLOW_FLOOD_PACKET } else { FLOOD_PACKET };
                    if let Err(e) = s.writer.queue_packet(r.key, packet(flow, seq, size)) {
                        sh.stats.violation(format!("{who}: queueing failed: {e}"));
                    }
                }
                if let Err(e) = s.writer.flush().await {
                    sh.stats.violation(format!("{who}: the sender could not write: {e}"));
                    break;
                }
                Stats::add(&sh.stats.sent, per_tick);
            },
            _ = tokio::time::sleep_until(toggle_at), if slow => {
                reading = !reading;
                let ms = if reading { 200..1_000 } else { 500..8_000 };
                toggle_at = Instant::now() + Duration::from_millis(rand::thread_rng().gen_range(ms));
            },
            _ = sh.stopped() => break,
        }
    }
    if let Err(e) = s.barrier(&sh).await {
        sh.stats
            .violation(format!("{who}: the sender's closing ping failed: {e}"));
    }
    let _ = s.writer.close().await;
    if r_alive {
        // A slow reader may be cut off by the deadline while it drains; that is fine.
        match r.barrier(&sh).await {
            Ok(()) => {}
            Err(_) if slow => {
                Stats::add(&sh.stats.slow_cut_off, 1);
                r.abandon_pings(&sh);
            }
            Err(e) => sh
                .stats
                .violation(format!("{who}: the receiver's closing ping failed: {e}")),
        }
        let _ = r.writer.close().await;
    }
}

/// Resources of the server, sampled through the run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Resources {
    pub(crate) rss_bytes: Option<u64>,
    pub(crate) fds: Option<u64>,
}

fn sample(target: &Target) -> Resources {
    let pid = match &target.probe {
        ServerProbe::Pids(pids) if pids.len() == 1 => pids[0].to_string(),
        ServerProbe::InProcess => "self".to_owned(),
        _ => return Resources::default(),
    };
    Resources {
        rss_bytes: procfs::process_rss(&pid),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
            .ok()
            .map(|d| d.count() as u64),
    }
}

/// One line of the checks table.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Check {
    pub(crate) name: String,
    pub(crate) ok: bool,
    pub(crate) detail: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct SoakConfig {
    pub(crate) clients: u32,
    pub(crate) duration_s: f64,
    pub(crate) closed_pairs: usize,
    pub(crate) closed_rate_pps: f64,
    pub(crate) flood_pairs: usize,
    pub(crate) flood_rate_pps: f64,
    pub(crate) churners: usize,
    pub(crate) hostile: usize,
    pub(crate) idle: usize,
    pub(crate) max_rss_bytes: u64,
    pub(crate) max_rss_after_bytes: u64,
}

/// Server-side counter changes over the run.
#[derive(Debug, Default, Serialize)]
pub(crate) struct ServerBooks {
    pub(crate) packets_received: u64,
    pub(crate) packets_sent: u64,
    pub(crate) packets_dropped: u64,
    pub(crate) dropped_by_reason: BTreeMap<String, u64>,
    pub(crate) forwarded_in: u64,
    pub(crate) forwarded_out: u64,
    pub(crate) accepts: u64,
    pub(crate) connection_errors: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct SoakResult {
    pub(crate) passed: bool,
    pub(crate) checks: Vec<Check>,
    pub(crate) violations: Vec<String>,
    pub(crate) violation_count: u64,
    pub(crate) elapsed_s: f64,
    pub(crate) client_packets_sent: u64,
    pub(crate) client_packets_received: u64,
    pub(crate) closed_loop_sent: u64,
    pub(crate) closed_loop_echoed: u64,
    pub(crate) closed_loop_lost: u64,
    pub(crate) pings: u64,
    pub(crate) pongs: u64,
    pub(crate) connects: u64,
    pub(crate) connect_failures: BTreeMap<String, u64>,
    pub(crate) slow_readers_cut_off: u64,
    pub(crate) churn_sessions: u64,
    pub(crate) churn_duplicates: u64,
    pub(crate) churn_abrupt_closes: u64,
    pub(crate) hostile_attempts: BTreeMap<&'static str, u64>,
    pub(crate) server: ServerBooks,
    pub(crate) resources_before: Resources,
    pub(crate) resources_peak: Resources,
    pub(crate) resources_after: Resources,
    pub(crate) peak_connections: u64,
}

fn delta(before: &Scrape, after: &Scrape, name: &str) -> u64 {
    (after.sum(name).unwrap_or(0.0) - before.sum(name).unwrap_or(0.0)).max(0.0) as u64
}

fn delta_by(before: &Scrape, after: &Scrape, name: &str, label: &str) -> BTreeMap<String, u64> {
    let earlier = before.sum_by(name, label);
    after
        .sum_by(name, label)
        .into_iter()
        .map(|(k, v)| {
            let was = earlier
                .iter()
                .find(|(e, _)| *e == k)
                .map_or(0.0, |(_, v)| *v);
            (k, (v - was).max(0.0) as u64)
        })
        .filter(|(_, v)| *v > 0)
        .collect()
}

async fn must_scrape(target: &Target) -> anyhow::Result<Scrape> {
    match &target.metrics {
        Some(source) => source.scrape().await,
        None => anyhow::bail!("soak needs the server's metrics: give --metrics-url"),
    }
}

/// Polls until `cond` holds on a fresh scrape, for at most `within`; returns the last scrape.
async fn scrape_until(
    target: &Target,
    within: Duration,
    cond: impl Fn(&Scrape) -> bool,
) -> anyhow::Result<(Scrape, bool)> {
    let deadline = Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let s = must_scrape(target).await?;
        if cond(&s) {
            return Ok((s, true));
        }
        if Instant::now() >= deadline {
            return Ok((s, false));
        }
    }
}

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &SoakArgs,
    quiet: bool,
) -> anyhow::Result<Outcome> {
    let n = args.clients as usize;
    crate::target::check_fd_budget(n + 64, ctx.target.spawned)?;
    match &ctx.target.probe {
        ServerProbe::None => anyhow::bail!(
            "soak checks the server's memory and descriptors: give --server-pid (or use --spawn-server)"
        ),
        ServerProbe::Pids(pids) if pids.len() != 1 => {
            anyhow::bail!("soak checks one server: give one --server-pid")
        }
        _ => {}
    }
    let target = &ctx.target;
    if target.url.scheme() == Scheme::Quic {
        anyhow::bail!(
            "soak's hostile clients and slow readers need TCP: give the node's https:// URL \
             (with --quic-port for QUIC clients)"
        );
    }
    let tls = if target.url.scheme().is_tls() {
        let config = target.client_config(new_key(), None);
        let tls = derp_client::tls::client_config(&config)
            .map_err(|e| anyhow::anyhow!("TLS for the soak's raw sockets: {e}"))?;
        Some((tls, target.url.host().to_owned()))
    } else {
        None
    };
    // Role sizes: 40% closed-loop pairs, 10% floods (sender + receiver), 25% churn, 5%
    // hostile, the rest idle.
    let closed_pairs = (n * 40 / 100 / 2).max(1);
    let flood_pairs = (n * 10 / 100 / 2).max(1);
    let churners = (n * 25 / 100).max(2);
    let hostile_workers = (n * 5 / 100).max(1);
    let idle_clients =
        n.saturating_sub(closed_pairs * 2 + flood_pairs * 2 + churners + hostile_workers);

    // The baseline once the preflight connection (and any earlier run's) has gone.
    let (before_scrape, _) = scrape_until(target, args.settle, |s| {
        s.sum("derp_current_connections").unwrap_or(0.0) == 0.0
    })
    .await?;
    let resources_before = sample(target);
    let (stop_tx, stop_rx) = watch::channel(false);
    let churn_keys: Vec<PublicKey> = (0..churners).map(|_| new_key().public_key()).collect();
    let shared = Arc::new(Shared {
        template: target.template(),
        sources: target.source_addrs(n),
        addr: format!("{}:{}", target.url.host(), target.url.port()),
        tls,
        stop: stop_rx,
        stats: Stats::default(),
        connect_gate: Semaphore::new(CONNECT_CONCURRENCY),
        churn_keys,
    });

    let started = Instant::now();
    let mut tasks = JoinSet::new();
    let mut slot = 0usize;
    let mut next_slot = || {
        slot += 1;
        slot - 1
    };
    for flow in 0..closed_pairs {
        let slots = (next_slot(), next_slot());
        tasks.spawn(closed_pair(
            shared.clone(),
            flow as u32,
            slots,
            args.closed_rate,
        ));
    }
    for i in 0..flood_pairs {
        let slots = (next_slot(), next_slot());
        let flow = (closed_pairs + i) as u32;
        tasks.spawn(flood(
            shared.clone(),
            flow,
            slots,
            args.flood_rate,
            i % 2 == 1,
        ));
    }
    for i in 0..churners {
        tasks.spawn(churner(shared.clone(), i, next_slot()));
    }
    for i in 0..hostile_workers {
        tasks.spawn(hostile::worker(shared.clone(), i));
    }
    for _ in 0..idle_clients {
        tasks.spawn(idle(shared.clone(), next_slot()));
    }

    // Watch the server while the load runs.
    let mut peak = resources_before;
    let mut peak_connections = 0u64;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let mut last_report = Instant::now();
    let end = started + args.duration;
    while Instant::now() < end {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::time::sleep_until(end) => break,
        }
        let now = sample(target);
        peak.rss_bytes = peak.rss_bytes.max(now.rss_bytes);
        peak.fds = peak.fds.max(now.fds);
        if let Some(s) = scrape(target).await {
            let c = s.sum("derp_current_connections").unwrap_or(0.0) as u64;
            peak_connections = peak_connections.max(c);
            if !quiet && last_report.elapsed() >= Duration::from_secs(60) {
                last_report = Instant::now();
                eprintln!(
                    "soak: {:>4}s  {c} connections, RSS {} MiB, {} fds, {} sent, {} received, {} violations",
                    started.elapsed().as_secs(),
                    now.rss_bytes.unwrap_or(0) >> 20,
                    now.fds.unwrap_or(0),
                    Stats::get(&shared.stats.sent),
                    Stats::get(&shared.stats.received),
                    Stats::get(&shared.stats.violation_count),
                );
            }
        }
    }

    // Wind down: every role finishes its session with a ping barrier and leaves.
    let _ = stop_tx.send(true);
    let wind_down = tokio::time::timeout(args.settle + ECHO_DEADLINE * 3, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if wind_down.is_err() {
        shared
            .stats
            .violation("clients did not finish within the settle time".to_owned());
        tasks.abort_all();
    }
    let elapsed_s = started.elapsed().as_secs_f64();

    let mut checks = Vec::new();
    let mut check = |name: &str, ok: bool, detail: String| {
        checks.push(Check {
            name: name.to_owned(),
            ok,
            detail,
        });
    };

    // Gauges back to zero.
    let gauges = [
        "derp_current_connections",
        "derp_clients_local",
        "derp_current_dup_client_keys",
        "derp_current_dup_client_conns",
        "derp_current_home_connections",
        "derp_current_notideal_connections",
    ];
    let (after_scrape, settled) = scrape_until(target, args.settle, |s| {
        gauges.iter().all(|g| s.sum(g).unwrap_or(0.0) == 0.0)
    })
    .await?;
    let gauge_text: Vec<String> = gauges
        .iter()
        .map(|g| {
            format!(
                "{}={}",
                g.trim_start_matches("derp_"),
                after_scrape.sum(g).unwrap_or(0.0)
            )
        })
        .collect();
    check("connection gauges back to 0", settled, gauge_text.join(" "));

    // Descriptors back to the baseline.
    let deadline = Instant::now() + args.settle;
    let mut resources_after = sample(target);
    let mut fd_tick = tokio::time::interval(Duration::from_millis(200));
    while resources_after.fds > resources_before.fds && Instant::now() < deadline {
        fd_tick.tick().await;
        resources_after = sample(target);
    }
    check(
        "descriptors back to the baseline",
        resources_after.fds <= resources_before.fds,
        format!(
            "{} before, {} at peak, {} after",
            opt_u(resources_before.fds),
            opt_u(peak.fds),
            opt_u(resources_after.fds)
        ),
    );
    peak.rss_bytes = peak.rss_bytes.max(resources_after.rss_bytes);

    // The server's books.
    let after_scrape = must_scrape(target).await.unwrap_or(after_scrape);
    let books = ServerBooks {
        packets_received: delta(&before_scrape, &after_scrape, "derp_packets_received"),
        packets_sent: delta(&before_scrape, &after_scrape, "derp_packets_sent"),
        packets_dropped: delta(&before_scrape, &after_scrape, "derp_packets_dropped"),
        dropped_by_reason: delta_by(
            &before_scrape,
            &after_scrape,
            "derp_packets_dropped",
            "reason",
        ),
        forwarded_in: delta(&before_scrape, &after_scrape, "derp_packets_forwarded_in"),
        forwarded_out: delta(&before_scrape, &after_scrape, "derp_packets_forwarded_out"),
        accepts: delta(&before_scrape, &after_scrape, "derp_accepts"),
        connection_errors: delta_by(
            &before_scrape,
            &after_scrape,
            "derp_connection_errors",
            "reason",
        ),
    };
    let inflow = books.packets_received + books.forwarded_in;
    let outflow = books.packets_sent + books.packets_dropped + books.forwarded_out;
    check(
        "server: received = sent + dropped",
        inflow == outflow,
        format!(
            "{} received = {} sent + {} dropped ({})",
            books.packets_received,
            books.packets_sent,
            books.packets_dropped,
            books
                .dropped_by_reason
                .iter()
                .map(|(r, v)| format!("{r} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let stats = &shared.stats;
    let client_sent = Stats::get(&stats.sent);
    let client_received = Stats::get(&stats.received);
    check(
        "server received every packet the clients sent",
        client_sent == books.packets_received,
        format!(
            "clients sent {client_sent}, server received {}",
            books.packets_received
        ),
    );
    check(
        "clients received no more than the server sent",
        client_received <= books.packets_sent,
        format!(
            "server sent {}, clients read {client_received} ({} were left unread by clients that \
             left or were cut off)",
            books.packets_sent,
            books.packets_sent.saturating_sub(client_received)
        ),
    );
    let (closed_sent, closed_echoed) = (
        Stats::get(&stats.closed_sent),
        Stats::get(&stats.closed_echoed),
    );
    check(
        "closed loop: zero loss",
        closed_sent == closed_echoed && Stats::get(&stats.closed_lost) == 0 && closed_sent > 0,
        format!("{closed_sent} sent, {closed_echoed} echoed"),
    );
    let (pings, pongs) = (Stats::get(&stats.pings), Stats::get(&stats.pongs));
    let (abandoned, ping_timeouts) = (
        Stats::get(&stats.pings_abandoned),
        Stats::get(&stats.ping_timeouts),
    );
    check(
        "every ping answered within 5 s",
        pings == pongs + abandoned && ping_timeouts == 0 && pings > 0,
        format!(
            "{pings} pings, {pongs} pongs, {ping_timeouts} timed out, {abandoned} outstanding \
             on slow readers when they were cut off"
        ),
    );
    let hostile = stats
        .hostile
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let hostile_failed = Stats::get(&stats.hostile_failed);
    check(
        "hostile connections answered and closed by the server",
        hostile_failed == 0 && !hostile.is_empty(),
        format!(
            "{} ({hostile_failed} not)",
            hostile
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let violation_count = Stats::get(&stats.violation_count);
    check(
        "no client saw anything wrong",
        violation_count == 0,
        format!("{violation_count} violations"),
    );
    let max_rss = args.max_rss_mib << 20;
    check(
        "peak RSS within bound",
        peak.rss_bytes.is_some_and(|r| r <= max_rss),
        format!(
            "peak {} MiB, bound {} MiB",
            mib(peak.rss_bytes),
            args.max_rss_mib
        ),
    );
    let max_after = resources_before.rss_bytes.unwrap_or(0) + (args.max_rss_after_mib << 20);
    check(
        "RSS after the run within bound",
        resources_after.rss_bytes.is_some_and(|r| r <= max_after),
        format!(
            "{} MiB before, {} MiB after, bound before + {} MiB",
            mib(resources_before.rss_bytes),
            mib(resources_after.rss_bytes),
            args.max_rss_after_mib
        ),
    );
    let fresh = fresh_client(target).await;
    check(
        "a new client is served afterwards",
        fresh.is_ok(),
        fresh
            .err()
            .unwrap_or_else(|| "connected and pinged".to_owned()),
    );

    let result = SoakResult {
        passed: checks.iter().all(|c| c.ok),
        checks: checks.clone(),
        violations: stats
            .violations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        violation_count,
        elapsed_s,
        client_packets_sent: client_sent,
        client_packets_received: client_received,
        closed_loop_sent: closed_sent,
        closed_loop_echoed: closed_echoed,
        closed_loop_lost: Stats::get(&stats.closed_lost),
        pings,
        pongs,
        connects: Stats::get(&stats.connects),
        connect_failures: stats
            .connect_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        slow_readers_cut_off: Stats::get(&stats.slow_cut_off),
        churn_sessions: Stats::get(&stats.churn_sessions),
        churn_duplicates: Stats::get(&stats.churn_duplicates),
        churn_abrupt_closes: Stats::get(&stats.churn_abrupt),
        hostile_attempts: hostile,
        server: books,
        resources_before,
        resources_peak: peak,
        resources_after,
        peak_connections,
    };
    let config = SoakConfig {
        clients: args.clients,
        duration_s: args.duration.as_secs_f64(),
        closed_pairs,
        closed_rate_pps: args.closed_rate,
        flood_pairs,
        flood_rate_pps: args.flood_rate,
        churners,
        hostile: hostile_workers,
        idle: idle_clients,
        max_rss_bytes: max_rss,
        max_rss_after_bytes: max_after,
    };
    let human = human(&config, &result);
    let failure = (!result.passed).then(|| {
        let failed: Vec<&str> = result
            .checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| c.name.as_str())
            .collect();
        format!("soak failed: {}", failed.join("; "))
    });
    let report = ctx.report(target_args, "soak", config, result);
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure,
    })
}

/// Connects one more client and pings: the server still serves after everything.
async fn fresh_client(target: &Target) -> Result<(), String> {
    let config = target.client_config(new_key(), None);
    let mut client = Client::connect(&config)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    client.ping().await.map_err(|e| format!("ping: {e}"))?;
    let _ = client.close().await;
    Ok(())
}

fn mib(b: Option<u64>) -> String {
    b.map_or_else(
        || "-".to_owned(),
        |b| format!("{:.1}", b as f64 / 1048576.0),
    )
}

fn opt_u(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn human(config: &SoakConfig, r: &SoakResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "soak: {} clients for {:.0}s ({} closed-loop pairs at {} pps, {} flood pairs at {} pps, \
         {} churners, {} hostile, {} idle)",
        config.clients,
        config.duration_s,
        config.closed_pairs,
        config.closed_rate_pps,
        config.flood_pairs,
        config.flood_rate_pps,
        config.churners,
        config.hostile,
        config.idle
    );
    let _ = writeln!(
        out,
        "server: RSS {} MiB before, {} MiB peak, {} MiB after; descriptors {} / {} / {}; \
         peak {} connections",
        mib(r.resources_before.rss_bytes),
        mib(r.resources_peak.rss_bytes),
        mib(r.resources_after.rss_bytes),
        opt_u(r.resources_before.fds),
        opt_u(r.resources_peak.fds),
        opt_u(r.resources_after.fds),
        r.peak_connections
    );
    let _ = writeln!(
        out,
        "packets: clients sent {}, server received {}, sent {}, dropped {}; clients read {}",
        r.client_packets_sent,
        r.server.packets_received,
        r.server.packets_sent,
        r.server.packets_dropped,
        r.client_packets_received
    );
    let _ = writeln!(
        out,
        "server connection errors: {}",
        r.server
            .connection_errors
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "clients: {} connects ({} failed), {} churn sessions ({} with a duplicate, {} abrupt), \
         {} slow readers cut off, {} pings",
        r.connects,
        r.connect_failures.values().sum::<u64>(),
        r.churn_sessions,
        r.churn_duplicates,
        r.churn_abrupt_closes,
        r.slow_readers_cut_off,
        r.pings
    );
    for c in &r.checks {
        let _ = writeln!(
            out,
            "{} {}: {}",
            if c.ok { "  ok" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    for v in &r.violations {
        let _ = writeln!(out, "violation: {v}");
    }
    let _ = writeln!(
        out,
        "{}",
        if r.passed {
            "soak passed"
        } else {
            "soak FAILED"
        }
    );
    out
}
