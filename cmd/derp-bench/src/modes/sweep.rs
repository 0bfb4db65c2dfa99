//! `sweep`: step the offered load up until the relay stops delivering it, then a few steps
//! past that, to find where it saturates and whether it degrades gently or collapses.
//!
//! A step's undelivered ratio is 1 - delivered/offered: packets the relay dropped plus load
//! the senders could not even hand over because TCP backpressure held them back. Both mean
//! the relay is not keeping up.

use std::fmt::Write as _;

use anyhow::bail;
use derp_load::args::TargetArgs;
use derp_load::packet::Kind;
use derp_load::report::{LoadRun, WindowSpec};
use derp_load::worker::FleetShare;
use derp_load::{Ctx, Outcome};

use crate::cli::{OutputArgs, SweepArgs};
use crate::progress::Progress;
use crate::report::{Saturation, SweepConfig, SweepResult, SweepStep, opt, pct, table};

use super::fleets::Generator;

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &SweepArgs,
    output: &OutputArgs,
) -> anyhow::Result<Outcome> {
    if !(args.start_mbps > 0.0 && args.start_mbps.is_finite()) {
        bail!("--start-mbps must be a positive number");
    }
    match args.step_mbps {
        Some(s) if !(s > 0.0 && s.is_finite()) => bail!("--step-mbps must be a positive number"),
        None if !(args.factor > 1.0 && args.factor.is_finite()) => {
            bail!("--factor must be greater than 1")
        }
        _ => {}
    }
    if !(0.0..1.0).contains(&args.loss_threshold) {
        bail!("--loss-threshold must be in [0, 1)");
    }
    let size = args.load.size as usize;
    let pairs = args.load.pairs;
    let mut fleet = Generator::connect(
        ctx,
        target_args,
        &[FleetShare {
            pairs,
            first_pair: 0,
            echo: false,
        }],
    )
    .await?;
    let progress = Progress::start(
        (args.load.warmup + args.step_duration) * args.max_steps,
        "sweep",
    );
    let mut steps: Vec<SweepStep> = Vec::new();
    let mut over = 0;
    let mut offered = args.start_mbps;
    for i in 0..args.max_steps {
        progress.message(format!("sweep step {} ({offered:.0} Mbit/s)", i + 1));
        let spec = WindowSpec {
            run: Ctx::run_id(),
            size,
            rate_pps: Some(offered * 1e6 / 8.0 / size as f64 / f64::from(pairs)),
            warmup: args.load.warmup,
            duration: args.step_duration,
            stop_receivers_after: None,
            kind: Kind::Load,
        };
        let (load, _) = fleet
            .run_windows(ctx, std::slice::from_ref(&spec))
            .await?
            .remove(0);
        ctx.check_cpu(&format!("step {} ({offered:.0} Mbit/s)", i + 1), &load.cpu);
        for e in &load.errors {
            ctx.warnings
                .push(format!("connection failed during the sweep: {e}"));
        }
        let undelivered_ratio = (1.0 - load.delivered_mbps / offered).max(0.0);
        let dead = fleet_dead(&load);
        steps.push(SweepStep {
            offered_mbps: offered,
            undelivered_ratio,
            load,
        });
        if undelivered_ratio > args.loss_threshold {
            over += 1;
            if over > args.steps_past {
                break;
            }
        }
        if dead {
            ctx.warnings
                .push("every pair failed; the sweep stopped early".to_owned());
            break;
        }
        offered = match args.step_mbps {
            Some(step) => offered + step,
            None => offered * args.factor,
        };
    }
    progress.finish();
    drop(fleet);
    if over == 0 {
        ctx.warnings.push(format!(
            "the relay delivered every step up to {:.0} Mbit/s: raise --start-mbps, --factor or \
             --max-steps to find its limit",
            steps.last().map_or(0.0, |s| s.offered_mbps)
        ));
    }
    let saturation = saturation(&steps, args.loss_threshold);
    if let Some(path) = &output.plot {
        crate::plot::sweep_svg(
            path,
            &steps,
            &format!("DERP relay sweep: {pairs} pairs, {size} B packets"),
        )?;
    }
    let human = human(args, &steps, &saturation);
    let config = SweepConfig {
        pairs,
        size_bytes: args.load.size,
        start_mbps: args.start_mbps,
        factor: args.step_mbps.is_none().then_some(args.factor),
        step_mbps: args.step_mbps,
        warmup_s: args.load.warmup.as_secs_f64(),
        step_duration_s: args.step_duration.as_secs_f64(),
        loss_threshold: args.loss_threshold,
        steps_past: args.steps_past,
        max_steps: args.max_steps,
    };
    let report = ctx.report(
        target_args,
        "sweep",
        config,
        SweepResult { steps, saturation },
    );
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure: None,
    })
}

fn fleet_dead(load: &LoadRun) -> bool {
    load.pairs.iter().all(|p| p.sent_packets == 0) && !load.errors.is_empty()
}

fn saturation(steps: &[SweepStep], threshold: f64) -> Saturation {
    let best = steps
        .iter()
        .max_by(|a, b| a.load.delivered_mbps.total_cmp(&b.load.delivered_mbps));
    Saturation {
        max_delivered_mbps: best.map_or(0.0, |s| s.load.delivered_mbps),
        max_delivered_at_offered_mbps: best.map_or(0.0, |s| s.offered_mbps),
        last_ok_offered_mbps: steps
            .iter()
            .take_while(|s| s.undelivered_ratio <= threshold)
            .last()
            .map(|s| s.offered_mbps),
        first_over_threshold_offered_mbps: steps
            .iter()
            .find(|s| s.undelivered_ratio > threshold)
            .map(|s| s.offered_mbps),
    }
}

fn human(args: &SweepArgs, steps: &[SweepStep], sat: &Saturation) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "sweep: {} pairs, {} B packets, {:?} warm-up + {:?} per step, threshold {}",
        args.load.pairs,
        args.load.size,
        args.load.warmup,
        args.step_duration,
        pct(args.loss_threshold)
    );
    let rows: Vec<Vec<String>> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            vec![
                (i + 1).to_string(),
                format!("{:.0}", s.offered_mbps),
                format!("{:.0}", s.load.sent_pps / 1.0),
                format!("{:.1}", s.load.delivered_mbps),
                format!("{:.0}", s.load.delivered_pps),
                pct(s.load.loss_ratio),
                pct(s.undelivered_ratio),
                s.load
                    .server_drops
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |d| d.total_packets.to_string()),
                opt(s.load.cpu.bench_cores, 2),
                opt(s.load.cpu.server_cores, 2),
                opt(s.load.server_cpu_s_per_mpkt, 2),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "step",
            "offered Mbit/s",
            "sent pkt/s",
            "delivered Mbit/s",
            "pkt/s",
            "loss",
            "undelivered",
            "srv drops",
            "bench cores",
            "srv cores",
            "srv CPU s/Mpkt",
        ],
        &rows,
    ));
    let _ = writeln!(
        out,
        "max delivered {:.1} Mbit/s (offered {:.0}); last step within threshold: {} Mbit/s offered; first past it: {} Mbit/s",
        sat.max_delivered_mbps,
        sat.max_delivered_at_offered_mbps,
        opt(sat.last_ok_offered_mbps, 0),
        opt(sat.first_over_threshold_offered_mbps, 0),
    );
    out
}
