//! The derpd binary serving TLS: an IP-only node in manual mode prints the pin clients need,
//! and SIGHUP puts rotated certificate files into service without a restart.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;

use derp_client::{Client, ClientConfig, rustls};
use derp_proto::SecretKey;
use support::{Node, STEP, TempDir, manual_ip_args};

/// An IP-only node in manual mode with its certificates in `certdir`; returns it and the pin
/// it printed in its DERP map node line.
fn start_ip_node(certdir: &Path) -> (Node, String) {
    let node = Node::start(&manual_ip_args(certdir.to_str().expect("utf8")));
    let map_node: serde_json::Value =
        node.wait_stdout("DERP map node", |l| serde_json::from_str(l.trim()).ok());
    let pin = map_node["CertName"].as_str().expect("CertName").to_owned();
    assert_eq!(map_node["HostName"], "127.0.0.1");
    assert_eq!(
        map_node["DERPPort"].as_u64(),
        Some(u64::from(node.addr.port()))
    );
    (node, pin)
}

fn client(addr: SocketAddr, pin: &str) -> ClientConfig {
    let port = addr.port();
    ClientConfig::new(
        &format!("https://127.0.0.1:{port}/derp"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_cert_name(pin)
    .with_connect_timeout(STEP)
}

#[tokio::test]
async fn ip_node_prints_its_pin_and_sighup_rotates_the_certificate() {
    let dir = TempDir::new("sighup");
    let (node, pin) = start_ip_node(&dir.0);
    let addr = node.addr;
    assert!(dir.0.join("127.0.0.1.crt").exists() && dir.0.join("127.0.0.1.key").exists());

    let mut old = Client::connect(&client(addr, &pin))
        .await
        .expect("pinned client");
    assert!(
        old.used_fast_start(),
        "TLS 1.3 with the meta certificate means fast start"
    );

    // Replace the pair on disk, then SIGHUP.
    let ip = "127.0.0.1".parse().expect("ip");
    let (cert_pem, key_pem) = derp_tls::generate_self_signed(ip).expect("generate");
    std::fs::write(dir.0.join("127.0.0.1.key"), &key_pem).expect("write key");
    std::fs::write(dir.0.join("127.0.0.1.crt"), &cert_pem).expect("write crt");
    let leaf = derp_tls::load_certs_pem(cert_pem.as_bytes()).expect("pem");
    let new_pin = derp_tls::cert_pin(&leaf[0]);
    node.signal("HUP");
    node.wait_message("SIGHUP: new certificate in service");

    // New connections need the new pin; the old connection is still up.
    Client::connect(&client(addr, &new_pin))
        .await
        .expect("client pinned to the new certificate");
    let err = Client::connect(&client(addr, &pin))
        .await
        .expect_err("the old pin must fail after the rotation");
    assert_eq!(
        err.certificate_error(),
        Some(&rustls::CertificateError::ApplicationVerificationFailure),
        "{err:?}"
    );
    tokio::time::timeout(STEP, old.ping())
        .await
        .expect("the old connection answers a ping")
        .expect("old connection still works");
}
