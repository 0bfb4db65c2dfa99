//! The HTTP/1.1 upgrade request the client sends and the response head it reads back.

use bytes::{BufMut, BytesMut};

use crate::config::{ServerUrl, TransportKind};
use crate::error::ConnectError;

/// What goes into the request head besides the URL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestOptions<'a> {
    pub(crate) transport: TransportKind,
    pub(crate) fast_start: bool,
    pub(crate) ideal_node: Option<&'a str>,
    /// `Sec-WebSocket-Key`, for [`TransportKind::WebSocket`].
    pub(crate) ws_key: Option<&'a str>,
}

/// Appends the upgrade request head to `out`.
///
/// The header order follows Go's `net/http` client: `Host`, `User-Agent`, then the rest sorted
/// by name. `User-Agent` names this crate instead of `Go-http-client/1.1`; servers ignore it.
pub(crate) fn write_request(url: &ServerUrl, opts: &RequestOptions<'_>, out: &mut BytesMut) {
    out.put_slice(b"GET ");
    out.put_slice(url.path().as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    let mut line = |name: &str, value: &str| {
        out.put_slice(name.as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    };
    line("Host", &url.host_header());
    line("User-Agent", USER_AGENT);
    line("Connection", "Upgrade");
    if opts.fast_start {
        line("Derp-Fast-Start", "1");
    }
    if let Some(node) = opts.ideal_node.filter(|n| !n.is_empty()) {
        line("Ideal-Node", node);
    }
    match (opts.transport, opts.ws_key) {
        (TransportKind::WebSocket, Some(key)) => {
            line("Sec-Websocket-Key", key);
            line("Sec-Websocket-Protocol", "derp");
            line("Sec-Websocket-Version", "13");
            line("Upgrade", "websocket");
        }
        _ => line("Upgrade", "DERP"),
    }
    out.put_slice(b"\r\n");
}

/// Whether a header value can be sent without breaking the head (no CR, LF or other controls).
pub(crate) fn valid_header_value(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b == b'\t' || (b' '..0x7f).contains(&b))
}

/// The parts of a response head the client looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseHead {
    pub(crate) status: u16,
    /// Length of the head including the blank line; DERP bytes follow.
    pub(crate) len: usize,
    pub(crate) ws_accept: Option<String>,
    pub(crate) ws_protocol: Option<String>,
}

/// Parses a response head at the front of `buf`; `Ok(None)` if more bytes are needed.
pub(crate) fn parse_response(buf: &[u8]) -> Result<Option<ResponseHead>, ConnectError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_LEN => {
            return Err(ConnectError::BadResponse("response head too long"));
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ConnectError::BadResponse("too many response headers"));
        }
        Err(_) => return Err(ConnectError::BadResponse("not an http/1.1 response head")),
    };
    let status = resp
        .code
        .ok_or(ConnectError::BadResponse("missing status"))?;
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(|v| v.trim().to_owned())
    };
    Ok(Some(ResponseHead {
        status,
        len,
        ws_accept: header("Sec-WebSocket-Accept"),
        ws_protocol: header("Sec-WebSocket-Protocol"),
    }))
}

/// Sent instead of Go's `Go-http-client/1.1`.
const USER_AGENT: &str = concat!("derp-client/", env!("CARGO_PKG_VERSION"));
/// Cap on the response head; derper's 101 is under 200 bytes.
const MAX_HEAD_LEN: usize = 16 * 1024;
/// Cap on response header count.
const MAX_HEADERS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    fn request(url: &str, opts: RequestOptions<'_>) -> String {
        let url: ServerUrl = url.parse().unwrap();
        let mut out = BytesMut::new();
        write_request(&url, &opts, &mut out);
        String::from_utf8(out.to_vec()).unwrap()
    }

    const PLAIN: RequestOptions<'static> = RequestOptions {
        transport: TransportKind::Upgrade,
        fast_start: false,
        ideal_node: None,
        ws_key: None,
    };

    #[test]
    fn plain_request_matches_go_layout() {
        let got = request("http://127.0.0.1:23473/derp", PLAIN);
        let want = format!(
            "GET /derp HTTP/1.1\r\nHost: 127.0.0.1:23473\r\nUser-Agent: {USER_AGENT}\r\n\
             Connection: Upgrade\r\nUpgrade: DERP\r\n\r\n"
        );
        assert_eq!(got, want);
    }

    #[test]
    fn fast_start_ideal_node_and_websocket_headers() {
        let got = request(
            "http://h/x?y",
            RequestOptions {
                fast_start: true,
                ideal_node: Some("node-1"),
                ..PLAIN
            },
        );
        assert!(got.starts_with("GET /x?y HTTP/1.1\r\nHost: h\r\n"), "{got}");
        assert!(got.ends_with(
            "Connection: Upgrade\r\nDerp-Fast-Start: 1\r\nIdeal-Node: node-1\r\n\
             Upgrade: DERP\r\n\r\n"
        ));
        let got = request(
            "ws://h/derp",
            RequestOptions {
                transport: TransportKind::WebSocket,
                ws_key: Some("a2V5"),
                ..PLAIN
            },
        );
        assert!(got.ends_with(
            "Connection: Upgrade\r\nSec-Websocket-Key: a2V5\r\nSec-Websocket-Protocol: derp\r\n\
             Sec-Websocket-Version: 13\r\nUpgrade: websocket\r\n\r\n"
        ));
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
        let parsed = parse_response(&buf).unwrap().unwrap();
        assert_eq!(parsed.status, 101);
        assert_eq!(parsed.len, head.len());
        assert_eq!(parse_response(&buf[..head.len() - 1]).unwrap(), None);
    }

    #[test]
    fn refuses_garbage_and_endless_heads() {
        assert!(matches!(
            parse_response(b"\x01\x00\x00\x00(DERP\r\n\r\n"),
            Err(ConnectError::BadResponse(_))
        ));
        let endless = [b"HTTP/1.1 101 OK\r\n".as_slice(), &[b'a'; MAX_HEAD_LEN]].concat();
        assert!(matches!(
            parse_response(&endless),
            Err(ConnectError::BadResponse(_))
        ));
    }
}
