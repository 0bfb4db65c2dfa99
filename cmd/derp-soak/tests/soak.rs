//! Runs derp-soak against a relay on loopback, plain and over TLS, and checks its account and
//! that its JSON matches the documented schema (docs/derp-soak.md; the structs below refuse
//! unknown fields).

#[path = "../../derp-bench/tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::process::Output;
use std::time::Duration;

use serde::Deserialize;

use support::{Report, config, private_ca_relay, serve_metrics};

fn soak(args: &[&str]) -> Output {
    support::run(env!("CARGO_BIN_EXE_derp-soak"), args)
}

fn soak_json<T: serde::de::DeserializeOwned>(args: &[&str]) -> Report<T> {
    support::run_json(env!("CARGO_BIN_EXE_derp-soak"), args)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoakConfig {
    clients: u32,
    duration_s: f64,
    closed_pairs: usize,
    closed_rate_pps: f64,
    flood_pairs: usize,
    flood_rate_pps: f64,
    churners: usize,
    hostile: usize,
    idle: usize,
    max_rss_bytes: u64,
    max_rss_after_bytes: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoakCheck {
    name: String,
    ok: bool,
    detail: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoakServer {
    packets_received: u64,
    packets_sent: u64,
    packets_dropped: u64,
    dropped_by_reason: BTreeMap<String, u64>,
    forwarded_in: u64,
    forwarded_out: u64,
    accepts: u64,
    connection_errors: BTreeMap<String, u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoakResources {
    rss_bytes: Option<u64>,
    fds: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SoakResult {
    passed: bool,
    checks: Vec<SoakCheck>,
    violations: Vec<String>,
    violation_count: u64,
    elapsed_s: f64,
    client_packets_sent: u64,
    client_packets_received: u64,
    closed_loop_sent: u64,
    closed_loop_echoed: u64,
    closed_loop_lost: u64,
    pings: u64,
    pongs: u64,
    connects: u64,
    connect_failures: BTreeMap<String, u64>,
    slow_readers_cut_off: u64,
    churn_sessions: u64,
    churn_duplicates: u64,
    churn_abrupt_closes: u64,
    hostile_attempts: BTreeMap<String, u64>,
    server: SoakServer,
    resources_before: SoakResources,
    resources_peak: SoakResources,
    resources_after: SoakResources,
    peak_connections: u64,
}

#[test]
fn soak_runs_every_role_and_balances_the_books() {
    let r: Report<SoakResult> =
        soak_json(&["--spawn-server", "--clients", "40", "--duration", "3s"]);
    let c: SoakConfig = config(&r);
    assert_eq!(c.clients, 40);
    assert_eq!(
        (c.duration_s, c.closed_rate_pps, c.flood_rate_pps),
        (3.0, 10.0, 100.0)
    );
    assert_eq!(c.max_rss_bytes, 256 << 20);
    assert!(c.max_rss_after_bytes > 64 << 20);
    assert_eq!(
        c.closed_pairs * 2 + c.flood_pairs * 2 + c.churners + c.hostile + c.idle,
        40
    );
    let res = &r.result;
    assert!(res.passed, "{:#?}", res.checks);
    let names: Vec<&str> = res.checks.iter().map(|c| c.name.as_str()).collect();
    for wanted in [
        "connection gauges back to 0",
        "descriptors back to the baseline",
        "server: received = sent + dropped",
        "closed loop: zero loss",
        "peak RSS within bound",
    ] {
        assert!(names.contains(&wanted), "{names:?}");
    }
    assert_eq!(res.checks.len(), 12);
    assert!(res.checks.iter().all(|c| c.ok && !c.detail.is_empty()));
    assert_eq!((res.violation_count, res.violations.len()), (0, 0));
    assert!(res.closed_loop_sent > 0 && res.closed_loop_lost == 0);
    assert_eq!(res.closed_loop_sent, res.closed_loop_echoed);
    assert_eq!(res.client_packets_sent, res.server.packets_received);
    assert_eq!(
        res.server.packets_received,
        res.server.packets_sent + res.server.packets_dropped
    );
    assert_eq!(
        res.server.dropped_by_reason.values().sum::<u64>(),
        res.server.packets_dropped
    );
    assert!(res.client_packets_received <= res.server.packets_sent);
    assert!(res.churn_sessions >= c.churners as u64 && res.connects > 0);
    assert!(!res.hostile_attempts.is_empty());
    assert!(res.pings > 0 && res.pongs > 0);
    // The relay runs in this process (--spawn-server), so /proc has every reading; a missing
    // one is a failure.
    let measured = |r: &SoakResources| (r.fds.expect("fds"), r.rss_bytes.expect("rss"));
    let (before, after, peak) = (
        measured(&res.resources_before),
        measured(&res.resources_after),
        measured(&res.resources_peak),
    );
    assert!(
        after.0 <= before.0,
        "descriptors: {before:?} then {after:?}"
    );
    assert!(peak.1 >= before.1, "RSS: {before:?}, peak {peak:?}");
    // The load ran for its whole --duration: a lower bound, which a slow machine only
    // lengthens.
    assert!(res.peak_connections > 0 && res.elapsed_s >= c.duration_s);
    assert!(res.server.accepts > 0);
    assert_eq!((res.server.forwarded_in, res.server.forwarded_out), (0, 0));
    for reason in res.server.connection_errors.keys() {
        assert!(
            [
                "handshake",
                "low_order_key",
                "malformed_frame",
                "not_mesh_peer",
                "io",
                "timeout"
            ]
            .contains(&reason.as_str()),
            "{reason}"
        );
    }
    // Connections refused, slow readers cut off and churners' duplicates and abrupt exits
    // depend on timing; they are counted, and the checks above hold whatever they are.
    let counted = res.connect_failures.values().sum::<u64>()
        + res.slow_readers_cut_off
        + res.churn_duplicates
        + res.churn_abrupt_closes;
    assert!(counted <= res.connects + res.churn_sessions * 2);

    // A bound the run cannot meet fails it, with the report printed first.
    let out = soak(&[
        "--spawn-server",
        "--clients",
        "20",
        "--duration",
        "1s",
        "--max-rss-mib",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("FAIL peak RSS within bound"), "{stdout}");
    assert!(stdout.contains("soak FAILED"), "{stdout}");
    assert!(
        stderr.contains("soak failed: peak RSS within bound"),
        "{stderr}"
    );
}

#[test]
fn soak_over_tls_with_a_private_ca() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, addr, ca_file, registry) = private_ca_relay(&rt);
    let metrics = rt.block_on(serve_metrics(registry));
    let pid = std::process::id().to_string();
    // Hostile clients and slow readers dial their own sockets: over TLS too, for both
    // schemes (a wss:// node serves plain DERP upgrades on the same port).
    for url in [format!("https://{addr}/derp"), format!("wss://{addr}/derp")] {
        let r: Report<SoakResult> = soak_json(&[
            "--url",
            &url,
            "--ca",
            ca_file.to_str().unwrap(),
            "--metrics-url",
            &format!("http://{metrics}/metrics"),
            "--server-pid",
            &pid,
            "--clients",
            "20",
            "--duration",
            "2s",
            "--settle",
            "10s",
        ]);
        assert!(r.result.passed, "{url}: {:#?}", r.result.checks);
        assert!(!r.result.hostile_attempts.is_empty(), "{url}");
        assert!(r.result.closed_loop_sent > 0, "{url}");
    }
    let _ = std::fs::remove_file(&ca_file);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), server.shutdown())
            .await
            .unwrap()
    });
}
