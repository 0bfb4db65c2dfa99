//! Command-line flags. Long names follow Tailscale derper's where the feature is the same, so
//! an operator's unit file carries over; they are read with Go's flag syntax, as derper reads
//! them ([`crate::goflags`]).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};

use crate::duration::{SignedDuration, parse_duration, parse_signed_duration};
use crate::goflags::{self, GoKind, GoKinds, Translated};

/// DERP relay server, wire-compatible with Tailscale's derper.
#[derive(Debug, Parser)]
#[command(name = "derpd", version, about, long_about = None, args_override_self = true,
          disable_version_flag = true, after_help = GO_SYNTAX)]
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
    #[arg(short = 'c', long = "config", value_parser = goflags::go_path())]
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

    /// Idle time before TCP keepalive probes start on client connections (then every 15 s,
    /// 9 in all, as derper's). 0 means 15s; a negative value turns TCP keepalive off.
    #[arg(long, default_value = "10m", value_parser = parse_signed_duration)]
    pub(crate) tcp_keepalive_time: SignedDuration,

    /// How long data sent to a client may go unacknowledged before the kernel drops the
    /// connection (TCP_USER_TIMEOUT, Linux). 0 leaves the kernel's default (no limit).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub(crate) tcp_user_timeout: Duration,

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

    /// Networks (CIDR) besides loopback allowed to read /debug/varz on the main listener,
    /// comma separated. Given more than once, the last list wins (it replaces, never adds).
    #[arg(long, value_delimiter = ',', action = ArgAction::Set)]
    pub(crate) debug_allow_cidr: Vec<derp_server::IpCidr>,

    /// Behind a TCP load balancer: every connection on the TCP listeners (--addr and
    /// --http-port) must open with a PROXY protocol header (version 1 or 2), whose client
    /// address is the one limits, logs and admission see. Needs --proxy-protocol-from.
    /// STUN and QUIC (UDP) cannot come through it; see docs/operations.md.
    #[arg(long, requires = "proxy_protocol_from")]
    pub(crate) proxy_protocol: bool,

    /// The load balancers (CIDR) allowed to send PROXY protocol headers, comma separated;
    /// connections from anywhere else are refused. Given more than once, the last list wins
    /// (it replaces, never adds). Only with --proxy-protocol.
    #[arg(long, value_delimiter = ',', action = ArgAction::Set, requires = "proxy_protocol")]
    pub(crate) proxy_protocol_from: Vec<derp_server::IpCidr>,

    /// HTTP reverse proxies (CIDR) whose --forwarded-header names a DERP client's address
    /// (nginx's http module, which cannot send PROXY protocol). From anyone else no header is
    /// believed. Comma separated; given more than once, the last list wins (it replaces,
    /// never adds: a later flag narrows an earlier one).
    #[arg(long, value_delimiter = ',', action = ArgAction::Set)]
    pub(crate) trust_forwarded_from: Vec<derp_server::IpCidr>,

    /// The one header the --trust-forwarded-from proxies set, and the only one read: the
    /// other is passed on as the client wrote it. x-forwarded-for: the proxies append to it
    /// (nginx's $proxy_add_x_forwarded_for) or overwrite it, and the rightmost entry that is
    /// not a trusted proxy is the client. x-real-ip: they overwrite it with the address they
    /// saw (nginx's `X-Real-IP $remote_addr`). Only with --trust-forwarded-from.
    #[arg(long, value_enum, default_value_t = ForwardedHeaderArg::XForwardedFor)]
    pub(crate) forwarded_header: ForwardedHeaderArg,

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
    /// the TAILSCALE_DERPER_MESH_KEY environment variable. "" means no mesh key.
    #[arg(long, value_parser = goflags::go_path())]
    pub(crate) mesh_psk_file: Option<PathBuf>,

    /// Siblings of this node's region to mesh with, comma separated. "host" dials
    /// https://host/derp; "host/dialhost" connects to dialhost instead, keeping host as the
    /// URL and TLS name; a full http:// or https:// URL is used as is, and quic://host:port
    /// links over DERP over QUIC. Every entry is dialed; the one that is this node (its own
    /// key answers) is dropped, so one list can serve every node of a region. Needs a mesh
    /// key. Given more than once, the last list wins (it replaces, never adds).
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

    /// On SIGUSR2 (an upgrade in place), how long the new binary may take to serve on the
    /// listeners it is handed and confirm; past it, this process kills it and keeps serving.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) upgrade_timeout: Duration,

    /// On SIGUSR2, hand the client connections that can go (all but QUIC and TLS on
    /// rustls's records) to the new binary
    /// with their state, so their clients notice nothing. With --upgrade-connections=false
    /// every client is told to reconnect (Restarting) and drained, as on a restart.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    pub(crate) upgrade_connections: bool,

    /// The Restarting frame sent to every client on shutdown: reconnect after this long.
    #[arg(long, default_value = "2s", value_parser = parse_restart_duration)]
    pub(crate) restart_reconnect_in: Duration,

    /// The Restarting frame sent to every client on shutdown: keep trying for this long.
    #[arg(long, default_value = "60s", value_parser = parse_restart_duration)]
    pub(crate) restart_try_for: Duration,

    /// Worker threads that run connections; 0 means the default: one where derpd may use at
    /// most two CPUs, else one per CPU. Most of a relay's CPU time is the kernel's, in system
    /// calls on these threads and in network interrupts; see docs/operations.md for how many
    /// to run.
    #[arg(long, default_value_t = 0)]
    pub(crate) workers: usize,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,

    /// Check the configuration and exit: parse the flags, read the key file, certificates,
    /// mesh key and CA files, look up a host name in --addr, print what would run, and exit 1
    /// on any error. Binds no socket, writes no file and contacts nobody else.
    #[arg(long)]
    pub(crate) check: bool,

    // Bootstrap DNS, ACME account binding and IP certificates (derper's flags of these names).
    /// Names served at /bootstrap-dns, comma separated: resolved at start and every 10
    /// minutes, and given to every client as JSON (name to addresses). Given more than once,
    /// the last list wins (it replaces, never adds).
    #[arg(long, default_value = "")]
    pub(crate) bootstrap_dns_names: String,

    /// Names served at /bootstrap-dns only to a client asking for one with ?q=name, comma
    /// separated. "name/txt-name" serves name only to the share of clients (0 to 100 per cent,
    /// chosen by client address) given by the TXT record of txt-name. Given more than once,
    /// the last list wins (it replaces, never adds).
    #[arg(long, default_value = "")]
    pub(crate) unpublished_bootstrap_dns_names: String,

    /// ACME External Account Binding key ID. Required with --certmode gcp; with letsencrypt,
    /// binds the account at any --acme-directory that asks for it.
    #[arg(long)]
    pub(crate) acme_eab_kid: Option<String>,

    /// ACME External Account Binding HMAC key, base64 (URL alphabet unpadded, or standard
    /// alphabet padded). Required with --certmode gcp.
    #[arg(long)]
    pub(crate) acme_eab_key: Option<String>,

    /// Get ACME certificates for the node's own IP addresses, on demand: a client connecting
    /// by address (no SNI, or the address as SNI) gets a certificate for --hostname when it
    /// is an IP address (whatever address the socket sees, as behind 1:1 NAT), else for the
    /// global address it connected to, validated by HTTP-01 on --http-port. Lets --hostname
    /// be an IP address with --certmode letsencrypt. The CA's short-lived profile is asked
    /// for when offered.
    /// Only with --certmode letsencrypt, as in derper (refused with manual or gcp).
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true")]
    pub(crate) acme_ip_certs: bool,

    /// Print the version and exit (after reading every other flag, as derper does).
    #[arg(long, short = 'V')]
    pub(crate) version: bool,

    #[command(flatten)]
    pub(crate) tls: crate::tls_setup::TlsArgs,

    #[command(flatten)]
    pub(crate) limits: crate::limits::LimitArgs,

    #[command(flatten)]
    pub(crate) compat: crate::compat::CompatArgs,

    /// The flags the command line gave (clap's ids), as against the defaults.
    #[arg(skip)]
    given: BTreeSet<String>,
}

/// The Go kind of each flag above ([`goflags::GoKind`]), in their order.
const GO_KINDS: &GoKinds = &[
    ("dev", GoKind::Bool),
    ("addr", GoKind::String),
    ("config", GoKind::String),
    ("home", GoKind::String),
    ("derp", GoKind::Bool),
    ("stun", GoKind::Bool),
    ("stun-port", GoKind::Int),
    ("quic-port", GoKind::Int),
    ("quic-congestion", GoKind::String),
    ("stun-answer-generic", GoKind::Bool),
    ("tcp-write-timeout", GoKind::Duration),
    ("tcp-keepalive-time", GoKind::Duration),
    ("tcp-user-timeout", GoKind::Duration),
    ("send-queue-depth", GoKind::Int),
    ("peer-cache-max-entries", GoKind::Int),
    ("peer-cache-max-idle", GoKind::Duration),
    ("peer-mirror", GoKind::Bool),
    ("debug-allow-cidr", GoKind::String),
    ("proxy-protocol", GoKind::Bool),
    ("proxy-protocol-from", GoKind::String),
    ("trust-forwarded-from", GoKind::String),
    ("forwarded-header", GoKind::String),
    ("metrics-addr", GoKind::String),
    ("packet-metrics", GoKind::Bool),
    ("mesh-psk-file", GoKind::String),
    ("mesh-with", GoKind::String),
    ("mesh-ca-file", GoKind::String),
    ("mesh-ping-interval", GoKind::Duration),
    ("drain-timeout", GoKind::Duration),
    ("upgrade-timeout", GoKind::Duration),
    ("upgrade-connections", GoKind::Bool),
    ("restart-reconnect-in", GoKind::Duration),
    ("restart-try-for", GoKind::Duration),
    ("workers", GoKind::Int),
    ("log-format", GoKind::String),
    ("check", GoKind::Bool),
    ("bootstrap-dns-names", GoKind::String),
    ("unpublished-bootstrap-dns-names", GoKind::String),
    ("acme-eab-kid", GoKind::String),
    ("acme-eab-key", GoKind::String),
    ("acme-ip-certs", GoKind::Bool),
    ("version", GoKind::Bool),
];

/// Every flag's Go kind: the table of each flag block.
pub(crate) fn go_kinds() -> Vec<(&'static str, GoKind)> {
    [
        GO_KINDS,
        crate::tls_setup::GO_KINDS,
        crate::limits::GO_KINDS,
        crate::compat::GO_KINDS,
    ]
    .concat()
}

/// How flags are written, under the help text.
const GO_SYNTAX: &str = "Flags are read as derper reads them (Go's flag package): one dash or \
two (-hostname, --hostname), the value after \"=\" or as the next argument, booleans as -flag or \
-flag=false (never -flag false), -a and -c as names. The last occurrence of a flag wins; for a \
list flag, its last list replaces the earlier ones.";

impl Cli {
    /// Whether the command line gave the flag of clap's id `id` (a default does not count):
    /// for the flags that act only beside another setting ([`crate::combinations`]).
    pub(crate) fn given(&self, id: &str) -> bool {
        self.given.contains(id)
    }

    /// Where derper reads an empty value as "not given" (`-c=`, `-rate-config=`,
    /// `-verify-client-url=`, `-acme-email=`), so does derpd.
    fn unset_empty(&mut self) {
        fn clear<T: AsRef<std::ffi::OsStr>>(v: &mut Option<T>) {
            if v.as_ref().is_some_and(|v| v.as_ref().is_empty()) {
                *v = None;
            }
        }
        clear(&mut self.config);
        clear(&mut self.limits.rate_config);
        clear(&mut self.limits.verify_client_url);
        clear(&mut self.tls.acme_email);
    }

    /// The TCP options of client connections, from the flags as derper reads them.
    pub(crate) fn tcp_options(&self) -> derp_server::TcpOptions {
        derp_server::TcpOptions {
            keepalive_idle: self
                .tcp_keepalive_time
                .non_negative()
                .map(|d| if d.is_zero() { GO_DEFAULT_KEEPALIVE } else { d }),
            user_timeout: Some(self.tcp_user_timeout).filter(|d| !d.is_zero()),
        }
    }
}

/// Go's keepalive idle time when a listener asks for 0.
const GO_DEFAULT_KEEPALIVE: Duration = Duration::from_secs(15);

/// What a command line asks for.
#[derive(Debug)]
pub(crate) enum Invocation {
    /// Run (or check) with these flags.
    Run(Box<Cli>),
    /// Print this help text and exit.
    Help(String),
}

/// derpd's flags as clap defines them, with every boolean taking Go's forms.
pub(crate) fn command() -> clap::Command {
    goflags::go_booleans(Cli::command(), &go_kinds())
}

/// Reads a command line (the program name first) in Go's flag syntax. The error is one line,
/// for journald.
pub(crate) fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, String> {
    let mut cmd = command();
    match goflags::translate(&cmd, &go_kinds(), args).map_err(|e| e.to_string())? {
        Translated::Help { long } => Ok(Invocation::Help(
            // As clap's own --help: the long form only where there is more to say.
            if long && cmd.get_arguments().any(|a| a.get_long_help().is_some()) {
                cmd.render_long_help()
            } else {
                cmd.render_help()
            }
            .to_string(),
        )),
        Translated::Args(args) => {
            let matches = cmd.try_get_matches_from_mut(args).map_err(one_line)?;
            let mut cli = Cli::from_arg_matches(&matches).map_err(one_line)?;
            cli.given = matches
                .ids()
                .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
                .map(|id| id.as_str().to_owned())
                .collect();
            cli.unset_empty();
            Ok(Invocation::Run(Box::new(cli)))
        }
    }
}

/// [`parse`] for tests: the flags, or the error line.
#[cfg(test)]
pub(crate) fn try_parse_from<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Cli, String> {
    match parse(args.into_iter().map(OsString::from))? {
        Invocation::Run(cli) => Ok(*cli),
        Invocation::Help(_) => Err("help".to_owned()),
    }
}

/// The first line of clap's message, without its "error: " prefix. A first line ending in a
/// colon is followed by what it names (missing arguments), which joins it.
fn one_line(e: clap::Error) -> String {
    let rendered = e.render().to_string();
    let mut lines = rendered.lines();
    let mut line = lines.next().unwrap_or("invalid arguments").to_owned();
    if line.ends_with(':') {
        let named: Vec<&str> = lines
            .take_while(|l| l.starts_with(' '))
            .map(str::trim)
            .collect();
        line = format!("{line} {}", named.join(", "));
    }
    line.trim_start_matches("error: ").to_owned()
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

/// The header of `--forwarded-header`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ForwardedHeaderArg {
    /// X-Forwarded-For, a list each proxy appends to.
    XForwardedFor,
    /// X-Real-IP, one address the proxy sets.
    XRealIp,
}

impl From<ForwardedHeaderArg> for derp_server::ForwardedHeader {
    fn from(arg: ForwardedHeaderArg) -> Self {
        match arg {
            ForwardedHeaderArg::XForwardedFor => Self::XForwardedFor,
            ForwardedHeaderArg::XRealIp => Self::XRealIp,
        }
    }
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
        let cli = try_parse_from([
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
        assert!(try_parse_from(["derpd", "--send-queue-depth", "0"]).is_err());
        assert!(try_parse_from(["derpd", "--log-format", "xml"]).is_err());
        let cli = try_parse_from([
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
        assert!(try_parse_from(["derpd", "--peer-cache-max-entries", "-2"]).is_err());
        // As with derper's Go flags, a later value wins: an image's entrypoint can carry
        // defaults that the operator's arguments override.
        let cli = try_parse_from([
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
        assert_eq!(
            cli.debug_allow_cidr,
            ["192.168.0.0/16"
                .parse::<derp_server::IpCidr>()
                .expect("cidr")],
            "the last list wins"
        );
        assert!(try_parse_from(["derpd", "--debug-allow-cidr", "10.0.0.0/99"]).is_err());
    }

    /// Every flag that takes a list (clap's, or a comma-separated string), with the flags it
    /// needs and two lists of its values: given twice, in each of Go's forms, the second
    /// replaces the first. The table must name every list flag, and each one's help says so.
    #[test]
    fn a_list_flag_given_twice_keeps_the_last_list() {
        let lists: [(&str, &[&str], &str, &str); 6] = [
            (
                "bootstrap-dns-names",
                &[],
                "a.example,b.example",
                "c.example",
            ),
            (
                "debug-allow-cidr",
                &[],
                "10.0.0.0/8,fd00::/8",
                "192.0.2.1/32",
            ),
            (
                "mesh-with",
                &[],
                "a.example,b.example/10.0.0.2",
                "c.example",
            ),
            (
                "proxy-protocol-from",
                &["--proxy-protocol"],
                "10.0.0.0/8,127.0.0.1/32",
                "192.0.2.1/32",
            ),
            (
                "trust-forwarded-from",
                &[],
                "10.0.0.0/8,172.16.0.0/12",
                "192.0.2.1/32",
            ),
            (
                "unpublished-bootstrap-dns-names",
                &[],
                "a.example,b.example/rollout.example",
                "c.example",
            ),
        ];
        let cmd = command();
        let is_list = |a: &clap::Arg| {
            a.get_value_delimiter().is_some()
                || a.get_num_args().is_some_and(|n| n.max_values() > 1)
                || a.get_help()
                    .is_some_and(|h| h.to_string().to_lowercase().contains("comma separated"))
        };
        let mut listed: Vec<&str> = cmd
            .get_arguments()
            .filter(|a| is_list(a))
            .filter_map(|a| a.get_long())
            .collect();
        listed.sort_unstable();
        assert_eq!(
            listed,
            lists.iter().map(|(l, ..)| *l).collect::<Vec<_>>(),
            "every list flag has a case here"
        );
        for arg in cmd.get_arguments().filter(|a| is_list(a)) {
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            assert!(
                help.contains("the last list wins"),
                "--{}'s help does not say the last list wins: {help}",
                arg.get_id()
            );
        }
        let get = |cli: &Cli, long: &str| -> Vec<String> {
            let cidrs = |v: &[derp_server::IpCidr]| v.iter().map(ToString::to_string).collect();
            let names = |v: &str| v.split(',').map(str::to_owned).collect();
            match long {
                "bootstrap-dns-names" => names(&cli.bootstrap_dns_names),
                "debug-allow-cidr" => cidrs(&cli.debug_allow_cidr),
                "mesh-with" => names(&cli.mesh_with),
                "proxy-protocol-from" => cidrs(&cli.proxy_protocol_from),
                "trust-forwarded-from" => cidrs(&cli.trust_forwarded_from),
                "unpublished-bootstrap-dns-names" => names(&cli.unpublished_bootstrap_dns_names),
                other => panic!("no field for --{other}"),
            }
        };
        let split = |list: &str| -> Vec<String> { list.split(',').map(str::to_owned).collect() };
        for (long, needs, first, last) in lists {
            let parse = |given: &[&str]| {
                let args = [&["derpd"][..], needs, given].concat();
                let cli = try_parse_from(args.iter().copied()).expect("parses");
                get(&cli, long)
            };
            let (a, b) = (format!("--{long}={first}"), format!("--{long}={last}"));
            assert_eq!(parse(&[&a, &b]), split(last), "{a} {b}");
            assert_eq!(parse(&[&b, &a]), split(first), "{b} {a}");
            let (a, b) = (format!("-{long}={first}"), format!("-{long}={last}"));
            assert_eq!(parse(&[&a, &b]), split(last), "{a} {b}");
            let flag = format!("-{long}");
            assert_eq!(
                parse(&[&flag, first, &flag, last]),
                split(last),
                "{flag} {first} {flag} {last}"
            );
            // Straight through clap, without Go's reading, the same holds.
            let (a, b) = (format!("-{a}"), format!("-{b}"));
            let args = [&["derpd"][..], needs, &[&a, &b]].concat();
            let cli = Cli::try_parse_from(args.iter().copied()).expect("parses");
            assert_eq!(get(&cli, long), split(last), "{args:?}");
        }
    }

    #[test]
    fn proxy_flags_parse_and_need_each_other() {
        let cli = Cli::try_parse_from([
            "derpd",
            "--proxy-protocol",
            "--proxy-protocol-from",
            "10.0.0.0/8,127.0.0.1",
            "--trust-forwarded-from",
            "127.0.0.1",
            "--forwarded-header",
            "x-real-ip",
        ])
        .expect("parses");
        assert!(cli.proxy_protocol);
        assert_eq!(cli.proxy_protocol_from.len(), 2);
        assert_eq!(cli.trust_forwarded_from.len(), 1);
        assert_eq!(cli.forwarded_header, ForwardedHeaderArg::XRealIp);
        for bad in [
            &["--proxy-protocol"][..],
            &["--proxy-protocol-from", "10.0.0.0/8"],
            &["--proxy-protocol", "--proxy-protocol-from", "10.0.0.0/40"],
            &["--trust-forwarded-from", "nonsense"],
            &["--forwarded-header", "forwarded"],
        ] {
            let args = std::iter::once("derpd").chain(bad.iter().copied());
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
        let defaults = Cli::try_parse_from(["derpd"]).expect("parses");
        assert!(!defaults.proxy_protocol && defaults.trust_forwarded_from.is_empty());
        assert_eq!(defaults.forwarded_header, ForwardedHeaderArg::XForwardedFor);
    }

    #[test]
    fn derper_single_dash_long_flags_parse() {
        let cli = try_parse_from([
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
            "-verify-clients=false",
            "--dev=true",
        ])
        .expect("parses");
        assert_eq!(cli.tls.hostname, "derp.example.com");
        assert_eq!(cli.addr, ":443");
        assert_eq!(cli.tls.http_port, -1);
        assert!(!cli.stun);
        assert!(!cli.limits.verify_clients);
        assert!(cli.dev);
        assert_eq!(cli.mesh_with, "a.example");
        assert_eq!(
            try_parse_from(["derpd", "-nosuchflag"]).unwrap_err(),
            "flag provided but not defined: -nosuchflag"
        );
        // Never short options run together.
        assert_eq!(
            try_parse_from(["derpd", "-acme-ip"]).unwrap_err(),
            "flag provided but not defined: -acme-ip"
        );
    }

    #[test]
    fn every_flag_has_a_long_name_and_a_go_kind() {
        for arg in command().get_arguments() {
            assert!(
                arg.get_long().is_some(),
                "{} has no long name",
                arg.get_id()
            );
            assert!(
                !matches!(arg.get_action(), ArgAction::SetFalse | ArgAction::Count),
                "{}: Go's flags have no such kind",
                arg.get_id()
            );
            // Go's flag.Value is set once per occurrence, the last one remaining: a list
            // given twice replaces, never adds up.
            assert!(
                !matches!(arg.get_action(), ArgAction::Append),
                "{}: a later occurrence must replace the list (ArgAction::Set)",
                arg.get_id()
            );
        }
    }

    /// Each flag declares one Go kind, every declaration names a flag, and the flag's parser
    /// takes what that kind hands it: a decimal integer and no fraction (Int), a fraction
    /// (Float), Go's units and no bare number (Duration), and for a string no value of the
    /// types Go reads itself, which would then miss Go's syntax.
    #[test]
    fn every_flag_declares_a_go_kind_its_parser_agrees_with() {
        use std::any::TypeId;
        let kinds = go_kinds();
        let cmd = command();
        for (long, _) in &kinds {
            let count = kinds.iter().filter(|(l, _)| l == long).count();
            assert_eq!(count, 1, "--{long} is declared {count} times");
            assert!(
                cmd.get_arguments().any(|a| a.get_long() == Some(*long)),
                "--{long} is declared but is no flag"
            );
        }
        let takes = |arg: &clap::Arg, v: &str| {
            goflags::check_value("x", arg, v.as_ref(), v.as_ref()).is_ok()
        };
        let typed = [
            TypeId::of::<bool>(),
            TypeId::of::<i8>(),
            TypeId::of::<i16>(),
            TypeId::of::<i32>(),
            TypeId::of::<i64>(),
            TypeId::of::<isize>(),
            TypeId::of::<u8>(),
            TypeId::of::<u16>(),
            TypeId::of::<u32>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<f32>(),
            TypeId::of::<f64>(),
            TypeId::of::<Duration>(),
            TypeId::of::<SignedDuration>(),
        ];
        for arg in cmd.get_arguments() {
            let long = arg.get_long().expect("long name");
            let Some((_, kind)) = kinds.iter().find(|(l, _)| *l == long) else {
                panic!("--{long} declares no Go kind (GO_KINDS beside its definition)");
            };
            let parser = arg.get_value_parser().type_id();
            match kind {
                GoKind::Bool => assert_eq!(parser, TypeId::of::<bool>(), "--{long}"),
                GoKind::Int => {
                    assert!(
                        ["0", "1", "-1", "80"].iter().any(|v| takes(arg, v)),
                        "--{long} takes no decimal integer"
                    );
                    for v in ["1.5", "1s", "x"] {
                        assert!(!takes(arg, v), "--{long} takes {v:?}");
                    }
                }
                GoKind::Float => {
                    assert!(takes(arg, "1.5"), "--{long}");
                    assert!(!takes(arg, "1s"), "--{long}");
                }
                GoKind::Duration => {
                    assert!(takes(arg, "1s"), "--{long}");
                    assert!(!takes(arg, "1"), "--{long} takes a number without a unit");
                }
                GoKind::String => assert!(
                    !typed.iter().any(|t| parser == *t),
                    "--{long} is declared a string but parses into {parser:?}"
                ),
            }
        }
    }

    /// derper's flags are read with the kinds derper gives them (its list, from its `-h`).
    #[test]
    fn derpers_flags_keep_derpers_kinds() {
        let kinds = go_kinds();
        let cmd = command();
        let list = include_str!("../tests/data/derper-flags.txt");
        let mut checked = 0;
        for line in list
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let mut fields = line.split('\t');
            let (name, go) = (fields.next().expect("name"), fields.next().expect("type"));
            let arg = cmd
                .get_arguments()
                .find(|a| {
                    a.get_long() == Some(name)
                        || a.get_short().is_some_and(|c| name == c.to_string())
                })
                .unwrap_or_else(|| panic!("derper's -{name} is no derpd flag"));
            let long = arg.get_long().expect("long name");
            let kind = kinds.iter().find(|(l, _)| *l == long).map(|(_, k)| *k);
            let want = match go {
                "bool" => GoKind::Bool,
                "int" => GoKind::Int,
                "float" => GoKind::Float,
                "duration" => GoKind::Duration,
                "string" => GoKind::String,
                other => panic!("-{name}: Go kind {other:?}"),
            };
            assert_eq!(kind, Some(want), "-{name}");
            checked += 1;
        }
        assert!(checked > 30, "only {checked} of derper's flags");
    }

    #[test]
    fn help_and_version() {
        for form in ["-h", "--help", "-help", "-help=false"] {
            let got = parse(["derpd", form].map(OsString::from)).expect("help");
            assert!(
                matches!(&got, Invocation::Help(text) if text.contains("--tcp-write-timeout")),
                "{form}: {got:?}"
            );
        }
        // Go parses the flags before -h in order: a bad value among them is the error, and
        // what follows -h is never looked at.
        let help = |args: &[&str]| parse(args.iter().map(OsString::from));
        let err = help(&["derpd", "-tcp-write-timeout=bogus", "-h"]).expect_err("bad value");
        assert!(
            err.starts_with("invalid value \"bogus\" for flag -tcp-write-timeout: "),
            "{err}"
        );
        // A string (in Go) is checked only after parsing, which -h ends first.
        assert!(matches!(
            help(&["derpd", "-certmode", "nope", "-help"]),
            Ok(Invocation::Help(_))
        ));
        assert!(help(&["derpd", "-tcp-keepalive-time=1x", "-help"]).is_err());
        assert!(matches!(
            help(&["derpd", "-h", "-tcp-write-timeout=bogus"]),
            Ok(Invocation::Help(_))
        ));
        assert!(matches!(
            help(&["derpd", "-proxy-protocol-from", "10.0.0.0/8", "-h"]),
            Ok(Invocation::Help(_))
        ));
        for form in ["-version", "--version", "-V", "-version=true"] {
            assert!(
                try_parse_from(["derpd", form]).expect(form).version,
                "{form}"
            );
        }
        // Every flag is read before the version is printed.
        assert!(try_parse_from(["derpd", "-version", "-nosuch"]).is_err());
    }

    #[test]
    fn tcp_flags_mean_what_derpers_mean() {
        let options = |args: &[&str]| {
            let cli = try_parse_from(std::iter::once("derpd").chain(args.iter().copied()))
                .expect("parses");
            cli.tcp_options()
        };
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(options(&[]), derp_server::TcpOptions::default());
        assert_eq!(options(&[]).keepalive_idle, secs(600));
        assert_eq!(options(&[]).user_timeout, secs(15));
        assert_eq!(options(&["-tcp-keepalive-time=0"]).keepalive_idle, secs(15));
        assert_eq!(
            options(&["-tcp-keepalive-time", "-1s"]).keepalive_idle,
            None
        );
        assert_eq!(
            options(&["--tcp-keepalive-time=2m"]).keepalive_idle,
            secs(120)
        );
        assert_eq!(options(&["-tcp-user-timeout", "0"]).user_timeout, None);
        assert_eq!(
            options(&["-tcp-user-timeout=1.5s"]).user_timeout,
            Some(Duration::from_millis(1500))
        );
        // derper fails to listen with a negative user timeout; derpd says why at once.
        let err = try_parse_from(["derpd", "-tcp-user-timeout=-1s"]).unwrap_err();
        assert!(err.contains("negative"), "{err}");
    }

    #[test]
    fn mesh_and_restart_flags_parse() {
        let cli = try_parse_from([
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
            "-upgrade-timeout=2m",
        ])
        .expect("parses");
        assert_eq!(cli.upgrade_timeout, Duration::from_secs(120));
        assert_eq!(cli.mesh_with, "a.example,b.example/10.0.0.2");
        assert_eq!(cli.drain_timeout, Duration::from_secs(30));
        assert_eq!(cli.restart_reconnect_in, Duration::from_millis(1500));
        assert_eq!(cli.restart_try_for, Duration::from_secs(300));
        let defaults = try_parse_from(["derpd"]).expect("parses");
        assert_eq!(defaults.drain_timeout, Duration::from_secs(10));
        assert_eq!(defaults.restart_reconnect_in, Duration::from_secs(2));
        assert_eq!(defaults.restart_try_for, Duration::from_secs(60));
        assert_eq!(defaults.upgrade_timeout, Duration::from_secs(30));
        assert!(try_parse_from(["derpd", "--restart-try-for", "1200h"]).is_err());
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
        let read = |rel: &str| std::fs::read_to_string(format!("{root}{rel}")).expect(rel);
        let unit = read("systemd/derpd.service");
        let k8s = read("kubernetes/base/statefulset.yaml");
        let deb_unit = read("debian/derpd.service");
        let deb_flags = read("debian/default");
        for (what, drain, stop) in [
            (
                "systemd",
                value_after(&unit, "    --drain-timeout"),
                value_after(&unit, "TimeoutStopSec"),
            ),
            (
                "the Debian package",
                value_after(&deb_flags, "\n --drain-timeout"),
                value_after(&deb_unit, "TimeoutStopSec"),
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
