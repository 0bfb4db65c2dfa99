//! The TLS listener: certificate selection, the handshake with its limits, and the hand-off to
//! the HTTP front.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwapOption;
use derp_proto::PublicKey;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::Acceptor;
use rustls::sign::CertifiedKey;
use rustls::{ProtocolVersion, ServerConfig};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::StartHandshake;
use tracing::{debug, warn};

use super::TlsError;
use super::ip_slots::{IpSlot, IpSlots, IpStatus, is_global_unicast};
use super::meta::meta_certificate;
use super::x509::{Host, check_valid_for, validity};
use derp_io::Transport;

mod options;
mod resolver;

use derp_server::{
    BudgetMetrics, Listener, Opened, ProxiedListener, ProxyProtocol, Server, UnprovenBudget,
    open_connection,
};
use options::HTTP_PORT_MAX_PER_SOURCE;
pub use options::{
    CertInfo, CertOrigin, DEFAULT_CLIENT_HELLO_TIMEOUT, DEFAULT_HTTP_PORT_MAX_CONNECTIONS,
    DEFAULT_TLS_HANDSHAKE_TIMEOUT, TlsOptions, TlsRecords,
};
use resolver::{CertState, Resolver, offers_alpn, server_config, serving_provider, sni_of};

/// ALPN protocol of TLS-ALPN-01 validation connections (RFC 8737).
pub(crate) const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";
const HTTP11_ALPN: &[u8] = b"http/1.1";

#[derive(Debug)]
struct TlsMetrics {
    handshakes: IntCounterVec,
    versions: IntCounterVec,
    record_layers: IntCounterVec,
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
        let record_layers = IntCounterVec::new(
            Opts::new(
                "derp_tls_connections_by_record_layer",
                "Completed TLS handshakes by who seals and opens their records: derpd (TLS 1.3) \
                 or rustls (TLS 1.2, and TLS 1.3 with --tls-records rustls)",
            ),
            &["layer"],
        )?;
        for layer in [TlsRecords::Derpd, TlsRecords::Rustls] {
            record_layers.with_label_values(&[layer.name()]);
        }
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
        registry.register(Box::new(record_layers.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(not_after.clone()))?;
        registry.register(Box::new(http_port_accept_errors.clone()))?;
        Ok(Self {
            handshakes,
            versions,
            record_layers,
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
    /// With [`TlsOptions::ip_certs`]: a certificate slot per local address.
    ip_slots: Option<IpSlots>,
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
        let provider = Arc::new(serving_provider(rustls::crypto::ring::default_provider()));
        let certs = Arc::new(CertState {
            host,
            current: ArcSwapOption::empty(),
            alpn_challenges: Mutex::new(HashMap::new()),
        });
        let build = |alpn: &[&[u8]], quic: bool| {
            let resolver = Resolver {
                certs: certs.clone(),
                acme: !quic,
                ip: None,
            };
            server_config(&provider, resolver, alpn, quic, options.records)
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
                ip_slots: options.ip_certs.then(IpSlots::new),
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
            return Err(TlsError::EmptyChain);
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

    /// Puts a certificate for the node's address `ip` into service for new handshakes to
    /// that address ([`TlsOptions::ip_certs`]). The leaf must be valid for `ip` and match
    /// the key; the meta certificate is appended as for the hostname's.
    pub fn install_ip(
        &self,
        ip: IpAddr,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        origin: CertOrigin,
    ) -> Result<CertInfo, TlsError> {
        let ip = ip.to_canonical();
        let slot = self.ip_slot(ip)?;
        let Some(leaf) = chain.first().cloned() else {
            return Err(TlsError::EmptyChain);
        };
        check_valid_for(&leaf, &Host::Ip(ip))?;
        let mut served = chain;
        served.push(self.inner.meta.clone());
        let certified = CertifiedKey::from_der(served, key, &self.inner.provider)?;
        let (not_before, not_after) =
            validity(&leaf).map_or((None, None), |(a, b)| (Some(a), Some(b)));
        slot.cert.store(Some(Arc::new(certified)));
        let mut info = CertInfo {
            generation: 0,
            origin,
            leaf_sha256: Sha256::digest(leaf.as_ref()).into(),
            not_before,
            not_after,
        };
        slot.status.send_modify(|s| {
            s.installs += 1;
            s.retry_at = None;
            info.generation = s.installs;
        });
        Ok(info)
    }

    /// The slots of IP certificates on demand, when the front has them.
    pub(crate) fn ip_slots(&self) -> Option<&IpSlots> {
        self.inner.ip_slots.as_ref()
    }

    /// The slot of the node's address `ip`, made on first use (which asks the manager for a
    /// certificate), for the configured address or a global unicast one only.
    pub(crate) fn ip_slot(&self, ip: IpAddr) -> Result<Arc<IpSlot>, TlsError> {
        let Some(slots) = &self.inner.ip_slots else {
            return Err(TlsError::IpCertsNotEnabled);
        };
        let configured = matches!(self.hostname(), Host::Ip(c) if c.to_canonical() == ip);
        if !configured && !is_global_unicast(ip) {
            return Err(TlsError::IpNotEligible(ip));
        }
        slots.get_or_create(ip, || {
            let cert = Arc::new(ArcSwapOption::empty());
            let config = |alpn: &[&[u8]]| {
                let resolver = Resolver {
                    certs: self.inner.certs.clone(),
                    acme: false,
                    ip: Some((ip, cert.clone())),
                };
                server_config(
                    &self.inner.provider,
                    resolver,
                    alpn,
                    false,
                    self.inner.options.records,
                )
            };
            Ok(IpSlot {
                plain: config(&[])?,
                http11: config(&[HTTP11_ALPN])?,
                cert,
                status: watch::Sender::new(IpStatus::default()),
            })
        })
    }

    /// With IP certificates on, the config for a connection to `local` whose client asks
    /// for an address's certificate (no SNI, or an address as SNI), after waiting for that
    /// address's first issuance. `None` when IP certificates are off or the client named a
    /// DNS host: the hostname's config then serves it.
    async fn ip_config(
        &self,
        local: IpAddr,
        sni: Option<&str>,
        http11: bool,
    ) -> Result<Option<Arc<ServerConfig>>, HandshakeError> {
        if self.inner.ip_slots.is_none() {
            return Ok(None);
        }
        let Some(ip) = self.ip_wanted(local.to_canonical(), sni)? else {
            return Ok(None);
        };
        let slot = self.ip_slot(ip)?;
        if slot.cert.load().is_none() {
            wait_for_ip_cert(&slot, ip).await?;
        }
        Ok(Some(if http11 {
            slot.http11.clone()
        } else {
            slot.plain.clone()
        }))
    }

    /// The address whose certificate a connection to `local` naming `sni` is served, or
    /// `None` for a DNS name. With an IP `--hostname` that is the configured address, not
    /// the socket's: behind 1:1 NAT (the usual cloud VM) the socket's is a private address
    /// no CA will certify, while the configured one is what clients dial.
    fn ip_wanted(&self, local: IpAddr, sni: Option<&str>) -> Result<Option<IpAddr>, IpCertError> {
        let named = match sni {
            None => None,
            Some(name) => match parse_ip_sni(name) {
                Some(ip) => Some(ip),
                None => return Ok(None),
            },
        };
        let configured = match self.hostname() {
            Host::Ip(ip) => Some(ip.to_canonical()),
            Host::Dns(_) => None,
        };
        let ip = named.or(configured).unwrap_or(local);
        if Some(ip) == configured || ip == local {
            Ok(Some(ip))
        } else {
            Err(IpCertError::NotOurs { ip })
        }
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
    /// runs in its own task on `server`'s tracker under a deadline, so that
    /// [`Server::shutdown`] ends and waits for it; a finished one is served by `server`'s HTTP
    /// front exactly like a plain connection. Failures of accept are counted and waited out
    /// as [`Listener`] does for every listener. With the server's PROXY protocol on, each
    /// connection's header is read first, within the same deadline, and the connection is
    /// the client's it names from then on.
    pub async fn serve(&self, server: &Server, listener: TcpListener) -> io::Result<()> {
        let shutdown = server.shutdown_token();
        let proxy = server.proxy_protocol();
        let mut listener = Listener::new(listener, "main", server.accept_error_counter("main"));
        loop {
            let (mut tcp, remote) = tokio::select! {
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
            let relay = server.clone();
            let shutdown = shutdown.clone();
            let proxy = proxy.clone();
            // On the server's tracker: a shutdown waits for handshakes under way as for
            // connections, instead of returning while they still hold sockets and gauges.
            server.spawn_task(async move {
                let deadline = tokio::time::Instant::now() + this.inner.options.handshake_timeout;
                let opened = open_connection(
                    proxy.as_ref(),
                    ProxiedListener::Main,
                    &mut tcp,
                    remote,
                    &guard,
                    deadline,
                    &shutdown,
                )
                .await;
                let Some(Opened {
                    remote,
                    dialed,
                    read,
                }) = opened
                else {
                    return;
                };
                let (dialed, received) = (dialed.map(|d| d.ip()), read.to_vec());
                let metrics = &this.inner.metrics;
                metrics.in_flight.inc();
                let result = tokio::select! {
                    _ = shutdown.cancelled() => None,
                    _ = guard.evicted() => Some(Err(Evicted)),
                    r = tokio::time::timeout_at(deadline, this.handshake(tcp, received, dialed)) => Some(Ok(r)),
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
                        let layer = match transport {
                            Transport::Tls(_) => TlsRecords::Derpd,
                            _ => TlsRecords::Rustls,
                        };
                        metrics
                            .record_layers
                            .with_label_values(&[layer.name()])
                            .inc();
                        relay.spawn_guarded(transport, remote, guard);
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
    /// no HTTP. `dialed` is the address the client connected to when a PROXY protocol
    /// header named it (the socket's own local address is the balancer-facing one): an IP
    /// certificate is chosen, or ordered, for it.
    ///
    /// A client that offers TLS 1.3 gets derpd's own record layer after rustls's handshake
    /// ([`derp_io::tls`]): no rustls buffers or connection state per connection, no lock
    /// between the halves, and a reader that can wait for the socket holding nothing. Any
    /// other client (and any hello derpd's reader does not follow), and every client with
    /// [`TlsRecords::Rustls`], is served by rustls's buffered connection.
    async fn handshake(
        &self,
        mut tcp: TcpStream,
        mut received: Vec<u8>,
        dialed: Option<IpAddr>,
    ) -> Result<Option<(Transport, &'static str)>, HandshakeError> {
        let local = match dialed {
            Some(ip) => ip,
            None => tcp.local_addr()?.ip(),
        };
        let hello = tokio::time::timeout(self.inner.options.client_hello_timeout, async {
            match read_client_hello(&mut tcp, &mut received).await? {
                derp_io::tls::ClientHello::Hello { tls13: true, alpn }
                    if self.inner.options.records == TlsRecords::Derpd =>
                {
                    Ok::<_, HandshakeError>(Hello::Tls13(alpn))
                }
                _ => Ok(Hello::Rustls(Box::new(
                    accept_client_hello(&mut tcp, &mut received).await?,
                ))),
            }
        })
        .await
        .map_err(|_| HandshakeError::HelloTimeout)?;
        match hello? {
            Hello::Tls13(alpn) => {
                let offers = |p: &[u8]| alpn.iter().any(|a| a == p);
                let (acme, http11) = (offers(ACME_TLS_ALPN), offers(HTTP11_ALPN));
                let for_ip = match acme {
                    true => None,
                    false => {
                        let sni = self.ip_slots().and_then(|_| sni_of(&received));
                        self.ip_config(local, sni.as_deref(), http11).await?
                    }
                };
                let config = for_ip.unwrap_or_else(|| self.config_for(acme, http11));
                let done = derp_io::tls::accept(tcp, received, config).await?;
                if done.alpn.as_deref() == Some(ACME_TLS_ALPN) {
                    return Ok(None);
                }
                Ok(Some((Transport::Tls(Box::new(done.stream)), "1.3")))
            }
            Hello::Rustls(accepted) => {
                let hello = accepted.client_hello();
                let (acme, http11) = (
                    offers_alpn(&hello, ACME_TLS_ALPN),
                    offers_alpn(&hello, HTTP11_ALPN),
                );
                let sni = hello.server_name().map(str::to_owned);
                let for_ip = match acme {
                    true => None,
                    false => self.ip_config(local, sni.as_deref(), http11).await?,
                };
                let config = for_ip.unwrap_or_else(|| self.config_for(acme, http11));
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

/// Waits for the first certificate of `ip` (or the failure of the attempt under way). Fails
/// at once while issuance is backing off after a failure, as derper does.
async fn wait_for_ip_cert(slot: &IpSlot, ip: IpAddr) -> Result<(), IpCertError> {
    let mut status = slot.status.subscribe();
    let start = *status.borrow_and_update();
    if slot.cert.load().is_some() {
        return Ok(());
    }
    if let Some(at) = start.retry_at.filter(|at| *at > SystemTime::now()) {
        return Err(IpCertError::BackingOff {
            ip,
            retry_in: at.duration_since(SystemTime::now()).unwrap_or_default(),
        });
    }
    loop {
        if status.changed().await.is_err() {
            return Err(IpCertError::FrontGone);
        }
        let now = *status.borrow_and_update();
        if now.installs > start.installs {
            return Ok(());
        }
        if now.failures > start.failures {
            return Err(IpCertError::Failed { ip });
        }
    }
}

/// An SNI that names an address (some clients send one, bracketed or not, though RFC 6066
/// forbids it), canonical.
fn parse_ip_sni(name: &str) -> Option<IpAddr> {
    name.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .ok()
        .map(|ip| ip.to_canonical())
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
) -> Result<rustls::server::Accepted, HandshakeError> {
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
                return Err(HandshakeError::BadHello(e));
            }
        }
        if received.len() >= derp_io::tls::MAX_CLIENT_HELLO {
            return Err(HandshakeError::HelloTooLarge);
        }
        received.reserve(2048);
        if tcp.read_buf(received).await? == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
    }
}

/// A handshake that lost its place in the unproven budget.
struct Evicted;

/// Why a handshake on the TLS listener failed (logged, and counted as `error`).
#[derive(Debug, thiserror::Error)]
enum HandshakeError {
    /// Reading or writing the socket failed, or rustls's handshake did.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// No whole ClientHello within the front's `client_hello_timeout`.
    #[error("no ClientHello in time")]
    HelloTimeout,
    /// A ClientHello longer than any real client sends.
    #[error("ClientHello larger than {} bytes", derp_io::tls::MAX_CLIENT_HELLO)]
    HelloTooLarge,
    /// rustls refused the ClientHello (and sent the alert it chose).
    #[error("bad ClientHello: {0}")]
    BadHello(rustls::Error),
    /// The TLS 1.3 handshake for derpd's record layer failed.
    #[error(transparent)]
    Handshake(#[from] derp_io::tls::AcceptError),
    /// The IP address's certificate slot could not be set up.
    #[error(transparent)]
    Slot(#[from] TlsError),
    /// The client wants the IP address's certificate and there is none to give.
    #[error(transparent)]
    IpCert(#[from] IpCertError),
}

/// Why a connection to one of the node's addresses has no certificate for that address.
#[derive(Debug, thiserror::Error)]
enum IpCertError {
    /// Issuance failed a short while ago and is not tried again before `retry_in`, as
    /// derper does.
    #[error("cert issuance for {ip} failed recently; next attempt in {retry_in:?}")]
    BackingOff { ip: IpAddr, retry_in: Duration },
    /// The issuance this connection waited for failed.
    #[error("cert issuance for {ip} failed")]
    Failed { ip: IpAddr },
    /// The client named an address that is neither the configured one nor the one it
    /// connected to: no certificate, and no order a CA would refuse.
    #[error("no certificate for {ip}: not this node's address")]
    NotOurs { ip: IpAddr },
    /// The slot stopped reporting while the connection waited for it.
    #[error("the front is gone")]
    FrontGone,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ip_slots::MAX_IP_SLOTS;

    /// Every config a front serves offers exactly the TLS 1.3 suites derpd's record layer
    /// implements, and hands the keys over only when the record layer is to take them.
    #[test]
    fn the_served_configs_offer_the_record_layers_suites() {
        let key = derp_testkit::server_secret().public_key();
        for records in [TlsRecords::Derpd, TlsRecords::Rustls] {
            let options = TlsOptions {
                records,
                ..TlsOptions::new("derp.test")
            };
            let front = TlsFront::new(&key, options, &Registry::new()).expect("front");
            let inner = &front.inner;
            for (config, tcp) in [
                (&inner.config_http11, true),
                (&inner.config_plain, true),
                (&inner.config_acme, true),
                (&inner.config_quic, false),
            ] {
                let offered: Vec<_> = config
                    .crypto_provider()
                    .cipher_suites
                    .iter()
                    .filter(|s| s.tls13().is_some())
                    .map(|s| s.suite())
                    .collect();
                assert_eq!(offered.len(), derp_io::tls::SUPPORTED_SUITES.len());
                assert!(
                    offered.iter().all(|s| derp_io::tls::supports(*s)),
                    "{offered:?}"
                );
                let derpd = tcp && records == TlsRecords::Derpd;
                assert_eq!(config.enable_secret_extraction, derpd);
                // The key log is the capture derp-io takes each handshake's secrets from.
                let key_log = format!("{:?}", config.key_log);
                assert_eq!(key_log.starts_with("SecretCapture"), derpd, "{key_log}");
            }
        }
    }

    /// Behind a balancer that sends PROXY protocol, the socket's local address is the
    /// balancer-facing one; the certificate a client dialing by address needs is for the
    /// address the header names as dialed.
    #[tokio::test]
    async fn behind_a_balancer_an_ip_certificate_is_for_the_address_the_client_dialed() {
        use derp_proto::proxy_protocol::{Addresses, Command, write_v2};
        use tokio::io::AsyncWriteExt;

        let registry = Registry::new();
        let mut config = derp_server::ServerConfig::new(derp_testkit::server_secret());
        config.proxy_protocol = Some(vec!["127.0.0.1/32".parse().expect("cidr")]);
        let server = Server::new(config, &registry).expect("server");
        let options = TlsOptions {
            ip_certs: true,
            ..TlsOptions::new("derp.test")
        };
        let front = TlsFront::new(&server.public_key(), options, &registry).expect("front");
        let mut requests = front
            .ip_slots()
            .expect("IP certificates on")
            .take_requests()
            .expect("the order queue");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = {
            let (front, server) = (front.clone(), server.clone());
            tokio::spawn(async move { front.serve(&server, listener).await })
        };

        let dialed: std::net::SocketAddr = "203.0.113.7:443".parse().expect("addr");
        let mut opening = Vec::new();
        write_v2(
            Command::Proxy,
            &Addresses::Tcp {
                source: "198.51.100.4:5000".parse().expect("addr"),
                destination: dialed,
            },
            &[],
            &mut opening,
        )
        .expect("header");
        // The ClientHello of a client dialing by address: no SNI.
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let mut hello = rustls::ClientConnection::new(
            Arc::new(client),
            rustls::pki_types::ServerName::IpAddress(dialed.ip().into()),
        )
        .expect("client");
        hello.write_tls(&mut opening).expect("hello");
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        tcp.write_all(&opening).await.expect("write");

        let ordered = tokio::time::timeout(derp_testkit::raw::STEP, requests.recv())
            .await
            .expect("an order in time")
            .expect("the queue is open");
        assert_eq!(ordered, dialed.ip());
        server.shutdown().await;
        serving.abort();
    }

    /// A front with IP certificates on for `hostname`, serving on 127.0.0.1, with the queue
    /// of addresses it orders for taken in the manager's place (the test is the issuer).
    async fn ip_front(
        hostname: &str,
    ) -> (
        Server,
        TlsFront,
        std::net::SocketAddr,
        tokio::sync::mpsc::UnboundedReceiver<IpAddr>,
        tokio::task::JoinHandle<io::Result<()>>,
    ) {
        let registry = Registry::new();
        let config = derp_server::ServerConfig::new(derp_testkit::server_secret());
        let server = Server::new(config, &registry).expect("server");
        let options = TlsOptions {
            ip_certs: true,
            ..TlsOptions::new(hostname)
        };
        let front = TlsFront::new(&server.public_key(), options, &registry).expect("front");
        let requests = front
            .ip_slots()
            .expect("IP certificates on")
            .take_requests()
            .expect("the order queue");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = {
            let (front, server) = (front.clone(), server.clone());
            tokio::spawn(async move { front.serve(&server, listener).await })
        };
        (server, front, addr, requests, serving)
    }

    /// A self-signed certificate for `ip` alone, as a CA would issue for an address.
    fn cert_for(ip: IpAddr) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = vec![rcgen::SanType::IpAddress(ip)];
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        (
            cert.der().clone(),
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
    }

    /// Connects to `addr` as a client dialing `ip` by address (no SNI), trusting `root`.
    async fn handshake_by_address(
        addr: std::net::SocketAddr,
        ip: IpAddr,
        root: CertificateDer<'static>,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(root).expect("root");
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await?;
        tokio_rustls::TlsConnector::from(Arc::new(client))
            .connect(rustls::pki_types::ServerName::IpAddress(ip.into()), tcp)
            .await
    }

    /// Behind 1:1 NAT the socket's local address is a private one; with an IP hostname the
    /// certificate ordered and served is the configured address's, whichever local address
    /// the connection arrived on.
    #[tokio::test]
    async fn with_an_ip_hostname_the_configured_address_is_ordered_and_served() {
        let configured: IpAddr = [127, 0, 0, 2].into();
        let (server, front, addr, mut requests, serving) = ip_front("127.0.0.2").await;
        assert_ne!(addr.ip(), configured);

        let client = tokio::spawn(async move {
            let (cert, key) = cert_for(configured);
            let connecting = handshake_by_address(addr, configured, cert.clone());
            (cert, key, connecting.await)
        });
        let ordered = tokio::time::timeout(derp_testkit::raw::STEP, requests.recv())
            .await
            .expect("an order in time")
            .expect("the queue is open");
        assert_eq!(ordered, configured);
        // The test plays the issuer: the waiting handshake gets what is installed.
        let (cert, key) = cert_for(configured);
        front
            .install_ip(configured, vec![cert], key, CertOrigin::Other)
            .expect("installed");
        let (_, _, first) = client.await.expect("client");
        // The first client trusted another self-signed certificate for the same address:
        // refused, which shows it was served the installed one for the configured address.
        assert!(first.is_err(), "{first:?}");
        let served = front
            .ip_slot(configured)
            .expect("slot")
            .cert
            .load_full()
            .expect("installed");
        let stream = handshake_by_address(addr, configured, served.cert[0].clone())
            .await
            .expect("a client dialing the configured address by IP verifies it");
        assert_eq!(
            stream.get_ref().1.peer_certificates().expect("chain")[0],
            served.cert[0]
        );
        assert!(requests.try_recv().is_err(), "one order, for one address");
        server.shutdown().await;
        serving.abort();
    }

    /// Which address a connection is served for: the configured one for no SNI or its own
    /// SNI, the socket's when there is no configured one, none for a DNS name, and a refusal
    /// for an address that is not the node's.
    #[tokio::test]
    async fn the_address_served_follows_the_hostname_then_the_socket() {
        let registry = Registry::new();
        let key = derp_testkit::server_secret().public_key();
        let front = |hostname: &str| {
            let options = TlsOptions {
                ip_certs: true,
                ..TlsOptions::new(hostname)
            };
            TlsFront::new(&key, options, &registry).expect("front")
        };
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let (public, private) = (ip("203.0.113.7"), ip("10.0.0.5"));

        let by_ip = front("203.0.113.7");
        let wanted = |sni| by_ip.ip_wanted(private, sni).map_err(|e| e.to_string());
        assert_eq!(wanted(None), Ok(Some(public)));
        assert_eq!(wanted(Some("203.0.113.7")), Ok(Some(public)));
        assert_eq!(wanted(Some("[203.0.113.7]")), Ok(Some(public)));
        assert_eq!(wanted(Some("derp.example.com")), Ok(None));
        assert!(wanted(Some("198.51.100.1")).is_err());
        let mapped = by_ip.ip_wanted(ip("::ffff:10.0.0.5").to_canonical(), None);
        assert_eq!(mapped.ok(), Some(Some(public)));

        let registry = Registry::new();
        let options = TlsOptions {
            ip_certs: true,
            ..TlsOptions::new("derp.example.com")
        };
        let by_name = TlsFront::new(&key, options, &registry).expect("front");
        let wanted = |sni| by_name.ip_wanted(public, sni).map_err(|e| e.to_string());
        assert_eq!(wanted(None), Ok(Some(public)));
        assert_eq!(wanted(Some("203.0.113.7")), Ok(Some(public)));
        assert_eq!(wanted(Some("derp.example.com")), Ok(None));
        assert!(wanted(Some("198.51.100.1")).is_err());
    }

    /// Slots, and so orders, only for addresses a CA may certify: the configured one
    /// whatever it is, else global unicast ones; and no more than the cap.
    #[test]
    fn slots_are_made_only_for_addresses_that_may_have_a_certificate() {
        let key = derp_testkit::server_secret().public_key();
        let front = |hostname: &str| {
            let options = TlsOptions {
                ip_certs: true,
                ..TlsOptions::new(hostname)
            };
            TlsFront::new(&key, options, &Registry::new()).expect("front")
        };
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");

        let by_name = front("derp.example.com");
        for local in [
            "127.0.0.1",
            "10.0.0.5",
            "172.17.0.1",
            "100.64.0.1",
            "fe80::1",
            "fd00::1",
        ] {
            let err = by_name.ip_slot(ip(local)).expect_err(local);
            assert!(matches!(err, TlsError::IpNotEligible(_)), "{local}: {err}");
        }
        for n in 0..MAX_IP_SLOTS {
            by_name
                .ip_slot(ip(&format!("203.0.113.{n}")))
                .expect("a global address");
        }
        let err = by_name
            .ip_slot(ip("198.51.100.1"))
            .expect_err("over the cap");
        assert!(matches!(err, TlsError::IpSlotsFull { .. }), "{err}");
        by_name
            .ip_slot(ip("203.0.113.0"))
            .expect("an address with a slot keeps it");
        assert_eq!(by_name.ip_slots().expect("on").len(), MAX_IP_SLOTS);

        // Configured, a loopback address is the operator's choice (a test CA on loopback).
        let by_ip = front("127.0.0.2");
        by_ip
            .ip_slot(ip("127.0.0.2"))
            .expect("the configured address");
        assert!(by_ip.ip_slot(ip("127.0.0.1")).is_err());
    }

    /// A client naming a DNS host never touches IP certificates, and one connecting by
    /// address to a loopback socket with no configured address gets none: no slot, no
    /// order, in either case.
    #[tokio::test]
    async fn no_slot_for_a_dns_name_nor_an_address_no_ca_would_certify() {
        let (server, front, addr, mut requests, serving) = ip_front("derp.example.com").await;
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        for name in [
            rustls::pki_types::ServerName::try_from("derp.example.com").expect("name"),
            rustls::pki_types::ServerName::IpAddress(addr.ip().into()),
        ] {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            let done = tokio::time::timeout(derp_testkit::raw::STEP, connector.connect(name, tcp))
                .await
                .expect("an answer in time");
            assert!(done.is_err(), "no certificate to verify: {done:?}");
        }
        assert!(requests.try_recv().is_err(), "no order");
        assert_eq!(front.ip_slots().expect("on").len(), 0);
        server.shutdown().await;
        serving.abort();
    }

    /// A handshake under way runs on the server's tracker: the shutdown ends it and returns
    /// only once it has (its gauge is back to zero and its socket closed). Its deadlines are
    /// an hour, so nothing but the shutdown can end it within the test.
    #[tokio::test]
    async fn a_shutdown_waits_for_the_handshakes_under_way() {
        let registry = Registry::new();
        let mut config = derp_server::ServerConfig::new(derp_testkit::server_secret());
        config.handshake_timeout = Duration::from_secs(3600);
        let server = Server::new(config, &registry).expect("server");
        let options = TlsOptions {
            handshake_timeout: Duration::from_secs(3600),
            client_hello_timeout: Duration::from_secs(3600),
            ..TlsOptions::new("derp.test")
        };
        let front = TlsFront::new(&server.public_key(), options, &registry).expect("front");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = {
            let (front, server) = (front.clone(), server.clone());
            tokio::spawn(async move { front.serve(&server, listener).await })
        };
        let in_flight = || {
            registry
                .gather()
                .iter()
                .filter(|f| f.name() == "derp_tls_handshakes_in_flight")
                .flat_map(|f| f.get_metric())
                .map(|m| m.get_gauge().get_value())
                .sum::<f64>()
        };

        // A client that connects and never sends its ClientHello.
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let started = async {
            while in_flight() < 1.0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(derp_testkit::raw::STEP, started)
            .await
            .expect("the handshake started");

        tokio::time::timeout(derp_testkit::raw::STEP, server.shutdown())
            .await
            .expect("the shutdown ended the handshake");
        assert_eq!(
            in_flight(),
            0.0,
            "the shutdown returned before the handshake ended"
        );
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(derp_testkit::raw::STEP, client.read(&mut byte))
            .await
            .expect("closed in time");
        assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
        serving.await.expect("no panic").expect("served");
    }

    /// A TLS 1.3 suite the record layer does not implement, added to the provider, is
    /// left out of what is served; TLS 1.2 suites stay.
    #[test]
    fn a_tls13_suite_the_record_layer_lacks_is_never_offered() {
        let mut provider = rustls::crypto::ring::default_provider();
        let tls12 = provider
            .cipher_suites
            .iter()
            .filter(|s| s.tls13().is_none())
            .count();
        let base = rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256
            .tls13()
            .expect("a TLS 1.3 suite");
        let ccm = rustls::Tls13CipherSuite {
            common: rustls::CipherSuiteCommon {
                suite: rustls::CipherSuite::TLS13_AES_128_CCM_SHA256,
                hash_provider: base.common.hash_provider,
                confidentiality_limit: base.common.confidentiality_limit,
            },
            hkdf_provider: base.hkdf_provider,
            aead_alg: base.aead_alg,
            quic: base.quic,
        };
        provider.cipher_suites.insert(
            0,
            rustls::SupportedCipherSuite::Tls13(Box::leak(Box::new(ccm))),
        );
        let served = serving_provider(provider);
        let tls13: Vec<_> = served
            .cipher_suites
            .iter()
            .filter(|s| s.tls13().is_some())
            .map(|s| s.suite())
            .collect();
        assert_eq!(tls13.len(), 3, "{tls13:?}");
        assert!(
            tls13.iter().all(|s| derp_io::tls::supports(*s)),
            "{tls13:?}"
        );
        let kept = served
            .cipher_suites
            .iter()
            .filter(|s| s.tls13().is_none())
            .count();
        assert_eq!(kept, tls12);
    }

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
