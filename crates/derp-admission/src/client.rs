//! The small HTTP/1.1 client the checks need: JSON POSTs to one URL over TCP or TLS with a
//! few pooled connections, and GETs over a Unix socket; every exchange under a deadline, with
//! the response head and body capped.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};
use tokio_rustls::TlsConnector;
use tracing::debug;

use crate::AdmissionError;

/// Why an exchange gave no usable response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    /// No response head arrived: the server is down, unreachable, refused TLS, or did not
    /// answer in time.
    #[error(transparent)]
    Unreachable(Unreachable),
    /// A response arrived but was unusable: a head that could not be read (too large, not
    /// HTTP), or a body too large, broken, or too slow.
    #[error(transparent)]
    BadBody(BadBody),
}

impl From<Unreachable> for Failure {
    fn from(e: Unreachable) -> Self {
        Self::Unreachable(e)
    }
}

impl From<BadBody> for Failure {
    fn from(e: BadBody) -> Self {
        Self::BadBody(e)
    }
}

/// Why no response head arrived.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unreachable {
    /// The TCP or Unix-socket connection was not made before the deadline.
    #[error("connect timed out")]
    ConnectTimeout,
    /// The TCP connection was refused or failed.
    #[error("connecting to {host}:{port}: {source}")]
    Connect {
        /// The host of the URL.
        host: String,
        /// The port.
        port: u16,
        /// Why it failed.
        source: io::Error,
    },
    /// The Unix socket could not be connected to.
    #[error("connecting to {}: {source}", socket.display())]
    ConnectUnix {
        /// The socket's path.
        socket: PathBuf,
        /// Why it failed.
        source: io::Error,
    },
    /// The TLS handshake did not finish before the deadline.
    #[error("tls handshake timed out")]
    TlsTimeout,
    /// rustls refused the server (an untrusted certificate, most likely) or the handshake.
    /// Boxed: it is twice the size of any other variant.
    #[error("tls: {0}")]
    Tls(#[source] Box<rustls::Error>),
    /// The socket failed or was closed during the TLS handshake.
    #[error("tls: {0}")]
    TlsIo(#[source] io::Error),
    /// The HTTP/1.1 connection was not set up before the deadline.
    #[error("http handshake timed out")]
    HttpTimeout,
    /// The HTTP/1.1 connection could not be set up.
    #[error("http: {0}")]
    Http(#[source] hyper::Error),
    /// The request could not be built.
    #[error("request: {0}")]
    BuildRequest(#[source] http::Error),
    /// The request could not be sent, or the connection failed before a response head.
    #[error("request: {0}")]
    Request(#[source] hyper::Error),
    /// No response head arrived before the deadline.
    #[error("no response in time")]
    ResponseTimeout,
}

/// Why a response that arrived is unusable.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadBody {
    /// The response head could not be read: too large, or not HTTP.
    #[error("response: {0}")]
    Head(#[source] hyper::Error),
    /// The body did not arrive before the deadline.
    #[error("the response body did not arrive in time")]
    BodyTimeout,
    /// Reading the body failed.
    #[error("reading the body: {0}")]
    Body(#[source] hyper::Error),
    /// The body is longer than the cap.
    #[error("the response body is larger than {max} bytes")]
    TooLarge {
        /// The cap.
        max: usize,
    },
}

/// Where POSTs go, parsed once.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    tls: Option<ServerName<'static>>,
    host: String,
    port: u16,
    authority: HeaderValue,
    /// The path and query, as the request target.
    target: http::Uri,
}

impl Target {
    pub(crate) fn parse(url: &str) -> Result<Self, AdmissionError> {
        let bad = |reason: &str| AdmissionError::Url {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(bad("the scheme must be http or https")),
        };
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("user info is not supported"));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            Some(
                ServerName::try_from(host.clone())
                    .map_err(|_| bad("the host is not a valid TLS server name"))?,
            )
        } else {
            None
        };
        let path = uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        Ok(Self {
            tls,
            port,
            authority: HeaderValue::from_str(authority.as_str())
                .map_err(|_| bad("the host is not a valid header value"))?,
            target: path.parse().map_err(|_| bad("the path is not valid"))?,
            host,
        })
    }
}

/// Connections idle longer than this are not reused (servers close idle connections too).
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most idle connections kept.
const MAX_IDLE: usize = 16;
/// Cap on a response head.
const MAX_HEAD: usize = 16 * 1024;

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    since: Instant,
}

/// JSON POSTs to one [`Target`].
pub(crate) struct PostClient {
    target: Target,
    tls: Option<TlsConnector>,
    idle: Mutex<Vec<Idle>>,
}

impl std::fmt::Debug for PostClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostClient")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl PostClient {
    /// A client for `target`; HTTPS trusts the system's roots (Mozilla's when the system has
    /// none) plus `extra_roots`.
    pub(crate) fn new(
        target: Target,
        extra_roots: &[CertificateDer<'static>],
    ) -> Result<Self, AdmissionError> {
        let tls = match target.tls {
            None => None,
            Some(_) => Some(TlsConnector::from(Arc::new(tls_config(extra_roots)?))),
        };
        Ok(Self {
            target,
            tls,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// POSTs `body` as JSON and returns the status and at most `max_body` bytes of body, all
    /// before `deadline`.
    pub(crate) async fn post_json(
        &self,
        body: Bytes,
        deadline: Instant,
        max_body: usize,
    ) -> Result<(StatusCode, Bytes), Failure> {
        let request = || {
            let mut req = Request::new(Full::new(body.clone()));
            *req.method_mut() = http::Method::POST;
            *req.uri_mut() = self.target.target.clone();
            let h = req.headers_mut();
            h.insert(header::HOST, self.target.authority.clone());
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            h.insert(header::USER_AGENT, HeaderValue::from_static("derpd"));
            req
        };
        // A pooled connection may have been closed by the server a moment ago; that costs a
        // retry on a fresh one, never a failed admission.
        let (mut sender, resp) = loop {
            let (mut sender, pooled) = match self.take_idle() {
                Some(s) => (s, true),
                None => (self.connect(deadline).await?, false),
            };
            let sent = timeout_at(deadline, async {
                sender.ready().await?;
                sender.send_request(request()).await
            })
            .await;
            match sent {
                Ok(Ok(resp)) => break (sender, resp),
                // Something answered, in a form derpd cannot read: the server is there, and
                // failing open would admit whoever a broken answer is about.
                Ok(Err(e)) if e.is_parse() || e.is_parse_too_large() || e.is_parse_status() => {
                    return Err(BadBody::Head(e).into());
                }
                Ok(Err(_)) if pooled => continue,
                Ok(Err(e)) => return Err(Unreachable::Request(e).into()),
                Err(_) => return Err(Unreachable::ResponseTimeout.into()),
            }
        };
        let status = resp.status();
        let body = timeout_at(deadline, read_capped(resp.into_body(), max_body))
            .await
            .map_err(|_| BadBody::BodyTimeout)??;
        if !sender.is_closed() {
            // Ready again once the response is fully read, which it now is.
            if timeout_at(deadline, sender.ready())
                .await
                .is_ok_and(|r| r.is_ok())
            {
                self.put_idle(sender);
            }
        }
        Ok((status, body))
    }

    fn take_idle(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(i) = idle.pop() {
            if i.since.elapsed() < IDLE_TIMEOUT && !i.sender.is_closed() {
                return Some(i.sender);
            }
        }
        None
    }

    fn put_idle(&self, sender: SendRequest<Full<Bytes>>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self, deadline: Instant) -> Result<SendRequest<Full<Bytes>>, Failure> {
        let t = &self.target;
        let tcp = timeout_at(deadline, TcpStream::connect((t.host.as_str(), t.port)))
            .await
            .map_err(|_| Unreachable::ConnectTimeout)?
            .map_err(|source| Unreachable::Connect {
                host: t.host.clone(),
                port: t.port,
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        match (&self.tls, &t.tls) {
            (Some(connector), Some(name)) => {
                let stream = timeout_at(deadline, connector.connect(name.clone(), tcp))
                    .await
                    .map_err(|_| Unreachable::TlsTimeout)?
                    .map_err(tls_error)?;
                handshake(stream, deadline).await
            }
            _ => handshake(tcp, deadline).await,
        }
    }
}

async fn handshake<S>(io: S, deadline: Instant) -> Result<SendRequest<Full<Bytes>>, Failure>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = timeout_at(
        deadline,
        http1::Builder::new()
            .max_buf_size(MAX_HEAD.max(8192))
            .handshake(TokioIo::new(io)),
    )
    .await
    .map_err(|_| Unreachable::HttpTimeout)?
    .map_err(Unreachable::Http)?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!(error = %e, "admission connection ended");
        }
    });
    Ok(sender)
}

/// A GET over a Unix socket (one connection per request: it is local and cheap), with `host`
/// as the Host header.
pub(crate) async fn get_unix(
    socket: &Path,
    host: &'static str,
    path_and_query: &str,
    extra: &[(&'static str, &'static str)],
    deadline: Instant,
    max_body: usize,
) -> Result<(StatusCode, Bytes), Failure> {
    let stream = timeout_at(deadline, tokio::net::UnixStream::connect(socket))
        .await
        .map_err(|_| Unreachable::ConnectTimeout)?
        .map_err(|source| Unreachable::ConnectUnix {
            socket: socket.to_owned(),
            source,
        })?;
    let mut sender = handshake(stream, deadline).await?;
    let mut req = Request::get(path_and_query)
        .body(Full::new(Bytes::new()))
        .map_err(Unreachable::BuildRequest)?;
    req.headers_mut()
        .insert(header::HOST, HeaderValue::from_static(host));
    for (name, value) in extra {
        req.headers_mut()
            .insert(*name, HeaderValue::from_static(value));
    }
    let resp = timeout_at(deadline, sender.send_request(req))
        .await
        .map_err(|_| Unreachable::ResponseTimeout)?
        .map_err(Unreachable::Request)?;
    let status = resp.status();
    let body = timeout_at(deadline, read_capped(resp.into_body(), max_body))
        .await
        .map_err(|_| BadBody::BodyTimeout)??;
    Ok((status, body))
}

async fn read_capped(mut body: Incoming, max: usize) -> Result<Bytes, Failure> {
    let mut out = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BadBody::Body)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > max {
                return Err(BadBody::TooLarge { max }.into());
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// tokio-rustls reports rustls's refusals inside an `io::Error`; they are taken out so that
/// an untrusted certificate is told from a reset socket.
fn tls_error(e: io::Error) -> Unreachable {
    match e.downcast::<rustls::Error>() {
        Ok(tls) => Unreachable::Tls(Box::new(tls)),
        Err(io) => Unreachable::TlsIo(io),
    }
}

fn tls_config(
    extra_roots: &[CertificateDer<'static>],
) -> Result<rustls::ClientConfig, AdmissionError> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        debug!(error = %e, "loading system CA certificates");
    }
    let (added, _) = roots.add_parsable_certificates(native.certs);
    if added == 0 {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for root in extra_roots {
        roots.add(root.clone())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    async fn post(
        url: &str,
        max_body: usize,
        within: Duration,
    ) -> Result<(StatusCode, Bytes), Failure> {
        let client = PostClient::new(Target::parse(url).expect("url"), &[]).expect("client");
        let deadline = Instant::now() + within;
        client
            .post_json(Bytes::from_static(b"{}"), deadline, max_body)
            .await
    }

    #[tokio::test]
    async fn a_server_that_is_not_listening_is_unreachable_with_the_connect_error() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let err = post(
            &format!("http://127.0.0.1:{port}/verify"),
            4096,
            Duration::from_secs(10),
        )
        .await
        .expect_err("nothing listens there");
        assert!(
            matches!(
                &err,
                Failure::Unreachable(Unreachable::Connect { source, .. })
                    if source.kind() == io::ErrorKind::ConnectionRefused
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with(&format!("connecting to 127.0.0.1:{port}: ")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_a_response_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/verify", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.expect("accept");
            let mut buf = Vec::new();
            let _ = io.read_to_end(&mut buf).await;
        });
        let err = post(&url, 4096, Duration::from_millis(300))
            .await
            .expect_err("no answer");
        assert!(
            matches!(err, Failure::Unreachable(Unreachable::ResponseTimeout)),
            "{err:?}"
        );
        server.abort();
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_a_bad_body() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/verify", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 4096];
            let _ = io.read(&mut buf).await;
            let body = vec![b'x'; 100];
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
            let _ = io.write_all(head.as_bytes()).await;
            let _ = io.write_all(&body).await;
            let _ = io.read(&mut buf).await;
        });
        let err = post(&url, 10, Duration::from_secs(10))
            .await
            .expect_err("too large");
        assert!(
            matches!(err, Failure::BadBody(BadBody::TooLarge { max: 10 })),
            "{err:?}"
        );
        server.abort();
    }

    #[test]
    fn urls_parse_or_are_refused_clearly() {
        let t = Target::parse("https://headscale.example.com/verify").expect("ok");
        assert_eq!(
            (t.host.as_str(), t.port, t.target.to_string().as_str()),
            ("headscale.example.com", 443, "/verify")
        );
        assert!(t.tls.is_some());
        let t = Target::parse("http://127.0.0.1:8080/v?x=1").expect("ok");
        assert_eq!(
            (t.host.as_str(), t.port, t.target.to_string().as_str()),
            ("127.0.0.1", 8080, "/v?x=1")
        );
        assert!(t.tls.is_none());
        let t = Target::parse("http://[::1]:9/").expect("ok");
        assert_eq!(t.host, "::1");
        assert_eq!(t.authority, "[::1]:9");
        for bad in [
            "ftp://x/",
            "/verify",
            "http://",
            "https://u:p@host/",
            "not a url",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
