//! A [`WsDecoder`]'s state between two calls, taken out as a [`WsSnapshot`] with a compact,
//! versioned encoding, and a decoder resumed from it (in another process).

use bytes::{Buf as _, BufMut};

use super::{Role, State, WsDecoder, WsError};

/// Version byte of [`WsSnapshot::encode`]'s format.
pub(super) const SNAPSHOT_VERSION: u8 = 1;
/// Encoded length of a snapshot taken between frames: version, role, flags, limit.
const SNAPSHOT_LEN_BETWEEN: usize = 1 + 1 + 1 + 8;
/// Encoded length of a snapshot taken inside a payload: the above, remaining length, mask.
const SNAPSHOT_LEN_PAYLOAD: usize = SNAPSHOT_LEN_BETWEEN + 8 + 4;
pub(super) const SNAPSHOT_IN_MESSAGE: u8 = 0x01;
pub(super) const SNAPSHOT_PAYLOAD: u8 = 0x02;

/// A [`WsDecoder`]'s whole state between two calls to [`WsDecoder::decode`], so that another
/// decoder (in another process) can continue the stream where this one stopped.
///
/// The decoder keeps no input of its own: an incomplete header or control frame stays in the
/// caller's input buffer, which must travel with the snapshot and be fed first to the resumed
/// decoder. Only a stream still being read has a snapshot; a closed or failed one is ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WsSnapshot {
    /// Which end of the connection the decoder serves.
    pub role: Role,
    /// The largest frame payload the decoder accepts. It resumes with the limit it had, so a
    /// frame it accepted is never refused halfway.
    pub max_payload: u64,
    /// A binary message is open (its last frame had FIN unset): the next data frame must be a
    /// continuation.
    pub in_message: bool,
    /// The binary or continuation frame whose payload was being streamed, if the decoder
    /// stopped inside one.
    pub payload: Option<WsPayload>,
}

/// Where a [`WsSnapshot`] stopped inside a frame's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WsPayload {
    /// Payload bytes still to come; at least one.
    pub remaining: u64,
    /// The masking key as it applies to the next payload byte: the frame's key rotated left by
    /// the number of payload bytes already consumed. All zeros for an unmasked frame.
    pub mask: [u8; 4],
}

/// Why a [`WsDecoder`] has no snapshot, or a snapshot is not one a decoder can resume from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WsSnapshotError {
    /// The peer closed the stream; nothing more is read from it.
    #[error("the WebSocket stream is closed")]
    Closed {
        /// The code of the peer's close frame, if it carried one.
        code: Option<u16>,
    },
    /// The peer broke the framing rules; the connection is ending.
    #[error("the WebSocket stream failed: {0}")]
    Failed(WsError),
    /// The encoding is not as long as its flags say.
    #[error("WebSocket snapshot of {len} bytes, expected {expected}")]
    Length {
        /// Bytes given.
        len: usize,
        /// Bytes the format needs.
        expected: usize,
    },
    /// An encoding version this build does not read.
    #[error("unknown WebSocket snapshot version {0}")]
    Version(u8),
    /// A role byte that names neither end.
    #[error("unknown WebSocket decoder role {0}")]
    Role(u8),
    /// Flag bits this version does not define.
    #[error("unknown WebSocket snapshot flags {0:#04x}")]
    Flags(u8),
    /// A payload limit above the 63 bits a frame length may use (RFC 6455 §5.2).
    #[error("WebSocket payload limit {0} is above 2^63 - 1")]
    MaxPayload(u64),
    /// A frame in progress with nothing left to read, or more than the limit allows.
    #[error("{remaining} WebSocket payload bytes remaining, outside 1..={max_payload}")]
    Remaining {
        /// The remaining count given.
        remaining: u64,
        /// The decoder's limit.
        max_payload: u64,
    },
}

impl WsSnapshot {
    /// The longest encoding, in bytes.
    pub const MAX_ENCODED_LEN: usize = SNAPSHOT_LEN_PAYLOAD;

    /// Length of [`WsSnapshot::encode`]'s output for this snapshot.
    pub fn encoded_len(&self) -> usize {
        if self.payload.is_some() {
            SNAPSHOT_LEN_PAYLOAD
        } else {
            SNAPSHOT_LEN_BETWEEN
        }
    }

    /// Appends the snapshot in a compact, versioned form: a version byte (1), the role (0 for
    /// [`Role::Server`], 1 for [`Role::Client`]), a flags byte (0x01 a message is open, 0x02 a
    /// payload is in progress), the payload limit as a big-endian `u64`, and for a payload in
    /// progress its remaining length (big-endian `u64`) and rotated mask: 11 or 23 bytes.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u8(SNAPSHOT_VERSION);
        out.put_u8(match self.role {
            Role::Server => 0,
            Role::Client => 1,
        });
        let mut flags = 0;
        if self.in_message {
            flags |= SNAPSHOT_IN_MESSAGE;
        }
        if self.payload.is_some() {
            flags |= SNAPSHOT_PAYLOAD;
        }
        out.put_u8(flags);
        out.put_u64(self.max_payload);
        if let Some(payload) = self.payload {
            out.put_u64(payload.remaining);
            out.put_slice(&payload.mask);
        }
    }

    /// Reads what [`WsSnapshot::encode`] wrote, exactly and only that: any other length, an
    /// unknown version, role or flag, or a state no decoder can be in is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, WsSnapshotError> {
        let length = |expected| WsSnapshotError::Length {
            len: bytes.len(),
            expected,
        };
        let Some(&version) = bytes.first() else {
            return Err(length(SNAPSHOT_LEN_BETWEEN));
        };
        if version != SNAPSHOT_VERSION {
            return Err(WsSnapshotError::Version(version));
        }
        let Some(&[_, role, flags]) = bytes.first_chunk::<3>() else {
            return Err(length(SNAPSHOT_LEN_BETWEEN));
        };
        let role = match role {
            0 => Role::Server,
            1 => Role::Client,
            other => return Err(WsSnapshotError::Role(other)),
        };
        if flags & !(SNAPSHOT_IN_MESSAGE | SNAPSHOT_PAYLOAD) != 0 {
            return Err(WsSnapshotError::Flags(flags));
        }
        let in_payload = flags & SNAPSHOT_PAYLOAD != 0;
        let expected = if in_payload {
            SNAPSHOT_LEN_PAYLOAD
        } else {
            SNAPSHOT_LEN_BETWEEN
        };
        if bytes.len() != expected {
            return Err(length(expected));
        }
        let mut rest = &bytes[3..];
        let max_payload = rest.get_u64();
        let payload = in_payload.then(|| {
            let remaining = rest.get_u64();
            let mut mask = [0u8; 4];
            rest.copy_to_slice(&mut mask);
            WsPayload { remaining, mask }
        });
        let snapshot = Self {
            role,
            max_payload,
            in_message: flags & SNAPSHOT_IN_MESSAGE != 0,
            payload,
        };
        snapshot.check()?;
        Ok(snapshot)
    }

    /// Whether a decoder can be in this state.
    fn check(&self) -> Result<(), WsSnapshotError> {
        if self.max_payload >> 63 != 0 {
            return Err(WsSnapshotError::MaxPayload(self.max_payload));
        }
        if let Some(WsPayload { remaining, .. }) = self.payload
            && (remaining == 0 || remaining > self.max_payload)
        {
            return Err(WsSnapshotError::Remaining {
                remaining,
                max_payload: self.max_payload,
            });
        }
        Ok(())
    }
}

impl WsDecoder {
    /// The decoder's state, to continue the stream elsewhere with [`WsDecoder::resume`]
    /// (together with the undecoded input). A closed or failed stream has none.
    pub fn snapshot(&self) -> Result<WsSnapshot, WsSnapshotError> {
        let payload = match self.state {
            State::Header => None,
            State::Payload { remaining, mask } => Some(WsPayload { remaining, mask }),
            State::Closed { code } => return Err(WsSnapshotError::Closed { code }),
            State::Failed(err) => return Err(WsSnapshotError::Failed(err)),
        };
        Ok(WsSnapshot {
            role: self.role,
            max_payload: self.max_payload,
            in_message: self.in_message,
            payload,
        })
    }

    /// A decoder that continues where the one [`WsDecoder::snapshot`] was taken of stopped:
    /// fed the rest of the stream (starting with the input that decoder had not consumed), it
    /// produces what that decoder would have. Refuses a state no decoder can be in.
    pub fn resume(snapshot: WsSnapshot) -> Result<Self, WsSnapshotError> {
        snapshot.check()?;
        Ok(Self {
            role: snapshot.role,
            state: match snapshot.payload {
                None => State::Header,
                Some(WsPayload { remaining, mask }) => State::Payload { remaining, mask },
            },
            in_message: snapshot.in_message,
            max_payload: snapshot.max_payload,
        })
    }
}
