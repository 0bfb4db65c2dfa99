//! TLS for a public derpd node: termination in front of the relay's HTTP front, and where its
//! certificates come from. A separate crate so that embedders of the relay library
//! (`derp-server`) do not pull in ACME, certificate generation and X.509 parsing.
//!
//! What it does:
//! - [`TlsFront`] accepts TCP connections under the server's accept limits and
//!   unproven-connection budget (and, when the server takes the PROXY protocol, reads each
//!   one's header first), runs the rustls handshake (TLS 1.2 minimum) with a deadline, on
//!   the server's task tracker ([`Server::spawn_task`](derp_server::Server::spawn_task)) so
//!   a shutdown waits for it, and hands the decrypted stream to
//!   [`Server::spawn_guarded`](derp_server::Server::spawn_guarded): for a TLS 1.3 client,
//!   derp-io's record layer on the keys rustls negotiated (offering only the suites it
//!   implements); for a TLS 1.2 client, and for every client with [`TlsRecords::Rustls`],
//!   rustls's buffered stream. Every served
//!   chain ends with the DERP meta certificate ([`meta_certificate`]) so Tailscale clients on
//!   TLS 1.3 can use fast start.
//! - [`ManualCerts`] serves `<certdir>/<hostname>.crt|.key`, reloads them when they change
//!   (polling, or on demand for SIGHUP) without touching established connections, and for an
//!   IP-address hostname with no files generates a self-signed certificate and reports the
//!   `sha256-raw:` pin clients need.
//! - [`AcmeManager`] gets and renews certificates from any RFC 8555 server (Let's Encrypt by
//!   default; Google Trust Services and other CAs with External Account Binding,
//!   [`ExternalAccount`]), answering TLS-ALPN-01 on the TLS listener and HTTP-01 on the
//!   port-80 listener, caching account and certificate in the cert directory and backing off
//!   on failure.
//! - [`IpCertManager`] gets certificates for the node's own IP addresses on demand (RFC 8738
//!   identifiers, HTTP-01, the CA's short-lived profile when offered): a client connecting
//!   without a hostname gets the configured address's certificate, or with a DNS hostname the
//!   global address it connected to ([`TlsOptions::ip_certs`]), within an hourly budget of
//!   orders.
//! - [`TlsFront::quic_server_config`] gives the same certificates to DERP over QUIC (TLS 1.3,
//!   ALPN `derp`, no TLS-ALPN-01 answers) for `derp_server::QuicListener`.
//! - [`TlsFront::serve_http_port`] runs the plain-HTTP port-80 listener: `/generate_204`, ACME
//!   HTTP-01 answers, and redirects to HTTPS (behind the PROXY protocol too), each connection
//!   on the server's task tracker as the TLS handshakes are. It never serves DERP.
//! - Names the temporary file a file is written through ([`temp_path`]) and sweeps those left
//!   by processes killed mid-write ([`remove_stale_temps`]), for its own files and derpd's
//!   key file.
//!
//! What it does not do: parse flags, bind sockets or install signal handlers (derpd does),
//! serve DERP itself (it hands decrypted streams to a [`derp_server::Server`]), or DNS-01
//! challenges.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod acme;
mod certs;
mod front;
mod http_port;
mod ip_slots;
mod ipcert;
mod meta;
mod temp_files;
mod x509;

use std::path::PathBuf;

pub use acme::{
    AcmeConfig, AcmeHttpError, AcmeManager, ChallengeKind, ExternalAccount, GOOGLE_TRUST_SERVICES,
    LETS_ENCRYPT_PRODUCTION,
};
pub use certs::{
    ManualCerts, ManualCheck, SelfSigned, cert_pin, generate_self_signed, load_certs_pem,
    load_key_pem, sanitize_hostname,
};
pub use front::{
    CertInfo, CertOrigin, DEFAULT_CLIENT_HELLO_TIMEOUT, DEFAULT_HTTP_PORT_MAX_CONNECTIONS,
    DEFAULT_TLS_HANDSHAKE_TIMEOUT, TlsFront, TlsOptions, TlsRecords,
};
pub use ipcert::{IP_ORDERS_PER_HOUR, IpCertManager, SHORT_LIVED_PROFILE};
pub use meta::meta_certificate;
pub use temp_files::{remove_stale_temps, temp_path};

/// Errors setting up TLS or obtaining certificates.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A certificate chain to serve holds no certificate.
    #[error("empty certificate chain")]
    EmptyChain,
    /// A PEM file ends inside a block: caught while it was being written, most likely.
    #[error("{} ends in an incomplete PEM block (still being written?)", path.display())]
    IncompletePem {
        /// The file.
        path: PathBuf,
    },
    /// The certificates of a PEM file could not be read.
    #[error("reading certificates: {0}")]
    PemCertificates(#[source] rustls::pki_types::pem::Error),
    /// A PEM file holds no certificate.
    #[error("no CERTIFICATE block found")]
    NoCertificate,
    /// The private key of a PEM file could not be read.
    #[error("reading key: {0}")]
    PemKey(#[source] rustls::pki_types::pem::Error),
    /// A key file without its certificate holds a key that cannot sign a new one.
    #[error("{} has no certificate and its key cannot sign a new one: {source}", path.display())]
    KeyCannotSign {
        /// The key file.
        path: PathBuf,
        /// Why the key is unusable.
        source: rcgen::Error,
    },
    /// Generating a certificate or key failed.
    #[error("generating certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused a certificate, key or configuration.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The certificate is not valid for the configured hostname.
    #[error("certificate is not valid for {hostname}: {source}")]
    WrongHost {
        /// The configured hostname.
        hostname: String,
        /// Why the check failed.
        source: webpki::Error,
    },
    /// The hostname is not usable for this certificate mode.
    #[error("invalid hostname {0:?}")]
    InvalidHostname(String),
    /// IP address certificates were asked of a front made without
    /// [`TlsOptions::ip_certs`].
    #[error("IP address certificates need a front made with ip_certs")]
    IpCertsNotEnabled,
    /// An address that is neither the configured hostname nor global unicast: no CA would
    /// certify it.
    #[error("no IP certificate for {0}: not the configured address, nor a global unicast one")]
    IpNotEligible(std::net::IpAddr),
    /// The front already keeps certificates for as many addresses as it may.
    #[error("no IP certificate for {ip}: the node already has {max} addresses with one")]
    IpSlotsFull {
        /// The address refused.
        ip: std::net::IpAddr,
        /// The cap.
        max: usize,
    },
    /// The External Account Binding's key ID is empty.
    #[error("acme: the EAB key ID is empty")]
    EabKeyIdEmpty,
    /// The External Account Binding's key is base64 in neither alphabet CAs use.
    #[error("acme: invalid base64 encoding for EAB key")]
    EabKeyEncoding,
    /// The External Account Binding's key is empty.
    #[error("acme: the EAB key is empty")]
    EabKeyEmpty,
    /// ACME was set up with no challenge type to answer.
    #[error("acme: no challenge type enabled")]
    NoChallengeType,
    /// The ACME server did not register an account.
    #[error("acme: registering an account at {directory}: {source}")]
    AcmeRegister {
        /// The ACME directory URL.
        directory: String,
        /// The server's answer, or why there was none.
        source: Box<instant_acme::Error>,
    },
    /// The ACME server did not register an account bound to an account with the CA (most
    /// often a wrong key ID or key).
    #[error(
        "acme: registering an account at {directory} with external account binding key ID \
         {key_id:?} (check --acme-eab-kid and --acme-eab-key): {source}"
    )]
    AcmeRegisterBound {
        /// The ACME directory URL.
        directory: String,
        /// The External Account Binding's key ID.
        key_id: String,
        /// The server's answer, or why there was none.
        source: Box<instant_acme::Error>,
    },
    /// An authorization of the order is neither pending nor valid.
    #[error("acme: authorization is {0:?}")]
    AcmeAuthorization(instant_acme::AuthorizationStatus),
    /// The ACME server offers no challenge of the kind tried for an identifier.
    #[error("acme: server offers no {kind:?} challenge for {identifier}")]
    AcmeNoChallenge {
        /// The challenge type tried.
        kind: ChallengeKind,
        /// The identifier (DNS name or IP address) to be validated.
        identifier: String,
    },
    /// The order is not ready once its challenges were answered: validation failed.
    #[error("acme: order is {0:?} after the challenge (validation failed)")]
    AcmeValidation(instant_acme::OrderStatus),
    /// A request to the ACME server failed, or the server refused it.
    #[error("acme: {0}")]
    AcmeRequest(#[source] Box<instant_acme::Error>),
    /// Registering metrics failed.
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

// instant-acme's error holds the server's whole problem document; boxed, it does not make
// every `Result<_, TlsError>` as large.
impl From<instant_acme::Error> for TlsError {
    fn from(e: instant_acme::Error) -> Self {
        Self::AcmeRequest(Box::new(e))
    }
}
