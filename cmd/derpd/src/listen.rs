//! The listen address (`-a`) as derper reads it: Go's `net.SplitHostPort`, then what
//! `net.Listen("tcp", …)` binds.
//!
//! - The port is a number or a service name (`:https`), looked up in `/etc/services` and then
//!   in Go's own small table; an empty port is 0 (any free port).
//! - No host, `0.0.0.0` or `::` binds one IPv6 socket with `IPV6_V6ONLY` off, which takes IPv4
//!   too (dual-stack on any host, whatever `net.ipv6.bindv6only` says), or IPv4 alone where
//!   the system has no IPv6.
//! - An IP literal binds that address (an IPv4-mapped one as IPv4, a zone as its interface).
//! - A host name is resolved, and only its first IPv4 address is bound (its first address if
//!   it has no IPv4 one), as Go does.
//!
//! TLS is decided, as derper decides it, by the port's text: `443` or `https`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, ToSocketAddrs};

use anyhow::{Context, bail};
use tokio::net::TcpListener;

use crate::limits::bind;

/// `-a` split as Go splits it, its port looked up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ListenAddr {
    /// The host part, without brackets; empty for every interface.
    pub(crate) host: String,
    /// The port as written: derper serves TLS when it is "443" or "https".
    pub(crate) port_text: String,
    /// The port number.
    pub(crate) port: u16,
}

/// Where the listeners bind, once the host is resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BindIp {
    /// Every interface, IPv4 and IPv6.
    Any,
    /// One address (an IPv6 one with its scope, for a link-local address).
    Ip(IpAddr, u32),
}

impl ListenAddr {
    /// Splits and checks `text` without resolving anything.
    pub(crate) fn parse(text: &str) -> anyhow::Result<Self> {
        let (host, port_text) = split_host_port(text)
            .with_context(|| format!("invalid listen address (-a) {text:?}"))?;
        let port = lookup_port(port_text)
            .with_context(|| format!("invalid listen address (-a) {text:?}"))?;
        Ok(Self {
            host: host.to_owned(),
            port_text: port_text.to_owned(),
            port,
        })
    }

    /// Whether derper would serve TLS on this address whatever the certificate mode: the
    /// port's text is "443" or "https" (so ":0443" and ":HTTPS" bind 443 but serve plain
    /// HTTP, as derper's do).
    pub(crate) fn is_https_port(&self) -> bool {
        self.port_text == "443" || self.port_text == "https"
    }

    /// The address to bind: a name is looked up (through the system's resolver) now.
    pub(crate) fn resolve(&self) -> anyhow::Result<BindIp> {
        if let Some(ip) = parse_ip(&self.host)? {
            return Ok(ip);
        }
        if looks_numeric(&self.host) {
            bail!(
                "looking up the listen host (-a) {:?}: no such host (an address must be \
                 written in full, as derper requires too)",
                self.host
            );
        }
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .with_context(|| format!("looking up the listen host (-a) {:?}", self.host))?
            .collect();
        let chosen = addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or_else(|| addrs.first())
            .with_context(|| format!("the listen host (-a) {:?} has no address", self.host))?;
        Ok(match chosen {
            SocketAddr::V4(a) => BindIp::Ip(IpAddr::V4(*a.ip()), 0),
            SocketAddr::V6(a) => BindIp::Ip(IpAddr::V6(*a.ip()), a.scope_id()),
        })
    }
}

impl BindIp {
    /// The address to bind `port` on: every interface as IPv6's unspecified address.
    pub(crate) fn with_port(self, port: u16) -> SocketAddr {
        match self {
            BindIp::Any => SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
            BindIp::Ip(IpAddr::V4(ip), _) => SocketAddr::from((ip, port)),
            BindIp::Ip(IpAddr::V6(ip), scope) => SocketAddrV6::new(ip, port, 0, scope).into(),
        }
    }

    /// The address itself: every interface as IPv6's unspecified address.
    pub(crate) fn ip(self) -> IpAddr {
        self.with_port(0).ip()
    }

    /// How `--check` shows it.
    pub(crate) fn describe(self, port: u16) -> String {
        self.with_port(port).to_string()
    }
}

/// Go's `net.SplitHostPort`: the port after the last colon; a host with a colon must be in
/// brackets; anything may be in brackets.
fn split_host_port(s: &str) -> anyhow::Result<(&str, &str)> {
    let Some(last) = s.rfind(':') else {
        bail!("missing port in address");
    };
    let (host, inner_from, inner_to) = if s.starts_with('[') {
        let Some(end) = s.find(']') else {
            bail!("missing ']' in address");
        };
        if end + 1 == s.len() {
            bail!("missing port in address");
        } else if end + 1 != last {
            if s.as_bytes()[end + 1] == b':' {
                bail!("too many colons in address");
            }
            bail!("missing port in address");
        }
        (&s[1..end], 1, end + 1)
    } else {
        let host = &s[..last];
        if host.contains(':') {
            bail!("too many colons in address; write an IPv6 address in brackets, [::1]:443");
        }
        (host, 0, 0)
    };
    if s[inner_from..].contains('[') {
        bail!("unexpected '[' in address");
    }
    if s[inner_to..].contains(']') {
        bail!("unexpected ']' in address");
    }
    Ok((host, &s[last + 1..]))
}

/// A TCP port as Go's resolver reads one: decimal (a sign and leading zeros allowed), a
/// service name, or nothing (0).
fn lookup_port(text: &str) -> anyhow::Result<u16> {
    if text.is_empty() {
        return Ok(0);
    }
    let (neg, digits) = match text.as_bytes()[0] {
        b'+' => (false, &text[1..]),
        b'-' => (true, &text[1..]),
        _ => (false, text),
    };
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        let n = digits.trim_start_matches('0');
        return match n.parse::<u32>() {
            _ if n.is_empty() => Ok(0),
            Ok(p) if !neg && p <= 0xffff => Ok(p as u16),
            _ => bail!("invalid port {text:?}"),
        };
    }
    service_port(text)
        .with_context(|| format!("unknown port {text:?} (not a number or a tcp service)"))
}

/// A tcp service's port: from /etc/services, else Go's built-in table. Names match without
/// regard to case.
fn service_port(name: &str) -> Option<u16> {
    let name = name.to_ascii_lowercase();
    if let Ok(text) = std::fs::read_to_string("/etc/services")
        && let Some(port) = services_lookup(&text, &name)
    {
        return Some(port);
    }
    GO_SERVICES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, p)| *p)
}

/// Looks `name` (lower case) up among the tcp entries of a services(5) file.
fn services_lookup(text: &str, name: &str) -> Option<u16> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or("");
        let mut fields = line.split_whitespace();
        let service = fields.next()?;
        let (port, proto) = fields.next()?.split_once('/')?;
        let named = std::iter::once(service)
            .chain(fields)
            .any(|n| n.eq_ignore_ascii_case(name));
        (proto == "tcp" && named)
            .then(|| port.parse().ok())
            .flatten()
    })
}

/// Go's fallback when /etc/services does not name the service (net/lookup.go).
const GO_SERVICES: &[(&str, u16)] = &[
    ("ftp", 21),
    ("ftps", 990),
    ("gopher", 70),
    ("http", 80),
    ("https", 443),
    ("imap2", 143),
    ("imap3", 220),
    ("imaps", 993),
    ("pop3", 110),
    ("pop3s", 995),
    ("smtp", 25),
    ("submissions", 465),
    ("ssh", 22),
    ("telnet", 23),
];

/// The host as an address, if it is one (or empty): `None` for a name to look up.
/// Whether `host`, which is no IP address as Go reads one, is a number the C resolver would
/// take as one (`inet_aton`'s short forms: `127.1`, `2130706433`, `0x7f.1`, `0`). Go looks
/// such a name up as a host name, finds nothing, and derper does not start; getaddrinfo
/// would bind some address, `0` even IPv4's every-interface one without the dual stack.
fn looks_numeric(host: &str) -> bool {
    let parts: Vec<&str> = host.split('.').collect();
    parts.len() <= 4
        && parts.iter().all(
            |p| match p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
                Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
                None => !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()),
            },
        )
}

fn parse_ip(host: &str) -> anyhow::Result<Option<BindIp>> {
    if host.is_empty() {
        return Ok(Some(BindIp::Any));
    }
    let (addr, zone) = match host.split_once('%') {
        Some((a, z)) => (a, Some(z)),
        None => (host, None),
    };
    let Ok(ip) = addr.parse::<IpAddr>() else {
        return Ok(None);
    };
    // An IPv4-mapped address is bound as IPv4, as Go does.
    let ip = ip.to_canonical();
    if ip.is_unspecified() {
        return Ok(Some(BindIp::Any));
    }
    let scope = match (zone, ip) {
        (None, _) => 0,
        (Some(zone), IpAddr::V6(_)) => zone_index(zone)?,
        (Some(_), IpAddr::V4(_)) => bail!("invalid listen host (-a) {host:?}: a zone on IPv4"),
    };
    Ok(Some(BindIp::Ip(ip, scope)))
}

/// An IPv6 zone: an interface name or its index.
fn zone_index(zone: &str) -> anyhow::Result<u32> {
    if let Ok(index) = zone.parse() {
        return Ok(index);
    }
    std::fs::read_to_string(format!("/sys/class/net/{zone}/ifindex"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|_| !zone.contains('/'))
        .with_context(|| format!("no network interface named {zone:?}"))
}

/// The main listener on `ip`:`port`. Every interface is one dual-stack IPv6 socket, or IPv4
/// alone on a system without IPv6.
pub(crate) fn bind_main(
    ip: BindIp,
    port: u16,
    backlog: Option<u32>,
) -> anyhow::Result<TcpListener> {
    let addr = ip.with_port(port);
    match bind(addr, backlog) {
        Ok(listener) => Ok(listener),
        Err(e) if ip == BindIp::Any && !no_ipv4_fallback(&e) => {
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            bind(v4, backlog).with_context(|| format!("listening on {addr} ({e}), then on {v4}"))
        }
        Err(e) => Err(e).with_context(|| format!("listening on {addr}")),
    }
}

/// Errors that IPv4 would meet too: only a missing IPv6 is worth the fallback.
fn no_ipv4_fallback(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::AddrInUse | std::io::ErrorKind::PermissionDenied
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_as_go_splits_them() {
        for (text, host, port) in [
            (":443", "", "443"),
            (":https", "", "https"),
            ("127.0.0.1:3340", "127.0.0.1", "3340"),
            ("[::1]:80", "::1", "80"),
            ("[fe80::1%eth0]:80", "fe80::1%eth0", "80"),
            ("[localhost]:80", "localhost", "80"),
            ("localhost:3340", "localhost", "3340"),
            ("127.0.0.1:", "127.0.0.1", ""),
            (":", "", ""),
        ] {
            assert_eq!(split_host_port(text).expect(text), (host, port), "{text}");
        }
        for (text, why) in [
            ("nonsense", "missing port"),
            ("::1:80", "too many colons"),
            ("[::1]", "missing port"),
            ("[::1]x:80", "missing port"),
            ("[::1]:80:", "too many colons"),
            ("[::1:80", "missing ']'"),
            ("a[b:80", "unexpected '['"),
            ("a]b:80", "unexpected ']'"),
        ] {
            let err = split_host_port(text).expect_err(text).to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn ports_are_numbers_or_services() {
        for (text, port) in [
            ("443", 443),
            ("0443", 443),
            ("+80", 80),
            ("", 0),
            ("0", 0),
            ("-0", 0),
            ("https", 443),
            ("HTTPS", 443),
            ("http", 80),
            ("ssh", 22),
            ("65535", 65535),
        ] {
            assert_eq!(lookup_port(text).expect(text), port, "{text}");
        }
        for text in ["65536", "99999", "-1", "nosuchsvc", "4 43"] {
            assert!(lookup_port(text).is_err(), "{text}");
        }
        let services =
            "# comment\nhttp\t80/tcp www # WorldWideWeb\nhttps 443/udp\nx-derp 8443/tcp derp-alt\n";
        assert_eq!(services_lookup(services, "www"), Some(80));
        assert_eq!(services_lookup(services, "https"), None, "udp only");
        assert_eq!(services_lookup(services, "derp-alt"), Some(8443));
        // Go's own table stands in where the file does not say.
        assert_eq!(
            GO_SERVICES
                .iter()
                .find(|s| s.0 == "submissions")
                .map(|s| s.1),
            Some(465)
        );
    }

    #[test]
    fn tls_follows_the_port_text() {
        let https = |t: &str| ListenAddr::parse(t).expect(t).is_https_port();
        assert!(https(":443"));
        assert!(https(":https"));
        assert!(https("[::]:443"));
        assert!(!https(":0443"), "derper serves plain HTTP there");
        assert!(!https(":HTTPS"), "derper serves plain HTTP there");
        assert!(!https(":3340"));
    }

    #[test]
    fn hosts_resolve_as_go_binds_them() {
        let resolve = |t: &str| ListenAddr::parse(t).expect(t).resolve().expect(t);
        let ip = |s: &str| BindIp::Ip(s.parse().expect("ip"), 0);
        assert_eq!(resolve(":3340"), BindIp::Any);
        assert_eq!(resolve("0.0.0.0:3340"), BindIp::Any);
        assert_eq!(resolve("[::]:3340"), BindIp::Any);
        assert_eq!(resolve("127.0.0.1:3340"), ip("127.0.0.1"));
        assert_eq!(resolve("[::ffff:127.0.0.1]:3340"), ip("127.0.0.1"));
        assert_eq!(resolve("[::1]:3340"), ip("::1"));
        assert_eq!(
            resolve("[fe80::1%1]:3340"),
            BindIp::Ip("fe80::1".parse().expect("ip"), 1)
        );
        assert_eq!(
            resolve("[fe80::1%lo]:3340"),
            BindIp::Ip("fe80::1".parse().expect("ip"), 1)
        );
        // localhost has 127.0.0.1 (and often ::1): the first IPv4 address is bound.
        assert_eq!(resolve("localhost:3340"), ip("127.0.0.1"));
        assert_eq!(resolve("[localhost]:3340"), ip("127.0.0.1"));
        assert!(
            ListenAddr::parse("[fe80::1%nosuchif0]:1")
                .expect("parses")
                .resolve()
                .is_err()
        );
        // Short numeric forms the C resolver reads as addresses; Go (and derper) do not.
        for short in [
            "127.1",
            "2130706433",
            "0x7f.1",
            "0",
            "0x7f000001",
            "127.0.1",
        ] {
            let err = ListenAddr::parse(&format!("{short}:3340"))
                .expect("parses")
                .resolve()
                .expect_err(short);
            assert!(err.to_string().contains("no such host"), "{short}: {err}");
        }
    }

    /// Every IPv6 listener is dual-stack, so `[::]` (every interface) takes IPv4 too, whatever
    /// `net.ipv6.bindv6only` says. Checked before the bind: tests bind loopback only, and
    /// some kernels report a socket bound to `[::1]` as IPv6-only.
    #[tokio::test]
    async fn ipv6_listeners_are_dual_stack() {
        let any = BindIp::Any.with_port(0);
        assert_eq!(any, "[::]:0".parse().expect("addr"));
        let socket = crate::limits::tcp_socket(any).expect("socket");
        assert!(
            !socket2::SockRef::from(&socket)
                .only_v6()
                .expect("getsockopt")
        );
    }
}
