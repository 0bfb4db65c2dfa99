//! Incremental frame decoders for both directions.
//!
//! Both decoders read from a caller-owned [`BytesMut`] and return `Ok(None)` until a whole
//! frame (or the part of it that matters) has arrived. Payloads come back as
//! [`Bytes`] slices of that buffer, so decoding copies and allocates nothing per
//! frame. A frame's length is checked against its type's limits as soon as its header is in,
//! before any body is waited for. Skipped frames are reported at once as `Unknown` and their
//! bodies are then discarded as they arrive, whatever their size, without ever being held in
//! memory. After an error the connection is to be closed; the decoder's state is unspecified.
//! Between frames a server decoder remembers only how much of a skipped body is still to
//! come ([`ServerDecoder::skipping`]), so one can be resumed elsewhere from that count and the
//! undecoded bytes ([`ServerDecoder::resume_skipping`]).

use bytes::{Buf, Bytes, BytesMut};

use crate::frame::{
    CLIENT_MAX_FRAME_LEN, ClientToRelay, FRAME_HEADER_LEN, FrameType, KEY_LEN, MAGIC,
    MAX_CLIENT_INFO_LEN, MAX_INFO_LEN, MAX_PACKET_SIZE, MAX_PING_LEN, MAX_SERVER_KEY_LEN,
    NONCE_LEN, OBSERVED_ADDR_LEN, PEER_PRESENT_LEN, PeerGoneReason, RelayToClient, parse_header,
    peer_present_addr,
};
use crate::keys::PublicKey;

/// A frame that breaks the reading side's rules; the connection should be closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header announced more bytes than this frame type allows.
    #[error("frame type {frame_type:#04x} too large: {len} bytes")]
    FrameTooLarge {
        /// The raw frame type byte.
        frame_type: u8,
        /// The announced payload length.
        len: u32,
    },
    /// The header announced fewer bytes than this frame type needs.
    #[error("frame type {frame_type:#04x} too short: {len} bytes")]
    FrameTooShort {
        /// The raw frame type byte.
        frame_type: u8,
        /// The announced payload length.
        len: u32,
    },
    /// The frame type requires an exact length and this is not it.
    #[error("frame type {frame_type:#04x} has wrong length {len}")]
    WrongLength {
        /// The raw frame type byte.
        frame_type: u8,
        /// The announced payload length.
        len: u32,
    },
    /// A frame type that is not allowed at this point (the server expects ClientInfo first).
    #[error("unexpected frame type {frame_type:#04x}")]
    UnexpectedFrame {
        /// The raw frame type byte.
        frame_type: u8,
    },
    /// A ServerKey frame without the DERP magic.
    #[error("bad ServerKey magic")]
    BadMagic,
}

/// How to read the frame whose header is at the front of the buffer.
enum Plan {
    /// Report `Unknown` now and discard the body as it arrives.
    Skip,
    /// Wait for the first `keep` payload bytes, decode them, and discard the rest of the body.
    Read { keep: usize },
}

/// Discards bytes of a skipped body; remembers how many are still to come. A frame's length
/// field is 32 bits, so the rest of one body fits in a `u32` (and a decoder in 8 bytes of
/// every connection's state).
#[derive(Debug, Default, Clone, Copy)]
struct Skipper {
    remaining: u32,
}

impl Skipper {
    /// Drops pending body bytes from `buf`; returns true once none are left to drop.
    fn drain(&mut self, buf: &mut BytesMut) -> bool {
        if self.remaining > 0 {
            let n = usize::try_from(self.remaining).map_or(buf.len(), |r| r.min(buf.len()));
            buf.advance(n);
            // n <= remaining, which is a u32.
            self.remaining -= n as u32;
        }
        self.remaining == 0
    }
}

/// The shared skeleton: drain skips, check the header, wait for the kept prefix, split it off.
///
/// Returns `Ok(None)` when more bytes are needed, else the type, header length and the kept
/// payload prefix (`None` payload means the frame was skipped).
fn next_frame(
    skipper: &mut Skipper,
    buf: &mut BytesMut,
    plan: impl FnOnce(u8, u32) -> Result<Plan, DecodeError>,
) -> Result<Option<(u8, u32, Option<BytesMut>)>, DecodeError> {
    if !skipper.drain(buf) {
        return Ok(None);
    }
    let Some(header) = buf.first_chunk::<FRAME_HEADER_LEN>() else {
        return Ok(None);
    };
    let (frame_type, len) = parse_header(header);
    let len_usize = len as usize;
    match plan(frame_type, len)? {
        Plan::Skip => {
            buf.advance(FRAME_HEADER_LEN);
            skipper.remaining = len;
            skipper.drain(buf);
            Ok(Some((frame_type, len, None)))
        }
        Plan::Read { keep } => {
            let keep = keep.min(len_usize);
            let needed = FRAME_HEADER_LEN + keep;
            if buf.len() < needed {
                buf.reserve(needed - buf.len());
                return Ok(None);
            }
            buf.advance(FRAME_HEADER_LEN);
            let payload = buf.split_to(keep);
            // keep <= len, which is a u32.
            skipper.remaining = (len_usize - keep) as u32;
            skipper.drain(buf);
            Ok(Some((frame_type, len, Some(payload))))
        }
    }
}

/// Reads a key from the front of `payload`, which the caller has sized to hold one.
fn take_key(payload: &mut BytesMut) -> PublicKey {
    let mut key = [0u8; KEY_LEN];
    key.copy_from_slice(&payload[..KEY_LEN]);
    payload.advance(KEY_LEN);
    PublicKey::from_bytes(key)
}

/// Reads eight bytes from the front of `payload`, which the caller has sized to hold them.
fn take_8(payload: &BytesMut) -> [u8; 8] {
    let mut data = [0u8; 8];
    data.copy_from_slice(&payload[..8]);
    data
}

fn check_range(frame_type: u8, len: u32, min: usize, max: usize) -> Result<(), DecodeError> {
    let n = len as usize;
    if n < min {
        Err(DecodeError::FrameTooShort { frame_type, len })
    } else if n > max {
        Err(DecodeError::FrameTooLarge { frame_type, len })
    } else {
        Ok(())
    }
}

fn check_exact(frame_type: u8, len: u32, want: usize) -> Result<(), DecodeError> {
    if len as usize == want {
        Ok(())
    } else {
        Err(DecodeError::WrongLength { frame_type, len })
    }
}

/// Decodes client-to-server frames with the reference server's rules.
#[derive(Debug, Clone, Default)]
pub struct ServerDecoder {
    handshake_done: bool,
    skipper: Skipper,
}

impl ServerDecoder {
    /// A decoder for a new connection: the first frame must be ClientInfo.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder for a connection whose ClientInfo was already read.
    pub fn after_handshake() -> Self {
        Self {
            handshake_done: true,
            skipper: Skipper::default(),
        }
    }

    /// Whether the ClientInfo frame has been decoded.
    pub fn handshake_done(&self) -> bool {
        self.handshake_done
    }

    /// Body bytes of a skipped frame (an unknown type, or the part of a Ping beyond its
    /// eight bytes) that have not arrived yet and will be discarded when they do. Together
    /// with the bytes not yet decoded, this is all a decoder remembers of the stream after the
    /// handshake: hand it to [`ServerDecoder::resume_skipping`] to continue elsewhere.
    pub fn skipping(&self) -> u32 {
        self.skipper.remaining
    }

    /// A decoder for a connection whose ClientInfo was already read, continuing one that was
    /// [`ServerDecoder::skipping`] `remaining` body bytes: those are discarded before the next
    /// header is read. Without them the middle of a skipped body would be taken for a header.
    pub fn resume_skipping(remaining: u32) -> Self {
        Self {
            handshake_done: true,
            skipper: Skipper { remaining },
        }
    }

    /// Decodes the next frame; `Ok(None)` means more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<ClientToRelay>, DecodeError> {
        let handshake_done = self.handshake_done;
        let Some((frame_type, len, payload)) =
            next_frame(&mut self.skipper, buf, |frame_type, len| {
                server_plan(handshake_done, frame_type, len)
            })?
        else {
            return Ok(None);
        };
        let Some(mut payload) = payload else {
            return Ok(Some(ClientToRelay::Unknown { frame_type, len }));
        };
        let msg = match FrameType::from_u8(frame_type) {
            Some(FrameType::ClientInfo) => {
                self.handshake_done = true;
                let key = take_key(&mut payload);
                ClientToRelay::ClientInfo {
                    key,
                    sealed: payload.freeze(),
                }
            }
            Some(FrameType::SendPacket) => {
                let dst = take_key(&mut payload);
                ClientToRelay::SendPacket {
                    dst,
                    packet: payload.freeze(),
                }
            }
            Some(FrameType::ForwardPacket) => {
                let src = take_key(&mut payload);
                let dst = take_key(&mut payload);
                ClientToRelay::ForwardPacket {
                    src,
                    dst,
                    packet: payload.freeze(),
                }
            }
            Some(FrameType::NotePreferred) => ClientToRelay::NotePreferred(payload[0] != 0),
            Some(FrameType::WatchConns) => ClientToRelay::WatchConns,
            Some(FrameType::ClosePeer) => ClientToRelay::ClosePeer(take_key(&mut payload)),
            Some(FrameType::Ping) => ClientToRelay::Ping(take_8(&payload)),
            // server_plan only reads the types above.
            _ => ClientToRelay::Unknown { frame_type, len },
        };
        Ok(Some(msg))
    }
}

/// The server's size rules. Every `Read` plan here guarantees the payload is long enough for
/// the field accesses in [`ServerDecoder::decode`].
fn server_plan(handshake_done: bool, frame_type: u8, len: u32) -> Result<Plan, DecodeError> {
    let n = len as usize;
    if !handshake_done {
        if frame_type != FrameType::ClientInfo as u8 {
            return Err(DecodeError::UnexpectedFrame { frame_type });
        }
        check_range(frame_type, len, KEY_LEN + NONCE_LEN, MAX_CLIENT_INFO_LEN)?;
        return Ok(Plan::Read { keep: n });
    }
    let Some(ty) = FrameType::from_u8(frame_type) else {
        return Ok(Plan::Skip);
    };
    match ty {
        FrameType::SendPacket => check_range(frame_type, len, KEY_LEN, KEY_LEN + MAX_PACKET_SIZE)?,
        FrameType::ForwardPacket => {
            check_range(frame_type, len, 2 * KEY_LEN, 2 * KEY_LEN + MAX_PACKET_SIZE)?;
        }
        FrameType::NotePreferred => check_exact(frame_type, len, 1)?,
        FrameType::WatchConns => check_exact(frame_type, len, 0)?,
        FrameType::ClosePeer => check_exact(frame_type, len, KEY_LEN)?,
        FrameType::Ping => {
            check_range(frame_type, len, 8, MAX_PING_LEN)?;
            return Ok(Plan::Read { keep: 8 });
        }
        _ => return Ok(Plan::Skip),
    }
    Ok(Plan::Read { keep: n })
}

/// Decodes server-to-client frames with the Go client's rules.
#[derive(Debug, Clone, Default)]
pub struct ClientDecoder {
    skipper: Skipper,
}

impl ClientDecoder {
    /// A decoder for a new connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes the next frame; `Ok(None)` means more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<RelayToClient>, DecodeError> {
        let Some((frame_type, len, payload)) = next_frame(&mut self.skipper, buf, client_plan)?
        else {
            return Ok(None);
        };
        let Some(mut payload) = payload else {
            return Ok(Some(RelayToClient::Unknown { frame_type, len }));
        };
        let msg = match FrameType::from_u8(frame_type) {
            Some(FrameType::ServerKey) => {
                if payload[..MAGIC.len()] != MAGIC {
                    return Err(DecodeError::BadMagic);
                }
                payload.advance(MAGIC.len());
                RelayToClient::ServerKey(take_key(&mut payload))
            }
            Some(FrameType::ServerInfo) => RelayToClient::ServerInfo {
                sealed: payload.freeze(),
            },
            Some(FrameType::RecvPacket) => {
                let src = take_key(&mut payload);
                RelayToClient::RecvPacket {
                    src,
                    packet: payload.freeze(),
                }
            }
            Some(FrameType::KeepAlive) => RelayToClient::KeepAlive,
            Some(FrameType::PeerGone) => {
                let peer = take_key(&mut payload);
                let reason = payload.first().map_or(PeerGoneReason::Disconnected, |b| {
                    PeerGoneReason::from_u8(*b)
                });
                RelayToClient::PeerGone { peer, reason }
            }
            Some(FrameType::PeerPresent) => {
                let peer = take_key(&mut payload);
                let addr = match payload.first_chunk::<18>() {
                    Some(addr) => peer_present_addr(addr),
                    None => std::net::SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)),
                };
                let flags = payload.get(18).copied().unwrap_or(0);
                RelayToClient::PeerPresent { peer, addr, flags }
            }
            Some(FrameType::Ping) => RelayToClient::Ping(take_8(&payload)),
            Some(FrameType::Pong) => RelayToClient::Pong(take_8(&payload)),
            Some(FrameType::Health) => {
                RelayToClient::Health(String::from_utf8_lossy(&payload).into_owned())
            }
            Some(FrameType::Restarting) => RelayToClient::Restarting {
                reconnect_in_ms: payload.get_u32(),
                try_for_ms: payload.get_u32(),
            },
            Some(FrameType::ObservedAddr) => match payload.first_chunk::<OBSERVED_ADDR_LEN>() {
                Some(addr) => RelayToClient::ObservedAddr(peer_present_addr(addr)),
                None => RelayToClient::Unknown { frame_type, len },
            },
            // client_plan only reads the types above.
            _ => RelayToClient::Unknown { frame_type, len },
        };
        Ok(Some(msg))
    }
}

/// The Go client's size rules. Every `Read` plan here guarantees the payload is long enough
/// for the field accesses in [`ClientDecoder::decode`].
fn client_plan(frame_type: u8, len: u32) -> Result<Plan, DecodeError> {
    let n = len as usize;
    if n > CLIENT_MAX_FRAME_LEN {
        return Err(DecodeError::FrameTooLarge { frame_type, len });
    }
    let Some(ty) = FrameType::from_u8(frame_type) else {
        return Ok(Plan::Skip);
    };
    let (min, keep) = match ty {
        FrameType::ServerKey => {
            check_range(frame_type, len, MAGIC.len() + KEY_LEN, MAX_SERVER_KEY_LEN)?;
            return Ok(Plan::Read {
                keep: MAGIC.len() + KEY_LEN,
            });
        }
        FrameType::ServerInfo => {
            check_range(frame_type, len, NONCE_LEN, NONCE_LEN + MAX_INFO_LEN)?;
            return Ok(Plan::Read { keep: n });
        }
        FrameType::RecvPacket => (KEY_LEN, n),
        FrameType::KeepAlive => (0, 0),
        FrameType::Health => (0, n),
        FrameType::PeerGone => (KEY_LEN, KEY_LEN + 1),
        FrameType::PeerPresent => (KEY_LEN, PEER_PRESENT_LEN),
        FrameType::Ping | FrameType::Pong | FrameType::Restarting => (8, 8),
        // Room for later fields: only the first 18 bytes are read, a shorter frame is skipped.
        FrameType::ObservedAddr => (OBSERVED_ADDR_LEN, OBSERVED_ADDR_LEN),
        _ => return Ok(Plan::Skip),
    };
    if n < min {
        // The Go client drops short known frames and keeps reading.
        return Ok(Plan::Skip);
    }
    Ok(Plan::Read { keep })
}

/// DERP over QUIC: a SendPacket datagram as the server reads it, `(destination, packet)`.
///
/// A datagram holds exactly one whole frame: the 5-byte header, whose length field must equal
/// the datagram's length minus 5, then the body. Anything else (another type, a length that
/// disagrees, a body shorter than a key) is `None`: the caller drops it.
pub fn decode_send_packet_datagram(datagram: &Bytes) -> Option<(PublicKey, Bytes)> {
    keyed_datagram(datagram, FrameType::SendPacket)
}

/// DERP over QUIC: a RecvPacket datagram as the client reads it, `(source, packet)`, by the
/// same rules as [`decode_send_packet_datagram`].
pub fn decode_recv_packet_datagram(datagram: &Bytes) -> Option<(PublicKey, Bytes)> {
    keyed_datagram(datagram, FrameType::RecvPacket)
}

fn keyed_datagram(datagram: &Bytes, want: FrameType) -> Option<(PublicKey, Bytes)> {
    let header = datagram.first_chunk::<FRAME_HEADER_LEN>()?;
    let (frame_type, len) = parse_header(header);
    let body_len = datagram.len() - FRAME_HEADER_LEN;
    if frame_type != want as u8
        || len as usize != body_len
        || !(KEY_LEN..=KEY_LEN + MAX_PACKET_SIZE).contains(&body_len)
    {
        return None;
    }
    let mut key = [0u8; KEY_LEN];
    key.copy_from_slice(&datagram[FRAME_HEADER_LEN..FRAME_HEADER_LEN + KEY_LEN]);
    Some((
        PublicKey::from_bytes(key),
        datagram.slice(FRAME_HEADER_LEN + KEY_LEN..),
    ))
}

#[cfg(test)]
mod tests {
    use bytes::{BufMut, Bytes};

    use super::*;
    use crate::frame::{FrameType, write_header};

    fn frame(ty: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![ty];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn header(ty: u8, len: u32) -> BytesMut {
        let mut out = BytesMut::new();
        out.put_u8(ty);
        out.put_u32(len);
        out
    }

    fn server_one(bytes: &[u8]) -> Result<Option<ClientToRelay>, DecodeError> {
        ServerDecoder::after_handshake().decode(&mut BytesMut::from(bytes))
    }

    fn client_one(bytes: &[u8]) -> Result<Option<RelayToClient>, DecodeError> {
        ClientDecoder::new().decode(&mut BytesMut::from(bytes))
    }

    fn key(byte: u8) -> PublicKey {
        PublicKey::from_bytes([byte; 32])
    }

    /// Feeds `bytes` one at a time and collects everything decoded.
    fn client_bytewise(bytes: &[u8]) -> Vec<RelayToClient> {
        let mut decoder = ClientDecoder::new();
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for &b in bytes {
            buf.put_u8(b);
            while let Some(msg) = decoder.decode(&mut buf).unwrap() {
                out.push(msg);
            }
        }
        out
    }

    #[test]
    fn server_requires_client_info_first() {
        let mut decoder = ServerDecoder::new();
        assert!(!decoder.handshake_done());
        let ping = frame(0x12, &[0; 8]);
        assert_eq!(
            decoder.decode(&mut BytesMut::from(&ping[..])),
            Err(DecodeError::UnexpectedFrame { frame_type: 0x12 })
        );
        // Rejected from the header alone, before the body arrives.
        assert_eq!(
            ServerDecoder::new().decode(&mut header(0x02, 55)),
            Err(DecodeError::FrameTooShort {
                frame_type: 2,
                len: 55
            })
        );
        assert_eq!(
            ServerDecoder::new().decode(&mut header(0x02, 256 * 1024 + 1)),
            Err(DecodeError::FrameTooLarge {
                frame_type: 2,
                len: 256 * 1024 + 1
            })
        );
        assert_eq!(
            ServerDecoder::new().decode(&mut header(0x02, 256 * 1024)),
            Ok(None)
        );

        let mut payload = vec![7u8; 32];
        payload.extend_from_slice(&[1; 24]);
        let mut buf = BytesMut::from(&frame(0x02, &payload)[..]);
        buf.extend_from_slice(&frame(0x02, &payload));
        let mut decoder = ServerDecoder::new();
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::ClientInfo {
                key: key(7),
                sealed: Bytes::from(vec![1; 24]),
            }))
        );
        assert!(decoder.handshake_done());
        // A second ClientInfo is skipped like any undispatched type.
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::Unknown {
                frame_type: 2,
                len: 56
            }))
        );
        assert!(buf.is_empty());
    }

    #[test]
    fn a_resumed_server_decoder_discards_the_rest_of_a_skipped_body() {
        // Bodies that are themselves well-formed frames, so that reading into them instead of
        // past them shows up as extra messages rather than only as errors.
        let inner = frame(0x12, &[9; 8]).repeat(6);
        let mut stream = frame(0x7f, &inner);
        let mut long_ping = vec![5u8; 8];
        long_ping.extend_from_slice(&inner);
        stream.extend(frame(0x12, &long_ping));
        stream.extend(frame(0x12, &[1; 8]));
        let expected = vec![
            ClientToRelay::Unknown {
                frame_type: 0x7f,
                len: inner.len() as u32,
            },
            ClientToRelay::Ping([5; 8]),
            ClientToRelay::Ping([1; 8]),
        ];
        let mut cuts_inside_a_skip = 0;
        for cut in 0..=stream.len() {
            let mut first = ServerDecoder::after_handshake();
            let mut buf = BytesMut::from(&stream[..cut]);
            let mut got = Vec::new();
            while let Some(msg) = first.decode(&mut buf).expect("first part") {
                got.push(msg);
            }
            cuts_inside_a_skip += usize::from(first.skipping() > 0);
            let mut second = ServerDecoder::resume_skipping(first.skipping());
            buf.extend_from_slice(&stream[cut..]);
            while let Some(msg) = second.decode(&mut buf).expect("second part") {
                got.push(msg);
            }
            assert_eq!(got, expected, "cut at {cut}");
            assert!(buf.is_empty(), "cut at {cut}");
            assert_eq!(second.skipping(), 0);
        }
        assert_eq!(cuts_inside_a_skip, 2 * inner.len());
    }

    #[test]
    fn server_size_rules() {
        let too_short = |frame_type, len| Err(DecodeError::FrameTooShort { frame_type, len });
        let too_large = |frame_type, len| Err(DecodeError::FrameTooLarge { frame_type, len });
        let wrong = |frame_type, len| Err(DecodeError::WrongLength { frame_type, len });
        let cases: [(u8, u32, Result<Option<ClientToRelay>, DecodeError>); 14] = [
            (0x04, 31, too_short(0x04, 31)),
            (0x04, 32 + 65537, too_large(0x04, 32 + 65537)),
            (0x0a, 63, too_short(0x0a, 63)),
            (0x0a, 64 + 65537, too_large(0x0a, 64 + 65537)),
            (0x07, 0, wrong(0x07, 0)),
            (0x07, 2, wrong(0x07, 2)),
            (0x10, 1, wrong(0x10, 1)),
            (0x11, 31, wrong(0x11, 31)),
            (0x11, 33, wrong(0x11, 33)),
            (0x12, 7, too_short(0x12, 7)),
            (0x12, 1001, too_large(0x12, 1001)),
            (0x04, u32::MAX, too_large(0x04, u32::MAX)),
            // In range: waiting for the body, nothing buffered beyond the header.
            (0x04, 32 + 65536, Ok(None)),
            (0x0a, 64 + 65536, Ok(None)),
        ];
        for (ty, len, want) in cases {
            let got = ServerDecoder::after_handshake().decode(&mut header(ty, len));
            assert_eq!(got, want, "type {ty:#04x} len {len}");
        }
    }

    #[test]
    fn server_decodes_dispatched_frames() {
        let mut send = vec![2u8; 32];
        send.extend_from_slice(b"pkt");
        assert_eq!(
            server_one(&frame(0x04, &send)),
            Ok(Some(ClientToRelay::SendPacket {
                dst: key(2),
                packet: Bytes::from_static(b"pkt")
            }))
        );
        assert_eq!(
            server_one(&frame(0x04, &[2; 32])),
            Ok(Some(ClientToRelay::SendPacket {
                dst: key(2),
                packet: Bytes::new()
            }))
        );
        let mut fwd = vec![1u8; 32];
        fwd.extend_from_slice(&[2; 32]);
        fwd.extend_from_slice(b"x");
        assert_eq!(
            server_one(&frame(0x0a, &fwd)),
            Ok(Some(ClientToRelay::ForwardPacket {
                src: key(1),
                dst: key(2),
                packet: Bytes::from_static(b"x")
            }))
        );
        for (byte, want) in [(0u8, false), (1, true), (2, true), (0xff, true)] {
            assert_eq!(
                server_one(&frame(0x07, &[byte])),
                Ok(Some(ClientToRelay::NotePreferred(want)))
            );
        }
        assert_eq!(
            server_one(&frame(0x10, &[])),
            Ok(Some(ClientToRelay::WatchConns))
        );
        assert_eq!(
            server_one(&frame(0x11, &[5; 32])),
            Ok(Some(ClientToRelay::ClosePeer(key(5))))
        );
        // Go's TestServerRepliesToPing data.
        assert_eq!(
            server_one(&frame(0x12, &[1, 2, 3, 4, 5, 6, 7, 0x2a])),
            Ok(Some(ClientToRelay::Ping([1, 2, 3, 4, 5, 6, 7, 0x2a])))
        );
    }

    #[test]
    fn server_ping_extra_bytes_are_discarded() {
        let mut payload = vec![9u8; 1000];
        payload[..8].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let mut buf = BytesMut::from(&frame(0x12, &payload)[..]);
        buf.extend_from_slice(&frame(0x10, &[]));
        let mut decoder = ServerDecoder::after_handshake();
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::Ping([1, 2, 3, 4, 5, 6, 7, 8])))
        );
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::WatchConns))
        );
        assert_eq!(decoder.decode(&mut buf), Ok(None));
    }

    #[test]
    fn server_skips_undispatched_types() {
        for ty in [
            0x01, 0x03, 0x05, 0x06, 0x08, 0x09, 0x0b, 0x13, 0x14, 0x15, 0x00, 0xff,
        ] {
            let mut buf = BytesMut::from(&frame(ty, &[1, 2, 3])[..]);
            buf.extend_from_slice(&frame(0x10, &[]));
            let mut decoder = ServerDecoder::after_handshake();
            assert_eq!(
                decoder.decode(&mut buf),
                Ok(Some(ClientToRelay::Unknown {
                    frame_type: ty,
                    len: 3
                }))
            );
            assert_eq!(
                decoder.decode(&mut buf),
                Ok(Some(ClientToRelay::WatchConns))
            );
        }
    }

    #[test]
    fn huge_unknown_frames_stream_without_buffering() {
        // Announce 4 GiB - 1 bytes: reported at once, then drained chunk by chunk.
        let mut decoder = ServerDecoder::after_handshake();
        let mut buf = header(0x0b, u32::MAX);
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::Unknown {
                frame_type: 0x0b,
                len: u32::MAX
            }))
        );
        let chunk = vec![0x12u8; 64 * 1024];
        for _ in 0..64 {
            buf.extend_from_slice(&chunk);
            assert_eq!(decoder.decode(&mut buf), Ok(None));
            assert!(buf.is_empty());
        }

        // A 3 MiB skip followed by a real frame, fed in odd-sized pieces.
        let mut decoder = ServerDecoder::after_handshake();
        let mut stream = header(0xfe, 3 << 20).to_vec();
        stream.extend(std::iter::repeat_n(0x12u8, 3 << 20));
        stream.extend_from_slice(&frame(0x10, &[]));
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for piece in stream.chunks(10_007) {
            buf.extend_from_slice(piece);
            while let Some(msg) = decoder.decode(&mut buf).unwrap() {
                got.push(msg);
            }
            assert!(buf.len() < 10_007 + 5);
        }
        assert_eq!(
            got,
            [
                ClientToRelay::Unknown {
                    frame_type: 0xfe,
                    len: 3 << 20
                },
                ClientToRelay::WatchConns
            ]
        );
    }

    /// Go's TestClientRecv cases.
    #[test]
    fn client_recv_go_cases() {
        let cases = [
            (
                frame(0x12, &[1, 2, 3, 4, 5, 6, 7, 8]),
                RelayToClient::Ping([1, 2, 3, 4, 5, 6, 7, 8]),
            ),
            (
                frame(0x13, &[1, 2, 3, 4, 5, 6, 7, 8]),
                RelayToClient::Pong([1, 2, 3, 4, 5, 6, 7, 8]),
            ),
            (frame(0x14, b"BAD"), RelayToClient::Health("BAD".to_owned())),
            (frame(0x14, b""), RelayToClient::Health(String::new())),
            (
                frame(0x15, &[0, 0, 0, 1, 0, 0, 0, 2]),
                RelayToClient::Restarting {
                    reconnect_in_ms: 1,
                    try_for_ms: 2,
                },
            ),
        ];
        for (bytes, want) in cases {
            assert_eq!(client_one(&bytes), Ok(Some(want.clone())));
            assert_eq!(client_bytewise(&bytes), [want]);
        }
    }

    #[test]
    fn client_server_key_rules() {
        let mut payload = MAGIC.to_vec();
        payload.extend_from_slice(&[3; 32]);
        assert_eq!(
            client_one(&frame(0x01, &payload)),
            Ok(Some(RelayToClient::ServerKey(key(3))))
        );
        // Future bytes up to 1 KiB are discarded.
        let mut long = payload.clone();
        long.resize(1024, 0xee);
        let mut buf = BytesMut::from(&frame(0x01, &long)[..]);
        buf.extend_from_slice(&frame(0x06, &[]));
        let mut decoder = ClientDecoder::new();
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(RelayToClient::ServerKey(key(3))))
        );
        assert_eq!(decoder.decode(&mut buf), Ok(Some(RelayToClient::KeepAlive)));
        assert!(buf.is_empty());

        assert_eq!(
            client_one(&frame(0x01, &payload[..39])),
            Err(DecodeError::FrameTooShort {
                frame_type: 1,
                len: 39
            })
        );
        assert_eq!(
            ClientDecoder::new().decode(&mut header(0x01, 1025)),
            Err(DecodeError::FrameTooLarge {
                frame_type: 1,
                len: 1025
            })
        );
        let mut bad = payload;
        bad[7] ^= 1;
        assert_eq!(client_one(&frame(0x01, &bad)), Err(DecodeError::BadMagic));
    }

    #[test]
    fn client_size_rules() {
        assert_eq!(
            ClientDecoder::new().decode(&mut header(0x0b, (1 << 20) + 1)),
            Err(DecodeError::FrameTooLarge {
                frame_type: 0x0b,
                len: (1 << 20) + 1
            })
        );
        assert_eq!(
            ClientDecoder::new().decode(&mut header(0x05, 1 << 20)),
            Ok(None)
        );
        assert_eq!(
            client_one(&frame(0x03, &[0; 23])),
            Err(DecodeError::FrameTooShort {
                frame_type: 3,
                len: 23
            })
        );
        assert_eq!(
            client_one(&frame(0x03, &[0; 24])),
            Ok(Some(RelayToClient::ServerInfo {
                sealed: Bytes::from(vec![0; 24])
            }))
        );
        // Short known frames are dropped, not fatal.
        for (ty, len) in [
            (0x05u8, 31usize),
            (0x08, 31),
            (0x09, 31),
            (0x12, 7),
            (0x13, 7),
            (0x15, 7),
        ] {
            assert_eq!(
                client_one(&frame(ty, &vec![0; len])),
                Ok(Some(RelayToClient::Unknown {
                    frame_type: ty,
                    len: len as u32
                })),
                "type {ty:#04x}"
            );
        }
        // Client-bound decoders skip client-to-server types.
        for ty in [0x02u8, 0x04, 0x07, 0x0a, 0x10, 0x11, 0x0c, 0xff] {
            assert_eq!(
                client_one(&frame(ty, &[0; 40])),
                Ok(Some(RelayToClient::Unknown {
                    frame_type: ty,
                    len: 40
                }))
            );
        }
    }

    #[test]
    fn client_peer_gone_and_present_lengths() {
        assert_eq!(
            client_one(&frame(0x08, &[4; 32])),
            Ok(Some(RelayToClient::PeerGone {
                peer: key(4),
                reason: PeerGoneReason::Disconnected
            }))
        );
        let mut gone = vec![4u8; 32];
        gone.extend_from_slice(&[1, 0xaa, 0xbb]);
        assert_eq!(
            client_one(&frame(0x08, &gone)),
            Ok(Some(RelayToClient::PeerGone {
                peer: key(4),
                reason: PeerGoneReason::NotHere
            }))
        );

        let unspecified: std::net::SocketAddr = "[::]:0".parse().unwrap();
        let mut present = vec![4u8; 32];
        let at = |len: usize, present: &[u8]| client_one(&frame(0x09, &present[..len]));
        present.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1]);
        present.extend_from_slice(&[0x1f, 0x90, 0x06, 0x77]);
        let want = |addr, flags| {
            Ok(Some(RelayToClient::PeerPresent {
                peer: key(4),
                addr,
                flags,
            }))
        };
        assert_eq!(at(32, &present), want(unspecified, 0));
        assert_eq!(at(49, &present), want(unspecified, 0));
        assert_eq!(at(50, &present), want("10.0.0.1:8080".parse().unwrap(), 0));
        assert_eq!(at(51, &present), want("10.0.0.1:8080".parse().unwrap(), 6));
        assert_eq!(at(52, &present), want("10.0.0.1:8080".parse().unwrap(), 6));
    }

    #[test]
    fn client_observed_addr_reads_18_bytes_and_skips_short_frames() {
        let mut body = vec![0u8; 10];
        body.extend_from_slice(&[0xff, 0xff, 198, 51, 100, 7, 0xa2, 0xa9]);
        assert_eq!(
            client_one(&frame(0xf1, &body)),
            Ok(Some(RelayToClient::ObservedAddr(
                "198.51.100.7:41641".parse().unwrap()
            )))
        );
        let mut longer = body.clone();
        longer.extend_from_slice(b"later fields");
        assert_eq!(
            client_bytewise(&frame(0xf1, &longer)),
            [RelayToClient::ObservedAddr(
                "198.51.100.7:41641".parse().unwrap()
            )]
        );
        assert_eq!(
            client_one(&frame(0xf1, &body[..17])),
            Ok(Some(RelayToClient::Unknown {
                frame_type: 0xf1,
                len: 17
            }))
        );
        // A client sending it is skipped like any type the server does not handle.
        let mut decoder = ServerDecoder::after_handshake();
        let mut buf = BytesMut::from(&frame(0xf1, &body)[..]);
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(ClientToRelay::Unknown {
                frame_type: 0xf1,
                len: 18
            }))
        );
    }

    #[test]
    fn datagrams_hold_exactly_one_packet_frame() {
        // The example of docs/protocol.md: "hello" to key 00 01 .. 1f.
        let dst: [u8; 32] = std::array::from_fn(|i| i as u8);
        let mut d = vec![0x04, 0, 0, 0, 0x25];
        d.extend_from_slice(&dst);
        d.extend_from_slice(b"hello");
        assert_eq!(d.len(), 42);
        let d = Bytes::from(d);
        let (key, packet) = decode_send_packet_datagram(&d).expect("valid");
        assert_eq!(key, PublicKey::from_bytes(dst));
        assert_eq!(&packet[..], b"hello");
        // The payload is a slice of the datagram, not a copy.
        assert_eq!(packet.as_ptr(), d[37..].as_ptr());
        assert_eq!(decode_recv_packet_datagram(&d), None, "wrong type");
        let mut recv = d.to_vec();
        recv[0] = 0x05;
        assert!(decode_recv_packet_datagram(&Bytes::from(recv)).is_some());

        let bad = |bytes: &[u8]| decode_send_packet_datagram(&Bytes::copy_from_slice(bytes));
        assert_eq!(bad(&d[..41]), None, "length field disagrees (short)");
        let mut long = d.to_vec();
        long.push(0);
        assert_eq!(bad(&long), None, "length field disagrees (long)");
        assert_eq!(bad(&[0x04, 0, 0, 0, 0]), None, "no key");
        assert_eq!(bad(&[0x04, 0, 0]), None, "no header");
        assert_eq!(bad(&[]), None);
        let mut empty_packet = vec![0x04, 0, 0, 0, 0x20];
        empty_packet.extend_from_slice(&dst);
        assert_eq!(bad(&empty_packet).map(|(_, p)| p.len()), Some(0));
    }

    #[test]
    fn client_health_is_lossy_utf8() {
        assert_eq!(
            client_one(&frame(0x14, b"a\xffb")),
            Ok(Some(RelayToClient::Health("a\u{fffd}b".to_owned())))
        );
    }

    #[test]
    fn client_keepalive_body_is_skipped() {
        let mut bytes = frame(0x06, &[1; 100]);
        bytes.extend_from_slice(&frame(0x12, &[5; 8]));
        assert_eq!(
            client_bytewise(&bytes),
            [RelayToClient::KeepAlive, RelayToClient::Ping([5; 8])]
        );
    }

    #[test]
    fn payloads_are_slices_of_the_input_buffer() {
        let mut buf = BytesMut::with_capacity(4096);
        for i in 0..4u8 {
            let mut payload = vec![i; 32];
            payload.extend_from_slice(&[i; 100]);
            write_header(&mut buf, FrameType::SendPacket, payload.len() as u32);
            buf.extend_from_slice(&payload);
        }
        let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let mut decoder = ServerDecoder::after_handshake();
        for i in 0..4u8 {
            let Some(ClientToRelay::SendPacket { dst, packet }) = decoder.decode(&mut buf).unwrap()
            else {
                panic!("expected SendPacket")
            };
            assert_eq!(dst, key(i));
            assert_eq!(packet[..], [i; 100]);
            assert!(
                range.contains(&(packet.as_ptr() as usize)),
                "payload was copied"
            );
        }
    }

    #[test]
    fn partial_frames_wait_for_more() {
        let mut decoder = ClientDecoder::new();
        let bytes = frame(0x13, &[1; 8]);
        let mut buf = BytesMut::new();
        for &b in &bytes[..bytes.len() - 1] {
            buf.put_u8(b);
            assert_eq!(decoder.decode(&mut buf), Ok(None));
        }
        buf.put_u8(1);
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Some(RelayToClient::Pong([1; 8])))
        );
        assert_eq!(decoder.decode(&mut buf), Ok(None));
    }
}
