//! DERP over WebSocket (RFC 6455, subprotocol `derp`), both sides, without IO.
//!
//! DERP is a byte stream; over WebSocket it travels in binary messages whose boundaries carry
//! no meaning. So this module is not a message API. It offers:
//!
//! - handshake helpers: [`accept_key`], [`wants_derp_subprotocol`], [`offers_derp_token`]
//!   (the HTTP heads themselves are in [`crate::upgrade`]);
//! - framing for writers: [`binary_header`] gives the few header bytes that go in front of
//!   each outgoing DERP frame of a server, so a writer can batch frames into one vectored
//!   write without copying them; [`write_header`] and [`write_masked_frame`] serve clients,
//!   which must mask; [`control_frame`], [`close_frame`] and [`close_frame_with_reason`] build
//!   unmasked control frames;
//! - [`WsDecoder`], a streaming decoder for either direction that turns raw bytes into the
//!   DERP byte stream, unmasking payload bytes as soon as they arrive, and reports pings and
//!   the close; its state between two calls can be taken out as a [`WsSnapshot`], with a
//!   compact encoding, and a decoder resumed from it elsewhere (another process).
//!
//! It does not do compression (derper disables it) or text messages.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::{Buf as _, BufMut, Bytes, BytesMut};
use sha1::{Digest as _, Sha1};

mod snapshot;

pub use snapshot::{WsPayload, WsSnapshot, WsSnapshotError};

/// The GUID that RFC 6455 §1.3 appends to the client's key before hashing.
const ACCEPT_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Largest payload a server accepts in one client frame.
///
/// The Go client writes each DERP frame (at most a little over 1 MiB, see `MaxInfoLen`) as its
/// own message, so anything much larger is not a DERP peer. The payload is streamed, so the cap
/// bounds nothing in memory; it only rejects nonsense lengths early.
pub const MAX_FRAME_PAYLOAD: u64 = (1 << 20) + (64 << 10);

/// RFC 6455 §5.5: control frame payloads are at most 125 bytes.
const MAX_CONTROL_PAYLOAD: usize = 125;

const FIN: u8 = 0x80;
const RSV_BITS: u8 = 0x70;
const OPCODE_BITS: u8 = 0x0F;
const MASK_BIT: u8 = 0x80;
const LEN7_BITS: u8 = 0x7F;

/// Frame opcodes (RFC 6455 §5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// Continues a fragmented message.
    Continuation = 0x0,
    /// A text message; DERP never uses one.
    Text = 0x1,
    /// A binary message: DERP bytes.
    Binary = 0x2,
    /// Starts or answers the close handshake.
    Close = 0x8,
    /// Asks for a pong.
    Ping = 0x9,
    /// Answers a ping.
    Pong = 0xA,
}

const OP_CONTINUATION: u8 = Opcode::Continuation as u8;
const OP_TEXT: u8 = Opcode::Text as u8;
const OP_BINARY: u8 = Opcode::Binary as u8;
const OP_CLOSE: u8 = Opcode::Close as u8;
const OP_PING: u8 = Opcode::Ping as u8;
const OP_PONG: u8 = Opcode::Pong as u8;

/// Close status codes DERP endpoints send (RFC 6455 §7.4.1).
pub mod close_code {
    /// Normal closure; also the code a server echoes when the client closes normally.
    pub const NORMAL: u16 = 1000;
    /// The peer broke the framing rules.
    pub const PROTOCOL_ERROR: u16 = 1002;
    /// The peer sent a message type we do not take (text).
    pub const UNSUPPORTED_DATA: u16 = 1003;
    /// A close reason that is not UTF-8.
    pub const INVALID_PAYLOAD: u16 = 1007;
    /// derper closes with this when the client did not negotiate the `derp` subprotocol.
    pub const POLICY_VIOLATION: u16 = 1008;
    /// A frame longer than [`super::MAX_FRAME_PAYLOAD`].
    pub const MESSAGE_TOO_BIG: u16 = 1009;
    /// derper closes with this when the DERP connection ends.
    pub const INTERNAL_ERROR: u16 = 1011;
}

/// The `Sec-WebSocket-Accept` value for a client's `Sec-WebSocket-Key` (RFC 6455 §4.2.2).
///
/// Surrounding spaces and tabs in the header value are ignored, as Go's header parser does;
/// other whitespace (such as U+00A0) is part of the key there, and so it is here.
pub fn accept_key(sec_websocket_key: &str) -> String {
    let mut hasher = Sha1::new();
    hasher.update(sec_websocket_key.trim_matches([' ', '\t']).as_bytes());
    hasher.update(ACCEPT_GUID.as_bytes());
    BASE64.encode(hasher.finalize())
}

/// A `Sec-WebSocket-Key` made from 16 random bytes the caller supplies.
pub fn new_key(random: [u8; 16]) -> String {
    BASE64.encode(random)
}

/// Whether a `Sec-WebSocket-Protocol` header value asks for DERP.
///
/// derper routes a request to the WebSocket path when the header merely contains `derp`
/// (case-sensitive substring, not a token match), so this does the same to route identically.
pub fn wants_derp_subprotocol(header_value: &str) -> bool {
    header_value.contains("derp")
}

/// Whether `derp` is one of the offered subprotocols (a token of the comma-separated list),
/// which is what negotiation needs; a value that only contains `derp` inside another token
/// is routed to DERP but refused with a 1008 close, as derper does.
pub fn offers_derp_token(header_value: &str) -> bool {
    header_value.split(',').any(|t| t.trim() == "derp")
}

/// The header of one unmasked, final binary frame carrying `payload_len` bytes.
///
/// Returns the header buffer and how many of its leading bytes are used (2, 4 or 10), so a
/// writer can put `&buf[..n]` in front of the payload in a single vectored write.
pub fn binary_header(payload_len: usize) -> ([u8; 10], usize) {
    let mut header = [0u8; 10];
    header[0] = FIN | OP_BINARY;
    if payload_len <= 125 {
        // Fits in the 7-bit length field: checked just above.
        header[1] = payload_len as u8;
        (header, 2)
    } else if let Ok(len16) = u16::try_from(payload_len) {
        header[1] = 126;
        header[2..4].copy_from_slice(&len16.to_be_bytes());
        (header, 4)
    } else {
        header[1] = 127;
        // usize is at most 64 bits on every target Rust supports.
        header[2..10].copy_from_slice(&(payload_len as u64).to_be_bytes());
        (header, 10)
    }
}

/// Length of a final frame's header for a payload of `len` bytes.
pub fn header_len(len: usize, masked: bool) -> usize {
    let ext = match len {
        0..=125 => 0,
        126..=0xffff => 2,
        _ => 8,
    };
    2 + ext + if masked { 4 } else { 0 }
}

/// Writes a final (FIN) frame header; the caller appends `len` payload bytes, masked with
/// `mask` (see [`apply_mask`]) when one is given. Clients must mask; servers must not.
pub fn write_header(out: &mut impl BufMut, opcode: Opcode, len: usize, mask: Option<[u8; 4]>) {
    out.put_u8(FIN | opcode as u8);
    let mask_bit = if mask.is_some() { MASK_BIT } else { 0 };
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

/// Appends one complete masked frame with the given payload, as a client sends it.
pub fn write_masked_frame(out: &mut BytesMut, opcode: Opcode, payload: &[u8], mask: [u8; 4]) {
    write_header(out, opcode, payload.len(), Some(mask));
    let start = out.len();
    out.extend_from_slice(payload);
    apply_mask(&mut out[start..], mask, 0);
}

/// XORs `data` with the mask, where `data[0]` sits at payload position `offset`. Masking is
/// its own inverse, so this both masks and unmasks.
pub fn apply_mask(data: &mut [u8], mask: [u8; 4], offset: usize) {
    let mut m = mask;
    m.rotate_left(offset % 4);
    unmask(data, m);
}

/// An unmasked control frame (close, ping or pong), as a server sends it.
///
/// Control payloads are limited to 125 bytes by RFC 6455 §5.5; a longer `payload` is cut to
/// 125 bytes rather than producing a frame the peer must reject. Pong payloads echo a ping
/// that [`WsDecoder`] already limited to 125 bytes, so nothing is cut in practice.
pub fn control_frame(opcode: Opcode, payload: &[u8]) -> Vec<u8> {
    let payload = &payload[..payload.len().min(MAX_CONTROL_PAYLOAD)];
    let mut frame = Vec::with_capacity(2 + payload.len());
    frame.push(FIN | opcode as u8);
    // At most 125 after the cut above.
    frame.push(payload.len() as u8);
    frame.extend_from_slice(payload);
    frame
}

/// An unmasked close frame carrying `code` and no reason.
pub fn close_frame(code: u16) -> Vec<u8> {
    control_frame(Opcode::Close, &code.to_be_bytes())
}

/// An unmasked close frame carrying `code` and a UTF-8 `reason` (cut to fit the 125-byte
/// limit, on a character boundary).
pub fn close_frame_with_reason(code: u16, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_CONTROL_PAYLOAD - 2);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = Vec::with_capacity(2 + end);
    payload.extend_from_slice(&code.to_be_bytes());
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    control_frame(Opcode::Close, &payload)
}

/// Why a WebSocket stream was rejected.
///
/// Every variant is the peer's fault; a server answers with [`close_frame`]`(err.close_code())`
/// and drops the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WsError {
    /// RFC 6455 §5.1: every client frame must be masked.
    #[error("client frame is not masked")]
    Unmasked,
    /// RSV1-3 set without a negotiated extension.
    #[error("reserved bits set in frame header")]
    ReservedBits,
    /// An opcode RFC 6455 does not define.
    #[error("unknown opcode {0:#x}")]
    UnknownOpcode(u8),
    /// DERP only travels in binary messages.
    #[error("text messages are not supported")]
    TextMessage,
    /// A control frame without FIN (RFC 6455 §5.5).
    #[error("fragmented control frame")]
    FragmentedControl,
    /// A control frame longer than 125 bytes (RFC 6455 §5.5).
    #[error("control frame payload of {0} bytes exceeds 125")]
    ControlTooLong(u8),
    /// A continuation frame with no message in progress.
    #[error("continuation frame without a message to continue")]
    UnexpectedContinuation,
    /// A new binary message before the previous fragmented one finished.
    #[error("new message started before the previous one finished")]
    UnfinishedMessage,
    /// A 64-bit length with the most significant bit set (RFC 6455 §5.2).
    #[error("frame length has its most significant bit set")]
    InvalidLength,
    /// A frame payload above the decoder's limit ([`MAX_FRAME_PAYLOAD`] for a server).
    #[error("frame payload of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge {
        /// The declared payload length.
        len: u64,
        /// The limit it exceeded.
        max: u64,
    },
    /// A close frame with a one-byte payload, which cannot hold a status code.
    #[error("close frame payload of one byte")]
    TruncatedClose,
    /// A close status code that may not be sent on the wire (RFC 6455 §7.4).
    #[error("invalid close code {0}")]
    InvalidCloseCode(u16),
    /// A close reason that is not UTF-8 (RFC 6455 §5.5.1).
    #[error("close reason is not valid UTF-8")]
    InvalidCloseReason,
}

impl WsError {
    /// The close status code to send back for this error.
    pub fn close_code(&self) -> u16 {
        match self {
            Self::TextMessage => close_code::UNSUPPORTED_DATA,
            Self::FrameTooLarge { .. } => close_code::MESSAGE_TOO_BIG,
            Self::InvalidCloseReason => close_code::INVALID_PAYLOAD,
            Self::Unmasked
            | Self::ReservedBits
            | Self::UnknownOpcode(_)
            | Self::FragmentedControl
            | Self::ControlTooLong(_)
            | Self::UnexpectedContinuation
            | Self::UnfinishedMessage
            | Self::InvalidLength
            | Self::TruncatedClose
            | Self::InvalidCloseCode(_) => close_code::PROTOCOL_ERROR,
        }
    }
}

/// Which end of the connection a decoder serves; it decides the masking rule and the size
/// limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Decodes client frames: each must be masked, and payloads above
    /// [`MAX_FRAME_PAYLOAD`] are refused.
    Server,
    /// Decodes server frames: unmasked as RFC 6455 requires, though a masked one is
    /// unmasked rather than refused, and no length limit beyond the 63-bit one (payloads are
    /// streamed, never buffered whole).
    Client,
}

/// What [`WsDecoder::decode`] stopped for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WsEvent {
    /// All complete input was consumed (payload bytes are in `out`); read more from the socket.
    /// Any bytes left in `input` are the start of a frame header or control frame.
    NeedMore,
    /// The peer pinged; answer with a pong echoing `payload` and call `decode` again, since
    /// more input may be waiting.
    Ping(Bytes),
    /// The peer started the close handshake. Echo its code (or an empty close frame if `code`
    /// is `None`) and stop reading. Later calls report the same event.
    Close {
        /// The peer's status code, if its close frame carried one.
        code: Option<u16>,
    },
}

#[derive(Clone, Copy)]
enum State {
    /// Between frames: the next input byte starts a header.
    Header,
    /// Inside a binary or continuation frame's payload.
    Payload {
        remaining: u64,
        /// Rotated as bytes are consumed, so `mask[0]` applies to the next byte; all zeros
        /// for an unmasked frame.
        mask: [u8; 4],
    },
    Closed {
        code: Option<u16>,
    },
    Failed(WsError),
}

/// Incremental decoder for one direction of a WebSocket stream.
///
/// Feed it whatever the socket produced; it consumes what it can from `input`, appends
/// unmasked payload bytes of binary messages to `out` as soon as they arrive (without waiting
/// for a frame to complete), and stops at each control event. Pongs are swallowed. After an
/// error it keeps returning that error.
pub struct WsDecoder {
    role: Role,
    state: State,
    /// A binary message with FIN unset is open, so continuation frames are expected.
    in_message: bool,
    max_payload: u64,
}

impl fmt::Debug for WsDecoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The mask key is not secret but is noise in logs; show the phase of decoding only.
        let state = match self.state {
            State::Header => "header",
            State::Payload { .. } => "payload",
            State::Closed { .. } => "closed",
            State::Failed(_) => "failed",
        };
        f.debug_struct("WsDecoder")
            .field("role", &self.role)
            .field("state", &state)
            .field("in_message", &self.in_message)
            .field("max_payload", &self.max_payload)
            .finish()
    }
}

/// A parsed frame header.
struct FrameHeader {
    fin: bool,
    opcode: u8,
    mask: [u8; 4],
    payload_len: u64,
    header_len: usize,
}

impl WsDecoder {
    /// Whether the next event needs more bytes. False once the stream is closed or failed:
    /// the decoder then repeats that event without reading anything, so a caller that
    /// waits for the socket before decoding again would wait for nothing.
    pub fn needs_input(&self) -> bool {
        matches!(self.state, State::Header | State::Payload { .. })
    }

    /// A decoder at the start of the stream, for the given end of the connection.
    pub fn new(role: Role) -> Self {
        Self {
            role,
            state: State::Header,
            in_message: false,
            max_payload: match role {
                Role::Server => MAX_FRAME_PAYLOAD,
                Role::Client => u64::MAX >> 1,
            },
        }
    }

    /// Consumes bytes from `input`, appending DERP stream bytes to `out`.
    ///
    /// Returns at the first control event, or with [`WsEvent::NeedMore`] once nothing more can
    /// be decoded from `input`.
    pub fn decode(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<WsEvent, WsError> {
        let result = self.decode_inner(input, out);
        if let Err(err) = result {
            self.state = State::Failed(err);
        }
        result
    }

    fn decode_inner(
        &mut self,
        input: &mut BytesMut,
        out: &mut BytesMut,
    ) -> Result<WsEvent, WsError> {
        loop {
            match self.state {
                State::Failed(err) => return Err(err),
                State::Closed { code } => return Ok(WsEvent::Close { code }),
                State::Payload {
                    remaining,
                    mut mask,
                } => {
                    if input.is_empty() {
                        return Ok(WsEvent::NeedMore);
                    }
                    // Bounded by input.len(), so it fits in usize.
                    let n = remaining.min(input.len() as u64) as usize;
                    let start = out.len();
                    out.extend_from_slice(&input[..n]);
                    if mask != [0; 4] {
                        unmask(&mut out[start..], mask);
                        mask.rotate_left(n % 4);
                    }
                    input.advance(n);
                    let remaining = remaining - n as u64;
                    self.state = if remaining == 0 {
                        State::Header
                    } else {
                        State::Payload { remaining, mask }
                    };
                }
                State::Header => {
                    let Some(header) = self.parse_header(input)? else {
                        return Ok(WsEvent::NeedMore);
                    };
                    if header.opcode & 0x8 == 0 {
                        // Binary or continuation: validated by parse_header.
                        input.advance(header.header_len);
                        self.in_message = !header.fin;
                        if header.payload_len > 0 {
                            self.state = State::Payload {
                                remaining: header.payload_len,
                                mask: header.mask,
                            };
                        }
                        continue;
                    }
                    // Control frames are short, so wait until one is whole rather than keep
                    // a partial control payload around.
                    // parse_header capped payload_len at 125.
                    let payload_len = header.payload_len as usize;
                    let total = header.header_len + payload_len;
                    if input.len() < total {
                        return Ok(WsEvent::NeedMore);
                    }
                    let mut payload = [0u8; MAX_CONTROL_PAYLOAD];
                    let payload = &mut payload[..payload_len];
                    payload.copy_from_slice(&input[header.header_len..total]);
                    unmask(payload, header.mask);
                    input.advance(total);
                    match header.opcode {
                        OP_PING => return Ok(WsEvent::Ping(Bytes::copy_from_slice(payload))),
                        OP_CLOSE => {
                            let code = parse_close(payload)?;
                            self.state = State::Closed { code };
                            return Ok(WsEvent::Close { code });
                        }
                        // Pong: neither side of DERP pings for liveness at this layer, so an
                        // unsolicited pong is ignored as RFC 6455 §5.5.3 allows.
                        _ => {}
                    }
                }
            }
        }
    }

    /// Parses and validates the header at the start of `input` without consuming it.
    ///
    /// Each check runs as soon as the bytes it needs are present, so a hostile length or
    /// opcode is rejected before anything else about the frame arrives.
    fn parse_header(&self, input: &[u8]) -> Result<Option<FrameHeader>, WsError> {
        let [b0, b1, ..] = *input else {
            return Ok(None);
        };
        if b0 & RSV_BITS != 0 {
            return Err(WsError::ReservedBits);
        }
        let fin = b0 & FIN != 0;
        let opcode = b0 & OPCODE_BITS;
        match opcode {
            OP_CONTINUATION if !self.in_message => return Err(WsError::UnexpectedContinuation),
            OP_CONTINUATION => {}
            OP_TEXT => return Err(WsError::TextMessage),
            OP_BINARY if self.in_message => return Err(WsError::UnfinishedMessage),
            OP_BINARY => {}
            OP_CLOSE | OP_PING | OP_PONG => {
                if !fin {
                    return Err(WsError::FragmentedControl);
                }
                if usize::from(b1 & LEN7_BITS) > MAX_CONTROL_PAYLOAD {
                    return Err(WsError::ControlTooLong(b1 & LEN7_BITS));
                }
            }
            other => return Err(WsError::UnknownOpcode(other)),
        }
        let masked = b1 & MASK_BIT != 0;
        if !masked && self.role == Role::Server {
            return Err(WsError::Unmasked);
        }
        let (payload_len, len_end) = match b1 & LEN7_BITS {
            126 => {
                let Some(&[hi, lo]) = input.get(2..4) else {
                    return Ok(None);
                };
                (u64::from(u16::from_be_bytes([hi, lo])), 4)
            }
            127 => {
                let Some(ext) = input.get(2..10) else {
                    return Ok(None);
                };
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(ext);
                let len = u64::from_be_bytes(bytes);
                if len >> 63 != 0 {
                    return Err(WsError::InvalidLength);
                }
                (len, 10)
            }
            len7 => (u64::from(len7), 2),
        };
        if payload_len > self.max_payload {
            return Err(WsError::FrameTooLarge {
                len: payload_len,
                max: self.max_payload,
            });
        }
        let (mask, header_len) = if masked {
            let Some(&[m0, m1, m2, m3]) = input.get(len_end..len_end + 4) else {
                return Ok(None);
            };
            ([m0, m1, m2, m3], len_end + 4)
        } else {
            ([0; 4], len_end)
        };
        Ok(Some(FrameHeader {
            fin,
            opcode,
            mask,
            payload_len,
            header_len,
        }))
    }
}

/// Validates an unmasked close payload and extracts its status code (RFC 6455 §5.5.1, §7.4).
fn parse_close(payload: &[u8]) -> Result<Option<u16>, WsError> {
    let [hi, lo, reason @ ..] = payload else {
        return if payload.is_empty() {
            Ok(None)
        } else {
            Err(WsError::TruncatedClose)
        };
    };
    let code = u16::from_be_bytes([*hi, *lo]);
    // 1004-1006 and 1015 are reserved for local use and must never appear on the wire; the
    // rest of 1000-2999 is unassigned; 3000-4999 belong to registries and applications.
    let valid = matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999);
    if !valid {
        return Err(WsError::InvalidCloseCode(code));
    }
    if std::str::from_utf8(reason).is_err() {
        return Err(WsError::InvalidCloseReason);
    }
    Ok(Some(code))
}

/// XORs `buf` with the repeating 4-byte `mask`, starting at `mask[0]`.
///
/// Works eight bytes at a time; since 8 is a multiple of 4, every chunk starts at mask
/// phase 0, and the loop is simple enough for the compiler to vectorise further.
fn unmask(buf: &mut [u8], mask: [u8; 4]) {
    let [m0, m1, m2, m3] = mask;
    // Native byte order on both sides of the XOR keeps byte i paired with mask[i % 4].
    let wide = u64::from_ne_bytes([m0, m1, m2, m3, m0, m1, m2, m3]);
    let (chunks, tail) = buf.as_chunks_mut::<8>();
    for chunk in chunks {
        *chunk = (u64::from_ne_bytes(*chunk) ^ wide).to_ne_bytes();
    }
    for (byte, m) in tail.iter_mut().zip(mask.iter().cycle()) {
        *byte ^= *m;
    }
}

#[cfg(test)]
mod tests {
    use derp_testkit::{unhex, vectors};
    use serde_json::Value;

    use super::snapshot::{SNAPSHOT_IN_MESSAGE, SNAPSHOT_PAYLOAD, SNAPSHOT_VERSION};
    use super::*;

    fn websocket_exchange() -> Value {
        vectors::http()["websocket"].clone()
    }

    /// Concatenation of one direction's transcript chunks.
    fn stream(exchange: &Value, dir: &str) -> Vec<u8> {
        let mut bytes = Vec::new();
        for chunk in exchange["transcript"].as_array().expect("transcript") {
            if chunk["dir"] == dir {
                bytes.extend(unhex(chunk["hex"].as_str().expect("hex")));
            }
        }
        bytes
    }

    /// The c2s bytes after the HTTP request head: the client's WebSocket frames.
    fn recorded_c2s_frames() -> Vec<u8> {
        let exchange = websocket_exchange();
        let all = stream(&exchange, "c2s");
        let request = unhex(exchange["request_hex"].as_str().expect("request_hex"));
        assert!(all.starts_with(&request));
        all[request.len()..].to_vec()
    }

    fn recorded_c2s_derp() -> Vec<u8> {
        let exchange = websocket_exchange();
        let mut bytes = Vec::new();
        for frame in exchange["derp_frames_inside_websocket"]
            .as_array()
            .expect("frames")
        {
            if frame["dir"] == "c2s" {
                bytes.extend(unhex(frame["hex"].as_str().expect("hex")));
            }
        }
        assert!(!bytes.is_empty());
        bytes
    }

    /// Builds a masked client frame, choosing the shortest length encoding.
    fn client_frame(b0: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
        let mut frame = vec![b0];
        let len = payload.len();
        if len <= 125 {
            frame.push(MASK_BIT | len as u8);
        } else if len <= 0xFFFF {
            frame.push(MASK_BIT | 126);
            frame.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            frame.push(MASK_BIT | 127);
            frame.extend_from_slice(&(len as u64).to_be_bytes());
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().zip(mask.iter().cycle()).map(|(b, m)| b ^ m));
        frame
    }

    /// Runs the decoder over `chunks` in order, answering until it needs more each time.
    /// Returns the DERP bytes and the events (without `NeedMore`), stopping at an error.
    fn run(chunks: &[&[u8]]) -> (Vec<u8>, Vec<WsEvent>, Option<WsError>) {
        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::new();
        let mut out = BytesMut::new();
        let mut events = Vec::new();
        for chunk in chunks {
            input.extend_from_slice(chunk);
            loop {
                match decoder.decode(&mut input, &mut out) {
                    Ok(WsEvent::NeedMore) => break,
                    Ok(event @ WsEvent::Close { .. }) => {
                        events.push(event);
                        return (out.to_vec(), events, None);
                    }
                    Ok(event) => events.push(event),
                    Err(err) => return (out.to_vec(), events, Some(err)),
                }
            }
        }
        (out.to_vec(), events, None)
    }

    fn first_error(bytes: &[u8]) -> Option<WsError> {
        run(&[bytes]).2
    }

    #[test]
    fn accept_key_matches_rfc_example() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        assert_eq!(
            accept_key(" dGhlIHNhbXBsZSBub25jZQ== "),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    /// Pulls one header's value out of a recorded head.
    fn header_value(head: &str, name: &str) -> String {
        head.split("\r\n")
            .find_map(|line| {
                let (n, v) = line.split_once(':')?;
                n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("no {name} header"))
    }

    #[test]
    fn accept_key_matches_recorded_exchange() {
        let exchange = websocket_exchange();
        let request = exchange["request_text"].as_str().expect("request_text");
        let response = exchange["response_text"].as_str().expect("response_text");
        let key = header_value(request, "Sec-WebSocket-Key");
        let accept = header_value(response, "Sec-WebSocket-Accept");
        assert_eq!(accept_key(&key), accept);
    }

    #[test]
    fn response_head_matches_recorded_response_without_date() {
        let exchange = websocket_exchange();
        let response = exchange["response_text"].as_str().expect("response_text");
        let expected: String = response
            .split_inclusive("\r\n")
            .filter(|line| !line.starts_with("Date:"))
            .collect();
        let accept = header_value(response, "Sec-WebSocket-Accept");
        assert_eq!(
            String::from_utf8(crate::upgrade::websocket_response_head(&accept, true)).unwrap(),
            expected
        );
    }

    #[test]
    fn subprotocol_detection_is_a_substring_match() {
        assert!(wants_derp_subprotocol("derp"));
        assert!(wants_derp_subprotocol("chat, derp"));
        assert!(wants_derp_subprotocol("derpy"));
        assert!(!wants_derp_subprotocol(""));
        assert!(!wants_derp_subprotocol("chat"));
        assert!(!wants_derp_subprotocol("DERP"));
    }

    #[test]
    fn binary_header_uses_shortest_length_form() {
        let cases: [(usize, &[u8]); 6] = [
            (0, &[0x82, 0]),
            (125, &[0x82, 125]),
            (126, &[0x82, 126, 0, 126]),
            (65535, &[0x82, 126, 0xFF, 0xFF]),
            (65536, &[0x82, 127, 0, 0, 0, 0, 0, 1, 0, 0]),
            (
                MAX_FRAME_PAYLOAD as usize,
                &[0x82, 127, 0, 0, 0, 0, 0, 0x11, 0, 0],
            ),
        ];
        for (len, expected) in cases {
            let (buf, n) = binary_header(len);
            assert_eq!(&buf[..n], expected, "length {len}");
        }
    }

    #[test]
    fn recorded_server_frames_are_reproduced() {
        let exchange = websocket_exchange();
        let mut binary = 0;
        for frame in exchange["parsed"].as_array().expect("parsed") {
            if frame["dir"] != "s2c" || frame["kind"] != "ws_frame" {
                continue;
            }
            let recorded = unhex(frame["hex"].as_str().expect("hex"));
            let payload = unhex(frame["unmasked_payload_hex"].as_str().expect("payload"));
            let built = match frame["opcode"].as_u64() {
                Some(2) => {
                    binary += 1;
                    let (header, n) = binary_header(payload.len());
                    [&header[..n], &payload[..]].concat()
                }
                Some(8) => {
                    let code = frame["close_code"].as_u64().expect("close_code");
                    close_frame(u16::try_from(code).unwrap())
                }
                other => panic!("unexpected opcode {other:?}"),
            };
            assert_eq!(built, recorded);
        }
        assert_eq!(binary, 2);
        assert_eq!(close_frame(close_code::NORMAL), [0x88, 0x02, 0x03, 0xE8]);
        // derper's close when the DERP connection ends.
        assert_eq!(
            close_frame(close_code::INTERNAL_ERROR),
            [0x88, 0x02, 0x03, 0xF3]
        );
    }

    #[test]
    fn recorded_client_frames_decode_to_derp_stream_then_close() {
        let (derp, events, err) = run(&[&recorded_c2s_frames()]);
        assert_eq!(err, None);
        assert_eq!(derp, recorded_c2s_derp());
        assert_eq!(events, [WsEvent::Close { code: Some(1000) }]);
    }

    #[test]
    fn recorded_client_frames_decode_the_same_at_every_split() {
        let frames = recorded_c2s_frames();
        let derp = recorded_c2s_derp();
        for split in 0..=frames.len() {
            let (head, tail) = frames.split_at(split);
            let (out, events, err) = run(&[head, tail]);
            assert_eq!(err, None, "split at {split}");
            assert_eq!(out, derp, "split at {split}");
            assert_eq!(
                events,
                [WsEvent::Close { code: Some(1000) }],
                "split {split}"
            );
        }
        let bytes: Vec<&[u8]> = frames.chunks(1).collect();
        let (out, events, err) = run(&bytes);
        assert_eq!((out, err), (derp, None));
        assert_eq!(events, [WsEvent::Close { code: Some(1000) }]);
    }

    #[test]
    fn payload_bytes_are_appended_before_the_frame_completes() {
        let payload: Vec<u8> = (0..=255u8).cycle().take(300).collect();
        let frame = client_frame(0x82, &payload, [1, 2, 3, 4]);
        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::from(&frame[..4 + 4 + 7]);
        let mut out = BytesMut::new();
        assert_eq!(decoder.decode(&mut input, &mut out), Ok(WsEvent::NeedMore));
        assert_eq!(&out[..], &payload[..7]);
        assert!(input.is_empty());
        input.extend_from_slice(&frame[4 + 4 + 7..]);
        assert_eq!(decoder.decode(&mut input, &mut out), Ok(WsEvent::NeedMore));
        assert_eq!(&out[..], &payload[..]);
    }

    #[test]
    fn all_length_forms_round_trip() {
        for len in [0usize, 1, 7, 8, 9, 125, 126, 127, 65535, 65536, 200_000] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let frame = client_frame(0x82, &payload, [0xDE, 0xAD, 0xBE, 0xEF]);
            let (out, events, err) = run(&[&frame]);
            assert_eq!((err, events.len()), (None, 0), "length {len}");
            assert!(out == payload, "length {len}");
        }
    }

    #[test]
    fn fragmented_message_with_interleaved_ping_and_pong() {
        let mask = [9, 8, 7, 6];
        let stream = [
            client_frame(0x02, b"hello ", mask),
            client_frame(0x89, b"are you there", mask),
            client_frame(0x00, b"", mask),
            client_frame(0x8A, b"unsolicited", mask),
            client_frame(0x80, b"world", mask),
            client_frame(0x82, b"!", mask),
            client_frame(0x88, &[], mask),
        ]
        .concat();
        let (out, events, err) = run(&[&stream]);
        assert_eq!(err, None);
        assert_eq!(out, b"hello world!");
        assert_eq!(
            events,
            [
                WsEvent::Ping(Bytes::from_static(b"are you there")),
                WsEvent::Close { code: None },
            ]
        );
    }

    #[test]
    fn close_is_sticky_and_stops_consuming() {
        let mut input = BytesMut::from(
            &[
                client_frame(0x88, &[0x03, 0xE8, b'b', b'y', b'e'], [1, 1, 1, 1]),
                client_frame(0x82, b"late", [1, 1, 1, 1]),
            ]
            .concat()[..],
        );
        let mut decoder = WsDecoder::new(Role::Server);
        assert!(decoder.needs_input());
        let mut out = BytesMut::new();
        for _ in 0..2 {
            assert_eq!(
                decoder.decode(&mut input, &mut out),
                Ok(WsEvent::Close { code: Some(1000) })
            );
            // The close repeats without input: nothing to wait for.
            assert!(!decoder.needs_input());
        }
        assert!(out.is_empty());
    }

    #[test]
    fn control_frames_are_built_unmasked() {
        assert_eq!(
            control_frame(Opcode::Pong, b"abc"),
            [0x8A, 3, b'a', b'b', b'c']
        );
        assert_eq!(control_frame(Opcode::Ping, b""), [0x89, 0]);
        let long = control_frame(Opcode::Pong, &[7; 200]);
        assert_eq!(long.len(), 2 + 125);
        assert_eq!(long[1], 125);
        let with_reason = close_frame_with_reason(
            close_code::POLICY_VIOLATION,
            "client must speak the derp subprotocol",
        );
        assert_eq!(&with_reason[..4], [0x88, 40, 0x03, 0xF0]);
        assert_eq!(&with_reason[4..], b"client must speak the derp subprotocol");
        // 'é' is two bytes; a cut must not split it.
        let cut = close_frame_with_reason(1000, &"é".repeat(100));
        assert_eq!(cut[1], 2 + 122);
        assert!(std::str::from_utf8(&cut[4..]).is_ok());
    }

    #[test]
    fn hostile_headers_are_rejected_with_the_right_code() {
        let mask = [1, 2, 3, 4];
        let cases: Vec<(Vec<u8>, WsError, u16)> = vec![
            (
                vec![0x82, 0x05, b'h', b'e', b'l', b'l', b'o'],
                WsError::Unmasked,
                1002,
            ),
            (
                client_frame(0x81, b"text", mask),
                WsError::TextMessage,
                1003,
            ),
            (client_frame(0xC2, b"x", mask), WsError::ReservedBits, 1002),
            (
                client_frame(0x83, b"x", mask),
                WsError::UnknownOpcode(3),
                1002,
            ),
            (
                client_frame(0x8B, b"x", mask),
                WsError::UnknownOpcode(0xB),
                1002,
            ),
            (
                client_frame(0x09, b"x", mask),
                WsError::FragmentedControl,
                1002,
            ),
            (
                client_frame(0x08, b"", mask),
                WsError::FragmentedControl,
                1002,
            ),
            (
                client_frame(0x89, &[0; 126], mask),
                WsError::ControlTooLong(126),
                1002,
            ),
            (
                client_frame(0x80, b"x", mask),
                WsError::UnexpectedContinuation,
                1002,
            ),
            (
                [
                    client_frame(0x02, b"a", mask),
                    client_frame(0x82, b"b", mask),
                ]
                .concat(),
                WsError::UnfinishedMessage,
                1002,
            ),
            (
                client_frame(0x88, &[3], mask),
                WsError::TruncatedClose,
                1002,
            ),
            (
                client_frame(0x88, &[0x03, 0xED], mask),
                WsError::InvalidCloseCode(1005),
                1002,
            ),
            (
                client_frame(0x88, &[0, 1], mask),
                WsError::InvalidCloseCode(1),
                1002,
            ),
            (
                client_frame(0x88, &[0x03, 0xE8, 0xFF], mask),
                WsError::InvalidCloseReason,
                1007,
            ),
        ];
        for (bytes, expected, code) in cases {
            assert_eq!(first_error(&bytes), Some(expected), "{bytes:02x?}");
            assert_eq!(expected.close_code(), code);
        }
    }

    #[test]
    fn oversize_lengths_are_rejected_before_any_payload_or_mask_arrives() {
        let too_big = MAX_FRAME_PAYLOAD + 1;
        let mut header = vec![0x82, MASK_BIT | 127];
        header.extend_from_slice(&too_big.to_be_bytes());
        let err = WsError::FrameTooLarge {
            len: too_big,
            max: MAX_FRAME_PAYLOAD,
        };
        assert_eq!(first_error(&header), Some(err));
        assert_eq!(err.close_code(), 1009);

        let mut huge = vec![0x82, MASK_BIT | 127];
        huge.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(first_error(&huge), Some(WsError::InvalidLength));
        huge[2] = 0x7F;
        assert!(matches!(
            first_error(&huge),
            Some(WsError::FrameTooLarge { .. })
        ));

        // Exactly at the limit is fine and is streamed, not buffered.
        let mut at_limit = vec![0x82, MASK_BIT | 127];
        at_limit.extend_from_slice(&MAX_FRAME_PAYLOAD.to_be_bytes());
        at_limit.extend_from_slice(&[0, 0, 0, 0, 42]);
        let (out, _, err) = run(&[&at_limit]);
        assert_eq!((out, err), (vec![42], None));
    }

    #[test]
    fn errors_are_sticky() {
        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::from(&[0x82, 0x00][..]);
        let mut out = BytesMut::new();
        assert_eq!(decoder.decode(&mut input, &mut out), Err(WsError::Unmasked));
        input.extend_from_slice(&client_frame(0x82, b"ok", [0; 4]));
        assert_eq!(decoder.decode(&mut input, &mut out), Err(WsError::Unmasked));
        assert!(out.is_empty());
    }

    #[test]
    fn unmask_matches_bytewise_xor_for_all_lengths_and_phases() {
        let mask = [0x12, 0x34, 0x56, 0x78];
        for len in 0..40 {
            for phase in 0..4 {
                let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
                let mut rotated = mask;
                rotated.rotate_left(phase);
                let mut fast = data.clone();
                unmask(&mut fast, rotated);
                let slow: Vec<u8> = data
                    .iter()
                    .enumerate()
                    .map(|(i, b)| b ^ mask[(i + phase) % 4])
                    .collect();
                assert_eq!(fast, slow, "len {len} phase {phase}");
            }
        }
    }

    /// xorshift64*: deterministic, dependency-free noise for the robustness tests.
    struct Prng(u64);

    impl Prng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u64) -> usize {
            (self.next() % n) as usize
        }
    }

    #[test]
    fn random_input_never_panics_and_output_never_exceeds_input() {
        let mut rng = Prng(0x9E37_79B9_7F4A_7C15);
        let mut errors = 0;
        for _ in 0..5000 {
            let len = rng.below(300);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            // Bias half the cases towards plausible headers so decoding gets past byte 0.
            if len >= 2 && rng.below(2) == 0 {
                bytes[0] = [0x82, 0x02, 0x80, 0x89, 0x8A, 0x88][rng.below(6)];
                bytes[1] |= MASK_BIT;
            }
            let mut chunks = Vec::new();
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                let (chunk, tail) = rest.split_at(1 + rng.below(rest.len() as u64));
                chunks.push(chunk);
                rest = tail;
            }
            let (out, _, err) = run(&chunks);
            assert!(out.len() <= bytes.len());
            errors += usize::from(err.is_some());
        }
        assert!(errors > 0);
    }

    #[test]
    fn random_valid_streams_decode_at_random_splits() {
        let mut rng = Prng(42);
        for _ in 0..200 {
            let mut stream = Vec::new();
            let mut expected = Vec::new();
            let mut pings = Vec::new();
            for _ in 0..rng.below(8) {
                let mask = (rng.next() as u32).to_ne_bytes();
                if rng.below(4) == 0 {
                    let ping: Vec<u8> = (0..rng.below(126)).map(|_| rng.next() as u8).collect();
                    stream.extend(client_frame(0x89, &ping, mask));
                    pings.push(WsEvent::Ping(Bytes::from(ping)));
                } else {
                    let len = [rng.below(126), rng.below(70_000)][rng.below(2)];
                    let payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                    stream.extend(client_frame(0x82, &payload, mask));
                    expected.extend(payload);
                }
            }
            let mut chunks = Vec::new();
            let mut rest = &stream[..];
            while !rest.is_empty() {
                let (chunk, tail) = rest.split_at(1 + rng.below(rest.len().min(5000) as u64));
                chunks.push(chunk);
                rest = tail;
            }
            let (out, events, err) = run(&chunks);
            assert_eq!(err, None);
            assert!(out == expected);
            assert_eq!(events, pings);
        }
    }

    /// Decodes `first` with one decoder and, after a snapshot passed through its encoding,
    /// the rest with another; the undecoded input travels along, as it must.
    fn run_resumed(first: &[u8], rest: &[u8]) -> (Vec<u8>, Vec<WsEvent>, Option<WsError>) {
        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::from(first);
        let mut out = BytesMut::new();
        let mut events = Vec::new();
        loop {
            match decoder.decode(&mut input, &mut out) {
                Ok(WsEvent::NeedMore) => break,
                Ok(WsEvent::Close { code }) => {
                    // Nothing to hand on: the stream ends here either way.
                    assert_eq!(decoder.snapshot(), Err(WsSnapshotError::Closed { code }));
                    events.push(WsEvent::Close { code });
                    return (out.to_vec(), events, None);
                }
                Ok(event) => events.push(event),
                Err(err) => panic!("first part: {err}"),
            }
        }
        let mut encoded = Vec::new();
        decoder.snapshot().expect("snapshot").encode(&mut encoded);
        let snapshot = WsSnapshot::decode(&encoded).expect("decode snapshot");
        let mut resumed = WsDecoder::resume(snapshot).expect("resume");
        input.extend_from_slice(rest);
        loop {
            match resumed.decode(&mut input, &mut out) {
                Ok(WsEvent::NeedMore) => break,
                Ok(event @ WsEvent::Close { .. }) => {
                    events.push(event);
                    break;
                }
                Ok(event) => events.push(event),
                Err(err) => return (out.to_vec(), events, Some(err)),
            }
        }
        (out.to_vec(), events, None)
    }

    #[test]
    fn a_resumed_decoder_continues_the_recorded_client_stream_from_any_byte() {
        let frames = recorded_c2s_frames();
        let whole = run(&[&frames]);
        assert_eq!(whole.0, recorded_c2s_derp());
        for cut in 0..=frames.len() {
            let (first, rest) = frames.split_at(cut);
            assert_eq!(run_resumed(first, rest), whole, "cut at {cut}");
        }
    }

    #[test]
    fn a_snapshot_inside_a_payload_carries_the_mask_where_it_stopped() {
        let mask = [0x11, 0x22, 0x33, 0x44];
        let frame = client_frame(0x02, b"hello", mask);
        // Header (6 bytes) and three payload bytes: the next byte is unmasked with mask[3].
        let mut decoder = WsDecoder::new(Role::Server);
        let (mut input, mut out) = (BytesMut::from(&frame[..9]), BytesMut::new());
        assert_eq!(decoder.decode(&mut input, &mut out), Ok(WsEvent::NeedMore));
        let snapshot = decoder.snapshot().expect("snapshot");
        assert_eq!(
            snapshot,
            WsSnapshot {
                role: Role::Server,
                max_payload: MAX_FRAME_PAYLOAD,
                in_message: true,
                payload: Some(WsPayload {
                    remaining: 2,
                    mask: [0x44, 0x11, 0x22, 0x33],
                }),
            }
        );
        let mut encoded = Vec::new();
        snapshot.encode(&mut encoded);
        assert_eq!(encoded.len(), snapshot.encoded_len());
        assert_eq!(
            hex::encode(&encoded),
            "0100030000000000110000000000000000000244112233"
        );
        // Between frames, with no message open: the short form.
        let between = WsDecoder::new(Role::Client).snapshot().expect("snapshot");
        let mut encoded = Vec::new();
        between.encode(&mut encoded);
        assert_eq!(hex::encode(&encoded), "0101007fffffffffffffff");
        assert_eq!(WsSnapshot::decode(&encoded), Ok(between));
    }

    #[test]
    fn a_closed_or_failed_stream_has_no_snapshot() {
        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::from(&client_frame(0x88, &1001u16.to_be_bytes(), [1; 4])[..]);
        let mut out = BytesMut::new();
        assert_eq!(
            decoder.decode(&mut input, &mut out),
            Ok(WsEvent::Close { code: Some(1001) })
        );
        assert_eq!(
            decoder.snapshot(),
            Err(WsSnapshotError::Closed { code: Some(1001) })
        );

        let mut decoder = WsDecoder::new(Role::Server);
        let mut input = BytesMut::from(&[0x82, 0x00][..]);
        assert_eq!(decoder.decode(&mut input, &mut out), Err(WsError::Unmasked));
        assert_eq!(
            decoder.snapshot(),
            Err(WsSnapshotError::Failed(WsError::Unmasked))
        );
    }

    #[test]
    fn malformed_snapshots_are_refused() {
        let valid = hex::decode("0100030000000000110000000000000000000244112233").unwrap();
        let with = |i: usize, b: u8| {
            let mut v = valid.clone();
            v[i] = b;
            v
        };
        let length = |len, expected| WsSnapshotError::Length { len, expected };
        let cases: Vec<(Vec<u8>, WsSnapshotError)> = vec![
            (vec![], length(0, 11)),
            (vec![1, 0], length(2, 11)),
            (valid[..11].to_vec(), length(11, 23)),
            (valid[..22].to_vec(), length(22, 23)),
            ([&valid[..], &[0]].concat(), length(24, 23)),
            (with(2, 0x01), length(23, 11)),
            (with(0, 2), WsSnapshotError::Version(2)),
            (with(0, 0), WsSnapshotError::Version(0)),
            (with(1, 2), WsSnapshotError::Role(2)),
            (with(2, 0x07), WsSnapshotError::Flags(0x07)),
            (
                with(3, 0x80),
                WsSnapshotError::MaxPayload(0x8000_0000_0011_0000),
            ),
            (
                with(18, 0),
                WsSnapshotError::Remaining {
                    remaining: 0,
                    max_payload: MAX_FRAME_PAYLOAD,
                },
            ),
            (
                with(16, 0x12),
                WsSnapshotError::Remaining {
                    remaining: 0x12_0002,
                    max_payload: MAX_FRAME_PAYLOAD,
                },
            ),
        ];
        for (bytes, want) in cases {
            assert_eq!(WsSnapshot::decode(&bytes), Err(want), "{bytes:02x?}");
        }
        // The same checks guard a snapshot built by hand.
        let snapshot = WsSnapshot::decode(&valid).expect("valid");
        let bad = WsSnapshot {
            payload: Some(WsPayload {
                remaining: MAX_FRAME_PAYLOAD + 1,
                mask: [0; 4],
            }),
            ..snapshot
        };
        assert!(matches!(
            WsDecoder::resume(bad),
            Err(WsSnapshotError::Remaining { .. })
        ));
        let bad = WsSnapshot {
            max_payload: u64::MAX,
            payload: None,
            ..snapshot
        };
        assert_eq!(
            WsDecoder::resume(bad).err(),
            Some(WsSnapshotError::MaxPayload(u64::MAX))
        );
    }

    #[test]
    fn arbitrary_snapshot_bytes_never_panic_and_what_decodes_re_encodes_the_same() {
        let mut rng = Prng(0x5EED_0F5A_4B54_0701);
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut bytes: Vec<u8> = (0..rng.below(26)).map(|_| rng.next() as u8).collect();
            // Bias most cases towards the valid header so the later checks are reached.
            if bytes.len() >= 3 && rng.below(4) != 0 {
                bytes[0] = SNAPSHOT_VERSION;
                bytes[1] = rng.below(2) as u8;
                bytes[2] &= SNAPSHOT_IN_MESSAGE | SNAPSHOT_PAYLOAD;
                if let Some(b) = bytes.get_mut(3) {
                    *b &= 0x7f;
                }
            }
            let Ok(snapshot) = WsSnapshot::decode(&bytes) else {
                continue;
            };
            accepted += 1;
            let mut again = Vec::new();
            snapshot.encode(&mut again);
            assert_eq!(again, bytes);
            let mut decoder = WsDecoder::resume(snapshot).expect("a decoded snapshot resumes");
            assert_eq!(decoder.snapshot(), Ok(snapshot));
            // And the decoder it gives works on whatever comes next.
            let tail: Vec<u8> = (0..rng.below(40)).map(|_| rng.next() as u8).collect();
            let mut input = BytesMut::from(&tail[..]);
            let mut out = BytesMut::new();
            let _ = decoder.decode(&mut input, &mut out);
            assert!(out.len() <= tail.len());
        }
        assert!(accepted > 100, "only {accepted} snapshots decoded");
    }

    /// The client side: decoding what a server sends.
    mod client_role {
        use super::super::Opcode::*;
        use super::super::*;

        /// Builds a frame the way a server (or a test peer) would.
        fn frame(fin: bool, opcode: Opcode, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
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
        fn run(input: &[u8], step: usize) -> Result<(Vec<u8>, Vec<WsEvent>), WsError> {
            let mut dec = WsDecoder::new(Role::Client);
            let mut raw = BytesMut::new();
            let mut out = BytesMut::new();
            let mut controls = Vec::new();
            for chunk in input.chunks(step) {
                raw.extend_from_slice(chunk);
                loop {
                    match dec.decode(&mut raw, &mut out)? {
                        WsEvent::NeedMore => break,
                        close @ WsEvent::Close { .. } => {
                            controls.push(close);
                            return Ok((out.to_vec(), controls));
                        }
                        event => controls.push(event),
                    }
                }
            }
            assert!(raw.is_empty(), "decoder left {} bytes", raw.len());
            Ok((out.to_vec(), controls))
        }

        #[test]
        fn accept_key_trims_spaces_and_tabs_only() {
            let key = "dGhlIHNhbXBsZSBub25jZQ==";
            assert_eq!(accept_key(&format!(" \t{key} ")), accept_key(key));
            // Go keeps a no-break space, so the hash covers it (found by the
            // upgrade_response fuzz target).
            assert_ne!(accept_key(&format!("{key}\u{a0}")), accept_key(key));
            assert_ne!(accept_key(&format!("{key}\r")), accept_key(key));
        }

        #[test]
        fn new_keys_are_24_characters_of_base64() {
            assert_eq!(new_key([7; 16]).len(), 24);
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
                Close,
                &close_code::NORMAL.to_be_bytes(),
                [0x88, 0x4e, 0xd9, 0xcc],
            );
            assert_eq!(hex::encode(&out), "8882884ed9cc8ba6");
        }

        #[test]
        fn round_trips_masked_and_unmasked_frames_of_every_length_class() {
            for len in [0usize, 1, 125, 126, 127, 65535, 65536, 70000] {
                let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
                for mask in [None, Some([1, 2, 3, 4])] {
                    let f = frame(true, Binary, &payload, mask);
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
            let mut input = frame(false, Binary, b"hel", Some([9, 8, 7, 6]));
            input.extend(frame(false, Continuation, b"", None));
            // A ping between fragments is allowed and must not disturb the data.
            input.extend(frame(true, Ping, b"hi", None));
            input.extend(frame(true, Continuation, b"lo, ", Some([1, 1, 1, 1])));
            input.extend(frame(true, Binary, b"derp", None));
            input.extend(frame(true, Pong, b"x", None));
            for step in [1, 2, 5, input.len()] {
                let (data, controls) = run(&input, step).unwrap();
                assert_eq!(data, b"hello, derp");
                assert_eq!(controls, vec![WsEvent::Ping(Bytes::from_static(b"hi"))]);
            }
        }

        #[test]
        fn surfaces_close_with_and_without_code() {
            // The recorded server close echo: unmasked, code 1000.
            let (_, c) = run(&hex::decode("880203e8").unwrap(), 1).unwrap();
            assert_eq!(c, vec![WsEvent::Close { code: Some(1000) }]);
            let (_, c) = run(&frame(true, Close, b"", None), 1).unwrap();
            assert_eq!(c, vec![WsEvent::Close { code: None }]);
            let mut with_reason = 1011u16.to_be_bytes().to_vec();
            with_reason.extend_from_slice(b"bye");
            let (_, c) = run(&frame(true, Close, &with_reason, Some([5, 6, 7, 8])), 2).unwrap();
            assert_eq!(c, vec![WsEvent::Close { code: Some(1011) }]);
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
                (frame(true, Text, b"hi", None), WsError::TextMessage),
                (
                    frame(true, Continuation, b"x", None),
                    WsError::UnexpectedContinuation,
                ),
                (
                    [
                        frame(false, Binary, b"x", None),
                        frame(true, Binary, b"y", None),
                    ]
                    .concat(),
                    WsError::UnfinishedMessage,
                ),
                (frame(false, Ping, b"", None), WsError::FragmentedControl),
                (
                    frame(true, Ping, &[0; 126], None),
                    WsError::ControlTooLong(126),
                ),
                (frame(true, Close, &[3], None), WsError::TruncatedClose),
                (
                    vec![0x82, 0x7f, 0x80, 0, 0, 0, 0, 0, 0, 0],
                    WsError::InvalidLength,
                ),
            ];
            for (input, want) in cases {
                assert_eq!(run(&input, input.len()).err(), Some(want), "{input:02x?}");
            }
        }

        #[test]
        fn keeps_incomplete_header_and_control_frame_in_raw() {
            let mut dec = WsDecoder::new(Role::Client);
            let mut out = BytesMut::new();
            let mut raw = BytesMut::from(&[0x82u8, 0x7e, 0x01][..]);
            assert_eq!(dec.decode(&mut raw, &mut out), Ok(WsEvent::NeedMore));
            assert_eq!(raw.len(), 3);
            let mut raw = BytesMut::from(&frame(true, Ping, b"abc", None)[..4]);
            assert_eq!(dec.decode(&mut raw, &mut out), Ok(WsEvent::NeedMore));
            assert_eq!(raw.len(), 4);
            assert!(out.is_empty());
        }
    }
}
