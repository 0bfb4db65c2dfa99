//! Many clients at once on loopback: every packet is delivered and nothing is dropped while
//! each destination's queue stays within its bounds.

use bytes::BytesMut;
use derp_proto::{ClientToRelay, PublicKey};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tokio::task::JoinSet;

use crate::harness::{RawClient, TestServer};

/// Clients in the ring.
const CLIENTS: usize = 1000;
/// Packets each client sends to its successor; well under the queue depth of 32, so a
/// correct relay has no reason to drop any.
const PER_CLIENT: usize = 5;
/// Handshakes in flight at once.
const CONNECT_BATCH: usize = 100;
/// File descriptors kept free for the runtime, the listener and tests running alongside.
const FD_RESERVE: u64 = 256;

/// Raises this process's soft limit on open files to its hard limit, and fails with the
/// reason unless that leaves room for `CLIENTS`: each client costs two descriptors in this
/// process, its own socket and the server's end. Never runs fewer clients than it says.
fn make_room_for_the_clients() {
    let need = 2 * CLIENTS as u64 + FD_RESERVE;
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    if current.is_none_or(|soft| soft >= need) {
        return;
    }
    // An unlimited hard limit still caps the soft one at the kernel's nr_open: ask for what
    // is needed.
    let soft = maximum.unwrap_or(need);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft),
            maximum,
        },
    )
    .unwrap_or_else(|e| panic!("raising the open file limit to {soft}: {e}"));
    assert!(
        soft >= need,
        "{CLIENTS} clients need {need} open files, and the hard limit is {soft}: raise it \
         (`ulimit -Hn`, LimitNOFILE=) to run this test"
    );
}

fn payload(sender: usize, seq: usize) -> Vec<u8> {
    let mut p = format!("from {sender} #{seq} ").into_bytes();
    // Varying sizes, so frames of many lengths share the writers' batches.
    p.resize(
        p.len() + (sender * 7 + seq * 13) % 1200,
        (sender % 251) as u8,
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_clients_in_a_ring_get_every_packet() {
    make_room_for_the_clients();
    let n = CLIENTS;
    let srv = TestServer::start_default().await;

    let mut clients: Vec<Option<RawClient>> = (0..n).map(|_| None).collect();
    for start in (0..n).step_by(CONNECT_BATCH) {
        let mut batch = JoinSet::new();
        for i in start..(start + CONNECT_BATCH).min(n) {
            let addr = srv.addr;
            batch.spawn(async move { (i, RawClient::connect(addr).await) });
        }
        while let Some(done) = batch.join_next().await {
            let (i, c) = done.expect("connect");
            clients[i] = Some(c);
        }
    }
    let clients: Vec<RawClient> = clients.into_iter().map(|c| c.expect("client")).collect();
    assert_eq!(srv.metric("derp_current_connections", &[]), n as f64);
    assert_eq!(srv.server.local_clients(), n);

    let keys: Vec<PublicKey> = clients.iter().map(|c| c.key).collect();
    let mut ring = JoinSet::new();
    for (i, mut c) in clients.into_iter().enumerate() {
        let next = keys[(i + 1) % n];
        let prev_index = (i + n - 1) % n;
        let prev = keys[prev_index];
        ring.spawn(async move {
            let mut out = BytesMut::new();
            for seq in 0..PER_CLIENT {
                ClientToRelay::SendPacket {
                    dst: next,
                    packet: payload(i, seq).into(),
                }
                .encode(&mut out);
            }
            c.send_raw(&out).await;
            // One sender, one queue: its packets arrive in the order sent.
            for seq in 0..PER_CLIENT {
                let (src, got) = c.recv_packet().await;
                assert_eq!(src, prev, "client {i} packet {seq}");
                assert_eq!(got, payload(prev_index, seq), "client {i} packet {seq}");
            }
            c
        });
    }
    let mut survivors = Vec::with_capacity(n);
    while let Some(done) = ring.join_next().await {
        survivors.push(done.expect("ring member"));
    }

    let total = (n * PER_CLIENT) as f64;
    srv.eventually("every packet counted as written", |s| {
        s.metric("derp_packets_sent", &[]) == total
    })
    .await;
    assert_eq!(srv.metric("derp_packets_received", &[]), total);
    for reason in derp_server::DropReason::ALL {
        for kind in ["disco", "other"] {
            assert_eq!(
                srv.metric(
                    "derp_packets_dropped",
                    &[("reason", reason.as_str()), ("kind", kind)]
                ),
                0.0,
                "{} {kind}",
                reason.as_str()
            );
        }
    }
    // Each client is still alone on its key and still served.
    assert_eq!(srv.metric("derp_current_dup_client_keys", &[]), 0.0);
    for c in survivors.iter_mut().take(10) {
        c.expect_quiet().await;
    }

    drop(survivors);
    srv.eventually("everyone disconnected", |s| {
        s.metric("derp_current_connections", &[]) == 0.0
    })
    .await;
    srv.stop().await;
}
