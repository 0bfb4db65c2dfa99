//! The WebSocket decoder, for each end of the connection, fed in arbitrary chunks.
//!
//! Input: `flags | chunk seed | body`. `(flags >> 1) & 3` picks the largest chunk (1, 3, 17
//! or 4096 bytes; more for streams over 2 KiB, so they are cut into at most about 2048
//! chunks). `flags & 1` picks what the body is:
//!
//! 0. raw bytes from the peer. They are decoded whole, again cut into chunks, and by a model
//!    written from RFC 6455 and the error list in derp-proto's `ws` docs; all three must give
//!    the same payload bytes, pings, end (waiting, closed with a code, or an error) and number
//!    of bytes consumed.
//! 1. a program for the encoders: binary messages (whole, or fragmented with pings between
//!    the fragments), pings, pongs and a close, built with `write_masked_frame`, `write_header`,
//!    `binary_header`, `control_frame`, `close_frame` and `close_frame_with_reason` as each end
//!    would send them. The stream must decode, at any chunking, to exactly the payloads and
//!    pings put in, end at the close, and leave whatever follows the close unread.
//!
//! Always: payload bytes out never outnumber the bytes consumed; after `NeedMore` what is
//! left is shorter than a header plus a control frame; an error or a close is final (later
//! calls return it again and neither consume nor produce anything). The chunked run hands the
//! stream to a new decoder at every chunk: one resumed from the last one's snapshot, passed
//! through its encoding, so a snapshot taken anywhere must carry everything that matters.

use bytes::{Bytes, BytesMut};
use derp_proto::ws::{
    self, MAX_FRAME_PAYLOAD, Opcode, Role, WsDecoder, WsError, WsEvent, WsSnapshot,
};

use crate::Rng;

/// Server side: decodes what a client sends (masked frames, size limit).
pub fn ws_server(data: &[u8]) {
    ws(Role::Server, data);
}

/// Client side: decodes what a server sends.
pub fn ws_client(data: &[u8]) {
    ws(Role::Client, data);
}

/// A snapshot's encoding, then a stream for the decoder resumed from it.
///
/// Input: `n | snapshot bytes (n of them, or what there is) | stream`. Whatever the bytes,
/// decoding the snapshot returns an error or a snapshot that re-encodes to exactly those
/// bytes and resumes a decoder, whose own snapshot is the same; that decoder then takes the
/// stream under the invariants of [`ws_server`] (never more payload out than bytes in, a
/// close or an error is final).
pub fn ws_snapshot(data: &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (encoded, stream) = rest.split_at(usize::from(n).min(rest.len()));
    let Ok(snapshot) = WsSnapshot::decode(encoded) else {
        return;
    };
    let mut again = Vec::new();
    snapshot.encode(&mut again);
    assert_eq!(again, encoded, "a decoded snapshot re-encodes differently");
    let decoder = WsDecoder::resume(snapshot).expect("a decoded snapshot resumes");
    assert_eq!(decoder.snapshot(), Ok(snapshot), "resumed to another state");
    let mut input = BytesMut::from(stream);
    let mut out = BytesMut::new();
    let mut decoder = decoder;
    let end = loop {
        let (in_before, out_before) = (input.len(), out.len());
        let event = decoder.decode(&mut input, &mut out);
        assert!(
            out.len() - out_before <= in_before - input.len(),
            "more payload than input"
        );
        match event {
            Ok(WsEvent::Ping(_)) => {}
            Ok(WsEvent::NeedMore) => return,
            Ok(WsEvent::Close { code }) => break Ok(WsEvent::Close { code }),
            Err(e) => break Err(e),
        }
    };
    let (in_len, out_len) = (input.len(), out.len());
    input.extend_from_slice(&ws::control_frame(Opcode::Ping, b"p"));
    assert_eq!(
        decoder.decode(&mut input, &mut out),
        end,
        "the end is not final"
    );
    assert_eq!(out.len(), out_len, "a finished decoder produced bytes");
    assert_eq!(input.len(), in_len + 3, "a finished decoder consumed bytes");
}

/// Longest a control frame can be (2-byte header, mask, 125-byte payload); anything the
/// decoder leaves unconsumed is shorter.
const MAX_CONTROL_FRAME: usize = 2 + 4 + 125;

fn ws(role: Role, data: &[u8]) {
    let (flags, seed, body) = match data {
        [flags, seed, body @ ..] => (*flags, *seed, body),
        [flags] => (*flags, 0, &[][..]),
        [] => return,
    };
    let max_chunk = [1, 3, 17, 4096][usize::from((flags >> 1) & 3)];
    let mut rng = Rng::new(&[seed, flags]);
    let (stream, expected) = if flags & 1 == 0 {
        (body.to_vec(), model(role, body))
    } else {
        program(role, body, &mut rng)
    };
    let mut whole = run(role, &stream, false, || stream.len());
    assert_eq!(whole.outcome, expected, "decoded whole vs expected");
    // At most about 2048 chunks, so long frames stay cheap to cut up.
    let max_chunk = max_chunk.max(stream.len() / 1024);
    let mut chunked = run(role, &stream, true, || rng.below_incl(max_chunk));
    assert_eq!(chunked.outcome, expected, "decoded in chunks vs expected");
    check_final(role, &mut whole);
    check_final(role, &mut chunked);
}

/// How decoding ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// Input ran out; the decoder waits for more.
    NeedMore,
    Closed(Option<u16>),
    Failed(WsError),
}

#[derive(Debug, PartialEq)]
struct Outcome {
    out: Vec<u8>,
    pings: Vec<Bytes>,
    end: End,
    consumed: usize,
}

struct Run {
    outcome: Outcome,
    decoder: WsDecoder,
    input: BytesMut,
    out: BytesMut,
}

/// Feeds `stream` in chunks of `next_chunk()` bytes, decoding after each until the decoder
/// wants more, then (when `resume` is set) carrying on with a decoder resumed from its
/// snapshot; stops at a close or an error.
fn run(role: Role, stream: &[u8], resume: bool, mut next_chunk: impl FnMut() -> usize) -> Run {
    let mut decoder = WsDecoder::new(role);
    let mut input = BytesMut::new();
    let mut out = BytesMut::new();
    let mut pings = Vec::new();
    let mut fed = 0;
    let end = 'feed: loop {
        loop {
            let (in_before, out_before) = (input.len(), out.len());
            let event = decoder.decode(&mut input, &mut out);
            assert!(input.len() <= in_before, "decode grew its input");
            assert!(
                out.len() - out_before <= in_before - input.len(),
                "{} payload bytes out of {} consumed",
                out.len() - out_before,
                in_before - input.len()
            );
            match event {
                Ok(WsEvent::NeedMore) => {
                    assert!(
                        input.len() < MAX_CONTROL_FRAME,
                        "NeedMore with {} bytes unread",
                        input.len()
                    );
                    break;
                }
                Ok(WsEvent::Ping(payload)) => {
                    assert!(payload.len() <= 125, "ping of {} bytes", payload.len());
                    pings.push(payload);
                }
                Ok(WsEvent::Close { code }) => break 'feed End::Closed(code),
                Err(e) => break 'feed End::Failed(e),
            }
        }
        if fed == stream.len() {
            break End::NeedMore;
        }
        if resume {
            decoder = resumed(&decoder);
        }
        let n = next_chunk().clamp(1, stream.len() - fed);
        input.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
    };
    let consumed = fed - input.len();
    assert!(out.len() <= consumed, "more payload than input");
    Run {
        outcome: Outcome {
            out: out.to_vec(),
            pings,
            end,
            consumed,
        },
        decoder,
        input,
        out,
    }
}

/// A decoder continuing from `decoder`'s snapshot, after an encode and decode of it.
fn resumed(decoder: &WsDecoder) -> WsDecoder {
    let snapshot = decoder
        .snapshot()
        .expect("a decoder waiting for input has a snapshot");
    let mut encoded = Vec::new();
    snapshot.encode(&mut encoded);
    assert_eq!(encoded.len(), snapshot.encoded_len());
    let decoded = WsSnapshot::decode(&encoded).expect("an encoded snapshot decodes");
    assert_eq!(decoded, snapshot);
    WsDecoder::resume(decoded).expect("a decoder's own snapshot resumes")
}

/// A closed or failed decoder stays so, whatever arrives next, and touches nothing.
fn check_final(role: Role, run: &mut Run) {
    let want = match run.outcome.end {
        End::NeedMore => return,
        End::Closed(code) => Ok(WsEvent::Close { code }),
        End::Failed(e) => Err(e),
    };
    let mut more = BytesMut::new();
    let mask = (role == Role::Server).then_some([1, 2, 3, 4]);
    ws::write_header(&mut more, Opcode::Binary, 3, mask);
    more.extend_from_slice(b"abc");
    run.input.extend_from_slice(&more);
    run.input
        .extend_from_slice(&ws::control_frame(Opcode::Ping, b"p"));
    let (in_len, out_len) = (run.input.len(), run.out.len());
    for _ in 0..2 {
        let again = run.decoder.decode(&mut run.input, &mut run.out);
        assert_eq!(again, want, "the end is not final");
        assert_eq!(
            (run.input.len(), run.out.len()),
            (in_len, out_len),
            "a finished decoder consumed or produced bytes"
        );
    }
}

/// A whole-buffer decoder written from RFC 6455 §5 and §7.4, checking each rule as soon as
/// the bytes it needs are there (which is what derp-proto documents).
fn model(role: Role, s: &[u8]) -> Outcome {
    let max = match role {
        Role::Server => MAX_FRAME_PAYLOAD,
        Role::Client => u64::MAX >> 1,
    };
    let mut pos = 0;
    let mut in_message = false;
    let mut out = Vec::new();
    let mut pings = Vec::new();
    let end = loop {
        let rest = &s[pos..];
        let [b0, b1, ..] = *rest else {
            break End::NeedMore;
        };
        if b0 & 0x70 != 0 {
            break End::Failed(WsError::ReservedBits);
        }
        let fin = b0 & 0x80 != 0;
        let opcode = b0 & 0x0f;
        let len7 = b1 & 0x7f;
        let refused = match opcode {
            0x0 if !in_message => Some(WsError::UnexpectedContinuation),
            0x1 => Some(WsError::TextMessage),
            0x2 if in_message => Some(WsError::UnfinishedMessage),
            0x0 | 0x2 => None,
            0x8..=0xa if !fin => Some(WsError::FragmentedControl),
            0x8..=0xa if len7 > 125 => Some(WsError::ControlTooLong(len7)),
            0x8..=0xa => None,
            other => Some(WsError::UnknownOpcode(other)),
        };
        if let Some(e) = refused {
            break End::Failed(e);
        }
        let masked = b1 & 0x80 != 0;
        if !masked && role == Role::Server {
            break End::Failed(WsError::Unmasked);
        }
        let (len, mut at) = match len7 {
            126 => match rest.get(2..4) {
                Some(b) => (u64::from(u16::from_be_bytes([b[0], b[1]])), 4),
                None => break End::NeedMore,
            },
            127 => match rest.get(2..10) {
                Some(b) => {
                    let len = b.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
                    if len >= 1 << 63 {
                        break End::Failed(WsError::InvalidLength);
                    }
                    (len, 10)
                }
                None => break End::NeedMore,
            },
            short => (u64::from(short), 2),
        };
        if len > max {
            break End::Failed(WsError::FrameTooLarge { len, max });
        }
        let mut mask = [0u8; 4];
        if masked {
            match rest.get(at..at + 4) {
                Some(m) => mask.copy_from_slice(m),
                None => break End::NeedMore,
            }
            at += 4;
        }
        if opcode & 0x8 == 0 {
            // Data: payload bytes are delivered as they arrive.
            pos += at;
            in_message = !fin;
            let available = (s.len() - pos).min(usize::try_from(len).unwrap_or(usize::MAX));
            out.extend(
                s[pos..pos + available]
                    .iter()
                    .enumerate()
                    .map(|(i, b)| b ^ mask[i % 4]),
            );
            pos += available;
            if (available as u64) < len {
                break End::NeedMore;
            }
            continue;
        }
        // Control: only whole.
        let len = len as usize;
        let Some(payload) = rest.get(at..at + len) else {
            break End::NeedMore;
        };
        let payload: Vec<u8> = payload
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ mask[i % 4])
            .collect();
        pos += at + len;
        match opcode {
            0x9 => pings.push(Bytes::from(payload)),
            0x8 => break close_payload(&payload).map_or_else(End::Failed, End::Closed),
            _ => {}
        }
    };
    Outcome {
        out,
        pings,
        end,
        consumed: pos,
    }
}

/// RFC 6455 §5.5.1 and §7.4: empty, or a code that may be sent on the wire plus UTF-8.
fn close_payload(payload: &[u8]) -> Result<Option<u16>, WsError> {
    match payload {
        [] => Ok(None),
        [_] => Err(WsError::TruncatedClose),
        [hi, lo, reason @ ..] => {
            let code = u16::from_be_bytes([*hi, *lo]);
            let on_wire = matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999);
            if !on_wire {
                Err(WsError::InvalidCloseCode(code))
            } else if std::str::from_utf8(reason).is_err() {
                Err(WsError::InvalidCloseReason)
            } else {
                Ok(Some(code))
            }
        }
    }
}

/// Close codes an endpoint may send.
const CLOSE_CODES: [u16; 8] = [1000, 1001, 1002, 1003, 1008, 1011, 3000, 4999];

/// Reads the program's bytes; zero once they run out.
struct Ops<'a>(&'a [u8]);

impl Ops<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    fn mask(&mut self) -> [u8; 4] {
        [self.byte(), self.byte(), self.byte(), self.byte()]
    }

    /// A payload length in each of the three header length classes, near their edges.
    fn len(&mut self) -> usize {
        let class = self.byte();
        let n = usize::from(u16::from_be_bytes([self.byte(), self.byte()]));
        match class & 3 {
            0 => n % 126,
            1 => 120 + n % 16,
            2 => 65_530 + n % 12,
            _ => n % 2048,
        }
    }
}

fn filler(len: usize, rng: &mut Rng) -> Vec<u8> {
    (0..len).map(|_| rng.below_incl(256) as u8).collect()
}

/// Appends one data frame as `role`'s peer sends it: masked for a server to decode; for a
/// client, unmasked (through `binary_header` or `write_header`) or masked when `mask` is given.
fn data_frame(
    role: Role,
    stream: &mut BytesMut,
    opcode: Opcode,
    fin: bool,
    payload: &[u8],
    mask: Option<[u8; 4]>,
) {
    let start = stream.len();
    match (role, mask) {
        (Role::Server, mask) => {
            ws::write_masked_frame(stream, opcode, payload, mask.unwrap_or([0; 4]));
        }
        (Role::Client, Some(mask)) => ws::write_masked_frame(stream, opcode, payload, mask),
        (Role::Client, None) if opcode == Opcode::Binary => {
            let (header, n) = ws::binary_header(payload.len());
            stream.extend_from_slice(&header[..n]);
            stream.extend_from_slice(payload);
        }
        (Role::Client, None) => {
            ws::write_header(stream, opcode, payload.len(), None);
            stream.extend_from_slice(payload);
        }
    }
    let masked = role == Role::Server || mask.is_some();
    assert_eq!(
        stream.len() - start,
        ws::header_len(payload.len(), masked) + payload.len(),
        "frame size for a {}-byte payload",
        payload.len()
    );
    if !fin {
        stream[start] &= 0x7f;
    }
}

/// Appends one control frame as `role`'s peer sends it; returns the payload it carries
/// (`control_frame` cuts payloads to 125 bytes).
fn control(
    role: Role,
    stream: &mut BytesMut,
    opcode: Opcode,
    payload: &[u8],
    mask: [u8; 4],
) -> Vec<u8> {
    let kept = &payload[..payload.len().min(125)];
    match role {
        Role::Server => ws::write_masked_frame(stream, opcode, kept, mask),
        Role::Client => stream.extend_from_slice(&ws::control_frame(opcode, payload)),
    }
    kept.to_vec()
}

/// Builds a valid stream from the program in `body` and what it must decode to.
fn program(role: Role, body: &[u8], rng: &mut Rng) -> (Vec<u8>, Outcome) {
    let mut ops = Ops(body);
    let mut stream = BytesMut::new();
    let mut out = Vec::new();
    let mut pings = Vec::new();
    let mut end = End::NeedMore;
    // Bounds the work per input; large frames are few.
    while !ops.0.is_empty() && stream.len() < 1 << 17 {
        let op = ops.byte();
        let masked = (op & 0x80 != 0).then(|| ops.mask());
        match op % 6 {
            0 => {
                let payload = filler(ops.len(), rng);
                data_frame(role, &mut stream, Opcode::Binary, true, &payload, masked);
                out.extend_from_slice(&payload);
            }
            1 => {
                let fragments = 2 + usize::from(ops.byte() % 3);
                for i in 0..fragments {
                    let opcode = if i == 0 {
                        Opcode::Binary
                    } else {
                        Opcode::Continuation
                    };
                    let payload = filler(ops.len() % 300, rng);
                    let fin = i + 1 == fragments;
                    data_frame(role, &mut stream, opcode, fin, &payload, masked);
                    out.extend_from_slice(&payload);
                    if !fin && ops.byte() & 1 == 1 {
                        let ping = filler(usize::from(ops.byte() % 20), rng);
                        let kept = control(role, &mut stream, Opcode::Ping, &ping, ops.mask());
                        pings.push(Bytes::from(kept));
                    }
                }
            }
            2 | 3 => {
                let payload = filler(usize::from(ops.byte()) % 200, rng);
                let mask = ops.mask();
                if op % 6 == 2 {
                    let kept = control(role, &mut stream, Opcode::Ping, &payload, mask);
                    pings.push(Bytes::from(kept));
                } else {
                    control(role, &mut stream, Opcode::Pong, &payload, mask);
                }
            }
            4 => {
                let code = CLOSE_CODES[usize::from(ops.byte()) % CLOSE_CODES.len()];
                let reason_len = usize::from(ops.byte() % 160);
                let taken = reason_len.min(ops.0.len());
                let reason = String::from_utf8_lossy(&ops.0[..taken]).into_owned();
                ops.0 = &ops.0[taken..];
                match role {
                    Role::Client if reason.is_empty() => {
                        stream.extend_from_slice(&ws::close_frame(code));
                    }
                    Role::Client => {
                        stream.extend_from_slice(&ws::close_frame_with_reason(code, &reason));
                    }
                    Role::Server => {
                        let mut payload = code.to_be_bytes().to_vec();
                        let mut cut = reason.len().min(123);
                        while !reason.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        payload.extend_from_slice(&reason.as_bytes()[..cut]);
                        ws::write_masked_frame(&mut stream, Opcode::Close, &payload, ops.mask());
                    }
                }
                end = End::Closed(Some(code));
                break;
            }
            _ => {
                control(role, &mut stream, Opcode::Close, &[], ops.mask());
                end = End::Closed(None);
                break;
            }
        }
    }
    let consumed = if end == End::NeedMore {
        stream.len()
    } else {
        // What follows a close is never read.
        let len = stream.len();
        stream.extend_from_slice(ops.0);
        len
    };
    let outcome = Outcome {
        out,
        pings,
        end,
        consumed,
    };
    (stream.to_vec(), outcome)
}
