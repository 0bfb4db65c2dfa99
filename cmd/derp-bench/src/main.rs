//! derp-bench: a load-test client for DERP relays (derpd, Tailscale's derper, or any other).
//!
//! What it does: measures a relay from the outside over its DERP URL (plain, WebSocket, TLS
//! or QUIC), in six modes (throughput, latency, pingpong, connect, idle, sweep), with paced
//! senders, per-pair loss counting, timestamped packets, warm-up and repeated runs, in one
//! process or spread over several (`--procs`); and soaks it (`soak`): every kind of client for
//! a long time, then a strict account that fails the run on any discrepancy. It reports its
//! own CPU use next to the server's and warns when it, rather than the server, is the likely
//! bottleneck. With `--spawn-server` it starts an in-process derpd relay to test;
//! `floor-relay` runs the least relay there is, to measure against.
//!
//! What it does not do: generate load from several machines (run one bench per machine
//! for that), or send anything anywhere but the URLs it is given.

mod cli;
mod closed_loop;
mod floor;
mod load;
mod modes;
mod pacing;
mod packet;
mod plot;
mod procfs;
mod procs;
mod progress;
mod prom;
mod report;
mod target;

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, anyhow, bail};
use clap::Parser;
use serde::Serialize;

use crate::cli::{Cli, Mode, OutputArgs, TargetArgs};
use crate::load::Clock;
use crate::report::{CpuUse, Machine, Report, TargetInfo};
use crate::target::{BENCH_THREAD_NAME, SpawnedServer, Target};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Mode::Worker = cli.mode {
        return match run_worker() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("derp-bench worker: error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if let Mode::FloorRelay(args) = &cli.mode {
        return match run_floor_relay(&cli, args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("derp-bench: error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let spawned = if cli.target.spawn_server {
        match SpawnedServer::start() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("derp-bench: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(BENCH_THREAD_NAME)
        .build()
        .context("starting the bench runtime")
        .and_then(|rt| {
            let out = rt.block_on(run(&cli, spawned.as_ref()));
            // Connections still open are dropped here, before the relay goes away.
            rt.shutdown_timeout(Duration::from_secs(2));
            out
        });
    if let Some(s) = spawned {
        s.stop();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("derp-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A worker of a `--procs` run: its job first, then a runtime sized by it.
fn run_worker() -> anyhow::Result<()> {
    let job: modes::worker::Job = procs::Parent::read_job()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(job.threads.max(1))
        .enable_all()
        .thread_name(BENCH_THREAD_NAME)
        .build()
        .context("starting the worker's runtime")?;
    let out = rt.block_on(modes::worker::run(job));
    rt.shutdown_timeout(Duration::from_secs(2));
    out
}

/// The floor relay measures nothing and tests nothing, so the target and output flags mean
/// nothing to it; refusing them catches a command line that mixed up the two roles.
fn run_floor_relay(cli: &Cli, args: &cli::FloorRelayArgs) -> anyhow::Result<()> {
    let t = &cli.target;
    if t.url.is_some()
        || t.spawn_server
        || t.peer_url.is_some()
        || t.metrics_url.is_some()
        || !t.server_pid.is_empty()
        || cli.output.json
        || cli.output.plot.is_some()
        || cli.procs > 1
    {
        bail!("floor-relay takes only --listen: it is the server, not a measurement");
    }
    floor::run(args.listen)
}

/// What every mode gets.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub(crate) target: Target,
    pub(crate) clock: Clock,
    pub(crate) cores: usize,
    pub(crate) warnings: Vec<String>,
    /// `--procs`: how many processes the load may be spread over.
    pub(crate) procs_asked: u32,
    /// How many carry it (1: this one alone).
    pub(crate) procs: usize,
    started_unix_s: u64,
}

impl Ctx {
    /// Notes when the bench, not the server, is the likely bottleneck of a window.
    pub(crate) fn check_cpu(&mut self, what: &str, cpu: &CpuUse) {
        let cores = self.cores as f64;
        let Some(bench) = cpu.bench_cores else {
            return;
        };
        let procs = if self.procs > 1 {
            format!(" (all {} bench processes together)", self.procs)
        } else {
            String::new()
        };
        let warning = if bench >= 0.8 * cores {
            Some(format!(
                "{what}: the bench used {bench:.2} of {cores} cores{procs}; it is likely the \
                 bottleneck and the figures are a lower bound for the server"
            ))
        } else if let Some(server) = cpu.server_cores
            && bench + server >= 0.85 * cores
            && bench >= server
        {
            Some(format!(
                "{what}: the machine's CPUs are saturated ({bench:.2} bench{procs} + {server:.2} \
                 server of {cores} cores) and the bench uses more than the server; run the bench \
                 on another machine to measure the server alone"
            ))
        } else if let Some(busy) = cpu.machine_busy_cores
            && busy >= 0.9 * cores
        {
            Some(format!(
                "{what}: the machine's CPUs were {:.0}% busy ({bench:.2} cores bench, {} server, \
                 {} kernel softirq): the figures are bounded by this machine, not only by the \
                 server",
                busy / cores * 100.0,
                cpu.server_cores
                    .map_or_else(|| "?".to_owned(), |s| format!("{s:.2}")),
                cpu.machine_softirq_cores
                    .map_or_else(|| "?".to_owned(), |s| format!("{s:.2}")),
            ))
        } else {
            None
        };
        if let Some(w) = warning
            && !self.warnings.contains(&w)
        {
            self.warnings.push(w);
        }
    }

    /// A fresh run id, so packets of earlier windows are never counted.
    pub(crate) fn run_id() -> u32 {
        rand::random()
    }

    /// Wraps a mode's result into the JSON document.
    pub(crate) fn report<C: Serialize, R: Serialize>(
        &self,
        args: &TargetArgs,
        mode: &'static str,
        config: C,
        result: R,
    ) -> Report<C, R> {
        Report {
            schema_version: report::SCHEMA_VERSION,
            tool_version: env!("CARGO_PKG_VERSION"),
            mode,
            started_unix_s: self.started_unix_s,
            procs: self.procs,
            target: TargetInfo {
                url: self.target.url.to_string(),
                spawned_server: self.target.spawned,
                metrics_source: self.target.metrics.as_ref().map(|m| m.describe()),
                server_pid: args.server_pid.first().copied(),
                server_pids: if args.server_pid.len() > 1 {
                    args.server_pid.clone()
                } else {
                    Vec::new()
                },
                peer_url: self.target.peer_url.as_ref().map(ToString::to_string),
            },
            machine: Machine {
                cores: self.cores,
                bench_release_build: !cfg!(debug_assertions),
            },
            config,
            result,
            warnings: self.warnings.clone(),
        }
    }
}

/// What a mode hands back: the JSON document and the human summary.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) json: serde_json::Value,
    pub(crate) human: String,
    pub(crate) warnings: Vec<String>,
    /// Set when the mode's own checks failed: the output is printed, then the run fails.
    pub(crate) failure: Option<String>,
}

async fn run(cli: &Cli, spawned: Option<&SpawnedServer>) -> anyhow::Result<()> {
    if cli.target.url.is_none() && spawned.is_none() {
        bail!("give the server with --url URL, or use --spawn-server");
    }
    check_plot(&cli.mode, &cli.output)?;
    if cli.procs > 1 && matches!(cli.mode, Mode::Soak(_)) {
        bail!(
            "--procs spreads the load of throughput, latency, pingpong, connect, idle and \
             sweep; soak runs in one process"
        );
    }
    let target = Target::new(&cli.target, spawned)?;
    let mut ctx = Ctx {
        target,
        clock: Clock::new(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        warnings: Vec::new(),
        procs_asked: cli.procs,
        procs: 1,
        started_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    if cfg!(debug_assertions) {
        ctx.warnings.push(
            "derp-bench is a debug build: it is slow enough to be the bottleneck; \
             use `cargo build --release -p derp-bench`"
                .to_owned(),
        );
    }
    if ctx.target.spawned {
        ctx.warnings.push(
            "the relay runs inside the bench process (--spawn-server): they share the CPUs, and \
             memory figures include the bench's; a separate derpd with --server-pid gives the \
             server's own figures"
                .to_owned(),
        );
    }
    ctx.target.preflight().await?;
    let bound = time_bound(&cli.mode);
    let fut = async {
        match &cli.mode {
            Mode::Throughput(a) => modes::throughput::run(&mut ctx, &cli.target, a).await,
            Mode::Latency(a) => modes::latency::run(&mut ctx, &cli.target, a, &cli.output).await,
            Mode::Pingpong(a) => modes::pingpong::run(&mut ctx, &cli.target, a).await,
            Mode::Connect(a) => modes::connect::run(&mut ctx, &cli.target, a).await,
            Mode::Idle(a) => modes::idle::run(&mut ctx, &cli.target, a).await,
            Mode::Sweep(a) => modes::sweep::run(&mut ctx, &cli.target, a, &cli.output).await,
            Mode::Soak(a) => modes::soak::run(&mut ctx, &cli.target, a, cli.output.json).await,
            Mode::FloorRelay(_) | Mode::Worker => bail!("not a measurement"),
        }
    };
    let outcome = tokio::time::timeout(bound, fut)
        .await
        .map_err(|_| anyhow!("the run exceeded its time bound of {bound:?} and was stopped"))??;
    if cli.output.json {
        println!("{}", serde_json::to_string_pretty(&outcome.json)?);
    } else {
        print!("{}", outcome.human);
        for w in &outcome.warnings {
            eprintln!("derp-bench: warning: {w}");
        }
    }
    if let Some(failure) = outcome.failure {
        bail!("{failure}");
    }
    Ok(())
}

fn check_plot(mode: &Mode, output: &OutputArgs) -> anyhow::Result<()> {
    if output.plot.is_some() && !matches!(mode, Mode::Sweep(_) | Mode::Latency(_)) {
        bail!(
            "--plot draws the sweep curve or the latency distribution; use it with `sweep` or `latency`"
        );
    }
    Ok(())
}

/// A hard upper bound on a mode's whole run: generous against its expected duration, so a
/// hung server cannot keep the bench running forever.
fn time_bound(mode: &Mode) -> Duration {
    const SLACK: Duration = Duration::from_secs(60);
    // Connect phase, drain and scrapes of one window.
    const PER_WINDOW: Duration = Duration::from_secs(15);
    let windows =
        |runs: u32, warmup: Duration, duration: Duration| (warmup + duration + PER_WINDOW) * runs;
    let expected = match mode {
        Mode::Throughput(a) => windows(a.runs, a.load.warmup, a.duration),
        Mode::Latency(a) => windows(a.runs, a.warmup, a.duration),
        Mode::Pingpong(a) => windows(a.runs, a.warmup, a.duration),
        Mode::Connect(a) => (a.max_duration + PER_WINDOW) * a.runs,
        Mode::Idle(a) => (a.hold + Duration::from_secs(120)) * a.runs,
        Mode::Sweep(a) => windows(a.max_steps, a.load.warmup, a.step_duration),
        // Connecting and winding down thousands of clients, then settling.
        Mode::Soak(a) => a.duration + a.settle * 2 + Duration::from_secs(120),
        Mode::FloorRelay(_) | Mode::Worker => Duration::ZERO,
    };
    expected * 2 + SLACK
}
