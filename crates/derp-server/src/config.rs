//! Typed server configuration.
//!
//! The library takes a plain struct; `derpd` owns flag parsing and files and converts them into
//! this type, so nothing here knows about clap or JSON.

use std::time::Duration;

use derp_proto::{MeshKey, SecretKey};

use crate::lookup::LookupConfig;

/// Everything the relay needs to run, independent of how it was configured.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The server's long-term identity. Clients learn its public half from the ServerKey frame.
    pub secret_key: SecretKey,
    /// Depth of each of a connection's two send queues (disco and other). The reference uses 32.
    pub send_queue_depth: usize,
    /// Deadline for each write to a client socket; `None` disables it. A client that cannot
    /// take a write within this time is disconnected, so it cannot pin memory on the server.
    pub write_timeout: Option<Duration>,
    /// Deadline for writes to mesh peers, which carry traffic for many clients and are given
    /// longer (the reference uses 30 s).
    pub mesh_write_timeout: Option<Duration>,
    /// Base keepalive period; each connection adds its own jitter of up to 5 s.
    pub keepalive_interval: Duration,
    /// Deadline for the HTTP request head and for each handshake step.
    pub handshake_timeout: Duration,
    /// Serve DERP on `/derp`. When false, `/derp` answers 404 and the probes keep working.
    pub derp_enabled: bool,
    /// What `/` (and every unmatched path) serves.
    pub home: HomePage,
    /// Pre-shared key that grants mesh privileges (WatchConns, ClosePeer, ForwardPacket).
    pub mesh_key: Option<MeshKey>,
    /// Which destination lookup layers run.
    pub lookup: LookupConfig,
}

impl ServerConfig {
    /// A configuration with the reference server's defaults and the given identity.
    pub fn new(secret_key: SecretKey) -> Self {
        Self {
            secret_key,
            send_queue_depth: DEFAULT_SEND_QUEUE_DEPTH,
            write_timeout: Some(DEFAULT_WRITE_TIMEOUT),
            mesh_write_timeout: Some(MESH_WRITE_TIMEOUT),
            keepalive_interval: KEEPALIVE_INTERVAL,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            derp_enabled: true,
            home: HomePage::Default,
            mesh_key: None,
            lookup: LookupConfig::default(),
        }
    }
}

/// The home page served at `/`, as derper's `--home` flag selects it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HomePage {
    /// A short HTML page saying what this server is.
    Default,
    /// An empty HTML page.
    Blank,
    /// A 302 redirect to this `http://` or `https://` URL.
    Redirect(String),
}

/// Default per-queue depth (`TS_DEBUG_DERP_PER_CLIENT_SEND_QUEUE_DEPTH` in the reference).
pub const DEFAULT_SEND_QUEUE_DEPTH: usize = 32;
/// Default per-write deadline for ordinary clients (derper's `--tcp-write-timeout`).
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Per-write deadline for mesh peers.
pub const MESH_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Base keepalive period.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
/// Handshake step deadline.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
