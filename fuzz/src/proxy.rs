//! The PROXY protocol parser on arbitrary first bytes of a connection, as the TCP listeners
//! read them from a load balancer.
//!
//! - It never panics, whatever the bytes.
//! - Fed the bytes one prefix at a time, it asks for more (never more than the header still
//!   lacks) until it settles once: a header that more bytes never change, or a refusal
//!   that more bytes never lift.
//! - A header never takes bytes past its own length, and what it says, written again by the
//!   writers of the same version, parses to the same header.

use derp_proto::proxy_protocol::{self, Addresses, Command, Parsed, Version};

/// Prefixes walked one by one: the longest valid version 1 header is 107 bytes, and a
/// version 2 header's length is known after 16.
const WALK: usize = 600;

/// Fuzz target.
pub fn proxy_protocol(data: &[u8]) {
    let whole = proxy_protocol::parse(data);
    let walk = &data[..data.len().min(WALK)];
    let mut settled = None;
    for cut in 0..=walk.len() {
        let got = proxy_protocol::parse(&walk[..cut]);
        match (&settled, got) {
            (None, Ok(Parsed::Incomplete { needed })) => {
                assert!(needed >= 1);
                if let Ok(Parsed::Complete { len, .. }) = whole {
                    assert!(cut + needed <= len, "needed {needed} at {cut} of {len}");
                }
            }
            (None, other) => settled = Some(other),
            (Some(Err(_)), got) => assert!(got.is_err(), "a refusal lifted: {got:?}"),
            (Some(first), got) => assert_eq!(&got, first, "more bytes changed the header"),
        }
    }
    if let (Some(first), true) = (&settled, data.len() > WALK) {
        match first {
            Err(_) => assert!(whole.is_err()),
            settled => assert_eq!(&whole, settled),
        }
    }
    let Ok(Parsed::Complete { header, len }) = whole else {
        return;
    };
    assert!(len <= data.len());
    let mut again = Vec::new();
    match header.version {
        Version::V1 => proxy_protocol::write_v1(&header.addresses, &mut again),
        Version::V2 => {
            proxy_protocol::write_v2(header.command, &header.addresses, &[], &mut again)
                .expect("no TLVs: always fits");
        }
    }
    let reparsed = proxy_protocol::parse(&again);
    let Ok(Parsed::Complete { header: h, len: n }) = reparsed else {
        panic!("{header:?} written again does not parse: {reparsed:?}");
    };
    assert_eq!(n, again.len());
    assert_eq!(h.version, header.version);
    assert_eq!(h.command, header.command);
    match header.addresses {
        // The writers map a mixed pair to IPv6, which the parsers keep as written.
        Addresses::Tcp {
            source,
            destination,
        }
        | Addresses::Udp {
            source,
            destination,
        } if source.is_ipv4() != destination.is_ipv4() => {}
        // LOCAL headers carry no addresses once parsed.
        _ if header.command == Command::Local => assert_eq!(h.addresses, Addresses::Unspecified),
        a => assert_eq!(h.addresses, a),
    }
}
