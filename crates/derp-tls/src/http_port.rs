//! The plain-HTTP listener that runs beside the TLS one (derper's `--http-port`, usually 80):
//! captive-portal checks, ACME HTTP-01 answers, and redirects to HTTPS. DERP is never served
//! here.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use derp_server::{
    ConnGuard, Listener, Opened, ProxiedListener, Rewind, Server, http1_builder, open_connection,
    text,
};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::debug;

use super::front::TlsFront;

type Body = Full<Bytes>;

/// Path prefix of ACME HTTP-01 challenge requests (RFC 8555 §8.3).
const ACME_CHALLENGE_PREFIX: &str = "/.well-known/acme-challenge/";
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Nothing on this port needs a connection for long.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

impl TlsFront {
    /// Serves the port-80 listener until `server` shuts down: `/generate_204`, ACME HTTP-01
    /// tokens, and otherwise a redirect to `https://<hostname>[:https_port]<path>` for GET and
    /// HEAD (the port is left out when it is 443) and 400 "Use HTTPS" for other methods. With
    /// [`TlsOptions::http_port_proxy_protocol`](super::TlsOptions::http_port_proxy_protocol) set, only its listed proxies may connect and
    /// each connection opens with a PROXY protocol header, as on the TLS listener. Each
    /// connection runs on `server`'s task tracker, so that [`Server::shutdown`] ends it and
    /// waits for it.
    ///
    /// The redirect names the configured hostname rather than the request's `Host`, so this
    /// listener cannot be used to redirect to arbitrary sites.
    pub async fn serve_http_port(
        &self,
        server: &Server,
        listener: TcpListener,
        https_port: u16,
    ) -> std::io::Result<()> {
        let shutdown = server.shutdown_token();
        // Every connection here is unproven for its whole (short) life: when the budget is
        // full the oldest makes room, so a flood of idle connections from many addresses
        // slows captive-portal checks and HTTP-01 validation down but never locks them out.
        let (budget, error_counter) = self.http_port_limits();
        let mut listener = Listener::new(listener, "http_port", error_counter);
        let base = Arc::new(https_base(&self.hostname().to_string(), https_port));
        let proxy = self.http_port_proxy_protocol();
        loop {
            let (mut tcp, peer) = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                a = listener.accept() => a,
            };
            let slot = ConnGuard::from(match &proxy {
                None => budget.admit(peer.ip()),
                Some(p) if p.allows(ProxiedListener::HttpPort, peer) => budget.admit_proxy(),
                Some(_) => continue,
            });
            let this = self.clone();
            let base = base.clone();
            let shutdown = shutdown.clone();
            let proxy = proxy.clone();
            // On the server's tracker: a shutdown waits for these as for the relay's own
            // connections, instead of returning while they still hold sockets and budget
            // places.
            server.spawn_task(async move {
                // The PROXY protocol header first, if any, under the head's own deadline.
                let deadline = tokio::time::Instant::now() + HEADER_READ_TIMEOUT;
                let opened = open_connection(
                    proxy.as_ref(),
                    ProxiedListener::HttpPort,
                    &mut tcp,
                    peer,
                    &slot,
                    deadline,
                    &shutdown,
                )
                .await;
                let Some(Opened { remote, read, .. }) = opened else {
                    return;
                };
                let service = hyper::service::service_fn(move |req| {
                    let resp = this.route_http_port(&req, &base);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let conn = http1_builder(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(Rewind::new(read.freeze(), tcp)), service);
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = slot.evicted() => debug!(%remote, "port-80 connection evicted"),
                    r = tokio::time::timeout(CONNECTION_LIFETIME, conn) => {
                        if let Ok(Err(e)) = r {
                            debug!(%remote, error = %e, "http port connection ended");
                        }
                    }
                }
                drop(slot);
            });
        }
    }

    fn route_http_port(&self, req: &Request<Incoming>, https_base: &str) -> Response<Body> {
        let path = req.uri().path();
        if path == "/generate_204" {
            return derp_server::generate_204(req);
        }
        if let Some(token) = path.strip_prefix(ACME_CHALLENGE_PREFIX) {
            return match self.http01_answer(token) {
                Some(answer) => {
                    let mut resp = Response::new(Body::from(answer));
                    resp.headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                    resp
                }
                None => text(StatusCode::NOT_FOUND, "no such challenge\n"),
            };
        }
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::BAD_REQUEST, "Use HTTPS\n");
        }
        // Only origin-form targets are kept; `*` and anything odd go to the root.
        let target = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .filter(|p| p.starts_with('/'))
            .unwrap_or("/");
        let mut resp = Response::new(Body::default());
        *resp.status_mut() = StatusCode::FOUND;
        if let Ok(v) = HeaderValue::from_str(&format!("{https_base}{target}")) {
            resp.headers_mut().insert(header::LOCATION, v);
        }
        resp
    }
}

/// `https://host[:port]`, with IPv6 literals bracketed.
fn https_base(host: &str, port: u16) -> String {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    if port == 443 {
        format!("https://{host}")
    } else {
        format!("https://{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use prometheus::Registry;

    use derp_testkit::http::{answer_to, read_head};

    use super::*;
    use crate::TlsOptions;

    const WITHIN: Duration = Duration::from_secs(5);

    /// A port-80 listener on loopback in front of a relay, served until the relay shuts down:
    /// the relay, the registry both share, the address, and the listener's task.
    async fn http_port() -> (
        Server,
        Registry,
        std::net::SocketAddr,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let registry = Registry::new();
        let config = derp_server::ServerConfig::new(derp_testkit::server_secret());
        let server = Server::new(config, &registry).expect("server");
        let front = TlsFront::new(
            &server.public_key(),
            TlsOptions::new("derp.test"),
            &registry,
        )
        .expect("front");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = tokio::spawn({
            let server = server.clone();
            async move { front.serve_http_port(&server, listener, 443).await }
        });
        (server, registry, addr, serving)
    }

    /// A GET of `/generate_204` whose head is `len` bytes long, padded by one header.
    fn padded_request(len: usize) -> Vec<u8> {
        let start = "GET /generate_204 HTTP/1.1\r\nHost: localhost\r\nX-Pad: ";
        let mut out = start.as_bytes().to_vec();
        out.resize(len - 4, b'a');
        out.extend_from_slice(b"\r\n\r\n");
        out
    }

    /// Every request on the port-80 listener, the first and any later one, is held to the
    /// request-head limit of the main listener: hyper's default buffer (about 400 KB) would
    /// have taken these heads in whole and answered them.
    #[tokio::test]
    async fn a_request_head_over_the_limit_is_refused_first_or_later() {
        let (server, _registry, addr, serving) = http_port().await;
        let limit = derp_proto::upgrade::MAX_HEAD_LEN;
        let refused = |answer: &[u8]| answer.is_empty() || answer.starts_with(b"HTTP/1.1 431");

        let mut client = TcpStream::connect(addr).await.expect("connect");
        client
            .write_all(&padded_request(limit - 512))
            .await
            .expect("request");
        let within = read_head(&mut client, WITHIN).await;
        assert!(within.starts_with(b"HTTP/1.1 204"), "{within:?}");
        let answer = answer_to(&mut client, &padded_request(4 * limit), WITHIN).await;
        assert!(refused(&answer), "a later request: {answer:?}");

        let mut client = TcpStream::connect(addr).await.expect("connect");
        let answer = answer_to(&mut client, &padded_request(4 * limit), WITHIN).await;
        assert!(refused(&answer), "a first request: {answer:?}");

        server.shutdown().await;
        serving.await.expect("no panic").expect("served");
    }

    /// A connection of the port-80 listener runs on the relay's tracker: the relay's shutdown
    /// ends it and returns only once it has (its budget place given back, its socket closed),
    /// though its own deadlines (the request head's 10 s, the connection's 60 s) are far off.
    #[tokio::test]
    async fn a_shutdown_waits_for_the_port_80_connections() {
        let (server, registry, addr, serving) = http_port().await;
        let unproven = || {
            registry
                .gather()
                .iter()
                .filter(|f| f.name() == "derp_http_port_unproven_connections")
                .flat_map(|f| f.get_metric())
                .map(|m| m.get_gauge().get_value())
                .sum::<f64>()
        };
        // A client that connects and sends nothing.
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let accepted = async {
            while unproven() < 1.0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(WITHIN, accepted)
            .await
            .expect("the connection was accepted");

        tokio::time::timeout(WITHIN, server.shutdown())
            .await
            .expect("the shutdown ended the connection");
        assert_eq!(
            unproven(),
            0.0,
            "the shutdown returned before the connection ended"
        );
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(WITHIN, client.read(&mut byte))
            .await
            .expect("closed in time");
        assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
        serving.await.expect("no panic").expect("served");
    }

    #[test]
    fn redirect_base_leaves_out_the_default_port() {
        assert_eq!(
            https_base("derp.example.com", 443),
            "https://derp.example.com"
        );
        assert_eq!(
            https_base("derp.example.com", 8443),
            "https://derp.example.com:8443"
        );
        assert_eq!(https_base("::1", 443), "https://[::1]");
    }
}
