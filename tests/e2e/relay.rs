//! Relay behaviour over real sockets: delivery, PeerGone, gauges, stuck receivers, duplicate
//! keys, ping, unknown and privileged frames, keepalives, WebSocket and the HTTP endpoints.
//!
//! Mirrors the reference's `TestSendRecv`, `TestSendFreeze`, `TestServerDupClients` and
//! `TestServerRepliesToPing`, and adds checks of the metrics each behaviour moves.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, FrameType, PeerGoneReason,
    PublicKey, RelayToClient, SecretKey,
};
use derp_server::{HomePage, ServerConfig};
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::harness::{
    HttpResponse, RawClient, STEP, TestServer, disco_packet, http_exchange, raw_frame,
};

fn config() -> ServerConfig {
    ServerConfig::new(derp_testkit::server_secret())
}

fn random_secret() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

fn nobody() -> PublicKey {
    random_secret().public_key()
}

fn dropped(srv: &TestServer, reason: &str, kind: &str) -> f64 {
    srv.metric(
        "derp_packets_dropped",
        &[("reason", reason), ("kind", kind)],
    )
}

fn gauge(srv: &TestServer, name: &str) -> f64 {
    srv.metric(name, &[])
}

fn gone(peer: PublicKey) -> RelayToClient {
    RelayToClient::PeerGone {
        peer,
        reason: PeerGoneReason::Disconnected,
    }
}

fn not_here(peer: PublicKey) -> RelayToClient {
    RelayToClient::PeerGone {
        peer,
        reason: PeerGoneReason::NotHere,
    }
}

#[tokio::test]
async fn packets_reach_the_right_client_with_the_sender_key() {
    let srv = TestServer::start_default().await;
    let mut c0 = RawClient::connect(srv.addr).await;
    let mut c1 = RawClient::connect(srv.addr).await;
    let mut c2 = RawClient::connect(srv.addr).await;

    c0.send_packet(c1.key, b"zero to one").await;
    assert_eq!(c1.recv_packet().await, (c0.key, b"zero to one".to_vec()));
    c1.send_packet(c2.key, b"one to two").await;
    assert_eq!(c2.recv_packet().await, (c1.key, b"one to two".to_vec()));

    // Each packet went to its destination only.
    c0.expect_quiet().await;
    c1.expect_quiet().await;
    c2.expect_quiet().await;
    srv.eventually("two packets written", |s| {
        gauge(s, "derp_packets_sent") == 2.0
    })
    .await;
    assert_eq!(gauge(&srv, "derp_packets_received"), 2.0);
    assert_eq!(gauge(&srv, "derp_bytes_received"), 21.0);
    assert_eq!(gauge(&srv, "derp_bytes_sent"), 21.0);
    srv.stop().await;
}

#[tokio::test]
async fn unknown_destination_gets_not_here_only_for_disco_and_rate_limited() {
    let srv = TestServer::start_default().await;
    let mut c0 = RawClient::connect(srv.addr).await;
    let mut c1 = RawClient::connect(srv.addr).await;
    let missing = nobody();

    // Not disco: dropped without a word.
    c0.send_packet(missing, b"wireguard-ish").await;
    c0.expect_quiet().await;
    assert_eq!(dropped(&srv, "unknown_dest", "other"), 1.0);
    assert_eq!(dropped(&srv, "unknown_dest", "disco"), 0.0);

    // Disco: the sender hears that the peer is not here.
    c0.send_packet(missing, &disco_packet()).await;
    assert_eq!(c0.barrier().await, vec![not_here(missing)]);

    // Six in a burst: the 1/s, burst 3 limiter lets exactly three replies through, and the
    // frame after the third is the pong.
    let mut burst = BytesMut::new();
    for _ in 0..6 {
        ClientToRelay::SendPacket {
            dst: missing,
            packet: disco_packet().into(),
        }
        .encode(&mut burst);
    }
    c1.send_raw(&burst).await;
    assert_eq!(c1.barrier().await, vec![not_here(missing); 3]);
    assert_eq!(dropped(&srv, "unknown_dest", "disco"), 7.0);
    assert_eq!(dropped(&srv, "unknown_dest", "other"), 1.0);
    srv.eventually("four NotHere frames counted", |s| {
        gauge(s, "derp_peer_gone_not_here_frames") == 4.0
    })
    .await;

    // The limiter refills: polling with one disco send at a time gets a reply again.
    let deadline = tokio::time::Instant::now() + STEP;
    let mut extra = 0;
    loop {
        c1.send_packet(missing, &disco_packet()).await;
        extra += 1;
        let seen = c1.barrier().await;
        if !seen.is_empty() {
            assert_eq!(seen, vec![not_here(missing)]);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "limiter never refilled"
        );
    }
    assert_eq!(
        dropped(&srv, "unknown_dest", "disco"),
        7.0 + f64::from(extra)
    );
    srv.stop().await;
}

#[tokio::test]
async fn connection_and_home_gauges_follow_clients() {
    let srv = TestServer::start_default().await;
    assert_eq!(gauge(&srv, "derp_current_connections"), 0.0);
    let mut c0 = RawClient::connect(srv.addr).await;
    let mut c1 = RawClient::connect(srv.addr).await;
    // Registration happens before ServerInfo is written, so the gauge is exact already.
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    assert_eq!(gauge(&srv, "derp_clients_local"), 2.0);
    assert_eq!(gauge(&srv, "derp_current_home_connections"), 0.0);

    let home = |srv: &TestServer| gauge(srv, "derp_current_home_connections");
    c0.send(ClientToRelay::NotePreferred(true)).await;
    c0.expect_quiet().await;
    assert_eq!(home(&srv), 1.0);
    // Saying it twice changes nothing.
    c0.send(ClientToRelay::NotePreferred(true)).await;
    c0.expect_quiet().await;
    assert_eq!(home(&srv), 1.0);
    c1.send(ClientToRelay::NotePreferred(true)).await;
    c1.expect_quiet().await;
    assert_eq!(home(&srv), 2.0);
    c0.send(ClientToRelay::NotePreferred(false)).await;
    c0.expect_quiet().await;
    assert_eq!(home(&srv), 1.0);
    c0.send(ClientToRelay::NotePreferred(false)).await;
    c0.expect_quiet().await;
    assert_eq!(home(&srv), 1.0);
    // Flips right after connecting are not moves.
    assert_eq!(gauge(&srv, "derp_home_moves_in"), 0.0);
    assert_eq!(gauge(&srv, "derp_home_moves_out"), 0.0);

    // A preferred client leaving takes its home count with it.
    drop(c1);
    srv.eventually("c1 unregistered", |s| {
        gauge(s, "derp_current_connections") == 1.0 && home(s) == 0.0
    })
    .await;
    assert_eq!(gauge(&srv, "derp_clients_local"), 1.0);

    c0.send(ClientToRelay::NotePreferred(true)).await;
    c0.expect_quiet().await;
    assert_eq!(home(&srv), 1.0);
    drop(c0);
    srv.eventually("everyone gone", |s| {
        gauge(s, "derp_current_connections") == 0.0 && home(s) == 0.0
    })
    .await;
    assert_eq!(gauge(&srv, "derp_clients_local"), 0.0);
    srv.stop().await;
}

#[tokio::test]
async fn peer_gone_goes_only_to_clients_that_received_from_the_departed() {
    let srv = TestServer::start_default().await;
    let mut c0 = RawClient::connect(srv.addr).await;
    let mut c1 = RawClient::connect(srv.addr).await;
    let mut c2 = RawClient::connect(srv.addr).await;
    let (k0, k1, k2) = (c0.key, c1.key, c2.key);

    c0.send_packet(k1, b"a").await;
    assert_eq!(c1.recv_packet().await.0, k0);
    c1.send_packet(k2, b"b").await;
    assert_eq!(c2.recv_packet().await.0, k1);
    // The receivers' writers register their watches after writing; a round trip through each
    // writer makes sure that has happened before anyone leaves.
    c1.expect_quiet().await;
    c2.expect_quiet().await;

    drop(c0);
    assert_eq!(c1.recv().await, gone(k0));
    // c2 never received from c0.
    c2.expect_quiet().await;

    // c1 sent to c2 but never received from it: sending does not subscribe.
    drop(c2);
    srv.eventually("c2 unregistered", |s| {
        gauge(s, "derp_current_connections") == 1.0
    })
    .await;
    c1.expect_quiet().await;
    srv.eventually("one PeerGone written", |s| {
        gauge(s, "derp_peer_gone_disconnected_frames") == 1.0
    })
    .await;
    srv.stop().await;
}

/// Opens a client whose socket has a tiny receive buffer, so that when it stops reading the
/// server's writes stall after a few megabytes instead of tens.
async fn connect_small_rcvbuf(addr: SocketAddr) -> RawClient {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stream = socket.connect(addr).await.expect("connect");
    RawClient::connect_on(stream, random_secret()).await
}

const BIG: usize = 60 * 1024;

#[tokio::test]
async fn stuck_receiver_does_not_freeze_the_senders_other_flows() {
    // No write deadline: Cathy stays connected however long she is stuck.
    let srv = TestServer::start(ServerConfig {
        write_timeout: None,
        ..config()
    })
    .await;
    let mut alice = RawClient::connect(srv.addr).await;
    let mut bob = RawClient::connect(srv.addr).await;
    let mut cathy = connect_small_rcvbuf(srv.addr).await;
    let big = vec![0x55u8; BIG];

    // Alice alternates between Cathy (never read) and Bob (read in lockstep), so Bob's queue
    // never holds more than one packet and every one of his must arrive.
    for i in 0u32..2000 {
        alice.send_packet(cathy.key, &big).await;
        alice.send_packet(bob.key, &i.to_be_bytes()).await;
        assert_eq!(
            bob.recv_packet().await,
            (alice.key, i.to_be_bytes().to_vec())
        );
    }
    // 120 MB for Cathy cannot fit in socket buffers plus two 32-deep queues: the oldest were
    // dropped to make room.
    let head_drops = dropped(&srv, "queue_head", "other");
    assert!(head_drops > 1000.0, "queue_head drops: {head_drops}");
    assert_eq!(dropped(&srv, "queue_head", "disco"), 0.0);
    assert_eq!(gauge(&srv, "derp_current_connections"), 3.0);
    assert_eq!(gauge(&srv, "derp_sclient_write_timeouts"), 0.0);

    // Once Cathy reads again she gets the freshest of Alice's packets and the connection is
    // in order.
    let seen = cathy.barrier().await;
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|f| matches!(
        f,
        RelayToClient::RecvPacket { src, packet } if *src == alice.key && packet.len() == BIG
    )));
    bob.expect_quiet().await;
    srv.stop().await;
}

#[tokio::test]
async fn stuck_receiver_is_cut_off_by_the_write_timeout() {
    let srv = TestServer::start(ServerConfig {
        write_timeout: Some(Duration::from_millis(200)),
        ..config()
    })
    .await;
    let mut alice = RawClient::connect(srv.addr).await;
    let mut bob = RawClient::connect(srv.addr).await;
    let mut cathy = connect_small_rcvbuf(srv.addr).await;
    let cathy_key = cathy.key;
    let big = vec![0x55u8; BIG];

    let deadline = tokio::time::Instant::now() + STEP;
    let mut i = 0u32;
    while gauge(&srv, "derp_sclient_write_timeouts") == 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "Cathy was never cut off"
        );
        alice.send_packet(cathy_key, &big).await;
        alice.send_packet(bob.key, &i.to_be_bytes()).await;
        assert_eq!(
            bob.recv_packet().await,
            (alice.key, i.to_be_bytes().to_vec())
        );
        i += 1;
    }
    srv.eventually("Cathy unregistered", |s| {
        gauge(s, "derp_current_connections") == 2.0
    })
    .await;
    assert_eq!(gauge(&srv, "derp_sclient_write_timeouts"), 1.0);
    // The connection is counted as ended by its failed write, once.
    srv.eventually("the end counted", |s| {
        s.metric("derp_connection_errors", &[("class", "local")]) == 1.0
    })
    .await;
    assert_eq!(
        srv.metric(
            "derp_connection_errors",
            &[("class", "local"), ("reason", "write_timeout")]
        ),
        1.0
    );
    // The batch being written when the deadline hit is lost as a write error.
    assert!(dropped(&srv, "write_error", "other") >= 1.0);
    cathy.expect_closed().await;

    // Alice and Bob carry on; Cathy's key is now simply unknown.
    let unknown_before = dropped(&srv, "unknown_dest", "other");
    alice.send_packet(cathy_key, &big).await;
    alice.send_packet(bob.key, b"still here").await;
    assert_eq!(bob.recv_packet().await, (alice.key, b"still here".to_vec()));
    alice.expect_quiet().await;
    assert_eq!(dropped(&srv, "unknown_dest", "other"), unknown_before + 1.0);
    srv.stop().await;
}

/// A batch cut off by the write deadline: the packets whose frames the socket took in full
/// before that reach the receiver once it reads again, and are counted as sent; only the
/// rest are write errors. So received = sent + dropped holds packet by packet, not only in
/// total.
#[tokio::test]
async fn packets_handed_to_the_socket_before_a_write_timeout_count_as_sent() {
    let srv = TestServer::start(ServerConfig {
        write_timeout: Some(Duration::from_millis(300)),
        ..config()
    })
    .await;
    let mut alice = RawClient::connect(srv.addr).await;
    let mut cathy = connect_small_rcvbuf(srv.addr).await;
    // Bursts of packets in one write each, so the server queues them together and writes
    // them in batches, the last of which the socket takes only in part.
    let mut burst = Vec::new();
    for i in 0..16u8 {
        ClientToRelay::SendPacket {
            dst: cathy.key,
            packet: Bytes::from(vec![i; BIG]),
        }
        .encode(&mut burst);
    }
    let deadline = tokio::time::Instant::now() + STEP;
    let mut offered = 0u32;
    while gauge(&srv, "derp_sclient_write_timeouts") == 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "Cathy was never cut off"
        );
        alice.send_raw(&burst).await;
        offered += 16;
        // Every packet handled before the timeout is checked again.
        alice.expect_quiet().await;
    }
    srv.eventually("Cathy unregistered", |s| {
        gauge(s, "derp_current_connections") == 1.0
    })
    .await;
    let (frames, _) = cathy.frames_until_closed().await;
    let delivered = frames
        .iter()
        .filter(|(ty, _)| *ty == FrameType::RecvPacket as u8)
        .count() as u32;
    let drops: f64 = [
        "queue_head",
        "queue_tail",
        "write_error",
        "gone_disconnected",
        "unknown_dest",
    ]
    .iter()
    .map(|r| dropped(&srv, r, "other"))
    .sum();
    assert!(dropped(&srv, "write_error", "other") >= 1.0);
    assert_eq!(
        (gauge(&srv, "derp_packets_sent"), drops),
        (f64::from(delivered), f64::from(offered - delivered)),
        "{delivered} of {offered} packets reached Cathy"
    );
    srv.stop().await;
}

#[tokio::test]
async fn duplicate_keys_follow_the_last_writer() {
    let srv = TestServer::start_default().await;
    let mut s = RawClient::connect(srv.addr).await;
    let secret = random_secret();
    let key = secret.public_key();
    let dup = |srv: &TestServer| {
        (
            gauge(srv, "derp_current_dup_client_keys"),
            gauge(srv, "derp_current_dup_client_conns"),
            gauge(srv, "derp_total_dup_client_conns"),
        )
    };

    let mut k1 = RawClient::connect_with(srv.addr, secret.clone()).await;
    // S receives from the key, so it is owed a PeerGone when the key leaves for good.
    k1.send_packet(s.key, b"hi from k1").await;
    assert_eq!(s.recv_packet().await.0, key);
    s.expect_quiet().await;
    s.send_packet(key, b"p1").await;
    assert_eq!(k1.recv_packet().await, (s.key, b"p1".to_vec()));
    assert_eq!(dup(&srv), (0.0, 0.0, 0.0));

    // A second connection with the same key: the newer one is active.
    let mut k2 = RawClient::connect_with(srv.addr, secret.clone()).await;
    assert_eq!(dup(&srv), (1.0, 2.0, 1.0));
    assert_eq!(gauge(&srv, "derp_current_connections"), 3.0);
    assert_eq!(gauge(&srv, "derp_clients_local"), 2.0);
    s.send_packet(key, b"p2").await;
    assert_eq!(k2.recv_packet().await, (s.key, b"p2".to_vec()));

    // Any frame makes its sender active; the barrier's pings are such frames.
    assert!(k1.barrier().await.is_empty());
    s.send_packet(key, b"p3").await;
    assert_eq!(k1.recv_packet().await, (s.key, b"p3".to_vec()));
    assert!(k2.barrier().await.is_empty());
    s.send_packet(key, b"p4").await;
    assert_eq!(k2.recv_packet().await, (s.key, b"p4".to_vec()));

    let mut k3 = RawClient::connect_with(srv.addr, secret.clone()).await;
    assert_eq!(dup(&srv), (1.0, 3.0, 2.0));
    s.send_packet(key, b"p5").await;
    assert_eq!(k3.recv_packet().await, (s.key, b"p5".to_vec()));

    // The active one leaves: the previous last writer (k2) takes over, and no PeerGone.
    drop(k3);
    srv.eventually("k3 unregistered", |srv| dup(srv) == (1.0, 2.0, 2.0))
        .await;
    s.send_packet(key, b"p6").await;
    assert_eq!(k2.recv_packet().await, (s.key, b"p6".to_vec()));
    s.expect_quiet().await;

    // Down to one: the set is a plain client again.
    drop(k2);
    srv.eventually("k2 unregistered", |srv| dup(srv) == (0.0, 0.0, 2.0))
        .await;
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    s.send_packet(key, b"p7").await;
    assert_eq!(k1.recv_packet().await, (s.key, b"p7".to_vec()));
    s.expect_quiet().await;
    assert_eq!(dropped(&srv, "dup_client", "other"), 0.0);

    // The last connection leaves: now the key is gone.
    drop(k1);
    assert_eq!(s.recv().await, gone(key));
    assert_eq!(gauge(&srv, "derp_current_connections"), 1.0);
    srv.stop().await;
}

#[tokio::test]
async fn ping_gets_a_pong_with_the_same_bytes() {
    let srv = TestServer::start_default().await;
    let mut c = RawClient::connect(srv.addr).await;
    let data = [0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x2a];
    c.send_raw(&[0x12, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 0x2a])
        .await;
    assert_eq!(c.recv().await, RelayToClient::Pong(data));
    assert_eq!(gauge(&srv, "derp_got_ping"), 1.0);
    srv.eventually("pong counted", |s| gauge(s, "derp_sent_pong") == 1.0)
        .await;
    srv.stop().await;
}

#[tokio::test]
async fn unknown_frame_types_are_skipped_and_counted() {
    let srv = TestServer::start_default().await;
    let mut c = RawClient::connect(srv.addr).await;
    let mut d = RawClient::connect(srv.addr).await;
    let frames = [
        raw_frame(0x0b, b"abc"),
        // Pong, KeepAlive, PeerGone and ServerKey make no sense from a client.
        raw_frame(0x13, &[9; 8]),
        raw_frame(0x06, &[]),
        raw_frame(0x08, &[1; 33]),
        raw_frame(0x01, &[0; 40]),
        // A second ClientInfo after the handshake.
        raw_frame(0x02, &[1; 60]),
        // Unassigned, and bigger than any packet: skipped without a size cap.
        raw_frame(0x30, &vec![7; 200_000]),
    ];
    c.send_raw(&frames.concat()).await;
    c.expect_quiet().await;
    srv.eventually("seven unknown frames", |s| {
        gauge(s, "derp_unknown_frames") == 7.0
    })
    .await;

    c.send_packet(d.key, b"after the junk").await;
    assert_eq!(d.recv_packet().await, (c.key, b"after the junk".to_vec()));
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    srv.stop().await;
}

#[tokio::test]
async fn mesh_frames_from_an_ordinary_client_close_only_that_client() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut forward = Vec::new();
    forward.extend_from_slice(a.key.as_bytes());
    forward.extend_from_slice(b.key.as_bytes());
    forward.extend_from_slice(b"forged");
    let cases = [
        ("WatchConns", raw_frame(0x10, &[])),
        ("ClosePeer", raw_frame(0x11, b.key.as_bytes())),
        ("ForwardPacket", raw_frame(0x0a, &forward)),
    ];
    for (name, frame) in cases {
        let mut m = RawClient::connect(srv.addr).await;
        m.send_raw(&frame).await;
        m.expect_closed().await;
        srv.eventually("violator unregistered", |s| {
            gauge(s, "derp_current_connections") == 2.0
        })
        .await;
        // B was neither closed nor handed the forged packet; A and B still talk.
        assert!(b.barrier().await.is_empty(), "{name}");
        a.send_packet(b.key, name.as_bytes()).await;
        assert_eq!(b.recv_packet().await, (a.key, name.as_bytes().to_vec()));
    }
    assert_eq!(gauge(&srv, "derp_watchers"), 0.0);
    assert_eq!(gauge(&srv, "derp_packets_forwarded_in"), 0.0);
    srv.stop().await;
}

#[tokio::test]
async fn idle_connection_gets_keepalives() {
    let srv = TestServer::start(ServerConfig {
        keepalive_interval: Duration::from_millis(100),
        ..config()
    })
    .await;
    let mut c = RawClient::connect(srv.addr).await;
    // Each connection adds up to 5 s of jitter to the period (at most the period itself).
    let frame = tokio::time::timeout(STEP, c.recv_any())
        .await
        .expect("no keepalive within the period plus jitter");
    assert_eq!(frame, RelayToClient::KeepAlive);
    // The connection is still fine afterwards.
    c.expect_quiet().await;
    srv.stop().await;
}

#[tokio::test]
async fn a_connection_quiet_for_a_keepalive_period_still_relays_its_next_packet() {
    let srv = TestServer::start(ServerConfig {
        keepalive_interval: Duration::from_millis(50),
        ..config()
    })
    .await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    for round in 0..3 {
        let packet = format!("after {round} quiet periods");
        a.send_packet(b.key, packet.as_bytes()).await;
        assert_eq!(b.recv_packet().await, (a.key, packet.into_bytes()));
        // A period with a read, then one without: the read loop leaves its busy state and
        // waits for traffic, still sending keepalives, and wakes for the next packet.
        for _ in 0..3 {
            let frame = tokio::time::timeout(STEP, a.recv_any())
                .await
                .expect("a keepalive within the period plus jitter");
            assert_eq!(frame, RelayToClient::KeepAlive);
        }
    }
    // The same for a client that has only ever been quiet and then talks.
    let mut c = RawClient::connect(srv.addr).await;
    for _ in 0..2 {
        let frame = tokio::time::timeout(STEP, c.recv_any())
            .await
            .expect("keepalive");
        assert_eq!(frame, RelayToClient::KeepAlive);
    }
    c.send_packet(b.key, b"from a quiet client").await;
    assert_eq!(
        b.recv_packet().await,
        (c.key, b"from a quiet client".to_vec())
    );
    srv.stop().await;
}

/// A DERP client over WebSocket: masked binary messages out, unmasked messages in.
struct WsClient {
    stream: TcpStream,
    raw: BytesMut,
    derp: BytesMut,
    decoder: ClientDecoder,
    key: PublicKey,
    pongs: Vec<Vec<u8>>,
}

/// RFC 6455 §1.3's example key and the accept value it must produce.
const WS_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const WS_ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

/// A masked client frame with the shortest length encoding.
fn ws_frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mut mask = [0u8; 4];
    rand::rngs::OsRng.fill_bytes(&mut mask);
    let mut out = vec![opcode | if fin { 0x80 } else { 0 }];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= 0xffff => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().zip(mask.iter().cycle()).map(|(b, m)| b ^ m));
    out
}

impl WsClient {
    async fn connect(addr: SocketAddr, secret: SecretKey) -> Self {
        Self::connect_after(addr, secret, false).await
    }

    /// Sends the WebSocket upgrade request with `protocol` as the offered subprotocols, after
    /// a probe request on the same connection when `after_probe` is set (so the upgrade is a
    /// later request of a keep-alive connection). Returns the client and the 101 response.
    async fn upgrade(
        addr: SocketAddr,
        secret: &SecretKey,
        after_probe: bool,
        protocol: &str,
    ) -> (Self, HttpResponse) {
        let mut c = Self {
            stream: TcpStream::connect(addr).await.expect("connect"),
            raw: BytesMut::new(),
            derp: BytesMut::new(),
            decoder: ClientDecoder::new(),
            key: secret.public_key(),
            pongs: Vec::new(),
        };
        if after_probe {
            let probe = format!("GET /derp/probe HTTP/1.1\r\nHost: {addr}\r\n\r\n");
            c.stream.write_all(probe.as_bytes()).await.expect("write");
            let head = c.read_head().await;
            assert_eq!(head.status, 200);
        }
        let req = format!(
            "GET /derp HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {WS_KEY}\r\n\
             Sec-WebSocket-Protocol: {protocol}\r\n\r\n"
        );
        c.stream.write_all(req.as_bytes()).await.expect("write");
        let head = c.read_head().await;
        (c, head)
    }

    async fn read_head(&mut self) -> HttpResponse {
        let head_end = loop {
            if let Some(i) = self.raw.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            self.read_some().await;
        };
        crate::harness::parse_http_response(&self.raw.split_to(head_end))
    }

    async fn connect_after(addr: SocketAddr, secret: SecretKey, after_probe: bool) -> Self {
        let (mut c, head) = Self::upgrade(addr, &secret, after_probe, "derp").await;
        assert_eq!(head.status, 101);
        assert_eq!(head.header("sec-websocket-accept"), Some(WS_ACCEPT));
        assert_eq!(head.header("sec-websocket-protocol"), Some("derp"));

        let mut hs = ClientHandshake::new(
            secret,
            ClientInfo {
                version: 2,
                ..ClientInfo::default()
            },
        );
        match c.recv().await {
            RelayToClient::ServerKey(k) => hs.handle_server_key(k).expect("server key"),
            other => panic!("expected ServerKey, got {other:?}"),
        }
        let mut out = BytesMut::new();
        hs.client_info_frame([3; 24], &mut out)
            .expect("client info");
        // The stream continues across messages: split ClientInfo over two of them.
        let (first, second) = out.split_at(10);
        c.send_message(first).await;
        c.send_message(second).await;
        match c.recv().await {
            RelayToClient::ServerInfo { sealed } => {
                hs.handle_server_info(&sealed).expect("server info");
            }
            other => panic!("expected ServerInfo, got {other:?}"),
        }
        c
    }

    async fn read_some(&mut self) {
        self.raw.reserve(64 * 1024);
        let n = tokio::time::timeout(STEP, self.stream.read_buf(&mut self.raw))
            .await
            .expect("timed out reading")
            .expect("read");
        assert!(n > 0, "server closed the connection");
    }

    /// Everything the server sends until it closes, starting with what is buffered.
    async fn read_to_close(&mut self) -> Vec<u8> {
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(STEP, self.stream.read_to_end(&mut rest))
            .await
            .expect("server closes");
        let mut all = self.raw.split().to_vec();
        all.extend_from_slice(&rest);
        all
    }

    async fn send_message(&mut self, payload: &[u8]) {
        let frame = ws_frame(0x2, true, payload);
        self.stream.write_all(&frame).await.expect("write");
    }

    async fn send(&mut self, msg: ClientToRelay) {
        let mut out = BytesMut::new();
        msg.encode(&mut out);
        self.send_message(&out).await;
    }

    /// Unwraps one server message into `derp` (binary) or `pongs`.
    async fn read_message(&mut self) {
        loop {
            if self.raw.len() >= 2 {
                assert_eq!(self.raw[1] & 0x80, 0, "server frames are unmasked");
                let (hdr, len) = match self.raw[1] & 0x7f {
                    126 if self.raw.len() >= 4 => (
                        4,
                        usize::from(u16::from_be_bytes([self.raw[2], self.raw[3]])),
                    ),
                    127 if self.raw.len() >= 10 => {
                        let mut n = [0u8; 8];
                        n.copy_from_slice(&self.raw[2..10]);
                        (10, u64::from_be_bytes(n) as usize)
                    }
                    126 | 127 => (usize::MAX, 0),
                    n => (2, usize::from(n)),
                };
                if hdr != usize::MAX && self.raw.len() >= hdr + len {
                    let opcode = self.raw[0] & 0x0f;
                    self.raw.advance(hdr);
                    let payload = self.raw.split_to(len);
                    match opcode {
                        0x2 => self.derp.extend_from_slice(&payload),
                        0xa => self.pongs.push(payload.to_vec()),
                        other => panic!("unexpected opcode {other:#x}: {payload:?}"),
                    }
                    return;
                }
            }
            self.read_some().await;
        }
    }

    async fn recv(&mut self) -> RelayToClient {
        loop {
            match self.recv_any().await {
                RelayToClient::KeepAlive => continue,
                frame => return frame,
            }
        }
    }

    /// The next frame from the server, keepalives included.
    async fn recv_any(&mut self) -> RelayToClient {
        loop {
            match self.decoder.decode(&mut self.derp).expect("decode") {
                Some(frame) => return frame,
                None => self.read_message().await,
            }
        }
    }
}

#[tokio::test]
async fn a_websocket_connection_quiet_for_a_keepalive_period_still_relays() {
    let srv = TestServer::start(ServerConfig {
        keepalive_interval: Duration::from_millis(50),
        ..config()
    })
    .await;
    let mut ws = WsClient::connect(srv.addr, random_secret()).await;
    let mut plain = RawClient::connect(srv.addr).await;
    for round in 0..2 {
        let packet = format!("websocket, after {round} quiet periods");
        ws.send(ClientToRelay::SendPacket {
            dst: plain.key,
            packet: Bytes::from(packet.clone()),
        })
        .await;
        assert_eq!(plain.recv_packet().await, (ws.key, packet.into_bytes()));
        for _ in 0..3 {
            let frame = tokio::time::timeout(STEP, ws.recv_any())
                .await
                .expect("a keepalive within the period plus jitter");
            assert_eq!(frame, RelayToClient::KeepAlive);
        }
    }
    srv.stop().await;
}

#[tokio::test]
async fn websocket_client_relays_with_a_plain_client() {
    let srv = TestServer::start_default().await;
    let mut ws = WsClient::connect(srv.addr, random_secret()).await;
    let mut plain = RawClient::connect(srv.addr).await;
    assert_eq!(gauge(&srv, "derp_websocket_accepts"), 1.0);

    ws.send(ClientToRelay::SendPacket {
        dst: plain.key,
        packet: Bytes::from_static(b"over websocket"),
    })
    .await;
    assert_eq!(
        plain.recv_packet().await,
        (ws.key, b"over websocket".to_vec())
    );

    let big: Vec<u8> = (0..60_000u32).map(|i| i as u8).collect();
    plain.send_packet(ws.key, &big).await;
    assert_eq!(
        ws.recv().await,
        RelayToClient::RecvPacket {
            src: plain.key,
            packet: big.into()
        }
    );

    // DERP ping through WebSocket, and a WebSocket-level ping answered by the server.
    ws.send(ClientToRelay::Ping([4; 8])).await;
    assert_eq!(ws.recv().await, RelayToClient::Pong([4; 8]));
    let ping = ws_frame(0x9, true, b"ws-ping");
    ws.stream.write_all(&ping).await.expect("ws ping");
    ws.send(ClientToRelay::Ping([5; 8])).await;
    assert_eq!(ws.recv().await, RelayToClient::Pong([5; 8]));
    let deadline = tokio::time::Instant::now() + STEP;
    while ws.pongs.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no WebSocket pong");
        tokio::time::timeout(STEP, ws.read_message())
            .await
            .expect("message");
    }
    assert_eq!(ws.pongs, vec![b"ws-ping".to_vec()]);

    // When the WebSocket client leaves, the plain client (which received from it) hears.
    let ws_key = ws.key;
    drop(ws);
    assert_eq!(plain.recv().await, gone(ws_key));
    srv.stop().await;
}

#[tokio::test]
async fn derp_upgrade_works_as_a_later_request_on_a_keepalive_connection() {
    let srv = TestServer::start_default().await;
    let mut peer = RawClient::connect(srv.addr).await;
    let stream = TcpStream::connect(srv.addr).await.expect("connect");
    let secret = random_secret();
    let mut c = RawClient::on_stream(stream, secret);
    c.send_raw(format!("GET /derp/probe HTTP/1.1\r\nHost: {}\r\n\r\n", srv.addr).as_bytes())
        .await;
    let probe = c.read_http_head().await;
    assert!(probe.starts_with("HTTP/1.1 200 "), "{probe}");
    c.send_raw(
        format!(
            "GET /derp HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n",
            srv.addr
        )
        .as_bytes(),
    )
    .await;
    let head = c.read_http_head().await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    c.handshake(ClientInfo::default()).await;
    c.send_packet(peer.key, b"via hyper").await;
    assert_eq!(peer.recv_packet().await, (c.key, b"via hyper".to_vec()));
    srv.stop().await;
}

#[tokio::test]
async fn absolute_form_request_target_upgrades() {
    let srv = TestServer::start_default().await;
    let mut peer = RawClient::connect(srv.addr).await;
    let stream = TcpStream::connect(srv.addr).await.expect("connect");
    let secret = random_secret();
    let mut c = RawClient::on_stream(stream, secret);
    c.send_raw(
        format!(
            "POST http://{0}/derp HTTP/1.1\r\nHost: {0}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n",
            srv.addr
        )
        .as_bytes(),
    )
    .await;
    let head = c.read_http_head().await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    c.handshake(ClientInfo::default()).await;
    c.send_packet(peer.key, b"absolute").await;
    assert_eq!(peer.recv_packet().await, (c.key, b"absolute".to_vec()));
    srv.stop().await;
}

async fn get(addr: SocketAddr, method: &str, path: &str, extra: &str) -> HttpResponse {
    http_exchange(
        addr,
        &format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}\r\n"),
    )
    .await
}

#[tokio::test]
async fn probe_endpoints_answer_get_and_head_only() {
    let srv = TestServer::start_default().await;
    for path in ["/derp/probe", "/derp/latency-check"] {
        for method in ["GET", "HEAD"] {
            let r = get(srv.addr, method, path, "").await;
            assert_eq!(r.status, 200, "{method} {path}");
            assert_eq!(r.header("access-control-allow-origin"), Some("*"));
            assert!(r.body.is_empty());
        }
        for method in ["POST", "PUT", "DELETE"] {
            let r = get(srv.addr, method, path, "Content-Length: 0\r\n").await;
            assert_eq!(r.status, 405, "{method} {path}");
            assert_eq!(r.header("allow"), Some("GET, HEAD"));
            assert_eq!(r.body, b"bogus probe method\n");
        }
        // An upgrade header does not turn a probe into a DERP connection.
        let r = get(srv.addr, "GET", path, "Upgrade: DERP\r\n").await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(gauge(&srv, "derp_accepts"), 0.0);
    srv.stop().await;
}

#[tokio::test]
async fn derp_paths_without_an_upgrade_get_426() {
    let srv = TestServer::start_default().await;
    for (path, extra) in [
        ("/derp", ""),
        ("/derp/sdf", ""),
        ("/derp?x=1", ""),
        ("/derp", "Upgrade: h2c\r\n"),
    ] {
        let r = get(srv.addr, "GET", path, extra).await;
        assert_eq!(r.status, 426, "{path} {extra:?}");
        assert_eq!(r.body, b"DERP requires connection upgrade\n");
    }
    assert_eq!(gauge(&srv, "derp_accepts"), 0.0);
    srv.stop().await;
}

#[tokio::test]
async fn generate_204_echoes_only_valid_challenges() {
    let srv = TestServer::start_default().await;
    let r = get(srv.addr, "GET", "/generate_204", "").await;
    assert_eq!(r.status, 204);
    assert_eq!(
        r.header("cache-control"),
        Some("no-cache, no-store, must-revalidate, no-transform, max-age=0")
    );
    assert_eq!(r.header("x-tailscale-response"), None);

    let long_ok = "a".repeat(64);
    let long_bad = "a".repeat(65);
    for (challenge, echoed) in [
        ("abc.DEF_123:4-5", true),
        (long_ok.as_str(), true),
        (long_bad.as_str(), false),
        ("has space", false),
        ("semi;colon", false),
        ("slash/", false),
    ] {
        let r = get(
            srv.addr,
            "GET",
            "/generate_204",
            &format!("X-Tailscale-Challenge: {challenge}\r\n"),
        )
        .await;
        assert_eq!(r.status, 204);
        let expected = format!("response {challenge}");
        assert_eq!(
            r.header("x-tailscale-response"),
            echoed.then_some(expected.as_str()),
            "{challenge:?}"
        );
    }
    srv.stop().await;
}

fn assert_browser_headers(r: &HttpResponse) {
    assert_eq!(
        r.header("strict-transport-security"),
        Some("max-age=63072000; includeSubDomains")
    );
    assert_eq!(r.header("x-frame-options"), Some("DENY"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    assert!(
        r.header("content-security-policy")
            .is_some_and(|v| v.starts_with("default-src 'self'")),
        "{r:?}"
    );
}

#[tokio::test]
async fn robots_txt_disallows_everything() {
    let srv = TestServer::start_default().await;
    let r = get(srv.addr, "GET", "/robots.txt", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"User-agent: *\nDisallow: /\n");
    assert_browser_headers(&r);
    srv.stop().await;
}

#[tokio::test]
async fn home_page_variants() {
    let srv = TestServer::start_default().await;
    for path in ["/", "/some/unmatched/path"] {
        let r = get(srv.addr, "GET", path, "").await;
        assert_eq!(r.status, 200);
        assert!(
            r.header("content-type")
                .is_some_and(|v| v.starts_with("text/html"))
        );
        assert!(String::from_utf8_lossy(&r.body).contains("DERP"));
        assert_browser_headers(&r);
    }
    srv.stop().await;

    let srv = TestServer::start(ServerConfig {
        home: HomePage::Blank,
        ..config()
    })
    .await;
    let r = get(srv.addr, "GET", "/", "").await;
    assert_eq!(r.status, 200);
    assert!(r.body.is_empty());
    assert_browser_headers(&r);
    srv.stop().await;

    let srv = TestServer::start(ServerConfig {
        home: HomePage::Redirect("https://example.com/derp-info".into()),
        ..config()
    })
    .await;
    let r = get(srv.addr, "GET", "/", "").await;
    assert_eq!(r.status, 302);
    assert_eq!(r.header("location"), Some("https://example.com/derp-info"));
    srv.stop().await;
}

#[tokio::test]
async fn disabled_derp_gives_404_but_probes_work() {
    let srv = TestServer::start(ServerConfig {
        derp_enabled: false,
        ..config()
    })
    .await;
    let r = get(
        srv.addr,
        "GET",
        "/derp",
        "Connection: Upgrade\r\nUpgrade: DERP\r\n",
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.body, b"derp server disabled\n");
    let r = get(srv.addr, "GET", "/derp", "").await;
    assert_eq!(r.status, 404);
    for path in ["/derp/probe", "/derp/latency-check"] {
        assert_eq!(get(srv.addr, "GET", path, "").await.status, 200);
    }
    assert_eq!(get(srv.addr, "GET", "/generate_204", "").await.status, 204);
    assert_eq!(gauge(&srv, "derp_accepts"), 0.0);
    srv.stop().await;
}

/// Only GET and POST open DERP (methods are case-sensitive), only GET opens WebSocket; every
/// other method gets 405 with `Allow`, on the first request of a connection (parsed by the
/// relay itself) and on later ones (parsed by hyper) alike.
#[tokio::test]
async fn derp_upgrade_methods_other_than_get_and_post_get_405() {
    let srv = TestServer::start_default().await;
    let mut peer = RawClient::connect(srv.addr).await;
    let upgrade = "Connection: Upgrade\r\nUpgrade: DERP\r\n";
    for method in [
        "FOO", "CONNECT", "get", "Get", "post", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH",
    ] {
        let r = get(srv.addr, method, "/derp", upgrade).await;
        assert_eq!(r.status, 405, "{method}");
        assert_eq!(r.header("allow"), Some("GET, POST"), "{method}");
        // Without an Upgrade header the method is still what is wrong.
        let r = get(srv.addr, method, "/derp", "").await;
        assert_eq!(r.status, 405, "{method} without upgrade");
    }
    let ws = "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: derp\r\n";
    let r = get(srv.addr, "POST", "/derp", ws).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET"));
    assert_eq!(
        gauge(&srv, "derp_accepts"),
        1.0,
        "only the peer was accepted"
    );

    // A later request on a keep-alive connection goes through hyper: same answer, and the
    // connection stays usable for a proper upgrade.
    let stream = TcpStream::connect(srv.addr).await.expect("connect");
    let secret = random_secret();
    let mut c = RawClient::on_stream(stream, secret);
    c.send_raw(format!("GET /derp/probe HTTP/1.1\r\nHost: {}\r\n\r\n", srv.addr).as_bytes())
        .await;
    let probe = c.read_http_head().await;
    assert!(probe.starts_with("HTTP/1.1 200 "), "{probe}");
    c.send_raw(format!("FOO /derp HTTP/1.1\r\nHost: {}\r\n{upgrade}\r\n", srv.addr).as_bytes())
        .await;
    let refused = c.read_http_head().await;
    assert!(refused.starts_with("HTTP/1.1 405 "), "{refused}");
    assert!(
        refused.to_lowercase().contains("\r\nallow: get, post\r\n"),
        "{refused}"
    );
    let len: usize = refused
        .to_lowercase()
        .lines()
        .find_map(|l| {
            l.strip_prefix("content-length: ")
                .map(|v| v.trim().parse().ok())
        })
        .flatten()
        .expect("content-length");
    while c.buf.unread().len() < len {
        c.read_more().await;
    }
    c.buf.consume(len);
    c.send_raw(format!("POST /derp HTTP/1.1\r\nHost: {}\r\n{upgrade}\r\n", srv.addr).as_bytes())
        .await;
    let head = c.read_http_head().await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    c.handshake(ClientInfo::default()).await;
    c.send_packet(peer.key, b"post via hyper").await;
    assert_eq!(
        peer.recv_packet().await,
        (c.key, b"post via hyper".to_vec())
    );
    srv.stop().await;
}

#[tokio::test]
async fn websocket_upgrade_variants() {
    let srv = TestServer::start_default().await;
    let mut plain = RawClient::connect(srv.addr).await;

    // As a later request on a keep-alive connection (the upgrade goes through hyper).
    let mut ws = WsClient::connect_after(srv.addr, random_secret(), true).await;
    ws.send(ClientToRelay::SendPacket {
        dst: plain.key,
        packet: Bytes::from_static(b"keep-alive websocket"),
    })
    .await;
    assert_eq!(
        plain.recv_packet().await,
        (ws.key, b"keep-alive websocket".to_vec())
    );

    // A subprotocol list that mentions derp only inside another token: accepted as a
    // WebSocket without a subprotocol, then closed with 1008 (policy violation).
    let (mut c, head) = WsClient::upgrade(srv.addr, &random_secret(), false, "derpish").await;
    assert_eq!(head.status, 101);
    assert_eq!(head.header("sec-websocket-protocol"), None);
    let rest = c.read_to_close().await;
    assert!(rest.len() >= 4, "{rest:?}");
    assert_eq!(rest[0], 0x88, "a close frame: {rest:?}");
    assert_eq!(u16::from_be_bytes([rest[2], rest[3]]), 1008);

    // `Upgrade: websocket` with no subprotocol at all is an old client speaking plain DERP.
    let stream = TcpStream::connect(srv.addr).await.expect("connect");
    let secret = random_secret();
    let mut old = RawClient::on_stream(stream, secret);
    old.send_raw(
        format!(
            "GET /derp HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n",
            srv.addr
        )
        .as_bytes(),
    )
    .await;
    let head = old.read_http_head().await;
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    assert!(head.contains("Upgrade: DERP\r\n"), "{head}");
    old.handshake(ClientInfo::default()).await;
    old.send_packet(plain.key, b"old client").await;
    assert_eq!(plain.recv_packet().await, (old.key, b"old client".to_vec()));
    assert_eq!(gauge(&srv, "derp_websocket_accepts"), 1.0);
    srv.stop().await;
}

#[tokio::test]
async fn websocket_frames_sent_with_a_keep_alive_upgrade_request_are_not_lost() {
    let srv = TestServer::start_default().await;
    let mut plain = RawClient::connect(srv.addr).await;
    let probe = format!("GET /derp/probe HTTP/1.1\r\nHost: {}\r\n\r\n", srv.addr);
    let upgrade = format!(
        "GET /derp HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {WS_KEY}\r\n\
         Sec-WebSocket-Protocol: derp\r\n\r\n",
        srv.addr
    );
    // The upgrade after the probe goes through hyper, which reads the frames behind it with
    // the head. Sent in one write with the probe too, they reach hyper in the bytes the
    // front read first and replays.
    for with_probe in [false, true] {
        let secret = random_secret();
        let mut hs = ClientHandshake::fast_start(
            secret.clone(),
            ClientInfo {
                version: 2,
                ..ClientInfo::default()
            },
            srv.server.public_key(),
        );
        let mut derp = BytesMut::new();
        hs.client_info_frame([3; 24], &mut derp)
            .expect("client info");
        ClientToRelay::SendPacket {
            dst: plain.key,
            packet: Bytes::from_static(b"sent with the upgrade"),
        }
        .encode(&mut derp);
        // ClientInfo split across two messages, the packet's frame in a third.
        let (a, rest) = derp.split_at(10);
        let (b, c) = rest.split_at(rest.len() - 60);
        let frames = [
            ws_frame(0x2, true, a),
            ws_frame(0x2, true, b),
            ws_frame(0x2, true, c),
        ];
        let mut ws = WsClient {
            stream: TcpStream::connect(srv.addr).await.expect("connect"),
            raw: BytesMut::new(),
            derp: BytesMut::new(),
            decoder: ClientDecoder::new(),
            key: secret.public_key(),
            pongs: Vec::new(),
        };
        let mut write = Vec::new();
        write.extend_from_slice(probe.as_bytes());
        if !with_probe {
            ws.stream.write_all(&write).await.expect("probe");
            assert_eq!(ws.read_head().await.status, 200);
            write.clear();
        }
        write.extend_from_slice(upgrade.as_bytes());
        write.extend(frames.concat());
        ws.stream.write_all(&write).await.expect("upgrade");
        if with_probe {
            assert_eq!(ws.read_head().await.status, 200);
        }
        let head = ws.read_head().await;
        assert_eq!(head.status, 101);
        assert_eq!(head.header("sec-websocket-protocol"), Some("derp"));
        assert_eq!(
            ws.recv().await,
            RelayToClient::ServerKey(srv.server.public_key())
        );
        match ws.recv().await {
            RelayToClient::ServerInfo { sealed } => {
                hs.handle_server_info(&sealed).expect("server info");
            }
            other => panic!("expected ServerInfo, got {other:?}"),
        }
        assert_eq!(
            plain.recv_packet().await,
            (ws.key, b"sent with the upgrade".to_vec())
        );
        plain.send_packet(ws.key, b"and back").await;
        assert_eq!(
            ws.recv().await,
            RelayToClient::RecvPacket {
                src: plain.key,
                packet: Bytes::from_static(b"and back"),
            }
        );
        drop(ws);
        assert_eq!(plain.recv().await, gone(secret.public_key()));
    }
    srv.stop().await;
}

#[tokio::test]
async fn frames_pipelined_behind_the_handshake_are_handled_in_order() {
    let srv = TestServer::start_default().await;
    let mut dst = RawClient::connect(srv.addr).await;

    // Fast start: request head, ClientInfo, a packet and a ping in one write; the server
    // answers with no HTTP response at all.
    let secret = random_secret();
    let key = secret.public_key();
    let mut hs = ClientHandshake::fast_start(
        secret.clone(),
        ClientInfo::default(),
        derp_testkit::server_secret().public_key(),
    );
    let mut out = BytesMut::new();
    out.extend_from_slice(
        format!(
            "GET /derp HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\
             Derp-Fast-Start: 1\r\n\r\n",
            srv.addr
        )
        .as_bytes(),
    );
    hs.client_info_frame([1; 24], &mut out)
        .expect("client info");
    ClientToRelay::SendPacket {
        dst: dst.key,
        packet: Bytes::from_static(b"pipelined"),
    }
    .encode(&mut out);
    ClientToRelay::Ping([6; 8]).encode(&mut out);
    let stream = TcpStream::connect(srv.addr).await.expect("connect");
    let mut c = RawClient::on_stream(stream, secret);
    c.send_raw(&out).await;
    assert!(matches!(c.recv().await, RelayToClient::ServerKey(k) if k == srv.server.public_key()));
    match c.recv().await {
        RelayToClient::ServerInfo { sealed } => {
            hs.handle_server_info(&sealed).expect("server info");
        }
        other => panic!("expected ServerInfo, got {other:?}"),
    }
    assert_eq!(c.recv().await, RelayToClient::Pong([6; 8]));
    assert_eq!(dst.recv_packet().await, (key, b"pipelined".to_vec()));
    srv.stop().await;
}

#[tokio::test]
async fn ideal_node_header_marks_the_connection_not_ideal() {
    let srv = TestServer::start_default().await;
    let notideal = |s: &TestServer| gauge(s, "derp_current_notideal_connections");
    let mut ideal = RawClient::connect(srv.addr).await;
    // An empty value does not count.
    let mut empty = RawClient::upgrade(srv.addr, random_secret(), "Ideal-Node: \r\n").await;
    empty.handshake(ClientInfo::default()).await;
    assert_eq!(notideal(&srv), 0.0);
    let mut other = RawClient::upgrade(srv.addr, random_secret(), "Ideal-Node: derp1a\r\n").await;
    other.handshake(ClientInfo::default()).await;
    assert_eq!(notideal(&srv), 1.0);
    other.send_packet(ideal.key, b"from elsewhere").await;
    assert_eq!(
        ideal.recv_packet().await,
        (other.key, b"from elsewhere".to_vec())
    );
    drop(other);
    srv.eventually("not-ideal connection gone", |s| notideal(s) == 0.0)
        .await;
    empty.expect_quiet().await;
    srv.stop().await;
}

/// The hyper upgrade path must match the `derp` subprotocol exactly, not as a substring
/// (`derpish`).
#[tokio::test]
async fn websocket_subprotocol_is_checked_on_keepalive_requests_too() {
    let srv = TestServer::start_default().await;
    let (mut c, head) = WsClient::upgrade(srv.addr, &random_secret(), true, "derpish").await;
    assert_eq!(head.status, 101);
    assert_eq!(head.header("sec-websocket-protocol"), None);
    let rest = c.read_to_close().await;
    assert!(rest.len() >= 4, "{rest:?}");
    assert_eq!(rest[0], 0x88, "a close frame: {rest:?}");
    assert_eq!(u16::from_be_bytes([rest[2], rest[3]]), 1008);
    srv.stop().await;
}

#[tokio::test]
async fn empty_and_self_addressed_packets_are_delivered() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    a.send_packet(b.key, b"").await;
    assert_eq!(b.recv_packet().await, (a.key, Vec::new()));
    a.send_packet(a.key, b"note to self").await;
    assert_eq!(a.recv_packet().await, (a.key, b"note to self".to_vec()));
    srv.stop().await;
}

/// The receiver must watch for the sender's PeerGone before the packet is written to it, or
/// a sender that leaves right away is never reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_gone_reaches_a_receiver_even_when_the_sender_leaves_at_once() {
    let srv = TestServer::start_default().await;
    for round in 0..50 {
        let mut x = RawClient::connect(srv.addr).await;
        let mut c = RawClient::connect(srv.addr).await;
        let xk = x.key;
        // The packet and the close leave together.
        x.send_packet(c.key, b"last words").await;
        x.stream.shutdown().await.expect("shutdown");
        drop(x);
        assert_eq!(c.recv_packet().await.0, xk, "round {round}");
        assert_eq!(c.recv().await, gone(xk), "round {round}");
    }
    srv.stop().await;
}

#[tokio::test]
async fn a_returning_peer_is_watched_again_and_its_second_departure_is_announced() {
    let srv = TestServer::start_default().await;
    let mut c = RawClient::connect(srv.addr).await;
    let x_secret = SecretKey::generate(&mut rand::rngs::OsRng);
    for round in 0..2 {
        let mut x = RawClient::connect_with(srv.addr, x_secret.clone()).await;
        x.send_packet(c.key, &[round; 8]).await;
        assert_eq!(c.recv_packet().await, (x.key, vec![round; 8]));
        drop(x);
        assert_eq!(
            c.recv().await,
            RelayToClient::PeerGone {
                peer: x_secret.public_key(),
                reason: PeerGoneReason::Disconnected,
            },
            "round {round}"
        );
    }
    srv.stop().await;
}

#[tokio::test]
async fn a_burst_bigger_than_the_queue_reaches_a_receiver_that_keeps_up() {
    // 500 small packets in one write: each of the relay's reads holds far more packets for
    // the one destination than its 32-packet queue. A receiver that reads everything must
    // still get every packet, in order: the relay writes to it as its queue fills, instead of
    // dropping.
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut burst = Vec::new();
    for i in 0..500u32 {
        ClientToRelay::SendPacket {
            dst: b.key,
            packet: Bytes::copy_from_slice(&i.to_be_bytes()),
        }
        .encode(&mut burst);
    }
    a.send_raw(&burst).await;
    for i in 0..500u32 {
        assert_eq!(
            b.recv_packet().await,
            (a.key, i.to_be_bytes().to_vec()),
            "packet {i}"
        );
    }
    assert_eq!(dropped(&srv, "queue_head", "other"), 0.0);
    assert_eq!(dropped(&srv, "queue_tail", "other"), 0.0);
    srv.stop().await;
}
