//! The stream and its halves: buffering between the socket and the caller, readiness, and
//! giving buffers back when idle; records are opened and sealed by the record layer.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::record::{
    CONTENT_ALERT, CONTENT_APPLICATION_DATA, HEADER_LEN, Keys, MAX_FRAGMENT, Opened, Shared,
};

/// What a busy reader reads per system call, at least.
const READ_CHUNK: usize = 32 * 1024;
/// Plaintext sealed per write call at most, so the record buffer stays bounded when the
/// caller hands over a large batch.
const MAX_SEAL_PER_WRITE: usize = 64 * 1024;

/// A TLS 1.3 connection after its handshake. Read and write it whole, or split it.
#[derive(Debug)]
pub struct TlsStream {
    pub(super) read: TlsRead,
    pub(super) write: TlsWrite,
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
    pub(super) half: OwnedReadHalf,
    pub(super) state: ReadState,
}

/// The receiving half without its socket: the record buffer, the peer's key and what the
/// peer's records said so far. Reads go through [`ReadState::poll_read_with`], whose caller
/// supplies the socket read.
pub(super) struct ReadState {
    pub(super) keys: Keys,
    /// Bytes from the socket; before `pos`, records already opened (their plaintext in
    /// place), from `pos`, records not opened yet.
    pub(super) buf: Vec<u8>,
    pub(super) pos: usize,
    /// The part of `buf` holding plaintext not handed over yet.
    pub(super) plain: Range<usize>,
    /// The peer sent close_notify, or ended the stream between records.
    pub(super) closed: bool,
    /// A record failed after earlier records' plaintext was handed over; the next read
    /// returns it.
    pub(super) error: Option<io::Error>,
    /// Records in a row that carried no application data.
    pub(super) idle_records: u8,
    pub(super) shared: Arc<Shared>,
}

// Lengths only: the buffers hold plaintext.
impl std::fmt::Debug for TlsRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state.fmt(f)
    }
}

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

impl TlsRead {
    /// Ready when a read would make progress: something is buffered, or the socket is
    /// readable. Holds no state of its own while it waits.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.state.has_buffered() {
            return Poll::Ready(Ok(()));
        }
        let stream: &TcpStream = self.half.as_ref();
        stream.poll_read_ready(cx)
    }

    /// [`TlsRead::poll_ready`], with the socket's readiness checked by a peek (see
    /// [`crate::ReadHalf::poll_readable`]).
    pub fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.state.has_buffered() {
            return Poll::Ready(Ok(()));
        }
        crate::poll_peek_one(self.half.as_ref(), cx)
    }

    /// Gives back the record buffer when nothing is in it, so an idle connection holds none.
    pub fn release_idle(&mut self) {
        self.state.release_idle();
    }
}

impl ReadState {
    pub(super) fn new(keys: Keys, buf: Vec<u8>, shared: Arc<Shared>) -> Self {
        Self {
            keys,
            buf,
            pos: 0,
            plain: 0..0,
            closed: false,
            error: None,
            idle_records: 0,
            shared,
        }
    }

    /// Whether a read would return without touching the socket.
    fn has_buffered(&self) -> bool {
        if !self.plain.is_empty() || self.closed || self.error.is_some() {
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
        if let Some(e) = self.error.take() {
            return Poll::Ready(Err(e));
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
                // What was handed over stands; the error comes with the next read.
                Err(e) if copied => {
                    self.error = Some(e);
                    return Poll::Ready(Ok(()));
                }
                Err(e) => return Poll::Ready(Err(e)),
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
            let n = ready!(fill(&mut self.buf))?;
            if n == 0 {
                if self.buf.is_empty() {
                    // The peer closed without close_notify; nothing was cut short.
                    self.closed = true;
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

impl AsyncRead for TlsRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Self { half, state } = self.get_mut();
        state.poll_read_with(out, |buf| {
            tokio_util::io::poll_read_buf(Pin::new(&mut *half), cx, buf)
        })
    }
}

/// The sending half: seals what it is given into records in its buffer and writes them.
pub struct TlsWrite {
    pub(super) half: OwnedWriteHalf,
    pub(super) keys: Keys,
    /// Sealed records; `out[sent..]` is not written yet.
    pub(super) out: Vec<u8>,
    pub(super) sent: usize,
    pub(super) shared: Arc<Shared>,
    /// The sequence number at which this side seals a KeyUpdate and moves to a new key.
    pub(super) update_at: u64,
    pub(super) close_sent: bool,
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
        let mut taken = 0;
        while taken < total {
            this.update_key_if_due()?;
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
            this.update_key_if_due()?;
            // Level warning, description close_notify.
            let alert = [1, 0];
            this.seal(CONTENT_ALERT, &[io::IoSlice::new(&alert)], 0, alert.len())?;
            this.close_sent = true;
        }
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.half).poll_shutdown(cx)
    }
}
