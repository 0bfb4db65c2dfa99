//! One sibling: its forward queue (the [`PacketForwarder`] the relay hands packets to) and
//! the task that keeps a connection to it, watches its clients and writes the queue out.
//!
//! The connection is an ordinary DERP client connection carrying the mesh key, made with
//! this node's own key, as derper's mesh client does: WatchConns, then PeerPresent adds a
//! forwarder for the key and PeerGone removes it. When the connection breaks, every key it
//! added is removed (derper's synthetic 0xF0 "mesh connection broke" step), so nothing stale
//! survives a sibling's restart: the new connection's presence flood rebuilds the set.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use derp_client::{
    Client, ClientConfig, ClientError, ClientReader, ClientWriter, ConnectError, PendingPing,
};
use derp_proto::{ClientToRelay, PublicKey};
use derp_server::{PacketForwarder, Server};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::MeshConfig;
use crate::backoff::Backoff;
use crate::metrics::{ForwardDrop, LinkGauges, LinkMetrics, LinkState};
use crate::sibling::Sibling;

/// A packet waiting to go to the sibling.
#[derive(Debug)]
pub(crate) struct Forward {
    src: PublicKey,
    dst: PublicKey,
    packet: Bytes,
}

/// One sibling's bounded forward queue. Pushed to by clients' read loops, drained by the
/// link's writer in batches.
#[derive(Debug)]
pub(crate) struct LinkQueue {
    label: String,
    state: Mutex<QueueState>,
    notify: Notify,
    /// The link became settled (see [`LinkQueue::is_settled`]).
    pub(crate) sync_changed: Notify,
    max_packets: usize,
    max_bytes: usize,
    metrics: LinkMetrics,
}

#[derive(Debug, Default)]
struct QueueState {
    /// A connection to the sibling is established and watching.
    up: bool,
    /// Up, and the sibling's clients as of the subscription are in the forwarder table.
    synced: bool,
    /// The entry turned out to name this node itself; the link stopped for good.
    is_self: bool,
    packets: VecDeque<Forward>,
    bytes: usize,
    /// The writer was notified and has not taken the queue yet: a burst costs one wake-up.
    woken: bool,
}

impl PacketForwarder for LinkQueue {
    /// Runs on a client's read loop: a short critical section that appends or drops, never
    /// a wait. Appending reuses the queue's capacity, so the steady state allocates nothing.
    fn forward_packet(&self, src: PublicKey, dst: PublicKey, packet: Bytes) {
        let mut state = self.lock();
        if !state.up {
            drop(state);
            self.metrics.drops[ForwardDrop::LinkDown as usize].inc();
            return;
        }
        if state.packets.len() >= self.max_packets || state.bytes + packet.len() > self.max_bytes {
            drop(state);
            self.metrics.drops[ForwardDrop::QueueFull as usize].inc();
            return;
        }
        state.bytes += packet.len();
        state.packets.push_back(Forward { src, dst, packet });
        let wake = !state.woken;
        state.woken = true;
        drop(state);
        if wake {
            self.notify.notify_one();
        }
    }
}

impl LinkGauges for LinkQueue {
    fn label(&self) -> &str {
        &self.label
    }

    /// Whether the link is up, whether it names this node itself, and how many packets
    /// wait.
    fn snapshot(&self) -> LinkState {
        let state = self.lock();
        LinkState {
            up: state.up,
            is_self: state.is_self,
            depth: state.packets.len(),
        }
    }
}

impl LinkQueue {
    pub(crate) fn new(label: String, config: &MeshConfig, metrics: LinkMetrics) -> Self {
        Self {
            label,
            state: Mutex::new(QueueState::default()),
            notify: Notify::new(),
            sync_changed: Notify::new(),
            max_packets: config.queue_packets.max(1),
            max_bytes: config.queue_bytes.max(derp_proto::frame::MAX_PACKET_SIZE),
            metrics,
        }
    }

    fn set_self(&self) {
        self.lock().is_self = true;
        self.sync_changed.notify_waiters();
    }

    fn set_up(&self) {
        self.lock().up = true;
    }

    fn set_synced(&self) {
        let mut state = self.lock();
        // A connection that ended meanwhile left the table without its keys.
        if state.up {
            state.synced = true;
        }
        drop(state);
        self.sync_changed.notify_waiters();
    }

    /// Whether the link is up with its sibling's clients in the table, or names this node
    /// itself (nothing to wait for).
    pub(crate) fn is_settled(&self) -> bool {
        let state = self.lock();
        state.synced || state.is_self
    }

    /// Marks the link down and drops what was queued for the connection that ended.
    fn set_down(&self) {
        let mut state = self.lock();
        state.up = false;
        state.synced = false;
        let dropped = state.packets.len();
        state.packets.clear();
        state.bytes = 0;
        state.woken = false;
        drop(state);
        if dropped > 0 {
            self.metrics.drops[ForwardDrop::LinkDown as usize].inc_by(dropped as u64);
        }
    }

    /// Swaps everything queued into `batch` (empty on entry).
    fn take(&self, batch: &mut VecDeque<Forward>) {
        let mut state = self.lock();
        std::mem::swap(&mut state.packets, batch);
        state.bytes = 0;
        state.woken = false;
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // Critical sections only push, swap or clear, so a poisoned lock holds valid data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Why a link's connection ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    #[error("connecting: {0}")]
    Connect(#[from] ConnectError),
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("a write to the sibling took longer than {0:?}")]
    WriteTimeout(Duration),
    #[error("the sibling did not answer a ping within {0:?}")]
    PingTimeout(Duration),
}

/// Everything one link's task needs.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) sibling: Sibling,
    pub(crate) queue: Arc<LinkQueue>,
    /// The same allocation as `queue`, as the relay's registry holds it; removals compare
    /// by pointer, so the link always passes this one.
    pub(crate) forwarder: Arc<dyn PacketForwarder>,
}

/// Keeps the link connected until `cancel`: connect, watch and forward, and on any failure
/// clean up and reconnect after a back-off. Ends for good when the sibling turns out to be
/// this node itself.
pub(crate) async fn run(
    link: Link,
    server: Server,
    config: Arc<MeshConfig>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(config.backoff);
    let mut first = true;
    let mut failing = false;
    loop {
        if !first {
            link.queue.metrics.reconnects.inc();
        }
        first = false;
        let connected = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            c = connect(&link.sibling, &config) => c,
        };
        match connected {
            Ok(client) if client.server_key() == server.public_key() => {
                info!(sibling = %link.sibling, "mesh entry is this node itself; not meshing with it");
                link.queue.set_self();
                let _ = client.close().await;
                return;
            }
            Ok(client) => {
                info!(sibling = %link.sibling, key = %client.server_key(), "mesh link up");
                failing = false;
                let since = Instant::now();
                let result = serve(&link, client, &server, &config, &cancel).await;
                if cancel.is_cancelled() {
                    return;
                }
                match result {
                    Ok(()) => warn!(sibling = %link.sibling, "mesh link closed; reconnecting"),
                    Err(e) => {
                        warn!(sibling = %link.sibling, error = %e, "mesh link lost; reconnecting")
                    }
                }
                if since.elapsed() >= config.backoff.reset_after {
                    backoff.reset();
                }
            }
            Err(e) => {
                // One warning per outage; the retries of a sibling that stays down are
                // visible in derp_mesh_reconnects.
                if failing {
                    debug!(sibling = %link.sibling, error = %e, "mesh connect failed");
                } else {
                    warn!(sibling = %link.sibling, error = %e, "mesh connect failed; retrying");
                    failing = true;
                }
            }
        }
        let wait = backoff.next(&mut rand::thread_rng());
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

async fn connect(sibling: &Sibling, config: &MeshConfig) -> Result<Client, LinkError> {
    let mut client = ClientConfig::with_url(sibling.url.clone(), config.secret_key.clone())
        .with_mesh_key(config.mesh_key)
        .with_can_ack_pings(false)
        .with_connect_timeout(config.connect_timeout)
        .with_read_timeout(config.read_timeout)
        .with_proxy_header(config.proxy_header);
    if let Some(tls) = &config.tls {
        client = client.with_tls_config(tls.clone());
    }
    if let Some(dial) = &sibling.dial {
        let addr = dial.resolve().await.map_err(ConnectError::Io)?;
        client = client.with_dial_addr(addr);
    }
    Ok(Client::connect(&client).await?)
}

/// Runs one connection: subscribe, then apply presence changes and write forwarded packets
/// until either side fails or the mesh stops. Whatever the outcome, the link is marked down
/// and every key this connection added is removed before returning.
async fn serve(
    link: &Link,
    client: Client,
    server: &Server,
    config: &MeshConfig,
    cancel: &CancellationToken,
) -> Result<(), LinkError> {
    let (mut reader, mut writer) = client.split();
    let mut present = HashSet::new();
    let result = async {
        timed_write(config.write_timeout, writer.watch_conns()).await?;
        link.queue.set_up();
        // The sibling answers WatchConns with a PeerPresent for each of its clients, then
        // this ping's pong: once it arrives, the table holds what the sibling held.
        let mut sync = timed_write_ping(config.write_timeout, &mut writer).await?;
        let synced = async {
            if let Err(e) = sync.wait_within(config.connect_timeout).await {
                debug!(sibling = %link.sibling, error = %e, "no pong to the mesh link's first ping");
            }
            link.queue.set_synced();
            std::future::pending().await
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => Ok(()),
            r = watch(&mut reader, &mut present, link, server) => r,
            r = synced => r,
            r = write_out(&mut writer, link, config) => r,
        }
    }
    .await;
    // Down first: a packet that still finds a cached route to this link is then counted as
    // link_down, and removing the keys retires those routes.
    link.queue.set_down();
    for key in present.drain() {
        server.remove_packet_forwarder(&key, &link.forwarder);
    }
    if cancel.is_cancelled() {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, writer.close()).await;
    }
    result
}

/// Applies the sibling's presence updates to the relay's forwarder table.
async fn watch(
    reader: &mut ClientReader,
    present: &mut HashSet<PublicKey>,
    link: &Link,
    server: &Server,
) -> Result<(), LinkError> {
    loop {
        match reader.recv().await? {
            derp_client::ReceivedFrame::PeerPresent { peer, .. } => {
                // Presence repeats for duplicate connections of a key; adding the same
                // forwarder again would change nothing.
                let new = present.insert(peer);
                if new {
                    server.add_packet_forwarder(peer, link.forwarder.clone());
                }
            }
            derp_client::ReceivedFrame::PeerGone { peer, .. } => {
                let known = present.remove(&peer);
                if known {
                    server.remove_packet_forwarder(&peer, &link.forwarder);
                }
            }
            derp_client::ReceivedFrame::Restarting {
                reconnect_in,
                try_for,
            } => {
                info!(sibling = %link.sibling, ?reconnect_in, ?try_for, "mesh sibling is restarting");
            }
            // Packets addressed to this node's own key, keepalives and the rest carry
            // nothing for the mesh.
            _ => {}
        }
    }
}

/// Writes the queue out: everything queued since the last batch as ForwardPacket frames,
/// flushed once. Between batches it pings the sibling now and then, so a sibling that went
/// silent without closing the connection is noticed.
async fn write_out(
    writer: &mut ClientWriter,
    link: &Link,
    config: &MeshConfig,
) -> Result<(), LinkError> {
    let mut batch = VecDeque::new();
    let mut next_ping = config.ping_interval.map(|i| Instant::now() + i);
    let mut pending: Option<PendingPing> = None;
    loop {
        tokio::select! {
            biased;
            _ = link.queue.notify.notified() => {}
            answer = wait_pong(&mut pending, config.ping_interval) => {
                pending = None;
                match answer {
                    Ok(_) => next_ping = config.ping_interval.map(|i| Instant::now() + i),
                    Err(ClientError::PingTimeout) => {
                        let waited = config.ping_interval.unwrap_or_default();
                        return Err(LinkError::PingTimeout(waited));
                    }
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            _ = sleep_until(next_ping), if pending.is_none() => {
                next_ping = None;
                let ping = tokio::time::timeout(config.write_timeout, writer.start_ping()).await;
                pending = Some(ping.map_err(|_| LinkError::WriteTimeout(config.write_timeout))??);
                continue;
            }
        }
        link.queue.take(&mut batch);
        if batch.is_empty() {
            continue;
        }
        let metrics = &link.queue.metrics;
        // Until a flush confirms them, the batch's packets count as write errors, also if
        // this future is dropped mid-flush (the other side of the link ended, or shutdown).
        let mut unflushed = Unflushed {
            left: batch.len() as u64,
            drops: &metrics.drops[ForwardDrop::WriteError as usize],
        };
        // Flushed a chunk at a time, each under the write deadline: a sibling that reads
        // slowly but steadily is not cut off because a burst queued megabytes at once.
        let (mut in_chunk, mut chunk_bytes) = (0u64, 0usize);
        let mut frames = batch.drain(..).peekable();
        while let Some(f) = frames.next() {
            chunk_bytes += FORWARD_FRAME_OVERHEAD + f.packet.len();
            writer.queue_frame(&ClientToRelay::ForwardPacket {
                src: f.src,
                dst: f.dst,
                packet: f.packet,
            })?;
            in_chunk += 1;
            if chunk_bytes >= FLUSH_CHUNK || frames.peek().is_none() {
                timed_write(config.write_timeout, writer.flush()).await?;
                metrics.forwarded.inc_by(in_chunk);
                unflushed.left -= in_chunk;
                (in_chunk, chunk_bytes) = (0, 0);
            }
        }
        drop(frames);
        if batch.capacity() > MAX_IDLE_BATCH {
            batch = VecDeque::new();
        }
    }
}

/// The answer to the outstanding ping, if there is one; never resolves otherwise.
async fn wait_pong(
    pending: &mut Option<PendingPing>,
    within: Option<Duration>,
) -> Result<Duration, ClientError> {
    match (pending.as_mut(), within) {
        (Some(ping), Some(within)) => ping.wait_within(within).await,
        _ => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends a ping under the write deadline.
async fn timed_write_ping(
    limit: Duration,
    writer: &mut ClientWriter,
) -> Result<PendingPing, LinkError> {
    match tokio::time::timeout(limit, writer.start_ping()).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(LinkError::WriteTimeout(limit)),
    }
}

async fn timed_write(
    limit: Duration,
    write: impl Future<Output = Result<(), ClientError>>,
) -> Result<(), LinkError> {
    match tokio::time::timeout(limit, write).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(LinkError::WriteTimeout(limit)),
    }
}

/// What a flush writes at most (one more frame may take it past): about one maximal packet,
/// the unit derper's write deadline bounds.
const FLUSH_CHUNK: usize = 64 * 1024;
/// A ForwardPacket frame's bytes besides its packet: header and both keys.
const FORWARD_FRAME_OVERHEAD: usize = 5 + 32 + 32;

/// Packets of a batch not yet confirmed written; dropped, counts them as write errors.
struct Unflushed<'a> {
    left: u64,
    drops: &'a prometheus::IntCounter,
}

impl Drop for Unflushed<'_> {
    fn drop(&mut self) {
        if self.left > 0 {
            self.drops.inc_by(self.left);
        }
    }
}

/// How long closing a link on shutdown may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// A batch buffer grown past this many packets by a burst is released afterwards.
const MAX_IDLE_BATCH: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::MeshMetrics;

    fn queue(packets: usize) -> (LinkQueue, LinkMetrics) {
        let registry = prometheus::Registry::new();
        let metrics = MeshMetrics::new(&registry).expect("metrics").link("b");
        let mut config = MeshConfig::new(
            derp_proto::SecretKey::from_bytes([1; 32]),
            derp_proto::MeshKey::from_bytes([2; 32]),
        );
        config.queue_packets = packets;
        (
            LinkQueue::new("b".into(), &config, metrics.clone()),
            metrics,
        )
    }

    fn key(b: u8) -> PublicKey {
        PublicKey::from_bytes([b; 32])
    }

    #[test]
    fn packets_queue_while_up_and_drop_by_reason_otherwise() {
        let (q, m) = queue(2);
        let drops = |r: ForwardDrop| m.drops[r as usize].get();
        q.forward_packet(key(1), key(2), Bytes::from_static(b"early"));
        assert_eq!(
            drops(ForwardDrop::LinkDown),
            1,
            "down until the link watches"
        );
        q.set_up();
        for _ in 0..3 {
            q.forward_packet(key(1), key(2), Bytes::from_static(b"x"));
        }
        assert_eq!(drops(ForwardDrop::QueueFull), 1);
        assert_eq!((q.snapshot().up, q.snapshot().depth), (true, 2));
        let mut batch = VecDeque::new();
        q.take(&mut batch);
        assert_eq!(batch.len(), 2);
        assert_eq!((q.snapshot().up, q.snapshot().depth), (true, 0));
        q.forward_packet(key(1), key(2), Bytes::from_static(b"y"));
        q.set_down();
        assert_eq!(
            drops(ForwardDrop::LinkDown),
            2,
            "what was queued is dropped"
        );
        assert_eq!((q.snapshot().up, q.snapshot().depth), (false, 0));
    }

    #[test]
    fn the_byte_bound_holds_too() {
        let (q, m) = queue(1000);
        q.set_up();
        let big = Bytes::from(vec![0u8; derp_proto::frame::MAX_PACKET_SIZE]);
        let fit = DEFAULT_QUEUE_BYTES_FOR_TEST / big.len();
        for _ in 0..fit + 1 {
            q.forward_packet(key(1), key(2), big.clone());
        }
        assert_eq!(q.snapshot().depth, fit);
        assert_eq!(m.drops[ForwardDrop::QueueFull as usize].get(), 1);
    }

    const DEFAULT_QUEUE_BYTES_FOR_TEST: usize = crate::DEFAULT_QUEUE_BYTES;
}
