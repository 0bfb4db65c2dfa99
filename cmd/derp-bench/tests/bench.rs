//! Runs the derp-bench binary in every mode against a real relay on loopback and checks that
//! its numbers make sense and that its JSON matches the documented schema (the structs below
//! mirror docs/derp-bench.md and refuse unknown fields).

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::{Command, Output};
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;

use support::{Report, config, private_ca_relay, serve_metrics, temp_path, tls_relay};

fn bench(args: &[&str]) -> Output {
    support::run(env!("CARGO_BIN_EXE_derp-bench"), args)
}

fn bench_json<T: DeserializeOwned>(args: &[&str]) -> Report<T> {
    support::run_json(env!("CARGO_BIN_EXE_derp-bench"), args)
}

// ---- The documented schema ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Cpu {
    wall_s: f64,
    bench_cpu_s: Option<f64>,
    bench_cores: Option<f64>,
    server_cpu_s: Option<f64>,
    server_cores: Option<f64>,
    machine_busy_cores: Option<f64>,
    machine_softirq_cores: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Drops {
    total_packets: u64,
    by_reason: BTreeMap<String, u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairResult {
    pair: u32,
    sent_packets: u64,
    delivered_packets: u64,
    lost_packets: u64,
    loss_ratio: f64,
    out_of_order_packets: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadRun {
    window_s: f64,
    pairs_connected: usize,
    offered_pps: Option<f64>,
    offered_mbps: Option<f64>,
    sent_packets: u64,
    sent_pps: f64,
    delivered_packets: u64,
    delivered_pps: f64,
    delivered_mbps: f64,
    lost_packets: u64,
    loss_ratio: f64,
    out_of_order_packets: u64,
    pairs: Vec<PairResult>,
    server_drops: Option<Drops>,
    cpu: Cpu,
    server_cpu_s_per_mpkt: Option<f64>,
    errors: Vec<String>,
    /// Over QUIC only.
    #[serde(default)]
    quic: Option<QuicWindow>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuicWindow {
    connections: usize,
    datagram_packets_sent: u64,
    stream_packets_sent: u64,
    datagram_packets_received: u64,
    stream_packets_received: u64,
    lost_packets: u64,
    congestion_events: u64,
    cwnd_mean_bytes: f64,
    rtt_mean_ms: f64,
    mtu_min: u16,
    mtu_max: u16,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadMedian {
    delivered_pps: f64,
    delivered_mbps: f64,
    loss_ratio: f64,
    bench_cores: Option<f64>,
    server_cores: Option<f64>,
    server_cpu_s_per_mpkt: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ThroughputConfig {
    pairs: u32,
    size_bytes: u32,
    rate_pps_per_pair: Option<f64>,
    warmup_s: f64,
    duration_s: f64,
    runs: u32,
    stop_receivers_after_s: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ThroughputResult {
    runs: Vec<LoadRun>,
    median: LoadMedian,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyConfig {
    probe_pairs: u32,
    probe_rate_pps: f64,
    size_bytes: u32,
    load_pairs: u32,
    load_rate_pps_per_pair: Option<f64>,
    warmup_s: f64,
    duration_s: f64,
    runs: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Percentiles {
    min_us: f64,
    mean_us: f64,
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyRun {
    probes_sent: u64,
    probes_received: u64,
    probes_lost: u64,
    rtt: Percentiles,
    background: Option<LoadRun>,
    cpu: Cpu,
    errors: Vec<String>,
    /// Over QUIC only: the probe connections'.
    #[serde(default)]
    quic: Option<QuicWindow>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyMedian {
    rtt: Percentiles,
    probe_loss_ratio: f64,
    background_delivered_mbps: Option<f64>,
    bench_cores: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyResult {
    runs: Vec<LatencyRun>,
    median: LatencyMedian,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PingpongConfig {
    pairs: u32,
    in_flight: u32,
    size_bytes: u32,
    client: String,
    warmup_s: f64,
    duration_s: f64,
    runs: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PingpongRun {
    sent_packets: u64,
    round_trips: u64,
    round_trips_per_s: f64,
    lost_packets: u64,
    rtt: Percentiles,
    cpu: Cpu,
    server_cpu_us_per_round_trip: Option<f64>,
    errors: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PingpongMedian {
    rtt: Percentiles,
    round_trips_per_s: f64,
    bench_cores: Option<f64>,
    server_cores: Option<f64>,
    server_cpu_us_per_round_trip: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PingpongResult {
    runs: Vec<PingpongRun>,
    median: PingpongMedian,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectConfig {
    connections: u32,
    concurrency: u32,
    max_duration_s: f64,
    runs: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandshakeTimes {
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectRun {
    attempted: u64,
    succeeded: u64,
    failed: u64,
    failures: BTreeMap<String, u64>,
    elapsed_s: f64,
    handshakes_per_s: f64,
    handshake: HandshakeTimes,
    source_addresses: usize,
    cpu: Cpu,
    server_cpu_ms_per_handshake: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectMedian {
    handshakes_per_s: f64,
    failure_ratio: f64,
    handshake_p50_ms: f64,
    handshake_p99_ms: f64,
    bench_cores: Option<f64>,
    server_cpu_ms_per_handshake: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectResult {
    runs: Vec<ConnectRun>,
    median: ConnectMedian,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdleConfig {
    connections: u32,
    concurrency: u32,
    hold_s: f64,
    runs: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdleRun {
    requested: u64,
    opened: u64,
    failed: u64,
    failures: BTreeMap<String, u64>,
    source_addresses: usize,
    open_s: f64,
    server_connections_before: Option<u64>,
    server_connections_held: Option<u64>,
    rss_source: Option<String>,
    rss_includes_bench: bool,
    rss_before_bytes: Option<u64>,
    rss_held_bytes: Option<u64>,
    rss_after_close_bytes: Option<u64>,
    bytes_per_connection: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdleMedian {
    opened: f64,
    bytes_per_connection: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdleResult {
    runs: Vec<IdleRun>,
    median: IdleMedian,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepConfig {
    pairs: u32,
    size_bytes: u32,
    start_mbps: f64,
    factor: Option<f64>,
    step_mbps: Option<f64>,
    warmup_s: f64,
    step_duration_s: f64,
    loss_threshold: f64,
    steps_past: u32,
    max_steps: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepStep {
    offered_mbps: f64,
    undelivered_ratio: f64,
    load: LoadRun,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saturation {
    max_delivered_mbps: f64,
    max_delivered_at_offered_mbps: f64,
    last_ok_offered_mbps: Option<f64>,
    first_over_threshold_offered_mbps: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepResult {
    steps: Vec<SweepStep>,
    saturation: Saturation,
}

/// Checks that hold for every load window.
fn check_load_run(run: &LoadRun, pairs: usize) {
    assert_eq!(run.pairs.len(), pairs);
    assert_eq!(run.pairs_connected, pairs);
    assert!(run.window_s > 0.0);
    assert!(run.sent_packets > 0, "nothing sent: {run:?}");
    assert!(run.delivered_packets <= run.sent_packets);
    assert_eq!(run.lost_packets, run.sent_packets - run.delivered_packets);
    let sent: u64 = run.pairs.iter().map(|p| p.sent_packets).sum();
    let delivered: u64 = run.pairs.iter().map(|p| p.delivered_packets).sum();
    assert_eq!((sent, delivered), (run.sent_packets, run.delivered_packets));
    for (i, p) in run.pairs.iter().enumerate() {
        assert!(p.delivered_packets <= p.sent_packets);
        assert_eq!(p.lost_packets, p.sent_packets - p.delivered_packets);
        assert!((0.0..=1.0).contains(&p.loss_ratio));
        assert!(p.out_of_order_packets <= p.delivered_packets + p.lost_packets);
        assert!(p.pair as usize >= i);
    }
    assert!((0.0..=1.0).contains(&run.loss_ratio));
    assert!(run.out_of_order_packets <= run.sent_packets);
    let pps = run.delivered_packets as f64 / run.window_s;
    assert!((run.delivered_pps - pps).abs() < 1e-6 * pps.max(1.0));
    assert!(run.delivered_pps <= run.sent_pps);
    assert_eq!(
        run.delivered_mbps > 0.0,
        run.delivered_packets > 0,
        "{run:?}"
    );
    assert!(run.cpu.wall_s > 0.0);
    let bench_cpu_s = run.cpu.bench_cpu_s.expect("the bench's own CPU time");
    let bench_cores = run.cpu.bench_cores.expect("the bench's cores");
    assert!((bench_cores - bench_cpu_s / run.cpu.wall_s).abs() < 1e-9 * bench_cores.max(1.0));
    let busy = run.cpu.machine_busy_cores.expect("/proc/stat is readable");
    assert!(busy > 0.0 && run.cpu.machine_softirq_cores.unwrap() <= busy);
    if let (Some(offered), Some(mbps)) = (run.offered_pps, run.offered_mbps) {
        assert!(offered > 0.0 && mbps > 0.0);
    }
}

// ---- Throughput ----

#[test]
fn throughput_paced_counts_every_packet() {
    let r: Report<ThroughputResult> = bench_json(&[
        "throughput",
        "--spawn-server",
        "--pairs",
        "2",
        "--size",
        "570",
        "--rate",
        "400",
        "--warmup",
        "200ms",
        "--duration",
        "600ms",
        "--runs",
        "2",
    ]);
    assert_eq!(r.schema_version, 2);
    assert_eq!(r.procs, 1);
    assert_eq!(r.mode, "throughput");
    assert!(!r.tool_version.is_empty() && r.started_unix_s > 1_600_000_000);
    assert!(r.target.spawned_server && r.target.url.starts_with("http://127.0.0.1:"));
    assert_eq!(
        r.target.metrics_source.as_deref(),
        Some("in-process registry")
    );
    assert_eq!(r.target.server_pid, None);
    assert!(r.machine.cores >= 1);
    // The tests and the program are built with the same profile.
    assert_eq!(r.machine.bench_release_build, !cfg!(debug_assertions));
    let c: ThroughputConfig = config(&r);
    assert_eq!((c.pairs, c.size_bytes, c.runs), (2, 570, 2));
    assert_eq!(c.rate_pps_per_pair, Some(400.0));
    assert!(c.warmup_s > 0.0 && c.duration_s > 0.0 && c.stop_receivers_after_s.is_none());
    assert_eq!(r.result.runs.len(), 2);
    for run in &r.result.runs {
        check_load_run(run, 2);
        // How many packets the pacer lets out is derp-load's pacing tests' (with an injected
        // clock); how close a loaded machine comes to the rate is what sent_pps measures.
        assert!(run.pairs.iter().all(|p| p.sent_packets > 0), "{run:?}");
        assert_eq!(run.offered_pps, Some(800.0));
        let drops = run
            .server_drops
            .as_ref()
            .expect("in-process metrics give drops");
        assert_eq!(drops.total_packets, drops.by_reason.values().sum::<u64>());
        assert!(run.cpu.server_cpu_s.is_some() && run.cpu.server_cores.is_some());
        assert!(run.errors.is_empty(), "{:?}", run.errors);
        assert!(run.server_cpu_s_per_mpkt.is_some());
    }
    let m = &r.result.median;
    assert!(m.delivered_pps > 0.0 && m.delivered_mbps > 0.0 && m.loss_ratio <= 1.0);
    assert!(m.bench_cores.is_some() && m.server_cores.is_some());
    assert!(m.server_cpu_s_per_mpkt.unwrap() > 0.0);
    assert!(
        r.warnings
            .iter()
            .any(|w| w.contains("inside the bench process"))
    );
}

#[test]
fn throughput_stopped_receivers_show_loss_and_server_drops() {
    let r: Report<ThroughputResult> = bench_json(&[
        "throughput",
        "--spawn-server",
        "--pairs",
        "2",
        "--warmup",
        "100ms",
        "--duration",
        "700ms",
        "--stop-receivers-after",
        "100ms",
    ]);
    let c: ThroughputConfig = config(&r);
    assert_eq!(c.rate_pps_per_pair, None);
    assert_eq!(c.stop_receivers_after_s, Some(0.1));
    let run = &r.result.runs[0];
    check_load_run(run, 2);
    assert!(
        run.lost_packets > 0,
        "a stopped receiver must show loss: {run:?}"
    );
    for p in &run.pairs {
        assert!(p.lost_packets > 0, "pair {} lost nothing", p.pair);
    }
    let drops = run.server_drops.as_ref().unwrap();
    assert!(drops.total_packets > 0);
    assert!(
        drops.by_reason.get("queue_head").copied().unwrap_or(0)
            + drops.by_reason.get("queue_tail").copied().unwrap_or(0)
            + drops
                .by_reason
                .get("gone_disconnected")
                .copied()
                .unwrap_or(0)
            > 0,
        "{drops:?}"
    );
}

// ---- Latency ----

#[test]
fn latency_percentiles_are_ordered_and_plotted() {
    let plot = temp_path("latency.svg");
    let plot_arg = plot.to_str().unwrap().to_owned();
    let r: Report<LatencyResult> = bench_json(&[
        "latency",
        "--spawn-server",
        "--probe-rate",
        "500",
        "--size",
        "570",
        "--load-pairs",
        "1",
        "--load-mbps",
        "5",
        "--warmup",
        "200ms",
        "--duration",
        "600ms",
        "--plot",
        &plot_arg,
    ]);
    let c: LatencyConfig = config(&r);
    assert_eq!(
        (c.probe_pairs, c.size_bytes, c.load_pairs, c.runs),
        (1, 570, 1, 1)
    );
    assert_eq!(c.probe_rate_pps, 500.0);
    assert!(c.load_rate_pps_per_pair.unwrap() > 0.0 && c.warmup_s > 0.0 && c.duration_s > 0.0);
    let run = &r.result.runs[0];
    assert!(run.probes_sent > 0, "{run:?}");
    assert!(run.probes_received > 0 && run.probes_received <= run.probes_sent);
    assert_eq!(run.probes_lost, run.probes_sent - run.probes_received);
    let p = &run.rtt;
    assert!(p.min_us > 0.0);
    assert!(p.min_us <= p.p50_us && p.p50_us <= p.p90_us && p.p90_us <= p.p99_us);
    assert!(p.p99_us <= p.p999_us && p.p999_us <= p.max_us);
    assert!(p.mean_us >= p.min_us && p.mean_us <= p.max_us);
    let bg = run.background.as_ref().expect("background load ran");
    check_load_run(bg, 1);
    assert!(run.cpu.bench_cores.is_some() && run.errors.is_empty());
    let m = &r.result.median;
    assert_eq!(m.rtt.p50_us, p.p50_us);
    assert!(m.probe_loss_ratio <= 1.0 && m.background_delivered_mbps.is_some());
    assert!(m.bench_cores.is_some());
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    let _ = std::fs::remove_file(&plot);
    assert!(
        svg.contains("<svg") && svg.contains("percentile"),
        "{svg:.200}"
    );
}

// ---- Pingpong ----

/// Checks that hold for every closed-loop window: `loops` pairs x in-flight packets.
fn check_pingpong_run(run: &PingpongRun, loops: u32, window_s: f64) {
    assert!(run.round_trips > 0, "{run:?}");
    assert!(run.round_trips <= run.sent_packets, "{run:?}");
    assert_eq!(run.lost_packets, 0, "{run:?}");
    assert!(run.errors.is_empty(), "{:?}", run.errors);
    let expected = run.round_trips as f64 / window_s;
    assert!((run.round_trips_per_s - expected).abs() < 1e-6 * expected);
    let p = &run.rtt;
    assert!(p.min_us > 0.0 && p.min_us <= p.p50_us && p.p50_us <= p.p90_us);
    assert!(p.p90_us <= p.p99_us && p.p99_us <= p.p999_us && p.p999_us <= p.max_us);
    assert!(p.mean_us >= p.min_us && p.mean_us <= p.max_us);
    // A closed loop: no more than `loops` packets are ever out, so the round trips of the
    // packets sent in the window add up to at most `loops` times the window plus the last
    // round trip (hdrhistogram's mean is good to 0.1%).
    let busy_s = run.round_trips as f64 * p.mean_us / 1e6;
    let bound_s = f64::from(loops) * (window_s + p.max_us / 1e6) * 1.01;
    assert!(
        busy_s <= bound_s,
        "{busy_s} s of round trips, bound {bound_s}: {run:?}"
    );
    assert!(run.cpu.bench_cores.is_some() && run.cpu.wall_s > 0.0);
}

#[test]
fn pingpong_keeps_one_packet_in_flight_and_times_each_round_trip() {
    let r: Report<PingpongResult> = bench_json(&[
        "pingpong",
        "--spawn-server",
        "--warmup",
        "200ms",
        "--duration",
        "500ms",
        "--runs",
        "2",
    ]);
    assert_eq!(r.mode, "pingpong");
    let c: PingpongConfig = config(&r);
    assert_eq!(
        (c.pairs, c.in_flight, c.size_bytes, c.runs),
        (1, 1, 1200, 2)
    );
    assert_eq!(c.client, "tokio");
    assert_eq!((c.warmup_s, c.duration_s), (0.2, 0.5));
    assert_eq!(r.result.runs.len(), 2);
    for run in &r.result.runs {
        check_pingpong_run(run, 1, 0.5);
        assert!(run.cpu.server_cpu_s.is_some());
        assert!(run.server_cpu_us_per_round_trip.is_some());
        // Sent and not back yet at the end of the window: at most the one in flight.
        assert!(run.sent_packets - run.round_trips <= 1, "{run:?}");
    }
    let m = &r.result.median;
    assert!(m.rtt.p50_us > 0.0 && m.round_trips_per_s > 0.0);
    assert!(m.bench_cores.is_some() && m.server_cores.is_some());
    assert!(m.server_cpu_us_per_round_trip.is_some());

    // Several pairs with several packets in flight each.
    let r: Report<PingpongResult> = bench_json(&[
        "pingpong",
        "--spawn-server",
        "--pairs",
        "2",
        "--in-flight",
        "4",
        "--size",
        "100",
        "--warmup",
        "100ms",
        "--duration",
        "400ms",
    ]);
    let c: PingpongConfig = config(&r);
    assert_eq!((c.pairs, c.in_flight, c.size_bytes), (2, 4, 100));
    let run = &r.result.runs[0];
    check_pingpong_run(run, 8, 0.4);
    assert!(run.sent_packets - run.round_trips <= 8, "{run:?}");
}

// ---- The floor relay ----

/// A `derp-bench floor-relay` process, stopped when dropped.
struct FloorRelay {
    child: std::process::Child,
    url: String,
}

impl FloorRelay {
    fn start() -> Self {
        use std::io::BufRead;
        let child = Command::new(env!("CARGO_BIN_EXE_derp-bench"))
            .args(["floor-relay", "--listen", "127.0.0.1:0"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting the floor relay");
        // Guarded before anything can panic, so a failed start still stops the process.
        let mut relay = Self {
            child,
            url: String::new(),
        };
        let mut line = String::new();
        let stdout = relay.child.stdout.take().unwrap();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap();
        relay.url = line.trim().to_owned();
        assert!(
            relay.url.starts_with("http://127.0.0.1:") && relay.url.ends_with("/derp"),
            "{:?}",
            relay.url
        );
        relay
    }
}

impl Drop for FloorRelay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn floor_relay_carries_every_client_and_mode() {
    let floor = FloorRelay::start();
    let pid = floor.child.id().to_string();
    let target = ["--url", floor.url.as_str(), "--server-pid", pid.as_str()];
    let with = |mode: &[&str]| -> Vec<String> {
        mode.iter()
            .chain(target.iter())
            .map(|s| s.to_string())
            .collect()
    };
    for client in ["tokio", "blocking"] {
        let args = with(&[
            "pingpong",
            "--client",
            client,
            "--pairs",
            "2",
            "--in-flight",
            "2",
            "--warmup",
            "100ms",
            "--duration",
            "400ms",
        ]);
        let r: Report<PingpongResult> =
            bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let c: PingpongConfig = config(&r);
        assert_eq!(c.client, client);
        let run = &r.result.runs[0];
        check_pingpong_run(run, 4, 0.4);
        assert!(run.cpu.server_cpu_s.is_some(), "--server-pid gives CPU");
    }

    // Open-loop probes and paced load go through it too.
    let args = with(&[
        "latency",
        "--probe-rate",
        "500",
        "--warmup",
        "100ms",
        "--duration",
        "400ms",
    ]);
    let r: Report<LatencyResult> = bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let run = &r.result.runs[0];
    assert!(run.probes_received > 0 && run.probes_lost == 0, "{run:?}");
    let args = with(&[
        "throughput",
        "--pairs",
        "2",
        "--rate",
        "500",
        "--warmup",
        "100ms",
        "--duration",
        "400ms",
    ]);
    let r: Report<ThroughputResult> =
        bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    check_load_run(&r.result.runs[0], 2);
    assert_eq!(r.result.runs[0].lost_packets, 0);
    assert!(r.result.runs[0].quic.is_none(), "no QUIC paths over TCP");

    // Anything but a DERP upgrade gets a 400 and the connection closes.
    let mut s = std::net::TcpStream::connect(
        floor
            .url
            .trim_start_matches("http://")
            .trim_end_matches("/derp"),
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
}

#[test]
fn pingpong_and_floor_relay_refuse_what_they_cannot_do() {
    let out = bench(&["floor-relay", "--url", "http://127.0.0.1:1/derp"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("only --listen"));
    let out = bench(&[
        "pingpong",
        "--spawn-server",
        "--client",
        "blocking",
        "--in-flight",
        "1000",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("at most 64 KiB in flight"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---- Several bench processes ----

#[test]
fn procs_split_the_load_and_merge_the_figures() {
    let window = ["--warmup", "150ms", "--duration", "500ms"];
    let with = |mode: &[&str]| -> Vec<String> {
        mode.iter()
            .chain(["--spawn-server", "--procs", "2"].iter())
            .chain(window.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let json = |args: Vec<String>| -> serde_json::Value {
        let r: Report<serde_json::Value> =
            bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(r.procs, 2, "{:?}", r.warnings);
        assert!(r.target.spawned_server);
        r.result
    };

    // Three pairs over two processes: every pair reported once, counted as one run.
    let r: ThroughputResult =
        serde_json::from_value(json(with(&["throughput", "--pairs", "3", "--rate", "300"])))
            .unwrap();
    let run = &r.runs[0];
    check_load_run(run, 3);
    let ids: Vec<u32> = run.pairs.iter().map(|p| p.pair).collect();
    assert_eq!(ids, [0, 1, 2]);
    // Both processes' pairs sent in the window.
    assert!(run.pairs.iter().all(|p| p.sent_packets > 0), "{run:?}");
    assert_eq!(run.offered_pps, Some(900.0));
    assert!(run.cpu.bench_cpu_s.is_some() && run.cpu.server_cpu_s.is_some());
    assert!(run.server_drops.is_some(), "the parent scrapes the metrics");

    // Probes in one process and background load in both; histograms merged.
    let r: LatencyResult = serde_json::from_value(json(with(&[
        "latency",
        "--probes",
        "2",
        "--probe-rate",
        "200",
        "--load-pairs",
        "2",
        "--load-mbps",
        "2",
    ])))
    .unwrap();
    let run = &r.runs[0];
    assert!(run.probes_received > 0, "{run:?}");
    let bg = run.background.as_ref().unwrap();
    check_load_run(bg, 2);
    assert_eq!(
        bg.pairs.iter().map(|p| p.pair).collect::<Vec<_>>(),
        [2, 3],
        "background pairs are numbered after the probes"
    );

    let r: PingpongResult =
        serde_json::from_value(json(with(&["pingpong", "--pairs", "2"]))).unwrap();
    check_pingpong_run(&r.runs[0], 2, 0.5);
    assert!(r.runs[0].server_cpu_us_per_round_trip.is_some());

    let r: SweepResult = serde_json::from_value(json(vec![
        "sweep".into(),
        "--spawn-server".into(),
        "--procs".into(),
        "2".into(),
        "--pairs".into(),
        "2".into(),
        "--start-mbps".into(),
        "2".into(),
        "--max-steps".into(),
        "2".into(),
        "--warmup".into(),
        "100ms".into(),
        "--step-duration".into(),
        "300ms".into(),
    ]))
    .unwrap();
    for step in &r.steps {
        check_load_run(&step.load, 2);
    }

    let conn = |mode: &[&str]| -> serde_json::Value {
        let mut args: Vec<String> = mode.iter().map(|s| s.to_string()).collect();
        args.extend(["--spawn-server", "--procs", "2"].map(String::from));
        json(args)
    };
    let r: ConnectResult = serde_json::from_value(conn(&[
        "connect",
        "--connections",
        "40",
        "--concurrency",
        "6",
        "--runs",
        "2",
    ]))
    .unwrap();
    for run in &r.runs {
        assert_eq!((run.attempted, run.succeeded, run.failed), (40, 40, 0));
        assert!(run.elapsed_s > 0.0 && run.cpu.bench_cpu_s.is_some());
        let expected = 40.0 / run.elapsed_s;
        assert!((run.handshakes_per_s - expected).abs() < 1e-6 * expected);
        assert!(run.handshake.p50_ms > 0.0 && run.handshake.p50_ms <= run.handshake.max_ms);
    }

    let r: IdleResult = serde_json::from_value(conn(&[
        "idle",
        "--connections",
        "60",
        "--hold",
        "50ms",
        "--runs",
        "2",
    ]))
    .unwrap();
    for run in &r.runs {
        assert_eq!((run.requested, run.opened, run.failed), (60, 60, 0));
        let before = run.server_connections_before.unwrap();
        assert_eq!(run.server_connections_held, Some(before + 60));
        // The clients live in the workers: the relay's process holds only the server side.
        assert!(!run.rss_includes_bench);
    }
}

#[test]
fn procs_beyond_the_load_or_where_they_do_not_apply() {
    let r: Report<PingpongResult> = bench_json(&[
        "pingpong",
        "--spawn-server",
        "--procs",
        "4",
        "--pairs",
        "2",
        "--warmup",
        "100ms",
        "--duration",
        "300ms",
    ]);
    assert_eq!(r.procs, 2);
    assert!(
        r.warnings.iter().any(|w| w.contains("--procs 4")),
        "{:?}",
        r.warnings
    );
    // The soak is its own program; the old mode says where it went.
    let out = bench(&["soak", "--spawn-server", "--clients", "20"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("run `derp-soak` with the same flags"));
    let out = bench(&["worker"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job on stdin"));
}

// ---- Connect ----

#[test]
fn connect_storm_completes_every_handshake() {
    let r: Report<ConnectResult> = bench_json(&[
        "connect",
        "--spawn-server",
        "--connections",
        "60",
        "--concurrency",
        "8",
    ]);
    let c: ConnectConfig = config(&r);
    assert_eq!((c.connections, c.concurrency, c.runs), (60, 8, 1));
    assert!(c.max_duration_s > 0.0);
    let run = &r.result.runs[0];
    assert_eq!((run.attempted, run.succeeded, run.failed), (60, 60, 0));
    assert!(run.failures.is_empty());
    assert!(run.elapsed_s > 0.0 && run.handshakes_per_s > 0.0);
    let expected = run.succeeded as f64 / run.elapsed_s;
    assert!((run.handshakes_per_s - expected).abs() < 1e-6 * expected);
    let h = &run.handshake;
    assert!(h.p50_ms > 0.0 && h.p50_ms <= h.p90_ms && h.p90_ms <= h.p99_ms && h.p99_ms <= h.max_ms);
    assert_eq!(run.source_addresses, 1);
    assert!(run.cpu.server_cpu_s.is_some());
    assert!(run.server_cpu_ms_per_handshake.is_some());
    let m = &r.result.median;
    assert_eq!(m.failure_ratio, 0.0);
    assert!(m.handshakes_per_s > 0.0 && m.handshake_p50_ms <= m.handshake_p99_ms);
    assert!(m.bench_cores.is_some() && m.server_cpu_ms_per_handshake.is_some());
}

// ---- Idle ----

#[test]
fn idle_connections_show_in_the_server_metrics() {
    let r: Report<IdleResult> = bench_json(&[
        "idle",
        "--spawn-server",
        "--connections",
        "150",
        "--hold",
        "100ms",
    ]);
    let c: IdleConfig = config(&r);
    assert_eq!((c.connections, c.runs), (150, 1));
    assert!(c.concurrency > 0 && c.hold_s > 0.0);
    let run = &r.result.runs[0];
    assert_eq!((run.requested, run.opened, run.failed), (150, 150, 0));
    assert!(run.failures.is_empty() && run.source_addresses == 1 && run.open_s > 0.0);
    let before = run
        .server_connections_before
        .expect("connection gauge scraped");
    assert_eq!(run.server_connections_held, Some(before + 150));
    assert!(run.rss_source.is_some() && run.rss_includes_bench);
    assert!(run.rss_before_bytes.unwrap() > 0 && run.rss_held_bytes.unwrap() > 0);
    assert!(run.rss_after_close_bytes.is_some());
    assert!(run.bytes_per_connection.is_some());
    assert_eq!(r.result.median.opened, 150.0);
    assert_eq!(
        r.result.median.bytes_per_connection,
        run.bytes_per_connection
    );
}

/// A shell's usual soft limit on open files is far below what a load test needs; like derpd
/// (and every Go program), derp-bench raises it to the hard limit instead of refusing.
#[test]
fn idle_opens_more_connections_than_the_soft_descriptor_limit_allows() {
    const SOFT: u32 = 256;
    const CONNECTIONS: u32 = 300;
    // Each connection is two descriptors with the relay in the process, and the hard limit
    // must allow them: where it does not, there is nothing to raise to.
    let hard = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(4)
                        .and_then(|h| h.parse::<u32>().ok())
                })
        })
        .unwrap_or(0);
    if hard < CONNECTIONS * 2 + 200 {
        eprintln!("skipped: the hard limit on open files ({hard}) is too low to test raising");
        return;
    }
    let script = format!(
        "ulimit -Sn {SOFT} && exec \"$0\" --json idle --spawn-server --connections {CONNECTIONS} --hold 100ms"
    );
    let out = Command::new("sh")
        .args(["-c", &script, env!("CARGO_BIN_EXE_derp-bench")])
        .output()
        .expect("run derp-bench under sh");
    assert!(
        out.status.success(),
        "derp-bench failed under a soft limit of {SOFT}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Report<IdleResult> = serde_json::from_slice(&out.stdout).expect("the JSON report");
    let run = &r.result.runs[0];
    assert_eq!((run.opened, run.failed), (CONNECTIONS as u64, 0));
}

// ---- Sweep ----

#[test]
fn sweep_steps_up_and_plots() {
    let plot = temp_path("sweep.svg");
    let plot_arg = plot.to_str().unwrap().to_owned();
    let r: Report<SweepResult> = bench_json(&[
        "sweep",
        "--spawn-server",
        "--pairs",
        "1",
        "--start-mbps",
        "2",
        "--factor",
        "3",
        "--max-steps",
        "3",
        "--warmup",
        "100ms",
        "--step-duration",
        "400ms",
        "--plot",
        &plot_arg,
    ]);
    let c: SweepConfig = config(&r);
    assert_eq!((c.pairs, c.max_steps, c.size_bytes), (1, 3, 1400));
    assert_eq!(
        (c.start_mbps, c.factor, c.step_mbps),
        (2.0, Some(3.0), None)
    );
    assert!(c.warmup_s > 0.0 && c.step_duration_s > 0.0 && c.loss_threshold > 0.0);
    assert_eq!(c.steps_past, 2);
    let steps = &r.result.steps;
    assert!(!steps.is_empty() && steps.len() <= 3);
    assert_eq!(steps[0].offered_mbps, 2.0);
    for w in steps.windows(2) {
        assert!((w[1].offered_mbps - 3.0 * w[0].offered_mbps).abs() < 1e-9);
    }
    for s in steps {
        check_load_run(&s.load, 1);
        assert!((0.0..=1.0).contains(&s.undelivered_ratio));
        // Each step's senders were paced at the step's load.
        let paced = s.load.offered_mbps.expect("sweep steps are paced");
        assert!(
            (paced - s.offered_mbps).abs() < 1e-9 * s.offered_mbps,
            "{s:?}"
        );
    }
    let sat = &r.result.saturation;
    let best = steps
        .iter()
        .map(|s| s.load.delivered_mbps)
        .fold(0.0, f64::max);
    assert_eq!(sat.max_delivered_mbps, best);
    assert!(sat.max_delivered_at_offered_mbps > 0.0);
    let within = |s: &&SweepStep| s.undelivered_ratio <= c.loss_threshold;
    assert_eq!(
        sat.last_ok_offered_mbps,
        steps
            .iter()
            .take_while(within)
            .last()
            .map(|s| s.offered_mbps)
    );
    assert_eq!(
        sat.first_over_threshold_offered_mbps,
        steps.iter().find(|s| !within(s)).map(|s| s.offered_mbps)
    );
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    let _ = std::fs::remove_file(&plot);
    assert!(
        svg.contains("<svg") && svg.contains("offered load"),
        "{svg:.200}"
    );
}

// ---- A separately served relay: metrics over HTTP, CPU and memory from /proc ----

#[test]
fn separate_relay_with_metrics_url_and_server_pid() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let registry = prometheus::Registry::new();
    let secret = derp_proto::SecretKey::generate(&mut rand::rngs::OsRng);
    let server =
        derp_server::Server::new(derp_server::ServerConfig::new(secret), &registry).unwrap();
    let (relay, metrics) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = server.clone();
        tokio::spawn(async move { serving.serve(listener).await });
        (addr, serve_metrics(registry).await)
    });
    let url = format!("http://{relay}/derp");
    let metrics_url = format!("http://{metrics}/metrics");
    let pid = std::process::id().to_string();

    let r: Report<ThroughputResult> = bench_json(&[
        "throughput",
        "--url",
        &url,
        "--metrics-url",
        &metrics_url,
        "--server-pid",
        &pid,
        "--pairs",
        "2",
        "--warmup",
        "100ms",
        "--duration",
        "500ms",
        "--stop-receivers-after",
        "50ms",
    ]);
    assert!(!r.target.spawned_server);
    assert_eq!(
        r.target.metrics_source.as_deref(),
        Some(metrics_url.as_str())
    );
    assert_eq!(r.target.server_pid, Some(std::process::id()));
    let run = &r.result.runs[0];
    check_load_run(run, 2);
    assert!(run.lost_packets > 0);
    let drops = run.server_drops.as_ref().expect("drops scraped over HTTP");
    assert!(drops.total_packets > 0, "{drops:?}");
    assert!(run.cpu.server_cpu_s.unwrap() > 0.0);

    let r: Report<IdleResult> = bench_json(&[
        "idle",
        "--url",
        &url,
        "--metrics-url",
        &metrics_url,
        "--server-pid",
        &pid,
        "--connections",
        "100",
        "--hold",
        "50ms",
    ]);
    let run = &r.result.runs[0];
    assert_eq!(run.opened, 100);
    let before = run.server_connections_before.unwrap();
    assert_eq!(run.server_connections_held, Some(before + 100));
    assert_eq!(run.rss_source.as_deref(), Some("server-pid"));
    assert!(!run.rss_includes_bench);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), server.shutdown())
            .await
            .unwrap()
    });
}

// ---- Failures are loud ----

#[test]
fn unreachable_server_fails_with_a_message() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/derp");
    let out = bench(&["throughput", "--url", &url, "--duration", "1s"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot use DERP server") && stderr.contains("refused"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn refused_handshake_fails_with_the_status() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 2048];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0);
            seen.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .unwrap();
    });
    let url = format!("http://{addr}/derp");
    let out = bench(&["connect", "--url", &url, "--connections", "5"]);
    server.join().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HTTP 404"), "{stderr}");
}

#[test]
fn human_output_is_a_table_without_terminal_codes() {
    let out = bench(&[
        "throughput",
        "--spawn-server",
        "--pairs",
        "1",
        "--rate",
        "200",
        "--warmup",
        "100ms",
        "--duration",
        "300ms",
    ]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("delivered pkt/s") && stdout.contains("median:"),
        "{stdout}"
    );
    assert!(!stdout.contains('\u{1b}') && !stderr.contains('\u{1b}'));
    assert!(stderr.contains("warning:"), "{stderr}");
}

#[test]
fn plot_is_refused_where_there_is_nothing_to_draw() {
    let out = bench(&["connect", "--spawn-server", "--plot", "/nonexistent/x.svg"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--plot"));
}

#[test]
fn pairs_split_across_two_meshed_relays_with_peer_url() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mesh_key = derp_proto::MeshKey::from_bytes(rand::random());
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let registry = prometheus::Registry::new();
        let secret = derp_proto::SecretKey::generate(&mut rand::rngs::OsRng);
        let mut config = derp_server::ServerConfig::new(secret.clone());
        config.mesh_key = Some(mesh_key);
        let server = derp_server::Server::new(config, &registry).unwrap();
        let addr = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let serving = server.clone();
            tokio::spawn(async move { serving.serve(listener).await });
            addr
        });
        nodes.push((server, registry, secret, format!("http://{addr}/derp")));
    }
    let _meshes: Vec<_> = (0..2)
        .map(|i| {
            let (server, registry, secret, _) = &nodes[i];
            let other = &nodes[1 - i].3;
            let _guard = rt.enter();
            derp_mesh::Mesh::start(
                server,
                derp_mesh::MeshConfig::new(secret.clone(), mesh_key),
                derp_mesh::parse_mesh_with(other).unwrap(),
                registry,
            )
            .unwrap()
        })
        .collect();
    let gauge = |registry: &prometheus::Registry, name: &str| {
        registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().iter().map(|m| m.get_gauge().get_value()))
            .sum::<f64>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while nodes
        .iter()
        .any(|n| gauge(&n.1, "derp_mesh_links_up") < 1.0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the two relays never meshed"
        );
        std::thread::park_timeout(Duration::from_millis(10));
    }
    let pid = std::process::id().to_string();
    let r: Report<ThroughputResult> = bench_json(&[
        "throughput",
        "--url",
        &nodes[0].3,
        "--peer-url",
        &nodes[1].3,
        "--server-pid",
        &format!("{pid},{pid}"),
        "--pairs",
        "2",
        "--rate",
        "200",
        "--warmup",
        "300ms",
        "--duration",
        "500ms",
    ]);
    assert_eq!(r.target.peer_url.as_deref(), Some(nodes[1].3.as_str()));
    assert_eq!(r.target.server_pids, [std::process::id(); 2]);
    let run = &r.result.runs[0];
    check_load_run(run, 2);
    assert!(run.delivered_packets > 0);
    // Every delivered packet crossed the mesh: the senders' relay forwarded it.
    let forwarded = nodes[0]
        .1
        .gather()
        .iter()
        .filter(|f| f.name() == "derp_packets_forwarded_out")
        .map(|f| f.get_metric()[0].get_counter().get_value())
        .sum::<f64>();
    assert!(forwarded >= run.delivered_packets as f64, "{forwarded}");
}

// ---- DERP over QUIC: every mode takes a quic:// URL ----

/// An in-process relay serving QUIC with a self-signed certificate for 127.0.0.1. Returns
/// the server, its quic:// URL and the certificate pin.
fn quic_relay(rt: &tokio::runtime::Runtime) -> (derp_server::Server, String, String) {
    let (server, front, _) = tls_relay();
    let (cert, key) = derp_tls::generate_self_signed("127.0.0.1".parse().unwrap()).unwrap();
    let chain = derp_tls::load_certs_pem(cert.as_bytes()).unwrap();
    let pin = derp_tls::cert_pin(&chain[0]);
    front
        .install(
            chain,
            derp_tls::load_key_pem(key.as_bytes()).unwrap(),
            derp_tls::CertOrigin::SelfSigned,
        )
        .unwrap();
    let addr = rt.block_on(async {
        let socket = derp_server::quic::bind_udp("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = derp_server::QuicListener::bind(
            socket,
            front.quic_server_config(),
            derp_server::QuicConfig::default(),
        )
        .unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = server.clone();
        tokio::spawn(async move { serving.serve_quic(listener).await });
        addr
    });
    (server, format!("quic://{addr}"), pin)
}

#[test]
fn every_mode_takes_a_quic_url() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, url, pin) = quic_relay(&rt);
    let target = ["--url", url.as_str(), "--cert-name", pin.as_str()];
    let with = |mode: &[&str]| -> Vec<String> {
        mode.iter()
            .chain(target.iter())
            .map(|s| s.to_string())
            .collect()
    };

    let args = with(&[
        "throughput",
        "--pairs",
        "2",
        "--rate",
        "200",
        "--warmup",
        "100ms",
        "--duration",
        "500ms",
    ]);
    let r: Report<ThroughputResult> =
        bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.target.url, format!("{url}/derp"));
    let load = &r.result.runs[0];
    check_load_run(load, 2);
    assert!(load.delivered_packets > 0, "{load:?}");
    // Every pair's two clients, and the packets they carried, by path.
    let quic = load.quic.as_ref().expect("a QUIC run reports its paths");
    assert_eq!(quic.connections, 4, "{quic:?}");
    assert!(
        quic.datagram_packets_sent + quic.stream_packets_sent > 0,
        "{quic:?}"
    );
    assert!(
        quic.datagram_packets_received + quic.stream_packets_received > 0,
        "{quic:?}"
    );
    assert!(
        quic.cwnd_mean_bytes > 0.0 && quic.rtt_mean_ms > 0.0,
        "{quic:?}"
    );
    assert!(
        quic.mtu_min >= 1200 && quic.mtu_max >= quic.mtu_min,
        "{quic:?}"
    );
    // quinn reports a congestion event only with a loss (no ECN marks on loopback).
    assert!(quic.congestion_events <= quic.lost_packets, "{quic:?}");

    let args = with(&[
        "latency",
        "--probe-rate",
        "200",
        "--warmup",
        "100ms",
        "--duration",
        "500ms",
    ]);
    let r: Report<LatencyResult> = bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let lat = &r.result.runs[0];
    assert!(lat.probes_received > 0, "{lat:?}");
    let quic = lat.quic.as_ref().expect("the probes' QUIC paths");
    assert!(
        quic.datagram_packets_received + quic.stream_packets_received > 0,
        "{quic:?}"
    );

    let args = with(&["connect", "--connections", "20", "--concurrency", "4"]);
    let r: Report<ConnectResult> = bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let c = &r.result.runs[0];
    assert_eq!((c.attempted, c.succeeded, c.failed), (20, 20, 0), "{c:?}");

    let args = with(&["idle", "--connections", "20", "--hold", "50ms"]);
    let r: Report<IdleResult> = bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(r.result.runs[0].opened, 20);

    let args = with(&[
        "sweep",
        "--pairs",
        "1",
        "--start-mbps",
        "1",
        "--factor",
        "2",
        "--max-steps",
        "2",
        "--warmup",
        "100ms",
        "--step-duration",
        "300ms",
    ]);
    let r: Report<SweepResult> = bench_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!r.result.steps.is_empty());

    // Without the pin the self-signed certificate is refused, with a hint.
    let out = bench(&["connect", "--url", &url, "--connections", "1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--cert-name"), "{stderr}");

    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), server.shutdown())
            .await
            .unwrap()
    });
}

// ---- TLS nodes with a private CA: https:// and wss:// ----

#[test]
fn every_mode_takes_https_and_wss_with_a_private_ca() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, addr, ca_file, _) = private_ca_relay(&rt);
    let ca = ca_file.to_str().unwrap();
    let https = format!("https://{addr}/derp");
    let wss = format!("wss://{addr}/derp");
    let run = |url: &str, ca_flag: &str, mode: &[&str]| -> serde_json::Value {
        let mut args: Vec<&str> = mode.to_vec();
        args.extend_from_slice(&["--url", url, ca_flag, ca]);
        let r: Report<serde_json::Value> = bench_json(&args);
        assert_eq!(r.target.url, url);
        r.result
    };
    let window = ["--warmup", "100ms", "--duration", "400ms"];
    for (url, ca_flag) in [(&https, "--ca"), (&wss, "--ca-cert")] {
        let mut mode = vec!["throughput", "--pairs", "2", "--rate", "200"];
        mode.extend_from_slice(&window);
        let r: ThroughputResult = serde_json::from_value(run(url, ca_flag, &mode)).unwrap();
        check_load_run(&r.runs[0], 2);
        assert!(r.runs[0].delivered_packets > 0, "{url}: {:?}", r.runs[0]);

        let mut mode = vec!["latency", "--probe-rate", "200"];
        mode.extend_from_slice(&window);
        let r: LatencyResult = serde_json::from_value(run(url, ca_flag, &mode)).unwrap();
        assert!(r.runs[0].probes_received > 0, "{url}: {:?}", r.runs[0]);

        let r: ConnectResult = serde_json::from_value(run(
            url,
            ca_flag,
            &["connect", "--connections", "10", "--concurrency", "4"],
        ))
        .unwrap();
        assert_eq!(r.runs[0].succeeded, 10, "{url}: {:?}", r.runs[0]);

        let r: IdleResult = serde_json::from_value(run(
            url,
            ca_flag,
            &["idle", "--connections", "10", "--hold", "50ms"],
        ))
        .unwrap();
        assert_eq!(r.runs[0].opened, 10, "{url}");

        let r: SweepResult = serde_json::from_value(run(
            url,
            ca_flag,
            &[
                "sweep",
                "--pairs",
                "1",
                "--start-mbps",
                "1",
                "--max-steps",
                "1",
                "--warmup",
                "100ms",
                "--step-duration",
                "300ms",
            ],
        ))
        .unwrap();
        assert!(r.steps[0].load.delivered_packets > 0, "{url}");

        let mut mode = vec!["pingpong", "--in-flight", "2"];
        mode.extend_from_slice(&window);
        let r: PingpongResult = serde_json::from_value(run(url, ca_flag, &mode)).unwrap();
        check_pingpong_run(&r.runs[0], 2, 0.4);
    }

    // The blocking client speaks plain http:// only, and says so.
    let out = bench(&[
        "pingpong", "--url", &https, "--ca", ca, "--client", "blocking",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("plain http:// only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Without the CA the certificate is refused, and the error says which flag to give.
    let out = bench(&["connect", "--url", &https, "--connections", "1"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--ca FILE"), "{stderr}");

    let _ = std::fs::remove_file(&ca_file);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), server.shutdown())
            .await
            .unwrap()
    });
}
