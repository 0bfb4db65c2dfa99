//! The HTTP/1.1 upgrade that opens a DERP connection, both sides, without IO.
//!
//! A DERP connection starts as an HTTP/1.1 request for `/derp` that asks to switch protocols,
//! either to DERP itself (`Upgrade: DERP`, optionally with `Derp-Fast-Start: 1`, in which
//! case the server writes no response head at all) or to WebSocket with the `derp`
//! subprotocol.
//!
//! Server side: [`request_head_len`] finds the end of a request head, [`classify_request`]
//! decides whether a complete head is a DERP upgrade, and [`classify_headers`] applies the
//! same rules to headers another HTTP parser already produced (so one set of rules serves
//! every path into the relay). [`derp_response_head`] and [`websocket_response_head`] build
//! the 101 answers byte for byte as derper writes them.
//!
//! Client side: [`write_request`] builds the request head, [`parse_response`] reads the
//! answer and [`check_websocket_response`] validates a WebSocket one.
//!
//! It does not read sockets, route other HTTP requests, or decide what a server does with a
//! request that is not an upgrade.

use bytes::BufMut;

use crate::frame::PROTOCOL_VERSION;
use crate::keys::PublicKey;
use crate::ws;

/// Longest request or response head accepted; derper's 101 is under 200 bytes and real
/// upgrade requests are well under 1 KiB.
pub const MAX_HEAD_LEN: usize = 16 * 1024;
/// Most request headers parsed (hyper's default limit).
pub const MAX_REQUEST_HEADERS: usize = 100;
/// Most response headers parsed.
const MAX_RESPONSE_HEADERS: usize = 32;

/// Why an upgrade head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UpgradeError {
    /// The head is longer than [`MAX_HEAD_LEN`].
    #[error("http head too long")]
    HeadTooLong,
    /// More headers than the parser takes.
    #[error("too many http headers")]
    TooManyHeaders,
    /// The bytes are not an HTTP/1.x head.
    #[error("not an http/1.1 head")]
    Malformed,
    /// A response head without a status code.
    #[error("missing status")]
    MissingStatus,
    /// The 101 response's `Sec-WebSocket-Accept` does not match the key sent.
    #[error("wrong Sec-WebSocket-Accept in upgrade response")]
    BadAccept,
    /// The server picked a WebSocket subprotocol other than `derp`.
    #[error("server selected a subprotocol other than derp")]
    BadSubprotocol,
}

impl From<httparse::Error> for UpgradeError {
    fn from(e: httparse::Error) -> Self {
        match e {
            httparse::Error::TooManyHeaders => Self::TooManyHeaders,
            _ => Self::Malformed,
        }
    }
}

/// A request the relay takes over as a DERP connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DerpUpgrade {
    /// Which of the two upgrade forms.
    pub kind: UpgradeKind,
    /// The request carried a non-empty `Ideal-Node` header: the client would rather be on
    /// another node of the region.
    pub not_ideal: bool,
}

/// The two ways to upgrade to DERP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpgradeKind {
    /// `Upgrade: DERP` (or, from very old clients, `Upgrade: WebSocket` without the `derp`
    /// subprotocol, which also means plain DERP).
    Derp {
        /// `Derp-Fast-Start: 1`: the client sends ClientInfo with the request and reads no
        /// response head, so the server must not write one.
        fast_start: bool,
    },
    /// WebSocket with a subprotocol header that mentions `derp`.
    WebSocket {
        /// The `Sec-WebSocket-Accept` value to answer with.
        accept: String,
        /// `derp` is one of the offered tokens. When it is only part of another token, derper
        /// completes the handshake without a subprotocol and closes with 1008; so does derpd.
        derp_token: bool,
    },
}

/// Why a request to `/derp` is not an upgrade.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotUpgrade {
    /// No `Upgrade` header at all.
    #[error("no Upgrade header")]
    Missing,
    /// An `Upgrade` header naming some other protocol.
    #[error("unsupported upgrade {0:?}")]
    Unsupported(String),
    /// A WebSocket upgrade without `Sec-WebSocket-Key`.
    #[error("missing Sec-WebSocket-Key")]
    MissingWebSocketKey,
    /// The method cannot open a DERP connection; the answer is 405 with this `Allow` value.
    #[error("method not allowed (allowed: {allow})")]
    MethodNotAllowed {
        /// The value of the `Allow` header.
        allow: &'static str,
    },
}

/// The methods that open a DERP connection, as an `Allow` header value. The Go client sends
/// GET; POST is accepted too because other clients send it and a body-less POST carries the
/// upgrade just as well. Methods are case-sensitive (RFC 9110 §9.1): `get` is not GET.
pub const DERP_METHODS: &str = "GET, POST";
/// The only method of a WebSocket opening handshake (RFC 6455 §4.1).
pub const WEBSOCKET_METHODS: &str = "GET";

/// What a complete request head asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// A DERP upgrade the relay takes over directly, keeping any bytes after the head.
    Upgrade(DerpUpgrade),
    /// Anything else (probes, the home page, a malformed `/derp` request): for a general HTTP
    /// server to answer.
    Other,
}

/// Finds the end of a request head at the front of `buf`: `Ok(Some(len))` once the blank line
/// has arrived, `Ok(None)` while more bytes are needed.
pub fn request_head_len(buf: &[u8]) -> Result<Option<usize>, UpgradeError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    head_len(req.parse(buf)?, buf.len())
}

/// Applies [`MAX_HEAD_LEN`] to a parse of `buffered` bytes. A complete head over the limit is
/// refused too: otherwise the same bytes would pass when they arrive in one read and fail
/// when they arrive in several.
fn head_len(
    status: httparse::Status<usize>,
    buffered: usize,
) -> Result<Option<usize>, UpgradeError> {
    match status {
        httparse::Status::Complete(n) if n > MAX_HEAD_LEN => Err(UpgradeError::HeadTooLong),
        httparse::Status::Complete(n) => Ok(Some(n)),
        httparse::Status::Partial if buffered >= MAX_HEAD_LEN => Err(UpgradeError::HeadTooLong),
        httparse::Status::Partial => Ok(None),
    }
}

/// Decides whether a complete request head is a DERP upgrade. `derp_enabled` false makes
/// every request [`Request::Other`] (the server then answers `/derp` with 404).
pub fn classify_request(head: &[u8], derp_enabled: bool) -> Request {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) {
        return Request::Other;
    }
    let Some(target) = req.path else {
        return Request::Other;
    };
    let path = request_path(target);
    if !derp_enabled || !is_derp_path(path) || is_probe_path(path) {
        return Request::Other;
    }
    let Some(method) = req.method else {
        return Request::Other;
    };
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
    };
    match classify_headers(method, header) {
        Ok(upgrade) => Request::Upgrade(upgrade),
        Err(_) => Request::Other,
    }
}

/// The upgrade rules for a `/derp` request, over its method and a header lookup (`name` is
/// lower case; the lookup must match names case-insensitively). Shared by
/// [`classify_request`] and servers that parsed the head with another HTTP library.
///
/// The method is checked first: anything but GET or POST is refused whatever the headers
/// say, and a WebSocket upgrade must be a GET.
pub fn classify_headers<'h>(
    method: &str,
    header: impl Fn(&str) -> Option<&'h str>,
) -> Result<DerpUpgrade, NotUpgrade> {
    if method != "GET" && method != "POST" {
        return Err(NotUpgrade::MethodNotAllowed {
            allow: DERP_METHODS,
        });
    }
    let header = |name| header(name).map(trim_value);
    let upgrade = header("upgrade").ok_or(NotUpgrade::Missing)?;
    let not_ideal = header("ideal-node").is_some_and(|v| !v.is_empty());
    let protocols = header("sec-websocket-protocol");
    let kind = if upgrade.eq_ignore_ascii_case("websocket")
        && protocols.is_some_and(ws::wants_derp_subprotocol)
    {
        if method != "GET" {
            return Err(NotUpgrade::MethodNotAllowed {
                allow: WEBSOCKET_METHODS,
            });
        }
        let key = header("sec-websocket-key").ok_or(NotUpgrade::MissingWebSocketKey)?;
        UpgradeKind::WebSocket {
            accept: ws::accept_key(key),
            derp_token: protocols.is_some_and(ws::offers_derp_token),
        }
    } else if upgrade.eq_ignore_ascii_case("derp") || upgrade.eq_ignore_ascii_case("websocket") {
        // Very old clients sent `Upgrade: WebSocket` but spoke plain DERP.
        UpgradeKind::Derp {
            fast_start: header("derp-fast-start") == Some("1"),
        }
    } else if upgrade.is_empty() {
        return Err(NotUpgrade::Missing);
    } else {
        return Err(NotUpgrade::Unsupported(upgrade.to_owned()));
    };
    Ok(DerpUpgrade { kind, not_ideal })
}

/// A header value without surrounding spaces and tabs, which is all Go's textproto trims (so
/// `Upgrade: \u{a0}DERP` is no upgrade, as for derper). Not `str::trim`, which also takes
/// Unicode spaces and control characters.
fn trim_value(value: &str) -> &str {
    value.trim_matches([' ', '\t'])
}

/// The path of a request target, for both origin form (`/derp?x`) and absolute form
/// (`http://host/derp`), which some clients send.
pub fn request_path(target: &str) -> &str {
    let target = match target.find("://") {
        Some(i) if !target.starts_with('/') => {
            let rest = &target[i + 3..];
            rest.find('/').map_or("/", |j| &rest[j..])
        }
        _ => target,
    };
    target.split(['?', '#']).next().unwrap_or("/")
}

/// Whether a path is served by the DERP handler (`/derp` and everything below it).
pub fn is_derp_path(path: &str) -> bool {
    path == "/derp" || path.starts_with("/derp/")
}

/// Whether a path is one of the probe endpoints, which are under `/derp` but never upgrade.
pub fn is_probe_path(path: &str) -> bool {
    path == "/derp/probe" || path == "/derp/latency-check"
}

/// The 101 response to `Upgrade: DERP`, byte for byte as derper writes it.
pub fn derp_response_head(server_key: &PublicKey) -> Vec<u8> {
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\
         Derp-Version: {PROTOCOL_VERSION}\r\nDerp-Public-Key: {}\r\n\r\n",
        server_key.to_untyped_hex()
    )
    .into_bytes()
}

/// The 101 response head that completes a WebSocket handshake, ending with the blank line.
///
/// Header order and spelling follow what derper sends (Go canonicalises names to
/// `Sec-Websocket-*`); its `Date` header is left out because clients ignore it. Without
/// `subprotocol` the handshake completes with no subprotocol, for a client that is then
/// closed with 1008 (see [`UpgradeKind::WebSocket`]).
pub fn websocket_response_head(accept: &str, subprotocol: bool) -> Vec<u8> {
    let protocol = if subprotocol {
        "Sec-Websocket-Protocol: derp\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 101 Switching Protocols\r\n\
         Connection: Upgrade\r\n\
         Sec-Websocket-Accept: {accept}\r\n\
         {protocol}\
         Upgrade: websocket\r\n\
         \r\n"
    )
    .into_bytes()
}

/// What goes into a client's upgrade request.
#[derive(Debug, Clone, Copy)]
pub struct RequestOptions<'a> {
    /// Request target, such as `/derp`.
    pub path: &'a str,
    /// `Host` header value.
    pub host: &'a str,
    /// `User-Agent` header value.
    pub user_agent: &'a str,
    /// Send `Derp-Fast-Start: 1` (the caller then sends ClientInfo right after the head).
    pub fast_start: bool,
    /// `Ideal-Node` header, when not empty.
    pub ideal_node: Option<&'a str>,
    /// `Sec-WebSocket-Key` for a WebSocket upgrade; `None` asks for `Upgrade: DERP`.
    pub websocket_key: Option<&'a str>,
}

/// Appends a client's upgrade request head to `out`.
///
/// The header order follows Go's `net/http` client: `Host`, `User-Agent`, then the rest sorted
/// by name. Callers check values with [`valid_header_value`] first.
pub fn write_request(opts: &RequestOptions<'_>, out: &mut impl BufMut) {
    out.put_slice(b"GET ");
    out.put_slice(opts.path.as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    let mut line = |name: &str, value: &str| {
        out.put_slice(name.as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    };
    line("Host", opts.host);
    line("User-Agent", opts.user_agent);
    line("Connection", "Upgrade");
    if opts.fast_start {
        line("Derp-Fast-Start", "1");
    }
    if let Some(node) = opts.ideal_node.filter(|n| !n.is_empty()) {
        line("Ideal-Node", node);
    }
    match opts.websocket_key {
        Some(key) => {
            line("Sec-Websocket-Key", key);
            line("Sec-Websocket-Protocol", "derp");
            line("Sec-Websocket-Version", "13");
            line("Upgrade", "websocket");
        }
        None => line("Upgrade", "DERP"),
    }
    out.put_slice(b"\r\n");
}

/// Whether a header value can be sent without breaking the head (no CR, LF or other controls).
pub fn valid_header_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (b' '..0x7f).contains(&b))
}

/// The parts of a response head a client looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// The status code.
    pub status: u16,
    /// Length of the head including the blank line; DERP bytes follow.
    pub len: usize,
    /// `Sec-WebSocket-Accept`, trimmed.
    pub ws_accept: Option<String>,
    /// `Sec-WebSocket-Protocol`, trimmed.
    pub ws_protocol: Option<String>,
}

/// Parses a response head at the front of `buf`; `Ok(None)` if more bytes are needed.
pub fn parse_response(buf: &[u8]) -> Result<Option<ResponseHead>, UpgradeError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let Some(len) = head_len(resp.parse(buf)?, buf.len())? else {
        return Ok(None);
    };
    let status = resp.code.ok_or(UpgradeError::MissingStatus)?;
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(|v| trim_value(v).to_owned())
    };
    Ok(Some(ResponseHead {
        status,
        len,
        ws_accept: header("Sec-WebSocket-Accept"),
        ws_protocol: header("Sec-WebSocket-Protocol"),
    }))
}

/// Checks a WebSocket 101 response against the key the client sent: the accept value must
/// match, and the server may pick `derp` or no subprotocol, but not another one.
pub fn check_websocket_response(head: &ResponseHead, key: &str) -> Result<(), UpgradeError> {
    if head.ws_accept.as_deref() != Some(ws::accept_key(key).as_str()) {
        return Err(UpgradeError::BadAccept);
    }
    if head
        .ws_protocol
        .as_deref()
        .is_some_and(|p| !p.eq_ignore_ascii_case("derp"))
    {
        return Err(UpgradeError::BadSubprotocol);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(head: &str) -> Request {
        classify_request(head.as_bytes(), true)
    }

    fn derp(fast_start: bool, not_ideal: bool) -> Request {
        Request::Upgrade(DerpUpgrade {
            kind: UpgradeKind::Derp { fast_start },
            not_ideal,
        })
    }

    #[test]
    fn request_path_handles_origin_and_absolute_form() {
        assert_eq!(request_path("/derp"), "/derp");
        assert_eq!(request_path("/derp?x=1"), "/derp");
        assert_eq!(request_path("http://example.com/derp"), "/derp");
        assert_eq!(request_path("https://example.com:8443/derp?q"), "/derp");
        assert_eq!(request_path("http://example.com"), "/");
    }

    #[test]
    fn derp_upgrades_are_recognised() {
        assert_eq!(
            classify("GET /derp HTTP/1.1\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\r\n"),
            derp(false, false)
        );
        assert_eq!(
            classify(
                "GET /derp HTTP/1.1\r\nupgrade: derp\r\nDerp-Fast-Start: 1\r\n\
                 Ideal-Node: n2\r\n\r\n"
            ),
            derp(true, true)
        );
        // Old clients: WebSocket without the derp subprotocol means plain DERP.
        assert_eq!(
            classify("GET /derp HTTP/1.1\r\nUpgrade: WebSocket\r\n\r\n"),
            derp(false, false)
        );
    }

    #[test]
    fn websocket_upgrades_carry_the_accept_key_and_token_check() {
        let head = "GET /derp HTTP/1.1\r\nUpgrade: websocket\r\n\
                    Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
                    Sec-WebSocket-Protocol: derp\r\n\r\n";
        assert_eq!(
            classify(head),
            Request::Upgrade(DerpUpgrade {
                kind: UpgradeKind::WebSocket {
                    accept: "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=".into(),
                    derp_token: true,
                },
                not_ideal: false,
            })
        );
        let substring = head.replace("Protocol: derp", "Protocol: notderp");
        assert!(matches!(
            classify(&substring),
            Request::Upgrade(DerpUpgrade {
                kind: UpgradeKind::WebSocket {
                    derp_token: false,
                    ..
                },
                ..
            })
        ));
    }

    #[test]
    fn everything_else_is_for_the_http_server() {
        for head in [
            "GET /derp HTTP/1.1\r\n\r\n",
            "GET /derp HTTP/1.1\r\nUpgrade: h2c\r\n\r\n",
            "GET /derp/probe HTTP/1.1\r\nUpgrade: DERP\r\n\r\n",
            "GET / HTTP/1.1\r\nUpgrade: DERP\r\n\r\n",
            "GET /derpx HTTP/1.1\r\nUpgrade: DERP\r\n\r\n",
            // WebSocket without a key: the HTTP server answers 400.
            "GET /derp HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Protocol: derp\r\n\r\n",
            "GET /derp HTTP/1.1\r\nUpgrade: DERP\r\n",
            "\x01\x02garbage\r\n\r\n",
        ] {
            assert_eq!(classify(head), Request::Other, "{head:?}");
        }
        let up = "GET /derp HTTP/1.1\r\nUpgrade: DERP\r\n\r\n";
        assert_eq!(classify_request(up.as_bytes(), false), Request::Other);
    }

    /// Only spaces and tabs around a value are ignored, as in Go's textproto (found by the
    /// upgrade_request fuzz target: `str::trim` also dropped U+00A0 and CR).
    #[test]
    fn header_values_lose_spaces_and_tabs_only() {
        assert_eq!(
            classify("GET /derp HTTP/1.1\r\nUpgrade: \t DERP \r\nDerp-Fast-Start:  1\t\r\n\r\n"),
            derp(true, false)
        );
        assert_eq!(
            classify("GET /derp HTTP/1.1\r\nUpgrade: \u{a0}DERP\r\n\r\n"),
            Request::Other
        );
        assert_eq!(
            classify("GET /derp HTTP/1.1\r\nUpgrade: DERP\r\nDerp-Fast-Start: 1\u{a0}\r\n\r\n"),
            derp(false, false)
        );
        let cr = |n: &str| (n == "upgrade").then_some("DERP\r");
        assert_eq!(
            classify_headers("GET", cr),
            Err(NotUpgrade::Unsupported("DERP\r".into()))
        );
        let head = "HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: \tabc \r\n\
                    Sec-WebSocket-Protocol: derp\u{a0}\r\n\r\n";
        let parsed = parse_response(head.as_bytes())
            .expect("valid")
            .expect("complete");
        assert_eq!(parsed.ws_accept.as_deref(), Some("abc"));
        assert_eq!(parsed.ws_protocol.as_deref(), Some("derp\u{a0}"));
    }

    #[test]
    fn header_rules_report_why() {
        let none = |_: &str| None;
        assert_eq!(classify_headers("GET", none), Err(NotUpgrade::Missing));
        let h2c = |n: &str| (n == "upgrade").then_some("h2c");
        assert_eq!(
            classify_headers("GET", h2c),
            Err(NotUpgrade::Unsupported("h2c".into()))
        );
        let ws = |n: &str| match n {
            "upgrade" => Some("websocket"),
            "sec-websocket-protocol" => Some("derp"),
            _ => None,
        };
        assert_eq!(
            classify_headers("GET", ws),
            Err(NotUpgrade::MissingWebSocketKey)
        );
    }

    #[test]
    fn only_get_and_post_open_derp_and_only_get_opens_websocket() {
        let derp_up = |n: &str| (n == "upgrade").then_some("DERP");
        let ws_up = |n: &str| match n {
            "upgrade" => Some("websocket"),
            "sec-websocket-protocol" => Some("derp"),
            "sec-websocket-key" => Some("dGhlIHNhbXBsZSBub25jZQ=="),
            _ => None,
        };
        for method in ["GET", "POST"] {
            assert!(classify_headers(method, derp_up).is_ok(), "{method}");
        }
        assert!(classify_headers("GET", ws_up).is_ok());
        assert_eq!(
            classify_headers("POST", ws_up),
            Err(NotUpgrade::MethodNotAllowed { allow: "GET" })
        );
        let refused = Err(NotUpgrade::MethodNotAllowed { allow: "GET, POST" });
        for method in [
            "FOO", "CONNECT", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "get", "Get",
            "post", "GET ",
        ] {
            assert_eq!(classify_headers(method, derp_up), refused, "{method}");
            assert_eq!(classify_headers(method, ws_up), refused, "{method}");
            // Refused before the headers are looked at, so even no Upgrade gets the 405.
            assert_eq!(classify_headers(method, |_| None), refused, "{method}");
        }
        // The fast path leaves every one of them to the HTTP server, which answers 405.
        for method in ["FOO", "CONNECT", "get", "HEAD"] {
            let head = format!("{method} /derp HTTP/1.1\r\nUpgrade: DERP\r\n\r\n");
            assert_eq!(classify(&head), Request::Other, "{method}");
        }
        let ws_head = "POST /derp HTTP/1.1\r\nUpgrade: websocket\r\n\
                       Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
                       Sec-WebSocket-Protocol: derp\r\n\r\n";
        assert_eq!(classify(ws_head), Request::Other);
        assert_eq!(
            classify("POST /derp HTTP/1.1\r\nUpgrade: DERP\r\n\r\n"),
            derp(false, false)
        );
    }

    #[test]
    fn head_length_is_found_and_bounded() {
        let head = b"GET /derp HTTP/1.1\r\nUpgrade: DERP\r\n\r\n";
        let mut buf = head.to_vec();
        buf.extend_from_slice(&[2, 0, 0, 0, 9]);
        assert_eq!(request_head_len(&buf), Ok(Some(head.len())));
        assert_eq!(request_head_len(&head[..head.len() - 1]), Ok(None));
        assert_eq!(
            request_head_len(b"\x16\x03\x01\x02\x00"),
            Err(UpgradeError::Malformed)
        );
        let endless = [b"GET / HTTP/1.1\r\nX: ".as_slice(), &[b'a'; MAX_HEAD_LEN]].concat();
        assert_eq!(request_head_len(&endless), Err(UpgradeError::HeadTooLong));
    }

    /// A head is refused over the limit whether it arrives in one piece or in many (found by
    /// the upgrade_request fuzz target: a complete 16.5 KiB head in one buffer was accepted).
    #[test]
    fn head_limit_holds_for_complete_heads() {
        let head_of = |len: usize| {
            let start = b"GET /derp HTTP/1.1\r\nX-Pad: ";
            let end = b"\r\nUpgrade: DERP\r\n\r\n";
            let pad = len - start.len() - end.len();
            [start.as_slice(), &vec![b'a'; pad], end].concat()
        };
        let at_limit = head_of(MAX_HEAD_LEN);
        assert_eq!(request_head_len(&at_limit), Ok(Some(MAX_HEAD_LEN)));
        let over = head_of(MAX_HEAD_LEN + 1);
        assert_eq!(request_head_len(&over), Err(UpgradeError::HeadTooLong));
        assert_eq!(
            request_head_len(&over[..MAX_HEAD_LEN]),
            Err(UpgradeError::HeadTooLong)
        );

        let response = |len: usize| {
            let start = b"HTTP/1.1 101 Switching Protocols\r\nX-Pad: ";
            let pad = len - start.len() - 4;
            [start.as_slice(), &vec![b'a'; pad], b"\r\n\r\n"].concat()
        };
        let at_limit = response(MAX_HEAD_LEN);
        assert_eq!(
            parse_response(&at_limit).map(|h| h.map(|h| h.len)),
            Ok(Some(MAX_HEAD_LEN))
        );
        assert_eq!(
            parse_response(&response(MAX_HEAD_LEN + 1)),
            Err(UpgradeError::HeadTooLong)
        );
    }

    #[test]
    fn derp_response_head_matches_derper() {
        let key = PublicKey::from_bytes([0xab; 32]);
        let head = String::from_utf8(derp_response_head(&key)).expect("utf8");
        assert_eq!(
            head,
            format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\
                 Derp-Version: 2\r\nDerp-Public-Key: {}\r\n\r\n",
                "ab".repeat(32)
            )
        );
    }

    fn request(opts: RequestOptions<'_>) -> String {
        let mut out = Vec::new();
        write_request(&opts, &mut out);
        String::from_utf8(out).expect("utf8")
    }

    const PLAIN: RequestOptions<'static> = RequestOptions {
        path: "/derp",
        host: "127.0.0.1:23473",
        user_agent: "ua/1",
        fast_start: false,
        ideal_node: None,
        websocket_key: None,
    };

    #[test]
    fn plain_request_matches_go_layout() {
        assert_eq!(
            request(PLAIN),
            "GET /derp HTTP/1.1\r\nHost: 127.0.0.1:23473\r\nUser-Agent: ua/1\r\n\
             Connection: Upgrade\r\nUpgrade: DERP\r\n\r\n"
        );
    }

    #[test]
    fn fast_start_ideal_node_and_websocket_headers() {
        let got = request(RequestOptions {
            fast_start: true,
            ideal_node: Some("node-1"),
            ..PLAIN
        });
        assert!(got.ends_with(
            "Connection: Upgrade\r\nDerp-Fast-Start: 1\r\nIdeal-Node: node-1\r\n\
             Upgrade: DERP\r\n\r\n"
        ));
        let got = request(RequestOptions {
            websocket_key: Some("a2V5"),
            ..PLAIN
        });
        assert!(got.ends_with(
            "Connection: Upgrade\r\nSec-Websocket-Key: a2V5\r\nSec-Websocket-Protocol: derp\r\n\
             Sec-Websocket-Version: 13\r\nUpgrade: websocket\r\n\r\n"
        ));
        // The client's own request is a DERP upgrade to the server's rules.
        assert_eq!(
            classify_request(request(PLAIN).as_bytes(), true),
            derp(false, false)
        );
    }

    #[test]
    fn header_values_with_line_breaks_are_refused() {
        assert!(valid_header_value("node 1\t"));
        assert!(!valid_header_value("a\r\nX-Evil: 1"));
        assert!(!valid_header_value("a\u{7f}"));
        assert!(!valid_header_value("é"));
    }

    #[test]
    fn parses_recorded_response_and_keeps_trailing_bytes() {
        let head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\
                     Derp-Version: 2\r\n\r\n";
        let mut buf = head.to_vec();
        buf.extend_from_slice(&[1, 0, 0, 0, 40]);
        let parsed = parse_response(&buf).expect("valid").expect("complete");
        assert_eq!(parsed.status, 101);
        assert_eq!(parsed.len, head.len());
        assert_eq!(parse_response(&buf[..head.len() - 1]), Ok(None));
    }

    #[test]
    fn refuses_garbage_and_endless_responses() {
        assert_eq!(
            parse_response(b"\x01\x00\x00\x00(DERP\r\n\r\n"),
            Err(UpgradeError::Malformed)
        );
        let endless = [b"HTTP/1.1 101 OK\r\n".as_slice(), &[b'a'; MAX_HEAD_LEN]].concat();
        assert_eq!(parse_response(&endless), Err(UpgradeError::HeadTooLong));
    }

    #[test]
    fn websocket_responses_are_checked_against_the_key() {
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let head = |accept: &str, protocol: Option<&str>| ResponseHead {
            status: 101,
            len: 0,
            ws_accept: Some(accept.into()),
            ws_protocol: protocol.map(Into::into),
        };
        let good = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";
        assert_eq!(
            check_websocket_response(&head(good, Some("derp")), key),
            Ok(())
        );
        assert_eq!(check_websocket_response(&head(good, None), key), Ok(()));
        assert_eq!(
            check_websocket_response(&head("nope", Some("derp")), key),
            Err(UpgradeError::BadAccept)
        );
        assert_eq!(
            check_websocket_response(&head(good, Some("chat")), key),
            Err(UpgradeError::BadSubprotocol)
        );
        // The server's own answer passes the client's check.
        let answer = websocket_response_head(&ws::accept_key(key), true);
        let parsed = parse_response(&answer).expect("valid").expect("complete");
        assert_eq!(check_websocket_response(&parsed, key), Ok(()));
    }
}
