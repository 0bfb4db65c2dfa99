//! `derpd --check`: what a start would read and decide, without doing any of it.
//!
//! Each step calls the same functions the start does (listen address, home page, key file,
//! certificates, mesh key and siblings, CA files), stopping short of their side effects: no
//! socket is bound, no file is written (a missing key file or self-signed certificate is
//! reported as "would create"), and nothing is contacted (no ACME order) but the system's
//! resolver, for a host name in `-a`, as a start would.
//! Every problem is reported, not only the first, and any one makes the exit status 1.

use std::path::Path;
use std::process::ExitCode;

use derp_proto::SecretKey;

use crate::cli::Cli;

mod tls;
use crate::tls_setup::CertMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Ok,
    Warn,
    Error,
}

#[derive(Debug, Default)]
struct Report {
    lines: Vec<(Level, String, String)>,
}

impl Report {
    fn ok(&mut self, what: &str, text: impl Into<String>) {
        self.lines.push((Level::Ok, what.to_owned(), text.into()));
    }

    fn warn(&mut self, what: &str, text: impl Into<String>) {
        self.lines.push((Level::Warn, what.to_owned(), text.into()));
    }

    fn error(&mut self, what: &str, err: impl std::fmt::Display) {
        self.lines
            .push((Level::Error, what.to_owned(), format!("{err:#}")));
    }

    fn errors(&self) -> usize {
        self.lines.iter().filter(|l| l.0 == Level::Error).count()
    }

    fn print(&self) {
        for (level, what, text) in &self.lines {
            let tag = match level {
                Level::Ok => "ok   ",
                Level::Warn => "warn ",
                Level::Error => "ERROR",
            };
            println!("{tag} {what:<9} {text}");
        }
    }
}

/// Runs the check, prints the report on stdout and returns the exit status.
pub(crate) fn run(cli: &Cli) -> ExitCode {
    let mut r = Report::default();
    check(cli, &mut r);
    r.print();
    match r.errors() {
        0 => {
            println!("derpd --check: the configuration is usable (nothing was bound or written)");
            ExitCode::SUCCESS
        }
        n => {
            println!("derpd --check: {n} error(s); derpd would not start");
            ExitCode::FAILURE
        }
    }
}

fn check(cli: &Cli, r: &mut Report) {
    if cli.dev {
        r.ok(
            "mode",
            "--dev: plain HTTP on 127.0.0.1:3340 unless --addr says otherwise",
        );
    }

    // The listeners: a host name is looked up, as a start would.
    let addr_text = crate::listen_addr_text(cli);
    let listen = match crate::listen::ListenAddr::parse(&addr_text) {
        Ok(listen) => Some(listen),
        Err(e) => {
            r.error("listen", format!("{e:#}"));
            None
        }
    };
    let tls = listen.as_ref().is_some_and(|l| cli.tls.tls_enabled(l));
    // Flags that cannot act with the rest; without a listen address TLS is not known.
    let review = listen
        .as_ref()
        .map(|l| crate::combinations::review(cli, tls, l.port))
        .unwrap_or_default();
    for e in &review.errors {
        r.error("flags", e);
    }
    for note in &review.ignored {
        r.warn("flags", note);
    }
    let bind = listen.as_ref().and_then(|l| match l.resolve() {
        Ok(ip) => Some((ip, l.port)),
        Err(e) => {
            r.error("listen", format!("{e:#}"));
            None
        }
    });
    if let Some((ip, port)) = bind {
        let proto = if tls {
            format!("TLS for {}", cli.tls.hostname)
        } else {
            "plain HTTP".to_owned()
        };
        let every = if ip == crate::listen::BindIp::Any {
            "every interface, IPv4 and IPv6; "
        } else {
            ""
        };
        r.ok(
            "listen",
            format!(
                "{}/tcp ({every}{proto}; --addr {addr_text}), would bind",
                ip.describe(port)
            ),
        );
        match crate::quic_port(cli, tls, port) {
            Some(port) => r.ok(
                "quic",
                format!("{}/udp (DERP over QUIC), would bind", ip.describe(port)),
            ),
            None if crate::quic_yields_to_stun(cli, tls, port) => r.warn(
                "quic",
                format!("off: STUN has UDP port {port} (--quic-port picks another)"),
            ),
            None => r.ok("quic", "off"),
        }
        if cli.stun {
            r.ok(
                "stun",
                format!("{}/udp, would bind", ip.describe(cli.stun_port)),
            );
        } else {
            r.ok("stun", "off (--stun=false)");
        }
        if tls {
            match cli.tls.http_port() {
                Ok(Some(port)) => r.ok(
                    "http",
                    format!(
                        "{}/tcp: /generate_204, ACME HTTP-01, redirects, would bind",
                        ip.describe(port)
                    ),
                ),
                Ok(None) => r.ok("http", "port-80 listener off (--http-port -1)"),
                Err(e) => r.error("http", e),
            }
        }
    }
    if let Some((ip, port)) = bind {
        let quic = crate::quic_port(cli, tls, port).is_some();
        check_proxies(cli, ip.ip(), tls, quic, r);
    }
    match cli.metrics_addr {
        Some(addr) => r.ok(
            "metrics",
            format!("{addr}/tcp: /metrics, /derp/probe (readiness), /healthz, would bind"),
        ),
        None => r.ok(
            "metrics",
            "no --metrics-addr: /debug/varz on the main listener only",
        ),
    }
    if let Err(e) = crate::parse_home(&cli.home) {
        r.error("home", e);
    }

    // The key: the node's identity.
    let key = check_key(cli, r);

    if tls && !review.errors.is_empty() {
        r.warn(
            "tls",
            "certificates not looked at: the flags above do not go together",
        );
    } else if tls {
        tls::check_tls(cli, &key, listen.as_ref().map_or(443, |l| l.port), r);
    } else if cli.tls.certmode == CertMode::Manual {
        // tls_enabled is true for manual mode; only a bad --addr gets here.
    } else {
        r.ok(
            "tls",
            "off: the port is not written 443 or https and --certmode is not manual",
        );
    }

    check_mesh(cli, r);
    r.ok(
        "workers",
        crate::workers::Workers::of(cli.workers).describe(),
    );
    check_limits(cli, r);
    check_bootstrap_dns(cli, r);
    for e in cli.compat.errors(cli.dev) {
        r.error("derper", e);
    }
    for note in cli.compat.ignored(cli.dev) {
        r.ok("derper", note);
    }

    r.ok(
        "relay",
        format!(
            "DERP {}, send queues {} deep, write timeout {}, lookup mirror {}",
            if cli.derp { "on" } else { "off (--derp=false)" },
            cli.send_queue_depth,
            if cli.tcp_write_timeout.is_zero() {
                "none".to_owned()
            } else {
                format!("{:?}", cli.tcp_write_timeout)
            },
            if cli.peer_mirror { "on" } else { "off" },
        ),
    );
    let tcp = cli.tcp_options();
    r.ok(
        "tcp",
        format!(
            "client connections: keepalive {}, user timeout {}",
            match tcp.keepalive_idle {
                Some(idle) if idle > derp_server::MAX_KEEPALIVE_IDLE => format!(
                    "after {:?} idle, the most Linux takes, not {idle:?} (then every 15s, 9 probes)",
                    derp_server::MAX_KEEPALIVE_IDLE
                ),
                Some(idle) => format!("after {idle:?} idle (then every 15s, 9 probes)"),
                None => "off (--tcp-keepalive-time < 0)".to_owned(),
            },
            match tcp.user_timeout {
                Some(t) => format!("{t:?}"),
                None => "the kernel's (none)".to_owned(),
            }
        ),
    );
    check_upgrade(cli, bind, tls, r);
    r.ok(
        "shutdown",
        format!(
            "SIGTERM: Restarting frame (reconnect in {:?}, try for {:?}), drain up to {:?}, \
             exit within {:?}: stop timeouts must be longer",
            cli.restart_reconnect_in,
            cli.restart_try_for,
            cli.drain_timeout,
            cli.drain_timeout + crate::CLOSE_GRACE,
        ),
    );
}

/// What SIGUSR2 would do to a derpd started as this `--check` was (the same path, working
/// directory and `PATH`): which file it starts, and what it hands that process (the
/// listeners these flags bind; never, yet, the client connections).
fn check_upgrade(cli: &Cli, bind: Option<(crate::listen::BindIp, u16)>, tls: bool, r: &mut Report) {
    let exe = match crate::upgrade::executable() {
        Ok(exe) => exe,
        Err(e) => {
            r.warn(
                "upgrade",
                format!("SIGUSR2 cannot upgrade in place: {e:#}; restart instead"),
            );
            return;
        }
    };
    let mut handed = Vec::new();
    if let Some((ip, port)) = bind {
        handed.push(format!("{}/tcp", ip.describe(port)));
        if tls && let Ok(Some(http)) = cli.tls.http_port() {
            handed.push(format!("{}/tcp (port 80)", ip.describe(http)));
        }
        if cli.stun {
            handed.push(format!("{}/udp (STUN)", ip.describe(cli.stun_port)));
        }
        if let Some(quic) = crate::quic_port(cli, tls, port) {
            handed.push(format!("{}/udp (QUIC)", ip.describe(quic)));
        }
    }
    if let Some(addr) = cli.metrics_addr {
        handed.push(format!("{addr}/tcp (metrics)"));
    }
    let conns = if !cli.upgrade_connections {
        "Client connections are not handed over (--upgrade-connections=false): each is told \
         to reconnect (Restarting) and drained, as on SIGTERM"
    } else if tls && matches!(cli.tls.tls_records, crate::tls_setup::TlsRecordsArg::Rustls) {
        "Client connections stay with the running derpd and are told to reconnect: TLS on \
         rustls's records (--tls-records rustls) and QUIC cannot go across"
    } else {
        "Client connections go across with their state, unnoticed by their clients (QUIC \
         ones are told to reconnect and drained, as on SIGTERM)"
    };
    r.ok(
        "upgrade",
        format!(
            "SIGUSR2 to a derpd started as this one was starts {} (found by {}) with these \
             flags and hands it {}; it has {:?} to serve on them (--upgrade-timeout), else the \
             running derpd keeps them. {conns}",
            exe.path.display(),
            exe.source,
            handed.join(", "),
            cli.upgrade_timeout,
        ),
    );
}

/// The PROXY protocol and forwarded headers; and STUN and QUIC, which a TCP balancer does not
/// carry: they listen on --addr's IP, so with the PROXY protocol on, that IP must be one
/// clients reach over UDP themselves. Loopback never is (a warning); a private address is
/// only where something forwards UDP to it (a warning that says so); all addresses or a
/// public one is (a note of how clients must reach them).
fn check_proxies(cli: &Cli, ip: std::net::IpAddr, tls: bool, quic: bool, r: &mut Report) {
    if cli.proxy_protocol {
        let listeners = if tls && cli.tls.http_port >= 0 {
            "--addr and --http-port"
        } else {
            "--addr"
        };
        r.ok(
            "proxy",
            format!(
                "PROXY protocol (v1, v2) required on {listeners}, from {} only; /debug/varz \
                 is not served there (use --metrics-addr)",
                crate::cidrs_text(&cli.proxy_protocol_from)
            ),
        );
    }
    if !cli.trust_forwarded_from.is_empty() {
        r.ok(
            "proxy",
            format!(
                "{} (and no other header) names DERP clients on connections from {}",
                derp_server::ForwardedHeader::from(cli.forwarded_header).name(),
                crate::cidrs_text(&cli.trust_forwarded_from)
            ),
        );
    }
    let mut udp = Vec::new();
    if cli.stun {
        udp.push(format!("STUN on {}/udp", cli.stun_port));
    }
    if quic {
        udp.push("QUIC".to_owned());
    }
    if !cli.proxy_protocol || udp.is_empty() {
        return;
    }
    let udp = udp.join(" and ");
    let off = "or turn them off (--stun=false, --quic-port=-1)";
    match udp_reach(ip) {
        UdpReach::Nobody => r.warn(
            "proxy",
            format!(
                "{udp} listen on {ip}, which no client can reach: a TCP balancer does not \
                 carry UDP. Listen on all addresses (--addr :PORT; the TCP port still takes \
                 only the balancers) or a public one, {off}"
            ),
        ),
        UdpReach::Forwarded => r.warn(
            "proxy",
            format!(
                "{udp} listen on the private address {ip}, which clients reach only if the \
                 balancer or a NAT forwards UDP to it as it is (never through the PROXY \
                 protocol); otherwise listen on a public address, {off}"
            ),
        ),
        UdpReach::Direct => r.ok(
            "proxy",
            format!(
                "{udp} listen on {} directly, not through the balancer: clients need this \
                 host's public address on UDP",
                ip_text(ip)
            ),
        ),
    }
}

/// Who can send UDP to an address derpd listens on.
#[derive(Debug, PartialEq, Eq)]
enum UdpReach {
    /// Only this host (loopback).
    Nobody,
    /// Clients on the internet only through a forward (a private, shared or link-local
    /// address).
    Forwarded,
    /// Clients directly (all addresses, or a public one).
    Direct,
}

fn udp_reach(ip: std::net::IpAddr) -> UdpReach {
    use std::net::IpAddr;
    let ip = ip.to_canonical();
    if ip.is_loopback() {
        return UdpReach::Nobody;
    }
    let forwarded = match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_private() || v4.is_link_local() || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80
        }
    };
    if forwarded {
        UdpReach::Forwarded
    } else {
        UdpReach::Direct
    }
}

/// The bootstrap DNS lists: nothing in them can be wrong before they are looked up (a name
/// that does not resolve is left out and retried), so this says what would be served.
fn check_bootstrap_dns(cli: &Cli, r: &mut Report) {
    let config = crate::bootstrap::config(cli);
    if config.published.is_empty() && config.unpublished.is_empty() {
        r.ok(
            "bootstrap",
            "no names: /bootstrap-dns serves an empty document",
        );
        return;
    }
    let count = |list: &str| {
        if list.is_empty() {
            0
        } else {
            list.split(',').count()
        }
    };
    r.ok(
        "bootstrap",
        format!(
            "/bootstrap-dns: {} published and {} unpublished name(s), resolved at start and \
             every 10 minutes (not looked up now)",
            count(&config.published),
            count(&config.unpublished)
        ),
    );
    let lists = [config.published.as_str(), config.unpublished.as_str()];
    for entry in lists
        .iter()
        .filter(|l| !l.is_empty())
        .flat_map(|l| l.split(','))
    {
        let name = entry.split_once('/').map_or(entry, |(name, _)| name);
        if name.is_empty() || name.trim() != name {
            r.warn(
                "bootstrap",
                format!(
                    "entry {entry:?} is looked up as written (empty or with spaces) and will fail"
                ),
            );
        }
    }
}

fn ip_text(ip: std::net::IpAddr) -> String {
    match ip {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    }
}

/// Reads the key file as a start would, without creating it. Returns the key to check the
/// rest with (a throwaway one when the start would create or generate it).
fn check_key(cli: &Cli, r: &mut Report) -> SecretKey {
    let fresh = || SecretKey::generate(&mut rand::rngs::OsRng);
    let path = match crate::key_path(cli) {
        Ok(Some(path)) => path,
        Ok(None) => {
            r.ok("key", "a fresh key for this run (--dev without -c)");
            return fresh();
        }
        Err(e) => {
            r.error("key", e);
            return fresh();
        }
    };
    match std::fs::read(&path) {
        Ok(bytes) => match SecretKey::from_key_file(&bytes) {
            Ok(key) => {
                r.ok(
                    "key",
                    format!("{}: public key {}", path.display(), key.public_key()),
                );
                check_private(&path, r);
                key
            }
            Err(e) => {
                r.error("key", format!("config file {}: {e}", path.display()));
                fresh()
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match creatable(&path) {
                Ok(()) => r.ok(
                    "key",
                    format!(
                        "{} does not exist: would create it with a new key (mode 0600)",
                        path.display()
                    ),
                ),
                Err(why) => r.error(
                    "key",
                    format!(
                        "{} does not exist and cannot be created: {why}",
                        path.display()
                    ),
                ),
            }
            fresh()
        }
        Err(e) => {
            r.error(
                "key",
                format!("reading config file {}: {e}", path.display()),
            );
            fresh()
        }
    }
}

/// Warns when the key file can be read by others than its owner.
fn check_private(path: &Path, r: &mut Report) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        r.warn(
            "key",
            format!(
                "{} is readable by group or others (mode {:o}); chmod 600 it",
                path.display(),
                meta.permissions().mode() & 0o777
            ),
        );
    }
}

/// Whether a start could create `path`: the nearest directory that exists on the way to it
/// must be a directory this process may write to (by its mode bits; a read-only mount or an
/// access control list is found only by the start itself).
pub(super) fn creatable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let mut dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let meta = loop {
        match std::fs::metadata(&dir) {
            Ok(meta) => break meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !dir.pop() {
                    return Err(format!("no existing directory above {}", path.display()));
                }
                if dir.as_os_str().is_empty() {
                    dir.push(".");
                }
            }
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        }
    };
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let Some(ids) = crate::effective_ids() else {
        return Ok(());
    };
    let mode = meta.mode();
    let writable = ids.uid == 0
        || if meta.uid() == ids.uid {
            mode & 0o200 != 0
        } else if meta.gid() == ids.gid || ids.groups.contains(&meta.gid()) {
            mode & 0o020 != 0
        } else {
            mode & 0o002 != 0
        };
    if writable {
        Ok(())
    } else {
        Err(format!("{} is not writable by this user", dir.display()))
    }
}

/// The admission checks and limits, configured exactly as a start would (files read and
/// parsed, the admission URL and its TLS roots prepared), into a throwaway config: nothing
/// is asked of the admission server or the local tailscaled.
fn check_limits(cli: &Cli, r: &mut Report) {
    let args = &cli.limits;
    // Any identity will do: only the limits' fields are filled in and read.
    let mut config = derp_server::ServerConfig::new(SecretKey::from_bytes([1; 32]));
    if let Err(e) = crate::limits::configure(args, &mut config, &prometheus::Registry::new()) {
        r.error("admission", e);
        return;
    }
    let mut checks = Vec::new();
    if let Some(path) = &args.allow_keys_file {
        checks.push(format!("the keys in {}", path.display()));
    }
    if args.verify_clients {
        checks.push(format!(
            "peers of the local tailscaled ({})",
            args.socket().display()
        ));
    }
    if let Some(url) = &args.verify_client_url {
        checks.push(format!(
            "{url} ({})",
            if args.verify_client_url_fail_open {
                "fail open"
            } else {
                "fail closed"
            }
        ));
    }
    r.ok(
        "admission",
        if checks.is_empty() {
            "every client (no --allow-keys-file, --verify-clients or --verify-client-url)"
                .to_owned()
        } else {
            format!("only {}", checks.join(", then "))
        },
    );
    let mut limits = Vec::new();
    match config.rate_limit {
        Some(l) if l.bytes_per_sec > 0 => limits.push(format!(
            "receive {} bytes/s per client, burst {}",
            l.bytes_per_sec, l.burst_bytes
        )),
        _ => limits.push("no per-client receive limit".to_owned()),
    }
    if let Some(a) = config.limits.accept_rate {
        limits.push(format!("accept {}/s, burst {}", a.per_sec, a.burst));
    }
    if let Some(n) = config.limits.max_connections {
        limits.push(format!("at most {n} connections"));
    }
    r.ok("limits", limits.join("; "));
    if config.limits.accept_rate.is_none() && args.accept_connection_burst.is_some() {
        r.warn(
            "limits",
            "--accept-connection-burst has no effect without --accept-connection-limit",
        );
    }
}

fn check_mesh(cli: &Cli, r: &mut Report) {
    let mesh_key = match crate::mesh_key(cli) {
        Ok(k) => k,
        Err(e) => {
            r.error("mesh", e);
            return;
        }
    };
    let link_key = crate::mesh_link_key(cli, mesh_key.as_ref());
    let siblings = match derp_mesh::parse_mesh_with(&cli.mesh_with) {
        Ok(s) => s,
        Err(e) => {
            r.error("mesh", format!("--mesh-with: {e}"));
            return;
        }
    };
    if let Err(e) = link_key {
        r.error("mesh", e);
        return;
    }
    if siblings.is_empty() {
        r.ok(
            "mesh",
            match mesh_key {
                Some(_) => "no --mesh-with: not meshing (the mesh key lets siblings in)",
                None => "off (no --mesh-with, no mesh key)",
            },
        );
    } else {
        let list = siblings
            .iter()
            .map(|s| match &s.dial {
                Some(dial) => format!("{} via {}", s.url, dial_text(dial)),
                None => s.url.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ");
        r.ok(
            "mesh",
            format!(
                "{} entries, each dialed (an entry that turns out to be this node, by the key \
                 that answers, is dropped): {list}",
                siblings.len(),
            ),
        );
    }
    let needs_tls = siblings.iter().any(|s| s.url.scheme().is_tls());
    match &cli.mesh_ca_file {
        Some(path) => match crate::mesh_tls_with_file(path) {
            Ok((_, summary)) => r.ok(
                "mesh",
                format!(
                    "trust: {} system CA certificate(s){} and {} from {}",
                    summary.system,
                    if summary.fallback {
                        " (none found: Mozilla's roots stand in)"
                    } else {
                        ""
                    },
                    summary.extra,
                    path.display()
                ),
            ),
            Err(e) => r.error("mesh", e),
        },
        None if needs_tls => match derp_mesh::mesh_tls_config(&[]) {
            Ok((_, summary)) if summary.fallback => r.warn(
                "mesh",
                "no system CA certificates found: https links would trust Mozilla's roots",
            ),
            Ok((_, summary)) => r.ok(
                "mesh",
                format!(
                    "trust: {} system CA certificate(s) for https links",
                    summary.system
                ),
            ),
            Err(e) => r.error("mesh", format!("mesh trust store: {e}")),
        },
        None => {}
    }
}

fn dial_text(dial: &derp_mesh::DialHost) -> String {
    match dial {
        derp_mesh::DialHost::Addr(a) => a.to_string(),
        derp_mesh::DialHost::Name(name, port) => format!("{name}:{port} (resolved when dialing)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_behind_a_balancer_is_reachable_on_all_or_public_addresses_only() {
        let reach = |s: &str| udp_reach(s.parse().expect("ip"));
        for s in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(reach(s), UdpReach::Nobody, "{s}");
        }
        for s in [
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.1.1",
        ] {
            assert_eq!(reach(s), UdpReach::Forwarded, "{s}");
        }
        for s in ["fd00::1", "fe80::1"] {
            assert_eq!(reach(s), UdpReach::Forwarded, "{s}");
        }
        for s in ["0.0.0.0", "::", "203.0.113.1", "2001:db8::1", "100.128.0.1"] {
            assert_eq!(reach(s), UdpReach::Direct, "{s}");
        }
    }

    #[test]
    fn creatable_walks_up_to_an_existing_directory() {
        let dir = std::env::temp_dir().join(format!("derpd-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        assert!(creatable(&dir.join("a/b/derper.key")).is_ok());
        let file = dir.join("file");
        std::fs::write(&file, b"x").expect("file");
        assert!(creatable(&file.join("derper.key")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
