//! Certificates from an RFC 8555 (ACME) server, Let's Encrypt by default.
//!
//! One certificate for one DNS hostname. The account and the certificate are cached in the
//! cert directory, so a restart serves the cached certificate and places no order. Renewal
//! starts when a third of the certificate's lifetime is left (30 days for Let's Encrypt's 90).
//! Failed attempts back off exponentially, because Let's Encrypt allows only 5 failed
//! validations per hostname per hour; consecutive attempts rotate through the configured
//! challenge types, so a port that is not reachable from outside does not block issuance.

use std::fmt;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use hyper_util::rt::TokioIo;
use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, BodyWrapper, BytesResponse, ChallengeType,
    ExternalAccountKey, HttpClient, Identifier, NewAccount, NewOrder, OrderStatus, RetryPolicy,
};
use rcgen::{CertificateParams, CustomExtension, DistinguishedName, KeyPair};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::TlsError;
use super::certs::{load_certs_pem, load_key_pem, sanitize_hostname, write_atomic};
use super::front::{CertInfo, CertOrigin, TlsFront};
use super::x509::Host;

/// Let's Encrypt's production directory, the default ACME server.
pub const LETS_ENCRYPT_PRODUCTION: &str = "https://acme-v02.api.letsencrypt.org/directory";
/// Google Trust Services' directory (derper's `--certmode gcp`), which requires External
/// Account Binding.
pub const GOOGLE_TRUST_SERVICES: &str = "https://dv.acme-v02.api.pki.goog/directory";

/// External Account Binding (RFC 8555 §7.3.4): the key ID and HMAC key a CA issues so that
/// a new ACME account is tied to an account with the CA.
#[derive(Clone)]
pub struct ExternalAccount {
    /// The key ID (`--acme-eab-kid`).
    pub key_id: String,
    /// The HMAC-SHA256 key, decoded.
    pub hmac_key: Vec<u8>,
}

impl fmt::Debug for ExternalAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalAccount")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl ExternalAccount {
    /// A binding from the key ID and the key as CAs hand it out, base64: the URL alphabet
    /// without padding first (Google's and Pebble's form), then the standard alphabet with
    /// padding, as derper decodes `--acme-eab-key`.
    pub fn decode(key_id: &str, key: &str) -> Result<Self, TlsError> {
        use base64::Engine as _;
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        if key_id.is_empty() {
            return Err(TlsError::EabKeyIdEmpty);
        }
        let hmac_key = URL_SAFE_NO_PAD
            .decode(key)
            .or_else(|_| STANDARD.decode(key))
            .map_err(|_| TlsError::EabKeyEncoding)?;
        if hmac_key.is_empty() {
            return Err(TlsError::EabKeyEmpty);
        }
        Ok(Self {
            key_id: key_id.to_owned(),
            hmac_key,
        })
    }
}

/// An ACME challenge type this server can answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChallengeKind {
    /// TLS-ALPN-01 (RFC 8737), answered on the TLS listener. The ACME server connects to port
    /// 443, so the TLS listener must be reachable there.
    TlsAlpn01,
    /// HTTP-01, answered on the port-80 listener, which must be reachable on port 80.
    Http01,
}

/// Settings for [`AcmeManager`].
#[derive(Debug, Clone)]
pub struct AcmeConfig {
    /// The ACME directory URL; [`LETS_ENCRYPT_PRODUCTION`] by default.
    pub directory_url: String,
    /// Contact address for the account (`mailto:` is added).
    pub contact_email: Option<String>,
    /// Where the account key and certificates are cached.
    pub cache_dir: PathBuf,
    /// Roots trusted for the ACME server's own HTTPS certificate, in addition to Mozilla's
    /// (for a test or private ACME server).
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// Challenge types to use, in order of preference; consecutive failed attempts move to
    /// the next one. Must not be empty.
    pub challenges: Vec<ChallengeKind>,
    /// Wait after the first failure; it doubles on each further failure.
    pub initial_backoff: Duration,
    /// Longest wait between failed attempts.
    pub max_backoff: Duration,
    /// External Account Binding for a new account, for CAs that require it (Google Trust
    /// Services, many commercial CAs). Unused once the account is cached.
    pub external_account: Option<ExternalAccount>,
}

impl AcmeConfig {
    /// Let's Encrypt production, both challenge types (TLS-ALPN-01 first), backoff from 1 min
    /// to 1 h.
    pub fn new(cache_dir: impl Into<PathBuf>) -> Self {
        Self {
            directory_url: LETS_ENCRYPT_PRODUCTION.to_owned(),
            contact_email: None,
            cache_dir: cache_dir.into(),
            extra_roots: Vec::new(),
            challenges: vec![ChallengeKind::TlsAlpn01, ChallengeKind::Http01],
            initial_backoff: Duration::from_secs(60),
            max_backoff: Duration::from_secs(3600),
            external_account: None,
        }
    }
}

/// What every order from one ACME server shares: the settings, the HTTPS client and the
/// account (registered once, cached in the cert directory).
pub(crate) struct AcmeClient {
    pub(crate) config: AcmeConfig,
    http: AcmeHttp,
    account: tokio::sync::Mutex<Option<Account>>,
    pub(crate) orders: AtomicU64,
}

impl fmt::Debug for AcmeClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcmeClient")
            .field("config", &self.config)
            .field("orders", &self.orders)
            .finish_non_exhaustive()
    }
}

impl AcmeClient {
    pub(crate) fn new(front: &TlsFront, config: AcmeConfig) -> Result<Self, TlsError> {
        let http = AcmeHttp::new(front.provider().clone(), &config.extra_roots)?;
        Ok(Self {
            config,
            http,
            account: tokio::sync::Mutex::new(None),
            orders: AtomicU64::new(0),
        })
    }

    /// A cache file for `name`, tagged with the directory URL, so switching ACME servers
    /// (say from staging to production) never serves the other server's certificate.
    pub(crate) fn cache_file(&self, name: &str, ext: &str) -> PathBuf {
        self.config.cache_dir.join(format!(
            "{}.acme-{}.{ext}",
            sanitize_hostname(name),
            self.directory_tag()
        ))
    }

    fn account_path(&self) -> PathBuf {
        self.config
            .cache_dir
            .join(format!("acme-account-{}.json", self.directory_tag()))
    }

    fn directory_tag(&self) -> String {
        hex::encode(&Sha256::digest(self.config.directory_url.as_bytes())[..8])
    }

    /// The account: from the cache file, or registered (with the External Account Binding,
    /// if configured) and then cached.
    pub(crate) async fn account(&self) -> Result<Account, TlsError> {
        let mut slot = self.account.lock().await;
        if let Some(account) = slot.as_ref() {
            return Ok(account.clone());
        }
        let path = self.account_path();
        let builder = || Account::builder_with_http(Box::new(self.http.clone()));
        let cached = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<AccountCredentials>(&b).ok());
        let account = match cached {
            Some(credentials) => builder().from_credentials(credentials).await?,
            None => {
                let contact = self
                    .config
                    .contact_email
                    .as_ref()
                    .map(|e| format!("mailto:{e}"));
                let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
                let eab = self
                    .config
                    .external_account
                    .as_ref()
                    .map(|e| ExternalAccountKey::new(e.key_id.clone(), &e.hmac_key));
                let (account, credentials) = builder()
                    .create(
                        &NewAccount {
                            contact: &contacts,
                            terms_of_service_agreed: true,
                            only_return_existing: false,
                        },
                        self.config.directory_url.clone(),
                        eab.as_ref(),
                    )
                    .await
                    .map_err(|e| {
                        let (directory, source) = (self.config.directory_url.clone(), Box::new(e));
                        match &self.config.external_account {
                            Some(eab) => TlsError::AcmeRegisterBound {
                                directory,
                                key_id: eab.key_id.clone(),
                                source,
                            },
                            None => TlsError::AcmeRegister { directory, source },
                        }
                    })?;
                // Kept in memory even if it cannot be cached, so retries reuse the account
                // instead of registering new ones.
                match serde_json::to_vec_pretty(&credentials) {
                    Ok(json) => {
                        if let Err(e) = write_atomic(&path, &json, true) {
                            warn!(error = %e, path = %path.display(), "acme account not cached");
                        }
                    }
                    Err(e) => warn!(error = %e, "encoding acme account"),
                }
                info!(account = account.id(), path = %path.display(), "acme account registered");
                account
            }
        };
        *slot = Some(account.clone());
        Ok(account)
    }
}

/// Gets, caches and renews the certificate of a [`TlsFront`] from an ACME server.
pub struct AcmeManager {
    front: TlsFront,
    client: Arc<AcmeClient>,
    hostname: String,
}

impl fmt::Debug for AcmeManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcmeManager")
            .field("hostname", &self.hostname)
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl AcmeManager {
    /// An ACME manager for `front`'s hostname, which must be a DNS name.
    pub fn new(front: TlsFront, config: AcmeConfig) -> Result<Self, TlsError> {
        let hostname = match front.hostname() {
            Host::Dns(name) => name.clone(),
            Host::Ip(ip) => {
                return Err(TlsError::InvalidHostname(format!(
                    "{ip}: ACME certificates need a DNS name (use manual mode for an IP)"
                )));
            }
        };
        if config.challenges.is_empty() {
            return Err(TlsError::NoChallengeType);
        }
        let client = Arc::new(AcmeClient::new(&front, config)?);
        Ok(Self {
            front,
            client,
            hostname,
        })
    }

    /// Orders placed with the ACME server by this manager (and the IP certificate manager
    /// sharing its account, if any).
    pub fn orders_placed(&self) -> u64 {
        self.client.orders.load(Ordering::Relaxed)
    }

    /// Certificates for the node's IP addresses from the same ACME server and account (see
    /// [`IpCertManager`](crate::IpCertManager)); `front` must have been made with
    /// [`TlsOptions::ip_certs`](crate::TlsOptions::ip_certs).
    pub fn ip_cert_manager(&self) -> Result<crate::IpCertManager, TlsError> {
        crate::IpCertManager::with_client(self.front.clone(), self.client.clone())
    }

    /// The cached certificate chain file.
    pub fn cert_path(&self) -> PathBuf {
        self.cache_file("crt")
    }

    /// The cached certificate key file.
    pub fn key_path(&self) -> PathBuf {
        self.cache_file("key")
    }

    fn cache_file(&self, ext: &str) -> PathBuf {
        self.client.cache_file(&self.hostname, ext)
    }

    /// Installs the cached certificate if there is one that is valid for the hostname and not
    /// expired. Returns what was installed.
    pub fn load_cached(&self) -> Result<Option<CertInfo>, TlsError> {
        let (cert_path, key_path) = (self.cert_path(), self.key_path());
        let (Ok(cert_pem), Ok(key_pem)) = (std::fs::read(&cert_path), std::fs::read(&key_path))
        else {
            return Ok(None);
        };
        let chain = load_certs_pem(&cert_pem)?;
        let key = load_key_pem(&key_pem)?;
        let info = self.front.install(chain, key, CertOrigin::AcmeCache)?;
        if info.not_after.is_some_and(|t| t <= SystemTime::now()) {
            warn!(cert = %cert_path.display(), "cached acme certificate has expired");
        }
        Ok(Some(info))
    }

    /// Serves the cached certificate if there is one, then keeps a valid certificate in service
    /// until `shutdown`: orders one when there is none or renewal is due, and backs off after
    /// failures.
    pub async fn run(&self, shutdown: CancellationToken) {
        let mut current = match self.load_cached() {
            Ok(Some(info)) => {
                info!(pin = %info.pin(), not_after = ?info.not_after, "acme certificate loaded from cache");
                Some(info)
            }
            Ok(None) => None,
            Err(e) => {
                warn!(error = %e, "ignoring unusable cached acme certificate");
                None
            }
        };
        let config = &self.client.config;
        let mut backoff = config.initial_backoff;
        let mut attempt = 0usize;
        loop {
            if !renewal_due(current.as_ref(), &shutdown).await {
                return;
            }
            let kind = config.challenges[attempt % config.challenges.len()];
            let result = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = tokio::time::timeout(ORDER_TIMEOUT, self.obtain(kind)) => r,
            };
            match result {
                Ok(Ok(info)) => {
                    info!(pin = %info.pin(), not_after = ?info.not_after, challenge = ?kind, "acme certificate issued");
                    let already_due = renewal_time(&info) <= SystemTime::now();
                    current = Some(info);
                    if !already_due {
                        backoff = config.initial_backoff;
                        attempt = 0;
                        continue;
                    }
                    // A fresh certificate that is already due (a clock far ahead, or a
                    // lifetime we cannot read) must not make us order again at once, over and
                    // over: Let's Encrypt allows few duplicates a week. Back off instead.
                    warn!(retry_in = ?backoff, "new acme certificate is already due for renewal; check the clock");
                }
                Ok(Err(e)) => {
                    warn!(error = %e, challenge = ?kind, retry_in = ?backoff, "acme order failed")
                }
                Err(_) => warn!(challenge = ?kind, retry_in = ?backoff, "acme order timed out"),
            }
            attempt += 1;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(config.max_backoff);
        }
    }

    /// Places one order, answers its challenge with `kind`, installs the certificate and writes
    /// it to the cache.
    pub async fn obtain(&self, kind: ChallengeKind) -> Result<CertInfo, TlsError> {
        let identifiers = [Identifier::Dns(self.hostname.clone())];
        let mut params = CertificateParams::new(vec![self.hostname.clone()])?;
        params.distinguished_name = DistinguishedName::new();
        let issued = order_certificate(
            &self.front,
            &self.client,
            &NewOrder::new(&identifiers),
            kind,
            params,
        )
        .await?;
        let info = self.front.install(
            issued.chain.clone(),
            issued.key_der(),
            CertOrigin::AcmeIssued,
        )?;
        issued.cache(&self.key_path(), &self.cert_path());
        Ok(info)
    }
}

/// A certificate an order brought: its chain as the CA sent it and the new key.
pub(crate) struct Issued {
    pub(crate) chain_pem: String,
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: KeyPair,
}

impl Issued {
    pub(crate) fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.serialize_der()))
    }

    /// Writes key and chain to the cache. Key first: a crash between the writes leaves a new
    /// key with the old chain, which fails the key check on load and leads to a fresh order
    /// rather than a broken server. The certificate is in service either way, so a failed
    /// write is reported, not treated as a failed order: retrying would order again and burn
    /// the rate limit.
    pub(crate) fn cache(&self, key_path: &std::path::Path, cert_path: &std::path::Path) {
        let cached = write_atomic(key_path, self.key.serialize_pem().as_bytes(), true)
            .and_then(|()| write_atomic(cert_path, self.chain_pem.as_bytes(), false));
        if let Err(e) = cached {
            warn!(error = %e, cert = %cert_path.display(), "acme certificate in service but not cached; a restart will order a new one");
        }
    }
}

/// Places `new_order` with `client`'s account, answers each pending authorization's `kind`
/// challenge (withdrawn however the attempt ends), and finalizes with a fresh P-256 key and a
/// CSR from `params`.
pub(crate) async fn order_certificate(
    front: &TlsFront,
    client: &AcmeClient,
    new_order: &NewOrder<'_>,
    kind: ChallengeKind,
    params: CertificateParams,
) -> Result<Issued, TlsError> {
    let account = client.account().await?;
    client.orders.fetch_add(1, Ordering::Relaxed);
    let mut order = account.new_order(new_order).await?;
    let mut guard = ChallengeGuard {
        front,
        http_tokens: Vec::new(),
        alpn_hosts: Vec::new(),
    };
    {
        let mut authorizations = order.authorizations();
        while let Some(authz) = authorizations.next().await {
            let mut authz = authz?;
            match authz.status {
                AuthorizationStatus::Valid => continue,
                AuthorizationStatus::Pending => {}
                other => return Err(TlsError::AcmeAuthorization(other)),
            }
            let name = authz.identifier().to_string();
            let challenge_type = match kind {
                ChallengeKind::TlsAlpn01 => ChallengeType::TlsAlpn01,
                ChallengeKind::Http01 => ChallengeType::Http01,
            };
            let Some(mut challenge) = authz.challenge(challenge_type) else {
                return Err(TlsError::AcmeNoChallenge {
                    kind,
                    identifier: name,
                });
            };
            let key_auth = challenge.key_authorization();
            match kind {
                ChallengeKind::Http01 => {
                    front.set_http01_token(&challenge.token, Some(key_auth.as_str().to_owned()));
                    guard.http_tokens.push(challenge.token.clone());
                }
                ChallengeKind::TlsAlpn01 => {
                    let cert = alpn_certificate(front, &name, key_auth.digest().as_ref())?;
                    front.set_alpn_challenge(&name, Some(cert));
                    guard.alpn_hosts.push(name.clone());
                }
            }
            challenge.set_ready().await?;
        }
    }
    let status = order.poll_ready(&POLL).await?;
    drop(guard);
    if status != OrderStatus::Ready {
        return Err(TlsError::AcmeValidation(status));
    }
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let csr = params.serialize_request(&key)?;
    order.finalize_csr(csr.der()).await?;
    let chain_pem = order.poll_certificate(&POLL).await?;
    let chain = load_certs_pem(chain_pem.as_bytes())?;
    Ok(Issued {
        chain_pem,
        chain,
        key,
    })
}

/// A self-signed certificate for `name` carrying the acmeIdentifier extension (RFC 8737).
fn alpn_certificate(
    front: &TlsFront,
    name: &str,
    digest: &[u8],
) -> Result<Arc<CertifiedKey>, TlsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::new(vec![name.to_owned()])?;
    params.distinguished_name = DistinguishedName::new();
    params.custom_extensions = vec![CustomExtension::new_acme_identifier(digest)];
    let cert = params.self_signed(&key)?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signing_key = front.provider().key_provider.load_private_key(key_der)?;
    // Not `CertifiedKey::from_der`: its key check parses the certificate with webpki, which
    // refuses the critical acmeIdentifier extension. The pair is freshly made here.
    Ok(Arc::new(CertifiedKey::new(
        vec![cert.der().clone()],
        signing_key,
    )))
}

/// When renewal is due: a third of the lifetime before expiry (30 days before for a 90-day
/// certificate), or 30 days before when the start is unknown.
pub(crate) fn renewal_time(info: &CertInfo) -> SystemTime {
    let Some(not_after) = info.not_after else {
        // Unknown expiry: renew on a fixed schedule rather than at once.
        return SystemTime::now() + UNKNOWN_EXPIRY_RENEWAL;
    };
    let lifetime = info
        .not_before
        .and_then(|nb| not_after.duration_since(nb).ok())
        .unwrap_or(Duration::from_secs(90 * 86400));
    not_after
        .checked_sub(lifetime / 3)
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Waits until `current` is due for renewal (at once when there is none), looking again at
/// least every [`RECHECK_INTERVAL`] in case the clock jumped. False when `shutdown` came first.
pub(crate) async fn renewal_due(current: Option<&CertInfo>, shutdown: &CancellationToken) -> bool {
    loop {
        let now = SystemTime::now();
        let due = current.map_or(now, renewal_time);
        let Ok(wait) = due.duration_since(now) else {
            return true;
        };
        if wait.is_zero() {
            return true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(wait.min(RECHECK_INTERVAL)) => {}
        }
    }
}

/// How long a certificate whose expiry cannot be read is kept before renewing.
const UNKNOWN_EXPIRY_RENEWAL: Duration = Duration::from_secs(7 * 86400);

/// Withdraws challenge answers when an attempt ends, however it ends.
struct ChallengeGuard<'a> {
    front: &'a TlsFront,
    http_tokens: Vec<String>,
    alpn_hosts: Vec<String>,
}

impl Drop for ChallengeGuard<'_> {
    fn drop(&mut self) {
        for token in &self.http_tokens {
            self.front.set_http01_token(token, None);
        }
        for host in &self.alpn_hosts {
            self.front.set_alpn_challenge(host, None);
        }
    }
}

/// Polling of orders: the first check after 250 ms, then doubling, for up to 90 s.
const POLL: RetryPolicy = RetryPolicy::new().timeout(Duration::from_secs(90));
/// Bound on one whole order, whatever the ACME server does.
pub(crate) const ORDER_TIMEOUT: Duration = Duration::from_secs(300);
/// Even with renewal far off, wake up this often (the clock may have jumped).
pub(crate) const RECHECK_INTERVAL: Duration = Duration::from_secs(12 * 3600);
/// Bound on one HTTP request to the ACME server.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// A minimal HTTPS client for the ACME server: one HTTP/1.1 connection per request, rustls
/// with Mozilla's roots plus the configured extra ones.
#[derive(Clone)]
struct AcmeHttp {
    tls: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for AcmeHttp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AcmeHttp")
    }
}

impl AcmeHttp {
    fn new(
        provider: Arc<rustls::crypto::CryptoProvider>,
        extra_roots: &[CertificateDer<'static>],
    ) -> Result<Self, TlsError> {
        let mut roots = RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        for root in extra_roots {
            roots.add(root.clone())?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self { tls: Arc::new(tls) })
    }
}

type HttpResult = Result<BytesResponse, instant_acme::Error>;

/// Why a request to the ACME server got no answer: the failures of the HTTPS client
/// [`AcmeManager`] and [`IpCertManager`](crate::IpCertManager) talk to the server through.
/// instant-acme passes them on as [`instant_acme::Error::Other`], which a [`TlsError`]
/// holds.
#[derive(Debug, thiserror::Error)]
pub enum AcmeHttpError {
    /// No answer within the bound on one request.
    #[error("request to the acme server timed out")]
    Timeout,
    /// A URL from the directory is not `https`.
    #[error("acme url {0} is not https")]
    NotHttps(http::Uri),
    /// A URL from the directory names no host.
    #[error("acme url {0} has no host")]
    NoHost(http::Uri),
    /// A URL's path is not one.
    #[error("acme url path: {0}")]
    Path(#[source] http::uri::InvalidUri),
    /// A URL's authority cannot be sent as the `Host` header.
    #[error("acme url authority is not a header value")]
    HostHeader(#[source] header::InvalidHeaderValue),
    /// A URL's host is not a name TLS can check a certificate against.
    #[error("{host} is not a tls server name")]
    ServerName {
        /// The host.
        host: String,
        /// Why it is not a server name.
        source: rustls::pki_types::InvalidDnsNameError,
    },
    /// The TCP connection failed.
    #[error("connecting to {authority}: {source}")]
    Connect {
        /// The server's host and port.
        authority: http::uri::Authority,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The TLS handshake failed.
    #[error("tls to {authority}: {source}")]
    Tls {
        /// The server's host and port.
        authority: http::uri::Authority,
        /// What failed (rustls's error inside).
        source: std::io::Error,
    },
    /// The HTTP/1.1 connection could not be set up.
    #[error("http to {authority}: {source}")]
    Http {
        /// The server's host and port.
        authority: http::uri::Authority,
        /// What hyper said.
        source: hyper::Error,
    },
    /// The request failed on the connection.
    #[error("request to {authority}: {source}")]
    Request {
        /// The server's host and port.
        authority: http::uri::Authority,
        /// What hyper said.
        source: hyper::Error,
    },
}

impl From<AcmeHttpError> for instant_acme::Error {
    fn from(e: AcmeHttpError) -> Self {
        Self::Other(Box::new(e))
    }
}

impl HttpClient for AcmeHttp {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = HttpResult> + Send>> {
        let tls = self.tls.clone();
        Box::pin(async move {
            let response = tokio::time::timeout(HTTP_TIMEOUT, send(tls, req))
                .await
                .map_err(|_| AcmeHttpError::Timeout)??;
            Ok(response)
        })
    }
}

async fn send(
    tls: Arc<rustls::ClientConfig>,
    req: http::Request<BodyWrapper<Bytes>>,
) -> Result<BytesResponse, AcmeHttpError> {
    let (mut parts, body) = req.into_parts();
    let uri = parts.uri.clone();
    if uri.scheme_str() != Some("https") {
        return Err(AcmeHttpError::NotHttps(uri));
    }
    let (Some(host), Some(authority)) = (uri.host(), uri.authority().cloned()) else {
        return Err(AcmeHttpError::NoHost(uri));
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(443);
    let tcp = match TcpStream::connect((bare, port)).await {
        Ok(tcp) => tcp,
        Err(source) => return Err(AcmeHttpError::Connect { authority, source }),
    };
    let name =
        ServerName::try_from(bare.to_owned()).map_err(|source| AcmeHttpError::ServerName {
            host: bare.to_owned(),
            source,
        })?;
    let stream = match tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
    {
        Ok(stream) => stream,
        Err(source) => return Err(AcmeHttpError::Tls { authority, source }),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(pair) => pair,
        Err(source) => return Err(AcmeHttpError::Http { authority, source }),
    };
    tokio::spawn(async move {
        let _ = tokio::time::timeout(HTTP_TIMEOUT, conn).await;
    });
    let host_header =
        HeaderValue::from_str(authority.as_str()).map_err(AcmeHttpError::HostHeader)?;
    parts.headers.insert(header::HOST, host_header);
    parts.uri = uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .map_err(AcmeHttpError::Path)?;
    match sender
        .send_request(http::Request::from_parts(parts, body))
        .await
    {
        Ok(resp) => Ok(BytesResponse::from(resp)),
        Err(source) => Err(AcmeHttpError::Request { authority, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(not_before: u64, not_after: u64) -> CertInfo {
        CertInfo {
            generation: 1,
            origin: CertOrigin::AcmeIssued,
            leaf_sha256: [0; 32],
            not_before: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(not_before)),
            not_after: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(not_after)),
        }
    }

    #[test]
    fn eab_keys_decode_as_derper_decodes_them() {
        let raw = b"\xfb\xff\x00key";
        assert_eq!(
            ExternalAccount::decode("k", "-_8Aa2V5")
                .expect("url")
                .hmac_key,
            raw
        );
        assert_eq!(
            ExternalAccount::decode("k", "+/8Aa2V5")
                .expect("std")
                .hmac_key,
            raw
        );
        // Padded URL alphabet and unpadded standard alphabet of a length that needs padding
        // are refused, as by Go's decoders.
        assert!(matches!(
            ExternalAccount::decode("k", "-_8Aa2U="),
            Err(TlsError::EabKeyEncoding)
        ));
        assert!(matches!(
            ExternalAccount::decode("k", "+/8Aa2U"),
            Err(TlsError::EabKeyEncoding)
        ));
        assert!(matches!(
            ExternalAccount::decode("", "-_8Aa2V5"),
            Err(TlsError::EabKeyIdEmpty)
        ));
        assert!(matches!(
            ExternalAccount::decode("k", ""),
            Err(TlsError::EabKeyEmpty)
        ));
        let debug = format!(
            "{:?}",
            ExternalAccount::decode("k", "-_8Aa2V5").expect("ok")
        );
        assert!(!debug.contains("fb"), "the key stays out of logs: {debug}");
    }

    #[test]
    fn renewal_starts_with_a_third_of_the_lifetime_left() {
        let day = 86400;
        let due = renewal_time(&info(0, 90 * day));
        assert_eq!(due, SystemTime::UNIX_EPOCH + Duration::from_secs(60 * day));
        let due = renewal_time(&info(1000, 1000 + 6 * day));
        assert_eq!(
            due,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + 4 * day)
        );
    }
}
