//! The TLS listener: certificate selection, the handshake with its limits, and the hand-off to
//! the HTTP front.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwapOption;
use derp_proto::PublicKey;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{Acceptor, ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ProtocolVersion, ServerConfig};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::StartHandshake;
use tracing::{debug, warn};

use super::TlsError;
use super::meta::meta_certificate;
use super::x509::{Host, check_valid_for, validity};
use derp_io::Transport;
use derp_server::{
    BudgetMetrics, Listener, ProxiedListener, ProxyProtocol, Server, UnprovenBudget,
};

/// Default deadline for a whole TLS handshake, from accept to the first application byte.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default size of the port-80 listener's budget of connections.
pub const DEFAULT_HTTP_PORT_MAX_CONNECTIONS: usize = 1024;
/// Port-80 connections one source (an IPv4 address or an IPv6 /64) may hold at once, so one
/// host cannot fill the port and block captive-portal checks or HTTP-01 validation: one more
/// evicts that source's oldest.
const HTTP_PORT_MAX_PER_SOURCE: usize = 16;
/// Default deadline for the ClientHello. A socket that says nothing is cut off well before the
/// whole-handshake deadline, so idle connections hold a slot only briefly.
pub const DEFAULT_CLIENT_HELLO_TIMEOUT: Duration = Duration::from_secs(3);

/// ALPN protocol of TLS-ALPN-01 validation connections (RFC 8737).
pub(crate) const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";
const HTTP11_ALPN: &[u8] = b"http/1.1";

/// Settings for [`TlsFront`].
#[derive(Debug, Clone)]
pub struct TlsOptions {
    /// The server's name: a DNS name, or an IP address (manual mode). With a DNS name, a
    /// ClientHello whose SNI is missing or different is refused; with an IP, any SNI is
    /// accepted, as clients connecting by address send none.
    pub hostname: String,
    /// Deadline for each handshake; see [`DEFAULT_TLS_HANDSHAKE_TIMEOUT`]. How many may be
    /// in progress at once is the server's unproven-connection budget
    /// ([`ConnLimits`](derp_server::ConnLimits)).
    pub handshake_timeout: Duration,
    /// Deadline for the ClientHello, within the handshake's; see
    /// [`DEFAULT_CLIENT_HELLO_TIMEOUT`].
    pub client_hello_timeout: Duration,
    /// The port-80 listener's connections are all unproven and held in a budget of this size
    /// (16 at most from one source); when full, the oldest is closed to admit a new one.
    pub http_port_max_connections: usize,
    /// The PROXY protocol the port-80 listener takes (the server's,
    /// [`Server::proxy_protocol`]), when it sits behind the same balancer as the TLS
    /// listener, which takes the server's own.
    pub http_port_proxy_protocol: Option<ProxyProtocol>,
}

impl TlsOptions {
    /// Defaults for `hostname`.
    pub fn new(hostname: impl Into<String>) -> Self {
        Self {
            hostname: hostname.into(),
            handshake_timeout: DEFAULT_TLS_HANDSHAKE_TIMEOUT,
            client_hello_timeout: DEFAULT_CLIENT_HELLO_TIMEOUT,
            http_port_max_connections: DEFAULT_HTTP_PORT_MAX_CONNECTIONS,
            http_port_proxy_protocol: None,
        }
    }
}

/// Where the certificate in service came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertOrigin {
    /// Manual mode, files on disk signed by some CA.
    Manual,
    /// Manual mode, a self-signed certificate (generated for an IP, or the operator's own).
    SelfSigned,
    /// ACME, loaded from the cache directory.
    AcmeCache,
    /// ACME, issued by the server during this run.
    AcmeIssued,
    /// Installed directly through [`TlsFront::install`].
    Other,
}

/// The certificate in service, as [`TlsFront::cert_updates`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// Counts installs, starting at 1 for the first certificate; 0 means none yet.
    pub generation: u64,
    /// Where it came from.
    pub origin: CertOrigin,
    /// SHA-256 of the leaf certificate's DER.
    pub leaf_sha256: [u8; 32],
    /// Start of the leaf's validity.
    pub not_before: Option<SystemTime>,
    /// End of the leaf's validity.
    pub not_after: Option<SystemTime>,
}

impl CertInfo {
    /// The `sha256-raw:<hex>` pin of the leaf.
    pub fn pin(&self) -> String {
        format!("sha256-raw:{}", hex::encode(self.leaf_sha256))
    }
}

/// Certificates the resolver can hand out; shared with the rustls configs.
#[derive(Debug)]
struct CertState {
    host: Host,
    current: ArcSwapOption<CertifiedKey>,
    /// TLS-ALPN-01 validation certificates, by lowercase hostname.
    alpn_challenges: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

#[derive(Debug)]
struct Resolver {
    certs: Arc<CertState>,
    /// Answer TLS-ALPN-01 validation handshakes (the TCP listener only: ACME validates over
    /// TCP, and QUIC's ALPN is `derp` alone).
    acme: bool,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let sni = hello.server_name();
        if self.acme && offers_alpn(&hello, ACME_TLS_ALPN) {
            let name = sni?.trim_end_matches('.').to_ascii_lowercase();
            let challenges = self
                .certs
                .alpn_challenges
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            return challenges.get(&name).cloned();
        }
        if !self.certs.host.accepts_sni(sni) {
            debug!(sni, "refusing tls handshake for another name");
            return None;
        }
        self.certs.current.load_full()
    }
}

fn offers_alpn(hello: &ClientHello<'_>, proto: &[u8]) -> bool {
    hello
        .alpn()
        .is_some_and(|mut offered| offered.any(|p| p == proto))
}

#[derive(Debug)]
struct TlsMetrics {
    handshakes: IntCounterVec,
    versions: IntCounterVec,
    in_flight: IntGauge,
    not_after: IntGauge,
    http_port_accept_errors: IntCounter,
    http_port_budget: BudgetMetrics,
}

impl TlsMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let handshakes = IntCounterVec::new(
            Opts::new(
                "derp_tls_handshakes",
                "TLS handshakes by result: ok, error, timeout, evicted (to make room for newer \
                 unproven connections) or acme_validation",
            ),
            &["result"],
        )?;
        let versions = IntCounterVec::new(
            Opts::new(
                "derp_tls_connections_by_version",
                "Completed TLS handshakes by protocol version",
            ),
            &["version"],
        )?;
        let in_flight = IntGauge::new(
            "derp_tls_handshakes_in_flight",
            "TLS handshakes in progress",
        )?;
        let not_after = IntGauge::new(
            "derp_tls_cert_not_after_seconds",
            "Expiry of the certificate in service, as a Unix timestamp (0 if none)",
        )?;
        // Every outcome from the start, at zero, so a rate or an alert over one of them
        // sees a series before the first such handshake.
        for result in ["ok", "error", "timeout", "evicted", "acme_validation"] {
            handshakes.with_label_values(&[result]);
        }
        let http_port_accept_errors = IntCounter::new(
            "derp_http_port_accept_errors",
            "failed accept calls on the port-80 listener",
        )?;
        registry.register(Box::new(handshakes.clone()))?;
        registry.register(Box::new(versions.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(not_after.clone()))?;
        registry.register(Box::new(http_port_accept_errors.clone()))?;
        Ok(Self {
            handshakes,
            versions,
            in_flight,
            not_after,
            http_port_accept_errors,
            http_port_budget: BudgetMetrics::register(registry, "derp_http_port")?,
        })
    }
}

#[derive(Debug)]
struct Inner {
    certs: Arc<CertState>,
    meta: CertificateDer<'static>,
    provider: Arc<CryptoProvider>,
    /// For clients that offer `http/1.1` (browsers, curl).
    config_http11: Arc<ServerConfig>,
    /// For clients that offer no ALPN, or only protocols we do not speak (Tailscale clients
    /// offer none): no ALPN in the answer rather than a failed handshake.
    config_plain: Arc<ServerConfig>,
    /// For TLS-ALPN-01 validation.
    config_acme: Arc<ServerConfig>,
    /// For DERP over QUIC: TLS 1.3 only, ALPN `derp`, no ACME answers.
    config_quic: Arc<ServerConfig>,
    http01_tokens: Mutex<HashMap<String, String>>,
    generation: AtomicU64,
    updates: watch::Sender<CertInfo>,
    options: TlsOptions,
    metrics: TlsMetrics,
}

/// TLS in front of a [`Server`]: holds the certificate in service (with the meta certificate
/// appended), ACME challenge answers, and the accept loops for the TLS port and the port-80
/// listener. Cheap to clone; clones share everything.
#[derive(Clone, Debug)]
pub struct TlsFront {
    inner: Arc<Inner>,
}

impl TlsFront {
    /// Creates the front for a relay whose DERP key is `server_key`, registering its metrics
    /// on `registry`. No certificate is in service until one is installed (by
    /// [`ManualCerts`](super::ManualCerts), [`AcmeManager`](super::AcmeManager) or
    /// [`TlsFront::install`]); handshakes fail until then.
    pub fn new(
        server_key: &PublicKey,
        options: TlsOptions,
        registry: &Registry,
    ) -> Result<Self, TlsError> {
        let host = Host::parse(&options.hostname)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = Arc::new(CertState {
            host,
            current: ArcSwapOption::empty(),
            alpn_challenges: Mutex::new(HashMap::new()),
        });
        let build = |alpn: &[&[u8]], quic: bool| -> Result<Arc<ServerConfig>, TlsError> {
            let versions: &[&rustls::SupportedProtocolVersion] = if quic {
                &[&rustls::version::TLS13]
            } else {
                &[&rustls::version::TLS13, &rustls::version::TLS12]
            };
            let mut config = ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(versions)?
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(Resolver {
                    certs: certs.clone(),
                    acme: !quic,
                }));
            config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            // TLS 1.3 connections hand their traffic keys to derpd's record layer.
            config.enable_secret_extraction = !quic;
            Ok(Arc::new(config))
        };
        let config = |alpn: &[&[u8]]| build(alpn, false);
        let (updates, _) = watch::channel(CertInfo {
            generation: 0,
            origin: CertOrigin::Other,
            leaf_sha256: [0; 32],
            not_before: None,
            not_after: None,
        });
        Ok(Self {
            inner: Arc::new(Inner {
                meta: meta_certificate(server_key)?,
                config_http11: config(&[HTTP11_ALPN])?,
                config_plain: config(&[])?,
                config_acme: config(&[ACME_TLS_ALPN])?,
                config_quic: build(&[derp_server::quic::ALPN], true)?,
                certs,
                provider,
                http01_tokens: Mutex::new(HashMap::new()),
                generation: AtomicU64::new(0),
                updates,
                metrics: TlsMetrics::new(registry)?,
                options,
            }),
        })
    }

    pub(crate) fn hostname(&self) -> &Host {
        &self.inner.certs.host
    }

    /// The meta certificate appended to every served chain.
    pub fn meta_certificate(&self) -> &CertificateDer<'static> {
        &self.inner.meta
    }

    /// Puts a certificate chain (leaf first) and its key into service for new handshakes. The
    /// leaf must be valid for the hostname and match the key. The meta certificate is appended
    /// to a copy of the chain, never to the caller's.
    pub fn install(
        &self,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        origin: CertOrigin,
    ) -> Result<CertInfo, TlsError> {
        let Some(leaf) = chain.first().cloned() else {
            return Err(TlsError::Pem("empty certificate chain".into()));
        };
        check_valid_for(&leaf, &self.inner.certs.host)?;
        let mut served = chain;
        served.push(self.inner.meta.clone());
        let certified = CertifiedKey::from_der(served, key, &self.inner.provider)?;
        let (not_before, not_after) = match validity(&leaf) {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        let info = CertInfo {
            generation: self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1,
            origin,
            leaf_sha256: Sha256::digest(leaf.as_ref()).into(),
            not_before,
            not_after,
        };
        if not_after.is_some_and(|t| t <= SystemTime::now()) {
            warn!(pin = %info.pin(), "the certificate put into service has expired");
        }
        self.inner.certs.current.store(Some(Arc::new(certified)));
        let expiry = not_after
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.inner.metrics.not_after.set(expiry);
        self.inner.updates.send_replace(info.clone());
        Ok(info)
    }

    /// The rustls config for DERP over QUIC
    /// ([`QuicListener::bind`](derp_server::QuicListener::bind)): the same certificates as
    /// this front (hot reload, ACME, the meta certificate), TLS 1.3 only, ALPN `derp`, and no
    /// early data.
    pub fn quic_server_config(&self) -> Arc<ServerConfig> {
        self.inner.config_quic.clone()
    }

    /// The chain served right now (leaf first, meta certificate last), if any.
    pub fn served_chain(&self) -> Option<Vec<CertificateDer<'static>>> {
        self.inner.certs.current.load_full().map(|c| c.cert.clone())
    }

    /// Follows certificate changes: the receiver's value is the certificate in service
    /// (generation 0 until the first install).
    pub fn cert_updates(&self) -> watch::Receiver<CertInfo> {
        self.inner.updates.subscribe()
    }

    pub(crate) fn set_alpn_challenge(&self, hostname: &str, key: Option<Arc<CertifiedKey>>) {
        let mut map = self
            .inner
            .certs
            .alpn_challenges
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let name = hostname.trim_end_matches('.').to_ascii_lowercase();
        match key {
            Some(k) => map.insert(name, k),
            None => map.remove(&name),
        };
    }

    pub(crate) fn set_http01_token(&self, token: &str, key_authorization: Option<String>) {
        let mut map = self
            .inner
            .http01_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match key_authorization {
            Some(v) => map.insert(token.to_owned(), v),
            None => map.remove(token),
        };
    }

    pub(crate) fn http01_answer(&self, token: &str) -> Option<String> {
        self.inner
            .http01_tokens
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(token)
            .cloned()
    }

    /// A fresh budget for the port-80 listener, and the counter of its accept errors.
    pub(crate) fn http_port_limits(&self) -> (UnprovenBudget, IntCounter) {
        let m = &self.inner.metrics;
        (
            UnprovenBudget::new(
                self.inner.options.http_port_max_connections,
                HTTP_PORT_MAX_PER_SOURCE,
                m.http_port_budget.clone(),
            ),
            m.http_port_accept_errors.clone(),
        )
    }

    pub(crate) fn http_port_proxy_protocol(&self) -> Option<ProxyProtocol> {
        self.inner.options.http_port_proxy_protocol.clone()
    }

    pub(crate) fn provider(&self) -> &Arc<CryptoProvider> {
        &self.inner.provider
    }

    /// Accepts TLS connections on `listener` until `server` shuts down. Each connection
    /// passes the server's accept limits first and holds a place in its unproven budget
    /// through the TLS handshake and on until its DERP client is registered; a handshake
    /// evicted from the budget (to admit a newer connection) is abandoned. Each handshake
    /// runs in its own task under a deadline; a finished one is served by `server`'s HTTP
    /// front exactly like a plain connection. Failures of accept are counted and waited out
    /// as [`Listener`] does for every listener. With the server's PROXY protocol on, each
    /// connection's header is read first, within the same deadline, and the connection is
    /// the client's it names from then on.
    pub async fn serve(&self, server: &Server, listener: TcpListener) -> io::Result<()> {
        let shutdown = server.shutdown_token();
        let proxy = server.proxy_protocol();
        let mut listener = Listener::new(listener, "main", server.accept_error_counter("main"));
        loop {
            let (tcp, remote) = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                a = listener.accept() => a,
            };
            let Some(guard) = server.admit_connection(remote) else {
                drop(tcp);
                continue;
            };
            derp_io::tune_socket(&tcp, server.tcp_options());
            let _ = tcp.set_nodelay(true);
            let this = self.clone();
            let server = server.clone();
            let shutdown = shutdown.clone();
            let proxy = proxy.clone();
            tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + this.inner.options.handshake_timeout;
                let (tcp, remote, received) = match proxy {
                    None => (tcp, remote, Vec::new()),
                    Some(proxy) => {
                        let mut tcp = tcp;
                        let mut buf = bytes::BytesMut::new();
                        let header = tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = guard.evicted() => {
                                debug!(%remote, "evicted while sending its proxy header");
                                return;
                            }
                            h = proxy.read_header(ProxiedListener::Main, &mut tcp, remote, deadline, &mut buf) => h,
                        };
                        let Ok(client) = header else { return };
                        if let Some(client) = client {
                            guard.relayed_for(client.ip());
                        }
                        (tcp, client.unwrap_or(remote), buf.to_vec())
                    }
                };
                let metrics = &this.inner.metrics;
                metrics.in_flight.inc();
                let result = tokio::select! {
                    _ = shutdown.cancelled() => None,
                    _ = guard.evicted() => Some(Err(Evicted)),
                    r = tokio::time::timeout_at(deadline, this.handshake(tcp, received)) => Some(Ok(r)),
                };
                metrics.in_flight.dec();
                let outcome = match result {
                    None => return,
                    Some(Err(Evicted)) => {
                        debug!(%remote, "tls handshake evicted");
                        "evicted"
                    }
                    // TLS-ALPN-01 validation: the handshake was all it wanted.
                    Some(Ok(Ok(Ok(None)))) => "acme_validation",
                    Some(Ok(Ok(Ok(Some((transport, version)))))) => {
                        metrics.versions.with_label_values(&[version]).inc();
                        server.spawn_guarded(transport, remote, guard);
                        "ok"
                    }
                    Some(Ok(Ok(Err(e)))) => {
                        debug!(%remote, error = %e, "tls handshake failed");
                        "error"
                    }
                    Some(Ok(Err(_))) => {
                        debug!(%remote, "tls handshake timed out");
                        "timeout"
                    }
                };
                metrics.handshakes.with_label_values(&[outcome]).inc();
            });
        }
    }

    /// Reads the ClientHello (`received` holds what was already read of it), picks the config
    /// for its ALPN offer, and finishes the handshake, returning the stream and the TLS
    /// version's metric label. `None` for a TLS-ALPN-01 validation connection, which carries
    /// no HTTP.
    ///
    /// A client that offers TLS 1.3 gets derpd's own record layer after rustls's handshake
    /// ([`derp_io::tls`]): no rustls buffers or connection state per connection, no lock
    /// between the halves, and a reader that can wait for the socket holding nothing. Any
    /// other client (and any hello derpd's reader does not follow) is served by rustls's
    /// buffered connection.
    async fn handshake(
        &self,
        mut tcp: TcpStream,
        mut received: Vec<u8>,
    ) -> io::Result<Option<(Transport, &'static str)>> {
        let hello = tokio::time::timeout(self.inner.options.client_hello_timeout, async {
            match read_client_hello(&mut tcp, &mut received).await? {
                derp_io::tls::ClientHello::Hello { tls13: true, alpn } => {
                    Ok::<_, io::Error>(Hello::Tls13(alpn))
                }
                _ => Ok(Hello::Rustls(Box::new(
                    accept_client_hello(&mut tcp, &mut received).await?,
                ))),
            }
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no ClientHello in time"))?;
        match hello? {
            Hello::Tls13(alpn) => {
                let offers = |p: &[u8]| alpn.iter().any(|a| a == p);
                let config = self.config_for(offers(ACME_TLS_ALPN), offers(HTTP11_ALPN));
                let done = derp_io::tls::accept(tcp, received, config)
                    .await
                    .map_err(io::Error::other)?;
                if done.alpn.as_deref() == Some(ACME_TLS_ALPN) {
                    return Ok(None);
                }
                Ok(Some((Transport::Tls(Box::new(done.stream)), "1.3")))
            }
            Hello::Rustls(accepted) => {
                let hello = accepted.client_hello();
                let config = self.config_for(
                    offers_alpn(&hello, ACME_TLS_ALPN),
                    offers_alpn(&hello, HTTP11_ALPN),
                );
                let stream = StartHandshake::from_parts(*accepted, tcp)
                    .into_stream(config)
                    .await?;
                let conn = stream.get_ref().1;
                if conn.alpn_protocol() == Some(ACME_TLS_ALPN) {
                    return Ok(None);
                }
                let version = match conn.protocol_version() {
                    Some(ProtocolVersion::TLSv1_3) => "1.3",
                    Some(ProtocolVersion::TLSv1_2) => "1.2",
                    _ => "other",
                };
                Ok(Some((Transport::Boxed(Box::new(stream)), version)))
            }
        }
    }

    /// The config for a client offering these ALPN protocols.
    fn config_for(&self, acme: bool, http11: bool) -> Arc<ServerConfig> {
        if acme {
            self.inner.config_acme.clone()
        } else if http11 {
            self.inner.config_http11.clone()
        } else {
            self.inner.config_plain.clone()
        }
    }
}

/// Which handshake a ClientHello gets.
enum Hello {
    /// TLS 1.3, with the ALPN protocols offered.
    Tls13(Vec<Vec<u8>>),
    /// rustls's buffered connection, its acceptor holding the hello (boxed: it is large,
    /// and this path is the rare one).
    Rustls(Box<rustls::server::Accepted>),
}

/// Reads until `received` holds a whole ClientHello, or bytes derpd's reader does not follow.
async fn read_client_hello(
    tcp: &mut TcpStream,
    received: &mut Vec<u8>,
) -> io::Result<derp_io::tls::ClientHello> {
    loop {
        let hello = derp_io::tls::ClientHello::parse(received);
        // The reader bounds what it waits for; this bounds what a read can add past that.
        if hello != derp_io::tls::ClientHello::Incomplete
            || received.len() > 2 * derp_io::tls::MAX_CLIENT_HELLO
        {
            return Ok(hello);
        }
        received.reserve(2048);
        if tcp.read_buf(received).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// Feeds what was read to rustls's acceptor and reads on until it has a whole ClientHello. A
/// malformed hello is answered with the alert rustls chose.
async fn accept_client_hello(
    tcp: &mut TcpStream,
    received: &mut Vec<u8>,
) -> io::Result<rustls::server::Accepted> {
    let mut acceptor = Acceptor::default();
    let mut fed = 0;
    loop {
        let mut rest = &received[fed..];
        while !rest.is_empty() {
            acceptor.read_tls(&mut rest)?;
        }
        fed = received.len();
        match acceptor.accept() {
            Ok(Some(accepted)) => return Ok(accepted),
            Ok(None) => {}
            Err((e, mut alert)) => {
                let mut bytes = Vec::new();
                let _ = alert.write_all(&mut bytes);
                let _ = tcp.write_all(&bytes).await;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
        if received.len() >= derp_io::tls::MAX_CLIENT_HELLO {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "ClientHello too large",
            ));
        }
        received.reserve(2048);
        if tcp.read_buf(received).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// A handshake that lost its place in the unproven budget.
struct Evicted;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_and_match_sni() {
        let dns = Host::parse("Derp.Example.com.").unwrap();
        assert_eq!(dns, Host::Dns("derp.example.com".into()));
        assert!(dns.accepts_sni(Some("derp.example.com")));
        assert!(dns.accepts_sni(Some("DERP.example.com.")));
        assert!(!dns.accepts_sni(Some("other.example.com")));
        assert!(!dns.accepts_sni(None));
        let ip = Host::parse("127.0.0.1").unwrap();
        assert!(ip.accepts_sni(None));
        assert!(ip.accepts_sni(Some("anything")));
        assert_eq!(
            Host::parse("[::1]").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        assert!(Host::parse("").is_err());
        assert!(Host::parse("a..b").is_err());
        assert!(Host::parse("under_score.example").is_err());
        assert!(Host::parse(&"a".repeat(64)).is_err());
    }
}
