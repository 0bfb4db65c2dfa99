//! The worker side of `--procs`: what a worker process is asked to do, and doing it. The
//! parent side of each mode sends a [`Job`] with the worker's share, then [`Command`]s with a
//! common start time; the worker answers each with an [`Answer`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::Ctx;
use crate::args::TargetArgs;
use crate::closed_loop::ClientKind;
use crate::closed_loop::{LoopError, LoopPairs, LoopResult, LoopSpec, LoopWindow};
use crate::connections::{ConnectionShare, Opening, Storm};
use crate::fleet::{Fleet, FleetError, run_fleets};
use crate::measure::{Clock, HistWire, new_histogram};
use crate::procs::{Parent, ProcsError, RemoteError, Workers, instant_at};
use crate::report::{LoadRun, WindowSpec, error_text};
use crate::target::{BENCH_THREAD_NAME, Target, TargetError};

/// How long the parent waits for answers beyond the window itself: stragglers, the
/// senders' grace period and a loaded machine.
pub const ANSWER_SLACK: Duration = Duration::from_secs(30);
/// How long workers get to connect their share, beyond the connect timeout.
const CONNECT_SLACK: Duration = Duration::from_secs(120);

/// Starts one worker per share of work (the caller leaves out empty shares) and waits until
/// every one is connected. Records in `ctx` how many processes carry the load.
pub async fn start_workers(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    work: Vec<Work>,
) -> Result<Workers, WorkerError> {
    let n = work.len();
    let mut target = target_args.clone();
    // The parent observes the server; workers only generate load, at the URL the parent
    // resolved (its in-process relay's, with --spawn-server).
    target.url = Some(ctx.target.url.to_string());
    target.spawn_server = false;
    target.server_pid = Vec::new();
    target.metrics_url = None;
    let threads = ctx.cores.div_ceil(n).max(1);
    let jobs: Vec<Job> = work
        .into_iter()
        .map(|work| Job {
            threads,
            target: target.clone(),
            work,
        })
        .collect();
    let (workers, ready) =
        Workers::start::<Job, Answer>(&jobs, ctx.target.connect_timeout + CONNECT_SLACK).await?;
    if let Some(other) = ready.iter().find(|a| !matches!(a, Answer::Ready)) {
        return Err(WorkerError::Unexpected(format!("{other:?}")));
    }
    ctx.procs = n;
    if n < ctx.procs_asked as usize {
        ctx.warnings.push(format!(
            "--procs {}: the load fits {n} process(es) (each needs at least one pair, \
             connection or unit of concurrency)",
            ctx.procs_asked
        ));
    }
    Ok(workers)
}

/// Everything a worker needs to connect its share.
#[derive(Debug, Serialize, Deserialize)]
pub struct Job {
    /// Runtime worker threads: the machine's cores divided among the workers.
    pub threads: usize,
    /// The parent's target flags, with the URL resolved (an in-process relay is the parent's)
    /// and the server's observation left to the parent.
    pub target: TargetArgs,
    /// Its share.
    pub work: Work,
}

/// A worker's share of the connections.
#[derive(Debug, Serialize, Deserialize)]
pub enum Work {
    /// Sender/receiver fleets (throughput, sweep; latency's probes and background load).
    Fleets(Vec<FleetShare>),
    /// Closed-loop pairs (pingpong).
    Loops(LoopShare),
    /// Connections of a storm (connect).
    Storm(ConnectionShare),
    /// Connections opened and held (idle).
    Idle(ConnectionShare),
}

/// A worker's part of one fleet.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct FleetShare {
    /// Pairs in this part.
    pub pairs: u32,
    /// The number of its first pair in the whole fleet.
    pub first_pair: u32,
    /// Whether the fleet echoes probes (latency's).
    pub echo: bool,
}

/// A worker's part of the closed loops.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct LoopShare {
    /// Pairs in this part.
    pub pairs: u32,
    /// The number of its first pair.
    pub first_pair: u32,
    /// Packet size in bytes.
    pub size: usize,
    /// Packets each pair keeps outstanding.
    pub in_flight: u32,
    /// The client each side runs on.
    pub client: ClientKind,
}

/// What the parent asks, after the job.
#[derive(Debug, Serialize, Deserialize)]
pub enum Command {
    /// Run a window on every fleet (one spec each) or on the closed loops (the first spec's
    /// run, warm-up and duration), from `start_unix_ns`.
    Window {
        /// The common start, Unix nanoseconds.
        start_unix_ns: u64,
        /// One per fleet.
        specs: Vec<WindowSpec>,
    },
    /// Connect-mode storm from `start_unix_ns`, stopping at `max_duration`.
    Storm {
        /// The common start, Unix nanoseconds.
        start_unix_ns: u64,
        /// When to stop even if connections remain.
        max_duration: Duration,
    },
    /// Idle mode: open the connections from `start_unix_ns` and hold them.
    Open {
        /// The common start, Unix nanoseconds.
        start_unix_ns: u64,
    },
    /// Idle mode: close the connections held.
    Close,
}

/// A worker's answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    /// Connected (or, for connections, keys made) and waiting for commands.
    Ready,
    /// One per fleet.
    Windows(Vec<WindowOut>),
    /// One per closed loop, and the worker's CPU over the measured window.
    Loops {
        /// Each pair's window.
        results: Vec<LoopOut>,
        /// The worker's CPU over it.
        bench_cpu_s: Option<f64>,
    },
    /// The worker's part of a storm.
    Storm(StormOut),
    /// The worker's connections are open.
    Opened(OpenOut),
    /// The worker's connections are closed.
    Closed,
}

/// One fleet's window, as a worker ran it.
#[derive(Debug, Serialize, Deserialize)]
pub struct WindowOut {
    /// The worker's pairs' figures and its own CPU.
    pub run: LoadRun,
    /// Probe round trips.
    pub rtt: HistWire,
}

/// One closed loop's window, as a worker ran it ([`LoopResult`] between processes).
#[derive(Debug, Serialize, Deserialize)]
pub struct LoopOut {
    /// The pair's number.
    pub pair: u32,
    /// Packets sent in the window.
    pub sent: u64,
    /// Of those, packets that came back.
    pub round_trips: u64,
    /// Packets given up.
    pub lost: u64,
    /// Round trips.
    pub rtt: HistWire,
    /// What stopped the pair, if anything did.
    pub error: Option<String>,
}

impl LoopOut {
    /// Back into a result with a histogram.
    pub fn into_result(self) -> LoopResult {
        let mut rtt = new_histogram();
        self.rtt.add_to(&mut rtt);
        LoopResult {
            pair: self.pair,
            sent: self.sent,
            round_trips: self.round_trips,
            lost: self.lost,
            rtt,
            error: self.error,
        }
    }
}

/// A worker's part of a storm.
#[derive(Debug, Serialize, Deserialize)]
pub struct StormOut {
    /// Connections tried.
    pub attempted: u64,
    /// Handshake times of those that succeeded.
    pub handshakes: HistWire,
    /// Failures by kind.
    pub failures: BTreeMap<String, u64>,
    /// From the common start to the last completion.
    pub elapsed_s: f64,
    /// The worker's CPU over the storm.
    pub bench_cpu_s: Option<f64>,
}

/// A worker's part of an idle run's opening.
#[derive(Debug, Serialize, Deserialize)]
pub struct OpenOut {
    /// Connections open.
    pub opened: u64,
    /// Failures by kind.
    pub failures: BTreeMap<String, u64>,
    /// How long opening them took.
    pub open_s: f64,
}

/// A worker process's whole life: its job first (read from stdin before any runtime exists,
/// since the job says how many threads the runtime gets), then [`run`] on that runtime.
pub fn run_process() -> Result<(), WorkerError> {
    let job: Job = Parent::read_job()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(job.threads.max(1))
        .enable_all()
        .thread_name(BENCH_THREAD_NAME)
        .build()
        .map_err(WorkerError::Runtime)?;
    let out = rt.block_on(run(job));
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(out?)
}

/// Runs a worker: the job has been read; this connects, answers `Ready`, then serves
/// commands until the parent closes stdin. Errors go back to the parent as answers.
pub async fn run(job: Job) -> Result<(), ProcsError> {
    let mut parent = Parent::listen()?;
    let setup = async {
        let target = Target::new(&job.target, None)?;
        let clock = Clock::start();
        let connections = match &job.work {
            Work::Fleets(shares) => shares.iter().map(|s| s.pairs as usize * 2).sum(),
            Work::Loops(s) => s.pairs as usize * 2,
            Work::Storm(s) => s.concurrency as usize,
            Work::Idle(s) => s.count,
        };
        crate::target::check_fd_budget(connections, false)?;
        let held = match job.work {
            Work::Fleets(shares) => {
                let mut fleets = Vec::new();
                for s in shares {
                    fleets.push(Fleet::connect(&target, s.pairs, s.first_pair, s.echo).await?);
                }
                Held::Fleets(fleets)
            }
            Work::Loops(s) => {
                let spec = LoopSpec {
                    size: s.size,
                    in_flight: s.in_flight,
                    client: s.client,
                };
                Held::Loops(LoopPairs::connect(&target, spec, s.first_pair, s.pairs, clock).await?)
            }
            Work::Storm(s) => Held::Storm(Some(Storm::prepare(&target, s)), s),
            Work::Idle(s) => Held::Idle(Some(Opening::prepare(&target, s)), None, s),
        };
        Ok::<_, WorkerError>((target, clock, held))
    };
    let (target, clock, mut held) = match setup.await {
        Ok(s) => s,
        Err(e) => {
            Parent::answer::<Answer>(&Err(RemoteError(error_text(&e))))?;
            return Ok(());
        }
    };
    Parent::answer(&Ok(Answer::Ready))?;
    while let Some(command) = parent.recv::<Command>().await? {
        let answer = serve(&target, clock, &mut held, command)
            .await
            .map_err(|e| RemoteError(error_text(&e)));
        Parent::answer(&answer)?;
    }
    Ok(())
}

/// What a worker holds between commands.
#[derive(Debug)]
enum Held {
    Fleets(Vec<Fleet>),
    Loops(LoopPairs),
    /// The next storm, its keys made ahead so that making them is not timed.
    Storm(Option<Storm>, ConnectionShare),
    /// The next opening (keys made ahead), and the connections held between Open and Close.
    Idle(
        Option<Opening>,
        Option<Vec<derp_client::Client>>,
        ConnectionShare,
    ),
}

async fn serve(
    target: &Target,
    clock: Clock,
    held: &mut Held,
    command: Command,
) -> Result<Answer, WorkerError> {
    match (held, command) {
        (
            Held::Fleets(fleets),
            Command::Window {
                start_unix_ns,
                specs,
            },
        ) => {
            let start = instant_at(start_unix_ns);
            let runs = run_fleets(fleets, &specs, start, clock, target).await?;
            Ok(Answer::Windows(
                runs.into_iter()
                    .map(|(run, rtt)| WindowOut {
                        run,
                        rtt: HistWire::of(&rtt),
                    })
                    .collect(),
            ))
        }
        (
            Held::Loops(pairs),
            Command::Window {
                start_unix_ns,
                specs,
            },
        ) => {
            let spec = specs.first().ok_or(WorkerError::NoSpec)?;
            let start = instant_at(start_unix_ns);
            let window = LoopWindow {
                run: spec.run,
                start,
                warm_end: start + spec.warmup,
                end: start + spec.warmup + spec.duration,
            };
            let measure = async {
                tokio::time::sleep_until(window.warm_end).await;
                let before = target.bench_cpu();
                tokio::time::sleep_until(window.end).await;
                before
                    .zip(target.bench_cpu())
                    .map(|(b, a)| a.since(b).total())
            };
            let (results, bench_cpu_s) = tokio::join!(pairs.run_window(window), measure);
            Ok(Answer::Loops {
                results: results
                    .into_iter()
                    .map(|r| LoopOut {
                        pair: r.pair,
                        sent: r.sent,
                        round_trips: r.round_trips,
                        lost: r.lost,
                        rtt: HistWire::of(&r.rtt),
                        error: r.error,
                    })
                    .collect(),
                bench_cpu_s,
            })
        }
        (
            Held::Storm(next, share),
            Command::Storm {
                start_unix_ns,
                max_duration,
            },
        ) => {
            let storm = match next.take() {
                Some(s) => s,
                None => Storm::prepare(target, *share),
            };
            let start = instant_at(start_unix_ns);
            tokio::time::sleep_until(start).await;
            let before = target.bench_cpu();
            let done = storm.run(start, max_duration).await;
            let bench_cpu_s = before
                .zip(target.bench_cpu())
                .map(|(b, a)| a.since(b).total());
            // The next run's keys, made before answering: the parent starts the next run
            // only when every process has answered.
            *next = Some(Storm::prepare(target, *share));
            Ok(Answer::Storm(StormOut {
                attempted: done.attempted,
                handshakes: HistWire::of(&done.handshakes),
                failures: done.failures,
                elapsed_s: done.end.saturating_duration_since(start).as_secs_f64(),
                bench_cpu_s,
            }))
        }
        (Held::Idle(next, open @ None, share), Command::Open { start_unix_ns }) => {
            let opening = match next.take() {
                Some(o) => o,
                None => Opening::prepare(target, *share),
            };
            tokio::time::sleep_until(instant_at(start_unix_ns)).await;
            let started = Instant::now();
            let (clients, failures) = opening.open().await;
            let out = OpenOut {
                opened: clients.len() as u64,
                failures,
                open_s: started.elapsed().as_secs_f64(),
            };
            *open = Some(clients);
            Ok(Answer::Opened(out))
        }
        (Held::Idle(next, open @ Some(_), share), Command::Close) => {
            *open = None;
            *next = Some(Opening::prepare(target, *share));
            Ok(Answer::Closed)
        }
        (_, command) => Err(WorkerError::Misfit(format!("{command:?}"))),
    }
}

/// Why a worker, or the parent's side of one, failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Talking to the other processes.
    #[error(transparent)]
    Procs(#[from] ProcsError),
    /// The worker's target.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The worker's fleets.
    #[error(transparent)]
    Fleet(#[from] FleetError),
    /// The worker's closed loops.
    #[error(transparent)]
    Loop(#[from] LoopError),
    /// The worker's runtime.
    #[error("starting the worker's runtime")]
    Runtime(#[source] std::io::Error),
    /// A worker answered its job with something else than `Ready`.
    #[error("a bench process answered its job with {0}")]
    Unexpected(String),
    /// A window command without a spec.
    #[error("a window without a spec")]
    NoSpec,
    /// A command for another kind of worker.
    #[error("{0} does not fit this worker's job")]
    Misfit(String),
}
