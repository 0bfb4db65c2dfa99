//! Connections that come through a proxy: the PROXY protocol header a TCP load balancer puts
//! in front of each connection it passes on, and the `X-Forwarded-For` or `X-Real-IP` header
//! of an HTTP reverse proxy (which cannot send PROXY protocol). Either way the client's
//! address takes the proxy's place for everything after it: the per-source unproven cap,
//! logs, admission requests, PeerPresent, the `/bootstrap-dns` rollout.
//!
//! **PROXY protocol** (`ProxyProtocol`): only peers in the configured networks may connect;
//! anyone else is closed at accept. A listed peer must open with a valid header (version 1
//! or 2, [`derp_proto::proxy_protocol`]) before anything else is read, within the deadline
//! the caller gives (the handshake's), while the connection holds its place in the unproven
//! budget: a proxy that stalls is one more unproven connection. Every refusal is counted in
//! `derp_proxy_protocol_refused{listener,reason}`. A LOCAL header (the balancer's own health
//! check) or one without a TCP client address (`UNKNOWN`, an unspecified family, a Unix
//! socket) leaves the proxy's own address in place; a header describing UDP is malformed
//! here, as no UDP connection reaches a TCP listener.
//!
//! **Forwarded headers** (`forwarded_client`): believed only on connections from the networks
//! of `--trust-forwarded-from`, which, like a balancer's, are not capped per source until a
//! DERP upgrade names its client. Only the one header the operator names
//! ([`ForwardedHeader`], `--forwarded-header`) is read: a proxy passes on every header it does
//! not set itself, so a second header would be the client's own words wherever the proxy sets
//! only the first (nginx with `X-Real-IP $remote_addr` alone passes a client's
//! `X-Forwarded-For` through unchanged).
//!
//! - `X-Forwarded-For` (the default: the shipped nginx recipe appends to it with
//!   `$proxy_add_x_forwarded_for`, and this rule makes an appended list trustworthy): the
//!   client is the rightmost entry that is not itself a trusted proxy. Each proxy appends the
//!   address it saw connecting, so walking from the right through trusted hops reaches the
//!   first address a trusted proxy saw from outside, and everything left of it was written by
//!   parties nobody vouches for. When every entry is a trusted proxy, the leftmost is taken.
//!   An entry on the walk that is no address makes the list unusable.
//! - `X-Real-IP`: one line holding one address, which the proxy must overwrite (nginx's
//!   `proxy_set_header` replaces the client's); two lines name nobody.
//!
//! The port is unknown, so it is 0.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use derp_proto::proxy_protocol::{self, Addresses, Command, Parsed, ProxyError};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::{ForwardedHeader, IpCidr};
use crate::listen::ConnGuard;

/// Which listener a connection came in on, for the metrics' `listener` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxiedListener {
    /// The main listener (plain HTTP, or TLS).
    Main,
    /// The plain-HTTP port-80 listener beside the TLS one.
    HttpPort,
}

impl ProxiedListener {
    fn index(self) -> usize {
        self as usize
    }

    fn label(self) -> &'static str {
        match self {
            Self::Main => "main",
            Self::HttpPort => "http_port",
        }
    }
}

/// Why a connection was closed before anything of its own was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyRefusal {
    /// The peer is not one of the proxies allowed to send a header.
    NotAllowed,
    /// The first bytes were not a PROXY protocol header.
    NoHeader,
    /// A header the specification does not allow (or one describing UDP).
    Malformed,
    /// No complete header within the deadline.
    Timeout,
    /// The peer closed (or the socket failed) before the header was complete.
    Closed,
    /// Evicted from the unproven-connection budget, to admit a newer connection, before the
    /// header was complete.
    Evicted,
}

impl ProxyRefusal {
    const ALL: [Self; 6] = [
        Self::NotAllowed,
        Self::NoHeader,
        Self::Malformed,
        Self::Timeout,
        Self::Closed,
        Self::Evicted,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::NotAllowed => "not_allowed",
            Self::NoHeader => "no_header",
            Self::Malformed => "malformed",
            Self::Timeout => "timeout",
            Self::Closed => "closed",
            Self::Evicted => "evicted",
        }
    }
}

/// What a valid header said, for `derp_proxy_protocol_headers{listener,command}`.
#[derive(Clone, Copy, Debug)]
enum HeaderCommand {
    /// A TCP client's address.
    Proxy,
    /// LOCAL: the proxy's own connection.
    Local,
    /// PROXY without a TCP address (`UNKNOWN`, unspecified, Unix).
    Unspecified,
}

impl HeaderCommand {
    const ALL: [Self; 3] = [Self::Proxy, Self::Local, Self::Unspecified];

    fn label(self) -> &'static str {
        match self {
            Self::Proxy => "proxy",
            Self::Local => "local",
            Self::Unspecified => "unspecified",
        }
    }
}

const LISTENERS: [ProxiedListener; 2] = [ProxiedListener::Main, ProxiedListener::HttpPort];

/// The PROXY protocol on the TCP listeners: who may send a header, reading it, and the
/// counters. Made by the server from
/// [`ServerConfig::proxy_protocol`](crate::ServerConfig::proxy_protocol) and shared with its
/// embedders' listeners
/// ([`Server::proxy_protocol`](crate::Server::proxy_protocol)). Cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyProtocol {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    from: Vec<IpCidr>,
    /// By listener, then by [`ProxyRefusal::ALL`]'s order.
    refused: [[IntCounter; ProxyRefusal::ALL.len()]; 2],
    /// By listener, then by [`HeaderCommand::ALL`]'s order.
    headers: [[IntCounter; 3]; 2],
}

impl ProxyProtocol {
    /// Takes headers from peers in `from` only, registering its counters on `registry`.
    pub(crate) fn new(from: Vec<IpCidr>, registry: &Registry) -> Result<Self, prometheus::Error> {
        let refused = IntCounterVec::new(
            Opts::new(
                "derp_proxy_protocol_refused",
                "connections closed before a valid PROXY protocol header, by listener and \
                 reason (not_allowed: the peer is not a listed proxy; no_header; malformed; \
                 timeout; closed: the peer left first)",
            ),
            &["listener", "reason"],
        )?;
        let headers = IntCounterVec::new(
            Opts::new(
                "derp_proxy_protocol_headers",
                "valid PROXY protocol headers, by listener and command (proxy: a client's \
                 address; local: the proxy's own connection, such as a health check; \
                 unspecified: no client address given)",
            ),
            &["listener", "command"],
        )?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(headers.clone()))?;
        let per = |l: ProxiedListener| {
            (
                ProxyRefusal::ALL.map(|r| refused.with_label_values(&[l.label(), r.label()])),
                HeaderCommand::ALL.map(|c| headers.with_label_values(&[l.label(), c.label()])),
            )
        };
        let [(r0, h0), (r1, h1)] = LISTENERS.map(per);
        Ok(Self {
            inner: Arc::new(Inner {
                from,
                refused: [r0, r1],
                headers: [h0, h1],
            }),
        })
    }

    /// Whether `peer` may send a header; if not, the refusal is counted.
    pub fn allows(&self, listener: ProxiedListener, peer: SocketAddr) -> bool {
        let ip = peer.ip();
        if self.inner.from.iter().any(|net| net.contains(ip)) {
            return true;
        }
        self.refuse(
            listener,
            peer,
            ProxyRefusal::NotAllowed,
            "not a listed proxy",
        );
        false
    }

    /// Counts a connection from `peer` evicted from the unproven budget while its header
    /// was awaited (the caller stops reading it).
    pub fn evicted(&self, listener: ProxiedListener, peer: SocketAddr) {
        self.refuse(
            listener,
            peer,
            ProxyRefusal::Evicted,
            "evicted while sending its header",
        );
    }

    fn refuse(&self, l: ProxiedListener, peer: SocketAddr, why: ProxyRefusal, detail: &str) {
        self.inner.refused[l.index()][why as usize].inc();
        debug!(%peer, listener = l.label(), reason = why.label(), detail, "proxied connection refused");
    }

    /// Reads the header that must open a connection from `peer` (a listed proxy), by
    /// `deadline`. Reads past the header are possible: what follows it is left in `buf`,
    /// the start of the connection's own bytes. Returns the connection's two ends as the
    /// header gives them, `None` when it gives none (the proxy's own connection stands), or
    /// why the connection must be closed (counted). Cancel-safe in the sense that dropping it
    /// reads nothing more.
    pub async fn read_header<S: AsyncRead + Unpin>(
        &self,
        listener: ProxiedListener,
        stream: &mut S,
        peer: SocketAddr,
        deadline: Instant,
        buf: &mut BytesMut,
    ) -> Result<Option<Proxied>, ProxyRefusal> {
        let read = async {
            loop {
                match proxy_protocol::parse(buf) {
                    Ok(Parsed::Complete { header, len }) => {
                        buf.advance(len);
                        return Ok(header);
                    }
                    Ok(Parsed::Incomplete { needed }) => {
                        buf.reserve(needed.max(256));
                        match stream.read_buf(buf).await {
                            Ok(0) => return Err((ProxyRefusal::Closed, "closed".to_owned())),
                            Ok(_) => {}
                            Err(e) => return Err((ProxyRefusal::Closed, e.to_string())),
                        }
                    }
                    Err(e @ ProxyError::NotProxy) => {
                        return Err((ProxyRefusal::NoHeader, e.to_string()));
                    }
                    Err(e @ ProxyError::Malformed(_)) => {
                        return Err((ProxyRefusal::Malformed, e.to_string()));
                    }
                }
            }
        };
        let header = match tokio::time::timeout_at(deadline, read).await {
            Ok(Ok(header)) => header,
            Ok(Err((why, detail))) => {
                self.refuse(listener, peer, why, &detail);
                return Err(why);
            }
            Err(_) => {
                self.refuse(listener, peer, ProxyRefusal::Timeout, "no header in time");
                return Err(ProxyRefusal::Timeout);
            }
        };
        let (command, client) = match (header.command, header.addresses) {
            (Command::Local, _) => (HeaderCommand::Local, None),
            (
                Command::Proxy,
                Addresses::Tcp {
                    source,
                    destination,
                },
            ) => (
                HeaderCommand::Proxy,
                // IPv4-mapped addresses as IPv4, as the rest of the server sees IPv4 clients.
                Some(Proxied {
                    client: SocketAddr::new(source.ip().to_canonical(), source.port()),
                    dialed: SocketAddr::new(destination.ip().to_canonical(), destination.port()),
                }),
            ),
            (Command::Proxy, Addresses::Udp { .. }) => {
                self.refuse(listener, peer, ProxyRefusal::Malformed, "a UDP connection");
                return Err(ProxyRefusal::Malformed);
            }
            (Command::Proxy, Addresses::Unspecified | Addresses::Unix) => {
                (HeaderCommand::Unspecified, None)
            }
        };
        self.inner.headers[listener.index()][command as usize].inc();
        Ok(client)
    }
}

/// A proxied connection's two ends, as its PROXY protocol header names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proxied {
    /// The client's address.
    pub client: SocketAddr,
    /// The address the client connected to (the balancer's, not derpd's): where an IP
    /// certificate must be valid.
    pub dialed: SocketAddr,
}

/// A connection accepted on a TCP listener, once the PROXY protocol header that opens it
/// (if the listener takes one) has been read.
#[derive(Debug)]
pub struct Opened {
    /// Whose connection it is: the client a header named, or else the socket's peer.
    pub remote: SocketAddr,
    /// The address the client dialed, when a header named it.
    pub dialed: Option<SocketAddr>,
    /// Bytes read past the header: the start of the connection's own.
    pub read: BytesMut,
}

/// The opening every TCP listener's connections go through (the main listener, plain or
/// TLS, and the port-80 listener). Without `proxy` the connection is `peer`'s and nothing is
/// read. With it, the header is read by `deadline` ([`ProxyProtocol::read_header`]) while
/// the connection holds its place in the unproven budget: an eviction from it ends the wait
/// and is counted as a refusal, and a header that names a client moves the connection to
/// that client's source ([`ConnGuard::relayed_for`]). `None` when the connection must be
/// closed: refused (counted), evicted, or `stop` cancelled (a shutdown, not counted).
pub async fn open_connection<S: AsyncRead + Unpin>(
    proxy: Option<&ProxyProtocol>,
    listener: ProxiedListener,
    stream: &mut S,
    peer: SocketAddr,
    guard: &ConnGuard,
    deadline: Instant,
    stop: &CancellationToken,
) -> Option<Opened> {
    let mut read = BytesMut::new();
    let Some(proxy) = proxy else {
        return Some(Opened {
            remote: peer,
            dialed: None,
            read,
        });
    };
    let header = tokio::select! {
        // A shutdown evicts every unproven connection too; it is not counted as one.
        biased;
        _ = stop.cancelled() => return None,
        _ = guard.evicted() => {
            proxy.evicted(listener, peer);
            return None;
        }
        h = proxy.read_header(listener, stream, peer, deadline, &mut read) => h,
    };
    let proxied = header.ok()?;
    if let Some(p) = proxied {
        guard.relayed_for(p.client.ip());
    }
    Some(Opened {
        remote: proxied.map_or(peer, |p| p.client),
        dialed: proxied.map(|p| p.dialed),
        read,
    })
}

/// The client an HTTP reverse proxy at a trusted address says it passes a request on for, in
/// `header` (see the module docs for the rule): `None` when the header gives no usable
/// address. `headers` yields every header of the request as (name, value); names in any case.
pub(crate) fn forwarded_client<'a>(
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
    header: ForwardedHeader,
    trusted: &[IpCidr],
) -> Option<IpAddr> {
    let mut values = headers
        .filter(|(name, _)| name.eq_ignore_ascii_case(header.name()))
        .map(|(_, value)| value);
    match header {
        ForwardedHeader::XForwardedFor => {
            // Several header lines are one list, in order (RFC 9110, 5.3).
            let entries: Vec<&[u8]> = values.flat_map(|v| v.split(|&b| b == b',')).collect();
            let is_trusted = |ip: IpAddr| trusted.iter().any(|n| n.contains(ip));
            let mut client = None;
            for entry in entries.iter().rev() {
                // A trusted hop wrote something that is no address: the list is unusable.
                let ip = forwarded_ip(entry)?;
                client = Some(ip);
                if !is_trusted(ip) {
                    break;
                }
            }
            client
        }
        ForwardedHeader::XRealIp => match (values.next(), values.next()) {
            (Some(one), None) => forwarded_ip(one),
            _ => None,
        },
    }
}

/// One address of a forwarded header: `ip`, `ipv4:port`, `[ipv6]` or `[ipv6]:port`, with
/// surrounding spaces; IPv4-mapped IPv6 as IPv4.
fn forwarded_ip(entry: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(entry).ok()?.trim_matches([' ', '\t']);
    let ip = if let Ok(ip) = text.parse::<IpAddr>() {
        ip
    } else if let Ok(sa) = text.parse::<SocketAddr>() {
        sa.ip()
    } else {
        text.strip_prefix('[')?.strip_suffix(']')?.parse().ok()?
    };
    Some(ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpCidr> {
        list.iter().map(|n| n.parse().expect("cidr")).collect()
    }

    fn named_in(
        header: ForwardedHeader,
        headers: &[(&str, &str)],
        trusted: &[&str],
    ) -> Option<IpAddr> {
        let pairs = headers.iter().map(|(n, v)| (*n, v.as_bytes()));
        forwarded_client(pairs, header, &nets(trusted))
    }

    fn client(headers: &[(&str, &str)], trusted: &[&str]) -> Option<IpAddr> {
        named_in(ForwardedHeader::XForwardedFor, headers, trusted)
    }

    fn real_ip_client(headers: &[(&str, &str)], trusted: &[&str]) -> Option<IpAddr> {
        named_in(ForwardedHeader::XRealIp, headers, trusted)
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().expect("ip"))
    }

    #[test]
    fn the_client_is_the_rightmost_untrusted_forwarded_for_entry() {
        let trusted = ["127.0.0.0/8", "10.0.0.0/8"];
        // One nginx: it appended the address it saw.
        assert_eq!(
            client(&[("X-Forwarded-For", "203.0.113.7")], &trusted),
            ip("203.0.113.7")
        );
        // The client sent its own header to forge an address: nginx appended the real one.
        assert_eq!(
            client(
                &[("x-forwarded-for", "198.51.100.1, 203.0.113.7")],
                &trusted
            ),
            ip("203.0.113.7")
        );
        // Two trusted proxies in a chain: skipped from the right.
        assert_eq!(
            client(
                &[("X-Forwarded-For", "198.51.100.1, 203.0.113.7, 10.1.2.3")],
                &trusted
            ),
            ip("203.0.113.7")
        );
        // Several header lines are one list.
        assert_eq!(
            client(
                &[
                    ("X-Forwarded-For", "198.51.100.1"),
                    ("X-Forwarded-For", "203.0.113.7,10.1.2.3")
                ],
                &trusted
            ),
            ip("203.0.113.7")
        );
        // Every entry a trusted proxy: the leftmost.
        assert_eq!(
            client(&[("X-Forwarded-For", "10.0.0.9, 127.0.0.1")], &trusted),
            ip("10.0.0.9")
        );
        // Ports, brackets and mapped addresses.
        assert_eq!(
            client(&[("X-Forwarded-For", "[2001:db8::7]:443")], &trusted),
            ip("2001:db8::7")
        );
        assert_eq!(
            client(&[("X-Forwarded-For", "203.0.113.7:5000")], &trusted),
            ip("203.0.113.7")
        );
        assert_eq!(
            client(&[("X-Forwarded-For", "::ffff:203.0.113.7")], &trusted),
            ip("203.0.113.7")
        );
    }

    /// The header the operator did not name is never read: a proxy that sets only the other
    /// one passes it on as the client wrote it.
    #[test]
    fn only_the_named_header_is_read() {
        let trusted = ["127.0.0.1"];
        // X-Forwarded-For: a lone X-Real-IP is the client's own, whatever the list says.
        assert_eq!(client(&[("X-Real-IP", "203.0.113.8")], &trusted), None);
        assert_eq!(
            client(
                &[
                    ("X-Real-IP", "203.0.113.8"),
                    ("X-Forwarded-For", "198.51.100.2")
                ],
                &trusted
            ),
            ip("198.51.100.2")
        );
        // Garbage where a trusted hop wrote: the list is not used, and nothing stands in.
        assert_eq!(
            client(
                &[
                    ("X-Forwarded-For", "198.51.100.2, unknown"),
                    ("X-Real-IP", "203.0.113.8")
                ],
                &trusted
            ),
            None
        );
        assert_eq!(client(&[("Host", "x")], &trusted), None);
        assert_eq!(client(&[("X-Forwarded-For", "")], &trusted), None);

        // X-Real-IP (nginx with `proxy_set_header X-Real-IP $remote_addr` and nothing else):
        // the client's own X-Forwarded-For came through untouched and names nobody.
        assert_eq!(
            real_ip_client(
                &[
                    ("X-Forwarded-For", "198.51.100.2"),
                    ("x-real-ip", "203.0.113.8")
                ],
                &trusted
            ),
            ip("203.0.113.8")
        );
        assert_eq!(
            real_ip_client(&[("X-Forwarded-For", "198.51.100.2")], &trusted),
            None
        );
        assert_eq!(
            real_ip_client(&[("X-Real-IP", " [2001:db8::8]:443 ")], &trusted),
            ip("2001:db8::8")
        );
        // Two X-Real-IP lines: which one? Neither.
        assert_eq!(
            real_ip_client(
                &[("X-Real-IP", "203.0.113.8"), ("X-Real-IP", "203.0.113.9")],
                &trusted
            ),
            None
        );
        assert_eq!(real_ip_client(&[("X-Real-IP", "unknown")], &trusted), None);
    }
}

#[cfg(test)]
mod listener_tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpSocket, TcpStream};

    use super::*;
    use crate::{Server, ServerConfig};

    /// Longer than the handshake deadline (10 s), which a stalled proxy runs into.
    const WITHIN: Duration = Duration::from_secs(30);

    /// A server taking PROXY protocol from `from` on a loopback listener.
    async fn server(from: &str) -> (Server, Registry, SocketAddr) {
        server_with(from, crate::ConnLimits::default()).await
    }

    async fn server_with(from: &str, limits: crate::ConnLimits) -> (Server, Registry, SocketAddr) {
        let mut config = ServerConfig::new(derp_testkit::server_secret());
        config.proxy_protocol = Some(vec![from.parse().expect("cidr")]);
        config.limits = limits;
        let registry = Registry::new();
        let server = Server::new(config, &registry).expect("server");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s = server.clone();
        tokio::spawn(async move { s.serve(listener).await });
        (server, registry, addr)
    }

    async fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{source}:0").parse().expect("addr"))
            .expect("bind");
        socket.connect(to).await.expect("connect")
    }

    /// Everything the server sends until it closes (a reset, for bytes it never read, is a
    /// close too).
    async fn answer(mut s: TcpStream) -> String {
        let mut out = Vec::new();
        let read = async {
            while let Ok(n) = s.read_buf(&mut out).await {
                if n == 0 {
                    break;
                }
            }
        };
        tokio::time::timeout(WITHIN, read)
            .await
            .expect("closed in time");
        String::from_utf8_lossy(&out).into_owned()
    }

    fn count(r: &Registry, name: &str, label: &str) -> f64 {
        r.gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                m.get_label().iter().any(|l| l.value() == "main")
                    && m.get_label().iter().any(|l| l.value() == label)
            })
            .map(|m| m.get_counter().get_value())
            .sum()
    }

    const PROBE: &[u8] = b"GET /derp/probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    const VARZ: &[u8] = b"GET /debug/varz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

    fn header_v2(client: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let addresses = Addresses::Tcp {
            source: client.parse().expect("addr"),
            destination: "127.0.0.1:443".parse().expect("addr"),
        };
        proxy_protocol::write_v2(Command::Proxy, &addresses, &[(0x04, b"pad")], &mut out)
            .expect("fits");
        out
    }

    #[tokio::test]
    async fn listed_proxies_with_a_header_get_in_and_everything_else_is_refused_and_counted() {
        let (server, r, addr) = server("127.0.0.1/32").await;

        // A v2 header and a request in one write, then a v1 header and one in two.
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(&[header_v2("203.0.113.9:4000"), PROBE.to_vec()].concat())
            .await
            .expect("write");
        assert!(answer(s).await.starts_with("HTTP/1.1 200"));
        let mut s = connect_from("127.0.0.1", addr).await;
        let mut v1 = Vec::new();
        proxy_protocol::write_v1(
            &Addresses::Tcp {
                source: "198.51.100.4:5000".parse().expect("addr"),
                destination: "127.0.0.1:443".parse().expect("addr"),
            },
            &mut v1,
        );
        s.write_all(&v1[..10]).await.expect("write");
        s.write_all(&[&v1[10..], PROBE].concat())
            .await
            .expect("write");
        assert!(answer(s).await.starts_with("HTTP/1.1 200"));
        assert_eq!(count(&r, "derp_proxy_protocol_headers", "proxy"), 2.0);

        // LOCAL (a health check) is served as the proxy's own connection.
        let mut s = connect_from("127.0.0.1", addr).await;
        let mut local = Vec::new();
        proxy_protocol::write_v2(Command::Local, &Addresses::Unspecified, &[], &mut local)
            .expect("fits");
        s.write_all(&[local, PROBE.to_vec()].concat())
            .await
            .expect("write");
        assert!(answer(s).await.starts_with("HTTP/1.1 200"));
        assert_eq!(count(&r, "derp_proxy_protocol_headers", "local"), 1.0);

        // /debug never through a proxy, even for a client on loopback.
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(&[header_v2("127.0.0.1:4000"), VARZ.to_vec()].concat())
            .await
            .expect("write");
        assert!(answer(s).await.starts_with("HTTP/1.1 403"));

        // No header: closed without an answer.
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(PROBE).await.expect("write");
        assert_eq!(answer(s).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "no_header"), 1.0);

        // A malformed one: version 2's signature with version 1 in it.
        let mut s = connect_from("127.0.0.1", addr).await;
        let mut bad = header_v2("203.0.113.9:4000");
        bad[12] = 0x11;
        s.write_all(&[bad, PROBE.to_vec()].concat())
            .await
            .expect("write");
        assert_eq!(answer(s).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "malformed"), 1.0);

        // Half a header, then the proxy leaves.
        let mut s = connect_from("127.0.0.1", addr).await;
        s.write_all(&header_v2("203.0.113.9:4000")[..20])
            .await
            .expect("write");
        s.shutdown().await.expect("shutdown");
        assert_eq!(answer(s).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "closed"), 1.0);

        // A peer that is not a listed proxy: closed at accept, whatever it sends.
        let mut s = connect_from("127.0.0.2", addr).await;
        let _ = s
            .write_all(&[header_v2("203.0.113.9:4000"), PROBE.to_vec()].concat())
            .await;
        assert_eq!(answer(s).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "not_allowed"), 1.0);
        server.shutdown().await;
    }

    /// Names for `/bootstrap-dns`: `pub.example` for everyone, `hidden.example` only to
    /// clients in a 50 % rollout.
    #[derive(Debug)]
    struct Names;

    impl crate::Resolver for Names {
        fn lookup_ip<'a>(&'a self, name: &'a str) -> crate::LookupFuture<'a, Vec<IpAddr>> {
            let found = match name {
                "pub.example" => Ok(vec![IpAddr::from([192, 0, 2, 7])]),
                "hidden.example" => Ok(vec![IpAddr::from([192, 0, 2, 1])]),
                _ => Err(std::io::ErrorKind::NotFound.into()),
            };
            Box::pin(async move { found })
        }

        fn lookup_txt<'a>(&'a self, name: &'a str) -> crate::LookupFuture<'a, Vec<String>> {
            let found = match name {
                "rollout.example" => Ok(vec!["50".to_owned()]),
                _ => Err(std::io::ErrorKind::NotFound.into()),
            };
            Box::pin(async move { found })
        }
    }

    /// `/bootstrap-dns` draws a client's rollout share from the address its connection was
    /// admitted with: a PROXY protocol header's client, or the client a trusted HTTP proxy
    /// (here one behind the balancer) names; never the proxy's own.
    #[tokio::test]
    async fn bootstrap_dns_rolls_out_by_the_proxied_client() {
        let in_rollout = |ip: &str| crate::address_in_rollout(ip.parse().expect("ip"), 0.5);
        // An address on the other side of the rollout from `ip`: where answering by the
        // wrong address gives the wrong answer.
        let opposite = |ip: &str| {
            (1..=254)
                .map(|i| format!("203.0.113.{i}"))
                .find(|c| in_rollout(c) != in_rollout(ip))
                .expect("some addresses fall on each side")
        };
        let http_proxy = "192.0.2.10";

        let registry = Registry::new();
        let dns = crate::BootstrapDns::new(
            crate::BootstrapDnsConfig {
                published: "pub.example".into(),
                unpublished: "hidden.example/rollout.example".into(),
            },
            Arc::new(Names),
            &registry,
        )
        .expect("metrics");
        dns.refresh().await;
        let mut config = ServerConfig::new(derp_testkit::server_secret());
        config.proxy_protocol = Some(vec!["127.0.0.1/32".parse().expect("cidr")]);
        config.trust_forwarded_from = vec![format!("{http_proxy}/32").parse().expect("cidr")];
        config.bootstrap_dns = Some(Arc::new(dns));
        let server = Server::new(config, &registry).expect("server");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s = server.clone();
        tokio::spawn(async move { s.serve(listener).await });

        let ask = |header_client: String, extra: String| async move {
            let mut s = connect_from("127.0.0.1", addr).await;
            let request = format!(
                "GET /bootstrap-dns?q=hidden.example HTTP/1.1\r\nHost: x\r\n{extra}\
                 Connection: close\r\n\r\n"
            );
            s.write_all(&[header_v2(&header_client), request.into_bytes()].concat())
                .await
                .expect("write");
            let answer = answer(s).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            answer.contains("hidden.example")
        };
        // The balancer's header names the client.
        let client = opposite(http_proxy);
        assert_eq!(
            ask(format!("{client}:4000"), String::new()).await,
            in_rollout(&client),
            "{client} by its PROXY header"
        );
        // The header names an HTTP proxy, which names the client.
        assert_eq!(
            ask(
                format!("{http_proxy}:4000"),
                format!("X-Forwarded-For: {client}\r\n")
            )
            .await,
            in_rollout(&client),
            "{client} named by the trusted HTTP proxy {http_proxy}"
        );
        // A client that is no trusted proxy names nobody, itself included.
        let named = opposite(&client);
        assert_eq!(
            ask(
                format!("{client}:4000"),
                format!("X-Forwarded-For: {named}\r\n")
            )
            .await,
            in_rollout(&client),
            "{client} naming {named}"
        );
        server.shutdown().await;
    }

    #[tokio::test]
    async fn a_connection_evicted_before_its_header_is_counted_as_refused() {
        let limits = crate::ConnLimits {
            max_unproven: 1,
            ..crate::ConnLimits::default()
        };
        let (server, r, addr) = server_with("127.0.0.1/32", limits).await;
        let mut first = connect_from("127.0.0.1", addr).await;
        first
            .write_all(&header_v2("203.0.113.9:4000")[..20])
            .await
            .expect("write");
        // The budget holds one unproven connection: the next one evicts the first.
        let _second = connect_from("127.0.0.1", addr).await;
        assert_eq!(answer(first).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "evicted"), 1.0);
        server.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxy_that_stalls_is_cut_off_at_the_handshake_deadline() {
        let (server, r, addr) = server("127.0.0.1/32").await;
        let s = connect_from("127.0.0.1", addr).await;
        // Paused time runs ahead while nothing else can happen: the deadline passes.
        assert_eq!(answer(s).await, "");
        assert_eq!(count(&r, "derp_proxy_protocol_refused", "timeout"), 1.0);
        server.shutdown().await;
    }
}
