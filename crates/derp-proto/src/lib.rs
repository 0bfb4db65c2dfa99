//! Sans-IO implementation of Tailscale's DERP relay wire protocol.
//!
//! What this crate does: node and mesh keys with their text forms and derper's key file; the
//! NaCl box used in the handshake; the ClientInfo/ServerInfo JSON bodies with Go-compatible
//! encoding and decoding; every frame type (Tailscale's 0x01–0x15, and derpd's ObservedAddr 0xF1 for DERP over
//! QUIC) as typed messages with encoders;
//! incremental decoders for each direction that apply the reference implementation's size
//! rules (the server's, and the WebSocket decoder, with their state between two calls exported
//! and resumed, to carry a connection on in another process); handshake state machines for both sides; the HTTP upgrade that opens a connection
//! ([`upgrade`]) and the WebSocket framing DERP can travel in ([`ws`]), for both sides; and a
//! STUN codec ([`stun`]); derper's rate configuration file ([`rate_config`]); the PROXY
//! protocol a TCP proxy or load balancer puts in front of a connection it passes on
//! ([`proxy_protocol`]), both versions, both sides.
//!
//! Cryptography: x25519-dalek and `crypto_secretbox`, except a server's per-handshake X25519
//! ([`KeyPair`]), which runs on aws-lc for speed and gives the same bytes.
//!
//! What it does not do: no sockets or other IO, no clock or timers, and no randomness of its
//! own. Callers read bytes into a [`bytes::BytesMut`], feed it to a decoder, write encoded
//! frames out themselves, and pass in nonces and RNGs.
//!
//! Protocol flow, once the HTTP upgrade (or WebSocket) is done:
//!
//! 1. Server → client: ServerKey (magic + server public key).
//! 2. Client → server: ClientInfo (client public key + box of the ClientInfo JSON, sealed to
//!    the server key).
//! 3. Server → client: ServerInfo (box of `{"version":2}`, sealed to the client key).
//! 4. Then frames in both directions: SendPacket / RecvPacket carry packets; NotePreferred,
//!    Ping/Pong, KeepAlive, PeerGone; mesh peers use WatchConns, PeerPresent, ForwardPacket and
//!    ClosePeer. Unknown frame types are skipped.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod codec;
pub mod crypto;
pub mod frame;
pub mod handshake;
pub mod info;
pub mod keys;
pub mod proxy_protocol;
pub mod rate_config;
pub mod stun;
pub mod upgrade;
pub mod ws;

pub use codec::{
    ClientDecoder, DecodeError, ServerDecoder, decode_recv_packet_datagram,
    decode_send_packet_datagram,
};
pub use crypto::BoxError;
pub use frame::{ClientToRelay, FrameType, PeerGoneReason, RelayToClient};
pub use handshake::{ClientHandshake, HandshakeError, ServerHandshake};
pub use info::{ClientInfo, InfoError, ServerInfo};
pub use keys::{KeyError, KeyFileError, KeyPair, MeshKey, PublicKey, SecretKey};
