//! The load of throughput, sweep and latency: fleets of pairs in this process, or spread
//! over worker processes (`--procs`) whose windows open together and whose figures are
//! merged into the same [`LoadRun`]s.

use derp_load::Ctx;
use derp_load::args::TargetArgs;
use derp_load::fleet::{Fleet, run_fleets};
use derp_load::measure::{RttHistogram, new_histogram, sample_cpu, scrape};
use derp_load::procs::{START_LEAD, Workers, instant_at, split, unix_ns_now};
use derp_load::report::{CpuUse, LoadRun, PairResult, QuicWindow, WindowSpec};
use derp_load::worker::{ANSWER_SLACK, Answer, Command, FleetShare, Work, start_workers};
use tokio::time::Instant;

/// Fleets that run their windows together.
#[derive(Debug)]
pub(crate) enum Generator {
    Local(Vec<Fleet>),
    Procs(Workers),
}

impl Generator {
    /// Connects the fleets (`pairs` each, numbered from `first_pair`, echoing or not), here
    /// or split over `ctx.procs_asked` processes by pairs.
    pub(crate) async fn connect(
        ctx: &mut Ctx,
        target_args: &TargetArgs,
        fleets: &[FleetShare],
    ) -> anyhow::Result<Self> {
        let total: u32 = fleets.iter().map(|f| f.pairs).sum();
        let procs = (ctx.procs_asked).min(total).max(1) as usize;
        if procs == 1 {
            derp_load::target::check_fd_budget(total as usize * 2, ctx.target.spawned)?;
            let mut local = Vec::new();
            for f in fleets {
                local.push(Fleet::connect(&ctx.target, f.pairs, f.first_pair, f.echo).await?);
            }
            return Ok(Self::Local(local));
        }
        if ctx.target.spawned {
            derp_load::target::check_fd_budget(total as usize * 2, false)?;
        }
        // Each fleet split by pairs; worker i gets the i-th share of every fleet.
        let mut work: Vec<Vec<FleetShare>> = vec![Vec::new(); procs];
        for f in fleets {
            let mut first = f.first_pair;
            for (i, n) in split(u64::from(f.pairs), procs).into_iter().enumerate() {
                work[i].push(FleetShare {
                    pairs: n as u32,
                    first_pair: first,
                    echo: f.echo,
                });
                first += n as u32;
            }
        }
        let work = work
            .into_iter()
            .filter(|shares| shares.iter().any(|s| s.pairs > 0))
            .map(Work::Fleets)
            .collect();
        Ok(Self::Procs(start_workers(ctx, target_args, work).await?))
    }

    /// One window on every fleet, one spec each (they share warm-up and duration); a load run
    /// and a histogram of probe round trips per fleet.
    pub(crate) async fn run_windows(
        &mut self,
        ctx: &Ctx,
        specs: &[WindowSpec],
    ) -> anyhow::Result<Vec<(LoadRun, RttHistogram)>> {
        match self {
            Self::Local(fleets) => {
                Ok(run_fleets(fleets, specs, Instant::now(), ctx.clock, &ctx.target).await?)
            }
            Self::Procs(workers) => remote_windows(workers, ctx, specs).await,
        }
    }
}

/// One window over every worker from a common start. The parent samples the server, the
/// machine and its own CPU across the measured window and scrapes the metrics, as a single
/// process does; the workers' CPU is added to the bench's, and their pairs are put together.
async fn remote_windows(
    workers: &mut Workers,
    ctx: &Ctx,
    specs: &[WindowSpec],
) -> anyhow::Result<Vec<(LoadRun, RttHistogram)>> {
    let Some(first) = specs.first() else {
        anyhow::bail!("a window without a spec");
    };
    let start_unix_ns = unix_ns_now() + START_LEAD.as_nanos() as u64;
    workers.send_all(&Command::Window {
        start_unix_ns,
        specs: specs.to_vec(),
    })?;
    let warm_end = instant_at(start_unix_ns) + first.warmup;
    let end = warm_end + first.duration;
    tokio::time::sleep_until(warm_end).await;
    let cpu_before = sample_cpu(&ctx.target);
    let scrape_before = scrape(&ctx.target).await;
    tokio::time::sleep_until(end).await;
    let cpu_after = sample_cpu(&ctx.target);
    let wall_s = Instant::now()
        .saturating_duration_since(warm_end)
        .as_secs_f64();
    let answers: Vec<Answer> = workers
        .recv_all(first.warmup + first.duration + ANSWER_SLACK)
        .await?;
    let scrape_after = scrape(&ctx.target).await;
    let mut per_worker = Vec::new();
    for answer in answers {
        let Answer::Windows(outs) = answer else {
            anyhow::bail!("a bench process answered a window with {answer:?}");
        };
        if outs.len() != specs.len() {
            anyhow::bail!(
                "a bench process ran {} fleets, not {}",
                outs.len(),
                specs.len()
            );
        }
        per_worker.push(outs);
    }
    let parent_cpu = CpuUse::between(cpu_before, cpu_after, wall_s);
    let drops = derp_load::measure::drops_between(scrape_before.as_ref(), scrape_after.as_ref());
    let mut out = Vec::new();
    for (k, spec) in specs.iter().enumerate() {
        let mut pairs: Vec<PairResult> = Vec::new();
        let mut errors = Vec::new();
        let mut connected = 0;
        let mut worker_cpu = Some(0.0);
        let mut rtt = new_histogram();
        let mut quic: Option<QuicWindow> = None;
        for outs in &per_worker {
            let o = &outs[k];
            if let Some(q) = &o.run.quic {
                quic.get_or_insert_with(QuicWindow::default).merge(q);
            }
            pairs.extend(o.run.pairs.iter().cloned());
            errors.extend(o.run.errors.iter().cloned());
            connected += o.run.pairs_connected;
            worker_cpu = worker_cpu.zip(o.run.cpu.bench_cpu_s).map(|(a, b)| a + b);
            o.rtt.add_to(&mut rtt);
        }
        pairs.sort_by_key(|p| p.pair);
        let mut run = LoadRun::from_pairs(
            pairs,
            spec,
            connected,
            parent_cpu.plus_bench(worker_cpu),
            drops.clone(),
            errors,
        );
        run.quic = quic;
        out.push((run, rtt));
    }
    Ok(out)
}
