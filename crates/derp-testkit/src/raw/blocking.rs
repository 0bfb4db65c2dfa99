//! The blocking client: a std socket read and written on the caller's thread.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::time::Duration;

use derp_proto::{ClientInfo, SecretKey};

use super::{ConnectError, FrameBuf, Handshake, Step, UpgradeRequest, decode_frame};

/// A connected, handshaken DERP connection over a blocking socket.
///
/// After [`BlockingClient::connect`], frames are read with [`BlockingClient::next_frame`] and
/// written with `(&client.stream).write_all(..)`, whole frames in one write each; a frame
/// read can be rewritten in place in [`BlockingClient::buf`] and written back from there.
#[derive(Debug)]
pub struct BlockingClient {
    /// The socket, TCP_NODELAY on, no read timeout.
    pub stream: TcpStream,
    /// What was read and not taken yet; index it with the ranges of
    /// [`BlockingClient::next_frame`].
    pub buf: FrameBuf,
}

impl BlockingClient {
    /// Dials `addr`, sends `request` and completes the handshake as `secret` with `info`,
    /// within `timeout` for the dial and for each read.
    pub fn connect(
        addr: SocketAddr,
        request: &UpgradeRequest<'_>,
        secret: &SecretKey,
        info: ClientInfo,
        timeout: Duration,
    ) -> Result<Self, ConnectError> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.write_all(&request.to_bytes())?;
        let mut client = Self {
            stream,
            buf: FrameBuf::new(),
        };
        let head = loop {
            if let Some(head) = client.buf.take_http_head() {
                break head;
            }
            client.read_some()?;
        };
        if !head.starts_with("HTTP/1.1 101 ") {
            let status = head.lines().next().unwrap_or_default().to_owned();
            return Err(ConnectError::Refused(status));
        }
        let mut hs = Handshake::new(secret.clone(), info);
        loop {
            let Some((_, range)) = client.buf.next_frame()? else {
                client.read_some()?;
                continue;
            };
            match hs.step(decode_frame(&client.buf[range])?)? {
                Step::Send(out) => client.stream.write_all(&out)?,
                Step::Read => {}
                Step::Done(_) => break,
            }
        }
        client.stream.set_read_timeout(None)?;
        Ok(client)
    }

    fn read_some(&mut self) -> Result<(), ConnectError> {
        match self.stream.read(self.buf.spare())? {
            0 => Err(ConnectError::Closed),
            n => {
                self.buf.filled(n);
                Ok(())
            }
        }
    }

    /// Reads until one whole frame is buffered; returns its type byte and where it is in
    /// [`BlockingClient::buf`] (header included). A read timeout set on the stream ends the
    /// wait with `WouldBlock` or `TimedOut`; the server closing it, with `UnexpectedEof`.
    #[inline]
    pub fn next_frame(&mut self) -> io::Result<(u8, Range<usize>)> {
        loop {
            if let Some(frame) = self.buf.next_frame()? {
                return Ok(frame);
            }
            let n = self.stream.read(self.buf.spare())?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.filled(n);
        }
    }
}
