//! What a run of either program has (the target, the clock, the machine, its warnings), and
//! how a run is started, bounded and ended.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::args::TargetArgs;
use crate::measure::Clock;
use crate::report::{self, CpuUse, Machine, Report, TargetInfo};
use crate::target::{BENCH_THREAD_NAME, SpawnError, SpawnedServer, Target, TargetError};

/// The program a run belongs to, for its messages and its report.
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    /// The executable's name, e.g. `derp-bench`.
    pub name: &'static str,
    /// Its crate version, reported as `tool_version`.
    pub version: &'static str,
}

/// What every mode gets.
#[derive(Debug)]
pub struct Ctx {
    /// The server under test.
    pub target: Target,
    /// The clock packets carry.
    pub clock: Clock,
    /// CPUs available to the bench.
    pub cores: usize,
    /// What makes the figures less trustworthy, for the report.
    pub warnings: Vec<String>,
    /// `--procs`: how many processes the load may be spread over.
    pub procs_asked: u32,
    /// How many carry it (1: this one alone).
    pub procs: usize,
    tool: Tool,
    started_unix_s: u64,
}

impl Ctx {
    /// Notes when the bench, not the server, is the likely bottleneck of a window.
    pub fn check_cpu(&mut self, what: &str, cpu: &CpuUse) {
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
    pub fn run_id() -> u32 {
        rand::random()
    }

    /// Wraps a mode's result into the JSON document.
    pub fn report<C: Serialize, R: Serialize>(
        &self,
        args: &TargetArgs,
        mode: &'static str,
        config: C,
        result: R,
    ) -> Report<C, R> {
        Report {
            schema_version: report::SCHEMA_VERSION,
            tool_version: self.tool.version,
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
pub struct Outcome {
    /// The whole JSON document.
    pub json: serde_json::Value,
    /// The summary for a terminal.
    pub human: String,
    /// The warnings, printed after the summary.
    pub warnings: Vec<String>,
    /// Set when the mode's own checks failed: the output is printed, then the run fails.
    pub failure: Option<String>,
}

impl Outcome {
    /// Prints the JSON document on stdout, or the summary on stdout and the warnings on
    /// stderr.
    pub fn print(&self, json: bool, tool: Tool) -> Result<(), serde_json::Error> {
        if json {
            println!("{}", serde_json::to_string_pretty(&self.json)?);
        } else {
            print!("{}", self.human);
            for w in &self.warnings {
                eprintln!("{}: warning: {w}", tool.name);
            }
        }
        Ok(())
    }
}

/// Runs `mode` on a runtime of its own against the server the flags name: with
/// `--spawn-server` it starts the in-process relay first and stops it afterwards; one
/// handshake checks the server before anything else; the whole run is stopped after `bound`.
/// `procs_asked` is `--procs` (1 for a program that has none). The soft limit on open
/// descriptors is raised to the hard one first (worker processes inherit it), so that a
/// shell's 1,024 does not cap the connections a run may open.
pub fn run<T, E: From<RunError>>(
    tool: Tool,
    args: &TargetArgs,
    procs_asked: u32,
    bound: Duration,
    mode: impl AsyncFnOnce(&mut Ctx) -> Result<T, E>,
) -> Result<T, E> {
    if args.url.is_none() && !args.spawn_server {
        return Err(RunError::Target(TargetError::NoServer).into());
    }
    // Silently, as Go's runtime does: the limit a run meets is in the error that names it.
    let _ = derp_server::raise_descriptor_limit();
    let spawned = if args.spawn_server {
        Some(SpawnedServer::start().map_err(RunError::Spawn)?)
    } else {
        None
    };
    let result = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(BENCH_THREAD_NAME)
        .build()
    {
        Ok(rt) => {
            let out = rt.block_on(async {
                let mut ctx = Ctx::start(tool, args, spawned.as_ref(), procs_asked)
                    .await
                    .map_err(RunError::Target)?;
                tokio::time::timeout(bound, mode(&mut ctx))
                    .await
                    .map_err(|_| RunError::TimedOut(bound))?
            });
            // Connections still open are dropped here, before the relay goes away.
            rt.shutdown_timeout(Duration::from_secs(2));
            out
        }
        Err(e) => Err(RunError::Runtime(e).into()),
    };
    if let Some(s) = spawned {
        s.stop();
    }
    result
}

/// Why a run could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The server named by the flags cannot be used.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The in-process relay did not start.
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    /// The run's runtime did not start.
    #[error("starting the bench runtime")]
    Runtime(#[source] std::io::Error),
    /// The run outlasted its bound.
    #[error("the run exceeded its time bound of {0:?} and was stopped")]
    TimedOut(Duration),
}

impl Ctx {
    /// The target resolved and checked with one handshake, and the warnings every run of
    /// this build and setup carries.
    async fn start(
        tool: Tool,
        args: &TargetArgs,
        spawned: Option<&SpawnedServer>,
        procs_asked: u32,
    ) -> Result<Self, TargetError> {
        let mut ctx = Self {
            target: Target::new(args, spawned)?,
            clock: Clock::start(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            warnings: Vec::new(),
            procs_asked,
            procs: 1,
            tool,
            started_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        if cfg!(debug_assertions) {
            ctx.warnings.push(format!(
                "{0} is a debug build: it is slow enough to be the bottleneck; \
                 use `cargo build --release -p {0}`",
                tool.name
            ));
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
        Ok(ctx)
    }
}
