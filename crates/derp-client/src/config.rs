//! Client configuration: the server URL, identity, `ClientInfo` fields and dial options.

use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use derp_io::quic::Congestion as QuicCongestion;
use derp_proto::{MeshKey, PublicKey, SecretKey};
use rustls::pki_types::CertificateDer;

use crate::error::{ConnectError, UrlError};

/// How DERP frames travel once the HTTP request has been answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// `Upgrade: DERP`: after the 101 (or right away in fast start) the connection carries raw
    /// DERP frames. This is what every Tailscale client uses.
    #[default]
    Upgrade,
    /// `Upgrade: websocket` with subprotocol `derp`: each DERP frame travels in its own binary
    /// WebSocket message, for clients behind proxies that only pass WebSockets.
    WebSocket,
}

/// Everything [`Client::connect`](crate::Client::connect) needs.
///
/// Build one with [`ClientConfig::new`] and adjust it with the `with_*` methods or by setting the
/// public fields directly.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The server to dial (`http://host:port/derp`).
    pub url: ServerUrl,
    /// This node's secret key; its public half is the client's identity on the relay.
    pub secret_key: SecretKey,
    /// Mesh pre-shared key sent in `ClientInfo`; a matching key grants mesh privileges.
    pub mesh_key: Option<MeshKey>,
    /// Sent as `IsProber` in `ClientInfo`.
    pub is_prober: bool,
    /// Sent as `CanAckPings` in `ClientInfo`: the caller promises to answer server pings with
    /// [`Client::send_pong`](crate::Client::send_pong). Defaults to true, as tailscaled does.
    pub can_ack_pings: bool,
    /// Sent as `AppName` in `ClientInfo` when non-empty.
    pub app_name: String,
    /// Value of the `Ideal-Node` request header; a non-empty value tells the server this is not
    /// the client's ideal node.
    pub ideal_node: Option<String>,
    /// The server's public key when it is already known. The client then sends
    /// `Derp-Fast-Start: 1`, writes the request and `ClientInfo` in one write and reads no HTTP
    /// response. Not available with [`TransportKind::WebSocket`]. Over TLS 1.3 the key is
    /// taken from the server's meta certificate when this is `None`.
    pub fast_start_key: Option<PublicKey>,
    /// Budget for the whole connect sequence: DNS, TCP connect, HTTP upgrade and DERP handshake
    /// up to and including `ServerInfo`. Defaults to 10 s, like the Go client.
    pub connect_timeout: Duration,
    /// If set, a receive that sees no bytes from the server for this long fails with
    /// [`ClientError::ReadTimeout`](crate::ClientError::ReadTimeout). The server sends a
    /// keepalive every 60 to 65 s, so twice that is a sensible value. None by default.
    pub read_timeout: Option<Duration>,
    /// Local address to bind before connecting, e.g. to spread a load test over many source
    /// addresses in 127.0.0.0/8. Port 0 lets the kernel pick.
    pub local_addr: Option<SocketAddr>,
    /// Address to dial instead of resolving the URL's host, as a DERP map node's `IPv4`/`IPv6`
    /// fields are used. The URL's host still goes into `Host`, SNI and certificate checks.
    pub dial_addr: Option<SocketAddr>,
    /// Framing after the HTTP request. Defaults to [`TransportKind::WebSocket`] for `ws` and
    /// `wss` URLs and to [`TransportKind::Upgrade`] otherwise.
    pub transport: TransportKind,
    /// TLS only: `DERPNode.CertName`. `sha256-raw:<64 hex>` accepts exactly the leaf
    /// certificate with that SHA-256 (self-signed IP-only servers); any other value is the name
    /// the certificate must be valid for instead of the URL's host. See
    /// [`CertName`](crate::CertName).
    pub cert_name: Option<String>,
    /// TLS only: roots trusted in addition to Mozilla's (`webpki-roots`), e.g. a private CA or
    /// a test ACME server's root.
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// TLS only: a complete rustls client config to use as is, replacing the one built from
    /// `cert_name` and `extra_roots`. Fast start from the meta certificate still applies.
    /// Over QUIC its ALPN list is replaced with `derp`, and it must allow TLS 1.3.
    pub tls_config: Option<Arc<rustls::ClientConfig>>,
    /// Connect to an `https://` server over QUIC, to this UDP port, instead of over TCP (a
    /// TLS node's `--quic-port`). `quic://` URLs always use QUIC, on the URL's port.
    pub quic_port: Option<u16>,
    /// QUIC only: accept and send packets in QUIC datagrams (on by default). Off, every
    /// packet travels on the stream, reliably and in order.
    pub quic_datagrams: bool,
    /// TCP only: open the connection with a PROXY protocol v2 header that names its own two
    /// ends, for a server that takes connections only from PROXY protocol senders (a derpd
    /// with `--proxy-protocol`, dialled directly by a sibling of its region). Off by default.
    pub proxy_header: bool,
    /// TCP only: send a `HEAD /derp/probe` request ahead of the upgrade, in the same write,
    /// so that the upgrade is the second request of a keep-alive connection. A relay may
    /// serve that by another path than a first request (derpd answers it through hyper);
    /// this is for tests and benchmarks of that path, Tailscale's clients never do it. Not
    /// with fast start (and it keeps a TLS meta certificate from starting one). Off by
    /// default.
    pub probe_first: bool,

    /// QUIC only: the congestion controller of what this client sends; by default the one
    /// derpd runs ([`QuicCongestion::LossFilter`]).
    pub quic_congestion: QuicCongestion,
}

impl ClientConfig {
    /// A config with defaults for everything but the server URL and the key.
    pub fn new(url: &str, secret_key: SecretKey) -> Result<Self, ConnectError> {
        let url: ServerUrl = url.parse().map_err(ConnectError::BadUrl)?;
        Ok(Self::with_url(url, secret_key))
    }

    /// Like [`ClientConfig::new`] with an already parsed URL.
    pub fn with_url(url: ServerUrl, secret_key: SecretKey) -> Self {
        let transport = match url.scheme() {
            Scheme::Ws | Scheme::Wss => TransportKind::WebSocket,
            Scheme::Http | Scheme::Https | Scheme::Quic => TransportKind::Upgrade,
        };
        Self {
            url,
            secret_key,
            mesh_key: None,
            is_prober: false,
            can_ack_pings: true,
            app_name: String::new(),
            ideal_node: None,
            fast_start_key: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: None,
            local_addr: None,
            dial_addr: None,
            transport,
            cert_name: None,
            extra_roots: Vec::new(),
            tls_config: None,
            quic_port: None,
            quic_datagrams: true,
            proxy_header: false,
            probe_first: false,
            quic_congestion: QuicCongestion::default(),
        }
    }

    /// Sets [`ClientConfig::proxy_header`].
    pub fn with_proxy_header(mut self, on: bool) -> Self {
        self.proxy_header = on;
        self
    }

    /// Sets [`ClientConfig::probe_first`].
    pub fn with_probe_first(mut self, on: bool) -> Self {
        self.probe_first = on;
        self
    }

    /// Sets [`ClientConfig::quic_port`].
    pub fn with_quic_port(mut self, port: u16) -> Self {
        self.quic_port = Some(port);
        self
    }

    /// Sets [`ClientConfig::quic_datagrams`].
    pub fn with_quic_datagrams(mut self, on: bool) -> Self {
        self.quic_datagrams = on;
        self
    }

    /// Sets [`ClientConfig::quic_congestion`].
    pub fn with_quic_congestion(mut self, congestion: QuicCongestion) -> Self {
        self.quic_congestion = congestion;
        self
    }

    /// Whether this config connects over QUIC: a `quic://` URL, or an `https://` one with
    /// [`ClientConfig::quic_port`].
    pub fn uses_quic(&self) -> bool {
        match self.url.scheme() {
            Scheme::Quic => true,
            Scheme::Https => self.quic_port.is_some(),
            _ => false,
        }
    }

    /// The UDP port a QUIC connection goes to.
    pub(crate) fn quic_dial_port(&self) -> u16 {
        match (self.url.scheme(), self.quic_port) {
            (Scheme::Https, Some(port)) => port,
            _ => self.url.port(),
        }
    }

    /// Sets [`ClientConfig::mesh_key`].
    pub fn with_mesh_key(mut self, key: MeshKey) -> Self {
        self.mesh_key = Some(key);
        self
    }

    /// Sets [`ClientConfig::is_prober`].
    pub fn with_prober(mut self, is_prober: bool) -> Self {
        self.is_prober = is_prober;
        self
    }

    /// Sets [`ClientConfig::can_ack_pings`].
    pub fn with_can_ack_pings(mut self, can_ack_pings: bool) -> Self {
        self.can_ack_pings = can_ack_pings;
        self
    }

    /// Sets [`ClientConfig::app_name`].
    pub fn with_app_name(mut self, name: impl Into<String>) -> Self {
        self.app_name = name.into();
        self
    }

    /// Sets [`ClientConfig::ideal_node`].
    pub fn with_ideal_node(mut self, node: impl Into<String>) -> Self {
        self.ideal_node = Some(node.into());
        self
    }

    /// Sets [`ClientConfig::fast_start_key`].
    pub fn with_fast_start_key(mut self, server_key: PublicKey) -> Self {
        self.fast_start_key = Some(server_key);
        self
    }

    /// Sets [`ClientConfig::connect_timeout`].
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`ClientConfig::read_timeout`].
    pub fn with_read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = Some(timeout);
        self
    }

    /// Sets [`ClientConfig::local_addr`].
    pub fn with_local_addr(mut self, addr: SocketAddr) -> Self {
        self.local_addr = Some(addr);
        self
    }

    /// Sets [`ClientConfig::dial_addr`].
    pub fn with_dial_addr(mut self, addr: SocketAddr) -> Self {
        self.dial_addr = Some(addr);
        self
    }

    /// Sets [`ClientConfig::transport`].
    pub fn with_transport(mut self, transport: TransportKind) -> Self {
        self.transport = transport;
        self
    }

    /// Sets [`ClientConfig::cert_name`].
    pub fn with_cert_name(mut self, cert_name: impl Into<String>) -> Self {
        self.cert_name = Some(cert_name.into());
        self
    }

    /// Adds a root to [`ClientConfig::extra_roots`].
    pub fn with_extra_root(mut self, root: CertificateDer<'static>) -> Self {
        self.extra_roots.push(root);
        self
    }

    /// Sets [`ClientConfig::tls_config`].
    pub fn with_tls_config(mut self, tls: Arc<rustls::ClientConfig>) -> Self {
        self.tls_config = Some(tls);
        self
    }

    /// The `ClientInfo` this config describes.
    pub(crate) fn client_info(&self) -> derp_proto::ClientInfo {
        derp_proto::ClientInfo {
            mesh_key: self.mesh_key,
            version: i64::from(derp_proto::frame::PROTOCOL_VERSION),
            can_ack_pings: self.can_ack_pings,
            is_prober: self.is_prober,
            app_name: self.app_name.clone(),
        }
    }
}

/// URL scheme of a DERP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Plain HTTP, default port 80.
    Http,
    /// HTTP over TLS, default port 443.
    Https,
    /// WebSocket, default port 80.
    Ws,
    /// WebSocket over TLS, default port 443.
    Wss,
    /// DERP over QUIC (always TLS 1.3), default port 443/udp. The path is not used.
    Quic,
}

impl Scheme {
    /// Whether this scheme runs over TLS.
    pub fn is_tls(self) -> bool {
        matches!(self, Self::Https | Self::Wss | Self::Quic)
    }

    /// The port used when the URL names none.
    pub fn default_port(self) -> u16 {
        if self.is_tls() { 443 } else { 80 }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Https => "https",
            Self::Ws => "ws",
            Self::Wss => "wss",
            Self::Quic => "quic",
        }
    }
}

/// A parsed DERP server URL: `scheme://host[:port][/path][?query]`.
///
/// The host is a DNS name, an IPv4 literal or a bracketed IPv6 literal. The path defaults to
/// `/derp`; user info is refused and a fragment is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUrl {
    scheme: Scheme,
    /// Host without IPv6 brackets.
    host: String,
    /// The port as written in the URL, if any.
    explicit_port: Option<u16>,
    /// Request target: path plus query.
    path: String,
}

impl ServerUrl {
    /// The URL scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The host, without brackets for IPv6 literals.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port to dial: the explicit one or the scheme's default.
    pub fn port(&self) -> u16 {
        self.explicit_port
            .unwrap_or_else(|| self.scheme.default_port())
    }

    /// The HTTP request target: path plus query, e.g. `/derp`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The `Host` header value: the host (bracketed if IPv6) plus the port if the URL named one,
    /// as Go's HTTP client writes it.
    pub fn host_header(&self) -> String {
        let mut out = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if let Some(port) = self.explicit_port {
            out.push(':');
            out.push_str(&port.to_string());
        }
        out
    }
}

impl fmt::Display for ServerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}://{}{}",
            self.scheme.as_str(),
            self.host_header(),
            self.path
        )
    }
}

impl FromStr for ServerUrl {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, UrlError> {
        let (scheme, rest) = s.split_once("://").ok_or(UrlError::MissingScheme)?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => Scheme::Http,
            "https" => Scheme::Https,
            "ws" => Scheme::Ws,
            "wss" => Scheme::Wss,
            "quic" => Scheme::Quic,
            _ => return Err(UrlError::UnsupportedScheme),
        };
        let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, target) = rest.split_at(authority_end);
        if authority.contains('@') {
            return Err(UrlError::UserInfo);
        }
        let (host, explicit_port) = parse_authority(authority)?;
        if target.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(UrlError::InvalidPath);
        }
        let path = if target.is_empty() || target.starts_with('?') {
            format!("{DEFAULT_PATH}{target}")
        } else {
            target.to_owned()
        };
        Ok(Self {
            scheme,
            host,
            explicit_port,
            path,
        })
    }
}

/// Splits `host[:port]` or `[v6][:port]`.
fn parse_authority(authority: &str) -> Result<(String, Option<u16>), UrlError> {
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (inside, after) = bracketed.split_once(']').ok_or(UrlError::InvalidHost)?;
        inside
            .parse::<Ipv6Addr>()
            .map_err(|_| UrlError::InvalidHost)?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or(UrlError::InvalidPort)?),
        };
        (inside, port)
    } else if authority.matches(':').count() > 1 {
        // An IPv6 literal must be bracketed, or its last group would read as a port.
        return Err(UrlError::InvalidHost);
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(UrlError::EmptyHost);
    }
    let host_ok = authority.starts_with('[')
        || host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if !host_ok {
        return Err(UrlError::InvalidHost);
    }
    let port = match port {
        None => None,
        Some(p) => {
            let valid = !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
            match p.parse::<u16>() {
                Ok(n) if valid && n != 0 => Some(n),
                _ => return Err(UrlError::InvalidPort),
            }
        }
    };
    Ok((host.to_owned(), port))
}

/// Request target used when the URL names no path.
const DEFAULT_PATH: &str = "/derp";

/// Default budget for the whole connect sequence, as in the Go client.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> ServerUrl {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn parses_plain_url_with_port_and_path() {
        let u = url("http://127.0.0.1:3340/derp");
        assert_eq!(u.scheme(), Scheme::Http);
        assert_eq!(u.host(), "127.0.0.1");
        assert_eq!(u.port(), 3340);
        assert_eq!(u.path(), "/derp");
        assert_eq!(u.host_header(), "127.0.0.1:3340");
        assert_eq!(u.to_string(), "http://127.0.0.1:3340/derp");
    }

    #[test]
    fn defaults_port_and_path_by_scheme() {
        let u = url("https://derp.example.com");
        assert_eq!(u.port(), 443);
        assert_eq!(u.path(), "/derp");
        assert_eq!(u.host_header(), "derp.example.com");
        assert_eq!(url("ws://h").port(), 80);
        assert_eq!(url("WSS://h/x").port(), 443);
        assert_eq!(url("http://h?q=1").path(), "/derp?q=1");
        assert_eq!(url("http://h/a/b?q#frag").path(), "/a/b?q");
    }

    #[test]
    fn parses_bracketed_ipv6() {
        let u = url("http://[::1]:8080/derp");
        assert_eq!(u.host(), "::1");
        assert_eq!(u.port(), 8080);
        assert_eq!(u.host_header(), "[::1]:8080");
        assert_eq!(url("http://[fe80::2]").host_header(), "[fe80::2]");
    }

    #[test]
    fn refuses_bad_urls() {
        let cases = [
            ("127.0.0.1:80/derp", UrlError::MissingScheme),
            ("ftp://h/derp", UrlError::UnsupportedScheme),
            ("http:///derp", UrlError::EmptyHost),
            ("http://:80/derp", UrlError::EmptyHost),
            ("http://::1/derp", UrlError::InvalidHost),
            ("http://[::1/derp", UrlError::InvalidHost),
            ("http://[nope]/derp", UrlError::InvalidHost),
            ("http://[::1]x/derp", UrlError::InvalidPort),
            ("http://h:0/derp", UrlError::InvalidPort),
            ("http://h:65536/derp", UrlError::InvalidPort),
            ("http://h:+80/derp", UrlError::InvalidPort),
            ("http://h:/derp", UrlError::InvalidPort),
            ("http://u@h/derp", UrlError::UserInfo),
            ("http://h o/derp", UrlError::InvalidHost),
            ("http://h/de rp", UrlError::InvalidPath),
            ("http://h/derp\r\nX: y", UrlError::InvalidPath),
        ];
        for (s, want) in cases {
            assert_eq!(s.parse::<ServerUrl>(), Err(want), "{s}");
        }
    }

    #[test]
    fn quic_urls_and_quic_ports() {
        let secret = SecretKey::from_bytes([7; 32]);
        let u = url("quic://127.0.0.1:8443");
        assert_eq!(u.scheme(), Scheme::Quic);
        assert!(u.scheme().is_tls());
        assert_eq!(u.port(), 8443);
        assert_eq!(url("quic://derp.example.com").port(), 443);
        assert_eq!(u.to_string(), "quic://127.0.0.1:8443/derp");
        let c = ClientConfig::new("quic://h:9", secret.clone()).unwrap();
        assert!(c.uses_quic() && c.quic_datagrams);
        assert_eq!(c.quic_dial_port(), 9);
        let c = ClientConfig::new("https://h/derp", secret.clone()).unwrap();
        assert!(!c.uses_quic());
        let c = c.with_quic_port(4433);
        assert!(c.uses_quic());
        assert_eq!(c.quic_dial_port(), 4433);
        // Only a TLS node's https URL takes a QUIC port.
        let c = ClientConfig::new("http://h/derp", secret)
            .unwrap()
            .with_quic_port(1);
        assert!(!c.uses_quic());
    }

    #[test]
    fn websocket_schemes_select_websocket_transport() {
        let secret = SecretKey::from_bytes([7; 32]);
        let c = ClientConfig::new("ws://h/derp", secret.clone()).unwrap();
        assert_eq!(c.transport, TransportKind::WebSocket);
        let c = ClientConfig::new("http://h/derp", secret).unwrap();
        assert_eq!(c.transport, TransportKind::Upgrade);
        assert!(c.can_ack_pings);
        assert_eq!(c.connect_timeout, Duration::from_secs(10));
    }
}
