//! Client tests against tiny in-test servers: recorded Go exchanges replayed byte for byte, and a
//! fake relay built from `derp_proto`'s server-side pieces.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_proto::frame::{FRAME_HEADER_LEN, MAX_PACKET_SIZE};
use derp_proto::{
    ClientToRelay, HandshakeError, PeerGoneReason, PublicKey, RelayToClient, SecretKey,
    ServerDecoder, ServerHandshake, ServerInfo,
};
use derp_testkit::{client_a_secret, client_b_secret, public_key, server_secret, unhex, vectors};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::{Client, ClientConfig, ClientError, ConnectError, ReceivedFrame, TransportKind};
use derp_proto::upgrade::UpgradeError;
use derp_proto::ws::{self, Opcode, Role, WsDecoder, WsEvent};

/// Wall-clock bound for anything a test waits on, so a bug fails instead of hanging.
const TEST_TIMEOUT: Duration = Duration::from_secs(10);

async fn within<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_TIMEOUT, fut)
        .await
        .expect("test step timed out")
}

fn exchange(name: &str) -> serde_json::Value {
    vectors::http()[name].clone()
}

/// The recorded server-to-client chunks of an exchange, in order.
fn s2c_chunks(ex: &serde_json::Value) -> Vec<Vec<u8>> {
    ex["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["dir"] == "s2c")
        .map(|c| unhex(c["hex"].as_str().unwrap()))
        .collect()
}

async fn listen() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/derp", listener.local_addr().unwrap());
    (listener, url)
}

fn config(url: &str, secret: SecretKey) -> ClientConfig {
    ClientConfig::new(url, secret).unwrap()
}

/// Reads up to and including the blank line ending an HTTP head; extra bytes stay in `buf`.
async fn read_head(io: &mut (impl AsyncRead + Unpin), buf: &mut BytesMut) -> String {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = buf.split_to(end + 4);
            return String::from_utf8(head.to_vec()).unwrap();
        }
        let n = io.read_buf(buf).await.unwrap();
        assert!(n > 0, "eof before the end of the request head");
    }
}

/// Reads until `buf` holds at least `n` bytes.
async fn read_at_least(io: &mut (impl AsyncRead + Unpin), buf: &mut BytesMut, n: usize) {
    while buf.len() < n {
        let read = io.read_buf(buf).await.unwrap();
        assert!(read > 0, "eof with {} of {n} bytes", buf.len());
    }
}

fn header_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

/// Checks our request head against the Go client's: same request line, same headers in the same
/// order, same values except `Host` (the port differs) and `User-Agent` (ours names this crate).
fn assert_head_matches_recorded(ours: &str, recorded: &str, host: &str) {
    let ours: Vec<&str> = ours.split("\r\n").collect();
    let recorded: Vec<&str> = recorded.split("\r\n").collect();
    assert_eq!(ours[0], recorded[0], "request line");
    // The Go client adds Accept-Encoding to WebSocket requests; it means nothing for a 101.
    let recorded: Vec<&str> = recorded
        .into_iter()
        .filter(|l| !l.starts_with("Accept-Encoding:"))
        .collect();
    assert_eq!(ours.len(), recorded.len(), "{ours:?} vs {recorded:?}");
    for (o, r) in ours.iter().zip(&recorded).skip(1) {
        let (Some((on, ov)), Some((rn, rv))) = (o.split_once(": "), r.split_once(": ")) else {
            assert_eq!(o, r);
            continue;
        };
        assert_eq!(on, rn, "header order");
        match on {
            "Host" => assert_eq!(ov, host),
            "User-Agent" => assert_eq!(ov, concat!("derp-client/", env!("CARGO_PKG_VERSION"))),
            "Sec-Websocket-Key" => assert_eq!(ov.len(), rv.len()),
            _ => assert_eq!(ov, rv, "value of {on}"),
        }
    }
}

/// Opens a ClientInfo frame with the reference server key, as derper would.
fn open_client_info(buf: &mut BytesMut) -> (PublicKey, derp_proto::ClientInfo) {
    let mut decoder = ServerDecoder::new();
    let Some(ClientToRelay::ClientInfo { key, sealed }) = decoder.decode(buf).unwrap() else {
        panic!("first client frame is not ClientInfo");
    };
    let info = ServerHandshake::new(server_secret())
        .handle_client_info(key, &sealed)
        .unwrap();
    (key, info)
}

#[tokio::test]
async fn replays_recorded_plain_upgrade() {
    let ex = exchange("plain_upgrade");
    let chunks = s2c_chunks(&ex);
    let recorded = ex["request_text"].as_str().unwrap().to_owned();
    let (listener, url) = listen().await;
    let host = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        let head = read_head(&mut io, &mut buf).await;
        assert!(buf.is_empty(), "client spoke before the 101");
        io.write_all(&chunks[0]).await.unwrap();
        read_at_least(&mut io, &mut buf, 109).await;
        let (key, info) = open_client_info(&mut buf);
        io.write_all(&chunks[1]).await.unwrap();
        // Stay connected until the client hangs up.
        let _ = io.read_buf(&mut buf).await;
        (head, key, info)
    });

    let client = within(Client::connect(&config(&url, client_a_secret())))
        .await
        .unwrap();
    assert_eq!(client.server_key(), public_key("server"));
    assert_eq!(client.server_info(), ServerInfo::default_server());
    assert_eq!(client.server_info().version, 2);
    client.close().await.unwrap();

    let (head, key, info) = within(server).await.unwrap();
    assert_head_matches_recorded(&head, &recorded, &host);
    assert_eq!(key, public_key("client_a"));
    assert_eq!(info.to_json(), br#"{"version":2,"CanAckPings":true}"#);
}

#[tokio::test]
async fn replays_recorded_fast_start() {
    let ex = exchange("fast_start");
    let chunks = s2c_chunks(&ex);
    let recorded = ex["request_text"].as_str().unwrap().to_owned();
    let (listener, url) = listen().await;
    let host = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        // Nothing is sent until the client's ClientInfo is in: the client must not wait for a
        // response.
        let head = read_head(&mut io, &mut buf).await;
        read_at_least(&mut io, &mut buf, 109).await;
        let (key, _) = open_client_info(&mut buf);
        for chunk in &chunks {
            io.write_all(chunk).await.unwrap();
        }
        let _ = io.read_buf(&mut buf).await;
        (head, key)
    });

    let cfg = config(&url, client_a_secret()).with_fast_start_key(public_key("server"));
    let client = within(Client::connect(&cfg)).await.unwrap();
    assert_eq!(client.server_info().version, 2);
    drop(client);
    let (head, key) = within(server).await.unwrap();
    assert_head_matches_recorded(&head, &recorded, &host);
    assert_eq!(key, public_key("client_a"));
}

/// Splits a recorded WebSocket stream into its frames (header parsing only).
fn split_ws_frames(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len7 = usize::from(bytes[1] & 0x7f);
        let masked = bytes[1] & 0x80 != 0;
        let (len, ext) = match len7 {
            126 => (usize::from(u16::from_be_bytes([bytes[2], bytes[3]])), 2),
            127 => unreachable!("recorded frames are small"),
            n => (n, 0),
        };
        let total = 2 + ext + if masked { 4 } else { 0 } + len;
        out.push(bytes[..total].to_vec());
        bytes = &bytes[total..];
    }
    out
}

/// Unframes client WebSocket bytes until `out` holds `n` DERP bytes or a control arrives.
async fn read_ws_payload(
    io: &mut (impl AsyncRead + Unpin),
    raw: &mut BytesMut,
    dec: &mut WsDecoder,
    out: &mut BytesMut,
    n: usize,
) -> Option<WsEvent> {
    loop {
        match dec.decode(raw, out).unwrap() {
            WsEvent::NeedMore => {}
            event => return Some(event),
        }
        if out.len() >= n {
            return None;
        }
        let read = io.read_buf(raw).await.unwrap();
        assert!(read > 0, "eof inside websocket stream");
    }
}

fn ws_server_frame(out: &mut BytesMut, opcode: Opcode, fin: bool, payload: &[u8]) {
    let start = out.len();
    ws::write_header(out, opcode, payload.len(), None);
    if !fin {
        out[start] &= 0x7f;
    }
    out.extend_from_slice(payload);
}

#[tokio::test]
async fn replays_recorded_websocket_upgrade_and_closes_cleanly() {
    let ex = exchange("websocket");
    let recorded = ex["request_text"].as_str().unwrap().to_owned();
    let s2c = s2c_chunks(&ex);
    // s2c[0] is the 101 head (with a stale accept key), then the ServerKey and ServerInfo
    // messages and the close echo.
    let frames = split_ws_frames(&s2c[1..].concat());
    assert_eq!(frames.len(), 3);
    let (listener, _) = listen().await;
    let url = format!("ws://{}/derp", listener.local_addr().unwrap());
    let host = listener.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut raw = BytesMut::new();
        let head = read_head(&mut io, &mut raw).await;
        let key = header_value(&head, "Sec-Websocket-Key").unwrap().to_owned();
        let response = format!(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\
             Sec-Websocket-Accept: {}\r\nSec-Websocket-Protocol: derp\r\n\
             Upgrade: websocket\r\n\r\n",
            ws::accept_key(&key)
        );
        io.write_all(response.as_bytes()).await.unwrap();
        io.write_all(&frames[0]).await.unwrap();
        let (mut dec, mut derp) = (WsDecoder::new(Role::Server), BytesMut::new());
        assert_eq!(
            read_ws_payload(&mut io, &mut raw, &mut dec, &mut derp, 109).await,
            None
        );
        // Client frames must be masked.
        let (client_key, _) = open_client_info(&mut derp);
        io.write_all(&frames[1]).await.unwrap();
        let close = read_ws_payload(&mut io, &mut raw, &mut dec, &mut derp, usize::MAX).await;
        io.write_all(&frames[2]).await.unwrap();
        (head, client_key, close)
    });

    let client = within(Client::connect(&config(&url, client_a_secret())))
        .await
        .unwrap();
    assert_eq!(client.server_info().version, 2);
    within(client.close()).await.unwrap();
    let (head, key, close) = within(server).await.unwrap();
    assert_head_matches_recorded(&head, &recorded, &host);
    assert_eq!(key, public_key("client_a"));
    assert_eq!(
        close,
        Some(WsEvent::Close {
            code: Some(ws::close_code::NORMAL)
        })
    );
}

#[test]
fn recorded_client_websocket_frame_is_masked() {
    // Sanity check of the test helper against the recording: the Go client's ClientInfo
    // message has the mask bit set.
    let ex = exchange("websocket");
    let c2s: Vec<Vec<u8>> = ex["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["dir"] == "c2s")
        .map(|c| unhex(c["hex"].as_str().unwrap()))
        .collect();
    assert_ne!(c2s[1][1] & 0x80, 0);
}

/// A minimal relay: real handshake with derp-proto's server pieces, then raw frame IO.
struct FakeServer<S> {
    io: S,
    buf: BytesMut,
    decoder: ServerDecoder,
    hs: ServerHandshake,
    client_key: PublicKey,
    head: String,
    /// Set when the client asked for WebSocket.
    ws: Option<(WsDecoder, BytesMut)>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> FakeServer<S> {
    /// Answers the upgrade, sends ServerKey, accepts ClientInfo and sends ServerInfo.
    async fn accept(io: S) -> Self {
        Self::accept_after(io, BytesMut::new()).await
    }

    /// [`FakeServer::accept`], with `raw` holding bytes already read from `io`.
    async fn accept_after(mut io: S, mut raw: BytesMut) -> Self {
        let head = read_head(&mut io, &mut raw).await;
        let hs = ServerHandshake::new(server_secret());
        let mut out = BytesMut::new();
        let mut server = if let Some(key) = header_value(&head, "Sec-Websocket-Key") {
            let response = format!(
                "HTTP/1.1 101 Switching Protocols\r\nSec-Websocket-Accept: {}\r\n\
                 Sec-Websocket-Protocol: derp\r\nUpgrade: websocket\r\n\r\n",
                ws::accept_key(key)
            );
            out.extend_from_slice(response.as_bytes());
            Self {
                io,
                buf: BytesMut::new(),
                decoder: ServerDecoder::new(),
                hs,
                client_key: public_key("server"),
                head,
                ws: Some((WsDecoder::new(Role::Server), raw)),
            }
        } else {
            out.extend_from_slice(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\n\r\n");
            Self {
                io,
                buf: raw,
                decoder: ServerDecoder::new(),
                hs,
                client_key: public_key("server"),
                head,
                ws: None,
            }
        };
        server.io.write_all(&out).await.unwrap();
        let mut key_frame = BytesMut::new();
        server.hs.server_key_frame(&mut key_frame);
        server.send_bytes(&key_frame).await;
        let Some(ClientToRelay::ClientInfo { key, sealed }) = server.recv().await else {
            panic!("expected ClientInfo");
        };
        server.hs.handle_client_info(key, &sealed).unwrap();
        server.client_key = key;
        let mut info = BytesMut::new();
        server.hs.server_info_frame([9; 24], &mut info).unwrap();
        server.send_bytes(&info).await;
        server
    }

    /// Sends DERP bytes, wrapped in one binary message over WebSocket.
    async fn send_bytes(&mut self, bytes: &[u8]) {
        let mut out = BytesMut::new();
        if self.ws.is_some() {
            ws_server_frame(&mut out, Opcode::Binary, true, bytes);
        } else {
            out.extend_from_slice(bytes);
        }
        self.io.write_all(&out).await.unwrap();
    }

    async fn send(&mut self, frame: &RelayToClient) {
        let mut out = BytesMut::new();
        frame.encode(&mut out);
        self.send_bytes(&out).await;
    }

    /// The next client frame, or `None` at EOF or a WebSocket close.
    async fn recv(&mut self) -> Option<ClientToRelay> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf).unwrap() {
                return Some(frame);
            }
            match &mut self.ws {
                None => {
                    if self.io.read_buf(&mut self.buf).await.unwrap() == 0 {
                        return None;
                    }
                }
                Some((dec, raw)) => {
                    let before = self.buf.len();
                    match dec.decode(raw, &mut self.buf).unwrap() {
                        WsEvent::Close { .. } => return None,
                        WsEvent::Ping(_) => continue,
                        WsEvent::NeedMore if self.buf.len() > before => continue,
                        WsEvent::NeedMore => {}
                    }
                    if self.io.read_buf(raw).await.unwrap() == 0 {
                        return None;
                    }
                }
            }
        }
    }
}

async fn fake_pair(cfg: impl FnOnce(&str) -> ClientConfig) -> (Client, FakeServer<TcpStream>) {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let (io, _) = listener.accept().await.unwrap();
        FakeServer::accept(io).await
    });
    let client = within(Client::connect(&cfg(&url))).await.unwrap();
    let server = within(server).await.unwrap();
    (client, server)
}

fn key(n: u8) -> PublicKey {
    PublicKey::from_bytes([n; 32])
}

#[tokio::test]
async fn receives_every_frame_type_and_skips_the_rest() {
    let (mut client, mut server) = fake_pair(|u| config(u, client_a_secret())).await;
    assert_eq!(server.client_key, public_key("client_a"));
    let sent = [
        RelayToClient::RecvPacket {
            src: key(1),
            packet: Bytes::from_static(b"hello, derp"),
        },
        RelayToClient::KeepAlive,
        RelayToClient::PeerGone {
            peer: key(2),
            reason: PeerGoneReason::NotHere,
        },
        RelayToClient::PeerPresent {
            peer: key(3),
            addr: "10.1.2.3:4567".parse().unwrap(),
            flags: 0x0a,
        },
        RelayToClient::Ping([1; 8]),
        RelayToClient::Pong([2; 8]),
        RelayToClient::Health("disk full".into()),
        RelayToClient::Restarting {
            reconnect_in_ms: 1500,
            try_for_ms: 30000,
        },
        // Skipped: a repeated ServerKey, and an unassigned type with a body.
        RelayToClient::ServerKey(public_key("server")),
    ];
    for frame in &sent {
        server.send(frame).await;
    }
    server.send_bytes(&[0x0b, 0, 0, 0, 3, 7, 7, 7]).await;
    let mut info = BytesMut::new();
    server.hs.server_info_frame([4; 24], &mut info).unwrap();
    server.send_bytes(&info).await;

    let want = [
        ReceivedFrame::RecvPacket {
            src: key(1),
            packet: Bytes::from_static(b"hello, derp"),
        },
        ReceivedFrame::KeepAlive,
        ReceivedFrame::PeerGone {
            peer: key(2),
            reason: PeerGoneReason::NotHere,
        },
        ReceivedFrame::PeerPresent {
            peer: key(3),
            addr: "10.1.2.3:4567".parse().unwrap(),
            flags: 0x0a,
        },
        ReceivedFrame::Ping([1; 8]),
        ReceivedFrame::Pong([2; 8]),
        ReceivedFrame::Health {
            problem: "disk full".into(),
        },
        ReceivedFrame::Restarting {
            reconnect_in: Duration::from_millis(1500),
            try_for: Duration::from_secs(30),
        },
        ReceivedFrame::ServerInfo(ServerInfo::default_server()),
    ];
    for w in want {
        assert_eq!(within(client.recv()).await.unwrap(), w);
    }
}

#[tokio::test]
async fn batches_queued_packets_and_refuses_oversized_ones() {
    let (mut client, mut server) = fake_pair(|u| config(u, client_a_secret())).await;
    for i in 0..3u8 {
        client.queue_packet(key(i), [i; 10]).unwrap();
    }
    assert_eq!(client.buffered_len(), 3 * (FRAME_HEADER_LEN + 32 + 10));
    let too_big = vec![0u8; MAX_PACKET_SIZE + 1];
    assert!(matches!(
        client.send_packet(key(9), &too_big).await,
        Err(ClientError::PacketTooLarge { len }) if len == MAX_PACKET_SIZE + 1
    ));
    // The refusal neither wrote nor dropped the queue.
    assert_eq!(client.buffered_len(), 3 * (FRAME_HEADER_LEN + 32 + 10));
    client.flush().await.unwrap();
    assert_eq!(client.buffered_len(), 0);
    client
        .send_packet(key(7), vec![5u8; MAX_PACKET_SIZE])
        .await
        .unwrap();
    client.note_preferred(true).await.unwrap();
    client.send_pong([3; 8]).await.unwrap();
    client.watch_conns().await.unwrap();
    client.close_peer(key(4)).await.unwrap();
    client
        .forward_packet(key(5), key(6), Bytes::from_static(b"fwd"))
        .await
        .unwrap();

    for i in 0..3u8 {
        assert_eq!(
            within(server.recv()).await,
            Some(ClientToRelay::SendPacket {
                dst: key(i),
                packet: Bytes::from(vec![i; 10]),
            })
        );
    }
    let want = [
        ClientToRelay::SendPacket {
            dst: key(7),
            packet: Bytes::from(vec![5u8; MAX_PACKET_SIZE]),
        },
        ClientToRelay::NotePreferred(true),
        // The server's decoder skips pongs, but the frame went out.
        ClientToRelay::Unknown {
            frame_type: 0x13,
            len: 8,
        },
        ClientToRelay::WatchConns,
        ClientToRelay::ClosePeer(key(4)),
        ClientToRelay::ForwardPacket {
            src: key(5),
            dst: key(6),
            packet: Bytes::from_static(b"fwd"),
        },
    ];
    for w in want {
        assert_eq!(within(server.recv()).await, Some(w));
    }
    client.close().await.unwrap();
    assert_eq!(within(server.recv()).await, None);
}

#[tokio::test]
async fn ping_consumes_its_pong_and_keeps_frames_that_arrive_meanwhile() {
    let (mut client, mut server) = fake_pair(|u| config(u, client_a_secret())).await;
    let server_task = tokio::spawn(async move {
        let Some(ClientToRelay::Ping(data)) = server.recv().await else {
            panic!("expected ping");
        };
        server.send(&RelayToClient::KeepAlive).await;
        server.send(&RelayToClient::Pong([0xee; 8])).await;
        server.send(&RelayToClient::Pong(data)).await;
        server.send(&RelayToClient::Health(String::new())).await;
        server
    });
    within(client.ping()).await.unwrap();
    let _server = within(server_task).await.unwrap();
    assert_eq!(client.recv().await.unwrap(), ReceivedFrame::KeepAlive);
    assert_eq!(client.recv().await.unwrap(), ReceivedFrame::Pong([0xee; 8]));
    // The matching pong is gone; the next frame is what followed it.
    assert_eq!(
        within(client.recv()).await.unwrap(),
        ReceivedFrame::Health {
            problem: String::new()
        }
    );
}

#[tokio::test]
async fn split_halves_send_and_ping_while_another_task_receives() {
    let (client, mut server) = fake_pair(|u| config(u, client_a_secret())).await;
    let (mut reader, mut writer) = client.split();
    assert_eq!(reader.server_key(), writer.server_key());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader_task = tokio::spawn(async move {
        loop {
            match reader.recv().await {
                Ok(frame) => tx.send(frame).unwrap(),
                Err(e) => return e,
            }
        }
    });
    // Echo every packet back and answer pings, like a relay with a loopback peer.
    let me = public_key("client_a");
    let server_task = tokio::spawn(async move {
        while let Some(frame) = server.recv().await {
            match frame {
                ClientToRelay::SendPacket { packet, .. } => {
                    server
                        .send(&RelayToClient::RecvPacket { src: me, packet })
                        .await;
                }
                ClientToRelay::Ping(data) => server.send(&RelayToClient::Pong(data)).await,
                _ => {}
            }
        }
    });
    within(writer.ping()).await.unwrap();
    let pending = writer.start_ping().await.unwrap();
    writer.send_packet(me, b"to myself").await.unwrap();
    within(pending.wait()).await.unwrap();
    assert_eq!(
        within(rx.recv()).await.unwrap(),
        ReceivedFrame::RecvPacket {
            src: me,
            packet: Bytes::from_static(b"to myself"),
        }
    );
    writer.close().await.unwrap();
    within(server_task).await.unwrap();
    let err = within(reader_task).await.unwrap();
    assert!(matches!(err, ClientError::Closed), "{err:?}");
    assert!(rx.try_recv().is_err(), "no pong may surface");
}

#[tokio::test]
async fn read_errors_are_sticky_and_fail_pings() {
    let (mut client, server) = fake_pair(|u| config(u, client_a_secret())).await;
    drop(server);
    assert!(matches!(
        within(client.recv()).await,
        Err(ClientError::Closed)
    ));
    assert!(matches!(client.recv().await, Err(ClientError::Closed)));
    let (_, mut writer) = client.split();
    // The reader is dead, so no pong can ever be seen; the ping fails at once.
    assert!(matches!(
        writer.start_ping().await,
        Err(ClientError::Closed)
    ));
}

#[tokio::test]
async fn oversized_frame_header_is_a_sticky_decode_error() {
    let (mut client, mut server) = fake_pair(|u| config(u, client_a_secret())).await;
    server.send_bytes(&[0x05, 0x00, 0x20, 0x00, 0x00]).await;
    let err = within(client.recv()).await.unwrap_err();
    assert!(matches!(err, ClientError::Decode(_)), "{err:?}");
    assert!(matches!(client.recv().await, Err(ClientError::Decode(_))));
}

#[tokio::test]
async fn websocket_session_reassembles_and_answers_control_frames() {
    let (mut client, mut server) =
        fake_pair(|u| config(u, client_a_secret()).with_transport(TransportKind::WebSocket)).await;
    assert!(server.head.contains("Upgrade: websocket\r\n"));

    // One DERP frame fragmented over three frames with a ping in between, then two DERP frames
    // in one message: message boundaries must not matter.
    let mut derp = BytesMut::new();
    RelayToClient::RecvPacket {
        src: key(1),
        packet: Bytes::from_static(b"fragmented"),
    }
    .encode(&mut derp);
    let mut two = BytesMut::new();
    RelayToClient::KeepAlive.encode(&mut two);
    RelayToClient::Pong([8; 8]).encode(&mut two);
    let mut out = BytesMut::new();
    ws_server_frame(&mut out, Opcode::Binary, false, &derp[..3]);
    ws_server_frame(&mut out, Opcode::Ping, true, b"are you there");
    ws_server_frame(&mut out, Opcode::Continuation, false, &derp[3..20]);
    ws_server_frame(&mut out, Opcode::Continuation, true, &derp[20..]);
    ws_server_frame(&mut out, Opcode::Binary, true, &two);
    server.io.write_all(&out).await.unwrap();

    assert_eq!(
        within(client.recv()).await.unwrap(),
        ReceivedFrame::RecvPacket {
            src: key(1),
            packet: Bytes::from_static(b"fragmented"),
        }
    );
    assert_eq!(client.recv().await.unwrap(), ReceivedFrame::KeepAlive);
    assert_eq!(client.recv().await.unwrap(), ReceivedFrame::Pong([8; 8]));

    // The next write carries the pong for the server's ping, then the packet.
    client.send_packet(key(2), b"up").await.unwrap();
    // The packet (45 bytes as a masked frame) and the pong for the server's ping (19 bytes).
    // WsDecoder swallows pongs, so split the frames by hand.
    let (_, raw) = server.ws.as_mut().unwrap();
    read_at_least(&mut server.io, raw, 45 + 19).await;
    let frames = split_ws_frames(&raw.split_to(45 + 19));
    let unmask = |f: &[u8]| {
        let mut body = f[6..].to_vec();
        ws::apply_mask(&mut body, [f[2], f[3], f[4], f[5]], 0);
        body
    };
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0][..2], [0x82, 0x80 | 39]);
    assert_eq!(frames[1][..2], [0x8a, 0x80 | 13]);
    assert_eq!(unmask(&frames[1]), b"are you there");
    server.buf.extend_from_slice(&unmask(&frames[0]));
    assert_eq!(
        server.decoder.decode(&mut server.buf).unwrap(),
        Some(ClientToRelay::SendPacket {
            dst: key(2),
            packet: Bytes::from_static(b"up"),
        })
    );

    // A server close ends the stream; the client echoes it on its next flush.
    let mut close = BytesMut::new();
    ws_server_frame(&mut close, Opcode::Close, true, &1001u16.to_be_bytes());
    server.io.write_all(&close).await.unwrap();
    assert!(matches!(
        within(client.recv()).await,
        Err(ClientError::Closed)
    ));
    client.flush().await.unwrap();
    assert!(matches!(
        client.send_packet(key(2), b"late").await,
        Err(ClientError::Closed)
    ));
    assert_eq!(within(server.recv()).await, None);
}

#[tokio::test]
async fn websocket_upgrade_with_wrong_accept_key_fails() {
    let err = connect_against(
        |_| b"HTTP/1.1 101 Switching Protocols\r\nSec-Websocket-Accept: bm9wZQ==\r\n\r\n".to_vec(),
        |u| config(u, client_a_secret()).with_transport(TransportKind::WebSocket),
    )
    .await;
    assert!(
        matches!(err, ConnectError::BadResponse(UpgradeError::BadAccept)),
        "{err:?}"
    );
}

/// Runs a server that reads the request head and answers with `respond(head)` bytes, then
/// waits for the client to hang up; returns the client's connect error.
async fn connect_against(
    respond: impl FnOnce(&str) -> Vec<u8> + Send + 'static,
    cfg: impl FnOnce(&str) -> ClientConfig,
) -> ConnectError {
    let (listener, url) = listen().await;
    let server: JoinHandle<()> = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        let head = read_head(&mut io, &mut buf).await;
        let reply = respond(&head);
        if reply.is_empty() {
            return;
        }
        io.write_all(&reply).await.unwrap();
        let _ = io.read_buf(&mut buf).await;
    });
    let err = within(Client::connect(&cfg(&url))).await.unwrap_err();
    within(server).await.unwrap();
    err
}

#[tokio::test]
async fn non_101_response_is_an_http_status_error() {
    let err = connect_against(
        |_| b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 31\r\n\r\nDERP requires connection upgrade".to_vec(),
        |u| config(u, client_a_secret()),
    )
    .await;
    assert!(
        matches!(err, ConnectError::HttpStatus { status: 426 }),
        "{err:?}"
    );
}

#[tokio::test]
async fn garbage_response_is_refused() {
    let err = connect_against(
        |_| b"\x00\x01\x02\x03 this is not http\r\n\r\n".to_vec(),
        |u| config(u, client_a_secret()),
    )
    .await;
    assert!(matches!(err, ConnectError::BadResponse(_)), "{err:?}");
}

#[tokio::test]
async fn hang_up_before_response_is_unexpected_eof() {
    let err = connect_against(|_| Vec::new(), |u| config(u, client_a_secret())).await;
    assert!(matches!(err, ConnectError::UnexpectedEof), "{err:?}");
}

#[tokio::test]
async fn bad_server_key_magic_is_a_decode_error() {
    let err = connect_against(
        |_| {
            let mut r = b"HTTP/1.1 101 Switching Protocols\r\n\r\n".to_vec();
            r.extend_from_slice(&[1, 0, 0, 0, 40]);
            r.extend_from_slice(&[b'X'; 40]);
            r
        },
        |u| config(u, client_a_secret()),
    )
    .await;
    assert!(matches!(err, ConnectError::Decode(_)), "{err:?}");
}

#[tokio::test]
async fn first_frame_other_than_server_key_is_refused() {
    let err = connect_against(
        |_| {
            let mut r = b"HTTP/1.1 101 Switching Protocols\r\n\r\n".to_vec();
            r.extend_from_slice(&[6, 0, 0, 0, 0]);
            r
        },
        |u| config(u, client_a_secret()),
    )
    .await;
    assert!(
        matches!(err, ConnectError::UnexpectedFrame { frame_type: 6 }),
        "{err:?}"
    );
}

#[tokio::test]
async fn server_info_sealed_to_another_key_fails_the_handshake() {
    // The recorded ServerInfo is sealed to client_a; client_b cannot open it.
    let chunks = s2c_chunks(&exchange("plain_upgrade"));
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let (mut io, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        read_head(&mut io, &mut buf).await;
        io.write_all(&chunks[0]).await.unwrap();
        read_at_least(&mut io, &mut buf, 109).await;
        io.write_all(&chunks[1]).await.unwrap();
        let _ = io.read_buf(&mut buf).await;
    });
    let err = within(Client::connect(&config(&url, client_b_secret())))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ConnectError::Handshake(HandshakeError::Box(_))),
        "{err:?}"
    );
    within(server).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn silent_server_times_out_on_the_connect_budget() {
    let (client_io, mut server_io): (DuplexStream, DuplexStream) = tokio::io::duplex(4096);
    let cfg = config("http://derp.invalid/derp", client_a_secret());
    let started = tokio::time::Instant::now();
    let err = Client::connect_stream(&cfg, client_io).await.unwrap_err();
    assert!(
        matches!(err, ConnectError::Timeout(d) if d == Duration::from_secs(10)),
        "{err:?}"
    );
    assert!(started.elapsed() >= Duration::from_secs(10));
    // The request did go out before the silence.
    let mut buf = BytesMut::new();
    let head = read_head(&mut server_io, &mut buf).await;
    assert!(head.starts_with("GET /derp HTTP/1.1\r\nHost: derp.invalid\r\n"));
}

#[tokio::test]
async fn silent_tcp_server_times_out_with_a_short_budget() {
    let (listener, url) = listen().await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let (_io, _) = listener.accept().await.unwrap();
        // Hold the connection open, silently, until the test is done.
        let _ = done_rx.await;
    });
    let cfg = config(&url, client_a_secret()).with_connect_timeout(Duration::from_millis(50));
    let err = within(Client::connect(&cfg)).await.unwrap_err();
    assert!(matches!(err, ConnectError::Timeout(_)), "{err:?}");
    done_tx.send(()).unwrap();
    within(server).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn read_timeout_kills_an_idle_connection() {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let server = tokio::spawn(FakeServer::accept(server_io));
    let cfg = config("http://derp.invalid/derp", client_a_secret())
        .with_read_timeout(Duration::from_secs(120));
    let mut client = Client::connect_stream(&cfg, client_io).await.unwrap();
    assert_eq!(client.local_addr(), None);
    let _server = server.await.unwrap();
    let err = client.recv().await.unwrap_err();
    assert!(matches!(err, ClientError::ReadTimeout(d) if d == Duration::from_secs(120)));
}

#[tokio::test(start_paused = true)]
async fn ping_without_pong_times_out_and_leaves_the_connection_usable() {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let server = tokio::spawn(FakeServer::accept(server_io));
    let cfg = config("http://derp.invalid/derp", client_a_secret());
    let mut client = Client::connect_stream(&cfg, client_io).await.unwrap();
    let mut server = server.await.unwrap();
    assert!(matches!(client.ping().await, Err(ClientError::PingTimeout)));
    let Some(ClientToRelay::Ping(data)) = server.recv().await else {
        panic!("expected the ping");
    };
    // A late pong is no longer matched, so it surfaces.
    server.send(&RelayToClient::Pong(data)).await;
    assert_eq!(client.recv().await.unwrap(), ReceivedFrame::Pong(data));
}

#[tokio::test]
async fn binds_the_configured_local_address_and_sends_client_info_fields() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let (io, peer) = listener.accept().await.unwrap();
        (FakeServer::accept(io).await, peer)
    });
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let cfg = config(&url, client_b_secret())
        .with_local_addr(local)
        .with_prober(true)
        .with_can_ack_pings(false)
        .with_app_name("bench")
        .with_ideal_node("node-7");
    let client = within(Client::connect(&cfg)).await.unwrap();
    let (server, peer) = within(server).await.unwrap();
    assert_eq!(client.local_addr(), Some(peer));
    assert_eq!(server.client_key, public_key("client_b"));
    assert_eq!(header_value(&server.head, "Ideal-Node"), Some("node-7"));
    assert_eq!(
        cfg.client_info().to_json(),
        br#"{"version":2,"CanAckPings":false,"IsProber":true,"AppName":"bench"}"#
    );
}

#[tokio::test]
async fn a_probe_first_goes_ahead_of_the_upgrade_in_the_same_write() {
    for scheme in ["http", "ws"] {
        let (listener, url) = listen().await;
        let url = url.replacen("http", scheme, 1);
        let server = tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.unwrap();
            let mut raw = BytesMut::new();
            let probe = read_head(&mut io, &mut raw).await;
            // The upgrade comes before any answer: the client does not wait for one.
            while !raw.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = io.read_buf(&mut raw).await.unwrap();
                assert!(n > 0, "eof before the upgrade request");
            }
            io.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                .await
                .unwrap();
            (probe, FakeServer::accept_after(io, raw).await)
        });
        let cfg = config(&url, client_a_secret()).with_probe_first(true);
        let mut client = within(Client::connect(&cfg)).await.unwrap();
        let (probe, mut server) = within(server).await.unwrap();
        let host = url.split('/').nth(2).unwrap();
        assert_eq!(
            probe,
            format!("HEAD /derp/probe HTTP/1.1\r\nHost: {host}\r\n\r\n")
        );
        assert!(
            server.head.starts_with("GET /derp HTTP/1.1\r\n"),
            "{}",
            server.head
        );
        assert_eq!(server.ws.is_some(), scheme == "ws");
        client
            .send_packet(key(1), b"after the probe")
            .await
            .unwrap();
        assert_eq!(
            within(server.recv()).await,
            Some(ClientToRelay::SendPacket {
                dst: key(1),
                packet: Bytes::from_static(b"after the probe"),
            })
        );
    }
}

#[tokio::test]
async fn a_probe_answered_with_other_than_200_is_an_http_status_error() {
    let err = connect_against(
        |_| b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        |u| config(u, client_a_secret()).with_probe_first(true),
    )
    .await;
    assert!(
        matches!(err, ConnectError::HttpStatus { status: 404 }),
        "{err:?}"
    );
}

#[tokio::test]
async fn refuses_bad_configs_before_dialing() {
    let cfg = config("https://127.0.0.1:1/derp", client_a_secret()).with_cert_name("sha256-raw:12");
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    let cfg = config("wss://127.0.0.1:1/derp", client_a_secret()).with_cert_name("not a name");
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    let cfg = config("ws://127.0.0.1:1/derp", client_a_secret())
        .with_fast_start_key(public_key("server"));
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    let cfg = config("http://127.0.0.1:1/derp", client_a_secret())
        .with_fast_start_key(public_key("server"))
        .with_probe_first(true);
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    let cfg = config("quic://127.0.0.1:1", client_a_secret()).with_probe_first(true);
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    let cfg = config("http://127.0.0.1:1/derp", client_a_secret()).with_ideal_node("a\r\nb: c");
    assert!(matches!(
        Client::connect(&cfg).await,
        Err(ConnectError::InvalidConfig(_))
    ));
    assert!(matches!(
        ClientConfig::new("derp.example.com", client_a_secret()),
        Err(ConnectError::BadUrl(_))
    ));
}

/// A TLS server on 127.0.0.1 with a fresh self-signed certificate for that address, for one
/// handshake; returns its `https://` URL and the certificate.
async fn self_signed_tls_server() -> (String, rustls::pki_types::CertificateDer<'static>) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let der = cert.der().clone();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![der.clone()],
            rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
        )
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}/derp", listener.local_addr().unwrap());
    tokio::spawn(async move {
        if let Ok((tcp, _)) = listener.accept().await {
            let _ = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(tls))
                .accept(tcp)
                .await;
        }
    });
    (url, der)
}

#[tokio::test]
async fn an_untrusted_certificate_is_a_tls_handshake_error_with_rustls_reason() {
    let (url, _) = self_signed_tls_server().await;
    let err = within(Client::connect(&config(&url, client_a_secret())))
        .await
        .unwrap_err();
    assert_eq!(
        err.certificate_error(),
        Some(&rustls::CertificateError::UnknownIssuer),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_certificate_other_than_the_pinned_one_is_a_tls_handshake_error() {
    let (url, _) = self_signed_tls_server().await;
    let cfg =
        config(&url, client_a_secret()).with_cert_name(format!("sha256-raw:{}", "ab".repeat(32)));
    let err = within(Client::connect(&cfg)).await.unwrap_err();
    assert_eq!(
        err.certificate_error(),
        Some(&rustls::CertificateError::ApplicationVerificationFailure),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_hang_up_during_the_tls_handshake_is_a_tls_io_error() {
    let (listener, url) = listen().await;
    let url = url.replacen("http://", "https://", 1);
    let server = tokio::spawn(async move {
        let _ = listener.accept().await.unwrap();
    });
    let err = within(Client::connect(&config(&url, client_a_secret())))
        .await
        .unwrap_err();
    within(server).await.unwrap();
    // An end of stream or a reset, depending on whether the ClientHello was read.
    assert!(matches!(err, ConnectError::TlsIo(_)), "{err:?}");
    assert!(err.to_string().starts_with("tls: "), "{err}");
}
