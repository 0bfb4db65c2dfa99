//! A live relay in process: arbitrary bytes from a hostile connection, beside an honest
//! client pair whose traffic must not notice.
//!
//! One [`derp_server::Server`] per thread (the fuzzer's, or a test's) runs on a current-thread
//! tokio runtime made once. Two honest clients, `client_a` and `client_b` from keys.json,
//! stay connected for the whole process over in-memory streams. Each input opens a third
//! connection and writes its bytes there, in pieces, with a packet from B to A and one from A
//! to B after every piece (each waited for before the next is sent), then closes it.
//!
//! Input: `mode | seed | bytes`. The mode byte:
//!
//! - bits 0–1, how the hostile connection arrives: 0 `Server::accept` (DERP from the first
//!   byte); 1 the HTTP front, the bytes being everything the client sends; 2 the HTTP front
//!   after an `Upgrade: DERP` request; 3 the HTTP front after a WebSocket upgrade request;
//! - bit 2: a valid ClientInfo for the hostile's own key (`0x48…`) goes first, so the bytes
//!   land after the handshake (ignored with front 1);
//! - bits 3–4: which ClientInfo (plain, prober, a wrong mesh key, an app name);
//! - bit 5: front 2 asks for fast start; front 3 carries the bytes in masked binary
//!   messages the target builds (otherwise they are the client's raw WebSocket stream);
//! - bits 6–7: one to four pieces, cut where the seed byte says.
//!
//! Checks:
//!
//! - every honest packet arrives once, unchanged and in order, and the honest clients receive
//!   nothing but packets from each other or the hostile key, keepalives, and PeerGone for
//!   the hostile key (the only one that can send to them and leave);
//! - the relay closes the hostile connection once its input ends, no relay task panics, and
//!   afterwards exactly the two honest keys are connected and still exchange packets;
//! - whenever the hostile's stream has a known shape (fronts 0, 2 and 3), what the relay
//!   wrote to it is well formed: the exact 101 head (unless fast start), then ServerKey, then
//!   (after a valid ClientInfo) ServerInfo sealed to the hostile's key, then frames that never
//!   carry packets from the honest keys or news of them leaving; in WebSocket messages for
//!   front 3. No frame is left half-written.
//!
//! The relay runs with its default settings except the send queue depth, raised so far above
//! what one input can queue that the drop policy never discards an honest packet behind the
//! hostile's flood (dropping under load is the policy working, not a fault). The hostile never
//! gets mesh privileges (which would let it legitimately close or impersonate the honest
//! clients); a wrong mesh key is among the ClientInfos it can send.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::sync::Once;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_proto::upgrade::{self, RequestOptions};
use derp_proto::ws::{self, Opcode, Role, WsDecoder, WsEvent};
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, MeshKey, PublicKey, RelayToClient,
    SecretKey, ServerInfo,
};
use derp_server::{Server, ServerConfig, Transport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::runtime::Runtime;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::Rng;

/// `client_a.private_hex` and `client_b.private_hex` in testdata/keys.json: the honest pair,
/// so the session vectors' packets (A ↔ B) are addressed to them.
const CLIENT_A_HEX: &str = "d0453a3a3cf498d231e8b82c22ec897f54718031ec49cbbdfeb4266d59db7c7f";
const CLIENT_B_HEX: &str = "a0167d3f0c25d9cf43774830c273a26a09c93a6598ffd4d656b1e66af79ddc66";
/// The relay's key is not the vectors' `server` key, so the ClientInfo frames recorded in the
/// vectors (which authenticate A and B to that key) cannot be replayed here to impersonate the
/// honest clients.
const SERVER_SECRET: [u8; 32] = [0x5e; 32];
const HOSTILE_SECRET: [u8; 32] = [0x48; 32];
const MESH_KEY: [u8; 32] = [0x6d; 32];
const WRONG_MESH_KEY: [u8; 32] = [0x6e; 32];
/// `Sec-WebSocket-Key` of the hostile's WebSocket upgrade (RFC 6455's example).
const WS_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// Bounds every wait: honest packets and the hostile connection's end normally take
/// microseconds, so reaching this means the relay is stuck.
const PATIENCE: Duration = Duration::from_secs(5);
/// Far more packets than one input can queue (the smallest SendPacket frame is 37 bytes).
const QUEUE_DEPTH: usize = 1 << 16;
/// In-memory stream buffers: large enough that the relay never waits on the target.
const PIPE: usize = 1 << 20;

/// Fuzz target.
pub fn server_stream(data: &[u8]) {
    install_panic_counter();
    WORLD.with(|cell| {
        let slot = &mut cell.borrow_mut().0;
        // An earlier input that panicked (in the replay test) may have left a packet in
        // flight; start over rather than blame the next input.
        if slot.as_ref().is_none_or(|w| w.dirty) {
            *slot = None;
            *slot = Some(World::new());
        }
        let world = slot.as_mut().expect("just made");
        world.dirty = true;
        let World { rt, relay, .. } = world;
        let panics = PANICS.with(Cell::get);
        rt.block_on(relay.hostile(data));
        assert_eq!(PANICS.with(Cell::get), panics, "a relay task panicked");
        world.dirty = false;
    });
}

thread_local! {
    static WORLD: RefCell<Slot> = const { RefCell::new(Slot(None)) };
    /// Panics on this thread. Relay tasks run here (current-thread runtime), and tokio
    /// catches their panics, so this is how the replay test sees them. (Under libFuzzer the
    /// panic hook aborts first.)
    static PANICS: Cell<u64> = const { Cell::new(0) };
}

fn install_panic_counter() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.with(|p| p.set(p.get() + 1));
            previous(info);
        }));
    });
}

/// The thread's relay. It is not dropped at thread exit: by then thread-locals the relay's
/// connections use when they unregister (papaya's epoch bookkeeping) may already be gone,
/// and the thread is ending anyway.
struct Slot(Option<World>);

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(world) = self.0.take() {
            std::mem::forget(world);
        }
    }
}

struct World {
    rt: Runtime,
    relay: Relay,
    dirty: bool,
}

impl World {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let relay = rt.block_on(Relay::start());
        Self {
            rt,
            relay,
            dirty: false,
        }
    }
}

/// The relay and its honest clients.
struct Relay {
    server: Server,
    a: Honest,
    b: Honest,
    hostile_key: PublicKey,
    hostile_secret: SecretKey,
    /// ClientInfo frames from the hostile key, one per variant.
    hostile_infos: Vec<Vec<u8>>,
    seq: u64,
}

fn secret(hex_text: &str) -> SecretKey {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(hex_text, &mut bytes).expect("fixed key hex");
    SecretKey::from_bytes(bytes)
}

fn addr(last: u8) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, last], 40_000 + u16::from(last)))
}

/// How many ClientInfos the mode byte can pick from.
const CLIENT_INFO_VARIANTS: usize = 4;

/// The ClientInfo frame the hostile key sends for mode bits 3–4 (`variant`), sealed to the
/// relay with a fixed nonce: the same bytes every time, so seeds can carry it too.
pub fn hostile_client_info(variant: usize) -> Vec<u8> {
    let info = match variant % CLIENT_INFO_VARIANTS {
        0 => ClientInfo {
            version: 2,
            can_ack_pings: true,
            ..ClientInfo::default()
        },
        1 => ClientInfo {
            version: 2,
            is_prober: true,
            ..ClientInfo::default()
        },
        2 => ClientInfo {
            version: 2,
            mesh_key: Some(MeshKey(WRONG_MESH_KEY)),
            ..ClientInfo::default()
        },
        _ => ClientInfo {
            version: 1,
            app_name: "derp-fuzz".into(),
            ..ClientInfo::default()
        },
    };
    let hostile = SecretKey::from_bytes(HOSTILE_SECRET);
    let relay_key = SecretKey::from_bytes(SERVER_SECRET).public_key();
    let mut frame = Vec::new();
    ClientToRelay::ClientInfo {
        key: hostile.public_key(),
        sealed: hostile
            .seal_to(&relay_key, &[0x11; 24], &info.to_json())
            .into(),
    }
    .encode(&mut frame);
    frame
}

/// The hostile connection's key, for seeds that address packets to it.
pub fn hostile_key() -> PublicKey {
    SecretKey::from_bytes(HOSTILE_SECRET).public_key()
}

impl Relay {
    async fn start() -> Self {
        let config = ServerConfig {
            send_queue_depth: QUEUE_DEPTH,
            mesh_key: Some(MeshKey(MESH_KEY)),
            ..ServerConfig::new(SecretKey::from_bytes(SERVER_SECRET))
        };
        let server = Server::new(config, &prometheus::Registry::new()).expect("relay");
        let a = Honest::connect(&server, secret(CLIENT_A_HEX), addr(1)).await;
        let b = Honest::connect(&server, secret(CLIENT_B_HEX), addr(2)).await;
        let hostile_secret = SecretKey::from_bytes(HOSTILE_SECRET);
        let hostile_infos = (0..CLIENT_INFO_VARIANTS).map(hostile_client_info).collect();
        let mut relay = Self {
            server,
            a,
            b,
            hostile_key: hostile_secret.public_key(),
            hostile_secret,
            hostile_infos,
            seq: 0,
        };
        relay.round_trip().await;
        relay
    }

    /// One packet B → A and one A → B, each waited for.
    async fn round_trip(&mut self) {
        let hostile = self.hostile_key;
        for forward in [true, false] {
            self.seq += 1;
            let packet = honest_packet(self.seq);
            let (from, to) = if forward {
                (&mut self.b, &mut self.a)
            } else {
                (&mut self.a, &mut self.b)
            };
            from.send(to.key, &packet).await;
            to.expect_from(from.key, hostile, &packet).await;
        }
    }

    /// One input's hostile connection, from open to close.
    async fn hostile(&mut self, data: &[u8]) {
        let (mode, seed, input) = match data {
            [mode, seed, rest @ ..] => (*mode, *seed, rest),
            [mode] => (*mode, 0, &[][..]),
            [] => (0, 0, &[][..]),
        };
        let front = mode & 3;
        let handshake = mode & 4 != 0 && front != 1;
        let variant = usize::from((mode >> 3) & 3);
        let flag = mode & 0x20 != 0;
        let pieces_wanted = 1 + usize::from(mode >> 6);
        let mut rng = Rng::new(&[seed, mode]);

        // What goes first, and the input cut into pieces (wrapped in WebSocket messages when
        // front 3 asks for it).
        let mut prefix = Vec::new();
        match front {
            2 => upgrade::write_request(&request_options(flag, None), &mut prefix),
            3 => upgrade::write_request(&request_options(false, Some(WS_KEY)), &mut prefix),
            _ => {}
        }
        let wrap = front == 3 && flag;
        if handshake {
            let info = &self.hostile_infos[variant];
            if front == 3 {
                let mut msg = BytesMut::new();
                ws::write_masked_frame(&mut msg, Opcode::Binary, info, mask(&mut rng));
                prefix.extend_from_slice(&msg);
            } else {
                prefix.extend_from_slice(info);
            }
        }
        let mut pieces = Vec::new();
        let mut rest = input;
        for i in 0..pieces_wanted {
            let n = if i + 1 == pieces_wanted || rest.is_empty() {
                rest.len()
            } else {
                rng.below_incl(rest.len()) - 1
            };
            let (piece, tail) = rest.split_at(n);
            rest = tail;
            if wrap && !piece.is_empty() {
                let mut msg = BytesMut::new();
                ws::write_masked_frame(&mut msg, Opcode::Binary, piece, mask(&mut rng));
                pieces.push(msg.to_vec());
            } else {
                pieces.push(piece.to_vec());
            }
        }

        let (client, server_end) = tokio::io::duplex(PIPE);
        let transport = Transport::Boxed(Box::new(server_end));
        let accept: Option<JoinHandle<()>> = if front == 0 {
            let server = self.server.clone();
            Some(tokio::spawn(async move {
                server.accept(transport, addr(66)).await;
            }))
        } else {
            self.server.spawn_connection(transport, addr(66));
            None
        };
        let (mut rd, mut wr) = tokio::io::split(client);

        let input_ended = Notify::new();
        let writer = async {
            let mut open = wr.write_all(&prefix).await.is_ok();
            for piece in &pieces {
                open = open && wr.write_all(piece).await.is_ok();
                self.round_trip().await;
            }
            let _ = wr.shutdown().await;
            input_ended.notify_one();
        };
        // Honest waits have their own limits; once the input has ended, the relay has
        // PATIENCE to close the connection (well inside libFuzzer's -timeout=10).
        let reader = async {
            let mut out = Vec::new();
            let closed = tokio::select! {
                read = rd.read_to_end(&mut out) => read,
                () = async {
                    input_ended.notified().await;
                    tokio::time::sleep(PATIENCE).await;
                } => panic!("the relay did not close the hostile connection after its input ended"),
            };
            closed.expect("reading what the relay wrote to the hostile connection");
            out
        };
        let ((), out) = tokio::join!(writer, reader);
        if let Some(task) = accept {
            let ended = tokio::time::timeout(PATIENCE, task)
                .await
                .expect("Server::accept did not return after the connection closed");
            if let Err(e) = ended {
                std::panic::resume_unwind(e.into_panic());
            }
        }

        let expect = match front {
            0 => Some(Shape::Raw),
            2 if flag => Some(Shape::Raw),
            2 => Some(Shape::DerpHead),
            3 => Some(Shape::WebSocket),
            _ => None,
        };
        // A valid ClientInfo must be answered, except in front 3's raw WebSocket stream: there
        // a bad frame read together with ClientInfo's message ends the connection first.
        let must_answer = handshake && (front != 3 || wrap);
        if let Some(shape) = expect {
            self.check_hostile_output(shape, handshake, must_answer, &out);
        }
        assert_eq!(
            self.server.local_clients(),
            2,
            "keys connected after the hostile connection closed"
        );
        assert!(
            !self.a.task.is_finished() && !self.b.task.is_finished(),
            "an honest connection ended"
        );
        self.round_trip().await;
    }

    /// What the relay wrote to the hostile connection, when its form is known.
    fn check_hostile_output(&self, shape: Shape, handshake: bool, must_answer: bool, out: &[u8]) {
        let derp_bytes = match shape {
            Shape::Raw => out.to_vec(),
            Shape::DerpHead => {
                let head = upgrade::derp_response_head(&self.server.public_key());
                assert!(out.starts_with(&head), "no exact 101 head: {out:02x?}");
                out[head.len()..].to_vec()
            }
            Shape::WebSocket => {
                let head = upgrade::websocket_response_head(&ws::accept_key(WS_KEY), true);
                assert!(out.starts_with(&head), "no exact WebSocket 101: {out:02x?}");
                unwrap_websocket(&out[head.len()..])
            }
        };
        let mut buf = BytesMut::from(&derp_bytes[..]);
        let mut decoder = ClientDecoder::new();
        let mut frames = Vec::new();
        while let Some(frame) = decoder
            .decode(&mut buf)
            .expect("the relay wrote a malformed frame to the hostile connection")
        {
            frames.push(frame);
        }
        assert!(
            buf.is_empty(),
            "the relay left a frame half-written: {buf:02x?}"
        );
        let mut frames = frames.into_iter();
        assert_eq!(
            frames.next(),
            Some(RelayToClient::ServerKey(self.server.public_key())),
            "first frame"
        );
        let mut frames = frames.peekable();
        let answered = matches!(frames.peek(), Some(RelayToClient::ServerInfo { .. }));
        assert!(
            answered || !must_answer,
            "no ServerInfo after a valid ClientInfo"
        );
        if answered {
            assert!(handshake, "ServerInfo without a valid ClientInfo");
            let Some(RelayToClient::ServerInfo { sealed }) = frames.next() else {
                unreachable!("peeked");
            };
            let json = self
                .hostile_secret
                .open_from(&self.server.public_key(), &sealed)
                .expect("ServerInfo sealed to the hostile key");
            ServerInfo::from_json(&json).expect("ServerInfo JSON");
        }
        let honest = [self.a.key, self.b.key];
        for frame in frames {
            match frame {
                RelayToClient::RecvPacket { src, .. } => {
                    assert!(answered, "a packet before the handshake");
                    assert_eq!(src, self.hostile_key, "the hostile got someone's packet");
                }
                RelayToClient::PeerGone { peer, .. } => {
                    assert!(
                        !honest.contains(&peer),
                        "told the hostile an honest key left"
                    );
                }
                RelayToClient::Pong(_) | RelayToClient::KeepAlive => {
                    assert!(answered, "{frame:?} before the handshake");
                }
                other => panic!("the relay sent the hostile {other:?}"),
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Shape {
    /// DERP frames from the first byte.
    Raw,
    /// derper's 101 head, then DERP frames.
    DerpHead,
    /// The WebSocket 101, then DERP frames in binary messages.
    WebSocket,
}

/// The DERP bytes in the relay's WebSocket messages, which must be well formed up to a close
/// (after which nothing may follow).
fn unwrap_websocket(bytes: &[u8]) -> Vec<u8> {
    let mut decoder = WsDecoder::new(Role::Client);
    let mut input = BytesMut::from(bytes);
    let mut out = BytesMut::new();
    // Every event ends the relay's stream: it never pings.
    match decoder.decode(&mut input, &mut out) {
        Ok(WsEvent::NeedMore) => {
            assert!(input.is_empty(), "half a WebSocket frame: {input:02x?}");
        }
        Ok(WsEvent::Close { .. }) => {
            assert!(input.is_empty(), "bytes after the close: {input:02x?}");
        }
        Ok(WsEvent::Ping(_)) => panic!("the relay pinged over WebSocket"),
        Err(e) => panic!("the relay wrote bad WebSocket framing: {e}"),
    }
    out.to_vec()
}

fn mask(rng: &mut Rng) -> [u8; 4] {
    let m = rng.below_incl(1 << 32) - 1;
    (m as u32).to_be_bytes()
}

fn request_options(
    fast_start: bool,
    websocket_key: Option<&'static str>,
) -> RequestOptions<'static> {
    RequestOptions {
        path: "/derp",
        host: "relay.test",
        user_agent: "derp-fuzz",
        fast_start,
        ideal_node: None,
        websocket_key,
    }
}

/// A unique, recognisable, non-disco payload of 40 to 239 bytes.
fn honest_packet(seq: u64) -> Vec<u8> {
    let mut p = format!("honest {seq:016x} ").into_bytes();
    let len = 40 + (seq % 200) as usize;
    let mut x = seq;
    while p.len() < len {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        p.push((x >> 56) as u8);
    }
    p
}

/// An honest client on an in-memory stream to the relay.
struct Honest {
    key: PublicKey,
    io: DuplexStream,
    buf: BytesMut,
    decoder: ClientDecoder,
    task: JoinHandle<()>,
}

impl Honest {
    async fn connect(server: &Server, secret: SecretKey, remote: SocketAddr) -> Self {
        let (io, server_end) = tokio::io::duplex(PIPE);
        let relay = server.clone();
        let task = tokio::spawn(async move {
            relay
                .accept(Transport::Boxed(Box::new(server_end)), remote)
                .await;
        });
        let mut honest = Self {
            key: secret.public_key(),
            io,
            buf: BytesMut::new(),
            decoder: ClientDecoder::new(),
            task,
        };
        let RelayToClient::ServerKey(server_key) = honest.next_frame().await else {
            panic!("no ServerKey");
        };
        let info = ClientInfo {
            version: 2,
            can_ack_pings: true,
            ..ClientInfo::default()
        };
        let mut hs = ClientHandshake::new(secret, info);
        hs.handle_server_key(server_key).expect("ServerKey");
        let mut frame = Vec::new();
        hs.client_info_frame([0x22; 24], &mut frame)
            .expect("ClientInfo");
        write(&mut honest.io, &frame).await;
        let RelayToClient::ServerInfo { sealed } = honest.next_frame().await else {
            panic!("no ServerInfo");
        };
        hs.handle_server_info(&sealed).expect("ServerInfo opens");
        honest
    }

    async fn send(&mut self, dst: PublicKey, packet: &[u8]) {
        let mut frame = Vec::new();
        ClientToRelay::SendPacket {
            dst,
            packet: Bytes::copy_from_slice(packet),
        }
        .encode(&mut frame);
        write(&mut self.io, &frame).await;
    }

    async fn next_frame(&mut self) -> RelayToClient {
        loop {
            if let Some(frame) = self
                .decoder
                .decode(&mut self.buf)
                .expect("the relay wrote a malformed frame to an honest client")
            {
                return frame;
            }
            let n = tokio::time::timeout(PATIENCE, self.io.read_buf(&mut self.buf))
                .await
                .expect("an honest client waited too long for the relay")
                .expect("honest read");
            assert!(n > 0, "the relay closed an honest client's connection");
        }
    }

    /// Reads until `packet` arrives from `peer`, which must be the next thing `peer` sent.
    async fn expect_from(&mut self, peer: PublicKey, hostile: PublicKey, packet: &[u8]) {
        loop {
            match self.next_frame().await {
                RelayToClient::RecvPacket { src, packet: got } if src == peer => {
                    assert!(
                        got[..] == packet[..],
                        "honest packet changed, lost or out of order: got {got:02x?}, \
                         want {packet:02x?}"
                    );
                    return;
                }
                RelayToClient::RecvPacket { src, .. } => {
                    assert_eq!(src, hostile, "a packet from a key nobody authenticated");
                }
                RelayToClient::PeerGone { peer: gone, .. } => {
                    // Only the hostile key ever sent it anything and left.
                    assert_eq!(
                        gone, hostile,
                        "told an honest client of the wrong key leaving"
                    );
                }
                RelayToClient::KeepAlive => {}
                other => panic!("an honest client got {other:?}"),
            }
        }
    }
}

async fn write(io: &mut (impl AsyncWrite + AsyncRead + Unpin), bytes: &[u8]) {
    tokio::time::timeout(PATIENCE, io.write_all(bytes))
        .await
        .expect("an honest write waited too long")
        .expect("honest write");
}
