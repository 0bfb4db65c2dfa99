//! `idle`: hold many idle connections and report the server's memory per connection,
//! (RSS with N connections - RSS before) / N, the figure Tailscale tracks for derper.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use derp_load::args::TargetArgs;
use derp_load::connections::{ConnectionShare, Opening};
use derp_load::measure::scrape;
use derp_load::procfs;
use derp_load::procs::{START_LEAD, Workers, unix_ns_now};
use derp_load::target::{ServerProbe, Target};
use derp_load::worker::{ANSWER_SLACK, Answer, Command, Work, start_workers};
use derp_load::{Ctx, Outcome};
use tokio::time::Instant;

use crate::cli::IdleArgs;
use crate::progress::Progress;
use crate::report::{IdleConfig, IdleMedian, IdleResult, IdleRun, median, median_opt, opt, table};

/// How long to wait for the server to notice closed connections before the last RSS reading.
const CLOSE_SETTLE: Duration = Duration::from_secs(3);
/// How long worker processes get to open their connections.
const OPEN_BUDGET: Duration = Duration::from_secs(600);

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &IdleArgs,
) -> anyhow::Result<Outcome> {
    let n = args.conns.connections as usize;
    let shares = ConnectionShare::split(
        args.conns.connections,
        args.conns.concurrency,
        ctx.procs_asked,
    );
    let mut workers = if shares.len() > 1 {
        if ctx.target.spawned {
            // The in-process relay holds the server side of every connection here.
            derp_load::target::check_fd_budget(n, false)?;
        }
        let work = shares.iter().map(|s| Work::Idle(*s)).collect();
        Some(start_workers(ctx, target_args, work).await?)
    } else {
        derp_load::target::check_fd_budget(n, ctx.target.spawned)?;
        None
    };
    let progress = Progress::start(
        (args.hold + Duration::from_secs(2)) * args.conns.runs,
        "idle",
    );
    let mut runs = Vec::new();
    for i in 0..args.conns.runs {
        progress.message(format!("idle run {}/{}", i + 1, args.conns.runs));
        runs.push(hold_run(&ctx.target, args, n, workers.as_mut()).await?);
    }
    progress.finish();
    drop(workers);
    if runs.iter().all(|r| r.opened == 0) {
        let kinds: Vec<String> = runs[0].failures.keys().cloned().collect();
        anyhow::bail!("no connection could be opened ({})", kinds.join(", "));
    }
    for r in &runs {
        if r.failed > 0 {
            ctx.warnings.push(format!(
                "{} of {} connections failed to open: {:?}",
                r.failed, r.requested, r.failures
            ));
        }
        if let (Some(before), Some(held)) = (r.server_connections_before, r.server_connections_held)
            && held.saturating_sub(before) != r.opened
        {
            ctx.warnings.push(format!(
                "the server counted {} new connections, the bench opened {}",
                held.saturating_sub(before),
                r.opened
            ));
        }
        if r.rss_source.is_none() {
            ctx.warnings.push(
                "no memory figure: give --server-pid, or a --metrics-url that exports \
                 process_resident_memory_bytes"
                    .to_owned(),
            );
        }
    }
    ctx.warnings.dedup();
    let median = IdleMedian {
        opened: median(runs.iter().map(|r| r.opened as f64)),
        bytes_per_connection: median_opt(runs.iter().map(|r| r.bytes_per_connection)),
    };
    let human = human(args, &runs, &median);
    let config = IdleConfig {
        connections: args.conns.connections,
        concurrency: args.conns.concurrency,
        hold_s: args.hold.as_secs_f64(),
        runs: args.conns.runs,
    };
    let report = ctx.report(target_args, "idle", config, IdleResult { runs, median });
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

/// The server's RSS and where it came from: `--server-pid`, then the metrics'
/// process_resident_memory_bytes, then (for an in-process relay) this process.
async fn server_rss(target: &Target) -> Option<(u64, &'static str, bool)> {
    if let ServerProbe::Pids(pids) = &target.probe {
        let mut total = 0;
        for pid in pids {
            total += procfs::process_rss(&pid.to_string())?;
        }
        return Some((total, "server-pid", false));
    }
    if let Some(rss) = scrape(target)
        .await
        .and_then(|s| s.sum("process_resident_memory_bytes"))
    {
        // An in-process relay's process metrics describe the bench process.
        return Some((rss as u64, "metrics", target.spawned));
    }
    if let ServerProbe::InProcess = target.probe {
        return procfs::process_rss("self").map(|r| (r, "in-process", true));
    }
    None
}

async fn server_connections(target: &Target) -> Option<u64> {
    scrape(target)
        .await
        .and_then(|s| s.sum("derp_current_connections"))
        .map(|v| v as u64)
}

/// The connection count once it has stopped changing (the preflight connection, or the
/// previous run's, may still be on its way out), waiting at most a second.
async fn settled_connections(target: &Target) -> Option<u64> {
    let mut last = server_connections(target).await?;
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut stable_since = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let now = Instant::now();
        let current = server_connections(target).await?;
        if current != last {
            last = current;
            stable_since = now;
        } else if now - stable_since >= Duration::from_millis(100) || now >= deadline {
            return Some(current);
        }
    }
}

async fn hold_run(
    target: &Target,
    args: &IdleArgs,
    n: usize,
    workers: Option<&mut Workers>,
) -> anyhow::Result<IdleRun> {
    let connections_before = settled_connections(target).await;
    let rss_before = server_rss(target).await;

    // With worker processes the clients live elsewhere: an in-process relay's memory is then
    // the server's alone.
    let clients_here = workers.is_none();
    let (opened, failures, open_s, clients, workers) = match workers {
        None => {
            let share = ConnectionShare::all(args.conns.connections, args.conns.concurrency);
            let opening = Opening::prepare(target, share);
            let started = Instant::now();
            let (clients, failures) = opening.open().await;
            let open_s = started.elapsed().as_secs_f64();
            (clients.len() as u64, failures, open_s, clients, None)
        }
        Some(workers) => {
            let start_unix_ns = unix_ns_now() + START_LEAD.as_nanos() as u64;
            workers.send_all(&Command::Open { start_unix_ns })?;
            let answers: Vec<Answer> = workers.recv_all(OPEN_BUDGET).await?;
            let (mut opened, mut open_s) = (0, 0.0f64);
            let mut failures: BTreeMap<String, u64> = BTreeMap::new();
            for answer in answers {
                let Answer::Opened(out) = answer else {
                    anyhow::bail!("a bench process answered Open with {answer:?}");
                };
                opened += out.opened;
                open_s = open_s.max(out.open_s);
                for (k, v) in out.failures {
                    *failures.entry(k).or_default() += v;
                }
            }
            (opened, failures, open_s, Vec::new(), Some(workers))
        }
    };
    tokio::time::sleep(args.hold).await;
    let connections_held = server_connections(target).await;
    let rss_held = server_rss(target).await;
    drop(clients);
    if let Some(workers) = workers {
        workers.send_all(&Command::Close)?;
        let _: Vec<Answer> = workers.recv_all(ANSWER_SLACK).await?;
    }

    // Let the server see the closes before the last reading (derper's RSS never shrinks;
    // that is worth seeing too).
    let settle_until = Instant::now() + CLOSE_SETTLE;
    if let Some(before) = connections_before {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        while Instant::now() < settle_until {
            tick.tick().await;
            if server_connections(target).await.is_none_or(|c| c <= before) {
                break;
            }
        }
    }
    let rss_after = server_rss(target).await;

    let bytes_per_connection = match (rss_before, rss_held) {
        (Some((b, _, _)), Some((h, _, _))) if opened > 0 => {
            Some((h as f64 - b as f64) / opened as f64)
        }
        _ => None,
    };
    Ok(IdleRun {
        requested: n as u64,
        opened,
        failed: n as u64 - opened,
        failures,
        source_addresses: target.source_addrs(n).count(n),
        open_s,
        server_connections_before: connections_before,
        server_connections_held: connections_held,
        rss_source: rss_held.map(|(_, s, _)| s.to_owned()),
        rss_includes_bench: clients_here && rss_held.is_some_and(|(_, _, b)| b),
        rss_before_bytes: rss_before.map(|r| r.0),
        rss_held_bytes: rss_held.map(|r| r.0),
        rss_after_close_bytes: rss_after.map(|r| r.0),
        bytes_per_connection,
    })
}

fn human(args: &IdleArgs, runs: &[IdleRun], median: &IdleMedian) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "idle: {} connections ({} opening at once), held {:?}, {} run(s)",
        args.conns.connections, args.conns.concurrency, args.hold, args.conns.runs
    );
    let mib = |b: Option<u64>| opt(b.map(|b| b as f64 / (1024.0 * 1024.0)), 1);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                (i + 1).to_string(),
                r.opened.to_string(),
                r.failed.to_string(),
                r.source_addresses.to_string(),
                format!("{:.2}", r.open_s),
                r.server_connections_held
                    .map_or_else(|| "-".to_owned(), |c| c.to_string()),
                mib(r.rss_before_bytes),
                mib(r.rss_held_bytes),
                mib(r.rss_after_close_bytes),
                opt(r.bytes_per_connection, 0),
                r.rss_source.clone().unwrap_or_else(|| "-".to_owned()),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "run",
            "opened",
            "failed",
            "src addrs",
            "open secs",
            "srv conns",
            "RSS before MiB",
            "RSS held MiB",
            "RSS after MiB",
            "bytes/conn",
            "RSS from",
        ],
        &rows,
    ));
    let includes_bench = runs.iter().any(|r| r.rss_includes_bench);
    let _ = writeln!(
        out,
        "median: {} bytes per idle connection{}",
        opt(median.bytes_per_connection, 0),
        if includes_bench {
            " (client and server side together: the relay runs in the bench process)"
        } else {
            ""
        }
    );
    out
}
