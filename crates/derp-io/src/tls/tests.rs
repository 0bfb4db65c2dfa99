//! The record layer's tests: against rustls's client here and in `suites` (every suite),
//! against OpenSSL's in `openssl`, and beside rustls's own server in `differential`; the
//! alerts it sends in `alerts`.

mod alerts;
mod capture;
mod differential;
mod handover;
mod openssl;
mod suites;

use std::io::{self, Read as _, Write as _};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use ring::aead::Aad;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::ServerConfig;
use rustls::{ClientConfig, ClientConnection, RootCertStore, SupportedProtocolVersion};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream as ClientStream;

use super::fuzzing::{Suite, TrafficSecret};
use super::hello::MAX_HELLO_RECORDS;
use super::keys::Keys;
use super::record::{
    CONTENT_ALERT, CONTENT_APPLICATION_DATA, CONTENT_HANDSHAKE, HANDSHAKE_KEY_UPDATE, HEADER_LEN,
    MAX_FRAGMENT, MAX_IDLE_RECORDS, Schedule, TAG_LEN,
};
use super::*;

struct Pki {
    server: Arc<ServerConfig>,
    root: CertificateDer<'static>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pki() -> Pki {
    let key = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
    let root = key.cert.der().clone();
    let private = PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![root.clone()], private)
        .expect("server config");
    configure(&mut server);
    Pki {
        server: Arc::new(server),
        root,
    }
}

fn client_config(pki: &Pki, versions: &[&'static SupportedProtocolVersion]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(pki.root.clone()).expect("root");
    Arc::new(
        ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

fn name() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("name")
}

/// A handshake between a tokio-rustls client and [`accept`] over loopback.
async fn pair() -> (TlsStream, ClientStream<TcpStream>) {
    let pki = pki();
    handshake(&pki, client_config(&pki, &[&rustls::version::TLS13])).await
}

/// A handshake between a tokio-rustls client with `config` and [`accept`] under `pki`.
async fn handshake(pki: &Pki, config: Arc<ClientConfig>) -> (TlsStream, ClientStream<TcpStream>) {
    handshake_with(pki, config, None).await
}

/// [`handshake`], with the server's sending key updated after `records_per_key` records
/// instead of the suite's limit.
async fn handshake_with(
    pki: &Pki,
    config: Arc<ClientConfig>,
    records_per_key: Option<u64>,
) -> (TlsStream, ClientStream<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connector = TlsConnector::from(config);
    let (client, server) = tokio::join!(
        async {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            connector
                .connect(name(), tcp)
                .await
                .expect("client handshake")
        },
        async {
            let (tcp, _) = listener.accept().await.expect("accept");
            handshake::accept_with(
                tcp,
                Vec::new(),
                pki.server.clone(),
                SecretCapture::process(),
                records_per_key,
            )
            .await
            .expect("server handshake")
        }
    );
    // Every stream here runs the key schedule itself, as every served one does whose
    // secrets were captured: the key update tests test that path.
    let schedules = (
        &server.stream.read.state.schedule,
        &server.stream.write.state.schedule,
    );
    assert!(
        matches!(schedules, (Schedule::Known(_), Schedule::Known(_))),
        "{schedules:?}"
    );
    (server.stream, client)
}

/// A TLS 1.3 client that offers `suite` alone, logging its traffic secrets to `log`.
fn suite_client(pki: &Pki, suite: Suite, log: Arc<SecretLog>) -> Arc<ClientConfig> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .retain(|s| s.suite() == suite.cipher_suite());
    assert_eq!(
        provider.cipher_suites.len(),
        1,
        "{suite:?} in ring's provider"
    );
    let mut roots = RootCertStore::empty();
    roots.add(pki.root.clone()).expect("root");
    let mut config = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.key_log = log;
    Arc::new(config)
}

/// The traffic secrets a client logged (the SSLKEYLOGFILE labels), and the ClientHello
/// random it logged them under.
#[derive(Debug, Default)]
struct SecretLog(Mutex<Vec<(String, Vec<u8>)>>, Mutex<Option<Vec<u8>>>);

impl rustls::KeyLog for SecretLog {
    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        let mut log = self.0.lock().expect("log");
        log.push((label.to_owned(), secret.to_vec()));
        *self.1.lock().expect("random") = Some(client_random.to_vec());
    }
}

impl SecretLog {
    fn random(&self) -> [u8; 32] {
        let random = self.1.lock().expect("random").clone();
        random
            .expect("a secret logged")
            .try_into()
            .expect("32 bytes")
    }

    fn secret(&self, suite: Suite, label: &str) -> TrafficSecret {
        let log = self.0.lock().expect("log");
        let (_, bytes) = log
            .iter()
            .find(|(l, _)| l == label)
            .unwrap_or_else(|| panic!("no {label} logged"));
        TrafficSecret::new(suite, bytes).expect("secret length")
    }
}

/// A client's raw socket after a rustls client's handshake, and the traffic secrets it
/// logged, to send records no TLS library would and to read the server's records as sent.
struct Peer {
    tcp: TcpStream,
    tx: TrafficSecret,
    tx_keys: Keys,
    rx: TrafficSecret,
    rx_keys: Keys,
    /// The server's key before its last KeyUpdate, as it ended (its `seq` the records it
    /// sealed).
    rx_keys_before: Keys,
    received: Vec<u8>,
}

/// What the server sent, record by record (session tickets left out).
#[derive(Debug, PartialEq, Eq)]
enum Sent {
    Data(Vec<u8>),
    /// A KeyUpdate, and whether it asked for one back; the peer now opens under the next key.
    KeyUpdate(bool),
    Alert(u8, u8),
    /// The end of the stream.
    End,
}

/// A handshake in `suite` between a rustls client and the server, which then hands the
/// client's socket and secrets over as a [`Peer`].
async fn peer_pair(pki: &Pki, suite: Suite, records_per_key: Option<u64>) -> (TlsStream, Peer) {
    let log = Arc::new(SecretLog::default());
    let config = suite_client(pki, suite, log.clone());
    let (server, client) = handshake_with(pki, config, records_per_key).await;
    (server, Peer::from_client(client, &log, suite))
}

impl Peer {
    /// The raw side of a rustls client that has just finished its handshake in `suite`.
    fn from_client(client: ClientStream<TcpStream>, log: &SecretLog, suite: Suite) -> Self {
        // The client stopped reading with its Finished; everything the server sent after
        // it, session tickets first, is still in the socket.
        let (tcp, _) = client.into_inner();
        let tx = log.secret(suite, "CLIENT_TRAFFIC_SECRET_0");
        let rx = log.secret(suite, "SERVER_TRAFFIC_SECRET_0");
        Self {
            tcp,
            tx_keys: tx.keys(0),
            tx,
            rx_keys: rx.keys(0),
            rx_keys_before: rx.keys(0),
            rx,
            received: Vec::new(),
        }
    }
}

impl Peer {
    /// A record whose inner plaintext is `inner` (content, type, padding).
    fn seal(&mut self, inner: &[u8]) -> Vec<u8> {
        seal_raw(&mut self.tx_keys, inner)
    }

    /// A record of application data followed by `padding` zeros.
    fn data(&mut self, data: &[u8], padding: usize) -> Vec<u8> {
        let mut inner = data.to_vec();
        inner.push(CONTENT_APPLICATION_DATA);
        inner.resize(inner.len() + padding, 0);
        self.seal(&inner)
    }

    /// A KeyUpdate, after which this side seals under its next key.
    fn key_update(&mut self, requested: bool) -> Vec<u8> {
        let record = self.seal(&[
            HANDSHAKE_KEY_UPDATE,
            0,
            0,
            1,
            u8::from(requested),
            CONTENT_HANDSHAKE,
        ]);
        self.tx = self.tx.next();
        self.tx_keys = self.tx.keys(0);
        record
    }

    /// A close_notify alert.
    fn close_notify(&mut self) -> Vec<u8> {
        self.seal(&[1, 0, CONTENT_ALERT])
    }

    async fn send(&mut self, records: &[u8]) {
        self.tcp.write_all(records).await.expect("peer write");
    }

    /// The server's next record, opened; follows the server's KeyUpdates.
    async fn recv(&mut self) -> Sent {
        const NEW_SESSION_TICKET: u8 = 4;
        loop {
            while self.received.len() < HEADER_LEN
                || self.received.len()
                    < HEADER_LEN
                        + usize::from(u16::from_be_bytes([self.received[3], self.received[4]]))
            {
                let mut chunk = [0u8; 4096];
                // A reset (the server closed with bytes unread) ends the stream too.
                let n = self.tcp.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    assert!(self.received.is_empty(), "the server cut a record short");
                    return Sent::End;
                }
                self.received.extend_from_slice(&chunk[..n]);
            }
            let len = usize::from(u16::from_be_bytes([self.received[3], self.received[4]]));
            let mut record: Vec<u8> = self.received.drain(..HEADER_LEN + len).collect();
            let header: [u8; HEADER_LEN] = record[..HEADER_LEN].try_into().expect("header");
            assert_eq!(
                header[..3],
                [CONTENT_APPLICATION_DATA, 3, 3],
                "outer header"
            );
            let nonce = self.rx_keys.nonce();
            let inner = self
                .rx_keys
                .key
                .open_in_place(nonce, Aad::from(header), &mut record[HEADER_LEN..])
                .expect("the server's record opens")
                .to_vec();
            self.rx_keys.seq += 1;
            let (&ty, content) = inner.split_last().expect("a content type");
            match (ty, content) {
                (CONTENT_APPLICATION_DATA, data) => return Sent::Data(data.to_vec()),
                (CONTENT_HANDSHAKE, [NEW_SESSION_TICKET, ..]) => continue,
                (CONTENT_HANDSHAKE, [HANDSHAKE_KEY_UPDATE, 0, 0, 1, request]) => {
                    self.rx = self.rx.next();
                    self.rx_keys_before = std::mem::replace(&mut self.rx_keys, self.rx.keys(0));
                    return Sent::KeyUpdate(*request == 1);
                }
                (CONTENT_ALERT, [level, description]) => return Sent::Alert(*level, *description),
                other => panic!("unexpected record from the server: {other:?}"),
            }
        }
    }
}

/// Whether the peer asked for a KeyUpdate the server has yet to send.
fn update_requested(server: &TlsStream) -> bool {
    server
        .read
        .state
        .shared
        .update_requested
        .load(Ordering::Acquire)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn bytes_cross_both_ways_in_records_of_every_size() {
    let (server, client) = pair().await;
    let sent = pattern(1 << 20);
    // The server echoes whatever it reads, in the sizes it reads them.
    let echo = tokio::spawn(async move {
        let (mut r, mut w) = server.into_split();
        let mut buf = vec![0u8; 40_000];
        loop {
            let n = r.read(&mut buf).await.expect("server read");
            if n == 0 {
                break;
            }
            // Split each write in two slices, so records gather across them.
            let (a, b) = buf[..n].split_at(n / 3);
            let mut done = 0;
            while done < n {
                let iov = if done < a.len() {
                    vec![io::IoSlice::new(&a[done..]), io::IoSlice::new(b)]
                } else {
                    vec![io::IoSlice::new(&b[done - a.len()..])]
                };
                done += w.write_vectored(&iov).await.expect("server write");
            }
            w.flush().await.expect("flush");
        }
        w.shutdown().await.expect("shutdown");
    });
    let (mut cr, mut cw) = tokio::io::split(client);
    let to_send = sent.clone();
    let writer = tokio::spawn(async move {
        // Sizes from one byte to more than a record.
        let mut at = 0;
        let mut size = 1;
        while at < to_send.len() {
            let end = (at + size).min(to_send.len());
            cw.write_all(&to_send[at..end]).await.expect("client write");
            at = end;
            size = size * 3 % 20_011 + 1;
        }
        cw.flush().await.expect("client flush");
        cw.shutdown().await.expect("client shutdown");
    });
    let mut received = Vec::new();
    cr.read_to_end(&mut received)
        .await
        .expect("echo ends with close_notify");
    writer.await.expect("writer");
    echo.await.expect("echo");
    assert_eq!(received.len(), sent.len());
    assert!(received == sent, "echoed bytes differ");
}

#[tokio::test]
async fn data_sent_with_the_clients_finished_is_not_lost() {
    records_behind_the_clients_finished(false).await;
}

#[tokio::test]
async fn a_key_update_sent_with_the_clients_finished_is_answered() {
    records_behind_the_clients_finished(true).await;
}

/// A blocking client whose request (and, with `update`, a KeyUpdate asking for an answer
/// before it) follows its Finished in the same write; the server must read the request and
/// answer under keys the client follows.
async fn records_behind_the_clients_finished(update: bool) {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = client_config(&pki, &[&rustls::version::TLS13]);
    let client = std::thread::spawn(move || {
        let mut sock = std::net::TcpStream::connect(addr).expect("connect");
        let mut conn = ClientConnection::new(config, name()).expect("client");
        if !update {
            conn.writer().write_all(b"early request").expect("queue");
        }
        let mut updated = !update;
        while conn.is_handshaking() || conn.wants_write() {
            if !conn.is_handshaking() && !updated {
                // Finished, then the KeyUpdate, then the request under the new key.
                conn.refresh_traffic_keys().expect("key update");
                conn.writer().write_all(b"early request").expect("queue");
                updated = true;
            }
            while conn.wants_write() {
                conn.write_tls(&mut sock).expect("write tls");
            }
            if conn.is_handshaking() {
                conn.read_tls(&mut sock).expect("read tls");
                conn.process_new_packets().expect("process");
            }
        }
        // Wait for the answer, then close.
        let mut answer = Vec::new();
        loop {
            conn.read_tls(&mut sock).expect("read tls");
            let state = conn.process_new_packets().expect("process");
            if state.plaintext_bytes_to_read() > 0 {
                let mut buf = vec![0; state.plaintext_bytes_to_read()];
                conn.reader().read_exact(&mut buf).expect("plaintext");
                answer.extend_from_slice(&buf);
            }
            if answer.len() >= 2 {
                return answer;
            }
        }
    });
    let (tcp, _) = listener.accept().await.expect("accept");
    let mut server = accept(tcp, Vec::new(), pki.server.clone())
        .await
        .expect("handshake")
        .stream;
    let mut request = [0u8; 13];
    server.read_exact(&mut request).await.expect("request");
    assert_eq!(&request, b"early request");
    server.write_all(b"ok").await.expect("answer");
    server.flush().await.expect("flush");
    if update {
        // The KeyUpdate went out under the old key, the answer under the new one.
        assert_eq!(server.write.state.keys.seq, 1);
    }
    let answer = tokio::task::spawn_blocking(move || client.join().expect("client"))
        .await
        .expect("join");
    assert_eq!(answer, b"ok");
}

#[tokio::test]
async fn a_clients_key_update_is_followed_and_answered() {
    let (mut server, mut client) = pair().await;
    client.write_all(b"before").await.expect("write");
    client.flush().await.expect("flush");
    let mut buf = [0u8; 6];
    server.read_exact(&mut buf).await.expect("read");
    assert_eq!(&buf, b"before");

    // rustls asks for an answer with its update.
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

    server.write_all(b"answer").await.expect("write");
    server.flush().await.expect("flush");
    // The KeyUpdate went out under the old key, the answer under the new one.
    assert_eq!(server.write.state.keys.seq, 1);
    assert!(!update_requested(&server));
    let mut buf = [0u8; 6];
    client.read_exact(&mut buf).await.expect("client reads");
    assert_eq!(&buf, b"answer");
}

#[tokio::test]
async fn the_server_updates_its_key_before_the_limit() {
    let (mut server, mut client) = pair().await;
    server.write.state.update_at = 3;
    let sent = pattern(10 * MAX_FRAGMENT);
    for chunk in sent.chunks(MAX_FRAGMENT) {
        server.write_all(chunk).await.expect("write");
        server.flush().await.expect("flush");
        assert!(server.write.state.keys.seq <= 3);
    }
    let mut received = vec![0u8; sent.len()];
    client
        .read_exact(&mut received)
        .await
        .expect("client follows each update");
    assert!(received == sent);
}

#[tokio::test]
async fn close_notify_ends_each_direction_cleanly() {
    let (mut server, mut client) = pair().await;
    client.shutdown().await.expect("client close_notify");
    let mut buf = Vec::new();
    assert_eq!(server.read_to_end(&mut buf).await.expect("server eof"), 0);
    server.shutdown().await.expect("server close_notify");
    // rustls reports an end without close_notify as an error; this one is clean.
    assert_eq!(client.read_to_end(&mut buf).await.expect("client eof"), 0);
}

/// Nothing follows the server's close_notify: a write after it is refused (`BrokenPipe`, as
/// TCP refuses a write after its own shutdown) and seals nothing, also while the
/// close_notify still waits for the socket, where a write would otherwise queue behind it.
#[tokio::test]
async fn writes_after_close_notify_are_refused() {
    let pki = pki();
    let (mut server, mut peer) = peer_pair(&pki, Suite::Aes128Gcm, None).await;
    server.shutdown().await.expect("close_notify");
    let sealed = server.write.state.keys.seq;
    let e = server.write_all(b"late").await.expect_err("refused");
    assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}");
    assert!(e.to_string().contains("close_notify"), "{e}");
    assert_eq!(server.write.state.keys.seq, sealed);
    assert_eq!(peer.recv().await, Sent::Alert(1, 0));
    assert_eq!(peer.recv().await, Sent::End);

    let (mut server, mut peer) = peer_pair(&pki, Suite::Chacha20Poly1305, None).await;
    // Small socket buffers, so that the socket pushes back soon.
    socket2::SockRef::from(server.tcp())
        .set_send_buffer_size(4096)
        .expect("send buffer");
    socket2::SockRef::from(&peer.tcp)
        .set_recv_buffer_size(4096)
        .expect("receive buffer");
    let mut cx = Context::from_waker(Waker::noop());
    let chunk = pattern(MAX_FRAGMENT);
    let mut written = 0;
    loop {
        match Pin::new(&mut server).poll_write(&mut cx, &chunk) {
            Poll::Ready(Ok(n)) => written += n,
            Poll::Ready(Err(e)) => panic!("write: {e}"),
            Poll::Pending => break,
        }
    }
    assert!(Pin::new(&mut server).poll_shutdown(&mut cx).is_pending());
    assert!(server.write.state.close_sent);
    match Pin::new(&mut server).poll_write(&mut cx, b"late") {
        Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}"),
        other => panic!("a write behind close_notify: {other:?}"),
    }
    let reader = tokio::spawn(async move {
        let mut got = 0;
        loop {
            match peer.recv().await {
                Sent::Data(data) => got += data.len(),
                Sent::Alert(1, 0) => break,
                other => panic!("before close_notify: {other:?}"),
            }
        }
        assert_eq!(peer.recv().await, Sent::End, "after close_notify");
        got
    });
    server.shutdown().await.expect("close_notify");
    drop(server);
    assert_eq!(reader.await.expect("reader"), written);
}

/// The end of the stream between records without close_notify reads as the end (DERP
/// frames delimit themselves), told apart from close_notify: a truncation, counted.
#[tokio::test]
async fn an_end_without_close_notify_reads_as_the_end_and_counts_as_a_truncation() {
    let (mut server, mut tcp, _conn) = raw_pair().await;
    let before = truncations();
    tcp.shutdown().await.expect("fin");
    let mut buf = Vec::new();
    assert_eq!(server.read_to_end(&mut buf).await.expect("an end"), 0);
    assert!(server.read.state.truncated);
    // Other tests' streams count too: at least this one.
    assert!(truncations() > before);
    assert_eq!(server.read(&mut [0; 8]).await.expect("still the end"), 0);

    let (mut server, mut client) = pair().await;
    client.shutdown().await.expect("close_notify");
    assert_eq!(server.read_to_end(&mut buf).await.expect("an end"), 0);
    assert!(!server.read.state.truncated);
}

/// The server's stream after a handshake, and the client's raw socket with the client's
/// TLS state, to send records the client would not.
async fn raw_pair() -> (TlsStream, TcpStream, ClientConnection) {
    let (server, client) = pair().await;
    let (tcp, conn) = client.into_inner();
    (server, tcp, conn)
}

async fn read_error(server: &mut TlsStream) -> io::Error {
    let mut buf = [0u8; 64];
    server
        .read(&mut buf)
        .await
        .expect_err("the record is refused")
}

#[tokio::test]
async fn a_tampered_record_is_refused() {
    let (mut server, mut tcp, mut conn) = raw_pair().await;
    conn.writer().write_all(b"hello").expect("queue");
    let mut record = Vec::new();
    conn.write_tls(&mut record).expect("record");
    let last = record.len() - 1;
    record[last] ^= 1;
    tcp.write_all(&record).await.expect("write");
    let e = read_error(&mut server).await;
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("authentication"), "{e}");
}

#[tokio::test]
async fn records_that_break_the_protocol_are_refused() {
    for (record, expect) in [
        // A plaintext handshake record after the handshake.
        (vec![22, 3, 3, 0, 4, 24, 0, 0, 1], "record type"),
        // Longer than any record may be.
        (vec![23, 3, 3, 0x48, 0x01], "overflow"),
        // Too short to hold a tag.
        (vec![23, 3, 3, 0, 3, 1, 2, 3], "too short"),
    ] {
        let (mut server, mut tcp, _conn) = raw_pair().await;
        tcp.write_all(&record).await.expect("write");
        let e = read_error(&mut server).await;
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(expect), "{e}");
    }

    // A record cut short by the end of the stream.
    let (mut server, mut tcp, _conn) = raw_pair().await;
    tcp.write_all(&[23, 3, 3, 0, 40, 1, 2])
        .await
        .expect("write");
    tcp.shutdown().await.expect("fin");
    assert_eq!(
        read_error(&mut server).await.kind(),
        io::ErrorKind::UnexpectedEof
    );
}

#[tokio::test]
async fn an_idle_connection_holds_no_record_buffers() {
    let (server, mut client) = pair().await;
    let (mut r, mut w) = server.into_split();
    client.write_all(&pattern(50_000)).await.expect("write");
    client.flush().await.expect("flush");
    let mut got = vec![0u8; 50_000];
    r.read_exact(&mut got).await.expect("read");
    w.write_all(&pattern(50_000)).await.expect("write");
    w.flush().await.expect("flush");
    // A burst leaves both buffers allocated.
    assert!(r.state.buf.capacity() > 0);
    assert!(w.state.out.capacity() > 0);
    r.release_idle();
    w.shrink_idle();
    assert_eq!(r.state.buf.capacity(), 0);
    assert_eq!(w.state.out.capacity(), 0);

    // Nothing buffered and nothing sent: not ready. Then the client writes, and it is.
    let mut cx = Context::from_waker(Waker::noop());
    assert!(r.poll_ready(&mut cx).is_pending());
    client.write_all(b"x").await.expect("write");
    client.flush().await.expect("flush");
    std::future::poll_fn(|cx| r.poll_ready(cx))
        .await
        .expect("ready");
    let mut one = [0u8; 1];
    r.read_exact(&mut one).await.expect("read");
    assert_eq!(&one, b"x");
}

/// What an idle connection's record layer keeps besides its socket: two boxed halves, each
/// mostly ring's expanded AEAD key (576 bytes) and, since the key schedule runs here, its
/// direction's traffic secret (49 bytes); and the small allocation they share. rustls's
/// connection state, 560 bytes inline and its key schedule on the heap, was kept in the
/// shared allocation for key updates before (1,944 bytes in all besides that heap): it is
/// dropped after the handshake, and nothing like it may come back unnoticed.
#[test]
fn an_idle_connections_record_layer_state_is_the_keys_and_little_more() {
    use std::mem::size_of;
    let shared = size_of::<record::Shared>();
    let halves = size_of::<TlsRead>() + size_of::<TlsWrite>();
    assert!(shared <= 32, "the halves' shared state is {shared} bytes");
    assert!(size_of::<Schedule>() <= 56);
    assert!(
        halves + shared <= 1_500,
        "an idle connection's record layer is {} bytes",
        halves + shared
    );
}

#[tokio::test]
async fn client_hellos_are_read_for_their_version_and_alpn() {
    let pki = pki();
    let hello = |versions: &[&'static SupportedProtocolVersion], alpn: &[&[u8]]| {
        let mut config = (*client_config(&pki, versions)).clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let mut conn = ClientConnection::new(Arc::new(config), name()).expect("client");
        let mut bytes = Vec::new();
        conn.write_tls(&mut bytes).expect("hello");
        bytes
    };
    let offered = |tls13: bool, alpn: &[&[u8]]| ClientHello::Hello {
        tls13,
        alpn: alpn.iter().map(|p| p.to_vec()).collect(),
    };
    let both = hello(&[&rustls::version::TLS13, &rustls::version::TLS12], &[]);
    assert_eq!(ClientHello::parse(&both), offered(true, &[]));
    assert_eq!(
        ClientHello::parse(&hello(&[&rustls::version::TLS13], &[b"acme-tls/1"])),
        offered(true, &[b"acme-tls/1"])
    );
    assert_eq!(
        ClientHello::parse(&hello(&[&rustls::version::TLS12], &[b"h2", b"http/1.1"])),
        offered(false, &[b"h2", b"http/1.1"])
    );
    // Bytes after the hello do not matter.
    let mut longer = both.clone();
    longer.extend_from_slice(b"\x17\x03\x03");
    assert_eq!(ClientHello::parse(&longer), offered(true, &[]));
    // Not whole yet, or not a ClientHello at all.
    assert_eq!(
        ClientHello::parse(&both[..both.len() - 1]),
        ClientHello::Incomplete
    );
    assert_eq!(ClientHello::parse(&both[..3]), ClientHello::Incomplete);
    assert_eq!(ClientHello::parse(&[]), ClientHello::Incomplete);
    assert_eq!(
        ClientHello::parse(b"GET / HTTP/1.1\r\n\r\n"),
        ClientHello::Unknown
    );
    let mut bad = both.clone();
    bad[HEADER_LEN] = 2; // a ServerHello's type
    assert_eq!(ClientHello::parse(&bad), ClientHello::Unknown);
    // Empty handshake records, and a hello in more records than anyone sends.
    let mut empty = vec![22, 3, 1, 0, 0];
    empty.extend_from_slice(&both);
    assert_eq!(ClientHello::parse(&empty), ClientHello::Unknown);
    let mut dribble = Vec::new();
    for b in &both[HEADER_LEN..HEADER_LEN + MAX_HELLO_RECORDS + 1] {
        dribble.extend_from_slice(&[22, 3, 1, 0, 1, *b]);
    }
    assert_eq!(ClientHello::parse(&dribble), ClientHello::Unknown);

    // The same hello split over two records.
    let body = &both[HEADER_LEN..];
    let (a, b) = body.split_at(100);
    let mut split = Vec::new();
    for part in [a, b] {
        split.extend_from_slice(&[22, 3, 1]);
        split.extend_from_slice(&(part.len() as u16).to_be_bytes());
        split.extend_from_slice(part);
    }
    assert_eq!(
        ClientHello::parse(&split[..split.len() - 10]),
        ClientHello::Incomplete
    );
    assert_eq!(ClientHello::parse(&split), offered(true, &[]));
}

#[tokio::test]
async fn one_read_gathers_buffered_records_and_a_bad_one_fails_the_next() {
    let (mut server, mut tcp, mut conn) = raw_pair().await;
    let mut records = Vec::new();
    for part in [&b"one "[..], b"two ", b"three"] {
        conn.writer().write_all(part).expect("queue");
        conn.write_tls(&mut records).expect("record");
    }
    conn.writer().write_all(b"spoilt").expect("queue");
    let good = records.len();
    conn.write_tls(&mut records).expect("record");
    let last = records.len() - 1;
    records[last] ^= 1;
    assert!(records.len() > good);
    // Everything arrives at once, so the server's first read sees all four records.
    tcp.write_all(&records).await.expect("write");
    let mut buf = [0u8; 1024];
    let n = server.read(&mut buf).await.expect("the good records");
    assert_eq!(&buf[..n], b"one two three");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("authentication"), "{e}");
}

#[tokio::test]
async fn a_failed_handshake_tells_the_client_why() {
    let pki = pki();
    // A server that speaks only TLS 1.3, a client that speaks only TLS 1.2.
    let mut server = (*pki.server).clone();
    server.enable_secret_extraction = true;
    let server = Arc::new(
        ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("versions")
            .with_no_client_auth()
            .with_cert_resolver(server.cert_resolver.clone()),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connector = TlsConnector::from(client_config(&pki, &[&rustls::version::TLS12]));
    let (client, accepted) = tokio::join!(
        async {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            connector.connect(name(), tcp).await
        },
        async {
            let (tcp, _) = listener.accept().await.expect("accept");
            accept(tcp, Vec::new(), server).await
        }
    );
    assert!(matches!(accepted, Err(AcceptError::Tls(_))), "{accepted:?}");
    let e = client.expect_err("the client is refused");
    assert!(e.to_string().contains("ProtocolVersion"), "{e}");
}

/// The server's stream, the client's raw socket, and the client's sending keys, to seal
/// records no TLS library would send.
async fn sealing_pair() -> (TlsStream, TcpStream, Keys) {
    let pki = pki();
    let mut config = (*client_config(&pki, &[&rustls::version::TLS13])).clone();
    config.enable_secret_extraction = true;
    let (server, client) = handshake(&pki, Arc::new(config)).await;
    let (tcp, conn) = client.into_inner();
    let secrets = conn.dangerous_extract_secrets().expect("client secrets");
    (server, tcp, Keys::new(secrets.tx).expect("keys"))
}

/// A record sealed under `keys` whose inner plaintext is `inner` (content, type, padding).
fn seal_raw(keys: &mut Keys, inner: &[u8]) -> Vec<u8> {
    seal_with_version(keys, [3, 3], inner)
}

/// [`seal_raw`], with `version` as the header's legacy version.
fn seal_with_version(keys: &mut Keys, version: [u8; 2], inner: &[u8]) -> Vec<u8> {
    let len = u16::try_from(inner.len() + TAG_LEN).expect("record length");
    let header = [
        CONTENT_APPLICATION_DATA,
        version[0],
        version[1],
        (len >> 8) as u8,
        len as u8,
    ];
    let mut record = header.to_vec();
    record.extend_from_slice(inner);
    let tag = keys
        .key
        .seal_in_place_separate_tag(keys.nonce(), Aad::from(header), &mut record[HEADER_LEN..])
        .expect("seal");
    record.extend_from_slice(tag.as_ref());
    keys.seq += 1;
    record
}

#[tokio::test]
async fn records_a_client_library_would_not_send_are_refused() {
    // Inner plaintext one byte over 2^14 + 1 (RFC 8446, section 5.4).
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut inner = vec![b'x'; MAX_FRAGMENT];
    inner.extend_from_slice(&[CONTENT_APPLICATION_DATA, 0]);
    tcp.write_all(&seal_raw(&mut keys, &inner))
        .await
        .expect("write");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("overflow"), "{e}");

    // The largest allowed, padding included, is fine.
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut inner = vec![b'y'; MAX_FRAGMENT - 10];
    inner.push(CONTENT_APPLICATION_DATA);
    inner.extend_from_slice(&[0; 10]);
    tcp.write_all(&seal_raw(&mut keys, &inner))
        .await
        .expect("write");
    let mut got = vec![0u8; MAX_FRAGMENT - 10];
    server.read_exact(&mut got).await.expect("padded record");
    assert!(got.iter().all(|&b| b == b'y'));

    // A run of records without data: empty application data, then padding only.
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut flood = Vec::new();
    for _ in 0..=MAX_IDLE_RECORDS {
        flood.extend_from_slice(&seal_raw(&mut keys, &[CONTENT_APPLICATION_DATA]));
    }
    tcp.write_all(&flood).await.expect("write");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("without data"), "{e}");
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    tcp.write_all(&seal_raw(&mut keys, &[0, 0, 0]))
        .await
        .expect("write");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("content type"), "{e}");

    // A KeyUpdate with more behind it in the same record.
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let inner = [HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0, 1, CONTENT_HANDSHAKE];
    tcp.write_all(&seal_raw(&mut keys, &inner))
        .await
        .expect("write");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("handshake message"), "{e}");
}

/// Once a record is refused, or the peer sends an error alert, nothing after it is read:
/// every later read fails the same way, and the connection takes no more writes (RFC 8446,
/// section 6.2: the connection is over both ways).
#[tokio::test]
async fn after_a_failure_every_read_fails_the_same_way_and_writes_are_refused() {
    use io::ErrorKind::{ConnectionAborted, InvalidData};
    let mut over = vec![b'x'; MAX_FRAGMENT + 1];
    over.push(CONTENT_APPLICATION_DATA);
    let cases = [
        (
            "a fatal alert",
            vec![2, 40, CONTENT_ALERT],
            ConnectionAborted,
        ),
        ("an inner plaintext overflow", over, InvalidData),
        ("no content type", vec![0, 0], InvalidData),
        (
            "a handshake message",
            vec![4, 0, 0, 0, CONTENT_HANDSHAKE],
            InvalidData,
        ),
    ];
    for (what, inner, kind) in cases {
        let (mut server, mut tcp, mut keys) = sealing_pair().await;
        let mut records = seal_raw(&mut keys, b"before\x17");
        records.extend(seal_raw(&mut keys, &inner));
        records.extend(seal_raw(&mut keys, b"after\x17"));
        records.extend(seal_raw(&mut keys, &[1, 0, CONTENT_ALERT]));
        tcp.write_all(&records).await.expect("write");
        let mut buf = [0u8; 64];
        let n = server.read(&mut buf).await.expect("the record before");
        assert_eq!(&buf[..n], b"before", "{what}");
        let first = read_error(&mut server).await;
        assert_eq!(first.kind(), kind, "{what}: {first}");
        // What is buffered after the failure is never read, so it is not kept.
        assert_eq!(server.read.state.buf.capacity(), 0, "{what}");
        for _ in 0..3 {
            let mut cx = Context::from_waker(Waker::noop());
            assert!(server.read.poll_ready(&mut cx).is_ready(), "{what}");
            let again = read_error(&mut server).await;
            assert_eq!(again.kind(), first.kind(), "{what}: {again}");
            assert_eq!(again.to_string(), first.to_string(), "{what}");
        }
        let e = server
            .write_all(b"reply")
            .await
            .expect_err("no writes after a failure");
        assert_eq!(e.kind(), ConnectionAborted, "{what}: {e}");
        assert!(e.to_string().contains(&first.to_string()), "{what}: {e}");
    }
}

/// RFC 8446, section 5.1: legacy_record_version MUST be ignored after the ClientHello. It is
/// part of the additional data all the same, so changing it in flight is caught.
#[tokio::test]
async fn a_records_legacy_version_is_ignored_but_authenticated() {
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut records = Vec::new();
    for (version, data) in [
        ([3, 1], &b"tls 1.0 "[..]),
        ([3, 4], b"tls 1.3 "),
        ([0, 0], b"none "),
        ([0xfe, 0xfd], b"dtls"),
    ] {
        let mut inner = data.to_vec();
        inner.push(CONTENT_APPLICATION_DATA);
        records.extend(seal_with_version(&mut keys, version, &inner));
    }
    records.extend(seal_raw(&mut keys, &[1, 0, CONTENT_ALERT]));
    tcp.write_all(&records).await.expect("write");
    let mut got = Vec::new();
    server.read_to_end(&mut got).await.expect("a clean end");
    assert_eq!(got, b"tls 1.0 tls 1.3 none dtls");

    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut record = seal_raw(&mut keys, b"changed\x17");
    record[2] = 1;
    tcp.write_all(&record).await.expect("write");
    let e = read_error(&mut server).await;
    assert!(e.to_string().contains("authentication"), "{e}");
}

#[tokio::test]
async fn closure_alerts_end_the_stream_or_pass_as_rustls_has_them() {
    const ALERT: u8 = 21;
    // user_canceled as a warning, then data, then close_notify: the data, then a clean end.
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut records = seal_raw(&mut keys, &[1, 90, ALERT]);
    records.extend(seal_raw(&mut keys, b"still here\x17"));
    records.extend(seal_raw(&mut keys, &[2, 0, ALERT]));
    tcp.write_all(&records).await.expect("write");
    let mut got = Vec::new();
    server.read_to_end(&mut got).await.expect("a clean end");
    assert_eq!(got, b"still here");

    // close_notify ends the stream cleanly after as many records without data as are
    // allowed.
    let (mut server, mut tcp, mut keys) = sealing_pair().await;
    let mut records = Vec::new();
    for _ in 0..MAX_IDLE_RECORDS {
        records.extend(seal_raw(&mut keys, &[CONTENT_APPLICATION_DATA]));
    }
    records.extend(seal_raw(&mut keys, &[1, 0, ALERT]));
    tcp.write_all(&records).await.expect("write");
    assert_eq!(server.read_to_end(&mut got).await.expect("a clean end"), 0);

    // user_canceled as a fatal alert, any other warning, and close_notify at a level that
    // does not exist, are errors.
    for alert in [[2, 90, ALERT], [1, 40, ALERT], [3, 0, ALERT]] {
        let (mut server, mut tcp, mut keys) = sealing_pair().await;
        tcp.write_all(&seal_raw(&mut keys, &alert))
            .await
            .expect("write");
        read_error(&mut server).await;
    }
}
