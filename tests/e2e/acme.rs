//! ACME against a local Pebble server, beyond what `tls.rs` covers: accounts bound with
//! External Account Binding, and certificates for the node's IP addresses on demand.

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

/// A port free on 127.0.0.1 and, when `v6`, on ::1 as well.
fn free_port_on_both(v6: bool) -> u16 {
    loop {
        let port = free_port();
        if !v6 || std::net::TcpListener::bind(("::1", port)).is_ok() {
            return port;
        }
    }
}

/// A client of `addr` by address (no SNI) trusting `root`.
fn client_by_address(
    addr: SocketAddr,
    root: &derp_client::rustls::pki_types::CertificateDer<'static>,
) -> ClientConfig {
    ClientConfig::new(
        &format!("https://{addr}/derp"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_dial_addr(addr)
    .with_connect_timeout(STEP)
    .with_extra_root(root.clone())
}

#[tokio::test]
async fn the_address_clients_connect_to_gets_a_certificate_on_demand() {
    ip_certificates_on_demand(false).await;
}

/// The same, and then the node's IPv6 loopback: its own certificate, in a second order. A
/// host without IPv6 fails this test rather than passing it without the IPv6 half;
/// `scripts/test` leaves it out there and names it in its NOT RUN list.
#[tokio::test]
async fn each_address_clients_connect_to_gets_its_own_certificate_on_demand_ipv6_too() {
    ip_certificates_on_demand(true).await;
}

/// An IP-only node with certificates on demand: the first client of 127.0.0.1 waits for
/// that address's certificate, later ones are served it; with `v6`, the first client of
/// ::1 then gets ::1's own.
async fn ip_certificates_on_demand(v6: bool) {
    require_pebble();
    if v6 && let Err(e) = TcpListener::bind("[::1]:0").await {
        panic!("no IPv6 loopback here ([::1]: {e}); scripts/test leaves this test out then");
    }
    let dir = TempDir::new("acme-ip");
    let http_port = free_port_on_both(v6);
    let pebble = Pebble::start(&dir.0, http_port, free_port()).await;
    // An IP-only node: its hostname is an address, and it has no other certificate.
    let options = TlsOptions {
        ip_certs: true,
        ..TlsOptions::new("127.0.0.1")
    };
    let relay = TlsRelay::start_with(options, None).await;
    let shutdown = relay.server.shutdown_token();
    let mut tasks = tokio::task::JoinSet::new();
    let serve_port_80 = |host: &str, tasks: &mut tokio::task::JoinSet<()>| {
        let listener = std::net::TcpListener::bind((host, http_port)).expect("port 80 listener");
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let (front, server, port) = (relay.front.clone(), relay.server.clone(), relay.addr.port());
        tasks.spawn(async move {
            front
                .serve_http_port(&server, listener, port)
                .await
                .expect("port 80");
        });
    };
    serve_port_80("127.0.0.1", &mut tasks);
    let config = pebble.acme_config(&dir.0.join("certs"), ChallengeKind::Http01);
    let manager = IpCertManager::new(relay.front.clone(), config).expect("manager");
    let (m, s) = (manager.clone(), shutdown.clone());
    tasks.spawn(async move { m.run(s).await });

    // The first client's handshake waits for the address's certificate; both then verify
    // it against Pebble's root by the address alone and relay.
    let root = pebble.root().await;
    connect_pair(&relay, || client_by_address(relay.addr, &root)).await;
    assert_eq!(manager.orders_placed(), 1);
    let v4: IpAddr = [127, 0, 0, 1].into();
    assert!(manager.cert_path(v4).exists() && manager.key_path(v4).exists());
    pebble.assert_validated();
    // Later connections are served the certificate in hand: no new order.
    connect_pair(&relay, || client_by_address(relay.addr, &root)).await;
    assert_eq!(manager.orders_placed(), 1);

    if v6 {
        // Another address of the same node: its own certificate, ordered when a client
        // first connects to it.
        serve_port_80("::1", &mut tasks);
        let listener = TcpListener::bind("[::1]:0").await.expect("bind ::1");
        let addr6 = listener.local_addr().expect("addr");
        let (front, server) = (relay.front.clone(), relay.server.clone());
        tasks.spawn(async move { front.serve(&server, listener).await.expect("serve ::1") });
        connect_pair(&relay, || client_by_address(addr6, &root)).await;
        assert_eq!(manager.orders_placed(), 2);
        assert!(manager.cert_path("::1".parse().expect("ip")).exists());
    }
    relay.stop().await;
    while tasks.join_next().await.is_some() {}
}
