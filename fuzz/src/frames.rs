//! The frame decoders, in both directions, fed in arbitrary chunks.
//!
//! Input: `flags | chunk seed | stream`. `flags & 3` picks the largest chunk (1, 7, 64 or
//! 4096 bytes); `flags & 4` starts the server decoder before the handshake (so the first
//! frame must be ClientInfo). The stream is decoded twice, once whole and once cut into
//! chunks, and checked against a model of the size rules written from docs/protocol.md:
//!
//! - chunking never changes what is decoded, nor the error that ends it;
//! - every message sits on the next frame boundary of the stream, and `Unknown` carries its
//!   header's type and length;
//! - every message holds exactly the bytes of its frame (re-encoding gives the frame back
//!   where the frame is in canonical form) and decodes again to itself after re-encoding;
//! - an error names the frame that broke a rule, and only frames that break one fail;
//! - when the input runs out, what is left is an incomplete frame the decoder must wait for;
//! - a server decoder past the handshake is all in its skip count: the chunked run replaces
//!   it before every call with one resumed from that count, and nothing changes.

use std::cell::Cell;
use std::net::{Ipv6Addr, SocketAddr};

use bytes::BytesMut;
use derp_proto::frame::{
    CLIENT_MAX_FRAME_LEN, FRAME_HEADER_LEN, KEY_LEN, MAGIC, MAX_CLIENT_INFO_LEN, MAX_PACKET_SIZE,
    MAX_PING_LEN, MAX_SERVER_KEY_LEN, NONCE_LEN, PEER_PRESENT_LEN,
};
use derp_proto::{
    ClientDecoder, ClientToRelay, DecodeError, PeerGoneReason, PublicKey, RelayToClient,
    ServerDecoder,
};

use crate::Rng;

/// Server side: decodes client frames.
pub fn server_frames(data: &[u8]) {
    let (flags, mut rng, stream) = split_input(data);
    let handshake = flags & 4 != 0;
    let new_decoder = || {
        if handshake {
            ServerDecoder::new()
        } else {
            ServerDecoder::after_handshake()
        }
    };
    let whole = decode_all(
        new_decoder(),
        stream,
        |_| stream.len(),
        ServerDecoder::decode,
    );
    let max_chunk = chunk_limit(flags);
    let chunked = decode_all(
        new_decoder(),
        stream,
        |_| rng.below_incl(max_chunk),
        |decoder, buf| {
            if decoder.handshake_done() {
                *decoder = ServerDecoder::resume_skipping(decoder.skipping());
            }
            decoder.decode(buf)
        },
    );
    assert_eq!(
        whole, chunked,
        "chunking and resuming changed the decoded frames"
    );

    let handshake_done = Cell::new(!handshake);
    check_against_model(
        stream,
        &whole,
        |ty, len| server_rule(handshake_done.get(), ty, len),
        |msg, frame| {
            check_server_msg(msg, frame);
            if matches!(msg, ClientToRelay::ClientInfo { .. }) {
                handshake_done.set(true);
            }
        },
    );
}

/// Client side: decodes relay frames.
pub fn client_frames(data: &[u8]) {
    let (flags, mut rng, stream) = split_input(data);
    let whole = decode_all(
        ClientDecoder::new(),
        stream,
        |_| stream.len(),
        ClientDecoder::decode,
    );
    let max_chunk = chunk_limit(flags);
    let chunked = decode_all(
        ClientDecoder::new(),
        stream,
        |_| rng.below_incl(max_chunk),
        ClientDecoder::decode,
    );
    assert_eq!(whole, chunked, "chunking changed the decoded frames");
    check_against_model(stream, &whole, client_rule, check_client_msg);
}

fn split_input(data: &[u8]) -> (u8, Rng, &[u8]) {
    match data {
        [flags, seed, stream @ ..] => (*flags, Rng::new(&[*seed]), stream),
        [flags] => (*flags, Rng::new(&[]), &[]),
        [] => (0, Rng::new(&[]), &[]),
    }
}

fn chunk_limit(flags: u8) -> usize {
    [1, 7, 64, 4096][usize::from(flags & 3)]
}

/// What decoding a stream produced: the messages, then the error that stopped it (if any).
#[derive(Debug, PartialEq)]
struct Outcome<M> {
    msgs: Vec<M>,
    error: Option<DecodeError>,
}

/// Feeds `stream` to `decoder` in chunks of `next_chunk` bytes, decoding after each chunk
/// until the decoder wants more, and stops at the first error.
fn decode_all<D, M>(
    mut decoder: D,
    stream: &[u8],
    mut next_chunk: impl FnMut(usize) -> usize,
    decode: fn(&mut D, &mut BytesMut) -> Result<Option<M>, DecodeError>,
) -> Outcome<M> {
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut msgs = Vec::new();
    loop {
        loop {
            let before = buf.len();
            match decode(&mut decoder, &mut buf) {
                Ok(Some(msg)) => msgs.push(msg),
                Ok(None) => break,
                Err(error) => {
                    return Outcome {
                        msgs,
                        error: Some(error),
                    };
                }
            }
            assert!(buf.len() <= before, "decoding grew the buffer");
        }
        if fed == stream.len() {
            return Outcome { msgs, error: None };
        }
        let n = next_chunk(fed).clamp(1, stream.len() - fed);
        buf.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
    }
}

/// How the model says a frame is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Reported as `Unknown` as soon as the header is in; the body is discarded.
    Skip,
    /// Reported once the first `keep` payload bytes are in.
    Read { keep: usize },
}

/// Which rule a frame broke, without the decoder's exact variant: the model checks the
/// variant's fields separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broken {
    TooShort,
    TooLarge,
    WrongLength,
    Unexpected,
}

fn range(len: usize, min: usize, max: usize) -> Result<(), Broken> {
    if len < min {
        Err(Broken::TooShort)
    } else if len > max {
        Err(Broken::TooLarge)
    } else {
        Ok(())
    }
}

fn exact(len: usize, want: usize) -> Result<(), Broken> {
    if len == want {
        Ok(())
    } else {
        Err(Broken::WrongLength)
    }
}

/// The server's rules, from the frame table in docs/protocol.md.
fn server_rule(handshake_done: bool, ty: u8, len: usize) -> Result<Plan, Broken> {
    if !handshake_done {
        if ty != 0x02 {
            return Err(Broken::Unexpected);
        }
        range(len, KEY_LEN + NONCE_LEN, MAX_CLIENT_INFO_LEN)?;
        return Ok(Plan::Read { keep: len });
    }
    match ty {
        0x04 => range(len, 32, 32 + 65536)?,
        0x0a => range(len, 64, 64 + 65536)?,
        0x07 => exact(len, 1)?,
        0x10 => exact(len, 0)?,
        0x11 => exact(len, 32)?,
        0x12 => {
            range(len, 8, 1000)?;
            return Ok(Plan::Read { keep: 8 });
        }
        // Everything else from a client, known type or not, is skipped whatever its size.
        _ => return Ok(Plan::Skip),
    }
    Ok(Plan::Read { keep: len })
}

/// The Go client's rules: a 1 MiB cap on every frame, ServerKey and ServerInfo bounds, and
/// short frames of the other known types dropped rather than refused.
fn client_rule(ty: u8, len: usize) -> Result<Plan, Broken> {
    if len > 1 << 20 {
        return Err(Broken::TooLarge);
    }
    let (min, keep) = match ty {
        0x01 => {
            range(len, 40, 1024)?;
            return Ok(Plan::Read { keep: 40 });
        }
        0x03 => {
            range(len, 24, 24 + (1 << 20))?;
            return Ok(Plan::Read { keep: len });
        }
        0x05 | 0x14 => (if ty == 0x05 { 32 } else { 0 }, len),
        0x06 => (0, 0),
        0x08 => (32, 33),
        0x09 => (32, 51),
        0x12 | 0x13 | 0x15 => (8, 8),
        0xf1 => (18, 18),
        _ => return Ok(Plan::Skip),
    };
    if len < min {
        return Ok(Plan::Skip);
    }
    Ok(Plan::Read {
        keep: keep.min(len),
    })
}

/// One frame as the model sees it in the stream.
#[derive(Debug, Clone, Copy)]
struct Frame<'a> {
    ty: u8,
    len: usize,
    plan: Plan,
    /// The frame's payload bytes that are in the stream (may be cut short by its end).
    body: &'a [u8],
    /// The whole frame, header included, if it is all in the stream.
    whole: Option<&'a [u8]>,
}

/// Walks the stream's frame headers alongside the decoded messages; see the module docs.
fn check_against_model<M: std::fmt::Debug>(
    stream: &[u8],
    outcome: &Outcome<M>,
    mut rule: impl FnMut(u8, usize) -> Result<Plan, Broken>,
    mut check_msg: impl FnMut(&M, &Frame<'_>),
) {
    // Offsets can pass the end of the stream (a skipped frame longer than the input).
    let mut pos: u64 = 0;
    let header_at = |pos: u64| -> Option<(u8, usize)> {
        let start = usize::try_from(pos).ok()?;
        let header = stream.get(start..start.checked_add(FRAME_HEADER_LEN)?)?;
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
        Some((header[0], len as usize))
    };
    for msg in &outcome.msgs {
        let Some((ty, len)) = header_at(pos) else {
            panic!("{msg:?} decoded with no frame header left at offset {pos}");
        };
        let plan = match rule(ty, len) {
            Ok(plan) => plan,
            Err(broken) => panic!("{msg:?} decoded from type {ty:#04x} len {len} ({broken:?})"),
        };
        let start = pos as usize + FRAME_HEADER_LEN;
        let end = start + len;
        let body = &stream[start..end.min(stream.len())];
        if let Plan::Read { keep } = plan {
            assert!(
                body.len() >= keep,
                "{msg:?} decoded before its {keep} bytes arrived"
            );
        }
        let whole = stream.get(pos as usize..end);
        check_msg(
            msg,
            &Frame {
                ty,
                len,
                plan,
                body,
                whole,
            },
        );
        pos += (FRAME_HEADER_LEN + len) as u64;
    }
    match (outcome.error, header_at(pos)) {
        (Some(DecodeError::BadMagic), Some((ty, len))) => {
            assert_eq!(ty, 0x01, "BadMagic on a frame of type {ty:#04x}");
            let Ok(Plan::Read { keep }) = rule(ty, len) else {
                panic!("BadMagic on a frame the rules do not read");
            };
            let body = &stream[pos as usize + FRAME_HEADER_LEN..];
            assert!(body.len() >= keep, "BadMagic before the key arrived");
            assert_ne!(body[..MAGIC.len()], MAGIC, "BadMagic on a good magic");
        }
        (Some(error), Some((ty, len))) => {
            let broken = rule(ty, len).expect_err("decoder refused a frame the rules allow");
            let (frame_type, got_len, want) = match error {
                DecodeError::FrameTooShort { frame_type, len } => {
                    (frame_type, Some(len), Broken::TooShort)
                }
                DecodeError::FrameTooLarge { frame_type, len } => {
                    (frame_type, Some(len), Broken::TooLarge)
                }
                DecodeError::WrongLength { frame_type, len } => {
                    (frame_type, Some(len), Broken::WrongLength)
                }
                DecodeError::UnexpectedFrame { frame_type } => {
                    (frame_type, None, Broken::Unexpected)
                }
                DecodeError::BadMagic => unreachable!("matched above"),
            };
            assert_eq!(broken, want, "{error:?} but the model says {broken:?}");
            assert_eq!(frame_type, ty, "{error:?} names the wrong frame");
            if let Some(got_len) = got_len {
                assert_eq!(got_len as usize, len, "{error:?} names the wrong length");
            }
        }
        (Some(error), None) => panic!("{error:?} with no frame header left"),
        (None, None) => {}
        (None, Some((ty, len))) => {
            // The decoder is waiting: the model must agree that this frame is readable but
            // not all there yet. A skipped frame or a broken rule shows at its header.
            let available = stream.len() - (pos as usize + FRAME_HEADER_LEN);
            match rule(ty, len) {
                Ok(Plan::Read { keep }) => assert!(
                    available < keep,
                    "decoder stopped at a complete type {ty:#04x} len {len} frame"
                ),
                other => panic!("decoder stopped at type {ty:#04x} len {len}: model {other:?}"),
            }
        }
    }
}

fn key_at(bytes: &[u8], at: usize) -> PublicKey {
    PublicKey::from_slice(&bytes[at..at + KEY_LEN]).expect("32 bytes")
}

fn check_server_msg(msg: &ClientToRelay, frame: &Frame<'_>) {
    let body = frame.body;
    if let ClientToRelay::Unknown { frame_type, len } = *msg {
        assert_eq!((frame_type, len as usize), (frame.ty, frame.len));
        assert_eq!(frame.plan, Plan::Skip, "{msg:?} for a frame the rules read");
        return;
    }
    assert_ne!(frame.plan, Plan::Skip, "{msg:?} for a frame the rules skip");
    assert_eq!(msg.frame_type().map(|t| t.as_u8()), Some(frame.ty));
    match msg {
        ClientToRelay::ClientInfo { key, sealed } => {
            assert_eq!(*key, key_at(body, 0));
            assert_eq!(sealed[..], body[KEY_LEN..]);
            assert!(sealed.len() >= NONCE_LEN);
            assert!(KEY_LEN + sealed.len() <= MAX_CLIENT_INFO_LEN);
        }
        ClientToRelay::SendPacket { dst, packet } => {
            assert_eq!(*dst, key_at(body, 0));
            assert_eq!(packet[..], body[KEY_LEN..]);
            assert!(packet.len() <= MAX_PACKET_SIZE);
        }
        ClientToRelay::ForwardPacket { src, dst, packet } => {
            assert_eq!(*src, key_at(body, 0));
            assert_eq!(*dst, key_at(body, KEY_LEN));
            assert_eq!(packet[..], body[2 * KEY_LEN..]);
            assert!(packet.len() <= MAX_PACKET_SIZE);
        }
        ClientToRelay::NotePreferred(preferred) => assert_eq!(*preferred, body[0] != 0),
        ClientToRelay::WatchConns => assert_eq!(frame.len, 0),
        ClientToRelay::ClosePeer(key) => assert_eq!(*key, key_at(body, 0)),
        ClientToRelay::Ping(data) => {
            assert_eq!(data[..], body[..8]);
            assert!(frame.len <= MAX_PING_LEN);
        }
        ClientToRelay::Pong(_) | ClientToRelay::Unknown { .. } => {
            panic!("the server decoder produced {msg:?}")
        }
    }
    let mut encoded = Vec::new();
    msg.encode(&mut encoded);
    assert_eq!(encoded.len(), msg.encoded_len());
    // Ping keeps only 8 of up to 1000 bytes; NotePreferred keeps only zero or not.
    let canonical = match msg {
        ClientToRelay::Ping(_) => frame.len == 8,
        ClientToRelay::NotePreferred(_) => body[0] <= 1,
        _ => true,
    };
    if canonical {
        assert_eq!(
            Some(&encoded[..]),
            frame.whole,
            "re-encoding changed {msg:?}"
        );
    }
    let mut decoder = if matches!(msg, ClientToRelay::ClientInfo { .. }) {
        ServerDecoder::new()
    } else {
        ServerDecoder::after_handshake()
    };
    let mut buf = BytesMut::from(&encoded[..]);
    let again = decoder.decode(&mut buf).expect("re-encoded frame decodes");
    assert_eq!(again.as_ref(), Some(msg), "decode(encode(msg)) != msg");
    assert!(buf.is_empty());
}

fn check_client_msg(msg: &RelayToClient, frame: &Frame<'_>) {
    let body = frame.body;
    if let RelayToClient::Unknown { frame_type, len } = *msg {
        assert_eq!((frame_type, len as usize), (frame.ty, frame.len));
        assert_eq!(frame.plan, Plan::Skip, "{msg:?} for a frame the rules read");
        return;
    }
    assert_ne!(frame.plan, Plan::Skip, "{msg:?} for a frame the rules skip");
    assert!(frame.len <= CLIENT_MAX_FRAME_LEN);
    assert_eq!(msg.frame_type().map(|t| t.as_u8()), Some(frame.ty));
    let mut canonical = true;
    match msg {
        RelayToClient::ServerKey(key) => {
            assert_eq!(body[..MAGIC.len()], MAGIC);
            assert_eq!(*key, key_at(body, MAGIC.len()));
            assert!(frame.len <= MAX_SERVER_KEY_LEN);
            canonical = frame.len == MAGIC.len() + KEY_LEN;
        }
        RelayToClient::ServerInfo { sealed } => {
            assert_eq!(sealed[..], body[..]);
            assert!(sealed.len() >= NONCE_LEN);
        }
        RelayToClient::RecvPacket { src, packet } => {
            assert_eq!(*src, key_at(body, 0));
            assert_eq!(packet[..], body[KEY_LEN..]);
        }
        RelayToClient::KeepAlive => canonical = frame.len == 0,
        RelayToClient::PeerGone { peer, reason } => {
            assert_eq!(*peer, key_at(body, 0));
            let want = body.get(KEY_LEN).map_or(PeerGoneReason::Disconnected, |b| {
                PeerGoneReason::from_u8(*b)
            });
            assert_eq!(*reason, want);
            canonical = frame.len == KEY_LEN + 1;
        }
        RelayToClient::PeerPresent { peer, addr, flags } => {
            assert_eq!(*peer, key_at(body, 0));
            let want_addr = match body.get(KEY_LEN..KEY_LEN + 18) {
                Some(raw) => {
                    let mut octets = [0u8; 16];
                    octets.copy_from_slice(&raw[..16]);
                    let ip = Ipv6Addr::from(octets).to_canonical();
                    SocketAddr::new(ip, u16::from_be_bytes([raw[16], raw[17]]))
                }
                None => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
            };
            assert_eq!(*addr, want_addr);
            assert_eq!(*flags, body.get(KEY_LEN + 18).copied().unwrap_or(0));
            canonical = frame.len == PEER_PRESENT_LEN;
        }
        RelayToClient::Ping(data) | RelayToClient::Pong(data) => {
            assert_eq!(data[..], body[..8]);
            canonical = frame.len == 8;
        }
        RelayToClient::Health(text) => {
            assert_eq!(*text, String::from_utf8_lossy(body));
            canonical = std::str::from_utf8(body).is_ok();
        }
        RelayToClient::Restarting {
            reconnect_in_ms,
            try_for_ms,
        } => {
            assert_eq!(reconnect_in_ms.to_be_bytes(), body[..4]);
            assert_eq!(try_for_ms.to_be_bytes(), body[4..8]);
            canonical = frame.len == 8;
        }
        RelayToClient::ObservedAddr(addr) => {
            let raw = &body[..18];
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&raw[..16]);
            let ip = Ipv6Addr::from(octets).to_canonical();
            assert_eq!(
                *addr,
                SocketAddr::new(ip, u16::from_be_bytes([raw[16], raw[17]]))
            );
            canonical = frame.len == 18;
        }
        RelayToClient::Unknown { .. } => unreachable!("handled above"),
    }
    let mut encoded = Vec::new();
    msg.encode(&mut encoded);
    assert_eq!(encoded.len(), msg.encoded_len());
    if canonical {
        assert_eq!(
            Some(&encoded[..]),
            frame.whole,
            "re-encoding changed {msg:?}"
        );
    }
    let mut buf = BytesMut::from(&encoded[..]);
    let again = ClientDecoder::new()
        .decode(&mut buf)
        .expect("re-encoded frame decodes");
    assert_eq!(again.as_ref(), Some(msg), "decode(encode(msg)) != msg");
    assert!(buf.is_empty());
}
