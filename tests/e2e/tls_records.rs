//! TLS 1.3 records end to end: a relay behind the TLS front, its records sealed and opened by
//! derpd's record layer (or, with `TlsRecords::Rustls`, by rustls's buffered connection),
//! relaying between clients that negotiate each TLS 1.3 suite: derp-client on rustls, and
//! OpenSSL's `s_client` carrying a DERP session the test builds byte by byte.
//!
//! `openssl` comes from scripts/test-tools; without it the OpenSSL test fails, naming the
//! install command.

use std::process::Stdio;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use derp_client::rustls::pki_types::CertificateDer;
use derp_client::rustls::{self, RootCertStore};
use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, PublicKey, RelayToClient, SecretKey,
};
use derp_tls::{CertOrigin, TlsOptions, TlsRecords};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use crate::harness::STEP;
use crate::tls::TlsRelay;

const HOST: &str = "derp.test";

/// rustls's and OpenSSL's names of each TLS 1.3 suite the relay offers.
const SUITES: [(rustls::CipherSuite, &str); 3] = [
    (
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
        "TLS_AES_128_GCM_SHA256",
    ),
    (
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
        "TLS_AES_256_GCM_SHA384",
    ),
    (
        rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
        "TLS_CHACHA20_POLY1305_SHA256",
    ),
];

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(STEP, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A relay behind a TLS front on 127.0.0.1 with a self-signed certificate for [`HOST`].
struct Relay {
    tls: TlsRelay,
    cert: CertificateDer<'static>,
}

impl Relay {
    async fn start(records: TlsRecords) -> Self {
        let options = TlsOptions {
            records,
            ..TlsOptions::new(HOST)
        };
        let tls = TlsRelay::start_with(options, None).await;
        let key = rcgen::generate_simple_self_signed(vec![HOST.to_string()]).expect("cert");
        let cert = key.cert.der().clone();
        tls.front
            .install(
                vec![cert.clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
                CertOrigin::Other,
            )
            .expect("install");
        Self { tls, cert }
    }

    /// A rustls client config that offers TLS 1.3 with `suite` alone.
    fn tls_config(&self, suite: rustls::CipherSuite) -> Arc<rustls::ClientConfig> {
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites.retain(|s| s.suite() == suite);
        let mut roots = RootCertStore::empty();
        roots.add(self.cert.clone()).expect("root");
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        Arc::new(tls)
    }

    /// A derp-client config whose TLS 1.3 offers `suite` alone.
    fn client(&self, suite: rustls::CipherSuite) -> ClientConfig {
        let url = format!("https://{HOST}:{}/derp", self.tls.addr.port());
        ClientConfig::new(&url, SecretKey::generate(&mut rand::rngs::OsRng))
            .expect("config")
            .with_dial_addr(self.tls.addr)
            .with_connect_timeout(STEP)
            .with_tls_config(self.tls_config(suite))
    }

    /// Completed handshakes whose records `layer` seals and opens.
    fn connections(&self, layer: &str) -> u64 {
        self.tls
            .counter("derp_tls_connections_by_record_layer", ("layer", layer))
    }

    async fn stop(self) {
        self.tls.stop().await;
    }
}

async fn connect(cfg: &ClientConfig) -> Client {
    within("client connect", Client::connect(cfg))
        .await
        .unwrap_or_else(|e| panic!("connect to {}: {e}", cfg.url))
}

/// Packets of these sizes (one byte to the largest DERP packet) from `from` reach `to` whole.
async fn relay_packets(from: &mut Client, from_key: PublicKey, to: &mut Client, to_key: PublicKey) {
    let max = derp_proto::frame::MAX_PACKET_SIZE;
    for size in [1, 100, 1400, 16_000, 16_384, 40_000, max] {
        let packet: Vec<u8> = (0..size).map(|i| (i * 13 + size) as u8).collect();
        from.send_packet(to_key, &packet).await.expect("send");
        loop {
            match within("packet delivery", to.recv()).await.expect("recv") {
                ReceivedFrame::RecvPacket { src, packet: got } => {
                    assert_eq!(src, from_key);
                    assert!(got[..] == packet[..], "a packet of {size} bytes changed");
                    break;
                }
                ReceivedFrame::KeepAlive | ReceivedFrame::Ping(_) => {}
                other => panic!("unexpected frame {other:?}"),
            }
        }
    }
}

/// Two derp-clients on `suite` relay packets of every size both ways through `relay`.
async fn pair_relays(relay: &Relay, suite: rustls::CipherSuite) {
    let (ca, cb) = (relay.client(suite), relay.client(suite));
    let (ka, kb) = (ca.secret_key.public_key(), cb.secret_key.public_key());
    let mut a = connect(&ca).await;
    let mut b = connect(&cb).await;
    assert!(a.used_fast_start(), "TLS 1.3 fast start");
    relay_packets(&mut a, ka, &mut b, kb).await;
    relay_packets(&mut b, kb, &mut a, ka).await;
}

#[tokio::test]
async fn every_suite_relays_through_derpds_record_layer() {
    let relay = Relay::start(TlsRecords::Derpd).await;
    for (n, (suite, _)) in SUITES.into_iter().enumerate() {
        pair_relays(&relay, suite).await;
        assert_eq!(relay.connections("derpd"), 2 * (n as u64 + 1), "{suite:?}");
    }
    assert_eq!(relay.connections("rustls"), 0);
    relay.stop().await;
}

/// A client that ends its TLS 1.3 stream with a TCP FIN alone, without close_notify, is read
/// as having ended it, and counted in `derp_tls_truncations`.
#[tokio::test]
async fn a_stream_ended_without_close_notify_is_counted_as_a_truncation() {
    let relay = Relay::start(TlsRecords::Derpd).await;
    let truncations = || relay.tls.unlabelled_counter("derp_tls_truncations");
    let before = truncations();
    let connector = tokio_rustls::TlsConnector::from(relay.tls_config(SUITES[0].0));
    let tcp = tokio::net::TcpStream::connect(relay.tls.addr)
        .await
        .expect("connect");
    let name = rustls::pki_types::ServerName::try_from(HOST).expect("name");
    let client = within("handshake", connector.connect(name, tcp))
        .await
        .expect("handshake");
    let (mut tcp, _) = client.into_inner();
    tcp.shutdown().await.expect("fin");
    // The relay closes once it has read the end: then the truncation is counted.
    let mut rest = Vec::new();
    within("the relay's end", tcp.read_to_end(&mut rest))
        .await
        .expect("read");
    assert_eq!(relay.connections("derpd"), 1);
    // The count is the process's: other tests' streams may be in it too.
    assert!(truncations() > before, "{before} before");
    relay.stop().await;
}

/// The TLS front catches every handshake's traffic secrets (what lets a connection be handed
/// to another process), in every suite: `derp_tls_uncaptured_handshakes` does not move.
#[tokio::test]
async fn every_handshake_on_derpds_records_has_its_secrets_caught() {
    let relay = Relay::start(TlsRecords::Derpd).await;
    let uncaptured = || {
        relay
            .tls
            .unlabelled_counter("derp_tls_uncaptured_handshakes")
    };
    let before = uncaptured();
    for (suite, _) in SUITES {
        pair_relays(&relay, suite).await;
    }
    assert_eq!(relay.connections("derpd"), 2 * SUITES.len() as u64);
    // The count is the process's, but no test here makes a handshake it would count.
    assert_eq!(uncaptured(), before);
    relay.stop().await;
}

/// With `TlsRecords::Rustls` (derpd's `--tls-records rustls`), TLS 1.3 clients of every
/// suite are served by rustls's buffered connection, and relay as well.
#[tokio::test]
async fn tls_records_rustls_serves_tls13_through_rustls() {
    let relay = Relay::start(TlsRecords::Rustls).await;
    for (n, (suite, _)) in SUITES.into_iter().enumerate() {
        pair_relays(&relay, suite).await;
        assert_eq!(relay.connections("rustls"), 2 * (n as u64 + 1), "{suite:?}");
    }
    assert_eq!(relay.connections("derpd"), 0);
    relay.stop().await;
}

/// `openssl s_client` offering one suite, its input a DERP fast-start session built here.
struct OpenSslClient {
    child: Child,
    // Kept open: the end of its input would not end s_client (-quiet), but nothing here ends
    // it before the test does.
    _stdin: tokio::process::ChildStdin,
    stdout: tokio::process::ChildStdout,
    buf: BytesMut,
    decoder: ClientDecoder,
}

impl OpenSslClient {
    async fn start(relay: &Relay, suite: &str, first: &[u8]) -> Self {
        let found = Command::new("openssl")
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "openssl is not installed: `apt-get install --no-install-recommends openssl`, or \
             run `scripts/test-tools install` (scripts/test does it when it can)"
        );
        let mut child = Command::new("openssl")
            .args([
                "s_client",
                "-quiet",
                "-connect",
                &relay.tls.addr.to_string(),
            ])
            .args(["-servername", HOST, "-tls1_3", "-ciphersuites", suite])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("run openssl s_client");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(first).await.expect("write to s_client");
        let stdout = child.stdout.take().expect("stdout");
        Self {
            child,
            _stdin: stdin,
            stdout,
            buf: BytesMut::new(),
            decoder: ClientDecoder::new(),
        }
    }

    /// The next frame the relay sent, keepalives skipped.
    async fn recv(&mut self) -> RelayToClient {
        loop {
            match self.decoder.decode(&mut self.buf).expect("decode") {
                Some(RelayToClient::KeepAlive) => continue,
                Some(frame) => return frame,
                None => {
                    self.buf.reserve(64 * 1024);
                    let n = within("s_client output", self.stdout.read_buf(&mut self.buf))
                        .await
                        .expect("read");
                    assert!(n > 0, "s_client ended");
                }
            }
        }
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// OpenSSL's client in each suite relays with a rustls client in the same suite: its
/// fast-start request, ClientInfo and a packet go through OpenSSL's records into derpd's
/// record layer; packets of every size come back through derpd's sealing into OpenSSL's.
#[tokio::test]
async fn openssl_relays_in_every_suite() {
    let relay = Relay::start(TlsRecords::Derpd).await;
    for (suite, name) in SUITES {
        let ca = relay.client(suite);
        let ka = ca.secret_key.public_key();
        let mut a = connect(&ca).await;

        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let kb = secret.public_key();
        let mut hs = ClientHandshake::fast_start(
            secret,
            ClientInfo::default(),
            relay.tls.server.public_key(),
        );
        let mut first = BytesMut::from(
            format!(
                "GET /derp HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\
                 Derp-Fast-Start: 1\r\n\r\n"
            )
            .as_bytes(),
        );
        hs.client_info_frame([7; 24], &mut first)
            .expect("client info");
        ClientToRelay::SendPacket {
            dst: ka,
            packet: Bytes::from_static(b"through openssl"),
        }
        .encode(&mut first);
        let mut b = OpenSslClient::start(&relay, name, &first).await;
        assert!(
            matches!(b.recv().await, RelayToClient::ServerKey(k) if k == relay.tls.server.public_key()),
            "{name}"
        );
        match b.recv().await {
            RelayToClient::ServerInfo { sealed } => {
                hs.handle_server_info(&sealed).expect("server info");
            }
            other => panic!("{name}: expected ServerInfo, got {other:?}"),
        }
        loop {
            match within("packet from openssl", a.recv()).await.expect("recv") {
                ReceivedFrame::RecvPacket { src, packet } => {
                    assert_eq!(src, kb);
                    assert_eq!(&packet[..], b"through openssl", "{name}");
                    break;
                }
                ReceivedFrame::KeepAlive | ReceivedFrame::Ping(_) => {}
                other => panic!("unexpected frame {other:?}"),
            }
        }

        let max = derp_proto::frame::MAX_PACKET_SIZE;
        for size in [1, 1400, 16_384, 40_000, max] {
            let packet: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
            a.send_packet(kb, &packet).await.expect("send");
            match b.recv().await {
                RelayToClient::RecvPacket { src, packet: got } => {
                    assert_eq!(src, ka);
                    assert!(got[..] == packet[..], "{name}: {size} bytes changed");
                }
                other => panic!("{name}: expected a packet, got {other:?}"),
            }
        }
        b.stop().await;
    }
    assert_eq!(relay.connections("derpd"), 6);
    relay.stop().await;
}
