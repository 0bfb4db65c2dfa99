//! Graceful restart of the derpd process: SIGTERM stops accepting, tells every client to
//! reconnect with a Restarting frame, delivers what is queued, closes and exits 0; a second
//! signal ends the drain at once.

mod support;

use std::net::SocketAddr;

use bytes::BytesMut;
use derp_client::ReceivedFrame;
use derp_proto::{ClientDecoder, ClientHandshake, ClientInfo, PublicKey, RelayToClient, SecretKey};
use support::{Node, STEP, client, expect_closed, secret};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A client speaking the wire format itself, with a small receive buffer so that what the
/// server sends it backs up in the server's queue.
struct RawClient {
    stream: TcpStream,
    buf: BytesMut,
    key: PublicKey,
}

impl RawClient {
    async fn connect(addr: SocketAddr, secret: SecretKey) -> Self {
        let socket = TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("rcvbuf");
        let mut stream = socket.connect(addr).await.expect("connect");
        stream
            .write_all(
                b"GET /derp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n",
            )
            .await
            .expect("request");
        let mut c = Self {
            stream,
            buf: BytesMut::new(),
            key: secret.public_key(),
        };
        let end = loop {
            if let Some(i) = c.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            c.read_some().await;
        };
        assert!(c.buf.starts_with(b"HTTP/1.1 101 "));
        let _ = c.buf.split_to(end);
        let mut hs = ClientHandshake::new(
            secret,
            ClientInfo {
                version: 2,
                ..ClientInfo::default()
            },
        );
        match c.frame().await {
            RelayToClient::ServerKey(k) => hs.handle_server_key(k).expect("server key"),
            other => panic!("expected ServerKey, got {other:?}"),
        }
        let mut out = BytesMut::new();
        hs.client_info_frame(rand::random(), &mut out)
            .expect("client info");
        c.stream.write_all(&out).await.expect("write client info");
        match c.frame().await {
            RelayToClient::ServerInfo { sealed } => {
                hs.handle_server_info(&sealed).expect("server info");
            }
            other => panic!("expected ServerInfo, got {other:?}"),
        }
        c
    }

    async fn read_some(&mut self) -> usize {
        self.buf.reserve(64 * 1024);
        tokio::time::timeout(STEP, self.stream.read_buf(&mut self.buf))
            .await
            .expect("timed out reading")
            .expect("read")
    }

    async fn frame(&mut self) -> RelayToClient {
        let mut decoder = ClientDecoder::new();
        loop {
            if let Some(f) = decoder.decode(&mut self.buf).expect("decode") {
                return f;
            }
            assert!(self.read_some().await > 0, "closed during the handshake");
        }
    }

    /// Everything the server sends until it closes the connection, as (type, payload).
    async fn frames_until_close(&mut self) -> Vec<(u8, Vec<u8>)> {
        while self.read_some().await > 0 {}
        let mut frames = Vec::new();
        let mut rest = &self.buf[..];
        while rest.len() >= 5 {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            assert!(rest.len() >= 5 + len, "connection closed mid-frame");
            frames.push((rest[0], rest[5..5 + len].to_vec()));
            rest = &rest[5 + len..];
        }
        assert!(rest.is_empty(), "trailing bytes after the last frame");
        frames
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_sends_restarting_delivers_queued_packets_and_exits_zero() {
    let mut node = Node::start(&[
        "-a".into(),
        "127.0.0.1:0".into(),
        "--dev".into(),
        // A receiver that reads late must not be cut off before the drain reaches it.
        "--tcp-write-timeout".into(),
        "0".into(),
        "--restart-reconnect-in".into(),
        "1500ms".into(),
        "--restart-try-for".into(),
        "45s".into(),
    ]);
    let mut receiver = RawClient::connect(node.addr, secret()).await;
    let s = secret();
    let sender_key = s.public_key();
    let mut sender = client(&node.url(), s).await;
    // More than the receiver's socket takes: the rest waits in the server's queue.
    let packets: Vec<Vec<u8>> = (0..16u8).map(|i| vec![i; 60_000]).collect();
    for p in &packets {
        sender.send_packet(receiver.key, p).await.expect("send");
    }
    // The server has routed every packet once it answers a later ping.
    sender.ping().await.expect("ping");

    node.signal("TERM");
    let frames = receiver.frames_until_close().await;
    let restarting: Vec<_> = frames.iter().filter(|(t, _)| *t == 0x15).collect();
    assert_eq!(restarting.len(), 1, "exactly one Restarting frame");
    // Type 0x15, length 8, then reconnect-in and try-for in big-endian milliseconds.
    let mut wire = vec![0x15, 0, 0, 0, 8];
    wire.extend_from_slice(&restarting[0].1);
    assert_eq!(
        wire,
        [
            0x15, 0, 0, 0, 8, 0x00, 0x00, 0x05, 0xdc, 0x00, 0x00, 0xaf, 0xc8
        ]
    );
    let delivered: Vec<&Vec<u8>> = frames
        .iter()
        .filter(|(t, _)| *t == 0x05)
        .map(|(_, body)| {
            assert_eq!(body[..32], *sender_key.as_bytes());
            body
        })
        .collect();
    assert_eq!(
        delivered.len(),
        packets.len(),
        "every queued packet arrived"
    );
    for (got, want) in delivered.iter().zip(&packets) {
        assert_eq!(got[32..], want[..]);
    }
    // The sender hears the same hint through the client library, then the close.
    support::recv_until(&mut sender, "Restarting", |f| match f {
        ReceivedFrame::Restarting {
            reconnect_in,
            try_for,
        } => Some((*reconnect_in, *try_for)),
        _ => None,
    })
    .await;
    expect_closed(&mut sender).await;
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
    // It stopped accepting: nothing listens on the port any more.
    assert!(TcpStream::connect(node.addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_ends_the_drain_at_once() {
    let mut node = Node::start(&[
        "-a".into(),
        "127.0.0.1:0".into(),
        "--dev".into(),
        "--tcp-write-timeout".into(),
        "0".into(),
        "--drain-timeout".into(),
        "10m".into(),
    ]);
    // A receiver that never reads: its queue cannot drain, so the first signal's drain would
    // run to its ten-minute deadline.
    let stuck = RawClient::connect(node.addr, secret()).await;
    let mut sender = client(&node.url(), secret()).await;
    for i in 0..64u8 {
        sender
            .send_packet(stuck.key, vec![i; 60_000])
            .await
            .expect("send");
    }
    sender.ping().await.expect("ping");

    node.signal("INT");
    node.wait_message("shutting down");
    assert!(node.is_running(), "the drain is waiting on the stuck queue");
    node.signal("TERM");
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(1), "{}", node.log_text());
    drop(stuck);
}
