//! The PROXY protocol (HAProxy's `proxy-protocol.txt`, versions 1 and 2), both sides, without
//! IO: the header a TCP proxy or load balancer puts in front of a connection it passes on,
//! saying whose connection it is.
//!
//! Receiving side: [`parse`] reads a header from the first bytes of a connection. It is
//! incremental: given the bytes read so far it returns the header and its length, says how
//! many more bytes it needs at least, or refuses the bytes as soon as they cannot start a
//! valid header. It is strict, as the specification asks of receivers: no guessing whether a
//! header is there ([`ProxyError::NotProxy`] when the first bytes are neither version's
//! signature), exactly one space between version 1's fields, no leading zeros, a CRLF within
//! 107 bytes and never a lone CR or LF, only version 2's assigned version, command, family
//! and transport values, an address length that covers the family's addresses, and TLVs that
//! exactly fill the rest. TLVs are checked for shape and otherwise ignored (the optional
//! CRC32C one is not verified).
//!
//! Sending side: [`write_v1`] and [`write_v2`], for tests and tools that play the proxy.
//!
//! It does not read sockets, decide which peers may send a header, or what a server does with
//! the address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The longest version 1 header, CRLF included (`PROXY UNKNOWN` with two full IPv6 addresses
/// and ports).
pub const V1_MAX_LEN: usize = 107;
/// The longest version 2 header: the 16 fixed bytes and a 16-bit length.
pub const V2_MAX_LEN: usize = 16 + u16::MAX as usize;
/// The 12 bytes every version 2 header starts with.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// What starts a version 1 header: `PROXY` and its one space.
const V1_SIGNATURE: &[u8] = b"PROXY ";
/// `PROXY UNKNOWN\r\n`, the shortest version 1 header.
const V1_MIN_LEN: usize = 15;
/// `PROXY TCP6 :: :: 0 0\r\n` and `PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n`, the shortest lines
/// with addresses.
const V1_MIN_TCP6_LEN: usize = 22;
const V1_MIN_TCP4_LEN: usize = 32;
const V2_FIXED_LEN: usize = 16;
/// Address block sizes of version 2's families: two addresses, then two ports for IP.
const V2_INET_LEN: usize = 12;
const V2_INET6_LEN: usize = 36;
const V2_UNIX_LEN: usize = 216;

/// Which version of the protocol a header was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Version {
    /// The text line.
    V1,
    /// The binary header.
    V2,
}

/// What the sender says the connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// Version 2's LOCAL: the proxy's own connection (a health check), not one it relays. The
    /// receiver uses the connection's real endpoints.
    Local,
    /// A connection relayed for a client (every version 1 header).
    Proxy,
}

/// The relayed connection's endpoints, as the header gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Addresses {
    /// None given: version 1's `UNKNOWN`, version 2's unspecified family or transport, and
    /// anything under LOCAL. The receiver uses the connection's real endpoints.
    Unspecified,
    /// TCP over IPv4 or IPv6.
    Tcp {
        /// The client's end.
        source: SocketAddr,
        /// The end the client connected to (the proxy's listener).
        destination: SocketAddr,
    },
    /// UDP over IPv4 or IPv6 (version 2 only).
    Udp {
        /// The client's end.
        source: SocketAddr,
        /// The end the client sent to.
        destination: SocketAddr,
    },
    /// Unix sockets (version 2 only); the paths are not kept.
    Unix,
}

/// A complete, valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// The version it was sent in.
    pub version: Version,
    /// LOCAL or PROXY.
    pub command: Command,
    /// The relayed connection's endpoints.
    pub addresses: Addresses,
}

impl Header {
    /// The address of the client a TCP connection was relayed for; `None` when the receiver
    /// must use the connection's own peer (LOCAL, unspecified or Unix addresses) or the
    /// header describes something other than TCP.
    pub fn tcp_source(&self) -> Option<SocketAddr> {
        match (self.command, self.addresses) {
            (Command::Proxy, Addresses::Tcp { source, .. }) => Some(source),
            _ => None,
        }
    }
}

/// What [`parse`] made of the bytes so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header, `len` bytes long; what follows it is the connection's own data.
    Complete {
        /// The header.
        header: Header,
        /// Its length in bytes.
        len: usize,
    },
    /// A valid start: at least `needed` more bytes must be read (never more than the header
    /// still lacks, so reading exactly that many never takes the connection's own data).
    Incomplete {
        /// How many more bytes are needed at least.
        needed: usize,
    },
}

/// Why the bytes are not a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    /// The bytes start with neither version's signature: no header was sent.
    #[error("no PROXY protocol header")]
    NotProxy,
    /// A signature, then something the specification does not allow.
    #[error("malformed PROXY protocol header: {0}")]
    Malformed(&'static str),
}

fn malformed<T>(why: &'static str) -> Result<T, ProxyError> {
    Err(ProxyError::Malformed(why))
}

/// Reads a header from the start of `buf`, the first bytes received on a connection. Call it
/// again with more bytes while it answers [`Parsed::Incomplete`]; it starts over each time
/// (a header is at most a few hundred bytes in practice).
pub fn parse(buf: &[u8]) -> Result<Parsed, ProxyError> {
    let Some(&first) = buf.first() else {
        return Ok(Parsed::Incomplete { needed: 1 });
    };
    let (signature, v1) = if first == V1_SIGNATURE[0] {
        (V1_SIGNATURE, true)
    } else {
        (&V2_SIGNATURE[..], false)
    };
    let seen = buf.len().min(signature.len());
    if buf[..seen] != signature[..seen] {
        return Err(ProxyError::NotProxy);
    }
    if v1 { parse_v1(buf) } else { parse_v2(buf) }
}

fn parse_v1(buf: &[u8]) -> Result<Parsed, ProxyError> {
    let window = &buf[..buf.len().min(V1_MAX_LEN)];
    let Some(end) = window.iter().position(|&b| b == b'\n') else {
        if buf.len() >= V1_MAX_LEN {
            return malformed("no CRLF within 107 bytes");
        }
        check_v1_start(buf)?;
        let proto = buf.get(V1_SIGNATURE.len()..).unwrap_or_default();
        let min = if proto.starts_with(b"TCP4") {
            V1_MIN_TCP4_LEN
        } else if proto.starts_with(b"TCP") {
            V1_MIN_TCP6_LEN
        } else {
            V1_MIN_LEN
        };
        let crlf = if buf.last() == Some(&b'\r') { 1 } else { 2 };
        return Ok(Parsed::Incomplete {
            needed: min.saturating_sub(buf.len()).max(crlf),
        });
    };
    if end < V1_SIGNATURE.len() || buf[end - 1] != b'\r' {
        return malformed("a line feed without a carriage return");
    }
    let line = &buf[V1_SIGNATURE.len()..end - 1];
    if line.contains(&b'\r') {
        return malformed("a carriage return inside the line");
    }
    let addresses = v1_addresses(line)?;
    Ok(Parsed::Complete {
        header: Header {
            version: Version::V1,
            command: Command::Proxy,
            addresses,
        },
        len: end + 1,
    })
}

/// Refuses an unfinished version 1 line as soon as it cannot become a valid one: an unknown
/// protocol word, a stray CR, or bytes no address or port is made of.
fn check_v1_start(buf: &[u8]) -> Result<(), ProxyError> {
    let rest = &buf[V1_SIGNATURE.len().min(buf.len())..];
    if let Some(cr) = rest.iter().position(|&b| b == b'\r')
        && cr + 1 < rest.len()
    {
        return malformed("a carriage return inside the line");
    }
    let word_len = rest
        .iter()
        .position(|&b| b == b' ' || b == b'\r')
        .unwrap_or(rest.len());
    let word = &rest[..word_len];
    let known: &[&[u8]] = &[b"TCP4", b"TCP6", b"UNKNOWN"];
    let complete = word_len < rest.len();
    let fits = known.iter().any(|k| {
        if complete {
            *k == word
        } else {
            k.starts_with(word)
        }
    });
    if !fits {
        return malformed("unknown protocol");
    }
    if word.starts_with(b"TCP")
        && !rest[word_len..]
            .iter()
            .all(|&b| b.is_ascii_hexdigit() || matches!(b, b' ' | b'.' | b':' | b'\r'))
    {
        return malformed("a character no address or port has");
    }
    Ok(())
}

fn v1_addresses(line: &[u8]) -> Result<Addresses, ProxyError> {
    if line == b"UNKNOWN" || line.starts_with(b"UNKNOWN ") {
        // The sender may put anything after UNKNOWN; the receiver ignores it.
        return Ok(Addresses::Unspecified);
    }
    let mut fields = line.split(|&b| b == b' ');
    let (Some(proto), Some(src), Some(dst), Some(sport), Some(dport), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return malformed("not five fields separated by single spaces");
    };
    let (src, dst) = match proto {
        b"TCP4" => (
            IpAddr::V4(v1_ip::<Ipv4Addr>(src)?),
            IpAddr::V4(v1_ip::<Ipv4Addr>(dst)?),
        ),
        b"TCP6" => (
            IpAddr::V6(v1_ip::<Ipv6Addr>(src)?),
            IpAddr::V6(v1_ip::<Ipv6Addr>(dst)?),
        ),
        _ => return malformed("unknown protocol"),
    };
    Ok(Addresses::Tcp {
        source: SocketAddr::new(src, v1_port(sport)?),
        destination: SocketAddr::new(dst, v1_port(dport)?),
    })
}

/// An address in its text form. Rust's parsers take exactly the forms the specification
/// allows: four decimal numbers without leading zeros for IPv4, RFC 4291 text for IPv6.
fn v1_ip<T: std::str::FromStr>(text: &[u8]) -> Result<T, ProxyError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or(ProxyError::Malformed(
            "an address not of the protocol's family",
        ))
}

fn v1_port(text: &[u8]) -> Result<u16, ProxyError> {
    let digits = !text.is_empty() && text.len() <= 5 && text.iter().all(u8::is_ascii_digit);
    if !digits || (text.len() > 1 && text[0] == b'0') {
        return malformed("a port that is not a decimal number without leading zeros");
    }
    let n = text.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0'));
    u16::try_from(n).or(malformed("a port above 65535"))
}

fn parse_v2(buf: &[u8]) -> Result<Parsed, ProxyError> {
    if let Some(&ver_cmd) = buf.get(12) {
        if ver_cmd >> 4 != 2 {
            return malformed("version 2 signature with another version");
        }
        if ver_cmd & 0x0f > 1 {
            return malformed("unassigned command");
        }
    }
    let local = buf.get(12).is_some_and(|b| b & 0x0f == 0);
    if let Some(&fam) = buf.get(13)
        && !local
        && (fam >> 4 > 3 || fam & 0x0f > 2)
    {
        return malformed("unassigned address family or transport");
    }
    if buf.len() < V2_FIXED_LEN {
        return Ok(Parsed::Incomplete {
            needed: V2_FIXED_LEN - buf.len(),
        });
    }
    let body_len = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    let total = V2_FIXED_LEN + body_len;
    if buf.len() < total {
        return Ok(Parsed::Incomplete {
            needed: total - buf.len(),
        });
    }
    let body = &buf[V2_FIXED_LEN..total];
    let command = if local {
        Command::Local
    } else {
        Command::Proxy
    };
    let addresses = if local {
        // The family and whatever follows are the proxy's business; the length is skipped.
        Addresses::Unspecified
    } else {
        v2_addresses(buf[13], body)?
    };
    Ok(Parsed::Complete {
        header: Header {
            version: Version::V2,
            command,
            addresses,
        },
        len: total,
    })
}

fn v2_addresses(fam: u8, body: &[u8]) -> Result<Addresses, ProxyError> {
    let (family, transport) = (fam >> 4, fam & 0x0f);
    if family == 0 || transport == 0 {
        // Unspecified: the addresses, if any, cannot be located and are ignored.
        return Ok(Addresses::Unspecified);
    }
    let need = match family {
        1 => V2_INET_LEN,
        2 => V2_INET6_LEN,
        _ => V2_UNIX_LEN,
    };
    if body.len() < need {
        return malformed("address length shorter than the family's addresses");
    }
    check_tlvs(&body[need..])?;
    let ip_pair = |len: usize| -> (IpAddr, IpAddr, u16, u16) {
        let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
        let (src, dst) = if len == 4 {
            let a: [u8; 4] = [body[0], body[1], body[2], body[3]];
            let b: [u8; 4] = [body[4], body[5], body[6], body[7]];
            (IpAddr::from(a), IpAddr::from(b))
        } else {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            a.copy_from_slice(&body[..16]);
            b.copy_from_slice(&body[16..32]);
            (IpAddr::from(a), IpAddr::from(b))
        };
        (src, dst, port(2 * len), port(2 * len + 2))
    };
    let (src, dst, sport, dport) = match family {
        1 => ip_pair(4),
        2 => ip_pair(16),
        _ => return Ok(Addresses::Unix),
    };
    let (source, destination) = (SocketAddr::new(src, sport), SocketAddr::new(dst, dport));
    Ok(if transport == 1 {
        Addresses::Tcp {
            source,
            destination,
        }
    } else {
        Addresses::Udp {
            source,
            destination,
        }
    })
}

/// The TLVs after the addresses must fill the rest exactly: a type byte, a 16-bit length,
/// that many bytes, again. Their contents are not looked at.
fn check_tlvs(mut rest: &[u8]) -> Result<(), ProxyError> {
    while !rest.is_empty() {
        if rest.len() < 3 {
            return malformed("a TLV shorter than its type and length");
        }
        let len = usize::from(u16::from_be_bytes([rest[1], rest[2]]));
        rest = rest
            .get(3 + len..)
            .ok_or(ProxyError::Malformed("a TLV longer than the header"))?;
    }
    Ok(())
}

/// Appends a version 1 line for `addresses`: `TCP4` when both ends are IPv4, `TCP6` when
/// either is IPv6 (an IPv4 end then written IPv4-mapped), `UNKNOWN` for anything else.
pub fn write_v1(addresses: &Addresses, out: &mut Vec<u8>) {
    let line = match *addresses {
        Addresses::Tcp {
            source,
            destination,
        } => match (source.ip(), destination.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => format!(
                "PROXY TCP4 {s} {d} {} {}\r\n",
                source.port(),
                destination.port()
            ),
            (s, d) => format!(
                "PROXY TCP6 {} {} {} {}\r\n",
                v6(s),
                v6(d),
                source.port(),
                destination.port()
            ),
        },
        _ => "PROXY UNKNOWN\r\n".to_owned(),
    };
    out.extend_from_slice(line.as_bytes());
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// TLVs for [`write_v2`] longer than a header can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("PROXY protocol header longer than 65551 bytes")]
pub struct TooLong;

/// Appends a version 2 header: `command`, `addresses` (IPv4 when both ends are IPv4,
/// otherwise IPv6 with IPv4 ends mapped; zeroed paths for Unix) and the TLVs given as
/// (type, value).
pub fn write_v2(
    command: Command,
    addresses: &Addresses,
    tlvs: &[(u8, &[u8])],
    out: &mut Vec<u8>,
) -> Result<(), TooLong> {
    let mut body = Vec::new();
    let fam = match *addresses {
        Addresses::Unspecified => 0x00,
        Addresses::Unix => {
            body.resize(V2_UNIX_LEN, 0);
            0x31
        }
        Addresses::Tcp {
            source,
            destination,
        }
        | Addresses::Udp {
            source,
            destination,
        } => {
            let transport = if matches!(addresses, Addresses::Tcp { .. }) {
                1
            } else {
                2
            };
            let family = match (source.ip(), destination.ip()) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    body.extend_from_slice(&s.octets());
                    body.extend_from_slice(&d.octets());
                    0x10
                }
                (s, d) => {
                    body.extend_from_slice(&v6(s).octets());
                    body.extend_from_slice(&v6(d).octets());
                    0x20
                }
            };
            body.extend_from_slice(&source.port().to_be_bytes());
            body.extend_from_slice(&destination.port().to_be_bytes());
            family | transport
        }
    };
    for (kind, value) in tlvs {
        let len = u16::try_from(value.len()).map_err(|_| TooLong)?;
        body.push(*kind);
        body.extend_from_slice(&len.to_be_bytes());
        body.extend_from_slice(value);
    }
    let len = u16::try_from(body.len()).map_err(|_| TooLong)?;
    out.extend_from_slice(&V2_SIGNATURE);
    out.push(match command {
        Command::Local => 0x20,
        Command::Proxy => 0x21,
    });
    out.push(fam);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&body);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rusts_address_parsers_take_only_the_forms_the_specification_allows() {
        assert!(v1_ip::<Ipv4Addr>(b"192.168.0.1").is_ok());
        for bad in [
            &b"192.168.0.01"[..],
            b"192.168.0",
            b"256.1.1.1",
            b"1.2.3.4.5",
            b"::1",
            b" 1.2.3.4",
        ] {
            assert!(v1_ip::<Ipv4Addr>(bad).is_err(), "{bad:?}");
        }
        assert!(v1_ip::<Ipv6Addr>(b"2001:db8::1").is_ok());
        assert!(v1_ip::<Ipv6Addr>(b"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff").is_ok());
        assert!(v1_ip::<Ipv6Addr>(b"1.2.3.4").is_err());
        assert!(v1_ip::<Ipv6Addr>(b"1::2::3").is_err());
        assert!(v1_ip::<Ipv6Addr>(b"fe80::1%eth0").is_err());
    }

    #[test]
    fn ports_are_decimal_without_leading_zeros() {
        assert_eq!(v1_port(b"0"), Ok(0));
        assert_eq!(v1_port(b"65535"), Ok(65535));
        for bad in [
            &b""[..],
            b"01",
            b"65536",
            b"99999",
            b"123456",
            b"-1",
            b"+1",
            b"1a",
        ] {
            assert!(v1_port(bad).is_err(), "{bad:?}");
        }
    }
}
