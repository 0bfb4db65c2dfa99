//! How much the relay takes: the per-client receive rate, the accept rate, the cap on open
//! connections, and the unproven-connection budget of the plain listener.
//!
//! The limits' arithmetic is unit-tested on injected or paused clocks in derp-server
//! (`ratelimit`, `listen`); these tests check that the relay applies them. Where a count
//! depends on time, the test runs on tokio's paused clock, which the limiters read: it moves
//! only while nothing can run, so what a limit lets through by a given instant is the
//! limit's doing alone, however fast or slow the machine. What the limits cost and what a
//! client sees of them in real time is measured by `scripts/bench-limits`.

use std::time::Duration;

use bytes::Bytes;
use derp_proto::{ClientInfo, ClientToRelay, MeshKey, PublicKey, SecretKey};
use derp_server::{AcceptRate, ConnLimits, MIN_RATE_BURST, RateLimit, ServerConfig};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::harness::{
    RawClient, STEP, TestServer, connect_from, flood_source, plain_info, read_until_closed,
};

fn new_key() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

fn mesh_key() -> MeshKey {
    "3c".repeat(32).parse().expect("mesh key")
}

/// Proves a pair of ordinary clients still relays.
async fn pair_works(a: &mut RawClient, b: &mut RawClient, tag: &str) {
    a.send_packet(b.key, tag.as_bytes()).await;
    assert_eq!(
        b.recv_packet().await,
        (a.key, tag.as_bytes().to_vec()),
        "{tag}"
    );
}

/// Bytes of a relayed frame carrying a payload of `n` bytes (header, key, payload): what
/// the limit counts on the way in and what the receiver reads on the way out.
fn frame_bytes(n: usize) -> u64 {
    (5 + 32 + n) as u64
}

/// The ratelimit module's quantum: what one refill lets through.
const QUANTUM: u64 = 16 * 1024;
const LIMIT: u64 = 1_000_000;
const PAYLOAD: usize = 1000;

/// On the paused clock, the relay reads a limited client by the bucket's schedule: by any
/// instant, the burst plus the rate times the time since its first batch, less at most a
/// quantum. A mesh peer forwarding far more than any burst beside it never waits.
#[tokio::test(start_paused = true)]
async fn a_limited_client_is_read_at_its_rate_and_an_exempt_mesh_peer_never_waits() {
    let srv = TestServer::start(ServerConfig {
        rate_limit: Some(RateLimit::new(LIMIT, 0)),
        mesh_key: Some(mesh_key()),
        // The relay runs on this test's single thread, so a receiver's writer only runs
        // between the sender's batches; deep queues keep the ordinary queue overflow (which
        // has nothing to do with the limit) away from the limited flow.
        send_queue_depth: 256,
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let waited = || srv.metric("derp_rate_limit_per_client_waited", &[]);
    let mut m = RawClient::try_connect(
        srv.addr,
        new_key(),
        ClientInfo {
            mesh_key: Some(mesh_key()),
            ..plain_info()
        },
    )
    .await
    .expect("mesh peer");

    // 8 MB forwarded by the mesh peer, to a key nobody has: the relay reads every frame (and
    // drops it), and a limited reader would have had to wait more than 100 times over.
    const MESH_PACKETS: usize = 8000;
    let mut out = bytes::BytesMut::new();
    for _ in 0..MESH_PACKETS {
        ClientToRelay::ForwardPacket {
            src: PublicKey::from_bytes([9; 32]),
            dst: PublicKey::from_bytes([8; 32]),
            packet: Bytes::from(vec![1u8; PAYLOAD]),
        }
        .encode(&mut out);
    }
    m.send_raw(&out).await;
    m.barrier().await;
    assert_eq!(waited(), 0.0, "the exempt mesh peer waited for the limit");

    // A sends numbered packets to B as fast as TCP lets it.
    let a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let b_key = b.key;
    let mut a_stream = a.stream;
    let sender = tokio::spawn(async move {
        let mut seq = 0u64;
        loop {
            let mut frames = bytes::BytesMut::new();
            for _ in 0..16 {
                let mut payload = vec![0u8; PAYLOAD];
                payload[..8].copy_from_slice(&seq.to_be_bytes());
                seq += 1;
                ClientToRelay::SendPacket {
                    dst: b_key,
                    packet: Bytes::from(payload),
                }
                .encode(&mut frames);
            }
            if a_stream.write_all(&frames).await.is_err() {
                return;
            }
        }
    });
    // B counts what arrives before two seconds of the clock have passed since the first
    // packet, checking that nothing of the limited flow is lost or reordered.
    let window = Duration::from_secs(2);
    let (_, first) = b.recv_packet().await;
    assert_eq!(u64::from_be_bytes(first[..8].try_into().expect("seq")), 0);
    let start = Instant::now();
    let mut received = frame_bytes(PAYLOAD);
    let mut expected = 1u64;
    loop {
        let (_, p) = b.recv_packet().await;
        let seq = u64::from_be_bytes(p[..8].try_into().expect("seq"));
        assert_eq!(seq, expected, "a packet of the limited flow was lost");
        expected += 1;
        if Instant::now() >= start + window {
            break;
        }
        received += frame_bytes(PAYLOAD);
    }
    sender.abort();
    let promised = MIN_RATE_BURST + LIMIT * window.as_secs();
    let frame = frame_bytes(PAYLOAD);
    assert!(
        received + QUANTUM + frame >= promised && received <= promised + frame,
        "{received} bytes read in {window:?} of the clock; the limit promises {promised}"
    );
    assert!(waited() > 0.0, "the limited client never waited");
    assert_eq!(
        srv.metric("derp_rate_limit_per_client_bytes_per_second", &[]),
        LIMIT as f64
    );
    srv.stop().await;
}

/// Sends `n` bytes of packets to `dst` and waits until the relay has read them all.
async fn send_bulk(c: &mut RawClient, dst: PublicKey, n: usize) {
    let mut out = bytes::BytesMut::new();
    for _ in 0..n / PAYLOAD {
        ClientToRelay::SendPacket {
            dst,
            packet: Bytes::from(vec![0u8; PAYLOAD]),
        }
        .encode(&mut out);
    }
    c.send_raw(&out).await;
    c.barrier().await;
}

/// On the paused clock, so that 300 kB is always more than the bucket refills while it is
/// read, however slowly.
#[tokio::test(start_paused = true)]
async fn a_new_limit_reaches_existing_connections_and_duplicates() {
    let srv = TestServer::start(ServerConfig {
        rate_limit: Some(RateLimit::OFF),
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let waited = || srv.metric("derp_rate_limit_per_client_waited", &[]);
    let key = new_key();
    let mut a = RawClient::connect_with(srv.addr, key.clone()).await;
    let mut dup = RawClient::connect_with(srv.addr, key).await;
    let nobody = PublicKey::from_bytes([7; 32]);
    send_bulk(&mut a, nobody, 300_000).await;
    assert_eq!(waited(), 0.0, "no limit yet");

    srv.server.set_rate_limit(RateLimit::new(2_000_000, 0));
    assert_eq!(
        srv.metric("derp_rate_limit_per_client_burst_bytes", &[]),
        MIN_RATE_BURST as f64
    );
    send_bulk(&mut a, nobody, 300_000).await;
    let after_a = waited();
    assert!(
        after_a > 0.0,
        "the existing connection did not get the new limit"
    );
    send_bulk(&mut dup, nobody, 300_000).await;
    assert!(
        waited() > after_a,
        "the duplicate did not get the new limit"
    );

    srv.server.set_rate_limit(RateLimit::OFF);
    let before = waited();
    send_bulk(&mut dup, nobody, 300_000).await;
    assert_eq!(waited(), before, "turned off, yet it waited");
    srv.stop().await;
}

/// Whether the server refused `s` at accept: it closes the connection (EOF or reset) without
/// a word, where an admitted one answers a probe request.
async fn refused(mut s: TcpStream) -> bool {
    let probe = b"GET /derp/probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if s.write_all(probe).await.is_err() {
        return true;
    }
    let answer = read_until_closed(&mut s).await;
    if answer.is_empty() {
        return true;
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 200 "),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    false
}

/// On the paused clock, which the accept limiter reads: no token comes back during the flood
/// unless the clock moves, and one second of it brings two back.
#[tokio::test(start_paused = true)]
async fn a_connection_flood_past_the_accept_limit_is_refused_and_counted() {
    let srv = TestServer::start(ServerConfig {
        limits: ConnLimits {
            accept_rate: Some(AcceptRate {
                per_sec: 2.0,
                burst: 12,
            }),
            ..ConnLimits::default()
        },
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let started = Instant::now();
    let mut flood = Vec::new();
    for i in 0..60 {
        flood.push(connect_from(srv.addr, flood_source(0, i)).await);
    }
    srv.eventually("the flood is handled", |s| {
        s.metric("derp_accept_refused", &[("reason", "rate_limit")])
            + s.metric("derp_open_connections", &[])
            >= 62.0
    })
    .await;
    let refused_count = srv.metric("derp_accept_refused", &[("reason", "rate_limit")]);
    let open = srv.metric("derp_open_connections", &[]);
    assert_eq!(
        refused_count + open,
        62.0,
        "each of the 62 connections is either open or refused, once"
    );
    // Ten tokens were left after a and b, and two more per second of the clock: the first
    // ten of the flood are let in whatever the clock did, and at most two more per second.
    let most_admitted = 10.0 + (2.0 * started.elapsed().as_secs_f64()).floor();
    assert!(
        (60.0 - most_admitted..=50.0).contains(&refused_count),
        "{refused_count} refused of 60 after {:?} of the clock",
        started.elapsed()
    );
    // Each refused one was closed without a word; each admitted one answers.
    let mut closed = 0.0;
    for s in flood {
        if refused(s).await {
            closed += 1.0;
        }
    }
    assert_eq!(
        closed, refused_count,
        "refused connections that were not closed"
    );
    // Existing clients carry on, and the listener keeps accepting once tokens come back.
    pair_works(&mut a, &mut b, "during the flood").await;
    tokio::time::advance(Duration::from_secs(1)).await;
    let mut c = RawClient::try_upgrade(srv.addr)
        .await
        .expect("the listener accepts again once tokens come back");
    c.handshake(plain_info()).await;
    pair_works(&mut a, &mut c, "a new client after the flood").await;
    srv.stop().await;
}

#[tokio::test]
async fn max_connections_holds() {
    let srv = TestServer::start(ServerConfig {
        limits: ConnLimits {
            max_connections: Some(4),
            ..ConnLimits::default()
        },
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    let idle1 = TcpStream::connect(srv.addr).await.expect("connect");
    srv.eventually("three open", |s| {
        s.metric("derp_open_connections", &[]) == 3.0
    })
    .await;
    let idle2 = TcpStream::connect(srv.addr).await.expect("connect");
    srv.eventually("four open", |s| {
        s.metric("derp_open_connections", &[]) == 4.0
    })
    .await;
    // At the cap a new connection takes the place of the oldest that has not shown it is a
    // client: stalled handshakes cannot hold the places against good clients.
    let mut c = RawClient::connect(srv.addr).await;
    assert!(
        refused(idle1).await,
        "the oldest unproven connection stayed"
    );
    assert_eq!(
        srv.metric("derp_unproven_evicted", &[("cause", "max_connections")]),
        1.0
    );
    let mut d = RawClient::connect(srv.addr).await;
    assert!(refused(idle2).await, "the other unproven connection stayed");
    srv.eventually("four clients", |s| {
        s.metric("derp_open_connections", &[]) == 4.0
    })
    .await;
    // Every place held by a client: a fifth connection is refused.
    let fifth = TcpStream::connect(srv.addr).await.expect("connect");
    assert!(refused(fifth).await, "a fifth connection was let in");
    assert_eq!(
        srv.metric("derp_accept_refused", &[("reason", "max_connections")]),
        1.0
    );
    pair_works(&mut a, &mut b, "at the cap").await;
    pair_works(&mut c, &mut d, "in the evicted ones' places").await;
    // A slot that frees up is usable again.
    drop(b);
    srv.eventually("a closed client frees its slot", |s| {
        s.metric("derp_open_connections", &[]) == 3.0
    })
    .await;
    let mut e = RawClient::connect(srv.addr).await;
    pair_works(&mut e, &mut a, "in the freed slot").await;
    srv.stop().await;
}

/// A good client gets in during each round of a flood of stalled request heads, while the
/// flood provably still holds the whole budget: its admission evicts one of the round's
/// connections. The flood's deadline is far beyond the test's, so the flood only ends when
/// the test ends it; how long the good client takes is measured by `scripts/bench-limits`.
#[tokio::test]
async fn stalled_request_heads_from_many_sources_never_lock_out_a_good_client() {
    const BUDGET: usize = 64;
    const FLOOD: usize = 150;
    let srv = TestServer::start(ServerConfig {
        limits: ConnLimits {
            max_unproven: BUDGET,
            ..ConnLimits::default()
        },
        handshake_timeout: Duration::from_secs(3600),
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let evicted = || srv.metric_or_zero("derp_unproven_evicted", &[("cause", "budget")]);
    let mut stalled = Vec::new();
    let mut good = Vec::new();
    for round in 0..5u8 {
        let mut flood = Vec::new();
        for i in 0..FLOOD {
            let mut s = connect_from(srv.addr, flood_source(round, i)).await;
            // Alternately silent, half a request head, and an upgrade without ClientInfo.
            let bytes: &[u8] = match i % 3 {
                0 => b"",
                1 => b"GET /derp HTTP/1.1\r\nHost: x\r\n",
                _ => {
                    b"GET /derp HTTP/1.1\r\nHost: x\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\r\n"
                }
            };
            s.write_all(bytes).await.expect("write");
            flood.push(s);
        }
        // The oldest of the round were evicted to make room for the newest, which also
        // shows the server has admitted the whole round.
        for s in &mut flood[..FLOOD - BUDGET] {
            read_until_closed(s).await;
        }
        let before = evicted();
        let c = tokio::time::timeout(STEP, RawClient::connect(srv.addr))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the good client was locked out"));
        assert_eq!(
            evicted(),
            before + 1.0,
            "round {round}: the good client got in, but not past a full budget"
        );
        good.push(c);
        stalled.extend(flood);
    }
    // Every stalled connection was evicted but the BUDGET - 1 of the last round still held
    // (the last good client took one place, then left the budget when it was admitted);
    // the good clients themselves never were.
    assert_eq!(evicted(), (5 * FLOOD - (BUDGET - 1)) as f64);
    let (first, rest) = good.split_at_mut(1);
    pair_works(&mut first[0], &mut rest[3], "after the floods").await;
    // Closed by the test, the stalled connections end at once instead of at their deadline.
    drop(stalled);
    srv.stop().await;
}

#[tokio::test]
async fn quic_datagrams_count_against_the_receive_rate_limit() {
    let relay = crate::quic::QuicRelay::start_with(
        ServerConfig {
            // Slow enough that 300 kB always outruns the refill: while it is sent, however
            // slowly, at most a few kB come back.
            rate_limit: Some(RateLimit::new(10_000, 0)),
            ..ServerConfig::new(new_key())
        },
        derp_server::QuicConfig::default(),
    )
    .await;
    let (mut a, _) = relay.quic_client().await;
    let (_b, kb) = relay.quic_client().await;
    relay
        .eventually("both registered", |r| r.server.local_clients() == 2)
        .await;
    // 300 kB of datagrams against a burst of 64 kB: the limit must make the reader wait.
    for i in 0..300u32 {
        a.send_packet(kb, [i as u8; PAYLOAD])
            .await
            .expect("send datagram");
    }
    relay
        .eventually("the limit waited", |r| {
            r.metric("derp_rate_limit_per_client_waited", &[]) > 0.0
        })
        .await;
    assert!(relay.metric("derp_quic_datagrams_received", &[]) > 0.0);
    relay.stop().await;
}
