//! `connect`: a connection storm. Each connection dials, upgrades, completes the DERP
//! handshake (ServerInfo received) and closes; the figure is handshakes per second at a given
//! concurrency, with failures counted by kind.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use derp_load::args::TargetArgs;
use derp_load::connections::{ConnectionShare, Storm};
use derp_load::measure::{RttHistogram, new_histogram, sample_cpu};
use derp_load::procs::{START_LEAD, Workers, instant_at, unix_ns_now};
use derp_load::report::CpuUse;
use derp_load::target::Target;
use derp_load::worker::{ANSWER_SLACK, Answer, Command, Work, start_workers};
use derp_load::{Ctx, Outcome};
use tokio::time::Instant;

use crate::cli::ConnectArgs;
use crate::progress::Progress;
use crate::report::{
    ConnectConfig, ConnectMedian, ConnectResult, ConnectRun, HandshakeTimes, opt, pct, table,
};

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &ConnectArgs,
) -> anyhow::Result<Outcome> {
    let n = args.conns.connections as usize;
    let shares = ConnectionShare::split(
        args.conns.connections,
        args.conns.concurrency,
        ctx.procs_asked,
    );
    let mut workers = if shares.len() > 1 {
        let work = shares.iter().map(|s| Work::Storm(*s)).collect();
        Some(start_workers(ctx, target_args, work).await?)
    } else {
        // Only `concurrency` connections are open at once (plus the server's side of them).
        derp_load::target::check_fd_budget(args.conns.concurrency as usize, ctx.target.spawned)?;
        None
    };
    let progress = Progress::start(
        args.max_duration.min(Duration::from_secs(3600)) * args.conns.runs,
        "connect",
    );
    let mut runs = Vec::new();
    for i in 0..args.conns.runs {
        progress.message(format!("connect run {}/{}", i + 1, args.conns.runs));
        let run = match &mut workers {
            None => storm(&ctx.target, args, n).await,
            Some(w) => remote_storm(&ctx.target, w, args, n).await?,
        };
        ctx.check_cpu(&format!("run {}", i + 1), &run.cpu);
        runs.push(run);
    }
    progress.finish();
    drop(workers);
    if runs.iter().all(|r| r.succeeded == 0) {
        let kinds: Vec<String> = runs[0].failures.keys().cloned().collect();
        anyhow::bail!(
            "every handshake failed ({}): the server refuses connections",
            kinds.join(", ")
        );
    }
    for r in &runs {
        if r.failed > 0 {
            let w = format!(
                "{} of {} handshakes failed: {:?}",
                r.failed, r.attempted, r.failures
            );
            ctx.warnings.push(w);
        }
    }
    let median = ConnectMedian::of(&runs);
    let human = human(args, &runs, &median);
    let config = ConnectConfig {
        connections: args.conns.connections,
        concurrency: args.conns.concurrency,
        max_duration_s: args.max_duration.as_secs_f64(),
        runs: args.conns.runs,
    };
    let report = ctx.report(
        target_args,
        "connect",
        config,
        ConnectResult { runs, median },
    );
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

async fn storm(target: &Target, args: &ConnectArgs, n: usize) -> ConnectRun {
    let storm = Storm::prepare(
        target,
        ConnectionShare::all(args.conns.connections, args.conns.concurrency),
    );
    let cpu_before = sample_cpu(target);
    let start = Instant::now();
    let done = storm.run(start, args.max_duration).await;
    let elapsed_s = done.end.saturating_duration_since(start).as_secs_f64();
    let cpu = CpuUse::between(cpu_before, sample_cpu(target), elapsed_s);
    connect_run(
        done.attempted,
        &done.handshakes,
        done.failures,
        elapsed_s,
        target.source_addrs(n).count(n),
        cpu,
    )
}

/// One storm over every worker, from a common start; the figures merged.
async fn remote_storm(
    target: &Target,
    workers: &mut Workers,
    args: &ConnectArgs,
    n: usize,
) -> anyhow::Result<ConnectRun> {
    let start_unix_ns = unix_ns_now() + START_LEAD.as_nanos() as u64;
    workers.send_all(&Command::Storm {
        start_unix_ns,
        max_duration: args.max_duration,
    })?;
    tokio::time::sleep_until(instant_at(start_unix_ns)).await;
    let cpu_before = sample_cpu(target);
    let answers: Vec<Answer> = workers.recv_all(args.max_duration + ANSWER_SLACK).await?;
    let cpu_after = sample_cpu(target);
    let mut handshakes = new_histogram();
    let mut failures: BTreeMap<String, u64> = BTreeMap::new();
    let (mut attempted, mut elapsed_s) = (0, 0.0f64);
    let mut worker_cpu = Some(0.0);
    for answer in answers {
        let Answer::Storm(out) = answer else {
            anyhow::bail!("a bench process answered the storm with {answer:?}");
        };
        attempted += out.attempted;
        out.handshakes.add_to(&mut handshakes);
        for (k, v) in out.failures {
            *failures.entry(k).or_default() += v;
        }
        elapsed_s = elapsed_s.max(out.elapsed_s);
        worker_cpu = worker_cpu.zip(out.bench_cpu_s).map(|(a, b)| a + b);
    }
    let cpu = CpuUse::between(cpu_before, cpu_after, elapsed_s).plus_bench(worker_cpu);
    Ok(connect_run(
        attempted,
        &handshakes,
        failures,
        elapsed_s,
        target.source_addrs(n).count(n),
        cpu,
    ))
}

fn connect_run(
    attempted: u64,
    hist: &RttHistogram,
    failures: BTreeMap<String, u64>,
    elapsed_s: f64,
    source_addresses: usize,
    cpu: CpuUse,
) -> ConnectRun {
    let succeeded = hist.len();
    ConnectRun {
        attempted,
        succeeded,
        failed: attempted.saturating_sub(succeeded),
        failures,
        elapsed_s,
        handshakes_per_s: if elapsed_s > 0.0 {
            succeeded as f64 / elapsed_s
        } else {
            0.0
        },
        handshake: HandshakeTimes::of(hist),
        source_addresses,
        server_cpu_ms_per_handshake: cpu
            .server_cpu_s
            .filter(|_| succeeded > 0)
            .map(|s| s * 1e3 / succeeded as f64),
        cpu,
    }
}

fn human(args: &ConnectArgs, runs: &[ConnectRun], median: &ConnectMedian) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "connect: {} connections, {} in flight, {} run(s)",
        args.conns.connections, args.conns.concurrency, args.conns.runs
    );
    let rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                (i + 1).to_string(),
                r.succeeded.to_string(),
                r.failed.to_string(),
                format!("{:.2}", r.elapsed_s),
                format!("{:.0}", r.handshakes_per_s),
                format!("{:.2}", r.handshake.p50_ms),
                format!("{:.2}", r.handshake.p99_ms),
                format!("{:.2}", r.handshake.max_ms),
                opt(r.cpu.bench_cores, 2),
                opt(r.server_cpu_ms_per_handshake, 3),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "run",
            "ok",
            "failed",
            "secs",
            "handshakes/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "bench cores",
            "srv CPU ms/hs",
        ],
        &rows,
    ));
    let _ = writeln!(
        out,
        "median: {:.0} handshakes/s, failures {}, p50 {:.2} ms, p99 {:.2} ms, server CPU {} ms per handshake",
        median.handshakes_per_s,
        pct(median.failure_ratio),
        median.handshake_p50_ms,
        median.handshake_p99_ms,
        opt(median.server_cpu_ms_per_handshake, 3)
    );
    out
}
