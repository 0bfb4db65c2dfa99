//! The traffic secrets captured at the handshake: the capture's bounds, the ClientHello
//! random that names a handshake, and the connections served without captured secrets (on
//! rustls's key schedule, and not handable).

use std::time::Duration;

use rustls::KeyLog;

use super::*;
use crate::tls::capture::SecretCapture;
use crate::tls::hello::client_random;

const CLIENT: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER: &str = "SERVER_TRAFFIC_SECRET_0";

fn log_both(capture: &SecretCapture, random: u8, secret: u8) {
    capture.log(CLIENT, &[random; 32], &[secret; 32]);
    capture.log(SERVER, &[random; 32], &[secret + 1; 32]);
}

#[test]
fn the_capture_keeps_both_secrets_until_taken_and_only_those() {
    let capture = SecretCapture::with_bounds(8, Duration::from_secs(60));
    assert!(capture.will_log(CLIENT) && capture.will_log(SERVER));
    for label in [
        "CLIENT_HANDSHAKE_TRAFFIC_SECRET",
        "SERVER_HANDSHAKE_TRAFFIC_SECRET",
        "EXPORTER_SECRET",
        "CLIENT_RANDOM",
    ] {
        assert!(!capture.will_log(label), "{label}");
        capture.log(label, &[1; 32], &[9; 48]);
    }
    assert!(capture.is_empty());

    log_both(&capture, 1, 10);
    // A SHA-384 suite's secrets are 48 bytes.
    capture.log(CLIENT, &[2; 32], &[20; 48]);
    capture.log(SERVER, &[2; 32], &[21; 48]);
    // One secret only: a handshake that failed between the two (rustls logs both at once).
    capture.log(CLIENT, &[3; 32], &[30; 32]);
    // Not a client random, or no secret rustls would derive.
    capture.log(CLIENT, &[4; 31], &[40; 32]);
    capture.log(CLIENT, &[5; 32], &[50; 49]);
    capture.log(CLIENT, &[6; 32], &[]);
    assert_eq!(capture.len(), 3);

    let one = capture.take(&[1; 32]).expect("both logged");
    assert_eq!((one.client(), one.server()), (&[10; 32][..], &[11; 32][..]));
    let two = capture.take(&[2; 32]).expect("both logged");
    assert_eq!((two.client(), two.server()), (&[20; 48][..], &[21; 48][..]));
    assert!(capture.take(&[1; 32]).is_none(), "taken once");
    assert!(capture.take(&[3; 32]).is_none(), "one secret is no use");
    assert!(capture.is_empty(), "a take removes the entry either way");
    assert!(capture.take(&[7; 32]).is_none());
}

#[test]
fn the_capture_is_bounded_in_entries_and_in_age() {
    let full = SecretCapture::with_bounds(2, Duration::from_secs(60));
    for random in 1..=4 {
        log_both(&full, random, 10 * random);
    }
    assert_eq!(full.len(), 2);
    // The first ones stay; those after are refused, not half kept.
    assert!(full.take(&[1; 32]).is_some());
    assert!(full.take(&[3; 32]).is_none());
    log_both(&full, 5, 50);
    assert!(full.take(&[5; 32]).is_some(), "room again after a take");

    // With no age allowed, every new handshake sweeps the ones before it.
    let aged = SecretCapture::with_bounds(100, Duration::ZERO);
    log_both(&aged, 1, 10);
    assert_eq!(aged.len(), 1);
    log_both(&aged, 2, 20);
    assert_eq!(aged.len(), 1);
    assert!(aged.take(&[1; 32]).is_none(), "swept");
    assert!(aged.take(&[2; 32]).is_some());
}

#[test]
fn the_captures_debug_shows_no_secret() {
    let capture = SecretCapture::with_bounds(8, Duration::from_secs(60));
    log_both(&capture, 1, 0xab);
    let shown = format!("{capture:?}");
    assert!(shown.contains("entries: 1"), "{shown}");
    assert!(!shown.contains("171") && !shown.contains("172"), "{shown}");
}

/// The random read from a ClientHello's bytes is the one rustls's key log names the
/// handshake by, in one record or split over several, and as soon as its bytes are here.
#[test]
fn a_client_hellos_random_is_read_as_rustls_logs_it() {
    let pki = pki();
    let log = Arc::new(SecretLog::default());
    let mut config = (*client_config(&pki, &[&rustls::version::TLS13])).clone();
    config.key_log = log.clone();
    let mut conn = ClientConnection::new(Arc::new(config), name()).expect("client");
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).expect("hello");
    // The client logs nothing before the server's flight.
    let random = client_random(&hello).expect("a random");

    let mut server = rustls::ServerConnection::new(pki.server).expect("server");
    server.read_tls(&mut &hello[..]).expect("read hello");
    server.process_new_packets().expect("process hello");
    let mut flight = Vec::new();
    server.write_tls(&mut flight).expect("server flight");
    conn.read_tls(&mut &flight[..]).expect("read flight");
    conn.process_new_packets().expect("process flight");
    assert_eq!(log.random(), random);

    // The hello split over records, the first shorter than the random's end.
    let body = &hello[HEADER_LEN..];
    let mut split = Vec::new();
    for part in [&body[..20], &body[20..30], &body[30..]] {
        split.extend_from_slice(&[22, 3, 1]);
        split.extend_from_slice(&(part.len() as u16).to_be_bytes());
        split.extend_from_slice(part);
    }
    assert_eq!(client_random(&split), Some(random));
    // Whole once its first 38 bytes are here, before the record is.
    assert_eq!(client_random(&hello[..HEADER_LEN + 38]), Some(random));
    assert_eq!(client_random(&hello[..HEADER_LEN + 37]), None);
    assert_eq!(
        client_random(&split[..HEADER_LEN + 20 + HEADER_LEN + 10]),
        None
    );
    // Not a ClientHello.
    let mut other = hello.clone();
    other[HEADER_LEN] = 2;
    assert_eq!(client_random(&other), None);
    assert_eq!(client_random(&[23, 3, 3, 0, 40]), None);
    assert_eq!(client_random(&[22, 3, 1, 0, 0, 22, 3, 1]), None);
    assert_eq!(client_random(&[]), None);
}

/// As the TLS front calls it: the ClientHello read already (to pick the path and the config),
/// and handed to [`accept`] with whatever came with it. The process's capture names the
/// handshake by that hello's random, and the stream runs the key schedule itself.
#[tokio::test]
async fn a_client_hello_read_before_the_handshake_still_names_it() {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connector = TlsConnector::from(client_config(&pki, &[&rustls::version::TLS13]));
    let (client, server) = tokio::join!(
        async {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            connector.connect(name(), tcp).await.expect("client")
        },
        async {
            let (mut tcp, _) = listener.accept().await.expect("accept");
            let mut received = Vec::new();
            while matches!(ClientHello::parse(&received), ClientHello::Incomplete) {
                let n = tcp.read_buf(&mut received).await.expect("read");
                assert!(n > 0, "the client left");
            }
            assert!(matches!(
                ClientHello::parse(&received),
                ClientHello::Hello { tls13: true, .. }
            ));
            accept(tcp, received, pki.server.clone())
                .await
                .expect("server handshake")
                .stream
        }
    );
    assert!(matches!(server.read.state.schedule, Schedule::Known(_)));
    let (rx, tx) = server.snapshot().expect("handable");
    assert_eq!(rx.suite(), tx.suite());
    drop(client);
}

/// A handshake whose secrets were not captured is served as before the capture existed: on
/// rustls's key schedule, key updates both ways included. Only its state cannot be copied
/// out.
#[tokio::test]
async fn a_handshake_without_captured_secrets_is_served_on_rustlss_schedule() {
    let pki = pki();
    let mut plain = (*pki.server).clone();
    plain.key_log = Arc::new(rustls::NoKeyLog);
    plain.enable_secret_extraction = true;
    let uncaptured_before = uncaptured();
    let (server, client) = uncaptured_pair(&pki, Arc::new(plain), SecretCapture::process()).await;
    assert!(uncaptured() > uncaptured_before);
    key_updates_both_ways_on_rustlss_schedule(server, client).await;
}

/// Secrets that do not yield the keys rustls handed over (another handshake's, logged under
/// the same ClientHello random) are not used: the connection is served on rustls's schedule.
#[tokio::test]
async fn captured_secrets_that_do_not_yield_the_handshakes_keys_are_not_used() {
    /// Logs into the capture with one bit of the server's secret changed.
    #[derive(Debug)]
    struct Spoilt(Arc<SecretCapture>);

    impl KeyLog for Spoilt {
        fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
            let mut secret = secret.to_vec();
            if label == SERVER {
                secret[0] ^= 1;
            }
            self.0.log(label, client_random, &secret);
        }

        fn will_log(&self, label: &str) -> bool {
            self.0.will_log(label)
        }
    }

    let pki = pki();
    let capture = Arc::new(SecretCapture::with_bounds(8, Duration::from_secs(60)));
    let mut spoilt = (*pki.server).clone();
    spoilt.key_log = Arc::new(Spoilt(capture.clone()));
    let (server, client) = uncaptured_pair(&pki, Arc::new(spoilt), &capture).await;
    // Taken all the same: nothing is left behind.
    assert!(capture.is_empty());
    key_updates_both_ways_on_rustlss_schedule(server, client).await;
}

/// A handshake under `config` taking secrets from `capture`, whose stream runs rustls's
/// schedule and cannot be copied out.
async fn uncaptured_pair(
    pki: &Pki,
    config: Arc<ServerConfig>,
    capture: &SecretCapture,
) -> (TlsStream, ClientStream<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connector = TlsConnector::from(client_config(pki, &[&rustls::version::TLS13]));
    let (client, server) = tokio::join!(
        async {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            connector.connect(name(), tcp).await.expect("client")
        },
        async {
            let (tcp, _) = listener.accept().await.expect("accept");
            handshake::accept_with(tcp, Vec::new(), config, capture, Some(3))
                .await
                .expect("server handshake")
        }
    );
    let server = server.stream;
    assert!(matches!(server.read.state.schedule, Schedule::Rustls(_)));
    assert!(matches!(server.write.state.schedule, Schedule::Rustls(_)));
    assert_eq!(server.read.snapshot().err(), Some(NotHandable::NotCaptured));
    assert_eq!(
        server.write.snapshot().err(),
        Some(NotHandable::NotCaptured)
    );
    (server, client)
}

/// The client updates its key asking for an answer, then the server seals enough records
/// to update its own key twice.
async fn key_updates_both_ways_on_rustlss_schedule(
    mut server: TlsStream,
    mut client: ClientStream<TcpStream>,
) {
    client.get_mut().1.refresh_traffic_keys().expect("refresh");
    client.write_all(b"after").await.expect("write");
    client.flush().await.expect("flush");
    let mut buf = [0u8; 5];
    server
        .read_exact(&mut buf)
        .await
        .expect("read under the new key");
    assert_eq!(&buf, b"after");
    assert!(update_requested(&server));
    let sent = pattern(8 * MAX_FRAGMENT);
    for chunk in sent.chunks(MAX_FRAGMENT) {
        server.write_all(chunk).await.expect("write");
        assert!(server.write.state.keys.seq <= 2);
    }
    server.flush().await.expect("flush");
    let mut got = vec![0u8; sent.len()];
    client.read_exact(&mut got).await.expect("client follows");
    assert!(got == sent);
}
