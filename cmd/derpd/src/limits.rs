//! Flags for who may use the relay and how much: admission checks, the per-client receive
//! rate, accept limits, the unproven-connection budget and the listen backlog; and their
//! reloads on SIGHUP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Args};
use derp_admission::{
    AdmissionMetrics, AllowKeys, CacheConfig, DEFAULT_TAILSCALED_SOCKET, LocalTailscaled,
    UrlOptions, VerifyUrl,
};
use derp_server::{
    AcceptRate, Admission, ConnLimits, DEFAULT_MAX_UNPROVEN, DEFAULT_MAX_UNPROVEN_PER_SOURCE,
    RateLimit, Server, ServerConfig,
};
use tokio::net::{TcpListener, TcpSocket};
use tracing::{info, warn};

use crate::duration::parse_duration;
use crate::goflags::{GoKind, GoKinds};

/// Admission and limit flags, flattened into the main command line.
#[derive(Debug, Args)]
#[command(next_help_heading = "Admission and limits")]
pub(crate) struct LimitArgs {
    /// Admit only clients that are peers of the tailscaled running on this host (asked over
    /// its LocalAPI socket, see --socket). Mesh peers are always admitted.
    #[arg(long)]
    pub(crate) verify_clients: bool,

    /// tailscaled's LocalAPI socket, for --verify-clients; "" means the default.
    #[arg(long, default_value = DEFAULT_TAILSCALED_SOCKET, value_parser = crate::goflags::go_path())]
    socket: PathBuf,

    /// Admission server: each client's key and address are POSTed here as
    /// {"NodePublic":"nodekey:…","Source":"…"}, and only {"Allow":true} admits it
    /// (headscale's /verify speaks this). http:// or https://.
    #[arg(long)]
    pub(crate) verify_client_url: Option<String>,

    /// Admit clients when --verify-client-url cannot be reached. Off by default (derper's
    /// default is on): a node restricted to one tailnet stays closed while its admission
    /// server is down.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    pub(crate) verify_client_url_fail_open: bool,

    /// File of allowed node keys, one per line ("nodekey:<hex>"; "#" comments). Re-read when
    /// it changes and on SIGHUP; a bad line is reported and the old list stays in force.
    #[arg(long)]
    pub(crate) allow_keys_file: Option<PathBuf>,

    /// How often to check --allow-keys-file for changes; 0 leaves only SIGHUP.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) allow_keys_reload_interval: Duration,

    /// Bytes per second each client may send (mesh peers are exempt); 0 for no limit.
    /// Enforced by reading more slowly, so TCP pushes back: nothing is dropped.
    #[arg(long, default_value_t = 0)]
    pub(crate) per_client_rate_limit: u64,

    /// Bytes a client may send at once after a quiet period. Default: twice the rate; never
    /// less than one maximal frame (65573 bytes).
    #[arg(long)]
    pub(crate) per_client_rate_burst: Option<u64>,

    /// derper's rate config file, {"PerClientRateLimitBytesPerSec":N,
    /// "PerClientRateBurstBytes":M}, re-read on SIGHUP and applied to existing connections.
    #[arg(long, conflicts_with_all = ["per_client_rate_limit", "per_client_rate_burst"],
          value_parser = crate::goflags::go_path())]
    pub(crate) rate_config: Option<PathBuf>,

    /// New connections accepted per second on --addr (a token bucket); connections over it
    /// are closed at once and counted. Default: no limit (as "inf").
    #[arg(long, value_parser = parse_positive_rate)]
    pub(crate) accept_connection_limit: Option<f64>,

    /// Connections accepted at once by that bucket. Default: one second's worth. Without a
    /// limit it has no effect (as in derper).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) accept_connection_burst: Option<u64>,

    /// Most connections open at once on --addr, in any state; more are closed at once and
    /// counted. Default: no cap (the file descriptor limit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_connections: Option<u64>,

    /// Connections still in a TLS, HTTP or DERP handshake held at once; when full, the
    /// oldest is closed to admit a new one.
    #[arg(long, default_value_t = DEFAULT_MAX_UNPROVEN as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_unproven_connections: u64,

    /// Of those, how many one source (IPv4 address or IPv6 /64) may hold; one more closes
    /// that source's oldest.
    #[arg(long, default_value_t = DEFAULT_MAX_UNPROVEN_PER_SOURCE as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_unproven_per_source: u64,

    /// Listen backlog of the TCP listeners. Default: the system's cap
    /// (/proc/sys/net/core/somaxconn), so a burst of clients reconnecting after a restart is
    /// not dropped by the kernel.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) listen_backlog: Option<u32>,
}

/// The Go kind of each flag above ([`crate::goflags::GoKind`]), in their order.
pub(crate) const GO_KINDS: &GoKinds = &[
    ("verify-clients", GoKind::Bool),
    ("socket", GoKind::String),
    ("verify-client-url", GoKind::String),
    ("verify-client-url-fail-open", GoKind::Bool),
    ("allow-keys-file", GoKind::String),
    ("allow-keys-reload-interval", GoKind::Duration),
    ("per-client-rate-limit", GoKind::Int),
    ("per-client-rate-burst", GoKind::Int),
    ("rate-config", GoKind::String),
    ("accept-connection-limit", GoKind::Float),
    ("accept-connection-burst", GoKind::Int),
    ("max-connections", GoKind::Int),
    ("max-unproven-connections", GoKind::Int),
    ("max-unproven-per-source", GoKind::Int),
    ("listen-backlog", GoKind::Int),
];

fn parse_positive_rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("invalid rate {s:?}"))?;
    if v > 0.0 {
        Ok(v)
    } else {
        // derper's 0 admits the burst once and then nothing, ever: never what is meant.
        Err(format!(
            "the rate must be positive, got {s:?} (leave the flag out, or \"inf\", for no limit)"
        ))
    }
}

impl LimitArgs {
    /// tailscaled's LocalAPI socket: `--socket`, or its default when that is empty (as derper
    /// reads `-socket=`).
    pub(crate) fn socket(&self) -> &Path {
        if self.socket.as_os_str().is_empty() {
            Path::new(DEFAULT_TAILSCALED_SOCKET)
        } else {
            &self.socket
        }
    }

    /// The accept rate limit, if any: an infinite one is none.
    fn accept_limit(&self) -> Option<f64> {
        self.accept_connection_limit.filter(|l| l.is_finite())
    }
}

/// What must be re-read on SIGHUP (and polled) once the server runs.
#[derive(Debug)]
pub(crate) struct Reloads {
    rate_config: Option<PathBuf>,
    allow_keys: Option<Arc<AllowKeys>>,
    allow_keys_every: Duration,
}

/// Fills in `config`'s admission checks, rate limit and accept limits from the flags,
/// registering the checks' metrics on `registry`.
pub(crate) fn configure(
    args: &LimitArgs,
    config: &mut ServerConfig,
    registry: &prometheus::Registry,
) -> anyhow::Result<Reloads> {
    let mut checks: Vec<Arc<dyn Admission>> = Vec::new();
    let mut allow_keys = None;
    if args.verify_clients || args.verify_client_url.is_some() || args.allow_keys_file.is_some() {
        let metrics = AdmissionMetrics::register(registry).context("admission metrics")?;
        // Cheapest first: a local list, then the local tailscaled, then the network.
        if let Some(path) = &args.allow_keys_file {
            let list = Arc::new(AllowKeys::load(path, &metrics).context("--allow-keys-file")?);
            info!(path = %path.display(), keys = list.len(), "admitting only the keys listed");
            allow_keys = Some(list.clone());
            checks.push(list);
        }
        if args.verify_clients {
            info!(socket = %args.socket().display(), "admitting only peers of the local tailscaled");
            checks.push(Arc::new(LocalTailscaled::new(
                args.socket(),
                CacheConfig::default(),
                &metrics,
            )));
        }
        if let Some(url) = &args.verify_client_url {
            let options = UrlOptions {
                fail_open: args.verify_client_url_fail_open,
                ..UrlOptions::default()
            };
            let check = VerifyUrl::new(url, options, &metrics).context("--verify-client-url")?;
            info!(url = %url, fail_open = args.verify_client_url_fail_open,
                  "admitting only clients the admission server allows");
            checks.push(Arc::new(check));
        }
    }
    config.admission = checks;

    config.rate_limit = match &args.rate_config {
        Some(path) => Some(read_rate_config(path)?),
        None if args.per_client_rate_limit > 0 => {
            let rate = args.per_client_rate_limit;
            Some(RateLimit::new(
                rate,
                args.per_client_rate_burst
                    .unwrap_or_else(|| rate.saturating_mul(2)),
            ))
        }
        None => None,
    };
    if let Some(limit) = config.rate_limit {
        info!(
            bytes_per_sec = limit.bytes_per_sec,
            burst_bytes = limit.burst_bytes,
            "per-client receive rate limit"
        );
    }

    config.limits = ConnLimits {
        accept_rate: args.accept_limit().map(|per_sec| AcceptRate {
            per_sec,
            burst: args
                .accept_connection_burst
                .unwrap_or_else(|| per_sec.ceil().clamp(1.0, u64::MAX as f64) as u64),
        }),
        max_connections: args
            .max_connections
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        max_unproven: usize::try_from(args.max_unproven_connections).unwrap_or(usize::MAX),
        max_unproven_per_source: usize::try_from(args.max_unproven_per_source)
            .unwrap_or(usize::MAX),
    };
    Ok(Reloads {
        rate_config: args.rate_config.clone(),
        allow_keys,
        allow_keys_every: args.allow_keys_reload_interval,
    })
}

impl Reloads {
    /// Starts the tasks that re-read files: on SIGHUP (the rate config and the allow-keys
    /// file) and, for the allow-keys file, when it changes.
    pub(crate) fn spawn(self, server: &Server) {
        let shutdown = server.shutdown_token();
        if let Some(list) = &self.allow_keys
            && !self.allow_keys_every.is_zero()
        {
            tokio::spawn(list.clone().watch(self.allow_keys_every, shutdown.clone()));
        }
        if self.rate_config.is_none() && self.allow_keys.is_none() {
            return;
        }
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let mut hup = match signal(SignalKind::hangup()) {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "cannot listen for SIGHUP; rate config and allow-keys will not be reloaded by it");
                    return;
                }
            };
            let server = server.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        got = hup.recv() => if got.is_none() { return },
                    }
                    self.reload(&server);
                }
            });
        }
    }

    fn reload(&self, server: &Server) {
        if let Some(path) = &self.rate_config {
            match read_rate_config(path) {
                Ok(limit) => {
                    server.set_rate_limit(limit);
                    info!(
                        bytes_per_sec = limit.bytes_per_sec,
                        burst_bytes = limit.burst_bytes,
                        "SIGHUP: rate config reloaded"
                    );
                }
                Err(e) => {
                    warn!(
                        error = format!("{e:#}"),
                        "SIGHUP: rate config not reloaded; the old limit stays"
                    )
                }
            }
        }
        if let Some(list) = &self.allow_keys {
            list.reload_and_log("SIGHUP");
        }
    }
}

/// Reads derper's rate config: a JSON object with the unsigned integers
/// `PerClientRateLimitBytesPerSec` and `PerClientRateBurstBytes` (names matched without
/// regard to case, as Go does; either may be left out, meaning 0; other fields ignored).
pub(crate) fn read_rate_config(path: &Path) -> anyhow::Result<RateLimit> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading rate config {}", path.display()))?;
    parse_rate_config(&text).with_context(|| format!("rate config {}", path.display()))
}

fn parse_rate_config(text: &str) -> anyhow::Result<RateLimit> {
    let c = derp_proto::rate_config::RateConfig::parse(text)?;
    Ok(RateLimit::new(c.bytes_per_sec, c.burst_bytes))
}

/// Binds a TCP listener on `addr` with the given backlog (default: the system's cap). An
/// IPv6 socket takes IPv4 too (`IPV6_V6ONLY` off, whatever the system's default), as Go's do.
pub(crate) fn bind(addr: SocketAddr, backlog: Option<u32>) -> std::io::Result<TcpListener> {
    let socket = tcp_socket(addr)?;
    socket.bind(addr)?;
    socket.listen(backlog.unwrap_or_else(default_backlog))
}

/// The unbound socket [`bind`] binds.
pub(crate) fn tcp_socket(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        let socket = TcpSocket::new_v6()?;
        socket2::SockRef::from(&socket).set_only_v6(false)?;
        socket
    };
    // As std and tokio do: a restarted server can bind while old connections linger.
    socket.set_reuseaddr(true)?;
    Ok(socket)
}

/// The kernel's cap on listen backlogs; asking for more is silently cut to it anyway.
fn default_backlog() -> u32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(FALLBACK_BACKLOG)
}

const FALLBACK_BACKLOG: u32 = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_config_reads_like_derper() {
        let l = parse_rate_config(
            r#"{"PerClientRateLimitBytesPerSec": 1250000, "PerClientRateBurstBytes": 2500000}"#,
        )
        .expect("ok");
        assert_eq!(l, RateLimit::new(1_250_000, 2_500_000));
        let l = parse_rate_config(r#"{"perclientratelimitbytespersec": 1000, "Other": 1}"#)
            .expect("ok");
        assert_eq!(l.burst_bytes, derp_server::MIN_RATE_BURST);
        assert_eq!(parse_rate_config("{}").expect("ok"), RateLimit::OFF);
        for bad in [
            "",
            "[1]",
            r#"{"PerClientRateLimitBytesPerSec": -1}"#,
            r#"{"PerClientRateLimitBytesPerSec": 1.5}"#,
            r#"{"PerClientRateBurstBytes": "x"}"#,
        ] {
            assert!(parse_rate_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flags_parse_and_conflict() {
        let cli = crate::cli::try_parse_from([
            "derpd",
            "--verify-client-url",
            "https://hs.example.com/verify",
            "--verify-client-url-fail-open",
            "--per-client-rate-limit",
            "1250000",
            "--accept-connection-limit",
            "50",
            "--max-connections",
            "10000",
            "--listen-backlog",
            "512",
        ])
        .expect("parses");
        assert!(cli.limits.verify_client_url_fail_open);
        assert_eq!(cli.limits.accept_connection_limit, Some(50.0));
        let mut config = ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        configure(&cli.limits, &mut config, &prometheus::Registry::new()).expect("configure");
        assert_eq!(config.admission.len(), 1);
        assert_eq!(
            config.rate_limit,
            Some(RateLimit::new(1_250_000, 2_500_000))
        );
        assert_eq!(
            config.limits.accept_rate,
            Some(AcceptRate {
                per_sec: 50.0,
                burst: 50
            })
        );
        assert_eq!(config.limits.max_connections, Some(10_000));
        let cli = crate::cli::try_parse_from(["derpd", "--verify-client-url-fail-open=false"])
            .expect("ok");
        assert!(!cli.limits.verify_client_url_fail_open);
        for bad in [
            &["--rate-config", "/x", "--per-client-rate-limit", "5"][..],
            &["--accept-connection-limit", "0"],
            &["--accept-connection-limit", "-3"],
            &["--accept-connection-limit", "NaN"],
            &["--accept-connection-burst", "0"],
            &["--max-connections", "0"],
            &["--max-unproven-connections", "0"],
            &["--listen-backlog", "0"],
        ] {
            let args = std::iter::once("derpd").chain(bad.iter().copied());
            assert!(crate::cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn derpers_own_inputs_are_taken() {
        let cli = crate::cli::try_parse_from([
            "derpd",
            "-accept-connection-limit=+Inf",
            "-accept-connection-burst",
            "9223372036854775807",
            "-socket=",
        ])
        .expect("parses");
        let mut config = ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        configure(&cli.limits, &mut config, &prometheus::Registry::new()).expect("configure");
        assert_eq!(
            config.limits.accept_rate, None,
            "an infinite rate is no limit"
        );
        assert_eq!(cli.limits.socket(), Path::new(DEFAULT_TAILSCALED_SOCKET));
        let cli = crate::cli::try_parse_from(["derpd", "-accept-connection-burst=5"]).expect("ok");
        assert_eq!(cli.limits.accept_connection_burst, Some(5));
        let cli =
            crate::cli::try_parse_from(["derpd", "-accept-connection-limit", "2.5e1"]).expect("ok");
        assert_eq!(cli.limits.accept_connection_limit, Some(25.0));
    }

    #[test]
    fn the_default_backlog_is_the_system_cap() {
        let want = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(FALLBACK_BACKLOG);
        assert_eq!(default_backlog(), want);
    }
}
