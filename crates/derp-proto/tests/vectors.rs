//! Every vector in keys.json, handshake.json and frames.json, reproduced byte for byte and
//! decoded back.

use std::net::SocketAddr;

use bytes::{Bytes, BytesMut};
use derp_proto::frame::{MAGIC, looks_like_disco};
use derp_proto::{
    BoxError, ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, DecodeError,
    HandshakeError, KeyPair, MeshKey, PeerGoneReason, PublicKey, RelayToClient, SecretKey,
    ServerDecoder, ServerHandshake, ServerInfo,
};
use derp_testkit::{client_a_secret, client_b_secret, public_key, server_secret, unhex, vectors};
use serde_json::Value;

fn text<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("missing string field {field} in {v}"))
}

fn hex_field(v: &Value, field: &str) -> Vec<u8> {
    unhex(text(v, field))
}

fn nonce_field(v: &Value) -> [u8; 24] {
    hex_field(v, "nonce_hex").try_into().expect("24-byte nonce")
}

fn secret_named(name: &str) -> SecretKey {
    match name {
        "server" => server_secret(),
        "client_a" => client_a_secret(),
        "client_b" => client_b_secret(),
        other => panic!("unknown key name {other}"),
    }
}

fn vector_mesh_key() -> MeshKey {
    let keys = vectors::keys();
    text(&keys["mesh_key"], "hex").parse().expect("mesh key")
}

/// Decodes one whole frame with a fresh client decoder and checks nothing is left over.
fn decode_client_frame(bytes: &[u8]) -> RelayToClient {
    let mut buf = BytesMut::from(bytes);
    let msg = ClientDecoder::new()
        .decode(&mut buf)
        .expect("decodes")
        .expect("complete frame");
    assert!(buf.is_empty(), "bytes left after decoding");
    msg
}

/// Decodes one whole frame with a relay-mode server decoder.
fn decode_server_frame(bytes: &[u8]) -> ClientToRelay {
    let mut buf = BytesMut::from(bytes);
    let msg = ServerDecoder::after_handshake()
        .decode(&mut buf)
        .expect("decodes")
        .expect("complete frame");
    assert!(buf.is_empty(), "bytes left after decoding");
    msg
}

#[test]
fn keys_text_forms_and_derivation() {
    let keys = vectors::keys();
    let entries = keys["keys"].as_array().expect("keys array");
    assert_eq!(entries.len(), 3);
    for entry in entries {
        let name = text(entry, "name");
        let seed: [u8; 32] = hex_field(entry, "seed_hex").try_into().expect("32 bytes");
        let private: [u8; 32] = hex_field(entry, "private_hex")
            .try_into()
            .expect("32 bytes");
        let public: [u8; 32] = hex_field(entry, "public_hex").try_into().expect("32 bytes");

        // Clamping the seed gives the private key, and changes exactly the listed bytes.
        let secret = SecretKey::from_bytes(seed);
        assert_eq!(secret.to_bytes(), private, "{name}: clamping");
        let changed: Vec<u64> = (0..32)
            .filter(|&i| seed[i] != private[i])
            .map(|i| i as u64)
            .collect();
        let expected: Vec<u64> = entry["clamping_changed_byte_indexes"]
            .as_array()
            .expect("indexes")
            .iter()
            .map(|v| v.as_u64().expect("index"))
            .collect();
        assert_eq!(changed, expected, "{name}: changed bytes");
        assert_eq!(SecretKey::from_bytes(private).to_bytes(), private);
        assert_eq!(secret_named(name).to_bytes(), private);

        // Derivation and text forms.
        let pk = secret.public_key();
        assert_eq!(pk.as_bytes(), &public, "{name}: public key");
        assert_eq!(pk, public_key(name));
        assert_eq!(secret.to_text(), text(entry, "private_text"));
        assert_eq!(pk.to_string(), text(entry, "public_text"));
        assert_eq!(pk.to_untyped_hex(), text(entry, "public_untyped_hex"));
        assert_eq!(pk.short(), text(entry, "public_short"));
        assert_eq!(
            format!("{pk:?}"),
            format!("PublicKey({})", text(entry, "public_short"))
        );

        // Parsing: typed, untyped, upper case.
        let parsed: PublicKey = text(entry, "public_text").parse().expect("typed");
        assert_eq!(parsed, pk);
        let parsed: PublicKey = text(entry, "public_untyped_hex").parse().expect("untyped");
        assert_eq!(parsed, pk);
        let upper = format!("nodekey:{}", text(entry, "public_hex").to_uppercase());
        assert_eq!(upper.parse::<PublicKey>().expect("upper"), pk);
        let parsed: SecretKey = text(entry, "private_text").parse().expect("privkey");
        assert_eq!(parsed.to_bytes(), private);
        let upper = format!("privkey:{}", text(entry, "private_hex").to_uppercase());
        assert_eq!(
            upper.parse::<SecretKey>().expect("upper").to_bytes(),
            private
        );
    }
}

#[test]
fn derper_config_holds_the_server_key() {
    let keys = vectors::keys();
    let config = &keys["derper_config"];
    for form in [
        text(config, "compact_json").to_owned(),
        String::from_utf8(hex_field(config, "file_contents_as_derper_writes_it_hex"))
            .expect("utf8"),
    ] {
        let parsed: Value = serde_json::from_str(&form).expect("config JSON");
        let secret: SecretKey = text(&parsed, "PrivateKey").parse().expect("privkey");
        assert_eq!(secret.to_bytes(), server_secret().to_bytes());
    }
}

/// HSalsa20 with a zero nonce: NaCl's `crypto_box_beforenm` step from the X25519 output.
/// Written out here so the vectors' precomputed keys can be checked independently.
fn hsalsa20_zero_nonce(key: &[u8; 32]) -> [u8; 32] {
    let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut x = [0u32; 16];
    x[0] = 0x6170_7865;
    x[5] = 0x3320_646e;
    x[10] = 0x7962_2d32;
    x[15] = 0x6b20_6574;
    for i in 0..4 {
        x[1 + i] = word(&key[4 * i..]);
        x[11 + i] = word(&key[16 + 4 * i..]);
    }
    let quarter = |x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
        x[b] ^= x[a].wrapping_add(x[d]).rotate_left(7);
        x[c] ^= x[b].wrapping_add(x[a]).rotate_left(9);
        x[d] ^= x[c].wrapping_add(x[b]).rotate_left(13);
        x[a] ^= x[d].wrapping_add(x[c]).rotate_left(18);
    };
    for _ in 0..10 {
        quarter(&mut x, 0, 4, 8, 12);
        quarter(&mut x, 5, 9, 13, 1);
        quarter(&mut x, 10, 14, 2, 6);
        quarter(&mut x, 15, 3, 7, 11);
        quarter(&mut x, 0, 1, 2, 3);
        quarter(&mut x, 5, 6, 7, 4);
        quarter(&mut x, 10, 11, 8, 9);
        quarter(&mut x, 15, 12, 13, 14);
    }
    let mut out = [0u8; 32];
    for (i, index) in [0, 5, 10, 15, 6, 7, 8, 9].into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&x[index].to_le_bytes());
    }
    out
}

#[test]
fn pairwise_shared_secrets_and_box_keys() {
    let keys = vectors::keys();
    let pairs = keys["pairwise_box_keys"].as_array().expect("pairs");
    assert_eq!(pairs.len(), 3);
    for pair in pairs {
        let names = pair["between"].as_array().expect("between");
        let a = secret_named(names[0].as_str().expect("name"));
        let b = secret_named(names[1].as_str().expect("name"));
        let expected = hex_field(pair, "x25519_shared_secret_hex");
        let shared = a.shared_secret(&b.public_key());
        assert_eq!(shared.to_vec(), expected);
        assert_eq!(b.shared_secret(&a.public_key()), shared);
        // The server's X25519 (aws-lc, through the key pair it keeps) gives the same bytes.
        let (pub_a, pub_b) = (a.public_key(), b.public_key());
        assert_eq!(KeyPair::new(a).shared_secret(&pub_b), shared);
        assert_eq!(KeyPair::new(b).shared_secret(&pub_a), shared);
        assert_eq!(
            hsalsa20_zero_nonce(&shared).to_vec(),
            hex_field(pair, "nacl_box_precomputed_key_hex")
        );
    }
}

#[test]
fn mesh_key_forms() {
    let keys = vectors::keys();
    let mesh = &keys["mesh_key"];
    let key = vector_mesh_key();
    let expected: Vec<u8> = (0xe0..=0xff).collect();
    assert_eq!(key.as_bytes().to_vec(), expected);
    assert_eq!(key.to_hex(), text(mesh, "hex"));
    assert_eq!(text(mesh, "text").parse::<MeshKey>().expect("text"), key);
    let json: String = serde_json::from_str(text(mesh, "json")).expect("json string");
    assert_eq!(json.parse::<MeshKey>().expect("json"), key);
    assert!(!key.is_zero());
}

#[test]
fn server_key_frame() {
    let hs = vectors::handshake();
    let vector = &hs["server_key_frame"];
    let frame = hex_field(vector, "frame_hex");

    let mut out = Vec::new();
    ServerHandshake::new(server_secret()).server_key_frame(&mut out);
    assert_eq!(out, frame);
    assert_eq!(hex_field(vector, "magic_hex"), MAGIC);

    let msg = decode_client_frame(&frame);
    assert_eq!(msg, RelayToClient::ServerKey(public_key("server")));
    assert_eq!(
        hex_field(vector, "server_public_hex"),
        public_key("server").as_bytes()
    );
    let RelayToClient::ServerKey(key) = msg else {
        unreachable!()
    };
    let mut client = ClientHandshake::new(client_a_secret(), ClientInfo::default());
    client.handle_server_key(key).expect("server key");
    assert_eq!(client.server_key(), Some(public_key("server")));
}

/// The ClientInfo the Go client encoded for each `client_info_frames` case.
fn expected_client_info(case: &str) -> ClientInfo {
    let base = ClientInfo {
        version: 2,
        ..ClientInfo::default()
    };
    match case {
        "normal" => ClientInfo {
            can_ack_pings: true,
            ..base
        },
        "mesh" => ClientInfo {
            mesh_key: Some(vector_mesh_key()),
            ..base
        },
        "prober" => ClientInfo {
            is_prober: true,
            ..base
        },
        "app_name" => ClientInfo {
            can_ack_pings: true,
            app_name: "vectors-app".to_owned(),
            ..base
        },
        other => panic!("unknown case {other}"),
    }
}

#[test]
fn client_info_frames() {
    let hs = vectors::handshake();
    let cases = hs["client_info_frames"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    for case in cases {
        let name = text(case, "case");
        let info = expected_client_info(name);
        let plaintext = hex_field(case, "plaintext_hex");
        let nonce = nonce_field(case);
        let frame = hex_field(case, "frame_hex");

        // Encoding: JSON, box and frame are all byte-exact.
        assert_eq!(info.to_json(), plaintext, "{name}: JSON");
        assert_eq!(plaintext, text(case, "plaintext_json").as_bytes());
        let sealed = client_a_secret().seal_to(&public_key("server"), &nonce, &plaintext);
        assert_eq!(sealed[..24], nonce);
        assert_eq!(sealed[24..], hex_field(case, "box_hex")[..], "{name}: box");
        let mut client = ClientHandshake::new(client_a_secret(), info.clone());
        client
            .handle_server_key(public_key("server"))
            .expect("server key");
        let mut out = Vec::new();
        client.client_info_frame(nonce, &mut out).expect("frame");
        assert_eq!(out, frame, "{name}: frame");

        // Decoding: the server decoder and handshake recover the same info.
        let mut buf = BytesMut::from(&frame[..]);
        let mut decoder = ServerDecoder::new();
        let msg = decoder.decode(&mut buf).expect("decode").expect("frame");
        let ClientToRelay::ClientInfo { key, sealed } = msg else {
            panic!("{name}: not ClientInfo: {msg:?}")
        };
        assert_eq!(key, public_key("client_a"));
        let mut server = ServerHandshake::new(server_secret());
        let got = server.handle_client_info(key, &sealed).expect("accepted");
        assert_eq!(got, info, "{name}: decoded info");
        assert_eq!(server.client_key(), Some(public_key("client_a")));
        let is_mesh = got.mesh_key.is_some_and(|k| k.ct_eq(&vector_mesh_key()));
        assert_eq!(is_mesh, name == "mesh");
        assert!(
            case["live_server_result"]["server_replied_with_ServerInfo"]
                .as_bool()
                .expect("bool")
        );
    }
}

#[test]
fn server_info_frame() {
    let hs = vectors::handshake();
    let vector = &hs["server_info_frame"];
    let frame = hex_field(vector, "frame_hex");
    let nonce = nonce_field(vector);
    assert_eq!(
        ServerInfo::default_server().to_json(),
        hex_field(vector, "plaintext_hex")
    );

    // Encode: the server handshake after accepting client_a's ClientInfo.
    let normal = &hs["client_info_frames"][0];
    let client_frame = hex_field(normal, "frame_hex");
    let mut server = ServerHandshake::new(server_secret());
    let mut out = Vec::new();
    assert_eq!(
        server.server_info_frame(nonce, &mut out),
        Err(HandshakeError::OutOfOrder)
    );
    server
        .handle_client_info(public_key("client_a"), &client_frame[5 + 32..])
        .expect("accepted");
    server.server_info_frame(nonce, &mut out).expect("frame");
    assert_eq!(out, frame);

    // Decode: the client handshake opens it.
    let msg = decode_client_frame(&frame);
    let RelayToClient::ServerInfo { sealed } = msg else {
        panic!("not ServerInfo: {msg:?}")
    };
    assert_eq!(sealed[24..], hex_field(vector, "box_hex")[..]);
    let mut client = ClientHandshake::fast_start(
        client_a_secret(),
        expected_client_info("normal"),
        public_key("server"),
    );
    let mut info_frame = Vec::new();
    client
        .client_info_frame(nonce_field(normal), &mut info_frame)
        .expect("client info");
    assert_eq!(info_frame, client_frame);
    assert!(!client.is_done());
    let info = client.handle_server_info(&sealed).expect("opens");
    assert_eq!(info, ServerInfo::default_server());
    assert!(client.is_done());
}

#[test]
fn negative_cases_are_refused() {
    let hs = vectors::handshake();
    let cases = hs["negative_cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = text(case, "case");
        let frame = hex_field(case, "frame_hex");
        let mut buf = BytesMut::from(&frame[..]);
        let decoded = ServerDecoder::new().decode(&mut buf);
        match name {
            "short_client_info" => {
                assert_eq!(
                    decoded,
                    Err(DecodeError::FrameTooShort {
                        frame_type: 2,
                        len: 55
                    })
                );
            }
            "sealed_to_wrong_server_key" | "tampered_ciphertext" => {
                let Ok(Some(ClientToRelay::ClientInfo { key, sealed })) = decoded else {
                    panic!("{name}: should frame-decode: {decoded:?}")
                };
                let mut server = ServerHandshake::new(server_secret());
                assert_eq!(
                    server.handle_client_info(key, &sealed),
                    Err(HandshakeError::Box(BoxError::Open)),
                    "{name}"
                );
                assert_eq!(server.client_key(), None);
                let opens_with_b = client_b_secret().open_from(&key, &sealed);
                assert_eq!(
                    opens_with_b.is_ok(),
                    case["opens_with_client_b_private_key"]
                        .as_bool()
                        .unwrap_or(false),
                    "{name}"
                );
                if let Ok(plain) = opens_with_b {
                    assert_eq!(plain, text(case, "plaintext_json").as_bytes());
                }
            }
            other => panic!("unknown negative case {other}"),
        }
    }
}

#[test]
fn client_info_json_variants() {
    let hs = vectors::handshake();
    let variants = hs["client_info_json_variants"]["variants"]
        .as_array()
        .expect("variants");
    assert!(variants.len() >= 11);
    let mesh = vector_mesh_key();
    for variant in variants {
        let what = text(variant, "what");
        let json = text(variant, "plaintext_json");
        let nonce = nonce_field(variant);
        let frame = hex_field(variant, "frame_hex");

        // The frame is exactly client_a sealing this plaintext to the server.
        let mut expected = Vec::new();
        ClientToRelay::ClientInfo {
            key: public_key("client_a"),
            sealed: Bytes::from(client_a_secret().seal_to(
                &public_key("server"),
                &nonce,
                json.as_bytes(),
            )),
        }
        .encode(&mut expected);
        assert_eq!(expected, frame, "{what}: frame");

        let mut buf = BytesMut::from(&frame[..]);
        let Ok(Some(ClientToRelay::ClientInfo { key, sealed })) =
            ServerDecoder::new().decode(&mut buf)
        else {
            panic!("{what}: frame does not decode")
        };
        let mut server = ServerHandshake::new(server_secret());
        let result = server.handle_client_info(key, &sealed);
        let accepted = variant["server_accepted"].as_bool().expect("bool");
        assert_eq!(result.is_ok(), accepted, "{what}: {json} -> {result:?}");
        if let Ok(info) = result {
            let is_mesh = info.mesh_key.is_some_and(|k| k.ct_eq(&mesh));
            let expected_mesh = variant["server_treated_as_mesh_peer"]
                .as_bool()
                .expect("bool");
            assert_eq!(is_mesh, expected_mesh, "{what}: mesh");
        } else {
            assert!(matches!(result, Err(HandshakeError::Info(_))), "{what}");
        }
    }
}

/// Builds the message a frames.json entry describes from its `inputs`.
enum Built {
    C2s(ClientToRelay),
    S2c(RelayToClient),
}

fn key_input(inputs: &Value, field: &str) -> PublicKey {
    public_key(text(inputs, field))
}

fn data8(inputs: &Value) -> [u8; 8] {
    hex_field(inputs, "data_hex").try_into().expect("8 bytes")
}

fn build_frame(entry: &Value) -> Built {
    let inputs = &entry["inputs"];
    let name = text(entry, "name");
    let packet = || Bytes::from(hex_field(inputs, "packet_hex"));
    match entry["frame_type"].as_u64().expect("type") {
        0x04 => Built::C2s(ClientToRelay::SendPacket {
            dst: key_input(inputs, "destination"),
            packet: packet(),
        }),
        0x05 => Built::S2c(RelayToClient::RecvPacket {
            src: key_input(inputs, "source"),
            packet: packet(),
        }),
        0x06 => Built::S2c(RelayToClient::KeepAlive),
        0x07 => Built::C2s(ClientToRelay::NotePreferred(
            inputs["preferred"].as_bool().expect("bool"),
        )),
        0x08 => Built::S2c(RelayToClient::PeerGone {
            peer: key_input(inputs, "peer"),
            reason: PeerGoneReason::from_u8(inputs["reason"].as_u64().expect("reason") as u8),
        }),
        0x09 => {
            let addr: SocketAddr = text(inputs, "ip_port")
                .parse()
                .unwrap_or_else(|_| "[::]:0".parse().expect("literal"));
            Built::S2c(RelayToClient::PeerPresent {
                peer: key_input(inputs, "peer"),
                addr,
                flags: inputs["flags"].as_u64().expect("flags") as u8,
            })
        }
        0x0a => Built::C2s(ClientToRelay::ForwardPacket {
            src: key_input(inputs, "source"),
            dst: key_input(inputs, "destination"),
            packet: packet(),
        }),
        0x10 => Built::C2s(ClientToRelay::WatchConns),
        0x11 => Built::C2s(ClientToRelay::ClosePeer(key_input(inputs, "target"))),
        0x12 => Built::C2s(ClientToRelay::Ping(data8(inputs))),
        0x13 if text(entry, "direction") == "client_to_server" => {
            Built::C2s(ClientToRelay::Pong(data8(inputs)))
        }
        0x13 => Built::S2c(RelayToClient::Pong(data8(inputs))),
        0x14 => Built::S2c(RelayToClient::Health(text(inputs, "problem").to_owned())),
        0x15 => Built::S2c(RelayToClient::Restarting {
            reconnect_in_ms: inputs["reconnect_in_ms"].as_u64().expect("ms") as u32,
            try_for_ms: inputs["try_for_ms"].as_u64().expect("ms") as u32,
        }),
        other => panic!("{name}: no builder for frame type {other}"),
    }
}

/// Checks a decoded server-to-client message against the vector's `go_client_parses_as`.
fn check_go_client_parse(name: &str, msg: &RelayToClient, go: &Value) {
    match msg {
        RelayToClient::RecvPacket { src, packet } => {
            assert_eq!(src.to_string(), text(go, "Source"), "{name}");
            assert_eq!(packet[..], hex_field(go, "Data_hex")[..], "{name}");
        }
        RelayToClient::KeepAlive => assert_eq!(text(go, "go_type"), "derp.KeepAliveMessage"),
        RelayToClient::PeerGone { peer, reason } => {
            assert_eq!(peer.to_string(), text(go, "Peer"), "{name}");
            assert_eq!(
                u64::from(reason.to_u8()),
                go["Reason"].as_u64().expect("reason")
            );
        }
        RelayToClient::PeerPresent { peer, addr, flags } => {
            assert_eq!(peer.to_string(), text(go, "Key"), "{name}");
            assert_eq!(addr.to_string(), text(go, "IPPort"), "{name}");
            assert_eq!(u64::from(*flags), go["Flags"].as_u64().expect("flags"));
        }
        RelayToClient::Pong(data) => assert_eq!(data[..], hex_field(go, "data_hex")[..]),
        RelayToClient::Health(problem) => assert_eq!(problem, text(go, "Problem")),
        RelayToClient::Restarting {
            reconnect_in_ms,
            try_for_ms,
        } => {
            assert_eq!(
                u64::from(*reconnect_in_ms),
                go["ReconnectIn_ms"].as_u64().expect("ms")
            );
            assert_eq!(
                u64::from(*try_for_ms),
                go["TryFor_ms"].as_u64().expect("ms")
            );
        }
        other => panic!("{name}: unexpected {other:?}"),
    }
}

#[test]
fn frames_encode_and_decode() {
    let frames = vectors::frames();
    let entries = frames["frames"].as_array().expect("frames");
    assert_eq!(entries.len(), 20);
    for entry in entries {
        let name = text(entry, "name");
        let bytes = hex_field(entry, "frame_hex");
        assert_eq!(
            bytes.len(),
            5 + entry["payload_len"].as_u64().expect("len") as usize
        );
        assert_eq!(bytes[..5], hex_field(entry, "header_hex")[..], "{name}");
        match build_frame(entry) {
            Built::C2s(msg) => {
                let mut out = Vec::new();
                msg.encode(&mut out);
                assert_eq!(out, bytes, "{name}: encode");
                assert_eq!(msg.encoded_len(), bytes.len(), "{name}");
                let decoded = decode_server_frame(&bytes);
                if matches!(msg, ClientToRelay::Pong(_)) {
                    // The server skips client pongs without closing the connection.
                    assert_eq!(
                        decoded,
                        ClientToRelay::Unknown {
                            frame_type: 0x13,
                            len: 8
                        }
                    );
                } else {
                    assert_eq!(decoded, msg, "{name}: decode");
                }
            }
            Built::S2c(msg) => {
                let mut out = Vec::new();
                msg.encode(&mut out);
                assert_eq!(out, bytes, "{name}: encode");
                assert_eq!(msg.encoded_len(), bytes.len(), "{name}");
                let decoded = decode_client_frame(&bytes);
                assert_eq!(decoded, msg, "{name}: decode");
                check_go_client_parse(name, &decoded, &entry["go_client_parses_as"]);
            }
        }
    }
}

#[test]
fn recv_packet_header_matches_vector() {
    let frames = vectors::frames();
    let entry = frames["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .find(|f| f["name"] == "RecvPacket")
        .expect("RecvPacket vector");
    let bytes = hex_field(entry, "frame_hex");
    let packet = hex_field(&frames["packet_used"], "hex");
    let header = derp_proto::frame::recv_packet_header(&public_key("client_a"), packet.len());
    assert_eq!(header[..], bytes[..37]);
    assert_eq!(packet[..], bytes[37..]);
}

#[test]
fn disco_like_packet() {
    let frames = vectors::frames();
    let disco = unhex(text(&frames, "disco_like_packet_hex"));
    assert_eq!(disco.len(), 62);
    assert!(looks_like_disco(&disco));
    assert!(!looks_like_disco(&disco[..61]));
    assert!(!looks_like_disco(&hex_field(&frames["packet_used"], "hex")));
    let mut not_disco = disco;
    not_disco[0] ^= 1;
    assert!(!looks_like_disco(&not_disco));
}

#[test]
fn ping_data_vector() {
    let frames = vectors::frames();
    let data: [u8; 8] = unhex(text(&frames, "ping_data_hex")).try_into().expect("8");
    let mut out = Vec::new();
    ClientToRelay::Ping(data).encode(&mut out);
    assert_eq!(out, unhex("12000000080102030405060708"));
}
