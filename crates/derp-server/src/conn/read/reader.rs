//! The socket side of the read half: bytes off the transport (and a QUIC connection's
//! datagrams), unwrapped from WebSocket messages when needed, into a DERP byte stream.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use derp_io::ReadHalf;
use derp_proto::ws::{self, Role, WsDecoder, WsEvent};
use tokio::io::AsyncReadExt;

use crate::conn::{ConnError, Framing};
use crate::handed::{LentSocket, WsState};
use crate::handle::ConnHandle;
use crate::queue::Control;
use crate::quic::QuicLink;

/// The read side: raw bytes from the socket, unwrapped from WebSocket messages when needed,
/// accumulate in `buf` as a DERP byte stream.
pub(in crate::conn) struct FrameReader {
    half: ReadHalf,
    pub(in crate::conn) buf: BytesMut,
    /// Boxed, like `quic`, so a plain TCP connection pays one pointer for each.
    ws: Option<Box<WsIn>>,
    /// The close code to answer with, once the WebSocket layer has one.
    pub(super) ws_close: Option<u16>,
    /// A QUIC connection's datagrams, once its handshake is done.
    quic: Option<Box<QuicIn>>,
}

struct QuicIn {
    link: Arc<QuicLink>,
    /// Datagrams read and not yet handled.
    datagrams: Vec<Bytes>,
}

struct WsIn {
    decoder: WsDecoder,
    raw: BytesMut,
}

impl FrameReader {
    pub(in crate::conn) fn new(half: ReadHalf, framing: Framing, initial: BytesMut) -> Self {
        match framing {
            Framing::WebSocket => Self {
                half,
                buf: BytesMut::new(),
                ws: Some(Box::new(WsIn {
                    decoder: WsDecoder::new(Role::Server),
                    raw: initial,
                })),
                ws_close: None,
                quic: None,
            },
            Framing::Raw => Self {
                half,
                buf: initial,
                ws: None,
                ws_close: None,
                quic: None,
            },
        }
    }

    /// From now on, reads also take the QUIC connection's datagrams. Datagrams the client
    /// sent before its handshake completed are dropped; returns how many.
    pub(in crate::conn) fn attach_quic(&mut self, link: Arc<QuicLink>) -> u64 {
        let early = link.registered();
        self.quic = Some(Box::new(QuicIn {
            link,
            datagrams: Vec::new(),
        }));
        early
    }

    /// The QUIC connection's link, for a connection over QUIC.
    pub(in crate::conn) fn quic_link(&self) -> Option<Arc<QuicLink>> {
        self.quic.as_ref().map(|q| q.link.clone())
    }

    /// Datagrams read since the last call (QUIC only).
    pub(super) fn take_datagrams(&mut self) -> Option<Vec<Bytes>> {
        let q = self.quic.as_mut()?;
        (!q.datagrams.is_empty()).then(|| std::mem::take(&mut q.datagrams))
    }

    /// Hands back what [`FrameReader::take_datagrams`] gave (emptied, or with what the rate
    /// limit held back), so its capacity is reused.
    pub(super) fn keep_datagrams(&mut self, datagrams: Vec<Bytes>) {
        if let Some(q) = &mut self.quic {
            q.datagrams = datagrams;
        }
    }

    /// Reads once from the socket and appends what it yields to `buf`. Returns 0 at EOF.
    /// WebSocket pings are answered through `handle` when one is given.
    pub(in crate::conn) async fn read_more(
        &mut self,
        handle: Option<&ConnHandle>,
        chunk: usize,
    ) -> Result<usize, ConnError> {
        if let Some(q) = &mut self.quic {
            if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE {
                self.buf.reserve(chunk);
            }
            // Stream bytes or datagrams, whichever come first (unbiased: a busy stream must
            // not starve the datagrams).
            return tokio::select! {
                n = self.half.read_buf(&mut self.buf) => {
                    let n = n?;
                    if n == 0 {
                        q.link.note_client_finished();
                    }
                    Ok(n)
                }
                n = q.link.read_datagrams(&mut q.datagrams) => Ok(n?),
            };
        }
        let Some(ws_in) = &mut self.ws else {
            self.half.ready().await?;
            if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE {
                self.buf.reserve(chunk);
            }
            return Ok(self.half.read_buf(&mut self.buf).await?);
        };
        loop {
            // Drain frames already buffered before reading again.
            let before = self.buf.len();
            let event = ws_in.decoder.decode(&mut ws_in.raw, &mut self.buf);
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    self.ws_close = Some(e.close_code());
                    return Err(e.into());
                }
            };
            match event {
                WsEvent::Ping(payload) => {
                    if let Some(h) = handle {
                        h.queue.push_control(Control::WsPong(payload));
                    }
                    continue;
                }
                WsEvent::Close { code } => {
                    // Echo the client's code, as the reference does. Data that came before
                    // the close is still handed over; the decoder repeats the close event on
                    // the next call.
                    self.ws_close = Some(code.unwrap_or(ws::close_code::NORMAL));
                    return Ok(self.buf.len() - before);
                }
                WsEvent::NeedMore => {}
            }
            let produced = self.buf.len() - before;
            if produced > 0 {
                return Ok(produced);
            }
            self.half.ready().await?;
            if ws_in.raw.capacity() - ws_in.raw.len() < MIN_READ_SPACE {
                ws_in.raw.reserve(chunk);
            }
            if self.half.read_buf(&mut ws_in.raw).await? == 0 {
                return Ok(0);
            }
        }
    }

    /// Whether the connection is carried over QUIC.
    pub(super) fn is_quic(&self) -> bool {
        self.quic.is_some()
    }

    /// What a successor process needs of this reader: the DERP bytes read and not yet
    /// handled, the state of the layers under them (derpd's TLS 1.3 records, WebSocket),
    /// and the transport itself, lent until [`FrameReader::restore`] gives it back (or
    /// dropped once the successor holds the socket). `None`, lending nothing, for a stream
    /// whose state is not the relay's to copy (QUIC, rustls's TLS, an embedder's) or a
    /// closing connection.
    ///
    /// Lending, rather than keeping a duplicate descriptor, keeps a handover at one
    /// descriptor per connection in this process: the successor's own arrives with the
    /// batch it is sent in.
    pub(super) fn export(&mut self) -> Option<ReaderExport> {
        if self.quic.is_some() || self.ws_close.is_some() {
            return None;
        }
        let ws = match &self.ws {
            Some(ws) => Some(WsState {
                decoder: ws.decoder.snapshot().ok()?,
                raw: ws.raw.to_vec(),
            }),
            None => None,
        };
        let socket = match LentSocket::lend(std::mem::replace(&mut self.half, ReadHalf::vacant())) {
            Ok(socket) => socket,
            // A stream whose state is not the relay's (rustls's TLS, an embedder's).
            Err(half) => {
                self.half = half;
                return None;
            }
        };
        let tls_rx = match &socket {
            LentSocket::Tcp(_) => None,
            LentSocket::Tls(r) => match r.snapshot() {
                Ok(rx) => Some(rx),
                Err(_) => {
                    self.restore(socket);
                    return None;
                }
            },
        };
        Some(ReaderExport {
            socket,
            buf: self.buf.to_vec(),
            tls_rx,
            ws,
        })
    }

    /// Takes back the transport [`FrameReader::export`] lent.
    pub(super) fn restore(&mut self, socket: LentSocket) {
        self.half = socket.into_half();
    }

    /// A reader continuing one a predecessor process exported: `buf` the DERP bytes it had
    /// not handled, `ws` its WebSocket layer.
    pub(in crate::conn) fn resumed(
        half: ReadHalf,
        buf: BytesMut,
        ws: Option<(WsDecoder, BytesMut)>,
    ) -> Self {
        Self {
            half,
            buf,
            ws: ws.map(|(decoder, raw)| Box::new(WsIn { decoder, raw })),
            ws_close: None,
            quic: None,
        }
    }

    /// Whether this reader can wait for the socket to become readable holding nothing:
    /// nothing is buffered, and the transport can tell readiness (plain TCP or TLS 1.3, with
    /// or without WebSocket framing; not rustls's TLS 1.2 stream, whose records may hold
    /// bytes the socket no longer does, nor QUIC, whose datagrams arrive apart from the
    /// stream).
    pub(super) fn can_wait_idle(&self) -> bool {
        self.quic.is_none()
            && self.half.tells_readiness()
            && self.buf.is_empty()
            && self.ws_close.is_none()
            && self
                .ws
                .as_ref()
                .is_none_or(|ws| ws.raw.is_empty() && ws.decoder.needs_input())
    }

    /// Whether the socket has bytes to read (see [`FrameReader::can_wait_idle`]).
    pub(super) fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.half.poll_readable(cx)
    }

    /// Gives back an empty buffer's memory, so an idle connection holds no read buffer.
    /// Packets still queued elsewhere keep their slices of the old allocation alive.
    pub(super) fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
        self.half.release_idle();
        if let Some(ws_in) = &mut self.ws
            && ws_in.raw.is_empty()
            && ws_in.raw.capacity() > 0
        {
            ws_in.raw = BytesMut::new();
        }
    }
}

/// A reader's state copied out for a successor process (see [`FrameReader::export`]).
pub(super) struct ReaderExport {
    pub(super) socket: LentSocket,
    pub(super) buf: Vec<u8>,
    pub(super) tls_rx: Option<derp_io::tls::RxSnapshot>,
    pub(super) ws: Option<WsState>,
}

/// Below this much free space the read buffer is grown before reading.
const MIN_READ_SPACE: usize = 4 * 1024;
