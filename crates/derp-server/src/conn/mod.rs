//! One client connection: the handshake and registration here, the read loop in [`read`](mod@read),
//! the writer in [`write`](mod@write).
//!
//! The per-packet path reads top to bottom across the two halves: a frame is read in
//! `read/` (read, decode), routed by `crate::route` (look up, enqueue on the destination's
//! queue) and written in `write/` (take the queue, frame it, one vectored write, account).

mod error;
pub(crate) mod quic;
mod read;
mod write;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_io::{Transport, WriteHalf};
use derp_proto::frame::{PEER_PRESENT_IS_MESH_PEER, PEER_PRESENT_IS_PROBER};
use derp_proto::frame::{PEER_PRESENT_IS_REGULAR, PEER_PRESENT_NOT_IDEAL};
use derp_proto::{ClientInfo, ClientToRelay, PublicKey, ServerDecoder, ServerHandshake, ws};
use rand::RngCore;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;
use tracing::debug;

use crate::admission::{AdmissionRequest, REFUSED_TIMEOUT, Refused, Verdict};
use crate::handle::ConnHandle;
use crate::listen::{ConnGuard, OpenPermit};
use crate::metrics::{DropReason, PacketKind, TransportLabel};
use crate::queue::{Batch, Control};
use crate::quic::QuicLink;
use crate::state::ServerState;
pub(crate) use error::{ConnError, LocalError, PeerMisbehaved};
use read::{FrameReader, ReadLoop};
use write::{Writer, write_with_timeout};

/// A connection handed over to the relay to speak DERP on, with how it arrived, as the HTTP
/// layer (or the QUIC front, or an embedder's [`crate::Server::accept`]) found it.
#[derive(Debug)]
pub(crate) struct Handover {
    pub(crate) transport: Transport,
    /// Bytes that arrived after the HTTP request head; they belong to the DERP stream.
    pub(crate) initial: BytesMut,
    pub(crate) remote: SocketAddr,
    /// Bytes to send before the ServerKey frame (the 101 response), if any. Sent in the same
    /// write as ServerKey, as the reference does.
    pub(crate) preamble: Bytes,
    /// How DERP frames travel on the stream.
    pub(crate) framing: Framing,
    /// The request carried a non-empty `Ideal-Node` header.
    pub(crate) not_ideal: bool,
    /// DERP over QUIC: the connection's datagrams and migration gate.
    pub(crate) quic: Option<Arc<QuicLink>>,
    /// The connection's place among the open and the unproven connections.
    pub(crate) guard: ConnGuard,
    /// Once established, the connection continues on a task of its own on the server's
    /// tracker and [`serve`] returns. The handshake's future (the HTTP front, the handshake
    /// and admission state, every layer's arguments) is several times the size of what an
    /// established connection needs, and a task is as big as its largest state: a fresh task
    /// for the steady state is what keeps idle connections small. Off where the caller awaits
    /// the connection to its end (an embedder's [`crate::Server::accept`], the QUIC front).
    pub(crate) detach: bool,
}

impl Handover {
    fn transport_label(&self) -> TransportLabel {
        match (&self.quic, self.framing) {
            (Some(_), _) => TransportLabel::Quic,
            (None, Framing::WebSocket) => TransportLabel::WebSocket,
            (None, Framing::Raw) => TransportLabel::Tcp,
        }
    }
}

/// Runs a DERP connection to completion. Never panics on peer input; every error closes only
/// this connection.
pub(crate) async fn serve(shared: Arc<ServerState>, handover: Handover) {
    let _ = serve_counted(shared, handover).await;
}

/// [`serve`], returning how the connection ended (already logged and counted).
pub(crate) async fn serve_counted(
    shared: Arc<ServerState>,
    handover: Handover,
) -> Result<(), ConnError> {
    let label = handover.transport_label();
    shared.metrics.accepts.inc();
    shared.metrics.accepts_by_transport[label as usize].inc();
    if handover.framing == Framing::WebSocket {
        shared.metrics.websocket_accepts.inc();
    }
    let remote = handover.remote;
    let result = run(shared.clone(), handover, label).await;
    count_end(&shared, remote, &result);
    result
}

/// Counts and logs how a connection ended.
fn count_end(shared: &ServerState, remote: SocketAddr, result: &Result<(), ConnError>) {
    if let Err(e) = result {
        shared
            .metrics
            .connection_errors
            .with_label_values(&e.labels())
            .inc();
        debug!(%remote, error = %e, "derp connection ended");
    }
}

async fn run(
    shared: Arc<ServerState>,
    handover: Handover,
    label: TransportLabel,
) -> Result<(), ConnError> {
    let Handover {
        transport,
        initial,
        remote,
        preamble,
        framing,
        not_ideal,
        quic,
        guard,
        detach,
    } = handover;
    // derper samples plain and TLS TCP connections only; WebSocket ones count as non-TCP.
    let tcp_socket = (framing == Framing::Raw && quic.is_none())
        .then(|| crate::tcpinfo::tcp_socket(&transport))
        .flatten();
    let (read_half, mut write_half) = transport.split();
    let mut reader = FrameReader::new(read_half, framing, initial);
    let config = &shared.config;
    let mut hs = ServerHandshake::with_keys(shared.keys.clone());
    // Until the client is admitted it is unproven: a newer connection may evict it. Boxed,
    // and in a block of its own, so that the handshake's state (deadlines, the admission
    // checks, the ClientInfo) is freed once it is done instead of sizing every idle
    // connection's task.
    let (client_key, flags, can_mesh, open) = {
        let proven = Box::pin(async {
            let (client_key, info) = match handshake(
                &mut hs,
                &mut reader,
                &mut write_half,
                framing,
                &preamble,
                config.handshake_timeout,
            )
            .await
            {
                Ok(done) => done,
                Err(e) => {
                    if matches!(e, ConnError::Peer(PeerMisbehaved::Handshake(_))) {
                        shared.metrics.handshake_failures.inc();
                    }
                    return Err(e);
                }
            };
            let can_mesh = is_mesh_peer(&shared, &info);
            // Mesh peers proved themselves with the mesh key; everyone else asks the checks.
            let verdict = if can_mesh {
                Ok(())
            } else {
                admit(&shared, client_key, remote).await
            };
            let flags = presence_flags(&info, can_mesh, not_ideal);
            Ok((client_key, flags, can_mesh, verdict))
        });
        let (client_key, flags, can_mesh, verdict) = tokio::select! {
            biased;
            _ = guard.evicted() => return Err(LocalError::Evicted.into()),
            r = proven => r?,
        };
        if let Err(refused) = verdict {
            shared
                .admission_refused
                .with_label_values(&[refused.reason])
                .inc();
            debug!(%remote, key = %client_key.short(), %refused, "client refused");
            return Ok(());
        }
        // Admitted: out of the unproven budget, still counted as open until it ends.
        (client_key, flags, can_mesh, guard.prove())
    };
    drop(preamble);
    let id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
    let handle = Arc::new(
        ConnHandle::new(
            id,
            client_key,
            remote,
            flags,
            can_mesh,
            config.send_queue_depth,
        )
        .with_tcp_socket(tcp_socket),
    );
    if quic.is_some() {
        handle.set_quic();
    }

    if let Some(link) = &quic {
        let early = reader.attach_quic(link.clone());
        shared.metrics.quic_garbage_datagrams.inc_by(early);
    }
    let registration = Registration::new(shared.clone(), handle.clone(), not_ideal, label, detach);
    // ServerInfo must be the first frame after ServerKey, so it is written before the writer
    // task starts draining whatever other clients have queued meanwhile. The handshake state
    // and its buffers are dropped here rather than held for the connection's lifetime.
    let server_info = {
        let mut nonce = [0u8; 24];
        rand::thread_rng().fill_bytes(&mut nonce);
        let mut out = BytesMut::new();
        let mut sealed_ok = Ok(());
        framing.frame(&mut out, |b| sealed_ok = hs.server_info_frame(nonce, b));
        drop(hs);
        sealed_ok.map(|()| out)
    };
    let result = match server_info {
        Ok(out) => {
            match write_with_timeout(&mut write_half, &out, Some(config.handshake_timeout)).await {
                Ok(()) => {
                    debug!(%remote, key = %client_key.short(), id, "client connected");
                    if let Some(link) = &quic {
                        // The first frame after ServerInfo: where the client's packets come
                        // from, as the server sees it.
                        handle
                            .queue
                            .push_control(Control::ObservedAddr(link.trusted_addr()));
                    }
                    Writer::start(
                        shared.clone(),
                        handle.clone(),
                        write_half,
                        framing,
                        quic.clone(),
                    );
                    let established = Established {
                        reader,
                        registration,
                        _open: open,
                    };
                    if detach {
                        shared.tasks.spawn(established.run());
                        return Ok(());
                    }
                    established.run().await
                }
                Err(e) => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    };
    debug!(%remote, key = %client_key.short(), id, "client disconnected");
    result
}

/// An established connection: registered, ServerInfo sent, its writer started. Only what the
/// read loop needs from here on, so that a task running just this stays small.
struct Established {
    /// Also holds the QUIC link of a connection over QUIC.
    reader: FrameReader,
    registration: Registration,
    /// Counts the connection as open until it ends.
    _open: Option<OpenPermit>,
}

impl Established {
    /// Runs the read loop until the connection ends, then unregisters it.
    ///
    /// An `async move` block rather than an `async fn`: an `async fn` taking `self` keeps a
    /// second copy of it in its state for the connection's life.
    #[allow(clippy::manual_async_fn)]
    fn run(mut self) -> impl Future<Output = Result<(), ConnError>> + Send {
        async move {
            if let Some(link) = self.reader.quic_link() {
                // Boxed: QUIC's path watcher would otherwise size every TCP connection's task.
                return Box::pin(self.run_quic(link)).await;
            }
            let r = &self.registration;
            let result = ReadLoop::new(&r.shared, &r.handle, &mut self.reader)
                .run()
                .await;
            // Borrowed again rather than kept from above, where they would take a slot each
            // in every idle connection's task.
            let Registration {
                shared,
                handle,
                detached,
                ..
            } = &self.registration;
            debug!(remote = %handle.remote, key = %handle.key.short(), id = handle.id, "client disconnected");
            let result = result.and_then(|()| written_out(handle));
            if *detached {
                count_end(shared, handle.remote.get(), &result);
            }
            // Leaving the registry (when `self.registration` drops) closes the queues; the
            // writer (running, or resumed from its parked state by the close) then finishes
            // the socket.
            result
        }
    }

    /// [`Established::run`] for DERP over QUIC: the path watcher runs beside the read loop,
    /// on the connection's own task, and stops with it.
    ///
    /// Borrows the connection rather than taking it: moved on one path only, it would need
    /// a drop flag in every connection's task.
    async fn run_quic(&mut self, link: Arc<QuicLink>) -> Result<(), ConnError> {
        let shared = &self.registration.shared;
        let handle = &self.registration.handle;
        let mut read_loop = ReadLoop::new(shared, handle, &mut self.reader);
        // Without a receive rate limit, the endpoint's driver routes the client's datagrams
        // as they arrive; with one, they come through the read loop, which keeps it.
        let routed = !read_loop.is_limited();
        if routed {
            link.route_in_driver(Some(handle.clone()));
        }
        // The path watcher also runs through a drain's wait, which `run` includes.
        let result = tokio::select! {
            r = read_loop.run() => r,
            never = link.watch_path(handle, &shared.metrics) => match never {},
        };
        if routed {
            link.route_in_driver(None);
        }
        debug!(remote = %handle.remote, key = %handle.key.short(), id = handle.id, "client disconnected");
        result.and_then(|()| written_out(handle))
    }
}

/// A read side that ended cleanly ended because the writer failed, if it did: that is how
/// the connection ended.
fn written_out(handle: &ConnHandle) -> Result<(), ConnError> {
    match handle.write_failure() {
        Some(timed_out) => Err(LocalError::Write { timed_out }.into()),
        None => Ok(()),
    }
}

/// A connection taken over from a predecessor process (see `crate::handover`), rebuilt and
/// not yet running: its socket is not touched until [`AdoptedConn::start_writer`] and [`AdoptedReader::start`].
pub(crate) struct AdoptedConn {
    handle: Arc<ConnHandle>,
    reader: FrameReader,
    writer: Box<Writer>,
    sources: Vec<PublicKey>,
    framing: Framing,
}

impl std::fmt::Debug for AdoptedConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdoptedConn")
            .field("id", &self.handle.id)
            .finish_non_exhaustive()
    }
}

impl AdoptedConn {
    /// Rebuilds a connection from its handed state and socket.
    pub(crate) fn build(
        shared: &Arc<ServerState>,
        record: crate::handed::ConnRecord,
        fd: std::os::fd::OwnedFd,
    ) -> io::Result<Self> {
        let stream = std::net::TcpStream::from(fd);
        // Refuses anything but a connected stream socket.
        stream.peer_addr()?;
        stream.set_nonblocking(true)?;
        let tcp = tokio::net::TcpStream::from_std(stream)?;
        // Sealed records the predecessor had not written yet: the writer flushes them first.
        let mut flush = false;
        let transport = match record.tls {
            Some((rx, tx)) => {
                flush = !tx.unsent().is_empty();
                let tls = derp_io::tls::TlsStream::resume(tcp, rx, tx).map_err(io::Error::other)?;
                Transport::Tls(Box::new(tls))
            }
            None => Transport::Tcp(tcp),
        };
        let framing = match record.ws {
            Some(_) => Framing::WebSocket,
            None => Framing::Raw,
        };
        // As at accept: derper samples raw TCP and TLS connections only.
        let tcp_socket = (framing == Framing::Raw)
            .then(|| crate::tcpinfo::tcp_socket(&transport))
            .flatten();
        let (read_half, write_half) = transport.split();
        let ws = match record.ws {
            Some(ws) => {
                let decoder = ws::WsDecoder::resume(ws.decoder).map_err(io::Error::other)?;
                Some((decoder, BytesMut::from(ws.raw.as_slice())))
            }
            None => None,
        };
        let reader =
            FrameReader::resumed(read_half, BytesMut::from(record.read_buf.as_slice()), ws);
        let id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let handle = ConnHandle::new(
            id,
            record.key,
            record.remote,
            record.presence_flags,
            record.can_mesh,
            shared.config.send_queue_depth,
        )
        .with_tcp_socket(tcp_socket);
        handle.swap_preferred(record.preferred);
        handle.rtt_mark.set(record.rtt_mark);
        handle.set_adopted();
        let now = Instant::now();
        let mut batch = Batch::default();
        for p in record.packets {
            let packet = crate::queue::Packet {
                src: p.src,
                data: p.data,
                enqueued: now
                    .checked_sub(Duration::from_micros(p.age_us))
                    .unwrap_or(now),
                forwarded: p.forwarded,
            };
            if p.disco {
                batch.disco.push_back(packet);
            } else {
                batch.other.push_back(packet);
            }
        }
        batch.control = record.control.into();
        batch.pong = record.pong;
        handle.queue.restore(batch);
        let handle = Arc::new(handle);
        let writer = Writer::adopt(
            shared.clone(),
            handle.clone(),
            write_half,
            framing,
            record.tail,
            record.sent_from.clone(),
            flush,
        );
        Ok(Self {
            handle,
            reader,
            writer,
            sources: record.sent_from,
            framing,
        })
    }

    pub(crate) fn handle(&self) -> &Arc<ConnHandle> {
        &self.handle
    }

    /// Watches, for PeerGone, every source the client received from before the handover.
    /// Watched as a mesh peer's sources are, whether or not they are known here yet: the
    /// mesh links that tell of remote keys are new too.
    pub(crate) fn watch_sources(&self, shared: &ServerState) {
        for src in &self.sources {
            shared.registry.watch_peer_gone(*src, true, &self.handle);
        }
    }

    /// Starts the writer, with what it had begun and what was queued, and returns what
    /// starts the read loop. Every writer of a handover starts before any read loop: a read
    /// loop that ran first would queue packets for connections whose writers are not in
    /// place to be taken along, and a burst would overflow their queues.
    pub(crate) fn start_writer(self) -> AdoptedReader {
        let Self {
            handle,
            reader,
            writer,
            framing,
            ..
        } = self;
        writer.start_adopted();
        let label = match framing {
            Framing::Raw => TransportLabel::Tcp,
            Framing::WebSocket => TransportLabel::WebSocket,
        };
        AdoptedReader {
            handle,
            reader,
            label,
        }
    }

    /// Lets go of the socket without a word to the peer: the predecessor serves it still.
    pub(crate) fn forget(self) {
        crate::queue::Resume::forget(self.writer);
    }
}

/// An adopted connection whose writer runs: its read loop, from where it stopped.
pub(crate) struct AdoptedReader {
    handle: Arc<ConnHandle>,
    reader: FrameReader,
    label: TransportLabel,
}

impl AdoptedReader {
    pub(crate) fn start(self, shared: &Arc<ServerState>) {
        let Self {
            handle,
            reader,
            label,
        } = self;
        let not_ideal = handle.presence_flags & PEER_PRESENT_NOT_IDEAL != 0;
        let registration = Registration::registered(shared.clone(), handle, not_ideal, label, true);
        let established = Established {
            reader,
            registration,
            _open: None,
        };
        shared.tasks.spawn(established.run());
    }
}

/// A registered connection. Dropping it (on every path: normal end, error, panic, or the
/// connection's future being dropped by an embedder) unregisters the connection, closes its
/// queues and counts what they still held.
struct Registration {
    shared: Arc<ServerState>,
    handle: Arc<ConnHandle>,
    not_ideal: bool,
    label: TransportLabel,
    /// Nobody awaits the connection's end: its task counts how it ended itself. Here, in
    /// what would otherwise be padding, rather than in a slot of its own in the task.
    detached: bool,
}

impl Registration {
    fn new(
        shared: Arc<ServerState>,
        handle: Arc<ConnHandle>,
        not_ideal: bool,
        label: TransportLabel,
        detached: bool,
    ) -> Self {
        shared.registry.register(&handle);
        Self::registered(shared, handle, not_ideal, label, detached)
    }

    /// For a connection the registry already holds (one taken over from a predecessor
    /// process).
    fn registered(
        shared: Arc<ServerState>,
        handle: Arc<ConnHandle>,
        not_ideal: bool,
        label: TransportLabel,
        detached: bool,
    ) -> Self {
        shared.watch_lifecycle();
        // Read after registering: a shutdown that began earlier ended every connection it
        // found registered, which may not have included this one.
        if shared.shutdown.is_cancelled() {
            handle.cancel.cancel();
        }
        shared.metrics.current_connections_by_transport[label as usize].inc();
        if not_ideal {
            shared.metrics.current_notideal_connections.inc();
        }
        Self {
            shared,
            handle,
            not_ideal,
            label,
            detached,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.handle.cancel.cancel();
        self.shared.registry.unregister(&self.handle);
        self.shared.registry.remove_watcher(self.handle.id);
        self.shared.metrics.current_connections_by_transport[self.label as usize].dec();
        if self.not_ideal {
            self.shared.metrics.current_notideal_connections.dec();
        }
        count_gone(&self.shared, self.handle.close());
    }
}

/// Runs the configured admission checks in order, the first refusal winning, all within the
/// handshake deadline.
async fn admit(shared: &ServerState, key: PublicKey, remote: SocketAddr) -> Verdict {
    let checks = &shared.config.admission;
    if checks.is_empty() {
        return Ok(());
    }
    let request = AdmissionRequest {
        key,
        source: remote.ip().to_canonical(),
    };
    let all = async {
        for check in checks {
            check.check(request).await?;
        }
        Ok(())
    };
    tokio::time::timeout(shared.config.handshake_timeout, all)
        .await
        .unwrap_or_else(|_| {
            Err(Refused::new(
                REFUSED_TIMEOUT,
                "admission checks took longer than the handshake deadline",
            ))
        })
}

/// Sends ServerKey (after the 101 head, if any, in the same write) and reads and opens the
/// client's ClientInfo, each step within its own deadline. Everything it buffered for that is
/// released when it returns, so an idle connection does not keep it.
async fn handshake(
    hs: &mut ServerHandshake,
    reader: &mut FrameReader,
    write_half: &mut WriteHalf,
    framing: Framing,
    preamble: &[u8],
    timeout: Duration,
) -> Result<(PublicKey, ClientInfo), ConnError> {
    let mut out = BytesMut::with_capacity(preamble.len() + 64);
    out.extend_from_slice(preamble);
    framing.frame(&mut out, |b| hs.server_key_frame(b));
    tokio::time::timeout(timeout, write_half.write_all(&out))
        .await
        .map_err(|_| LocalError::HandshakeTimeout)??;

    // The ClientInfo must arrive within its own deadline, counted from after ServerKey.
    let deadline = Instant::now() + timeout;
    let mut decoder = ServerDecoder::new();
    loop {
        match decoder.decode(&mut reader.buf)? {
            Some(ClientToRelay::ClientInfo { key, sealed }) => {
                let info = hs.handle_client_info(key, &sealed)?;
                return Ok((key, info));
            }
            // The decoder refuses anything but ClientInfo as the first frame.
            Some(other) => return Err(PeerMisbehaved::UnexpectedFrame(other.frame_type()).into()),
            None => {
                let n = tokio::time::timeout_at(deadline, reader.read_more(None, HANDSHAKE_READ))
                    .await
                    .map_err(|_| LocalError::HandshakeTimeout)??;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed during the handshake",
                    )
                    .into());
                }
            }
        }
    }
}

fn is_mesh_peer(shared: &ServerState, info: &ClientInfo) -> bool {
    match (&shared.config.mesh_key, &info.mesh_key) {
        (Some(ours), Some(theirs)) => !theirs.is_zero() && ours.ct_eq(theirs),
        _ => false,
    }
}

fn presence_flags(info: &ClientInfo, can_mesh: bool, not_ideal: bool) -> u8 {
    let mut flags = 0;
    if can_mesh {
        flags |= PEER_PRESENT_IS_MESH_PEER;
    }
    if info.is_prober {
        flags |= PEER_PRESENT_IS_PROBER;
    }
    if not_ideal {
        flags |= PEER_PRESENT_NOT_IDEAL;
    }
    if flags == 0 {
        flags = PEER_PRESENT_IS_REGULAR;
    }
    flags
}

/// Counts packets left in a closed connection's queues as dropped because it went away.
fn count_gone(shared: &ServerState, rest: Batch) {
    for (queue, kind) in [
        (&rest.disco, PacketKind::Disco),
        (&rest.other, PacketKind::Other),
    ] {
        for p in queue {
            shared
                .metrics
                .drop_one(DropReason::GoneDisconnected, kind, p.data.len());
        }
    }
}

/// How DERP frames travel on a connection's byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Bare, as after `Upgrade: DERP`.
    Raw,
    /// Each frame in its own WebSocket binary message (the client may split or merge them).
    WebSocket,
}

impl Framing {
    /// Appends one frame produced by `encode`, wrapped in a WebSocket header when needed.
    fn frame(self, out: &mut BytesMut, encode: impl FnOnce(&mut BytesMut)) {
        if self == Self::Raw {
            encode(out);
            return;
        }
        let mut frame = BytesMut::new();
        encode(&mut frame);
        let (hdr, n) = ws::binary_header(frame.len());
        out.extend_from_slice(&hdr[..n]);
        out.extend_from_slice(&frame);
    }
}

/// Reads during the handshake are small: a ClientInfo is a few hundred bytes, and a buffer
/// allocated now must not stay with an idle connection.
const HANDSHAKE_READ: usize = 1024;

/// A connected loopback TCP pair, for tests that need a real socket: (the server's end, the
/// client's end).
#[cfg(test)]
async fn loopback_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"));
    let (client, handover) = tokio::join!(client, listener.accept());
    (handover.expect("accept").0, client.expect("connect"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_registered_after_the_shutdown_began_is_cancelled() {
        let shared = ServerState::for_tests();
        let register = |handle: &Arc<ConnHandle>| {
            Registration::new(
                shared.clone(),
                handle.clone(),
                false,
                TransportLabel::Tcp,
                false,
            )
        };
        let before = ConnHandle::for_tests(1, 2);
        let _before = register(&before);
        shared.shutdown.cancel();
        // The lifecycle task ends what is registered; one registering later ends itself.
        let late = ConnHandle::for_tests(2, 3);
        let _late = register(&late);
        assert!(late.cancel.is_cancelled());
        before.cancel.cancelled().await;
    }

    /// Every idle connection is one task parked in the quiet wait, and tokio sizes a task's
    /// cell in steps of 128 bytes: a future of at most 400 bytes (with the task tracker's
    /// token and tokio's header, core and trailer) takes a 512-byte cell, eight bytes more
    /// (futures grow in steps of their 8-byte alignment) a 640-byte one. A field added to
    /// what the read loop keeps between reads must be paid for elsewhere (docs/bench-log/2026-12.md,
    /// "A 512-byte task for every idle connection").
    #[tokio::test]
    async fn an_idle_connections_task_fits_a_512_byte_cell() {
        let (server, client) = loopback_pair().await;
        let (read_half, _write_half) = Transport::Tcp(server).split();
        let shared = ServerState::for_tests();
        let handle = ConnHandle::for_tests(1, 2);
        let established = Established {
            reader: FrameReader::new(read_half, Framing::Raw, BytesMut::new()),
            registration: Registration::new(shared, handle, false, TransportLabel::Tcp, true),
            _open: None,
        };
        let task = established.run();
        let size = size_of_val(&task);
        assert!(
            size <= 400,
            "an established connection's future is {size} bytes; at most 400 fit a 512-byte task"
        );
        drop(task);
        drop(client);
    }
}
