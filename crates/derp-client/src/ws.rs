//! The small part of WebSocket (RFC 6455) a DERP client needs.
//!
//! The client sends every DERP frame as one masked binary message and reads server messages as
//! a byte stream: message boundaries carry no meaning, so payloads of binary and continuation
//! frames are appended to the DERP read buffer as they arrive, without waiting for a message or
//! even a frame to be complete. Control frames are handed back to the caller. No extensions are
//! negotiated, so compression never applies.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use sha1::{Digest, Sha1};

/// WebSocket protocol violations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WsError {
    /// A reserved header bit was set although no extension was negotiated.
    #[error("reserved bits set in frame header")]
    ReservedBits,
    /// The opcode is not defined by RFC 6455.
    #[error("unknown opcode {0:#x}")]
    UnknownOpcode(u8),
    /// The server sent a text message; DERP only uses binary messages.
    #[error("text message on a derp connection")]
    TextMessage,
    /// A control frame was fragmented or longer than 125 bytes, or a close payload was 1 byte.
    #[error("malformed control frame")]
    BadControlFrame,
    /// A continuation frame arrived outside a fragmented message.
    #[error("continuation frame without a message")]
    UnexpectedContinuation,
    /// A new message started before the previous fragmented one finished.
    #[error("new message inside a fragmented message")]
    ExpectedContinuation,
    /// The 64-bit length had its most significant bit set.
    #[error("frame length out of range")]
    LengthOverflow,
    /// The 101 response's `Sec-WebSocket-Accept` does not match the key sent.
    #[error("wrong Sec-WebSocket-Accept in upgrade response")]
    BadAccept,
    /// The server picked a subprotocol other than `derp`.
    #[error("server selected a subprotocol other than derp")]
    BadSubprotocol,
}

/// A control frame surfaced by [`WsDecoder::decode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Control {
    /// The peer pinged; RFC 6455 wants a pong with the same payload.
    Ping(Bytes),
    /// The peer closed the connection, with its status code if it gave one.
    Close(Option<u16>),
}

/// Streaming decoder for server-to-client WebSocket frames.
#[derive(Debug, Default)]
pub(crate) struct WsDecoder {
    state: ReadState,
    /// Inside a fragmented data message: the next data frame must be a continuation.
    in_message: bool,
}

#[derive(Debug, Default, Clone, Copy)]
enum ReadState {
    /// Expecting a frame header.
    #[default]
    Header,
    /// Copying a data frame's payload.
    Payload {
        remaining: u64,
        mask: Option<[u8; 4]>,
        /// Position in the payload, modulo 4, for unmasking.
        offset: usize,
    },
}

impl WsDecoder {
    /// Moves message payload from `raw` (bytes read off the socket) to `out` (the DERP stream).
    ///
    /// Returns `Ok(Some(_))` at each control frame (pongs are swallowed), and `Ok(None)` once
    /// `raw` holds no complete header or payload bytes any more. Call again after each control
    /// frame; bytes of an incomplete header or control frame stay in `raw`.
    pub(crate) fn decode(
        &mut self,
        raw: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<Option<Control>, WsError> {
        loop {
            match self.state {
                ReadState::Payload {
                    remaining,
                    mask,
                    offset,
                } => {
                    if raw.is_empty() {
                        return Ok(None);
                    }
                    // `n` fits in usize because it is at most `raw.len()`.
                    let n = usize::try_from(remaining).map_or(raw.len(), |r| r.min(raw.len()));
                    let start = out.len();
                    out.extend_from_slice(&raw[..n]);
                    raw.advance(n);
                    if let Some(mask) = mask {
                        apply_mask(&mut out[start..], mask, offset);
                    }
                    let remaining = remaining - n as u64;
                    self.state = if remaining == 0 {
                        ReadState::Header
                    } else {
                        ReadState::Payload {
                            remaining,
                            mask,
                            offset: (offset + n) % 4,
                        }
                    };
                }
                ReadState::Header => {
                    let Some(header) = parse_header(raw)? else {
                        return Ok(None);
                    };
                    if header.opcode & 0x8 != 0 {
                        if !header.fin || header.payload_len > MAX_CONTROL_PAYLOAD {
                            return Err(WsError::BadControlFrame);
                        }
                        // Control payloads are buffered whole; they are at most 125 bytes.
                        let len = header.payload_len as usize;
                        if raw.len() < header.header_len + len {
                            return Ok(None);
                        }
                        raw.advance(header.header_len);
                        let payload = raw.split_to(len);
                        match control_frame(header, payload)? {
                            Some(control) => return Ok(Some(control)),
                            None => continue,
                        }
                    }
                    match header.opcode {
                        OP_CONTINUATION if !self.in_message => {
                            return Err(WsError::UnexpectedContinuation);
                        }
                        OP_BINARY if self.in_message => return Err(WsError::ExpectedContinuation),
                        OP_CONTINUATION | OP_BINARY => {}
                        OP_TEXT => return Err(WsError::TextMessage),
                        other => return Err(WsError::UnknownOpcode(other)),
                    }
                    self.in_message = !header.fin;
                    raw.advance(header.header_len);
                    if header.payload_len > 0 {
                        self.state = ReadState::Payload {
                            remaining: header.payload_len,
                            mask: header.mask,
                            offset: 0,
                        };
                    }
                }
            }
        }
    }
}

/// Interprets a complete control frame; `None` for a pong, which needs no action.
fn control_frame(header: Header, mut payload: BytesMut) -> Result<Option<Control>, WsError> {
    if let Some(mask) = header.mask {
        apply_mask(&mut payload, mask, 0);
    }
    match header.opcode {
        OP_CLOSE => match *payload {
            [] => Ok(Some(Control::Close(None))),
            [_] => Err(WsError::BadControlFrame),
            [hi, lo, ..] => Ok(Some(Control::Close(Some(u16::from_be_bytes([hi, lo]))))),
        },
        OP_PING => Ok(Some(Control::Ping(payload.freeze()))),
        OP_PONG => Ok(None),
        other => Err(WsError::UnknownOpcode(other)),
    }
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy)]
struct Header {
    fin: bool,
    opcode: u8,
    mask: Option<[u8; 4]>,
    payload_len: u64,
    header_len: usize,
}

/// Parses the header at the front of `raw` without consuming it; `Ok(None)` if incomplete.
fn parse_header(raw: &[u8]) -> Result<Option<Header>, WsError> {
    let [b0, b1, ..] = *raw else {
        return Ok(None);
    };
    if b0 & 0x70 != 0 {
        return Err(WsError::ReservedBits);
    }
    let masked = b1 & 0x80 != 0;
    let (len_bytes, short_len) = match b1 & 0x7f {
        126 => (2, None),
        127 => (8, None),
        n => (0, Some(u64::from(n))),
    };
    let header_len = 2 + len_bytes + if masked { 4 } else { 0 };
    if raw.len() < header_len {
        return Ok(None);
    }
    let payload_len = match short_len {
        Some(n) => n,
        None => {
            let mut be = [0u8; 8];
            be[8 - len_bytes..].copy_from_slice(&raw[2..2 + len_bytes]);
            let n = u64::from_be_bytes(be);
            if n >> 63 != 0 {
                return Err(WsError::LengthOverflow);
            }
            n
        }
    };
    let mask = masked.then(|| {
        let at = 2 + len_bytes;
        [raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]
    });
    Ok(Some(Header {
        fin: b0 & 0x80 != 0,
        opcode: b0 & 0x0f,
        mask,
        payload_len,
        header_len,
    }))
}

/// Length of a frame header for a payload of `len` bytes.
pub(crate) fn header_len(len: usize, masked: bool) -> usize {
    let ext = match len {
        0..=125 => 0,
        126..=0xffff => 2,
        _ => 8,
    };
    2 + ext + if masked { 4 } else { 0 }
}

/// Writes a final (FIN) frame header; the caller appends `len` payload bytes, masked with
/// `mask` when one is given.
pub(crate) fn write_header(out: &mut impl BufMut, opcode: u8, len: usize, mask: Option<[u8; 4]>) {
    out.put_u8(0x80 | opcode);
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    match len {
        // The match arms bound `len`, so the casts are lossless.
        0..=125 => out.put_u8(mask_bit | len as u8),
        126..=0xffff => {
            out.put_u8(mask_bit | 126);
            out.put_u16(len as u16);
        }
        _ => {
            out.put_u8(mask_bit | 127);
            out.put_u64(len as u64);
        }
    }
    if let Some(mask) = mask {
        out.put_slice(&mask);
    }
}

/// Appends one complete masked frame with the given payload.
pub(crate) fn write_masked_frame(out: &mut BytesMut, opcode: u8, payload: &[u8], mask: [u8; 4]) {
    write_header(out, opcode, payload.len(), Some(mask));
    let start = out.len();
    out.extend_from_slice(payload);
    apply_mask(&mut out[start..], mask, 0);
}

/// XORs `data` with the mask, where `data[0]` sits at payload position `offset`.
pub(crate) fn apply_mask(data: &mut [u8], mask: [u8; 4], offset: usize) {
    let mut m = mask;
    m.rotate_left(offset % 4);
    // Eight bytes at a time: payloads are up to 64 KiB and this runs on every byte.
    let wide = u64::from_ne_bytes([m[0], m[1], m[2], m[3], m[0], m[1], m[2], m[3]]);
    let mut chunks = data.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        chunk.copy_from_slice(&(u64::from_ne_bytes(word) ^ wide).to_ne_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= m[i % 4];
    }
}

/// A fresh random `Sec-WebSocket-Key`.
pub(crate) fn new_key() -> String {
    BASE64.encode(rand::random::<[u8; 16]>())
}

/// The `Sec-WebSocket-Accept` value a server must answer to `key`.
pub(crate) fn accept_key(key: &str) -> String {
    let mut sha = Sha1::new();
    sha.update(key.as_bytes());
    sha.update(ACCEPT_GUID);
    BASE64.encode(sha.finalize())
}

/// Continuation frame opcode.
pub(crate) const OP_CONTINUATION: u8 = 0x0;
/// Text frame opcode.
pub(crate) const OP_TEXT: u8 = 0x1;
/// Binary frame opcode.
pub(crate) const OP_BINARY: u8 = 0x2;
/// Close frame opcode.
pub(crate) const OP_CLOSE: u8 = 0x8;
/// Ping frame opcode.
pub(crate) const OP_PING: u8 = 0x9;
/// Pong frame opcode.
pub(crate) const OP_PONG: u8 = 0xa;
/// Close status code for a normal closure.
pub(crate) const CLOSE_NORMAL: u16 = 1000;
/// Control frames carry at most 125 payload bytes (RFC 6455 §5.5).
const MAX_CONTROL_PAYLOAD: u64 = 125;
/// Fixed GUID of the accept-key computation (RFC 6455 §1.3).
const ACCEPT_GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a frame the way a server (or a test peer) would.
    fn frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut out = BytesMut::new();
        write_header(&mut out, opcode, payload.len(), mask);
        if !fin {
            out[0] &= 0x7f;
        }
        let start = out.len();
        out.extend_from_slice(payload);
        if let Some(mask) = mask {
            apply_mask(&mut out[start..], mask, 0);
        }
        out.to_vec()
    }

    /// Feeds `input` in chunks of `step` bytes, collecting data and control frames.
    fn run(input: &[u8], step: usize) -> Result<(Vec<u8>, Vec<Control>), WsError> {
        let mut dec = WsDecoder::default();
        let mut raw = BytesMut::new();
        let mut out = BytesMut::new();
        let mut controls = Vec::new();
        for chunk in input.chunks(step) {
            raw.extend_from_slice(chunk);
            while let Some(c) = dec.decode(&mut raw, &mut out)? {
                controls.push(c);
            }
        }
        assert!(raw.is_empty(), "decoder left {} bytes", raw.len());
        Ok((out.to_vec(), controls))
    }

    #[test]
    fn accept_key_matches_rfc_example() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn accept_key_matches_recorded_exchange() {
        // http.json websocket: request key and the accept derper answered.
        assert_eq!(
            accept_key("EFP1lSaC4iR5OTxXLDN3kQ=="),
            "QosucUXxZNJUa7c1rFjupKoCZVY="
        );
        assert_eq!(new_key().len(), 24);
    }

    #[test]
    fn masking_is_its_own_inverse_at_any_offset() {
        let original: Vec<u8> = (0..=255u8).cycle().take(1037).collect();
        let mask = [0xda, 0x3d, 0x7c, 0x79];
        let mut data = original.clone();
        apply_mask(&mut data, mask, 0);
        assert_ne!(data, original);
        for (i, (m, o)) in data.iter().zip(&original).enumerate() {
            assert_eq!(m ^ o, mask[i % 4]);
        }
        // Unmasking in two pieces with a carried offset gives the same result as one piece.
        let (a, b) = data.split_at_mut(13);
        apply_mask(a, mask, 0);
        apply_mask(b, mask, 13);
        assert_eq!(data, original);
    }

    #[test]
    fn masked_frame_matches_recorded_client_close() {
        // http.json websocket: the Go client's close frame, code 1000, mask 884ed9cc.
        let mut out = BytesMut::new();
        write_masked_frame(
            &mut out,
            OP_CLOSE,
            &CLOSE_NORMAL.to_be_bytes(),
            [0x88, 0x4e, 0xd9, 0xcc],
        );
        assert_eq!(hex::encode(&out), "8882884ed9cc8ba6");
    }

    #[test]
    fn round_trips_masked_and_unmasked_frames_of_every_length_class() {
        for len in [0usize, 1, 125, 126, 127, 65535, 65536, 70000] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            for mask in [None, Some([1, 2, 3, 4])] {
                let f = frame(true, OP_BINARY, &payload, mask);
                assert_eq!(f.len(), header_len(len, mask.is_some()) + len);
                for step in [1, 3, 4096, f.len()] {
                    let (data, controls) = run(&f, step).unwrap();
                    assert_eq!(data, payload, "len {len} mask {mask:?} step {step}");
                    assert!(controls.is_empty());
                }
            }
        }
    }

    #[test]
    fn reassembles_fragmented_messages_and_consecutive_messages() {
        let mut input = frame(false, OP_BINARY, b"hel", Some([9, 8, 7, 6]));
        input.extend(frame(false, OP_CONTINUATION, b"", None));
        // A ping between fragments is allowed and must not disturb the data.
        input.extend(frame(true, OP_PING, b"hi", None));
        input.extend(frame(true, OP_CONTINUATION, b"lo, ", Some([1, 1, 1, 1])));
        input.extend(frame(true, OP_BINARY, b"derp", None));
        input.extend(frame(true, OP_PONG, b"x", None));
        for step in [1, 2, 5, input.len()] {
            let (data, controls) = run(&input, step).unwrap();
            assert_eq!(data, b"hello, derp");
            assert_eq!(controls, vec![Control::Ping(Bytes::from_static(b"hi"))]);
        }
    }

    #[test]
    fn surfaces_close_with_and_without_code() {
        // The recorded server close echo: unmasked, code 1000.
        let (_, c) = run(&hex::decode("880203e8").unwrap(), 1).unwrap();
        assert_eq!(c, vec![Control::Close(Some(1000))]);
        let (_, c) = run(&frame(true, OP_CLOSE, b"", None), 1).unwrap();
        assert_eq!(c, vec![Control::Close(None)]);
        let mut with_reason = 1011u16.to_be_bytes().to_vec();
        with_reason.extend_from_slice(b"bye");
        let (_, c) = run(&frame(true, OP_CLOSE, &with_reason, Some([5, 6, 7, 8])), 2).unwrap();
        assert_eq!(c, vec![Control::Close(Some(1011))]);
    }

    #[test]
    fn decodes_recorded_server_frames() {
        // http.json websocket: ServerKey message as derper sent it.
        let f = hex::decode(
            "822d010000002844455250f09f9491a5cc7c231e1ccce44f37e2fafeff3f1520fdf68d7eccd28d45e78f668ee93e29",
        )
        .unwrap();
        let (data, _) = run(&f, 7).unwrap();
        assert_eq!(data, f[2..]);
    }

    #[test]
    fn refuses_protocol_violations() {
        let cases: Vec<(Vec<u8>, WsError)> = vec![
            (vec![0xc2, 0x00], WsError::ReservedBits),
            (vec![0x83, 0x00], WsError::UnknownOpcode(3)),
            (vec![0x8b, 0x00], WsError::UnknownOpcode(0xb)),
            (frame(true, OP_TEXT, b"hi", None), WsError::TextMessage),
            (
                frame(true, OP_CONTINUATION, b"x", None),
                WsError::UnexpectedContinuation,
            ),
            (
                [
                    frame(false, OP_BINARY, b"x", None),
                    frame(true, OP_BINARY, b"y", None),
                ]
                .concat(),
                WsError::ExpectedContinuation,
            ),
            (frame(false, OP_PING, b"", None), WsError::BadControlFrame),
            (
                frame(true, OP_PING, &[0; 126], None),
                WsError::BadControlFrame,
            ),
            (frame(true, OP_CLOSE, &[3], None), WsError::BadControlFrame),
            (
                vec![0x82, 0x7f, 0x80, 0, 0, 0, 0, 0, 0, 0],
                WsError::LengthOverflow,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(run(&input, input.len()).err(), Some(want), "{input:02x?}");
        }
    }

    #[test]
    fn keeps_incomplete_header_and_control_frame_in_raw() {
        let mut dec = WsDecoder::default();
        let mut out = BytesMut::new();
        let mut raw = BytesMut::from(&[0x82u8, 0x7e, 0x01][..]);
        assert_eq!(dec.decode(&mut raw, &mut out), Ok(None));
        assert_eq!(raw.len(), 3);
        let mut raw = BytesMut::from(&frame(true, OP_PING, b"abc", None)[..4]);
        assert_eq!(dec.decode(&mut raw, &mut out), Ok(None));
        assert_eq!(raw.len(), 4);
        assert!(out.is_empty());
    }
}
