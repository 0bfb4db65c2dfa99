//! Property tests: round trips for every message, and decoders that never panic and do not
//! care how their input is split.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use bytes::{Bytes, BytesMut};
use derp_proto::frame::MAX_PACKET_SIZE;
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, DecodeError, MeshKey,
    PeerGoneReason, PublicKey, RelayToClient, SecretKey, ServerDecoder, ServerHandshake,
    ServerInfo,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn arb_key() -> impl Strategy<Value = PublicKey> {
    any::<[u8; 32]>().prop_map(PublicKey::from_bytes)
}

fn arb_bytes(len: impl Strategy<Value = usize>) -> impl Strategy<Value = Bytes> {
    len.prop_flat_map(|n| vec(any::<u8>(), n))
        .prop_map(Bytes::from)
}

/// Packet sizes: mostly small, sometimes at the 64 KiB limit.
fn arb_packet() -> impl Strategy<Value = Bytes> {
    arb_bytes(prop_oneof![
        8 => 0..300usize,
        1 => (MAX_PACKET_SIZE - 64)..=MAX_PACKET_SIZE,
    ])
}

/// Addresses that survive the wire: no flow info or scope, and IPv6 never IPv4-mapped
/// (the decoder unmaps those to IPv4, as the Go client does).
fn arb_addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>())
            .prop_map(|(ip, port)| SocketAddr::from((Ipv4Addr::from(ip), port))),
        (any::<[u8; 16]>(), any::<u16>()).prop_filter_map("IPv4-mapped", |(ip, port)| {
            let ip = Ipv6Addr::from(ip);
            ip.to_ipv4_mapped()
                .is_none()
                .then(|| SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0)))
        }),
    ]
}

/// Messages the server decoder dispatches after the handshake.
fn arb_relay_c2s() -> impl Strategy<Value = ClientToRelay> {
    prop_oneof![
        (arb_key(), arb_packet())
            .prop_map(|(dst, packet)| ClientToRelay::SendPacket { dst, packet }),
        (arb_key(), arb_key(), arb_packet())
            .prop_map(|(src, dst, packet)| ClientToRelay::ForwardPacket { src, dst, packet }),
        any::<bool>().prop_map(ClientToRelay::NotePreferred),
        Just(ClientToRelay::WatchConns),
        arb_key().prop_map(ClientToRelay::ClosePeer),
        any::<[u8; 8]>().prop_map(ClientToRelay::Ping),
    ]
}

fn arb_client_info_frame() -> impl Strategy<Value = ClientToRelay> {
    (arb_key(), arb_bytes(24..400usize))
        .prop_map(|(key, sealed)| ClientToRelay::ClientInfo { key, sealed })
}

fn arb_s2c() -> impl Strategy<Value = RelayToClient> {
    prop_oneof![
        arb_key().prop_map(RelayToClient::ServerKey),
        arb_bytes(24..400usize).prop_map(|sealed| RelayToClient::ServerInfo { sealed }),
        (arb_key(), arb_packet())
            .prop_map(|(src, packet)| RelayToClient::RecvPacket { src, packet }),
        Just(RelayToClient::KeepAlive),
        (arb_key(), any::<u8>()).prop_map(|(peer, reason)| RelayToClient::PeerGone {
            peer,
            reason: PeerGoneReason::from_u8(reason),
        }),
        (arb_key(), arb_addr(), any::<u8>())
            .prop_map(|(peer, addr, flags)| RelayToClient::PeerPresent { peer, addr, flags }),
        any::<[u8; 8]>().prop_map(RelayToClient::Ping),
        any::<[u8; 8]>().prop_map(RelayToClient::Pong),
        any::<String>().prop_map(RelayToClient::Health),
        (any::<u32>(), any::<u32>()).prop_map(|(reconnect_in_ms, try_for_ms)| {
            RelayToClient::Restarting {
                reconnect_in_ms,
                try_for_ms,
            }
        }),
        arb_addr().prop_map(RelayToClient::ObservedAddr),
    ]
}

/// Raw frames with any type byte and a body whose length may disagree with the header.
fn arb_frame_soup() -> impl Strategy<Value = Vec<u8>> {
    let frame = (
        prop_oneof![0x00..=0x16u8, any::<u8>()],
        vec(any::<u8>(), 0..120),
        prop_oneof![4 => Just(None), 1 => any::<u32>().prop_map(Some), 1 => (0..200u32).prop_map(Some)],
    )
        .prop_map(|(ty, body, len)| {
            let len = len.unwrap_or(body.len() as u32);
            let mut out = vec![ty];
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&body);
            out
        });
    vec(frame, 0..12).prop_map(|frames| frames.concat())
}

/// Anything that decodes frames, so the helpers work for both directions.
trait Decoder {
    type Msg;
    fn step(&mut self, buf: &mut BytesMut) -> Result<Option<Self::Msg>, DecodeError>;
}

impl Decoder for ServerDecoder {
    type Msg = ClientToRelay;
    fn step(&mut self, buf: &mut BytesMut) -> Result<Option<ClientToRelay>, DecodeError> {
        self.decode(buf)
    }
}

impl Decoder for ClientDecoder {
    type Msg = RelayToClient;
    fn step(&mut self, buf: &mut BytesMut) -> Result<Option<RelayToClient>, DecodeError> {
        self.decode(buf)
    }
}

/// Feeds `data` in pieces cut at `cuts`, decoding as far as possible after each piece; stops
/// at the first error. Returns the messages and the error, if any.
fn decode_in_pieces<D: Decoder>(
    mut decoder: D,
    data: &[u8],
    cuts: &[usize],
) -> (Vec<D::Msg>, Option<DecodeError>) {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    points.push(data.len());
    points.sort_unstable();
    let mut buf = BytesMut::new();
    let mut msgs = Vec::new();
    let mut start = 0;
    for end in points {
        buf.extend_from_slice(&data[start..end]);
        start = end;
        loop {
            match decoder.step(&mut buf) {
                Ok(Some(msg)) => msgs.push(msg),
                Ok(None) => break,
                Err(e) => return (msgs, Some(e)),
            }
        }
    }
    (msgs, None)
}

fn encode_c2s(msgs: &[ClientToRelay]) -> Vec<u8> {
    let mut out = Vec::new();
    for msg in msgs {
        msg.encode(&mut out);
    }
    out
}

fn encode_s2c(msgs: &[RelayToClient]) -> Vec<u8> {
    let mut out = Vec::new();
    for msg in msgs {
        msg.encode(&mut out);
    }
    out
}

fn arb_client_info() -> impl Strategy<Value = ClientInfo> {
    (
        proptest::option::of(any::<[u8; 32]>().prop_filter("zero key", |k| *k != [0; 32])),
        any::<i64>(),
        any::<bool>(),
        any::<bool>(),
        any::<String>(),
    )
        .prop_map(
            |(mesh, version, can_ack_pings, is_prober, app_name)| ClientInfo {
                mesh_key: mesh.map(MeshKey::from_bytes),
                version,
                can_ack_pings,
                is_prober,
                app_name,
            },
        )
}

proptest! {
    #[test]
    fn server_stream_round_trips(
        first in arb_client_info_frame(),
        rest in vec(arb_relay_c2s(), 0..16),
        cuts in vec(any::<usize>(), 0..8),
    ) {
        let mut msgs = vec![first];
        msgs.extend(rest);
        let data = encode_c2s(&msgs);
        let expected_len: usize = msgs.iter().map(ClientToRelay::encoded_len).sum();
        prop_assert_eq!(data.len(), expected_len);
        let (whole, err) = decode_in_pieces(ServerDecoder::new(), &data, &[]);
        prop_assert_eq!(err, None);
        prop_assert_eq!(&whole, &msgs);
        let (pieces, err) = decode_in_pieces(ServerDecoder::new(), &data, &cuts);
        prop_assert_eq!(err, None);
        prop_assert_eq!(pieces, msgs);
    }

    #[test]
    fn client_stream_round_trips(
        msgs in vec(arb_s2c(), 0..16),
        cuts in vec(any::<usize>(), 0..8),
    ) {
        let data = encode_s2c(&msgs);
        let expected_len: usize = msgs.iter().map(RelayToClient::encoded_len).sum();
        prop_assert_eq!(data.len(), expected_len);
        let (whole, err) = decode_in_pieces(ClientDecoder::new(), &data, &[]);
        prop_assert_eq!(err, None);
        prop_assert_eq!(&whole, &msgs);
        let (pieces, err) = decode_in_pieces(ClientDecoder::new(), &data, &cuts);
        prop_assert_eq!(err, None);
        prop_assert_eq!(pieces, msgs);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_splitting_changes_nothing(
        data in vec(any::<u8>(), 0..600),
        cuts in vec(any::<usize>(), 0..12),
    ) {
        let whole = decode_in_pieces(ServerDecoder::new(), &data, &[]);
        prop_assert_eq!(decode_in_pieces(ServerDecoder::new(), &data, &cuts), whole);
        let whole = decode_in_pieces(ServerDecoder::after_handshake(), &data, &[]);
        prop_assert_eq!(decode_in_pieces(ServerDecoder::after_handshake(), &data, &cuts), whole);
        let whole = decode_in_pieces(ClientDecoder::new(), &data, &[]);
        prop_assert_eq!(decode_in_pieces(ClientDecoder::new(), &data, &cuts), whole);
    }

    #[test]
    fn frame_shaped_garbage_never_panics_and_splitting_changes_nothing(
        data in arb_frame_soup(),
        cuts in vec(any::<usize>(), 0..12),
    ) {
        let whole = decode_in_pieces(ServerDecoder::after_handshake(), &data, &[]);
        prop_assert_eq!(decode_in_pieces(ServerDecoder::after_handshake(), &data, &cuts), whole);
        let whole = decode_in_pieces(ClientDecoder::new(), &data, &[]);
        prop_assert_eq!(decode_in_pieces(ClientDecoder::new(), &data, &cuts), whole);
        // Everything a decoder returns re-encodes to frames that decode to the same values.
        let (msgs, _) = decode_in_pieces(ClientDecoder::new(), &data, &cuts);
        let known: Vec<RelayToClient> = msgs
            .into_iter()
            .filter(|m| !matches!(m, RelayToClient::Unknown { .. }))
            .collect();
        let (again, err) = decode_in_pieces(ClientDecoder::new(), &encode_s2c(&known), &[]);
        prop_assert_eq!(err, None);
        prop_assert_eq!(again, known);
        let (msgs, _) = decode_in_pieces(ServerDecoder::after_handshake(), &data, &cuts);
        let known: Vec<ClientToRelay> = msgs
            .into_iter()
            .filter(|m| !matches!(m, ClientToRelay::Unknown { .. }))
            .collect();
        let (again, err) =
            decode_in_pieces(ServerDecoder::after_handshake(), &encode_c2s(&known), &[]);
        prop_assert_eq!(err, None);
        prop_assert_eq!(again, known);
    }

    #[test]
    fn client_info_json_round_trips(info in arb_client_info()) {
        let json = info.to_json();
        // Always well-formed JSON, with the same content serde_json sees.
        let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
        prop_assert_eq!(value["AppName"].as_str().unwrap_or(""), info.app_name.as_str());
        prop_assert_eq!(ClientInfo::from_json(&json), Ok(info));
    }

    #[test]
    fn server_info_json_round_trips(v in any::<i64>(), rate in any::<i64>(), burst in any::<i64>()) {
        let info = ServerInfo {
            version: v,
            token_bucket_bytes_per_second: rate,
            token_bucket_bytes_burst: burst,
        };
        prop_assert_eq!(ServerInfo::from_json(&info.to_json()), Ok(info));
    }

    #[test]
    fn info_decoders_never_panic(data in vec(any::<u8>(), 0..200)) {
        let _ = ClientInfo::from_json(&data);
        let _ = ServerInfo::from_json(&data);
    }

    #[test]
    fn json_shaped_garbage_never_panics(text in r#"[{}\[\]":,.\\/ a-zA-Z0-9ſK\-]{0,80}"#) {
        let _ = ClientInfo::from_json(text.as_bytes());
        let _ = ServerInfo::from_json(text.as_bytes());
        let wrapped = format!(r#"{{"AppName":"{text}","version":{text}}}"#);
        let _ = ClientInfo::from_json(wrapped.as_bytes());
    }

    #[test]
    fn public_key_text_round_trips(key in arb_key()) {
        prop_assert_eq!(key.to_string().parse::<PublicKey>(), Ok(key));
        prop_assert_eq!(key.to_untyped_hex().parse::<PublicKey>(), Ok(key));
        prop_assert_eq!(key.to_untyped_hex().to_uppercase().parse::<PublicKey>(), Ok(key));
        prop_assert_eq!(key.short().len(), 7);
    }

    #[test]
    fn key_parsers_never_panic(text in "\\PC{0,80}") {
        let _ = text.parse::<PublicKey>();
        let _ = text.parse::<SecretKey>();
        let _ = text.parse::<MeshKey>();
    }

    #[test]
    fn handshake_carries_any_client_info(
        info in arb_client_info(),
        server_seed in any::<[u8; 32]>(),
        client_seed in any::<[u8; 32]>(),
        nonces in any::<([u8; 24], [u8; 24])>(),
    ) {
        let server_secret = SecretKey::from_bytes(server_seed);
        let client_secret = SecretKey::from_bytes(client_seed);
        let mut client = ClientHandshake::fast_start(
            client_secret.clone(),
            info.clone(),
            server_secret.public_key(),
        );
        let mut wire = BytesMut::new();
        client.client_info_frame(nonces.0, &mut wire).unwrap();
        let Some(ClientToRelay::ClientInfo { key, sealed }) =
            ServerDecoder::new().decode(&mut wire).unwrap()
        else {
            panic!("expected ClientInfo");
        };
        prop_assert_eq!(key, client_secret.public_key());
        let mut server = ServerHandshake::new(server_secret);
        prop_assert_eq!(server.handle_client_info(key, &sealed), Ok(info));
        let mut reply = BytesMut::new();
        server.server_info_frame(nonces.1, &mut reply).unwrap();
        let Some(RelayToClient::ServerInfo { sealed }) =
            ClientDecoder::new().decode(&mut reply).unwrap()
        else {
            panic!("expected ServerInfo");
        };
        prop_assert_eq!(client.handle_server_info(&sealed), Ok(ServerInfo::default_server()));
        prop_assert!(client.is_done());
    }
}
