//! Against OpenSSL's client (`openssl s_client`, a separate implementation, so a
//! misreading of RFC 8446 shared with rustls cannot pass both ends), in every suite: bytes
//! both ways (records of every size from the server, OpenSSL's own record sizes and its
//! padding from the client), key updates from either side, with and without a request for
//! one back, close_notify both ways, and the alert for records the server refuses.
//!
//! `openssl` comes from scripts/test-tools; without it these tests fail, naming the
//! install command.

use std::io::Write as _;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;

use tokio::sync::mpsc;

use super::*;

/// OpenSSL's names for the suites, in [`Suite::ALL`]'s order.
const OPENSSL_SUITES: [&str; 3] = [
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
];

fn require_openssl() {
    let found = Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "openssl is not installed: `apt-get install --no-install-recommends openssl`, or run \
         `scripts/test-tools install` (scripts/test does it when it can)"
    );
}

/// `openssl s_client` connected to a server of ours, its standard streams piped: what the
/// test writes goes to its stdin from a thread of its own, what it prints comes back
/// through channels. Killed and reaped when dropped.
struct SClient {
    child: Child,
    stdin: Option<std_mpsc::Sender<Vec<u8>>>,
    stdout: mpsc::UnboundedReceiver<Vec<u8>>,
    stderr: mpsc::UnboundedReceiver<Vec<u8>>,
    out: Vec<u8>,
    err: Vec<u8>,
}

impl SClient {
    /// Starts s_client for `addr`, TLS 1.3 with `suite` alone, and `extra` arguments.
    fn start(addr: std::net::SocketAddr, suite: &str, extra: &[&str]) -> Self {
        require_openssl();
        let mut child = Command::new("openssl")
            .args(["s_client", "-connect", &addr.to_string()])
            .args([
                "-servername",
                "localhost",
                "-tls1_3",
                "-ciphersuites",
                suite,
            ])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run openssl s_client");
        let mut stdin = child.stdin.take().expect("stdin");
        let (to_stdin, from_test) = std_mpsc::channel::<Vec<u8>>();
        std::thread::spawn(move || {
            for bytes in from_test {
                if stdin.write_all(&bytes).is_err() {
                    return;
                }
            }
            // The sender dropped: end of input.
        });
        let pipe = |mut from: Box<dyn io::Read + Send>| {
            let (tx, rx) = mpsc::unbounded_channel();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            });
            rx
        };
        let stdout = pipe(Box::new(child.stdout.take().expect("stdout")));
        let stderr = pipe(Box::new(child.stderr.take().expect("stderr")));
        Self {
            child,
            stdin: Some(to_stdin),
            stdout,
            stderr,
            out: Vec::new(),
            err: Vec::new(),
        }
    }

    fn send(&self, bytes: &[u8]) {
        self.stdin
            .as_ref()
            .expect("stdin open")
            .send(bytes.to_vec())
            .expect("stdin thread");
    }

    /// Ends s_client's input; interactively, that closes the connection with close_notify.
    fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Reads stdout until it holds `n` bytes, and returns them.
    async fn stdout_bytes(&mut self, n: usize) -> Vec<u8> {
        while self.out.len() < n {
            match self.stdout.recv().await {
                Some(bytes) => self.out.extend_from_slice(&bytes),
                None => panic!(
                    "s_client ended after {} of {n} bytes; stderr: {}",
                    self.out.len(),
                    String::from_utf8_lossy(&self.err)
                ),
            }
        }
        self.out.drain(..n).collect()
    }

    /// Reads stdout until `needle` appears, dropping everything up to its end.
    async fn stdout_until(&mut self, needle: &[u8]) {
        read_until(&mut self.out, &mut self.stdout, needle, "stdout").await;
    }

    /// Reads stderr until `needle` appears, dropping everything up to its end.
    async fn stderr_until(&mut self, needle: &[u8]) {
        read_until(&mut self.err, &mut self.stderr, needle, "stderr").await;
    }
}

/// Takes output from `from` into `buf` until `needle` appears, and drops everything up to its
/// end.
async fn read_until(
    buf: &mut Vec<u8>,
    from: &mut mpsc::UnboundedReceiver<Vec<u8>>,
    needle: &[u8],
    what: &str,
) {
    loop {
        if let Some(i) = buf.windows(needle.len()).position(|w| w == needle) {
            buf.drain(..i + needle.len());
            return;
        }
        match from.recv().await {
            Some(bytes) => buf.extend_from_slice(&bytes),
            None => panic!(
                "s_client ended before printing {:?} to {what}: {}",
                String::from_utf8_lossy(needle),
                String::from_utf8_lossy(buf)
            ),
        }
    }
}

impl Drop for SClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server's stream once its handshake with OpenSSL is done.
async fn accepted_stream(
    accepted: tokio::task::JoinHandle<Result<FinishedHandshake, AcceptError>>,
    name: &str,
) -> TlsStream {
    accepted
        .await
        .expect("server task")
        .unwrap_or_else(|e| panic!("{name}: handshake: {e}"))
        .stream
}

/// A listener and the server side of the next connection it takes.
async fn server_for(
    pki: &Pki,
    records_per_key: Option<u64>,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<FinishedHandshake, AcceptError>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = pki.server.clone();
    let accepted = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        handshake::accept_with(
            tcp,
            Vec::new(),
            config,
            SecretCapture::process(),
            records_per_key,
        )
        .await
    });
    (addr, accepted)
}

/// Bytes from OpenSSL in the records it makes of its input (and, with `-record_padding`,
/// padded), echoed back; then records of every length from 1 to 2^14 from the server, under
/// keys it updates every few records, which OpenSSL must follow.
async fn both_ways(suite: usize) {
    let pki = pki();
    let name = OPENSSL_SUITES[suite];
    for padding in [None, Some("1000")] {
        let (addr, accepted) = server_for(&pki, Some(5)).await;
        let mut extra = vec!["-quiet"];
        if let Some(block) = padding {
            extra.extend(["-record_padding", block]);
        }
        let mut client = SClient::start(addr, name, &extra);
        let mut server = accepted_stream(accepted, name).await;
        // Reads of one byte to more than a record, as the pipe hands them to s_client.
        let sent = pattern(300_000);
        let mut at = 0;
        let mut size = 1;
        while at < sent.len() {
            let end = (at + size).min(sent.len());
            client.send(&sent[at..end]);
            at = end;
            size = size * 7 % 40_009 + 1;
        }
        let mut got = vec![0u8; sent.len()];
        server.read_exact(&mut got).await.expect("server reads");
        assert!(
            got == sent,
            "{name} {padding:?}: the server read other bytes"
        );
        server.write_all(&got).await.expect("echo");
        server.flush().await.expect("flush");
        let echoed = client.stdout_bytes(sent.len()).await;
        assert!(
            echoed == sent,
            "{name} {padding:?}: OpenSSL read other bytes"
        );
    }

    let (addr, accepted) = server_for(&pki, Some(5)).await;
    let mut client = SClient::start(addr, name, &["-quiet"]);
    let server = accepted_stream(accepted, name).await;
    let (_r, mut w) = server.into_split();
    let sizes = 1..=MAX_FRAGMENT;
    let total: usize = sizes.clone().sum();
    let sent = pattern(total);
    let to_send = sent.clone();
    let writer = tokio::spawn(async move {
        let mut at = 0;
        for n in sizes {
            w.write_all(&to_send[at..at + n]).await.expect("write");
            at += n;
        }
        w.flush().await.expect("flush");
        w
    });
    let got = client.stdout_bytes(total).await;
    assert!(got == sent, "{name}: OpenSSL read other bytes");
    writer.await.expect("writer");
}

#[tokio::test]
async fn openssl_both_ways_aes_128_gcm() {
    both_ways(0).await;
}

#[tokio::test]
async fn openssl_both_ways_aes_256_gcm() {
    both_ways(1).await;
}

#[tokio::test]
async fn openssl_both_ways_chacha20_poly1305() {
    both_ways(2).await;
}

/// OpenSSL's KeyUpdates (`k`: no answer wanted, `K`: answer wanted) are followed and
/// answered; the server's own, every three records, are followed by OpenSSL; close_notify
/// ends each direction cleanly.
#[tokio::test]
async fn openssl_key_updates_and_close_notify_in_every_suite() {
    let pki = pki();
    for name in OPENSSL_SUITES {
        let (addr, accepted) = server_for(&pki, Some(4)).await;
        // Interactive, so that s_client takes its command letters.
        let mut client = SClient::start(addr, name, &[]);
        let mut server = accepted_stream(accepted, name).await;
        client.send(b"one\n");
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"one\n");

        // `k` asks for no KeyUpdate back, `K` does; the command itself is not sent.
        for (command, requested, after) in [(b"k\n", false, b"two\n"), (b"K\n", true, b"six\n")] {
            client.send(command);
            client.stderr_until(b"KEYUPDATE").await;
            client.send(after);
            server
                .read_exact(&mut got)
                .await
                .expect("read under the next key");
            assert_eq!(&got, after, "{name}");
            assert_eq!(update_requested(&server), requested, "{name}");
        }
        // The answer, then lines under keys the server updates every three records.
        for i in 0..10 {
            server
                .write_all(format!("answer {i}\n").as_bytes())
                .await
                .expect("write");
            server.flush().await.expect("flush");
            client
                .stdout_until(format!("answer {i}\n").as_bytes())
                .await;
        }
        assert!(!update_requested(&server), "{name}");

        // s_client ends with close_notify when its input does: one more record opened,
        // then the end.
        client.close_stdin();
        let opened = server.read.state.keys.seq;
        let mut rest = Vec::new();
        assert_eq!(
            server.read_to_end(&mut rest).await.expect("a clean end"),
            0,
            "{name}"
        );
        assert_eq!(
            server.read.state.keys.seq,
            opened + 1,
            "{name}: no close_notify"
        );
        server.shutdown().await.expect("close_notify");
    }
}

/// OpenSSL reads the alert the server sends when it refuses its records: 33 KeyUpdates in a
/// row (`k`, each sent before the next is typed) are more records without data than the
/// server takes, and RFC 8446 has unexpected_message for them. s_client names the alert it
/// received in the error it prints.
#[tokio::test]
async fn openssl_reads_the_alert_for_records_the_server_refuses_in_every_suite() {
    let pki = pki();
    for name in OPENSSL_SUITES {
        let (addr, accepted) = server_for(&pki, None).await;
        let mut client = SClient::start(addr, name, &[]);
        let mut server = accepted_stream(accepted, name).await;
        let reader = tokio::spawn(async move {
            let e = read_error(&mut server).await;
            server.shutdown().await.expect("shutdown");
            e
        });
        for _ in 0..=MAX_IDLE_RECORDS {
            client.send(b"k\n");
            client.stderr_until(b"KEYUPDATE").await;
        }
        let e = reader.await.expect("server task");
        assert!(e.to_string().contains("without data"), "{name}: {e}");
        client.stderr_until(b"alert unexpected message").await;
        client.stderr_until(b"SSL alert number 10").await;
    }
}
