//! derpd: a DERP relay server that Tailscale clients can use in place of derper.

mod cli;
mod duration;
mod keyfile;
mod tls_setup;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser as _;
use derp_proto::{MeshKey, SecretKey};
use derp_server::{HomePage, LookupConfig, PeerCacheConfig, Server, ServerConfig};
use tokio::net::TcpListener;
use tracing::info;

use crate::cli::{Cli, LogFormat};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // One line, not clap's usage block: operators read these in journald.
            let rendered = e.render().to_string();
            let line = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!(
                "derpd: {} (see derpd --help)",
                line.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("derpd: starting runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
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

async fn run(cli: Cli) -> anyhow::Result<()> {
    ignore_sighup_by_default();
    let addr_text = if cli.dev && cli.addr == ":443" {
        "127.0.0.1:3340".to_owned()
    } else {
        cli.addr.clone()
    };
    let addrs = parse_listen_addr(&addr_text)?;
    let tls = cli.tls.tls_enabled(addrs[0].port());
    let home = parse_home(&cli.home)?;
    let secret_key = load_key(&cli)?;
    let mesh_key = match &cli.mesh_psk_file {
        Some(path) => Some(load_mesh_key(path)?),
        None => None,
    };

    let mut config = ServerConfig::new(secret_key);
    config.home = home;
    config.derp_enabled = cli.derp;
    config.send_queue_depth = cli.send_queue_depth as usize;
    config.write_timeout = (!cli.tcp_write_timeout.is_zero()).then_some(cli.tcp_write_timeout);
    config.mesh_key = mesh_key;
    config.lookup = LookupConfig {
        mirror: cli.peer_mirror,
        peer_cache: PeerCacheConfig::from_flags(
            cli.peer_cache_max_entries,
            cli.peer_cache_max_idle,
        ),
    };
    config.debug_allow = cli.debug_allow_cidr.clone();
    config.packet_metrics = cli.packet_metrics;

    let registry = prometheus::Registry::new();
    let server = Server::new(config, &registry).context("creating server")?;
    let listener = bind_tcp(&addrs).await?;
    let local = listener.local_addr()?;
    if !tls {
        info!(addr = %local, key = %server.public_key(), dev = cli.dev, "derpd listening (plain HTTP)");
    }

    let mut background = tokio::task::JoinSet::new();
    if cli.stun {
        let stun_addr = SocketAddr::new(local.ip(), cli.stun_port);
        let socket = derp_server::bind_stun(stun_addr)
            .with_context(|| format!("binding STUN on {stun_addr}"))?;
        info!(addr = %socket.local_addr()?, "STUN listening");
        let metrics = derp_server::StunMetrics::new(&registry).context("STUN metrics")?;
        let stun_config = derp_server::StunConfig {
            answer_generic: cli.stun_answer_generic,
        };
        let token = server.shutdown_token();
        background.spawn(async move {
            derp_server::serve_stun(socket, stun_config, metrics, token.cancelled_owned()).await;
            Ok(())
        });
    }
    if let Some(addr) = cli.metrics_addr {
        let metrics_listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening for metrics on {addr}"))?;
        info!(addr = %metrics_listener.local_addr()?, "metrics listening at /metrics");
        let server = server.clone();
        background.spawn(async move { server.serve_metrics(metrics_listener).await });
    }

    let serve = async {
        if tls {
            tls_setup::run_tls(&server, &registry, &cli.tls, listener).await
        } else {
            server.serve(listener).await.context("serving")
        }
    };
    tokio::pin!(serve);
    tokio::select! {
        r = &mut serve => r?,
        _ = shutdown_signal() => {
            info!("shutting down");
            server.shutdown().await;
        }
    }
    Ok(())
}

/// Parses derper-style listen addresses. ":port" means every address; IPv6's unspecified
/// address is tried first because on Linux it also accepts IPv4.
fn parse_listen_addr(s: &str) -> anyhow::Result<Vec<SocketAddr>> {
    if let Some(port) = s.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .with_context(|| format!("invalid port in --addr {s:?}"))?;
        return Ok(vec![
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        ]);
    }
    let addr: SocketAddr = s
        .parse()
        .with_context(|| format!("invalid --addr {s:?}: want :port, ip:port or [ip]:port"))?;
    Ok(vec![addr])
}

async fn bind_tcp(addrs: &[SocketAddr]) -> anyhow::Result<TcpListener> {
    let mut last_err = None;
    for addr in addrs {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) => last_err = Some((addr, e)),
        }
    }
    match last_err {
        Some((addr, e)) => Err(e).with_context(|| format!("listening on {addr}")),
        None => bail!("no listen address"),
    }
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
    if cli.dev && cli.config.is_none() {
        return Ok(SecretKey::generate(&mut rand::rngs::OsRng));
    }
    let path = match &cli.config {
        Some(p) => p.clone(),
        None if is_root() => PathBuf::from(DEFAULT_ROOT_CONFIG),
        None => bail!("-c/--config is required when not running as root (or use --dev)"),
    };
    keyfile::load_or_create(&path)
}

fn load_mesh_key(path: &std::path::Path) -> anyhow::Result<MeshKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading mesh key file {}", path.display()))?;
    text.trim()
        .parse::<MeshKey>()
        .map_err(|e| anyhow::anyhow!("mesh key file {}: {e}", path.display()))
}

fn is_root() -> bool {
    // The effective uid is not in std; /proc is enough on the platforms derpd targets.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
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

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

const DEFAULT_ROOT_CONFIG: &str = "/var/lib/derper/derper.key";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse_like_derper() {
        assert_eq!(parse_listen_addr(":3340").expect("ok").len(), 2);
        assert_eq!(
            parse_listen_addr("127.0.0.1:3340").expect("ok"),
            vec!["127.0.0.1:3340".parse().expect("addr")]
        );
        assert!(parse_listen_addr("[::1]:80").is_ok());
        assert!(parse_listen_addr("nonsense").is_err());
        assert!(parse_listen_addr(":99999").is_err());
    }

    #[test]
    fn home_values() {
        assert_eq!(parse_home("").expect("ok"), HomePage::Default);
        assert_eq!(parse_home("blank").expect("ok"), HomePage::Blank);
        assert!(matches!(parse_home("https://x"), Ok(HomePage::Redirect(_))));
        assert!(parse_home("ftp://x").is_err());
    }
}
