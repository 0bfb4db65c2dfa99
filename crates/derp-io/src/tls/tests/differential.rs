//! The record layer beside rustls's own server (its buffered `ServerConnection`, the path
//! TLS 1.2 and `--tls-records rustls` take): the same client traffic, records built by a
//! raw peer so that they can be anything a client may send (data of any size, padding,
//! empty records, key updates, alerts, close_notify, tampered or malformed records), goes to
//! each, in every suite. Each server's application echoes what it reads and closes with
//! close_notify when its reading ends cleanly. Both must read the same bytes and end the
//! same way, and the client must get the same bytes back and the same close_notify.
//!
//! A broken record comes in a read of its own (the client waits for the echo of what came
//! before): rustls's stream drops the good records that share a socket read with a bad one,
//! derpd hands them over first and fails the next read.
//!
//! Where they differ by design, the test says so and checks that exact difference: derpd
//! takes the end of the stream without close_notify as the end (DERP frames delimit
//! themselves, and rustls's error for it would only change how a finished connection is
//! counted), derpd ignores a record header's legacy version as RFC 8446 asks (rustls
//! authenticates every record as if its header said TLS 1.2, so a record sealed under
//! another version fails there), and the fatal alert each sends before it closes is checked
//! per scenario ([`Sends`]): derpd sends the one RFC 8446 asks for, which is rustls's for
//! most; where rustls sends another or none, and where rustls answers a peer's error alert
//! (which RFC 8446, section 6.2, only asks to close on), the scenario says so.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsAcceptor;

use super::super::record::{
    ALERT_BAD_RECORD_MAC as BAD_RECORD_MAC, ALERT_DECODE_ERROR as DECODE_ERROR,
    ALERT_ILLEGAL_PARAMETER as ILLEGAL_PARAMETER, ALERT_RECORD_OVERFLOW as RECORD_OVERFLOW,
    ALERT_UNEXPECTED_MESSAGE as UNEXPECTED_MESSAGE,
};
use super::*;

/// One piece of the client's traffic.
#[derive(Debug, Clone)]
enum Step {
    /// Application data with this much padding.
    Data(Vec<u8>, usize),
    KeyUpdate(bool),
    Alert(u8, u8),
    /// A record of data whose last byte (of its tag) is changed after sealing.
    Tampered(Vec<u8>),
    /// A record whose inner plaintext is exactly this.
    Inner(Vec<u8>),
    /// A record of data sealed under a header with this legacy version.
    Version([u8; 2], Vec<u8>),
    /// Bytes as they are.
    Raw(Vec<u8>),
    /// The end of the client's sending (TCP FIN), without close_notify.
    Fin,
    /// Send what came before, and wait for the server to echo its data: what follows comes
    /// in another read, so that a server is not judged by what shares a read with it.
    Sync,
}

use Step::*;

fn close() -> Step {
    Alert(1, 0)
}

fn data(bytes: &[u8]) -> Step {
    Data(bytes.to_vec(), 0)
}

/// The fatal alert each server sends before it closes, if any.
#[derive(Debug, Clone, Copy)]
enum Sends {
    /// Neither sends one.
    Nothing,
    /// Both send this one.
    Both(u8),
    /// derpd sends the one RFC 8446 asks for, rustls another or none.
    Differ { derpd: u8, rustls: Option<u8> },
    /// Only rustls sends one, to a peer's error alert.
    RustlsOnly(u8),
}

use Sends::*;

/// Alerts as the client got them: (level, description).
type Alerts = Vec<(u8, u8)>;

impl Sends {
    /// The alerts derpd's client gets, and rustls's.
    fn alerts(self) -> (Alerts, Alerts) {
        let fatal = |d: Option<u8>| d.map(|d| (2, d)).into_iter().collect();
        match self {
            Nothing => (vec![], vec![]),
            Both(d) => (fatal(Some(d)), fatal(Some(d))),
            Differ { derpd, rustls } => (fatal(Some(derpd)), fatal(rustls)),
            RustlsOnly(d) => (vec![], fatal(Some(d))),
        }
    }
}

/// How a server's reading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Clean,
    Error,
}

/// What a scenario did: the server application's view, and the client's.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    server_read: Vec<u8>,
    server_end: End,
    client_read: Vec<u8>,
    /// The server ended its sending with close_notify.
    close_notify: bool,
    /// Alerts other than close_notify the server sent.
    alerts: Vec<(u8, u8)>,
}

/// The server application: echoes what it reads; at the end of the stream, close_notify.
async fn echo(mut s: impl AsyncRead + AsyncWrite + Unpin) -> (Vec<u8>, End) {
    let mut read = Vec::new();
    let mut buf = vec![0u8; 70_000];
    loop {
        match s.read(&mut buf).await {
            Ok(0) => {
                let _ = s.shutdown().await;
                return (read, End::Clean);
            }
            Ok(n) => {
                read.extend_from_slice(&buf[..n]);
                let _ = s.write_all(&buf[..n]).await;
                let _ = s.flush().await;
            }
            Err(_) => return (read, End::Error),
        }
    }
}

impl Peer {
    /// The records (or bytes) for `steps`.
    fn build(&mut self, steps: &[Step]) -> Vec<u8> {
        let mut out = Vec::new();
        for step in steps {
            match step {
                Data(bytes, padding) => out.extend(self.data(bytes, *padding)),
                KeyUpdate(requested) => out.extend(self.key_update(*requested)),
                Alert(level, description) => {
                    out.extend(self.seal(&[*level, *description, CONTENT_ALERT]));
                }
                Tampered(bytes) => {
                    let mut record = self.data(bytes, 0);
                    *record.last_mut().expect("a tag") ^= 1;
                    out.extend(record);
                }
                Inner(inner) => out.extend(self.seal(inner)),
                Version(version, bytes) => {
                    let mut inner = bytes.clone();
                    inner.push(CONTENT_APPLICATION_DATA);
                    let [hi, lo] = u16::try_from(inner.len() + TAG_LEN)
                        .expect("length")
                        .to_be_bytes();
                    let header = [CONTENT_APPLICATION_DATA, version[0], version[1], hi, lo];
                    let mut record = header.to_vec();
                    record.extend_from_slice(&inner);
                    let keys = &mut self.tx_keys;
                    let tag = keys
                        .key
                        .seal_in_place_separate_tag(
                            keys.nonce(),
                            Aad::from(header),
                            &mut record[HEADER_LEN..],
                        )
                        .expect("seal");
                    record.extend_from_slice(tag.as_ref());
                    keys.seq += 1;
                    out.extend(record);
                }
                Raw(bytes) => out.extend_from_slice(bytes),
                Fin | Sync => {}
            }
        }
        out
    }

    /// The server's data, whether it ended with close_notify and any other alerts, read
    /// until the server closes or, with `until`, until that many bytes of data came.
    async fn read_into(&mut self, got: &mut Received, until: Option<usize>) {
        while until.is_none_or(|n| got.data.len() < n) {
            match self.recv().await {
                Sent::Data(bytes) => got.data.extend(bytes),
                Sent::KeyUpdate(_) => {}
                Sent::Alert(_, 0) => {
                    got.close_notify = true;
                    return;
                }
                Sent::Alert(level, description) => got.alerts.push((level, description)),
                Sent::End => return,
            }
        }
    }

    /// Sends the client's traffic, then reads what the server sends back until it closes.
    async fn run(mut self, steps: &[Step]) -> Received {
        let mut got = Received::default();
        let mut sent = 0;
        for (i, group) in steps.split(|s| matches!(s, Sync)).enumerate() {
            if i > 0 {
                self.read_into(&mut got, Some(sent)).await;
            }
            let records = self.build(group);
            sent += group
                .iter()
                .map(|s| match s {
                    Data(bytes, _) => bytes.len(),
                    _ => 0,
                })
                .sum::<usize>();
            // A server that stops reading may close with bytes unread; the kernel then
            // resets the connection, which ends the client's writing and reading alike.
            let _ = self.tcp.write_all(&records).await;
            if group.iter().any(|s| matches!(s, Fin)) {
                let _ = self.tcp.shutdown().await;
            }
        }
        self.read_into(&mut got, None).await;
        got
    }
}

/// What the client got back.
#[derive(Debug, Default)]
struct Received {
    data: Vec<u8>,
    close_notify: bool,
    alerts: Vec<(u8, u8)>,
}

impl Outcome {
    fn new((server_read, server_end): (Vec<u8>, End), client: Received) -> Self {
        Self {
            server_read,
            server_end,
            client_read: client.data,
            close_notify: client.close_notify,
            alerts: client.alerts,
        }
    }
}

/// The scenario through derpd's record layer.
async fn through_derpd(pki: &Pki, suite: Suite, steps: &[Step]) -> Outcome {
    let (server, peer) = peer_pair(pki, suite, None).await;
    let server = tokio::spawn(echo(server));
    let client = peer.run(steps).await;
    Outcome::new(server.await.expect("server"), client)
}

/// The scenario through rustls's buffered server connection, under the same config.
async fn through_rustls(pki: &Pki, suite: Suite, steps: &[Step]) -> Outcome {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let log = Arc::new(SecretLog::default());
    let connector = TlsConnector::from(suite_client(pki, suite, log.clone()));
    let acceptor = TlsAcceptor::from(pki.server.clone());
    let (client, server) = tokio::join!(
        async {
            let tcp = TcpStream::connect(addr).await.expect("connect");
            connector.connect(name(), tcp).await.expect("client")
        },
        async {
            let (tcp, _) = listener.accept().await.expect("accept");
            acceptor.accept(tcp).await.expect("rustls server")
        }
    );
    let peer = Peer::from_client(client, &log, suite);
    let server = tokio::spawn(echo(server));
    let client = peer.run(steps).await;
    Outcome::new(server.await.expect("server"), client)
}

/// Client traffic that both servers must take alike, and how it must end for the server.
fn scenarios() -> Vec<(&'static str, Vec<Step>, End, Sends)> {
    let big = pattern(MAX_FRAGMENT);
    let mut over = big.clone();
    over.extend_from_slice(&[CONTENT_APPLICATION_DATA, 0]);
    let empty = || Data(Vec::new(), 0);
    let mut oversized = vec![23, 3, 3, 0x41, 0x01];
    oversized.resize(HEADER_LEN + MAX_FRAGMENT + 257, 7);
    vec![
        (
            "data of many sizes, padded and empty, then close_notify",
            vec![
                data(b"a"),
                Data(pattern(100), 7),
                empty(),
                Data(big.clone(), 0),
                Data(pattern(500), 1000),
                Data(Vec::new(), 300),
                Data(big[..MAX_FRAGMENT - 9].to_vec(), 9),
                close(),
            ],
            End::Clean,
            Nothing,
        ),
        (
            "key updates with and without a request between data",
            vec![
                data(b"one"),
                KeyUpdate(false),
                data(b"two"),
                KeyUpdate(true),
                data(b"three"),
                KeyUpdate(true),
                KeyUpdate(true),
                data(b"four"),
                close(),
            ],
            End::Clean,
            Nothing,
        ),
        (
            "32 key updates asking for one back, then data",
            [
                vec![data(b"x")],
                vec![KeyUpdate(true); 32],
                vec![data(b"y"), close()],
            ]
            .concat(),
            End::Clean,
            Nothing,
        ),
        (
            "33 key updates without data between",
            [
                vec![data(b"x"), Sync],
                vec![KeyUpdate(true); 33],
                vec![data(b"y")],
            ]
            .concat(),
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: None,
            },
        ),
        (
            "32 empty records, then close_notify",
            [vec![data(b"x")], vec![empty(); 32], vec![close()]].concat(),
            End::Clean,
            Nothing,
        ),
        (
            "33 empty records",
            [vec![data(b"x"), Sync], vec![empty(); 33], vec![data(b"y")]].concat(),
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: None,
            },
        ),
        (
            "user_canceled, more data, close_notify",
            vec![data(b"a"), Alert(1, 90), data(b"b"), close()],
            End::Clean,
            Nothing,
        ),
        (
            "close_notify as a fatal alert",
            vec![data(b"a"), Alert(2, 0), data(b"never read")],
            End::Clean,
            Nothing,
        ),
        (
            "data after close_notify",
            vec![data(b"a"), close(), data(b"never read")],
            End::Clean,
            Nothing,
        ),
        (
            "a fatal alert",
            vec![data(b"a"), Sync, Alert(2, 40), data(b"never read")],
            End::Error,
            Nothing,
        ),
        (
            "a warning other than user_canceled",
            vec![data(b"a"), Sync, Alert(1, 42), data(b"never read")],
            End::Error,
            RustlsOnly(DECODE_ERROR),
        ),
        (
            "an alert at a level that does not exist",
            vec![data(b"a"), Sync, Alert(3, 0), data(b"never read")],
            End::Error,
            RustlsOnly(ILLEGAL_PARAMETER),
        ),
        (
            "a malformed alert",
            vec![data(b"a"), Sync, Inner(vec![1, 0, 0, CONTENT_ALERT])],
            End::Error,
            Both(DECODE_ERROR),
        ),
        (
            "a tampered record",
            vec![
                data(b"a"),
                Sync,
                Tampered(b"b".to_vec()),
                data(b"never read"),
            ],
            End::Error,
            Both(BAD_RECORD_MAC),
        ),
        (
            "inner plaintext one byte over 2^14 + 1",
            vec![data(b"a"), Sync, Inner(over)],
            End::Error,
            Both(RECORD_OVERFLOW),
        ),
        (
            "padding only, no content type",
            vec![data(b"a"), Sync, Inner(vec![0; 10])],
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: None,
            },
        ),
        (
            "an unknown content type",
            vec![data(b"a"), Sync, Inner(vec![1, 2, 3, 24])],
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: Some(DECODE_ERROR),
            },
        ),
        (
            "a change_cipher_spec inside a record",
            vec![data(b"a"), Sync, Inner(vec![1, 20])],
            End::Error,
            Both(UNEXPECTED_MESSAGE),
        ),
        (
            "a handshake message other than KeyUpdate",
            vec![
                data(b"a"),
                Sync,
                Inner(vec![4, 0, 0, 1, 0, CONTENT_HANDSHAKE]),
            ],
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: Some(DECODE_ERROR),
            },
        ),
        (
            "a KeyUpdate with a request byte of 2",
            vec![
                data(b"a"),
                Sync,
                Inner(vec![24, 0, 0, 1, 2, CONTENT_HANDSHAKE]),
            ],
            End::Error,
            Both(ILLEGAL_PARAMETER),
        ),
        (
            "a KeyUpdate with data behind it in its record",
            vec![
                data(b"a"),
                Sync,
                Inner(vec![24, 0, 0, 1, 0, b'x', CONTENT_HANDSHAKE]),
            ],
            End::Error,
            Both(UNEXPECTED_MESSAGE),
        ),
        (
            "a plaintext alert after the handshake",
            vec![data(b"a"), Sync, Raw(vec![21, 3, 3, 0, 2, 2, 40])],
            End::Error,
            Differ {
                derpd: UNEXPECTED_MESSAGE,
                rustls: Some(BAD_RECORD_MAC),
            },
        ),
        (
            // rustls waits for records up to TLS 1.2's 2^14 + 2048 bytes and then fails to
            // open it; derpd refuses it from the header (RFC 8446, section 5.2).
            "a record over 2^14 + 256 bytes",
            vec![data(b"a"), Sync, Raw(oversized)],
            End::Error,
            Differ {
                derpd: RECORD_OVERFLOW,
                rustls: Some(BAD_RECORD_MAC),
            },
        ),
        (
            "a record too short for its tag",
            vec![data(b"a"), Sync, Raw(vec![23, 3, 3, 0, 3, 1, 2, 3])],
            End::Error,
            Both(BAD_RECORD_MAC),
        ),
        (
            "a record cut short by the end of the stream",
            vec![data(b"a"), Sync, Raw(vec![23, 3, 3, 0, 40, 1, 2]), Fin],
            End::Error,
            Nothing,
        ),
    ]
}

#[tokio::test]
async fn derpds_records_read_as_rustlss_in_every_suite() {
    let pki = pki();
    let mut differences = Vec::new();
    for suite in Suite::ALL {
        for (what, steps, end, sends) in scenarios() {
            // A hang is a difference too (a guard, not a measurement).
            let limit = std::time::Duration::from_secs(20);
            let Ok(derpd) = tokio::time::timeout(limit, through_derpd(&pki, suite, &steps)).await
            else {
                differences.push(format!("{suite:?}, {what}: derpd never finished"));
                continue;
            };
            let Ok(rustls) = tokio::time::timeout(limit, through_rustls(&pki, suite, &steps)).await
            else {
                differences.push(format!("{suite:?}, {what}: rustls never finished"));
                continue;
            };
            let (derpds_alerts, rustlss_alerts) = sends.alerts();
            if rustls.server_end != end || rustls.alerts != rustlss_alerts {
                differences.push(format!("{suite:?}, {what}: rustls ended {rustls:?}"));
            }
            let mut expected = rustls.clone();
            expected.alerts = derpds_alerts;
            if derpd != expected {
                differences.push(format!(
                    "{suite:?}, {what}:\n  derpd  {derpd:?}\n  rustls {rustls:?}"
                ));
            }
        }
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

/// The one difference in what the application reads: the end of the stream without
/// close_notify is an end for derpd and an error for rustls.
#[tokio::test]
async fn the_end_of_the_stream_without_close_notify_is_an_end_for_derpd_and_an_error_for_rustls() {
    let pki = pki();
    for suite in Suite::ALL {
        let steps = [data(b"bytes"), Fin];
        let derpd = through_derpd(&pki, suite, &steps).await;
        let rustls = through_rustls(&pki, suite, &steps).await;
        assert_eq!(derpd.server_read, b"bytes");
        assert_eq!(rustls.server_read, b"bytes");
        assert_eq!(derpd.server_end, End::Clean, "{suite:?}");
        assert_eq!(rustls.server_end, End::Error, "{suite:?}");
    }
}

/// A record sealed under a header whose legacy version is not TLS 1.2's: derpd ignores the
/// field (RFC 8446, section 5.1) and opens the record under the header it came with (5.2);
/// rustls's additional data always says TLS 1.2, so the record fails authentication there.
#[tokio::test]
async fn a_legacy_version_other_than_tls_1_2_is_ignored_by_derpd_and_fails_rustlss_authentication()
{
    let pki = pki();
    for suite in Suite::ALL {
        let steps = [
            data(b"a"),
            Sync,
            Version([3, 1], b"b".to_vec()),
            data(b"c"),
            close(),
        ];
        let derpd = through_derpd(&pki, suite, &steps).await;
        let rustls = through_rustls(&pki, suite, &steps).await;
        assert_eq!(derpd.server_read, b"abc", "{suite:?}");
        assert_eq!(derpd.server_end, End::Clean, "{suite:?}");
        assert_eq!(derpd.client_read, b"abc", "{suite:?}");
        assert!(derpd.close_notify, "{suite:?}");
        assert_eq!(rustls.server_read, b"a", "{suite:?}");
        assert!(derpd.alerts.is_empty(), "{suite:?}");
        assert_eq!(rustls.server_end, End::Error, "{suite:?}");
        assert_eq!(rustls.alerts, [(2, BAD_RECORD_MAC)], "{suite:?}");
    }
}
