//! The record layer: the record format, each direction's state short of its socket (the
//! record buffer, the traffic key, what the peer's records said so far), opening received
//! records in place and handing their plaintext over, sealing records to send, and key
//! updates both ways. The stream's halves (`stream.rs`) add the socket.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Poll, ready};

use ring::aead::Aad;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::{CipherSuite, ConnectionTrafficSecrets};
use tokio::io::ReadBuf;

use super::keys::Keys;
use super::known::TrafficSecret;

/// Record content types (RFC 8446, section 5.1).
pub(super) const CONTENT_ALERT: u8 = 21;
pub(super) const CONTENT_HANDSHAKE: u8 = 22;
pub(super) const CONTENT_APPLICATION_DATA: u8 = 23;
/// Alert levels and the closure alerts (RFC 8446, section 6).
pub(super) const ALERT_WARNING: u8 = 1;
const ALERT_FATAL: u8 = 2;
pub(super) const ALERT_CLOSE_NOTIFY: u8 = 0;
const ALERT_USER_CANCELED: u8 = 90;
/// The error alerts this side sends (RFC 8446, section 6.2).
pub(super) const ALERT_UNEXPECTED_MESSAGE: u8 = 10;
pub(super) const ALERT_BAD_RECORD_MAC: u8 = 20;
pub(super) const ALERT_RECORD_OVERFLOW: u8 = 22;
pub(super) const ALERT_ILLEGAL_PARAMETER: u8 = 47;
pub(super) const ALERT_DECODE_ERROR: u8 = 50;
pub(super) const ALERT_INTERNAL_ERROR: u8 = 80;
/// The handshake message type of KeyUpdate, the only one a TLS 1.3 server takes after the
/// handshake.
pub(super) const HANDSHAKE_KEY_UPDATE: u8 = 24;
/// A record header: type, legacy version, length.
pub(super) const HEADER_LEN: usize = 5;
pub(super) const TAG_LEN: usize = 16;
/// Largest plaintext per record (2^14).
pub(super) const MAX_FRAGMENT: usize = 16 * 1024;
/// Largest ciphertext a peer may send per record (2^14 + 256).
pub(super) const MAX_CIPHERTEXT: usize = MAX_FRAGMENT + 256;
/// Records sealed under one key at most, whatever the suite allows: short of where sequence
/// numbers would wrap (rustls stops at the same point).
const MAX_RECORDS_PER_KEY: u64 = 0xffff_ffff_ffff_0000;
/// Records in a row without application data (empty records, key updates, user_canceled
/// warnings) a peer may send. Each costs work and gives nothing, a KeyUpdate the most (a key
/// derivation and a new AEAD key); a peer has no reason to send more than a few in a row.
/// 32 is BoringSSL's bound on KeyUpdates between application data (`kMaxKeyUpdates`) and
/// rustls's on KeyUpdates and on empty records alike, so no client those libraries serve
/// is refused here.
pub(super) const MAX_IDLE_RECORDS: u8 = 32;
/// What a busy reader reads per system call, at least.
const READ_CHUNK: usize = 32 * 1024;

/// The TLS 1.3 suites this record layer seals and opens: the three AEADs rustls hands keys
/// over for (AES-GCM with 128- and 256-bit keys, ChaCha20-Poly1305), all with a 12-byte
/// nonce and a 16-byte tag. A server config must offer no other TLS 1.3 suite.
pub const SUPPORTED_SUITES: [CipherSuite; 3] = [
    CipherSuite::TLS13_AES_128_GCM_SHA256,
    CipherSuite::TLS13_AES_256_GCM_SHA384,
    CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
];

/// Whether the record layer seals and opens records of `suite` (see [`SUPPORTED_SUITES`]).
pub fn supports(suite: CipherSuite) -> bool {
    SUPPORTED_SUITES.contains(&suite)
}

/// The sequence number at which the sending side seals a KeyUpdate, given how many records
/// one key may seal (a suite's confidentiality limit, RFC 8446 section 5.5, as rustls gives
/// it): the KeyUpdate is the last record under the old key, so every key seals at most
/// `records_per_key` records. At least one record of data goes under each key.
pub(super) fn key_update_at(records_per_key: u64) -> u64 {
    records_per_key
        .min(MAX_RECORDS_PER_KEY)
        .saturating_sub(1)
        .max(1)
}

/// What both halves share: whether the peer asked for a key update the sending half has yet
/// to answer, and whether the reading half found the connection broken. Each half keeps its
/// own key schedule.
pub(super) struct Shared {
    pub(super) update_requested: AtomicBool,
    /// Set once the peer's records were refused or the peer sent an error alert: RFC 8446
    /// (section 6.2) ends the connection both ways then, so the sending half takes no more
    /// data.
    pub(super) failed: OnceLock<RecordError>,
}

impl Shared {
    pub(super) fn new() -> Self {
        Self {
            update_requested: AtomicBool::new(false),
            failed: OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("update_requested", &self.update_requested)
            .finish_non_exhaustive()
    }
}

/// rustls's key schedule, kept for a connection whose traffic secrets were not captured at
/// its handshake (it holds both directions', so both halves share it).
pub(super) type Kernel = Arc<Mutex<KernelConnection<ServerConnectionData>>>;

/// Where one direction's next traffic key comes from at a KeyUpdate.
pub(super) enum Schedule {
    /// RFC 8446's key schedule run here from the direction's current traffic secret: every
    /// connection whose secrets were captured at its handshake.
    Known(TrafficSecret),
    /// rustls's, for a connection whose secrets were not captured: served all the same, but
    /// its state cannot be copied out.
    Rustls(Kernel),
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Known(_) => "Known",
            Self::Rustls(_) => "Rustls",
        })
    }
}

impl Schedule {
    /// The peer's next key, after its KeyUpdate.
    fn next_rx(&mut self) -> io::Result<Keys> {
        match self {
            Self::Known(secret) => {
                *secret = secret.next();
                Ok(secret.keys(0))
            }
            Self::Rustls(kernel) => keys_for(lock(kernel).update_rx_secret()),
        }
    }

    /// This side's next key, after its KeyUpdate.
    fn next_tx(&mut self) -> io::Result<Keys> {
        match self {
            Self::Known(secret) => {
                *secret = secret.next();
                Ok(secret.keys(0))
            }
            Self::Rustls(kernel) => keys_for(lock(kernel).update_tx_secret()),
        }
    }

    /// The current traffic secret, if this schedule is run here.
    pub(super) fn secret(&self) -> Option<&TrafficSecret> {
        match self {
            Self::Known(secret) => Some(secret),
            Self::Rustls(_) => None,
        }
    }
}

fn lock(kernel: &Kernel) -> std::sync::MutexGuard<'_, KernelConnection<ServerConnectionData>> {
    kernel.lock().unwrap_or_else(|e| e.into_inner())
}

fn keys_for(update: Result<(u64, ConnectionTrafficSecrets), rustls::Error>) -> io::Result<Keys> {
    Keys::new(update.map_err(protocol_error)?)
        .ok_or_else(|| protocol_error("tls key update for another suite"))
}

pub(super) fn protocol_error(
    what: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Why the peer's records ended the connection: a record this layer refuses, or the peer's
/// own error alert. Reads return it as an [`io::Error`] of [`RecordError::kind`].
#[derive(Debug, Clone, thiserror::Error)]
pub(super) enum RecordError {
    #[error("unexpected tls record type {0} after the handshake")]
    RecordType(u8),
    /// The header's length is over 2^14 + 256.
    #[error("tls record overflow")]
    CiphertextOverflow,
    #[error("tls record too short")]
    TooShort,
    #[error("tls record failed authentication")]
    Authentication,
    /// The inner plaintext is over 2^14 + 1.
    #[error("tls record overflow")]
    PlaintextOverflow,
    #[error("tls record without a content type")]
    NoContentType,
    #[error("too many tls records without data")]
    TooManyWithoutData,
    #[error("unexpected tls content type {0}")]
    ContentType(u8),
    #[error("malformed tls alert")]
    MalformedAlert,
    /// A handshake message of a type a server takes no more after the handshake.
    #[error("unexpected tls handshake message {0} after the handshake")]
    HandshakeMessage(u8),
    #[error("tls handshake message KeyUpdate with request_update {0}")]
    KeyUpdateRequest(u8),
    /// A KeyUpdate with more behind it in its record: a handshake message across a key
    /// change (RFC 8446, section 5.1).
    #[error("tls handshake message KeyUpdate with more behind it in its record")]
    AcrossKeyChange,
    /// A KeyUpdate of the wrong length, or a handshake record too short for any message.
    #[error("malformed tls handshake message")]
    MalformedHandshake,
    /// The peer's next key could not be had (rustls's schedule refused).
    #[error("tls key update: {0}")]
    KeyUpdate(Arc<io::Error>),
    #[error("tls alert {0} from the peer")]
    PeerAlert(u8),
}

impl RecordError {
    pub(super) fn kind(&self) -> io::ErrorKind {
        match self {
            Self::PeerAlert(_) => io::ErrorKind::ConnectionAborted,
            _ => io::ErrorKind::InvalidData,
        }
    }

    /// The alert RFC 8446 asks this side to send before it closes: none after the peer's
    /// own error alert (section 6.2: both sides just close).
    pub(super) fn alert(&self) -> Option<u8> {
        Some(match self {
            // Section 5: an unexpected record type; 5.4: no content type; 5.1: a handshake
            // message across a key change. Records without data are not wrong one by one,
            // only too many of them (BoringSSL answers those with unexpected_message too).
            Self::RecordType(_)
            | Self::NoContentType
            | Self::TooManyWithoutData
            | Self::ContentType(_)
            | Self::HandshakeMessage(_)
            | Self::AcrossKeyChange => ALERT_UNEXPECTED_MESSAGE,
            // Section 5.2: whatever cannot be deprotected, a record too short for its tag
            // included.
            Self::TooShort | Self::Authentication => ALERT_BAD_RECORD_MAC,
            Self::CiphertextOverflow | Self::PlaintextOverflow => ALERT_RECORD_OVERFLOW,
            // Section 4.6.3.
            Self::KeyUpdateRequest(_) => ALERT_ILLEGAL_PARAMETER,
            Self::MalformedAlert | Self::MalformedHandshake => ALERT_DECODE_ERROR,
            Self::KeyUpdate(_) => ALERT_INTERNAL_ERROR,
            Self::PeerAlert(_) => return None,
        })
    }
}

impl From<RecordError> for io::Error {
    fn from(e: RecordError) -> Self {
        io::Error::new(e.kind(), e)
    }
}

/// Why the sending half refuses to write.
#[derive(Debug, thiserror::Error)]
pub(super) enum WriteRefused {
    /// The connection failed on the reading side (see [`Shared::failed`]).
    #[error("tls connection failed: {0}")]
    Failed(RecordError),
    /// This side sent close_notify: nothing may follow it (RFC 8446, section 6.1).
    #[error("tls write after close_notify")]
    Closed,
}

impl From<WriteRefused> for io::Error {
    fn from(e: WriteRefused) -> Self {
        let kind = match e {
            // Not a failed write: the connection had already ended (derp-server's writer
            // tells the two apart by this kind).
            WriteRefused::Failed(_) => io::ErrorKind::ConnectionAborted,
            // What a TCP socket says to a write after its own shutdown.
            WriteRefused::Closed => io::ErrorKind::BrokenPipe,
        };
        io::Error::new(kind, e)
    }
}

/// The receiving half without its socket: the record buffer, the peer's key and what the
/// peer's records said so far. Reads go through [`ReadState::poll_read_with`], whose caller
/// supplies the socket read.
pub(super) struct ReadState {
    pub(super) keys: Keys,
    /// Where the peer's next key comes from.
    pub(super) schedule: Schedule,
    /// Bytes from the socket; before `pos`, records already opened (their plaintext in
    /// place), from `pos`, records not opened yet.
    pub(super) buf: Vec<u8>,
    pub(super) pos: usize,
    /// The part of `buf` holding plaintext not handed over yet.
    pub(super) plain: Range<usize>,
    /// The peer sent close_notify, or ended the stream between records.
    pub(super) closed: bool,
    /// The peer ended the stream between records without close_notify: a truncation
    /// (RFC 8446, section 6.1), read as the end all the same.
    pub(super) truncated: bool,
    /// What ended the reading with an error. Every read from then on returns it: the records
    /// after a bad one, or after the peer's error alert, must never be read (and a record
    /// that failed after earlier records' plaintext was handed over fails the next read).
    pub(super) failure: Option<(io::ErrorKind, Arc<io::Error>)>,
    /// Records in a row that carried no application data.
    pub(super) idle_records: u8,
    pub(super) shared: Arc<Shared>,
}

// Lengths only: the buffers hold plaintext.
impl std::fmt::Debug for ReadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsRead")
            .field("buffered", &(self.buf.len() - self.pos))
            .field("plaintext", &self.plain.len())
            .field("closed", &self.closed)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl ReadState {
    pub(super) fn new(keys: Keys, schedule: Schedule, buf: Vec<u8>, shared: Arc<Shared>) -> Self {
        Self {
            keys,
            schedule,
            buf,
            pos: 0,
            plain: 0..0,
            closed: false,
            truncated: false,
            failure: None,
            idle_records: 0,
            shared,
        }
    }

    /// Whether a read would return without touching the socket.
    pub(super) fn has_buffered(&self) -> bool {
        if !self.plain.is_empty() || self.closed || self.failure.is_some() {
            return true;
        }
        let avail = &self.buf[self.pos..];
        avail.len() >= HEADER_LEN
            && avail.len() >= HEADER_LEN + usize::from(u16::from_be_bytes([avail[3], avail[4]]))
    }

    pub(super) fn release_idle(&mut self) {
        if self.plain.is_empty() && self.pos == self.buf.len() && self.buf.capacity() > 0 {
            self.buf = Vec::new();
            self.pos = 0;
            self.plain = 0..0;
        }
    }

    /// Hands over the plaintext of as many buffered records as fit, calling `fill` (one
    /// read from the socket into the buffer's spare capacity, returning the bytes read, 0 at
    /// the end of the stream) only when none is buffered: a sender's records, each often one
    /// small frame, reach the caller together, as they would from a plain socket.
    pub(super) fn poll_read_with(
        &mut self,
        out: &mut ReadBuf<'_>,
        mut fill: impl FnMut(&mut Vec<u8>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<()>> {
        if let Some((kind, e)) = &self.failure {
            return Poll::Ready(Err(io::Error::new(*kind, e.clone())));
        }
        let mut copied = false;
        loop {
            if !self.plain.is_empty() {
                let n = self.plain.len().min(out.remaining());
                out.put_slice(&self.buf[self.plain.start..self.plain.start + n]);
                self.plain.start += n;
                copied = true;
                if out.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if self.closed {
                return Poll::Ready(Ok(()));
            }
            let need = match self.open_next() {
                Ok(Opened::Record) => continue,
                Ok(Opened::NeedMore(need)) => need,
                Err(e) => {
                    let _ = self.shared.failed.set(e.clone());
                    let e = self.fail(e.into());
                    // What was handed over stands; the error comes with the next read.
                    return Poll::Ready(if copied { Ok(()) } else { Err(e) });
                }
            };
            if copied {
                return Poll::Ready(Ok(()));
            }
            // Everything before `pos` is handed over: make room at the front.
            if self.pos > 0 {
                self.buf.drain(..self.pos);
                self.pos = 0;
                self.plain = 0..0;
            }
            let missing = need - self.buf.len();
            if self.buf.capacity() - self.buf.len() < missing.max(READ_CHUNK / 8) {
                self.buf.reserve(missing.max(READ_CHUNK));
            }
            let n = match ready!(fill(&mut self.buf)) {
                Ok(n) => n,
                Err(e) => return Poll::Ready(Err(self.fail(e))),
            };
            if n == 0 {
                if self.buf.is_empty() {
                    // The peer closed without close_notify. DERP frames delimit themselves,
                    // so no frame can have been cut short unnoticed: this is the end.
                    self.closed = true;
                    self.truncated = true;
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(self.fail(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "tls record cut short by the end of the stream",
                ))));
            }
        }
    }

    /// Ends the reading with `e`: returns it, and keeps it for every later read. The records
    /// still buffered will never be read, so the buffer goes.
    fn fail(&mut self, e: io::Error) -> io::Error {
        self.buf = Vec::new();
        self.pos = 0;
        self.plain = 0..0;
        let kind = e.kind();
        let e = Arc::new(e);
        self.failure = Some((kind, e.clone()));
        io::Error::new(kind, e)
    }
}

/// What opening the next buffered record did.
pub(super) enum Opened {
    /// A record was opened (its plaintext, if any, is ready).
    Record,
    /// The next record is not all here: this many bytes from `pos` are needed.
    NeedMore(usize),
}

impl ReadState {
    /// Opens the record at `pos`, if it is all here.
    pub(super) fn open_next(&mut self) -> Result<Opened, RecordError> {
        let avail = &self.buf[self.pos..];
        if avail.len() < HEADER_LEN {
            return Ok(Opened::NeedMore(HEADER_LEN));
        }
        let header: [u8; HEADER_LEN] = [avail[0], avail[1], avail[2], avail[3], avail[4]];
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if header[0] != CONTENT_APPLICATION_DATA {
            return Err(RecordError::RecordType(header[0]));
        }
        // The legacy version (header[1..3]) is ignored, as RFC 8446 (section 5.1) requires
        // after the ClientHello. It is still part of the additional data (section 5.2), so
        // a version changed in flight fails authentication.
        if len > MAX_CIPHERTEXT {
            return Err(RecordError::CiphertextOverflow);
        }
        if len < TAG_LEN + 1 {
            return Err(RecordError::TooShort);
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
            .map_err(|_| RecordError::Authentication)?
            .len();
        self.keys.seq += 1;
        self.pos = end;
        if opened > MAX_FRAGMENT + 1 {
            return Err(RecordError::PlaintextOverflow);
        }
        // The content type is the last non-zero byte; zeros after it are padding.
        let content = &self.buf[start..start + opened];
        let Some(last) = content.iter().rposition(|&b| b != 0) else {
            return Err(RecordError::NoContentType);
        };
        // Records that carry no data (empty ones, key updates) cost work and give nothing:
        // a run of them is cut off, as rustls does. close_notify ends the stream whatever
        // came before it.
        let close_notify = content[last] == CONTENT_ALERT
            && matches!(
                content[..last],
                [ALERT_WARNING | ALERT_FATAL, ALERT_CLOSE_NOTIFY]
            );
        if content[last] == CONTENT_APPLICATION_DATA && last > 0 {
            self.idle_records = 0;
        } else if !close_notify {
            self.idle_records += 1;
            if self.idle_records > MAX_IDLE_RECORDS {
                return Err(RecordError::TooManyWithoutData);
            }
        }
        match content[last] {
            CONTENT_APPLICATION_DATA => self.plain = start..start + last,
            CONTENT_ALERT => match content[..last] {
                _ if close_notify => self.closed = true,
                // A closure alert that close_notify should follow (RFC 8446, section 6.1),
                // sent as a warning by some clients before close_notify: passed over, as
                // rustls does, and counted with the records that carry no data.
                [ALERT_WARNING, ALERT_USER_CANCELED] => {}
                [_, description] => return Err(RecordError::PeerAlert(description)),
                _ => return Err(RecordError::MalformedAlert),
            },
            CONTENT_HANDSHAKE => self.handshake_message(start..start + last)?,
            other => return Err(RecordError::ContentType(other)),
        }
        Ok(Opened::Record)
    }

    /// A post-handshake message: only KeyUpdate is allowed from a client, and as the last
    /// message of its record (a key change ends the record it is in).
    fn handshake_message(&mut self, range: Range<usize>) -> Result<(), RecordError> {
        match self.buf[range] {
            [HANDSHAKE_KEY_UPDATE, 0, 0, 1, request @ (0 | 1)] => {
                self.keys = self
                    .schedule
                    .next_rx()
                    .map_err(|e| RecordError::KeyUpdate(Arc::new(e)))?;
                if request == 1 {
                    self.shared.update_requested.store(true, Ordering::Release);
                }
                Ok(())
            }
            [HANDSHAKE_KEY_UPDATE, 0, 0, 1, request] => Err(RecordError::KeyUpdateRequest(request)),
            [HANDSHAKE_KEY_UPDATE, 0, 0, 1, _, _, ..] => Err(RecordError::AcrossKeyChange),
            [HANDSHAKE_KEY_UPDATE, ..] | [] => Err(RecordError::MalformedHandshake),
            [other, ..] => Err(RecordError::HandshakeMessage(other)),
        }
    }
}

/// The sending half without its socket: this side's key, when it moves to the next one,
/// and the records sealed and not written yet.
pub(super) struct WriteState {
    pub(super) keys: Keys,
    /// Where this side's next key comes from.
    pub(super) schedule: Schedule,
    /// Sealed records; `out[sent..]` is not written yet.
    pub(super) out: Vec<u8>,
    pub(super) sent: usize,
    pub(super) shared: Arc<Shared>,
    /// The sequence number at which this side seals a KeyUpdate and moves to a new key.
    pub(super) update_at: u64,
    pub(super) close_sent: bool,
    /// The reading half's failure was taken up: its alert, if it calls for one, is sealed.
    pub(super) failure_sealed: bool,
}

impl std::fmt::Debug for WriteState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsWrite")
            .field("unsent", &(self.out.len() - self.sent))
            .field("keys", &self.keys)
            .field("close_sent", &self.close_sent)
            .field("failure_sealed", &self.failure_sealed)
            .finish_non_exhaustive()
    }
}

impl WriteState {
    pub(super) fn new(keys: Keys, schedule: Schedule, shared: Arc<Shared>, update_at: u64) -> Self {
        Self {
            keys,
            schedule,
            out: Vec::new(),
            sent: 0,
            shared,
            update_at,
            close_sent: false,
            failure_sealed: false,
        }
    }

    /// Gives back the record buffer when it is empty, so an idle connection holds none.
    pub(super) fn shrink_idle(&mut self) {
        if self.sent == self.out.len() && self.out.capacity() > 0 {
            self.out = Vec::new();
            self.sent = 0;
        }
    }

    /// Seals `len` bytes gathered from `bufs` (starting `skip` bytes in) as one record.
    pub(super) fn seal(
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
    /// has sealed all the records but the KeyUpdate that it may. Called before every record
    /// of data.
    pub(super) fn update_key_if_due(&mut self) -> io::Result<()> {
        // A load first: the flag is shared with the reading half, and almost always clear.
        let requested = self.shared.update_requested.load(Ordering::Acquire)
            && self.shared.update_requested.swap(false, Ordering::AcqRel);
        if !requested && self.keys.seq < self.update_at {
            return Ok(());
        }
        self.update_key()
    }

    /// Seals an alert, after a KeyUpdate if this key has no record left but that one.
    pub(super) fn seal_alert(&mut self, level: u8, description: u8) -> io::Result<()> {
        if self.keys.seq >= self.update_at {
            self.update_key()?;
        }
        let alert = [level, description];
        self.seal(CONTENT_ALERT, &[io::IoSlice::new(&alert)], 0, alert.len())
    }

    /// The reading half's failure, if it found one; the first call after it seals the alert
    /// the failure calls for (RFC 8446, section 6.2), unless this side sent close_notify
    /// already. The alert goes under the current key, which the peer still opens with: a
    /// KeyUpdate it asked for is not owed on a connection that is ending.
    pub(super) fn take_up_failure(&mut self) -> Option<RecordError> {
        let failure = self.shared.failed.get()?.clone();
        if !self.failure_sealed {
            self.failure_sealed = true;
            if let Some(description) = failure.alert().filter(|_| !self.close_sent) {
                // Best effort: the peer not hearing why is no reason to hide the failure
                // from the caller.
                let _ = self.seal_alert(ALERT_FATAL, description);
            }
        }
        Some(failure)
    }

    /// Seals a KeyUpdate and moves to the next key.
    fn update_key(&mut self) -> io::Result<()> {
        // update_not_requested: this side's update needs no answer.
        let message = [HANDSHAKE_KEY_UPDATE, 0, 0, 1, 0];
        self.seal(
            CONTENT_HANDSHAKE,
            &[io::IoSlice::new(&message)],
            0,
            message.len(),
        )?;
        self.keys = self.schedule.next_tx()?;
        Ok(())
    }
}
