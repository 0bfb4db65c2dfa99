//! Command-line flags. Long names follow Tailscale derper's where the feature is the same, so
//! an operator's unit file carries over.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};

use crate::duration::parse_duration;

/// DERP relay server, wire-compatible with Tailscale's derper.
#[derive(Debug, Parser)]
#[command(name = "derpd", version, about, long_about = None, args_override_self = true)]
pub(crate) struct Cli {
    /// Development mode: plain HTTP on 127.0.0.1:3340 (unless --addr is given) with a fresh
    /// key and no config file.
    #[arg(long)]
    pub(crate) dev: bool,

    /// Listen address: ":port", "ip:port" or "[ip]:port". TLS is served when the port is 443
    /// or --certmode is manual; otherwise plain HTTP.
    #[arg(short = 'a', long = "addr", default_value = ":443")]
    pub(crate) addr: String,

    /// Config file holding the server's private key, in derper's JSON format. Created with
    /// mode 0600 when missing. Defaults to /var/lib/derper/derper.key when running as root.
    #[arg(short = 'c', long = "config")]
    pub(crate) config: Option<PathBuf>,

    /// Home page: "" for the default page, "blank" for an empty page, or an http(s):// URL to
    /// redirect to.
    #[arg(long, default_value = "")]
    pub(crate) home: String,

    /// Serve DERP on /derp. With --derp=false, /derp answers 404; STUN and the probe
    /// endpoints keep working.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    pub(crate) derp: bool,

    /// Run the STUN server.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    pub(crate) stun: bool,

    /// UDP port for STUN, on the same IP as --addr.
    #[arg(long, default_value_t = 3478)]
    pub(crate) stun_port: u16,

    /// UDP port for DERP over QUIC, on the same IP as --addr; TLS only (QUIC needs the
    /// certificate). Default: the TLS listener's port (443/udp), except with --dev, where
    /// QUIC is off unless this is given. -1 disables QUIC; 0 picks a free port.
    #[arg(long, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1..=65535))]
    pub(crate) quic_port: Option<i32>,

    /// Congestion controller of DERP over QUIC, for what the server sends: loss-filter
    /// (CUBIC that lets random loss pass; see docs/protocol.md), cubic, bbr (quinn's,
    /// experimental), or none (no congestion control: for benchmarks only, never deploy it).
    #[arg(long, default_value = "loss-filter")]
    pub(crate) quic_congestion: derp_server::quic::Congestion,

    /// Also answer generic RFC 5389/8489 binding requests, not only Tailscale's.
    #[arg(long)]
    pub(crate) stun_answer_generic: bool,

    /// Deadline for each write to a client (e.g. "2s", "500ms"); 0 disables it.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) tcp_write_timeout: Duration,

    /// Depth of each per-client send queue (disco and other).
    #[arg(long, default_value_t = derp_server::DEFAULT_SEND_QUEUE_DEPTH as u32,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) send_queue_depth: u32,

    /// Most destinations each client's lookup cache (LRU) holds; 0 uses the default (100),
    /// -1 disables the cache.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..))]
    pub(crate) peer_cache_max_entries: i64,

    /// How long an unused lookup-cache entry is kept (trimmed when the client pings);
    /// 0 uses the default (10m).
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    pub(crate) peer_cache_max_idle: Duration,

    /// Look destinations up in the lock-free mirror of the client map first. With
    /// --peer-mirror=false every lookup goes to the per-client cache, then the locked map.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    pub(crate) peer_mirror: bool,

    /// Networks (CIDR) besides loopback allowed to read /debug/varz on the main listener.
    /// Repeat or comma-separate.
    #[arg(long, value_delimiter = ',')]
    pub(crate) debug_allow_cidr: Vec<derp_server::IpCidr>,

    /// Also serve Prometheus metrics at /metrics on this address (e.g. 127.0.0.1:9090),
    /// without access control.
    #[arg(long)]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,

    /// Fold per-packet counters into the metrics. Off only to measure what counting costs.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true", hide = true)]
    pub(crate) packet_metrics: bool,

    /// File holding the 64-hex-digit mesh pre-shared key (surrounding whitespace is
    /// trimmed). Default, as derper's: /home/derp/keys/derp-mesh.key or
    /// $HOME/keys/derp-mesh.key, whichever exists. In --dev mode the key comes only from
    /// the TAILSCALE_DERPER_MESH_KEY environment variable.
    #[arg(long)]
    pub(crate) mesh_psk_file: Option<PathBuf>,

    /// Siblings of this node's region to mesh with, comma separated. "host" dials
    /// https://host/derp; "host/dialhost" connects to dialhost instead, keeping host as the
    /// URL and TLS name; a full http:// or https:// URL is used as is, and quic://host:port
    /// links over DERP over QUIC. This node's own name may be listed (it is skipped). Needs
    /// a mesh key.
    #[arg(long, default_value = "")]
    pub(crate) mesh_with: String,

    /// PEM file of CA certificates trusted for https mesh links, besides the system's
    /// store (which honours SSL_CERT_FILE and SSL_CERT_DIR).
    #[arg(long)]
    pub(crate) mesh_ca_file: Option<PathBuf>,

    /// How often each mesh link pings its sibling, and how long the pong may take: a
    /// sibling whose host died or was cut off without closing its connections is dropped
    /// from the region within twice this. 0 turns the pings off (the link then relies on the
    /// sibling's keepalives and a 120 s read timeout, as derper's mesh does).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) mesh_ping_interval: Duration,

    /// On SIGTERM or SIGINT, how long queued packets may take to reach their clients before
    /// every connection is closed. A second signal exits at once.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) drain_timeout: Duration,

    /// The Restarting frame sent to every client on shutdown: reconnect after this long.
    #[arg(long, default_value = "2s", value_parser = parse_restart_duration)]
    pub(crate) restart_reconnect_in: Duration,

    /// The Restarting frame sent to every client on shutdown: keep trying for this long.
    #[arg(long, default_value = "60s", value_parser = parse_restart_duration)]
    pub(crate) restart_try_for: Duration,

    /// Worker threads that run connections; 0 means one per CPU. Most of a relay's CPU time
    /// is the kernel's, in system calls on these threads and in network interrupts; see
    /// docs/operations.md for how many to run.
    #[arg(long, default_value_t = 0)]
    pub(crate) workers: usize,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,

    /// Check the configuration and exit: parse the flags, read the key file, certificates,
    /// mesh key and CA files, print what would run, and exit 1 on any error. Binds no socket,
    /// writes no file and contacts nobody.
    #[arg(long)]
    pub(crate) check: bool,

    #[command(flatten)]
    pub(crate) tls: crate::tls_setup::TlsArgs,

    #[command(flatten)]
    pub(crate) limits: crate::limits::LimitArgs,
}

/// derper's Go flags take long names after one dash (`-hostname`): rewrites those to two
/// dashes, so a derper command line runs unchanged. Only names of derpd's own long flags are
/// rewritten, so short flags (`-a`, `-c`) and values such as `-1` pass as they are.
pub(crate) fn derper_style_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    use clap::CommandFactory;
    let command = Cli::command();
    let long: Vec<&str> = command
        .get_arguments()
        .filter_map(|a| a.get_long())
        .collect();
    let mut out: Vec<std::ffi::OsString> = Vec::new();
    for (i, arg) in args.into_iter().enumerate() {
        let rewritten = arg.to_str().and_then(|text| {
            let body = text.strip_prefix('-').filter(|b| !b.starts_with('-'))?;
            let name = body.split_once('=').map_or(body, |(n, _)| n);
            (i > 0 && name.len() > 1 && long.contains(&name)).then(|| format!("-{text}").into())
        });
        out.push(rewritten.unwrap_or(arg));
    }
    out
}

/// A duration the Restarting frame can carry: whole milliseconds in 32 bits.
fn parse_restart_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.as_millis() > u128::from(u32::MAX) {
        return Err(format!(
            "{s:?} is longer than the Restarting frame can carry (49 days)"
        ));
    }
    Ok(d)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derper_style_flags_parse() {
        let cli = Cli::try_parse_from([
            "derpd",
            "-a",
            ":8443",
            "-c",
            "/tmp/k",
            "--derp=false",
            "--tcp-write-timeout",
            "0",
            "--home",
            "blank",
        ])
        .expect("parses");
        assert_eq!(cli.addr, ":8443");
        assert!(!cli.derp);
        assert_eq!(cli.tcp_write_timeout, Duration::ZERO);
        assert!(Cli::try_parse_from(["derpd", "--send-queue-depth", "0"]).is_err());
        assert!(Cli::try_parse_from(["derpd", "--log-format", "xml"]).is_err());
        let cli = Cli::try_parse_from([
            "derpd",
            "--peer-cache-max-entries",
            "-1",
            "--peer-mirror=false",
            "--debug-allow-cidr",
            "100.64.0.0/10,fd7a:115c:a1e0::/48",
        ])
        .expect("parses");
        assert_eq!(cli.peer_cache_max_entries, -1);
        assert!(!cli.peer_mirror);
        assert_eq!(cli.debug_allow_cidr.len(), 2);
        assert!(Cli::try_parse_from(["derpd", "--peer-cache-max-entries", "-2"]).is_err());
        // As with derper's Go flags, a later value wins: an image's entrypoint can carry
        // defaults that the operator's arguments override.
        let cli = Cli::try_parse_from([
            "derpd",
            "--metrics-addr",
            "127.0.0.1:9090",
            "--debug-allow-cidr",
            "10.0.0.0/8",
            "--metrics-addr",
            "10.1.2.3:9090",
            "--debug-allow-cidr",
            "192.168.0.0/16",
            "--check",
            "--check",
        ])
        .expect("parses");
        assert_eq!(
            cli.metrics_addr,
            Some("10.1.2.3:9090".parse().expect("addr"))
        );
        assert_eq!(cli.debug_allow_cidr.len(), 2, "repeated lists still add up");
        assert!(Cli::try_parse_from(["derpd", "--debug-allow-cidr", "10.0.0.0/99"]).is_err());
    }

    #[test]
    fn derper_single_dash_long_flags_parse() {
        let args = [
            "derpd",
            "-hostname",
            "derp.example.com",
            "-a",
            ":443",
            "-http-port",
            "-1",
            "-stun=false",
            "-c",
            "/tmp/k",
            "-mesh-with=a.example",
        ]
        .map(std::ffi::OsString::from);
        let cli = Cli::try_parse_from(derper_style_args(args)).expect("parses");
        assert_eq!(cli.tls.hostname, "derp.example.com");
        assert_eq!(cli.addr, ":443");
        assert_eq!(cli.tls.http_port, -1);
        assert!(!cli.stun);
        assert_eq!(cli.mesh_with, "a.example");
        // Not a derpd flag: left alone, and refused by the parser.
        let args = ["derpd", "-nosuchflag"].map(std::ffi::OsString::from);
        assert_eq!(derper_style_args(args.clone()), args);
    }

    #[test]
    fn mesh_and_restart_flags_parse() {
        let cli = Cli::try_parse_from([
            "derpd",
            "--mesh-with",
            "a.example,b.example/10.0.0.2",
            "--mesh-ca-file",
            "/etc/derp/ca.pem",
            "--drain-timeout",
            "30s",
            "--restart-reconnect-in",
            "1500ms",
            "--restart-try-for",
            "5m",
        ])
        .expect("parses");
        assert_eq!(cli.mesh_with, "a.example,b.example/10.0.0.2");
        assert_eq!(cli.drain_timeout, Duration::from_secs(30));
        assert_eq!(cli.restart_reconnect_in, Duration::from_millis(1500));
        assert_eq!(cli.restart_try_for, Duration::from_secs(300));
        let defaults = Cli::try_parse_from(["derpd"]).expect("parses");
        assert_eq!(defaults.drain_timeout, Duration::from_secs(10));
        assert_eq!(defaults.restart_reconnect_in, Duration::from_secs(2));
        assert_eq!(defaults.restart_try_for, Duration::from_secs(60));
        assert!(Cli::try_parse_from(["derpd", "--restart-try-for", "1200h"]).is_err());
    }

    /// The value after `key` up to the next whitespace or quote, in a deploy file.
    fn value_after<'a>(text: &'a str, key: &str) -> &'a str {
        let start = text.find(key).unwrap_or_else(|| panic!("{key} not found")) + key.len();
        let rest = text[start..].trim_start_matches([' ', '=', ':']);
        let end = rest
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\\')
            .unwrap_or(rest.len());
        &rest[..end]
    }

    #[test]
    fn deploy_stop_timeouts_cover_the_drain() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/");
        let unit = std::fs::read_to_string(format!("{root}systemd/derpd.service")).expect("unit");
        let k8s = std::fs::read_to_string(format!("{root}kubernetes/base/statefulset.yaml"))
            .expect("k8s");
        for (what, drain, stop) in [
            (
                "systemd",
                value_after(&unit, "    --drain-timeout"),
                value_after(&unit, "TimeoutStopSec"),
            ),
            (
                "kubernetes",
                value_after(&k8s, "- --drain-timeout"),
                value_after(&k8s, "terminationGracePeriodSeconds"),
            ),
        ] {
            let drain = parse_duration(drain).expect("drain");
            let stop = Duration::from_secs(stop.parse().expect("seconds"));
            assert!(
                // derpd exits at most 3 s after the drain deadline; the init system must
                // not kill it before.
                stop > drain + Duration::from_secs(3),
                "{what}: stop timeout {stop:?} leaves no margin over the drain {drain:?}"
            );
        }
    }
}
