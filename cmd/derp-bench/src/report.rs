//! Each mode's part of the JSON document (schema in docs/derp-bench.md; the envelope and the
//! shared pieces are derp-load's) and the human summary tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use derp_load::report::{CpuUse, LoadRun, QuicWindow, ratio};
use serde::Serialize;

/// Medians of the headline load figures over runs.
#[derive(Debug, Serialize)]
pub(crate) struct LoadMedian {
    pub(crate) delivered_pps: f64,
    pub(crate) delivered_mbps: f64,
    pub(crate) loss_ratio: f64,
    pub(crate) bench_cores: Option<f64>,
    pub(crate) server_cores: Option<f64>,
    pub(crate) server_cpu_s_per_mpkt: Option<f64>,
}

impl LoadMedian {
    pub(crate) fn of(runs: &[LoadRun]) -> Self {
        Self {
            delivered_pps: median(runs.iter().map(|r| r.delivered_pps)),
            delivered_mbps: median(runs.iter().map(|r| r.delivered_mbps)),
            loss_ratio: median(runs.iter().map(|r| r.loss_ratio)),
            bench_cores: median_opt(runs.iter().map(|r| r.cpu.bench_cores)),
            server_cores: median_opt(runs.iter().map(|r| r.cpu.server_cores)),
            server_cpu_s_per_mpkt: median_opt(runs.iter().map(|r| r.server_cpu_s_per_mpkt)),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct ThroughputConfig {
    pub(crate) pairs: u32,
    pub(crate) size_bytes: u32,
    pub(crate) rate_pps_per_pair: Option<f64>,
    pub(crate) warmup_s: f64,
    pub(crate) duration_s: f64,
    pub(crate) runs: u32,
    pub(crate) stop_receivers_after_s: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ThroughputResult {
    pub(crate) runs: Vec<LoadRun>,
    pub(crate) median: LoadMedian,
}

#[derive(Debug, Serialize)]
pub(crate) struct LatencyConfig {
    pub(crate) probe_pairs: u32,
    pub(crate) probe_rate_pps: f64,
    pub(crate) size_bytes: u32,
    pub(crate) load_pairs: u32,
    pub(crate) load_rate_pps_per_pair: Option<f64>,
    pub(crate) warmup_s: f64,
    pub(crate) duration_s: f64,
    pub(crate) runs: u32,
}

/// Round-trip percentiles, microseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Percentiles {
    pub(crate) min_us: f64,
    pub(crate) mean_us: f64,
    pub(crate) p50_us: f64,
    pub(crate) p90_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) p999_us: f64,
    pub(crate) max_us: f64,
}

impl Percentiles {
    /// From a histogram of nanoseconds.
    pub(crate) fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        let us = |ns: u64| ns as f64 / 1e3;
        if h.is_empty() {
            return Self::default();
        }
        Self {
            min_us: us(h.min()),
            mean_us: h.mean() / 1e3,
            p50_us: us(h.value_at_quantile(0.5)),
            p90_us: us(h.value_at_quantile(0.9)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }

    fn median_of(all: &[Self]) -> Self {
        Self {
            min_us: median(all.iter().map(|p| p.min_us)),
            mean_us: median(all.iter().map(|p| p.mean_us)),
            p50_us: median(all.iter().map(|p| p.p50_us)),
            p90_us: median(all.iter().map(|p| p.p90_us)),
            p99_us: median(all.iter().map(|p| p.p99_us)),
            p999_us: median(all.iter().map(|p| p.p999_us)),
            max_us: median(all.iter().map(|p| p.max_us)),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct LatencyRun {
    pub(crate) probes_sent: u64,
    pub(crate) probes_received: u64,
    pub(crate) probes_lost: u64,
    pub(crate) rtt: Percentiles,
    pub(crate) background: Option<LoadRun>,
    pub(crate) cpu: CpuUse,
    pub(crate) errors: Vec<String>,
    /// The probe connections' DERP-over-QUIC figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) quic: Option<QuicWindow>,
}

/// One line per run with what DERP over QUIC carried how, and the clients' paths at its end.
pub(crate) fn quic_lines(out: &mut String, label: &str, runs: &[Option<&QuicWindow>]) {
    for (i, q) in runs.iter().enumerate() {
        let Some(q) = q else { continue };
        let _ = writeln!(
            out,
            "{label} run {}: QUIC packets received {} in datagrams / {} on the stream, sent {} / {}; \
             clients' quinn: {} lost, {} congestion events, cwnd {:.0} B, rtt {:.1} ms, MTU {}-{} (mean over {} connections)",
            i + 1,
            q.datagram_packets_received,
            q.stream_packets_received,
            q.datagram_packets_sent,
            q.stream_packets_sent,
            q.lost_packets,
            q.congestion_events,
            q.cwnd_mean_bytes,
            q.rtt_mean_ms,
            q.mtu_min,
            q.mtu_max,
            q.connections,
        );
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct LatencyMedian {
    pub(crate) rtt: Percentiles,
    pub(crate) probe_loss_ratio: f64,
    pub(crate) background_delivered_mbps: Option<f64>,
    pub(crate) bench_cores: Option<f64>,
}

impl LatencyMedian {
    pub(crate) fn of(runs: &[LatencyRun]) -> Self {
        let rtts: Vec<Percentiles> = runs.iter().map(|r| r.rtt).collect();
        Self {
            rtt: Percentiles::median_of(&rtts),
            probe_loss_ratio: median(runs.iter().map(|r| ratio(r.probes_lost, r.probes_sent))),
            background_delivered_mbps: median_opt(
                runs.iter()
                    .map(|r| r.background.as_ref().map(|b| b.delivered_mbps)),
            ),
            bench_cores: median_opt(runs.iter().map(|r| r.cpu.bench_cores)),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct LatencyResult {
    pub(crate) runs: Vec<LatencyRun>,
    pub(crate) median: LatencyMedian,
}

#[derive(Debug, Serialize)]
pub(crate) struct PingpongConfig {
    pub(crate) pairs: u32,
    pub(crate) in_flight: u32,
    pub(crate) size_bytes: u32,
    pub(crate) client: &'static str,
    pub(crate) warmup_s: f64,
    pub(crate) duration_s: f64,
    pub(crate) runs: u32,
}

/// One measured window of closed loops.
#[derive(Debug, Serialize)]
pub(crate) struct PingpongRun {
    pub(crate) sent_packets: u64,
    pub(crate) round_trips: u64,
    pub(crate) round_trips_per_s: f64,
    pub(crate) lost_packets: u64,
    pub(crate) rtt: Percentiles,
    pub(crate) cpu: CpuUse,
    pub(crate) server_cpu_us_per_round_trip: Option<f64>,
    pub(crate) errors: Vec<String>,
}

#[derive(Debug, Serialize)]
pub(crate) struct PingpongMedian {
    pub(crate) rtt: Percentiles,
    pub(crate) round_trips_per_s: f64,
    pub(crate) bench_cores: Option<f64>,
    pub(crate) server_cores: Option<f64>,
    pub(crate) server_cpu_us_per_round_trip: Option<f64>,
}

impl PingpongMedian {
    pub(crate) fn of(runs: &[PingpongRun]) -> Self {
        let rtts: Vec<Percentiles> = runs.iter().map(|r| r.rtt).collect();
        Self {
            rtt: Percentiles::median_of(&rtts),
            round_trips_per_s: median(runs.iter().map(|r| r.round_trips_per_s)),
            bench_cores: median_opt(runs.iter().map(|r| r.cpu.bench_cores)),
            server_cores: median_opt(runs.iter().map(|r| r.cpu.server_cores)),
            server_cpu_us_per_round_trip: median_opt(
                runs.iter().map(|r| r.server_cpu_us_per_round_trip),
            ),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct PingpongResult {
    pub(crate) runs: Vec<PingpongRun>,
    pub(crate) median: PingpongMedian,
}

#[derive(Debug, Serialize)]
pub(crate) struct ConnectConfig {
    pub(crate) connections: u32,
    pub(crate) concurrency: u32,
    pub(crate) max_duration_s: f64,
    pub(crate) runs: u32,
}

/// Handshake durations, milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct HandshakeTimes {
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl HandshakeTimes {
    pub(crate) fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        let ms = |ns: u64| ns as f64 / 1e6;
        if h.is_empty() {
            return Self::default();
        }
        Self {
            p50_ms: ms(h.value_at_quantile(0.5)),
            p90_ms: ms(h.value_at_quantile(0.9)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct ConnectRun {
    pub(crate) attempted: u64,
    pub(crate) succeeded: u64,
    pub(crate) failed: u64,
    pub(crate) failures: BTreeMap<String, u64>,
    pub(crate) elapsed_s: f64,
    pub(crate) handshakes_per_s: f64,
    pub(crate) handshake: HandshakeTimes,
    pub(crate) source_addresses: usize,
    pub(crate) cpu: CpuUse,
    pub(crate) server_cpu_ms_per_handshake: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ConnectMedian {
    pub(crate) handshakes_per_s: f64,
    pub(crate) failure_ratio: f64,
    pub(crate) handshake_p50_ms: f64,
    pub(crate) handshake_p99_ms: f64,
    pub(crate) bench_cores: Option<f64>,
    pub(crate) server_cpu_ms_per_handshake: Option<f64>,
}

impl ConnectMedian {
    pub(crate) fn of(runs: &[ConnectRun]) -> Self {
        Self {
            handshakes_per_s: median(runs.iter().map(|r| r.handshakes_per_s)),
            failure_ratio: median(runs.iter().map(|r| ratio(r.failed, r.attempted))),
            handshake_p50_ms: median(runs.iter().map(|r| r.handshake.p50_ms)),
            handshake_p99_ms: median(runs.iter().map(|r| r.handshake.p99_ms)),
            bench_cores: median_opt(runs.iter().map(|r| r.cpu.bench_cores)),
            server_cpu_ms_per_handshake: median_opt(
                runs.iter().map(|r| r.server_cpu_ms_per_handshake),
            ),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct ConnectResult {
    pub(crate) runs: Vec<ConnectRun>,
    pub(crate) median: ConnectMedian,
}

#[derive(Debug, Serialize)]
pub(crate) struct IdleConfig {
    pub(crate) connections: u32,
    pub(crate) concurrency: u32,
    pub(crate) hold_s: f64,
    pub(crate) runs: u32,
}

#[derive(Debug, Serialize)]
pub(crate) struct IdleRun {
    pub(crate) requested: u64,
    pub(crate) opened: u64,
    pub(crate) failed: u64,
    pub(crate) failures: BTreeMap<String, u64>,
    pub(crate) source_addresses: usize,
    pub(crate) open_s: f64,
    pub(crate) server_connections_before: Option<u64>,
    pub(crate) server_connections_held: Option<u64>,
    pub(crate) rss_source: Option<String>,
    pub(crate) rss_includes_bench: bool,
    pub(crate) rss_before_bytes: Option<u64>,
    pub(crate) rss_held_bytes: Option<u64>,
    pub(crate) rss_after_close_bytes: Option<u64>,
    pub(crate) bytes_per_connection: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct IdleMedian {
    pub(crate) opened: f64,
    pub(crate) bytes_per_connection: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct IdleResult {
    pub(crate) runs: Vec<IdleRun>,
    pub(crate) median: IdleMedian,
}

#[derive(Debug, Serialize)]
pub(crate) struct SweepConfig {
    pub(crate) pairs: u32,
    pub(crate) size_bytes: u32,
    pub(crate) start_mbps: f64,
    pub(crate) factor: Option<f64>,
    pub(crate) step_mbps: Option<f64>,
    pub(crate) warmup_s: f64,
    pub(crate) step_duration_s: f64,
    pub(crate) loss_threshold: f64,
    pub(crate) steps_past: u32,
    pub(crate) max_steps: u32,
}

#[derive(Debug, Serialize)]
pub(crate) struct SweepStep {
    pub(crate) offered_mbps: f64,
    pub(crate) undelivered_ratio: f64,
    pub(crate) load: LoadRun,
}

#[derive(Debug, Serialize)]
pub(crate) struct Saturation {
    pub(crate) max_delivered_mbps: f64,
    pub(crate) max_delivered_at_offered_mbps: f64,
    pub(crate) last_ok_offered_mbps: Option<f64>,
    pub(crate) first_over_threshold_offered_mbps: Option<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct SweepResult {
    pub(crate) steps: Vec<SweepStep>,
    pub(crate) saturation: Saturation,
}

#[derive(Debug, Serialize)]
pub(crate) struct UpgradeConfig {
    pub(crate) upgrade_pid: u32,
    pub(crate) pairs: u32,
    pub(crate) connections: u32,
    pub(crate) interval_ms: f64,
    /// The interval over the pair count: how far apart the fleet's sends are.
    pub(crate) send_spacing_us: f64,
    pub(crate) size_bytes: u32,
    pub(crate) warmup_s: f64,
    pub(crate) baseline_s: f64,
    pub(crate) after_s: f64,
    pub(crate) upgrade_timeout_s: f64,
    pub(crate) allow_broken: bool,
}

/// A distribution in milliseconds, and how many values it has.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Spread {
    pub(crate) count: u64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl Spread {
    /// From a histogram of nanoseconds.
    pub(crate) fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        let ms = |ns: u64| ns as f64 / 1e6;
        if h.is_empty() {
            return Self::default();
        }
        Self {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.5)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }
}

/// One phase of an upgrade run, by packets sent in it.
#[derive(Debug, Serialize)]
pub(crate) struct UpgradePhase {
    pub(crate) sent_packets: u64,
    pub(crate) delivered_packets: u64,
    pub(crate) lost_packets: u64,
    /// Each packet's delay, send to arrival.
    pub(crate) delay: Spread,
    /// Per pair, the longest delay of its packets.
    pub(crate) connection_max_delay: Spread,
    /// Per pair, the longest time between two consecutive arrivals, the later packet sent in
    /// the phase.
    pub(crate) connection_longest_gap: Spread,
}

#[derive(Debug, Serialize)]
pub(crate) struct UpgradeResult {
    /// Whether the old process exited within the timeout.
    pub(crate) old_process_exited: bool,
    /// From the signal to the old process's exit.
    pub(crate) upgrade_s: f64,
    pub(crate) before: UpgradePhase,
    pub(crate) during: UpgradePhase,
    pub(crate) after: UpgradePhase,
    pub(crate) sent_packets: u64,
    pub(crate) delivered_packets: u64,
    pub(crate) lost_packets: u64,
    pub(crate) duplicated_packets: u64,
    pub(crate) out_of_order_packets: u64,
    pub(crate) unsent_packets: u64,
    pub(crate) broken_connections: u64,
    pub(crate) breaks: BTreeMap<String, u64>,
    pub(crate) break_examples: Vec<String>,
    /// From the end of the warm-up to the senders' stop.
    pub(crate) cpu: CpuUse,
}

/// Median of the values (the mean of the middle two for an even count); 0 when empty.
pub(crate) fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Median of the values present; `None` when none is.
pub(crate) fn median_opt(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = values.flatten().collect();
    (!v.is_empty()).then(|| median(v.into_iter()))
}

/// A plain text table: a header row, then rows, columns padded to fit.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        let mut first = true;
        for (cell, w) in cells.zip(&widths) {
            if !first {
                out.push_str("  ");
            }
            first = false;
            let _ = write!(out, "{cell:>w$}");
        }
        out.push('\n');
    };
    line(&mut out, &mut header.iter().copied());
    for row in rows {
        line(&mut out, &mut row.iter().map(String::as_str));
    }
    out
}

/// Formats an optional number with `digits` decimals, or "-".
pub(crate) fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// Formats a ratio as a percentage.
pub(crate) fn pct(r: f64) -> String {
    format!("{:.3}%", r * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), 2.5);
        assert_eq!(median(std::iter::empty()), 0.0);
        assert_eq!(median_opt([None, Some(5.0), None].into_iter()), Some(5.0));
        assert_eq!(median_opt([None::<f64>].into_iter()), None);
    }

    #[test]
    fn table_pads_columns() {
        let t = table(&["a", "bbb"], &[vec!["1000".into(), "2".into()]]);
        assert_eq!(t, "   a  bbb\n1000    2\n");
    }

    #[test]
    fn percentiles_are_ordered() {
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        for v in 1..=10_000u64 {
            h.record(v * 1000).unwrap();
        }
        let p = Percentiles::of(&h);
        assert!(p.min_us <= p.p50_us && p.p50_us <= p.p90_us && p.p90_us <= p.p99_us);
        assert!(p.p99_us <= p.p999_us && p.p999_us <= p.max_us);
        assert!((p.p50_us - 5000.0).abs() / 5000.0 < 0.01);
    }
}
