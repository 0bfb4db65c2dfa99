//! `throughput`: pairs of connections through the relay, paced or unpaced.

use std::fmt::Write as _;

use anyhow::bail;
use derp_load::args::TargetArgs;
use derp_load::packet::Kind;
use derp_load::report::LoadRun;
use derp_load::report::WindowSpec;
use derp_load::worker::FleetShare;
use derp_load::{Ctx, Outcome};

use crate::cli::ThroughputArgs;
use crate::progress::Progress;
use crate::report::{LoadMedian, ThroughputConfig, ThroughputResult, opt, pct, quic_lines, table};

use super::fleets::Generator;

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &ThroughputArgs,
) -> anyhow::Result<Outcome> {
    let size = args.load.size as usize;
    let rate_pps = match (args.rate, args.mbps) {
        (Some(r), _) if !(r > 0.0 && r.is_finite()) => bail!("--rate must be a positive number"),
        (_, Some(m)) if !(m > 0.0 && m.is_finite()) => bail!("--mbps must be a positive number"),
        (Some(r), _) => Some(r),
        (None, Some(mbps)) => Some(mbps * 1e6 / 8.0 / size as f64 / f64::from(args.load.pairs)),
        (None, None) => None,
    };
    let mut fleet = Generator::connect(
        ctx,
        target_args,
        &[FleetShare {
            pairs: args.load.pairs,
            first_pair: 0,
            echo: false,
        }],
    )
    .await?;
    let progress = Progress::start((args.load.warmup + args.duration) * args.runs, "throughput");
    let mut runs = Vec::new();
    for i in 0..args.runs {
        progress.message(format!("throughput run {}/{}", i + 1, args.runs));
        let spec = WindowSpec {
            run: Ctx::run_id(),
            size,
            rate_pps,
            warmup: args.load.warmup,
            duration: args.duration,
            stop_receivers_after: args.stop_receivers_after,
            kind: Kind::Load,
        };
        let (result, _) = fleet
            .run_windows(ctx, std::slice::from_ref(&spec))
            .await?
            .remove(0);
        ctx.check_cpu(&format!("run {}", i + 1), &result.cpu);
        note_shortfall(ctx, &result);
        runs.push(result);
    }
    progress.finish();
    drop(fleet);

    let median = LoadMedian::of(&runs);
    let human = human(args, rate_pps, &runs, &median);
    let config = ThroughputConfig {
        pairs: args.load.pairs,
        size_bytes: args.load.size,
        rate_pps_per_pair: rate_pps,
        warmup_s: args.load.warmup.as_secs_f64(),
        duration_s: args.duration.as_secs_f64(),
        runs: args.runs,
        stop_receivers_after_s: args.stop_receivers_after.map(|d| d.as_secs_f64()),
    };
    let report = ctx.report(
        target_args,
        "throughput",
        config,
        ThroughputResult { runs, median },
    );
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

/// Says so when paced senders could not offer what they were asked to, or pairs failed.
pub(crate) fn note_shortfall(ctx: &mut Ctx, run: &LoadRun) {
    if let Some(offered) = run.offered_pps
        && run.sent_pps < 0.95 * offered
    {
        ctx.warnings.push(format!(
            "senders offered {:.0} packets/s of the {:.0} asked for: TCP backpressure from the \
             server, or the bench's own CPU, held them back",
            run.sent_pps, offered
        ));
    }
    if run.offered_pps.is_none() && run.loss_ratio > 0.5 {
        let w = "unpaced senders overran the relay (or the bench's own receivers, which share \
                 the CPUs with them): the delivered figure shows overload behaviour, not \
                 capacity; use `sweep` or --mbps to find the capacity"
            .to_owned();
        if !ctx.warnings.contains(&w) {
            ctx.warnings.push(w);
        }
    }
    for e in &run.errors {
        ctx.warnings
            .push(format!("connection failed during the run: {e}"));
    }
}

fn human(
    args: &ThroughputArgs,
    rate: Option<f64>,
    runs: &[LoadRun],
    median: &LoadMedian,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "throughput: {} pairs, {} B packets, {}, {:?} warm-up + {:?} window, {} run(s)",
        args.load.pairs,
        args.load.size,
        rate.map_or_else(
            || "unpaced".to_owned(),
            |r| format!("{r:.0} pkt/s per pair")
        ),
        args.load.warmup,
        args.duration,
        args.runs
    );
    let rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                (i + 1).to_string(),
                format!("{:.0}", r.sent_pps),
                format!("{:.0}", r.delivered_pps),
                format!("{:.1}", r.delivered_mbps),
                r.lost_packets.to_string(),
                pct(r.loss_ratio),
                r.out_of_order_packets.to_string(),
                r.server_drops
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |d| d.total_packets.to_string()),
                opt(r.cpu.bench_cores, 2),
                opt(r.cpu.server_cores, 2),
                opt(r.server_cpu_s_per_mpkt, 2),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "run",
            "sent pkt/s",
            "delivered pkt/s",
            "Mbit/s",
            "lost",
            "loss",
            "reordered",
            "srv drops",
            "bench cores",
            "srv cores",
            "srv CPU s/Mpkt",
        ],
        &rows,
    ));
    let _ = writeln!(
        out,
        "median: {:.0} pkt/s, {:.1} Mbit/s, loss {}, bench {} cores, server {} cores, server CPU {} s per million packets",
        median.delivered_pps,
        median.delivered_mbps,
        pct(median.loss_ratio),
        opt(median.bench_cores, 2),
        opt(median.server_cores, 2),
        opt(median.server_cpu_s_per_mpkt, 2),
    );
    if let Some(last) = runs.last() {
        if let Some(d) = &last.server_drops
            && d.total_packets > 0
        {
            let reasons: Vec<String> = d
                .by_reason
                .iter()
                .filter(|(_, v)| **v > 0)
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let _ = writeln!(out, "server drops (last run): {}", reasons.join(" "));
        }
        let lossy: Vec<String> = last
            .pairs
            .iter()
            .filter(|p| p.lost_packets > 0)
            .map(|p| {
                format!(
                    "pair {}: {}/{} lost",
                    p.pair, p.lost_packets, p.sent_packets
                )
            })
            .collect();
        if !lossy.is_empty() {
            let _ = writeln!(out, "loss per pair (last run): {}", lossy.join(", "));
        }
    }
    let quic: Vec<_> = runs.iter().map(|r| r.quic.as_ref()).collect();
    quic_lines(&mut out, "throughput", &quic);
    out
}
