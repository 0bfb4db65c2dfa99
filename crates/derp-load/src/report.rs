//! The parts of the JSON document every program and mode shares (schema in
//! docs/derp-bench.md): the envelope, CPU use, and one window of load.
//!
//! Units are in the field names: `_s` seconds, `_us` microseconds, `_ms` milliseconds,
//! `_pps` packets per second, `_mbps` megabits (10^6 bits) of DERP payload per second,
//! `_bytes` bytes, `_ratio` a fraction between 0 and 1, `_cores` CPU-seconds per second.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::packet::Kind;
use crate::procfs::CpuSample;

/// Version of the JSON layout; bumped when a field changes meaning or goes away.
pub const SCHEMA_VERSION: u32 = 2;

/// The whole JSON document.
#[derive(Debug, Serialize)]
pub struct Report<C: Serialize, R: Serialize> {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The version of the program that wrote it.
    pub tool_version: &'static str,
    /// The mode, e.g. `throughput` or `soak`.
    pub mode: &'static str,
    /// When the run started, seconds since 1970.
    pub started_unix_s: u64,
    /// Bench processes that carried the load (`--procs`; 1 without it).
    pub procs: usize,
    /// The server and how it was observed.
    pub target: TargetInfo,
    /// Where the bench ran.
    pub machine: Machine,
    /// The mode's settings.
    pub config: C,
    /// The mode's figures.
    pub result: R,
    /// Everything that makes the figures less trustworthy.
    pub warnings: Vec<String>,
}

/// The server in the report.
#[derive(Debug, Serialize)]
pub struct TargetInfo {
    /// The DERP URL tested.
    pub url: String,
    /// Whether the relay ran in the bench's process.
    pub spawned_server: bool,
    /// Where its metrics came from.
    pub metrics_source: Option<String>,
    /// The first `--server-pid`.
    pub server_pid: Option<u32>,
    /// Every `--server-pid`, when more than one was given.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub server_pids: Vec<u32>,
    /// Where the receiving halves of the pairs connected (`--peer-url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_url: Option<String>,
}

/// The bench's machine in the report.
#[derive(Debug, Serialize)]
pub struct Machine {
    /// CPUs available to the bench.
    pub cores: usize,
    /// False for a debug build, whose figures mean little.
    pub bench_release_build: bool,
}

/// CPU used during a measured window.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct CpuUse {
    /// Length of the window.
    pub wall_s: f64,
    /// The bench's CPU seconds (every bench process's).
    pub bench_cpu_s: Option<f64>,
    /// The same per second.
    pub bench_cores: Option<f64>,
    /// The server's CPU seconds.
    pub server_cpu_s: Option<f64>,
    /// The same per second.
    pub server_cores: Option<f64>,
    /// The machine's non-idle CPU per second.
    pub machine_busy_cores: Option<f64>,
    /// Of that, softirq (loopback delivery, charged to no process).
    pub machine_softirq_cores: Option<f64>,
}

impl CpuUse {
    /// The CPU used between two samples `wall_s` apart.
    pub fn between(before: CpuSample, after: CpuSample, wall_s: f64) -> Self {
        let bench = before
            .bench
            .zip(after.bench)
            .map(|(b, a)| a.since(b).total());
        let server = before
            .server
            .zip(after.server)
            .map(|(b, a)| a.since(b).total());
        let per_wall = |cpu: Option<f64>| cpu.map(|c| if wall_s > 0.0 { c / wall_s } else { 0.0 });
        let machine = before.machine.zip(after.machine);
        Self {
            wall_s,
            bench_cpu_s: bench,
            bench_cores: per_wall(bench),
            server_cpu_s: server,
            server_cores: per_wall(server),
            machine_busy_cores: per_wall(machine.map(|(b, a)| (a.busy_s - b.busy_s).max(0.0))),
            machine_softirq_cores: per_wall(
                machine.map(|(b, a)| (a.softirq_s - b.softirq_s).max(0.0)),
            ),
        }
    }
}

impl CpuUse {
    /// Adds other bench processes' CPU over the same window (`--procs`): the bench's figure
    /// is what all of them used. Unknown when any of them is.
    pub fn plus_bench(mut self, others: Option<f64>) -> Self {
        self.bench_cpu_s = self.bench_cpu_s.zip(others).map(|(a, b)| a + b);
        self.bench_cores = self.bench_cpu_s.map(|c| {
            if self.wall_s > 0.0 {
                c / self.wall_s
            } else {
                0.0
            }
        });
        self
    }
}

/// Server drops during a window, from `derp_packets_dropped{reason,kind}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Drops {
    /// Packets dropped in all.
    pub total_packets: u64,
    /// Packets dropped by reason.
    pub by_reason: BTreeMap<String, u64>,
}

/// One pair's counts in a window.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PairResult {
    /// The pair's number.
    pub pair: u32,
    /// Packets sent with a send time in the window.
    pub sent_packets: u64,
    /// Of those, packets that arrived.
    pub delivered_packets: u64,
    /// Sent less delivered.
    pub lost_packets: u64,
    /// That over sent.
    pub loss_ratio: f64,
    /// Arrivals behind one already seen.
    pub out_of_order_packets: u64,
}

/// One measured load window.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoadRun {
    /// Length of the measured window.
    pub window_s: f64,
    /// Pairs connected at its start.
    pub pairs_connected: usize,
    /// The load asked for, all pairs together; `None` when unpaced.
    pub offered_pps: Option<f64>,
    /// The same in Mbit/s of payload.
    pub offered_mbps: Option<f64>,
    /// Packets sent with a send time in the window.
    pub sent_packets: u64,
    /// The same per second.
    pub sent_pps: f64,
    /// Of those, packets that arrived.
    pub delivered_packets: u64,
    /// The same per second.
    pub delivered_pps: f64,
    /// The same in Mbit/s of payload.
    pub delivered_mbps: f64,
    /// Sent less delivered.
    pub lost_packets: u64,
    /// That over sent.
    pub loss_ratio: f64,
    /// Arrivals behind one already seen.
    pub out_of_order_packets: u64,
    /// Each pair's counts.
    pub pairs: Vec<PairResult>,
    /// The server's drops across the window, when its metrics are read.
    pub server_drops: Option<Drops>,
    /// CPU over the window.
    pub cpu: CpuUse,
    /// Server CPU seconds per million delivered packets.
    pub server_cpu_s_per_mpkt: Option<f64>,
    /// Connections that failed in the window.
    pub errors: Vec<String>,
    /// DERP over QUIC: how the packets travelled, and quinn's view of the paths.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quic: Option<QuicWindow>,
}

/// What a fleet's DERP-over-QUIC connections carried in one window, all together (each
/// count is the change across the window), and quinn's path figures at its end.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QuicWindow {
    /// Connections counted.
    pub connections: usize,
    /// Packets the clients sent in datagrams.
    pub datagram_packets_sent: u64,
    /// Packets the clients sent on the stream.
    pub stream_packets_sent: u64,
    /// Packets the clients received in datagrams.
    pub datagram_packets_received: u64,
    /// Packets the clients received on the stream.
    pub stream_packets_received: u64,
    /// QUIC packets the clients' quinn declared lost.
    pub lost_packets: u64,
    /// Congestion events the clients' quinn passed to its controller.
    pub congestion_events: u64,
    /// The clients' congestion windows at the end, mean over connections.
    pub cwnd_mean_bytes: f64,
    /// The clients' smoothed round trips at the end, mean over connections.
    pub rtt_mean_ms: f64,
    /// The smallest and largest path MTU among the connections at the end.
    pub mtu_min: u16,
    /// See `mtu_min`.
    pub mtu_max: u16,
}

impl QuicWindow {
    /// Adds another fleet's (another process's) window to this one.
    pub fn merge(&mut self, o: &Self) {
        let n = (self.connections + o.connections).max(1) as f64;
        let mean = |a: f64, na: usize, b: f64, nb: usize| (a * na as f64 + b * nb as f64) / n;
        self.cwnd_mean_bytes = mean(
            self.cwnd_mean_bytes,
            self.connections,
            o.cwnd_mean_bytes,
            o.connections,
        );
        self.rtt_mean_ms = mean(
            self.rtt_mean_ms,
            self.connections,
            o.rtt_mean_ms,
            o.connections,
        );
        self.mtu_min = if self.connections == 0 {
            o.mtu_min
        } else {
            self.mtu_min.min(o.mtu_min)
        };
        self.mtu_max = self.mtu_max.max(o.mtu_max);
        self.connections += o.connections;
        self.datagram_packets_sent += o.datagram_packets_sent;
        self.stream_packets_sent += o.stream_packets_sent;
        self.datagram_packets_received += o.datagram_packets_received;
        self.stream_packets_received += o.stream_packets_received;
        self.lost_packets += o.lost_packets;
        self.congestion_events += o.congestion_events;
    }
}

impl LoadRun {
    /// The window's figures from its pairs' counts.
    pub fn from_pairs(
        pairs: Vec<PairResult>,
        spec: &WindowSpec,
        connected: usize,
        cpu: CpuUse,
        server_drops: Option<Drops>,
        errors: Vec<String>,
    ) -> Self {
        let window_s = spec.duration.as_secs_f64();
        let sent: u64 = pairs.iter().map(|p| p.sent_packets).sum();
        let delivered: u64 = pairs.iter().map(|p| p.delivered_packets).sum();
        let out_of_order = pairs.iter().map(|p| p.out_of_order_packets).sum();
        let per_s = |n: u64| {
            if window_s > 0.0 {
                n as f64 / window_s
            } else {
                0.0
            }
        };
        let mbps = |pps: f64| pps * spec.size as f64 * 8.0 / 1e6;
        let offered_pps = spec.rate_pps.map(|r| r * pairs.len() as f64);
        let server_cpu_s_per_mpkt = cpu
            .server_cpu_s
            .filter(|_| delivered > 0)
            .map(|s| s / delivered as f64 * 1e6);
        Self {
            window_s,
            pairs_connected: connected,
            offered_pps,
            offered_mbps: offered_pps.map(mbps),
            sent_packets: sent,
            sent_pps: per_s(sent),
            delivered_packets: delivered,
            delivered_pps: per_s(delivered),
            delivered_mbps: mbps(per_s(delivered)),
            lost_packets: sent - delivered,
            loss_ratio: ratio(sent - delivered, sent),
            out_of_order_packets: out_of_order,
            pairs,
            server_drops,
            cpu,
            server_cpu_s_per_mpkt,
            errors,
            quic: None,
        }
    }
}

/// What one window does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WindowSpec {
    /// The run id packets carry.
    pub run: u32,
    /// Packet size in bytes.
    pub size: usize,
    /// Packets/s per pair; `None` is unpaced.
    pub rate_pps: Option<f64>,
    /// Warm-up before the window.
    pub warmup: Duration,
    /// The measured window.
    pub duration: Duration,
    /// Test knob: receivers stop reading this long into the window.
    pub stop_receivers_after: Option<Duration>,
    /// Load, or latency probes (timestamped one by one and timed on return).
    pub kind: Kind,
}

/// `part / whole`, or 0 for an empty whole.
pub fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// An error and its causes on one line (`outer: inner: ...`), as a report's error lists and a
/// worker's answers carry them. A cause the text already ends with (an error that shows its
/// cause itself) is not repeated.
pub fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let more = e.to_string();
        if !text.ends_with(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    /// An error that shows its cause itself and also gives it as its source.
    #[derive(Debug, thiserror::Error)]
    #[error("io error: {0}")]
    struct Shows(#[source] std::io::Error);

    #[test]
    fn error_text_follows_the_causes_once() {
        let io = || std::io::Error::other("broken pipe");
        assert_eq!(error_text(&Outer(io())), "outer: broken pipe");
        assert_eq!(error_text(&Shows(io())), "io error: broken pipe");
        assert_eq!(error_text(&io()), "broken pipe");
    }
}
