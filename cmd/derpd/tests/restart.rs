//! Graceful restart of the derpd process: SIGTERM stops accepting, tells every client to
//! reconnect with a Restarting frame, delivers what is queued, closes and exits 0; a second
//! signal ends the drain at once.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use derp_client::ReceivedFrame;
use derp_proto::SecretKey;
use derp_proto::frame::FrameType;
use derp_testkit::raw::RawClient;
use support::{Node, STEP, client, expect_closed, secret};
use tokio::net::{TcpSocket, TcpStream};

/// A raw client with a small receive buffer, so that what the server sends it backs up in
/// the server's queue.
pub(crate) async fn small_buffer_client(addr: SocketAddr, secret: SecretKey) -> RawClient {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stream = socket.connect(addr).await.expect("connect");
    RawClient::connect_on(stream, secret).await
}

/// The flags a node needs for [`stuck_receiver`]: a queue deep enough to hold more than the
/// kernel's socket buffers take (tcp_wmem's 4 MiB at most), writes that never time out, and
/// a drain that waits ten minutes.
pub(crate) const STUCK_FLAGS: [&str; 6] = [
    "--send-queue-depth",
    "128",
    "--tcp-write-timeout",
    "0",
    "--drain-timeout",
    "10m",
];

/// A receiver that never reads, with more queued for it (128 packets of 60 000 bytes) than
/// its connection's socket buffers hold: a drain of a node started with [`STUCK_FLAGS`]
/// waits on its queue until the drain's deadline. Kept until dropped.
pub(crate) async fn stuck_receiver(node: &Node) -> RawClient {
    let stuck = small_buffer_client(node.addr, secret()).await;
    let mut sender = client(&node.url(), secret()).await;
    for i in 0..128u8 {
        sender
            .send_packet(stuck.key, vec![i; 60_000])
            .await
            .expect("send");
    }
    // Every packet is routed once a later ping is answered.
    sender.ping().await.expect("ping");
    stuck
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_sends_restarting_delivers_queued_packets_and_exits_zero() {
    let mut node = Node::start(&[
        "-a",
        "127.0.0.1:0",
        "--dev",
        // A receiver that reads late must not be cut off before the drain reaches it.
        "--tcp-write-timeout",
        "0",
        "--restart-reconnect-in",
        "1500ms",
        "--restart-try-for",
        "45s",
    ]);
    let mut receiver = small_buffer_client(node.addr, secret()).await;
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
    let (frames, cut_short) = receiver.frames_until_closed().await;
    assert_eq!(cut_short, 0, "the connection closed mid-frame");
    let restarting: Vec<_> = frames
        .iter()
        .filter(|(t, _)| *t == FrameType::Restarting as u8)
        .collect();
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
        .filter(|(t, _)| *t == FrameType::RecvPacket as u8)
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
    let hint = support::recv_until(&mut sender, "Restarting", |f| match f {
        ReceivedFrame::Restarting {
            reconnect_in,
            try_for,
        } => Some((*reconnect_in, *try_for)),
        _ => None,
    })
    .await;
    assert_eq!(
        hint,
        (Duration::from_millis(1500), Duration::from_secs(45)),
        "the library client's Restarting values"
    );
    expect_closed(&mut sender).await;
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
    // It stopped accepting: nothing listens on the port any more.
    assert!(TcpStream::connect(node.addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_ends_the_drain_at_once() {
    let mut args = vec!["-a", "127.0.0.1:0", "--dev"];
    args.extend(STUCK_FLAGS);
    let mut node = Node::start(&args);
    // The first signal's drain would run to its ten-minute deadline.
    let stuck = stuck_receiver(&node).await;

    node.signal("INT");
    node.wait_message("shutting down");
    assert!(node.is_running(), "the drain is waiting on the stuck queue");
    node.signal("TERM");
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(1), "{}", node.log_text());
    drop(stuck);
}

/// Over QUIC as over TCP: SIGTERM's Restarting frame goes to the client, then the server
/// closes the connection, and derpd exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_tells_quic_clients_to_reconnect_and_closes_their_connections() {
    let dir = support::TempDir::new("restart-quic");
    let certdir = dir.path("certs").display().to_string();
    let mut args = support::manual_ip_args(&certdir);
    args.extend(["--quic-port", "0"]);
    let mut node = Node::start(&args);
    let mut a = support::quic_client(&node, secret()).await;
    a.ping().await.expect("ping");
    node.signal("TERM");
    support::expect_quic_shutdown(&mut a, false).await;
    assert_eq!(node.wait_exit(STEP).code(), Some(0), "{}", node.log_text());
}
