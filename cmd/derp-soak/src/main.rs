//! derp-soak: a long correctness run against a DERP relay, not a measurement.
//!
//! What it does: connects many clients to one relay for a long time, every kind at once
//! (closed-loop pairs that must lose nothing, floods into slow readers, churn, hostile
//! connections, idle pingers), then holds the relay to a strict account of every packet,
//! connection, descriptor and byte of memory, and exits non-zero when any check fails. It
//! takes derp-bench's target flags (`--url`, `--metrics-url`, `--server-pid`,
//! `--spawn-server`, ...), and its JSON document has derp-bench's envelope.
//!
//! What it does not do: measure speed (that is derp-bench's), spread its clients over
//! several processes, or speak QUIC (its hostile clients and slow readers need TCP).

mod account;
mod client;
mod hostile;
mod report;
mod roles;
mod soak;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Parser};
use derp_load::Tool;
use derp_load::args::{MAX_CONNECTIONS, TargetArgs, parse_duration};

const TOOL: Tool = Tool {
    name: "derp-soak",
    version: env!("CARGO_PKG_VERSION"),
};

/// Soak test for DERP relays: many clients of every kind for a long time, then a strict
/// account. Exits non-zero when any check fails. Needs --metrics-url and --server-pid (or
/// --spawn-server).
#[derive(Debug, Parser)]
#[command(name = "derp-soak", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    target: TargetArgs,

    /// Print one JSON document on stdout instead of the report (schema: docs/derp-soak.md).
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    soak: SoakArgs,
}

/// What the soak runs: how many clients, for how long, how hard, and the bounds it holds
/// the relay to.
#[derive(Debug, Args)]
pub(crate) struct SoakArgs {
    /// Clients: 40% closed-loop pairs, 10% flood pairs (half with slow readers), 25% churn,
    /// 5% hostile, the rest idle.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(20..=MAX_CONNECTIONS))]
    pub(crate) clients: u32,

    /// How long the load runs.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub(crate) duration: Duration,

    /// Packets per second each closed-loop pair sends (each is echoed back).
    #[arg(long, default_value_t = 10.0)]
    pub(crate) closed_rate: f64,

    /// Packets per second each flood sender offers, open loop (1200-byte packets; 8 KiB to
    /// slow readers).
    #[arg(long, default_value_t = 100.0)]
    pub(crate) flood_rate: f64,

    /// Bound on the server's peak resident memory, MiB.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_rss_mib: u64,

    /// Bound on how much more resident memory the server holds after every client has left
    /// than before the run, MiB (the allocator keeps some; a leak keeps growing).
    #[arg(long, default_value_t = 64)]
    pub(crate) max_rss_after_mib: u64,

    /// How long to wait at the end for clients to leave and the server to settle.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) settle: Duration,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("derp-soak: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let args = &cli.soak;
    // Connecting and winding down thousands of clients, then settling; a hung server
    // cannot keep the run going forever.
    let bound =
        (args.duration + args.settle * 2 + Duration::from_secs(120)) * 2 + Duration::from_secs(60);
    let outcome = derp_load::ctx::run(TOOL, &cli.target, 1, bound, async |ctx| {
        soak::run(ctx, &cli.target, args, cli.json).await
    })?;
    outcome.print(cli.json, TOOL)?;
    if let Some(failure) = outcome.failure {
        bail!("{failure}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn target_flags_and_soak_flags_in_any_order() {
        let cli = Cli::try_parse_from([
            "derp-soak",
            "--clients",
            "40",
            "--spawn-server",
            "--json",
            "--duration",
            "3s",
        ])
        .unwrap();
        assert!(cli.target.spawn_server && cli.json);
        assert_eq!(cli.soak.clients, 40);
        assert_eq!(cli.soak.duration, Duration::from_secs(3));
        assert_eq!((cli.soak.closed_rate, cli.soak.max_rss_mib), (10.0, 256));
        assert!(Cli::try_parse_from(["derp-soak", "--clients", "19"]).is_err());
    }
}
