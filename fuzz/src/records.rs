//! derpd's TLS 1.3 record layer (`derp_io::tls`), receiving side, on a connection opened
//! under traffic secrets the target knows (`derp_io::tls::fuzzing::RecordReader`, the same
//! read loop and record opening the server runs, with socket reads taken from the input).
//!
//! `tls_records`: `suite | chunk seed (8) | bytes`, the bytes as the peer's records. Read
//! twice, once in reads and output buffers of sizes the seed picks and once in one read:
//!
//! - it never panics, and the record buffer never grows past [`MAX_BUFFER`];
//! - what comes out, and how the stream ends (a clean end or an error, with its kind and
//!   message), is the same however the bytes are split;
//! - no more plaintext comes out than bytes went in.
//!
//! Seeded with valid records sealed under the target's secrets (by `seeds`), which
//! libFuzzer then mutates.
//!
//! `tls_records_sealed`: `suite | chunk seed (8) | program`. The program builds the records
//! a peer sends (data of any length with padding, empty records, KeyUpdates with any request
//! byte, alerts, any inner plaintext), seals them with this module's own sealer (ring, the
//! key schedule's next secret after each KeyUpdate), then tampers with the sealed bytes (a
//! byte changed anywhere, header included, or the stream cut). A model written from RFC
//! 8446 (sections 5.1–5.4, 4.6.3 and 6) says what each record means; the reader must:
//!
//! - hand over exactly the data of the records before the first that stops it (close_notify,
//!   a record the model refuses, or a tampered one), and nothing of that record or later:
//!   **a tampered record is always refused**;
//! - end cleanly at close_notify or at the end of a stream cut between records, and with an
//!   error at any other stop;
//! - have followed every KeyUpdate (the records after it open under the next key), and
//!   report a pending request for one exactly when the model has one;
//! - keep its buffer under [`MAX_BUFFER`].

use derp_io::tls::fuzzing::{RecordReader, Suite, TrafficSecret};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey};

use crate::Rng;

/// The record buffer's bound. The reader reads into spare room of at least 4 KiB, growing
/// the buffer to 32 KiB plus the record in progress (at most 2^14 + 256 + 5 bytes) when it
/// has less, and `Vec` doubles what it grows; 96 KiB is above both and far below what an
/// unbounded buffer would reach.
pub const MAX_BUFFER: usize = 96 * 1024;

const APPLICATION_DATA: u8 = 23;
const HANDSHAKE: u8 = 22;
const ALERT: u8 = 21;
const KEY_UPDATE: u8 = 24;
/// Largest inner plaintext, content type and padding included (RFC 8446, section 5.4).
const MAX_INNER: usize = (1 << 14) + 1;
/// Records without application data in a row the reader allows (derp-io's bound, which is
/// BoringSSL's and rustls's).
const MAX_IDLE: usize = 32;

/// The secret the peer's first key comes from, in every target and seed.
pub fn peer_secret(suite: Suite) -> TrafficSecret {
    TrafficSecret::new(suite, &vec![0x42; suite.secret_len()])
        .unwrap_or_else(|| unreachable!("the length is the suite's"))
}

/// The suite an input's first byte picks.
pub fn suite(byte: u8) -> Suite {
    Suite::ALL[usize::from(byte) % Suite::ALL.len()]
}

/// Seals records as a TLS 1.3 peer does, independently of derp-io's sealing: ring's AEAD, the
/// IV XORed with the sequence number, the record header as additional data.
#[derive(Debug)]
pub struct Sealer {
    secret: TrafficSecret,
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Sealer {
    /// Sealing from sequence number 0 under `secret`.
    pub fn new(secret: TrafficSecret) -> Self {
        let key = UnboundKey::new(secret.suite().aead(), &secret.key())
            .unwrap_or_else(|_| unreachable!("the key length is the suite's"));
        Self {
            iv: secret.iv(),
            key: LessSafeKey::new(key),
            secret,
            seq: 0,
        }
    }

    /// One record whose inner plaintext is `inner` (content, type, padding); at most 65,519
    /// bytes.
    pub fn seal(&mut self, inner: &[u8]) -> Vec<u8> {
        let len = u16::try_from(inner.len() + 16).unwrap_or(u16::MAX);
        let [hi, lo] = len.to_be_bytes();
        let header = [APPLICATION_DATA, 3, 3, hi, lo];
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        let mut record = header.to_vec();
        record.extend_from_slice(inner);
        let tag = self
            .key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(header),
                &mut record[5..],
            )
            .unwrap_or_else(|_| unreachable!("records are far below the AEAD's limit"));
        record.extend_from_slice(tag.as_ref());
        self.seq += 1;
        record
    }

    /// A record of `data` followed by `padding` zeros.
    pub fn data(&mut self, data: &[u8], padding: usize) -> Vec<u8> {
        let mut inner = data.to_vec();
        inner.push(APPLICATION_DATA);
        inner.resize(inner.len() + padding, 0);
        self.seal(&inner)
    }

    /// A KeyUpdate with `request` as its request byte, then the next key.
    pub fn key_update(&mut self, request: u8) -> Vec<u8> {
        let record = self.seal(&[KEY_UPDATE, 0, 0, 1, request, HANDSHAKE]);
        *self = Self::new(self.secret.next());
        record
    }

    /// An alert record.
    pub fn alert(&mut self, level: u8, description: u8) -> Vec<u8> {
        self.seal(&[level, description, ALERT])
    }
}

/// How a read of the whole stream ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Clean,
    Error(std::io::ErrorKind, String),
}

/// Reads everything `reader` gives out of `input`: the plaintext and how it ended. Reads
/// and output buffers are sized by `sizes` (socket read, output buffer).
fn read_all(
    reader: &mut RecordReader,
    mut input: &[u8],
    mut sizes: impl FnMut() -> (usize, usize),
) -> (Vec<u8>, End) {
    let mut plain = Vec::new();
    let mut out = vec![0u8; 1 << 16];
    loop {
        let (chunk, out_len) = sizes();
        let result = reader.read(&mut input, chunk, &mut out[..out_len.clamp(1, 1 << 16)]);
        assert!(
            reader.buffer_capacity() <= MAX_BUFFER,
            "the record buffer grew to {} bytes",
            reader.buffer_capacity()
        );
        match result {
            Ok(0) => return (plain, End::Clean),
            Ok(n) => plain.extend_from_slice(&out[..n]),
            Err(e) => return (plain, End::Error(e.kind(), e.to_string())),
        }
    }
}

/// Fuzz target: arbitrary bytes as the peer's records.
pub fn tls_records(data: &[u8]) {
    let Some((&suite_byte, rest)) = data.split_first() else {
        return;
    };
    let (seed, stream) = rest.split_at(rest.len().min(8));
    let secret = peer_secret(suite(suite_byte));
    let mut rng = Rng::new(seed);
    let mut reader = RecordReader::new(secret.clone());
    let split = read_all(&mut reader, stream, || {
        (rng.below_incl(20_000), rng.below_incl(70_000))
    });
    let mut reader = RecordReader::new(secret);
    let whole = read_all(&mut reader, stream, || (stream.len(), 1 << 16));
    assert_eq!(
        split, whole,
        "splitting the stream changed what it reads as"
    );
    assert!(whole.0.len() <= stream.len());
}

/// What the model says a record does.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Meaning {
    Data(Vec<u8>),
    /// close_notify: the end of the stream.
    Close,
    /// Over the size limit, or no content type: refused before anything else is read.
    Unreadable,
    /// A record without data: counted towards the bound on those, then taken for what it is.
    NoData(NoData),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum NoData {
    /// Nothing to do: an empty record, a KeyUpdate (with its request), a user_canceled
    /// warning.
    Idle { key_update: Option<bool> },
    /// A fatal alert (the connection aborted by the peer).
    Aborted,
    /// A record that breaks the protocol.
    Refused,
}

/// RFC 8446's reading of one record's inner plaintext, written apart from derp-io's code:
/// the content type is the last non-zero byte (5.4), the whole at most 2^14 + 1 bytes; a
/// server takes application data, alerts (close_notify at either level ends the stream,
/// user_canceled as a warning is passed over as rustls does, anything else is fatal: 6) and
/// of handshake messages only a whole KeyUpdate whose request is 0 or 1, alone in its record
/// (4.6.3, 5.1). Records without data count towards derpd's bound before anything else.
fn meaning(inner: &[u8]) -> Meaning {
    if inner.len() > MAX_INNER {
        return Meaning::Unreadable;
    }
    let Some(end) = inner.iter().rposition(|&b| b != 0) else {
        return Meaning::Unreadable;
    };
    let (content, ty) = (&inner[..end], inner[end]);
    Meaning::NoData(match (ty, content) {
        (APPLICATION_DATA, []) => NoData::Idle { key_update: None },
        (APPLICATION_DATA, data) => return Meaning::Data(data.to_vec()),
        (ALERT, [1 | 2, 0]) => return Meaning::Close,
        (ALERT, [1, 90]) => NoData::Idle { key_update: None },
        (ALERT, [_, _]) => NoData::Aborted,
        (HANDSHAKE, [KEY_UPDATE, 0, 0, 1, request @ (0 | 1)]) => NoData::Idle {
            key_update: Some(*request == 1),
        },
        _ => NoData::Refused,
    })
}

/// Whether a record's header (RFC 8446, section 5.2) lets the reader wait for the rest of it:
/// application data, room for a tag and a content type, at most 2^14 + 256 bytes. The legacy
/// version is ignored (5.1).
fn header_fits(record: &[u8]) -> bool {
    let len = usize::from(u16::from_be_bytes([record[3], record[4]]));
    record[0] == APPLICATION_DATA && (17..=(1 << 14) + 256).contains(&len)
}

/// Big-endian fields off the front of the program; zeros once it runs out.
struct Program<'a>(&'a [u8]);

impl Program<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// Fuzz target: valid records, sealed here, then tampered with.
pub fn tls_records_sealed(data: &[u8]) {
    let Some((&suite_byte, rest)) = data.split_first() else {
        return;
    };
    let (seed, program) = rest.split_at(rest.len().min(8));
    let secret = peer_secret(suite(suite_byte));
    let mut sealer = Sealer::new(secret.clone());
    let mut program = Program(program);
    // (sealed bytes, what the record means).
    let mut records: Vec<(Vec<u8>, Meaning)> = Vec::new();
    // (record, offset in it, XOR): applied after sealing.
    let mut tampering: Vec<(usize, usize, u8)> = Vec::new();
    let mut cut: Option<usize> = None;
    let fill = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 31 + n) as u8 | 1).collect() };
    while !program.0.is_empty() && records.len() < 64 {
        let (record, inner) = match program.u8() % 8 {
            0 | 1 => {
                let len = usize::from(program.u16()) % (MAX_INNER + 8);
                let padding = usize::from(program.u8()) * usize::from(program.u8() % 4);
                let data = fill(len);
                let mut inner = data.clone();
                inner.push(APPLICATION_DATA);
                inner.resize(inner.len() + padding, 0);
                (sealer.data(&data, padding), inner)
            }
            2 => {
                let padding = usize::from(program.u8());
                let mut inner = vec![APPLICATION_DATA];
                inner.resize(1 + padding, 0);
                (sealer.seal(&inner), inner)
            }
            3 => {
                let request = program.u8() % 4;
                let inner = [KEY_UPDATE, 0, 0, 1, request, HANDSHAKE];
                let record = if request < 2 {
                    sealer.key_update(request)
                } else {
                    // Refused: the next key is never reached.
                    sealer.seal(&inner)
                };
                (record, inner.to_vec())
            }
            4 => {
                let (level, description) = (program.u8() % 4, program.u8());
                (
                    sealer.alert(level, description),
                    vec![level, description, ALERT],
                )
            }
            5 => {
                let n = usize::from(program.u8());
                let inner = program.bytes(n).to_vec();
                (sealer.seal(&inner), inner)
            }
            6 => {
                if !records.is_empty() {
                    let at = usize::from(program.u8()) % records.len();
                    tampering.push((at, usize::from(program.u16()), program.u8()));
                }
                continue;
            }
            _ => {
                cut = Some(usize::from(program.u16()) * 4);
                continue;
            }
        };
        let meaning = meaning(&inner);
        records.push((record, meaning));
    }
    let sealed: Vec<Vec<u8>> = records.iter().map(|(r, _)| r.clone()).collect();
    for &(at, offset, xor) in &tampering {
        let record = &mut records[at].0;
        let i = offset % record.len();
        record[i] ^= xor;
    }
    // A record is tampered with if any of its bytes changed (XORs can cancel out).
    let tampered: Vec<bool> = records
        .iter()
        .zip(&sealed)
        .map(|((now, _), then)| now != then)
        .collect();

    let mut stream: Vec<u8> = records.iter().flat_map(|(r, _)| r.clone()).collect();
    let cut = cut.map_or(stream.len(), |c| c.min(stream.len()));
    stream.truncate(cut);

    // The model's reading: records in order until one stops the stream, and the errors it
    // may stop with.
    use std::io::ErrorKind::{ConnectionAborted, InvalidData, UnexpectedEof};
    let mut expected = Vec::new();
    let mut end: Option<&[std::io::ErrorKind]> = None;
    let mut requested = false;
    let mut idle = 0;
    let mut at = 0;
    for (i, (record, meaning)) in records.iter().enumerate() {
        if at + record.len() > cut {
            // Cut inside this record (a cut between records ends the stream cleanly). A
            // header that is in and refuses the record by itself refuses it at once.
            if at < cut {
                end = Some(if tampered[i] {
                    &[InvalidData, UnexpectedEof]
                } else if at + 5 <= cut && !header_fits(record) {
                    &[InvalidData]
                } else {
                    &[UnexpectedEof]
                });
            }
            break;
        }
        at += record.len();
        if tampered[i] {
            // A header that asks for more than is left of the stream ends it early.
            end = Some(&[InvalidData, UnexpectedEof]);
            break;
        }
        match meaning {
            Meaning::Data(data) => {
                idle = 0;
                expected.extend_from_slice(data);
            }
            Meaning::Close => break,
            Meaning::Unreadable => {
                end = Some(&[InvalidData]);
                break;
            }
            Meaning::NoData(what) => {
                idle += 1;
                if idle > MAX_IDLE {
                    end = Some(&[InvalidData]);
                    break;
                }
                match what {
                    NoData::Idle { key_update } => requested |= *key_update == Some(true),
                    NoData::Aborted => {
                        end = Some(&[ConnectionAborted]);
                        break;
                    }
                    NoData::Refused => {
                        end = Some(&[InvalidData]);
                        break;
                    }
                }
            }
        }
    }

    let mut rng = Rng::new(seed);
    let mut reader = RecordReader::new(secret);
    let (plain, got_end) = read_all(&mut reader, &stream, || {
        (rng.below_incl(20_000), rng.below_incl(70_000))
    });
    assert!(
        plain == expected,
        "handed over {} bytes where the model has {} (records: {:?})",
        plain.len(),
        expected.len(),
        records.iter().map(|(_, m)| m).collect::<Vec<_>>()
    );
    match (end, &got_end) {
        (None, End::Clean) => {}
        (Some(kinds), End::Error(kind, _)) if kinds.contains(kind) => {}
        _ => panic!("the stream ended {got_end:?}; the model says {end:?}"),
    }
    assert_eq!(
        reader.update_requested(),
        requested,
        "a KeyUpdate request pending"
    );
}
