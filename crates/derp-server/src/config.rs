//! Typed server configuration.
//!
//! The library takes a plain struct; `derpd` owns flag parsing and files and converts them into
//! this type, so nothing here knows about clap or JSON.

use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use derp_io::TcpOptions;
use derp_proto::{MeshKey, SecretKey};

use crate::admission::Admission;
use crate::listen::ConnLimits;
use crate::lookup::LookupConfig;
use crate::ratelimit::RateLimit;

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
    /// Networks besides loopback allowed to read the `/debug/` pages (`/debug/varz` and the
    /// others) on the main listener.
    pub debug_allow: Vec<IpCidr>,
    /// Fold per-connection packet counters into the registry. Turning this off leaves the
    /// packet and drop counters at zero; it exists to measure what counting costs.
    pub packet_metrics: bool,
    /// Checks every client (mesh peers excepted) must pass, in order, after its ClientInfo
    /// opens and before it is registered. A refused client is closed with nothing sent.
    pub admission: Vec<Arc<dyn Admission>>,
    /// Per-client receive rate limit. `None`: not configured (its metrics are not published);
    /// `Some` with a zero rate: configured but off, changeable with
    /// [`Server::set_rate_limit`](crate::Server::set_rate_limit).
    pub rate_limit: Option<RateLimit>,
    /// What [`Server::serve`](crate::Server::serve) (and a TLS front) lets in.
    pub limits: ConnLimits,
    /// TCP keepalive and user timeout of every client connection the server's listeners (and
    /// a TLS front) accept.
    pub tcp: TcpOptions,
    /// The PROXY protocol on the TCP listeners: `Some(networks)` makes every connection open
    /// with a header (version 1 or 2) and accepts connections only from peers in these
    /// networks, the load balancers; `None` (the default) reads no header. See
    /// [`ProxyProtocol`](crate::ProxyProtocol).
    pub proxy_protocol: Option<Vec<IpCidr>>,
    /// Networks of HTTP reverse proxies (nginx's `http` module, which cannot send PROXY
    /// protocol) whose [`forwarded_header`](Self::forwarded_header) names the client of a
    /// request. From anyone else no header is believed for addressing.
    pub trust_forwarded_from: Vec<IpCidr>,
    /// The one header those proxies set: the other is never read, since a proxy passes it on
    /// as the client wrote it. `X-Forwarded-For` by default.
    pub forwarded_header: ForwardedHeader,
    /// What `/bootstrap-dns` serves; `None` answers with an empty document, as derper does
    /// with no names configured. The embedder runs its refresh task
    /// ([`BootstrapDns::run`](crate::BootstrapDns::run)).
    pub bootstrap_dns: Option<Arc<crate::bootstrap_dns::BootstrapDns>>,
    /// How often the kernel's smoothed RTT of every client's TCP connection is sampled into
    /// `derp_tcp_rtt` (10 s, as derper); `None` turns sampling off (derper's
    /// `TS_DERP_DISABLE_RTT_STATS`). One netlink dump per period, never per packet.
    pub tcp_rtt_interval: Option<Duration>,
    /// Extra lines for the `/debug/` page, as (label, value): what the embedder knows and
    /// the relay does not (its version, the TLS hostname).
    pub debug_info: Vec<(String, String)>,
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
            debug_allow: Vec::new(),
            packet_metrics: true,
            admission: Vec::new(),
            rate_limit: None,
            limits: ConnLimits::default(),
            tcp: TcpOptions::default(),
            proxy_protocol: None,
            trust_forwarded_from: Vec::new(),
            forwarded_header: ForwardedHeader::default(),
            bootstrap_dns: None,
            tcp_rtt_interval: Some(TCP_RTT_INTERVAL),
            debug_info: Vec::new(),
        }
    }
}

/// The request header in which trusted HTTP proxies name the client they pass a request on
/// for (see `proxy.rs` for why only one is read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For`, a list each proxy appends to; the rightmost untrusted entry.
    #[default]
    XForwardedFor,
    /// `X-Real-IP`, one address the proxy sets.
    XRealIp,
}

impl ForwardedHeader {
    /// The header's name, as written in logs and docs.
    pub fn name(self) -> &'static str {
        match self {
            Self::XForwardedFor => "X-Forwarded-For",
            Self::XRealIp => "X-Real-IP",
        }
    }
}

/// An IP network in CIDR notation, such as `100.64.0.0/10` or `fd7a:115c:a1e0::/48`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpCidr {
    addr: IpAddr,
    prefix: u8,
}

impl IpCidr {
    /// Whether `ip` is inside the network. An IPv4 address and its IPv4-mapped IPv6 form
    /// (`::ffff:a.b.c.d`, as a dual-stack socket reports IPv4 peers) are one address: either
    /// matches an IPv4 network and an IPv6 network written in the mapped form alike.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), ip) => {
                let ip = match ip {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            (IpAddr::V4(_), IpAddr::V6(_)) => false,
        }
    }
}

impl std::fmt::Display for IpCidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for IpCidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("invalid CIDR {s:?}: bad address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("invalid CIDR {s:?}: prefix must be 0-{max}"))?,
            None => max,
        };
        Ok(Self { addr, prefix })
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
/// Default period of `derp_tcp_rtt` sampling.
pub const TCP_RTT_INTERVAL: Duration = Duration::from_secs(10);
/// Handshake step deadline.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_and_match() {
        let net: IpCidr = "100.64.0.0/10".parse().expect("parses");
        assert!(net.contains("100.100.1.2".parse().expect("ip")));
        assert!(!net.contains("100.128.0.1".parse().expect("ip")));
        assert!(net.contains("::ffff:100.64.0.1".parse().expect("ip")));
        let v6: IpCidr = "fd7a:115c:a1e0::/48".parse().expect("parses");
        assert!(v6.contains("fd7a:115c:a1e0:ab12::1".parse().expect("ip")));
        assert!(!v6.contains("fd7a:115c:a1e1::1".parse().expect("ip")));
        let all: IpCidr = "0.0.0.0/0".parse().expect("parses");
        assert!(all.contains("8.8.8.8".parse().expect("ip")));
        let host: IpCidr = "10.1.2.3".parse().expect("parses");
        assert!(host.contains("10.1.2.3".parse().expect("ip")));
        assert!(!host.contains("10.1.2.4".parse().expect("ip")));
        assert_eq!(host.to_string(), "10.1.2.3/32");
        assert_eq!(v6.to_string(), "fd7a:115c:a1e0::/48");
        assert!("10.0.0.0/33".parse::<IpCidr>().is_err());
        // A network written in the IPv4-mapped form holds the IPv4 addresses it maps, in
        // either form.
        let mapped: IpCidr = "::ffff:10.0.0.0/104".parse().expect("parses");
        assert!(mapped.contains("10.1.2.3".parse().expect("ip")));
        assert!(mapped.contains("::ffff:10.1.2.3".parse().expect("ip")));
        assert!(!mapped.contains("11.1.2.3".parse().expect("ip")));
        assert!(!mapped.contains("fd7a::1".parse().expect("ip")));
        let one: IpCidr = "::ffff:127.0.0.1".parse().expect("parses");
        assert!(one.contains("127.0.0.1".parse().expect("ip")));
        assert!(!one.contains("127.0.0.2".parse().expect("ip")));
        assert!("nonsense/8".parse::<IpCidr>().is_err());
    }
}
