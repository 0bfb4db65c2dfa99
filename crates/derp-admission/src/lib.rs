//! Admission checks for derpd: who may use the relay.
//!
//! Each check implements [`derp_server::Admission`] and is handed to the relay in
//! [`ServerConfig::admission`](derp_server::ServerConfig::admission); the relay asks it about
//! every client (mesh peers excepted) right after the client's ClientInfo opens, and closes a
//! refused client with nothing relayed.
//!
//! What it does:
//! - [`VerifyUrl`]: derper's `--verify-client-url`. POSTs
//!   `{"NodePublic":"nodekey:<hex>","Source":"<ip>"}` to an admission server (headscale's
//!   `/verify` speaks it) over HTTP or HTTPS (the system's roots), admits only on
//!   `{"Allow":true}`, with a deadline, a cap on the response, pooled connections, and a
//!   choice between failing closed (the default) and open when the server cannot be reached.
//! - [`LocalTailscaled`]: derper's `--verify-clients`. Asks the local tailscaled's LocalAPI
//!   (`whois` by node key, over its Unix socket) whether the key is a peer of this node.
//! - [`AllowKeys`]: a file of allowed node keys, re-read when it changes or on demand, keeping
//!   the old list when the new file has a bad line.
//! - The two remote checks cache their decisions briefly ([`CacheConfig`]), per key and source
//!   address, and merge concurrent questions about the same client into one request, so a
//!   reconnect storm does not become a storm on the admission server.
//!
//! What it does not do: parse flags, install signal handlers (derpd calls
//! [`AllowKeys::reload`] on SIGHUP), or revisit clients already admitted.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod allow;
mod cache;
mod client;
mod metrics;
mod tailscaled;
mod url;

pub use allow::{AllowKeys, AllowKeysError};
pub use cache::CacheConfig;
pub use metrics::AdmissionMetrics;
pub use tailscaled::{DEFAULT_TAILSCALED_SOCKET, LocalTailscaled};
pub use url::{DEFAULT_VERIFY_TIMEOUT, MAX_RESPONSE_BODY, UrlOptions, VerifyUrl};

/// Errors setting up an admission check.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The admission URL is not usable.
    #[error("invalid admission url {url:?}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// TLS could not be set up for an `https://` URL.
    #[error("tls: {0}")]
    Tls(#[from] rustls::Error),
    /// Registering metrics failed.
    #[error("registering metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}
