//! Sender/receiver pairs and one measured load window, shared by throughput, sweep and the
//! background load of latency.
//!
//! Each pair is two connections: the sender writes to the receiver's key. Packets carry a
//! header (see [`crate::packet`]) with the run, the pair, a sequence number and the send
//! time. A packet belongs to the measured window when its send time falls inside it; the
//! sender counts what it sent in the window, the receiver what arrived of it, so loss per pair
//! is the difference once the stragglers have drained.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use derp_client::{
    Client, ClientReader, ClientWriter, ConnectError, QuicCounts, QuicPath, ReceivedFrame,
    ServerUrl,
};
use derp_proto::{PublicKey, SecretKey};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::measure::{Clock, RttHistogram, drops_between, new_histogram, sample_cpu, scrape};
use crate::pacing::Pacer;
use crate::packet::{HEADER_LEN, Header, Kind};
use crate::report::{CpuUse, LoadRun, PairResult, QuicWindow, WindowSpec, ratio};
use crate::target::{Target, describe_connect_error};

/// How long a sender may stay blocked in a write after its window ended.
const SENDER_GRACE: Duration = Duration::from_secs(3);
/// Drain phase: stop waiting for stragglers after this long without progress...
const DRAIN_IDLE: Duration = Duration::from_millis(250);
/// ...or after this long in total.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// Handshakes in flight while a fleet connects.
const CONNECT_CONCURRENCY: usize = 64;

/// Counters one pair publishes for the coordinator.
#[derive(Debug, Default)]
struct PairCounters {
    sent: AtomicU64,
    received: AtomicU64,
    out_of_order: AtomicU64,
}

#[derive(Debug)]
struct Pair {
    dst: PublicKey,
    writer: Option<ClientWriter>,
    reader: Option<ClientReader>,
    /// Unused, but dropping a writer half shuts the socket's sending side down, which the
    /// server takes as the client leaving.
    _receiver_writer: Option<ClientWriter>,
    /// Drains whatever the server sends to the sending connection, or (echo fleets) runs the
    /// echo.
    helper: JoinHandle<()>,
}

/// A set of connected pairs, reused across windows.
#[derive(Debug)]
pub struct Fleet {
    pairs: Vec<Pair>,
    /// Index of this fleet's first pair in packet headers, so two fleets in one run (probes
    /// and background load) never count each other's packets.
    first_pair: u32,
    /// Every connection's QUIC path, when the fleet runs over QUIC.
    quic: Vec<QuicPath>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for p in &self.pairs {
            p.helper.abort();
        }
    }
}

impl Fleet {
    /// Connects `pairs` sender/receiver pairs with pre-generated keys.
    ///
    /// With `echo`, the second connection of each pair sends every probe it receives back to
    /// its sender, and the first connection's reader collects the echoes.
    pub async fn connect(
        target: &Target,
        pairs: u32,
        first_pair: u32,
        echo: bool,
    ) -> Result<Self, FleetError> {
        let n = pairs as usize * 2;
        let keys: Vec<SecretKey> = (0..n)
            .map(|_| SecretKey::generate(&mut rand::rngs::OsRng))
            .collect();
        let sources = target.source_addrs(n);
        let gate = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
        let public: Vec<PublicKey> = keys.iter().map(SecretKey::public_key).collect();
        let mut tasks = Vec::with_capacity(n);
        for (i, key) in keys.into_iter().enumerate() {
            // Even connections send, odd ones receive (or echo).
            let config = if i % 2 == 0 {
                target.client_config(key, sources.for_index(i))
            } else {
                target.peer_client_config(key, sources.for_index(i))
            };
            let gate = gate.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire_owned().await;
                Client::connect(&config).await
            }));
        }
        let mut clients = Vec::with_capacity(n);
        for t in tasks {
            let client = t.await?.map_err(|error| FleetError::Connect {
                url: target.url.clone(),
                error,
            })?;
            clients.push(client);
        }
        let quic = clients
            .iter()
            .filter_map(|c| c.quic_path().cloned())
            .collect();
        let mut out = Vec::with_capacity(pairs as usize);
        let mut it = clients.into_iter().zip(public);
        while let (Some((sender, _)), Some((receiver, dst))) = (it.next(), it.next()) {
            let (mut sreader, swriter) = sender.split();
            let (rreader, rwriter) = receiver.split();
            let pair = if echo {
                Pair {
                    dst,
                    writer: Some(swriter),
                    reader: Some(sreader),
                    _receiver_writer: None,
                    helper: tokio::spawn(echo_loop(rreader, rwriter)),
                }
            } else {
                Pair {
                    dst,
                    writer: Some(swriter),
                    reader: Some(rreader),
                    _receiver_writer: Some(rwriter),
                    helper: tokio::spawn(async move { while sreader.recv().await.is_ok() {} }),
                }
            };
            out.push(pair);
        }
        Ok(Self {
            pairs: out,
            first_pair,
            quic,
        })
    }

    /// Each QUIC connection's packet counts and quinn's path figures now.
    fn quic_snapshot(&self) -> Vec<(QuicCounts, quinn_path::Snapshot)> {
        self.quic
            .iter()
            .map(|p| (p.counts(), quinn_path::Snapshot::of(p)))
            .collect()
    }

    /// Runs one warm-up plus measured window from `start` (now, or a start time shared
    /// with other bench processes) and waits for stragglers.
    pub async fn run_window(
        &mut self,
        spec: &WindowSpec,
        start: Instant,
        clock: Clock,
        target: &Target,
    ) -> (LoadRun, RttHistogram) {
        tokio::time::sleep_until(start).await;
        let warm_end = start + spec.warmup;
        let end = warm_end + spec.duration;
        let window = (clock.ns(warm_end), clock.ns(end));
        let (stop_tx, stop_rx) = watch::channel(false);
        let counters: Vec<Arc<PairCounters>> =
            (0..self.pairs.len()).map(|_| Arc::default()).collect();

        let mut receivers = Vec::new();
        let mut senders = Vec::new();
        for (i, pair) in self.pairs.iter_mut().enumerate() {
            let id = self.first_pair + i as u32;
            let (Some(reader), Some(writer)) = (pair.reader.take(), pair.writer.take()) else {
                // A pair that died in an earlier window stays dead; its loss shows as zero
                // sent, and the error count says why.
                continue;
            };
            let stop_at = spec.stop_receivers_after.map(|d| warm_end + d);
            receivers.push((
                i,
                tokio::spawn(receive_loop(
                    reader,
                    ReceiveSpec {
                        run: spec.run,
                        pair: id,
                        kind: spec.kind,
                        window,
                        stop_at,
                    },
                    clock,
                    counters[i].clone(),
                    stop_rx.clone(),
                )),
            ));
            senders.push((
                i,
                tokio::spawn(send_loop(
                    writer,
                    pair.dst,
                    SendSpec {
                        run: spec.run,
                        pair: id,
                        size: spec.size,
                        rate_pps: spec.rate_pps,
                        kind: spec.kind,
                        window,
                        end,
                    },
                    clock,
                    counters[i].clone(),
                )),
            ));
        }

        tokio::time::sleep_until(warm_end).await;
        let cpu_before = sample_cpu(target);
        let quic_before = self.quic_snapshot();
        let scrape_before = scrape(target).await;
        tokio::time::sleep_until(end).await;
        let cpu_after = sample_cpu(target);
        let wall_s = Instant::now()
            .saturating_duration_since(warm_end)
            .as_secs_f64();

        let mut errors = Vec::new();
        for (i, task) in senders {
            match tokio::time::timeout_at(end + SENDER_GRACE, task).await {
                Ok(Ok((writer, None))) => self.pairs[i].writer = Some(writer),
                Ok(Ok((_, Some(e)))) => errors.push(format!("pair {i} sender: {e}")),
                Ok(Err(e)) => errors.push(format!("pair {i} sender task: {e}")),
                Err(_) => errors.push(format!("pair {i} sender: write blocked past the window")),
            }
        }

        let stopped = spec.stop_receivers_after.is_some();
        drain(&counters, stopped).await;
        let quic = quic_window(&quic_before, &self.quic_snapshot());
        let scrape_after = scrape(target).await;
        // A receiver that stopped or failed ignores the signal; it has already returned.
        let _ = stop_tx.send(true);
        let mut rtt = new_histogram();
        for (i, task) in receivers {
            match task.await {
                Ok((reader, hist, error)) => {
                    // Both histograms have the same bounds, so adding cannot fail.
                    let _ = rtt.add(&hist);
                    match error {
                        None => self.pairs[i].reader = Some(reader),
                        Some(e) => errors.push(format!("pair {i} receiver: {e}")),
                    }
                }
                Err(e) => errors.push(format!("pair {i} receiver task: {e}")),
            }
        }

        let pairs: Vec<PairResult> = counters
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let sent = c.sent.load(Ordering::Relaxed);
                // Duplicates would count twice; cap so loss is never negative.
                let delivered = c.received.load(Ordering::Relaxed).min(sent);
                PairResult {
                    pair: self.first_pair + i as u32,
                    sent_packets: sent,
                    delivered_packets: delivered,
                    lost_packets: sent - delivered,
                    loss_ratio: ratio(sent - delivered, sent),
                    out_of_order_packets: c.out_of_order.load(Ordering::Relaxed),
                }
            })
            .collect();
        let mut run = LoadRun::from_pairs(
            pairs,
            spec,
            self.pairs.len(),
            CpuUse::between(cpu_before, cpu_after, wall_s),
            drops_between(scrape_before.as_ref(), scrape_after.as_ref()),
            errors,
        );
        run.quic = quic;
        (run, rtt)
    }
}

/// quinn's figures of a path that a window reports.
mod quinn_path {
    use derp_client::QuicPath;

    #[derive(Clone, Copy, Debug)]
    pub(super) struct Snapshot {
        pub(super) lost_packets: u64,
        pub(super) congestion_events: u64,
        pub(super) cwnd: u64,
        pub(super) rtt_ms: f64,
        pub(super) mtu: u16,
    }

    impl Snapshot {
        pub(super) fn of(path: &QuicPath) -> Self {
            let stats = path.connection().stats().path;
            Self {
                lost_packets: stats.lost_packets,
                congestion_events: stats.congestion_events,
                cwnd: stats.cwnd,
                rtt_ms: stats.rtt.as_secs_f64() * 1e3,
                mtu: stats.current_mtu,
            }
        }
    }
}

/// The change across a window of every QUIC connection's counts, and the paths at its end;
/// `None` without QUIC connections.
fn quic_window(
    before: &[(QuicCounts, quinn_path::Snapshot)],
    after: &[(QuicCounts, quinn_path::Snapshot)],
) -> Option<QuicWindow> {
    if after.is_empty() {
        return None;
    }
    let mut w = QuicWindow {
        connections: after.len(),
        mtu_min: u16::MAX,
        ..QuicWindow::default()
    };
    for ((c0, p0), (c1, p1)) in before.iter().zip(after) {
        w.datagram_packets_sent += c1.datagrams_sent - c0.datagrams_sent;
        w.stream_packets_sent += c1.stream_packets_sent - c0.stream_packets_sent;
        w.datagram_packets_received += c1.datagrams_received - c0.datagrams_received;
        w.stream_packets_received += c1.stream_packets_received - c0.stream_packets_received;
        w.lost_packets += p1.lost_packets - p0.lost_packets;
        w.congestion_events += p1.congestion_events - p0.congestion_events;
        w.cwnd_mean_bytes += p1.cwnd as f64;
        w.rtt_mean_ms += p1.rtt_ms;
        w.mtu_min = w.mtu_min.min(p1.mtu);
        w.mtu_max = w.mtu_max.max(p1.mtu);
    }
    w.cwnd_mean_bytes /= after.len() as f64;
    w.rtt_mean_ms /= after.len() as f64;
    Some(w)
}

/// Runs a window on one fleet, or on two at once from the same start (latency's probes and
/// background load), one spec each.
pub async fn run_fleets(
    fleets: &mut [Fleet],
    specs: &[WindowSpec],
    start: Instant,
    clock: Clock,
    target: &Target,
) -> Result<Vec<(LoadRun, RttHistogram)>, FleetError> {
    match (fleets, specs) {
        ([a], [sa]) => Ok(vec![a.run_window(sa, start, clock, target).await]),
        ([a, b], [sa, sb]) => {
            let (ra, rb) = tokio::join!(
                a.run_window(sa, start, clock, target),
                b.run_window(sb, start, clock, target)
            );
            Ok(vec![ra, rb])
        }
        (f, s) => Err(FleetError::Shape {
            fleets: f.len(),
            specs: s.len(),
        }),
    }
}

/// Why a fleet could not connect or run.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// A pair's connection failed.
    #[error("connecting load pairs to {url}: {}", describe_connect_error(error))]
    Connect {
        /// The server.
        url: ServerUrl,
        /// How it failed.
        error: ConnectError,
    },
    /// A connecting task panicked or was cancelled.
    #[error("connect task")]
    Task(#[from] tokio::task::JoinError),
    /// Specs that do not match the fleets.
    #[error(
        "{fleets} fleets and {specs} window specs: one or two of each, as many specs as fleets"
    )]
    Shape {
        /// Fleets given.
        fleets: usize,
        /// Specs given.
        specs: usize,
    },
}

/// Waits until every receiver has what its sender sent in the window, or until no packet has
/// arrived for a while. With stopped receivers nothing more will come, so it does not wait.
async fn drain(counters: &[Arc<PairCounters>], receivers_stopped: bool) {
    if receivers_stopped {
        return;
    }
    drain_until(DRAIN_IDLE, DRAIN_MAX, || {
        counters.iter().fold((false, 0), |(missing, total), c| {
            let received = c.received.load(Ordering::Relaxed);
            (
                missing || received < c.sent.load(Ordering::Relaxed),
                total + received,
            )
        })
    })
    .await;
}

/// Polls `counts` (whether any receiver still misses packets, and how many arrived in all)
/// every 10 ms until none misses any, or none has arrived for `idle`, or `max` has passed.
pub(crate) async fn drain_until(
    idle: Duration,
    max: Duration,
    mut counts: impl FnMut() -> (bool, u64),
) {
    let started = Instant::now();
    let mut last_total = u64::MAX;
    let mut last_progress = started;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        let (missing, total) = counts();
        let now = Instant::now();
        if !missing || now - started >= max {
            return;
        }
        if total != last_total {
            last_total = total;
            last_progress = now;
        } else if now - last_progress >= idle {
            return;
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct SendSpec {
    run: u32,
    pair: u32,
    size: usize,
    rate_pps: Option<f64>,
    kind: Kind,
    window: (u64, u64),
    end: Instant,
}

async fn send_loop(
    mut writer: ClientWriter,
    dst: PublicKey,
    spec: SendSpec,
    clock: Clock,
    counters: Arc<PairCounters>,
) -> (ClientWriter, Option<String>) {
    let mut buf = vec![0u8; spec.size.max(HEADER_LEN)];
    let mut pacer = Pacer::new(spec.rate_pps, Instant::now());
    let mut seq = 0u64;
    let mut sent_in_window = 0u64;
    loop {
        let now = Instant::now();
        if now >= spec.end {
            break;
        }
        let n = pacer.due(now);
        if n == 0 {
            if let Some(at) = pacer.next(now) {
                tokio::time::sleep_until(at.min(spec.end)).await;
            }
            continue;
        }
        let batch_ns = clock.ns(now);
        let in_window = |ns: u64| ns >= spec.window.0 && ns < spec.window.1;
        for _ in 0..n {
            // Probes are timed one by one; load shares the batch's time.
            let sent_ns = if spec.kind == Kind::Probe {
                clock.ns(Instant::now())
            } else {
                batch_ns
            };
            Header {
                run: spec.run,
                pair: spec.pair,
                kind: spec.kind,
                seq,
                sent_ns,
            }
            .write(&mut buf);
            seq += 1;
            if let Err(e) = writer.queue_packet(dst, &buf) {
                return (writer, Some(e.to_string()));
            }
            // Counted by the same send time the receiver will look at.
            if in_window(sent_ns) {
                sent_in_window += 1;
            }
        }
        counters.sent.store(sent_in_window, Ordering::Relaxed);
        if let Err(e) = writer.flush().await {
            return (writer, Some(e.to_string()));
        }
        if pacer.is_paced() {
            // Let the relay (and the other senders) run between small paced batches.
            tokio::task::yield_now().await;
        }
    }
    (writer, None)
}

#[derive(Clone, Copy, Debug)]
struct ReceiveSpec {
    run: u32,
    pair: u32,
    kind: Kind,
    window: (u64, u64),
    stop_at: Option<Instant>,
}

async fn receive_loop(
    mut reader: ClientReader,
    spec: ReceiveSpec,
    clock: Clock,
    counters: Arc<PairCounters>,
    mut stop: watch::Receiver<bool>,
) -> (ClientReader, RttHistogram, Option<String>) {
    let mut rtt = new_histogram();
    let mut received = 0u64;
    let mut out_of_order = 0u64;
    let mut next_seq = 0u64;
    loop {
        let frame = tokio::select! {
            biased;
            _ = stop.changed() => break,
            _ = sleep_until_opt(spec.stop_at) => {
                // Simulated stuck client: keep the connection, read nothing more.
                let _ = stop.changed().await;
                break;
            }
            f = reader.recv() => f,
        };
        match frame {
            Ok(ReceivedFrame::RecvPacket { packet, .. }) => {
                let Some(h) = Header::read(&packet) else {
                    continue;
                };
                if h.run != spec.run || h.pair != spec.pair || h.kind != spec.kind {
                    continue;
                }
                if h.seq < next_seq {
                    out_of_order += 1;
                    counters.out_of_order.store(out_of_order, Ordering::Relaxed);
                } else {
                    next_seq = h.seq + 1;
                }
                if h.sent_ns >= spec.window.0 && h.sent_ns < spec.window.1 {
                    if spec.kind == Kind::Probe {
                        let now = clock.ns(Instant::now());
                        rtt.saturating_record(now.saturating_sub(h.sent_ns).max(1));
                    }
                    received += 1;
                    counters.received.store(received, Ordering::Relaxed);
                }
            }
            Ok(_) => {}
            Err(e) => return (reader, rtt, Some(e.to_string())),
        }
    }
    (reader, rtt, None)
}

/// Sends every probe back to where it came from, unchanged.
async fn echo_loop(mut reader: ClientReader, mut writer: ClientWriter) {
    loop {
        match reader.recv().await {
            Ok(ReceivedFrame::RecvPacket { src, packet }) => {
                if Header::read(&packet).is_some_and(|h| h.kind == Kind::Probe)
                    && writer.send_packet(src, &packet).await.is_err()
                {
                    return;
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
