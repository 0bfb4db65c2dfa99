//! Command-line flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use derp_load::args::{MAX_CONNECTIONS, TargetArgs, parse_duration};
use derp_load::closed_loop::ClientKind;

/// Load-test client for DERP relays (derpd, Tailscale's derper or any other).
///
/// Every run targets only the given URL (or the relay started with --spawn-server), is
/// bounded in time and connections, and exits non-zero with a message when the server is
/// unreachable or refuses the handshake.
#[derive(Debug, Parser)]
#[command(name = "derp-bench", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) target: TargetArgs,
    #[command(flatten)]
    pub(crate) output: OutputArgs,
    /// Spread the load over this many bench processes (throughput, latency, pingpong,
    /// connect, idle, sweep): each gets a share of the pairs or connections, their windows
    /// open together, and their figures are merged into one result (CPU summed, histograms
    /// merged), so the generator is not what runs out first.
    #[arg(long, global = true, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_PROCS))]
    pub(crate) procs: u32,
    #[command(subcommand)]
    pub(crate) mode: Mode,
}

/// How results are shown.
#[derive(Debug, Args)]
pub(crate) struct OutputArgs {
    /// Print one JSON document on stdout instead of the table (schema: docs/derp-bench.md).
    #[arg(long, global = true)]
    pub(crate) json: bool,

    /// Draw an SVG: the sweep curve (sweep) or the latency distribution (latency).
    #[arg(long, global = true, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
}

/// The measurement to run.
#[derive(Debug, Subcommand)]
pub(crate) enum Mode {
    /// Sender/receiver pairs through the relay: delivered packets/s and Mbit/s, loss per pair.
    Throughput(ThroughputArgs),
    /// Round trips A -> relay -> B -> relay -> A with a timestamp in each packet, optionally
    /// under background load.
    Latency(LatencyArgs),
    /// Closed loop: A sends a packet to B through the relay, B echoes it at once, A times the
    /// round trip and sends the next, with --in-flight packets outstanding. Round-trip
    /// percentiles, round trips per second and server CPU per round trip.
    Pingpong(PingpongArgs),
    /// Connection storm: handshakes per second and failures at a given concurrency.
    Connect(ConnectArgs),
    /// Hold many idle connections and report the server's memory per connection.
    Idle(IdleArgs),
    /// Step the offered load up until the relay stops delivering it.
    Sweep(SweepArgs),
    /// Pairs carrying a steady trickle of timestamped packets through the server's upgrade
    /// in place (SIGUSR2 to --upgrade-pid): how long packets were held, per packet and per
    /// connection, beside the delay before it; and any packet lost, repeated or reordered and
    /// any connection that broke (a Restarting or health frame, EOF, reset), which fail the
    /// run.
    Upgrade(UpgradeArgs),
    /// The soak test is its own program now: `derp-soak`, with the same flags.
    #[command(hide = true, disable_help_flag = true)]
    Soak {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Not a measurement: a minimal relay to measure against. It speaks just enough DERP for
    /// derp-bench's clients (plain http://, no TLS) and copies each packet from one socket to
    /// the other with one read and one write, so a round trip through it is the floor of what
    /// a relay on this machine can do. Prints its URL, then relays until stopped.
    FloorRelay(FloorRelayArgs),
    /// One of the processes of a --procs run; started by derp-bench itself.
    #[command(hide = true)]
    Worker,
}

#[derive(Debug, Args)]
pub(crate) struct FloorRelayArgs {
    /// Address to listen on; port 0 lets the kernel choose (the URL printed says which).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
}

/// Load shape shared by throughput and sweep.
#[derive(Debug, Args, Clone)]
pub(crate) struct LoadArgs {
    /// Sender/receiver pairs (two connections each).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=MAX_PAIRS))]
    pub(crate) pairs: u32,

    /// Packet size in bytes (the DERP payload). 570 is the mean size seen in production.
    #[arg(long, default_value_t = 1400, value_parser = clap::value_parser!(u32).range(32..=65536))]
    pub(crate) size: u32,

    /// Warm-up before each measured window (not counted).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) warmup: Duration,
}

#[derive(Debug, Args)]
pub(crate) struct ThroughputArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,

    /// Offered rate per pair in packets/s, paced by a token bucket. Without it (and without
    /// --mbps) senders are unpaced: they write as fast as TCP lets them.
    #[arg(long, conflicts_with = "mbps")]
    pub(crate) rate: Option<f64>,

    /// Offered load in Mbit/s of payload for all pairs together, paced.
    #[arg(long)]
    pub(crate) mbps: Option<f64>,

    /// Measured window of each run.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) duration: Duration,

    /// Repeat the measurement; the summary gives medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_RUNS))]
    pub(crate) runs: u32,

    /// Test knob: receivers stop reading this long into the measured window, simulating a
    /// stuck client (loss must then show up).
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub(crate) stop_receivers_after: Option<Duration>,
}

#[derive(Debug, Args)]
pub(crate) struct LatencyArgs {
    /// Echo pairs carrying timestamped probes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) probes: u32,

    /// Probes per second per echo pair (open loop, so a slow server cannot hide its stalls).
    #[arg(long, default_value_t = 1000.0)]
    pub(crate) probe_rate: f64,

    /// Probe size in bytes.
    #[arg(long, default_value_t = 1400, value_parser = clap::value_parser!(u32).range(32..=65536))]
    pub(crate) size: u32,

    /// Background load pairs running at the same time (0: none).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=MAX_PAIRS))]
    pub(crate) load_pairs: u32,

    /// Background load in Mbit/s for all load pairs together (unpaced when omitted).
    #[arg(long)]
    pub(crate) load_mbps: Option<f64>,

    /// Warm-up before each measured window.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) warmup: Duration,

    /// Measured window of each run.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) duration: Duration,

    /// Repeat the measurement; the summary gives medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_RUNS))]
    pub(crate) runs: u32,
}

#[derive(Debug, Args)]
pub(crate) struct PingpongArgs {
    /// Echo pairs, each its own closed loop (two connections and two threads each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=128))]
    pub(crate) pairs: u32,

    /// Packets each pair keeps outstanding: 1 is strict ping-pong.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) in_flight: u32,

    /// Packet size in bytes (the DERP payload).
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(32..=65536))]
    pub(crate) size: u32,

    /// The client each side uses: `tokio` (derp-client on a current-thread runtime per
    /// side; every URL scheme) or `blocking` (a blocking socket speaking DERP directly; plain
    /// http:// only; the leanest client there is).
    #[arg(long, value_enum, default_value_t = ClientKind::Tokio)]
    pub(crate) client: ClientKind,

    /// Warm-up before each measured window.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) warmup: Duration,

    /// Measured window of each run.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) duration: Duration,

    /// Repeat the measurement; the summary gives medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_RUNS))]
    pub(crate) runs: u32,
}

/// Connections opened for their own sake, shared by connect and idle.
#[derive(Debug, Args)]
pub(crate) struct ConnectionArgs {
    /// Connections to open.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=MAX_CONNECTIONS))]
    pub(crate) connections: u32,

    /// Handshakes in flight at once.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) concurrency: u32,

    /// Repeat the run; the summary gives medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_RUNS))]
    pub(crate) runs: u32,
}

/// Each connection dials, upgrades, completes the handshake and closes.
#[derive(Debug, Args)]
pub(crate) struct ConnectArgs {
    #[command(flatten)]
    pub(crate) conns: ConnectionArgs,

    /// Stop a run after this long even if connections remain.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) max_duration: Duration,
}

/// The connections are opened, then held idle.
#[derive(Debug, Args)]
#[command(mut_arg("concurrency", |a| a.default_value("100")))]
pub(crate) struct IdleArgs {
    #[command(flatten)]
    pub(crate) conns: ConnectionArgs,

    /// How long to hold the connections before measuring.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) hold: Duration,
}

#[derive(Debug, Args)]
pub(crate) struct SweepArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,

    /// Offered load of the first step, Mbit/s of payload for all pairs together.
    #[arg(long, default_value_t = 100.0)]
    pub(crate) start_mbps: f64,

    /// Each step offers this many times the previous one.
    #[arg(long, default_value_t = 1.5)]
    pub(crate) factor: f64,

    /// Add this many Mbit/s per step instead of multiplying.
    #[arg(long)]
    pub(crate) step_mbps: Option<f64>,

    /// Measured window of each step.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) step_duration: Duration,

    /// A step is past saturation when this share of the offered load is not delivered.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) loss_threshold: f64,

    /// Steps to run past the first one over the threshold, to show the behaviour beyond it.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=10))]
    pub(crate) steps_past: u32,

    /// Upper bound on the number of steps.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub(crate) max_steps: u32,
}

/// Connections carrying traffic through an upgrade in place.
#[derive(Debug, Args)]
pub(crate) struct UpgradeArgs {
    /// The server process to upgrade: SIGUSR2 goes to it after the warm-up and the
    /// baseline, and the run goes on until it has exited (its successor serving), then for
    /// --after. It must be the process serving --url, started from a path its successor can
    /// be started from.
    #[arg(long, value_name = "PID")]
    pub(crate) upgrade_pid: u32,

    /// Sender/receiver pairs (two connections each).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=MAX_PAIRS))]
    pub(crate) pairs: u32,

    /// Each pair sends one packet this often, the pairs' sends spread evenly over it. A
    /// connection's own hold is resolved to this; the largest delay of all packets to this
    /// over the pair count. Default: 40 µs per pair (about 25,000 packets/s in all), at
    /// least 1 ms.
    #[arg(long, value_parser = parse_duration)]
    pub(crate) interval: Option<Duration>,

    /// Packet size in bytes (the DERP payload).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(32..=65536))]
    pub(crate) size: u32,

    /// Connections opening at once.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) concurrency: u32,

    /// Traffic before anything is measured. Long, because a relay that has just taken
    /// thousands of connections is slow for its first seconds (at 10,000 connections on
    /// two CPUs, packets of the first seconds waited up to 3.7 s).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) warmup: Duration,

    /// Traffic measured before the signal: the baseline delay.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) baseline: Duration,

    /// Traffic measured after the old process has exited.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) after: Duration,

    /// How long the old process may take to exit after the signal; past it the run fails.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) upgrade_timeout: Duration,

    /// Report lost, repeated or reordered packets and broken connections without failing
    /// the run (to measure an upgrade that is known to break connections).
    #[arg(long)]
    pub(crate) allow_broken: bool,
}

impl UpgradeArgs {
    /// `--interval`, or the default for the pair count.
    pub(crate) fn interval(&self) -> Duration {
        self.interval.unwrap_or_else(|| {
            (Duration::from_micros(40) * self.pairs).max(Duration::from_millis(1))
        })
    }
}

/// Upper bounds that keep every run finite.
pub(crate) const MAX_PAIRS: i64 = 5000;
pub(crate) const MAX_RUNS: i64 = 20;
pub(crate) const MAX_PROCS: i64 = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn globals_after_the_subcommand() {
        let cli = Cli::try_parse_from([
            "derp-bench",
            "throughput",
            "--spawn-server",
            "--json",
            "--pairs",
            "2",
            "--size",
            "570",
        ])
        .unwrap();
        assert!(cli.target.spawn_server && cli.output.json);
        let Mode::Throughput(t) = cli.mode else {
            panic!("wrong mode")
        };
        assert_eq!((t.load.pairs, t.load.size), (2, 570));
        assert!(
            Cli::try_parse_from(["derp-bench", "idle", "--url", "http://x", "--spawn-server"])
                .is_err()
        );
        assert!(Cli::try_parse_from(["derp-bench", "throughput", "--size", "8"]).is_err());
    }

    #[test]
    fn connect_and_idle_share_their_flags_but_not_the_concurrency_default() {
        let Mode::Connect(c) = Cli::try_parse_from(["derp-bench", "connect"]).unwrap().mode else {
            panic!("wrong mode")
        };
        assert_eq!(
            (c.conns.connections, c.conns.concurrency, c.conns.runs),
            (1000, 50, 1)
        );
        let Mode::Idle(i) = Cli::try_parse_from(["derp-bench", "idle", "--runs", "3"])
            .unwrap()
            .mode
        else {
            panic!("wrong mode")
        };
        assert_eq!(
            (i.conns.connections, i.conns.concurrency, i.conns.runs),
            (1000, 100, 3)
        );
        let Mode::Idle(i) = Cli::try_parse_from(["derp-bench", "idle", "--concurrency", "7"])
            .unwrap()
            .mode
        else {
            panic!("wrong mode")
        };
        assert_eq!(i.conns.concurrency, 7);
    }

    #[test]
    fn upgrade_needs_a_pid_and_spaces_its_packets_by_the_pair_count() {
        assert!(Cli::try_parse_from(["derp-bench", "upgrade"]).is_err());
        let interval = |more: &[&str]| {
            let mut args = vec!["derp-bench", "upgrade", "--upgrade-pid", "7"];
            args.extend_from_slice(more);
            let Mode::Upgrade(u) = Cli::try_parse_from(args).unwrap().mode else {
                panic!("wrong mode")
            };
            u.interval()
        };
        assert_eq!(interval(&[]), Duration::from_millis(20));
        assert_eq!(interval(&["--pairs", "4500"]), Duration::from_millis(180));
        assert_eq!(interval(&["--pairs", "3"]), Duration::from_millis(1));
        assert_eq!(interval(&["--interval", "5ms"]), Duration::from_millis(5));
    }
}
