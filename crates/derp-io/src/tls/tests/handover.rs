//! Handing a connection over: both halves' state copied out through its binary form, the
//! old halves forgotten, and the stream rebuilt on a duplicate of the socket, with the cut
//! anywhere in either direction (a record half read, plaintext not handed over, a KeyUpdate
//! read or half read, a KeyUpdate owed either way, records sealed and not written). The
//! client, rustls's, sees one stream: every byte once and in order, key updates both ways
//! after the cut, and no alert or end until the server's close_notify.

use std::future::poll_fn;

use tokio::io::{AsyncRead, ReadBuf};

use super::*;

/// Records one sending key seals in these tests (the KeyUpdate included): the server
/// updates its own key every few records, before and after each cut.
const RECORDS_PER_KEY: u64 = 4;

/// A rustls client driven by hand over its socket, so that its records reach the server
/// whole, split or late as a test says. What it reads is checked by rustls as it comes.
struct Client {
    tcp: TcpStream,
    conn: ClientConnection,
    /// Plaintext read and not taken yet.
    plain: Vec<u8>,
}

impl Client {
    /// The records rustls seals `data` into.
    fn seal(&mut self, data: &[u8]) -> Vec<u8> {
        self.conn.writer().write_all(data).expect("queue");
        self.flight()
    }

    /// rustls's KeyUpdate, which asks for one back; what the client seals next goes under
    /// its next key.
    fn key_update(&mut self) -> Vec<u8> {
        self.conn.refresh_traffic_keys().expect("key update");
        self.flight()
    }

    fn flight(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        while self.conn.wants_write() {
            self.conn.write_tls(&mut out).expect("records");
        }
        out
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.tcp.write_all(bytes).await.expect("client write");
    }

    /// The server's next `n` bytes. Anything before them but records of data and
    /// KeyUpdates (an alert, close_notify, a record rustls cannot open, the end of the
    /// stream) is an error, described.
    async fn recv(&mut self, n: usize) -> Result<Vec<u8>, String> {
        let mut buf = vec![0u8; 64 * 1024];
        while self.plain.len() < n {
            let got = self
                .tcp
                .read(&mut buf)
                .await
                .map_err(|e| format!("read: {e}"))?;
            if got == 0 {
                return Err("the end of the stream".into());
            }
            let mut rest = &buf[..got];
            while !rest.is_empty() {
                self.conn
                    .read_tls(&mut rest)
                    .map_err(|e| format!("read_tls: {e}"))?;
                let state = self
                    .conn
                    .process_new_packets()
                    .map_err(|e| format!("tls: {e}"))?;
                let start = self.plain.len();
                self.plain
                    .resize(start + state.plaintext_bytes_to_read(), 0);
                self.conn
                    .reader()
                    .read_exact(&mut self.plain[start..])
                    .expect("plaintext");
                if state.peer_has_closed() && self.plain.len() < n {
                    return Err("close_notify".into());
                }
            }
        }
        Ok(self.plain.drain(..n).collect())
    }
}

/// The server's halves after a handshake with a [`Client`], updating its key every
/// [`RECORDS_PER_KEY`] records.
async fn client_pair() -> (TlsRead, TlsWrite, Client) {
    let pki = pki();
    let config = client_config(&pki, &[&rustls::version::TLS13]);
    let (server, client) = handshake_with(&pki, config, Some(RECORDS_PER_KEY)).await;
    let (tcp, conn) = client.into_inner();
    let (r, w) = server.into_split();
    let client = Client {
        tcp,
        conn,
        plain: Vec::new(),
    };
    (r, w, client)
}

/// Waits for the socket, then reads as the server's read loop does, `chunk` bytes at most
/// per read, until a read would wait; returns what it read.
async fn pump(r: &mut TlsRead, chunk: usize) -> Vec<u8> {
    poll_fn(|cx| r.poll_ready(cx)).await.expect("ready");
    let mut cx = Context::from_waker(Waker::noop());
    let mut buf = vec![0u8; chunk];
    let mut got = Vec::new();
    loop {
        let mut out = ReadBuf::new(&mut buf);
        match Pin::new(&mut *r).poll_read(&mut cx, &mut out) {
            Poll::Ready(Ok(())) => {
                assert!(!out.filled().is_empty(), "the server's stream ended");
                got.extend_from_slice(out.filled());
            }
            Poll::Ready(Err(e)) => panic!("server read: {e}"),
            Poll::Pending => return got,
        }
    }
}

/// Writes as the server's writer does until the socket takes no more; returns what the
/// writes took.
fn fill(w: &mut TlsWrite, data: &[u8]) -> usize {
    let mut cx = Context::from_waker(Waker::noop());
    let mut taken = 0;
    loop {
        let chunk = &data[taken % data.len()..];
        match Pin::new(&mut *w).poll_write(&mut cx, chunk) {
            Poll::Ready(Ok(n)) => taken += n,
            Poll::Ready(Err(e)) => panic!("server write: {e}"),
            Poll::Pending => return taken,
        }
    }
}

/// What becomes of the old halves once their state is copied out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Old {
    Forgotten,
    /// Dropped as any connection's are: what a handover must not do.
    Dropped,
}

/// A duplicate of `tcp`'s socket, as another process receives it.
fn dup(tcp: &TcpStream) -> TcpStream {
    let socket = socket2::SockRef::from(tcp).try_clone().expect("dup");
    let std = std::net::TcpStream::from(socket);
    std.set_nonblocking(true).expect("non-blocking");
    TcpStream::from_std(std).expect("register")
}

/// Copies both halves' state out through its binary form, ends the halves as `old` says,
/// and rebuilds the stream on a duplicate of the socket. Returns the new halves and the
/// states they were rebuilt from.
fn hand_over(r: TlsRead, w: TlsWrite, old: Old) -> (TlsRead, TlsWrite, RxSnapshot, TxSnapshot) {
    let rx = r.snapshot().expect("receiving half");
    let tx = w.snapshot().expect("sending half");
    let (rx_bytes, tx_bytes) = (rx.encode(), tx.encode());
    let tcp = dup(r.tcp());
    match old {
        Old::Forgotten => {
            r.forget();
            w.forget();
        }
        Old::Dropped => {
            drop(r);
            drop(w);
        }
    }
    let rx_again = RxSnapshot::decode(&rx_bytes).expect("decode");
    let tx_again = TxSnapshot::decode(&tx_bytes).expect("decode");
    assert_eq!((&rx_again, &tx_again), (&rx, &tx));
    let (r, w) = TlsStream::resume(tcp, rx_again, tx_again)
        .expect("resume")
        .into_split();
    (r, w, rx, tx)
}

fn rx_secret(r: &TlsRead) -> TrafficSecret {
    r.state.schedule.secret().expect("known").clone()
}

fn tx_secret(w: &TlsWrite) -> TrafficSecret {
    w.state.schedule.secret().expect("known").clone()
}

/// After a cut: bytes both ways (enough from the server for its own key updates), a
/// KeyUpdate from the client that asks for one back, then close_notify: the client reads
/// one stream to its clean end.
async fn carry_on(mut r: TlsRead, mut w: TlsWrite, mut client: Client) {
    let data = pattern(3 * MAX_FRAGMENT + 7);
    let records = client.seal(&data);
    client.send(&records).await;
    let mut got = vec![0u8; data.len()];
    r.read_exact(&mut got).await.expect("server reads");
    assert!(got == data, "the server read other bytes");

    let tx_before = tx_secret(&w);
    let sent = pattern(2 * RECORDS_PER_KEY as usize * MAX_FRAGMENT);
    let (written, got) = tokio::join!(
        async {
            w.write_all(&sent).await?;
            w.flush().await
        },
        client.recv(sent.len())
    );
    written.expect("server write");
    assert!(
        got.expect("client reads") == sent,
        "the client read other bytes"
    );
    assert!(tx_secret(&w) != tx_before, "the server updated its own key");

    let (rx_before, tx_before) = (rx_secret(&r), tx_secret(&w));
    let mut records = client.key_update();
    records.extend(client.seal(b"under the next key"));
    client.send(&records).await;
    let mut got = [0u8; 18];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"under the next key");
    assert!(rx_secret(&r) != rx_before, "the server followed the update");
    w.write_all(b"answered").await.expect("server write");
    w.flush().await.expect("flush");
    assert!(tx_secret(&w) != tx_before, "the server answered the update");
    assert_eq!(client.recv(8).await.expect("client reads"), b"answered");

    w.shutdown().await.expect("close_notify");
    assert_eq!(client.recv(1).await, Err("close_notify".into()));
}

/// Some of everything before the cut: records both ways, key updates both ways.
async fn warm_up(r: &mut TlsRead, w: &mut TlsWrite, client: &mut Client) {
    let mut records = client.seal(b"hello");
    records.extend(client.key_update());
    records.extend(client.seal(b" again"));
    client.send(&records).await;
    let mut got = [0u8; 11];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"hello again");
    let sent = pattern(RECORDS_PER_KEY as usize * MAX_FRAGMENT + 100);
    w.write_all(&sent).await.expect("server write");
    w.flush().await.expect("flush");
    assert!(client.recv(sent.len()).await.expect("client reads") == sent);
}

/// An idle connection handed over with the old halves ended as `old` says; the client's
/// first read after it.
async fn idle_hand_over(old: Old) -> Result<(), String> {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    let (r, mut w, rx, tx) = hand_over(r, w, old);
    assert!(rx.plaintext().is_empty() && rx.ciphertext().is_empty() && tx.unsent().is_empty());
    // Refused on a socket whose sending side was shut down: the client decides.
    if w.write_all(b"after").await.is_ok() {
        let _ = w.flush().await;
    }
    let got = client.recv(5).await?;
    assert_eq!(got, b"after");
    carry_on(r, w, client).await;
    Ok(())
}

#[tokio::test]
async fn an_idle_connection_carries_on_after_a_hand_over() {
    idle_hand_over(Old::Forgotten)
        .await
        .expect("one stream for the client");
}

/// What the forgetting is for: old halves dropped as usual shut the socket's sending side
/// down under the new ones, and the client reads the end of the stream.
#[tokio::test]
async fn old_halves_dropped_instead_of_forgotten_end_the_clients_stream() {
    assert_eq!(
        idle_hand_over(Old::Dropped).await,
        Err("the end of the stream".into())
    );
}

#[tokio::test]
async fn a_record_half_read_is_carried_over() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    let records = client.seal(&pattern(1000));
    let (first, rest) = records.split_at(300);
    client.send(first).await;
    assert!(pump(&mut r, 4096).await.is_empty());
    let (mut r, w, rx, _) = hand_over(r, w, Old::Forgotten);
    assert_eq!(rx.ciphertext(), first);
    client.send(rest).await;
    let mut got = vec![0u8; 1000];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(got, pattern(1000));
    carry_on(r, w, client).await;
}

#[tokio::test]
async fn plaintext_opened_and_not_read_is_carried_over() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    // Two records and the start of a third: all of it in the record buffer.
    let mut records = client.seal(b"first record ");
    records.extend(client.seal(b"second record "));
    let third = client.seal(b"third record");
    records.extend_from_slice(&third[..10]);
    client.send(&records).await;
    assert_eq!(pump(&mut r, 6).await, b"first record second record ");
    client.send(&third[10..]).await;
    let mut got = vec![0u8; 7];
    // The first read takes part of the third record's plaintext, leaving the rest opened.
    poll_fn(|cx| r.poll_ready(cx)).await.expect("ready");
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"third r");
    let (mut r, w, rx, _) = hand_over(r, w, Old::Forgotten);
    assert_eq!(rx.plaintext(), b"ecord");
    assert!(rx.ciphertext().is_empty());
    let records = client.seal(b", fourth and fifth");
    client.send(&records).await;
    let mut got = vec![0u8; 13];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"ecord, fourth");
    let mut got = vec![0u8; 10];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b" and fifth");
    carry_on(r, w, client).await;
}

/// The client's KeyUpdate read before the cut, the record after it half read: the new
/// stream opens under the client's next key, and owes the client a KeyUpdate, which it
/// sends before its next data.
#[tokio::test]
async fn a_key_update_read_and_owed_is_carried_over() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    let rx_before = rx_secret(&r);
    let update = client.key_update();
    let data = client.seal(b"under the next key");
    let mut records = update.clone();
    records.extend_from_slice(&data[..20]);
    client.send(&records).await;
    assert!(pump(&mut r, 4096).await.is_empty());
    let (mut r, mut w, rx, tx) = hand_over(r, w, Old::Forgotten);
    assert!(tx.update_requested());
    assert_eq!((rx.seq(), rx.ciphertext()), (0, &data[..20]));
    assert!(rx_secret(&r) == rx_before.next());
    client.send(&data[20..]).await;
    let mut got = [0u8; 18];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"under the next key");
    let tx_before = tx_secret(&w);
    w.write_all(b"answer").await.expect("server write");
    w.flush().await.expect("flush");
    assert!(
        tx_secret(&w) == tx_before.next(),
        "the owed KeyUpdate went first"
    );
    assert_eq!(client.recv(6).await.expect("client reads"), b"answer");
    carry_on(r, w, client).await;
}

/// The client's KeyUpdate itself half read at the cut: the new stream opens it.
#[tokio::test]
async fn a_key_update_half_read_is_carried_over() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    let rx_before = rx_secret(&r);
    let mut records = client.key_update();
    let split = records.len() - 7;
    records.extend(client.seal(b"under the next key"));
    client.send(&records[..split]).await;
    assert!(pump(&mut r, 4096).await.is_empty());
    let (mut r, w, rx, tx) = hand_over(r, w, Old::Forgotten);
    assert!(!tx.update_requested());
    assert_eq!(rx.ciphertext(), &records[..split]);
    client.send(&records[split..]).await;
    let mut got = [0u8; 18];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"under the next key");
    assert!(rx_secret(&r) == rx_before.next());
    carry_on(r, w, client).await;
}

/// The server's own key at its last record at the cut: the new stream's first record is
/// its KeyUpdate.
#[tokio::test]
async fn an_own_key_update_due_is_carried_over() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    w.state.update_at = w.state.keys.seq;
    let (r, mut w, _, tx) = hand_over(r, w, Old::Forgotten);
    assert_eq!(tx.seq(), tx.update_at());
    let tx_before = tx_secret(&w);
    w.write_all(b"under the next key").await.expect("write");
    w.flush().await.expect("flush");
    assert!(tx_secret(&w) == tx_before.next());
    assert_eq!(w.state.keys.seq, 1);
    let got = client.recv(18).await.expect("client reads");
    assert_eq!(got, b"under the next key");
    carry_on(r, w, client).await;
}

/// Records sealed and not written when the cut comes (the socket full, a record half
/// written, the server's KeyUpdates among them) are written first by the new stream.
#[tokio::test]
async fn records_sealed_and_not_written_are_written_first() {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    small_buffers(&r, &client);
    let data = pattern(64 * 1024 + 13);
    let taken = fill(&mut w, &data);
    // And a record half read the other way.
    let records = client.seal(b"meanwhile");
    client.send(&records[..9]).await;
    assert!(pump(&mut r, 4096).await.is_empty());
    let (mut r, mut w, rx, tx) = hand_over(r, w, Old::Forgotten);
    assert!(!tx.unsent().is_empty());
    assert_eq!(rx.ciphertext(), &records[..9]);
    let mut expected: Vec<u8> = data.iter().cycle().take(taken).copied().collect();
    // Records after them, more than the rest of a record the socket took part of: without
    // them, the client would meet these under the wrong sequence number, or cut apart.
    let after = pattern(MAX_FRAGMENT + 100);
    expected.extend_from_slice(&after);
    let (got, written) = tokio::join!(client.recv(expected.len()), async {
        w.write_all(&after).await?;
        w.flush().await
    });
    written.expect("server write");
    assert!(
        got.expect("client reads") == expected,
        "the client read other bytes"
    );
    client.send(&records[9..]).await;
    let mut got = [0u8; 9];
    r.read_exact(&mut got).await.expect("server reads");
    assert_eq!(&got, b"meanwhile");
    carry_on(r, w, client).await;
}

/// Every byte of a client's stream as a cut: records of data, empty records, padding,
/// KeyUpdates that ask for one back and ones that do not, sent up to the cut, read by the
/// server, handed over, and so on to the end. The server reads the data once and in order,
/// and answers the requests with one KeyUpdate before its next data.
#[tokio::test]
async fn every_cut_in_a_clients_stream_is_carried_over() {
    let pki = pki();
    for suite in [Suite::Aes128Gcm, Suite::Chacha20Poly1305] {
        let (server, mut peer) = peer_pair(&pki, suite, Some(RECORDS_PER_KEY)).await;
        let (mut r, mut w) = server.into_split();
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        for (i, part) in [&b"one"[..], b"", b"three", b"four", b"", b"six"]
            .iter()
            .enumerate()
        {
            stream.extend(peer.data(part, i % 3));
            expected.extend_from_slice(part);
            if i % 2 == 1 {
                stream.extend(peer.key_update(i % 4 == 1));
            }
        }
        let mut got = Vec::new();
        let mut at = 0;
        for cut in 1..=stream.len() {
            peer.send(&stream[at..cut]).await;
            at = cut;
            got.extend(pump(&mut r, 2).await);
            (r, w, _, _) = hand_over(r, w, Old::Forgotten);
        }
        assert_eq!(got, expected, "{suite:?}");
        assert!(w.snapshot().expect("sending half").update_requested());
        w.write_all(b"done").await.expect("write");
        w.flush().await.expect("flush");
        assert_eq!(peer.recv().await, Sent::KeyUpdate(false), "{suite:?}");
        assert_eq!(peer.recv().await, Sent::Data(b"done".to_vec()), "{suite:?}");
    }
}

/// Every write of the server's as a cut, with its own key updated every few records: the
/// client reads every record once and in order, under the keys it follows.
#[tokio::test]
async fn every_cut_between_the_servers_writes_is_carried_over() {
    let pki = pki();
    let (server, mut peer) = peer_pair(&pki, Suite::Aes256Gcm, Some(RECORDS_PER_KEY)).await;
    let (mut r, mut w) = server.into_split();
    let mut updates = 0;
    for i in 0..20u8 {
        w.write_all(&[i; 3]).await.expect("write");
        w.flush().await.expect("flush");
        (r, w, _, _) = hand_over(r, w, Old::Forgotten);
        loop {
            match peer.recv().await {
                Sent::Data(data) => {
                    assert_eq!(data, [i; 3]);
                    break;
                }
                Sent::KeyUpdate(false) => updates += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(
        updates >= 20 / RECORDS_PER_KEY as usize - 1,
        "{updates} key updates"
    );
    drop(r);
}

/// The run of records without data is carried over: a peer cannot reset its bound with a
/// hand-over.
#[tokio::test]
async fn a_run_of_records_without_data_is_carried_over() {
    let pki = pki();
    let (server, mut peer) = peer_pair(&pki, Suite::Aes128Gcm, None).await;
    let (mut r, w) = server.into_split();
    let mut records = Vec::new();
    for _ in 0..MAX_IDLE_RECORDS {
        records.extend(peer.data(b"", 0));
    }
    peer.send(&records).await;
    assert!(pump(&mut r, 64).await.is_empty());
    let (mut r, _w, rx, _) = hand_over(r, w, Old::Forgotten);
    assert!(format!("{rx:?}").contains(&format!("idle_records: {MAX_IDLE_RECORDS}")));
    let mut records = peer.data(b"", 0);
    records.extend(peer.data(b"data", 0));
    peer.send(&records).await;
    let e = r.read(&mut [0; 8]).await.expect_err("one too many");
    assert!(e.to_string().contains("without data"), "{e}");
}

/// A connection that ended, failed or was closed by this side is not handed over.
#[tokio::test]
async fn an_ended_or_failed_connection_is_not_handable() {
    let (server, mut client) = pair().await;
    let (mut r, w) = server.into_split();
    client.shutdown().await.expect("close_notify");
    assert_eq!(r.read(&mut [0; 8]).await.expect("the end"), 0);
    assert_eq!(r.snapshot().err(), Some(NotHandable::Closed));
    assert!(w.snapshot().is_ok(), "this side may still send");

    // The end of the stream without close_notify too.
    let (server, mut tcp, _conn) = raw_pair().await;
    let (mut r, _w) = server.into_split();
    tcp.shutdown().await.expect("fin");
    assert_eq!(r.read(&mut [0; 8]).await.expect("the end"), 0);
    assert_eq!(r.snapshot().err(), Some(NotHandable::Closed));

    let (mut server, _client) = pair().await;
    server.shutdown().await.expect("close_notify");
    assert_eq!(server.write.snapshot().err(), Some(NotHandable::CloseSent));
    assert!(server.read.snapshot().is_ok(), "the peer may still send");

    let (server, mut tcp, mut conn) = raw_pair().await;
    let (mut r, w) = server.into_split();
    conn.writer().write_all(b"spoilt").expect("queue");
    let mut record = Vec::new();
    conn.write_tls(&mut record).expect("record");
    *record.last_mut().expect("a tag") ^= 1;
    tcp.write_all(&record).await.expect("write");
    r.read(&mut [0; 8]).await.expect_err("refused");
    assert_eq!(r.snapshot().err(), Some(NotHandable::Failed));
    assert_eq!(w.snapshot().err(), Some(NotHandable::Failed));
}

/// A snapshot of each kind with every field set: plaintext opened and not read, a record
/// half read, a KeyUpdate owed, records sealed and not written.
async fn busy_snapshots() -> (RxSnapshot, TxSnapshot) {
    let (mut r, mut w, mut client) = client_pair().await;
    warm_up(&mut r, &mut w, &mut client).await;
    small_buffers(&r, &client);
    assert!(fill(&mut w, &pattern(40_000)) > 0);
    let mut records = client.key_update();
    records.extend(client.seal(b"plaintext"));
    let next = client.seal(b"ciphertext");
    records.extend_from_slice(&next[..12]);
    client.send(&records).await;
    poll_fn(|cx| r.poll_ready(cx)).await.expect("ready");
    let mut first = [0u8; 5];
    let n = r.read(&mut first).await.expect("read");
    assert_eq!(&first[..n], b"plain");
    let (rx, tx) = (r.snapshot().expect("rx"), w.snapshot().expect("tx"));
    assert_eq!(rx.plaintext(), b"text");
    assert_eq!(rx.ciphertext(), &next[..12]);
    assert!(tx.update_requested() && !tx.unsent().is_empty());
    (rx, tx)
}

/// Socket buffers small enough that the server's writes soon wait for the client.
fn small_buffers(r: &TlsRead, client: &Client) {
    socket2::SockRef::from(r.tcp())
        .set_send_buffer_size(4096)
        .expect("send buffer");
    socket2::SockRef::from(&client.tcp)
        .set_recv_buffer_size(4096)
        .expect("receive buffer");
}

#[tokio::test]
async fn snapshots_round_trip_through_their_binary_form() {
    let (rx, tx) = busy_snapshots().await;
    let bytes = rx.encode();
    assert_eq!(bytes.len(), rx.encoded_len());
    assert_eq!(RxSnapshot::decode(&bytes), Ok(rx.clone()));
    let bytes = tx.encode();
    assert_eq!(bytes.len(), tx.encoded_len());
    assert_eq!(TxSnapshot::decode(&bytes), Ok(tx.clone()));
    let mut both = Vec::with_capacity(rx.encoded_len() + tx.encoded_len());
    rx.encode_into(&mut both);
    tx.encode_into(&mut both);
    let (rx_part, tx_part) = both.split_at(rx.encoded_len());
    assert_eq!(RxSnapshot::decode(rx_part), Ok(rx));
    assert_eq!(TxSnapshot::decode(tx_part), Ok(tx));
}

/// Bytes that are not a snapshot of this build are refused with an error that says why,
/// never a panic: every truncation, every single byte changed in the fixed fields, trailing
/// bytes, lengths past the end or over the bound, and the other kind.
#[tokio::test]
async fn malformed_snapshots_are_refused() {
    let (rx, tx) = busy_snapshots().await;
    let (rx_bytes, tx_bytes) = (rx.encode(), tx.encode());
    for len in 0..rx_bytes.len() {
        assert_eq!(
            RxSnapshot::decode(&rx_bytes[..len]),
            Err(SnapshotError::Truncated),
            "{len}"
        );
    }
    for len in 0..tx_bytes.len() {
        assert_eq!(
            TxSnapshot::decode(&tx_bytes[..len]),
            Err(SnapshotError::Truncated),
            "{len}"
        );
    }
    let mut longer = rx_bytes.to_vec();
    longer.push(0);
    assert_eq!(RxSnapshot::decode(&longer), Err(SnapshotError::Trailing(1)));
    assert!(matches!(
        RxSnapshot::decode(&tx_bytes),
        Err(SnapshotError::Kind { found: b'T', .. })
    ));
    assert!(matches!(
        TxSnapshot::decode(&rx_bytes),
        Err(SnapshotError::Kind { found: b'R', .. })
    ));

    let changed = |bytes: &[u8], at: usize, value: u8| {
        let mut bytes = bytes.to_vec();
        bytes[at] = value;
        bytes
    };
    assert_eq!(
        RxSnapshot::decode(&changed(&rx_bytes, 1, 2)),
        Err(SnapshotError::Format(2))
    );
    // TLS_AES_128_CCM_SHA256: a TLS 1.3 suite, not one the record layer implements.
    let mut ccm = rx_bytes.to_vec();
    ccm[2..4].copy_from_slice(&[0x13, 0x04]);
    assert_eq!(RxSnapshot::decode(&ccm), Err(SnapshotError::Suite(0x1304)));
    let secret_end = 4 + rx.suite().secret_len();
    // idle_records after the sequence number: over the bound no connection passes.
    assert_eq!(
        RxSnapshot::decode(&changed(&rx_bytes, secret_end + 8, MAX_IDLE_RECORDS + 1)),
        Err(SnapshotError::Field("idle_records"))
    );
    // update_requested after the two sequence numbers.
    assert_eq!(
        TxSnapshot::decode(&changed(&tx_bytes, secret_end + 16, 2)),
        Err(SnapshotError::Field("update_requested"))
    );
    // The plaintext's length: past the end, and over the bound.
    let len_at = secret_end + 9;
    let mut past = rx_bytes.to_vec();
    past[len_at..len_at + 4].copy_from_slice(&1000u32.to_be_bytes());
    assert_eq!(RxSnapshot::decode(&past), Err(SnapshotError::Truncated));
    let mut over = rx_bytes.to_vec();
    over[len_at..len_at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(
        RxSnapshot::decode(&over),
        Err(SnapshotError::Field("plaintext"))
    );

    // Any byte changed anywhere: a snapshot or an error, never a panic.
    for at in 0..rx_bytes.len() {
        for value in [0, 1, 0x7f, 0xff] {
            let _ = RxSnapshot::decode(&changed(&rx_bytes, at, value));
        }
    }
    for at in 0..tx_bytes.len() {
        for value in [0, 1, 0x7f, 0xff] {
            let _ = TxSnapshot::decode(&changed(&tx_bytes, at, value));
        }
    }
}

/// Snapshots of halves of different suites are not one connection's.
#[tokio::test]
async fn halves_of_different_suites_are_not_resumed() {
    let pki = pki();
    let (one, _peer_one) = peer_pair(&pki, Suite::Aes128Gcm, None).await;
    let (other, _peer_other) = peer_pair(&pki, Suite::Aes256Gcm, None).await;
    let rx = one.read.snapshot().expect("rx");
    let tx = other.write.snapshot().expect("tx");
    let tcp = dup(one.tcp());
    assert!(matches!(
        TlsStream::resume(tcp, rx, tx),
        Err(ResumeError::SuiteMismatch {
            rx: Suite::Aes128Gcm,
            tx: Suite::Aes256Gcm
        })
    ));
}

/// A snapshot's `Debug` shows its lengths and sequence numbers, never the secret or the
/// bytes.
#[tokio::test]
async fn a_snapshots_debug_shows_no_secret() {
    let (rx, tx) = busy_snapshots().await;
    let shown = format!("{rx:?} {tx:?}");
    for secret in [rx_bytes_of(&rx), tx_bytes_of(&tx)] {
        let decimal = format!("{:?}", &secret[..4]);
        let decimal = decimal.trim_end_matches(']');
        let hex: String = secret[..4].iter().map(|b| format!("{b:02x}")).collect();
        assert!(!shown.contains(decimal), "{shown}");
        assert!(!shown.to_lowercase().contains(&hex), "{shown}");
    }
    assert!(shown.contains("ciphertext"), "{shown}");
}

/// The secret's bytes, read from the binary form (kind, format, suite, then the secret).
fn rx_bytes_of(rx: &RxSnapshot) -> Vec<u8> {
    rx.encode()[4..4 + rx.suite().secret_len()].to_vec()
}

fn tx_bytes_of(tx: &TxSnapshot) -> Vec<u8> {
    tx.encode()[4..4 + tx.suite().secret_len()].to_vec()
}
