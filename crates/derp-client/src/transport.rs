//! The byte stream under the DERP framing, and the frame-level reader and writer halves.
//!
//! The stream is a [`derp_io::Transport`]: a plain TCP socket (split without locking) or any
//! boxed `AsyncRead + AsyncWrite`, which is where a TLS stream slots in. On top of it, frames
//! travel either raw (`Upgrade: DERP`) or one per WebSocket binary message.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use derp_io::{ReadHalf, WriteHalf};
use derp_proto::ws::{self, Opcode, Role, WsDecoder, WsEvent};
use derp_proto::{ClientDecoder, ClientToRelay, RelayToClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::ClientError;
use crate::path::QuicCounters;

/// Bytes of a DERP frame header plus the key of a SendPacket or RecvPacket.
const PACKET_OVERHEAD: usize = derp_proto::frame::FRAME_HEADER_LEN + derp_proto::frame::KEY_LEN;

/// WebSocket control work the reader hands to the writer (only the writer may write).
#[derive(Debug, Default)]
pub(crate) struct WsShared {
    pending: Mutex<WsPending>,
}

#[derive(Debug, Default)]
struct WsPending {
    /// Payload of the latest unanswered ping; RFC 6455 allows answering only the latest.
    pong: Option<Bytes>,
    /// The server closed; echo this code and stop writing.
    close: Option<u16>,
}

impl WsShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, WsPending> {
        // The critical sections only move plain values, so a poisoned lock holds valid data.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads DERP frames: raw bytes or WebSocket payloads go into one buffer that
/// [`ClientDecoder`] slices frames out of without copying.
#[derive(Debug)]
pub(crate) struct FrameReader {
    io: ReadHalf,
    /// DERP stream bytes not yet decoded.
    buf: BytesMut,
    decoder: ClientDecoder,
    ws: Option<WsRead>,
    read_timeout: Option<Duration>,
    /// DERP over QUIC: RecvPacket frames may also come in datagrams.
    quic: Option<(quinn::Connection, Arc<QuicCounters>)>,
}

#[derive(Debug)]
struct WsRead {
    decoder: WsDecoder,
    /// Socket bytes not yet unframed.
    raw: BytesMut,
    shared: Arc<WsShared>,
}

impl FrameReader {
    /// A reader whose first bytes (read along with the HTTP response) are `leftover`.
    pub(crate) fn new(
        io: ReadHalf,
        leftover: BytesMut,
        ws: Option<Arc<WsShared>>,
        read_timeout: Option<Duration>,
    ) -> Self {
        let (buf, ws) = match ws {
            None => (leftover, None),
            Some(shared) => (
                BytesMut::new(),
                Some(WsRead {
                    decoder: WsDecoder::new(Role::Client),
                    raw: leftover,
                    shared,
                }),
            ),
        };
        Self {
            io,
            buf,
            decoder: ClientDecoder::new(),
            ws,
            read_timeout,
            quic: None,
        }
    }

    /// From now on, also read the QUIC connection's datagrams, and count packets by path.
    pub(crate) fn attach_quic(&mut self, conn: quinn::Connection, counters: Arc<QuicCounters>) {
        self.quic = Some((conn, counters));
    }

    /// The next frame, including ones the caller may skip (ServerKey, Unknown).
    ///
    /// Cancel safe: bytes read before a cancellation stay buffered, and a datagram is taken
    /// only when it is returned.
    pub(crate) async fn next_frame(&mut self) -> Result<RelayToClient, ClientError> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf)? {
                if let (Some((_, counters)), RelayToClient::RecvPacket { .. }) =
                    (&self.quic, &frame)
                {
                    counters.received(false);
                }
                return Ok(frame);
            }
            let Some((conn, counters)) = self.quic.clone() else {
                self.fill().await?;
                continue;
            };
            let next = async {
                tokio::select! {
                    r = read_some(&mut self.io, &mut self.buf, None) => r.map(|_| None),
                    d = conn.read_datagram() => match d {
                        Ok(d) => Ok(derp_proto::decode_recv_packet_datagram(&d)),
                        Err(e) => Err(ClientError::from(io::Error::from(e))),
                    },
                }
            };
            let got = match self.read_timeout {
                None => next.await?,
                Some(limit) => tokio::time::timeout(limit, next)
                    .await
                    .map_err(|_| ClientError::ReadTimeout(limit))??,
            };
            // A datagram that is not one RecvPacket frame is dropped.
            if let Some((src, packet)) = got {
                counters.received(true);
                return Ok(RelayToClient::RecvPacket { src, packet });
            }
        }
    }

    /// Reads at least one more byte of DERP stream into `buf`.
    async fn fill(&mut self) -> Result<(), ClientError> {
        let Some(ws) = &mut self.ws else {
            read_some(&mut self.io, &mut self.buf, self.read_timeout).await?;
            return Ok(());
        };
        loop {
            let before = self.buf.len();
            loop {
                match ws.decoder.decode(&mut ws.raw, &mut self.buf)? {
                    WsEvent::NeedMore => break,
                    WsEvent::Ping(payload) => ws.shared.lock().pong = Some(payload),
                    WsEvent::Close { code } => {
                        tracing::debug!(?code, "server sent websocket close");
                        ws.shared.lock().close = Some(code.unwrap_or(ws::close_code::NORMAL));
                        return Err(ClientError::Closed);
                    }
                }
            }
            if self.buf.len() > before {
                return Ok(());
            }
            read_some(&mut self.io, &mut ws.raw, self.read_timeout).await?;
        }
    }
}

/// One read into `dst`'s spare capacity; EOF is [`ClientError::Closed`].
async fn read_some(
    io: &mut ReadHalf,
    dst: &mut BytesMut,
    timeout: Option<Duration>,
) -> Result<usize, ClientError> {
    if dst.capacity() - dst.len() < MIN_READ_SPACE {
        dst.reserve(READ_CHUNK);
    }
    let n = match timeout {
        None => io.read_buf(dst).await?,
        Some(limit) => tokio::time::timeout(limit, io.read_buf(dst))
            .await
            .map_err(|_| ClientError::ReadTimeout(limit))??,
    };
    if n == 0 {
        return Err(ClientError::Closed);
    }
    Ok(n)
}

/// Buffers encoded frames and writes them with one `write` per flush.
#[derive(Debug)]
pub(crate) struct FrameWriter {
    io: WriteHalf,
    /// Encoded bytes not yet written; reused across flushes.
    buf: BytesMut,
    ws: Option<Arc<WsShared>>,
    /// First write error; the stream position is unknown after it.
    sticky: Option<ClientError>,
    /// A close frame went out (or the server's close was echoed): no more data frames.
    closed: bool,
    /// DERP over QUIC: the connection, and packets queued to go in datagrams.
    quic: Option<QuicOut>,
}

#[derive(Debug)]
struct QuicOut {
    conn: quinn::Connection,
    /// This client sends packets in datagrams when they fit.
    use_datagrams: bool,
    datagrams: std::collections::VecDeque<Bytes>,
    datagram_bytes: usize,
    counters: Arc<QuicCounters>,
}

impl FrameWriter {
    pub(crate) fn new(io: WriteHalf, ws: Option<Arc<WsShared>>) -> Self {
        Self {
            io,
            buf: BytesMut::with_capacity(WRITE_BUF_INITIAL),
            ws,
            sticky: None,
            closed: false,
            quic: None,
        }
    }

    /// From now on, count packets by path, and (with `use_datagrams`) send them in
    /// datagrams when the connection allows and they fit.
    pub(crate) fn attach_quic(
        &mut self,
        conn: quinn::Connection,
        use_datagrams: bool,
        counters: Arc<QuicCounters>,
    ) {
        self.quic = Some(QuicOut {
            conn,
            use_datagrams,
            datagrams: std::collections::VecDeque::new(),
            datagram_bytes: 0,
            counters,
        });
    }

    /// Queues bytes outside any DERP or WebSocket framing (the HTTP request head).
    pub(crate) fn queue_raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Queues one frame. `ClientToRelay::Unknown` encodes to nothing and is ignored.
    pub(crate) fn queue_frame(&mut self, frame: &ClientToRelay) -> Result<(), ClientError> {
        self.check_open()?;
        let len = frame.encoded_len();
        if len == 0 {
            return Ok(());
        }
        if let (Some(q), ClientToRelay::SendPacket { .. }) = (&self.quic, frame) {
            q.counters.sent(false);
        }
        let (start, mask) = self.begin(len);
        frame.encode(&mut self.buf);
        self.end(start, mask);
        Ok(())
    }

    /// Queues already-encoded DERP frame bytes (one frame).
    pub(crate) fn queue_encoded(&mut self, frame: &[u8]) -> Result<(), ClientError> {
        self.check_open()?;
        let (start, mask) = self.begin(frame.len());
        self.buf.extend_from_slice(frame);
        self.end(start, mask);
        Ok(())
    }

    /// Queues a SendPacket frame straight from a slice, without building a `ClientToRelay`.
    pub(crate) fn queue_send_packet(
        &mut self,
        dst: &derp_proto::PublicKey,
        packet: &[u8],
    ) -> Result<(), ClientError> {
        self.check_open()?;
        let body = derp_proto::frame::KEY_LEN + packet.len();
        if let Some(q) = &mut self.quic
            && q.use_datagrams
            && q.conn
                .max_datagram_size()
                .is_some_and(|max| PACKET_OVERHEAD + packet.len() <= max)
        {
            let mut frame = BytesMut::with_capacity(PACKET_OVERHEAD + packet.len());
            derp_proto::frame::write_header(
                &mut frame,
                derp_proto::FrameType::SendPacket,
                body as u32,
            );
            frame.extend_from_slice(dst.as_bytes());
            frame.extend_from_slice(packet);
            q.datagram_bytes += frame.len();
            q.datagrams.push_back(frame.freeze());
            return Ok(());
        }
        if let Some(q) = &self.quic {
            q.counters.sent(false);
        }
        let (start, mask) = self.begin(derp_proto::frame::FRAME_HEADER_LEN + body);
        // `body` is at most 32 + 64 KiB: callers check the packet size first.
        derp_proto::frame::write_header(
            &mut self.buf,
            derp_proto::FrameType::SendPacket,
            body as u32,
        );
        self.buf.extend_from_slice(dst.as_bytes());
        self.buf.extend_from_slice(packet);
        self.end(start, mask);
        Ok(())
    }

    /// Bytes queued and not yet written.
    pub(crate) fn buffered_len(&self) -> usize {
        self.buf.len() + self.quic.as_ref().map_or(0, |q| q.datagram_bytes)
    }

    /// Writes everything queued (plus any WebSocket pong or close echo the reader asked for).
    ///
    /// Cancel safe: bytes already written are dropped from the buffer as they go out.
    pub(crate) async fn flush(&mut self) -> Result<(), ClientError> {
        if let Some(e) = &self.sticky {
            return Err(e.clone());
        }
        self.queue_ws_control();
        let mut result = self.send_datagrams().await;
        if self.buf.is_empty() || result.is_err() {
            if let Err(e) = &result {
                self.sticky = Some(e.clone());
            }
            return result;
        }
        result = self.write_out().await;
        if let Err(e) = &result {
            self.sticky = Some(e.clone());
        }
        result
    }

    /// Flushes, sends a WebSocket close if applicable, and shuts the write side down.
    pub(crate) async fn close(&mut self) -> Result<(), ClientError> {
        if !self.closed {
            if self.ws.is_some() {
                let mask = rand::random();
                ws::write_masked_frame(
                    &mut self.buf,
                    Opcode::Close,
                    &ws::close_code::NORMAL.to_be_bytes(),
                    mask,
                );
            }
            self.closed = true;
        }
        self.flush().await?;
        self.io.shutdown().await.map_err(ClientError::from)
    }

    /// Sends the queued datagrams, waiting while quinn's datagram buffer is full. One that no
    /// longer fits (the path MTU shrank) goes on the stream.
    ///
    /// Cancel safe: a datagram leaves the queue only once quinn has taken it.
    async fn send_datagrams(&mut self) -> Result<(), ClientError> {
        let Some(q) = &mut self.quic else {
            return Ok(());
        };
        while let Some(frame) = q.datagrams.front().cloned() {
            let len = frame.len();
            match q.conn.send_datagram_wait(frame.clone()).await {
                Ok(()) => q.counters.sent(true),
                Err(quinn::SendDatagramError::TooLarge) => {
                    q.counters.sent(false);
                    self.buf.extend_from_slice(&frame);
                }
                Err(quinn::SendDatagramError::ConnectionLost(e)) => {
                    return Err(io::Error::from(e).into());
                }
                Err(e) => return Err(io::Error::other(e).into()),
            }
            q.datagrams.pop_front();
            q.datagram_bytes -= len;
        }
        Ok(())
    }

    async fn write_out(&mut self) -> Result<(), ClientError> {
        while !self.buf.is_empty() {
            let n = self.io.write(&self.buf).await?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero).into());
            }
            self.buf.advance(n);
        }
        self.io.flush().await?;
        // Empty now; clearing lets the next `reserve` reuse the allocation from the front.
        self.buf.clear();
        Ok(())
    }

    fn check_open(&self) -> Result<(), ClientError> {
        match &self.sticky {
            Some(e) => Err(e.clone()),
            None if self.closed => Err(ClientError::Closed),
            None => Ok(()),
        }
    }

    /// Starts a frame of `len` DERP bytes: writes the WebSocket header if needed and returns
    /// where the payload starts and its mask.
    fn begin(&mut self, len: usize) -> (usize, Option<[u8; 4]>) {
        let mask = self.ws.as_ref().map(|_| rand::random::<[u8; 4]>());
        if mask.is_some() {
            self.buf.reserve(ws::header_len(len, true) + len);
            ws::write_header(&mut self.buf, Opcode::Binary, len, mask);
        }
        (self.buf.len(), mask)
    }

    fn end(&mut self, start: usize, mask: Option<[u8; 4]>) {
        if let Some(mask) = mask {
            ws::apply_mask(&mut self.buf[start..], mask, 0);
        }
    }

    fn queue_ws_control(&mut self) {
        let Some(shared) = &self.ws else {
            return;
        };
        let (pong, close) = {
            let mut pending = shared.lock();
            (pending.pong.take(), pending.close.take())
        };
        if self.closed {
            return;
        }
        if let Some(payload) = pong {
            ws::write_masked_frame(&mut self.buf, Opcode::Pong, &payload, rand::random());
        }
        if let Some(code) = close {
            ws::write_masked_frame(
                &mut self.buf,
                Opcode::Close,
                &code.to_be_bytes(),
                rand::random(),
            );
            self.closed = true;
        }
    }
}

/// Read size: big enough for a max-size packet frame in one read.
const READ_CHUNK: usize = 64 * 1024;
/// Below this much spare capacity, the read buffer grows by [`READ_CHUNK`] before reading.
const MIN_READ_SPACE: usize = 4 * 1024;
/// Initial write buffer; it grows to the largest batch and is then reused.
const WRITE_BUF_INITIAL: usize = 16 * 1024;
