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
//!   frames, slowloris heads ([`crate::hostile`]); the server must close each one;
//! - **idle**: connected, pinging now and then.
//!
//! At the end every client leaves after a ping barrier (so the server has read everything it
//! sent), and the run checks: the server's books balance (packets received = sent + dropped,
//! by reason), the server received exactly what the clients sent, no stable client lost its
//! connection or a packet, every ping was answered, every hostile connection was closed,
//! the connection gauges are back to 0, the server's descriptors back to where they started,
//! its memory within the stated bounds, and it still serves a new client. Any failure makes
//! the run fail.

use std::sync::Arc;
use std::time::Duration;

use derp_client::Scheme;
use derp_load::args::TargetArgs;
use derp_load::measure::scrape;
use derp_load::target::{ServerProbe, Target};
use derp_load::{Ctx, Outcome};
use derp_proto::PublicKey;
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

use crate::SoakArgs;
use crate::account::{self, Baseline, sample, scrape_until};
use crate::client::{Shared, Stats, new_key};
use crate::report::{Resources, SoakConfig, SoakResult, human};
use crate::roles::{ECHO_DEADLINE, Roles};

/// How often resources are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Handshakes in flight at once while clients (re)connect.
const CONNECT_CONCURRENCY: usize = 64;

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &SoakArgs,
    quiet: bool,
) -> anyhow::Result<Outcome> {
    let n = args.clients as usize;
    derp_load::target::check_fd_budget(n + 64, ctx.target.spawned)?;
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
    let roles = Roles::of(n);

    // The baseline once the preflight connection (and any earlier run's) has gone.
    let (scrape, _) = scrape_until(target, args.settle, |s| {
        s.sum("derp_current_connections").unwrap_or(0.0) == 0.0
    })
    .await?;
    let before = Baseline {
        scrape,
        resources: sample(target),
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let churn_keys: Vec<PublicKey> = (0..roles.churners)
        .map(|_| new_key().public_key())
        .collect();
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
    let mut tasks = roles.spawn(&shared, args.closed_rate, args.flood_rate);
    let (peak, peak_connections) = watch(
        target,
        &shared.stats,
        before.resources,
        started,
        started + args.duration,
        quiet,
    )
    .await;

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

    let stats = &shared.stats;
    let account = account::settle_and_check(target, args, &before, peak, stats).await?;
    let hostile_attempts = stats
        .hostile
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let result = SoakResult {
        passed: account.checks.iter().all(|c| c.ok),
        checks: account.checks,
        violations: stats
            .violations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        violation_count: Stats::get(&stats.violation_count),
        elapsed_s,
        client_packets_sent: Stats::get(&stats.sent),
        client_packets_received: Stats::get(&stats.received),
        closed_loop_sent: Stats::get(&stats.closed_sent),
        closed_loop_echoed: Stats::get(&stats.closed_echoed),
        closed_loop_lost: Stats::get(&stats.closed_lost),
        pings: Stats::get(&stats.pings),
        pongs: Stats::get(&stats.pongs),
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
        hostile_attempts,
        server: account.books,
        resources_before: before.resources,
        resources_peak: account.peak,
        resources_after: account.resources_after,
        peak_connections,
    };
    let config = SoakConfig {
        clients: args.clients,
        duration_s: args.duration.as_secs_f64(),
        closed_pairs: roles.closed_pairs,
        closed_rate_pps: args.closed_rate,
        flood_pairs: roles.flood_pairs,
        flood_rate_pps: args.flood_rate,
        churners: roles.churners,
        hostile: roles.hostile,
        idle: roles.idle,
        max_rss_bytes: account.max_rss_bytes,
        max_rss_after_bytes: account.max_rss_after_bytes,
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

/// Watches the server while the load runs: its peak memory, descriptors and connections,
/// and (unless `quiet`) a line on stderr every minute.
async fn watch(
    target: &Target,
    stats: &Stats,
    before: Resources,
    started: Instant,
    end: Instant,
    quiet: bool,
) -> (Resources, u64) {
    let mut peak = before;
    let mut peak_connections = 0u64;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let mut last_report = Instant::now();
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
                    Stats::get(&stats.sent),
                    Stats::get(&stats.received),
                    Stats::get(&stats.violation_count),
                );
            }
        }
    }
    (peak, peak_connections)
}
