//! The server under test: its URL, how to observe it, and the relay `--spawn-server` starts.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use derp_client::rustls::pki_types::CertificateDer;
use derp_client::{Client, ClientConfig, ConnectError, ServerUrl, UrlError};
use derp_proto::SecretKey;
use derp_server::ServeError;
use derp_server::{Server, ServerConfig};

use crate::args::TargetArgs;
use crate::procfs::{self, CpuTime};
use crate::prom::MetricsSource;

/// Thread-name prefix of the spawned relay's runtime, so its CPU can be told from the
/// bench's (both live in one process).
pub const SERVER_THREAD_PREFIX: &str = "derpd-srv";
/// Thread-name prefix of the bench's own runtime.
pub const BENCH_THREAD_NAME: &str = "derp-bench";

/// A relay running in this process on its own runtime.
#[derive(Debug)]
pub struct SpawnedServer {
    runtime: tokio::runtime::Runtime,
    server: Server,
    /// Its DERP URL.
    pub url: String,
    /// Its metrics registry.
    pub registry: prometheus::Registry,
}

impl SpawnedServer {
    /// Starts a relay with derpd's defaults on 127.0.0.1, on a port the kernel picks.
    pub fn start() -> Result<Self, SpawnError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name(SERVER_THREAD_PREFIX)
            .build()
            .map_err(SpawnError::Runtime)?;
        let registry = prometheus::Registry::new();
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let server = Server::new(ServerConfig::new(secret), &registry)?;
        let listen = || {
            let std_listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
            std_listener.set_nonblocking(true)?;
            let addr = std_listener.local_addr()?;
            let _guard = runtime.enter();
            Ok((tokio::net::TcpListener::from_std(std_listener)?, addr))
        };
        let (listener, addr) = listen().map_err(SpawnError::Listen)?;
        let serving = server.clone();
        runtime.spawn(async move {
            if let Err(e) = serving.serve(listener).await {
                eprintln!("in-process relay stopped: {e}");
            }
        });
        Ok(Self {
            runtime,
            server,
            url: format!("http://{addr}/derp"),
            registry,
        })
    }

    /// Closes every connection and stops the relay's runtime.
    pub fn stop(self) {
        let server = self.server;
        let stopped = self.runtime.block_on(async move {
            tokio::time::timeout(Duration::from_secs(5), server.shutdown()).await
        });
        if stopped.is_err() {
            eprintln!("derp-bench: in-process relay did not stop within 5s");
        }
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// Where the server's CPU and memory figures come from.
#[derive(Clone, Debug)]
pub enum ServerProbe {
    /// Not observable from here.
    None,
    /// Separate processes on this machine (their CPU is added up).
    Pids(Vec<u32>),
    /// The spawned relay's threads in this process.
    InProcess,
}

/// The server under test.
#[derive(Debug)]
pub struct Target {
    /// The DERP URL.
    pub url: ServerUrl,
    /// Where the receiving halves of pairs connect, when not to `url`.
    pub peer_url: Option<ServerUrl>,
    /// Where the server's metrics come from, if anywhere.
    pub metrics: Option<MetricsSource>,
    /// Where its CPU and memory figures come from.
    pub probe: ServerProbe,
    /// Budget for each connection's dial, upgrade and handshake.
    pub connect_timeout: Duration,
    /// Whether the server is the relay this process started.
    pub spawned: bool,
    ticks: f64,
    tls: TlsOptions,
}

/// Certificate checks and transport choices for TLS and QUIC targets.
#[derive(Clone, Debug, Default)]
struct TlsOptions {
    cert_name: Option<String>,
    extra_roots: Vec<CertificateDer<'static>>,
    quic_port: Option<u16>,
    quic_datagrams: bool,
    quic_congestion: derp_client::QuicCongestion,
    /// A probe request ahead of each upgrade (`--probe-first`).
    probe_first: bool,
}

impl Target {
    /// Resolves the flags into a target; `spawned` is the relay `--spawn-server` started.
    pub fn new(args: &TargetArgs, spawned: Option<&SpawnedServer>) -> Result<Self, TargetError> {
        let url_text = match (spawned, &args.url) {
            (Some(s), _) => s.url.clone(),
            (None, Some(url)) => url.clone(),
            (None, None) => return Err(TargetError::NoServer),
        };
        let url: ServerUrl = url_text.parse().map_err(|source| TargetError::BadUrl {
            flag: "--url",
            url: url_text.clone(),
            source,
        })?;
        let metrics = match (&args.metrics_url, spawned) {
            (Some(m), _) => Some(MetricsSource::Http(m.clone())),
            (None, Some(s)) => Some(MetricsSource::InProcess(s.registry.clone())),
            (None, None) => None,
        };
        let peer_url = match &args.peer_url {
            Some(p) => Some(p.parse().map_err(|source| TargetError::BadUrl {
                flag: "--peer-url",
                url: p.clone(),
                source,
            })?),
            None => None,
        };
        for pid in &args.server_pid {
            if !std::path::Path::new(&format!("/proc/{pid}/stat")).exists() {
                return Err(TargetError::NoSuchPid(*pid));
            }
        }
        let probe = match (args.server_pid.is_empty(), spawned) {
            (false, _) => ServerProbe::Pids(args.server_pid.clone()),
            (true, Some(_)) => ServerProbe::InProcess,
            (true, None) => ServerProbe::None,
        };
        let extra_roots = match &args.ca {
            None => Vec::new(),
            Some(path) => {
                let pem = std::fs::read(path).map_err(|source| TargetError::ReadCa {
                    path: path.clone(),
                    source,
                })?;
                read_pem_certs(&pem).map_err(|source| TargetError::CaFile {
                    path: path.clone(),
                    source,
                })?
            }
        };
        if args.quic_port.is_some() && url.scheme() != derp_client::Scheme::Https {
            return Err(TargetError::QuicPortScheme);
        }
        Ok(Self {
            url,
            peer_url,
            metrics,
            probe,
            connect_timeout: args.connect_timeout,
            spawned: spawned.is_some(),
            ticks: procfs::clock_ticks_per_second(),
            tls: TlsOptions {
                cert_name: args.cert_name.clone(),
                extra_roots,
                quic_port: args.quic_port,
                quic_datagrams: !args.quic_no_datagrams,
                quic_congestion: args.quic_congestion,
                probe_first: args.probe_first,
            },
        })
    }

    /// Whether connections open with a probe request (`--probe-first`).
    pub fn probe_first(&self) -> bool {
        self.tls.probe_first
    }

    /// A client config for this target.
    pub fn client_config(&self, secret: SecretKey, local: Option<SocketAddr>) -> ClientConfig {
        self.template().config(secret, local)
    }

    /// A client config for the receiving half of a pair: on `--peer-url` when given.
    pub fn peer_client_config(&self, secret: SecretKey, local: Option<SocketAddr>) -> ClientConfig {
        match &self.peer_url {
            Some(url) => ClientTemplate {
                url: url.clone(),
                connect_timeout: self.connect_timeout,
                tls: self.tls.clone(),
            }
            .config(secret, local),
            None => self.client_config(secret, local),
        }
    }

    /// What tasks need to build client configs, detached from the target.
    pub fn template(&self) -> ClientTemplate {
        ClientTemplate {
            url: self.url.clone(),
            connect_timeout: self.connect_timeout,
            tls: self.tls.clone(),
        }
    }

    /// One connection and handshake before anything else, so that an unreachable or refusing
    /// server ends the run at once with a clear message.
    pub async fn preflight(&self) -> Result<(), TargetError> {
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let mut configs = vec![(self.url.clone(), self.client_config(secret.clone(), None))];
        if let Some(peer) = &self.peer_url {
            configs.push((peer.clone(), self.peer_client_config(secret, None)));
        }
        for (url, config) in configs {
            match Client::connect(&config).await {
                Ok(client) => {
                    let _ = client.close().await;
                }
                Err(error) => return Err(TargetError::Unusable { url, error }),
            }
        }
        Ok(())
    }

    /// CPU used so far by the server, if it can be observed.
    pub fn server_cpu(&self) -> Option<CpuTime> {
        match self.probe {
            ServerProbe::None => None,
            ServerProbe::Pids(ref pids) => {
                let mut total = CpuTime::default();
                for pid in pids {
                    let cpu = procfs::process_cpu(&pid.to_string(), self.ticks)?;
                    total.user_s += cpu.user_s;
                    total.system_s += cpu.system_s;
                }
                Some(total)
            }
            ServerProbe::InProcess => procfs::own_threads_cpu(SERVER_THREAD_PREFIX, self.ticks),
        }
    }

    /// Machine-wide CPU time so far.
    pub fn machine_cpu(&self) -> Option<procfs::MachineCpu> {
        procfs::machine_cpu(self.ticks)
    }

    /// CPU used so far by the bench itself: the whole process, less the spawned relay's
    /// threads when there is one.
    pub fn bench_cpu(&self) -> Option<CpuTime> {
        let all = procfs::process_cpu("self", self.ticks)?;
        match self.probe {
            ServerProbe::InProcess => {
                let server = procfs::own_threads_cpu(SERVER_THREAD_PREFIX, self.ticks)?;
                Some(all.since(server))
            }
            _ => Some(all),
        }
    }

    /// Source addresses for `n` connections: `None` (let the kernel pick) unless `n` exceeds
    /// what one source address can hold and the target is an IPv4 loopback address, in which
    /// case connections are spread over 127.0.1.0/24 and beyond.
    pub fn source_addrs(&self, n: usize) -> SourceAddrs {
        // Leave headroom for TIME_WAIT sockets and whatever else uses ephemeral ports.
        let per_addr = (procfs::ephemeral_ports() as usize * 3 / 4).max(1);
        let loopback = match self.url.host().parse::<IpAddr>() {
            Ok(IpAddr::V4(ip)) => ip.is_loopback(),
            Ok(IpAddr::V6(_)) => false,
            Err(_) => self.url.host().eq_ignore_ascii_case("localhost"),
        };
        if n <= per_addr || !loopback {
            return SourceAddrs { per_addr: 0 };
        }
        SourceAddrs { per_addr }
    }
}

/// Builds client configs for one target.
#[derive(Clone, Debug)]
pub struct ClientTemplate {
    url: ServerUrl,
    connect_timeout: Duration,
    tls: TlsOptions,
}

impl ClientTemplate {
    /// A config for a client with key `secret`, from `local` when given.
    pub fn config(&self, secret: SecretKey, local: Option<SocketAddr>) -> ClientConfig {
        let mut config = ClientConfig::with_url(self.url.clone(), secret)
            .with_connect_timeout(self.connect_timeout)
            .with_app_name("derp-bench")
            .with_quic_datagrams(self.tls.quic_datagrams)
            .with_quic_congestion(self.tls.quic_congestion);
        config.extra_roots = self.tls.extra_roots.clone();
        config.cert_name = self.tls.cert_name.clone();
        config.quic_port = self.tls.quic_port;
        config.probe_first = self.tls.probe_first;
        if let Some(local) = local {
            config = config.with_local_addr(local);
        }
        config
    }
}

/// The certificates in a PEM file.
fn read_pem_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let text = std::str::from_utf8(pem).map_err(|_| PemError::NotUtf8)?;
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(PEM_BEGIN) {
        let body = &rest[start + PEM_BEGIN.len()..];
        let end = body.find(PEM_END).ok_or(PemError::Unterminated)?;
        let b64: String = body[..end].split_whitespace().collect();
        let der = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &b64)
            .map_err(|_| PemError::Base64)?;
        out.push(CertificateDer::from(der));
        rest = &body[end + PEM_END.len()..];
    }
    if out.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(out)
}

const PEM_BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const PEM_END: &str = "-----END CERTIFICATE-----";

/// Assigns source addresses to connection indexes.
#[derive(Clone, Copy, Debug)]
pub struct SourceAddrs {
    /// Connections per source address; 0 means "let the kernel choose".
    per_addr: usize,
}

impl SourceAddrs {
    /// The local address for connection `i`.
    pub fn for_index(self, i: usize) -> Option<SocketAddr> {
        if self.per_addr == 0 {
            return None;
        }
        let base = u32::from(Ipv4Addr::new(127, 0, 1, 1));
        // 127.0.1.1 up to 127.255.255.254 is far more than MAX_CONNECTIONS needs.
        let ip = Ipv4Addr::from(base + (i / self.per_addr) as u32);
        Some(SocketAddr::from((ip, 0)))
    }

    /// How many source addresses `n` connections use (1 when the kernel chooses).
    pub fn count(self, n: usize) -> usize {
        if self.per_addr == 0 {
            1
        } else {
            n.div_ceil(self.per_addr)
        }
    }
}

/// A connect error in words an operator can act on.
pub fn describe_connect_error(e: &ConnectError) -> String {
    match e {
        ConnectError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            format!("connection refused (is the server running and listening there?): {e}")
        }
        ConnectError::HttpStatus { status } => {
            format!(
                "the server refused the DERP upgrade with HTTP {status} (wrong path, or DERP disabled?)"
            )
        }
        ConnectError::Timeout(_) => format!("{e} (server unreachable or overloaded)"),
        other if is_tls(other) => format!(
            "{other} (https://, wss:// and quic:// need a certificate the client trusts: \
             --cert-name sha256-raw:<pin> for a self-signed node, or --ca FILE for a private CA)"
        ),
        ConnectError::QuicConnect(_) | ConnectError::QuicConnection(_) => format!(
            "{e} (is QUIC enabled on the server, and is that its UDP port? derpd serves it on \
             TLS nodes with --quic-port)"
        ),
        other => other.to_string(),
    }
}

/// Whether setting up TLS or its handshake failed, over TCP or QUIC.
fn is_tls(e: &ConnectError) -> bool {
    matches!(
        e,
        ConnectError::ExtraRoot { .. }
            | ConnectError::Verifier { .. }
            | ConnectError::TlsVersions(_)
            | ConnectError::QuicTlsConfig(_)
            | ConnectError::TlsHandshake(_)
            | ConnectError::TlsIo(_)
            | ConnectError::QuicTls(_)
    )
}

/// A short, stable name for a connect error, for failure counts.
pub fn connect_error_kind(e: &ConnectError) -> String {
    match e {
        ConnectError::BadUrl(_) => "bad_url".into(),
        ConnectError::InvalidConfig(_) => "invalid_config".into(),
        ConnectError::NoAddress { .. } => "no_address".into(),
        ConnectError::Io(io) => format!("io_{:?}", io.kind()).to_ascii_lowercase(),
        ConnectError::Timeout(_) => "timeout".into(),
        ConnectError::UnexpectedEof => "closed_during_handshake".into(),
        ConnectError::HttpStatus { status } => format!("http_{status}"),
        ConnectError::BadResponse(_) => "bad_http_response".into(),
        ConnectError::WebSocket(_) => "websocket".into(),
        ConnectError::Decode(_) | ConnectError::UnexpectedFrame { .. } => "bad_frame".into(),
        ConnectError::Handshake(_) => "handshake".into(),
        ConnectError::Connection(_) => "connection".into(),
        ConnectError::NoRuntime(_)
        | ConnectError::QuicConnect(_)
        | ConnectError::QuicConnection(_) => "quic".into(),
        other if is_tls(other) => "tls".into(),
        _ => "other".into(),
    }
}

/// Fails early when `n` connections (doubled when the relay lives in this process) would
/// exceed the open-files limit, instead of failing half-way with EMFILE.
pub fn check_fd_budget(n: usize, spawned: bool) -> Result<(), TargetError> {
    let needed = n as u64 * if spawned { 2 } else { 1 } + 64;
    if let Some(limit) = procfs::open_files_limit()
        && needed > limit
    {
        return Err(TargetError::FdBudget {
            connections: n,
            needed,
            limit,
            spawned,
        });
    }
    Ok(())
}

/// Why the target cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// Neither `--url` nor `--spawn-server`.
    #[error("give the server with --url URL, or use --spawn-server")]
    NoServer,
    /// A URL flag that does not parse.
    #[error("bad {flag} {url:?}")]
    BadUrl {
        /// `--url` or `--peer-url`.
        flag: &'static str,
        /// What was given.
        url: String,
        /// Why it is no DERP URL.
        source: UrlError,
    },
    /// A `--server-pid` with no process behind it.
    #[error("--server-pid {0}: no such process (or /proc is not mounted)")]
    NoSuchPid(u32),
    /// The `--ca` file cannot be read.
    #[error("reading --ca {}", path.display())]
    ReadCa {
        /// The file.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The `--ca` file holds no usable certificate.
    #[error("--ca {}", path.display())]
    CaFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: PemError,
    },
    /// `--quic-port` with a URL that is not https://.
    #[error("--quic-port goes with an https:// URL (a quic:// URL names its own port)")]
    QuicPortScheme,
    /// The preflight connection failed.
    #[error("cannot use DERP server {url}: {}", describe_connect_error(error))]
    Unusable {
        /// The server that failed.
        url: ServerUrl,
        /// How.
        error: ConnectError,
    },
    /// More connections than the open-files limit allows.
    #[error(
        "{connections} connections need about {needed} open files{}, but the limit is \
         {limit}: raise `ulimit -n` or lower --connections",
        if *spawned { " (client and in-process server side)" } else { "" }
    )]
    FdBudget {
        /// Connections asked for.
        connections: usize,
        /// Descriptors they need.
        needed: u64,
        /// The soft limit.
        limit: u64,
        /// Whether the in-process relay's side counts too.
        spawned: bool,
    },
}

/// What is wrong with a PEM file of certificates.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// Not text.
    #[error("not UTF-8 PEM")]
    NotUtf8,
    /// A BEGIN without its END.
    #[error("unterminated certificate")]
    Unterminated,
    /// A certificate's body is not base64.
    #[error("bad base64 in certificate")]
    Base64,
    /// No certificate at all.
    #[error("no certificate")]
    NoCertificate,
}

/// Why the in-process relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// Its runtime.
    #[error("starting the relay's runtime")]
    Runtime(#[source] std::io::Error),
    /// The relay itself.
    #[error("creating the in-process relay")]
    Server(#[from] ServeError),
    /// Its listener on 127.0.0.1.
    #[error("listening on 127.0.0.1 for the in-process relay")]
    Listen(#[source] std::io::Error),
}

#[cfg(test)]
mod tests {
    use derp_client::quinn::{ConnectionClose, ConnectionError, TransportErrorCode};
    use derp_client::rustls;

    use super::*;

    #[test]
    fn tls_and_quic_failures_keep_their_kinds_and_hints() {
        let crypto_close = ConnectionError::ConnectionClosed(ConnectionClose {
            error_code: TransportErrorCode::crypto(42),
            frame_type: None,
            reason: Default::default(),
        });
        let tls = [
            ConnectError::ExtraRoot {
                source: Box::new(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::BadEncoding,
                )),
            },
            ConnectError::TlsHandshake(Box::new(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))),
            ConnectError::TlsIo(std::io::ErrorKind::ConnectionReset.into()),
            ConnectError::QuicTls(Box::new(crypto_close)),
        ];
        for e in &tls {
            assert_eq!(connect_error_kind(e), "tls", "{e:?}");
            assert!(describe_connect_error(e).contains("--cert-name"), "{e:?}");
        }
        let quic = ConnectError::QuicConnection(Box::new(ConnectionError::TimedOut));
        assert_eq!(connect_error_kind(&quic), "quic");
        assert!(describe_connect_error(&quic).contains("--quic-port"));
        let no_runtime = tokio::runtime::Handle::try_current().expect_err("a plain test");
        assert_eq!(
            connect_error_kind(&ConnectError::NoRuntime(no_runtime)),
            "quic"
        );
    }
}
