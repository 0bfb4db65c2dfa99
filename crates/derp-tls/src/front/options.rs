//! The front's settings and what it reports about the certificate in service.

use std::time::{Duration, SystemTime};

use derp_server::ProxyProtocol;

/// Default deadline for a whole TLS handshake, from accept to the first application byte.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default size of the port-80 listener's budget of connections.
pub const DEFAULT_HTTP_PORT_MAX_CONNECTIONS: usize = 1024;
/// Port-80 connections one source (an IPv4 address or an IPv6 /64) may hold at once, so one
/// host cannot fill the port and block captive-portal checks or HTTP-01 validation: one more
/// evicts that source's oldest.
pub(super) const HTTP_PORT_MAX_PER_SOURCE: usize = 16;
/// Default deadline for the ClientHello. A socket that says nothing is cut off well before the
/// whole-handshake deadline, so idle connections hold a slot only briefly.
pub const DEFAULT_CLIENT_HELLO_TIMEOUT: Duration = Duration::from_secs(3);

/// Settings for [`TlsFront`](crate::TlsFront).
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
    /// [`Server::proxy_protocol`](derp_server::Server::proxy_protocol)), when it sits behind the same balancer as the TLS
    /// listener, which takes the server's own.
    pub http_port_proxy_protocol: Option<ProxyProtocol>,
    /// Serve certificates for the node's own IP addresses, obtained on demand by an
    /// [`IpCertManager`](crate::IpCertManager): a client that sends no SNI (or the address
    /// as SNI) gets the certificate of the hostname when it is an address (whatever local
    /// address the connection arrived on: behind NAT that is a private one), else of the
    /// address it connected to, and its handshake waits for the first one to be issued. Clients naming the hostname get the hostname's
    /// certificate as before.
    pub ip_certs: bool,
    /// Who seals and opens the records of TLS 1.3 connections; see [`TlsRecords`].
    pub records: TlsRecords,
}

/// Who seals and opens the records of TLS 1.3 connections once rustls has run the
/// handshake. TLS 1.2 connections are always rustls's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsRecords {
    /// derpd's own record layer ([`derp_io::tls`]): no record buffer in an idle connection,
    /// halves split without a lock.
    #[default]
    Derpd,
    /// rustls's buffered connection, as TLS 1.2 connections are served: the way back for an
    /// operator who meets a client the record layer does not get along with.
    Rustls,
}

impl TlsRecords {
    /// The name of the `derp_tls_connections_by_record_layer` label and of derpd's flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Derpd => "derpd",
            Self::Rustls => "rustls",
        }
    }
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
            ip_certs: false,
            records: TlsRecords::default(),
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
    /// Installed directly through [`TlsFront::install`](crate::TlsFront::install).
    Other,
}

/// The certificate in service, as [`TlsFront::cert_updates`](crate::TlsFront::cert_updates) reports it.
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
