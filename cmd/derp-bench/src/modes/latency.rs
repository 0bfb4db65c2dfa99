//! `latency`: timestamped probes echoed through the relay, optionally under background load.

use std::fmt::Write as _;

use anyhow::bail;
use derp_load::args::TargetArgs;
use derp_load::measure::{RttHistogram, new_histogram};
use derp_load::packet::Kind;
use derp_load::report::WindowSpec;
use derp_load::worker::FleetShare;
use derp_load::{Ctx, Outcome};

use crate::cli::{LatencyArgs, OutputArgs};
use crate::modes::throughput::note_shortfall;
use crate::progress::Progress;
use crate::report::{
    LatencyConfig, LatencyMedian, LatencyResult, LatencyRun, Percentiles, opt, pct, quic_lines,
    table,
};

use super::fleets::Generator;

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &LatencyArgs,
    output: &OutputArgs,
) -> anyhow::Result<Outcome> {
    if !(args.probe_rate > 0.0 && args.probe_rate.is_finite()) {
        bail!("--probe-rate must be a positive number");
    }
    let load_rate = match args.load_mbps {
        Some(m) if !(m > 0.0 && m.is_finite()) => bail!("--load-mbps must be a positive number"),
        Some(_) if args.load_pairs == 0 => bail!("--load-mbps needs --load-pairs"),
        Some(m) => Some(m * 1e6 / 8.0 / f64::from(args.size) / f64::from(args.load_pairs)),
        None => None,
    };
    let mut fleets = vec![FleetShare {
        pairs: args.probes,
        first_pair: 0,
        echo: true,
    }];
    if args.load_pairs > 0 {
        fleets.push(FleetShare {
            pairs: args.load_pairs,
            first_pair: args.probes,
            echo: false,
        });
    }
    let mut generator = Generator::connect(ctx, target_args, &fleets).await?;
    let progress = Progress::start((args.warmup + args.duration) * args.runs, "latency");
    let mut all = new_histogram();
    let mut runs = Vec::new();
    for i in 0..args.runs {
        progress.message(format!("latency run {}/{}", i + 1, args.runs));
        let probe_spec = WindowSpec {
            run: Ctx::run_id(),
            size: args.size as usize,
            rate_pps: Some(args.probe_rate),
            warmup: args.warmup,
            duration: args.duration,
            stop_receivers_after: None,
            kind: Kind::Probe,
        };
        let load_spec = WindowSpec {
            run: Ctx::run_id(),
            rate_pps: load_rate,
            kind: Kind::Load,
            ..probe_spec.clone()
        };
        let mut specs = vec![probe_spec];
        if args.load_pairs > 0 {
            specs.push(load_spec);
        }
        let mut results = generator.run_windows(ctx, &specs).await?.into_iter();
        let Some((probe_run, hist)) = results.next() else {
            bail!("the probe window gave no result");
        };
        let background = results.next().map(|(run, _)| run);
        ctx.check_cpu(&format!("run {}", i + 1), &probe_run.cpu);
        if let Some(bg) = &background {
            note_shortfall(ctx, bg);
        }
        for e in &probe_run.errors {
            ctx.warnings.push(format!("probe connection failed: {e}"));
        }
        // Same bounds on both sides, so adding cannot fail.
        let _ = all.add(&hist);
        runs.push(LatencyRun {
            probes_sent: probe_run.sent_packets,
            probes_received: probe_run.delivered_packets,
            probes_lost: probe_run.lost_packets,
            rtt: Percentiles::of(&hist),
            background,
            cpu: probe_run.cpu,
            errors: probe_run.errors,
            quic: probe_run.quic,
        });
    }
    progress.finish();
    drop(generator);
    if runs.iter().all(|r| r.probes_received == 0) {
        bail!("no probe came back through the relay: nothing to measure");
    }
    if let Some(path) = &output.plot {
        crate::plot::latency_svg(path, &all, &plot_caption(args))?;
    }

    let median = LatencyMedian::of(&runs);
    let human = human(args, &runs, &median, &all);
    let config = LatencyConfig {
        probe_pairs: args.probes,
        probe_rate_pps: args.probe_rate,
        size_bytes: args.size,
        load_pairs: args.load_pairs,
        load_rate_pps_per_pair: load_rate,
        warmup_s: args.warmup.as_secs_f64(),
        duration_s: args.duration.as_secs_f64(),
        runs: args.runs,
    };
    let report = ctx.report(
        target_args,
        "latency",
        config,
        LatencyResult { runs, median },
    );
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

fn plot_caption(args: &LatencyArgs) -> String {
    let load = match (args.load_pairs, args.load_mbps) {
        (0, _) => "no background load".to_owned(),
        (p, Some(m)) => format!("{p} load pairs at {m} Mbit/s"),
        (p, None) => format!("{p} unpaced load pairs"),
    };
    format!(
        "DERP round trip, {} B probes at {}/s, {load}",
        args.size, args.probe_rate
    )
}

fn human(
    args: &LatencyArgs,
    runs: &[LatencyRun],
    median: &LatencyMedian,
    all: &RttHistogram,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "latency: {} echo pair(s), {} B probes at {}/s each, {} background pair(s), {:?} warm-up + {:?} window, {} run(s)",
        args.probes,
        args.size,
        args.probe_rate,
        args.load_pairs,
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
                r.probes_received.to_string(),
                r.probes_lost.to_string(),
                format!("{:.0}", r.rtt.p50_us),
                format!("{:.0}", r.rtt.p90_us),
                format!("{:.0}", r.rtt.p99_us),
                format!("{:.0}", r.rtt.p999_us),
                format!("{:.0}", r.rtt.max_us),
                opt(r.background.as_ref().map(|b| b.delivered_mbps), 1),
                opt(r.cpu.bench_cores, 2),
                opt(r.cpu.server_cores, 2),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "run",
            "probes",
            "lost",
            "p50 us",
            "p90 us",
            "p99 us",
            "p99.9 us",
            "max us",
            "bg Mbit/s",
            "bench cores",
            "srv cores",
        ],
        &rows,
    ));
    let m = &median.rtt;
    let _ = writeln!(
        out,
        "median of runs: p50 {:.0} us, p90 {:.0} us, p99 {:.0} us, p99.9 {:.0} us, max {:.0} us; probe loss {}; {} round trips in all",
        m.p50_us,
        m.p90_us,
        m.p99_us,
        m.p999_us,
        m.max_us,
        pct(median.probe_loss_ratio),
        all.len()
    );
    let probes: Vec<_> = runs.iter().map(|r| r.quic.as_ref()).collect();
    quic_lines(&mut out, "probes", &probes);
    let load: Vec<_> = runs
        .iter()
        .map(|r| r.background.as_ref().and_then(|b| b.quic.as_ref()))
        .collect();
    quic_lines(&mut out, "background load", &load);
    out
}
