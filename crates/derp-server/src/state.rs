//! The state every connection shares. Its own module, imported by the server, the HTTP front
//! and the connections, so that dependencies between those point one way.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use bytes::Bytes;

use derp_proto::{KeyPair, PublicKey};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ServerConfig;
use crate::listen::Gate;
use crate::metrics::{Metrics, ReaderCounts};
use crate::proxy::ProxyProtocol;
use crate::ratelimit::RateLimits;
use crate::registry::Registry;

/// State every connection shares.
#[derive(Debug)]
pub(crate) struct ServerState {
    pub(crate) config: ServerConfig,
    /// The server's keys, derived once rather than per handshake.
    pub(crate) keys: KeyPair,
    pub(crate) public_key: PublicKey,
    /// The 101 answer to `Upgrade: DERP`, which depends only on the server key: built once
    /// rather than formatted (with the key in hex) for every connection.
    pub(crate) derp_response_head: Bytes,
    pub(crate) registry: Registry,
    pub(crate) metrics: Metrics,
    pub(crate) next_conn_id: AtomicU64,
    pub(crate) shutdown: CancellationToken,
    /// Cancelled when a graceful shutdown begins: accept loops stop and read loops stop
    /// reading, while writers drain what is queued.
    pub(crate) draining: CancellationToken,
    /// Set by the lifecycle task once `draining` is cancelled, before it wakes every read
    /// loop: what a busy read loop checks on each wake-up. Reading the token itself takes its
    /// lock, one lock every connection on every thread shares, and waiting on it registers a
    /// waiter under that lock on every read.
    pub(crate) drain_begun: AtomicBool,
    /// Another process reads the QUIC listeners' UDP sockets too (it took them over): the
    /// endpoints answer nothing but their own connections' packets.
    pub(crate) udp_handed_over: AtomicBool,
    /// A handover of connections to a successor process, while one is in progress.
    pub(crate) handover: crate::handed::HandoverState,
    /// The registry the metrics live on, gathered for `/debug/varz` and `/metrics`.
    pub(crate) prometheus: prometheus::Registry,
    /// Every connection task, so shutdown can wait for them.
    pub(crate) tasks: TaskTracker,
    /// Whether clients can be served, as the embedder reports it (see `Server::set_ready`).
    pub(crate) ready: AtomicBool,
    /// What the listeners let in.
    pub(crate) gate: Gate,
    /// The per-client receive limit in force.
    pub(crate) rate_limits: RateLimits,
    /// The PROXY protocol on the TCP listeners, when configured.
    pub(crate) proxy: Option<ProxyProtocol>,
    /// `derp_admission_refused{reason}`.
    pub(crate) admission_refused: prometheus::IntCounterVec,
    /// `derp_tcp_rtt{le}`: derper's per-connection RTT samples (see `tcpinfo::RttSampler`).
    pub(crate) tcp_rtt: prometheus::IntCounterVec,
    /// Reads the kernel's statistics of the relay's TCP sockets, for `derp_tcp_rtt` and
    /// `/debug/traffic`.
    pub(crate) sock_diag: crate::tcpinfo::SockDiag,
    /// When the relay was created, for `/debug/`'s uptime.
    pub(crate) started: std::time::Instant,
    /// The task that ends connections on shutdown was started.
    watching: AtomicBool,
    /// Cancelled when this state is dropped, so that task also ends for a server dropped
    /// without a shutdown.
    dropped: CancellationToken,
}

impl Drop for ServerState {
    fn drop(&mut self) {
        self.dropped.cancel();
    }
}

impl ServerState {
    /// State for a new relay, with its metrics registered on `prometheus`.
    pub(crate) fn new(
        config: ServerConfig,
        prometheus: &prometheus::Registry,
    ) -> Result<Self, prometheus::Error> {
        let metrics = Metrics::new(prometheus)?;
        let keys = KeyPair::new(config.secret_key.clone());
        let public_key = keys.public();
        let admission_refused = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "derp_admission_refused",
                "clients refused by an admission check after their handshake, by reason",
            ),
            &["reason"],
        )?;
        prometheus.register(Box::new(admission_refused.clone()))?;
        let proxy = match &config.proxy_protocol {
            Some(from) => Some(ProxyProtocol::new(from.clone(), prometheus)?),
            None => None,
        };
        // Not a Prometheus histogram: derper counts each sample under one `le` label only
        // (no cumulative buckets, no sum), as a counter family; its labels are kept.
        let tcp_rtt = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "derp_tcp_rtt",
                "samples of client TCP connections' smoothed RTT, every 10 s per connection, \
                 by upper bound (non-tcp: not sampled; error: no kernel statistics)",
            ),
            &["le"],
        )?;
        prometheus.register(Box::new(tcp_rtt.clone()))?;
        Ok(Self {
            proxy,
            gate: Gate::new(&config.limits, prometheus)?,
            rate_limits: RateLimits::new(config.rate_limit, prometheus)?,
            admission_refused,
            tcp_rtt,
            sock_diag: crate::tcpinfo::SockDiag::default(),
            started: std::time::Instant::now(),
            registry: Registry::new(metrics.clone(), public_key),
            keys,
            derp_response_head: Bytes::from(derp_proto::upgrade::derp_response_head(&public_key)),
            public_key,
            metrics,
            config,
            next_conn_id: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
            draining: CancellationToken::new(),
            drain_begun: AtomicBool::new(false),
            udp_handed_over: AtomicBool::new(false),
            handover: crate::handed::HandoverState::default(),
            prometheus: prometheus.clone(),
            tasks: TaskTracker::new(),
            ready: AtomicBool::new(false),
            watching: AtomicBool::new(false),
            dropped: CancellationToken::new(),
        })
    }

    /// Starts, once, the task that carries the server's lifecycle to every registered
    /// connection: when a graceful shutdown begins it sets `drain_begun` and wakes each read
    /// loop to stop reading, and on shutdown it cancels each connection. Connections hold no waiter on the
    /// server's tokens themselves (see [`crate::handle::Cancel`]), so this one task is what
    /// ends them, whoever cancels the tokens. Started by the first registration, which runs
    /// on the runtime, rather than when the state is created, which may not: an embedder
    /// that runs connections on several runtimes must keep that one running until the
    /// server has shut down.
    pub(crate) fn watch_lifecycle(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::Relaxed) {
            return;
        }
        let state = Arc::downgrade(self);
        let tokens = [&self.draining, &self.shutdown, &self.dropped].map(|t| t.clone());
        let sampling = self
            .config
            .tcp_rtt_interval
            .map(|every| sample_tcp_rtt(state.clone(), self.tcp_rtt.clone(), every));
        self.tasks.spawn(async move {
            let [draining, shutdown, dropped] = tokens;
            let sampling = async {
                match sampling {
                    Some(s) => s.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = dropped.cancelled() => {}
                _ = carry_lifecycle(state, draining, shutdown) => {}
                () = sampling => {}
            }
        });
    }

    /// Folds a connection's local counts into the registry (or discards them when packet
    /// metrics are off).
    pub(crate) fn fold(&self, counts: &mut ReaderCounts) {
        if self.config.packet_metrics {
            self.metrics.fold(counts);
        } else {
            *counts = ReaderCounts::default();
        }
    }
}

#[cfg(test)]
impl ServerState {
    /// A relay's state with the default configuration, for tests.
    pub(crate) fn for_tests() -> Arc<Self> {
        let config = ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        Arc::new(Self::new(config, &prometheus::Registry::new()).expect("state"))
    }
}

/// Samples the kernel's RTT of every registered connection into `derp_tcp_rtt` every
/// `every`, while the relay lives (it is held weakly). Nothing per packet: one registry pass
/// and one netlink dump of the sockets on the relay's ports (those its registered connections
/// were accepted on, so a listener added later is covered), off the runtime's workers, per
/// period.
async fn sample_tcp_rtt(
    state: Weak<ServerState>,
    metric: prometheus::IntCounterVec,
    every: std::time::Duration,
) {
    let sampler = crate::tcpinfo::RttSampler::new(metric);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (due, diag) = match state.upgrade() {
            Some(state) => (sampler.due(&state.registry), state.sock_diag.clone()),
            None => return,
        };
        if due.is_empty() {
            continue;
        }
        // Shared with the dump's thread so that the list, and with it every connection
        // first seen this period, is counted even when that thread fails.
        let due = Arc::new(due);
        let reading = due.clone();
        let read = tokio::task::spawn_blocking(move || diag.read_rtts(&reading))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if let Err(e) = &read {
            tracing::debug!(error = %e, "reading TCP statistics");
        }
        sampler.count(&due, read.as_ref().copied());
    }
}

/// The task of [`ServerState::watch_lifecycle`]. It holds the state weakly, so a server that
/// is dropped without a shutdown is not kept alive by it (and the task then ends).
async fn carry_lifecycle(
    state: Weak<ServerState>,
    draining: CancellationToken,
    shutdown: CancellationToken,
) {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => {}
        _ = draining.cancelled() => {
            if let Some(state) = state.upgrade() {
                // Before the wake-ups: a read loop woken reads the flag.
                state.drain_begun.store(true, Ordering::Release);
                state.registry.wake_quiet_all();
            }
            shutdown.cancelled().await;
        }
    }
    if let Some(state) = state.upgrade() {
        state.registry.cancel_all();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn the_lifecycle_task_ends_with_a_server_dropped_without_a_shutdown() {
        let state = ServerState::for_tests();
        state.watch_lifecycle();
        let (tasks, shutdown) = (state.tasks.clone(), state.shutdown.clone());
        drop(state);
        tasks.close();
        // A guard against a hang, not a timing: the task ends as soon as it is polled.
        tokio::time::timeout(Duration::from_secs(60), tasks.wait())
            .await
            .expect("the lifecycle task ended");
        assert!(!shutdown.is_cancelled(), "dropping is not a shutdown");
    }
}
