//! A region of meshed derpd processes on loopback: packets cross between nodes in every
//! direction, a node killed or restarted is noticed and healed without a manual step, and
//! mesh privileges go only with the right key.

use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use derp_client::{ClientConfig, ReceivedFrame};
use derp_proto::{MeshKey, PublicKey};
use support::{
    Node, Region, STEP, TempDir, client, expect_closed, expect_gone, expect_packet, free_port,
    secret, write_mesh_key,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_meshed_nodes_carry_packets_in_every_direction() {
    let mut region = Region::start(3, &[]);
    region.wait_meshed();
    // Each node lists itself too; only the answering key tells it apart from a sibling.
    for node in &mut region.nodes {
        node.wait_message("mesh entry is this node itself");
    }
    let secrets: Vec<_> = (0..3).map(|_| secret()).collect();
    let mut clients = Vec::new();
    for (node, s) in region.nodes.iter().zip(&secrets) {
        clients.push(client(&node.url(), s.clone()).await);
    }
    region.wait_known(3);
    let keys: Vec<PublicKey> = secrets.iter().map(|s| s.public_key()).collect();
    for i in 0..3 {
        for j in 0..3 {
            if i != j {
                let payload = format!("{i} to {j}");
                clients[i]
                    .send_packet(keys[j], payload.as_bytes())
                    .await
                    .expect("send");
                expect_packet(&mut clients[j], keys[i], payload.as_bytes()).await;
            }
        }
    }
    for node in &region.nodes {
        node.wait_metric("derp_packets_forwarded_out", &[], |v| v == 2.0);
        node.wait_metric("derp_packets_forwarded_in", &[], |v| v == 2.0);
        node.wait_metric("derp_mesh_forwarded_out", &[], |v| v == 2.0);
        assert_eq!(node.metric("derp_mesh_forward_drops", &[]), Some(0.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sibling_is_noticed_and_traffic_recovers_through_another_node() {
    let mut region = Region::start(3, &[]);
    region.wait_meshed();
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut a = client(&region.nodes[0].url(), sa).await;
    let mut b = client(&region.nodes[1].url(), sb.clone()).await;
    region.wait_known(2);
    // b sends to a, so a watches b and must hear when b leaves the region.
    b.send_packet(ka, b"hello a").await.expect("send");
    expect_packet(&mut a, kb, b"hello a").await;
    a.send_packet(kb, b"hello b").await.expect("send");
    expect_packet(&mut b, ka, b"hello b").await;

    let killed = Instant::now();
    region.nodes[1].kill();
    expect_gone(&mut a, kb).await;
    let gone_after = killed.elapsed();
    region.nodes[0].wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);
    region.nodes[2].wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);

    // b's connection died with its node; it comes back on the third node, as a client
    // whose home went away does.
    let mut b = client(&region.nodes[2].url(), sb).await;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let mut n = 0u32;
    let recovered = tokio::time::timeout(STEP, async {
        loop {
            tick.tick().await;
            n += 1;
            let payload = n.to_be_bytes();
            a.send_packet(kb, payload).await.expect("send");
            let got = tokio::time::timeout(Duration::from_millis(50), b.recv()).await;
            if let Ok(Ok(ReceivedFrame::RecvPacket { src, .. })) = got
                && src == ka
            {
                return killed.elapsed();
            }
        }
    })
    .await
    .expect("delivery recovers through the third node");
    eprintln!(
        "sibling SIGKILL: PeerGone after {} ms, delivery recovered after {} ms",
        gone_after.as_millis(),
        recovered.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_goes_silent_is_dropped_by_its_pings() {
    // A stopped process keeps its sockets open and the kernel keeps acknowledging for it,
    // as a hung node or a one-way partition would: only the links' pings can tell.
    let region = Region::start(2, &["--mesh-ping-interval", "300ms"]);
    region.wait_meshed();
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut a = client(&region.nodes[0].url(), sa).await;
    let mut b = client(&region.nodes[1].url(), sb).await;
    region.wait_known(2);
    b.send_packet(ka, b"hello a").await.expect("send");
    expect_packet(&mut a, kb, b"hello a").await;

    region.nodes[1].signal("STOP");
    // Its clients leave the region for a: within two ping intervals, not the read timeout.
    expect_gone(&mut a, kb).await;
    region.nodes[0].wait_metric("derp_mesh_links_up", &[], |v| v == 0.0);

    // Resumed, it is taken back without a manual step.
    region.nodes[1].signal("CONT");
    region.wait_meshed();
    region.wait_known(2);
    a.send_packet(kb, b"hello again").await.expect("send");
    expect_packet(&mut b, ka, b"hello again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_restarts_gracefully_rejoins_and_the_region_heals() {
    let mut region = Region::start(3, &["--drain-timeout", "5s"]);
    region.wait_meshed();
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut a = client(&region.nodes[0].url(), sa).await;
    let mut b = client(&region.nodes[1].url(), sb.clone()).await;
    region.wait_known(2);
    b.send_packet(ka, b"before").await.expect("send");
    expect_packet(&mut a, kb, b"before").await;

    region.nodes[1].signal("TERM");
    // b is told to come back, and its node ends cleanly.
    support::recv_until(&mut b, "Restarting", |f| {
        matches!(f, ReceivedFrame::Restarting { .. }).then_some(())
    })
    .await;
    expect_closed(&mut b).await;
    assert!(region.nodes[1].wait_exit(STEP).success());
    // The siblings notice, and a hears that b left the region.
    expect_gone(&mut a, kb).await;
    region.nodes[0].wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);

    // Same port, same key: the siblings' links reconnect on their own.
    region.nodes[1].restart();
    region.wait_meshed();
    let mut b = client(&region.nodes[1].url(), sb).await;
    region.wait_known(2);
    a.send_packet(kb, b"after").await.expect("send");
    expect_packet(&mut b, ka, b"after").await;
    b.send_packet(ka, b"and back").await.expect("send");
    expect_packet(&mut a, kb, b"and back").await;
    region.nodes[0].wait_metric("derp_mesh_reconnects", &[], |v| v >= 1.0);
}

/// A node with a mesh key and no siblings, for the privilege tests.
fn lone_node(dir: &TempDir) -> (Node, MeshKey) {
    let key_file = dir.path("mesh.key");
    let hex = write_mesh_key(&key_file);
    let node = Node::start(&[
        "-a".into(),
        "127.0.0.1:0".into(),
        "--dev".into(),
        "--mesh-psk-file".into(),
        key_file.display().to_string(),
    ]);
    (node, hex.parse().expect("mesh key"))
}

async fn mesh_client(node: &Node, key: MeshKey) -> derp_client::Client {
    let config = ClientConfig::new(&node.url(), secret())
        .expect("config")
        .with_mesh_key(key)
        .with_can_ack_pings(false)
        .with_connect_timeout(STEP);
    derp_client::Client::connect(&config)
        .await
        .expect("mesh client connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_peer_from_a_mesh_peer_disconnects_the_client() {
    let dir = TempDir::new("closepeer");
    let (node, key) = lone_node(&dir);
    let victim_secret = secret();
    let victim_key = victim_secret.public_key();
    let mut victim = client(&node.url(), victim_secret).await;
    let mut bystander = client(&node.url(), secret()).await;

    // Without mesh privileges, ClosePeer ends the sender's own connection, not the target's.
    let mut intruder = client(&node.url(), secret()).await;
    intruder.close_peer(victim_key).await.expect("send");
    expect_closed(&mut intruder).await;
    victim.ping().await.expect("victim still connected");

    let mut mesh = mesh_client(&node, key).await;
    mesh.close_peer(victim_key).await.expect("send");
    expect_closed(&mut victim).await;
    bystander.ping().await.expect("others stay connected");
    mesh.ping().await.expect("the mesh peer stays connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_zero_mesh_key_gets_no_privileges() {
    let dir = TempDir::new("meshkey");
    let (node, key) = lone_node(&dir);
    let sink_secret = secret();
    let sink_key = sink_secret.public_key();
    let mut sink = client(&node.url(), sink_secret).await;

    let mut wrong = key.0;
    wrong[31] ^= 1;
    for bad in [MeshKey::from_bytes(wrong), MeshKey::from_bytes([0; 32])] {
        let mut c = mesh_client(&node, bad).await;
        c.watch_conns().await.expect("send");
        // No presence flood: the connection is closed instead.
        let wait = async {
            loop {
                match c.recv().await {
                    Ok(ReceivedFrame::PeerPresent { .. }) => panic!("watch granted"),
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        };
        tokio::time::timeout(STEP, wait).await.expect("closed");
        let mut c = mesh_client(&node, bad).await;
        c.forward_packet(
            PublicKey::from_bytes([9; 32]),
            sink_key,
            Bytes::from_static(b"x"),
        )
        .await
        .expect("send");
        expect_closed(&mut c).await;
    }
    // Nothing was delivered; the right key works.
    let mut good = mesh_client(&node, key).await;
    good.forward_packet(
        PublicKey::from_bytes([9; 32]),
        sink_key,
        Bytes::from_static(b"ok"),
    )
    .await
    .expect("send");
    expect_packet(&mut sink, PublicKey::from_bytes([9; 32]), b"ok").await;
    good.watch_conns().await.expect("send");
    support::recv_until(&mut good, "the presence flood", |f| match f {
        ReceivedFrame::PeerPresent { peer, .. } if *peer == sink_key => Some(()),
        _ => None,
    })
    .await;
    assert_eq!(
        node.metric("derp_connection_errors", &[("reason", "not_mesh_peer")]),
        Some(4.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_flood_through_one_sibling_does_not_stall_local_delivery() {
    let dir = TempDir::new("flood");
    let (node, key) = lone_node(&dir);
    // The flood's target reads nothing, so its queue overflows the whole time.
    let stuck_secret = secret();
    let stuck_key = stuck_secret.public_key();
    let _stuck = client(&node.url(), stuck_secret).await;
    let (sp, sq) = (secret(), secret());
    let (kp, kq) = (sp.public_key(), sq.public_key());
    let mut p = client(&node.url(), sp).await;
    let mut q = client(&node.url(), sq).await;
    let mut flood = mesh_client(&node, key).await;
    let packet = Bytes::from(vec![7u8; 1200]);
    let flooding = tokio::spawn(async move {
        // Batches of 256 packets, to a local client and to nobody, until the test ends it.
        loop {
            for i in 0..256u32 {
                let dst = if i % 2 == 0 {
                    stuck_key
                } else {
                    PublicKey::from_bytes([3; 32])
                };
                let frame = derp_proto::ClientToRelay::ForwardPacket {
                    src: PublicKey::from_bytes([4; 32]),
                    dst,
                    packet: packet.clone(),
                };
                flood.queue_frame(&frame).expect("queue");
            }
            if flood.flush().await.is_err() {
                return;
            }
        }
    });
    node.wait_metric("derp_packets_forwarded_in", &[], |v| v >= 1000.0);
    let forwarded = || {
        node.metric("derp_packets_forwarded_in", &[])
            .expect("derp_packets_forwarded_in")
    };
    // Forwarded packets counted at the start, the middle and the end of the round trips:
    // the flood kept arriving in each half, so it overlapped all of them.
    let mut counts = vec![forwarded()];
    for i in 0..200u32 {
        if i == 100 {
            counts.push(forwarded());
        }
        p.send_packet(kq, i.to_be_bytes()).await.expect("send");
        expect_packet(&mut q, kp, &i.to_be_bytes()).await;
        q.send_packet(kp, i.to_be_bytes()).await.expect("send");
        expect_packet(&mut p, kq, &i.to_be_bytes()).await;
    }
    counts.push(forwarded());
    assert!(
        !flooding.is_finished(),
        "the flood stopped before the round trips ended"
    );
    assert!(
        counts[1] > counts[0] && counts[2] > counts[1],
        "forwarded packets did not keep arriving during the round trips: {counts:?}"
    );
    flooding.abort();
}

/// Certificates for an https mesh, made for the test: a private CA and one leaf per name.
struct Pki {
    ca_pem: String,
    ca_der: derp_client::rustls::pki_types::CertificateDer<'static>,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "derpd mesh test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("ca key");
        let cert = params.self_signed(&key).expect("ca cert");
        Self {
            ca_pem: cert.pem(),
            ca_der: cert.der().clone(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// Writes `<dir>/<name>.crt` and `.key`, as manual certificate mode reads them.
    fn issue(&self, name: &str, dir: &std::path::Path) {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params");
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).expect("write crt");
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("write key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_mesh_trusts_a_private_ca_from_the_flag_or_ssl_cert_file() {
    let dir = TempDir::new("httpsmesh");
    let pki = Pki::new();
    let ca_file = dir.path("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).expect("write ca");
    let mesh_key = dir.path("mesh.key");
    write_mesh_key(&mesh_key);
    let names = ["node-a.test", "node-b.test", "node-c.test"];
    let ports: Vec<u16> = names.iter().map(|_| free_port()).collect();
    // host:port/dialhost entries: the name is the URL's and the certificate's, the dial
    // goes to loopback. Each node dials its own entry too, and drops it when its own key
    // answers.
    let mesh_with = names
        .iter()
        .zip(&ports)
        .map(|(n, p)| format!("{n}:{p}/127.0.0.1"))
        .collect::<Vec<_>>()
        .join(",");
    let start = |i: usize, trust: &[&str], env: &[(String, String)]| {
        let certdir = dir.path(names[i]);
        std::fs::create_dir_all(&certdir).expect("certdir");
        pki.issue(names[i], &certdir);
        let mut args: Vec<String> = vec![
            "-a".into(),
            format!("127.0.0.1:{}", ports[i]),
            "-c".into(),
            dir.path(&format!("{i}.key")).display().to_string(),
            "--certmode".into(),
            "manual".into(),
            "--certdir".into(),
            certdir.display().to_string(),
            "--hostname".into(),
            names[i].into(),
            "--http-port".into(),
            "-1".into(),
            "--metrics-addr".into(),
            "127.0.0.1:0".into(),
            "--mesh-psk-file".into(),
            mesh_key.display().to_string(),
            "--mesh-with".into(),
            mesh_with.clone(),
        ];
        args.extend(trust.iter().map(|s| s.to_string()));
        let mut env = env.to_vec();
        env.push(("SSL_CERT_DIR".to_owned(), String::new()));
        Node::start_with_env(&args, &env)
    };
    let empty = dir.path("empty.pem");
    std::fs::write(&empty, "").expect("write");
    let no_system = ("SSL_CERT_FILE".to_owned(), empty.display().to_string());
    // a trusts the CA by flag, b through SSL_CERT_FILE, c not at all.
    let a = start(
        0,
        &["--mesh-ca-file", &ca_file.display().to_string()],
        std::slice::from_ref(&no_system),
    );
    let b = start(
        1,
        &[],
        &[("SSL_CERT_FILE".to_owned(), ca_file.display().to_string())],
    );
    let c = start(2, &[], &[no_system]);
    a.wait_metric("derp_mesh_links_up", &[], |v| v == 2.0);
    b.wait_metric("derp_mesh_links_up", &[], |v| v == 2.0);
    // c cannot verify its siblings' certificates: it keeps retrying, its links stay down.
    c.wait_metric(
        "derp_mesh_reconnects",
        &[("sibling", &format!("{}:{}/127.0.0.1", names[0], ports[0]))],
        |v| v >= 2.0,
    );
    assert_eq!(c.metric("derp_mesh_links_up", &[]), Some(0.0));

    let tls_client = |i: usize, s: derp_proto::SecretKey| {
        ClientConfig::new(&format!("https://{}:{}/derp", names[i], ports[i]), s)
            .expect("config")
            .with_extra_root(pki.ca_der.clone())
            .with_dial_addr(([127, 0, 0, 1], ports[i]).into())
            .with_connect_timeout(STEP)
    };
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut ca = derp_client::Client::connect(&tls_client(0, sa))
        .await
        .expect("a");
    let mut cb = derp_client::Client::connect(&tls_client(1, sb))
        .await
        .expect("b");
    // Seen from a and b: both clients and the two nodes whose links are up (c's never
    // come up, so its key is nowhere).
    a.wait_metric("derp_clients_total", &[], |v| v == 4.0);
    b.wait_metric("derp_clients_total", &[], |v| v == 4.0);
    ca.send_packet(kb, b"over tls").await.expect("send");
    expect_packet(&mut cb, ka, b"over tls").await;
    cb.send_packet(ka, b"and back").await.expect("send");
    expect_packet(&mut ca, kb, b"and back").await;
}

/// A region written as derper's docs write one: every node has the same --hostname
/// (`localhost`, each on its own port) and the same list naming every node. Each dials every
/// entry, its own included, and tells itself apart by the key that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_named_alike_dial_every_entry_and_know_themselves_by_key() {
    let dir = TempDir::new("samename");
    let pki = Pki::new();
    pki.issue("localhost", &dir.0);
    let ca_file = dir.path("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).expect("write ca");
    let mesh_key = dir.path("mesh.key");
    write_mesh_key(&mesh_key);
    let ports = [free_port(), free_port()];
    let mesh_with = format!("localhost:{},localhost:{}", ports[0], ports[1]);
    let nodes: Vec<Node> = (0..2)
        .map(|i| {
            // derper's own syntax, one dash and "=".
            Node::start(&[
                format!("-a=localhost:{}", ports[i]),
                format!("-c={}", dir.path(&format!("{i}.key")).display()),
                "-hostname=localhost".to_owned(),
                "-certmode=manual".to_owned(),
                format!("-certdir={}", dir.0.display()),
                "-http-port=-1".to_owned(),
                "-quic-port=-1".to_owned(),
                "--metrics-addr".to_owned(),
                "127.0.0.1:0".to_owned(),
                format!("-mesh-psk-file={}", mesh_key.display()),
                format!("-mesh-with={mesh_with}"),
                format!("--mesh-ca-file={}", ca_file.display()),
                // The sibling's pings are the clock the no-redial check below runs by.
                "--mesh-ping-interval=500ms".to_owned(),
            ])
        })
        .collect();
    let pings = |node: &Node| node.metric("derp_got_ping", &[]).unwrap_or(0.0);
    let mut pinged = Vec::new();
    for node in &nodes {
        node.wait_message("mesh entry is this node itself");
        node.wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);
        node.wait_metric("derp_mesh_siblings", &[], |v| v == 1.0);
        // The connection to itself was closed (derper leaves it open): only the sibling's
        // link is connected here.
        node.wait_metric("derp_current_connections", &[], |v| v == 1.0);
        pinged.push(pings(node));
    }
    // A redial would come within the back-off's first ceiling (100 ms), and later ones
    // within 200, 400, 800 and 1600 ms more: checked after each of seven sibling pings
    // (500 ms apart), some 3.5 s in all.
    for round in 1..=7 {
        for (i, node) in nodes.iter().enumerate() {
            let until = pinged[i] + f64::from(round);
            node.wait_metric("derp_got_ping", &[], |v| v >= until);
            let own = format!("localhost:{}", ports[i]);
            assert_eq!(
                node.metric("derp_mesh_reconnects", &[("sibling", &own)])
                    .unwrap_or(0.0),
                0.0,
                "round {round}: the entry for this node itself was redialed"
            );
            let noticed = node
                .log_text()
                .matches("mesh entry is this node itself")
                .count();
            assert_eq!(noticed, 1, "round {round}: node {i} dialed itself again");
        }
    }

    let urls = ports.map(|p| format!("https://localhost:{p}/derp"));
    relay_across_two_tls_nodes(&pki, &urls, &nodes, b"across the region").await;
}

/// Connects a client to each of two meshed TLS nodes (at `urls`, trusting `pki`'s CA), waits
/// until both nodes know the four keys (the clients' and the nodes'), and relays `payload`
/// from the first client to the second and back.
async fn relay_across_two_tls_nodes(pki: &Pki, urls: &[String; 2], nodes: &[Node], payload: &[u8]) {
    let tls_client = |i: usize, s: derp_proto::SecretKey| {
        ClientConfig::new(&urls[i], s)
            .expect("config")
            .with_extra_root(pki.ca_der.clone())
            .with_connect_timeout(STEP)
    };
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut a = derp_client::Client::connect(&tls_client(0, sa))
        .await
        .expect("a");
    let mut b = derp_client::Client::connect(&tls_client(1, sb))
        .await
        .expect("b");
    for node in nodes {
        node.wait_metric("derp_clients_total", &[], |v| v == 4.0);
    }
    a.send_packet(kb, payload).await.expect("send");
    expect_packet(&mut b, ka, payload).await;
    b.send_packet(ka, payload).await.expect("send back");
    expect_packet(&mut a, kb, payload).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_by_two_siblings_fails_over_without_peer_gone() {
    let mut region = Region::start(3, &[]);
    region.wait_meshed();
    let (sa, sk) = (secret(), secret());
    let (ka, kk) = (sa.public_key(), sk.public_key());
    let mut a = client(&region.nodes[0].url(), sa).await;
    // The same key on two siblings: the first claim is used, the second kept in reserve.
    let mut k_on_b = client(&region.nodes[1].url(), sk.clone()).await;
    region.nodes[0].wait_metric("derp_clients_total", &[], |v| v == 5.0);
    // A's own key already reaches A through both siblings (its links to them are clients
    // there): that is one multi-forwarder before k's second claim.
    let created = |n: &Node| n.metric("derp_multiforwarder_created", &[]).unwrap_or(0.0);
    let deleted = |n: &Node| n.metric("derp_multiforwarder_deleted", &[]).unwrap_or(0.0);
    let (created_before, deleted_before) = (created(&region.nodes[0]), deleted(&region.nodes[0]));
    let mut k_on_c = client(&region.nodes[2].url(), sk).await;
    region.nodes[0].wait_metric("derp_multiforwarder_created", &[], |v| {
        v == created_before + 1.0
    });
    a.send_packet(kk, b"first").await.expect("send");
    expect_packet(&mut k_on_b, ka, b"first").await;
    k_on_b.send_packet(ka, b"hi").await.expect("send");
    expect_packet(&mut a, kk, b"hi").await;

    region.nodes[1].kill();
    // a keeps sending until the other sibling's claim takes over.
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tokio::time::timeout(STEP, async {
        loop {
            tick.tick().await;
            a.send_packet(kk, b"second").await.expect("send");
            let got = tokio::time::timeout(Duration::from_millis(50), k_on_c.recv()).await;
            if let Ok(Ok(ReceivedFrame::RecvPacket { src, .. })) = got
                && src == ka
            {
                return;
            }
        }
    })
    .await
    .expect("the remaining claim carries the key");
    // Both of them lost B's claim: A's own key and k.
    region.nodes[0].wait_metric("derp_multiforwarder_deleted", &[], |v| {
        v == deleted_before + 2.0
    });
    // The key never left the region, so a was not told it did. A ping is a barrier: the
    // pong is written after anything queued for a before it, and the frames read while
    // waiting for it are kept for recv, which hands them out without waiting.
    a.ping().await.expect("ping");
    while let Ok(frame) = tokio::time::timeout(Duration::ZERO, a.recv()).await {
        let frame = frame.expect("a's connection is fine");
        assert!(
            !matches!(frame, ReceivedFrame::PeerGone { peer, .. } if peer == kk),
            "a was told k left, but k is still on C"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_links_can_run_over_quic() {
    let dir = TempDir::new("quicmesh");
    let pki = Pki::new();
    let ca_file = dir.path("ca.pem");
    std::fs::write(&ca_file, &pki.ca_pem).expect("write ca");
    let mesh_key = dir.path("mesh.key");
    write_mesh_key(&mesh_key);
    let tcp_ports = [free_port(), free_port()];
    let quic_ports = [free_udp_port(), free_udp_port()];
    // Every node lists both by QUIC URL; its own entry is recognised by the key answering.
    let mesh_with = quic_ports
        .iter()
        .map(|p| format!("quic://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    let nodes: Vec<Node> = (0..2)
        .map(|i| {
            let certdir = dir.path(&format!("certs{i}"));
            std::fs::create_dir_all(&certdir).expect("certdir");
            pki.issue("127.0.0.1", &certdir);
            let args: Vec<String> = vec![
                "-a".into(),
                format!("127.0.0.1:{}", tcp_ports[i]),
                "-c".into(),
                dir.path(&format!("{i}.key")).display().to_string(),
                "--certmode".into(),
                "manual".into(),
                "--certdir".into(),
                certdir.display().to_string(),
                "--hostname".into(),
                "127.0.0.1".into(),
                "--http-port".into(),
                "-1".into(),
                "--quic-port".into(),
                quic_ports[i].to_string(),
                "--metrics-addr".into(),
                "127.0.0.1:0".into(),
                "--mesh-psk-file".into(),
                mesh_key.display().to_string(),
                "--mesh-ca-file".into(),
                ca_file.display().to_string(),
                "--mesh-with".into(),
                mesh_with.clone(),
            ];
            Node::start(&args)
        })
        .collect();
    for node in &nodes {
        node.wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);
        // The sibling's link arrived over QUIC.
        node.wait_metric(
            "derp_current_connections_by_transport",
            &[("transport", "quic")],
            |v| v == 1.0,
        );
    }
    let urls = tcp_ports.map(|p| format!("https://127.0.0.1:{p}/derp"));
    relay_across_two_tls_nodes(&pki, &urls, &nodes, b"across a quic link").await;
    for node in &nodes {
        node.wait_metric("derp_packets_forwarded_in", &[], |v| v == 1.0);
    }
}

/// A UDP port nothing is bound to right now.
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("udp port")
        .port()
}
