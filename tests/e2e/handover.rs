//! Handing live connections from one relay to another: the relay's half of an upgrade in
//! place, here between two servers in one process (derpd's own tests run it between two
//! processes). The clients are byte-level ones: any frame they do not expect, an EOF or a
//! reset fails the test.

use std::os::fd::OwnedFd;
use std::time::Duration;

use derp_proto::{PublicKey, RelayToClient, SecretKey};
use derp_server::{Frozen, HandedConn, ServerConfig, decode_conns, encode_conns};
use tokio::net::TcpSocket;

use crate::harness::{RawClient, TestServer};

/// Deep queues, so that a receiver that does not read loses nothing to the queue limit
/// while the test holds it back; no write deadline for the same reason.
fn config() -> ServerConfig {
    ServerConfig {
        send_queue_depth: 4096,
        write_timeout: None,
        ..ServerConfig::new(derp_testkit::server_secret())
    }
}

fn packet(seq: u32, len: usize) -> Vec<u8> {
    let mut p = vec![(seq % 251) as u8; len.max(4)];
    p[..4].copy_from_slice(&seq.to_be_bytes());
    p
}

/// Reads packets `from..to` from `src`, in order, each once, and nothing else.
async fn expect_packets(c: &mut RawClient, src: PublicKey, from: u32, to: u32, len: usize) {
    for seq in from..to {
        let (got_src, data) = c.recv_packet().await;
        assert_eq!(got_src, src, "packet {seq} from the wrong source");
        assert_eq!(
            data,
            packet(seq, len),
            "packet {seq} out of order, lost or damaged"
        );
    }
}

async fn send_packets(c: &mut RawClient, dst: PublicKey, from: u32, to: u32, len: usize) {
    for seq in from..to {
        c.send_packet(dst, &packet(seq, len)).await;
    }
}

/// A client whose socket takes little, so that the server's writes to it stall.
async fn connect_small_rcvbuf(srv: &TestServer) -> RawClient {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let stream = socket.connect(srv.addr).await.expect("connect");
    RawClient::connect_on(stream, SecretKey::generate(&mut rand::rngs::OsRng)).await
}

/// Moves `conns` across as two processes would: their state as bytes, their sockets as new
/// descriptors (the sender's stay lent until it commits or resumes).
fn carry(conns: &[HandedConn]) -> Vec<HandedConn> {
    let fds: Vec<OwnedFd> = conns
        .iter()
        .map(|c| c.fd().try_clone_to_owned().expect("dup"))
        .collect();
    let bytes = encode_conns(conns);
    decode_conns(&bytes, fds).expect("decodes")
}

const PAIRS: usize = 40;
const SMALL: usize = 200;
const BIG: usize = 60 * 1024;
const BIG_COUNT: u32 = 300;

struct Fleet {
    senders: Vec<RawClient>,
    receivers: Vec<RawClient>,
    /// Sent a stream of large packets it does not read until the end.
    stuck: RawClient,
    stuck_sender: RawClient,
}

impl Fleet {
    async fn connect(srv: &TestServer) -> Self {
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..PAIRS {
            senders.push(RawClient::connect(srv.addr).await);
            receivers.push(RawClient::connect(srv.addr).await);
        }
        Self {
            senders,
            receivers,
            stuck: connect_small_rcvbuf(srv).await,
            stuck_sender: RawClient::connect(srv.addr).await,
        }
    }

    fn len(&self) -> usize {
        2 * PAIRS + 2
    }

    /// Every sender sends packets `from..to`; receivers read up to `read_to` of them.
    async fn round(&mut self, from: u32, to: u32, read_from: u32, read_to: u32) {
        for (s, r) in self.senders.iter_mut().zip(&mut self.receivers) {
            send_packets(s, r.key, from, to, SMALL).await;
            expect_packets(r, s.key, read_from, read_to, SMALL).await;
        }
    }

    /// Leaves packets in every state and freezes `srv`: read and handled, queued, in the
    /// receivers' sockets, for the stuck receiver a batch its writer could not finish, and,
    /// sent once frozen, in the senders' sockets.
    async fn frozen_with_traffic(&mut self, srv: &TestServer) -> Frozen {
        self.round(0, 100, 0, 50).await;
        let stuck_key = self.stuck.key;
        send_packets(&mut self.stuck_sender, stuck_key, 0, BIG_COUNT, BIG).await;
        srv.eventually("every packet read", |s| {
            s.metric("derp_packets_received", &[]) as u32 >= 100 * PAIRS as u32 + BIG_COUNT
        })
        .await;
        let frozen = srv
            .server
            .freeze_for_handover(Duration::from_secs(10))
            .await;
        assert_eq!(frozen.handed(), self.len(), "every connection can go");
        assert_eq!(frozen.staying(), 0);
        for (s, r) in self.senders.iter_mut().zip(&self.receivers) {
            send_packets(s, r.key, 100, 150, SMALL).await;
        }
        frozen
    }

    /// Everything left arrives, in order, once.
    async fn finish(&mut self, read_from: u32, sent: u32) {
        for (s, r) in self.senders.iter_mut().zip(&mut self.receivers) {
            expect_packets(r, s.key, read_from, sent, SMALL).await;
            r.expect_quiet().await;
        }
        let src = self.stuck_sender.key;
        expect_packets(&mut self.stuck, src, 0, BIG_COUNT, BIG).await;
        self.stuck.expect_quiet().await;
    }
}

fn dropped(srv: &TestServer) -> f64 {
    srv.registry
        .gather()
        .iter()
        .filter(|f| f.name() == "derp_packets_dropped")
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_handed_to_another_server_lose_nothing_and_notice_nothing() {
    let old = TestServer::start(config()).await;
    let new = TestServer::start(config()).await;
    let mut fleet = Fleet::connect(&old).await;
    let frozen = fleet.frozen_with_traffic(&old).await;
    let adopted = new.server.adopt(carry(frozen.conns())).expect("adopts");
    assert_eq!(adopted.len(), fleet.len());
    frozen.commit();
    let holds = adopted.start();
    assert_eq!(holds.len(), fleet.len());

    fleet.round(150, 250, 50, 100).await;
    fleet.finish(100, 250).await;
    assert_eq!(
        old.metric("derp_current_connections", &[]),
        0.0,
        "the old server let go of every connection"
    );
    assert_eq!(
        new.metric("derp_current_connections", &[]),
        fleet.len() as f64
    );
    assert_eq!(dropped(&old), 0.0, "the old server dropped packets");
    assert_eq!(dropped(&new), 0.0, "the new server dropped packets");

    // The new server knows every client: a newcomer reaches one, and one leaving is told to
    // those that heard from it.
    let mut newcomer = RawClient::connect(new.addr).await;
    let receiver = &mut fleet.receivers[0];
    newcomer.send_packet(receiver.key, b"hello").await;
    assert_eq!(
        receiver.recv_packet().await,
        (newcomer.key, b"hello".to_vec())
    );
    let sender = fleet.senders.remove(0);
    let gone = sender.key;
    drop(sender);
    assert_eq!(
        fleet.receivers[0].recv().await,
        RelayToClient::PeerGone {
            peer: gone,
            reason: derp_proto::PeerGoneReason::Disconnected
        },
        "a PeerGone watch made before the handover holds after it"
    );
    old.stop().await;
    new.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_called_off_leaves_every_connection_where_it_was() {
    let old = TestServer::start(config()).await;
    let new = TestServer::start(config()).await;
    let mut fleet = Fleet::connect(&old).await;
    let frozen = fleet.frozen_with_traffic(&old).await;
    // The successor took them in and then refused: it lets go without a word.
    let adopted = new.server.adopt(carry(frozen.conns())).expect("adopts");
    drop(adopted);
    assert_eq!(new.metric("derp_current_connections", &[]), 0.0);
    frozen.resume();
    fleet.round(150, 250, 50, 100).await;
    fleet.finish(100, 250).await;
    assert_eq!(
        old.metric("derp_current_connections", &[]),
        fleet.len() as f64
    );
    assert_eq!(dropped(&old), 0.0);
    old.stop().await;
    new.stop().await;
}
