//! TLS flags and wiring: which certificate mode, the port-80 listener, reloads on SIGHUP.
//!
//! As in derper, TLS is served when the listen port is 443 or `--certmode manual` is given;
//! otherwise the main listener speaks plain HTTP and none of this runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use derp_server::Server;
use derp_tls::{
    AcmeConfig, AcmeManager, ChallengeKind, LETS_ENCRYPT_PRODUCTION, ManualCerts, TlsFront,
    TlsOptions, load_certs_pem,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::duration::parse_duration;

/// How the TLS certificate is obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CertMode {
    /// From an ACME server (Let's Encrypt unless --acme-directory says otherwise).
    Letsencrypt,
    /// From <certdir>/<hostname>.crt and .key, reloaded when they change or on SIGHUP.
    Manual,
}

/// Which ACME challenge to answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AcmeChallenge {
    /// TLS-ALPN-01 first when listening on 443, else HTTP-01 first; the other after a failure.
    Auto,
    /// Only TLS-ALPN-01, on the TLS listener (must be reachable from outside on 443).
    #[value(name = "tls-alpn-01")]
    TlsAlpn01,
    /// Only HTTP-01, on the --http-port listener (must be reachable from outside on 80).
    #[value(name = "http-01")]
    Http01,
}

/// TLS flags, flattened into the main command line.
#[derive(Debug, Args)]
#[command(next_help_heading = "TLS (served when --addr's port is 443 or --certmode is manual)")]
pub(crate) struct TlsArgs {
    /// How to get the TLS certificate. TLS is served when --addr's port is 443 or the mode is
    /// manual; any other port with letsencrypt means plain HTTP.
    #[arg(long, value_enum, default_value_t = CertMode::Letsencrypt)]
    pub(crate) certmode: CertMode,

    /// Certificate directory. Manual mode reads <hostname>.crt and <hostname>.key here (and
    /// writes a self-signed pair for an IP hostname); letsencrypt mode caches its account and
    /// certificates here. Default: $XDG_CACHE_HOME or ~/.cache, then tailscale/derper-certs.
    #[arg(long)]
    pub(crate) certdir: Option<PathBuf>,

    /// The server's hostname: the certificate's name, and the only SNI accepted. May be an IP
    /// address in manual mode (any SNI is then accepted).
    #[arg(long, default_value = "derp.tailscale.com")]
    pub(crate) hostname: String,

    /// Contact email for the ACME account.
    #[arg(long)]
    pub(crate) acme_email: Option<String>,

    /// ACME directory URL (any RFC 8555 server).
    #[arg(long, default_value = LETS_ENCRYPT_PRODUCTION)]
    pub(crate) acme_directory: String,

    /// PEM file with extra CA certificates to trust for the ACME server's own HTTPS (for a
    /// private or test ACME server).
    #[arg(long)]
    pub(crate) acme_ca_cert: Option<PathBuf>,

    /// ACME challenge type.
    #[arg(long, value_enum, default_value_t = AcmeChallenge::Auto)]
    pub(crate) acme_challenge: AcmeChallenge,

    /// Plain-HTTP port, only in TLS mode, on the same IP as --addr: /generate_204, ACME HTTP-01
    /// and redirects to HTTPS (never DERP). -1 disables it.
    #[arg(long, default_value_t = 80, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1..=65535))]
    pub(crate) http_port: i32,

    /// Manual mode: how often to check the certificate files for changes (SIGHUP also
    /// reloads). 0 disables the check.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) cert_reload_interval: Duration,
}

impl TlsArgs {
    /// Whether the main listener serves TLS, by derper's rule.
    pub(crate) fn tls_enabled(&self, listen_port: u16) -> bool {
        listen_port == 443 || self.certmode == CertMode::Manual
    }

    pub(crate) fn certdir(&self) -> anyhow::Result<PathBuf> {
        if let Some(dir) = &self.certdir {
            return Ok(dir.clone());
        }
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
        match cache {
            Some(c) => Ok(c.join("tailscale").join("derper-certs")),
            None => bail!("--certdir is required: neither XDG_CACHE_HOME nor HOME is set"),
        }
    }
}

/// Serves TLS on `listener` for `server` until the server shuts down: sets up the certificate
/// (failing early if manual files are missing or unusable), the port-80 listener, and the
/// reload and renewal tasks.
pub(crate) async fn run_tls(
    server: &Server,
    registry: &prometheus::Registry,
    args: &TlsArgs,
    listener: TcpListener,
    quic: Option<(u16, derp_server::QuicConfig)>,
    backlog: Option<u32>,
) -> anyhow::Result<()> {
    let listen = listener.local_addr()?;
    let front = TlsFront::new(
        &server.public_key(),
        TlsOptions::new(args.hostname.clone()),
        registry,
    )
    .context("setting up tls")?;
    let certdir = args.certdir()?;
    let shutdown = server.shutdown_token();
    let mut tasks = tokio::task::JoinSet::new();

    match args.certmode {
        CertMode::Manual => {
            let manual = Arc::new(ManualCerts::new(front.clone(), &certdir));
            let generated = manual.load_or_generate().with_context(|| {
                format!(
                    "manual certificate ({} and {})",
                    manual.cert_path().display(),
                    manual.key_path().display()
                )
            })?;
            if let Some(g) = &generated {
                info!(cert = %g.cert_path.display(), key = %g.key_path.display(), "generated a self-signed certificate");
            }
            let served = front.cert_updates().borrow().clone();
            if served.origin == derp_tls::CertOrigin::SelfSigned
                && args.hostname.parse::<std::net::IpAddr>().is_ok()
            {
                print_derp_map_node(&args.hostname, listen.port(), &served.pin());
            }
            if !args.cert_reload_interval.is_zero() {
                let (m, s, every) = (manual.clone(), shutdown.clone(), args.cert_reload_interval);
                tasks.spawn(async move { m.watch(every, s).await });
            }
            tasks.spawn(reload_on_sighup(manual, shutdown.clone()));
        }
        CertMode::Letsencrypt => {
            let config = acme_config(args, &certdir, listen.port())?;
            let manager = AcmeManager::new(front.clone(), config).context("acme")?;
            info!(
                hostname = %args.hostname,
                directory = %args.acme_directory,
                cache = %certdir.display(),
                "getting certificates by ACME"
            );
            let s = shutdown.clone();
            tasks.spawn(async move { manager.run(s).await });
        }
    }

    if let Ok(port) = u16::try_from(args.http_port) {
        let addr = SocketAddr::new(listen.ip(), port);
        let http = crate::limits::bind(addr, backlog)
            .with_context(|| format!("listening on {addr} (--http-port; -1 disables it)"))?;
        info!(addr = %http.local_addr()?, "port-80 listener (generate_204, acme, redirects)");
        let (f, s) = (front.clone(), shutdown.clone());
        tasks.spawn(async move {
            if let Err(e) = f.serve_http_port(http, listen.port(), s).await {
                warn!(error = %e, "http port listener stopped");
            }
        });
    }

    if let Some((port, quic_config)) = quic {
        let addr = SocketAddr::new(listen.ip(), port);
        let socket = derp_server::quic::bind_udp(addr)
            .with_context(|| format!("binding QUIC on {addr}/udp (--quic-port; -1 disables it)"))?;
        let quic = derp_server::QuicListener::bind(socket, front.quic_server_config(), quic_config)
            .context("setting up QUIC")?;
        info!(addr = %quic.local_addr()?, "QUIC listening (DERP over QUIC)");
        let server = server.clone();
        tasks.spawn(async move { server.serve_quic(quic).await });
    }

    // Until a certificate is in service every handshake fails: not ready before that.
    let mut certs = front.cert_updates();
    let (ready, s) = (server.clone(), shutdown.clone());
    tasks.spawn(async move {
        while certs.borrow_and_update().generation == 0 {
            tokio::select! {
                _ = s.cancelled() => return,
                changed = certs.changed() => if changed.is_err() { return },
            }
        }
        ready.set_ready(true);
    });

    info!(addr = %listen, key = %server.public_key(), hostname = %args.hostname, mode = ?args.certmode, "derpd listening (TLS)");
    let result = front.serve(server, listener).await.context("serving tls");
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
    result
}

/// The ACME settings the flags ask for, with the extra CA file read.
pub(crate) fn acme_config(
    args: &TlsArgs,
    certdir: &std::path::Path,
    listen_port: u16,
) -> anyhow::Result<AcmeConfig> {
    let mut config = AcmeConfig::new(certdir);
    config.directory_url = args.acme_directory.clone();
    config.contact_email = args.acme_email.clone();
    if let Some(path) = &args.acme_ca_cert {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading --acme-ca-cert {}", path.display()))?;
        config.extra_roots =
            load_certs_pem(&pem).with_context(|| format!("--acme-ca-cert {}", path.display()))?;
    }
    config.challenges = challenges(args.acme_challenge, listen_port, args.http_port >= 0);
    if config.challenges.is_empty() {
        bail!("--acme-challenge http-01 needs the port-80 listener (--http-port is -1)");
    }
    Ok(config)
}

/// The challenge order for `--acme-challenge`.
fn challenges(choice: AcmeChallenge, tls_port: u16, http_enabled: bool) -> Vec<ChallengeKind> {
    match choice {
        AcmeChallenge::TlsAlpn01 => vec![ChallengeKind::TlsAlpn01],
        AcmeChallenge::Http01 if http_enabled => vec![ChallengeKind::Http01],
        AcmeChallenge::Http01 => Vec::new(),
        AcmeChallenge::Auto if !http_enabled => vec![ChallengeKind::TlsAlpn01],
        AcmeChallenge::Auto if tls_port == 443 => {
            vec![ChallengeKind::TlsAlpn01, ChallengeKind::Http01]
        }
        AcmeChallenge::Auto => vec![ChallengeKind::Http01, ChallengeKind::TlsAlpn01],
    }
}

/// Prints what a DERP map needs for a self-signed IP-only node, as derper does.
fn print_derp_map_node(ip: &str, port: u16, pin: &str) {
    let mut node = serde_json::json!({
        "Name": "900a",
        "RegionID": 900,
        "HostName": ip,
        "CertName": pin,
    });
    if let Ok(addr) = ip.parse::<std::net::IpAddr>() {
        let key = if addr.is_ipv4() { "IPv4" } else { "IPv6" };
        node[key] = serde_json::Value::String(ip.to_owned());
    }
    if port != 443 {
        node["DERPPort"] = port.into();
    }
    info!(cert_name = %pin, "self-signed certificate for an IP address: clients must pin it");
    println!(
        "Self-signed certificate for {ip}. Use this node in your DERP map (CertName pins the \
         certificate):\n  {node}"
    );
}

async fn reload_on_sighup(manual: Arc<ManualCerts>, shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGHUP; certificate files are still polled");
                return;
            }
        };
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                got = hup.recv() => if got.is_none() { return },
            }
            match manual.reload_if_changed() {
                Ok(true) => info!("SIGHUP: new certificate in service"),
                Ok(false) => info!("SIGHUP: certificate files unchanged"),
                Err(e) => {
                    warn!(error = %e, "SIGHUP: certificate reload failed; keeping the old one")
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = manual;
        shutdown.cancelled().await;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn tls_is_served_on_443_or_in_manual_mode() {
        let mut args = TlsArgs {
            certmode: CertMode::Letsencrypt,
            certdir: None,
            hostname: "derp.example.com".into(),
            acme_email: None,
            acme_directory: LETS_ENCRYPT_PRODUCTION.into(),
            acme_ca_cert: None,
            acme_challenge: AcmeChallenge::Auto,
            http_port: 80,
            cert_reload_interval: Duration::from_secs(10),
        };
        assert!(args.tls_enabled(443));
        assert!(!args.tls_enabled(3340));
        args.certmode = CertMode::Manual;
        assert!(args.tls_enabled(3340));
    }

    #[test]
    fn flags_parse() {
        let cli = crate::cli::Cli::try_parse_from([
            "derpd",
            "--certmode",
            "manual",
            "--hostname",
            "192.0.2.1",
            "--acme-challenge",
            "tls-alpn-01",
            "--http-port",
            "-1",
            "--cert-reload-interval",
            "1m",
        ])
        .expect("parses");
        assert_eq!(cli.tls.certmode, CertMode::Manual);
        assert_eq!(cli.tls.acme_challenge, AcmeChallenge::TlsAlpn01);
        assert_eq!(cli.tls.http_port, -1);
        assert_eq!(cli.tls.cert_reload_interval, Duration::from_secs(60));
        assert!(crate::cli::Cli::try_parse_from(["derpd", "--acme-challenge", "http-01"]).is_ok());
        assert!(crate::cli::Cli::try_parse_from(["derpd", "--http-port", "-2"]).is_err());
        assert!(crate::cli::Cli::try_parse_from(["derpd", "--certmode", "gcp"]).is_err());
    }

    #[test]
    fn challenge_order_follows_the_ports() {
        use ChallengeKind::{Http01, TlsAlpn01};
        assert_eq!(
            challenges(AcmeChallenge::Auto, 443, true),
            [TlsAlpn01, Http01]
        );
        assert_eq!(
            challenges(AcmeChallenge::Auto, 8443, true),
            [Http01, TlsAlpn01]
        );
        assert_eq!(challenges(AcmeChallenge::Auto, 8443, false), [TlsAlpn01]);
        assert_eq!(challenges(AcmeChallenge::Http01, 443, false), []);
        assert_eq!(
            challenges(AcmeChallenge::TlsAlpn01, 8443, true),
            [TlsAlpn01]
        );
    }
}
