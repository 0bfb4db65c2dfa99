//! The HTTP/1.1 front: DERP upgrades, probe endpoints and the home page.
//!
//! The first request on a connection is read and parsed here rather than by hyper, because a
//! fast-start client writes its request and its ClientInfo frame together and never reads an
//! HTTP response: hyper's upgrade API always answers and may swallow the bytes after the head.
//! A `/derp` upgrade is therefore taken over directly, with the bytes that followed the head
//! kept; every other request, and everything after it on the same connection, goes to hyper
//! with the already-read bytes replayed in front of the socket. A `/derp` upgrade hyper
//! answers there is taken back out of hyper as the transport the connection came on (plain
//! TCP or derpd's TLS records), so both kinds of upgrade run on the same streams.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::channel::Channel;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

use derp_io::Transport;
use derp_proto::upgrade::{self, DerpUpgrade, UpgradeKind};
use derp_proto::ws;

use crate::config::HomePage;
use crate::conn::{self, Framing, Handover};
use crate::listen::ConnGuard;
use crate::proxy::{Opened, ProxiedListener, open_connection};
use crate::state::ServerState;

mod rewind;
mod via_hyper;

pub use rewind::Rewind;
use via_hyper::derp_via_hyper;

/// Serves one connection handover from a listed proxy on the main plain-HTTP listener: reads
/// its PROXY protocol header (within the handshake deadline, while it may be evicted as any
/// unproven connection), then serves it as the client's the header names.
pub(crate) async fn serve_proxied(
    shared: Arc<ServerState>,
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    guard: ConnGuard,
) {
    let deadline = tokio::time::Instant::now() + shared.config.handshake_timeout;
    let opened = open_connection(
        shared.proxy.as_ref(),
        ProxiedListener::Main,
        &mut stream,
        peer,
        &guard,
        deadline,
        &shared.shutdown,
    )
    .await;
    let Some(Opened { remote, read, .. }) = opened else {
        return;
    };
    serve_conn(shared, Transport::Tcp(stream), remote, guard, read).await;
}

/// Serves one handover connection (plain TCP, or TLS after its handshake). `buf` holds bytes
/// already read from it (after a PROXY protocol header), usually none.
///
/// Until its DERP client is registered, the connection may be evicted from the unproven
/// budget (see `listen.rs`); `guard` says when, and is held until the connection ends.
pub(crate) async fn serve_conn(
    shared: Arc<ServerState>,
    mut stream: Transport,
    mut remote: SocketAddr,
    guard: ConnGuard,
    mut buf: BytesMut,
) {
    let head = tokio::select! {
        _ = guard.evicted() => {
            debug!(%remote, "evicted while sending its request head");
            return;
        }
        head = tokio::time::timeout(
            shared.config.handshake_timeout,
            read_head(&mut stream, &mut buf),
        ) => head,
    };
    let head_len = match head {
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => {
            // Too large or not HTTP: answer once, plainly, and close.
            let _ = stream.write_all(BAD_REQUEST).await;
            return;
        }
        Ok(Err(e)) => {
            debug!(%remote, error = %e, "reading request head");
            return;
        }
        Err(_) => {
            debug!(%remote, "request head timed out");
            return;
        }
    };
    let forwarder = forwarder(&shared, remote);
    let proxied = guard.via_proxy() || forwarder;
    match upgrade::classify_request(&buf[..head_len], shared.config.derp_enabled) {
        upgrade::Request::Upgrade(up) => {
            if forwarder && let Some(client) = forwarded_in_head(&shared, &buf[..head_len]) {
                guard.relayed_for(client);
                remote = SocketAddr::new(client, 0);
            }
            buf.advance(head_len);
            take_over(shared, stream, buf, remote, up, guard).await;
        }
        upgrade::Request::Other => {
            let peer = Peer {
                remote,
                proxied,
                forwarder,
            };
            serve_hyper(shared, Rewind::new(buf.freeze(), stream), peer, guard).await;
        }
    }
}

/// Where a connection handed to hyper comes from.
#[derive(Clone, Copy, Debug)]
struct Peer {
    /// The client's address as known at accept (a PROXY protocol header's, or the socket's).
    remote: SocketAddr,
    /// It came through a proxy: `/debug` is never served on it.
    proxied: bool,
    /// Its peer is a trusted HTTP proxy, whose forwarded headers name each request's client.
    forwarder: bool,
}

/// Whether a connection from `remote` is a trusted HTTP proxy's.
pub(crate) fn forwarder(shared: &ServerState, remote: SocketAddr) -> bool {
    let trusted = &shared.config.trust_forwarded_from;
    !trusted.is_empty() && trusted.iter().any(|n| n.contains(remote.ip()))
}

/// The client a trusted proxy names in a request head (see `proxy.rs` for the rule).
fn forwarded_in_head(shared: &ServerState, head: &[u8]) -> Option<std::net::IpAddr> {
    let mut headers = [httparse::EMPTY_HEADER; upgrade::MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    req.parse(head).ok()?;
    let pairs = req.headers.iter().map(|h| (h.name, h.value));
    let config = &shared.config;
    crate::proxy::forwarded_client(pairs, config.forwarded_header, &config.trust_forwarded_from)
}

/// [`forwarded_in_head`] for a request hyper parsed.
fn forwarded_in_request<B>(shared: &ServerState, req: &Request<B>) -> Option<std::net::IpAddr> {
    let pairs = req
        .headers()
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()));
    let config = &shared.config;
    crate::proxy::forwarded_client(pairs, config.forwarded_header, &config.trust_forwarded_from)
}

/// Runs DERP on an upgraded stream: answers the upgrade (unless the client asked for fast
/// start) in the same write as the ServerKey frame, or refuses a WebSocket client that did not
/// offer the `derp` subprotocol token. `initial` holds bytes that followed the request head.
async fn take_over(
    shared: Arc<ServerState>,
    mut stream: Transport,
    initial: BytesMut,
    remote: SocketAddr,
    up: DerpUpgrade,
    guard: ConnGuard,
) {
    let (preamble, framing) = match up.kind {
        UpgradeKind::Derp { fast_start: true } => (Bytes::new(), Framing::Raw),
        UpgradeKind::Derp { fast_start: false } => {
            (shared.derp_response_head.clone(), Framing::Raw)
        }
        UpgradeKind::WebSocket {
            accept,
            derp_token: true,
        } => (
            Bytes::from(upgrade::websocket_response_head(&accept, true)),
            Framing::WebSocket,
        ),
        UpgradeKind::WebSocket {
            accept,
            derp_token: false,
        } => {
            let mut out = upgrade::websocket_response_head(&accept, false);
            out.extend_from_slice(&refuse_subprotocol_frame());
            let _ =
                tokio::time::timeout(shared.config.handshake_timeout, stream.write_all(&out)).await;
            return;
        }
    };
    let handover = Handover {
        transport: stream,
        initial,
        remote,
        preamble,
        framing,
        not_ideal: up.not_ideal,
        quic: None,
        guard,
        detach: true,
    };
    conn::serve(shared, handover).await;
}

/// The close frame for a WebSocket client whose subprotocol list only mentions `derp`.
fn refuse_subprotocol_frame() -> Vec<u8> {
    ws::close_frame_with_reason(
        ws::close_code::POLICY_VIOLATION,
        "client must speak the derp subprotocol",
    )
}

/// Reads until a complete request head is buffered. Returns its length, or `None` when the
/// bytes are not a request or the head is too large.
///
/// The head is parsed again only when a read brings a new line (and on the first read, so
/// garbage is refused at once): a client dribbling one byte at a time costs one parse per
/// line, not one per byte.
async fn read_head(stream: &mut Transport, buf: &mut BytesMut) -> io::Result<Option<usize>> {
    let mut parse = !buf.is_empty();
    loop {
        if parse {
            match upgrade::request_head_len(buf) {
                Ok(Some(n)) => return Ok(Some(n)),
                Ok(None) => {}
                Err(_) => return Ok(None),
            }
        }
        if buf.len() >= upgrade::MAX_HEAD_LEN {
            return Ok(None);
        }
        let first = buf.is_empty();
        let before = buf.len();
        buf.reserve(1024);
        if stream.read_buf(buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        parse = first || buf[before..].contains(&b'\n');
    }
}

/// hyper's HTTP/1.1 server as every listener runs it (the main one after its first request,
/// the metrics listener, `derp-tls`'s port-80 listener): each request head within
/// `header_read_timeout`, and at most [`upgrade::MAX_HEAD_LEN`] bytes buffered, the bound the
/// first request head of a main-listener connection has. hyper's own default (about 400 KB)
/// would let every keep-alive request, and every request on the other listeners, hold that
/// much; a longer head is answered 431 and the connection closed.
pub fn http1_builder(header_read_timeout: Duration) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .max_buf_size(upgrade::MAX_HEAD_LEN);
    builder
}

// hyper panics on a buffer limit below its minimum read buffer of 8 KiB.
const _: () = assert!(upgrade::MAX_HEAD_LEN >= 8192);

/// The connection's guard while hyper serves it: a `/derp` request upgraded through hyper
/// takes it along to its DERP task.
type GuardCell = Arc<Mutex<Option<ConnGuard>>>;

/// The stream hyper serves a main-listener connection on, named so that an upgrade can take
/// it back out of hyper as exactly this type ([`via_hyper::unwrap_upgraded`]).
type HyperIo = TokioIo<Rewind<Transport>>;

async fn serve_hyper(
    shared: Arc<ServerState>,
    io: Rewind<Transport>,
    peer: Peer,
    guard: ConnGuard,
) {
    // Plain HTTP exchanges stay unproven: probes and pages are short, and a connection that
    // lingers on them is the first to make room under pressure.
    let evicted = guard.eviction_token();
    let guard: GuardCell = Arc::new(Mutex::new(Some(guard)));
    // Later requests on the connection get the same deadline as the first one's head.
    let header_timeout = shared.config.handshake_timeout;
    let service = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        let guard = guard.clone();
        async move { Ok::<_, Infallible>(respond(&shared, req, peer, &guard)) }
    });
    let conn = http1_builder(header_timeout)
        .serve_connection(HyperIo::new(io), service)
        .with_upgrades();
    let remote = peer.remote;
    let result = tokio::select! {
        _ = evicted.cancelled() => {
            debug!(%remote, "http connection evicted");
            return;
        }
        r = conn => r,
    };
    if let Err(e) = result {
        debug!(%remote, error = %e, "http connection ended");
    }
}

type Body = Full<Bytes>;

/// What hyper sends: a whole body, or `/debug/traffic`'s stream.
type AnyBody = Either<Body, Channel<Bytes>>;

/// One request that reached hyper: the `/debug` pages, or [`route`].
fn respond(
    shared: &Arc<ServerState>,
    req: Request<Incoming>,
    peer: Peer,
    guard: &GuardCell,
) -> Response<AnyBody> {
    let path = req.uri().path();
    if path != "/debug" && !path.starts_with("/debug/") {
        return route(shared, req, peer, guard).map(Either::Left);
    }
    if path == "/debug" {
        // As Go's ServeMux answers, before any access check.
        let mut resp = Response::new(Body::default());
        *resp.status_mut() = StatusCode::TEMPORARY_REDIRECT;
        resp.headers_mut()
            .insert(header::LOCATION, HeaderValue::from_static("/debug/"));
        return resp.map(Either::Left);
    }
    if peer.proxied || !debug_allowed(shared, &req, peer.remote) {
        return text(StatusCode::FORBIDDEN, "debug access denied\n").map(Either::Left);
    }
    let resp = match path {
        "/debug/" => {
            let mut resp = Response::new(Body::from(crate::debug::index(shared)));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            );
            browser_headers(resp)
        }
        "/debug/varz" => prometheus_text(shared),
        "/debug/check" => match crate::debug::check(shared) {
            Ok(()) => text(StatusCode::OK, crate::debug::CHECK_OK),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
        },
        "/debug/traffic" => {
            let mut resp = Response::new(crate::debug::traffic(shared));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            return resp.map(Either::Right);
        }
        _ => text(StatusCode::NOT_FOUND, "404 page not found\n"),
    };
    resp.map(Either::Left)
}

fn route(
    shared: &Arc<ServerState>,
    req: Request<Incoming>,
    peer: Peer,
    guard: &GuardCell,
) -> Response<Body> {
    let path = req.uri().path();
    if upgrade::is_probe_path(path) {
        return probe(req.method());
    }
    if upgrade::is_derp_path(path) {
        let (remote, forwarded) = client_of(shared, &req, peer);
        return derp_via_hyper(shared, req, remote, forwarded, guard);
    }
    match path {
        "/generate_204" => generate_204(&req),
        "/robots.txt" => browser_headers(text(StatusCode::OK, "User-agent: *\nDisallow: /\n")),
        // The rollout share is drawn from the client's address: behind an HTTP proxy the
        // proxy's would put every client on one side.
        "/bootstrap-dns" => browser_headers(crate::bootstrap_dns::serve(
            shared.config.bootstrap_dns.as_deref(),
            &req,
            client_of(shared, &req, peer).0,
        )),
        _ => home(&shared.config.home),
    }
}

/// Whose request `req` is: the client a trusted HTTP proxy names in it (also returned alone,
/// port 0), or else the connection's client as admitted (a PROXY protocol header's, or the
/// socket's peer).
fn client_of<B>(
    shared: &ServerState,
    req: &Request<B>,
    peer: Peer,
) -> (SocketAddr, Option<std::net::IpAddr>) {
    let forwarded = peer
        .forwarder
        .then(|| forwarded_in_request(shared, req))
        .flatten();
    let remote = forwarded.map_or(peer.remote, |ip| SocketAddr::new(ip, 0));
    (remote, forwarded)
}

/// Whether a request may see the `/debug/` pages (Prometheus text and the others): from
/// loopback and the configured networks only. A request that came through a proxy is
/// refused whatever its source, since the proxy's address says nothing about the client's
/// (see [`names_a_proxy`]); so is every request on a connection from a PROXY protocol
/// balancer or a trusted HTTP proxy (see `respond`), whatever client address they name.
fn debug_allowed(shared: &ServerState, req: &Request<Incoming>, remote: SocketAddr) -> bool {
    let ip = remote.ip().to_canonical();
    let proxied = req
        .headers()
        .keys()
        .any(|name| names_a_proxy(name.as_str()));
    !proxied && (ip.is_loopback() || shared.config.debug_allow.iter().any(|n| n.contains(ip)))
}

/// Whether a request header (name in lower case, as `http` stores it) is one that a proxy,
/// load balancer or CDN adds when it passes a request on.
///
/// A reverse proxy on the same host connects from loopback, so without this check anyone on
/// the internet could read the metrics through it. Proxies differ in which header they add,
/// and a client can send any of them itself; so any one of them refuses the request. The
/// rule errs towards refusing: a scraper talking to derpd directly sends none of these, and
/// one that goes through a proxy should use `--metrics-addr` instead.
///
/// - `Forwarded` (RFC 7239) and `Via` (RFC 9110, which every HTTP proxy must add);
/// - every `X-Forwarded-*` (`-For`, `-Host`, `-Proto`, `-Port`, `-Server`, `-Prefix`...) and
///   other names ending in `forwarded-for` (`X-Original-Forwarded-For` of ingress-nginx);
/// - client-address headers: `X-Real-IP` (nginx), `True-Client-IP` (Akamai, Cloudflare),
///   `X-Client-IP`, `Client-IP`, `CF-Connecting-IP` and `CF-Connecting-IPv6` (Cloudflare),
///   `Fastly-Client-IP`, `X-Cluster-Client-IP`, `X-Azure-ClientIP` and `X-Azure-SocketIP`
///   (Azure Front Door), `X-Envoy-External-Address` (Envoy), `X-ProxyUser-IP` (Google),
///   and any other name ending in `client-ip` or `clientip`.
fn names_a_proxy(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "forwarded",
        "via",
        "x-real-ip",
        "cf-connecting-ip",
        "cf-connecting-ipv6",
        "x-azure-socketip",
        "x-envoy-external-address",
        "x-proxyuser-ip",
    ];
    EXACT.contains(&name)
        || name.starts_with("x-forwarded-")
        || name.ends_with("forwarded-for")
        || name.ends_with("client-ip")
        || name.ends_with("clientip")
}

fn prometheus_text(shared: &ServerState) -> Response<Body> {
    let families = shared.prometheus.gather();
    let mut out = String::new();
    if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&families, &mut out) {
        debug!(error = %e, "encoding metrics");
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        );
    }
    let mut resp = Response::new(Body::from(out));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// One connection to the `--metrics-addr` listener: `/metrics`, and the health checks an
/// orchestrator runs, which cannot use the main listener (in TLS mode it refuses a handshake
/// without the node's hostname as SNI, and kubelet and Docker send none).
pub(crate) async fn serve_metrics_conn(
    shared: Arc<ServerState>,
    stream: tokio::net::TcpStream,
    remote: SocketAddr,
) {
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let shared = shared.clone();
        async move {
            Ok::<_, Infallible>(match req.uri().path() {
                "/metrics" => prometheus_text(&shared),
                "/derp/probe" => readiness(&shared, req.method()),
                // Liveness: answered whenever the runtime is, whatever the load or the
                // certificate, so a busy node is never restarted for being busy.
                "/healthz" => probe(req.method()),
                _ => text(StatusCode::NOT_FOUND, "not found\n"),
            })
        }
    });
    let result = http1_builder(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service)
        .await;
    if let Err(e) = result {
        debug!(%remote, error = %e, "metrics connection ended");
    }
}

/// `/derp/probe` on the metrics listener: what the main listener's probe would tell a
/// client. 503 before the embedder reports the node ready (no certificate yet) and from the
/// start of a graceful shutdown, when the main listener is closed.
fn readiness(shared: &ServerState, method: &Method) -> Response<Body> {
    if shared.draining.is_cancelled() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    if !shared.ready.load(std::sync::atomic::Ordering::Relaxed) {
        return text(StatusCode::SERVICE_UNAVAILABLE, "not serving yet\n");
    }
    probe(method)
}

fn probe(method: &Method) -> Response<Body> {
    if method == Method::GET || method == Method::HEAD {
        let mut resp = Response::new(Body::default());
        resp.headers_mut().insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
        resp
    } else {
        method_not_allowed("bogus probe method\n", "GET, HEAD")
    }
}

/// 405 with the `Allow` header RFC 9110 §15.5.6 requires.
fn method_not_allowed(body: &'static str, allow: &'static str) -> Response<Body> {
    let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, body);
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    resp
}

/// `/generate_204`: captive-portal detection, with the challenge echo clients use to check
/// that the answer came from this server. Public so the port-80 listener answers it the
/// same way.
pub fn generate_204<B>(req: &Request<B>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Body::default());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    let h = resp.headers_mut();
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-store, must-revalidate, no-transform, max-age=0"),
    );
    if let Some(challenge) = req.headers().get("x-tailscale-challenge")
        && valid_challenge(challenge.as_bytes())
        && let Ok(v) = HeaderValue::from_bytes(
            [b"response ".as_slice(), challenge.as_bytes()]
                .concat()
                .as_slice(),
        )
    {
        h.insert("x-tailscale-response", v);
    }
    resp
}

fn valid_challenge(c: &[u8]) -> bool {
    c.len() <= 64
        && c.iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

fn home(home: &HomePage) -> Response<Body> {
    match home {
        HomePage::Default => browser_headers(html(HOME_PAGE)),
        HomePage::Blank => browser_headers(html("")),
        HomePage::Redirect(url) => {
            let mut resp = Response::new(Body::default());
            *resp.status_mut() = StatusCode::FOUND;
            if let Ok(v) = HeaderValue::from_str(url) {
                resp.headers_mut().insert(header::LOCATION, v);
            }
            resp
        }
    }
}

fn html(body: &'static str) -> Response<Body> {
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    resp
}

/// A plain-text answer (`text/plain; charset=utf-8`). Public so the port-80 listener
/// answers in the same form.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Body::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Headers derper adds to pages a browser may render.
fn browser_headers(mut resp: Response<Body>) -> Response<Body> {
    let h = resp.headers_mut();
    h.insert(
        header::STRICT_TRANSPORT_SECURITY,
        HeaderValue::from_static("max-age=63072000; includeSubDomains"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'self'; \
             block-all-mixed-content; object-src 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
const BAD_REQUEST: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

const HOME_PAGE: &str = "<!DOCTYPE html>
<html lang=\"en\">
<head><meta charset=\"utf-8\"><title>DERP relay</title></head>
<body>
<h1>DERP</h1>
<p>This is a DERP relay server (derpd). It relays encrypted WireGuard packets for Tailscale
clients that cannot reach each other directly. It cannot read the traffic it carries.</p>
<p>There is nothing to see here with a browser.</p>
</body>
</html>
";

#[cfg(test)]
mod tests {
    use derp_testkit::http::{answer_to, read_head};

    use super::via_hyper::unwrap_upgraded;
    use super::*;

    const WITHIN: Duration = Duration::from_secs(5);

    fn test_state() -> Arc<ServerState> {
        let config = crate::ServerConfig::new(derp_testkit::server_secret());
        Arc::new(ServerState::new(config, &prometheus::Registry::new()).expect("state"))
    }

    /// A listener on a loopback port of its own.
    async fn listener() -> tokio::net::TcpListener {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
    }

    /// A connection through `listener`: the client's end, then the accepted end and its
    /// peer's address.
    async fn connect(
        listener: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, tokio::net::TcpStream, SocketAddr) {
        let addr = listener.local_addr().expect("address");
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (stream, remote) = accepted.expect("accept");
        (client.expect("connect"), stream, remote)
    }

    /// A client connection to `listener` and the task serving its other end.
    async fn served_connection(
        shared: &Arc<ServerState>,
        listener: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, tokio::task::JoinHandle<()>) {
        let (client, stream, remote) = connect(listener).await;
        let serving = tokio::spawn(serve_conn(
            shared.clone(),
            Transport::Tcp(stream),
            remote,
            ConnGuard::none(),
            BytesMut::new(),
        ));
        (client, serving)
    }

    /// A served connection whose first request, a probe read by the HTTP front, has been
    /// answered: every request after it goes through hyper.
    async fn served_after_a_probe(
        shared: &Arc<ServerState>,
        listener: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, tokio::task::JoinHandle<()>) {
        let (mut client, serving) = served_connection(shared, listener).await;
        client
            .write_all(b"HEAD /derp/probe HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .expect("probe");
        let probe = read_head(&mut client, WITHIN).await;
        assert!(probe.starts_with(b"HTTP/1.1 200"), "{probe:?}");
        (client, serving)
    }

    /// The DERP upgrade request the Go client sends.
    fn derp_request(fast_start: bool) -> Vec<u8> {
        let mut request = Vec::new();
        upgrade::write_request(
            &upgrade::RequestOptions {
                path: "/derp",
                host: "localhost",
                user_agent: "test",
                fast_start,
                ideal_node: None,
                websocket_key: None,
            },
            &mut request,
        );
        request
    }

    /// Leaving mid-handshake ends the connection's task, without a panic.
    async fn ends_in_time(serving: tokio::task::JoinHandle<()>) {
        tokio::time::timeout(WITHIN, serving)
            .await
            .expect("task ended")
            .expect("no panic");
    }

    #[tokio::test]
    async fn a_derp_upgrade_gets_derpers_101_then_the_server_key_and_a_fast_start_only_the_key() {
        let shared = test_state();
        let listener = listener().await;
        for fast_start in [false, true] {
            let (mut client, serving) = served_connection(&shared, &listener).await;
            client
                .write_all(&derp_request(fast_start))
                .await
                .expect("request");
            let mut expected = if fast_start {
                Vec::new()
            } else {
                upgrade::derp_response_head(&shared.public_key)
            };
            derp_proto::RelayToClient::ServerKey(shared.public_key).encode(&mut expected);
            let mut got = vec![0; expected.len()];
            tokio::time::timeout(WITHIN, client.read_exact(&mut got))
                .await
                .expect("in time")
                .expect("read");
            assert_eq!(got, expected, "fast start {fast_start}");
            drop(client);
            ends_in_time(serving).await;
        }
    }

    /// A head's header lines as (lowercase name, value), without `Date` (only hyper adds
    /// it).
    fn header_set(head: &[u8]) -> std::collections::BTreeSet<(String, String)> {
        String::from_utf8_lossy(head)
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .filter(|(n, _)| n != "date")
            .collect()
    }

    #[tokio::test]
    async fn an_upgrade_after_another_request_gets_the_same_101_through_hyper() {
        let shared = test_state();
        let listener = listener().await;
        let (mut client, serving) = served_after_a_probe(&shared, &listener).await;
        client
            .write_all(&derp_request(false))
            .await
            .expect("request");
        let head = read_head(&mut client, WITHIN).await;
        let fast_path = upgrade::derp_response_head(&shared.public_key);
        assert_eq!(
            head.split(|&b| b == b'\r').next(),
            fast_path.split(|&b| b == b'\r').next(),
            "status line"
        );
        assert_eq!(header_set(&head), header_set(&fast_path));
        let mut expected = Vec::new();
        derp_proto::RelayToClient::ServerKey(shared.public_key).encode(&mut expected);
        let mut got = vec![0; expected.len()];
        client.read_exact(&mut got).await.expect("server key");
        assert_eq!(got, expected);
        drop(client);
        ends_in_time(serving).await;
    }

    #[tokio::test]
    async fn a_derp_upgrade_through_hyper_keeps_its_tcp_socket_and_the_frame_sent_with_it() {
        let shared = test_state();
        let listener = listener().await;
        let (mut client, serving) = served_after_a_probe(&shared, &listener).await;
        // ClientInfo in the same write as the upgrade: hyper reads it with the head.
        let mut hs = derp_proto::ClientHandshake::fast_start(
            derp_testkit::client_a_secret(),
            derp_proto::ClientInfo {
                version: 2,
                ..Default::default()
            },
            shared.public_key,
        );
        let mut request = derp_request(false);
        hs.client_info_frame([7; 24], &mut request)
            .expect("client info");
        client.write_all(&request).await.expect("request");
        let head = read_head(&mut client, WITHIN).await;
        assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
        let mut decoder = derp_proto::ClientDecoder::new();
        let mut buf = BytesMut::new();
        let sealed = loop {
            match decoder.decode(&mut buf).expect("frame") {
                Some(derp_proto::RelayToClient::ServerInfo { sealed }) => break sealed,
                Some(derp_proto::RelayToClient::ServerKey(key)) => {
                    assert_eq!(key, shared.public_key);
                }
                Some(other) => panic!("unexpected {other:?}"),
                None => {
                    let n = tokio::time::timeout(WITHIN, client.read_buf(&mut buf))
                        .await
                        .expect("ServerInfo in time")
                        .expect("read");
                    assert!(n > 0, "closed before ServerInfo");
                }
            }
        };
        hs.handle_server_info(&sealed).expect("server info");
        // Registered before ServerInfo was written. Its socket is known only if the
        // connection left hyper as the plain TCP stream it came as.
        let conns = shared.registry.summaries();
        assert_eq!(conns.len(), 1);
        assert!(
            conns[0].tcp_socket.is_some(),
            "the upgraded connection has no TCP socket"
        );
        drop(client);
        ends_in_time(serving).await;
    }

    /// A WebSocket upgrade request head, as hyper needs it to upgrade.
    fn websocket_head() -> Vec<u8> {
        b"GET /derp HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\n\
          Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            .to_vec()
    }

    /// `len` bytes that do not repeat with any short period, so that pieces out of order
    /// never compare equal.
    fn noise(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_add(seed).wrapping_mul(0x9E37_79B1) >> 24) as u8)
            .collect()
    }

    /// Serves `io` as [`serve_hyper`] does (the same builder and stream type) with a service
    /// that upgrades the first request, and returns what [`unwrap_upgraded`] makes of it.
    async fn upgraded_by_hyper(io: Rewind<Transport>) -> (Transport, BytesMut) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let on_upgrade = hyper::upgrade::on(&mut req);
            let tx = tx.lock().expect("lock").take();
            tokio::spawn(async move {
                let upgraded = on_upgrade.await.expect("upgraded");
                if let Some(tx) = tx {
                    let _ = tx.send(unwrap_upgraded(upgraded));
                }
            });
            let mut resp = Response::new(Body::default());
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            let h = resp.headers_mut();
            h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
            h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
            std::future::ready(Ok::<_, Infallible>(resp))
        });
        let conn = http1_builder(WITHIN)
            .serve_connection(HyperIo::new(io), service)
            .with_upgrades();
        let serving = tokio::spawn(conn);
        let upgraded = tokio::time::timeout(WITHIN, rx)
            .await
            .expect("upgraded in time")
            .expect("upgraded");
        serving.await.expect("no panic").expect("served");
        upgraded
    }

    /// Reads from `transport` onto `got` until it holds `len` bytes.
    async fn read_up_to(transport: &mut Transport, got: &mut BytesMut, len: usize) {
        while got.len() < len {
            let n = tokio::time::timeout(WITHIN, transport.read_buf(got))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(n > 0, "closed after {} of {len} bytes", got.len());
        }
    }

    #[tokio::test]
    async fn an_upgrade_through_hyper_comes_back_as_plain_tcp_with_every_byte_in_order() {
        let (mut client, stream, _) = connect(&listener().await).await;
        // Replayed bytes well past hyper's first read (8 KiB), so that at the upgrade hyper
        // holds some of them and the replay the rest; then more on the socket.
        let replayed = noise(20_000, 1);
        let on_socket = noise(5_000, 2);
        client.write_all(&on_socket).await.expect("write");
        let prefix = [websocket_head(), replayed.clone()].concat();
        let io = Rewind::new(prefix.into(), Transport::Tcp(stream));
        let (mut transport, mut got) = upgraded_by_hyper(io).await;
        assert!(
            matches!(transport, Transport::Tcp(_)),
            "came back as {transport:?}"
        );
        let head = read_head(&mut client, WITHIN).await;
        assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
        let want = [replayed, on_socket].concat();
        read_up_to(&mut transport, &mut got, want.len()).await;
        assert!(got[..] == want[..], "bytes lost or out of order");
    }

    /// A client and derpd's end of a TLS 1.3 connection on derpd's record layer.
    async fn tls_pair() -> (
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        Transport,
    ) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
        let der = cert.cert.der().clone();
        let private =
            rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], private)
            .expect("server config");
        // derpd's record layer takes the traffic keys over from rustls.
        server.enable_secret_extraction = true;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).expect("root");
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let listener = listener().await;
        let addr = listener.local_addr().expect("address");
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
        let (client, server) = tokio::join!(
            async {
                let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
                connector
                    .connect(name, tcp)
                    .await
                    .expect("client handshake")
            },
            async {
                let (tcp, _) = listener.accept().await.expect("accept");
                derp_io::tls::accept(tcp, Vec::new(), Arc::new(server))
                    .await
                    .expect("server handshake")
            }
        );
        (client, Transport::Tls(Box::new(server.stream)))
    }

    #[tokio::test]
    async fn an_upgrade_through_hyper_on_derpds_tls_records_comes_back_as_that_tls_stream() {
        let (mut client, server) = tls_pair().await;
        // The first bytes of the new protocol in the same write as the head, and more after.
        let sent_with_head = noise(3_000, 3);
        let after = noise(20_000, 4);
        client
            .write_all(&[websocket_head(), sent_with_head.clone()].concat())
            .await
            .expect("write");
        client.write_all(&after).await.expect("write");
        client.flush().await.expect("flush");
        let (mut transport, mut got) = upgraded_by_hyper(Rewind::new(Bytes::new(), server)).await;
        assert!(
            matches!(transport, Transport::Tls(_)),
            "came back as {transport:?}"
        );
        let want = [sent_with_head, after].concat();
        read_up_to(&mut transport, &mut got, want.len()).await;
        assert!(got[..] == want[..], "bytes lost or out of order");
        // And it still speaks TLS both ways.
        transport
            .write_all(b"after the upgrade")
            .await
            .expect("write");
        transport.flush().await.expect("flush");
        let mut answer = Vec::new();
        while !answer.ends_with(b"after the upgrade") {
            let n = tokio::time::timeout(WITHIN, client.read_buf(&mut answer))
                .await
                .expect("in time")
                .expect("read");
            assert!(n > 0, "closed");
        }
        assert!(answer.starts_with(b"HTTP/1.1 101"));
    }

    /// A GET of `path` whose head is `len` bytes long, padded by one header.
    fn padded_request(path: &str, len: usize, close: bool) -> Vec<u8> {
        let start = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n");
        let end = if close {
            "Connection: close\r\n\r\n"
        } else {
            "\r\n"
        };
        let pad = len - start.len() - end.len() - "X-Pad: \r\n".len();
        let mut out = start.into_bytes();
        out.extend_from_slice(b"X-Pad: ");
        out.resize(out.len() + pad, b'a');
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(end.as_bytes());
        assert_eq!(out.len(), len);
        out
    }

    /// What a head over the limit must get: 431 and a close, or a close alone (a reset can
    /// overtake the answer), but never an answer to the request.
    fn refused(answer: &[u8]) -> bool {
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 431")
    }

    /// Four times the limit: well within hyper's default buffer of about 400 KB, which
    /// would have taken it in whole and answered.
    const OVER_THE_LIMIT: usize = 4 * upgrade::MAX_HEAD_LEN;

    #[tokio::test]
    async fn a_keep_alive_request_gets_the_first_requests_head_limit() {
        let shared = test_state();
        let listener = listener().await;
        for (len, served) in [(upgrade::MAX_HEAD_LEN - 512, true), (OVER_THE_LIMIT, false)] {
            let (mut client, serving) = served_after_a_probe(&shared, &listener).await;
            let answer = answer_to(
                &mut client,
                &padded_request("/derp/probe", len, true),
                WITHIN,
            )
            .await;
            if served {
                assert!(answer.starts_with(b"HTTP/1.1 200"), "{len}: {answer:?}");
            } else {
                assert!(refused(&answer), "{len}: {answer:?}");
            }
            ends_in_time(serving).await;
        }
    }

    #[tokio::test]
    async fn the_metrics_listener_refuses_a_head_over_the_limit() {
        let shared = test_state();
        let listener = listener().await;
        for (len, served) in [(upgrade::MAX_HEAD_LEN - 512, true), (OVER_THE_LIMIT, false)] {
            let (mut client, stream, remote) = connect(&listener).await;
            let serving = tokio::spawn(serve_metrics_conn(shared.clone(), stream, remote));
            let answer =
                answer_to(&mut client, &padded_request("/healthz", len, true), WITHIN).await;
            if served {
                assert!(answer.starts_with(b"HTTP/1.1 200"), "{len}: {answer:?}");
            } else {
                assert!(refused(&answer), "{len}: {answer:?}");
            }
            ends_in_time(serving).await;
        }
    }

    #[test]
    fn every_forwarding_header_names_a_proxy() {
        for name in [
            "Forwarded",
            "Via",
            "X-Forwarded-For",
            "X-Forwarded-Host",
            "X-Forwarded-Proto",
            "X-Forwarded-Port",
            "X-Forwarded-Server",
            "X-Original-Forwarded-For",
            "X-Real-IP",
            "True-Client-IP",
            "X-Client-IP",
            "Client-IP",
            "CF-Connecting-IP",
            "CF-Connecting-IPv6",
            "Fastly-Client-IP",
            "X-Cluster-Client-IP",
            "X-Azure-ClientIP",
            "X-Azure-SocketIP",
            "X-Envoy-External-Address",
            "X-ProxyUser-IP",
        ] {
            // Header names reach the check lower-cased, whatever case the client sent.
            let parsed = header::HeaderName::from_bytes(name.as_bytes()).expect("valid name");
            assert!(names_a_proxy(parsed.as_str()), "{name}");
        }
        for name in [
            "host",
            "user-agent",
            "accept",
            "accept-encoding",
            "authorization",
            "connection",
            "x-prometheus-scrape-timeout-seconds",
        ] {
            assert!(!names_a_proxy(name), "{name}");
        }
    }

    #[test]
    fn challenge_rules_match_derper() {
        assert!(valid_challenge(b"input"));
        assert!(valid_challenge(b"host_name.example:1-2"));
        assert!(!valid_challenge(b"has space"));
        assert!(!valid_challenge(b"nul\0"));
        assert!(!valid_challenge(&[b'a'; 65]));
        assert!(valid_challenge(&[b'a'; 64]));
    }

    #[test]
    fn readiness_follows_the_embedder_then_drops_when_draining() {
        let config = crate::ServerConfig::new(derp_testkit::server_secret());
        let state = ServerState::new(config, &prometheus::Registry::new()).expect("state");
        let status = |s: &ServerState| readiness(s, &Method::GET).status();
        assert_eq!(status(&state), StatusCode::SERVICE_UNAVAILABLE);
        state
            .ready
            .store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(status(&state), StatusCode::OK);
        state.draining.cancel();
        assert_eq!(status(&state), StatusCode::SERVICE_UNAVAILABLE);
    }
}
