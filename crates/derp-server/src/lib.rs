//! The derpd relay: a DERP server that Tailscale clients can use in place of `derper`.
//!
//! What it does:
//! - serves HTTP/1.1 on a listener it is given: `/derp` upgrades (plain `Upgrade: DERP`,
//!   fast start, and WebSocket with subprotocol `derp`), the probe endpoints, `/generate_204`,
//!   `/robots.txt`, a home page, the `/debug/` pages (Prometheus text, a health check,
//!   live per-connection TCP counters; loopback and configured networks only) and `/bootstrap-dns` (names resolved in the background by a
//!   [`Resolver`] it is given, see [`BootstrapDns`]);
//! - runs the relay: an authoritative client map under a lock, a lock-free papaya mirror for
//!   the packet path, bounded per-destination queues with the reference's drop policy, batched
//!   vectored writes, keepalives, write deadlines, PeerGone notifications, duplicate-key
//!   handling and the receiving side of mesh frames;
//! - limits what it accepts: an accept rate, a cap on open connections, a budget of unproven
//!   connections that evicts the oldest when full, and a per-client receive rate enforced by
//!   reading more slowly; runs the admission checks it is given ([`Admission`]) on every
//!   client before registering it;
//! - takes connections off every listener, its own and its embedders', through [`Listener`],
//!   which retries an accept that failed for one connection at once and backs off while
//!   accept fails for want of file descriptors or memory;
//! - takes the client's address from a load balancer's PROXY protocol header (versions 1 and
//!   2, from listed peers only, [`ProxyProtocol`]) or a trusted HTTP proxy's
//!   `X-Forwarded-For`, so per-source limits, logs and admission see the client, not the
//!   proxy;
//! - counts everything into Prometheus metrics registered on a registry the caller passes in;
//! - answers STUN binding requests on a UDP socket it is given;
//! - serves DERP over QUIC ([`quic`]) on a UDP socket and TLS config it is given, with a
//!   driver of its own on quinn-proto: one stream per client runs the same handshake,
//!   registration and relay as TCP, and QUIC datagrams carry packets both ways, routed by
//!   the task that received them;
//! - hands its live TCP connections (plain or on derpd's TLS records, bare or WebSocket) to
//!   another server, or takes them over from one
//!   ([`Server::freeze_for_handover`], [`Server::adopt`]): frozen where they are, their state
//!   copied into bytes and their sockets duplicated, then forgotten here without a word to
//!   the client, or resumed. Moving the bytes and sockets between processes is the caller's.
//!
//! What it does not do: parse flags or files, choose addresses, install a tracing subscriber
//! or a global metrics registry (`derpd` does those); terminate TLS or obtain certificates
//! (`derp-tls` does, and hands the decrypted streams to [`Server::spawn_guarded`] once
//! [`Server::admit_connection`] let them in);
//! implement admission checks that need an HTTP client, a Unix socket or files
//! (`derp-admission` does). The wire protocol, including the HTTP upgrade and WebSocket
//! framing, lives in `derp-proto`.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod accept;
mod admission;
mod bootstrap_dns;
mod config;
mod conn;
mod debug;
mod handed;
mod handle;
mod handover;
mod http;
mod listen;
mod lookup;
mod metrics;
mod proxy;
mod queue;
pub mod quic;
mod ratelimit;
mod registry;
mod route;
mod server;
mod state;
mod stun;
mod tcpinfo;

pub use accept::{Accept, Listener};
pub use admission::{
    Admission, AdmissionRequest, REFUSED_TIMEOUT, Refused, Verdict, VerdictFuture,
};
pub use bootstrap_dns::{
    BootstrapDns, BootstrapDnsConfig, LIST_TIMEOUT as BOOTSTRAP_DNS_LIST_TIMEOUT, LookupFuture,
    REFRESH_INTERVAL as BOOTSTRAP_DNS_REFRESH_INTERVAL, Resolver, address_in_rollout,
};
pub use config::{
    DEFAULT_SEND_QUEUE_DEPTH, DEFAULT_WRITE_TIMEOUT, ForwardedHeader, HANDSHAKE_TIMEOUT, HomePage,
    IpCidr, KEEPALIVE_INTERVAL, MESH_WRITE_TIMEOUT, ServerConfig, TCP_RTT_INTERVAL,
};
pub use derp_io::{
    BoxedIo, MAX_KEEPALIVE_IDLE, TcpOptions, Transport, raise_descriptor_limit, tune_listener,
    tune_socket,
};
pub use handover::{
    AdoptError, Adopted, ExitWatch, FORMAT as HANDOVER_FORMAT, Frozen, HandedConn, RecordError,
    decode_conns, encode_conns,
};
pub use http::{Rewind, generate_204, http1_builder, text};
pub use listen::{
    AcceptRate, BudgetMetrics, ConnGuard, ConnLimits, DEFAULT_MAX_UNPROVEN,
    DEFAULT_MAX_UNPROVEN_PER_SOURCE, Refusal, Unproven, UnprovenBudget,
};
/// Benchmark scaffolding over the real lookup path; only with the `bench` feature.
#[cfg(feature = "bench")]
pub use lookup::bench as lookup_bench;
pub use lookup::{
    DEFAULT_PEER_CACHE_MAX_ENTRIES, DEFAULT_PEER_CACHE_MAX_IDLE, LookupConfig, PeerCacheConfig,
};
pub use metrics::{
    DropReason, FallbackReason, HandshakeResult, Metrics, PacketKind, TransportLabel,
};
pub use proxy::{Opened, Proxied, ProxiedListener, ProxyProtocol, ProxyRefusal, open_connection};
pub use quic::{QuicConfig, QuicError, QuicListener};
pub use ratelimit::{MIN_RATE_BURST, RateLimit};
pub use registry::PacketForwarder;
pub use server::{ServeError, Server};
pub use stun::{StunConfig, StunMetrics, bind_stun, serve_stun};
