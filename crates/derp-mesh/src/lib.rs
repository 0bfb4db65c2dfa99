//! Meshing the nodes of a DERP region, as derper's `--mesh-with` does.
//!
//! What it does:
//! - keeps one link per sibling node ([`Mesh::start`]): a DERP client connection made with
//!   the node's own key and the mesh key, which sends WatchConns and turns the sibling's
//!   PeerPresent and PeerGone frames into the relay's forwarder table
//!   ([`derp_server::Server::add_packet_forwarder`]); on any failure every key the link added
//!   is removed and the link reconnects with capped exponential back-off and full jitter;
//! - forwards packets for keys a sibling holds: the relay hands them to the link's bounded
//!   queue on the sending client's read loop (never waiting), and the link's writer sends
//!   them as ForwardPacket frames in batches, one flush per batch; drops are counted by
//!   reason (`queue_full`, `link_down`, `write_error`);
//! - notices a sibling that died without closing its connections: the link pings after
//!   [`MeshConfig::ping_interval`] without one and reconnects when the pong is as late, with
//!   a read timeout behind that;
//! - tells when every link is settled ([`Mesh::wait_settled`]): up, with the clients its
//!   sibling announced before answering a ping sent after WatchConns in the table;
//! - detects a link to the node itself by the answering server key and stops it;
//! - parses `--mesh-with` entries ([`parse_mesh_with`]) and builds the trust store for
//!   `https` links ([`mesh_tls_config`]: the system's roots honouring `SSL_CERT_FILE` and
//!   `SSL_CERT_DIR`, plus a private CA);
//! - registers `derp_mesh_*` metrics on the relay's registry.
//!
//! What it does not do: receive mesh frames (the relay does that for any mesh-key client),
//! forward more than one hop (the relay delivers forwarded packets locally or drops them),
//! use anything but the frames of the DERP protocol: a sibling may be derpd or Tailscale's
//! derper, and nothing here can tell them apart.

mod backoff;
mod link;
mod metrics;
mod sibling;
mod trust;

use std::sync::Arc;
use std::time::Duration;

use derp_proto::{MeshKey, SecretKey};
use derp_server::{PacketForwarder, Server};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use backoff::BackoffConfig;
pub use metrics::ForwardDrop;
/// The rustls version the mesh's TLS configuration is built with.
pub use rustls;
pub use sibling::{DialHost, DialHostError, Sibling, SiblingError, parse_mesh_with};
pub use trust::{TrustError, TrustSummary, mesh_tls_config};

use link::{Link, LinkQueue};
use metrics::{LinkGauges, LinkStateCollector, MeshMetrics};

/// How a node meshes.
#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// The node's own key: its identity on the siblings (a sibling sees the link as a client
    /// with this key), and how a link to the node itself is recognised.
    pub secret_key: SecretKey,
    /// The region's pre-shared mesh key.
    pub mesh_key: MeshKey,
    /// Trust for `https` links; `None` uses derp-client's default (Mozilla's roots).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Most packets waiting for one sibling; more are dropped as `queue_full`.
    pub queue_packets: usize,
    /// Most packet bytes waiting for one sibling.
    pub queue_bytes: usize,
    /// Deadline for each write to a sibling; a link that misses it is reconnected (derper
    /// gives a forwarded write 5 s).
    pub write_timeout: Duration,
    /// A link that receives nothing for this long is reconnected (siblings send a keepalive
    /// at least every 65 s).
    pub read_timeout: Duration,
    /// A link pings its sibling after this long without a ping, and is reconnected when the
    /// pong takes longer than this too. A sibling whose host died or was cut off without
    /// closing its connections is then noticed within twice this, instead of after the
    /// read timeout; what it held stops being routed there. `None` turns pings off.
    pub ping_interval: Option<Duration>,
    /// Budget for dialing, TLS, the upgrade and the handshake.
    pub connect_timeout: Duration,
    /// Reconnect delays.
    pub backoff: BackoffConfig,
    /// Open each link with a PROXY protocol header naming its own ends, for siblings that
    /// take connections only from PROXY protocol senders (`--proxy-protocol`; a region's
    /// nodes share the setting, and list each other in `--proxy-protocol-from`).
    pub proxy_header: bool,
}

impl MeshConfig {
    /// Defaults for everything but the keys.
    pub fn new(secret_key: SecretKey, mesh_key: MeshKey) -> Self {
        Self {
            secret_key,
            mesh_key,
            tls: None,
            queue_packets: DEFAULT_QUEUE_PACKETS,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            write_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(120),
            ping_interval: Some(DEFAULT_PING_INTERVAL),
            connect_timeout: Duration::from_secs(10),
            backoff: BackoffConfig::default(),
            proxy_header: false,
        }
    }
}

/// Default interval (and pong deadline) of a link's liveness pings.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(5);
/// Default bound of each sibling's queue, in packets.
pub const DEFAULT_QUEUE_PACKETS: usize = 4096;
/// Default bound of each sibling's queue, in packet bytes.
pub const DEFAULT_QUEUE_BYTES: usize = 8 << 20;

/// Why the mesh could not start.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// Registering the mesh metrics failed (for example, a second mesh on one registry).
    #[error("registering mesh metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// The running links of a node. Dropping it does not stop them; call [`Mesh::shutdown`].
#[derive(Debug)]
pub struct Mesh {
    cancel: CancellationToken,
    tasks: TaskTracker,
    siblings: Vec<Sibling>,
    queues: Vec<Arc<LinkQueue>>,
}

impl Mesh {
    /// Starts one link per sibling on the current tokio runtime and registers the mesh
    /// metrics on `registry` (the relay's).
    pub fn start(
        server: &Server,
        config: MeshConfig,
        siblings: Vec<Sibling>,
        registry: &prometheus::Registry,
    ) -> Result<Self, MeshError> {
        let metrics = MeshMetrics::new(registry)?;
        let config = Arc::new(config);
        let links: Vec<Link> = siblings
            .iter()
            .map(|s| {
                let queue = Arc::new(LinkQueue::new(
                    s.label.clone(),
                    &config,
                    metrics.link(&s.label),
                ));
                let forwarder: Arc<dyn PacketForwarder> = queue.clone();
                Link {
                    sibling: s.clone(),
                    queue,
                    forwarder,
                }
            })
            .collect();
        let gauges = links
            .iter()
            .map(|l| l.queue.clone() as Arc<dyn LinkGauges>)
            .collect();
        let collector = LinkStateCollector::new(gauges)?;
        registry.register(Box::new(collector))?;
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let queues = links.iter().map(|l| l.queue.clone()).collect();
        for link in links {
            tasks.spawn(link::run(
                link,
                server.clone(),
                config.clone(),
                cancel.clone(),
            ));
        }
        tasks.close();
        Ok(Self {
            cancel,
            tasks,
            siblings,
            queues,
        })
    }

    /// Waits up to `within` until every link is up with its sibling's clients in the
    /// forwarder table (a link to the node itself counts as done). Returns the siblings
    /// still not there, empty when all are.
    ///
    /// The sibling's clients are those it announced before answering a ping sent right
    /// after WatchConns. derpd writes a watcher's presence flood before that pong; Tailscale's
    /// derper may interleave the two, so against it the table can still be filling for a
    /// moment after this returns.
    pub async fn wait_settled(&self, within: Duration) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + within;
        for queue in &self.queues {
            loop {
                let changed = queue.sync_changed.notified();
                tokio::pin!(changed);
                // Registered before the check, so a change right after it is not missed.
                changed.as_mut().enable();
                if queue.is_settled() || tokio::time::timeout_at(deadline, changed).await.is_err() {
                    break;
                }
            }
        }
        self.queues
            .iter()
            .filter(|q| !q.is_settled())
            .map(|q| q.label().to_owned())
            .collect()
    }

    /// The siblings this node meshes with.
    pub fn siblings(&self) -> &[Sibling] {
        &self.siblings
    }

    /// Closes every link (removing what they added to the forwarder table) and waits for
    /// their tasks.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.wait().await;
    }
}
