//! derp-bench: a load-test client for DERP relays (derpd, Tailscale's derper, or any other).
//!
//! What it does: measures a relay from the outside over its DERP URL (plain, WebSocket, TLS
//! or QUIC), in seven modes (throughput, latency, pingpong, connect, idle, sweep, and upgrade: what
//! clients feel of a server's upgrade in place), with paced
//! senders, per-pair loss counting, timestamped packets, warm-up and repeated runs, in one
//! process or spread over several (`--procs`). It reports its own CPU use next to the
//! server's and warns when it, rather than the server, is the likely bottleneck. With
//! `--spawn-server` it starts an in-process derpd relay to test; `floor-relay` runs the least
//! relay there is, to measure against. This crate is the command line and the modes; the
//! engines are derp-load's.
//!
//! What it does not do: generate load from several machines (run one bench per machine
//! for that), send anything anywhere but the URLs it is given, or soak a relay (that is
//! `derp-soak`).

mod cli;
mod modes;
mod plot;
mod progress;
mod report;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use derp_load::{Outcome, Tool};

use crate::cli::{Cli, Mode, OutputArgs};

const TOOL: Tool = Tool {
    name: "derp-bench",
    version: env!("CARGO_PKG_VERSION"),
};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        // Only when asked: the clients' own diagnostics (QUIC congestion decisions, for
        // one), on stderr beside the report.
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let (result, who) = match &cli.mode {
        Mode::Worker => (
            derp_load::worker::run_process().map_err(Into::into),
            "derp-bench worker",
        ),
        Mode::FloorRelay(args) => (run_floor_relay(&cli, args), "derp-bench"),
        _ => (measure(&cli), "derp-bench"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{who}: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the mode and prints what it found; fails when the mode's own checks failed.
fn measure(cli: &Cli) -> anyhow::Result<()> {
    check_plot(&cli.mode, &cli.output)?;
    if let Mode::Soak { .. } = cli.mode {
        bail!("the soak test is its own program now: run `derp-soak` with the same flags");
    }
    let outcome: Outcome = derp_load::ctx::run(
        TOOL,
        &cli.target,
        cli.procs,
        time_bound(&cli.mode),
        async |ctx| match &cli.mode {
            Mode::Throughput(a) => modes::throughput::run(ctx, &cli.target, a).await,
            Mode::Latency(a) => modes::latency::run(ctx, &cli.target, a, &cli.output).await,
            Mode::Pingpong(a) => modes::pingpong::run(ctx, &cli.target, a).await,
            Mode::Connect(a) => modes::connect::run(ctx, &cli.target, a).await,
            Mode::Idle(a) => modes::idle::run(ctx, &cli.target, a).await,
            Mode::Sweep(a) => modes::sweep::run(ctx, &cli.target, a, &cli.output).await,
            Mode::Upgrade(a) => modes::upgrade::run(ctx, &cli.target, a).await,
            Mode::Soak { .. } | Mode::FloorRelay(_) | Mode::Worker => bail!("not a measurement"),
        },
    )?;
    outcome.print(cli.output.json, TOOL)?;
    if let Some(failure) = outcome.failure {
        bail!("{failure}");
    }
    Ok(())
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
    Ok(derp_load::floor::run(args.listen)?)
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
        Mode::Connect(a) => (a.max_duration + PER_WINDOW) * a.conns.runs,
        Mode::Idle(a) => (a.hold + Duration::from_secs(120)) * a.conns.runs,
        Mode::Sweep(a) => windows(a.max_steps, a.load.warmup, a.step_duration),
        // Opening the connections, the phases, and the drain.
        Mode::Upgrade(a) => {
            a.warmup + a.baseline + a.upgrade_timeout + a.after + Duration::from_secs(120)
        }
        Mode::Soak { .. } | Mode::FloorRelay(_) | Mode::Worker => Duration::ZERO,
    };
    expected * 2 + SLACK
}
