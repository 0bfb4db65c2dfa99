//! The alerts the record layer sends when it refuses a peer's records (RFC 8446, section
//! 6.2), sealed under the server's current key: opened by a raw peer on the known key
//! schedule, and by rustls's client. OpenSSL's client reads one in `openssl`.

use super::super::record::{
    ALERT_BAD_RECORD_MAC as BAD_RECORD_MAC, ALERT_DECODE_ERROR as DECODE_ERROR,
    ALERT_ILLEGAL_PARAMETER as ILLEGAL_PARAMETER, ALERT_RECORD_OVERFLOW as RECORD_OVERFLOW,
    ALERT_UNEXPECTED_MESSAGE as UNEXPECTED_MESSAGE,
};
use super::*;

/// What the peer sends after a record of data.
#[derive(Debug, Clone)]
enum Bad {
    /// A record of data whose tag is changed after sealing.
    Tampered,
    /// A record whose inner plaintext is exactly this.
    Inner(Vec<u8>),
    /// So many records with this inner plaintext.
    Repeated(usize, Vec<u8>),
    /// Bytes as they are.
    Raw(Vec<u8>),
}

impl Peer {
    fn bad(&mut self, bad: &Bad) -> Vec<u8> {
        match bad {
            Bad::Tampered => {
                let mut record = self.data(b"tampered", 0);
                *record.last_mut().expect("a tag") ^= 1;
                record
            }
            Bad::Inner(inner) => self.seal(inner),
            Bad::Repeated(n, inner) => (0..*n).flat_map(|_| self.seal(inner)).collect(),
            Bad::Raw(bytes) => bytes.clone(),
        }
    }
}

/// How the server's application ends the connection after its read failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Shutdown,
    /// A write, which fails, while the stream is kept.
    Write,
    /// A flush, which fails, while the stream is kept.
    Flush,
    Drop,
}

/// Records the server refuses, and the alert RFC 8446 asks for (none after the peer's own
/// error alert: section 6.2).
fn refused() -> Vec<(&'static str, Bad, Option<u8>)> {
    let mut over = vec![b'x'; MAX_FRAGMENT + 1];
    over.push(CONTENT_APPLICATION_DATA);
    vec![
        ("a tampered record", Bad::Tampered, Some(BAD_RECORD_MAC)),
        (
            "a record too short for its tag",
            Bad::Raw(vec![23, 3, 3, 0, 3, 1, 2, 3]),
            Some(BAD_RECORD_MAC),
        ),
        (
            "a plaintext alert",
            Bad::Raw(vec![21, 3, 3, 0, 2, 2, 40]),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "a header over 2^14 + 256 bytes",
            Bad::Raw(vec![23, 3, 3, 0x41, 0x01]),
            Some(RECORD_OVERFLOW),
        ),
        (
            "inner plaintext over 2^14 + 1",
            Bad::Inner(over),
            Some(RECORD_OVERFLOW),
        ),
        (
            "no content type",
            Bad::Inner(vec![0, 0]),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "an unknown content type",
            Bad::Inner(vec![1, 24]),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "a handshake message other than KeyUpdate",
            Bad::Inner(vec![4, 0, 0, 0, CONTENT_HANDSHAKE]),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "a KeyUpdate whose request is 2",
            Bad::Inner(vec![HANDSHAKE_KEY_UPDATE, 0, 0, 1, 2, CONTENT_HANDSHAKE]),
            Some(ILLEGAL_PARAMETER),
        ),
        (
            "a KeyUpdate with more behind it in its record",
            Bad::Inner(vec![HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0, 1, CONTENT_HANDSHAKE]),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "a KeyUpdate of the wrong length",
            Bad::Inner(vec![HANDSHAKE_KEY_UPDATE, 0, 0, 2, 0, 0, CONTENT_HANDSHAKE]),
            Some(DECODE_ERROR),
        ),
        (
            "a malformed alert",
            Bad::Inner(vec![2, 40, 0, CONTENT_ALERT]),
            Some(DECODE_ERROR),
        ),
        (
            "a run of records without data",
            Bad::Repeated(
                usize::from(MAX_IDLE_RECORDS) + 1,
                vec![CONTENT_APPLICATION_DATA],
            ),
            Some(UNEXPECTED_MESSAGE),
        ),
        (
            "the peer's fatal alert",
            Bad::Inner(vec![2, 40, CONTENT_ALERT]),
            None,
        ),
        (
            "the peer's warning other than a closure alert",
            Bad::Inner(vec![1, 42, CONTENT_ALERT]),
            None,
        ),
    ]
}

/// Every refused record gets its alert, however the application ends the connection: the
/// alert under the server's key as it stands, then the end of the stream without
/// close_notify (an error alert closes the connection by itself).
#[tokio::test]
async fn a_refused_record_gets_the_alert_rfc_8446_asks_for_however_the_connection_ends() {
    let pki = pki();
    let endings = [Ending::Shutdown, Ending::Write, Ending::Flush, Ending::Drop];
    for (what, bad, alert) in refused() {
        for (i, ending) in endings.into_iter().enumerate() {
            let suite = Suite::ALL[i % Suite::ALL.len()];
            let (mut server, mut peer) = peer_pair(&pki, suite, None).await;
            let mut records = peer.data(b"a", 0);
            records.extend(peer.bad(&bad));
            peer.send(&records).await;
            let mut buf = [0u8; 16];
            let n = server.read(&mut buf).await.expect("the data before");
            assert_eq!(&buf[..n], b"a", "{what}");
            let failure = read_error(&mut server).await;
            let kept = match ending {
                Ending::Shutdown => {
                    server.shutdown().await.expect("shutdown");
                    Some(server)
                }
                Ending::Write | Ending::Flush => {
                    let e = match ending {
                        Ending::Write => server.write_all(b"reply").await,
                        _ => server.flush().await,
                    }
                    .expect_err("the connection failed");
                    assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted, "{what}: {e}");
                    assert!(e.to_string().contains(&failure.to_string()), "{what}: {e}");
                    Some(server)
                }
                Ending::Drop => {
                    drop(server);
                    None
                }
            };
            if let Some(alert) = alert {
                assert_eq!(
                    peer.recv().await,
                    Sent::Alert(2, alert),
                    "{what}, {ending:?}"
                );
            }
            // Nothing more, until the stream ends.
            drop(kept);
            assert_eq!(peer.recv().await, Sent::End, "{what}, {ending:?}");
        }
    }
}

/// A key with no record left but a KeyUpdate seals the KeyUpdate before the alert, so the
/// alert goes under the next key.
#[tokio::test]
async fn an_alert_at_the_keys_limit_goes_under_the_next_key() {
    let pki = pki();
    let (mut server, mut peer) = peer_pair(&pki, Suite::Aes256Gcm, None).await;
    server.write.state.update_at = server.write.state.keys.seq;
    let record = peer.bad(&Bad::Tampered);
    peer.send(&record).await;
    read_error(&mut server).await;
    server.shutdown().await.expect("shutdown");
    assert_eq!(peer.recv().await, Sent::KeyUpdate(false));
    assert_eq!(peer.recv().await, Sent::Alert(2, BAD_RECORD_MAC));
    assert_eq!(peer.recv().await, Sent::End);
}

/// The alert is best effort: a peer gone before it could be sent changes nothing in what the
/// application is told, which is the failure.
#[tokio::test]
async fn a_peer_gone_before_the_alert_does_not_hide_the_failure() {
    let pki = pki();
    let (mut server, mut peer) = peer_pair(&pki, Suite::Chacha20Poly1305, None).await;
    let record = peer.bad(&Bad::Tampered);
    peer.send(&record).await;
    let failure = read_error(&mut server).await;
    // A reset (a zero linger time makes the close one): the server's writes meet a socket
    // error.
    socket2::SockRef::from(&peer.tcp)
        .set_linger(Some(std::time::Duration::ZERO))
        .expect("linger");
    drop(peer);
    for _ in 0..2 {
        let e = server.write_all(b"reply").await.expect_err("failed");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted, "{e}");
        assert!(e.to_string().contains(&failure.to_string()), "{e}");
        let e = server.flush().await.expect_err("failed");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted, "{e}");
        assert!(e.to_string().contains(&failure.to_string()), "{e}");
    }
    let again = read_error(&mut server).await;
    assert_eq!(again.to_string(), failure.to_string());
}

/// rustls's client opens the alert and reports it.
#[tokio::test]
async fn rustlss_client_reads_the_alert() {
    for (record, alert) in [
        (None, rustls::AlertDescription::BadRecordMac),
        (
            Some(vec![23, 3, 3, 0x41, 0x01]),
            rustls::AlertDescription::RecordOverflow,
        ),
        (
            Some(vec![22, 3, 3, 0, 4, 24, 0, 0, 1]),
            rustls::AlertDescription::UnexpectedMessage,
        ),
    ] {
        let (mut server, mut tcp, mut conn) = raw_pair().await;
        let bytes = match record {
            Some(bytes) => bytes,
            None => {
                conn.writer().write_all(b"hello").expect("queue");
                let mut bytes = Vec::new();
                conn.write_tls(&mut bytes).expect("record");
                *bytes.last_mut().expect("a tag") ^= 1;
                bytes
            }
        };
        tcp.write_all(&bytes).await.expect("write");
        read_error(&mut server).await;
        server.shutdown().await.expect("shutdown");
        let mut buf = vec![0u8; 16 * 1024];
        let error = loop {
            let n = tcp.read(&mut buf).await.expect("read");
            assert!(n > 0, "the stream ended without an alert");
            conn.read_tls(&mut &buf[..n]).expect("read_tls");
            if let Err(e) = conn.process_new_packets() {
                break e;
            }
        };
        assert_eq!(error, rustls::Error::AlertReceived(alert));
    }
}
