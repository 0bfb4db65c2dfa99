//! Every suite the record layer supports, against rustls's client and a raw peer: the key
//! schedule, records of every size both ways, padding and empty records, records split
//! across reads and many in one, key updates both ways and a KeyUpdate flood.

use super::*;
use crate::tls::fuzzing::RecordReader;
use crate::tls::record::key_update_at;

/// rustls's ring provider offers these TLS 1.3 suites; each must be one the record layer
/// supports, and each of those is tested here.
#[test]
fn the_providers_tls13_suites_are_the_record_layers() {
    let offered: Vec<_> = provider()
        .cipher_suites
        .iter()
        .filter(|s| s.tls13().is_some())
        .map(|s| s.suite())
        .collect();
    assert_eq!(offered.len(), SUPPORTED_SUITES.len());
    assert!(
        offered.iter().all(|s| SUPPORTED_SUITES.contains(s)),
        "{offered:?}"
    );
    let tested: Vec<_> = Suite::ALL.iter().map(|s| s.cipher_suite()).collect();
    assert_eq!(tested, SUPPORTED_SUITES);
    assert!(SUPPORTED_SUITES.iter().all(|s| supports(*s)));
    assert!(!supports(rustls::CipherSuite::TLS13_AES_128_CCM_SHA256));
}

/// The key schedule run here (the server's, the fuzz targets' and these tests') is rustls's:
/// a record sealed under a secret rustls's client logged, and under the secret after a
/// KeyUpdate, opens on the server, and the server's records open under the secret the client
/// logged for them and the ones after the server's KeyUpdates.
#[tokio::test]
async fn the_known_key_schedule_is_rustlss() {
    let pki = pki();
    for suite in Suite::ALL {
        // One record of data per key, then the KeyUpdate.
        let (mut server, mut peer) = peer_pair(&pki, suite, Some(2)).await;
        let mut records = peer.data(b"under the first key", 0);
        records.extend(peer.key_update(false));
        records.extend(peer.data(b", then the next", 3));
        peer.send(&records).await;
        let mut got = vec![0u8; 34];
        server.read_exact(&mut got).await.expect("server reads");
        assert_eq!(got, b"under the first key, then the next", "{suite:?}");

        for part in [&b"a"[..], b"b", b"c"] {
            server.write_all(part).await.expect("write");
        }
        server.flush().await.expect("flush");
        for part in [&b"a"[..], b"b", b"c"] {
            assert_eq!(peer.recv().await, Sent::KeyUpdate(false), "{suite:?}");
            assert_eq!(peer.recv().await, Sent::Data(part.to_vec()), "{suite:?}");
        }
    }
}

/// Records of every plaintext length from 1 to 2^14 each way through rustls's client, and
/// from 0 to 2^14 from a raw peer, with padding up to the record's limit.
async fn every_record_size(suite: Suite) {
    let pki = pki();
    let sizes = 1..=MAX_FRAGMENT;
    let total: usize = sizes.clone().sum();
    let sent = pattern(total);

    let log = Arc::new(SecretLog::default());
    let (server, client) = handshake(&pki, suite_client(&pki, suite, log)).await;
    let (mut sr, mut sw) = server.into_split();
    let (mut cr, mut cw) = tokio::io::split(client);
    let to_send = sent.clone();
    let (sizes_c, sizes_s) = (sizes.clone(), sizes.clone());
    let client_writes = tokio::spawn(async move {
        // rustls seals each write of up to 2^14 bytes as one record.
        let mut at = 0;
        for n in sizes_c {
            cw.write_all(&to_send[at..at + n])
                .await
                .expect("client write");
            at += n;
        }
        cw.flush().await.expect("flush");
        cw
    });
    let to_send = sent.clone();
    let server_writes = tokio::spawn(async move {
        let mut at = 0;
        for n in sizes_s {
            sw.write_all(&to_send[at..at + n])
                .await
                .expect("server write");
            at += n;
        }
        sw.flush().await.expect("flush");
        sw
    });
    let mut got = vec![0u8; total];
    sr.read_exact(&mut got).await.expect("server reads");
    assert!(got == sent, "{suite:?}: the server read other bytes");
    let mut got = vec![0u8; total];
    cr.read_exact(&mut got).await.expect("client reads");
    assert!(got == sent, "{suite:?}: the client read other bytes");
    client_writes.await.expect("client writer");
    server_writes.await.expect("server writer");

    // The raw peer: one record of each length, empty included, padded up to 2^14 + 1.
    let (mut server, mut peer) = peer_pair(&pki, suite, None).await;
    let mut records = Vec::new();
    let mut expected = Vec::new();
    for n in 0..=MAX_FRAGMENT {
        let data = &sent[..n];
        let padding = (n % 5 * 101).min(MAX_FRAGMENT - n);
        records.extend(peer.data(data, padding));
        expected.extend_from_slice(data);
    }
    records.extend(peer.close_notify());
    let writer = tokio::spawn(async move {
        peer.send(&records).await;
        peer
    });
    let mut got = Vec::new();
    server.read_to_end(&mut got).await.expect("server reads");
    assert!(got == expected, "{suite:?}: the server read other bytes");
    writer.await.expect("peer");
}

#[tokio::test]
async fn every_record_size_crosses_both_ways_aes_128_gcm() {
    every_record_size(Suite::Aes128Gcm).await;
}

#[tokio::test]
async fn every_record_size_crosses_both_ways_aes_256_gcm() {
    every_record_size(Suite::Aes256Gcm).await;
}

#[tokio::test]
async fn every_record_size_crosses_both_ways_chacha20_poly1305() {
    every_record_size(Suite::Chacha20Poly1305).await;
}

/// The records a peer sends, fed to the reading half in reads of every size from one byte to
/// more than all of them: the same plaintext and the same end, however the bytes arrive.
#[test]
fn records_split_across_reads_or_many_in_one_read_the_same() {
    for suite in Suite::ALL {
        let secret = TrafficSecret::new(suite, &vec![0x5a; suite.secret_len()]).expect("secret");
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        let data = pattern(MAX_FRAGMENT);
        // (key index, data length, padding): a KeyUpdate asking for one back comes between
        // the records under the first key and those under the next.
        let records = [
            (0, 0, 0),
            (0, 1, 0),
            (0, 100, 7),
            (0, MAX_FRAGMENT, 0),
            (0, 0, 300),
            (1, MAX_FRAGMENT - 20, 20),
            (1, 5, 0),
        ];
        let mut keys = secret.keys(0);
        for (i, &(key, len, padding)) in records.iter().enumerate() {
            if key == 1 && records[i - 1].0 == 0 {
                stream.extend(seal_raw(
                    &mut keys,
                    &[HANDSHAKE_KEY_UPDATE, 0, 0, 1, 1, CONTENT_HANDSHAKE],
                ));
                keys = secret.next().keys(0);
            }
            let mut inner = data[..len].to_vec();
            inner.push(CONTENT_APPLICATION_DATA);
            inner.resize(inner.len() + padding, 0);
            stream.extend(seal_raw(&mut keys, &inner));
            expected.extend_from_slice(&data[..len]);
        }
        stream.extend(seal_raw(&mut keys, &[1, 0, CONTENT_ALERT]));
        // Bytes after close_notify are never read.
        stream.extend_from_slice(b"ignored");

        let mut chunks: Vec<usize> = (1..=64).collect();
        chunks.extend([
            HEADER_LEN + TAG_LEN,
            1000,
            MAX_FRAGMENT + HEADER_LEN + TAG_LEN,
            MAX_FRAGMENT + HEADER_LEN + TAG_LEN + 1,
            stream.len(),
        ]);
        for chunk in chunks {
            for out_len in [1, 1500, 64 * 1024] {
                let mut reader = RecordReader::new(secret.clone());
                let mut input = &stream[..];
                let mut got = Vec::new();
                let mut out = vec![0u8; out_len];
                loop {
                    let n = reader
                        .read(&mut input, chunk, &mut out)
                        .unwrap_or_else(|e| panic!("{suite:?}, reads of {chunk}: {e}"));
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&out[..n]);
                }
                assert!(got == expected, "{suite:?}, reads of {chunk}: other bytes");
                assert!(reader.update_requested(), "{suite:?}");
                // Only what came in the read that brought close_notify was taken.
                assert!(
                    b"ignored".ends_with(input) && input.len() + chunk > b"ignored".len(),
                    "{suite:?}, reads of {chunk}: {input:?} left"
                );
            }
        }
    }
}

/// The sending key lasts each suite's confidentiality limit as rustls gives it (the
/// KeyUpdate the last record under it); lowered, the server updates its key that often,
/// within a write as well, and rustls's client follows.
#[tokio::test]
async fn the_server_updates_its_key_at_each_suites_limit() {
    let pki = pki();
    for (suite, update_at) in [
        (Suite::Aes128Gcm, (1 << 24) - 1),
        (Suite::Aes256Gcm, (1 << 24) - 1),
        (Suite::Chacha20Poly1305, 0xffff_ffff_fffe_ffff),
    ] {
        let log = Arc::new(SecretLog::default());
        let (server, _client) = handshake(&pki, suite_client(&pki, suite, log)).await;
        assert_eq!(server.write.state.update_at, update_at, "{suite:?}");

        let log = Arc::new(SecretLog::default());
        let config = suite_client(&pki, suite, log);
        let (mut server, mut client) = handshake_with(&pki, config, Some(4)).await;
        assert_eq!(server.write.state.update_at, key_update_at(4));
        let sent = pattern(20 * MAX_FRAGMENT + 5);
        // Single records, then writes of four records at once.
        let (singles, batches) = sent.split_at(8 * MAX_FRAGMENT);
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; 20 * MAX_FRAGMENT + 5];
            client
                .read_exact(&mut got)
                .await
                .expect("rustls follows every update");
            got
        });
        for chunk in singles
            .chunks(MAX_FRAGMENT)
            .chain(batches.chunks(4 * MAX_FRAGMENT))
        {
            server.write_all(chunk).await.expect("write");
            assert!(server.write.state.keys.seq <= 3, "{suite:?}");
        }
        server.flush().await.expect("flush");
        assert!(reader.await.expect("reader") == sent, "{suite:?}");

        // The records as sent: three of data per key, then the KeyUpdate.
        let (mut server, mut peer) = peer_pair(&pki, suite, Some(4)).await;
        for _ in 0..7 {
            server.write_all(b"x").await.expect("write");
        }
        server.flush().await.expect("flush");
        // Every key seals four records, the KeyUpdate the last of them (the first key
        // sealed the session tickets too).
        let mut data = 0;
        let mut updates = 0;
        while data < 7 {
            match peer.recv().await {
                Sent::Data(_) => data += 1,
                Sent::KeyUpdate(false) => {
                    assert_eq!(peer.rx_keys_before.seq, 4, "{suite:?}");
                    updates += 1;
                }
                other => panic!("{suite:?}: {other:?}"),
            }
        }
        assert_eq!(updates, 2, "{suite:?}");
    }
}

/// A peer's KeyUpdate without a request is followed; with one, it is followed and answered
/// before the server's next data, once however many requests came in between.
#[tokio::test]
async fn peer_key_updates_with_and_without_a_request_in_every_suite() {
    let pki = pki();
    for suite in Suite::ALL {
        let (mut server, mut peer) = peer_pair(&pki, suite, None).await;
        let mut records = peer.data(b"one", 0);
        records.extend(peer.key_update(false));
        records.extend(peer.data(b"two", 0));
        peer.send(&records).await;
        let mut got = [0u8; 6];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"onetwo");
        assert!(!update_requested(&server), "{suite:?}");
        server.write_all(b"a").await.expect("write");
        server.flush().await.expect("flush");
        assert_eq!(peer.recv().await, Sent::Data(b"a".to_vec()), "{suite:?}");

        let mut records = peer.key_update(true);
        records.extend(peer.data(b"three", 0));
        records.extend(peer.key_update(true));
        records.extend(peer.data(b"four", 0));
        peer.send(&records).await;
        let mut got = [0u8; 9];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"threefour");
        server.write_all(b"b").await.expect("write");
        server.write_all(b"c").await.expect("write");
        server.flush().await.expect("flush");
        assert_eq!(peer.recv().await, Sent::KeyUpdate(false), "{suite:?}");
        assert_eq!(peer.recv().await, Sent::Data(b"b".to_vec()), "{suite:?}");
        assert_eq!(peer.recv().await, Sent::Data(b"c".to_vec()), "{suite:?}");

        // rustls's client asks for an answer with every update.
        let log = Arc::new(SecretLog::default());
        let (mut server, mut client) = handshake(&pki, suite_client(&pki, suite, log)).await;
        for round in 0..3u8 {
            client.get_mut().1.refresh_traffic_keys().expect("refresh");
            client.write_all(&[round; 100]).await.expect("write");
            client.flush().await.expect("flush");
            let mut got = [0u8; 100];
            server.read_exact(&mut got).await.expect("read");
            assert_eq!(got, [round; 100]);
            server.write_all(&[round; 50]).await.expect("write");
            server.flush().await.expect("flush");
            let mut got = [0u8; 50];
            client.read_exact(&mut got).await.expect("client follows");
            assert_eq!(got, [round; 50], "{suite:?}");
        }
    }
}

/// 32 KeyUpdates in a row, each asking for one back, are taken (and answered once); the
/// 33rd without data between is refused, not answered.
#[tokio::test]
async fn a_key_update_flood_is_cut_off_in_every_suite() {
    let pki = pki();
    for suite in Suite::ALL {
        let (mut server, mut peer) = peer_pair(&pki, suite, None).await;
        let mut records = Vec::new();
        for _ in 0..MAX_IDLE_RECORDS {
            records.extend(peer.key_update(true));
        }
        records.extend(peer.data(b"data", 0));
        peer.send(&records).await;
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.expect("read");
        server.write_all(b"answer").await.expect("write");
        server.flush().await.expect("flush");
        assert_eq!(peer.recv().await, Sent::KeyUpdate(false), "{suite:?}");
        assert_eq!(
            peer.recv().await,
            Sent::Data(b"answer".to_vec()),
            "{suite:?}"
        );

        let mut records = Vec::new();
        for _ in 0..=MAX_IDLE_RECORDS {
            records.extend(peer.key_update(true));
        }
        peer.send(&records).await;
        let e = read_error(&mut server).await;
        assert!(e.to_string().contains("without data"), "{suite:?}: {e}");
    }
}
