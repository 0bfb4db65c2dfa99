//! Command-line flags. Long names follow Tailscale derper's where the feature is the same, so
//! an operator's unit file carries over.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};

use crate::duration::parse_duration;

/// DERP relay server, wire-compatible with Tailscale's derper.
#[derive(Debug, Parser)]
#[command(name = "derpd", version, about, long_about = None)]
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

    /// File holding the 64-hex-digit mesh pre-shared key.
    #[arg(long)]
    pub(crate) mesh_psk_file: Option<PathBuf>,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,

    #[command(flatten)]
    pub(crate) tls: crate::tls_setup::TlsArgs,
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
        assert!(Cli::try_parse_from(["derpd", "--debug-allow-cidr", "10.0.0.0/99"]).is_err());
    }
}
