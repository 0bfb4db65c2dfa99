//! The handshake driver: rustls's unbuffered server connection fed one record at a time
//! from the socket, until it hands over the traffic keys.

use std::io;
use std::sync::Arc;

use rustls::ProtocolVersion;
use rustls::server::{ServerConfig, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::keys::Keys;
use super::record::{HEADER_LEN, ReadState, Schedule, Shared, WriteState, key_update_at, supports};
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

/// Runs a TLS 1.3 server handshake on `tcp` under `config`, whose ClientHello (and whatever
/// followed it) was read already into `received`. `config` must enable secret extraction,
/// and should offer no TLS 1.3 suite outside [`SUPPORTED_SUITES`](super::SUPPORTED_SUITES).
///
/// Application data the client sent with its last flight is kept for the stream to return.
/// The stream updates its sending key before the negotiated suite's confidentiality limit.
pub async fn accept(
    tcp: TcpStream,
    received: Vec<u8>,
    config: Arc<ServerConfig>,
) -> Result<FinishedHandshake, AcceptError> {
    accept_with(tcp, received, config, None).await
}

/// [`accept`], with the records sealed under one sending key set to `records_per_key`
/// instead of the suite's confidentiality limit (tests lower it to watch key updates).
pub(super) async fn accept_with(
    mut tcp: TcpStream,
    mut received: Vec<u8>,
    config: Arc<ServerConfig>,
    records_per_key: Option<u64>,
) -> Result<FinishedHandshake, AcceptError> {
    let mut conn = UnbufferedServerConnection::new(config)?;
    let mut outgoing: Vec<u8> = Vec::new();
    // rustls sees the received bytes one whole record at a time, and none past the record
    // that finishes the handshake: what follows (application data, a KeyUpdate, an alert) is
    // left for the record layer, which handles all of it. (Given more, rustls would process
    // a KeyUpdate whose answer it then keeps to itself, since the conversion takes only its
    // traffic keys.) Records rustls has seen but not yet discarded (a handshake message it
    // is still joining) stay in place at the front.
    let mut window = 0;
    loop {
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
    let suite = kernel.negotiated_cipher_suite();
    let limit = match suite.tls13() {
        Some(tls13) if supports(suite.suite()) => tls13.common.confidentiality_limit,
        _ => return Err(AcceptError::UnsupportedSuite),
    };
    let rx = Keys::new(secrets.rx).ok_or(AcceptError::UnsupportedSuite)?;
    let tx = Keys::new(secrets.tx).ok_or(AcceptError::UnsupportedSuite)?;
    let shared = Arc::new(Shared::new(Schedule::Rustls(kernel)));
    let (r, w) = tcp.into_split();
    Ok(FinishedHandshake {
        stream: TlsStream {
            read: TlsRead {
                half: r,
                // Records after the Finished, if any, are the record layer's to open.
                state: ReadState::new(rx, received, shared.clone()),
            },
            write: TlsWrite {
                half: w,
                state: WriteState::new(tx, shared, key_update_at(records_per_key.unwrap_or(limit))),
            },
        },
        alpn,
    })
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
