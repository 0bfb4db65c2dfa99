//! Frame types, the 5-byte frame header, and the two message enums with their encoders.
//!
//! A frame is one type byte, a big-endian `u32` payload length (header excluded), then the
//! payload. [`ClientToRelay`] covers what clients send; [`RelayToClient`] what servers send.
//! Decoding, with each side's size rules, lives in [`crate::codec`].

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use bytes::{BufMut, Bytes};

use crate::keys::PublicKey;

/// The one-byte frame type.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameType {
    /// S→C: magic + server public key.
    ServerKey = 0x01,
    /// C→S: client public key + sealed ClientInfo JSON.
    ClientInfo = 0x02,
    /// S→C: sealed ServerInfo JSON.
    ServerInfo = 0x03,
    /// C→S: destination key + packet.
    SendPacket = 0x04,
    /// S→C: source key + packet.
    RecvPacket = 0x05,
    /// S→C: empty keepalive.
    KeepAlive = 0x06,
    /// C→S: one byte, whether this is the client's home relay.
    NotePreferred = 0x07,
    /// S→C: peer key + reason.
    PeerGone = 0x08,
    /// S→C (mesh watchers): peer key + address + flags.
    PeerPresent = 0x09,
    /// Mesh C→S: source key + destination key + packet.
    ForwardPacket = 0x0a,
    /// Mesh C→S: subscribe to presence changes.
    WatchConns = 0x10,
    /// Mesh C→S: disconnect a client.
    ClosePeer = 0x11,
    /// Eight opaque bytes to be echoed.
    Ping = 0x12,
    /// The echo of a Ping.
    Pong = 0x13,
    /// S→C: health problem text; empty means healthy.
    Health = 0x14,
    /// S→C: the server is restarting; reconnect timing hints.
    Restarting = 0x15,
    /// S→C, DERP over QUIC only (a derpd extension): the client's UDP address as the server
    /// sees it. derpd numbers its own types down from 0xFF, away from Tailscale's, which
    /// grow up from 0x01; 0xF0 is left unused because Tailscale's client uses it as a
    /// local-only PeerGone reason.
    ObservedAddr = 0xf1,
}

impl FrameType {
    /// Maps a wire byte to a known frame type.
    pub const fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            0x01 => Self::ServerKey,
            0x02 => Self::ClientInfo,
            0x03 => Self::ServerInfo,
            0x04 => Self::SendPacket,
            0x05 => Self::RecvPacket,
            0x06 => Self::KeepAlive,
            0x07 => Self::NotePreferred,
            0x08 => Self::PeerGone,
            0x09 => Self::PeerPresent,
            0x0a => Self::ForwardPacket,
            0x10 => Self::WatchConns,
            0x11 => Self::ClosePeer,
            0x12 => Self::Ping,
            0x13 => Self::Pong,
            0x14 => Self::Health,
            0x15 => Self::Restarting,
            0xf1 => Self::ObservedAddr,
            _ => return None,
        })
    }

    /// The wire byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

/// Writes a frame header: type byte, then the payload length as big-endian `u32`.
pub fn write_header(buf: &mut impl BufMut, ty: FrameType, len: u32) {
    buf.put_u8(ty as u8);
    buf.put_u32(len);
}

/// Splits a frame header into its raw type byte and payload length.
pub const fn parse_header(header: &[u8; FRAME_HEADER_LEN]) -> (u8, u32) {
    (
        header[0],
        u32::from_be_bytes([header[1], header[2], header[3], header[4]]),
    )
}

/// The header and source key of a RecvPacket frame carrying `packet_len` bytes, so a writer can
/// send it and the packet bytes as two slices without copying the packet.
///
/// `packet_len` is at most [`MAX_PACKET_SIZE`] for frames the server relays.
pub fn recv_packet_header(src: &PublicKey, packet_len: usize) -> [u8; FRAME_HEADER_LEN + KEY_LEN] {
    let mut out = [0u8; FRAME_HEADER_LEN + KEY_LEN];
    out[0] = FrameType::RecvPacket as u8;
    out[1..5].copy_from_slice(&payload_len_u32(KEY_LEN + packet_len).to_be_bytes());
    out[5..].copy_from_slice(src.as_bytes());
    out
}

/// Converts a payload length to the header field. Payloads are bounded far below 4 GiB by
/// every caller (packets ≤ 64 KiB, info boxes ≤ 1 MiB); saturate rather than wrap if not.
fn payload_len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Whether a packet looks like a Tailscale disco message: it starts with [`DISCO_MAGIC`] and is
/// long enough to hold the magic, a sender key and a nonce.
pub fn looks_like_disco(packet: &[u8]) -> bool {
    packet.len() >= DISCO_MAGIC.len() + KEY_LEN + NONCE_LEN && packet.starts_with(&DISCO_MAGIC)
}

/// Why a PeerGone frame was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerGoneReason {
    /// 0x00: the peer left this server or region.
    Disconnected,
    /// 0x01: the server has no record of the destination.
    NotHere,
    /// Any other byte, kept as-is.
    Other(u8),
}

impl PeerGoneReason {
    /// Maps a wire byte to a reason.
    pub const fn from_u8(value: u8) -> Self {
        match value {
            0x00 => Self::Disconnected,
            0x01 => Self::NotHere,
            other => Self::Other(other),
        }
    }

    /// The wire byte.
    pub const fn to_u8(self) -> u8 {
        match self {
            Self::Disconnected => 0x00,
            Self::NotHere => 0x01,
            Self::Other(other) => other,
        }
    }
}

impl From<u8> for PeerGoneReason {
    fn from(value: u8) -> Self {
        Self::from_u8(value)
    }
}

impl From<PeerGoneReason> for u8 {
    fn from(value: PeerGoneReason) -> Self {
        value.to_u8()
    }
}

/// A frame sent by a client (or mesh peer) to a relay server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientToRelay {
    /// The client's key and its sealed ClientInfo (nonce || tag || ciphertext).
    ClientInfo {
        /// The client's public key.
        key: PublicKey,
        /// The sealed ClientInfo JSON.
        sealed: Bytes,
    },
    /// A packet for `dst`.
    SendPacket {
        /// Destination key.
        dst: PublicKey,
        /// Packet bytes (at most [`MAX_PACKET_SIZE`]).
        packet: Bytes,
    },
    /// A packet a mesh peer relays on behalf of `src`.
    ForwardPacket {
        /// Original sender.
        src: PublicKey,
        /// Destination key.
        dst: PublicKey,
        /// Packet bytes (at most [`MAX_PACKET_SIZE`]).
        packet: Bytes,
    },
    /// Whether this server is the client's home relay.
    NotePreferred(bool),
    /// Mesh peer subscribes to PeerPresent/PeerGone updates.
    WatchConns,
    /// Mesh peer asks the server to disconnect a key.
    ClosePeer(PublicKey),
    /// Ping with eight opaque bytes.
    Ping([u8; 8]),
    /// Reply to a server ping.
    Pong([u8; 8]),
    /// A frame the decoder skipped; decode-only, encodes to nothing.
    Unknown {
        /// The raw frame type byte.
        frame_type: u8,
        /// The payload length from the header.
        len: u32,
    },
}

impl ClientToRelay {
    /// The frame type, or `None` for [`ClientToRelay::Unknown`].
    pub fn frame_type(&self) -> Option<FrameType> {
        Some(match self {
            Self::ClientInfo { .. } => FrameType::ClientInfo,
            Self::SendPacket { .. } => FrameType::SendPacket,
            Self::ForwardPacket { .. } => FrameType::ForwardPacket,
            Self::NotePreferred(_) => FrameType::NotePreferred,
            Self::WatchConns => FrameType::WatchConns,
            Self::ClosePeer(_) => FrameType::ClosePeer,
            Self::Ping(_) => FrameType::Ping,
            Self::Pong(_) => FrameType::Pong,
            Self::Unknown { .. } => return None,
        })
    }

    fn payload_len(&self) -> usize {
        match self {
            Self::ClientInfo { sealed, .. } => KEY_LEN + sealed.len(),
            Self::SendPacket { packet, .. } => KEY_LEN + packet.len(),
            Self::ForwardPacket { packet, .. } => 2 * KEY_LEN + packet.len(),
            Self::NotePreferred(_) => 1,
            Self::WatchConns | Self::Unknown { .. } => 0,
            Self::ClosePeer(_) => KEY_LEN,
            Self::Ping(_) | Self::Pong(_) => 8,
        }
    }

    /// The number of bytes [`ClientToRelay::encode`] writes (0 for `Unknown`).
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Unknown { .. } => 0,
            _ => FRAME_HEADER_LEN + self.payload_len(),
        }
    }

    /// Writes the whole frame. `Unknown` writes nothing. Size limits are the caller's job:
    /// the encoder writes whatever it is given.
    pub fn encode(&self, buf: &mut impl BufMut) {
        let Some(ty) = self.frame_type() else {
            return;
        };
        write_header(buf, ty, payload_len_u32(self.payload_len()));
        match self {
            Self::ClientInfo { key, sealed } => {
                buf.put_slice(key.as_bytes());
                buf.put_slice(sealed);
            }
            Self::SendPacket { dst, packet } => {
                buf.put_slice(dst.as_bytes());
                buf.put_slice(packet);
            }
            Self::ForwardPacket { src, dst, packet } => {
                buf.put_slice(src.as_bytes());
                buf.put_slice(dst.as_bytes());
                buf.put_slice(packet);
            }
            Self::NotePreferred(preferred) => buf.put_u8(u8::from(*preferred)),
            Self::ClosePeer(key) => buf.put_slice(key.as_bytes()),
            Self::Ping(data) | Self::Pong(data) => buf.put_slice(data),
            Self::WatchConns | Self::Unknown { .. } => {}
        }
    }
}

/// A frame sent by a relay server to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayToClient {
    /// The server's public key, preceded on the wire by [`MAGIC`].
    ServerKey(PublicKey),
    /// The sealed ServerInfo JSON (nonce || tag || ciphertext).
    ServerInfo {
        /// The sealed box.
        sealed: Bytes,
    },
    /// A packet from `src`.
    RecvPacket {
        /// Source key.
        src: PublicKey,
        /// Packet bytes.
        packet: Bytes,
    },
    /// Keepalive; no payload.
    KeepAlive,
    /// A peer this client talked to (or watched) is gone.
    PeerGone {
        /// The peer's key.
        peer: PublicKey,
        /// Why it is gone.
        reason: PeerGoneReason,
    },
    /// A peer connected (sent to mesh watchers).
    PeerPresent {
        /// The peer's key.
        peer: PublicKey,
        /// The peer's remote address as the server saw it (`[::]:0` if unknown).
        addr: SocketAddr,
        /// `PEER_PRESENT_*` bits.
        flags: u8,
    },
    /// Ping with eight opaque bytes.
    Ping([u8; 8]),
    /// Echo of a client's ping.
    Pong([u8; 8]),
    /// Health problem text; empty means healthy again.
    Health(String),
    /// The server is restarting.
    Restarting {
        /// Milliseconds to wait before reconnecting.
        reconnect_in_ms: u32,
        /// Milliseconds to keep trying.
        try_for_ms: u32,
    },
    /// DERP over QUIC only: the client's UDP source address as the server sees it, after
    /// the handshake and after each validated migration.
    ObservedAddr(SocketAddr),
    /// A frame the decoder skipped; decode-only, encodes to nothing.
    Unknown {
        /// The raw frame type byte.
        frame_type: u8,
        /// The payload length from the header.
        len: u32,
    },
}

/// Payload length of a PeerPresent frame as the server always writes it.
pub const PEER_PRESENT_LEN: usize = KEY_LEN + 16 + 2 + 1;
/// Payload length of an ObservedAddr frame as the server always writes it: a 16-byte IPv6
/// (or IPv4-mapped) address and a big-endian port.
pub const OBSERVED_ADDR_LEN: usize = 18;

impl RelayToClient {
    /// The frame type, or `None` for [`RelayToClient::Unknown`].
    pub fn frame_type(&self) -> Option<FrameType> {
        Some(match self {
            Self::ServerKey(_) => FrameType::ServerKey,
            Self::ServerInfo { .. } => FrameType::ServerInfo,
            Self::RecvPacket { .. } => FrameType::RecvPacket,
            Self::KeepAlive => FrameType::KeepAlive,
            Self::PeerGone { .. } => FrameType::PeerGone,
            Self::PeerPresent { .. } => FrameType::PeerPresent,
            Self::Ping(_) => FrameType::Ping,
            Self::Pong(_) => FrameType::Pong,
            Self::Health(_) => FrameType::Health,
            Self::Restarting { .. } => FrameType::Restarting,
            Self::ObservedAddr(_) => FrameType::ObservedAddr,
            Self::Unknown { .. } => return None,
        })
    }

    fn payload_len(&self) -> usize {
        match self {
            Self::ObservedAddr(_) => OBSERVED_ADDR_LEN,
            Self::ServerKey(_) => MAGIC.len() + KEY_LEN,
            Self::ServerInfo { sealed } => sealed.len(),
            Self::RecvPacket { packet, .. } => KEY_LEN + packet.len(),
            Self::KeepAlive | Self::Unknown { .. } => 0,
            Self::PeerGone { .. } => KEY_LEN + 1,
            Self::PeerPresent { .. } => PEER_PRESENT_LEN,
            Self::Ping(_) | Self::Pong(_) | Self::Restarting { .. } => 8,
            Self::Health(text) => text.len(),
        }
    }

    /// The number of bytes [`RelayToClient::encode`] writes (0 for `Unknown`).
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Unknown { .. } => 0,
            _ => FRAME_HEADER_LEN + self.payload_len(),
        }
    }

    /// Writes the whole frame. `Unknown` writes nothing.
    pub fn encode(&self, buf: &mut impl BufMut) {
        let Some(ty) = self.frame_type() else {
            return;
        };
        write_header(buf, ty, payload_len_u32(self.payload_len()));
        match self {
            Self::ServerKey(key) => {
                buf.put_slice(&MAGIC);
                buf.put_slice(key.as_bytes());
            }
            Self::ServerInfo { sealed } => buf.put_slice(sealed),
            Self::RecvPacket { src, packet } => {
                buf.put_slice(src.as_bytes());
                buf.put_slice(packet);
            }
            Self::PeerGone { peer, reason } => {
                buf.put_slice(peer.as_bytes());
                buf.put_u8(reason.to_u8());
            }
            Self::PeerPresent { peer, addr, flags } => {
                buf.put_slice(peer.as_bytes());
                put_addr(buf, addr);
                buf.put_u8(*flags);
            }
            Self::ObservedAddr(addr) => put_addr(buf, addr),
            Self::Ping(data) | Self::Pong(data) => buf.put_slice(data),
            Self::Health(text) => buf.put_slice(text.as_bytes()),
            Self::Restarting {
                reconnect_in_ms,
                try_for_ms,
            } => {
                buf.put_u32(*reconnect_in_ms);
                buf.put_u32(*try_for_ms);
            }
            Self::KeepAlive | Self::Unknown { .. } => {}
        }
    }
}

/// Writes the 18-byte address form of PeerPresent and ObservedAddr: IPv6, with IPv4 as
/// IPv4-mapped, then the port, big-endian. Zone IDs are not carried.
fn put_addr(buf: &mut impl BufMut, addr: &SocketAddr) {
    let ip = match addr.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    buf.put_slice(&ip.octets());
    buf.put_u16(addr.port());
}

/// Decodes the 18 address bytes of a PeerPresent or ObservedAddr frame, unmapping IPv4-mapped addresses as
/// the Go client does.
pub(crate) fn peer_present_addr(bytes: &[u8; 18]) -> SocketAddr {
    let mut octets = [0u8; 16];
    octets.copy_from_slice(&bytes[..16]);
    let port = u16::from_be_bytes([bytes[16], bytes[17]]);
    SocketAddr::new(Ipv6Addr::from(octets).to_canonical(), port)
}

/// The 8-byte magic at the start of a ServerKey payload: `"DERP🔑"`.
pub const MAGIC: [u8; 8] = *b"DERP\xF0\x9F\x94\x91";
/// Length of the frame header: type byte plus big-endian `u32` length.
pub const FRAME_HEADER_LEN: usize = 5;
/// Length of a public key on the wire.
pub const KEY_LEN: usize = 32;
/// Length of a NaCl box nonce.
pub const NONCE_LEN: usize = 24;
/// Largest packet (excluding DERP framing) a SendPacket or ForwardPacket may carry.
pub const MAX_PACKET_SIZE: usize = 64 << 10;
/// The protocol version this crate speaks (RecvPacket carries the source key).
pub const PROTOCOL_VERSION: u8 = 2;
/// Largest ServerInfo box a client accepts (beyond the nonce).
pub const MAX_INFO_LEN: usize = 1 << 20;
/// Largest ClientInfo payload the server accepts.
pub const MAX_CLIENT_INFO_LEN: usize = 256 * 1024;
/// Largest Ping payload the server accepts.
pub const MAX_PING_LEN: usize = 1000;
/// Largest frame payload the client accepts.
pub const CLIENT_MAX_FRAME_LEN: usize = 1 << 20;
/// Largest ServerKey payload the client accepts.
pub const MAX_SERVER_KEY_LEN: usize = 1024;
/// The 6-byte prefix of Tailscale disco packets: `"TS💬"`.
pub const DISCO_MAGIC: [u8; 6] = *b"TS\xF0\x9F\x92\xAC";

/// PeerPresent flag: none of the other flags apply.
pub const PEER_PRESENT_IS_REGULAR: u8 = 1;
/// PeerPresent flag: the peer presented a valid mesh key.
pub const PEER_PRESENT_IS_MESH_PEER: u8 = 2;
/// PeerPresent flag: the peer is a prober.
pub const PEER_PRESENT_IS_PROBER: u8 = 4;
/// PeerPresent flag: the peer is not on its ideal node.
pub const PEER_PRESENT_NOT_IDEAL: u8 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// The three headers from Go's TestReadFrameHeader / TestWriteFrameHeader.
    const HEADERS: [(FrameType, u32, [u8; 5]); 3] = [
        (FrameType::SendPacket, 1024, [0x04, 0x00, 0x00, 0x04, 0x00]),
        (FrameType::KeepAlive, 0, [0x06, 0x00, 0x00, 0x00, 0x00]),
        (
            FrameType::RecvPacket,
            0xffff_ffff,
            [0x05, 0xff, 0xff, 0xff, 0xff],
        ),
    ];

    #[test]
    fn read_frame_header() {
        for (ty, len, bytes) in HEADERS {
            assert_eq!(parse_header(&bytes), (ty as u8, len));
        }
    }

    #[test]
    fn write_frame_header_roomy_and_exact_buffers() {
        for (ty, len, bytes) in HEADERS {
            let mut roomy = Vec::with_capacity(4096);
            write_header(&mut roomy, ty, len);
            assert_eq!(roomy, bytes);

            // A buffer with exactly five bytes of room left.
            let mut backing = [0xaau8; 8];
            let mut slot: &mut [u8] = &mut backing[3..];
            write_header(&mut slot, ty, len);
            assert!(slot.is_empty());
            assert_eq!(backing[3..], bytes);
            assert_eq!(backing[..3], [0xaa; 3]);
        }
    }

    #[test]
    fn frame_type_bytes_round_trip() {
        let mut known = 0;
        for byte in 0..=u8::MAX {
            match FrameType::from_u8(byte) {
                Some(ty) => {
                    known += 1;
                    assert_eq!(ty.as_u8(), byte);
                }
                None => assert!(
                    byte == 0 || (0x0b..=0x0f).contains(&byte) || (byte > 0x15 && byte != 0xf1)
                ),
            }
        }
        assert_eq!(known, 17);
    }

    #[test]
    fn peer_gone_reason_bytes() {
        for byte in 0..=u8::MAX {
            let reason = PeerGoneReason::from(byte);
            assert_eq!(u8::from(reason), byte);
        }
        assert_eq!(PeerGoneReason::from_u8(0), PeerGoneReason::Disconnected);
        assert_eq!(PeerGoneReason::from_u8(1), PeerGoneReason::NotHere);
        assert_eq!(PeerGoneReason::from_u8(0xf0), PeerGoneReason::Other(0xf0));
    }

    /// Go's TestClientSendPing / TestClientSendPong and TestServerRepliesToPing bytes.
    #[test]
    fn ping_and_pong_exact_bytes() {
        let data = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut out = Vec::new();
        ClientToRelay::Ping(data).encode(&mut out);
        assert_eq!(out, [0x12, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]);
        out.clear();
        ClientToRelay::Pong(data).encode(&mut out);
        assert_eq!(out, [0x13, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]);
        out.clear();
        RelayToClient::Pong([1, 2, 3, 4, 5, 6, 7, 0x2a]).encode(&mut out);
        assert_eq!(out, [0x13, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 0x2a]);
    }

    #[test]
    fn magic_constants() {
        assert_eq!(MAGIC, [0x44, 0x45, 0x52, 0x50, 0xf0, 0x9f, 0x94, 0x91]);
        assert_eq!(&MAGIC, "DERP🔑".as_bytes());
        assert_eq!(&DISCO_MAGIC, "TS💬".as_bytes());
        assert_eq!(PEER_PRESENT_LEN, 51);
    }

    #[test]
    fn recv_packet_header_for_largest_packet() {
        let key = PublicKey::from_bytes([9; 32]);
        let header = recv_packet_header(&key, MAX_PACKET_SIZE);
        assert_eq!(header[..5], [0x05, 0x00, 0x01, 0x00, 0x20]);
        assert_eq!(header[5..], [9; 32]);
        let mut full = Vec::new();
        RelayToClient::RecvPacket {
            src: key,
            packet: Bytes::from(vec![0; 3]),
        }
        .encode(&mut full);
        assert_eq!(recv_packet_header(&key, 3)[..], full[..37]);
    }

    #[test]
    fn disco_detection() {
        let mut packet = DISCO_MAGIC.to_vec();
        packet.resize(62, 0);
        assert!(looks_like_disco(&packet));
        assert!(!looks_like_disco(&packet[..61]));
        packet[5] = 0;
        assert!(!looks_like_disco(&packet));
        assert!(!looks_like_disco(b""));
    }

    #[test]
    fn peer_present_addresses() {
        let peer = PublicKey::from_bytes([1; 32]);
        let mut out = Vec::new();
        RelayToClient::PeerPresent {
            peer,
            addr: "192.0.2.1:41641".parse().unwrap(),
            flags: PEER_PRESENT_IS_MESH_PEER | PEER_PRESENT_NOT_IDEAL,
        }
        .encode(&mut out);
        assert_eq!(out.len(), 5 + 51);
        assert_eq!(
            out[37..],
            [
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1, 0xa2, 0xa9, 0x0a
            ]
        );
        let addr: &[u8; 18] = out[37..55].try_into().unwrap();
        assert_eq!(peer_present_addr(addr), "192.0.2.1:41641".parse().unwrap());
        assert_eq!(peer_present_addr(&[0; 18]), "[::]:0".parse().unwrap());
        let mut v6 = [0u8; 18];
        v6[0] = 0x20;
        v6[1] = 0x01;
        v6[15] = 1;
        v6[17] = 80;
        assert_eq!(peer_present_addr(&v6), "[2001::1]:80".parse().unwrap());
    }

    /// The byte-exact examples of docs/protocol.md's QUIC section.
    #[test]
    fn observed_addr_exact_bytes() {
        let mut out = Vec::new();
        RelayToClient::ObservedAddr("198.51.100.7:41641".parse().unwrap()).encode(&mut out);
        assert_eq!(
            out,
            [
                0xf1, 0, 0, 0, 0x12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xc6, 0x33, 0x64,
                0x07, 0xa2, 0xa9
            ]
        );
        out.clear();
        RelayToClient::ObservedAddr("[2001:db8::1]:443".parse().unwrap()).encode(&mut out);
        assert_eq!(
            out,
            [
                0xf1, 0, 0, 0, 0x12, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
                0x01, 0xbb
            ]
        );
    }

    #[test]
    fn encoded_len_matches_encode() {
        let key = PublicKey::from_bytes([4; 32]);
        let packet = Bytes::from_static(b"abc");
        let client_msgs = [
            ClientToRelay::ClientInfo {
                key,
                sealed: packet.clone(),
            },
            ClientToRelay::SendPacket {
                dst: key,
                packet: packet.clone(),
            },
            ClientToRelay::ForwardPacket {
                src: key,
                dst: key,
                packet: packet.clone(),
            },
            ClientToRelay::NotePreferred(true),
            ClientToRelay::WatchConns,
            ClientToRelay::ClosePeer(key),
            ClientToRelay::Ping([0; 8]),
            ClientToRelay::Pong([0; 8]),
            ClientToRelay::Unknown {
                frame_type: 0x0b,
                len: 9,
            },
        ];
        for msg in &client_msgs {
            let mut out = Vec::new();
            msg.encode(&mut out);
            assert_eq!(out.len(), msg.encoded_len(), "{msg:?}");
            if let Some(ty) = msg.frame_type() {
                assert_eq!(parse_header(out[..5].try_into().unwrap()).0, ty as u8);
                assert_eq!(out.len() - 5, msg.payload_len());
            } else {
                assert!(out.is_empty());
            }
        }
        let relay_msgs = [
            RelayToClient::ServerKey(key),
            RelayToClient::ServerInfo {
                sealed: packet.clone(),
            },
            RelayToClient::RecvPacket { src: key, packet },
            RelayToClient::KeepAlive,
            RelayToClient::PeerGone {
                peer: key,
                reason: PeerGoneReason::NotHere,
            },
            RelayToClient::PeerPresent {
                peer: key,
                addr: "[::1]:1".parse().unwrap(),
                flags: PEER_PRESENT_IS_REGULAR | PEER_PRESENT_IS_PROBER,
            },
            RelayToClient::Ping([0; 8]),
            RelayToClient::Pong([0; 8]),
            RelayToClient::Health("bad".to_owned()),
            RelayToClient::Restarting {
                reconnect_in_ms: 1,
                try_for_ms: 2,
            },
            RelayToClient::ObservedAddr("198.51.100.7:41641".parse().unwrap()),
            RelayToClient::Unknown {
                frame_type: 0xff,
                len: 1,
            },
        ];
        for msg in &relay_msgs {
            let mut out = Vec::new();
            msg.encode(&mut out);
            assert_eq!(out.len(), msg.encoded_len(), "{msg:?}");
            if let Some(ty) = msg.frame_type() {
                assert_eq!(out[0], ty as u8);
                assert_eq!(out.len() - 5, msg.payload_len());
            } else {
                assert!(out.is_empty());
            }
        }
    }
}
