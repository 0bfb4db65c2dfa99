//! Upgrading in place with the clients' connections: on SIGUSR2 the old derpd hands its
//! plain TCP connections, with everything behind them, to the new binary, and their clients
//! notice nothing. The clients are byte-level ones, which fail on any frame they do not
//! expect (a Restarting frame, a second ServerKey), on EOF and on a reset, and check that
//! every packet arrives once and in order.

use derp_proto::PublicKey;
use derp_testkit::raw::RawClient;

use crate::support::{Launch, Node, STEP, TempDir};
use crate::upgrade::{Successor, install, replace, start_launched, started_successor};

/// Connections in each test: the floor for a live relay's upgrade.
const PAIRS: usize = 500;

fn packet(seq: u32) -> Vec<u8> {
    let mut p = vec![(seq % 251) as u8; 120];
    p[..4].copy_from_slice(&seq.to_be_bytes());
    p
}

struct Fleet(Vec<(RawClient, RawClient)>);

impl Fleet {
    async fn connect(node: &Node) -> Self {
        let mut pairs = Vec::with_capacity(PAIRS);
        for _ in 0..PAIRS {
            pairs.push((
                RawClient::connect(node.addr).await,
                RawClient::connect(node.addr).await,
            ));
        }
        Self(pairs)
    }

    async fn send(&mut self, from: u32, to: u32) {
        for (s, r) in &mut self.0 {
            for seq in from..to {
                s.send_packet(r.key, &packet(seq)).await;
            }
        }
    }

    async fn expect(&mut self, from: u32, to: u32) {
        for (s, r) in &mut self.0 {
            expect_in_order(r, s.key, from, to).await;
        }
    }
}

/// Packets `from..to` from `src`, each once and in order, and nothing else but keepalives.
async fn expect_in_order(c: &mut RawClient, src: PublicKey, from: u32, to: u32) {
    for seq in from..to {
        let (got, data) = c.recv_packet().await;
        assert_eq!(got, src, "packet {seq} from another source");
        assert_eq!(
            data,
            packet(seq),
            "packet {seq} lost, repeated or reordered"
        );
    }
}

/// The new process's line saying it took the connections over: (count, p50, p99 hold).
fn took_over(node: &Node) -> (u64, String, String) {
    node.wait_log("the connections taken over", |v| {
        let f = &v["fields"];
        f["message"]
            .as_str()?
            .starts_with("took over the client connections")
            .then(|| {
                Some((
                    f["conns"].as_u64()?,
                    f["hold_p50"].as_str()?.to_owned(),
                    f["hold_p99"].as_str()?.to_owned(),
                ))
            })?
    })
}

/// Descriptors each process may hold beyond one per connection: listeners, the runtime's,
/// the upgrade channel and a batch's memfd, with room to spare. An old process that kept a
/// second descriptor per connection through the handover would run out.
const SPARE_FDS: usize = 200;

/// A node of 1,000 connections carrying traffic, upgraded: SIGUSR2 with a new file at its
/// path, and a round sent while the connections cross, racing the freeze (each packet is
/// read by the old process before its sender stops, or waits in the socket for the new
/// one). `envs` go to both processes, which may each hold one descriptor per connection
/// and [`SPARE_FDS`] more. The directory is returned to outlive the test.
async fn upgrading(name: &str, envs: &[(String, String)]) -> (TempDir, Node, Fleet, Successor) {
    let dir = TempDir::new(name);
    let exe = install(&dir);
    let launch = Launch {
        setup: format!("ulimit -n {}", 2 * PAIRS + SPARE_FDS),
        ..Launch::program(&exe.display().to_string())
    };
    let node = start_launched(&launch, &dir, &[], envs);
    let mut fleet = Fleet::connect(&node).await;
    fleet.send(0, 20).await;
    fleet.expect(0, 10).await;
    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    fleet.send(20, 40).await;
    (dir, node, fleet, successor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_hands_a_thousand_live_connections_over_without_a_client_noticing() {
    let (_dir, mut node, mut fleet, successor) = upgrading("handover", &[]).await;
    let (conns, p50, p99) = took_over(&node);
    assert_eq!(conns, 2 * PAIRS as u64, "{}", node.log_text());
    println!("held p50 {p50}, p99 {p99} for {conns} connections");
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    fleet.send(40, 60).await;
    fleet.expect(10, 60).await;
    // Nothing was dropped, and the new process serves every one of them.
    assert_eq!(node.metric("derp_packets_dropped", &[]), Some(0.0));
    assert_eq!(
        node.metric("derp_current_connections", &[]),
        Some(2.0 * PAIRS as f64)
    );
    // A newcomer reaches a handed client through the new process.
    let mut newcomer = RawClient::connect(node.addr).await;
    let receiver = &mut fleet.0[0].1;
    newcomer.send_packet(receiver.key, b"hi").await;
    assert_eq!(receiver.recv_packet().await, (newcomer.key, b"hi".to_vec()));
    for (_, r) in &mut fleet.0 {
        r.expect_quiet().await;
    }
    successor.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_that_refuses_the_connections_leaves_them_with_the_old_one() {
    let refuse = [("DERPD_TEST_REFUSE_CONNECTIONS".to_owned(), "1".to_owned())];
    let (_dir, mut node, mut fleet, successor) = upgrading("handover-refused", &refuse).await;
    let error = node.wait_log("the upgrade's failure", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("upgrade failed; this process keeps every listener")
            .then(|| v["fields"]["error"].as_str().map(str::to_owned))?
    });
    assert!(
        error.contains("refused the connections") && error.contains("REFUSE_CONNECTIONS"),
        "{error}"
    );
    successor.wait_ended();
    assert!(node.is_running(), "{}", node.log_text());
    fleet.send(40, 60).await;
    fleet.expect(10, 60).await;
    assert_eq!(node.metric("derp_packets_dropped", &[]), Some(0.0));
    for (_, r) in &mut fleet.0 {
        r.expect_quiet().await;
    }
}

/// A TLS client of `node` (an IP node in manual mode, whose certificate `pin` names),
/// speaking raw DERP or WebSocket.
async fn tls_client(
    node: &Node,
    pin: &str,
    transport: derp_client::TransportKind,
) -> (derp_client::Client, PublicKey) {
    let secret = crate::support::secret();
    let key = secret.public_key();
    let config = derp_client::ClientConfig::new(
        &format!("https://127.0.0.1:{}/derp", node.addr.port()),
        secret,
    )
    .expect("config")
    .with_cert_name(pin)
    .with_transport(transport)
    .with_connect_timeout(STEP);
    let client = derp_client::Client::connect(&config)
        .await
        .expect("client connects");
    (client, key)
}

/// A packet from `from` to `to`.
async fn relays_one(
    from: &mut (derp_client::Client, PublicKey),
    to: &mut (derp_client::Client, PublicKey),
) {
    let payload: [u8; 16] = rand::random();
    from.0
        .send_packet(to.1, payload.to_vec())
        .await
        .expect("send");
    crate::support::expect_packet(&mut to.0, from.1, &payload).await;
}

/// A packet each way between two clients.
async fn relays(
    a: &mut (derp_client::Client, PublicKey),
    b: &mut (derp_client::Client, PublicKey),
) {
    relays_one(a, b).await;
    relays_one(b, a).await;
}

type TlsPair = (
    (derp_client::Client, PublicKey),
    (derp_client::Client, PublicKey),
);

/// Sends packets `from..to` from each pair's first client to its second.
async fn send_tls(pairs: &mut [TlsPair], from: u32, to: u32) {
    for (s, r) in pairs.iter_mut() {
        for seq in from..to {
            s.0.send_packet(r.1, packet(seq)).await.expect("send");
        }
    }
}

/// Packets `from..to` at each pair's second client, each once and in order, and nothing
/// else but keepalives: a Restarting frame, a PeerGone, an EOF or a reset fails.
async fn expect_tls(pairs: &mut [TlsPair], from: u32, to: u32) {
    use derp_client::ReceivedFrame;
    for (s, r) in pairs.iter_mut() {
        for seq in from..to {
            let frame = tokio::time::timeout(STEP, async {
                loop {
                    match r.0.recv().await {
                        Ok(ReceivedFrame::KeepAlive) => {}
                        Ok(ReceivedFrame::RecvPacket { src, packet: p }) => {
                            return (src, p.to_vec());
                        }
                        Ok(other) => panic!("{other:?} instead of packet {seq}"),
                        Err(e) => panic!("waiting for packet {seq}: {e}"),
                    }
                }
            })
            .await
            .unwrap_or_else(|_| panic!("packet {seq} never came"));
            assert_eq!(frame, (s.1, packet(seq)), "packet {seq} lost or reordered");
        }
    }
}

/// TLS pairs per framing (raw DERP and WebSocket): 1,000 connections in all.
const TLS_PAIRS: usize = PAIRS / 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_tls_connections_raw_and_websocket_go_across_with_their_record_layer() {
    use derp_client::TransportKind::{Upgrade, WebSocket};
    let dir = TempDir::new("handover-tls");
    let exe = install(&dir);
    let certdir = dir.path("certs").display().to_string();
    let key = dir.path("derp.key").display().to_string();
    let mut args = crate::support::manual_ip_args(&certdir);
    args.extend(["-c", &key, "--metrics-addr", "127.0.0.1:0"]);
    let launch = Launch {
        setup: format!("ulimit -n {}", 4 * TLS_PAIRS + SPARE_FDS),
        ..Launch::program(&exe.display().to_string())
    };
    let mut node = Node::start_with(&launch, &args, &[]);
    let map_node: serde_json::Value =
        node.wait_stdout("DERP map node", |l| serde_json::from_str(l.trim()).ok());
    let pin = map_node["CertName"].as_str().expect("CertName").to_owned();
    let mut pairs: Vec<TlsPair> = Vec::with_capacity(2 * TLS_PAIRS);
    for kind in [Upgrade, WebSocket] {
        for _ in 0..TLS_PAIRS {
            pairs.push((
                tls_client(&node, &pin, kind).await,
                tls_client(&node, &pin, kind).await,
            ));
        }
    }
    send_tls(&mut pairs, 0, 10).await;
    expect_tls(&mut pairs, 0, 5).await;

    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    // Racing the freeze, as in the plain test.
    send_tls(&mut pairs, 10, 20).await;
    let (conns, _, _) = took_over(&node);
    assert_eq!(conns, 4 * TLS_PAIRS as u64, "{}", node.log_text());
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    // The same TLS sessions, under the same keys, now served by the new process.
    send_tls(&mut pairs, 20, 30).await;
    expect_tls(&mut pairs, 5, 30).await;
    assert_eq!(node.metric("derp_packets_dropped", &[]), Some(0.0));
    // A WebSocket client reaches a raw one, and back.
    let (raw, ws) = pairs.split_at_mut(TLS_PAIRS);
    relays(&mut raw[0].0, &mut ws[0].1).await;
    successor.stop();
}

/// Cross-node pairs in the mesh test: one client on each node.
const MESH_PAIRS: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meshed_node_upgrades_without_its_clients_or_its_siblings_clients_noticing() {
    let dir = TempDir::new("handover-mesh");
    let exe = install(&dir);
    let program = exe.display().to_string();
    let mut region = crate::support::Region::start_in(dir, 2, &[], |i| {
        if i == 0 {
            Launch::program(&program)
        } else {
            Launch::plain()
        }
    });
    region.wait_meshed();
    // Each pair: a client of the node that upgrades, and one of its sibling.
    let mut pairs = Vec::with_capacity(MESH_PAIRS);
    for _ in 0..MESH_PAIRS {
        pairs.push((
            RawClient::connect(region.nodes[0].addr).await,
            RawClient::connect(region.nodes[1].addr).await,
        ));
    }
    region.wait_known(2 * MESH_PAIRS);
    let mut there = Fleet(pairs);
    there.send(0, 10).await;
    there.expect(0, 10).await;
    let mut back = Fleet(there.0.into_iter().map(|(a, b)| (b, a)).collect());
    back.send(0, 10).await;
    back.expect(0, 10).await;

    replace(&exe, None);
    region.nodes[0].signal("USR2");
    let successor = started_successor(&region.nodes[0]);
    // Racing the freeze: the handed clients' packets reach the sibling's clients through
    // the new process's own link, from the first one it reads.
    back.send(10, 20).await;
    let mut there = Fleet(back.0.into_iter().map(|(b, a)| (a, b)).collect());
    there.send(10, 20).await;
    let node = &mut region.nodes[0];
    // The new process brought its link up, and the sibling's clients are in its table,
    // before it said it serves.
    node.wait_message("mesh links up, with the siblings' clients; taking over");
    let (conns, _, _) = took_over(node);
    assert_eq!(
        conns,
        MESH_PAIRS as u64 + 1,
        "the clients and the sibling's link"
    );
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    there.send(20, 30).await;
    there.expect(10, 30).await;
    let mut back = Fleet(there.0.into_iter().map(|(a, b)| (b, a)).collect());
    back.send(20, 30).await;
    back.expect(10, 30).await;
    for node in &region.nodes {
        assert_eq!(node.metric("derp_packets_dropped", &[]), Some(0.0));
        assert_eq!(node.metric("derp_mesh_forward_drops", &[]), Some(0.0));
    }
    for (_, r) in &mut back.0 {
        r.expect_quiet().await;
    }
    successor.stop();
}
