//! TLS flags and wiring: which certificate mode, the port-80 listener, reloads on SIGHUP.
//!
//! As in derper, TLS is served when the listen port is 443 or `--certmode manual` is given;
//! otherwise the main listener speaks plain HTTP and none of this runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use derp_server::Server;
use derp_tls::{
    AcmeConfig, AcmeManager, ChallengeKind, ExternalAccount, GOOGLE_TRUST_SERVICES, IpCertManager,
    LETS_ENCRYPT_PRODUCTION, ManualCerts, TlsFront, TlsOptions, TlsRecords, load_certs_pem,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::duration::parse_duration;
use crate::goflags::{GoKind, GoKinds};
use crate::upgrade::Readiness;
use crate::upgrade::sockets::Sockets;
use crate::upgrade::wire::ListenerKind;

/// How the TLS certificate is obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CertMode {
    /// From an ACME server (Let's Encrypt unless --acme-directory says otherwise).
    Letsencrypt,
    /// From <certdir>/<hostname>.crt and .key, reloaded when they change or on SIGHUP.
    Manual,
    /// From Google Trust Services' ACME server; needs --acme-eab-kid, --acme-eab-key and
    /// --acme-email.
    Gcp,
}

/// The ACME flags declared beside the others in `cli.rs`: External Account Binding and IP
/// certificates.
#[derive(Clone, Debug, Default)]
pub(crate) struct AcmeExtras {
    pub(crate) eab_kid: Option<String>,
    pub(crate) eab_key: Option<String>,
    pub(crate) ip_certs: bool,
}

/// Whether `--hostname` is an IP address (bracketed or not).
pub(crate) fn hostname_is_ip(hostname: &str) -> bool {
    hostname
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
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

/// Who seals and opens TLS 1.3 records after rustls's handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TlsRecordsArg {
    /// derpd's own record layer: the least memory per idle connection and CPU per packet.
    Derpd,
    /// rustls's buffered connection, as TLS 1.2 is served.
    Rustls,
}

impl From<TlsRecordsArg> for TlsRecords {
    fn from(arg: TlsRecordsArg) -> Self {
        match arg {
            TlsRecordsArg::Derpd => Self::Derpd,
            TlsRecordsArg::Rustls => Self::Rustls,
        }
    }
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
    #[arg(long, value_parser = crate::goflags::go_path())]
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
    /// and redirects to HTTPS (never DERP). -1 (any negative value) disables it.
    #[arg(long, default_value_t = 80, allow_negative_numbers = true)]
    pub(crate) http_port: i64,

    /// Manual mode: how often to check the certificate files for changes (SIGHUP also
    /// reloads). 0 disables the check.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) cert_reload_interval: Duration,

    /// Who seals and opens the records of TLS 1.3 connections after rustls's handshake:
    /// derpd's own record layer, or rustls's buffered connection (as TLS 1.2 is served; more
    /// memory per idle connection and CPU per packet). rustls is the way out for a client
    /// that does not get along with derpd's record layer, without a rebuild.
    #[arg(long, value_enum, default_value_t = TlsRecordsArg::Derpd)]
    pub(crate) tls_records: TlsRecordsArg,
}

/// The Go kind of each flag above ([`crate::goflags::GoKind`]), in their order.
pub(crate) const GO_KINDS: &GoKinds = &[
    ("certmode", GoKind::String),
    ("certdir", GoKind::String),
    ("hostname", GoKind::String),
    ("acme-email", GoKind::String),
    ("acme-directory", GoKind::String),
    ("acme-ca-cert", GoKind::String),
    ("acme-challenge", GoKind::String),
    ("http-port", GoKind::Int),
    ("cert-reload-interval", GoKind::Duration),
    ("tls-records", GoKind::String),
];

impl TlsArgs {
    /// Whether the main listener serves TLS, by derper's rule: the port is written "443" or
    /// "https", or the mode is manual.
    pub(crate) fn tls_enabled(&self, listen: &crate::listen::ListenAddr) -> bool {
        listen.is_https_port() || self.certmode == CertMode::Manual
    }

    /// The port-80 listener's port, or `None` when any negative --http-port turns it off
    /// (derper's test is `> -1`).
    pub(crate) fn http_port(&self) -> anyhow::Result<Option<u16>> {
        if self.http_port < 0 {
            return Ok(None);
        }
        u16::try_from(self.http_port).map(Some).map_err(|_| {
            anyhow::anyhow!(
                "--http-port {}: not a port (0 to 65535, or -1 to turn the listener off)",
                self.http_port
            )
        })
    }

    pub(crate) fn certdir(&self) -> anyhow::Result<PathBuf> {
        if let Some(dir) = &self.certdir {
            if dir.as_os_str().is_empty() {
                bail!(
                    "--certdir is empty: name a directory, or leave the flag out for the default"
                );
            }
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

/// The sockets a TLS node serves on: the main listener, the QUIC port and its settings (if
/// any), and the backlog for the listeners bound here.
pub(crate) struct TlsListeners {
    pub(crate) main: TcpListener,
    pub(crate) quic: Option<(u16, derp_server::QuicConfig)>,
    pub(crate) backlog: Option<u32>,
    /// Where the port-80 and QUIC sockets come from.
    pub(crate) sockets: Sockets,
    /// Cancelled to stop accepting (a shutdown or a handover): [`run_tls`] returns once the
    /// listeners are closed, the server's connections carrying on.
    pub(crate) stop: CancellationToken,
}

/// Serves TLS on `listener` for `server` until the server shuts down: sets up the certificate
/// (failing early if manual files are missing or unusable), the port-80 listener, and the
/// reload and renewal tasks.
pub(crate) async fn run_tls(
    server: &Server,
    registry: &prometheus::Registry,
    args: &TlsArgs,
    extras: &AcmeExtras,
    listeners: TlsListeners,
    readiness: &Readiness,
) -> anyhow::Result<()> {
    let TlsListeners {
        main: listener,
        quic,
        backlog,
        sockets,
        stop,
    } = listeners;
    let notify = readiness.notifier();
    let listen = listener.local_addr()?;
    let options = TlsOptions {
        ip_certs: extras.ip_certs,
        http_port_proxy_protocol: server.proxy_protocol(),
        records: args.tls_records.into(),
        ..TlsOptions::new(args.hostname.clone())
    };
    if options.records == TlsRecords::Rustls {
        info!("TLS 1.3 records sealed and opened by rustls (--tls-records rustls)");
    }
    let front = TlsFront::new(&server.public_key(), options, registry).context("setting up tls")?;
    // An IP-only node has no hostname certificate to wait for: its certificates come on
    // demand, one per address clients connect to.
    let ip_only = extras.ip_certs && hostname_is_ip(&args.hostname);
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
        CertMode::Letsencrypt | CertMode::Gcp => {
            let config = acme_config(args, extras, &certdir, listen.port())?;
            info!(
                hostname = %args.hostname,
                directory = %config.directory_url,
                cache = %certdir.display(),
                external_account = config.external_account.is_some(),
                ip_certs = extras.ip_certs,
                "getting certificates by ACME"
            );
            let ip_manager = if ip_only {
                Some(IpCertManager::new(front.clone(), config).context("acme")?)
            } else {
                let manager = AcmeManager::new(front.clone(), config).context("acme")?;
                let ip_manager = match extras.ip_certs {
                    true => Some(manager.ip_cert_manager().context("acme")?),
                    false => None,
                };
                let s = shutdown.clone();
                tasks.spawn(async move { manager.run(s).await });
                ip_manager
            };
            if let Some(ip_manager) = ip_manager {
                let s = shutdown.clone();
                tasks.spawn(async move { ip_manager.run(s).await });
            }
        }
    }

    if let Some(port) = args.http_port()? {
        let addr = crate::with_port(listen, port);
        let http = sockets
            .tcp(ListenerKind::HttpPort, addr, backlog, || {
                Ok(crate::limits::bind(addr, backlog)?)
            })
            .with_context(|| format!("listening on {addr} (--http-port; -1 disables it)"))?;
        // As derper's: the same keepalive and user timeout as the main listener. Set on the
        // listener, which passes them on to each connection (on Linux).
        derp_server::tune_listener(&http, server.tcp_options());
        info!(addr = %http.local_addr()?, "port-80 listener (generate_204, acme, redirects)");
        let (f, s, r, stop) = (
            front.clone(),
            server.clone(),
            readiness.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            // Dropped here when stopped, so the listener is closed once the task is joined.
            tokio::select! {
                () = r.may_serve() => {}
                () = stop.cancelled() => return,
            }
            tokio::select! {
                r = f.serve_http_port(&s, http, listen.port()) => {
                    if let Err(e) = r {
                        warn!(error = %e, "http port listener stopped");
                    }
                }
                () = stop.cancelled() => {}
            }
        });
    }

    if let Some((port, quic_config)) = quic {
        let addr = crate::with_port(listen, port);
        let socket = sockets
            .udp(ListenerKind::Quic, addr, || {
                Ok(derp_server::quic::bind_udp(addr)?)
            })
            .with_context(|| format!("binding QUIC on {addr}/udp (--quic-port; -1 disables it)"))?;
        let quic = derp_server::QuicListener::bind(socket, front.quic_server_config(), quic_config)
            .context("setting up QUIC")?;
        info!(addr = %quic.local_addr()?, "QUIC listening (DERP over QUIC)");
        // On the server's tracker, not with the listeners: the endpoint must outlive them
        // to tell its clients to reconnect and close their connections when the server
        // shuts down (after a signal or a handover), as it does for TCP clients.
        let (s, r, stop) = (server.clone(), readiness.clone(), shutdown.clone());
        server.spawn_task(async move {
            tokio::select! {
                () = r.may_serve() => s.serve_quic(quic).await,
                () = stop.cancelled() => {}
            }
        });
    }

    // Until a certificate is in service every handshake fails: not ready before that.
    let mut certs = front.cert_updates();
    let (ready, s, r) = (server.clone(), shutdown.clone(), readiness.clone());
    let mode = args.certmode.to_possible_value();
    let mode = mode.as_ref().map_or("", |v| v.get_name());
    let serving = format!(
        "serving DERP over TLS on {listen} for {} (--certmode {mode})",
        args.hostname
    );
    if !ip_only && certs.borrow().generation == 0 {
        notify.status(&format!(
            "listening on {listen}, waiting for a certificate for {} (--certmode {mode})",
            args.hostname
        ));
    }
    tasks.spawn(async move {
        while !ip_only && certs.borrow_and_update().generation == 0 {
            tokio::select! {
                _ = s.cancelled() => return,
                changed = certs.changed() => if changed.is_err() { return },
            }
        }
        ready.set_ready(true);
        r.ready(serving);
    });

    info!(addr = %listen, key = %server.public_key(), hostname = %args.hostname, mode = ?args.certmode, "derpd listening (TLS)");
    let result = tokio::select! {
        r = async {
            readiness.may_serve().await;
            front.serve(server, listener).await
        } => r.context("serving tls"),
        // The listener is dropped with the future: closed now.
        () = stop.cancelled() => {
            // The port-80 listener ends by the same token; the certificate tasks, which only
            // a server shutdown ends, go with the listeners.
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
            return Ok(());
        }
    };
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
    result
}

/// The ACME settings the flags ask for (letsencrypt or gcp mode), with the extra CA file
/// read and the EAB key decoded. The flags' combinations (what derper refuses, with its
/// reasons, and derpd's own) are [`crate::combinations::review`]'s, which runs first.
pub(crate) fn acme_config(
    args: &TlsArgs,
    extras: &AcmeExtras,
    certdir: &std::path::Path,
    listen_port: u16,
) -> anyhow::Result<AcmeConfig> {
    let mut config = AcmeConfig::new(certdir);
    config.directory_url = args.acme_directory.clone();
    config.contact_email = args.acme_email.clone().filter(|e| !e.is_empty());
    if args.certmode == CertMode::Gcp {
        config.directory_url = GOOGLE_TRUST_SERVICES.to_owned();
    }
    config.external_account = match (&extras.eab_kid, &extras.eab_key) {
        (Some(kid), Some(key)) => Some(
            ExternalAccount::decode(kid, key)
                .map_err(|e| anyhow::anyhow!("--acme-eab-key: {e}"))?,
        ),
        // One without the other was refused with the rest of the combinations.
        _ => None,
    };
    if let Some(path) = &args.acme_ca_cert {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading --acme-ca-cert {}", path.display()))?;
        config.extra_roots =
            load_certs_pem(&pem).with_context(|| format!("--acme-ca-cert {}", path.display()))?;
    }
    config.challenges = challenges(args.acme_challenge, listen_port, args.http_port >= 0);
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
            tls_records: TlsRecordsArg::Derpd,
        };
        let at = |a: &str| crate::listen::ListenAddr::parse(a).expect("addr");
        assert!(args.tls_enabled(&at(":443")));
        assert!(args.tls_enabled(&at("127.0.0.1:https")));
        assert!(!args.tls_enabled(&at(":3340")));
        args.certmode = CertMode::Manual;
        assert!(args.tls_enabled(&at(":3340")));
    }

    #[test]
    fn flags_parse() {
        let cli = crate::cli::try_parse_from([
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
        assert!(crate::cli::try_parse_from(["derpd", "--acme-challenge", "http-01"]).is_ok());
        let off = crate::cli::try_parse_from(["derpd", "--http-port", "-2"]).expect("parses");
        assert_eq!(off.tls.http_port().expect("ok"), None);
        let big = crate::cli::try_parse_from(["derpd", "--http-port", "65536"]).expect("parses");
        assert!(big.tls.http_port().is_err());
        assert!(crate::cli::try_parse_from(["derpd", "--certmode", "bogus"]).is_err());
    }

    /// `acme_config` for a command line on port 443, after the review of its combinations
    /// as a start runs it, or the first error's text.
    fn acme(args: &[&str]) -> Result<AcmeConfig, String> {
        let cli = crate::cli::try_parse_from(std::iter::once("derpd").chain(args.iter().copied()))?;
        let review = crate::combinations::review(&cli, true, 443);
        if let Some(e) = review.errors.into_iter().next() {
            return Err(e);
        }
        let extras = crate::acme_extras(&cli);
        acme_config(&cli.tls, &extras, std::path::Path::new("/tmp/certs"), 443)
            .map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn gcp_mode_needs_derpers_flags_and_uses_googles_directory() {
        let gcp = ["--certmode", "gcp", "--hostname", "derp.example.com"];
        let with = |more: &[&'static str]| {
            let mut v = gcp.to_vec();
            v.extend_from_slice(more);
            acme(&v)
        };
        assert_eq!(
            with(&[]).expect_err("no eab"),
            "--certmode=gcp requires --acme-eab-kid and --acme-eab-key flags"
        );
        assert_eq!(
            with(&[
                "--acme-eab-kid",
                "kid-1",
                "--acme-eab-key",
                "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W"
            ])
            .expect_err("no email"),
            "--certmode=gcp requires --acme-email flag"
        );
        let config = with(&[
            "--acme-eab-kid",
            "kid-1",
            "--acme-eab-key",
            "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W",
            "--acme-email",
            "ops@example.com",
        ])
        .expect("complete");
        assert_eq!(config.directory_url, GOOGLE_TRUST_SERVICES);
        assert_eq!(config.external_account.expect("eab").hmac_key.len(), 48);
        assert!(
            with(&[
                "--acme-eab-kid",
                "k",
                "--acme-eab-key",
                "!!",
                "--acme-email",
                "a@b"
            ])
            .expect_err("bad key")
            .contains("invalid base64 encoding for EAB key")
        );
        let ip = acme(&["--certmode", "gcp", "--hostname", "192.0.2.1"]).expect_err("ip");
        assert_eq!(
            ip,
            "--certmode=gcp requires --hostname to be a DNS name, not an IP address"
        );
    }

    #[test]
    fn eab_binds_any_directory_and_ip_certs_follow_derpers_rules() {
        let config = acme(&[
            "--hostname",
            "derp.example.com",
            "--acme-directory",
            "https://ca.example/dir",
            "--acme-eab-kid=k",
            // Standard alphabet, padded: the second form derper accepts.
            "--acme-eab-key=c2VjcmV0LWtleQ==",
        ])
        .expect("eab with any directory");
        assert_eq!(
            config.external_account.expect("eab").hmac_key,
            b"secret-key"
        );
        assert!(
            acme(&["--hostname", "d.example", "--acme-eab-kid", "k"])
                .expect_err("half")
                .contains("together")
        );
        assert!(
            acme(&["--hostname", "192.0.2.1"])
                .expect_err("ip without ip certs")
                .starts_with("--hostname is an IP address; use --certmode=manual")
        );
        assert!(acme(&["--hostname", "192.0.2.1", "--acme-ip-certs"]).is_ok());
        assert!(acme(&["--hostname", "d.example", "--acme-ip-certs=true"]).is_ok());
        assert_eq!(
            acme(&[
                "--hostname",
                "d.example",
                "--acme-ip-certs",
                "--http-port",
                "-1"
            ])
            .expect_err("no port 80")
            .split(',')
            .next(),
            Some("--acme-ip-certs needs the port-80 listener")
        );
        assert_eq!(
            acme(&["--certmode", "gcp", "--acme-ip-certs"]).expect_err("gcp"),
            "--acme-ip-certs requires --certmode=letsencrypt"
        );
    }

    #[test]
    fn the_tls_records_flag_picks_the_record_layer() {
        let parse = |args: &[&str]| {
            crate::cli::try_parse_from([&["derpd"], args].concat())
                .map(|cli| TlsRecords::from(cli.tls.tls_records))
        };
        assert_eq!(parse(&[]).expect("default"), TlsRecords::Derpd);
        assert_eq!(
            parse(&["--tls-records", "derpd"]).expect("derpd"),
            TlsRecords::Derpd
        );
        assert_eq!(
            parse(&["--tls-records", "rustls"]).expect("rustls"),
            TlsRecords::Rustls
        );
        assert!(parse(&["--tls-records", "openssl"]).is_err());
        // derper's one-dash style reaches it too.
        let cli = crate::cli::try_parse_from(["derpd", "-tls-records=rustls"]).expect("parses");
        assert_eq!(cli.tls.tls_records, TlsRecordsArg::Rustls);
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
