//! A mesh link settling: [`derp_mesh::Mesh::wait_settled`] returns once each link's sibling
//! clients are in the relay's forwarder table, which is what a process taking over waits
//! for before it serves; a sibling that cannot be reached is named instead.

use std::time::Duration;

use derp_proto::{MeshKey, SecretKey};
use derp_server::ServerConfig;

use crate::harness::{RawClient, STEP, TestServer};

/// Clients of the sibling: a presence flood large enough to take many reads.
const CLIENTS: usize = 300;

fn secret() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

async fn meshed_server(secret: SecretKey, key: MeshKey) -> TestServer {
    TestServer::start(ServerConfig {
        mesh_key: Some(key),
        ..ServerConfig::new(secret)
    })
    .await
}

fn start_mesh(node: &TestServer, secret: SecretKey, key: MeshKey, url: &str) -> derp_mesh::Mesh {
    derp_mesh::Mesh::start(
        &node.server,
        derp_mesh::MeshConfig::new(secret, key),
        derp_mesh::parse_mesh_with(url).expect("entry"),
        &node.registry,
    )
    .expect("mesh")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_link_has_every_client_of_its_sibling_in_the_table() {
    let key = MeshKey::from_bytes([7; 32]);
    let sibling = meshed_server(secret(), key).await;
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        clients.push(RawClient::connect(sibling.addr).await);
    }
    let (node_secret, node_url) = (secret(), format!("http://{}/derp", sibling.addr));
    let node = meshed_server(node_secret.clone(), key).await;
    let mesh = start_mesh(&node, node_secret, key, &node_url);
    let unsettled = mesh.wait_settled(STEP).await;
    assert!(unsettled.is_empty(), "{unsettled:?}");
    // At once, with no waiting: the sibling's clients, and the link's own key there.
    assert_eq!(
        node.server.metrics().clients_remote.get(),
        CLIENTS as i64 + 1
    );
    mesh.shutdown().await;
    node.stop().await;
    sibling.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_cannot_be_reached_is_named_after_the_wait() {
    let key = MeshKey::from_bytes([7; 32]);
    let node_secret = secret();
    let node = meshed_server(node_secret.clone(), key).await;
    // A port that refuses: bound, never listened on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let closed_addr = closed.local_addr().expect("addr");
    drop(closed);
    let url = format!("http://{closed_addr}/derp,http://{}/derp", node.addr);
    let mesh = start_mesh(&node, node_secret, key, &url);
    // The entry naming the node itself settles; the unreachable one does not.
    let unsettled = mesh.wait_settled(Duration::from_millis(300)).await;
    assert_eq!(unsettled, vec![format!("http://{closed_addr}/derp")]);
    mesh.shutdown().await;
    node.stop().await;
}
