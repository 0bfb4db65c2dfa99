//! derpd: a DERP relay server that Tailscale clients can use in place of derper.

mod bootstrap;
mod check;
mod cli;
mod combinations;
mod compat;
mod debug_pages;
mod duration;
mod goflags;
mod keyfile;
mod limits;
mod listen;
mod sd_notify;
mod tls_setup;
mod upgrade;
mod workers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use derp_proto::{MeshKey, SecretKey};
use derp_server::{HomePage, LookupConfig, PeerCacheConfig, Server, ServerConfig};
use tracing::{info, warn};

use crate::cli::{Cli, LogFormat};
use crate::upgrade::sockets::Sockets;
use crate::upgrade::wire::ListenerKind;
use crate::workers::Workers;

fn main() -> ExitCode {
    let cli = match cli::parse(std::env::args_os()) {
        Ok(cli::Invocation::Run(cli)) => *cli,
        Ok(cli::Invocation::Help(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(line) => {
            // One line, not a usage block: operators read these in journald.
            eprintln!("derpd: {line} (see derpd --help)");
            return ExitCode::from(2);
        }
    };
    if cli.version {
        println!("derpd {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    if cli.check {
        return check::run(&cli);
    }
    init_logging(cli.log_format);
    let workers = Workers::of(cli.workers);
    let runtime = match workers.runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("derpd: starting runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli, workers)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("derpd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(cli: Cli, workers: Workers) -> anyhow::Result<()> {
    ignore_sighup_by_default();
    if let Some((from, to)) = derp_server::raise_descriptor_limit() {
        info!(
            from,
            to, "raised the open-descriptor limit to the hard limit"
        );
    }
    // Before anything can take long: SIGUSR2's default action ends the process.
    let mut upgrades = upgrade::UpgradeSignal::new()?;
    // At start-up, while the file at that path is still the one running.
    let exe = upgrade::executable();
    let (takeover, sockets) = match upgrade::takeover_from_env()? {
        Some((takeover, handed)) => (Some(takeover), Sockets::adopting(handed)),
        None => (None, Sockets::bind_here()),
    };
    let node = Node {
        readiness: upgrade::Readiness::new(
            sd_notify::Notifier::from_env(),
            takeover.clone(),
            sockets.clone(),
        ),
        sockets,
        exe,
        workers,
    };
    let result = serve_node(cli, node, &mut upgrades).await;
    if let (Err(e), Some(takeover)) = (&result, &takeover) {
        // The old process keeps serving; it logs this too.
        takeover.refuse(&format!("{e:#}"));
    }
    result
}

/// What a start sets up before the flags are read: where its sockets come from, whom it
/// tells that it serves, and the file an upgrade starts.
struct Node {
    readiness: upgrade::Readiness,
    sockets: Sockets,
    exe: anyhow::Result<upgrade::Executable>,
    workers: Workers,
}

async fn serve_node(
    cli: Cli,
    node: Node,
    upgrades: &mut upgrade::UpgradeSignal,
) -> anyhow::Result<()> {
    let Node {
        readiness,
        sockets,
        exe,
        workers,
    } = node;
    let notify = readiness.notifier().clone();
    if let Some(e) = cli.compat.errors(cli.dev).into_iter().next() {
        bail!("{e}");
    }
    for note in cli.compat.ignored(cli.dev) {
        info!("{note}");
    }
    let listen = listen::ListenAddr::parse(&listen_addr_text(&cli))?;
    let tls = cli.tls.tls_enabled(&listen);
    let review = combinations::review(&cli, tls, listen.port);
    if !review.errors.is_empty() {
        bail!("{}", review.errors.join("; "));
    }
    for note in &review.ignored {
        warn!("{note}");
    }
    let quic_port = quic_port(&cli, tls, listen.port);
    if quic_yields_to_stun(&cli, tls, listen.port) {
        warn!(
            port = listen.port,
            "DERP over QUIC is off: STUN has its UDP port (--quic-port picks another)"
        );
    }
    let bind_ip = listen.resolve()?;
    let home = parse_home(&cli.home)?;
    let mesh_key = mesh_key(&cli)?;
    let siblings = derp_mesh::parse_mesh_with(&cli.mesh_with)
        .map_err(|e| anyhow::anyhow!("--mesh-with: {e}"))?;
    let mesh_key_for_links = mesh_link_key(&cli, mesh_key.as_ref())?;
    let mesh_tls = match &cli.mesh_ca_file {
        Some(path) => Some(mesh_tls(path)?),
        None if siblings.iter().any(|s| s.url.scheme().is_tls()) => Some(mesh_tls_system()?),
        None => None,
    };
    // Last of the checks above, since a missing key file is created: a bad flag or file
    // must not leave a new key behind.
    let secret_key = load_key(&cli)?;

    // The node's, so that a restarted or upgraded process's QUIC resets end the previous
    // process's connections at once.
    let reset_secret = derp_server::quic::ResetSecret::from_node_key(&secret_key);
    let mut config = ServerConfig::new(secret_key.clone());
    config.home = home;
    config.derp_enabled = cli.derp;
    config.send_queue_depth = cli.send_queue_depth as usize;
    config.write_timeout = (!cli.tcp_write_timeout.is_zero()).then_some(cli.tcp_write_timeout);
    config.tcp = cli.tcp_options();
    config.mesh_key = mesh_key;
    config.lookup = LookupConfig {
        mirror: cli.peer_mirror,
        peer_cache: PeerCacheConfig::from_flags(
            cli.peer_cache_max_entries,
            cli.peer_cache_max_idle,
        ),
    };
    config.debug_allow = cli.debug_allow_cidr.clone();
    config.proxy_protocol = cli.proxy_protocol.then(|| cli.proxy_protocol_from.clone());
    config.trust_forwarded_from = cli.trust_forwarded_from.clone();
    config.forwarded_header = cli.forwarded_header.into();
    if cli.proxy_protocol {
        info!(
            from = %cidrs_text(&cli.proxy_protocol_from),
            "PROXY protocol: every TCP connection opens with a header from these balancers only"
        );
    }
    if !cli.trust_forwarded_from.is_empty() {
        info!(
            from = %cidrs_text(&cli.trust_forwarded_from),
            header = config.forwarded_header.name(),
            "a forwarded header names DERP clients on connections from these proxies"
        );
    }
    config.packet_metrics = cli.packet_metrics;
    debug_pages::configure(&cli, tls, &mut config);

    let registry = prometheus::Registry::new();
    let bootstrap_dns = bootstrap::bootstrap_dns(&cli, &registry)?;
    config.bootstrap_dns = Some(bootstrap_dns.clone());
    let reloads = limits::configure(&cli.limits, &mut config, &registry)?;
    let server = Server::new(config, &registry).context("creating server")?;
    reloads.spawn(&server);
    readiness.take_connections_into(server.clone());
    let backlog = cli.limits.listen_backlog;
    let listener = sockets.tcp(
        ListenerKind::Main,
        bind_ip.with_port(listen.port),
        backlog,
        || listen::bind_main(bind_ip, listen.port, backlog),
    )?;
    let local = listener.local_addr()?;
    info!(workers = workers.count, "{}", workers.describe());
    if !tls {
        info!(addr = %local, key = %server.public_key(), dev = cli.dev, "derpd listening (plain HTTP)");
    }

    let mesh = match mesh_key_for_links {
        Some(key) => {
            let mut mesh_config = derp_mesh::MeshConfig::new(secret_key, key);
            mesh_config.tls = mesh_tls;
            mesh_config.ping_interval =
                Some(cli.mesh_ping_interval).filter(|interval| !interval.is_zero());
            // Siblings take what this node takes: with the PROXY protocol on, a link that
            // dials one directly must open with a header too.
            mesh_config.proxy_header = cli.proxy_protocol;
            info!(siblings = %cli.mesh_with, "meshing");
            let mesh = std::sync::Arc::new(
                derp_mesh::Mesh::start(&server, mesh_config, siblings, &registry)
                    .context("starting the mesh")?,
            );
            readiness.settle_mesh_first(mesh.clone());
            Some(mesh)
        }
        None => None,
    };

    let mut background = tokio::task::JoinSet::<()>::new();
    // The tasks that serve STUN's socket and the metrics listener, ended when a successor
    // takes them over.
    let mut listening = tokio::task::JoinSet::<Result<(), derp_server::ServeError>>::new();
    if cli.stun {
        let stun_addr = with_port(local, cli.stun_port);
        let socket = sockets
            .udp(ListenerKind::Stun, stun_addr, || {
                Ok(derp_server::bind_stun(stun_addr)?.into_std()?)
            })
            .with_context(|| format!("binding STUN on {stun_addr}"))?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        info!(addr = %socket.local_addr()?, "STUN listening");
        let metrics = derp_server::StunMetrics::new(&registry).context("STUN metrics")?;
        let stun_config = derp_server::StunConfig {
            answer_generic: cli.stun_answer_generic,
        };
        let token = server.shutdown_token();
        let r = readiness.clone();
        listening.spawn(async move {
            r.may_serve().await;
            derp_server::serve_stun(socket, stun_config, metrics, token.cancelled_owned()).await;
            Ok(())
        });
    }
    let token = server.shutdown_token();
    background.spawn(async move { bootstrap_dns.run(token).await });
    if let Some(addr) = cli.metrics_addr {
        let metrics_listener = sockets
            .tcp(ListenerKind::Metrics, addr, backlog, || {
                Ok(limits::bind(addr, backlog)?)
            })
            .with_context(|| format!("listening for metrics on {addr}"))?;
        info!(addr = %metrics_listener.local_addr()?, "metrics listening at /metrics");
        let (server, r) = (server.clone(), readiness.clone());
        listening.spawn(async move {
            r.may_serve().await;
            server.serve_metrics(metrics_listener).await
        });
    }

    let mut signals = ShutdownSignals::new()?;
    // Ends the accept loops (the serve future then returns): a handover or a shutdown awaits
    // that, so that nothing is accepted once it is logged.
    let stop_accepting = tokio_util::sync::CancellationToken::new();
    let mut serve = Box::pin(async {
        if tls {
            let quic = quic_port.map(|port| {
                let config = derp_server::QuicConfig {
                    congestion: cli.quic_congestion,
                    reset_secret: Some(reset_secret.clone()),
                    ..Default::default()
                };
                (port, config)
            });
            let extras = acme_extras(&cli);
            let listeners = tls_setup::TlsListeners {
                main: listener,
                quic,
                backlog,
                sockets: sockets.clone(),
                stop: stop_accepting.clone(),
            };
            tls_setup::run_tls(&server, &registry, &cli.tls, &extras, listeners, &readiness).await
        } else {
            server.set_ready(true);
            // The listener is bound and listening (as are STUN's and the metrics one): a
            // connection made now is accepted.
            readiness.ready(format!("serving DERP over plain HTTP on {local}"));
            tokio::select! {
                () = readiness.may_serve() => {}
                () = stop_accepting.cancelled() => return Ok(()),
            }
            server
                .serve_until(listener, stop_accepting.clone())
                .await
                .context("serving")
        }
    });
    let mut upgrader =
        upgrade::Upgrader::new(exe, cli.upgrade_timeout, sockets.clone(), notify.clone());
    if cli.upgrade_connections {
        upgrader = upgrader.with_connections(server.clone());
    }
    let mut attempt = None;
    let handed_to = loop {
        tokio::select! {
            r = &mut serve => {
                r?;
                // The listener ended without a signal: nothing left to drain for.
                server.shutdown().await;
                if let Some(mesh) = &mesh {
                    mesh.shutdown().await;
                }
                return Ok(());
            }
            _ = signals.recv() => {
                let Some(committed) = attempt.take().filter(|_| !upgrader.cancel()) else {
                    // Dropped below: the new process is killed and reaped.
                    break None;
                };
                // The new process is the service, or about to be: let the handover end
                // (within the wait for its Done) rather than kill it.
                info!("signal during an upgrade that is committed: finishing the handover first");
                tokio::select! {
                    outcome = committed => match outcome {
                        upgrade::Outcome::HandedOver { pid, conns } => break Some((pid, conns)),
                        upgrade::Outcome::Failed(e) => {
                            warn!(error = %format!("{e:#}"), "upgrade failed");
                            break None;
                        }
                    },
                    _ = signals.recv() => {
                        eprintln!("derpd: second signal: exiting without draining");
                        std::process::exit(SECOND_SIGNAL_EXIT);
                    }
                }
            }
            () = upgrades.recv() => {
                if attempt.is_some() {
                    info!("SIGUSR2 ignored: an upgrade is under way");
                } else if readiness.taking_over() {
                    info!("SIGUSR2 ignored: this process is still taking over from the last one");
                } else {
                    info!("SIGUSR2: upgrading in place");
                    attempt = Some(Box::pin(upgrader.run()));
                }
            }
            outcome = async { attempt.as_mut().expect("polled only while under way").await },
                if attempt.is_some() =>
            {
                attempt = None;
                match outcome {
                    upgrade::Outcome::HandedOver { pid, conns } => break Some((pid, conns)),
                    upgrade::Outcome::Failed(e) => warn!(
                        error = %format!("{e:#}"),
                        "upgrade failed; this process keeps every listener and goes on serving"
                    ),
                }
            }
        }
    };
    // A signal during an upgrade not yet committed ends it: the new process is killed and
    // reaped.
    drop(attempt);
    // Stop accepting first: the listeners (and, in TLS mode, their side tasks) end and are
    // closed before anything is logged or told.
    stop_accepting.cancel();
    // Bounded, as the drain is, so that the stop timeouts in the deploy files hold whatever
    // a listener's task does; a second signal exits at once here too.
    tokio::select! {
        ended = tokio::time::timeout(CLOSE_GRACE, &mut serve) => match ended {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %format!("{e:#}"), "the listeners ended with an error"),
            Err(_) => warn!("the listeners did not end in time; dropped"),
        },
        _ = signals.recv() => {
            eprintln!("derpd: second signal: exiting without draining");
            std::process::exit(SECOND_SIGNAL_EXIT);
        }
    }
    drop(serve);
    match handed_to {
        Some((pid, conns)) => {
            // The successor accepts on every port now; this process's copies are closed so
            // that it accepts and reads nothing more. systemd hears nothing from it: the
            // successor is the main process.
            listening.abort_all();
            while listening.join_next().await.is_some() {}
            // The QUIC endpoints serve their own clients through the drain, but the rest of
            // what reaches their sockets is the successor's.
            server.udp_handed_over();
            sockets.release();
            info!(
                to = pid,
                handed = conns,
                staying = server.local_clients(),
                drain_timeout = ?cli.drain_timeout,
                "handed every listener over, and every client connection that can go; those \
                 that stay (QUIC, TLS on rustls's records) are told to reconnect (Restarting) \
                 and drained; a signal exits at once"
            );
        }
        // A process still taking over is not the service yet: what systemd hears of a stop
        // is the main process's to say.
        None if readiness.taking_over() => {
            readiness.refuse("the new process got a signal to shut down before taking over");
            info!(
                "shutting down before taking over: the running derpd keeps serving; a second \
                 signal exits at once"
            );
        }
        None => {
            notify.stopping(&format!(
                "shutting down: telling {} clients to reconnect, draining for up to {:?}",
                server.local_clients(),
                cli.drain_timeout
            ));
            info!(
                drain_timeout = ?cli.drain_timeout,
                reconnect_in = ?cli.restart_reconnect_in,
                try_for = ?cli.restart_try_for,
                "shutting down: clients are told to reconnect elsewhere; a second signal exits \
                 at once"
            );
        }
    }
    let graceful = async {
        server
            .shutdown_gracefully(
                cli.restart_reconnect_in,
                cli.restart_try_for,
                cli.drain_timeout,
            )
            .await;
        // After the drain, so clients are not told their sibling-held peers are gone
        // while they still hear from this node.
        if let Some(mesh) = &mesh {
            mesh.shutdown().await;
        }
    };
    // Closing after the drain waits for connection tasks, some of which (a handshake, an
    // idle HTTP keep-alive) only end at their own timeouts: bound the whole, so the stop
    // timeouts in the deploy files hold.
    let bounded = tokio::time::timeout(cli.drain_timeout + CLOSE_GRACE, graceful);
    tokio::select! {
        r = bounded => match r {
            Ok(()) => info!("shut down"),
            Err(_) => tracing::warn!("connections still closing after the drain; exiting"),
        },
        _ = signals.recv() => {
            eprintln!("derpd: second signal: exiting without draining");
            std::process::exit(SECOND_SIGNAL_EXIT);
        }
    }
    Ok(())
}

/// The UDP port DERP over QUIC listens on, if any: given, or by default the TLS port on a
/// TLS node that is not in --dev mode. The flags that conflict over it are refused by
/// [`combinations::review`].
fn quic_port(cli: &Cli, tls: bool, listen_port: u16) -> Option<u16> {
    if combinations::quic_off(cli, tls, listen_port).is_some() {
        return None;
    }
    match cli.quic_port {
        Some(p) => u16::try_from(p).ok(),
        None => Some(listen_port),
    }
}

/// Whether QUIC, on by default on the TLS port, stays off because STUN was given that UDP
/// port (`-a :443 -stun-port 443`, a derper command line that puts STUN where firewalls let
/// it through): the command line means STUN there, and derper has no QUIC to be in the way.
fn quic_yields_to_stun(cli: &Cli, tls: bool, listen_port: u16) -> bool {
    cli.quic_port.is_none() && tls && !cli.dev && cli.stun && cli.stun_port == listen_port
}

/// Networks as a comma-separated list, as the flags take them.
fn cidrs_text(nets: &[derp_server::IpCidr]) -> String {
    nets.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The ACME flags of the flag block beside the TLS ones, for the TLS setup.
fn acme_extras(cli: &Cli) -> tls_setup::AcmeExtras {
    // An empty value is no value, as derper's "" defaults are.
    let given = |v: &Option<String>| v.clone().filter(|v| !v.is_empty());
    tls_setup::AcmeExtras {
        eab_kid: given(&cli.acme_eab_kid),
        eab_key: given(&cli.acme_eab_key),
        ip_certs: cli.acme_ip_certs,
    }
}

/// `--addr`, with --dev's own default.
fn listen_addr_text(cli: &Cli) -> String {
    if cli.dev && cli.addr == ":443" {
        "127.0.0.1:3340".to_owned()
    } else {
        cli.addr.clone()
    }
}

/// The key the mesh links present: the mesh key, required (and non-zero) when there are
/// siblings to mesh with.
fn mesh_link_key(cli: &Cli, mesh_key: Option<&MeshKey>) -> anyhow::Result<Option<MeshKey>> {
    Ok(match (mesh_key, cli.mesh_with.trim().is_empty()) {
        (_, true) => None,
        (Some(k), false) if !k.is_zero() => Some(*k),
        (Some(_), false) => bail!("--mesh-with: the mesh key is all zeros, which never authorizes"),
        (None, false) => bail!("--mesh-with needs a mesh key (--mesh-psk-file)"),
    })
}

/// The listener's address with another port: the STUN, port-80 and QUIC listeners bind the
/// main listener's address (keeping an IPv6 scope).
pub(crate) fn with_port(mut addr: SocketAddr, port: u16) -> SocketAddr {
    addr.set_port(port);
    addr
}

fn parse_home(home: &str) -> anyhow::Result<HomePage> {
    match home {
        "" => Ok(HomePage::Default),
        "blank" => Ok(HomePage::Blank),
        url if url.starts_with("http://") || url.starts_with("https://") => {
            Ok(HomePage::Redirect(url.to_owned()))
        }
        other => bail!("invalid --home {other:?}: want \"\", \"blank\" or an http(s):// URL"),
    }
}

fn load_key(cli: &Cli) -> anyhow::Result<SecretKey> {
    match key_path(cli)? {
        Some(path) => keyfile::load_or_create(&path),
        None => Ok(SecretKey::generate(&mut rand::rngs::OsRng)),
    }
}

/// The key file, or `None` in --dev mode without -c (a fresh key for each run).
fn key_path(cli: &Cli) -> anyhow::Result<Option<PathBuf>> {
    if cli.dev && cli.config.is_none() {
        return Ok(None);
    }
    Ok(Some(match &cli.config {
        Some(p) => p.clone(),
        None if is_root() => PathBuf::from(DEFAULT_ROOT_CONFIG),
        None => bail!("-c/--config is required when not running as root (or use --dev)"),
    }))
}

/// The mesh key, found as derper finds it: in --dev mode only from the environment,
/// otherwise from --mesh-psk-file or, without it, the first default file that exists.
fn mesh_key(cli: &Cli) -> anyhow::Result<Option<MeshKey>> {
    if cli.dev && cli.mesh_psk_file.is_none() {
        return match std::env::var(DEV_MESH_KEY_ENV) {
            Ok(text) => text
                .trim()
                .parse::<MeshKey>()
                .map(Some)
                .map_err(|e| anyhow::anyhow!("{DEV_MESH_KEY_ENV}: {e}")),
            Err(_) => Ok(None),
        };
    }
    let path = match &cli.mesh_psk_file {
        // As derper: an empty -mesh-psk-file means no key file, not the default ones.
        Some(p) if p.as_os_str().is_empty() => return Ok(None),
        Some(p) => p.clone(),
        None => {
            let mut candidates = vec![PathBuf::from(DEFAULT_MESH_KEY_FILE)];
            if let Some(home) = std::env::var_os("HOME") {
                candidates.push(PathBuf::from(home).join("keys/derp-mesh.key"));
            }
            match candidates.into_iter().find(|p| p.exists()) {
                Some(p) => p,
                None => return Ok(None),
            }
        }
    };
    load_mesh_key(&path).map(Some)
}

/// Trust for https mesh links: the system's store plus the PEM file's certificates.
fn mesh_tls(
    path: &std::path::Path,
) -> anyhow::Result<std::sync::Arc<derp_mesh::rustls::ClientConfig>> {
    let (config, summary) = mesh_tls_with_file(path)?;
    log_trust(&summary);
    Ok(config)
}

/// The system's trust store plus the PEM file's certificates, and what went into it.
fn mesh_tls_with_file(
    path: &std::path::Path,
) -> anyhow::Result<(
    std::sync::Arc<derp_mesh::rustls::ClientConfig>,
    derp_mesh::TrustSummary,
)> {
    let pem = std::fs::read(path)
        .with_context(|| format!("reading --mesh-ca-file {}", path.display()))?;
    let extra = derp_tls::load_certs_pem(&pem)
        .with_context(|| format!("--mesh-ca-file {}", path.display()))?;
    derp_mesh::mesh_tls_config(&extra).with_context(|| format!("--mesh-ca-file {}", path.display()))
}

fn mesh_tls_system() -> anyhow::Result<std::sync::Arc<derp_mesh::rustls::ClientConfig>> {
    let (config, summary) = derp_mesh::mesh_tls_config(&[]).context("mesh trust store")?;
    log_trust(&summary);
    Ok(config)
}

fn log_trust(s: &derp_mesh::TrustSummary) {
    if s.fallback {
        tracing::warn!(
            extra = s.extra,
            "no system CA certificates found (SSL_CERT_FILE, SSL_CERT_DIR, the OS store): \
             https mesh links trust Mozilla's roots and --mesh-ca-file"
        );
    } else {
        info!(
            system = s.system,
            rejected = s.system_rejected,
            extra = s.extra,
            "mesh trust store"
        );
    }
}

fn load_mesh_key(path: &std::path::Path) -> anyhow::Result<MeshKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading mesh key file {}", path.display()))?;
    text.trim()
        .parse::<MeshKey>()
        .map_err(|e| anyhow::anyhow!("mesh key file {}: {e}", path.display()))
}

fn is_root() -> bool {
    effective_ids().is_some_and(|ids| ids.uid == 0)
}

/// The process's effective user and group ids and its supplementary groups.
#[derive(Debug)]
struct Ids {
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
}

fn effective_ids() -> Option<Ids> {
    // Not in std; /proc is enough on the platforms derpd targets.
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|rest| {
                rest.split_whitespace()
                    .filter_map(|v| v.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            })
    };
    Some(Ids {
        // Real, effective, saved, filesystem: the second is the effective one.
        uid: *field("Uid:")?.get(1)?,
        gid: *field("Gid:")?.get(1)?,
        groups: field("Groups:").unwrap_or_default(),
    })
}

/// SIGHUP's default action ends the process, and init systems send it for "reload" (the
/// systemd unit's ExecReload does). Listening for it from the start replaces that action in
/// every mode; manual certificate mode adds its own listener that reloads the files.
fn ignore_sighup_by_default() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(mut hup) => {
                tokio::spawn(async move {
                    while hup.recv().await.is_some() {
                        tracing::debug!("SIGHUP received");
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot listen for SIGHUP"),
        }
    }
}

/// SIGTERM and SIGINT, listened for from startup on, so a second one is seen while the
/// first one's drain runs.
struct ShutdownSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn new() -> anyhow::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
                int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// How long closing may take after the drain deadline before derpd exits regardless.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(3);
/// Exit status when a second signal cuts the drain short.
const SECOND_SIGNAL_EXIT: i32 = 1;
const DEFAULT_MESH_KEY_FILE: &str = "/home/derp/keys/derp-mesh.key";
const DEV_MESH_KEY_ENV: &str = "TAILSCALE_DERPER_MESH_KEY";
const DEFAULT_ROOT_CONFIG: &str = "/var/lib/derper/derper.key";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quic_port_defaults_to_the_tls_port() {
        let cli = |args: &[&str]| {
            cli::try_parse_from(std::iter::once("derpd").chain(args.iter().copied()))
                .expect("parses")
        };
        assert_eq!(quic_port(&cli(&[]), true, 443), Some(443));
        assert_eq!(quic_port(&cli(&["--dev"]), true, 8443), None);
        assert_eq!(
            quic_port(&cli(&["--dev", "--quic-port", "0"]), true, 8443),
            Some(0)
        );
        assert_eq!(quic_port(&cli(&["--quic-port=-1"]), true, 443), None);
        assert_eq!(quic_port(&cli(&[]), false, 3340), None);
        // STUN given the TLS port: QUIC, not asked for, stays off rather than refusing the
        // command line (asked for there, it is refused: combinations.rs).
        let stun_on_443 = cli(&["-a", ":443", "-stun-port", "443"]);
        assert_eq!(quic_port(&stun_on_443, true, 443), None);
        assert!(quic_yields_to_stun(&stun_on_443, true, 443));
        assert!(!quic_yields_to_stun(&cli(&[]), true, 443));
        assert_eq!(
            quic_port(
                &cli(&["-stun-port", "443", "--quic-port", "8443"]),
                true,
                443
            ),
            Some(8443)
        );
        assert!(cli::try_parse_from(["derpd", "--quic-port", "-2"]).is_err());
    }

    #[test]
    fn home_values() {
        assert_eq!(parse_home("").expect("ok"), HomePage::Default);
        assert_eq!(parse_home("blank").expect("ok"), HomePage::Blank);
        assert!(matches!(parse_home("https://x"), Ok(HomePage::Redirect(_))));
        assert!(parse_home("ftp://x").is_err());
    }
}
