//! The server object: shared state, the accept loop and shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use derp_io::Transport;
use derp_proto::PublicKey;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::accept::Listener;
use crate::config::ServerConfig;
use crate::conn::{self, Handover};
use crate::listen::{ConnGuard, SocketOptions};
use crate::metrics::Metrics;
use crate::proxy::{ProxiedListener, ProxyProtocol};
use crate::quic::QuicListener;
use crate::ratelimit::RateLimit;
use crate::registry::PacketForwarder;
use crate::state::ServerState;

/// A DERP relay. Cheap to clone; clones share one relay.
#[derive(Clone, Debug)]
pub struct Server {
    shared: Arc<ServerState>,
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Registering metrics failed (for example, a name registered twice on one registry).
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// A listener failed in a way that is not about one connection.
    #[error("listener: {0}")]
    Io(#[from] io::Error),
}

impl Server {
    /// Creates a relay and registers its metrics on `registry`.
    pub fn new(config: ServerConfig, registry: &prometheus::Registry) -> Result<Self, ServeError> {
        Ok(Self {
            shared: Arc::new(ServerState::new(config, registry)?),
        })
    }

    /// The server's public key, as clients see it in the ServerKey frame.
    pub fn public_key(&self) -> PublicKey {
        self.shared.public_key
    }

    /// The TCP options client connections are given ([`ServerConfig::tcp`]).
    pub fn tcp_options(&self) -> &crate::TcpOptions {
        &self.shared.config.tcp
    }

    /// The relay's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Registers a forwarder for `key`, which is connected to a sibling node of the region.
    /// Local connections of the key always win over forwarders.
    pub fn add_packet_forwarder(&self, key: PublicKey, forwarder: Arc<dyn PacketForwarder>) {
        self.shared.registry.add_forwarder(key, forwarder);
    }

    /// Removes a forwarder added with [`Server::add_packet_forwarder`].
    pub fn remove_packet_forwarder(&self, key: &PublicKey, forwarder: &Arc<dyn PacketForwarder>) {
        self.shared.registry.remove_forwarder(key, forwarder);
    }

    /// Reports whether a client could be served right now: the embedder sets it once its
    /// listener accepts and, with TLS, a certificate is in service. It is what `/derp/probe`
    /// on the metrics listener answers (200, or 503 while not ready), so an orchestrator's
    /// readiness check sees what a client would. A draining server is never ready.
    pub fn set_ready(&self, ready: bool) {
        self.shared.ready.store(ready, Ordering::Relaxed);
    }

    /// Number of distinct keys connected right now.
    pub fn local_clients(&self) -> usize {
        self.shared.registry.local_keys()
    }

    /// Accepts HTTP connections on `listener` until [`Server::shutdown`] is called.
    ///
    /// Each connection passes the configured [`ConnLimits`](crate::ConnLimits) first (over the
    /// accept rate or the connection cap it is closed at once). Errors on individual
    /// connections, and failures of accept itself (such as running out of file descriptors,
    /// handled by [`Listener`]), are counted and the loop carries on: one bad
    /// connection must never stop the listener.
    ///
    /// The loop runs as a task of its own on the runtime (it stops when this future is
    /// dropped): a caller's `block_on` thread is not one of the runtime's workers, so every
    /// connection handover there would be a wake-up of that thread and a hand-over of the new
    /// task to a worker, two cross-thread wake-ups per connection in a reconnect storm.
    pub async fn serve(&self, listener: TcpListener) -> Result<(), ServeError> {
        self.serve_until(listener, CancellationToken::new()).await
    }

    /// [`Server::serve`], which also stops when `stop` is cancelled, the server's
    /// connections carrying on: once this returns, the listener is closed and nothing more
    /// is accepted (dropping the future stops the loop too, but on its own time).
    pub async fn serve_until(
        &self,
        listener: TcpListener,
        stop: CancellationToken,
    ) -> Result<(), ServeError> {
        let server = self.clone();
        let mut task = AbortOnDrop(tokio::spawn(async move {
            server.accept_loop(listener, stop).await
        }));
        match (&mut task.0).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Only aborted by dropping this future, which then is not polled again.
            Err(_) => Ok(()),
        }
    }

    async fn accept_loop(
        &self,
        listener: TcpListener,
        stop: CancellationToken,
    ) -> Result<(), ServeError> {
        let mut options = SocketOptions::for_listener(&listener, self.tcp_options());
        let mut listener = Listener::new(listener, "main", self.accept_error_counter("main"));
        loop {
            let (stream, remote) = tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Ok(()),
                _ = self.shared.draining.cancelled() => return Ok(()),
                _ = stop.cancelled() => return Ok(()),
                a = listener.accept() => a,
            };
            let Some(guard) = self.admit_connection(remote) else {
                continue;
            };
            options.apply(&stream);
            if self.shared.proxy.is_some() {
                let shared = self.shared.clone();
                self.shared
                    .tasks
                    .spawn(crate::http::serve_proxied(shared, stream, remote, guard));
            } else {
                self.spawn_tracked(Transport::Tcp(stream), remote, guard);
            }
        }
    }

    /// Serves one already-handover connection through the HTTP front, as [`Server::serve`]
    /// does for each connection it accepts, but without the accept limits. For listeners
    /// the server does not own (TLS is terminated by the caller, then the stream is handed
    /// over). The task is tracked, so [`Server::shutdown`] waits for it.
    pub fn spawn_connection(&self, transport: Transport, remote: SocketAddr) {
        self.spawn_guarded(transport, remote, ConnGuard::none());
    }

    /// Applies the accept limits to a connection just handover from `remote` by a listener
    /// the caller runs: `None` when it must be closed at once (counted), otherwise the guard
    /// to pass to [`Server::spawn_guarded`] once the caller's own handshake (TLS) is done.
    /// Meanwhile the caller must give up the connection when [`ConnGuard::evicted`]
    /// completes.
    ///
    /// With the PROXY protocol on ([`Server::proxy_protocol`]), a peer that is not a listed
    /// proxy is refused here, and the caller must read the header
    /// ([`ProxyProtocol::read_header`]) before anything else and tell the guard whose
    /// connection it is ([`ConnGuard::relayed_for`]).
    pub fn admit_connection(&self, remote: SocketAddr) -> Option<ConnGuard> {
        let admitted = match &self.shared.proxy {
            // A trusted HTTP proxy speaks for many clients too: not capped per source until
            // a request names one.
            None if crate::http::forwarder(&self.shared, remote) => {
                self.shared.gate.admit_proxy(remote)
            }
            None => self.shared.gate.admit(remote),
            Some(proxy) if proxy.allows(ProxiedListener::Main, remote) => {
                self.shared.gate.admit_proxy(remote)
            }
            Some(_) => return None,
        };
        match admitted {
            Ok(guard) => Some(guard),
            Err(why) => {
                debug!(%remote, ?why, "connection refused at accept");
                None
            }
        }
    }

    /// Like [`Server::spawn_connection`] for a connection admitted by
    /// [`Server::admit_connection`]: it stays in the unproven budget until its DERP client is
    /// registered, and counts against the connection cap until it ends.
    pub fn spawn_guarded(&self, transport: Transport, remote: SocketAddr, guard: ConnGuard) {
        // Relayed packets must not wait for Nagle. Connections from `serve` have it from
        // the listener already; a TCP stream handed over by an embedder may not.
        transport.set_nodelay();
        self.spawn_tracked(transport, remote, guard);
    }

    fn spawn_tracked(&self, transport: Transport, remote: SocketAddr, guard: ConnGuard) {
        let shared = self.shared.clone();
        self.shared.tasks.spawn(crate::http::serve_conn(
            shared,
            transport,
            remote,
            guard,
            bytes::BytesMut::new(),
        ));
    }

    /// Runs `task` on the server's task tracker, so that [`Server::shutdown`] waits for it:
    /// for work a listener the caller runs does on a connection before handing it over (a
    /// TLS handshake). The task must end soon after [`Server::shutdown_token`] is cancelled,
    /// or the shutdown waits that long.
    pub fn spawn_task<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.shared.tasks.spawn(task);
    }

    /// The PROXY protocol the TCP listeners take, when configured
    /// ([`ServerConfig::proxy_protocol`]): for listeners the caller runs in front of this
    /// server (TLS, port 80), which must read the header as [`Server::serve`] does.
    pub fn proxy_protocol(&self) -> Option<ProxyProtocol> {
        self.shared.proxy.clone()
    }

    /// `derp_accept_errors{listener}`, for an accept loop the caller runs for this server
    /// (such as a TLS front on the main listener, `listener = "main"`).
    pub fn accept_error_counter(&self, listener: &str) -> prometheus::IntCounter {
        self.shared
            .gate
            .metrics
            .accept_errors
            .with_label_values(&[listener])
    }

    /// Serves DERP over QUIC on `listener` until [`Server::shutdown`] is called, sharing the
    /// relay (clients, queues, metrics) with the TCP listeners. QUIC handshakes run under the
    /// listener's deadline and in-flight cap; each connection is then served exactly as a TCP
    /// one is, plus its datagrams.
    pub async fn serve_quic(&self, listener: QuicListener) {
        conn::quic::accept_loop(self.shared.clone(), listener).await;
    }

    /// Puts a new per-client receive limit in force for every connection, existing ones
    /// (duplicates included) at their next read. Mesh peers are never limited. Has an effect
    /// only when the server was created with [`ServerConfig::rate_limit`] set (possibly to
    /// [`RateLimit::OFF`]); otherwise connections carry no bucket at all.
    pub fn set_rate_limit(&self, limit: RateLimit) {
        self.shared.rate_limits.set(limit);
    }

    /// The per-client receive limit in force.
    pub fn rate_limit(&self) -> RateLimit {
        self.shared.rate_limits.get()
    }

    /// A token cancelled when the server shuts down; for accept loops run by callers.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shared.shutdown.clone()
    }

    /// Says that another process now reads the QUIC listeners' UDP sockets too (it took them
    /// over, as an upgrade in place does): from here on the endpoints answer only packets
    /// of their own connections. What they do not know is that process's: no stateless
    /// reset (valid for its clients too when both derive it from the node key), no refusal
    /// of a connection attempt (left unanswered, so a resend may reach the other process).
    /// Their own clients are served, drained and closed as before.
    pub fn udp_handed_over(&self) {
        self.shared.udp_handed_over.store(true, Ordering::Release);
    }

    /// A token cancelled when a graceful shutdown begins ([`Server::shutdown_gracefully`]):
    /// accept loops run by callers stop accepting then.
    pub fn drain_token(&self) -> CancellationToken {
        self.shared.draining.clone()
    }

    /// Serves Prometheus text at `/metrics` on `listener` until shutdown. Unlike
    /// `/debug/varz` on the main listener, this has no access control: it is meant for a
    /// listener the operator binds to a private address.
    pub async fn serve_metrics(&self, listener: TcpListener) -> Result<(), ServeError> {
        let mut listener = Listener::new(listener, "metrics", self.accept_error_counter("metrics"));
        loop {
            let (stream, remote) = tokio::select! {
                _ = self.shared.shutdown.cancelled() => return Ok(()),
                a = listener.accept() => a,
            };
            let shared = self.shared.clone();
            self.shared
                .tasks
                .spawn(crate::http::serve_metrics_conn(shared, stream, remote));
        }
    }

    /// Runs the DERP protocol directly on an already-upgraded stream (no HTTP), as the
    /// reference's `Server.Accept` does; for embedding and tests.
    pub async fn accept(&self, transport: Transport, remote: SocketAddr) {
        let handover = Handover {
            transport,
            initial: bytes::BytesMut::new(),
            remote,
            preamble: bytes::Bytes::new(),
            framing: conn::Framing::Raw,
            not_ideal: false,
            quic: None,
            guard: ConnGuard::none(),
            detach: false,
        };
        conn::serve(self.shared.clone(), handover).await;
    }

    /// Freezes every connection for a handover to a successor process (see [`crate::Frozen`]):
    /// read loops stop between reads, and the writers of the connections that can be handed
    /// over park where they are. Waits up to `within` for them; a connection that has not
    /// stopped by then stays with this process. Accepting new connections is the caller's
    /// to stop first.
    pub async fn freeze_for_handover(&self, within: Duration) -> crate::Frozen {
        crate::handover::freeze(&self.shared, within).await
    }

    /// Takes over connections a predecessor process handed over ([`crate::decode_conns`]):
    /// registers them, inert until [`crate::Adopted::start`]. Must run inside the runtime
    /// that will serve them.
    pub fn adopt(
        &self,
        conns: Vec<crate::HandedConn>,
    ) -> Result<crate::Adopted, crate::AdoptError> {
        crate::handover::adopt(&self.shared, conns)
    }

    /// Shuts down without cutting clients off mid-stream: stops accepting ([`Server::serve`]
    /// returns; callers' accept loops watch [`Server::drain_token`]), queues a Restarting
    /// frame for every client telling it to reconnect after `reconnect_in` and to keep
    /// trying for `try_for` (both sent in milliseconds, saturating at `u32::MAX`), stops
    /// reading from clients, lets every writer send what is queued, then closes everything
    /// as [`Server::shutdown`] does. Closing happens as soon as all queues are out, or at
    /// `drain_deadline` with whatever is left counted as `gone_disconnected`.
    pub async fn shutdown_gracefully(
        &self,
        reconnect_in: Duration,
        try_for: Duration,
        drain_deadline: Duration,
    ) {
        let deadline = tokio::time::Instant::now() + drain_deadline;
        debug!("draining");
        self.shared
            .registry
            .announce_restart(millis_u32(reconnect_in), millis_u32(try_for));
        self.shared.draining.cancel();
        let mut tick = tokio::time::interval(DRAIN_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.shared.registry.all_drained() {
                debug!("every queue drained");
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                warn!("drain deadline passed with packets still queued");
                break;
            }
        }
        self.shutdown().await;
    }

    /// Closes every connection and stops accepting. Returns once all connection tasks ended.
    pub async fn shutdown(&self) {
        debug!("shutting down");
        self.shared.shutdown.cancel();
        self.shared.gate.close();
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
    }
}

/// Aborts a task when dropped, so the task lives no longer than whoever awaits it.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How often a graceful shutdown checks whether the queues are out.
const DRAIN_POLL: Duration = Duration::from_millis(5);

fn millis_u32(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use tokio::net::TcpStream;

    use super::*;
    use crate::ServerConfig;

    fn server() -> Server {
        let config = ServerConfig::new(derp_testkit::server_secret());
        Server::new(config, &prometheus::Registry::new()).expect("server")
    }

    async fn listener() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        (listener, addr)
    }

    #[tokio::test]
    async fn serve_returns_on_shutdown() {
        let server = server();
        let (listener, addr) = listener().await;
        let serving = tokio::spawn({
            let server = server.clone();
            async move { server.serve(listener).await }
        });
        TcpStream::connect(addr).await.expect("accepting");
        server.shutdown().await;
        let result = tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("serve returned");
        assert!(matches!(result, Ok(Ok(()))), "{result:?}");
    }

    /// A connection still in its handshake holds a shutdown up no longer than it takes to
    /// close it, however long its deadline: here an hour, which the test's own deadline
    /// would turn into a failure.
    #[tokio::test]
    async fn shutdown_ends_connections_still_in_their_handshake() {
        let mut config = ServerConfig::new(derp_testkit::server_secret());
        config.handshake_timeout = Duration::from_secs(3600);
        let server = Server::new(config, &prometheus::Registry::new()).expect("server");
        let (listener, addr) = listener().await;
        let serving = tokio::spawn({
            let server = server.clone();
            async move { server.serve(listener).await }
        });
        // One connection that never sends its request head, one that stops in the middle of
        // it: both are unproven, waiting for bytes that will not come.
        let silent = TcpStream::connect(addr).await.expect("connect");
        let mut partial = TcpStream::connect(addr).await.expect("connect");
        tokio::io::AsyncWriteExt::write_all(&mut partial, b"GET /derp HTTP/1.1\r\n")
            .await
            .expect("write");
        let registered = async {
            while server.shared.gate.unproven() < 2 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), registered)
            .await
            .expect("both connections were handover");
        tokio::time::timeout(Duration::from_secs(10), server.shutdown())
            .await
            .expect("the shutdown did not wait for the handshakes' deadline");
        for mut stream in [silent, partial] {
            let mut buf = [0u8; 1];
            let n = tokio::io::AsyncReadExt::read(&mut stream, &mut buf).await;
            assert!(matches!(n, Ok(0) | Err(_)), "closed: {n:?}");
        }
        let _ = serving.await;
    }

    #[tokio::test]
    async fn dropping_serve_stops_the_accept_loop_and_closes_the_listener() {
        let server = server();
        let (listener, addr) = listener().await;
        let mut serving = Box::pin(server.serve(listener));
        tokio::select! {
            r = &mut serving => panic!("serve ended early: {r:?}"),
            c = TcpStream::connect(addr) => drop(c.expect("accepting")),
        }
        drop(serving);
        // The loop's task is cancelled at its next turn; then nothing listens any more.
        let closed = async {
            loop {
                match TcpStream::connect(addr).await {
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => return,
                    _ => tokio::task::yield_now().await,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("the listener closed");
    }
}
