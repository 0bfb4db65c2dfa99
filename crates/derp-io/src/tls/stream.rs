//! The stream and its halves: the socket under the record layer's state of each direction,
//! readiness, reads through the record buffer, writes of sealed records, and giving
//! buffers back when idle; records are opened and sealed by the record layer.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::record::{
    ALERT_CLOSE_NOTIFY, ALERT_WARNING, CONTENT_APPLICATION_DATA, MAX_FRAGMENT, ReadState,
    WriteRefused, WriteState,
};

/// Plaintext sealed per write call at most, so the record buffer stays bounded when the
/// caller hands over a large batch.
const MAX_SEAL_PER_WRITE: usize = 64 * 1024;

static TRUNCATIONS: AtomicU64 = AtomicU64::new(0);

/// The streams of this process whose peer ended its sending without close_notify (between
/// records). Such an end reads as the end of the stream, DERP frames delimiting themselves,
/// where RFC 8446 calls it a truncation; this count (with a debug log of each) is how an
/// operator sees the clients that do it. A process-wide count: the record layer knows no
/// metric registry.
pub fn truncations() -> u64 {
    TRUNCATIONS.load(Ordering::Relaxed)
}

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
        self.read.tcp()
    }

    /// Drops both halves without a word to the peer and without shutting the socket down
    /// (see [`TlsWrite::forget`]).
    pub fn forget(self) {
        self.read.forget();
        self.write.forget();
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

impl std::fmt::Debug for TlsRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state.fmt(f)
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

    /// The underlying socket (shared with the sending half).
    pub fn tcp(&self) -> &TcpStream {
        self.half.as_ref()
    }

    /// Drops the half. A reading half's drop neither shuts the socket down nor tells the
    /// peer anything, so this is a plain drop, there for code handing a connection over to
    /// say what it means (and to stay right if the drop ever does more).
    pub fn forget(self) {
        drop(self);
    }
}

impl AsyncRead for TlsRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Self { half, state } = self.get_mut();
        let was_closed = state.closed;
        let read = state.poll_read_with(out, |buf| {
            tokio_util::io::poll_read_buf(Pin::new(&mut *half), cx, buf)
        });
        if state.truncated && !was_closed {
            TRUNCATIONS.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                peer = ?half.peer_addr().ok(),
                "tls peer ended its stream without close_notify"
            );
        }
        read
    }
}

/// The sending half: seals what it is given into records in its buffer and writes them.
pub struct TlsWrite {
    /// Always there but in the drop that follows [`TlsWrite::forget`], which takes it (tokio's
    /// half shuts the socket's sending side down when dropped, unless forgotten).
    half: Option<OwnedWriteHalf>,
    pub(super) state: WriteState,
}

impl std::fmt::Debug for TlsWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state.fmt(f)
    }
}

impl TlsWrite {
    pub(super) fn new(half: OwnedWriteHalf, state: WriteState) -> Self {
        Self {
            half: Some(half),
            state,
        }
    }

    /// Gives back the record buffer when it is empty, so an idle connection holds none.
    pub fn shrink_idle(&mut self) {
        self.state.shrink_idle();
    }

    /// Drops the half without a word to the peer: no close_notify or alert, and, unlike a
    /// drop, no `shutdown(2)` of the socket's sending side. The socket is closed once the
    /// reading half is dropped too, as a plain `close(2)`, which leaves a duplicate of it
    /// (another process's, after a handover) open and untouched. Records sealed and not
    /// written yet are not written.
    pub fn forget(mut self) {
        if let Some(half) = self.half.take() {
            half.forget();
        }
    }

    /// Writes out sealed records until none is left.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Self { half, state } = self;
        let half = socket(half)?;
        while state.sent < state.out.len() {
            let n = ready!(Pin::new(&mut *half).poll_write(cx, &state.out[state.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            state.sent += n;
        }
        state.out.clear();
        state.sent = 0;
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
    /// write or flush. Refuses once the reading half found the connection broken, and after
    /// close_notify.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.state.take_up_failure() {
            // Whatever of the alert the socket takes now; the rest goes with the flush, the
            // shutdown or the drop that ends the connection.
            let _ = this.poll_drain(cx);
            return Poll::Ready(Err(WriteRefused::Failed(e).into()));
        }
        if this.state.close_sent {
            return Poll::Ready(Err(WriteRefused::Closed.into()));
        }
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
            this.state.update_key_if_due()?;
            let len = (total - taken).min(MAX_FRAGMENT);
            this.state
                .seal(CONTENT_APPLICATION_DATA, bufs, taken, len)?;
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

    /// Writes out what was sealed; once the reading half failed, that includes the alert the
    /// failure calls for, and the flush then fails with the failure.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let failure = this.state.take_up_failure();
        let drained = ready!(this.poll_drain(cx));
        if let Some(e) = failure {
            // The failure, not an error in sending its alert.
            return Poll::Ready(Err(WriteRefused::Failed(e).into()));
        }
        drained?;
        Pin::new(socket(&mut this.half)?).poll_flush(cx)
    }

    /// Sends close_notify, then ends the TCP stream's sending side. After the reading half
    /// failed, the failure's alert goes instead of close_notify (RFC 8446, section 6.1: an
    /// error alert closes the connection by itself), or nothing after the peer's own alert.
    /// Either is sealed at the first call, behind what is not written yet, so that no write
    /// gets in after it while it waits for the socket.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.state.close_sent
            && !this.state.failure_sealed
            && this.state.take_up_failure().is_none()
        {
            this.state.update_key_if_due()?;
            this.state.seal_alert(ALERT_WARNING, ALERT_CLOSE_NOTIFY)?;
            this.state.close_sent = true;
        }
        ready!(this.poll_drain(cx))?;
        Pin::new(socket(&mut this.half)?).poll_shutdown(cx)
    }
}

/// The sending half's socket; gone only in the drop after [`TlsWrite::forget`].
fn socket(half: &mut Option<OwnedWriteHalf>) -> io::Result<&mut OwnedWriteHalf> {
    half.as_mut()
        .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
}

impl Drop for TlsWrite {
    /// A connection dropped after its reading half failed still tells the peer why, as far
    /// as the socket takes the alert at once: a drop cannot wait.
    fn drop(&mut self) {
        // Forgotten: nothing goes to the peer.
        let Some(half) = &self.half else {
            return;
        };
        if self.state.take_up_failure().is_none() {
            return;
        }
        let unsent = &self.state.out[self.state.sent..];
        if !unsent.is_empty() {
            let stream: &TcpStream = half.as_ref();
            let _ = stream.try_write(unsent);
        }
    }
}
