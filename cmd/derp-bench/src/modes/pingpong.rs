//! `pingpong`: closed loops through the relay. Each pair keeps `--in-flight` packets
//! outstanding; B echoes every packet the moment it reads it, A times the round trip and sends
//! the next. With one in flight this is the relay's latency with nothing queued anywhere.

use std::fmt::Write as _;

use derp_load::args::TargetArgs;
use derp_load::closed_loop::{LoopPairs, LoopResult, LoopSpec, LoopWindow};
use derp_load::measure::{RttHistogram, new_histogram, sample_cpu};
use derp_load::packet::Kind;
use derp_load::procs::{START_LEAD, Workers, instant_at, split, unix_ns_now};
use derp_load::report::{CpuUse, WindowSpec};
use derp_load::worker::{ANSWER_SLACK, Answer, Command, LoopShare, Work, start_workers};
use derp_load::{Ctx, Outcome};
use tokio::time::Instant;

use crate::cli::PingpongArgs;
use crate::progress::Progress;
use crate::report::{
    Percentiles, PingpongConfig, PingpongMedian, PingpongResult, PingpongRun, opt, table,
};

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &PingpongArgs,
) -> anyhow::Result<Outcome> {
    let spec = spec(args);
    spec.check(&ctx.target)?;
    let procs = ctx.procs_asked.min(args.pairs).max(1) as usize;
    let mut pairs = if procs > 1 {
        if ctx.target.spawned {
            derp_load::target::check_fd_budget(args.pairs as usize * 2, false)?;
        }
        let mut first_pair = 0;
        let work = split(u64::from(args.pairs), procs)
            .into_iter()
            .map(|n| {
                let share = LoopShare {
                    pairs: n as u32,
                    first_pair,
                    size: spec.size,
                    in_flight: spec.in_flight,
                    client: spec.client,
                };
                first_pair += n as u32;
                Work::Loops(share)
            })
            .collect();
        Loops::Procs(start_workers(ctx, target_args, work).await?)
    } else {
        derp_load::target::check_fd_budget(args.pairs as usize * 2, ctx.target.spawned)?;
        Loops::Local(LoopPairs::connect(&ctx.target, spec, 0, args.pairs, ctx.clock).await?)
    };
    let progress = Progress::start((args.warmup + args.duration) * args.runs, "pingpong");
    let mut runs = Vec::new();
    for i in 0..args.runs {
        progress.message(format!("pingpong run {}/{}", i + 1, args.runs));
        let run = match &mut pairs {
            Loops::Local(pairs) => {
                let window = window(args, Instant::now());
                let target = &ctx.target;
                let measure = async {
                    tokio::time::sleep_until(window.warm_end).await;
                    let before = sample_cpu(target);
                    tokio::time::sleep_until(window.end).await;
                    let after = sample_cpu(target);
                    let wall = Instant::now().saturating_duration_since(window.warm_end);
                    CpuUse::between(before, after, wall.as_secs_f64())
                };
                let (results, cpu) = tokio::join!(pairs.run_window(window), measure);
                pingpong_run(results, cpu, args)
            }
            Loops::Procs(workers) => remote_window(ctx, workers, args).await?,
        };
        ctx.check_cpu(&format!("run {}", i + 1), &run.cpu);
        runs.push(run);
    }
    progress.finish();
    drop(pairs);
    finish(ctx, target_args, args, runs)
}

/// The closed loops: in this process, or split over worker processes.
#[derive(Debug)]
enum Loops {
    Local(LoopPairs),
    Procs(Workers),
}

/// One window over every worker from a common start, the parent measuring the server and
/// the machine.
async fn remote_window(
    ctx: &Ctx,
    workers: &mut Workers,
    args: &PingpongArgs,
) -> anyhow::Result<PingpongRun> {
    let start_unix_ns = unix_ns_now() + START_LEAD.as_nanos() as u64;
    let spec = WindowSpec {
        run: Ctx::run_id(),
        size: args.size as usize,
        rate_pps: None,
        warmup: args.warmup,
        duration: args.duration,
        stop_receivers_after: None,
        kind: Kind::Probe,
    };
    workers.send_all(&Command::Window {
        start_unix_ns,
        specs: vec![spec],
    })?;
    let warm_end = instant_at(start_unix_ns) + args.warmup;
    tokio::time::sleep_until(warm_end).await;
    let before = sample_cpu(&ctx.target);
    tokio::time::sleep_until(warm_end + args.duration).await;
    let after = sample_cpu(&ctx.target);
    let wall_s = Instant::now()
        .saturating_duration_since(warm_end)
        .as_secs_f64();
    let answers: Vec<Answer> = workers
        .recv_all(args.warmup + args.duration + ANSWER_SLACK)
        .await?;
    let mut results = Vec::new();
    let mut worker_cpu = Some(0.0);
    for answer in answers {
        let Answer::Loops {
            results: outs,
            bench_cpu_s,
        } = answer
        else {
            anyhow::bail!("a bench process answered a window with {answer:?}");
        };
        results.extend(outs.into_iter().map(|o| o.into_result()));
        worker_cpu = worker_cpu.zip(bench_cpu_s).map(|(a, b)| a + b);
    }
    let cpu = CpuUse::between(before, after, wall_s).plus_bench(worker_cpu);
    Ok(pingpong_run(results, cpu, args))
}

pub(crate) fn spec(args: &PingpongArgs) -> LoopSpec {
    LoopSpec {
        size: args.size as usize,
        in_flight: args.in_flight,
        client: args.client,
    }
}

/// A window starting at `start`.
pub(crate) fn window(args: &PingpongArgs, start: Instant) -> LoopWindow {
    LoopWindow {
        run: Ctx::run_id(),
        start,
        warm_end: start + args.warmup,
        end: start + args.warmup + args.duration,
    }
}

/// One run's figures from every pair's result.
pub(crate) fn pingpong_run(
    results: Vec<LoopResult>,
    cpu: CpuUse,
    args: &PingpongArgs,
) -> PingpongRun {
    let mut rtt: RttHistogram = new_histogram();
    let (mut sent, mut round_trips, mut lost) = (0, 0, 0);
    let mut errors = Vec::new();
    for r in results {
        // Same bounds on both sides, so adding cannot fail.
        let _ = rtt.add(&r.rtt);
        sent += r.sent;
        round_trips += r.round_trips;
        lost += r.lost;
        if let Some(e) = r.error {
            errors.push(format!("pair {}: {e}", r.pair));
        }
    }
    let window_s = args.duration.as_secs_f64();
    PingpongRun {
        sent_packets: sent,
        round_trips,
        round_trips_per_s: if window_s > 0.0 {
            round_trips as f64 / window_s
        } else {
            0.0
        },
        lost_packets: lost,
        rtt: Percentiles::of(&rtt),
        server_cpu_us_per_round_trip: cpu
            .server_cpu_s
            .filter(|_| round_trips > 0)
            .map(|s| s / round_trips as f64 * 1e6),
        cpu,
        errors,
    }
}

/// Checks the runs and builds the report.
pub(crate) fn finish(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &PingpongArgs,
    runs: Vec<PingpongRun>,
) -> anyhow::Result<Outcome> {
    if runs.iter().all(|r| r.round_trips == 0) {
        let errors: Vec<&str> = runs
            .iter()
            .flat_map(|r| r.errors.iter().map(String::as_str))
            .collect();
        anyhow::bail!(
            "no packet came back through the relay: nothing to measure{}",
            if errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", errors.join("; "))
            }
        );
    }
    for r in &runs {
        if r.lost_packets > 0 {
            ctx.warnings.push(format!(
                "{} packets never came back (given up after 2 s each); the round trips \
                 measured exclude them",
                r.lost_packets
            ));
        }
        for e in &r.errors {
            ctx.warnings
                .push(format!("connection failed during the run: {e}"));
        }
    }
    ctx.warnings.dedup();
    let median = PingpongMedian::of(&runs);
    let human = human(args, &runs, &median);
    let config = PingpongConfig {
        pairs: args.pairs,
        in_flight: args.in_flight,
        size_bytes: args.size,
        client: args.client.name(),
        warmup_s: args.warmup.as_secs_f64(),
        duration_s: args.duration.as_secs_f64(),
        runs: args.runs,
    };
    let report = ctx.report(
        target_args,
        "pingpong",
        config,
        PingpongResult { runs, median },
    );
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

fn human(args: &PingpongArgs, runs: &[PingpongRun], median: &PingpongMedian) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pingpong: {} pair(s), {} in flight each, {} B packets, {} client, {:?} warm-up + {:?} window, {} run(s)",
        args.pairs,
        args.in_flight,
        args.size,
        args.client.name(),
        args.warmup,
        args.duration,
        args.runs
    );
    let rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                (i + 1).to_string(),
                r.round_trips.to_string(),
                format!("{:.0}", r.round_trips_per_s),
                r.lost_packets.to_string(),
                format!("{:.1}", r.rtt.p50_us),
                format!("{:.1}", r.rtt.p90_us),
                format!("{:.1}", r.rtt.p99_us),
                format!("{:.1}", r.rtt.p999_us),
                format!("{:.1}", r.rtt.max_us),
                opt(r.cpu.bench_cores, 2),
                opt(r.cpu.server_cores, 2),
                opt(r.server_cpu_us_per_round_trip, 2),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "run",
            "round trips",
            "per s",
            "lost",
            "p50 us",
            "p90 us",
            "p99 us",
            "p99.9 us",
            "max us",
            "bench cores",
            "srv cores",
            "srv CPU us/rt",
        ],
        &rows,
    ));
    let m = &median.rtt;
    let _ = writeln!(
        out,
        "median of runs: p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us; {:.0} round trips/s; server CPU {} us per round trip",
        m.p50_us,
        m.p90_us,
        m.p99_us,
        m.p999_us,
        m.max_us,
        median.round_trips_per_s,
        opt(median.server_cpu_us_per_round_trip, 2),
    );
    out
}
