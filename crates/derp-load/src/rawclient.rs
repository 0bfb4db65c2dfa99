//! A blocking DERP client over plain TCP: the leanest client there can be, to tell how much of
//! a measured round trip is the bench's own.
//!
//! It does the HTTP upgrade and the handshake with derp-proto, then sends and receives whole
//! frames with one `write` and (when a frame arrives whole, as small ones do on loopback) one
//! `read` each, on the caller's thread. No TLS, WebSocket or QUIC: those need
//! [`derp_client`], which is what every mode uses by default.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use bytes::BytesMut;
use derp_proto::frame::{FRAME_HEADER_LEN, KEY_LEN, MAX_PACKET_SIZE, PROTOCOL_VERSION};
use derp_proto::upgrade::{self, RequestOptions};
use derp_proto::{ClientDecoder, ClientHandshake, ClientInfo, RelayToClient, SecretKey};

/// Largest frame the server sends that this client reads whole: a full-size RecvPacket. The
/// buffer holds two, so a frame never straddles its end once the unread tail moves to the
/// front.
const MAX_FRAME: usize = FRAME_HEADER_LEN + KEY_LEN + MAX_PACKET_SIZE;

/// A connected, handshaken DERP connection.
#[derive(Debug)]
pub(crate) struct RawConn {
    pub(crate) stream: TcpStream,
    pub(crate) buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl RawConn {
    /// Dials `host:port`, upgrades at `path` and completes the handshake as `secret`, within
    /// `timeout` for each step.
    pub(crate) fn connect(
        host: &str,
        port: u16,
        path: &str,
        secret: &SecretKey,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let addr: SocketAddr = (host, port)
            .to_socket_addrs()
            .with_context(|| format!("resolving {host}"))?
            .next()
            .ok_or_else(|| anyhow!("{host} has no address"))?;
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        let host_header = if port == 80 {
            host.to_owned()
        } else {
            format!("{host}:{port}")
        };
        let mut head = BytesMut::new();
        upgrade::write_request(
            &RequestOptions {
                path,
                host: &host_header,
                user_agent: "derp-bench",
                fast_start: false,
                ideal_node: None,
                websocket_key: None,
            },
            &mut head,
        );
        stream.write_all(&head)?;

        let mut buf = BytesMut::with_capacity(4096);
        let response = loop {
            if let Some(r) = upgrade::parse_response(&buf).context("upgrade response")? {
                break r;
            }
            read_some(&mut stream, &mut buf)?;
        };
        if response.status != 101 {
            bail!(
                "the server refused the DERP upgrade with HTTP {}",
                response.status
            );
        }
        let _ = buf.split_to(response.len);
        let info = ClientInfo {
            version: i64::from(PROTOCOL_VERSION),
            app_name: "derp-bench".into(),
            ..ClientInfo::default()
        };
        let mut hs = ClientHandshake::new(secret.clone(), info);
        let mut decoder = ClientDecoder::new();
        let mut out = BytesMut::new();
        loop {
            match decoder.decode(&mut buf).context("handshake frame")? {
                Some(RelayToClient::ServerKey(key)) if hs.server_key().is_none() => {
                    hs.handle_server_key(key)?;
                    hs.client_info_frame(rand::random(), &mut out)?;
                    stream.write_all(&out)?;
                }
                Some(RelayToClient::ServerInfo { sealed }) => {
                    hs.handle_server_info(&sealed)?;
                    break;
                }
                Some(RelayToClient::Unknown { .. }) => {}
                Some(other) => bail!("unexpected frame during the handshake: {other:?}"),
                None => read_some(&mut stream, &mut buf)?,
            }
        }
        stream.set_read_timeout(None)?;
        let mut conn = Self {
            stream,
            buf: vec![0u8; 2 * MAX_FRAME],
            start: 0,
            end: buf.len(),
        };
        conn.buf[..buf.len()].copy_from_slice(&buf);
        Ok(conn)
    }

    /// Reads until one whole frame is buffered; returns its type byte and where it is in
    /// [`RawConn::buf`] (header included). A timeout set on the stream ends the wait with
    /// `WouldBlock` or `TimedOut`.
    pub(crate) fn next_frame(&mut self) -> io::Result<(u8, Range<usize>)> {
        loop {
            if self.end - self.start >= FRAME_HEADER_LEN {
                let b = &self.buf[self.start..];
                let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
                if FRAME_HEADER_LEN + len > MAX_FRAME {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame of {len} bytes from the server"),
                    ));
                }
                let frame_end = self.start + FRAME_HEADER_LEN + len;
                if frame_end <= self.end {
                    let range = self.start..frame_end;
                    self.start = frame_end;
                    return Ok((b[0], range));
                }
            }
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.buf.len() - self.end < MAX_FRAME {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            let n = self.stream.read(&mut self.buf[self.end..])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.end += n;
        }
    }
}

fn read_some(stream: &mut TcpStream, buf: &mut BytesMut) -> anyhow::Result<()> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        bail!("the server closed the connection during the handshake");
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}
