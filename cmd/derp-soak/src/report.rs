//! The soak's JSON result and its human summary.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// Resources of the server, sampled through the run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Resources {
    pub(crate) rss_bytes: Option<u64>,
    pub(crate) fds: Option<u64>,
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

pub(crate) fn mib(b: Option<u64>) -> String {
    b.map_or_else(
        || "-".to_owned(),
        |b| format!("{:.1}", b as f64 / 1048576.0),
    )
}

pub(crate) fn opt_u(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

pub(crate) fn human(config: &SoakConfig, r: &SoakResult) -> String {
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
