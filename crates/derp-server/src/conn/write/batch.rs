//! A write batch: what the writer takes from its queue in one swap, laid out as frames
//! (control frames and packet headers in a scratch buffer, payloads where they are),
//! gathered into `writev` pieces from where the last call stopped, and accounted once it is
//! written or has failed. A packet whose frame was handed to the transport in full before a
//! failure, or went out in a QUIC datagram, counts as sent, since the peer may well read it;
//! the rest as `write_error`.

use std::io::IoSlice;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use derp_proto::{PeerGoneReason, RelayToClient, frame, ws};
use tokio::time::Instant;

use super::Writer;
use crate::conn::Framing;
use crate::metrics::{DropReason, FallbackReason, PacketKind};
use crate::queue::{Batch, Control, Packet};

/// What a writer needs only while it writes: the batch taken from the queue, how it is laid
/// out and what it holds. Kept per thread while no writer there needs it, so an idle
/// connection's parked writer holds none, and a busy one takes one without allocating.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) batch: Batch,
    /// Frame headers for the current batch; the payloads are written from their own buffers.
    headers: Vec<u8>,
    /// The pieces of the current batch in write order, while one is being written.
    segs: Vec<Seg>,
    /// Packets of the current batch that go in QUIC datagrams rather than on the stream;
    /// emptied once they are sent.
    pub(super) datagrams: Vec<(PacketKind, usize)>,
    /// Those of them sent so far.
    datagrams_sent: Vec<(PacketKind, usize)>,
    /// What the current batch holds, for its accounting.
    framed: Framed,
    /// Bytes of the current batch's stream pieces the transport has taken.
    pub(super) progress: usize,
    /// Where QUIC datagram frames are laid out, one after another: quinn takes each frame
    /// as its own `Bytes`, and slices of one buffer cost a reference count each where a
    /// buffer per frame would cost an allocation and a free. A frame keeps the buffer alive
    /// only until quinn has sent it (its datagram buffer is bounded).
    frames: BytesMut,
}

thread_local! {
    /// Scratch given back by writers on this thread between batches. Boxed: a writer holds its
    /// scratch by pointer, so taking one and giving it back moves no bytes and allocates
    /// nothing.
    #[allow(clippy::vec_box)]
    static SCRATCH: std::cell::RefCell<Vec<Box<Scratch>>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Scratch {
    /// One from this thread's pool, or a new one.
    pub(super) fn take() -> Box<Self> {
        SCRATCH
            .try_with(|pool| pool.borrow_mut().pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Back to this thread's pool (empty: given back only between batches), or freed when
    /// the pool is full. What a burst grew it to stays with it, up to a bound:
    /// a busy stream's writer parks between batches and takes the same scratch back for
    /// the next, and must not regrow it each time.
    pub(super) fn give(mut self: Box<Self>) {
        debug_assert!(
            self.batch.is_empty(),
            "scratch goes back only between batches"
        );
        if self.batch.disco.capacity().max(self.batch.other.capacity()) > MAX_POOLED_PACKETS
            || self.headers.capacity() > MAX_POOLED_HEADERS
            || self.segs.capacity() > 2 * MAX_POOLED_PACKETS
        {
            self.shrink_idle();
        }
        let _ = SCRATCH.try_with(|pool| {
            let mut pool = pool.borrow_mut();
            if pool.len() < MAX_POOLED_SCRATCH {
                pool.push(self);
            }
        });
    }

    /// Bytes of the batch that go on the stream.
    pub(super) fn stream_len(&self) -> usize {
        self.segs
            .iter()
            .map(|seg| match seg {
                Seg::Header(range) => range.len(),
                Seg::Payload(PacketKind::Disco, i) => self.batch.disco[*i].data.len(),
                Seg::Payload(PacketKind::Other, i) => self.batch.other[*i].data.len(),
            })
            .sum()
    }

    /// Fills `iov` with the stream pieces of the batch from byte `progress` on; returns how
    /// many it filled (at most [`MAX_IOV`]; the rest go in the next call).
    pub(super) fn gather<'a>(&'a self, iov: &mut [IoSlice<'a>; MAX_IOV]) -> usize {
        let mut skip = self.progress;
        let mut n = 0;
        for seg in &self.segs {
            let bytes: &[u8] = match seg {
                Seg::Header(range) => &self.headers[range.clone()],
                Seg::Payload(PacketKind::Disco, i) => &self.batch.disco[*i].data,
                Seg::Payload(PacketKind::Other, i) => &self.batch.other[*i].data,
            };
            if skip >= bytes.len() {
                skip -= bytes.len();
                continue;
            }
            iov[n] = IoSlice::new(&bytes[skip..]);
            skip = 0;
            n += 1;
            if n == MAX_IOV {
                break;
            }
        }
        n
    }

    /// The batch's stream bytes not yet handed to the transport, copied: what a successor
    /// process must write first when the connection is handed over mid-batch.
    pub(super) fn unsent(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.stream_len().saturating_sub(self.progress));
        let mut skip = self.progress;
        for seg in &self.segs {
            let bytes: &[u8] = match seg {
                Seg::Header(range) => &self.headers[range.clone()],
                Seg::Payload(PacketKind::Disco, i) => &self.batch.disco[*i].data,
                Seg::Payload(PacketKind::Other, i) => &self.batch.other[*i].data,
            };
            let from = skip.min(bytes.len());
            skip -= from;
            out.extend_from_slice(&bytes[from..]);
        }
        out
    }

    /// Lays out a batch of bytes already framed (a predecessor process's unsent tail), to
    /// be written as they are.
    pub(super) fn raw(&mut self, bytes: Vec<u8>) {
        self.headers = bytes;
        self.segs.clear();
        self.segs.push(Seg::Header(0..self.headers.len()));
        self.progress = 0;
    }

    /// Empties a batch that will be neither written nor accounted here (its connection was
    /// handed over), so the scratch can go back to the pool.
    pub(super) fn clear(&mut self) {
        self.batch = Batch::default();
        self.segs.clear();
        self.headers.clear();
        self.datagrams.clear();
        self.datagrams_sent.clear();
        self.framed = Framed::default();
        self.progress = 0;
    }

    /// The RecvPacket frame of the `n`th packet that goes in a QUIC datagram.
    pub(super) fn datagram(&mut self, n: usize) -> Bytes {
        let p = packet_at(&self.batch, self.datagrams[n]);
        let header = frame::recv_packet_header(&p.src, p.data.len());
        let len = header.len() + p.data.len();
        if self.frames.capacity() - self.frames.len() < len {
            // Never grown in place: frames already handed out still point into the old
            // buffer, which goes once quinn has sent them.
            self.frames = BytesMut::with_capacity(FRAME_ARENA.max(len));
        }
        self.frames.extend_from_slice(&header);
        self.frames.extend_from_slice(&p.data);
        self.frames.split().freeze()
    }

    /// The `n`th datagram went out.
    pub(super) fn datagram_sent(&mut self, n: usize) {
        self.framed.datagrams += 1;
        self.datagrams_sent.push(self.datagrams[n]);
    }

    /// The first `n` datagrams are sent (or on the stream): the next one is the first.
    pub(super) fn datagrams_done(&mut self, n: usize) {
        self.datagrams.drain(..n);
    }

    /// Lays the `n`th datagram's packet out on the stream instead: its frame no longer fits
    /// (the path MTU shrank since the batch was laid out).
    pub(super) fn datagram_on_stream(&mut self, n: usize) {
        let (kind, i) = self.datagrams[n];
        let p = packet_at(&self.batch, (kind, i));
        let header = frame::recv_packet_header(&p.src, p.data.len());
        let start = self.headers.len();
        self.headers.extend_from_slice(&header);
        self.segs.push(Seg::Header(start..self.headers.len()));
        self.segs.push(Seg::Payload(kind, i));
        self.framed.fallbacks[FallbackReason::TooLarge as usize] += 1;
    }

    /// Gives back what a burst grew the batch and the buffers to.
    fn shrink_idle(&mut self) {
        self.batch.shrink_idle();
        if self.headers.capacity() > MAX_IDLE_HEADER_CAPACITY {
            self.headers = Vec::new();
        }
        if self.segs.capacity() > MAX_IDLE_SEGS {
            self.segs = Vec::new();
        }
        if self.datagrams.capacity() > MAX_IDLE_SEGS {
            self.datagrams = Vec::new();
            self.datagrams_sent = Vec::new();
        }
        self.frames = BytesMut::new();
    }
}

/// The packet at `(kind, index)` of the batch's packet queues.
fn packet_at(batch: &Batch, (kind, i): (PacketKind, usize)) -> &Packet {
    match kind {
        PacketKind::Disco => &batch.disco[i],
        PacketKind::Other => &batch.other[i],
    }
}

/// Where one piece of a vectored write comes from.
enum Seg {
    /// A range of the header scratch buffer (frame headers and whole control frames).
    Header(Range<usize>),
    /// The payload of the packet at this index of one of the batch's packet queues.
    Payload(PacketKind, usize),
}

/// What a framed batch holds, for the accounting after the write.
#[derive(Default)]
struct Framed {
    frames: usize,
    packets: u64,
    packet_bytes: u64,
    pongs: u64,
    /// PeerGone frames, indexed by `[Disconnected, NotHere]`.
    gone: [u64; 2],
    /// This batch's queueing times for [`Metrics::fold_queue_waits`](crate::Metrics): 0.9 to
    /// the packet count, and what the packets add to the average.
    wait_decay: f64,
    wait_sum: f64,
    /// Packets sent in QUIC datagrams.
    datagrams: u64,
    /// Packets to QUIC clients that went on the stream, indexed by [`FallbackReason`].
    fallbacks: [u64; 2],
}

impl Writer {
    /// Accounts the batch, sent or failed, and empties it for the next (keeping its queues'
    /// capacity). Returns how many frames it held.
    pub(super) fn end_batch(&mut self, s: &mut Scratch, written: bool) -> usize {
        let framed = std::mem::take(&mut s.framed);
        let progress = std::mem::take(&mut s.progress);
        if written {
            self.account(s, &framed);
        } else {
            self.account_failed(s, progress);
        }
        s.batch.disco.clear();
        s.batch.other.clear();
        s.batch.control.clear();
        framed.frames
    }

    /// Lays the batch out as frames: control frames and headers go into the scratch buffer,
    /// payloads stay where they are, and `segs` lists the pieces in write order.
    pub(super) fn begin_batch(&mut self, s: &mut Scratch) {
        s.headers.clear();
        s.segs.clear();
        s.progress = 0;
        let segs = &mut s.segs;
        let framing = self.framing;
        let mut framed = Framed {
            wait_decay: 1.0,
            ..Framed::default()
        };
        for control in s.batch.control.drain(..) {
            let start = s.headers.len();
            match control {
                Control::PeerGone(peer, reason) => {
                    match reason {
                        PeerGoneReason::NotHere => framed.gone[1] += 1,
                        _ => {
                            framed.gone[0] += 1;
                            // If the peer comes back and sends again, watch it again.
                            self.sent_from.remove(&peer);
                        }
                    }
                    push_frame(
                        &mut s.headers,
                        framing,
                        &RelayToClient::PeerGone { peer, reason },
                    );
                }
                Control::PeerPresent { peer, addr, flags } => push_frame(
                    &mut s.headers,
                    framing,
                    &RelayToClient::PeerPresent { peer, addr, flags },
                ),
                Control::KeepAlive => {
                    push_frame(&mut s.headers, framing, &RelayToClient::KeepAlive)
                }
                Control::Restarting {
                    reconnect_in_ms,
                    try_for_ms,
                } => push_frame(
                    &mut s.headers,
                    framing,
                    &RelayToClient::Restarting {
                        reconnect_in_ms,
                        try_for_ms,
                    },
                ),
                Control::WsPong(payload) => {
                    s.headers
                        .extend_from_slice(&ws::control_frame(ws::Opcode::Pong, &payload));
                }
                Control::ObservedAddr(addr) => {
                    push_frame(&mut s.headers, framing, &RelayToClient::ObservedAddr(addr))
                }
            }
            segs.push(Seg::Header(start..s.headers.len()));
            framed.frames += 1;
        }
        if let Some(data) = s.batch.pong.take() {
            let start = s.headers.len();
            push_frame(&mut s.headers, framing, &RelayToClient::Pong(data));
            segs.push(Seg::Header(start..s.headers.len()));
            framed.frames += 1;
            framed.pongs += 1;
        }
        let now = Instant::now();
        // QUIC: `Some(limit)`, where the limit is `None` when the client takes no datagrams.
        let datagram_limit = self.quic.as_ref().map(|link| link.max_datagram_frame());
        s.datagrams.clear();
        s.datagrams_sent.clear();
        for (kind, queue) in [
            (PacketKind::Disco, &s.batch.disco),
            (PacketKind::Other, &s.batch.other),
        ] {
            for (i, p) in queue.iter().enumerate() {
                let waited = now.saturating_duration_since(p.enqueued).as_secs_f64() * 1000.0;
                framed.wait_sum = framed.wait_sum * 0.9 + waited * 0.1;
                framed.wait_decay *= 0.9;
                framed.packets += 1;
                framed.packet_bytes += p.data.len() as u64;
                framed.frames += 1;
                if let Some(limit) = datagram_limit {
                    match limit {
                        Some(max) if frame::FRAME_HEADER_LEN + 32 + p.data.len() <= max => {
                            s.datagrams.push((kind, i));
                            continue;
                        }
                        Some(_) => framed.fallbacks[FallbackReason::TooLarge as usize] += 1,
                        None => framed.fallbacks[FallbackReason::NoDatagrams as usize] += 1,
                    }
                }
                let start = s.headers.len();
                if framing == Framing::WebSocket {
                    let (hdr, n) = ws::binary_header(frame::FRAME_HEADER_LEN + 32 + p.data.len());
                    s.headers.extend_from_slice(&hdr[..n]);
                }
                s.headers
                    .extend_from_slice(&frame::recv_packet_header(&p.src, p.data.len()));
                segs.push(Seg::Header(start..s.headers.len()));
                segs.push(Seg::Payload(kind, i));
            }
        }
        s.framed = framed;
    }

    /// After a failed write: the packets sent in QUIC datagrams and those whose frames lay
    /// entirely within the first `handed_over` bytes of the stream count as sent, the others
    /// as dropped (`write_error`).
    fn account_failed(&self, s: &Scratch, handed_over: usize) {
        let segs = &s.segs;
        let m = &self.shared.metrics;
        let mut sent = [
            vec![false; s.batch.disco.len()],
            vec![false; s.batch.other.len()],
        ];
        for &(kind, i) in &s.datagrams_sent {
            sent[kind as usize][i] = true;
        }
        let mut offset = 0;
        for seg in segs {
            match seg {
                Seg::Header(range) => offset += range.len(),
                Seg::Payload(kind, i) => {
                    let queue = match kind {
                        PacketKind::Disco => &s.batch.disco,
                        PacketKind::Other => &s.batch.other,
                    };
                    offset += queue[*i].data.len();
                    if offset <= handed_over {
                        sent[*kind as usize][*i] = true;
                    }
                }
            }
        }
        let (mut packets, mut bytes) = (0, 0);
        for (queue, kind) in [
            (&s.batch.disco, PacketKind::Disco),
            (&s.batch.other, PacketKind::Other),
        ] {
            for (p, sent) in queue.iter().zip(&sent[kind as usize]) {
                if *sent {
                    packets += 1;
                    bytes += p.data.len() as u64;
                } else {
                    m.drop_one(DropReason::WriteError, kind, p.data.len());
                }
            }
        }
        if packets > 0 && self.shared.config.packet_metrics {
            m.packets_sent.inc_by(packets);
            m.bytes_sent.inc_by(bytes);
        }
        if !s.datagrams_sent.is_empty() {
            m.quic_datagrams_sent.inc_by(s.datagrams_sent.len() as u64);
        }
    }

    /// Counts a written batch into the metrics and watches its sources for PeerGone.
    fn account(&mut self, s: &Scratch, framed: &Framed) {
        let shared = self.shared.clone();
        let m = &shared.metrics;
        if framed.packets > 0 {
            self.note_sources(s);
            if shared.config.packet_metrics {
                m.packets_sent.inc_by(framed.packets);
                m.bytes_sent.inc_by(framed.packet_bytes);
                m.fold_queue_waits(framed.wait_decay, framed.wait_sum);
            }
        }
        if framed.pongs > 0 {
            m.sent_pong.inc_by(framed.pongs);
        }
        if framed.datagrams > 0 {
            m.quic_datagrams_sent.inc_by(framed.datagrams);
        }
        for (counter, n) in m.quic_stream_fallbacks.iter().zip(framed.fallbacks) {
            if n > 0 {
                counter.inc_by(n);
            }
        }
        if framed.gone[0] > 0 {
            m.peer_gone_disconnected_frames.inc_by(framed.gone[0]);
        }
        if framed.gone[1] > 0 {
            m.peer_gone_not_here_frames.inc_by(framed.gone[1]);
        }
    }

    /// Registers this connection as a PeerGone watcher of every new source in the batch.
    fn note_sources(&mut self, s: &Scratch) {
        for p in s.batch.disco.iter().chain(s.batch.other.iter()) {
            if !self.sent_from.contains(&p.src) {
                self.sent_from.insert(p.src);
                self.shared
                    .registry
                    .watch_peer_gone(p.src, p.forwarded, &self.handle);
            }
        }
    }
}

fn push_frame(out: &mut Vec<u8>, framing: Framing, frame: &RelayToClient) {
    if framing == Framing::WebSocket {
        let (hdr, n) = ws::binary_header(frame.encoded_len());
        out.extend_from_slice(&hdr[..n]);
    }
    frame.encode(out);
}

/// The buffer QUIC datagram frames are laid out in ([`Scratch::datagram`]): a dozen
/// full-size frames, or a few dozen small ones, per allocation.
const FRAME_ARENA: usize = 16 * 1024;
/// Most pieces handed to one `writev`; a batch with more takes several calls.
pub(super) const MAX_IOV: usize = 64;
/// Header scratch above this size is released when a pooled scratch is shrunk (a few
/// packets' worth is kept, so a steady trickle allocates nothing).
const MAX_IDLE_HEADER_CAPACITY: usize = 512;
/// Piece lists longer than this are released when a pooled scratch is shrunk.
const MAX_IDLE_SEGS: usize = 16;
/// Scratch kept per thread for writers to take: about as many as write at once on a thread.
const MAX_POOLED_SCRATCH: usize = 8;
/// A pooled scratch whose batch queues or header buffer outgrew these is shrunk first, so
/// the pools hold a few hundred KiB per thread at most.
const MAX_POOLED_PACKETS: usize = 1024;
const MAX_POOLED_HEADERS: usize = 64 * 1024;

#[cfg(test)]
impl Scratch {
    /// The scratch on top of this thread's pool, and how many the pool holds.
    pub(super) fn pool_top() -> (*const Self, usize) {
        SCRATCH.with_borrow(|pool| {
            let top = pool
                .last()
                .map_or(std::ptr::null(), |s| &**s as *const Self);
            (top, pool.len())
        })
    }
}

#[cfg(test)]
mod tests {
    use derp_proto::PublicKey;

    use super::*;

    /// Frames laid out one after another in the shared buffer are each exactly one
    /// RecvPacket frame, stay intact when the buffer fills and a new one is started, and do
    /// not change when the scratch goes on to the next frames.
    #[test]
    fn datagram_frames_from_the_shared_buffer_are_whole_and_independent() {
        let mut s = Scratch::default();
        let src = PublicKey::from_bytes([7; 32]);
        // Enough 1,400-byte packets to fill the 16 KiB buffer more than twice.
        let payloads: Vec<Bytes> = (0..40u8).map(|i| Bytes::from(vec![i; 1400])).collect();
        for p in &payloads {
            s.batch.other.push_back(Packet {
                src,
                data: p.clone(),
                enqueued: Instant::now(),
                forwarded: false,
            });
        }
        s.datagrams = (0..payloads.len())
            .map(|i| (PacketKind::Other, i))
            .collect();
        let frames: Vec<Bytes> = (0..payloads.len()).map(|n| s.datagram(n)).collect();
        for (f, p) in frames.iter().zip(&payloads) {
            let header = frame::recv_packet_header(&src, p.len());
            assert_eq!(f.len(), header.len() + p.len());
            assert_eq!(&f[..header.len()], &header[..]);
            assert_eq!(&f[header.len()..], &p[..]);
        }
        // A frame laid out later does not write over one handed out before.
        s.batch.other[0].data = Bytes::from(vec![0xee; 10]);
        let later = s.datagram(0);
        assert_eq!(&later[later.len() - 10..], &[0xee; 10]);
        assert_eq!(&frames[1][frames[1].len() - 1400..], &payloads[1][..]);
        assert_eq!(&frames[0][frames[0].len() - 1400..], &payloads[0][..]);
    }
}
