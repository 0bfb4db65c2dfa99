//! Incremental frame decoders for both directions.
//!
//! Both decoders read from a caller-owned [`BytesMut`] and return `Ok(None)` until a whole
//! frame (or the part of it that matters) has arrived. Payloads come back as [`Bytes`] slices
//! of that buffer, so decoding copies and allocates nothing per frame. A frame's length is
//! checked against its type's limits as soon as its header is in, before any body is waited
//! for. Skipped frames are reported at once as `Unknown` and their bodies are then discarded as
//! they arrive, whatever their size, without ever being held in memory.

use bytes::{Buf, BytesMut};

use crate::frame::{
    CLIENT_MAX_FRAME_LEN, ClientToRelay, FRAME_HEADER_LEN, FrameType, KEY_LEN, MAGIC,
    MAX_CLIENT_INFO_LEN, MAX_INFO_LEN, MAX_PACKET_SIZE, MAX_PING_LEN, MAX_SERVER_KEY_LEN,
    NONCE_LEN, PEER_PRESENT_LEN, PeerGoneReason, RelayToClient, parse_header, peer_present_addr,
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

/// Discards bytes of a skipped body; remembers how many are still to come.
#[derive(Debug, Default, Clone, Copy)]
struct Skipper {
    remaining: u64,
}

impl Skipper {
    /// Drops pending body bytes from `buf`; returns true once none are left to drop.
    fn drain(&mut self, buf: &mut BytesMut) -> bool {
        if self.remaining > 0 {
            let n = usize::try_from(self.remaining).map_or(buf.len(), |r| r.min(buf.len()));
            buf.advance(n);
            self.remaining -= n as u64;
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
            skipper.remaining = u64::from(len);
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
            skipper.remaining = (len_usize - keep) as u64;
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
        _ => return Ok(Plan::Skip),
    };
    if n < min {
        // The Go client drops short known frames and keeps reading.
        return Ok(Plan::Skip);
    }
    Ok(Plan::Read { keep })
}
