//! The handshake driver: rustls's unbuffered server connection fed one record at a time
//! from the socket, until it hands over the traffic keys.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls::server::{ServerConfig, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use rustls::{ConnectionTrafficSecrets, ProtocolVersion};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::capture::{Captured, SecretCapture};
use super::hello::client_random;
use super::keys::Keys;
use super::known::{Suite, TrafficSecret};
use super::record::{HEADER_LEN, ReadState, Schedule, Shared, WriteState, key_update_at};
use super::stream::{TlsRead, TlsStream, TlsWrite};

/// Why a TLS 1.3 handshake did not yield a stream.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    /// The socket failed, or the peer closed it.
    #[error("tls handshake i/o: {0}")]
    Io(#[from] io::Error),
    /// The handshake failed (bad ClientHello, no common parameters, and so on).
    #[error("tls handshake: {0}")]
    Tls(#[from] rustls::Error),
    /// The peer closed the TLS session before the handshake finished.
    #[error("tls peer closed the connection during the handshake")]
    Closed,
    /// The handshake settled on a version other than TLS 1.3 (the caller sends clients that
    /// cannot speak TLS 1.3 elsewhere).
    #[error("tls handshake negotiated {0:?}, not TLS 1.3")]
    NotTls13(Option<ProtocolVersion>),
    /// The peer sent more handshake bytes than any handshake needs.
    #[error("tls handshake larger than {MAX_HANDSHAKE_BUFFER} bytes")]
    TooLarge,
    /// rustls handed over traffic keys for an AEAD this module does not implement.
    #[error("tls cipher suite not supported by the record layer")]
    UnsupportedSuite,
}

/// A finished handshake.
#[derive(Debug)]
pub struct FinishedHandshake {
    /// The connection, ready for application data.
    pub stream: TlsStream,
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
}

/// Handshake bytes buffered at most before the handshake must have finished (a client's
/// flights are a few KiB; rustls bounds each message as well).
const MAX_HANDSHAKE_BUFFER: usize = 64 * 1024;

static UNCAPTURED: AtomicU64 = AtomicU64::new(0);

/// The TLS 1.3 handshakes [`accept`] finished in this process without the traffic secrets
/// it needs to run the key schedule itself (a config not [`configure`](super::configure)d,
/// or a capture full of failed handshakes): each is served on rustls's key schedule, and its
/// state cannot be copied out ([`NotHandable::NotCaptured`](super::NotHandable)).
pub fn uncaptured() -> u64 {
    UNCAPTURED.load(Ordering::Relaxed)
}

/// Runs a TLS 1.3 server handshake on `tcp` under `config`, whose ClientHello (and whatever
/// followed it) was read already into `received`. `config` must be
/// [`configure`](super::configure)d (secret extraction on, the key log this process's
/// [`SecretCapture`]), and should offer no TLS 1.3 suite outside
/// [`SUPPORTED_SUITES`](super::SUPPORTED_SUITES).
///
/// Application data the client sent with its last flight is kept for the stream to return.
/// The stream updates its sending key before the negotiated suite's confidentiality limit.
/// The handshake's traffic secrets are taken from the capture, checked against the keys
/// rustls hands over, and the key schedule runs in the stream from then on; without them
/// (see [`uncaptured`]) the stream keeps rustls's.
pub async fn accept(
    tcp: TcpStream,
    received: Vec<u8>,
    config: Arc<ServerConfig>,
) -> Result<FinishedHandshake, AcceptError> {
    accept_with(tcp, received, config, SecretCapture::process(), None).await
}

/// [`accept`], taking the secrets from `capture`, and with the records sealed under one
/// sending key set to `records_per_key` instead of the suite's confidentiality limit (tests
/// lower it to watch key updates).
pub(super) async fn accept_with(
    mut tcp: TcpStream,
    mut received: Vec<u8>,
    config: Arc<ServerConfig>,
    capture: &SecretCapture,
    records_per_key: Option<u64>,
) -> Result<FinishedHandshake, AcceptError> {
    let mut conn = UnbufferedServerConnection::new(config)?;
    // What names the handshake in the key log; read before rustls discards the hello.
    let mut random = None;
    let mut outgoing: Vec<u8> = Vec::new();
    // rustls sees the received bytes one whole record at a time, and none past the record
    // that finishes the handshake: what follows (application data, a KeyUpdate, an alert) is
    // left for the record layer, which handles all of it. (Given more, rustls would process
    // a KeyUpdate whose answer it then keeps to itself, since the conversion takes only its
    // traffic keys.) Records rustls has seen but not yet discarded (a handshake message it
    // is still joining) stay in place at the front.
    let mut window = 0;
    loop {
        if random.is_none() && window > 0 {
            random = client_random(&received);
        }
        let UnbufferedStatus { discard, state } = conn.process_tls_records(&mut received[..window]);
        let state = match state {
            Ok(state) => state,
            Err(e) => {
                send_alert(&mut conn, &mut tcp).await;
                return Err(e.into());
            }
        };
        let next = match state {
            ConnectionState::EncodeTlsData(mut data) => {
                let start = outgoing.len();
                outgoing.resize(start + 4096, 0);
                let n = match data.encode(&mut outgoing[start..]) {
                    Ok(n) => n,
                    Err(EncodeError::InsufficientSize(InsufficientSizeError { required_size })) => {
                        outgoing.resize(start + required_size, 0);
                        data.encode(&mut outgoing[start..])
                            .map_err(|e| rustls::Error::General(e.to_string()))?
                    }
                    Err(e) => return Err(rustls::Error::General(e.to_string()).into()),
                };
                outgoing.truncate(start + n);
                Step::Again
            }
            ConnectionState::TransmitTlsData(data) => {
                // Written below, once the state's borrows are gone; nothing is read before.
                data.done();
                Step::Write
            }
            ConnectionState::BlockedHandshake => Step::Read,
            ConnectionState::WriteTraffic(_) => Step::Done,
            ConnectionState::PeerClosed | ConnectionState::Closed => {
                return Err(AcceptError::Closed);
            }
            // rustls sees no record past the Finished, so no application data, and early
            // data is not enabled.
            _ => return Err(rustls::Error::General("unexpected tls state".into()).into()),
        };
        received.drain(..discard);
        window -= discard;
        if !outgoing.is_empty() && !matches!(next, Step::Again) {
            tcp.write_all(&outgoing).await?;
            outgoing.clear();
        }
        match next {
            Step::Again | Step::Write => {}
            // Able to send before the client's Finished (half-RTT data, were it enabled)
            // is not finished: wait for the Finished.
            Step::Read | Step::Done if conn.is_handshaking() => {
                window += next_record(&mut tcp, &mut received, window).await?;
            }
            Step::Read => {
                return Err(rustls::Error::General(
                    "tls handshake wants more after it ended".into(),
                )
                .into());
            }
            Step::Done => break,
        }
    }
    if window != 0 {
        return Err(rustls::Error::General("tls handshake ended inside a record".into()).into());
    }
    let version = conn.protocol_version();
    if version != Some(ProtocolVersion::TLSv1_3) {
        return Err(AcceptError::NotTls13(version));
    }
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    let (secrets, kernel) = conn.dangerous_into_kernel_connection()?;
    let negotiated = kernel.negotiated_cipher_suite();
    let (suite, limit) = match (
        negotiated.tls13(),
        Suite::from_cipher_suite(negotiated.suite()),
    ) {
        (Some(tls13), Some(suite)) => (suite, tls13.common.confidentiality_limit),
        _ => return Err(AcceptError::UnsupportedSuite),
    };
    let captured = random.and_then(|random| capture.take(&random));
    let known = captured.and_then(|c| known_secrets(suite, &c, &secrets.rx.1, &secrets.tx.1));
    let rx = Keys::new(secrets.rx).ok_or(AcceptError::UnsupportedSuite)?;
    let tx = Keys::new(secrets.tx).ok_or(AcceptError::UnsupportedSuite)?;
    let (rx_schedule, tx_schedule) = match known {
        Some((rx, tx)) => {
            // The secrets are all a KeyUpdate needs: rustls's state goes now.
            drop(kernel);
            (Schedule::Known(rx), Schedule::Known(tx))
        }
        None => {
            UNCAPTURED.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                peer = ?tcp.peer_addr().ok(),
                "tls traffic secrets not captured: served on rustls's key schedule"
            );
            let kernel = Arc::new(Mutex::new(kernel));
            (Schedule::Rustls(kernel.clone()), Schedule::Rustls(kernel))
        }
    };
    let shared = Arc::new(Shared::new());
    let (r, w) = tcp.into_split();
    Ok(FinishedHandshake {
        stream: TlsStream {
            read: TlsRead {
                half: r,
                // Records after the Finished, if any, are the record layer's to open.
                state: ReadState::new(rx, rx_schedule, received, shared.clone()),
            },
            write: TlsWrite::new(
                w,
                WriteState::new(
                    tx,
                    tx_schedule,
                    shared,
                    key_update_at(records_per_key.unwrap_or(limit)),
                ),
            ),
        },
        alpn,
    })
}

/// The captured secrets as each direction's traffic secret (the peer's first), if they
/// yield the keys rustls handed over: a client that reused another's ClientHello random
/// could otherwise have put its own secrets in the other's place.
fn known_secrets(
    suite: Suite,
    captured: &Captured,
    rx: &ConnectionTrafficSecrets,
    tx: &ConnectionTrafficSecrets,
) -> Option<(TrafficSecret, TrafficSecret)> {
    let rx_secret = TrafficSecret::new(suite, captured.client())?;
    let tx_secret = TrafficSecret::new(suite, captured.server())?;
    (yields(&rx_secret, rx) && yields(&tx_secret, tx)).then_some((rx_secret, tx_secret))
}

/// Whether `secret` gives the key and IV rustls handed over.
fn yields(secret: &TrafficSecret, keys: &ConnectionTrafficSecrets) -> bool {
    let (ConnectionTrafficSecrets::Aes128Gcm { key, iv }
    | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
    | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv }) = keys
    else {
        return false;
    };
    secret.key().as_slice() == key.as_ref() && secret.iv() == iv.as_ref()
}

/// Reads until `received` holds one more whole record after its first `window` bytes;
/// returns that record's length.
async fn next_record(
    tcp: &mut TcpStream,
    received: &mut Vec<u8>,
    window: usize,
) -> Result<usize, AcceptError> {
    loop {
        if let [_, _, _, hi, lo, ..] = received[window..] {
            let len = HEADER_LEN + usize::from(u16::from_be_bytes([hi, lo]));
            if received.len() - window >= len {
                return Ok(len);
            }
        }
        if received.len() >= MAX_HANDSHAKE_BUFFER {
            return Err(AcceptError::TooLarge);
        }
        received.reserve(4096);
        if tokio::io::AsyncReadExt::read_buf(tcp, received).await? == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
    }
}

/// Sends the alert rustls queued when the handshake failed (unrecognized_name for a wrong
/// SNI, protocol_version, handshake_failure...), so the client learns why. Best effort: the
/// connection is closed either way.
async fn send_alert(conn: &mut UnbufferedServerConnection, tcp: &mut TcpStream) {
    let mut alert = Vec::new();
    // An alert is one record; the bound only guards against a state that never settles.
    for _ in 0..4 {
        let UnbufferedStatus { state, .. } = conn.process_tls_records(&mut []);
        match state {
            Ok(ConnectionState::EncodeTlsData(mut data)) => {
                let start = alert.len();
                alert.resize(start + 64, 0);
                match data.encode(&mut alert[start..]) {
                    Ok(n) => alert.truncate(start + n),
                    Err(_) => {
                        alert.truncate(start);
                        break;
                    }
                }
            }
            Ok(ConnectionState::TransmitTlsData(data)) => data.done(),
            _ => break,
        }
    }
    if !alert.is_empty() {
        let _ = tcp.write_all(&alert).await;
    }
}

enum Step {
    Again,
    Write,
    Read,
    Done,
}
