//! DERP over QUIC end to end: a relay serving plain TCP and QUIC (with a self-signed
//! certificate for 127.0.0.1 through `derp-tls`) on one registry, and clients of both kinds.

use std::net::{SocketAddr, UdpSocket as StdUdpSocket};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use derp_client::{Client, ClientConfig, ConnectError, QUIC_PREAMBLE, ReceivedFrame};
use derp_proto::{PublicKey, SecretKey};
use derp_server::quic::close_code;
use derp_server::{QuicConfig, QuicListener, Server, ServerConfig};
use derp_tls::{CertOrigin, TlsFront, TlsOptions, cert_pin, load_certs_pem, load_key_pem};
use tokio::task::JoinHandle;

use crate::harness::STEP;

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A relay with a plain TCP listener and a QUIC listener, sharing one registry.
pub(crate) struct QuicRelay {
    pub(crate) server: Server,
    pub(crate) tcp: SocketAddr,
    pub(crate) quic: SocketAddr,
    pub(crate) pin: String,
    pub(crate) registry: prometheus::Registry,
    tasks: Vec<JoinHandle<()>>,
}

impl QuicRelay {
    pub(crate) async fn start() -> Self {
        Self::start_with(
            ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng)),
            QuicConfig::default(),
        )
        .await
    }

    pub(crate) async fn start_with(config: ServerConfig, quic: QuicConfig) -> Self {
        let socket =
            derp_server::quic::bind_udp("127.0.0.1:0".parse().expect("addr")).expect("udp");
        Self::start_on(config, quic, socket).await
    }

    /// A relay whose QUIC listener serves on `socket`, bound already.
    pub(crate) async fn start_on(
        config: ServerConfig,
        quic: QuicConfig,
        socket: StdUdpSocket,
    ) -> Self {
        derp_testkit::init_tracing();
        let registry = prometheus::Registry::new();
        let server = Server::new(config, &registry).expect("server");
        let front = TlsFront::new(
            &server.public_key(),
            TlsOptions::new("127.0.0.1"),
            &registry,
        )
        .expect("tls front");
        let (cert, key) =
            derp_tls::generate_self_signed("127.0.0.1".parse().expect("ip")).expect("cert");
        let chain = load_certs_pem(cert.as_bytes()).expect("chain");
        let pin = cert_pin(&chain[0]);
        front
            .install(
                chain,
                load_key_pem(key.as_bytes()).expect("key"),
                CertOrigin::SelfSigned,
            )
            .expect("install");
        let listener =
            QuicListener::bind(socket, front.quic_server_config(), quic).expect("quic listener");
        let quic = listener.local_addr().expect("quic addr");
        let tcp_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let tcp = tcp_listener.local_addr().expect("tcp addr");
        let (s1, s2) = (server.clone(), server.clone());
        let tasks = vec![
            tokio::spawn(async move { s1.serve_quic(listener).await }),
            tokio::spawn(async move { s2.serve(tcp_listener).await.expect("serve") }),
        ];
        Self {
            server,
            tcp,
            quic,
            pin,
            registry,
            tasks,
        }
    }

    /// A QUIC client config for this relay, trusting its certificate by pin.
    pub(crate) fn quic_config(&self, secret: SecretKey) -> ClientConfig {
        ClientConfig::new(&format!("quic://{}", self.quic), secret)
            .expect("config")
            .with_cert_name(self.pin.clone())
            .with_local_addr("127.0.0.1:0".parse().expect("addr"))
            .with_connect_timeout(STEP)
    }

    /// A connected QUIC client and its public key.
    pub(crate) async fn quic_client(&self) -> (Client, PublicKey) {
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let key = secret.public_key();
        let config = self.quic_config(secret);
        let client = within("quic connect", Client::connect(&config))
            .await
            .expect("quic connect");
        (client, key)
    }

    /// A connected plain TCP client and its public key.
    pub(crate) async fn tcp_client(&self) -> (Client, PublicKey) {
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let key = secret.public_key();
        let config =
            ClientConfig::new(&format!("http://{}/derp", self.tcp), secret).expect("config");
        let client = within("tcp connect", Client::connect(&config))
            .await
            .expect("tcp connect");
        (client, key)
    }

    /// Sum of a metric's samples whose labels include `labels`.
    pub(crate) fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                })
            })
            .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
            .sum()
    }

    pub(crate) async fn eventually(&self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + STEP;
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        while !cond(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tick.tick().await;
        }
    }

    pub(crate) async fn stop(self) {
        self.server.shutdown().await;
        for t in self.tasks {
            t.abort();
        }
    }
}

/// The next frame that is not a keepalive.
async fn next(c: &mut Client) -> ReceivedFrame {
    loop {
        match within("frame", c.recv()).await.expect("recv") {
            ReceivedFrame::KeepAlive => continue,
            f => return f,
        }
    }
}

/// The next relayed packet, skipping keepalives and ObservedAddr.
async fn next_packet(c: &mut Client) -> (PublicKey, Bytes) {
    loop {
        match next(c).await {
            ReceivedFrame::RecvPacket { src, packet } => return (src, packet),
            ReceivedFrame::ObservedAddr(_) => continue,
            other => panic!("expected a packet, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn quic_handshake_observed_addr_and_relay_both_ways_in_datagrams() {
    let relay = QuicRelay::start().await;
    let (mut a, ka) = relay.quic_client().await;
    let (mut b, kb) = relay.quic_client().await;
    // QUIC is TLS 1.3 and the chain carries the meta certificate: fast start.
    assert!(a.used_fast_start());
    assert_eq!(a.server_key(), relay.server.public_key());
    // The first frame after ServerInfo is the address the server sees.
    let local = a.quic_path().expect("quic").local_addr().expect("local");
    assert_eq!(next(&mut a).await, ReceivedFrame::ObservedAddr(local));
    let b_local = b.quic_path().expect("quic").local_addr().expect("local");
    assert_eq!(next(&mut b).await, ReceivedFrame::ObservedAddr(b_local));
    relay
        .eventually("both registered", |r| r.server.local_clients() == 2)
        .await;

    assert_eq!(a.server_info().version, 2);
    for i in 0..20u8 {
        a.send_packet(kb, [i; 100]).await.expect("send");
        let (src, packet) = next_packet(&mut b).await;
        assert_eq!(src, ka);
        assert_eq!(&packet[..], &[i; 100]);
        b.send_packet(ka, [i; 200]).await.expect("send back");
        let (src, packet) = next_packet(&mut a).await;
        assert_eq!(src, kb);
        assert_eq!(&packet[..], &[i; 200]);
    }
    // Every packet went in a datagram, both ways.
    assert_eq!(relay.metric("derp_quic_datagrams_received", &[]), 40.0);
    assert_eq!(relay.metric("derp_quic_datagrams_sent", &[]), 40.0);
    assert_eq!(relay.metric("derp_quic_stream_fallbacks", &[]), 0.0);
    assert_eq!(
        relay.metric("derp_accepts_by_transport", &[("transport", "quic")]),
        2.0
    );
    assert_eq!(
        relay.metric(
            "derp_current_connections_by_transport",
            &[("transport", "quic")]
        ),
        2.0
    );
    assert_eq!(
        relay.metric("derp_quic_handshakes", &[("result", "ok")]),
        2.0
    );
    a.ping().await.expect("ping over the stream");
    a.close().await.expect("close");
    relay
        .eventually("a unregistered", |r| {
            r.metric(
                "derp_current_connections_by_transport",
                &[("transport", "quic")],
            ) == 1.0
        })
        .await;
    relay.stop().await;
}

#[tokio::test]
async fn frames_over_the_datagram_limit_and_clients_without_datagrams_use_the_stream() {
    let relay = QuicRelay::start().await;
    let (mut a, ka) = relay.quic_client().await;
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let kn = secret.public_key();
    let config = relay.quic_config(secret).with_quic_datagrams(false);
    let mut no_dgram = within("connect", Client::connect(&config))
        .await
        .expect("connect");
    assert_eq!(
        no_dgram.quic_path().expect("quic").max_datagram_frame(),
        None
    );
    let (mut b, kb) = relay.quic_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 3)
        .await;

    // Larger than any datagram: the client sends it on the stream, and so does the relay.
    let big: Vec<u8> = (0..4000u32).map(|i| i as u8).collect();
    a.send_packet(kb, &big).await.expect("send");
    let (src, packet) = next_packet(&mut b).await;
    assert_eq!(src, ka);
    assert_eq!(&packet[..], &big[..]);
    assert_eq!(
        relay.metric("derp_quic_stream_fallbacks", &[("reason", "too_large")]),
        1.0
    );
    assert_eq!(relay.metric("derp_quic_datagrams_received", &[]), 0.0);

    // A small packet to a client that takes no datagrams also goes on the stream.
    a.send_packet(kn, b"small").await.expect("send");
    let (_, packet) = next_packet(&mut no_dgram).await;
    assert_eq!(&packet[..], b"small");
    assert_eq!(
        relay.metric("derp_quic_stream_fallbacks", &[("reason", "no_datagrams")]),
        1.0
    );
    assert_eq!(relay.metric("derp_quic_datagrams_received", &[]), 1.0);
    // ... and such a client sends on the stream.
    no_dgram
        .send_packet(kb, b"from the stream")
        .await
        .expect("send");
    let (_, packet) = next_packet(&mut b).await;
    assert_eq!(&packet[..], b"from the stream");
    assert_eq!(relay.metric("derp_quic_datagrams_received", &[]), 1.0);
    assert_eq!(relay.metric("derp_quic_datagrams_sent", &[]), 1.0);
    relay.stop().await;
}

#[tokio::test]
async fn tcp_and_quic_clients_reach_each_other() {
    let relay = QuicRelay::start().await;
    let (mut q, kq) = relay.quic_client().await;
    let (mut t, kt) = relay.tcp_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    q.send_packet(kt, b"quic to tcp").await.expect("send");
    let (src, packet) = next_packet(&mut t).await;
    assert_eq!((src, &packet[..]), (kq, &b"quic to tcp"[..]));
    t.send_packet(kq, b"tcp to quic").await.expect("send");
    let (src, packet) = next_packet(&mut q).await;
    assert_eq!((src, &packet[..]), (kt, &b"tcp to quic"[..]));
    assert_eq!(
        relay.metric("derp_accepts_by_transport", &[("transport", "tcp")]),
        1.0
    );
    assert_eq!(
        relay.metric("derp_accepts_by_transport", &[("transport", "quic")]),
        1.0
    );
    assert_eq!(relay.metric("derp_packets_received", &[]), 2.0);
    assert_eq!(relay.metric("derp_packets_sent", &[]), 2.0);
    // PeerGone reaches a QUIC client like any other.
    drop(t);
    loop {
        match next(&mut q).await {
            ReceivedFrame::PeerGone { peer, .. } => {
                assert_eq!(peer, kt);
                break;
            }
            ReceivedFrame::ObservedAddr(_) => {}
            other => panic!("expected PeerGone, got {other:?}"),
        }
    }
    relay.stop().await;
}

/// Accepts any certificate (handshake signatures are still checked): for raw QUIC clients
/// that test what happens after the TLS handshake.
#[derive(Debug)]
struct AcceptAny(Arc<derp_client::rustls::crypto::CryptoProvider>);

impl derp_client::rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &derp_client::rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[derp_client::rustls::pki_types::CertificateDer<'_>],
        _server_name: &derp_client::rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: derp_client::rustls::pki_types::UnixTime,
    ) -> Result<derp_client::rustls::client::danger::ServerCertVerified, derp_client::rustls::Error>
    {
        Ok(derp_client::rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &derp_client::rustls::pki_types::CertificateDer<'_>,
        dss: &derp_client::rustls::DigitallySignedStruct,
    ) -> Result<
        derp_client::rustls::client::danger::HandshakeSignatureValid,
        derp_client::rustls::Error,
    > {
        derp_client::rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &derp_client::rustls::pki_types::CertificateDer<'_>,
        dss: &derp_client::rustls::DigitallySignedStruct,
    ) -> Result<
        derp_client::rustls::client::danger::HandshakeSignatureValid,
        derp_client::rustls::Error,
    > {
        derp_client::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<derp_client::rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A raw quinn client endpoint offering `alpn` and trusting any certificate.
fn raw_endpoint(alpn: &[&[u8]]) -> (quinn::Endpoint, quinn::ClientConfig) {
    let provider = Arc::new(derp_client::rustls::crypto::ring::default_provider());
    let mut tls = derp_client::rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&derp_client::rustls::version::TLS13])
        .expect("tls 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
    let config = quinn::ClientConfig::new(Arc::new(crypto));
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("client");
    (endpoint, config)
}

#[tokio::test]
async fn a_client_offering_another_alpn_is_refused() {
    let relay = QuicRelay::start().await;
    let (endpoint, config) = raw_endpoint(&[b"h3"]);
    let result = within(
        "handshake",
        endpoint
            .connect_with(config, relay.quic, "127.0.0.1")
            .expect("connect"),
    )
    .await;
    let err = result.expect_err("a wrong ALPN must fail the handshake");
    // TLS alert no_application_protocol (120) in a CONNECTION_CLOSE.
    assert!(err.to_string().contains("120"), "{err}");
    relay
        .eventually("counted", |r| {
            r.metric("derp_quic_handshakes", &[("result", "error")]) == 1.0
        })
        .await;
    assert_eq!(relay.server.local_clients(), 0);
    relay.stop().await;
}

#[tokio::test]
async fn garbage_datagrams_are_dropped_and_counted() {
    let relay = QuicRelay::start().await;
    let (mut a, _) = relay.quic_client().await;
    let (mut b, kb) = relay.quic_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    let conn = a.quic_path().expect("quic").connection().clone();
    let mut wrong_len = vec![0x04, 0, 0, 0, 40];
    wrong_len.extend_from_slice(kb.as_bytes());
    wrong_len.extend_from_slice(b"abc");
    let mut ping = vec![0x12, 0, 0, 0, 8];
    ping.extend_from_slice(&[1; 8]);
    for garbage in [
        &b""[..],
        &b"\x04\x00"[..],
        &[0x04, 0, 0, 0, 0][..],
        &wrong_len[..],
        &ping[..],
    ] {
        conn.send_datagram(Bytes::copy_from_slice(garbage))
            .expect("send datagram");
    }
    // The connection carries on: the next good packet is relayed.
    a.send_packet(kb, b"still here").await.expect("send");
    let (_, packet) = next_packet(&mut b).await;
    assert_eq!(&packet[..], b"still here");
    relay
        .eventually("garbage counted", |r| {
            r.metric("derp_quic_garbage_datagrams", &[]) == 5.0
        })
        .await;
    a.ping().await.expect("connection alive");
    assert_eq!(
        relay.metric("derp_connection_errors", &[("class", "peer_misbehaved")]),
        0.0
    );
    relay.stop().await;
}

#[tokio::test]
async fn a_client_that_never_finishes_the_derp_handshake_is_closed_on_time() {
    let (endpoint, client) = raw_endpoint(&[derp_server::quic::ALPN]);

    // Half a preamble, then nothing: the preamble is due by the QUIC handshake's deadline
    // (here short), not the DERP handshake's (here an hour).
    let mut config = ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng));
    config.handshake_timeout = Duration::from_secs(3600);
    let quic = QuicConfig {
        handshake_timeout: Duration::from_millis(300),
        ..QuicConfig::default()
    };
    let relay = QuicRelay::start_with(config, quic).await;
    let conn = within(
        "handshake",
        endpoint
            .connect_with(client.clone(), relay.quic, "127.0.0.1")
            .expect("connect"),
    )
    .await
    .expect("quic handshake");
    let (mut send, _recv) = conn.open_bi().await.expect("stream");
    send.write_all(&QUIC_PREAMBLE[..3]).await.expect("write");
    let closed = within("close", conn.closed()).await;
    assert_eq!(
        closed,
        quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
            error_code: quinn::VarInt::from_u32(close_code::HANDSHAKE_TIMEOUT),
            reason: Bytes::new(),
        })
    );
    assert_eq!(
        relay.metric(
            "derp_connection_errors",
            &[("class", "local"), ("reason", "timeout")]
        ),
        1.0
    );
    // A connection that never registered still counts in the QUIC path metrics (its
    // handshake's packets, added when it ends).
    relay
        .eventually("the ended connection's packets counted", |r| {
            r.metric("derp_quic_packets_sent", &[]) > 0.0
        })
        .await;
    relay.stop().await;

    let mut config = ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng));
    config.handshake_timeout = Duration::from_millis(300);
    let relay = QuicRelay::start_with(config, QuicConfig::default()).await;

    // A wrong preamble fails the handshake at once.
    let conn = within(
        "handshake",
        endpoint
            .connect_with(client.clone(), relay.quic, "127.0.0.1")
            .expect("connect"),
    )
    .await
    .expect("quic handshake");
    let (mut send, _recv) = conn.open_bi().await.expect("stream");
    send.write_all(b"GET / HTTP/1.1\r\n").await.expect("write");
    let closed = within("close", conn.closed()).await;
    assert!(
        matches!(&closed, quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == quinn::VarInt::from_u32(close_code::HANDSHAKE_FAILED)),
        "{closed:?}"
    );

    // The preamble but no ClientInfo: the DERP handshake deadline.
    let conn = within(
        "handshake",
        endpoint
            .connect_with(client, relay.quic, "127.0.0.1")
            .expect("connect"),
    )
    .await
    .expect("quic handshake");
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    send.write_all(&QUIC_PREAMBLE).await.expect("write");
    // ServerKey comes back first.
    let mut server_key = [0u8; 45];
    recv.read_exact(&mut server_key).await.expect("server key");
    assert_eq!(server_key[0], 0x01);
    assert_eq!(&server_key[13..], relay.server.public_key().as_bytes());
    let closed = within("close", conn.closed()).await;
    assert!(
        matches!(&closed, quinn::ConnectionError::ApplicationClosed(c)
            if c.error_code == quinn::VarInt::from_u32(close_code::HANDSHAKE_TIMEOUT)),
        "{closed:?}"
    );
    assert_eq!(
        relay.metric(
            "derp_connection_errors",
            &[("class", "local"), ("reason", "timeout")]
        ),
        1.0
    );
    assert_eq!(
        relay.metric(
            "derp_connection_errors",
            &[("class", "peer_misbehaved"), ("reason", "handshake")]
        ),
        1.0
    );
    relay.stop().await;
}

#[tokio::test]
async fn a_client_that_never_finishes_the_quic_handshake_is_dropped_on_time() {
    let quic = QuicConfig {
        handshake_timeout: Duration::from_millis(300),
        ..QuicConfig::default()
    };
    let relay = QuicRelay::start_with(
        ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng)),
        quic,
    )
    .await;
    // Catch a real client's first Initial packet on a socket of ours...
    let catcher = StdUdpSocket::bind("127.0.0.1:0").expect("bind");
    catcher.set_read_timeout(Some(STEP)).expect("read timeout");
    let (endpoint, client) = raw_endpoint(&[derp_server::quic::ALPN]);
    let connecting = endpoint
        .connect_with(client, catcher.local_addr().expect("addr"), "127.0.0.1")
        .expect("connect");
    let mut initial = vec![0u8; 2048];
    let n = tokio::task::spawn_blocking(move || {
        let n = catcher.recv(&mut initial).expect("initial packet");
        initial.truncate(n);
        initial
    })
    .await
    .expect("join");
    drop(connecting);
    // ... and hand it to the relay from a socket that never answers its reply.
    let mute = StdUdpSocket::bind("127.0.0.1:0").expect("bind");
    mute.send_to(&n, relay.quic).expect("send initial");
    relay
        .eventually("handshake timed out", |r| {
            r.metric("derp_quic_handshakes", &[("result", "timeout")]) == 1.0
        })
        .await;
    assert_eq!(relay.server.local_clients(), 0);
    relay.stop().await;
}

#[tokio::test]
async fn a_rebound_client_keeps_its_registration_and_its_packets_keep_flowing() {
    let relay = QuicRelay::start().await;
    let (mut a, ka) = relay.quic_client().await;
    let (b, kb) = relay.tcp_client().await;
    let first = a.quic_path().expect("quic").local_addr().expect("local");
    assert_eq!(next(&mut a).await, ReceivedFrame::ObservedAddr(first));
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    let path = a.quic_path().expect("quic").clone();
    let (mut a_rx, mut a_tx) = a.split();
    let (mut b_rx, mut b_tx) = b.split();
    // B echoes everything back to A.
    let echo = tokio::spawn(async move {
        loop {
            match b_rx.recv().await {
                Ok(ReceivedFrame::RecvPacket { packet, .. }) => {
                    if b_tx.send_packet(ka, &packet).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    // A sends numbered packets one at a time and waits for each echo, resending after a
    // loss (datagrams are unreliable); halfway it moves to a new local port.
    let mut new_addr = None;
    let mut observed = Vec::new();
    for i in 0..200u32 {
        if i == 100 {
            new_addr = Some(
                path.rebind("127.0.0.1:0".parse().expect("addr"))
                    .expect("rebind"),
            );
        }
        let payload = i.to_be_bytes();
        let give_up = tokio::time::Instant::now() + STEP;
        'resend: loop {
            assert!(
                tokio::time::Instant::now() < give_up,
                "packet {i} was not echoed within {STEP:?}, resends included"
            );
            a_tx.send_packet(kb, payload).await.expect("send");
            let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
            loop {
                match tokio::time::timeout_at(deadline, a_rx.recv()).await {
                    Err(_) => continue 'resend,
                    Ok(Ok(ReceivedFrame::RecvPacket { packet, .. })) if packet[..] == payload => {
                        break 'resend;
                    }
                    Ok(Ok(ReceivedFrame::ObservedAddr(addr))) => observed.push(addr),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => panic!("connection died at packet {i}: {e}"),
                }
            }
        }
    }
    let new_addr = new_addr.expect("rebound");
    assert_ne!(new_addr, first);
    // The server validated the new address and said so.
    let deadline = tokio::time::Instant::now() + STEP;
    while !observed.contains(&new_addr) {
        match tokio::time::timeout_at(deadline, a_rx.recv()).await {
            Ok(Ok(ReceivedFrame::ObservedAddr(addr))) => observed.push(addr),
            Ok(Ok(_)) => {}
            other => panic!("no ObservedAddr for {new_addr}: {other:?} (saw {observed:?})"),
        }
    }
    assert_eq!(relay.metric("derp_quic_migrations", &[]), 1.0);
    // Still the one registration: no new connection, no reconnect.
    assert_eq!(
        relay.metric("derp_accepts_by_transport", &[("transport", "quic")]),
        1.0
    );
    assert_eq!(relay.server.local_clients(), 2);
    echo.abort();
    relay.stop().await;
}

/// A UDP relay between a QUIC client and the server that can, on demand, forward the
/// client's packets from a second socket whose replies it throws away: an off-path forwarder
/// trying to pull the client's traffic to an address that cannot answer. It can also throw
/// away everything the server sends the client (`cut_down`): a downlink that went dead.
struct Forwarder {
    front: SocketAddr,
    /// Where the server sees the client's packets come from normally.
    normal: SocketAddr,
    diverted: SocketAddr,
    divert: Arc<std::sync::atomic::AtomicBool>,
    /// Sends the client's next 1-RTT packet alone from the diverted address (then clears).
    divert_one: Arc<std::sync::atomic::AtomicBool>,
    /// Datagrams the server sent to the diverted address.
    lost: Arc<std::sync::atomic::AtomicU64>,
    cut_down: Arc<std::sync::atomic::AtomicBool>,
    /// Datagrams the server sent the client while the downlink was cut.
    swallowed: Arc<std::sync::atomic::AtomicU64>,
    /// Datagrams the server sent the client that were passed on.
    passed_down: Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl Forwarder {
    async fn start(server: SocketAddr) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use tokio::net::UdpSocket;
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
        let normal = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
        let other = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
        let divert = Arc::new(AtomicBool::new(false));
        let cut_down = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicU64::new(0));
        let divert_one = Arc::new(AtomicBool::new(false));
        let client = Arc::new(std::sync::Mutex::new(None::<SocketAddr>));
        let (f, n, o, d, one, c) = (
            front.clone(),
            normal.clone(),
            other.clone(),
            divert.clone(),
            divert_one.clone(),
            client.clone(),
        );
        let upstream = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((len, from)) = f.recv_from(&mut buf).await {
                *c.lock().expect("lock") = Some(from);
                // A short header (form bit 0): a 1-RTT packet, after the handshake.
                let short = len > 0 && buf[0] & 0x80 == 0;
                let via =
                    if d.load(Ordering::Relaxed) || (short && one.swap(false, Ordering::Relaxed)) {
                        &o
                    } else {
                        &n
                    };
                let _ = via.send_to(&buf[..len], server).await;
            }
        });
        let swallowed = Arc::new(AtomicU64::new(0));
        let passed_down = Arc::new(AtomicU64::new(0));
        let (f, n, cut, sw, passed) = (
            front.clone(),
            normal.clone(),
            cut_down.clone(),
            swallowed.clone(),
            passed_down.clone(),
        );
        let downstream = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok(len) = n.recv(&mut buf).await {
                if cut.load(Ordering::Relaxed) {
                    sw.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let to = *client.lock().expect("lock");
                if let Some(to) = to {
                    passed.fetch_add(1, Ordering::Relaxed);
                    let _ = f.send_to(&buf[..len], to).await;
                }
            }
        });
        let (o, l) = (other.clone(), lost.clone());
        let sink = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while o.recv(&mut buf).await.is_ok() {
                l.fetch_add(1, Ordering::Relaxed);
            }
        });
        Self {
            front: front.local_addr().expect("addr"),
            normal: normal.local_addr().expect("addr"),
            diverted: other.local_addr().expect("addr"),
            divert,
            divert_one,
            lost,
            cut_down,
            swallowed,
            passed_down,
            tasks: vec![upstream, downstream, sink],
        }
    }

    fn lost(&self) -> u64 {
        self.lost.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lost_down(&self) -> u64 {
        self.swallowed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn passed_down(&self) -> u64 {
        self.passed_down.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[tokio::test]
async fn packets_are_never_relayed_to_an_address_that_was_not_validated() {
    let relay = QuicRelay::start().await;
    let (fwd, (mut a, ka, first), (mut b, kb)) = forwarded_and_tcp(&relay).await;

    // The forwarder now sends A's packets from another address, whose replies are lost.
    fwd.divert.store(true, std::sync::atomic::Ordering::Relaxed);
    for i in 0..20u8 {
        a.send_packet(kb, [i; 1000]).await.expect("send");
    }
    // They still arrive (the server takes packets from an unvalidated address)...
    for _ in 0..20 {
        next_packet(&mut b).await;
    }
    // ... and the server has moved to the diverted address: it sends there.
    relay.eventually("server follows", |_| fwd.lost() > 0).await;
    for i in 0..10u8 {
        b.send_packet(ka, [i; 500]).await.expect("send to a");
    }
    // Let the server's writer have its chances: it keeps sending challenges and probes to
    // the diverted address, until quinn gives up on validating it and goes back to the
    // client's validated address (then the server sends there, and the packets may arrive
    // through it even before the client stops being diverted).
    let (seen, passed) = (fwd.lost(), fwd.passed_down());
    relay
        .eventually("server keeps probing or goes back", |_| {
            fwd.lost() >= seen + 5 || fwd.passed_down() > passed
        })
        .await;

    // A's packets come straight again; the packets B sent were held, not lost on the way
    // to an address that could not receive them.
    fwd.divert
        .store(false, std::sync::atomic::Ordering::Relaxed);
    // Nothing is sent to wake the server's writer: it must notice by itself that quinn is
    // back on the validated address (its path watcher does).
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + STEP;
    while got.len() < 10 {
        match tokio::time::timeout_at(deadline, a.recv()).await {
            Ok(Ok(ReceivedFrame::RecvPacket { src, packet })) => {
                assert_eq!(src, kb);
                got.push(packet[0]);
            }
            Ok(Ok(ReceivedFrame::ObservedAddr(addr))) => {
                assert_ne!(addr, fwd.diverted, "an unvalidated address was reported");
                assert_eq!(addr, first);
            }
            Ok(Ok(_)) => {}
            other => panic!(
                "held packets did not arrive (got {got:?}): {other:?}; sent as datagrams {}, lost {}, passed {}",
                relay.metric("derp_quic_datagrams_sent", &[]),
                fwd.lost(),
                fwd.passed_down()
            ),
        }
    }
    got.sort();
    assert_eq!(got, (0..10).collect::<Vec<u8>>());
    assert_eq!(relay.metric("derp_quic_migrations", &[]), 0.0);
    relay.stop().await;
}

/// The next frame on a raw DERP stream.
async fn read_frame(recv: &mut quinn::RecvStream) -> derp_proto::RelayToClient {
    let mut frame = vec![0u8; 5];
    within("a frame header", recv.read_exact(&mut frame))
        .await
        .expect("read");
    let len = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
    frame.resize(5 + len, 0);
    within("a frame", recv.read_exact(&mut frame[5..]))
        .await
        .expect("read");
    derp_testkit::raw::decode_frame(&frame).expect("a frame")
}

#[tokio::test]
async fn the_handshake_address_is_trusted_not_where_a_forwarded_packet_moved_quinn() {
    use derp_testkit::raw::{Handshake, Step, plain_info};

    let relay = QuicRelay::start().await;
    let fwd = Forwarder::start(relay.quic).await;
    let (endpoint, config) = raw_endpoint(&[derp_server::quic::ALPN]);
    let conn = within(
        "handshake",
        endpoint
            .connect_with(config, fwd.front, "127.0.0.1")
            .expect("connect"),
    )
    .await
    .expect("handshake");
    relay
        .eventually("the server's handshake", |r| {
            r.metric("derp_quic_handshakes", &[("result", "ok")]) == 1.0
        })
        .await;
    // The packet that opens the DERP stream arrives from another address, as if an attacker
    // forwarded a copy first: quinn follows it there at once, unvalidated.
    fwd.divert_one
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    send.write_all(&QUIC_PREAMBLE).await.expect("preamble");
    relay
        .eventually("the diverted packet", |_| {
            !fwd.divert_one.load(std::sync::atomic::Ordering::Relaxed)
        })
        .await;

    // The DERP handshake (its frames reach the client once quinn is back on its address).
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let mut hs = Handshake::new(secret, plain_info());
    loop {
        match hs.step(read_frame(&mut recv).await).expect("handshake") {
            Step::Send(out) => send.write_all(&out).await.expect("client info"),
            Step::Read => {}
            Step::Done(_) => break,
        }
    }
    // The address reported is the one the handshake came from, never the diverted one.
    loop {
        match read_frame(&mut recv).await {
            derp_proto::RelayToClient::ObservedAddr(addr) => {
                assert_eq!(addr, fwd.normal);
                break;
            }
            derp_proto::RelayToClient::KeepAlive => {}
            other => panic!("expected ObservedAddr, got {other:?}"),
        }
    }
    assert_eq!(relay.metric("derp_quic_migrations", &[]), 0.0);
    conn.close(0u32.into(), b"");
    relay.stop().await;
}

/// A QUIC client connected through `fwd`, its key, and the ObservedAddr the server sent it
/// first.
async fn client_through(relay: &QuicRelay, fwd: &Forwarder) -> (Client, PublicKey, SocketAddr) {
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let key = secret.public_key();
    let config = ClientConfig::new(&format!("quic://{}", fwd.front), secret)
        .expect("config")
        .with_cert_name(relay.pin.clone())
        .with_local_addr("127.0.0.1:0".parse().expect("addr"))
        .with_connect_timeout(STEP);
    let mut client = within("connect", Client::connect(&config))
        .await
        .expect("connect");
    let ReceivedFrame::ObservedAddr(observed) = next(&mut client).await else {
        panic!("expected ObservedAddr first");
    };
    (client, key, observed)
}

/// A QUIC client behind a [`Forwarder`] (with its key and first ObservedAddr) and a TCP
/// client, both registered.
async fn forwarded_and_tcp(
    relay: &QuicRelay,
) -> (
    Forwarder,
    (Client, PublicKey, SocketAddr),
    (Client, PublicKey),
) {
    let fwd = Forwarder::start(relay.quic).await;
    let quic = client_through(relay, &fwd).await;
    let tcp = relay.tcp_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    (fwd, quic, tcp)
}

/// Packets sent towards a dead downlink: about six times what quinn's datagram buffer holds.
const FLOOD: u16 = 400;

/// Packets derpd dropped, for every reason.
fn dropped(relay: &QuicRelay) -> f64 {
    relay.metric("derp_packets_dropped", &[])
}

#[tokio::test]
async fn when_quinn_has_no_room_for_datagrams_derpds_queue_drops_and_counts() {
    let mut config = ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng));
    config.write_timeout = None;
    config.send_queue_depth = 8;
    let relay = QuicRelay::start_with(config, QuicConfig::default()).await;
    let (fwd, (mut a, ka, _), (mut b, kb)) = forwarded_and_tcp(&relay).await;
    b.send_packet(ka, [0xff; 1000]).await.expect("send");
    assert_eq!(next_packet(&mut a).await.0, kb);
    assert_eq!(relay.metric("derp_quic_datagrams_sent", &[]), 1.0);

    // Nothing the server sends reaches A any more: quinn's window fills, then its datagram
    // buffer, and the writer waits for room while A's queue in derpd fills and drops.
    fwd.cut_down
        .store(true, std::sync::atomic::Ordering::Relaxed);
    for i in 0..FLOOD {
        b.send_packet(ka, [&i.to_be_bytes()[..], &[0; 998]].concat())
            .await
            .expect("send");
    }
    relay
        .eventually("derpd's queue to drop", |r| dropped(r) > 0.0)
        .await;

    // The downlink comes back: what quinn and the queue held arrives, then a packet sent now.
    fwd.cut_down
        .store(false, std::sync::atomic::Ordering::Relaxed);
    b.send_packet(ka, [0xee; 1000]).await.expect("send");
    let mut received = std::collections::BTreeSet::new();
    loop {
        let (src, packet) = next_packet(&mut a).await;
        assert_eq!(src, kb);
        if packet[0] == 0xee {
            break;
        }
        received.insert(u16::from_be_bytes([packet[0], packet[1]]));
    }
    assert!(!received.is_empty(), "nothing held back was delivered");
    // Every packet is accounted for. derpd handed it to quinn or dropped and counted it (the
    // first packet and the last make two more)...
    let handed = relay.metric("derp_quic_datagrams_sent", &[]);
    assert_eq!(
        handed + relay.metric("derp_quic_stream_fallbacks", &[]) + dropped(&relay),
        f64::from(FLOOD) + 2.0
    );
    // ... and what quinn took it delivered, or sent in a UDP packet the dead link swallowed
    // (a datagram is never resent). Had quinn dropped datagrams from a full buffer itself,
    // some would be missing.
    let cut = fwd.lost_down();
    assert!(
        received.len() as f64 + cut as f64 >= handed - 2.0,
        "quinn took {handed} datagrams; {} delivered, {cut} swallowed",
        received.len(),
    );
    assert_eq!(relay.metric("derp_sclient_write_timeouts", &[]), 0.0);
    assert_eq!(relay.server.local_clients(), 2);
    relay.stop().await;
}

/// The relay's QUIC path counters follow its connections' loss detection: what a cut
/// downlink swallowed is counted lost once the client acknowledges later packets, never
/// more than was swallowed, and the packets sent cover every one the link carried.
#[tokio::test]
async fn the_quic_path_counters_count_what_a_cut_downlink_lost() {
    use std::sync::atomic::Ordering::Relaxed;
    let relay = QuicRelay::start().await;
    let (fwd, (mut a, ka, _), (mut b, kb)) = forwarded_and_tcp(&relay).await;
    b.send_packet(ka, [0; 500]).await.expect("send");
    assert_eq!(next_packet(&mut a).await.0, kb);
    assert_eq!(relay.metric("derp_quic_packets_lost", &[]), 0.0);

    fwd.cut_down.store(true, Relaxed);
    for i in 1..=10u8 {
        b.send_packet(ka, [i; 500]).await.expect("send");
    }
    relay
        .eventually("the server to send into the cut", |r| {
            r.metric("derp_quic_datagrams_sent", &[]) == 11.0 && fwd.lost_down() > 0
        })
        .await;
    fwd.cut_down.store(false, Relaxed);
    // Packets sent now arrive, and A's acknowledgements of them show the server the gap.
    for i in 11..=20u8 {
        b.send_packet(ka, [i; 500]).await.expect("send");
    }
    while next_packet(&mut a).await.1[0] != 20 {}
    let carried = fwd.lost_down() + fwd.passed_down();
    relay
        .eventually("the losses counted", |r| {
            r.metric("derp_quic_packets_lost", &[]) > 0.0
                && r.metric("derp_quic_packets_sent", &[]) >= carried as f64
        })
        .await;
    let lost = relay.metric("derp_quic_packets_lost", &[]);
    assert!(
        lost <= fwd.lost_down() as f64,
        "{lost} counted lost, {} swallowed",
        fwd.lost_down()
    );
    assert_eq!(relay.metric("derp_quic_mtu_black_holes", &[]), 0.0);
    relay.stop().await;
}

#[tokio::test]
async fn a_quic_client_whose_downlink_stays_dead_is_closed_at_the_write_deadline() {
    let mut config = ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng));
    config.write_timeout = Some(Duration::from_millis(500));
    config.send_queue_depth = 8;
    let relay = QuicRelay::start_with(config, QuicConfig::default()).await;
    let (fwd, (_a, ka, _), (mut b, _)) = forwarded_and_tcp(&relay).await;

    fwd.cut_down
        .store(true, std::sync::atomic::Ordering::Relaxed);
    for i in 0..FLOOD {
        b.send_packet(ka, [&i.to_be_bytes()[..], &[0; 998]].concat())
            .await
            .expect("send");
    }
    // The writer waited for quinn's room past the deadline: the connection is closed, and
    // what it still held is counted as dropped.
    relay
        .eventually("the write deadline", |r| {
            r.metric("derp_sclient_write_timeouts", &[]) == 1.0 && r.server.local_clients() == 1
        })
        .await;
    // Each packet was handed to quinn (whose buffer went with the connection, as a closed
    // socket's does) or dropped and counted.
    relay
        .eventually("every packet accounted for", |r| {
            r.metric("derp_quic_datagrams_sent", &[]) + dropped(r) == f64::from(FLOOD)
        })
        .await;
    relay.stop().await;
}

/// A relay that vanished without a word (killed), and another process of the same node on
/// its UDP socket (a copy of it, as an upgrade in place hands over): the new one's stateless
/// reset, derived from the node's key, ends the old one's clients at once; they would
/// otherwise wait for the idle timeout.
#[tokio::test]
async fn a_client_of_a_vanished_endpoint_believes_the_reset_of_its_successor() {
    let node = SecretKey::generate(&mut rand::rngs::OsRng);
    let quic = QuicConfig {
        reset_secret: Some(derp_server::quic::ResetSecret::from_node_key(&node)),
        ..QuicConfig::default()
    };
    let socket = derp_server::quic::bind_udp("127.0.0.1:0".parse().expect("addr")).expect("udp");
    let copy = socket.try_clone().expect("dup");
    let old = QuicRelay::start_on(ServerConfig::new(node.clone()), quic.clone(), socket).await;
    let (mut a, _) = old.quic_client().await;
    old.eventually("registered", |r| r.server.local_clients() == 1)
        .await;
    // Gone without a CONNECTION_CLOSE: its endpoint stops with its task.
    for t in &old.tasks {
        t.abort();
    }
    let new = QuicRelay::start_on(ServerConfig::new(node), quic, copy).await;
    let _ = a.ping().await;
    let ended = within("the connection's end", async {
        loop {
            if a.recv().await.is_err() {
                break;
            }
        }
    });
    ended.await;
    new.stop().await;
    old.server.shutdown().await;
}

/// Once another process reads its socket too (it took it over), an endpoint answers only
/// its own connections: a connection attempt goes unanswered (its resend may reach the
/// other process), while a client it already had keeps being served.
#[tokio::test]
async fn an_endpoint_whose_socket_was_handed_over_answers_only_its_own_clients() {
    let relay = QuicRelay::start().await;
    let (mut a, _) = relay.quic_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 1)
        .await;
    relay.server.udp_handed_over();
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let config = relay
        .quic_config(secret)
        .with_connect_timeout(Duration::from_secs(2));
    let Err(err) = within("the attempt's end", Client::connect(&config)).await else {
        panic!("the attempt was taken; it is the other process's");
    };
    // No answer at all: neither taken nor refused.
    assert!(matches!(err, ConnectError::Timeout(_)), "{err:?}");
    within("a pong", a.ping()).await.expect("its own client");
    assert_eq!(relay.server.local_clients(), 1);
    relay.stop().await;
}

#[tokio::test]
async fn while_the_server_drains_a_new_quic_client_is_refused_at_once() {
    let relay = QuicRelay::start().await;
    let (a, _) = relay.quic_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 1)
        .await;
    relay.server.drain_token().cancel();
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let err = within("a refusal", Client::connect(&relay.quic_config(secret)))
        .await
        .expect_err("a draining server takes no new client");
    // Refused in so many words (CONNECTION_REFUSED), not a handshake left to time out.
    assert!(
        matches!(
            &err,
            ConnectError::QuicConnection(e)
                if matches!(
                    &**e,
                    quinn::ConnectionError::ConnectionClosed(c)
                        if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED
                )
        ),
        "{err:?}"
    );
    assert_eq!(
        relay.metric("derp_quic_handshakes", &[("result", "refused")]),
        1.0
    );
    // The client already there keeps its connection (until the drain is over).
    assert_eq!(relay.server.local_clients(), 1);
    drop(a);
    relay.stop().await;
}

#[tokio::test]
async fn a_mesh_peer_can_use_quic() {
    let mesh_key: derp_proto::MeshKey = "ab".repeat(32).parse().expect("mesh key");
    let mut config = ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng));
    config.mesh_key = Some(mesh_key);
    let relay = QuicRelay::start_with(config, QuicConfig::default()).await;
    let mesh = relay
        .quic_config(SecretKey::generate(&mut rand::rngs::OsRng))
        .with_mesh_key(mesh_key);
    let mut peer = within("connect", Client::connect(&mesh))
        .await
        .expect("mesh peer over quic");
    peer.watch_conns().await.expect("watch");
    let (mut local, kl) = relay.tcp_client().await;
    // Presence of a client of this node reaches the peer over the QUIC stream...
    loop {
        match next(&mut peer).await {
            ReceivedFrame::PeerPresent { peer: key, .. } if key == kl => break,
            _ => {}
        }
    }
    // ... and a packet forwarded on behalf of a client of the peer's node is delivered.
    let remote = SecretKey::generate(&mut rand::rngs::OsRng).public_key();
    peer.forward_packet(remote, kl, Bytes::from_static(b"via the mesh"))
        .await
        .expect("forward");
    let (src, packet) = next_packet(&mut local).await;
    assert_eq!((src, &packet[..]), (remote, &b"via the mesh"[..]));
    assert_eq!(relay.metric("derp_packets_forwarded_in", &[]), 1.0);
    relay.stop().await;
}

#[tokio::test]
async fn quic_clients_are_put_to_the_admission_checks_like_any_other() {
    let dir = std::env::temp_dir().join(format!("derp-quic-admission-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (allowed, refused) = (
        SecretKey::generate(&mut rand::rngs::OsRng),
        SecretKey::generate(&mut rand::rngs::OsRng),
    );
    let tcp_peer = SecretKey::generate(&mut rand::rngs::OsRng);
    let list = dir.join("allow.txt");
    std::fs::write(
        &list,
        format!("{}\n{}\n", allowed.public_key(), tcp_peer.public_key()),
    )
    .expect("write list");
    let check =
        derp_admission::AllowKeys::load(&list, &derp_admission::AdmissionMetrics::unregistered())
            .expect("allow list");
    let config = ServerConfig {
        admission: vec![Arc::new(check)],
        ..ServerConfig::new(SecretKey::generate(&mut rand::rngs::OsRng))
    };
    let relay = QuicRelay::start_with(config, QuicConfig::default()).await;

    // Not listed: closed after its ClientInfo, never registered.
    let outcome = within(
        "refused quic client",
        Client::connect(&relay.quic_config(refused.clone())),
    )
    .await;
    assert!(outcome.is_err(), "an unlisted QUIC client was admitted");
    assert_eq!(
        relay.metric("derp_admission_refused", &[("reason", "not_listed")]),
        1.0
    );
    assert_eq!(relay.server.local_clients(), 0);

    // Listed: admitted, and relays to a listed TCP client.
    let mut q = within(
        "allowed quic client",
        Client::connect(&relay.quic_config(allowed.clone())),
    )
    .await
    .expect("a listed QUIC client refused");
    let config =
        ClientConfig::new(&format!("http://{}/derp", relay.tcp), tcp_peer.clone()).expect("config");
    let mut t = within("tcp connect", Client::connect(&config))
        .await
        .expect("a listed TCP client refused");
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    q.send_packet(tcp_peer.public_key(), b"admitted over quic")
        .await
        .expect("send");
    let (src, packet) = next_packet(&mut t).await;
    assert_eq!(
        (src, &packet[..]),
        (allowed.public_key(), &b"admitted over quic"[..])
    );
    relay.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_https_url_with_a_quic_port_connects_over_quic() {
    let relay = QuicRelay::start().await;
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let key = secret.public_key();
    // The URL names the node as a DERP map does; the QUIC port says to use QUIC there.
    // The URL's TCP port holds a listener that never answers, so only QUIC can succeed.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("https://{}/derp", silent.local_addr().expect("addr"));
    let config = ClientConfig::new(&url, secret)
        .expect("config")
        .with_quic_port(relay.quic.port())
        .with_cert_name(relay.pin.clone())
        .with_local_addr("127.0.0.1:0".parse().expect("addr"))
        .with_connect_timeout(STEP);
    let mut q = within("https + quic port", Client::connect(&config))
        .await
        .expect("connect over quic");
    let (mut t, kt) = relay.tcp_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    q.send_packet(kt, b"via the quic port").await.expect("send");
    let (src, packet) = next_packet(&mut t).await;
    assert_eq!((src, &packet[..]), (key, &b"via the quic port"[..]));
    assert_eq!(
        relay.metric("derp_accepts_by_transport", &[("transport", "quic")]),
        1.0
    );
    relay.stop().await;
}

#[tokio::test]
async fn clients_that_come_and_go_are_each_routed_as_themselves() {
    // The server's QUIC driver routes datagrams as the client its connection registered,
    // and quinn-proto hands a drained connection's slot to the next one: a client arriving
    // in the slot of one that left must be routed as itself.
    let relay = QuicRelay::start().await;
    let (mut b, kb) = relay.tcp_client().await;
    for round in 0..5u8 {
        let (mut a, ka) = relay.quic_client().await;
        assert!(matches!(next(&mut a).await, ReceivedFrame::ObservedAddr(_)));
        relay
            .eventually("a registered", |r| r.server.local_clients() == 2)
            .await;
        a.send_packet(kb, [round; 64]).await.expect("send");
        // b hears that the previous round's client left; then the packet.
        let (src, packet) = loop {
            match next(&mut b).await {
                ReceivedFrame::RecvPacket { src, packet } => break (src, packet),
                ReceivedFrame::PeerGone { .. } => continue,
                other => panic!("expected a packet, got {other:?}"),
            }
        };
        assert_eq!(src, ka, "round {round}");
        assert_eq!(&packet[..], &[round; 64]);
        a.close().await.expect("close");
        relay
            .eventually("a gone", |r| r.server.local_clients() == 1)
            .await;
    }
    assert_eq!(relay.metric("derp_quic_stream_fallbacks", &[]), 0.0);
    relay.stop().await;
}

#[tokio::test]
async fn over_ipv4_a_1400_byte_packet_travels_as_a_datagram_both_ways() {
    // derpd's 4-byte connection IDs, derp-client's empty ones and discovery up to a 1472-byte
    // path MTU over IPv4 leave room for a 1,400-byte packet's 1,437-byte frame.
    let relay = QuicRelay::start().await;
    let (mut a, ka) = relay.quic_client().await;
    let (mut b, kb) = relay.quic_client().await;
    relay
        .eventually("registered", |r| r.server.local_clients() == 2)
        .await;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for c in [&a, &b] {
        let path = c.quic_path().expect("quic").clone();
        within("the client's path MTU discovery", async {
            while path.max_datagram_frame() < Some(1437) {
                tick.tick().await;
            }
        })
        .await;
    }
    let packet = [7u8; 1400];
    // The relay's own discovery towards b may still be probing: until it is done, its
    // packets to b go on the stream.
    let mut sent = 0.0;
    within("a 1400-byte datagram from the relay", async {
        while relay.metric("derp_quic_datagrams_sent", &[]) < 1.0 {
            a.send_packet(kb, packet).await.expect("send");
            sent += 1.0;
            let (src, got) = next_packet(&mut b).await;
            assert_eq!(src, ka);
            assert_eq!(&got[..], &packet[..]);
            tick.tick().await;
        }
    })
    .await;
    // a's discovery was done before its first packet: every one was a datagram.
    assert_eq!(relay.metric("derp_quic_datagrams_received", &[]), sent);
    b.send_packet(ka, packet).await.expect("send back");
    let (src, got) = next_packet(&mut a).await;
    assert_eq!(src, kb);
    assert_eq!(&got[..], &packet[..]);
    assert_eq!(
        relay.metric("derp_quic_datagrams_received", &[]),
        sent + 1.0
    );
    relay.stop().await;
}
