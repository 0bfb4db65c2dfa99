//! `floor-relay`: the least a relay can do, to measure what is left when the DERP work is
//! taken away.
//!
//! It speaks just enough DERP for derp-bench's clients to connect unchanged: the HTTP upgrade
//! (`Upgrade: DERP` over plain TCP, no TLS or WebSocket), ServerKey, ClientInfo and
//! ServerInfo through derp-proto's handshake. After that each connection has one blocking
//! thread that reads whatever the socket holds, turns every SendPacket frame into a
//! RecvPacket frame in place (both have a 5-byte header and a 32-byte key before the packet,
//! so only the type byte and the key change) and writes it to the destination's socket: one
//! read and one write per packet when packets come one at a time. Pings are answered; every
//! other frame is skipped.
//!
//! What it leaves out, on purpose: queues (a receiver that does not read holds its senders
//! back through TCP instead of losing packets), drops, limits, metrics, keepalives, mesh,
//! PeerGone. A round trip through it is what the kernel and two hops cost; whatever a real
//! relay adds on top of that is its own work.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use derp_proto::frame::{FRAME_HEADER_LEN, FrameType, KEY_LEN, MAX_PACKET_SIZE};
use derp_proto::upgrade::{self, DerpUpgrade, Request, UpgradeError, UpgradeKind};
use derp_proto::{
    ClientToRelay, DecodeError, HandshakeError, PublicKey, SecretKey, ServerDecoder,
    ServerHandshake,
};

use crate::report::error_text;

/// How long a new connection has for its request head and ClientInfo.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest frame accepted after the handshake: a full-size SendPacket.
const MAX_FRAME: usize = KEY_LEN + MAX_PACKET_SIZE;
/// The read buffer holds at least two of the largest frames, so a frame is never split
/// across the buffer's end after the unread tail moves to the front.
const READ_BUF: usize = 2 * (FRAME_HEADER_LEN + MAX_FRAME);

/// A connected client: its socket's sending side.
#[derive(Debug)]
struct Peer {
    out: Mutex<TcpStream>,
}

impl Peer {
    /// Writes one whole frame. Several senders may write to one receiver; the lock keeps
    /// their frames from interleaving.
    fn write(&self, frame: &[u8]) -> io::Result<()> {
        self.out
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(frame)
    }
}

#[derive(Debug)]
struct Relay {
    secret: SecretKey,
    peers: RwLock<HashMap<PublicKey, Arc<Peer>>>,
}

/// Listens on `listen` and relays until the process is stopped. The first line on stdout is
/// the DERP URL to give derp-bench (`--url`), with the port the kernel chose for port 0.
pub fn run(listen: SocketAddr) -> Result<(), FloorError> {
    let listener =
        TcpListener::bind(listen).map_err(|source| FloorError::Bind { listen, source })?;
    let addr = listener.local_addr()?;
    println!("http://{addr}/derp");
    io::stdout().flush()?;
    let relay = Arc::new(Relay {
        secret: SecretKey::generate(&mut rand::rngs::OsRng),
        peers: RwLock::default(),
    });
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                eprintln!("derp-bench floor-relay: accept: {e}");
                // Out of descriptors, most likely: give connections time to close.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let relay = relay.clone();
        let spawned = std::thread::Builder::new()
            .name("floor-conn".into())
            .spawn(move || {
                if let Err(e) = serve(&relay, stream) {
                    eprintln!(
                        "derp-bench floor-relay: connection closed: {}",
                        error_text(&e)
                    );
                }
            });
        if let Err(e) = spawned {
            eprintln!("derp-bench floor-relay: no thread for a connection: {e}");
        }
    }
    Ok(())
}

/// One connection from its first byte to its last.
fn serve(relay: &Relay, mut stream: TcpStream) -> Result<(), FloorError> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut buf = BytesMut::with_capacity(4096);
    let Some(client) = handshake(relay, &mut stream, &mut buf)? else {
        return Ok(());
    };
    stream.set_read_timeout(None)?;
    let peer = Arc::new(Peer {
        out: Mutex::new(stream.try_clone()?),
    });
    relay
        .peers
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(client, peer.clone());
    let result = forward(relay, client, &peer, &mut stream, &buf);
    let mut peers = relay.peers.write().unwrap_or_else(PoisonError::into_inner);
    // A newer connection with the same key replaced this one: leave it.
    if peers.get(&client).is_some_and(|p| Arc::ptr_eq(p, &peer)) {
        peers.remove(&client);
    }
    drop(peers);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    result
}

/// The upgrade and the DERP handshake. Returns the client's key, or `None` when the request
/// was not a DERP upgrade (answered with an HTTP error). Bytes read past ClientInfo stay in
/// `buf`.
fn handshake(
    relay: &Relay,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
) -> Result<Option<PublicKey>, FloorError> {
    let head_len = loop {
        if let Some(n) = upgrade::request_head_len(buf)? {
            break n;
        }
        read_more(stream, buf)?;
    };
    let Request::Upgrade(DerpUpgrade {
        kind: UpgradeKind::Derp { fast_start },
        ..
    }) = upgrade::classify_request(&buf[..head_len], true)
    else {
        stream.write_all(
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(None);
    };
    let _ = buf.split_to(head_len);
    let mut hs = ServerHandshake::new(relay.secret.clone());
    let mut out = Vec::new();
    if !fast_start {
        out.extend_from_slice(&upgrade::derp_response_head(&hs.public_key()));
    }
    hs.server_key_frame(&mut out);
    stream.write_all(&out)?;
    let mut decoder = ServerDecoder::new();
    let (key, sealed) = loop {
        match decoder.decode(buf)? {
            Some(ClientToRelay::ClientInfo { key, sealed }) => break (key, sealed),
            Some(other) => return Err(FloorError::NotClientInfo(format!("{other:?}"))),
            None => read_more(stream, buf)?,
        }
    };
    hs.handle_client_info(key, &sealed)?;
    out.clear();
    hs.server_info_frame(rand::random(), &mut out)?;
    stream.write_all(&out)?;
    Ok(Some(key))
}

fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<(), FloorError> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk)?;
    if n == 0 {
        return Err(FloorError::Closed);
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// Relays the client's frames until it leaves. `early` holds bytes read with the handshake.
fn forward(
    relay: &Relay,
    client: PublicKey,
    me: &Peer,
    stream: &mut TcpStream,
    early: &[u8],
) -> Result<(), FloorError> {
    let mut buf = vec![0u8; READ_BUF];
    buf[..early.len()].copy_from_slice(early);
    let (mut start, mut end) = (0, early.len());
    loop {
        // Every whole frame in the buffer.
        while end - start >= FRAME_HEADER_LEN {
            let ty = buf[start];
            let len = u32::from_be_bytes([
                buf[start + 1],
                buf[start + 2],
                buf[start + 3],
                buf[start + 4],
            ]) as usize;
            if len > MAX_FRAME {
                return Err(FloorError::FrameTooLarge(len));
            }
            let frame_end = start + FRAME_HEADER_LEN + len;
            if frame_end > end {
                break;
            }
            let frame = &mut buf[start..frame_end];
            if ty == FrameType::SendPacket as u8 {
                if len < KEY_LEN {
                    return Err(FloorError::NoDestination);
                }
                let key_at = FRAME_HEADER_LEN..FRAME_HEADER_LEN + KEY_LEN;
                let mut dst = [0u8; KEY_LEN];
                dst.copy_from_slice(&frame[key_at.clone()]);
                frame[0] = FrameType::RecvPacket as u8;
                frame[key_at].copy_from_slice(client.as_bytes());
                let to = relay
                    .peers
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&PublicKey::from_bytes(dst))
                    .cloned();
                // An unknown or failed destination loses the packet, as in any relay.
                if let Some(to) = to {
                    let _ = to.write(frame);
                }
            } else if ty == FrameType::Ping as u8 && len == 8 {
                frame[0] = FrameType::Pong as u8;
                me.write(frame)?;
            }
            start = frame_end;
        }
        if start == end {
            (start, end) = (0, 0);
        } else if buf.len() - end < FRAME_HEADER_LEN + MAX_FRAME {
            buf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        let n = stream.read(&mut buf[end..])?;
        if n == 0 {
            return Ok(());
        }
        end += n;
    }
}

/// Why the floor relay, or one of its connections, stopped.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    /// The listening address is not available.
    #[error("binding {listen} for the relay")]
    Bind {
        /// The address asked for.
        listen: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// The socket.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// A request head that does not parse.
    #[error("request head")]
    Head(#[from] UpgradeError),
    /// A frame that does not decode during the handshake.
    #[error("ClientInfo frame")]
    Decode(#[from] DecodeError),
    /// Another frame where ClientInfo belongs.
    #[error("expected ClientInfo, got {0}")]
    NotClientInfo(String),
    /// The DERP handshake.
    #[error("handshake")]
    Handshake(#[from] HandshakeError),
    /// The client left during the handshake.
    #[error("closed during the handshake")]
    Closed,
    /// A frame larger than a full-size SendPacket.
    #[error("frame of {0} bytes")]
    FrameTooLarge(usize),
    /// A SendPacket shorter than its key.
    #[error("SendPacket without a destination")]
    NoDestination,
}
