//! The STUN codec: both request parsers and the response parser on arbitrary datagrams, and
//! build → parse round trips on addresses and transaction IDs taken from the input.
//!
//! - An accepted request really is a binding request with the cookie, a length field equal
//!   to its attribute bytes (a multiple of 4), and the transaction ID from bytes 8..20; an
//!   accepted Tailscale request also ends in a FINGERPRINT that matches an independent CRC.
//! - An accepted response echoes bytes 8..20 and never yields an IPv4-mapped IPv6 address;
//!   the response derpd would send for that address parses back to the same pair.
//! - `binding_request` parses with both request parsers; `binding_response` parses back to its
//!   transaction ID and the (unmapped) address, and is 32 bytes for IPv4, 44 for IPv6.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use derp_proto::stun::{
    self, BINDING_REQUEST_LEN, HEADER_LEN, MAGIC_COOKIE, MAX_RESPONSE_LEN, StunError, TxId,
};

/// Fuzz target.
pub fn stun(data: &[u8]) {
    let tailscale = stun::parse_binding_request(data);
    let generic = stun::parse_generic_binding_request(data);
    for tx in [&tailscale, &generic].into_iter().flatten() {
        check_request_header(data, tx);
    }
    if tailscale.is_ok() {
        let n = data.len();
        assert!(n >= HEADER_LEN + 8, "no room for FINGERPRINT");
        assert_eq!(
            data[n - 8..n - 4],
            [0x80, 0x28, 0x00, 0x04],
            "last attribute"
        );
        let want = crc32fast::hash(&data[..n - 8]) ^ 0x5354_554e;
        assert_eq!(data[n - 4..], want.to_be_bytes(), "fingerprint");
    }

    if let Ok((tx, addr)) = stun::parse_response(data) {
        assert_eq!(data[0..2], [0x01, 0x01]);
        assert_eq!(tx.as_bytes()[..], data[8..HEADER_LEN]);
        assert_unmapped(addr);
        assert_eq!(response_round_trip(&tx, addr), (tx, addr));
    }

    // Round trips on values from the input.
    if let Some((tx, addr)) = tx_and_addr(data) {
        let request = stun::binding_request(&tx);
        assert_eq!(request.len(), BINDING_REQUEST_LEN);
        assert_eq!(stun::parse_binding_request(&request), Ok(tx));
        assert_eq!(stun::parse_generic_binding_request(&request), Ok(tx));
        assert_eq!(
            stun::parse_response(&request),
            Err(StunError::NotSuccessResponse)
        );

        let want = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        assert_eq!(response_round_trip(&tx, addr), (tx, want));
    }
}

fn check_request_header(data: &[u8], tx: &TxId) {
    assert!(data.len() >= HEADER_LEN);
    assert_eq!(data[0..2], [0x00, 0x01], "not a binding request");
    assert_eq!(data[4..8], MAGIC_COOKIE);
    let len = usize::from(u16::from_be_bytes([data[2], data[3]]));
    assert_eq!(len, data.len() - HEADER_LEN, "length field");
    assert_eq!(len % 4, 0, "length not padded");
    assert_eq!(tx.as_bytes()[..], data[8..HEADER_LEN]);
}

fn assert_unmapped(addr: SocketAddr) {
    if let IpAddr::V6(v6) = addr.ip() {
        assert!(v6.to_ipv4_mapped().is_none(), "IPv4-mapped address {addr}");
    }
}

/// Builds derpd's response for `tx`/`addr`, checks its size, and parses it back.
fn response_round_trip(tx: &TxId, addr: SocketAddr) -> (TxId, SocketAddr) {
    let mut out = [0u8; MAX_RESPONSE_LEN];
    let n = stun::binding_response(tx, addr, &mut out);
    let parsed = stun::parse_response(&out[..n]).expect("our own response parses");
    let want_len = if parsed.1.is_ipv4() { 32 } else { 44 };
    assert_eq!(n, want_len, "response size for {}", parsed.1);
    assert_eq!(
        stun::parse_binding_request(&out[..n]),
        Err(StunError::NotBindingRequest)
    );
    parsed
}

/// A transaction ID and address from the first 31 bytes, when there are that many.
fn tx_and_addr(data: &[u8]) -> Option<(TxId, SocketAddr)> {
    let bytes: &[u8; 31] = data.get(..31)?.try_into().ok()?;
    let mut tx = [0u8; 12];
    tx.copy_from_slice(&bytes[..12]);
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&bytes[12..28]);
    let port = u16::from_be_bytes([bytes[28], bytes[29]]);
    let ip = match bytes[30] % 3 {
        0 => IpAddr::V4(std::net::Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3])),
        1 => IpAddr::V6(Ipv6Addr::from(ip)),
        // An IPv4-mapped IPv6 address, as a dual-stack socket reports IPv4 peers.
        _ => IpAddr::V6(std::net::Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]).to_ipv6_mapped()),
    };
    Some((TxId::from(tx), SocketAddr::new(ip, port)))
}
