//! One handed connection's state as bytes, and back: a versioned, length-checked binary
//! layout, read without trusting a single length in it. The socket itself travels beside
//! the bytes (SCM_RIGHTS), one descriptor per record, in record order.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bytes::Bytes;
use derp_proto::{PeerGoneReason, PublicKey};

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;
use tokio::time::Instant;

use std::os::fd::{AsFd, BorrowedFd};

use derp_io::ReadHalf;
use derp_io::tls::{RxSnapshot, TlsRead, TxSnapshot};
use derp_proto::ws::WsSnapshot;
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

use crate::queue::Control;

/// The server's side of a handover in progress.
#[derive(Debug, Default)]
pub(crate) struct HandoverState {
    /// Set while connections are frozen for a handover: read loops park, frozen writers
    /// park. Read on every wake-up of a busy read loop, as `drain_begun` is. Cleared only
    /// under `parked`'s lock, so a loop depositing its transport either sees the freeze
    /// still on or keeps what it would have lent.
    pub(crate) begun: AtomicBool,
    /// What each parked read loop left: its copy, or `None` for one that cannot go.
    pub(crate) parked: Mutex<HashMap<u64, Option<ReadExport>>>,
    /// Transports lent by parked read loops and given back (the handover was called off,
    /// or their connection stays), each taken by its loop when it goes on.
    pub(crate) returned: Mutex<HashMap<u64, LentSocket>>,
    /// A read loop or a frozen writer parked.
    pub(crate) changed: Notify,
    /// Read-loop state of adopted connections, taken by each when it starts.
    pub(crate) resume: Mutex<HashMap<u64, ReadResume>>,
}

impl HandoverState {
    pub(crate) fn is_begun(&self) -> bool {
        self.begun.load(Ordering::Acquire)
    }

    /// A read loop parked, leaving `export` (`None`: it cannot be handed over). Gives the
    /// lent transport straight back when the freeze has already ended: the loop goes on
    /// with it.
    pub(crate) fn deposit(&self, id: u64, export: Option<ReadExport>) -> Option<LentSocket> {
        let mut parked = lock(&self.parked);
        if !self.is_begun() {
            return export.map(|e| e.socket);
        }
        parked.insert(id, export);
        drop(parked);
        self.changed.notify_waiters();
        None
    }

    /// Ends the freeze: every transport still deposited goes back to its loop.
    pub(crate) fn end(&self) {
        let mut parked = lock(&self.parked);
        self.begun.store(false, Ordering::Release);
        let mut returned = lock(&self.returned);
        for (id, export) in parked.drain() {
            if let Some(export) = export {
                returned.insert(id, export.socket);
            }
        }
    }

    /// Gives connection `id`'s lent transport back, for its loop to take when it goes on.
    pub(crate) fn give_back(&self, id: u64, socket: LentSocket) {
        lock(&self.returned).insert(id, socket);
    }

    /// The transport connection `id`'s loop lent, if it was given back.
    pub(crate) fn take_back(&self, id: u64) -> Option<LentSocket> {
        lock(&self.returned).remove(&id)
    }

    /// A frozen connection's writer parked.
    pub(crate) fn note_still(&self) {
        self.changed.notify_waiters();
    }

    /// The read-loop state an adopted connection continues from, once.
    pub(crate) fn take_resume(&self, id: u64) -> Option<ReadResume> {
        lock(&self.resume).remove(&id)
    }

    /// Waits until `done` holds, re-checking whenever a loop or writer parks, or until
    /// `deadline`. Returns whether it holds.
    pub(crate) async fn wait_for(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a park right after it is not missed.
            changed.as_mut().enable();
            if done() {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return done();
            }
        }
    }
}

/// What a parked read loop leaves for the handover: its transport and state.
#[derive(Debug)]
pub(crate) struct ReadExport {
    pub(crate) socket: LentSocket,
    pub(crate) read_buf: Vec<u8>,
    pub(crate) resume: ReadResume,
    /// The receiving half of derpd's TLS 1.3 record layer, for a TLS connection.
    pub(crate) tls_rx: Option<RxSnapshot>,
    /// The WebSocket layer, for a connection framed in WebSocket messages.
    pub(crate) ws: Option<WsState>,
}

/// A read loop's transport, lent to a handover while the loop is parked: the kinds whose
/// state is all in the kernel and the relay, so a socket is what goes across. Holding it
/// keeps the socket open without a descriptor of its own.
pub(crate) enum LentSocket {
    Tcp(OwnedReadHalf),
    Tls(Box<TlsRead>),
}

impl LentSocket {
    /// `half` as a lendable transport, or `half` back for any other kind.
    pub(crate) fn lend(half: ReadHalf) -> Result<Self, ReadHalf> {
        match half {
            ReadHalf::Tcp(r) => Ok(Self::Tcp(r)),
            ReadHalf::Tls(r) => Ok(Self::Tls(r)),
            other @ (ReadHalf::Boxed(_) | ReadHalf::Halves(_)) => Err(other),
        }
    }

    /// The transport, for its loop to read from again.
    pub(crate) fn into_half(self) -> ReadHalf {
        match self {
            Self::Tcp(r) => ReadHalf::Tcp(r),
            Self::Tls(r) => ReadHalf::Tls(r),
        }
    }

    /// The TCP socket under it.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Tcp(r) => AsRef::<TcpStream>::as_ref(r).as_fd(),
            Self::Tls(r) => r.tcp().as_fd(),
        }
    }
}

impl std::fmt::Debug for LentSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LentSocket").field(&self.fd()).finish()
    }
}

/// A WebSocket decoder's state and the wire bytes it has not decoded yet.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WsState {
    pub(crate) decoder: WsSnapshot,
    pub(crate) raw: Vec<u8>,
}

/// What the bytes start with: a name and the layout's version.
const MAGIC: &[u8; 4] = b"DRPH";
/// The layout this build writes and reads. A predecessor writing another is refused (the
/// connections then stay with it).
pub const FORMAT: u16 = 2;

/// Why handed connection state could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    /// It does not start as handed state does.
    #[error("not handed connection state")]
    Magic,
    /// A layout this build does not read.
    #[error("handed state of format {0}, this build reads {FORMAT}")]
    Format(u16),
    /// It ends in the middle of a field.
    #[error("handed state is truncated")]
    Truncated,
    /// A field holds a value no writer produces.
    #[error("handed state has a bad {0}")]
    Bad(&'static str),
    /// Records and sockets do not pair up.
    #[error("{records} records arrived with {sockets} sockets")]
    Sockets { records: usize, sockets: usize },
}

/// How the read loop continues: the parts of its state that are not bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ReadResume {
    /// Bytes of an unknown or oversized frame still to be skipped.
    pub(crate) skip: u32,
    /// The receive rate limit's bucket, when the connection has one.
    pub(crate) tokens: Option<f64>,
    /// How long the connection has been up.
    pub(crate) age_ms: u64,
    /// How long until its next keepalive.
    pub(crate) keepalive_in_ms: u64,
}

/// A queued packet.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PacketRecord {
    pub(crate) disco: bool,
    pub(crate) src: PublicKey,
    pub(crate) forwarded: bool,
    /// How long it had been queued, for the queue-time metrics.
    pub(crate) age_us: u64,
    pub(crate) data: Bytes,
}

/// One connection's state. The fields are what `conn` and the registry need to rebuild it
/// exactly; see `docs/architecture.md`, "Upgrading in place".
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ConnRecord {
    pub(crate) key: PublicKey,
    pub(crate) remote: SocketAddr,
    pub(crate) presence_flags: u8,
    pub(crate) can_mesh: bool,
    pub(crate) preferred: bool,
    /// Its key's active connection.
    pub(crate) active: bool,
    /// A mesh peer subscribed to presence updates.
    pub(crate) watcher: bool,
    pub(crate) rtt_mark: u8,
    /// DERP bytes read and not yet handled.
    pub(crate) read_buf: Vec<u8>,
    pub(crate) resume: ReadResume,
    /// Framed bytes of a batch begun and not finished: written first.
    pub(crate) tail: Vec<u8>,
    /// Sources to tell the client about when they leave.
    pub(crate) sent_from: Vec<PublicKey>,
    pub(crate) packets: Vec<PacketRecord>,
    /// PeerGone, PeerPresent and WebSocket pongs; a pending keepalive is not carried (the
    /// read loop times its own).
    pub(crate) control: Vec<Control>,
    pub(crate) pong: Option<[u8; 8]>,
    /// CLOCK_MONOTONIC when its read loop parked, in nanoseconds: what the successor
    /// measures the hold from.
    pub(crate) parked_at_ns: u64,
    /// derpd's TLS 1.3 record layer, both directions, for a TLS connection (secrets
    /// included: the record is never written where anything but the two processes reads).
    pub(crate) tls: Option<(RxSnapshot, TxSnapshot)>,
    /// The WebSocket layer, for a connection framed in WebSocket messages.
    pub(crate) ws: Option<WsState>,
}

/// Appends the records to `out`.
pub(crate) fn encode(records: &[&ConnRecord], out: &mut Vec<u8>) {
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_be_bytes());
    put_u32(out, records.len());
    for r in records {
        let mut body = Vec::with_capacity(256 + r.read_buf.len() + r.tail.len());
        encode_one(r, &mut body);
        put_u32(out, body.len());
        out.extend_from_slice(&body);
    }
}

fn encode_one(r: &ConnRecord, out: &mut Vec<u8>) {
    out.extend_from_slice(r.key.as_bytes());
    put_addr(out, r.remote);
    out.push(r.presence_flags);
    let bits = u8::from(r.can_mesh)
        | u8::from(r.preferred) << 1
        | u8::from(r.active) << 2
        | u8::from(r.watcher) << 3;
    out.push(bits);
    out.push(r.rtt_mark);
    put_bytes(out, &r.read_buf);
    out.extend_from_slice(&r.resume.skip.to_be_bytes());
    match r.resume.tokens {
        Some(t) => {
            out.push(1);
            out.extend_from_slice(&t.to_bits().to_be_bytes());
        }
        None => out.push(0),
    }
    out.extend_from_slice(&r.resume.age_ms.to_be_bytes());
    out.extend_from_slice(&r.resume.keepalive_in_ms.to_be_bytes());
    put_bytes(out, &r.tail);
    put_u32(out, r.sent_from.len());
    for k in &r.sent_from {
        out.extend_from_slice(k.as_bytes());
    }
    put_u32(out, r.packets.len());
    for p in &r.packets {
        out.push(u8::from(p.disco) | u8::from(p.forwarded) << 1);
        out.extend_from_slice(p.src.as_bytes());
        out.extend_from_slice(&p.age_us.to_be_bytes());
        put_bytes(out, &p.data);
    }
    put_u32(out, r.control.iter().filter(|c| carried(c)).count());
    for c in &r.control {
        match c {
            Control::PeerGone(peer, reason) => {
                out.push(1);
                out.extend_from_slice(peer.as_bytes());
                out.push((*reason).to_u8());
            }
            Control::PeerPresent { peer, addr, flags } => {
                out.push(2);
                out.extend_from_slice(peer.as_bytes());
                put_addr(out, *addr);
                out.push(*flags);
            }
            Control::WsPong(data) => {
                out.push(3);
                put_bytes(out, data);
            }
            Control::KeepAlive | Control::Restarting { .. } | Control::ObservedAddr(_) => {}
        }
    }
    match r.pong {
        Some(p) => {
            out.push(1);
            out.extend_from_slice(&p);
        }
        None => out.push(0),
    }
    out.extend_from_slice(&r.parked_at_ns.to_be_bytes());
    out.push(u8::from(r.tls.is_some()) | u8::from(r.ws.is_some()) << 1);
    if let Some((rx, tx)) = &r.tls {
        put_u32(out, rx.encoded_len());
        rx.encode_into(out);
        put_u32(out, tx.encoded_len());
        tx.encode_into(out);
    }
    if let Some(ws) = &r.ws {
        put_u32(out, ws.decoder.encoded_len());
        ws.decoder.encode(out);
        put_bytes(out, &ws.raw);
    }
}

/// Whether a queued control frame is carried to the successor: a keepalive is timed again
/// there, a Restarting frame is never queued during a handover, and QUIC is not handed.
fn carried(c: &Control) -> bool {
    matches!(
        c,
        Control::PeerGone(..) | Control::PeerPresent { .. } | Control::WsPong(_)
    )
}

/// Reads the records `encode` wrote.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<ConnRecord>, RecordError> {
    let mut r = Reader { bytes };
    if r.take(4).map_err(|_| RecordError::Magic)? != MAGIC {
        return Err(RecordError::Magic);
    }
    let format = u16::from_be_bytes(r.array()?);
    if format != FORMAT {
        return Err(RecordError::Format(format));
    }
    let count = r.u32()?;
    let mut records = Vec::new();
    for _ in 0..count {
        let len = r.u32()?;
        let mut body = Reader {
            bytes: r.take(len)?,
        };
        records.push(decode_one(&mut body)?);
        if !body.bytes.is_empty() {
            return Err(RecordError::Bad("record length"));
        }
    }
    if !r.bytes.is_empty() {
        return Err(RecordError::Bad("length"));
    }
    Ok(records)
}

fn decode_one(r: &mut Reader<'_>) -> Result<ConnRecord, RecordError> {
    let key = r.key()?;
    let remote = r.addr()?;
    let presence_flags = r.u8()?;
    let bits = r.u8()?;
    if bits & !0b1111 != 0 {
        return Err(RecordError::Bad("flags"));
    }
    let rtt_mark = r.u8()?;
    let read_buf = r.bytes()?.to_vec();
    let skip = u32::from_be_bytes(r.array()?);
    let tokens = match r.u8()? {
        0 => None,
        1 => Some(f64::from_bits(u64::from_be_bytes(r.array()?))),
        _ => return Err(RecordError::Bad("rate limit")),
    };
    let age_ms = u64::from_be_bytes(r.array()?);
    let keepalive_in_ms = u64::from_be_bytes(r.array()?);
    let tail = r.bytes()?.to_vec();
    let n = r.u32()?;
    let mut sent_from = Vec::new();
    for _ in 0..n {
        sent_from.push(r.key()?);
    }
    let n = r.u32()?;
    let mut packets = Vec::new();
    for _ in 0..n {
        let bits = r.u8()?;
        if bits & !0b11 != 0 {
            return Err(RecordError::Bad("packet flags"));
        }
        packets.push(PacketRecord {
            disco: bits & 1 != 0,
            forwarded: bits & 2 != 0,
            src: r.key()?,
            age_us: u64::from_be_bytes(r.array()?),
            data: Bytes::copy_from_slice(r.bytes()?),
        });
    }
    let n = r.u32()?;
    let mut control = Vec::new();
    for _ in 0..n {
        control.push(match r.u8()? {
            1 => Control::PeerGone(r.key()?, PeerGoneReason::from_u8(r.u8()?)),
            2 => Control::PeerPresent {
                peer: r.key()?,
                addr: r.addr()?,
                flags: r.u8()?,
            },
            3 => Control::WsPong(Bytes::copy_from_slice(r.bytes()?)),
            _ => return Err(RecordError::Bad("control frame")),
        });
    }
    let pong = match r.u8()? {
        0 => None,
        1 => Some(r.array()?),
        _ => return Err(RecordError::Bad("pong")),
    };
    let parked_at_ns = u64::from_be_bytes(r.array()?);
    let layers = r.u8()?;
    if layers & !0b11 != 0 {
        return Err(RecordError::Bad("layers"));
    }
    let tls = if layers & 1 != 0 {
        let rx = RxSnapshot::decode(r.bytes()?).map_err(|_| RecordError::Bad("TLS state"))?;
        let tx = TxSnapshot::decode(r.bytes()?).map_err(|_| RecordError::Bad("TLS state"))?;
        Some((rx, tx))
    } else {
        None
    };
    let ws = if layers & 2 != 0 {
        let decoder =
            WsSnapshot::decode(r.bytes()?).map_err(|_| RecordError::Bad("WebSocket state"))?;
        Some(WsState {
            decoder,
            raw: r.bytes()?.to_vec(),
        })
    } else {
        None
    };
    Ok(ConnRecord {
        key,
        remote,
        presence_flags,
        can_mesh: bits & 1 != 0,
        preferred: bits & 2 != 0,
        active: bits & 4 != 0,
        watcher: bits & 8 != 0,
        rtt_mark,
        read_buf,
        resume: ReadResume {
            skip,
            tokens,
            age_ms,
            keepalive_in_ms,
        },
        tail,
        sent_from,
        packets,
        control,
        pong,
        parked_at_ns,
        tls,
        ws,
    })
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    // Every length written is of something held in memory, far below 4 GiB.
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    out.extend_from_slice(&n.to_be_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_u32(out, b.len());
    out.extend_from_slice(b);
}

fn put_addr(out: &mut Vec<u8>, addr: SocketAddr) {
    match addr.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out.extend_from_slice(&addr.port().to_be_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        if self.bytes.len() < n {
            return Err(RecordError::Truncated);
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RecordError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<usize, RecordError> {
        usize::try_from(u32::from_be_bytes(self.array()?)).map_err(|_| RecordError::Truncated)
    }

    fn bytes(&mut self) -> Result<&'a [u8], RecordError> {
        let n = self.u32()?;
        self.take(n)
    }

    fn key(&mut self) -> Result<PublicKey, RecordError> {
        Ok(PublicKey::from_bytes(self.array()?))
    }

    fn addr(&mut self) -> Result<SocketAddr, RecordError> {
        let ip = match self.u8()? {
            4 => IpAddr::V4(Ipv4Addr::from(self.array::<4>()?)),
            6 => IpAddr::V6(Ipv6Addr::from(self.array::<16>()?)),
            _ => return Err(RecordError::Bad("address")),
        };
        Ok(SocketAddr::new(ip, u16::from_be_bytes(self.array()?)))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section here is an insert, a remove or a clear.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ConnRecord {
        ConnRecord {
            key: PublicKey::from_bytes([7; 32]),
            remote: "[2001:db8::1]:41641".parse().expect("addr"),
            presence_flags: 3,
            can_mesh: true,
            preferred: true,
            active: false,
            watcher: true,
            rtt_mark: 2,
            read_buf: b"partial frame".to_vec(),
            resume: ReadResume {
                skip: 12,
                tokens: Some(-3.5),
                age_ms: 123_456,
                keepalive_in_ms: 40_000,
            },
            tail: vec![4, 0, 0, 0, 1],
            sent_from: vec![PublicKey::from_bytes([1; 32])],
            packets: vec![PacketRecord {
                disco: true,
                src: PublicKey::from_bytes([2; 32]),
                forwarded: true,
                age_us: 99,
                data: Bytes::from_static(b"payload"),
            }],
            control: vec![
                Control::PeerGone(PublicKey::from_bytes([3; 32]), PeerGoneReason::NotHere),
                Control::KeepAlive,
                Control::PeerPresent {
                    peer: PublicKey::from_bytes([4; 32]),
                    addr: "192.0.2.1:3478".parse().expect("addr"),
                    flags: 1,
                },
                Control::WsPong(Bytes::from_static(b"p")),
            ],
            pong: Some([9; 8]),
            parked_at_ns: 42,
            tls: None,
            ws: Some(WsState {
                decoder: ws_snapshot(),
                raw: vec![0x82, 0x05, 1],
            }),
        }
    }

    /// A server decoder's state in the middle of a masked frame's payload.
    fn ws_snapshot() -> WsSnapshot {
        let mut decoder = derp_proto::ws::WsDecoder::new(derp_proto::ws::Role::Server);
        let mut input = bytes::BytesMut::from(&[0x82, 0x84, 1, 2, 3, 4, 9][..]);
        let mut out = bytes::BytesMut::new();
        decoder.decode(&mut input, &mut out).expect("decodes");
        decoder.snapshot().expect("mid-payload")
    }

    #[test]
    fn a_record_reads_back_as_written_without_the_keepalive() {
        let r = record();
        let mut bytes = Vec::new();
        encode(&[&r, &r], &mut bytes);
        let back = decode(&bytes).expect("decodes");
        let mut expected = r;
        expected.control.remove(1);
        assert_eq!(back, vec![expected.clone(), expected]);
    }

    #[test]
    fn every_truncation_and_a_wrong_format_are_refused_without_a_panic() {
        let mut bytes = Vec::new();
        encode(&[&record()], &mut bytes);
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "truncated at {n} accepted");
        }
        let mut other = bytes.clone();
        other[5] = 7;
        assert_eq!(decode(&other), Err(RecordError::Format(7)));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), Err(RecordError::Bad("length")));
        // Any single corrupted byte reads as an error or as some record, never a panic.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xa5;
            let _ = decode(&b);
        }
    }
}
