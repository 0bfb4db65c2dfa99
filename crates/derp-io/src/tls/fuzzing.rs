//! The record layer's receiving side without a socket or a handshake, for fuzz targets
//! (cargo feature `fuzzing`; never in a build that serves): a connection opened under
//! traffic secrets the caller knows, fed bytes as socket reads would bring them.

use std::io;
use std::sync::Arc;
use std::task::Poll;

use tokio::io::ReadBuf;

pub use super::known::{Suite, TrafficSecret};
use super::record::{ReadState, Schedule, Shared};

/// The receiving half of a connection after its handshake, reading from a byte slice.
#[derive(Debug)]
pub struct RecordReader {
    state: ReadState,
}

impl RecordReader {
    /// A connection whose peer seals its records under `peer` from sequence number 0 (and
    /// moves to `peer.next()` and on at each KeyUpdate), with nothing buffered yet.
    pub fn new(peer: TrafficSecret) -> Self {
        let keys = peer.keys(0);
        Self {
            state: ReadState::new(
                keys,
                Schedule::Known(peer),
                Vec::new(),
                Arc::new(Shared::new()),
            ),
        }
    }

    /// One read, as the stream's `poll_read` does it: plaintext into `out`; when none is
    /// buffered, socket reads taken from the front of `input`, each of at most `chunk` bytes
    /// and never more than the record buffer's spare capacity (as a read into it would). An
    /// empty `input` is the end of the stream. `Ok(0)` is the end: close_notify, or the
    /// stream ending between records.
    pub fn read(&mut self, input: &mut &[u8], chunk: usize, out: &mut [u8]) -> io::Result<usize> {
        let mut out = ReadBuf::new(out);
        let fill = |buf: &mut Vec<u8>| {
            let n = chunk
                .max(1)
                .min(input.len())
                .min(buf.capacity() - buf.len());
            let (head, rest) = input.split_at(n);
            buf.extend_from_slice(head);
            *input = rest;
            Poll::Ready(Ok(n))
        };
        match self.state.poll_read_with(&mut out, fill) {
            Poll::Ready(Ok(())) => Ok(out.filled().len()),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => unreachable!("reads from a slice never wait"),
        }
    }

    /// The record buffer's capacity now.
    pub fn buffer_capacity(&self) -> usize {
        self.state.buf.capacity()
    }

    /// Whether the peer asked for a KeyUpdate that the sending side has not answered yet.
    pub fn update_requested(&self) -> bool {
        self.state
            .shared
            .update_requested
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Gives the record buffer back if nothing is in it, as an idle connection does.
    pub fn release_idle(&mut self) {
        self.state.release_idle();
    }
}
