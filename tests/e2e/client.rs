//! derp-client against the real relay.

use derp_client::{Client, ClientConfig, ReceivedFrame, TransportKind};
use derp_proto::{PeerGoneReason, SecretKey};

use crate::harness::{STEP, TestServer};

/// Fails the test unless `fut` completes within [`STEP`].
async fn within<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(STEP, fut)
        .await
        .expect("nothing arrived in time")
}

/// A client config with a fresh key, and that key's public half.
fn config(srv: &TestServer, transport: TransportKind) -> (ClientConfig, derp_proto::PublicKey) {
    let url = format!("http://{}/derp", srv.addr);
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let public = secret.public_key();
    let config = ClientConfig::new(&url, secret)
        .expect("valid url")
        .with_transport(transport);
    (config, public)
}

async fn next_packet(c: &mut Client) -> (derp_proto::PublicKey, Vec<u8>) {
    loop {
        match within(c.recv()).await.expect("recv") {
            ReceivedFrame::RecvPacket { src, packet } => return (src, packet.to_vec()),
            ReceivedFrame::KeepAlive => continue,
            other => panic!("expected a packet, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn client_library_relays_pings_and_sees_peers_leave() {
    for transport in [TransportKind::Upgrade, TransportKind::WebSocket] {
        let srv = TestServer::start_default().await;
        let (ca, a_pub) = config(&srv, transport);
        let (cb, b_pub) = config(&srv, transport);
        let mut a = Client::connect(&ca).await.expect("a");
        let mut b = Client::connect(&cb).await.expect("b");
        assert_eq!(a.server_key(), srv.server.public_key());
        assert_eq!(b.server_key(), srv.server.public_key());
        assert_eq!(a.server_info().version, 2);
        a.send_packet(b_pub, b"hello over the relay")
            .await
            .expect("send");
        assert_eq!(
            next_packet(&mut b).await,
            (a_pub, b"hello over the relay".to_vec())
        );
        b.send_packet(a_pub, vec![9u8; 1400]).await.expect("send");
        assert_eq!(next_packet(&mut a).await, (b_pub, vec![9u8; 1400]));

        within(a.ping()).await.expect("ping");

        a.note_preferred(true).await.expect("note preferred");
        srv.eventually("home connection counted", |s| {
            s.metric("derp_current_home_connections", &[]) == 1.0
        })
        .await;

        b.close().await.expect("close");
        match a.recv().await.expect("recv") {
            ReceivedFrame::PeerGone { peer, reason } => {
                assert_eq!((peer, reason), (b_pub, PeerGoneReason::Disconnected));
            }
            other => panic!("expected PeerGone, got {other:?}"),
        }
        srv.stop().await;
    }
}

#[tokio::test]
async fn split_halves_stream_packets_both_ways() {
    let srv = TestServer::start_default().await;
    let (ca, a_pub) = config(&srv, TransportKind::Upgrade);
    let (cb, b_pub) = config(&srv, TransportKind::Upgrade);
    let a = Client::connect(&ca).await.expect("a");
    let mut b = Client::connect(&cb).await.expect("b");
    let (mut reader, mut writer) = a.split();
    // Windows of 16 stay within the relay's queue depth (32), so nothing may be dropped.
    const WINDOW: usize = 16;
    const ROUNDS: usize = 30;
    let (window_tx, mut window_rx) = tokio::sync::mpsc::channel::<()>(1);
    let sender = tokio::spawn(async move {
        for round in 0..ROUNDS {
            for i in 0..WINDOW {
                let n = (round * WINDOW + i) as u32;
                writer.queue_packet(b_pub, n.to_be_bytes()).expect("queue");
            }
            writer.flush().await.expect("flush");
            // Wait until the echoes of this window are back before sending the next.
            if window_rx.recv().await.is_none() {
                break;
            }
        }
        writer
    });
    let echo = tokio::spawn(async move {
        for _ in 0..ROUNDS * WINDOW {
            let (src, packet) = next_packet(&mut b).await;
            assert_eq!(src, a_pub);
            b.send_packet(a_pub, packet).await.expect("echo");
        }
        b
    });
    let mut seen = 0;
    while seen < ROUNDS * WINDOW {
        match within(reader.recv()).await.expect("recv") {
            ReceivedFrame::RecvPacket { src, packet } => {
                assert_eq!(src, b_pub);
                assert_eq!(packet.as_ref(), (seen as u32).to_be_bytes());
                seen += 1;
                if seen % WINDOW == 0 {
                    let _ = window_tx.send(()).await;
                }
            }
            ReceivedFrame::KeepAlive => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let _writer = sender.await.expect("sender");
    let _b = echo.await.expect("echo");
    assert_eq!(
        srv.metric(
            "derp_packets_dropped",
            &[("reason", "queue_head"), ("kind", "other")]
        ),
        0.0
    );
    srv.stop().await;
}

#[tokio::test]
async fn a_client_that_probes_first_upgrades_on_the_keep_alive_connection_and_relays() {
    let srv = TestServer::start_default().await;
    for transport in [TransportKind::Upgrade, TransportKind::WebSocket] {
        let (ca, a_pub) = config(&srv, transport);
        let (cb, b_pub) = config(&srv, TransportKind::Upgrade);
        let mut a = Client::connect(&ca.with_probe_first(true))
            .await
            .expect("a, after a probe");
        let mut b = Client::connect(&cb).await.expect("b");
        for i in 0..50u8 {
            a.send_packet(b_pub, vec![i; 1400]).await.expect("send");
            b.send_packet(a_pub, vec![i; 700]).await.expect("send");
        }
        for i in 0..50u8 {
            assert_eq!(next_packet(&mut b).await, (a_pub, vec![i; 1400]));
            assert_eq!(next_packet(&mut a).await, (b_pub, vec![i; 700]));
        }
        within(a.ping()).await.expect("ping");
    }
    srv.stop().await;
}
