//! A QUIC stream's sending half that takes a vectored write in one call.

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;

/// quinn's [`quinn::SendStream`], with vectored writes. quinn takes one slice per call, and
/// each call locks the connection, copies the slice and wakes the connection's driver; a
/// relayed packet is two slices (frame header, payload) and a batch many. This gathers the
/// slices of one write into a buffer and hands them over in one call.
#[derive(Debug)]
pub struct SendStream(pub quinn::SendStream);

/// Most bytes gathered for one call: about what quinn sends before the stream's flow
/// control or the congestion window pushes back anyway.
const MAX_GATHER: usize = 64 * 1024;

thread_local! {
    /// Where the slices are gathered; used only inside one synchronous call.
    static GATHER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl AsyncWrite for SendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.get_mut().0), cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let stream = &mut self.get_mut().0;
        let first = bufs.iter().position(|b| !b.is_empty());
        let Some(first) = first else {
            return Poll::Ready(Ok(0));
        };
        let bufs = &bufs[first..];
        if bufs.len() == 1 || bufs[0].len() >= MAX_GATHER {
            return AsyncWrite::poll_write(Pin::new(stream), cx, &bufs[0]);
        }
        GATHER.with_borrow_mut(|gather| {
            gather.clear();
            for b in bufs {
                let room = MAX_GATHER - gather.len();
                if room == 0 {
                    break;
                }
                gather.extend_from_slice(&b[..b.len().min(room)]);
            }
            // The bytes taken are a prefix of the slices: what quinn took of the buffer is
            // what was written.
            AsyncWrite::poll_write(Pin::new(stream), cx, gather)
        })
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.get_mut().0), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.get_mut().0), cx)
    }
}
