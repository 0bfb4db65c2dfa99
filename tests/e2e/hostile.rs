//! Hostile and broken peers: garbage before and after the handshake, malformed frames,
//! clients that never read, slowloris heads and piles of half-open connections.
//!
//! Every case checks that the server closes or drops only what it must: the offender goes,
//! and in the same test another pair of clients keeps relaying.

use std::net::SocketAddr;
use std::time::Duration;

use derp_proto::{ClientToRelay, PublicKey, RelayToClient, SecretKey};
use derp_server::ServerConfig;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinSet;

use crate::harness::{RawClient, STEP, TestServer, raw_frame, read_until_closed};

fn config() -> ServerConfig {
    ServerConfig::new(derp_testkit::server_secret())
}

fn gauge(srv: &TestServer, name: &str) -> f64 {
    srv.metric(name, &[])
}

fn dropped(srv: &TestServer, reason: &str, kind: &str) -> f64 {
    srv.metric(
        "derp_packets_dropped",
        &[("reason", reason), ("kind", kind)],
    )
}

/// Proves a pair of ordinary clients still relays both ways.
async fn pair_still_works(a: &mut RawClient, b: &mut RawClient, tag: &str) {
    a.send_packet(b.key, tag.as_bytes()).await;
    assert_eq!(
        b.recv_packet().await,
        (a.key, tag.as_bytes().to_vec()),
        "{tag}"
    );
    b.send_packet(a.key, tag.as_bytes()).await;
    assert_eq!(
        a.recv_packet().await,
        (b.key, tag.as_bytes().to_vec()),
        "{tag}"
    );
}

/// Opens a connection, upgrades it, and reads the ServerKey frame.
async fn upgraded_before_client_info(addr: SocketAddr) -> RawClient {
    let mut c = RawClient::upgrade(addr, SecretKey::generate(&mut rand::rngs::OsRng), "").await;
    assert!(matches!(c.recv().await, RelayToClient::ServerKey(_)));
    c
}

#[tokio::test]
async fn garbage_instead_of_an_http_request_gets_400_and_close() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xde4b);

    let mut random = vec![0u8; 300];
    rng.fill(&mut random[..]);
    // Control bytes up front so this can never be the start of a request line.
    random[0] = 0x00;
    // A DERP client that forgot the upgrade and starts with a ClientInfo frame.
    let bare_frame = raw_frame(0x02, &[7; 80]);
    for (name, junk) in [("random", random), ("bare DERP frame", bare_frame)] {
        let mut s = TcpStream::connect(srv.addr).await.expect("connect");
        s.write_all(&junk).await.expect("write");
        let reply = read_until_closed(&mut s).await;
        assert!(
            reply.starts_with(b"HTTP/1.1 400 "),
            "{name}: {:?}",
            String::from_utf8_lossy(&reply)
        );
    }

    // A request head that never ends: cut off at the size limit rather than buffered forever.
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    let mut endless = b"GET /derp HTTP/1.1\r\n".to_vec();
    while endless.len() < 64 * 1024 {
        endless.extend_from_slice(b"X-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    // The server may close (even with a reset) before taking every byte.
    let _ = s.write_all(&endless).await;
    let reply = read_until_closed(&mut s).await;
    assert!(
        reply.is_empty() || reply.starts_with(b"HTTP/1.1 400 "),
        "{:?}",
        String::from_utf8_lossy(&reply)
    );

    assert_eq!(gauge(&srv, "derp_accepts"), 2.0);
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    pair_still_works(&mut a, &mut b, "after http garbage").await;
    srv.stop().await;
}

#[tokio::test]
async fn garbage_instead_of_client_info_closes_before_registering() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xc11e);
    let mut random = vec![0u8; 200];
    rng.fill(&mut random[..]);
    // Make sure the random bytes do not happen to start a ClientInfo frame.
    random[0] = 0xee;

    let mut sealed_junk = vec![0u8; 32 + 24 + 16 + 20];
    rng.fill(&mut sealed_junk[..]);
    let cases: [(&str, Vec<u8>, bool); 5] = [
        ("random bytes", random, false),
        // Right type and size, but the box does not open.
        ("unopenable ClientInfo", raw_frame(0x02, &sealed_junk), true),
        // Announces more than 256 KiB; only the header is sent, so the server must refuse
        // it from the header alone.
        (
            "oversize ClientInfo",
            vec![0x02, 0x00, 0x10, 0x00, 0x00],
            false,
        ),
        ("too short ClientInfo", raw_frame(0x02, &[1; 40]), false),
        ("SendPacket first", raw_frame(0x04, &[1; 40]), false),
    ];
    let mut failures = 0.0;
    for (name, junk, counts_as_failure) in cases {
        let mut c = upgraded_before_client_info(srv.addr).await;
        c.send_raw(&junk).await;
        let rest = read_until_closed(&mut c.stream).await;
        assert!(rest.is_empty(), "{name}: got {rest:?}");
        if counts_as_failure {
            failures += 1.0;
        }
        assert_eq!(gauge(&srv, "derp_handshake_failures"), failures, "{name}");
        assert_eq!(gauge(&srv, "derp_current_connections"), 2.0, "{name}");
    }
    pair_still_works(&mut a, &mut b, "after handshake garbage").await;
    srv.stop().await;
}

/// A ClientInfo "from" a low-order key, sealed under the all-zero shared secret that any
/// party can compute, must not register the key: the connection is closed without a word,
/// the refusal is counted, and packets addressed to the key are not delivered to anyone.
#[tokio::test]
async fn low_order_client_keys_are_refused_and_receive_nothing() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let points = derp_testkit::low_order_points();
    for (i, point) in points.iter().enumerate() {
        let key = PublicKey::from_bytes(*point);
        let forger = SecretKey::generate(&mut rand::rngs::OsRng);
        assert_eq!(forger.shared_secret(&key), [0; 32]);
        let mut c = upgraded_before_client_info(srv.addr).await;
        let sealed = forger.seal_to(&key, &[i as u8; 24], br#"{"version":2}"#);
        c.send(ClientToRelay::ClientInfo {
            key,
            sealed: sealed.into(),
        })
        .await;
        // No ServerInfo, nothing at all: just the close.
        let rest = read_until_closed(&mut c.stream).await;
        assert!(rest.is_empty(), "{point:02x?}: got {rest:?}");

        // Packets to the key find no one, and no one else receives them.
        a.send_packet(key, b"for the forger").await;
        assert!(a.barrier().await.is_empty(), "{point:02x?}");
        assert!(b.barrier().await.is_empty(), "{point:02x?}");
    }
    let n = points.len() as f64;
    assert_eq!(gauge(&srv, "derp_handshake_failures"), n);
    assert_eq!(
        srv.metric(
            "derp_connection_errors",
            &[("class", "peer_misbehaved"), ("reason", "low_order_key")]
        ),
        n
    );
    assert_eq!(dropped(&srv, "unknown_dest", "other"), n);
    assert_eq!(gauge(&srv, "derp_packets_sent"), 0.0);
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    assert_eq!(gauge(&srv, "derp_clients_local"), 2.0);
    pair_still_works(&mut a, &mut b, "after low-order keys").await;
    srv.stop().await;
}

#[tokio::test]
async fn malformed_frames_after_the_handshake_close_only_the_sender() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut packet_31 = vec![0u8; 31];
    packet_31.copy_from_slice(&b.key.as_bytes()[..31]);
    let cases: [(&str, Vec<u8>); 8] = [
        // Headers alone: the length must be refused before any body is awaited.
        ("SendPacket of 4 GiB", vec![0x04, 0xff, 0xff, 0xff, 0xff]),
        ("SendPacket of 1 MiB", vec![0x04, 0x00, 0x10, 0x00, 0x00]),
        (
            "SendPacket one byte over the maximum",
            [0x04u8, 0x00, 0x01, 0x00, 0x21].to_vec(),
        ),
        ("SendPacket shorter than a key", raw_frame(0x04, &packet_31)),
        ("NotePreferred of length 2", raw_frame(0x07, &[1, 1])),
        ("Ping of length 2000", raw_frame(0x12, &[1; 2000])),
        ("Ping of length 7", raw_frame(0x12, &[1; 7])),
        ("ClosePeer of length 31", raw_frame(0x11, &[1; 31])),
    ];
    for (name, frame) in cases {
        let mut m = RawClient::connect(srv.addr).await;
        m.send_raw(&frame).await;
        m.expect_closed().await;
        srv.eventually("offender unregistered", |s| {
            gauge(s, "derp_current_connections") == 2.0
        })
        .await;
        assert!(b.barrier().await.is_empty(), "{name}");
        pair_still_works(&mut a, &mut b, name).await;
    }
    // Nothing was relayed on the offenders' behalf.
    assert_eq!(gauge(&srv, "derp_packets_received"), 2.0 * 8.0);
    // Each ended on its connection's own steady-state task, which still counts how.
    srv.eventually("every offender counted", |s| {
        s.metric(
            "derp_connection_errors",
            &[("class", "peer_misbehaved"), ("reason", "malformed_frame")],
        ) == 8.0
    })
    .await;

    // The largest ping allowed is answered with its first eight bytes.
    let mut m = RawClient::connect(srv.addr).await;
    let mut big_ping = vec![0xabu8; 1000];
    big_ping[..8].copy_from_slice(b"8 bytes!");
    m.send_raw(&raw_frame(0x12, &big_ping)).await;
    assert_eq!(m.recv().await, RelayToClient::Pong(*b"8 bytes!"));
    srv.stop().await;
}

#[tokio::test]
async fn truncated_frame_then_eof_delivers_nothing() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut m = RawClient::connect(srv.addr).await;

    // A SendPacket to B announcing 100 packet bytes, of which only 50 arrive before EOF.
    let mut frame = raw_frame(0x04, &[]);
    frame[1..5].copy_from_slice(&(32u32 + 100).to_be_bytes());
    frame.extend_from_slice(b.key.as_bytes());
    frame.extend_from_slice(&[9; 50]);
    m.send_raw(&frame).await;
    m.stream.shutdown().await.expect("shutdown");
    m.expect_closed().await;
    srv.eventually("truncating client unregistered", |s| {
        gauge(s, "derp_current_connections") == 2.0
    })
    .await;
    assert!(b.barrier().await.is_empty());
    assert_eq!(gauge(&srv, "derp_packets_received"), 0.0);
    pair_still_works(&mut a, &mut b, "after truncation").await;
    srv.stop().await;
}

#[tokio::test]
async fn websocket_protocol_errors_close_only_that_connection() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    let req = format!(
        "GET /derp HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: derp\r\n\r\n",
        srv.addr
    );
    s.write_all(req.as_bytes()).await.expect("write");
    // An unmasked client frame breaks RFC 6455 §5.1.
    s.write_all(&[0x82, 0x03, 1, 2, 3]).await.expect("write");
    let reply = read_until_closed(&mut s).await;
    assert!(reply.starts_with(b"HTTP/1.1 101 "));
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    pair_still_works(&mut a, &mut b, "after websocket garbage").await;
    srv.stop().await;
}

#[tokio::test]
async fn client_that_never_reads_is_dropped_without_hurting_others() {
    let srv = TestServer::start(ServerConfig {
        write_timeout: Some(Duration::from_millis(300)),
        ..config()
    })
    .await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let mut victim = RawClient::connect_on(
        socket.connect(srv.addr).await.expect("connect"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .await;
    let victim_key = victim.key;

    // Three flooders write 60 KiB packets at the victim as fast as they can, until the
    // server gives up on it.
    let metrics = srv.server.metrics().clone();
    let mut flooders = JoinSet::new();
    for _ in 0..3 {
        let mut f = RawClient::connect(srv.addr).await;
        let metrics = metrics.clone();
        flooders.spawn(async move {
            let big = vec![0x77u8; 60 * 1024];
            let deadline = tokio::time::Instant::now() + STEP;
            let mut sent = 0u64;
            while metrics.write_timeouts.get() == 0 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "victim never cut off"
                );
                for _ in 0..16 {
                    f.send_packet(victim_key, &big).await;
                }
                sent += 16;
            }
            // Still connected and served.
            assert!(f.barrier().await.is_empty());
            (sent, f)
        });
    }
    // Meanwhile A and B keep talking.
    let mut round = 0u32;
    let deadline = tokio::time::Instant::now() + STEP;
    while metrics.write_timeouts.get() == 0 {
        pair_still_works(&mut a, &mut b, &format!("round {round}")).await;
        round += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "victim never cut off"
        );
    }
    let mut flooded = 0;
    // Kept connected until the end, so the gauge below counts them.
    let mut flooder_clients = Vec::new();
    while let Some(done) = flooders.join_next().await {
        let (sent, f) = done.expect("flooder");
        flooded += sent;
        flooder_clients.push(f);
    }
    srv.eventually("victim unregistered", |s| {
        gauge(s, "derp_current_connections") == 5.0
    })
    .await;
    assert_eq!(gauge(&srv, "derp_sclient_write_timeouts"), 1.0);
    victim.expect_closed().await;

    // Everything not written was dropped and counted under one reason or another.
    let expected = flooded as f64 + 2.0 * f64::from(round);
    let accounted = |s: &TestServer| {
        let drops: f64 = [
            "queue_head",
            "queue_tail",
            "write_error",
            "gone_disconnected",
            "unknown_dest",
        ]
        .iter()
        .map(|r| dropped(s, r, "other"))
        .sum();
        gauge(s, "derp_packets_sent") + drops
    };
    srv.eventually("every packet written or counted as dropped", |s| {
        accounted(s) == expected
    })
    .await;
    assert!(dropped(&srv, "write_error", "other") >= 1.0);
    pair_still_works(&mut a, &mut b, "after the victim left").await;
    srv.stop().await;
}

/// On the paused clock, which the deadline reads: the cut-off comes exactly at the deadline
/// in the clock's time, never before, however slow the machine.
#[tokio::test(start_paused = true)]
async fn slowloris_heads_are_cut_off_by_the_handshake_timeout() {
    let timeout = Duration::from_millis(300);
    let srv = TestServer::start(ServerConfig {
        handshake_timeout: timeout,
        ..config()
    })
    .await;

    // Half a request head, then silence.
    let started = tokio::time::Instant::now();
    let mut head = TcpStream::connect(srv.addr).await.expect("connect");
    head.write_all(b"GET /derp HTTP/1.1\r\nHost: slow\r\nUpgrade: DE")
        .await
        .expect("write");
    // A complete upgrade, then no ClientInfo.
    let mut silent = upgraded_before_client_info(srv.addr).await;

    // Ordinary clients are served meanwhile.
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    pair_still_works(&mut a, &mut b, "during slowloris").await;

    assert!(read_until_closed(&mut head).await.is_empty());
    assert!(read_until_closed(&mut silent.stream).await.is_empty());
    assert!(
        started.elapsed() >= timeout,
        "cut off after {:?} of the clock",
        started.elapsed()
    );
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);
    pair_still_works(&mut a, &mut b, "after slowloris").await;
    srv.stop().await;
}

#[tokio::test]
async fn many_half_open_connections_do_not_block_a_full_session() {
    let srv = TestServer::start(ServerConfig {
        handshake_timeout: Duration::from_secs(2),
        ..config()
    })
    .await;
    let mut half_open = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(srv.addr).await.expect("connect");
        match i % 3 {
            // Connected and silent.
            0 => {}
            // Part of a request head.
            1 => s
                .write_all(b"GET /derp HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write"),
            // A complete upgrade and no ClientInfo.
            _ => s
                .write_all(b"GET /derp HTTP/1.1\r\nHost: x\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\r\n")
                .await
                .expect("write"),
        }
        half_open.push(s);
    }

    // A full session completes while all of them hang.
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    for i in 0..20 {
        pair_still_works(&mut a, &mut b, &format!("session {i}")).await;
    }
    assert_eq!(gauge(&srv, "derp_current_connections"), 2.0);

    // And the server lets go of every one of them on its own.
    let mut closers = JoinSet::new();
    for mut s in half_open {
        closers.spawn(async move {
            read_until_closed(&mut s).await;
        });
    }
    while let Some(r) = closers.join_next().await {
        r.expect("half-open connection closed");
    }
    pair_still_works(&mut a, &mut b, "after the half-open ones").await;
    srv.stop().await;
}

#[tokio::test]
async fn ping_flood_is_answered_without_queueing_pongs() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let mut m = RawClient::connect(srv.addr).await;
    let mut flood = Vec::new();
    for i in 0..10_000u32 {
        let mut data = [0u8; 8];
        data[4..].copy_from_slice(&i.to_be_bytes());
        flood.extend_from_slice(&raw_frame(0x12, &data));
    }
    m.send_raw(&flood).await;
    // One pong slot: pings that arrive while a pong is pending are ignored, so the pongs
    // that come back are a subset of the pings, in order, and at most one per ping. A
    // closing ping may be ignored the same way, so it is repeated after each pong.
    let tag = [0xff; 8];
    m.send(ClientToRelay::Ping(tag)).await;
    let mut tags_sent = 1.0;
    let mut last: Option<u32> = None;
    loop {
        match m.recv().await {
            RelayToClient::Pong(data) if data == tag => break,
            RelayToClient::Pong(data) => {
                let i = u32::from_be_bytes([data[4], data[5], data[6], data[7]]);
                assert!(
                    i < 10_000 && last.is_none_or(|l| i > l),
                    "pong {i} after {last:?}"
                );
                last = Some(i);
                m.send(ClientToRelay::Ping(tag)).await;
                tags_sent += 1.0;
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    assert!(last.is_some(), "no pong for the flood at all");
    srv.eventually("every ping counted", |s| {
        gauge(s, "derp_got_ping") == 10_000.0 + tags_sent
    })
    .await;
    pair_still_works(&mut a, &mut b, "after the ping flood").await;
    srv.stop().await;
}

/// A writer blocked on a client that does not read must still notice shutdown when no write
/// timeout is set, or shutdown never returns.
#[tokio::test]
async fn shutdown_finishes_with_a_stuck_receiver_and_no_write_timeout() {
    let srv = TestServer::start(ServerConfig {
        write_timeout: None,
        ..config()
    })
    .await;
    let mut sender = RawClient::connect(srv.addr).await;
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stuck = RawClient::connect_on(
        socket.connect(srv.addr).await.expect("connect"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .await;
    let big = vec![1u8; 60 * 1024];
    // Enough to fill the socket buffers both ways and leave the writer blocked.
    let deadline = tokio::time::Instant::now() + STEP;
    while dropped(&srv, "queue_head", "other") == 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "queue never filled");
        sender.send_packet(stuck.key, &big).await;
        sender.expect_quiet().await;
    }
    tokio::time::timeout(STEP, srv.stop())
        .await
        .expect("shutdown hangs on a writer blocked on a client that does not read");
    drop(stuck);
}

/// Clients that keep connecting and leaving (with the same key or a new one, politely or by
/// dropping the socket, sometimes two at once with one key) leave nothing behind: gauges
/// return to the two stable clients, every packet they sent was delivered, and the stable
/// pair never noticed.
#[tokio::test]
async fn churn_leaves_no_state_behind() {
    let srv = TestServer::start_default().await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let a_key = a.key;
    const CHURNERS: u64 = 20;
    const ROUNDS: u64 = 8;
    let mut tasks = JoinSet::new();
    for i in 0..CHURNERS {
        let addr = srv.addr;
        tasks.spawn(async move {
            let own = SecretKey::generate(&mut rand::rngs::OsRng);
            for round in 0..ROUNDS {
                let secret = if round % 3 == 2 {
                    SecretKey::generate(&mut rand::rngs::OsRng)
                } else {
                    own.clone()
                };
                let mut c = RawClient::connect_with(addr, secret.clone()).await;
                // Every fourth round, a second connection with the same key.
                let mut dup = if (i + round) % 4 == 0 {
                    Some(RawClient::connect_with(addr, secret).await)
                } else {
                    None
                };
                c.send_packet(a_key, format!("{i}/{round}").as_bytes())
                    .await;
                // Handled before leaving, so nothing sent is in flight when the socket goes.
                c.barrier().await;
                if let Some(d) = dup.as_mut() {
                    d.barrier().await;
                }
                if round % 2 == 0 {
                    c.stream.shutdown().await.expect("shutdown");
                }
                drop((c, dup));
            }
        });
    }
    let mut got = 0;
    while got < CHURNERS * ROUNDS {
        match a.recv().await {
            RelayToClient::RecvPacket { .. } => got += 1,
            RelayToClient::PeerGone { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("churner");
    }
    srv.eventually("the churners gone", |s| {
        gauge(s, "derp_current_connections") == 2.0
            && gauge(s, "derp_clients_local") == 2.0
            && gauge(s, "derp_current_dup_client_keys") == 0.0
            && gauge(s, "derp_current_dup_client_conns") == 0.0
    })
    .await;
    assert_eq!(
        gauge(&srv, "derp_packets_received"),
        (CHURNERS * ROUNDS) as f64
    );
    assert_eq!(gauge(&srv, "derp_packets_sent"), (CHURNERS * ROUNDS) as f64);
    // What A still has queued is PeerGone for the churners it heard from.
    for frame in a.barrier().await {
        assert!(matches!(frame, RelayToClient::PeerGone { .. }), "{frame:?}");
    }
    pair_still_works(&mut a, &mut b, "after the churn").await;
    srv.stop().await;
}
