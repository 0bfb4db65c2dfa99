//! Error types: one enum for connecting, one for the established connection.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use derp_proto::{DecodeError, HandshakeError};

use derp_proto::upgrade::UpgradeError;
use derp_proto::ws::WsError;

/// Why a server URL was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// There was no `scheme://` prefix.
    #[error("url has no scheme")]
    MissingScheme,
    /// The scheme is not http, https, ws, wss or quic.
    #[error("url scheme must be http, https, ws, wss or quic")]
    UnsupportedScheme,
    /// The host part was empty.
    #[error("url has an empty host")]
    EmptyHost,
    /// The host was not a valid name, IPv4 literal or bracketed IPv6 literal.
    #[error("url host is not valid")]
    InvalidHost,
    /// The port was not a number in 1..=65535.
    #[error("url port is not valid")]
    InvalidPort,
    /// The URL carried `user@`; DERP has no use for it.
    #[error("url must not contain user info")]
    UserInfo,
    /// The path contained spaces or control characters.
    #[error("url path contains spaces or control characters")]
    InvalidPath,
}

/// Why [`Client::connect`](crate::Client::connect) failed.
///
/// rustls's and quinn's errors are boxed: unboxed, they would make every
/// `Result<_, ConnectError>`, and the errors that embed one, more than twice as large.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The server URL could not be parsed.
    #[error("bad server url: {0}")]
    BadUrl(#[source] UrlError),
    /// An extra root certificate (`ClientConfig::extra_roots`) cannot be trusted: it does not
    /// parse as a CA certificate.
    #[error("tls: extra root rejected: {source}")]
    ExtraRoot {
        /// Why rustls refused it.
        source: Box<rustls::Error>,
    },
    /// The certificate verifier could not be built from the roots.
    #[error("tls: building verifier: {source}")]
    Verifier {
        /// Why rustls could not build it.
        source: Box<rustls::client::VerifierBuilderError>,
    },
    /// The crypto provider supports none of the TLS versions asked for.
    #[error("tls: tls versions: {0}")]
    TlsVersions(#[source] Box<rustls::Error>),
    /// The TLS config cannot be used for QUIC: it offers no TLS 1.3 cipher suite QUIC can
    /// start with (a caller's own `tls_config`, most likely).
    #[error("tls: {0}")]
    QuicTlsConfig(#[source] quinn::crypto::rustls::NoInitialCipherSuite),
    /// The TLS handshake failed: the server's certificate is not trusted, not valid for the
    /// name or not the pinned one, the server sent an alert, or the protocol broke.
    #[error("tls: {0}")]
    TlsHandshake(#[source] Box<rustls::Error>),
    /// The socket failed or was closed during the TLS handshake.
    #[error("tls: {0}")]
    TlsIo(#[source] io::Error),
    /// The QUIC handshake failed in TLS: the connection was closed with a CRYPTO_ERROR
    /// (codes 0x100-0x1ff, a TLS alert: untrusted certificate, no common ALPN).
    #[error("tls: {0}")]
    QuicTls(#[source] Box<quinn::ConnectionError>),
    /// QUIC was asked for outside a tokio runtime.
    #[error("quic: no tokio runtime: {0}")]
    NoRuntime(#[source] tokio::runtime::TryCurrentError),
    /// quinn refused to start the connection (a server name it cannot use, a stopping
    /// endpoint).
    #[error("quic: {0}")]
    QuicConnect(#[source] Box<quinn::ConnectError>),
    /// The QUIC connection could not be set up other than in TLS: no answer, a version not
    /// spoken, the server refused it or closed it with an error code.
    #[error("quic: {0}")]
    QuicConnection(#[source] Box<quinn::ConnectionError>),
    /// A config value cannot be used (the reason says which).
    #[error("invalid client config: {0}")]
    InvalidConfig(&'static str),
    /// Name resolution produced no address to dial (or none of the local address's family).
    #[error("no usable address for {host}")]
    NoAddress {
        /// The host that was resolved.
        host: String,
    },
    /// A socket operation failed.
    #[error("io error: {0}")]
    Io(#[from] io::Error),
    /// The whole connect sequence took longer than the configured budget.
    #[error("connect timed out after {0:?}")]
    Timeout(Duration),
    /// The server closed the connection before the handshake completed.
    #[error("server closed the connection during the handshake")]
    UnexpectedEof,
    /// The server answered the upgrade request with a status other than 101.
    #[error("server answered http status {status}, want 101")]
    HttpStatus {
        /// The status code received.
        status: u16,
    },
    /// The upgrade response is not one (not HTTP, too long, a WebSocket answer with the
    /// wrong accept key or subprotocol).
    #[error("bad upgrade response: {0}")]
    BadResponse(#[source] UpgradeError),
    /// The server's WebSocket framing broke the protocol.
    #[error("websocket: {0}")]
    WebSocket(#[source] WsError),
    /// A handshake frame could not be decoded.
    #[error("decoding handshake frame: {0}")]
    Decode(#[source] DecodeError),
    /// The server sent a frame the handshake does not allow at that point.
    #[error("unexpected frame type {frame_type:#04x} during the handshake")]
    UnexpectedFrame {
        /// The frame type byte.
        frame_type: u8,
    },
    /// Sealing or opening a handshake box, or parsing its JSON, failed.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// Any other error of the connection while the handshake was running.
    #[error("connection error during the handshake: {0}")]
    Connection(#[source] ClientError),
}

impl ConnectError {
    /// Why the server's certificate was refused over TCP, when that is why the connect
    /// failed: not trusted, not valid for the name, or not the pinned one
    /// (`ApplicationVerificationFailure`).
    pub fn certificate_error(&self) -> Option<&rustls::CertificateError> {
        match self {
            Self::TlsHandshake(e) => match &**e {
                rustls::Error::InvalidCertificate(why) => Some(why),
                _ => None,
            },
            _ => None,
        }
    }
}

impl From<ClientError> for ConnectError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Io(e) => Self::Io(
                Arc::try_unwrap(e).unwrap_or_else(|e| io::Error::new(e.kind(), e.to_string())),
            ),
            ClientError::Decode(e) => Self::Decode(e),
            ClientError::WebSocket(e) => Self::WebSocket(e),
            ClientError::Closed => Self::UnexpectedEof,
            // The connect budget applies on top of the read timeout; report the one that fired.
            ClientError::ReadTimeout(d) => Self::Timeout(d),
            other => Self::Connection(other),
        }
    }
}

/// Errors on an established connection.
///
/// Receive errors are sticky: after one, every later receive returns a clone of it, because the
/// byte stream can no longer be trusted (the Go client does the same). Callers reconnect.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// A socket read or write failed.
    #[error("io error: {0}")]
    Io(#[source] Arc<io::Error>),
    /// The server sent a frame that breaks the protocol's size rules.
    #[error("decoding frame: {0}")]
    Decode(#[source] DecodeError),
    /// The WebSocket framing was broken.
    #[error("websocket: {0}")]
    WebSocket(#[source] WsError),
    /// The connection is closed: the server hung up, sent a WebSocket close, or this side
    /// already closed it or died after an earlier error.
    #[error("connection closed")]
    Closed,
    /// No bytes arrived within the configured read timeout.
    #[error("no data from server for {0:?}")]
    ReadTimeout(Duration),
    /// A packet exceeded the 64 KiB limit and was not sent (the connection stays usable).
    #[error("packet of {len} bytes exceeds the 65536-byte limit")]
    PacketTooLarge {
        /// The packet's length.
        len: usize,
    },
    /// No matching pong arrived within 5 s (the connection stays usable).
    #[error("ping timed out")]
    PingTimeout,
    /// A ServerInfo frame after the handshake did not open or parse.
    #[error("server info frame does not open or parse")]
    BadServerInfo,
}

impl From<io::Error> for ClientError {
    fn from(e: io::Error) -> Self {
        Self::Io(Arc::new(e))
    }
}

impl From<DecodeError> for ClientError {
    fn from(e: DecodeError) -> Self {
        Self::Decode(e)
    }
}

impl From<WsError> for ClientError {
    fn from(e: WsError) -> Self {
        Self::WebSocket(e)
    }
}
