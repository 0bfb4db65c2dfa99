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
    pub schema_version: u32,
    pub tool_version: &'static str,
    pub mode: &'static str,
    pub started_unix_s: u64,
    /// Bench processes that carried the load (`--procs`; 1 without it).
    pub procs: usize,
    pub target: TargetInfo,
    pub machine: Machine,
    pub config: C,
    pub result: R,
    pub warnings: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct TargetInfo {
    pub url: String,
    pub spawned_server: bool,
    pub metrics_source: Option<String>,
    pub server_pid: Option<u32>,
    /// Every `--server-pid`, when more than one was given.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub server_pids: Vec<u32>,
    /// Where the receiving halves of the pairs connected (`--peer-url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_url: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub bench_release_build: bool,
}

/// CPU used during a measured window.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct CpuUse {
    pub wall_s: f64,
    pub bench_cpu_s: Option<f64>,
    pub bench_cores: Option<f64>,
    pub server_cpu_s: Option<f64>,
    pub server_cores: Option<f64>,
    pub machine_busy_cores: Option<f64>,
    pub machine_softirq_cores: Option<f64>,
}

impl CpuUse {
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
    pub total_packets: u64,
    pub by_reason: BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PairResult {
    pub pair: u32,
    pub sent_packets: u64,
    pub delivered_packets: u64,
    pub lost_packets: u64,
    pub loss_ratio: f64,
    pub out_of_order_packets: u64,
}

/// One measured load window.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoadRun {
    pub window_s: f64,
    pub pairs_connected: usize,
    pub offered_pps: Option<f64>,
    pub offered_mbps: Option<f64>,
    pub sent_packets: u64,
    pub sent_pps: f64,
    pub delivered_packets: u64,
    pub delivered_pps: f64,
    pub delivered_mbps: f64,
    pub lost_packets: u64,
    pub loss_ratio: f64,
    pub out_of_order_packets: u64,
    pub pairs: Vec<PairResult>,
    pub server_drops: Option<Drops>,
    pub cpu: CpuUse,
    pub server_cpu_s_per_mpkt: Option<f64>,
    pub errors: Vec<String>,
}

impl LoadRun {
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
        }
    }
}

/// What one window does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WindowSpec {
    pub run: u32,
    pub size: usize,
    /// Packets/s per pair; `None` is unpaced.
    pub rate_pps: Option<f64>,
    pub warmup: Duration,
    pub duration: Duration,
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
