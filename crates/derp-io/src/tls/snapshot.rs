//! A connection's record layer state copied out of its halves, and a stream rebuilt from it
//! on a duplicate of the socket: what hands a live TLS connection to another process without
//! the peer noticing. Each half's state is its own (its key, its traffic secret, its
//! buffers); the flag the halves share (a KeyUpdate the peer asked for and this side still
//! owes) goes with the sending half's. Also the states' binary form, secrets included, which
//! the handover carries in memory only the two processes share.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::net::TcpStream;
use zeroize::Zeroizing;

use super::known::{Suite, TrafficSecret};
use super::record::{MAX_IDLE_RECORDS, ReadState, Schedule, Shared, WriteState};
use super::stream::{TlsRead, TlsStream, TlsWrite};

/// Bytes a snapshot's buffer may hold. The record layer's buffers stay far below it (the
/// reading half's under 96 KiB: reads of 32 KiB and the record in progress; the sending
/// half's 64 KiB of sealed records and a few more); the bound keeps a decoder from taking
/// anything larger.
pub const MAX_SNAPSHOT_BUFFER: usize = 1 << 20;

/// The binary form's version, after its kind byte.
const FORMAT: u8 = 1;
const KIND_RX: u8 = b'R';
const KIND_TX: u8 = b'T';

/// Why a half's state cannot be copied out and carried on elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotHandable {
    /// The handshake's traffic secrets were not captured: the key schedule is rustls's,
    /// which cannot be exported (see [`uncaptured`](super::uncaptured)).
    #[error("tls traffic secrets not captured at the handshake")]
    NotCaptured,
    /// The peer ended its sending (close_notify, or the end of the stream).
    #[error("tls peer ended its stream")]
    Closed,
    /// The connection failed: a refused record, the peer's error alert, a failed read.
    #[error("tls connection failed")]
    Failed,
    /// This side sent close_notify.
    #[error("tls close_notify sent")]
    CloseSent,
    /// A buffer holds more than [`MAX_SNAPSHOT_BUFFER`] bytes.
    #[error("tls buffer over {MAX_SNAPSHOT_BUFFER} bytes")]
    Oversized,
}

/// Why bytes are not a snapshot this build reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The bytes end before the snapshot does.
    #[error("tls snapshot cut short")]
    Truncated,
    /// The first byte names no snapshot of this kind.
    #[error("not a tls {expected} snapshot (kind byte {found:#04x})")]
    Kind {
        /// The kind asked for: "receiving" or "sending".
        expected: &'static str,
        /// The byte found.
        found: u8,
    },
    /// A format this build does not read.
    #[error("tls snapshot format {0}, this build reads {FORMAT}")]
    Format(u8),
    /// A suite the record layer does not implement.
    #[error("tls snapshot of suite {0:#06x}, not one the record layer implements")]
    Suite(u16),
    /// A field holds a value it cannot have.
    #[error("tls snapshot field {0} out of range")]
    Field(&'static str),
    /// Bytes follow the snapshot.
    #[error("{0} bytes after the tls snapshot")]
    Trailing(usize),
}

/// Why a stream could not be rebuilt from its halves' states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    /// The two halves' states are of different suites: not one connection's.
    #[error("tls snapshots of different suites: {rx:?} received, {tx:?} sent")]
    SuiteMismatch {
        /// The receiving half's suite.
        rx: Suite,
        /// The sending half's suite.
        tx: Suite,
    },
}

/// The receiving half's state: the peer's current traffic secret and the sequence number of
/// its next record, the records read from the socket and not opened yet, the plaintext
/// opened and not handed over yet, and how many records in a row came without data. Its
/// `Debug` shows lengths, never the secret or the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct RxSnapshot {
    secret: TrafficSecret,
    seq: u64,
    plaintext: Vec<u8>,
    ciphertext: Vec<u8>,
    idle_records: u8,
}

/// The sending half's state: this side's current traffic secret and the sequence number of
/// its next record, the sequence number at which it updates its key, whether it owes the
/// peer a KeyUpdate, and the records sealed and not written yet (which the rebuilt stream
/// writes before anything else: the sequence number counts them already). Its `Debug` shows
/// lengths, never the secret or the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct TxSnapshot {
    secret: TrafficSecret,
    seq: u64,
    update_at: u64,
    update_requested: bool,
    unsent: Vec<u8>,
}

impl std::fmt::Debug for RxSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxSnapshot")
            .field("suite", &self.secret.suite())
            .field("seq", &self.seq)
            .field("plaintext", &self.plaintext.len())
            .field("ciphertext", &self.ciphertext.len())
            .field("idle_records", &self.idle_records)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for TxSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxSnapshot")
            .field("suite", &self.secret.suite())
            .field("seq", &self.seq)
            .field("update_at", &self.update_at)
            .field("update_requested", &self.update_requested)
            .field("unsent", &self.unsent.len())
            .finish_non_exhaustive()
    }
}

impl TlsRead {
    /// Copies the half's state out, to be carried on by [`TlsStream::resume`] on a duplicate
    /// of the socket. Take it, and the sending half's, while neither half is being polled
    /// (between polls any point is a consistent one); then [`forget`](TlsRead::forget) the
    /// half, or carry on with it as if nothing happened.
    pub fn snapshot(&self) -> Result<RxSnapshot, NotHandable> {
        let s = &self.state;
        if s.failure.is_some() || s.shared.failed.get().is_some() {
            return Err(NotHandable::Failed);
        }
        if s.closed {
            return Err(NotHandable::Closed);
        }
        let secret = s.schedule.secret().ok_or(NotHandable::NotCaptured)?;
        let (plaintext, ciphertext) = (&s.buf[s.plain.clone()], &s.buf[s.pos..]);
        if plaintext.len() > MAX_SNAPSHOT_BUFFER || ciphertext.len() > MAX_SNAPSHOT_BUFFER {
            return Err(NotHandable::Oversized);
        }
        Ok(RxSnapshot {
            secret: secret.clone(),
            seq: s.keys.seq,
            plaintext: plaintext.to_vec(),
            ciphertext: ciphertext.to_vec(),
            idle_records: s.idle_records,
        })
    }
}

impl TlsWrite {
    /// Copies the half's state out, to be carried on by [`TlsStream::resume`] on a duplicate
    /// of the socket; see [`TlsRead::snapshot`]. Then [`forget`](TlsWrite::forget) the half:
    /// a drop would shut the socket's sending side down under the new stream.
    pub fn snapshot(&self) -> Result<TxSnapshot, NotHandable> {
        let s = &self.state;
        if s.failure_sealed || s.shared.failed.get().is_some() {
            return Err(NotHandable::Failed);
        }
        if s.close_sent {
            return Err(NotHandable::CloseSent);
        }
        let secret = s.schedule.secret().ok_or(NotHandable::NotCaptured)?;
        let unsent = &s.out[s.sent..];
        if unsent.len() > MAX_SNAPSHOT_BUFFER {
            return Err(NotHandable::Oversized);
        }
        Ok(TxSnapshot {
            secret: secret.clone(),
            seq: s.keys.seq,
            update_at: s.update_at,
            update_requested: s.shared.update_requested.load(Ordering::Acquire),
            unsent: unsent.to_vec(),
        })
    }
}

impl TlsStream {
    /// Both halves' states; see [`TlsRead::snapshot`].
    pub fn snapshot(&self) -> Result<(RxSnapshot, TxSnapshot), NotHandable> {
        Ok((self.read.snapshot()?, self.write.snapshot()?))
    }

    /// The stream whose halves' states were copied out as `rx` and `tx`, on `tcp`, a
    /// duplicate of its socket (registered with the runtime, in non-blocking mode). Writes
    /// nothing and reads nothing: the first write, flush or shutdown writes the records the
    /// old stream sealed and did not write before anything else, and reads return the
    /// plaintext it had opened and not handed over before anything else.
    pub fn resume(tcp: TcpStream, rx: RxSnapshot, tx: TxSnapshot) -> Result<Self, ResumeError> {
        if rx.secret.suite() != tx.secret.suite() {
            return Err(ResumeError::SuiteMismatch {
                rx: rx.secret.suite(),
                tx: tx.secret.suite(),
            });
        }
        let shared = Arc::new(Shared::new());
        shared
            .update_requested
            .store(tx.update_requested, Ordering::Release);
        let RxSnapshot {
            secret: rx_secret,
            seq: rx_seq,
            mut plaintext,
            ciphertext,
            idle_records,
        } = rx;
        let opened = plaintext.len();
        plaintext.extend_from_slice(&ciphertext);
        let mut read = ReadState::new(
            rx_secret.keys(rx_seq),
            Schedule::Known(rx_secret),
            plaintext,
            shared.clone(),
        );
        read.pos = opened;
        read.plain = 0..opened;
        read.idle_records = idle_records;
        let TxSnapshot {
            secret: tx_secret,
            seq: tx_seq,
            update_at,
            update_requested: _,
            unsent,
        } = tx;
        let mut write = WriteState::new(
            tx_secret.keys(tx_seq),
            Schedule::Known(tx_secret),
            shared,
            update_at,
        );
        write.out = unsent;
        let (r, w) = tcp.into_split();
        Ok(Self {
            read: TlsRead {
                half: r,
                state: read,
            },
            write: TlsWrite::new(w, write),
        })
    }
}

impl RxSnapshot {
    /// The connection's suite.
    pub fn suite(&self) -> Suite {
        self.secret.suite()
    }

    /// The sequence number of the peer's next record under its current key.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The plaintext opened and not handed over yet, which the rebuilt stream's reads return
    /// first.
    pub fn plaintext(&self) -> &[u8] {
        &self.plaintext
    }

    /// The bytes read from the socket and not opened yet (the rest of a record, or several).
    pub fn ciphertext(&self) -> &[u8] {
        &self.ciphertext
    }

    /// The binary form's length.
    pub fn encoded_len(&self) -> usize {
        2 + 2
            + self.suite().secret_len()
            + 8
            + 1
            + 4
            + self.plaintext.len()
            + 4
            + self.ciphertext.len()
    }

    /// The binary form, in a buffer zeroed when dropped (it holds the secret).
    pub fn encode(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(self.encoded_len()));
        self.encode_into(&mut out);
        out
    }

    /// Appends the binary form to `out`. Reserve [`RxSnapshot::encoded_len`] first: a `Vec`
    /// that grows leaves a copy of what it held (the secret) in the memory it frees.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        put_head(out, KIND_RX, &self.secret);
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.push(self.idle_records);
        put_bytes(out, &self.plaintext);
        put_bytes(out, &self.ciphertext);
    }

    /// Reads the binary form, which must be all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let mut r = Reader(bytes);
        let secret = r.head(KIND_RX, "receiving")?;
        let seq = r.u64()?;
        let idle_records = r.u8()?;
        if idle_records > MAX_IDLE_RECORDS {
            return Err(SnapshotError::Field("idle_records"));
        }
        let plaintext = r.bytes("plaintext")?.to_vec();
        let ciphertext = r.bytes("ciphertext")?.to_vec();
        r.end()?;
        Ok(Self {
            secret,
            seq,
            plaintext,
            ciphertext,
            idle_records,
        })
    }
}

impl TxSnapshot {
    /// The connection's suite.
    pub fn suite(&self) -> Suite {
        self.secret.suite()
    }

    /// The sequence number of this side's next record under its current key.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The sequence number at which this side updates its key.
    pub fn update_at(&self) -> u64 {
        self.update_at
    }

    /// Whether the peer asked for a KeyUpdate this side has not sent yet.
    pub fn update_requested(&self) -> bool {
        self.update_requested
    }

    /// The records sealed and not written yet (possibly starting inside one).
    pub fn unsent(&self) -> &[u8] {
        &self.unsent
    }

    /// The binary form's length.
    pub fn encoded_len(&self) -> usize {
        2 + 2 + self.suite().secret_len() + 8 + 8 + 1 + 4 + self.unsent.len()
    }

    /// The binary form, in a buffer zeroed when dropped (it holds the secret).
    pub fn encode(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(self.encoded_len()));
        self.encode_into(&mut out);
        out
    }

    /// Appends the binary form to `out`; see [`RxSnapshot::encode_into`].
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        put_head(out, KIND_TX, &self.secret);
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&self.update_at.to_be_bytes());
        out.push(u8::from(self.update_requested));
        put_bytes(out, &self.unsent);
    }

    /// Reads the binary form, which must be all of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let mut r = Reader(bytes);
        let secret = r.head(KIND_TX, "sending")?;
        let seq = r.u64()?;
        let update_at = r.u64()?;
        let update_requested = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(SnapshotError::Field("update_requested")),
        };
        let unsent = r.bytes("unsent")?.to_vec();
        r.end()?;
        Ok(Self {
            secret,
            seq,
            update_at,
            update_requested,
            unsent,
        })
    }
}

/// Kind, format, suite (its IANA number) and the secret (the suite's hash length).
fn put_head(out: &mut Vec<u8>, kind: u8, secret: &TrafficSecret) {
    out.extend_from_slice(&[kind, FORMAT]);
    out.extend_from_slice(&u16::from(secret.suite().cipher_suite()).to_be_bytes());
    out.extend_from_slice(secret.as_bytes());
}

/// A length (four bytes) and the bytes.
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Snapshots hold at most MAX_SNAPSHOT_BUFFER bytes per buffer.
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Big-endian fields off the front of the binary form.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let (head, rest) = self.0.split_at_checked(n).ok_or(SnapshotError::Truncated)?;
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let bytes = self.take(N)?;
        Ok(bytes
            .try_into()
            .unwrap_or_else(|_| unreachable!("took {N} bytes")))
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.array::<1>()?[0])
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn head(&mut self, kind: u8, expected: &'static str) -> Result<TrafficSecret, SnapshotError> {
        let [found, format] = self.array()?;
        if found != kind {
            return Err(SnapshotError::Kind { expected, found });
        }
        if format != FORMAT {
            return Err(SnapshotError::Format(format));
        }
        let code = u16::from_be_bytes(self.array()?);
        let suite = Suite::from_cipher_suite(code.into()).ok_or(SnapshotError::Suite(code))?;
        let secret = self.take(suite.secret_len())?;
        TrafficSecret::new(suite, secret).ok_or(SnapshotError::Field("secret"))
    }

    fn bytes(&mut self, field: &'static str) -> Result<&'a [u8], SnapshotError> {
        let len = usize::try_from(u32::from_be_bytes(self.array()?))
            .map_err(|_| SnapshotError::Field(field))?;
        if len > MAX_SNAPSHOT_BUFFER {
            return Err(SnapshotError::Field(field));
        }
        self.take(len)
    }

    fn end(&self) -> Result<(), SnapshotError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(SnapshotError::Trailing(n)),
        }
    }
}
