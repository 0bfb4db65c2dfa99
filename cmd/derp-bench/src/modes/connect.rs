//! `connect`: a connection storm. Each connection dials, upgrades, completes the DERP
//! handshake (ServerInfo received) and closes; the figure is handshakes per second at a given
//! concurrency, with failures counted by kind.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use derp_client::Client;
use derp_proto::SecretKey;
use tokio::time::Instant;

use crate::cli::{ConnectArgs, TargetArgs};
use crate::load::{new_histogram, sample_cpu};
use crate::progress::Progress;
use crate::report::{
    ConnectConfig, ConnectMedian, ConnectResult, ConnectRun, CpuUse, HandshakeTimes, opt, pct,
    table,
};
use crate::target::{Target, connect_error_kind};
use crate::{Ctx, Outcome};

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &ConnectArgs,
) -> anyhow::Result<Outcome> {
    let n = args.connections as usize;
    // Only `concurrency` connections are open at once (plus the server's side of them).
    crate::target::check_fd_budget(args.concurrency as usize, ctx.target.spawned)?;
    let progress = Progress::start(
        args.max_duration.min(std::time::Duration::from_secs(3600)) * args.runs,
        "connect",
    );
    let mut runs = Vec::new();
    for i in 0..args.runs {
        progress.message(format!("connect run {}/{}", i + 1, args.runs));
        let run = storm(&ctx.target, args, n).await;
        ctx.check_cpu(&format!("run {}", i + 1), &run.cpu);
        runs.push(run);
    }
    progress.finish();
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
        connections: args.connections,
        concurrency: args.concurrency,
        max_duration_s: args.max_duration.as_secs_f64(),
        runs: args.runs,
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
    // Key generation is the client's share of the handshake; do it before the clock starts.
    let keys: Arc<Vec<SecretKey>> = Arc::new(
        (0..n)
            .map(|_| SecretKey::generate(&mut rand::rngs::OsRng))
            .collect(),
    );
    let sources = target.source_addrs(n);
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_before = sample_cpu(target);
    let start = Instant::now();
    let deadline = start + args.max_duration;
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.min(args.connections) {
        let keys = keys.clone();
        let next = next.clone();
        let template = target.template();
        workers.push(tokio::spawn(async move {
            let mut hist = new_histogram();
            let mut failures: BTreeMap<String, u64> = BTreeMap::new();
            let mut attempted = 0u64;
            let mut last_done = start;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= keys.len() || Instant::now() >= deadline {
                    break;
                }
                attempted += 1;
                let config = template.config(keys[i].clone(), sources.for_index(i));
                let t0 = Instant::now();
                match Client::connect(&config).await {
                    Ok(client) => {
                        let took = t0.elapsed();
                        hist.saturating_record((took.as_nanos() as u64).max(1));
                        drop(client);
                    }
                    Err(e) => *failures.entry(connect_error_kind(&e)).or_default() += 1,
                }
                last_done = Instant::now();
            }
            (hist, failures, attempted, last_done)
        }));
    }
    let mut hist = new_histogram();
    let mut failures: BTreeMap<String, u64> = BTreeMap::new();
    let mut attempted = 0;
    let mut end = start;
    for w in workers {
        match w.await {
            Ok((h, f, a, last)) => {
                let _ = hist.add(&h);
                for (k, v) in f {
                    *failures.entry(k).or_default() += v;
                }
                attempted += a;
                end = end.max(last);
            }
            Err(e) => *failures.entry(format!("task_{e}")).or_default() += 1,
        }
    }
    let elapsed_s = end.saturating_duration_since(start).as_secs_f64();
    let cpu = CpuUse::between(cpu_before, sample_cpu(target), elapsed_s);
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
        handshake: HandshakeTimes::of(&hist),
        source_addresses: sources.count(n),
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
        args.connections, args.concurrency, args.runs
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
