//! Property tests for carrying a connection's read state elsewhere: a stream decoded up to any
//! byte by one decoder and from there by another, resumed from the first one's snapshot (and
//! the input it had not consumed), decodes exactly as one decoder decodes it whole.

use bytes::{BufMut, BytesMut};
use derp_proto::ws::{self, Opcode, Role, WsDecoder, WsError, WsEvent, WsSnapshot};
use derp_proto::{ClientToRelay, DecodeError, PublicKey, ServerDecoder};
use proptest::collection::vec;
use proptest::prelude::*;

/// One WebSocket frame to put on the wire.
#[derive(Debug, Clone)]
struct Frame {
    opcode: Opcode,
    fin: bool,
    payload: Vec<u8>,
    mask: Option<[u8; 4]>,
}

/// Payload lengths that cover every length form and its edges: 7-bit, 16-bit around 126,
/// and, now and then, 64-bit around 65536.
fn arb_payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => 0..20usize,
        3 => 120..135usize,
        2 => 250..700usize,
        1 => 65_530..65_545usize,
    ]
    .prop_flat_map(|n| vec(any::<u8>(), n))
}

/// A ping or pong, which may sit between two fragments of a message (RFC 6455 §5.4).
fn arb_control(masked: bool) -> impl Strategy<Value = Frame> {
    (
        prop_oneof![Just(Opcode::Ping), Just(Opcode::Pong)],
        vec(any::<u8>(), 0..=125),
        arb_mask(masked),
    )
        .prop_map(|(opcode, payload, mask)| Frame {
            opcode,
            fin: true,
            payload,
            mask,
        })
}

fn arb_mask(masked: bool) -> BoxedStrategy<Option<[u8; 4]>> {
    if masked {
        any::<[u8; 4]>().prop_map(Some).boxed()
    } else {
        // A server's frames are unmasked, though a client decoder takes masked ones too.
        prop_oneof![4 => Just(None), 1 => any::<[u8; 4]>().prop_map(Some)].boxed()
    }
}

/// A binary message in one to four fragments, with control frames between them.
fn arb_message(masked: bool) -> impl Strategy<Value = Vec<Frame>> {
    vec(
        (
            arb_payload(),
            arb_mask(masked),
            proptest::option::weighted(0.3, arb_control(masked)),
        ),
        1..=4,
    )
    .prop_map(|parts| {
        let last = parts.len() - 1;
        let mut frames = Vec::new();
        for (i, (payload, mask, control)) in parts.into_iter().enumerate() {
            frames.push(Frame {
                opcode: if i == 0 {
                    Opcode::Binary
                } else {
                    Opcode::Continuation
                },
                fin: i == last,
                payload,
                mask,
            });
            if i < last
                && let Some(control) = control
            {
                frames.push(control);
            }
        }
        frames
    })
}

/// A whole stream for a decoder of `role`: messages, lone control frames, and sometimes a
/// close at the end.
fn arb_stream(role: Role) -> impl Strategy<Value = (Role, Vec<Frame>)> {
    let masked = role == Role::Server;
    (
        vec(
            prop_oneof![
                4 => arb_message(masked),
                1 => arb_control(masked).prop_map(|f| vec![f]),
            ],
            0..6,
        ),
        proptest::option::weighted(0.3, (any::<[u8; 4]>(), any::<bool>())),
    )
        .prop_map(move |(items, close)| {
            let mut frames: Vec<Frame> = items.into_iter().flatten().collect();
            if let Some((mask, with_code)) = close {
                frames.push(Frame {
                    opcode: Opcode::Close,
                    fin: true,
                    payload: if with_code {
                        ws::close_code::NORMAL.to_be_bytes().to_vec()
                    } else {
                        Vec::new()
                    },
                    mask: Some(mask),
                });
            }
            (role, frames)
        })
}

/// The wire bytes, and the offsets where a frame or a payload starts.
fn encode_frames(frames: &[Frame]) -> (Vec<u8>, Vec<usize>) {
    let mut out = BytesMut::new();
    let mut marks = Vec::new();
    for f in frames {
        marks.push(out.len());
        let start = out.len();
        ws::write_header(&mut out, f.opcode, f.payload.len(), f.mask);
        if !f.fin {
            out[start] &= 0x7f;
        }
        marks.push(out.len());
        let payload_start = out.len();
        out.put_slice(&f.payload);
        if let Some(mask) = f.mask {
            ws::apply_mask(&mut out[payload_start..], mask, 0);
        }
    }
    marks.push(out.len());
    (out.to_vec(), marks)
}

/// Where to cut: every byte of a short stream; in a long one, every byte near a frame or
/// payload start and a stride through the payloads between them.
fn cut_points(len: usize, marks: &[usize]) -> Vec<usize> {
    if len <= 4096 {
        return (0..=len).collect();
    }
    let mut cuts: Vec<usize> = (0..=len).step_by(509).collect();
    for &m in marks {
        cuts.extend(m.saturating_sub(16)..=(m + 16).min(len));
    }
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// What a decoder made of a stream: payload bytes, events (pongs are swallowed), and the
/// error it stopped at.
type Decoded = (Vec<u8>, Vec<WsEvent>, Option<WsError>);

/// Decodes as far as `input` goes, stopping at a close or an error. Returns whether the
/// stream ended (closed or failed).
fn decode_available(
    decoder: &mut WsDecoder,
    input: &mut BytesMut,
    out: &mut BytesMut,
    events: &mut Vec<WsEvent>,
    err: &mut Option<WsError>,
) -> bool {
    loop {
        match decoder.decode(input, out) {
            Ok(WsEvent::NeedMore) => return false,
            Ok(event @ WsEvent::Close { .. }) => {
                events.push(event);
                return true;
            }
            Ok(event) => events.push(event),
            Err(e) => {
                *err = Some(e);
                return true;
            }
        }
    }
}

fn decode_whole(role: Role, stream: &[u8]) -> Decoded {
    let mut decoder = WsDecoder::new(role);
    let (mut input, mut out) = (BytesMut::from(stream), BytesMut::new());
    let (mut events, mut err) = (Vec::new(), None);
    decode_available(&mut decoder, &mut input, &mut out, &mut events, &mut err);
    (out.to_vec(), events, err)
}

/// Decodes `stream[..cut]` with one decoder and the rest with one resumed from its snapshot,
/// which goes through its encoding on the way, as it would between processes.
fn decode_cut(role: Role, stream: &[u8], cut: usize) -> Result<Decoded, TestCaseError> {
    let mut first = WsDecoder::new(role);
    let (mut input, mut out) = (BytesMut::from(&stream[..cut]), BytesMut::new());
    let (mut events, mut err) = (Vec::new(), None);
    if decode_available(&mut first, &mut input, &mut out, &mut events, &mut err) {
        // A closed or failed stream is not carried on.
        prop_assert!(first.snapshot().is_err());
        return Ok((out.to_vec(), events, err));
    }
    let snapshot = first
        .snapshot()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut encoded = Vec::with_capacity(WsSnapshot::MAX_ENCODED_LEN);
    snapshot.encode(&mut encoded);
    prop_assert_eq!(encoded.len(), snapshot.encoded_len());
    let decoded = WsSnapshot::decode(&encoded).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(decoded, snapshot);
    let mut second = WsDecoder::resume(decoded).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // `input` holds what the first decoder left: a partial header or control frame.
    input.extend_from_slice(&stream[cut..]);
    decode_available(&mut second, &mut input, &mut out, &mut events, &mut err);
    Ok((out.to_vec(), events, err))
}

/// A ServerDecoder message, or raw frame bytes the decoder skips (an unknown type, or a
/// Ping longer than its eight bytes, whose tail is skipped).
#[derive(Debug, Clone)]
enum DerpFrame {
    Known(ClientToRelay),
    Raw(u8, Vec<u8>),
}

fn arb_derp_frame() -> impl Strategy<Value = DerpFrame> {
    let body = prop_oneof![
        4 => 0..64usize,
        2 => 64..400usize,
        1 => 60_000..70_000usize,
    ]
    .prop_flat_map(|n| vec(any::<u8>(), n));
    prop_oneof![
        (any::<[u8; 32]>(), vec(any::<u8>(), 0..300)).prop_map(|(dst, packet)| {
            DerpFrame::Known(ClientToRelay::SendPacket {
                dst: PublicKey::from_bytes(dst),
                packet: packet.into(),
            })
        }),
        any::<[u8; 8]>().prop_map(|p| DerpFrame::Known(ClientToRelay::Ping(p))),
        any::<bool>().prop_map(|b| DerpFrame::Known(ClientToRelay::NotePreferred(b))),
        // Types no DERP version assigns: skipped whatever their length.
        (0x20..=0xefu8, body).prop_map(|(ty, body)| DerpFrame::Raw(ty, body)),
        vec(any::<u8>(), 9..=1000).prop_map(|body| DerpFrame::Raw(0x12, body)),
    ]
}

fn encode_derp(frames: &[DerpFrame]) -> (Vec<u8>, Vec<usize>) {
    let mut out = Vec::new();
    let mut marks = Vec::new();
    for f in frames {
        marks.push(out.len());
        match f {
            DerpFrame::Known(msg) => msg.encode(&mut out),
            DerpFrame::Raw(ty, body) => {
                out.push(*ty);
                out.extend_from_slice(&(body.len() as u32).to_be_bytes());
                marks.push(out.len());
                out.extend_from_slice(body);
            }
        }
    }
    marks.push(out.len());
    (out, marks)
}

fn decode_derp(
    decoder: &mut ServerDecoder,
    buf: &mut BytesMut,
) -> Result<Vec<ClientToRelay>, DecodeError> {
    let mut msgs = Vec::new();
    while let Some(msg) = decoder.decode(buf)? {
        msgs.push(msg);
    }
    Ok(msgs)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_websocket_stream_resumes_from_any_byte(
        (role, frames) in prop_oneof![arb_stream(Role::Server), arb_stream(Role::Client)],
    ) {
        let (stream, marks) = encode_frames(&frames);
        let whole = decode_whole(role, &stream);
        // The generator makes valid streams only: the comparison below is between successes.
        prop_assert_eq!(&whole.2, &None);
        let data: Vec<u8> = frames
            .iter()
            .filter(|f| matches!(f.opcode, Opcode::Binary | Opcode::Continuation))
            .flat_map(|f| f.payload.iter().copied())
            .collect();
        prop_assert!(whole.0 == data, "payload bytes differ from what was framed");
        for cut in cut_points(stream.len(), &marks) {
            let resumed = decode_cut(role, &stream, cut)?;
            prop_assert!(resumed == whole, "cut at {} of {}", cut, stream.len());
        }
    }

    #[test]
    fn a_derp_stream_resumes_from_any_byte_even_inside_a_skipped_body(
        frames in vec(arb_derp_frame(), 0..10),
    ) {
        let (stream, marks) = encode_derp(&frames);
        let whole = decode_derp(&mut ServerDecoder::after_handshake(), &mut BytesMut::from(&stream[..]));
        prop_assert!(whole.is_ok(), "{:?}", whole);
        for cut in cut_points(stream.len(), &marks) {
            let mut first = ServerDecoder::after_handshake();
            let mut buf = BytesMut::from(&stream[..cut]);
            let mut got = decode_derp(&mut first, &mut buf);
            let mut second = ServerDecoder::resume_skipping(first.skipping());
            buf.extend_from_slice(&stream[cut..]);
            if let Ok(msgs) = &mut got {
                match decode_derp(&mut second, &mut buf) {
                    Ok(more) => msgs.extend(more),
                    Err(e) => got = Err(e),
                }
            }
            prop_assert_eq!(&got, &whole, "cut at {} of {}", cut, stream.len());
            prop_assert!(buf.is_empty());
        }
    }
}
