//! The byte streams a DERP connection can run over, split into independently owned halves so
//! the read loop and the writer can run as separate tasks.
//!
//! Plain TCP is kept unboxed: its halves need no lock, its writes are real `writev` calls, and
//! the read loop can wait for readability before it allocates a buffer, so an idle connection
//! holds no read buffer at all. Anything else (TLS, a hyper upgrade) is boxed.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A stream other than plain TCP.
pub trait BoxedIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> BoxedIo for T {}

/// A connection's byte stream.
pub enum Transport {
    /// Plain TCP.
    Tcp(TcpStream),
    /// Any other stream.
    Boxed(Box<dyn BoxedIo>),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(s) => f.debug_tuple("Tcp").field(s).finish(),
            Self::Boxed(_) => f.write_str("Boxed"),
        }
    }
}

impl Transport {
    /// Sets `TCP_NODELAY` where the stream is plain TCP; relayed packets must not wait for
    /// Nagle's algorithm. (A TLS stream's socket is configured before it is boxed.)
    pub(crate) fn set_nodelay(&self) {
        if let Self::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }

    pub(crate) fn split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Self::Tcp(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Self::Boxed(b) => {
                let (r, w) = tokio::io::split(b);
                (ReadHalf::Boxed(r), WriteHalf::Boxed(w))
            }
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Boxed(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Boxed(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Boxed(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(s) => s.is_write_vectored(),
            Self::Boxed(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Boxed(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Boxed(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

pub(crate) enum ReadHalf {
    Tcp(OwnedReadHalf),
    Boxed(tokio::io::ReadHalf<Box<dyn BoxedIo>>),
}

impl ReadHalf {
    /// Waits until a read would make progress, where the stream can tell without reading.
    pub(crate) async fn ready(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(r) => r.readable().await,
            Self::Boxed(_) => Ok(()),
        }
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            Self::Boxed(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

pub(crate) enum WriteHalf {
    Tcp(OwnedWriteHalf),
    Boxed(tokio::io::WriteHalf<Box<dyn BoxedIo>>),
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(w) => Pin::new(w).poll_write(cx, buf),
            Self::Boxed(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            Self::Boxed(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(w) => w.is_write_vectored(),
            Self::Boxed(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(w) => Pin::new(w).poll_flush(cx),
            Self::Boxed(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(w) => Pin::new(w).poll_shutdown(cx),
            Self::Boxed(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}
