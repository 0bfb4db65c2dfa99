//! TLS 1.3 with the record layer in derpd's hands: rustls runs the handshake (through its
//! unbuffered API, on buffers this module owns) and keeps the key schedule; once the handshake
//! is done, records are sealed and opened here, in place, with the traffic keys rustls hands
//! over. This is what kernel TLS does, in user space: kernel TLS is missing on many hosts
//! (no `tls` module), and without it rustls's buffered connection keeps a 4 KiB record
//! buffer and its whole connection state in every idle connection, copies every received
//! record twice and allocates for every record it receives or sends.
//!
//! What it does: [`accept`] finishes a handshake whose ClientHello has already been read,
//! and yields a [`TlsStream`] that splits without a lock into a [`TlsRead`] and a
//! [`TlsWrite`]. Received records are decrypted where they were read and handed over with
//! one copy; sent bytes are copied once into the record buffer and sealed there. An idle
//! connection holds no record buffer in either direction ([`TlsRead::release_idle`],
//! [`TlsWrite::shrink_idle`]), and its reader can wait for the socket to become readable
//! without reading. Key updates work both ways: a peer's KeyUpdate is followed (and answered
//! when it asks), and the sending side updates its own key long before the AEAD's
//! confidentiality limit.
//!
//! What it does not do: TLS 1.2 (a client that cannot speak TLS 1.3 is served by rustls's
//! buffered connection instead), early data (not enabled), the client side, or alerts after
//! the handshake: a failed handshake sends the alert rustls chose, but a connection that
//! breaks the protocol later is closed, the error returned to the caller.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use ring::aead::{
    AES_128_GCM, AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey,
};
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConfig, ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use rustls::{ConnectionTrafficSecrets, ProtocolVersion};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

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
pub struct Accepted {
    /// The connection, ready for application data.
    pub stream: TlsStream,
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
}

/// Handshake bytes buffered at most before the handshake must have finished (a client's
/// flights are a few KiB; rustls bounds each message as well).
const MAX_HANDSHAKE_BUFFER: usize = 64 * 1024;

/// Runs a TLS 1.3 server handshake on `tcp` under `config`, whose ClientHello (and whatever
/// followed it) was read already into `received`. `config` must enable secret extraction.
///
/// Application data the client sent with its last flight is kept for the stream to return.
pub async fn accept(
    mut tcp: TcpStream,
    mut received: Vec<u8>,
    config: Arc<ServerConfig>,
) -> Result<Accepted, AcceptError> {
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
    let rx = Keys::new(secrets.rx).ok_or(AcceptError::UnsupportedSuite)?;
    let tx = Keys::new(secrets.tx).ok_or(AcceptError::UnsupportedSuite)?;
    let shared = Arc::new(Shared {
        kernel: Mutex::new(kernel),
        update_requested: AtomicBool::new(false),
    });
    let (r, w) = tcp.into_split();
    Ok(Accepted {
        stream: TlsStream {
            read: TlsRead {
                half: r,
                keys: rx,
                // Records after the Finished, if any, are the record layer's to open.
                buf: received,
                pos: 0,
                plain: 0..0,
                closed: false,
                error: None,
                idle_records: 0,
                shared: shared.clone(),
            },
            write: TlsWrite {
                half: w,
                keys: tx,
                out: Vec::new(),
                sent: 0,
                shared,
                update_after: KEY_UPDATE_AFTER,
                close_sent: false,
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

/// What the TLS front needs from a ClientHello before it picks a path and a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientHello {
    /// The bytes hold the start of a ClientHello; read more.
    Incomplete,
    /// The bytes are not a well-formed ClientHello (or one this reader does not follow, such
    /// as one over many records): leave the connection to rustls, which refuses or handles it.
    Unknown,
    /// A whole ClientHello.
    Hello {
        /// It offers TLS 1.3 in its supported_versions extension.
        tls13: bool,
        /// The ALPN protocols it offers, in its order (empty when it offers none).
        alpn: Vec<Vec<u8>>,
    },
}

impl ClientHello {
    /// Reads the ClientHello at the start of `bytes`, as read from the socket (one or more
    /// handshake records). Bytes after the hello are ignored.
    pub fn parse(bytes: &[u8]) -> Self {
        // The records' headers first: nothing is copied until the hello is whole, so a hello
        // trickled in over many reads costs a few header reads per read.
        let mut parts: [&[u8]; MAX_HELLO_RECORDS] = [&[]; MAX_HELLO_RECORDS];
        let mut records = 0;
        let mut have = 0;
        let mut need = usize::MAX;
        let mut rest = bytes;
        while have < need {
            match *rest {
                [CONTENT_HANDSHAKE, _, _, hi, lo, ..] => {
                    let len = usize::from(u16::from_be_bytes([hi, lo]));
                    // Empty handshake records are forbidden (RFC 8446, section 5.1).
                    if len == 0 || records == MAX_HELLO_RECORDS {
                        return Self::Unknown;
                    }
                    let Some(payload) = rest.get(HEADER_LEN..HEADER_LEN + len) else {
                        return Self::Incomplete;
                    };
                    if records == 0 {
                        let [_, a, b, c, ..] = *payload else {
                            return Self::Unknown;
                        };
                        need = 4 + (usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c));
                        if need > MAX_CLIENT_HELLO {
                            return Self::Unknown;
                        }
                    }
                    parts[records] = payload;
                    records += 1;
                    have += len;
                    rest = &rest[HEADER_LEN + len..];
                }
                [CONTENT_HANDSHAKE, ..] | [] => return Self::Incomplete,
                _ => return Self::Unknown,
            }
        }
        let message = parts[..records].concat();
        Self::read_message(&message).unwrap_or(Self::Unknown)
    }

    /// Reads a ClientHello message (RFC 8446, section 4.1.2) for its supported_versions and
    /// application_layer_protocol_negotiation extensions.
    fn read_message(message: &[u8]) -> Option<Self> {
        const CLIENT_HELLO: u8 = 1;
        const ALPN: u16 = 16;
        const SUPPORTED_VERSIONS: u16 = 43;
        let mut r = Reader(message);
        if r.u8()? != CLIENT_HELLO {
            return None;
        }
        let len = r.u24()?;
        let mut r = Reader(r.take(len)?);
        r.take(2 + 32)?; // legacy_version, random
        let n = r.u8()?;
        r.take(usize::from(n))?; // legacy_session_id
        let n = r.u16()?;
        r.take(usize::from(n))?; // cipher_suites
        let n = r.u8()?;
        r.take(usize::from(n))?; // legacy_compression_methods
        let (mut tls13, mut alpn) = (false, Vec::new());
        if r.0.is_empty() {
            // No extensions at all: an old client.
            return Some(Self::Hello { tls13, alpn });
        }
        let n = r.u16()?;
        let mut extensions = Reader(r.take(usize::from(n))?);
        while !extensions.0.is_empty() {
            let kind = extensions.u16()?;
            let n = extensions.u16()?;
            let mut body = Reader(extensions.take(usize::from(n))?);
            match kind {
                SUPPORTED_VERSIONS => {
                    let n = body.u8()?;
                    let versions = body.take(usize::from(n))?;
                    tls13 = versions.chunks_exact(2).any(|v| v == [3, 4]);
                }
                ALPN => {
                    let n = body.u16()?;
                    let mut list = Reader(body.take(usize::from(n))?);
                    while !list.0.is_empty() {
                        let n = list.u8()?;
                        alpn.push(list.take(usize::from(n))?.to_vec());
                    }
                }
                _ => {}
            }
        }
        Some(Self::Hello { tls13, alpn })
    }
}

/// Records a ClientHello may span here (one in practice); more is left to rustls.
const MAX_HELLO_RECORDS: usize = 8;

/// A ClientHello's bytes read at most before it must be whole (a post-quantum key share
/// makes one about 1.8 KB; rustls refuses a handshake message over 64 KiB).
pub const MAX_CLIENT_HELLO: usize = 64 * 1024;

/// Big-endian fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u24(&mut self) -> Option<usize> {
        let b = self.take(3)?;
        Some(usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]))
    }
}

/// Record content types (RFC 8446, section 5.1).
const CONTENT_ALERT: u8 = 21;
const CONTENT_HANDSHAKE: u8 = 22;
const CONTENT_APPLICATION_DATA: u8 = 23;
/// The handshake message type of KeyUpdate, the only one a TLS 1.3 server takes after the
/// handshake.
const HANDSHAKE_KEY_UPDATE: u8 = 24;
/// A record header: type, legacy version, length.
const HEADER_LEN: usize = 5;
const TAG_LEN: usize = 16;
/// Largest plaintext per record (2^14).
const MAX_FRAGMENT: usize = 16 * 1024;
/// Largest ciphertext a peer may send per record (2^14 + 256).
const MAX_CIPHERTEXT: usize = MAX_FRAGMENT + 256;
/// Records sealed under one key before the sender updates it: well below AES-GCM's
/// confidentiality limit of 2^24.5 full-size records (RFC 8446, section 5.5).
const KEY_UPDATE_AFTER: u64 = 1 << 23;
/// Records in a row without application data (empty records, key updates) a peer may send.
const MAX_IDLE_RECORDS: u8 = 32;
/// What a busy reader reads per system call, at least.
const READ_CHUNK: usize = 32 * 1024;
/// Plaintext sealed per write call at most, so the record buffer stays bounded when the
/// caller hands over a large batch.
const MAX_SEAL_PER_WRITE: usize = 64 * 1024;

/// What both halves share: the key schedule (touched only on key updates) and whether the
/// peer asked for a key update the sending half has yet to answer.
struct Shared {
    kernel: Mutex<KernelConnection<ServerConnectionData>>,
    update_requested: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("update_requested", &self.update_requested)
            .finish_non_exhaustive()
    }
}

/// One direction's traffic key, its IV and the next record's sequence number.
struct Keys {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").field("seq", &self.seq).finish()
    }
}

impl Keys {
    fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> Option<Self> {
        let (alg, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return None,
        };
        Some(Self {
            key: LessSafeKey::new(UnboundKey::new(alg, key.as_ref()).ok()?),
            iv: iv.as_ref().try_into().ok()?,
            seq,
        })
    }

    /// The per-record nonce: the IV with the sequence number XORed into its last 8 bytes
    /// (RFC 8446, section 5.3).
    fn nonce(&self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        Nonce::assume_unique_for_key(n)
    }
}

fn protocol_error(what: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// A TLS 1.3 connection after its handshake. Read and write it whole, or split it.
#[derive(Debug)]
pub struct TlsStream {
    read: TlsRead,
    write: TlsWrite,
}

impl TlsStream {
    /// Splits the stream into halves that need no lock between them.
    pub fn into_split(self) -> (TlsRead, TlsWrite) {
        (self.read, self.write)
    }

    /// The underlying socket.
    pub fn tcp(&self) -> &TcpStream {
        self.read.half.as_ref()
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().read).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().write).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().write).poll_shutdown(cx)
    }
}

/// The receiving half: opens records in place in its buffer and hands their plaintext over.
pub struct TlsRead {
    half: OwnedReadHalf,
    keys: Keys,
    /// Bytes from the socket; before `pos`, records already opened (their plaintext in
    /// place), from `pos`, records not opened yet.
    buf: Vec<u8>,
    pos: usize,
    /// The part of `buf` holding plaintext not handed over yet.
    plain: Range<usize>,
    /// The peer sent close_notify.
    closed: bool,
    /// A record failed after earlier records' plaintext was handed over; the next read
    /// returns it.
    error: Option<io::Error>,
    /// Records in a row that carried no application data.
    idle_records: u8,
    shared: Arc<Shared>,
}

// Lengths only: the buffers hold plaintext.
impl std::fmt::Debug for TlsRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsRead")
            .field("buffered", &(self.buf.len() - self.pos))
            .field("plaintext", &self.plain.len())
            .field("closed", &self.closed)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for TlsWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsWrite")
            .field("unsent", &(self.out.len() - self.sent))
            .field("keys", &self.keys)
            .field("close_sent", &self.close_sent)
            .finish_non_exhaustive()
    }
}

/// What opening the next buffered record did.
enum Opened {
    /// A record was opened (its plaintext, if any, is ready).
    Record,
    /// The next record is not all here: this many bytes from `pos` are needed.
    NeedMore(usize),
}

impl TlsRead {
    /// Whether a read would return without touching the socket.
    fn has_buffered(&self) -> bool {
        if !self.plain.is_empty() || self.closed || self.error.is_some() {
            return true;
        }
        let avail = &self.buf[self.pos..];
        avail.len() >= HEADER_LEN
            && avail.len() >= HEADER_LEN + usize::from(u16::from_be_bytes([avail[3], avail[4]]))
    }

    /// Ready when a read would make progress: something is buffered, or the socket is
    /// readable. Holds no state of its own while it waits.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.has_buffered() {
            return Poll::Ready(Ok(()));
        }
        let stream: &TcpStream = self.half.as_ref();
        stream.poll_read_ready(cx)
    }

    /// [`TlsRead::poll_ready`], with the socket's readiness checked by a peek (see
    /// [`crate::ReadHalf::poll_readable`]).
    pub fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.has_buffered() {
            return Poll::Ready(Ok(()));
        }
        crate::poll_peek_one(self.half.as_ref(), cx)
    }

    /// Gives back the record buffer when nothing is in it, so an idle connection holds none.
    pub fn release_idle(&mut self) {
        if self.plain.is_empty() && self.pos == self.buf.len() && self.buf.capacity() > 0 {
            self.buf = Vec::new();
            self.pos = 0;
            self.plain = 0..0;
        }
    }

    /// Opens the record at `pos`, if it is all here.
    fn open_next(&mut self) -> io::Result<Opened> {
        let avail = &self.buf[self.pos..];
        if avail.len() < HEADER_LEN {
            return Ok(Opened::NeedMore(HEADER_LEN));
        }
        let header: [u8; HEADER_LEN] = [avail[0], avail[1], avail[2], avail[3], avail[4]];
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if header[0] != CONTENT_APPLICATION_DATA {
            return Err(protocol_error(format!(
                "unexpected tls record type {} after the handshake",
                header[0]
            )));
        }
        if len > MAX_CIPHERTEXT {
            return Err(protocol_error("tls record overflow"));
        }
        if len < TAG_LEN + 1 {
            return Err(protocol_error("tls record too short"));
        }
        if avail.len() < HEADER_LEN + len {
            return Ok(Opened::NeedMore(HEADER_LEN + len));
        }
        let start = self.pos + HEADER_LEN;
        let end = start + len;
        let nonce = self.keys.nonce();
        let opened = self
            .keys
            .key
            .open_in_place(nonce, Aad::from(header), &mut self.buf[start..end])
            .map_err(|_| protocol_error("tls record failed authentication"))?
            .len();
        self.keys.seq += 1;
        self.pos = end;
        if opened > MAX_FRAGMENT + 1 {
            return Err(protocol_error("tls record overflow"));
        }
        // The content type is the last non-zero byte; zeros after it are padding.
        let content = &self.buf[start..start + opened];
        let Some(last) = content.iter().rposition(|&b| b != 0) else {
            return Err(protocol_error("tls record without a content type"));
        };
        // Records that carry no data (empty ones, key updates) cost work and give nothing:
        // a run of them is cut off, as rustls does.
        if content[last] == CONTENT_APPLICATION_DATA && last > 0 {
            self.idle_records = 0;
        } else {
            self.idle_records += 1;
            if self.idle_records > MAX_IDLE_RECORDS {
                return Err(protocol_error("too many tls records without data"));
            }
        }
        match content[last] {
            CONTENT_APPLICATION_DATA => self.plain = start..start + last,
            CONTENT_ALERT => match content[..last] {
                // close_notify, at whatever level the peer gave it.
                [_, 0] => self.closed = true,
                [_, description] => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        format!("tls alert {description} from the peer"),
                    ));
                }
                _ => return Err(protocol_error("malformed tls alert")),
            },
            CONTENT_HANDSHAKE => self.handshake_message(start..start + last)?,
            other => {
                return Err(protocol_error(format!(
                    "unexpected tls content type {other}"
                )));
            }
        }
        Ok(Opened::Record)
    }

    /// A post-handshake message: only KeyUpdate is allowed from a client, and as the last
    /// message of its record (a key change ends the record it is in).
    fn handshake_message(&mut self, range: Range<usize>) -> io::Result<()> {
        match self.buf[range] {
            [HANDSHAKE_KEY_UPDATE, 0, 0, 1, request @ (0 | 1)] => {
                let update = self
                    .shared
                    .kernel
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .update_rx_secret()
                    .map_err(protocol_error)?;
                self.keys = Keys::new(update)
                    .ok_or_else(|| protocol_error("tls key update for another suite"))?;
                if request == 1 {
                    self.shared.update_requested.store(true, Ordering::Release);
                }
                Ok(())
            }
            _ => Err(protocol_error(
                "unexpected tls handshake message after the handshake",
            )),
        }
    }
}

impl AsyncRead for TlsRead {
    /// Hands over the plaintext of as many buffered records as fit, reading from the socket
    /// only when none is buffered: a sender's records, each often one small frame, reach the
    /// caller together, as they would from a plain socket.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.error.take() {
            return Poll::Ready(Err(e));
        }
        let mut copied = false;
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(out.remaining());
                out.put_slice(&this.buf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                copied = true;
                if out.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.closed {
                return Poll::Ready(Ok(()));
            }
            let need = match this.open_next() {
                Ok(Opened::Record) => continue,
                Ok(Opened::NeedMore(need)) => need,
                // What was handed over stands; the error comes with the next read.
                Err(e) if copied => {
                    this.error = Some(e);
                    return Poll::Ready(Ok(()));
                }
                Err(e) => return Poll::Ready(Err(e)),
            };
            if copied {
                return Poll::Ready(Ok(()));
            }
            // Everything before `pos` is handed over: make room at the front.
            if this.pos > 0 {
                this.buf.drain(..this.pos);
                this.pos = 0;
                this.plain = 0..0;
            }
            let missing = need - this.buf.len();
            if this.buf.capacity() - this.buf.len() < missing.max(READ_CHUNK / 8) {
                this.buf.reserve(missing.max(READ_CHUNK));
            }
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.half),
                cx,
                &mut this.buf
            ))?;
            if n == 0 {
                if this.buf.is_empty() {
                    // The peer closed without close_notify; nothing was cut short.
                    this.closed = true;
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "tls record cut short by the end of the stream",
                )));
            }
        }
    }
}

/// The sending half: seals what it is given into records in its buffer and writes them.
pub struct TlsWrite {
    half: OwnedWriteHalf,
    keys: Keys,
    /// Sealed records; `out[sent..]` is not written yet.
    out: Vec<u8>,
    sent: usize,
    shared: Arc<Shared>,
    /// Records sealed under one key before this side updates it.
    update_after: u64,
    close_sent: bool,
}

impl TlsWrite {
    /// Gives back the record buffer when it is empty, so an idle connection holds none.
    pub fn shrink_idle(&mut self) {
        if self.sent == self.out.len() && self.out.capacity() > 0 {
            self.out = Vec::new();
            self.sent = 0;
        }
    }

    /// Writes out sealed records until none is left.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.len() {
            let n = ready!(Pin::new(&mut self.half).poll_write(cx, &self.out[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.out.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }

    /// Seals `len` bytes gathered from `bufs` (starting `skip` bytes in) as one record.
    fn seal(
        &mut self,
        content_type: u8,
        bufs: &[io::IoSlice<'_>],
        mut skip: usize,
        len: usize,
    ) -> io::Result<()> {
        let start = self.out.len();
        let sealed_len = len + 1 + TAG_LEN;
        self.out.reserve(HEADER_LEN + sealed_len);
        // TLS 1.3 hides the real type inside the record: outside, every one is
        // application data, version 1.2.
        self.out
            .extend_from_slice(&[CONTENT_APPLICATION_DATA, 3, 3]);
        self.out
            .extend_from_slice(&u16::try_from(sealed_len).unwrap_or(u16::MAX).to_be_bytes());
        let mut left = len;
        for b in bufs {
            if left == 0 {
                break;
            }
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            let take = (b.len() - skip).min(left);
            self.out.extend_from_slice(&b[skip..skip + take]);
            skip = 0;
            left -= take;
        }
        self.out.push(content_type);
        let header: [u8; HEADER_LEN] = [
            self.out[start],
            self.out[start + 1],
            self.out[start + 2],
            self.out[start + 3],
            self.out[start + 4],
        ];
        let nonce = self.keys.nonce();
        let tag = self
            .keys
            .key
            .seal_in_place_separate_tag(
                nonce,
                Aad::from(header),
                &mut self.out[start + HEADER_LEN..],
            )
            // Sealing fails only for inputs far larger than a record.
            .map_err(|_| io::Error::other("tls record could not be sealed"))?;
        self.out.extend_from_slice(tag.as_ref());
        self.keys.seq += 1;
        Ok(())
    }

    /// Sends a KeyUpdate and moves to the next key when the peer asked for one or this key
    /// has sealed enough records.
    fn update_key_if_due(&mut self) -> io::Result<()> {
        // A load first: the flag is shared with the reading half, and almost always clear.
        let requested = self.shared.update_requested.load(Ordering::Acquire)
            && self.shared.update_requested.swap(false, Ordering::AcqRel);
        if !requested && self.keys.seq < self.update_after {
            return Ok(());
        }
        // update_not_requested: this side's update needs no answer.
        let message = [HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0];
        self.seal(
            CONTENT_HANDSHAKE,
            &[io::IoSlice::new(&message)],
            0,
            message.len(),
        )?;
        let update = self
            .shared
            .kernel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .update_tx_secret()
            .map_err(protocol_error)?;
        self.keys =
            Keys::new(update).ok_or_else(|| protocol_error("tls key update for another suite"))?;
        Ok(())
    }
}

impl AsyncWrite for TlsWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    /// Takes up to 64 KiB (`MAX_SEAL_PER_WRITE`) once earlier records are written, seals
    /// them and starts writing; what the socket does not take now goes out at the next
    /// write or flush.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        let total = bufs
            .iter()
            .map(|b| b.len())
            .sum::<usize>()
            .min(MAX_SEAL_PER_WRITE);
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        this.update_key_if_due()?;
        let mut taken = 0;
        while taken < total {
            let len = (total - taken).min(MAX_FRAGMENT);
            this.seal(CONTENT_APPLICATION_DATA, bufs, taken, len)?;
            taken += len;
        }
        // The bytes are taken: a socket that pushes back only delays them.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(taken))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.half).poll_flush(cx)
    }

    /// Sends close_notify, then ends the TCP stream's sending side.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_sent {
            ready!(this.poll_drain(cx))?;
            // Level warning, description close_notify.
            let alert = [1, 0];
            this.seal(CONTENT_ALERT, &[io::IoSlice::new(&alert)], 0, alert.len())?;
            this.close_sent = true;
        }
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.half).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
