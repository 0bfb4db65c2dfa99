//! ACME against a local Pebble server, beyond what `tls.rs` covers: accounts bound with
//! External Account Binding, and certificates for the node's IP address on demand.

use std::net::{IpAddr, SocketAddr};

use derp_client::ClientConfig;
use derp_proto::SecretKey;
use derp_tls::{
    AcmeManager, CertOrigin, ChallengeKind, ExternalAccount, IpCertManager, TlsOptions,
};
use tokio::net::TcpListener;

use crate::harness::STEP;
use crate::tls::{
    HOST, Pebble, TempDir, TlsRelay, connect_pair, free_port, require_pebble, within,
};

/// The key ID and HMAC key Pebble is configured with (base64url, unpadded, as CAs hand
/// them out).
const EAB_KID: &str = "kid-1";
const EAB_KEY: &str = "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W";

#[tokio::test]
async fn an_account_bound_by_eab_gets_a_certificate_and_a_wrong_key_is_refused() {
    require_pebble();
    let dir = TempDir::new("acme-eab");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let tls_port = listener.local_addr().expect("addr").port();
    let pebble = Pebble::start_with(
        &dir.0,
        free_port(),
        tls_port,
        serde_json::json!({
            "externalAccountBindingRequired": true,
            "externalAccountMACKeys": { EAB_KID: EAB_KEY },
        }),
    )
    .await;
    let relay = TlsRelay::start_with(TlsOptions::new(HOST), Some(listener)).await;

    // Without a binding, and with the wrong key, the CA refuses the account, and the error
    // says which flags to look at.
    let unbound = pebble.acme_config(&dir.0.join("unbound"), ChallengeKind::TlsAlpn01);
    let manager = AcmeManager::new(relay.front.clone(), unbound).expect("manager");
    let err = within("refusal", manager.obtain(ChallengeKind::TlsAlpn01))
        .await
        .expect_err("no binding")
        .to_string();
    assert!(err.contains("registering an account at"), "{err}");
    assert!(err.contains("externalAccountRequired"), "{err}");

    let mut wrong = pebble.acme_config(&dir.0.join("wrong"), ChallengeKind::TlsAlpn01);
    wrong.external_account =
        Some(ExternalAccount::decode(EAB_KID, &"A".repeat(64)).expect("decodes"));
    let manager = AcmeManager::new(relay.front.clone(), wrong).expect("manager");
    let err = within("refusal", manager.obtain(ChallengeKind::TlsAlpn01))
        .await
        .expect_err("wrong key")
        .to_string();
    assert!(
        err.contains("with external account binding key ID \"kid-1\"")
            && err.contains("--acme-eab-key"),
        "{err}"
    );
    assert!(relay.front.served_chain().is_none(), "nothing was issued");

    let mut bound = pebble.acme_config(&dir.0.join("certs"), ChallengeKind::TlsAlpn01);
    bound.external_account = Some(ExternalAccount::decode(EAB_KID, EAB_KEY).expect("decodes"));
    let manager = AcmeManager::new(relay.front.clone(), bound).expect("manager");
    let issued = tokio::time::timeout(STEP * 6, manager.obtain(ChallengeKind::TlsAlpn01))
        .await
        .expect("in time")
        .unwrap_or_else(|e| panic!("{e}; pebble log:\n{}", pebble.pebble.log()));
    assert_eq!(issued.origin, CertOrigin::AcmeIssued);
    let root = pebble.root().await;
    connect_pair(&relay, || relay.client(HOST).with_extra_root(root.clone())).await;
    relay.stop().await;
}

/// A port free on 127.0.0.1 and 127.0.0.2 and, when `v6`, on ::1 as well.
fn free_port_on_all(v6: bool) -> u16 {
    loop {
        let port = free_port();
        let free = |host: &str| std::net::TcpListener::bind((host, port)).is_ok();
        if free("127.0.0.2") && (!v6 || free("::1")) {
            return port;
        }
    }
}

/// A client of the relay at `dial` that names `ip` (by address: no SNI) and trusts `root`.
fn client_by_address(
    dial: SocketAddr,
    ip: IpAddr,
    root: &derp_client::rustls::pki_types::CertificateDer<'static>,
) -> ClientConfig {
    let named = SocketAddr::new(ip, dial.port());
    ClientConfig::new(
        &format!("https://{named}/derp"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_dial_addr(dial)
    .with_connect_timeout(STEP)
    .with_extra_root(root.clone())
}

/// As on a cloud VM with its public address NATed 1:1 onto a private one: the node is
/// configured with one address (127.0.0.2, where the CA validates it) and its sockets see
/// another (127.0.0.1, and ::1). Every client dialing by address gets the configured
/// address's certificate, ordered once.
#[tokio::test]
async fn an_ip_node_orders_and_serves_its_configured_address_whatever_the_socket_sees() {
    ip_certificates_on_demand(false).await;
}

/// The same, and then a client of the node's IPv6 loopback: still the configured address's
/// certificate, and no second order. A host without IPv6 fails this test rather than
/// passing it without the IPv6 half; `scripts/test` leaves it out there and names it in its
/// NOT RUN list.
#[tokio::test]
async fn an_ip_node_serves_its_configured_address_on_ipv6_too() {
    ip_certificates_on_demand(true).await;
}

async fn ip_certificates_on_demand(v6: bool) {
    require_pebble();
    if v6 && let Err(e) = TcpListener::bind("[::1]:0").await {
        panic!("no IPv6 loopback here ([::1]: {e}); scripts/test leaves this test out then");
    }
    let dir = TempDir::new("acme-ip");
    let http_port = free_port_on_all(v6);
    let pebble = Pebble::start(&dir.0, http_port, free_port()).await;
    let configured: IpAddr = [127, 0, 0, 2].into();
    let options = TlsOptions {
        ip_certs: true,
        ..TlsOptions::new("127.0.0.2")
    };
    let relay = TlsRelay::start_with(options, None).await;
    assert_ne!(relay.addr.ip(), configured);
    let shutdown = relay.server.shutdown_token();
    let mut tasks = tokio::task::JoinSet::new();
    // The CA validates the configured address: the port-80 listener is reachable there.
    let listener = std::net::TcpListener::bind(("127.0.0.2", http_port)).expect("port 80");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = TcpListener::from_std(listener).expect("tokio listener");
    let (front, server, port) = (relay.front.clone(), relay.server.clone(), relay.addr.port());
    tasks.spawn(async move {
        front
            .serve_http_port(&server, listener, port)
            .await
            .expect("port 80");
    });
    let config = pebble.acme_config(&dir.0.join("certs"), ChallengeKind::Http01);
    let manager = IpCertManager::new(relay.front.clone(), config).expect("manager");
    let (m, s) = (manager.clone(), shutdown.clone());
    tasks.spawn(async move { m.run(s).await });

    // The first client's handshake waits for the certificate; both then verify it against
    // Pebble's root by the configured address alone and relay.
    let root = pebble.root().await;
    connect_pair(&relay, || client_by_address(relay.addr, configured, &root)).await;
    assert_eq!(manager.orders_placed(), 1);
    assert!(manager.cert_path(configured).exists() && manager.key_path(configured).exists());
    assert!(!manager.cert_path(relay.addr.ip()).exists());
    pebble.assert_validated();
    // Later connections are served the certificate in hand: no new order.
    connect_pair(&relay, || client_by_address(relay.addr, configured, &root)).await;
    assert_eq!(manager.orders_placed(), 1);

    if v6 {
        // Another local address, of another family: still the configured address's
        // certificate, and no order.
        let listener = TcpListener::bind("[::1]:0").await.expect("bind ::1");
        let addr6 = listener.local_addr().expect("addr");
        let (front, server) = (relay.front.clone(), relay.server.clone());
        tasks.spawn(async move { front.serve(&server, listener).await.expect("serve ::1") });
        connect_pair(&relay, || client_by_address(addr6, configured, &root)).await;
        assert_eq!(manager.orders_placed(), 1);
        assert!(!manager.cert_path("::1".parse().expect("ip")).exists());
    }
    relay.stop().await;
    while tasks.join_next().await.is_some() {}
}
