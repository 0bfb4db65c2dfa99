//! The reference recordings replayed against a live server: http.json and session.json.

use bytes::BytesMut;
use derp_proto::{ClientDecoder, ClientHandshake, ClientInfo, RelayToClient, SecretKey};
use derp_testkit::{client_a_secret, client_b_secret, unhex, vectors};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::{RawClient, STEP, TestServer};

/// Concatenates one direction of a recorded transcript.
fn stream(exchange: &Value, dir: &str) -> Vec<u8> {
    exchange["transcript"]
        .as_array()
        .expect("transcript")
        .iter()
        .filter(|c| c["dir"] == dir)
        .flat_map(|c| unhex(c["hex"].as_str().expect("hex")))
        .collect()
}

/// Reads from `s` until `buf` holds at least `n` bytes.
async fn read_at_least(s: &mut TcpStream, buf: &mut BytesMut, n: usize) {
    while buf.len() < n {
        buf.reserve(4096);
        let got = tokio::time::timeout(STEP, s.read_buf(buf))
            .await
            .expect("timed out")
            .expect("read");
        assert!(got > 0, "server closed after {} bytes", buf.len());
    }
}

/// Decodes the ServerInfo that follows and checks it opens to `{"version":2}` for client_a.
fn check_server_info(buf: &mut BytesMut) {
    let mut dec = ClientDecoder::new();
    let sealed = match dec.decode(buf).expect("decode") {
        Some(RelayToClient::ServerInfo { sealed }) => sealed,
        other => panic!("expected ServerInfo, got {other:?}"),
    };
    let server = derp_testkit::public_key("server");
    let plain = client_a_secret()
        .open_from(&server, &sealed)
        .expect("ServerInfo opens with client_a's key");
    assert_eq!(plain, br#"{"version":2}"#);
}

#[tokio::test]
async fn plain_upgrade_matches_recording_byte_for_byte() {
    let srv = TestServer::start_default().await;
    let http = vectors::http();
    let ex = &http["plain_upgrade"];
    let c2s = stream(ex, "c2s");
    let expected_head = unhex(ex["response_hex"].as_str().expect("response"));
    let server_key_frame = unhex(
        vectors::handshake()["server_key_frame"]["frame_hex"]
            .as_str()
            .expect("frame"),
    );

    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    s.write_all(&c2s).await.expect("write");
    let mut buf = BytesMut::new();
    let first = expected_head.len() + server_key_frame.len();
    read_at_least(&mut s, &mut buf, first).await;
    assert_eq!(&buf[..expected_head.len()], &expected_head[..], "101 head");
    assert_eq!(
        &buf[expected_head.len()..first],
        &server_key_frame[..],
        "ServerKey frame"
    );
    let _ = buf.split_to(first);
    read_at_least(&mut s, &mut buf, 5 + 24 + 16 + 13).await;
    check_server_info(&mut buf);
    srv.stop().await;
}

#[tokio::test]
async fn fast_start_sends_no_http_response_and_keeps_early_bytes() {
    let srv = TestServer::start_default().await;
    let http = vectors::http();
    let ex = &http["fast_start"];
    assert!(ex["response_hex"].is_null());
    // The request head and the ClientInfo frame arrive in one write.
    let c2s = stream(ex, "c2s");
    let server_key_frame = unhex(
        vectors::handshake()["server_key_frame"]["frame_hex"]
            .as_str()
            .expect("frame"),
    );
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    s.write_all(&c2s).await.expect("write");
    let mut buf = BytesMut::new();
    read_at_least(&mut s, &mut buf, server_key_frame.len()).await;
    assert_eq!(&buf[..server_key_frame.len()], &server_key_frame[..]);
    let _ = buf.split_to(server_key_frame.len());
    read_at_least(&mut s, &mut buf, 5 + 24 + 16 + 13).await;
    check_server_info(&mut buf);
    srv.stop().await;
}

#[tokio::test]
async fn websocket_exchange_works() {
    let srv = TestServer::start_default().await;
    let http = vectors::http();
    let ex = &http["websocket"];
    let request = unhex(ex["request_hex"].as_str().expect("request"));
    let recorded =
        String::from_utf8(unhex(ex["response_hex"].as_str().expect("resp"))).expect("utf8");
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    // Replay the whole client side: request, masked ClientInfo, then the close frame.
    let c2s = stream(ex, "c2s");
    assert!(c2s.starts_with(&request));
    s.write_all(&c2s).await.expect("write");
    let mut buf = BytesMut::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let want = buf.len() + 1;
        read_at_least(&mut s, &mut buf, want).await;
    };
    let head = String::from_utf8(buf.split_to(head_end).to_vec()).expect("utf8 head");
    // Same head as derper's, apart from the Date header it adds.
    let strip_date = |h: &str| {
        h.split("\r\n")
            .filter(|l| !l.starts_with("Date:"))
            .collect::<Vec<_>>()
            .join("\r\n")
    };
    assert_eq!(strip_date(&head), strip_date(&recorded));

    // Unwrap the server's binary messages and compare the DERP frames inside.
    let expected_s2c: Vec<Vec<u8>> = ex["derp_frames_inside_websocket"]
        .as_array()
        .expect("frames")
        .iter()
        .filter(|f| f["dir"] == "s2c")
        .map(|f| unhex(f["hex"].as_str().expect("hex")))
        .collect();
    let mut derp = BytesMut::new();
    let mut close_code = None;
    while close_code.is_none() {
        read_at_least(&mut s, &mut buf, 2).await;
        let len7 = (buf[1] & 0x7f) as usize;
        let (hdr, len) = match len7 {
            126 => {
                read_at_least(&mut s, &mut buf, 4).await;
                (4, u16::from_be_bytes([buf[2], buf[3]]) as usize)
            }
            127 => panic!("unexpectedly long message"),
            n => (2, n),
        };
        read_at_least(&mut s, &mut buf, hdr + len).await;
        let opcode = buf[0] & 0x0f;
        assert_eq!(buf[1] & 0x80, 0, "server frames are not masked");
        let frame = buf.split_to(hdr + len);
        match opcode {
            2 => derp.extend_from_slice(&frame[hdr..]),
            8 => close_code = Some(u16::from_be_bytes([frame[hdr], frame[hdr + 1]])),
            other => panic!("unexpected opcode {other}"),
        }
    }
    // ServerKey is exact; ServerInfo carries a random nonce, so it is opened instead.
    assert_eq!(&derp[..expected_s2c[0].len()], &expected_s2c[0][..]);
    let _ = derp.split_to(expected_s2c[0].len());
    check_server_info(&mut derp);
    assert_eq!(
        close_code,
        Some(1000),
        "server echoes the client's close code"
    );
    srv.stop().await;
}

fn session_packet(p: &Value) -> Vec<u8> {
    let size = p["size"].as_u64().expect("size") as usize;
    let rule = p["content_rule"].as_str().expect("rule");
    // "byte i = (i + K) mod 251"
    let k: usize = rule
        .split("(i + ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|k| k.parse().ok())
        .expect("content rule");
    let data: Vec<u8> = (0..size).map(|i| ((i + k) % 251) as u8).collect();
    assert_eq!(
        hex::encode(Sha256::digest(&data)),
        p["sha256"].as_str().expect("sha")
    );
    data
}

/// Expected s2c frames of one client's recorded transcript that must match exactly.
fn recorded_frames(session: &Value, client: &str) -> Vec<(String, String, Option<Value>)> {
    let c = session["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .find(|c| c["client"] == client)
        .expect("client transcript");
    c["transcript"]
        .as_array()
        .expect("transcript")
        .iter()
        .filter(|t| t["dir"] == "s2c" && t["kind"] == "derp_frame")
        .map(|t| {
            (
                t["frame"].as_str().expect("frame").to_owned(),
                t["hex"].as_str().expect("hex").to_owned(),
                t.get("elided").cloned(),
            )
        })
        .collect()
}

fn encoded(frame: &RelayToClient) -> Vec<u8> {
    let mut out = Vec::new();
    frame.encode(&mut out);
    out
}

#[tokio::test]
async fn recorded_session_replays_exactly() {
    let srv = TestServer::start_default().await;
    let session = vectors::session();
    let packets: Vec<Vec<u8>> = session["packets"]
        .as_array()
        .expect("packets")
        .iter()
        .map(session_packet)
        .collect();
    let mut a = RawClient::connect_with(srv.addr, client_a_secret()).await;
    let mut b = RawClient::connect_with(srv.addr, client_b_secret()).await;
    assert_eq!(a.server_info.expect("info").version, 2);

    for p in &packets[..3] {
        a.send_packet(b.key, p).await;
    }
    b.send_packet(a.key, &packets[3]).await;

    let expected_b = recorded_frames(&session, "client_b");
    let recv_b: Vec<_> = expected_b
        .iter()
        .filter(|(name, _, _)| name == "RecvPacket")
        .collect();
    assert_eq!(recv_b.len(), 3);
    for (name, hex, elided) in recv_b {
        let got = encoded(&b.recv().await);
        match elided {
            None => assert_eq!(hex::encode(&got), *hex, "{name}"),
            Some(e) => {
                // The recording keeps only the first 37 bytes of the 64 KiB frame and the
                // SHA-256 of the whole entry.
                assert_eq!(hex::encode(&got[..37]), *hex);
                assert_eq!(
                    hex::encode(Sha256::digest(&got)),
                    e["sha256_of_full_segment"].as_str().expect("sha")
                );
            }
        }
    }

    let expected_a = recorded_frames(&session, "client_a");
    let (_, recv_hex, _) = expected_a
        .iter()
        .find(|(name, _, _)| name == "RecvPacket")
        .expect("A's RecvPacket");
    assert_eq!(hex::encode(encoded(&a.recv().await)), *recv_hex);

    let ping = [0xd0, 0xfd, 0x33, 0xf2, 0xf6, 0x76, 0x3b, 0x22];
    a.send(derp_proto::ClientToRelay::Ping(ping)).await;
    assert_eq!(a.recv().await, RelayToClient::Pong(ping));

    drop(b);
    let (_, gone_hex, _) = expected_a
        .iter()
        .find(|(name, _, _)| name == "PeerGone")
        .expect("A's PeerGone");
    assert_eq!(hex::encode(encoded(&a.recv().await)), *gone_hex);
    srv.stop().await;
}

#[tokio::test]
async fn oversize_packet_closes_only_the_sender() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let max = vec![3u8; derp_proto::frame::MAX_PACKET_SIZE];
    a.send_packet(b.key, &max).await;
    let (src, got) = b.recv_packet().await;
    assert_eq!((src, got.len()), (a.key, max.len()));

    let too_big = vec![3u8; derp_proto::frame::MAX_PACKET_SIZE + 1];
    a.send_packet(b.key, &too_big).await;
    a.expect_closed().await;
    // B hears that A left (it had received from A), and is otherwise unaffected.
    assert_eq!(
        b.recv().await,
        RelayToClient::PeerGone {
            peer: a.key,
            reason: derp_proto::PeerGoneReason::Disconnected
        }
    );
    b.send(derp_proto::ClientToRelay::Ping([1; 8])).await;
    assert_eq!(b.recv().await, RelayToClient::Pong([1; 8]));
    srv.stop().await;
}

#[tokio::test]
async fn handshake_negative_cases_close_silently() {
    let srv = TestServer::start_default().await;
    let hs = vectors::handshake();
    for case in hs["negative_cases"].as_array().expect("negative cases") {
        let frame = unhex(case["frame_hex"].as_str().expect("frame"));
        let mut c = RawClient::upgrade(srv.addr, SecretKey::from_bytes([9; 32]), "").await;
        match c.recv().await {
            RelayToClient::ServerKey(_) => {}
            other => panic!("expected ServerKey, got {other:?}"),
        }
        c.send_raw(&frame).await;
        // Nothing more: no ServerInfo, no error text, just the close.
        c.expect_refused(&case.to_string()).await;
    }
    srv.stop().await;
}

#[tokio::test]
async fn every_client_info_variant_is_treated_like_the_reference() {
    let srv = TestServer::start(derp_server::ServerConfig {
        mesh_key: Some(
            vectors::keys()["mesh_key"]["hex"]
                .as_str()
                .expect("mesh key")
                .parse()
                .expect("valid"),
        ),
        ..derp_server::ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let hs = vectors::handshake();
    for v in hs["client_info_json_variants"]["variants"]
        .as_array()
        .expect("variants")
    {
        let frame = unhex(v["frame_hex"].as_str().expect("frame_hex"));
        let accepted = v["server_accepted"].as_bool().expect("accepted");
        let mut c = RawClient::upgrade(srv.addr, client_a_secret(), "").await;
        assert!(matches!(c.recv().await, RelayToClient::ServerKey(_)));
        c.stream.write_all(&frame).await.expect("write");
        if accepted {
            assert!(
                matches!(c.recv().await, RelayToClient::ServerInfo { .. }),
                "{v}"
            );
            // Mesh-ness: WatchConns is allowed only for mesh peers.
            c.send(derp_proto::ClientToRelay::WatchConns).await;
            let mesh = v["server_treated_as_mesh_peer"].as_bool().unwrap_or(false);
            if mesh {
                assert!(
                    matches!(c.recv().await, RelayToClient::PeerPresent { .. }),
                    "{v}"
                );
            } else {
                c.expect_closed().await;
            }
        } else {
            c.expect_refused(&format!("refused variant {v}")).await;
        }
    }
    srv.stop().await;
}

#[tokio::test]
async fn go_client_info_frames_are_all_accepted() {
    let srv = TestServer::start_default().await;
    let hs = vectors::handshake();
    for case in hs["client_info_frames"].as_array().expect("frames") {
        let frame = unhex(case["frame_hex"].as_str().expect("frame"));
        let mut c = RawClient::upgrade(srv.addr, client_a_secret(), "").await;
        assert!(matches!(c.recv().await, RelayToClient::ServerKey(_)));
        c.stream.write_all(&frame).await.expect("write");
        match c.recv().await {
            RelayToClient::ServerInfo { sealed } => {
                let mut chs = ClientHandshake::new(client_a_secret(), ClientInfo::default());
                chs.handle_server_key(derp_testkit::public_key("server"))
                    .expect("key");
                let mut scratch = BytesMut::new();
                chs.client_info_frame([0; 24], &mut scratch).expect("info");
                assert_eq!(chs.handle_server_info(&sealed).expect("opens").version, 2);
            }
            other => panic!("{}: expected ServerInfo, got {other:?}", case["case"]),
        }
    }
    srv.stop().await;
}
