//! The HTTP upgrade heads, both sides: the relay reading a request, the client reading the
//! relay's answer.
//!
//! The rules are checked against a model written from docs/protocol.md and the reference
//! (derper's handler): headers are looked up by name without regard to case, the first one
//! wins, and values lose surrounding spaces and tabs (Go's textproto trims exactly those).
//! The model reads the head with httparse directly, so what is under test is derp-proto's
//! rules and its bookkeeping of head lengths, not httparse.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use derp_proto::upgrade::{
    self, DerpUpgrade, MAX_HEAD_LEN, MAX_REQUEST_HEADERS, NotUpgrade, Request, ResponseHead,
    UpgradeError, UpgradeKind,
};
use derp_proto::{PublicKey, ws};
use sha1::{Digest as _, Sha1};

use crate::Rng;

/// Most response headers `parse_response` reads (not public in derp-proto).
const MAX_RESPONSE_HEADERS: usize = 32;

/// Relay side. Input: `flags | bytes`.
///
/// - `flags & 0x80`: the bytes are a header list (`name:value` lines) for
///   [`upgrade::classify_headers`] with the method `flags & 3` picks (GET, POST, `get`,
///   FOO), checked against the model and against [`upgrade::classify_request`] on a head
///   built from the same method and lines.
/// - otherwise the bytes are what a client sent; `flags & 0x40` first inserts a padding
///   header after the first line so the head ends near [`MAX_HEAD_LEN`] (`flags & 0x3f`
///   moves it across the limit).
///
/// Checks: [`upgrade::request_head_len`] finds the blank line and never a head longer than
/// the limit; what it says of the bytes it says of every extension (a complete head keeps its
/// length, an error stays an error) and of every prefix (shorter than the head: incomplete);
/// [`upgrade::classify_request`] says `Other` whenever DERP is disabled and otherwise agrees
/// with the model: an upgrade only for a complete head on `/derp` or below (never a probe
/// path), by GET or POST (a WebSocket upgrade only by GET; methods are case-sensitive), with
/// an `Upgrade` of `derp` or `websocket`, the right kind, fast-start flag, not-ideal flag and
/// `Sec-WebSocket-Accept` value.
pub fn upgrade_request(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    if flags & 0x80 != 0 {
        header_list(["GET", "POST", "get", "FOO"][usize::from(flags & 3)], rest);
        return;
    }
    let padded;
    let buf = if flags & 0x40 != 0 {
        padded = pad_head(rest, usize::from(flags & 0x3f));
        &padded[..]
    } else {
        rest
    };
    let mut rng = Rng::new(buf);
    check_head_len(buf, upgrade::request_head_len, &mut rng);
    assert_eq!(
        upgrade::classify_request(buf, false),
        Request::Other,
        "an upgrade with DERP disabled"
    );
    let got = upgrade::classify_request(buf, true);
    assert_eq!(
        got,
        model_request(buf),
        "classify_request disagrees with the model"
    );
    if let Request::Upgrade(_) = got {
        // classify_request takes a head request_head_len already bounded; find its end here.
        let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
        let Ok(httparse::Status::Complete(n)) = httparse::Request::new(&mut headers).parse(buf)
        else {
            panic!("an upgrade from an incomplete head");
        };
        assert_eq!(
            upgrade::classify_request(&buf[..n], true),
            got,
            "bytes after the head changed the verdict"
        );
    }
}

/// Client side. Input: `key length | Sec-WebSocket-Key | response bytes`.
///
/// Checks: [`upgrade::parse_response`] has the same prefix and extension rules as the
/// request side, reports the status and length of the head (which ends in its blank line)
/// and the first `Sec-WebSocket-Accept`/`-Protocol` values, trimmed; bytes after the head do
/// not change it. [`upgrade::check_websocket_response`] accepts exactly an accept value equal
/// to the RFC 6455 hash of the key and a subprotocol of `derp` or none, and the relay's own
/// 101 heads for that key (WebSocket with and without the subprotocol, DERP) parse back and
/// pass it.
pub fn upgrade_response(data: &[u8]) {
    let (key, buf) = match data.split_first() {
        Some((&n, rest)) => rest.split_at(usize::from(n).min(rest.len())),
        None => (&[][..], data),
    };
    let key = String::from_utf8_lossy(key);
    let mut rng = Rng::new(buf);
    let parsed = upgrade::parse_response(buf);
    check_head_len(
        buf,
        |b| upgrade::parse_response(b).map(|h| h.map(|h| h.len)),
        &mut rng,
    );
    if let Ok(Some(head)) = &parsed {
        assert_eq!(
            Some(head),
            model_response(buf).as_ref(),
            "parse_response disagrees"
        );
        assert_eq!(
            upgrade::parse_response(&buf[..head.len]).as_ref(),
            Ok(&Some(head.clone())),
            "bytes after the head changed it"
        );
        let verdict = upgrade::check_websocket_response(head, &key);
        let want = if head.ws_accept.as_deref() != Some(rfc_accept(&key).as_str()) {
            Err(UpgradeError::BadAccept)
        } else if head
            .ws_protocol
            .as_deref()
            .is_some_and(|p| !p.eq_ignore_ascii_case("derp"))
        {
            Err(UpgradeError::BadSubprotocol)
        } else {
            Ok(())
        };
        assert_eq!(verdict, want, "check_websocket_response({head:?}, {key:?})");
    }

    // The relay's answers for this key pass the client's checks, whatever follows them.
    let accept = ws::accept_key(&key);
    assert_eq!(accept, rfc_accept(&key));
    for subprotocol in [true, false] {
        let mut answer = upgrade::websocket_response_head(&accept, subprotocol);
        let len = answer.len();
        answer.extend_from_slice(&buf[..buf.len().min(64)]);
        let head = upgrade::parse_response(&answer)
            .expect("the relay's WebSocket answer parses")
            .expect("the relay's WebSocket answer is complete");
        assert_eq!((head.status, head.len), (101, len));
        assert_eq!(head.ws_accept.as_deref(), Some(accept.as_str()));
        assert_eq!(head.ws_protocol.as_deref(), subprotocol.then_some("derp"));
        assert_eq!(upgrade::check_websocket_response(&head, &key), Ok(()));
    }
    let mut raw_key = [0u8; 32];
    for (dst, src) in raw_key.iter_mut().zip(buf) {
        *dst = *src;
    }
    let answer = upgrade::derp_response_head(&PublicKey::from_bytes(raw_key));
    let head = upgrade::parse_response(&answer)
        .expect("the relay's DERP answer parses")
        .expect("the relay's DERP answer is complete");
    assert_eq!((head.status, head.len), (101, answer.len()));
}

/// `classify_headers` on a header list; `classify_request` on a head made of the same method
/// and lines.
fn header_list(method: &str, data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let pairs: Vec<(&str, &str)> = text
        .split('\n')
        .filter_map(|line| line.split_once(':'))
        .collect();
    let lookup = |name: &str| {
        assert!(
            !name.bytes().any(|b| b.is_ascii_uppercase()),
            "classify_headers looked up {name:?}, which is not lower case"
        );
        pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    };
    let got = upgrade::classify_headers(method, lookup);
    let want = model_rules(method, |name| {
        pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Some(*v))
    });
    assert_eq!(
        got, want,
        "classify_headers disagrees with the model on {pairs:?}"
    );

    // The same headers in a request head, where httparse takes them as they are.
    let mut head = format!("{method} /derp HTTP/1.1\r\n").into_bytes();
    for (name, value) in &pairs {
        head.extend_from_slice(format!("{name}:{value}\r\n").as_bytes());
    }
    head.extend_from_slice(b"\r\n");
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = req.parse(&head) else {
        return;
    };
    // httparse trims values; only compare heads it took byte for byte.
    let same = req.headers.len() == pairs.len()
        && req
            .headers
            .iter()
            .zip(&pairs)
            .all(|(h, (n, v))| h.name == *n && h.value == v.as_bytes());
    if same {
        let via_head = upgrade::classify_request(&head, true);
        assert_eq!(via_head, want.map_or(Request::Other, Request::Upgrade));
    }
}

/// Inserts a padding header after the first line (or pads the end) so the head ends within
/// a few hundred bytes of [`MAX_HEAD_LEN`].
fn pad_head(bytes: &[u8], shift: usize) -> Vec<u8> {
    let pad_len = MAX_HEAD_LEN - 128 + shift * 4;
    let mut out = Vec::with_capacity(bytes.len() + pad_len + 16);
    match bytes.iter().position(|&b| b == b'\n') {
        Some(i) => {
            out.extend_from_slice(&bytes[..=i]);
            out.extend_from_slice(b"X-Pad: ");
            out.resize(out.len() + pad_len, b'a');
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(&bytes[i + 1..]);
        }
        None => {
            out.extend_from_slice(bytes);
            out.resize(out.len() + pad_len, b'a');
        }
    }
    out
}

/// Checks a head-length function against its prefixes and an extension of `buf`.
fn check_head_len(
    buf: &[u8],
    head_len: impl Fn(&[u8]) -> Result<Option<usize>, UpgradeError>,
    rng: &mut Rng,
) {
    let verdict = head_len(buf);
    // Prefixes to try: every one of a short input, a sample of a long one.
    let prefixes: Vec<usize> = if buf.len() <= 256 {
        (0..buf.len()).collect()
    } else {
        let mut v: Vec<usize> = (0..12).map(|_| rng.below_incl(buf.len()) - 1).collect();
        v.extend([
            buf.len() - 1,
            MAX_HEAD_LEN.min(buf.len() - 1),
            MAX_HEAD_LEN - 1,
        ]);
        v.retain(|&k| k < buf.len());
        v
    };
    let extended = [buf, b"\r\n\r\nGET / HTTP/1.1\r\n\r\n".as_slice()].concat();
    match verdict {
        Ok(Some(n)) => {
            assert!(n > 0 && n <= buf.len(), "head length {n} of {}", buf.len());
            assert_eq!(
                buf[n - 1],
                b'\n',
                "a head that does not end in a line break"
            );
            assert!(
                n <= MAX_HEAD_LEN,
                "a {n}-byte head was accepted; the limit is {MAX_HEAD_LEN}"
            );
            assert_eq!(head_len(&buf[..n]), Ok(Some(n)), "the head alone");
            assert_eq!(head_len(&extended), Ok(Some(n)), "the head with more bytes");
            for k in prefixes {
                let want = if k < n { Ok(None) } else { Ok(Some(n)) };
                assert_eq!(
                    head_len(&buf[..k]),
                    want,
                    "prefix of {k} bytes of a {n}-byte head"
                );
            }
        }
        Ok(None) => {
            assert!(
                buf.len() < MAX_HEAD_LEN,
                "waiting for more after {}",
                buf.len()
            );
            for k in prefixes {
                assert_eq!(head_len(&buf[..k]), Ok(None), "prefix of {k} bytes");
            }
        }
        Err(UpgradeError::HeadTooLong) => {
            assert!(buf.len() >= MAX_HEAD_LEN, "too long at {} bytes", buf.len());
            // Still refused, though more bytes may show it malformed as well.
            assert!(
                head_len(&extended).is_err(),
                "more bytes made a long head acceptable"
            );
            for k in prefixes.into_iter().filter(|&k| k < MAX_HEAD_LEN) {
                assert_eq!(head_len(&buf[..k]), Ok(None), "prefix of {k} bytes");
            }
        }
        Err(e @ (UpgradeError::Malformed | UpgradeError::TooManyHeaders)) => {
            assert_eq!(
                head_len(&extended),
                Err(e),
                "more bytes fixed a broken head"
            );
        }
        Err(e) => panic!("head length error {e:?}"),
    }
}

/// Go's textproto trims exactly spaces and tabs around a header value.
fn trim_ows(value: &str) -> &str {
    value.trim_matches([' ', '\t'])
}

/// `Sec-WebSocket-Accept` for a key, straight from RFC 6455 §4.2.2.
fn rfc_accept(key: &str) -> String {
    let mut hasher = Sha1::new();
    hasher.update(trim_ows(key).as_bytes());
    hasher.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    BASE64.encode(hasher.finalize())
}

/// The path of a request target: origin form, or absolute form with scheme and authority
/// removed; then without query or fragment.
fn model_path(target: &str) -> &str {
    let path = if target.starts_with('/') {
        target
    } else if let Some((_, rest)) = target.split_once("://") {
        rest.find('/').map_or("/", |i| &rest[i..])
    } else {
        target
    };
    path.split(['?', '#']).next().unwrap_or(path)
}

/// What a request head should be classified as, with DERP enabled.
fn model_request(buf: &[u8]) -> Request {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(buf), Ok(httparse::Status::Complete(_))) {
        return Request::Other;
    }
    let path = model_path(req.path.unwrap_or_default());
    let derp = path == "/derp" || path.starts_with("/derp/");
    let probe = path == "/derp/probe" || path == "/derp/latency-check";
    if !derp || probe {
        return Request::Other;
    }
    let rules = model_rules(req.method.unwrap_or_default(), |name| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| std::str::from_utf8(h.value).ok())
    });
    rules.map_or(Request::Other, Request::Upgrade)
}

/// The upgrade rules over a method and a header lookup. `find(name)` gives the first header
/// of that name: `None` if absent, `Some(None)` if its value is not UTF-8 (then treated as
/// absent). Only GET and POST open DERP, and only GET a WebSocket (RFC 6455 §4.1); the
/// method is judged before the headers.
fn model_rules<'a>(
    method: &str,
    find: impl Fn(&str) -> Option<Option<&'a str>>,
) -> Result<DerpUpgrade, NotUpgrade> {
    if method != "GET" && method != "POST" {
        return Err(NotUpgrade::MethodNotAllowed { allow: "GET, POST" });
    }
    let header = |name: &str| find(name).flatten().map(trim_ows);
    let Some(up) = header("upgrade").filter(|v| !v.is_empty()) else {
        return Err(NotUpgrade::Missing);
    };
    let not_ideal = header("ideal-node").is_some_and(|v| !v.is_empty());
    let protocols = header("sec-websocket-protocol");
    let websocket = up.eq_ignore_ascii_case("websocket");
    let kind = if websocket && protocols.is_some_and(|p| p.contains("derp")) {
        if method != "GET" {
            return Err(NotUpgrade::MethodNotAllowed { allow: "GET" });
        }
        let key = header("sec-websocket-key").ok_or(NotUpgrade::MissingWebSocketKey)?;
        UpgradeKind::WebSocket {
            accept: rfc_accept(key),
            derp_token: protocols.is_some_and(|p| p.split(',').any(|t| t.trim() == "derp")),
        }
    } else if websocket || up.eq_ignore_ascii_case("derp") {
        UpgradeKind::Derp {
            fast_start: header("derp-fast-start") == Some("1"),
        }
    } else {
        return Err(NotUpgrade::Unsupported(up.to_owned()));
    };
    Ok(DerpUpgrade { kind, not_ideal })
}

/// What `parse_response` should find in a response head it called complete.
fn model_response(buf: &[u8]) -> Option<ResponseHead> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let Ok(httparse::Status::Complete(len)) = resp.parse(buf) else {
        return None;
    };
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(|v| trim_ows(v).to_owned())
    };
    Some(ResponseHead {
        status: resp.code?,
        len,
        ws_accept: header("sec-websocket-accept"),
        ws_protocol: header("sec-websocket-protocol"),
    })
}
