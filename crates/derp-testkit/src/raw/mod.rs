//! A DERP client that speaks the wire format itself, built straight on `derp-proto`: tests use
//! it to check exact bytes and to send malformed input, and derp-load's closed loop
//! (derp-bench's `pingpong`) uses it as the leanest client there can be.
//!
//! The parts that do no IO are written once here: the upgrade request, the buffer that
//! frames are read into and taken from ([`FrameBuf`]), and the handshake's steps. Two
//! wrappers drive them over a socket: [`RawClient`] (tokio, for tests: it panics with a
//! message on anything unexpected, and gives up on any wait after [`STEP`]) and
//! [`BlockingClient`] (a std socket read on the caller's thread, returning errors: a
//! benchmark client, whose reads hand out frames in place, with no allocation or copy per
//! frame).

mod blocking;
mod client;

use std::io;
use std::ops::{Index, IndexMut, Range};
use std::time::Duration;

use bytes::BytesMut;
use derp_proto::frame::{FRAME_HEADER_LEN, KEY_LEN, MAX_PACKET_SIZE};
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, DecodeError, HandshakeError, RelayToClient,
    SecretKey, ServerInfo,
};

pub use blocking::BlockingClient;
pub use client::RawClient;

/// How long [`RawClient`] waits for any one read before it fails the test.
pub const STEP: Duration = Duration::from_secs(10);

/// The largest frame a relay sends a client: a RecvPacket carrying a maximal packet.
pub const MAX_FRAME: usize = FRAME_HEADER_LEN + KEY_LEN + MAX_PACKET_SIZE;

/// The ClientInfo ordinary test clients send: protocol version 2, able to answer pings.
pub fn plain_info() -> ClientInfo {
    ClientInfo {
        version: 2,
        can_ack_pings: true,
        ..ClientInfo::default()
    }
}

/// An upgrade request to DERP (`Upgrade: DERP`, not WebSocket).
#[derive(Debug, Clone, Copy)]
pub struct UpgradeRequest<'a> {
    /// `Host` header value.
    pub host: &'a str,
    /// Request target, such as `/derp`.
    pub path: &'a str,
    /// More header lines, each ending in CRLF, sent as they are (malformed ones included).
    pub extra_headers: &'a str,
}

impl UpgradeRequest<'_> {
    /// The request head.
    pub fn to_bytes(&self) -> Vec<u8> {
        let Self {
            host,
            path,
            extra_headers,
        } = self;
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\
             {extra_headers}\r\n"
        )
        .into_bytes()
    }
}

/// Why [`BlockingClient::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket failed, or a read timed out.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The server answered the upgrade with something other than 101.
    #[error("the server refused the DERP upgrade: {0}")]
    Refused(String),
    /// The server closed the connection before the handshake was done.
    #[error("the server closed the connection during the handshake")]
    Closed,
    /// The server sent a frame the client cannot decode.
    #[error("handshake frame: {0}")]
    Decode(#[from] DecodeError),
    /// The server's handshake frames did not check out.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// The server sent a frame that has no place in the handshake.
    #[error("unexpected frame during the handshake: {0}")]
    Unexpected(String),
}

/// Bytes read from a relay, taken off the front as an HTTP head and then as whole frames.
///
/// One buffer the size of two maximal frames, allocated once. A frame is handed out as the
/// range of the buffer it lies in (index the buffer with it), so it can be read and even
/// rewritten in place: an echo turns a RecvPacket into a SendPacket by its type byte. The
/// unread bytes move to the front only when less than a frame's room is left after them, so
/// a frame never straddles the end.
#[derive(Debug)]
pub struct FrameBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Default for FrameBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameBuf {
    /// An empty buffer.
    pub fn new() -> Self {
        Self {
            buf: vec![0; 2 * MAX_FRAME].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The bytes read and not taken yet.
    pub fn unread(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Drops the first `n` unread bytes.
    ///
    /// # Panics
    ///
    /// If fewer than `n` are unread.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.end - self.start, "consuming more than was read");
        self.start += n;
    }

    /// Takes an HTTP response head (its blank line included) off the front once it has
    /// arrived whole.
    pub fn take_http_head(&mut self) -> Option<String> {
        let end = self.unread().windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = String::from_utf8_lossy(&self.unread()[..end]).into_owned();
        self.start += end;
        Some(head)
    }

    /// Takes the next whole frame off the front: its type byte and the range it lies in,
    /// header included; `None` until all of it has arrived. A frame longer than
    /// [`MAX_FRAME`] is an error: no relay sends one.
    #[inline]
    pub fn next_frame(&mut self) -> io::Result<Option<(u8, Range<usize>)>> {
        let unread = &self.buf[self.start..self.end];
        let Some(header) = unread.first_chunk::<FRAME_HEADER_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if FRAME_HEADER_LEN + len > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes from the server"),
            ));
        }
        if unread.len() < FRAME_HEADER_LEN + len {
            return Ok(None);
        }
        let range = self.start..self.start + FRAME_HEADER_LEN + len;
        self.start = range.end;
        Ok(Some((header[0], range)))
    }

    /// Room for the next read. Ranges handed out before are no longer valid: the unread
    /// bytes may have moved.
    #[inline]
    pub fn spare(&mut self) -> &mut [u8] {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.buf.len() - self.end < MAX_FRAME {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        &mut self.buf[self.end..]
    }

    /// Counts `n` bytes read into [`FrameBuf::spare`].
    #[inline]
    pub fn filled(&mut self, n: usize) {
        debug_assert!(self.end + n <= self.buf.len());
        self.end += n;
    }
}

impl Index<Range<usize>> for FrameBuf {
    type Output = [u8];

    #[inline]
    fn index(&self, range: Range<usize>) -> &[u8] {
        &self.buf[range]
    }
}

impl IndexMut<Range<usize>> for FrameBuf {
    #[inline]
    fn index_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        &mut self.buf[range]
    }
}

impl Index<usize> for FrameBuf {
    type Output = u8;

    #[inline]
    fn index(&self, i: usize) -> &u8 {
        &self.buf[i]
    }
}

impl IndexMut<usize> for FrameBuf {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut u8 {
        &mut self.buf[i]
    }
}

/// Decodes one whole frame (as [`FrameBuf::next_frame`] hands out) by the Go client's rules.
pub fn decode_frame(frame: &[u8]) -> Result<RelayToClient, DecodeError> {
    let mut bytes = BytesMut::from(frame);
    let decoded = ClientDecoder::new().decode(&mut bytes)?;
    // Every plan of the decoder needs at most the whole frame, and the whole frame is there.
    Ok(decoded.expect("a whole frame decodes"))
}

/// The client side of the DERP handshake, fed one frame at a time, so that every client
/// (these two, and tests speaking DERP on a stream of their own, such as a QUIC stream) runs
/// the same steps.
#[derive(Debug)]
pub struct Handshake {
    hs: ClientHandshake,
}

/// What the handshake needs next.
#[derive(Debug)]
pub enum Step {
    /// Send these bytes (ClientInfo), then read on.
    Send(BytesMut),
    /// Read on.
    Read,
    /// The server let the client in.
    Done(ServerInfo),
}

impl Handshake {
    /// A handshake for the client `secret` that will send `info`.
    pub fn new(secret: SecretKey, info: ClientInfo) -> Self {
        Self {
            hs: ClientHandshake::new(secret, info),
        }
    }

    /// Whether ClientInfo has gone out, so that a close now is the server's answer to it.
    fn sent_client_info(&self) -> bool {
        self.hs.server_key().is_some()
    }

    /// Takes the next frame from the server.
    pub fn step(&mut self, frame: RelayToClient) -> Result<Step, ConnectError> {
        match frame {
            RelayToClient::ServerKey(key) if !self.sent_client_info() => {
                self.hs.handle_server_key(key)?;
                let mut out = BytesMut::new();
                self.hs.client_info_frame(rand::random(), &mut out)?;
                Ok(Step::Send(out))
            }
            RelayToClient::ServerInfo { sealed } if self.sent_client_info() => {
                Ok(Step::Done(self.hs.handle_server_info(&sealed)?))
            }
            RelayToClient::KeepAlive | RelayToClient::Unknown { .. } => Ok(Step::Read),
            other => Err(ConnectError::Unexpected(format!("{other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![ty];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    fn feed(b: &mut FrameBuf, bytes: &[u8]) {
        b.spare()[..bytes.len()].copy_from_slice(bytes);
        b.filled(bytes.len());
    }

    #[test]
    fn a_frame_is_handed_out_only_once_whole_and_in_place() {
        let mut b = FrameBuf::new();
        let f = frame(4, &[1, 2, 3]);
        feed(&mut b, b"HTTP/1.1 101 Switching\r\nA: b\r\n\r\n");
        feed(&mut b, &f[..6]);
        assert_eq!(
            b.take_http_head().as_deref(),
            Some("HTTP/1.1 101 Switching\r\nA: b\r\n\r\n")
        );
        assert!(b.next_frame().expect("ok").is_none());
        feed(&mut b, &f[6..]);
        let (ty, range) = b.next_frame().expect("ok").expect("whole");
        assert_eq!((ty, &b[range.clone()]), (4, &f[..]));
        b[range.start] = 5;
        assert_eq!(b[range.start], 5);
        assert!(b.unread().is_empty());
        assert!(b.next_frame().expect("ok").is_none());
    }

    #[test]
    fn unread_bytes_move_to_the_front_before_a_frame_could_straddle_the_end() {
        let mut b = FrameBuf::new();
        let big = frame(5, &vec![9; MAX_FRAME - FRAME_HEADER_LEN]);
        for _ in 0..5 {
            // A whole maximal frame, then the start of the next one.
            feed(&mut b, &big);
            feed(&mut b, &big[..100]);
            let (_, range) = b.next_frame().expect("ok").expect("whole");
            assert_eq!(&b[range], &big[..]);
            assert!(b.spare().len() >= MAX_FRAME);
            feed(&mut b, &big[100..]);
            let (_, range) = b.next_frame().expect("ok").expect("whole");
            assert_eq!(&b[range], &big[..]);
        }
    }

    #[test]
    fn a_frame_longer_than_any_relay_sends_is_an_error() {
        let mut b = FrameBuf::new();
        feed(&mut b, &[5, 0, 1, 0, 37]);
        assert_eq!(
            b.next_frame().expect_err("too long").kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn the_upgrade_request_carries_extra_headers_verbatim() {
        let req = UpgradeRequest {
            host: "h:1",
            path: "/derp",
            extra_headers: "Ideal-Node: \r\n",
        };
        assert_eq!(
            req.to_bytes(),
            b"GET /derp HTTP/1.1\r\nHost: h:1\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\
              Ideal-Node: \r\n\r\n"
        );
    }
}
