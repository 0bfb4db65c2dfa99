//! STUN binding requests and responses, as spoken on derper's UDP port (3478).
//!
//! This module is a codec only: it parses and builds datagrams in caller-supplied buffers and
//! never touches a socket. The server side answers [`parse_binding_request`] (Tailscale
//! clients only, as derper does) or, when an operator opts in, [`parse_generic_binding_request`]
//! (any RFC 5389/8489 client), replying with [`binding_response`]. The client side builds
//! [`binding_request`] and reads the answer with [`parse_response`].
//!
//! Not implemented: MESSAGE-INTEGRITY, error responses, RFC 3489 (cookie-less) messages, and
//! every method other than Binding.
//!
//! Design follows tailscale `net/stun/stun.go`; the rules are in PROTOCOL §4.4.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A 12-byte STUN transaction ID, echoed unchanged from request to response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TxId(pub [u8; TX_ID_LEN]);

impl TxId {
    /// Draws a fresh random transaction ID, as a client must for every request.
    pub fn generate(rng: &mut impl rand_core::RngCore) -> Self {
        let mut id = [0u8; TX_ID_LEN];
        rng.fill_bytes(&mut id);
        TxId(id)
    }

    /// The raw transaction ID bytes.
    pub fn as_bytes(&self) -> &[u8; TX_ID_LEN] {
        &self.0
    }
}

impl From<[u8; TX_ID_LEN]> for TxId {
    fn from(bytes: [u8; TX_ID_LEN]) -> Self {
        TxId(bytes)
    }
}

/// Why a datagram was not accepted as the STUN message the caller asked for.
///
/// The request variants are checked in the same order as Tailscale's parser, so a packet with
/// several faults reports the same reason Go would.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StunError {
    /// Shorter than a header, top two bits set, or wrong magic cookie.
    #[error("not a STUN packet")]
    NotStun,
    /// A STUN message, but not a Binding request (type 0x0001).
    #[error("STUN packet is not a binding request")]
    NotBindingRequest,
    /// The header's message length disagrees with the datagram size or is not a multiple of 4.
    #[error("STUN header length {header} does not match {actual} bytes of attributes")]
    LengthMismatch {
        /// The message length field from the header.
        header: u16,
        /// The number of bytes actually following the 20-byte header.
        actual: usize,
    },
    /// An attribute header or (padded) value runs past the end of the message, or an
    /// attribute value has an impossible size.
    #[error("malformed STUN attributes")]
    MalformedAttributes,
    /// No SOFTWARE attribute, or its value is not `tailnode`.
    #[error("STUN request came from non-Tailscale software")]
    WrongSoftware,
    /// The last attribute is not FINGERPRINT (Tailscale requests must end with one).
    #[error("STUN request didn't end in fingerprint")]
    NoFingerprint,
    /// A FINGERPRINT attribute is present but not the last attribute.
    #[error("STUN fingerprint is not the last attribute")]
    FingerprintNotLast,
    /// The FINGERPRINT value does not match the CRC-32 of the message before it.
    #[error("STUN request had bogus fingerprint")]
    BadFingerprint,
    /// A STUN message, but not a Binding success response (type 0x0101).
    #[error("STUN packet is not a binding success response")]
    NotSuccessResponse,
    /// A success response without a usable (XOR-)MAPPED-ADDRESS attribute.
    #[error("STUN response has no mapped address")]
    NoMappedAddress,
}

/// Parses a Tailscale binding request and returns its transaction ID.
///
/// This is the only kind of request derper answers (PROTOCOL §4.4): a Binding request whose
/// attributes are well formed with 4-byte padding, that carries SOFTWARE exactly `tailnode`,
/// and whose last attribute is a correct FINGERPRINT. Unlike Go, the header's length field must
/// also match the datagram size; every Tailscale client sends it that way.
pub fn parse_binding_request(packet: &[u8]) -> Result<TxId, StunError> {
    let attrs = request_attributes(packet)?;
    let mut software_ok = false;
    let mut last = None;
    for attr in Attributes::new(attrs) {
        let attr = attr?;
        // Go keeps only the verdict on the last SOFTWARE attribute; so do we.
        if attr.kind == ATTR_SOFTWARE {
            software_ok = attr.value == SOFTWARE;
        }
        last = Some(attr);
    }
    if !software_ok {
        return Err(StunError::WrongSoftware);
    }
    match last {
        Some(fp) if fp.kind == ATTR_FINGERPRINT => {
            check_fingerprint(packet, &fp)?;
            Ok(tx_id(packet))
        }
        _ => Err(StunError::NoFingerprint),
    }
}

/// Parses any well-formed RFC 5389/8489 binding request and returns its transaction ID.
///
/// Requires the magic cookie, type 0x0001, a header length equal to the attribute bytes (and so a
/// multiple of 4), and well-formed padded attributes. A FINGERPRINT is optional, but if present it
/// must be the last attribute and correct. SOFTWARE is not required. For servers that choose to
/// answer non-Tailscale STUN clients, which derper itself does not.
pub fn parse_generic_binding_request(packet: &[u8]) -> Result<TxId, StunError> {
    let attrs = request_attributes(packet)?;
    let mut fingerprint = None;
    for attr in Attributes::new(attrs) {
        let attr = attr?;
        if fingerprint.is_some() {
            return Err(StunError::FingerprintNotLast);
        }
        if attr.kind == ATTR_FINGERPRINT {
            fingerprint = Some(attr);
        }
    }
    if let Some(fp) = fingerprint {
        check_fingerprint(packet, &fp)?;
    }
    Ok(tx_id(packet))
}

/// Writes the Binding success response for a request with `tx` from `addr` into `out` and
/// returns its length: 32 bytes for an IPv4 address, 44 for IPv6.
///
/// The response is byte-identical to derper's: the header, then exactly one XOR-MAPPED-ADDRESS
/// and nothing else (no SOFTWARE, no FINGERPRINT). An IPv4-mapped IPv6 source (`::ffff:a.b.c.d`,
/// seen on dual-stack sockets) is answered as IPv4: the client sent from an IPv4 address and
/// expects that family back, and Tailscale's parser unmaps the address anyway, so this is also
/// what a Tailscale client ends up with.
pub fn binding_response(tx: &TxId, addr: SocketAddr, out: &mut [u8; MAX_RESPONSE_LEN]) -> usize {
    let (family, ip): (u8, [u8; 16]) = match addr.ip().to_canonical() {
        IpAddr::V4(v4) => (FAMILY_IPV4, v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => (FAMILY_IPV6, v6.octets()),
    };
    let addr_len = if family == FAMILY_IPV4 { 4 } else { 16 };
    let value_len = 4 + addr_len;
    let total = HEADER_LEN + 4 + value_len;

    out[0..2].copy_from_slice(&TYPE_BINDING_SUCCESS.to_be_bytes());
    // Lengths are at most 24, so these casts cannot truncate.
    out[2..4].copy_from_slice(&((4 + value_len) as u16).to_be_bytes());
    out[4..8].copy_from_slice(&MAGIC_COOKIE);
    out[8..HEADER_LEN].copy_from_slice(&tx.0);
    out[20..22].copy_from_slice(&ATTR_XOR_MAPPED_ADDRESS.to_be_bytes());
    out[22..24].copy_from_slice(&(value_len as u16).to_be_bytes());
    out[24] = 0;
    out[25] = family;
    out[26..28].copy_from_slice(&(addr.port() ^ COOKIE_HIGH).to_be_bytes());
    let key = xor_key(tx);
    for (i, (o, ip)) in out[28..total]
        .iter_mut()
        .zip(&ip[16 - addr_len..])
        .enumerate()
    {
        *o = ip ^ key[i];
    }
    total
}

/// Builds the 40-byte binding request a Tailscale client sends: the header, SOFTWARE
/// `tailnode` (first, which derper's XDP responder relies on), then FINGERPRINT.
pub fn binding_request(tx: &TxId) -> [u8; BINDING_REQUEST_LEN] {
    let mut b = [0u8; BINDING_REQUEST_LEN];
    b[0..2].copy_from_slice(&TYPE_BINDING_REQUEST.to_be_bytes());
    b[2..4].copy_from_slice(&((BINDING_REQUEST_LEN - HEADER_LEN) as u16).to_be_bytes());
    b[4..8].copy_from_slice(&MAGIC_COOKIE);
    b[8..HEADER_LEN].copy_from_slice(&tx.0);
    b[20..22].copy_from_slice(&ATTR_SOFTWARE.to_be_bytes());
    b[22..24].copy_from_slice(&(SOFTWARE.len() as u16).to_be_bytes());
    b[24..32].copy_from_slice(SOFTWARE);
    b[32..34].copy_from_slice(&ATTR_FINGERPRINT.to_be_bytes());
    b[34..36].copy_from_slice(&4u16.to_be_bytes());
    let fp = fingerprint(&b[..32]);
    b[36..40].copy_from_slice(&fp.to_be_bytes());
    b
}

/// Parses a Binding success response and returns its transaction ID and mapped address.
///
/// Follows Tailscale's client parser: XOR-MAPPED-ADDRESS (0x0020) or its pre-RFC number
/// (0x8020) wins, with legacy MAPPED-ADDRESS (0x0001) as a fallback; attributes are padded to
/// 4 bytes; bytes after the header's length are ignored; IPv4-mapped IPv6 addresses are
/// returned as IPv4. The caller compares the transaction ID with the one it sent.
pub fn parse_response(packet: &[u8]) -> Result<(TxId, SocketAddr), StunError> {
    if !is_stun(packet) {
        return Err(StunError::NotStun);
    }
    if packet[0..2] != TYPE_BINDING_SUCCESS.to_be_bytes() {
        return Err(StunError::NotSuccessResponse);
    }
    let tx = tx_id(packet);
    let len = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let attrs = packet[HEADER_LEN..]
        .get(..len)
        .ok_or(StunError::MalformedAttributes)?;
    let mut mapped = None;
    let mut fallback = None;
    for attr in Attributes::new(attrs) {
        let attr = attr?;
        match attr.kind {
            ATTR_XOR_MAPPED_ADDRESS | ATTR_XOR_MAPPED_ADDRESS_ALT => {
                mapped = Some(read_address(attr.value, Some(&tx))?);
            }
            ATTR_MAPPED_ADDRESS => fallback = Some(read_address(attr.value, None)?),
            _ => {}
        }
    }
    mapped
        .or(fallback)
        .map(|addr| (tx, addr))
        .ok_or(StunError::NoMappedAddress)
}

/// Checks the header of a request and returns its attribute bytes.
fn request_attributes(packet: &[u8]) -> Result<&[u8], StunError> {
    if !is_stun(packet) {
        return Err(StunError::NotStun);
    }
    if packet[0..2] != TYPE_BINDING_REQUEST.to_be_bytes() {
        return Err(StunError::NotBindingRequest);
    }
    let header = u16::from_be_bytes([packet[2], packet[3]]);
    let attrs = &packet[HEADER_LEN..];
    if usize::from(header) != attrs.len() || !header.is_multiple_of(4) {
        return Err(StunError::LengthMismatch {
            header,
            actual: attrs.len(),
        });
    }
    Ok(attrs)
}

/// The header predicate: long enough, top two bits clear, magic cookie present.
fn is_stun(packet: &[u8]) -> bool {
    packet.len() >= HEADER_LEN && packet[0] & 0b1100_0000 == 0 && packet[4..8] == MAGIC_COOKIE
}

/// Reads the transaction ID; callers have checked the packet holds a full header.
fn tx_id(packet: &[u8]) -> TxId {
    let mut id = [0u8; TX_ID_LEN];
    id.copy_from_slice(&packet[8..HEADER_LEN]);
    TxId(id)
}

/// Verifies a FINGERPRINT attribute, which covers every byte before the attribute.
fn check_fingerprint(packet: &[u8], fp: &Attribute<'_>) -> Result<(), StunError> {
    let want: [u8; 4] = fp
        .value
        .try_into()
        .map_err(|_| StunError::MalformedAttributes)?;
    if u32::from_be_bytes(want) != fingerprint(&packet[..fp.offset]) {
        return Err(StunError::BadFingerprint);
    }
    Ok(())
}

/// RFC 5389 §15.5: CRC-32 (IEEE) XOR the ASCII of "STUN".
fn fingerprint(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes) ^ FINGERPRINT_XOR
}

/// The bytes a mapped address is XORed with: the cookie, then the transaction ID (IPv6 only).
fn xor_key(tx: &TxId) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&MAGIC_COOKIE);
    key[4..].copy_from_slice(&tx.0);
    key
}

/// Decodes a (XOR-)MAPPED-ADDRESS value; `tx` is `Some` for the XOR form.
///
/// As in Go, a value longer than its family needs is accepted and the excess ignored.
fn read_address(value: &[u8], tx: Option<&TxId>) -> Result<SocketAddr, StunError> {
    let [_, family, p0, p1, rest @ ..] = value else {
        return Err(StunError::MalformedAttributes);
    };
    let addr_len = match *family {
        FAMILY_IPV4 => 4,
        FAMILY_IPV6 => 16,
        _ => return Err(StunError::MalformedAttributes),
    };
    let raw = rest.get(..addr_len).ok_or(StunError::MalformedAttributes)?;
    let mut port = u16::from_be_bytes([*p0, *p1]);
    let mut ip = [0u8; 16];
    ip[..addr_len].copy_from_slice(raw);
    if let Some(tx) = tx {
        port ^= COOKIE_HIGH;
        for (b, k) in ip.iter_mut().zip(xor_key(tx)) {
            *b ^= k;
        }
    }
    let ip = if addr_len == 4 {
        IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
    } else {
        Ipv6Addr::from(ip).to_canonical()
    };
    Ok(SocketAddr::new(ip, port))
}

/// One attribute: its type, its unpadded value, and where its 4-byte header starts in the
/// whole message (what a FINGERPRINT covers).
#[derive(Debug, Clone, Copy)]
struct Attribute<'a> {
    kind: u16,
    value: &'a [u8],
    offset: usize,
}

/// Walks the attributes after the header, yielding an error (once) if one is truncated.
#[derive(Debug)]
struct Attributes<'a> {
    rest: &'a [u8],
    offset: usize,
}

impl<'a> Attributes<'a> {
    fn new(attrs: &'a [u8]) -> Self {
        Attributes {
            rest: attrs,
            offset: HEADER_LEN,
        }
    }
}

impl<'a> Iterator for Attributes<'a> {
    type Item = Result<Attribute<'a>, StunError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let parsed = match self.rest {
            [t0, t1, l0, l1, body @ ..] => {
                let len = usize::from(u16::from_be_bytes([*l0, *l1]));
                let padded = len.next_multiple_of(4);
                body.get(..padded).map(|_| {
                    let attr = Attribute {
                        kind: u16::from_be_bytes([*t0, *t1]),
                        value: &body[..len],
                        offset: self.offset,
                    };
                    (attr, &body[padded..])
                })
            }
            _ => None,
        };
        match parsed {
            Some((attr, rest)) => {
                self.offset += self.rest.len() - rest.len();
                self.rest = rest;
                Some(Ok(attr))
            }
            None => {
                self.rest = &[];
                Some(Err(StunError::MalformedAttributes))
            }
        }
    }
}

/// Length of the STUN header: type, length, cookie, transaction ID.
pub const HEADER_LEN: usize = 20;

/// Length of a STUN transaction ID.
pub const TX_ID_LEN: usize = 12;

/// Length of the request [`binding_request`] builds.
pub const BINDING_REQUEST_LEN: usize = 40;

/// The largest response [`binding_response`] writes (IPv6); IPv4 responses are 32 bytes.
pub const MAX_RESPONSE_LEN: usize = 44;

/// The RFC 5389 magic cookie, bytes 4..8 of every message.
pub const MAGIC_COOKIE: [u8; 4] = [0x21, 0x12, 0xa4, 0x42];

/// The SOFTWARE value that marks a request as coming from Tailscale.
pub const SOFTWARE: &[u8; 8] = b"tailnode";

const TYPE_BINDING_REQUEST: u16 = 0x0001;
const TYPE_BINDING_SUCCESS: u16 = 0x0101;

const ATTR_MAPPED_ADDRESS: u16 = 0x0001;
const ATTR_XOR_MAPPED_ADDRESS: u16 = 0x0020;
/// The number XOR-MAPPED-ADDRESS had in drafts before RFC 5389; some servers still send it.
const ATTR_XOR_MAPPED_ADDRESS_ALT: u16 = 0x8020;
const ATTR_SOFTWARE: u16 = 0x8022;
const ATTR_FINGERPRINT: u16 = 0x8028;

const FAMILY_IPV4: u8 = 0x01;
const FAMILY_IPV6: u8 = 0x02;

/// The port in XOR-MAPPED-ADDRESS is XORed with the cookie's first half.
const COOKIE_HIGH: u16 = 0x2112;
const FINGERPRINT_XOR: u32 = 0x5354_554e;

#[cfg(test)]
mod tests {
    use super::*;

    use derp_testkit::{unhex, vectors};
    use serde_json::Value;

    fn tx_from_hex(s: &str) -> TxId {
        TxId(unhex(s).try_into().expect("12-byte txid"))
    }

    fn addr(v: &Value, key: &str) -> SocketAddr {
        v[key].as_str().expect(key).parse().expect("socket address")
    }

    #[test]
    fn vector_requests_parse_to_their_txid() {
        for ex in vectors::stun_exchanges() {
            let request = unhex(ex["request_hex"].as_str().unwrap());
            let want = tx_from_hex(ex["parsed_txid_hex"].as_str().unwrap());
            assert_eq!(parse_binding_request(&request), Ok(want));
            assert_eq!(parse_generic_binding_request(&request), Ok(want));
        }
    }

    #[test]
    fn vector_responses_are_reproduced_exactly() {
        for ex in vectors::stun_exchanges() {
            let tx = tx_from_hex(ex["txid_hex"].as_str().unwrap());
            let mut out = [0u8; MAX_RESPONSE_LEN];
            let n = binding_response(&tx, addr(&ex, "client"), &mut out);
            assert_eq!(
                hex::encode(&out[..n]),
                ex["response_hex"].as_str().unwrap(),
                "{}",
                ex["address_family"]
            );
        }
    }

    #[test]
    fn vector_requests_are_built_exactly() {
        for ex in vectors::stun_exchanges() {
            let tx = tx_from_hex(ex["txid_hex"].as_str().unwrap());
            assert_eq!(
                hex::encode(binding_request(&tx)),
                ex["request_hex"].as_str().unwrap()
            );
        }
    }

    #[test]
    fn vector_responses_parse_to_the_client_address() {
        for ex in vectors::stun_exchanges() {
            let response = unhex(ex["response_hex"].as_str().unwrap());
            let tx = tx_from_hex(ex["parsed_txid_hex"].as_str().unwrap());
            let want = addr(&ex, "parsed_mapped_address");
            assert_eq!(parse_response(&response), Ok((tx, want)));
        }
    }

    #[test]
    fn tailscale_parser_refuses_every_ignored_request() {
        let want = [
            ("no_attributes", StunError::WrongSoftware),
            ("bad_fingerprint", StunError::BadFingerprint),
            ("fingerprint_without_software", StunError::WrongSoftware),
            ("other_software", StunError::WrongSoftware),
        ];
        let requests = vectors::stun_ignored_requests();
        assert_eq!(requests.len(), want.len());
        for ((name, request), (want_name, want_err)) in requests.iter().zip(want) {
            assert_eq!(name, want_name);
            assert_eq!(parse_binding_request(request), Err(want_err), "{name}");
        }
    }

    #[test]
    fn generic_parser_accepts_well_formed_requests_but_not_a_bad_fingerprint() {
        for (name, request) in vectors::stun_ignored_requests() {
            let got = parse_generic_binding_request(&request);
            if name == "bad_fingerprint" {
                assert_eq!(got, Err(StunError::BadFingerprint));
            } else {
                let tx = tx_id(&request);
                assert_eq!(got, Ok(tx), "{name}");
            }
        }
    }

    #[test]
    fn software_is_the_first_attribute_for_the_xdp_responder() {
        let req = binding_request(&TxId([7; 12]));
        assert_eq!(req[20..22], [0x80, 0x22]);
        assert_eq!(&req[24..32], b"tailnode");
    }

    #[test]
    fn request_round_trips() {
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..100 {
            let mut id = [0u8; 12];
            for b in &mut id {
                *b = next(&mut state) as u8;
            }
            let tx = TxId(id);
            assert_eq!(parse_binding_request(&binding_request(&tx)), Ok(tx));
        }
    }

    #[test]
    fn response_round_trips_for_both_families() {
        let tx = TxId(*b"abcdefghijkl");
        let cases: [(SocketAddr, usize); 5] = [
            ("1.2.3.4:1".parse().unwrap(), 32),
            ("255.255.255.255:65535".parse().unwrap(), 32),
            ("[2001:db8::1]:41641".parse().unwrap(), 44),
            ("[fe80::1]:0".parse().unwrap(), 44),
            ("[::]:3478".parse().unwrap(), 44),
        ];
        for (addr, len) in cases {
            let mut out = [0u8; MAX_RESPONSE_LEN];
            let n = binding_response(&tx, addr, &mut out);
            assert_eq!(n, len, "{addr}");
            assert_eq!(parse_response(&out[..n]), Ok((tx, addr)));
        }
    }

    #[test]
    fn ipv4_mapped_source_is_answered_as_ipv4() {
        let tx = TxId([1; 12]);
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:5000".parse().unwrap();
        let plain: SocketAddr = "192.0.2.7:5000".parse().unwrap();
        let (mut a, mut b) = ([0u8; MAX_RESPONSE_LEN], [0u8; MAX_RESPONSE_LEN]);
        let n = binding_response(&tx, mapped, &mut a);
        assert_eq!(n, 32);
        assert_eq!(a[25], FAMILY_IPV4);
        let m = binding_response(&tx, plain, &mut b);
        assert_eq!(a[..n], b[..m]);
    }

    #[test]
    fn responses_with_padding_alternate_and_legacy_attributes_parse() {
        let tx = TxId(*b"0123456789ab");
        let want: SocketAddr = "198.51.100.9:3478".parse().unwrap();
        let mut xor = [0u8; MAX_RESPONSE_LEN];
        let n = binding_response(&tx, want, &mut xor);
        let xor_value = xor[24..n].to_vec();
        let legacy_value = [0, 1, 0x0d, 0x96, 198, 51, 100, 9];

        // SOFTWARE with a 5-byte value (3 padding bytes) before the address.
        let soft = [&[0x80, 0x22, 0, 5][..], b"pion!", &[0, 0, 0]].concat();
        for (kind, value) in [
            (ATTR_XOR_MAPPED_ADDRESS, &xor_value[..]),
            (ATTR_XOR_MAPPED_ADDRESS_ALT, &xor_value[..]),
            (ATTR_MAPPED_ADDRESS, &legacy_value[..]),
        ] {
            let attr = [&kind.to_be_bytes()[..], &[0, 8], value].concat();
            let body = [&soft[..], &attr].concat();
            let packet = response_with(&tx, &body);
            assert_eq!(parse_response(&packet), Ok((tx, want)), "{kind:#x}");
        }

        // XOR-MAPPED-ADDRESS wins over MAPPED-ADDRESS whatever the order.
        let other = [0, 1, 0, 1, 10, 0, 0, 1];
        let body = [
            &[0x00, 0x20, 0, 8][..],
            &xor_value,
            &[0x00, 0x01, 0, 8],
            &other,
        ]
        .concat();
        assert_eq!(parse_response(&response_with(&tx, &body)), Ok((tx, want)));
    }

    #[test]
    fn response_without_address_is_refused() {
        let tx = TxId([0; 12]);
        assert_eq!(
            parse_response(&response_with(&tx, &[])),
            Err(StunError::NoMappedAddress)
        );
        let mut request = binding_request(&tx).to_vec();
        assert_eq!(parse_response(&request), Err(StunError::NotSuccessResponse));
        request[4] = 0;
        assert_eq!(parse_response(&request), Err(StunError::NotStun));
    }

    #[test]
    fn requests_with_broken_headers_are_refused() {
        let good = binding_request(&TxId([9; 12]));
        let cases: [(&str, Vec<u8>, StunError); 6] = [
            ("short", good[..19].to_vec(), StunError::NotStun),
            ("top bits", with(&good, 0, 0x40), StunError::NotStun),
            ("cookie", with(&good, 5, 0), StunError::NotStun),
            ("type", with(&good, 1, 0x02), StunError::NotBindingRequest),
            (
                "trailing byte",
                [&good[..], &[0]].concat(),
                StunError::LengthMismatch {
                    header: 20,
                    actual: 21,
                },
            ),
            (
                "truncated",
                good[..36].to_vec(),
                StunError::LengthMismatch {
                    header: 20,
                    actual: 16,
                },
            ),
        ];
        for (name, packet, err) in cases {
            assert_eq!(parse_binding_request(&packet), Err(err), "{name}");
            assert_eq!(parse_generic_binding_request(&packet), Err(err), "{name}");
        }
    }

    #[test]
    fn attribute_running_past_the_end_is_malformed() {
        // Header length 8, one attribute claiming 8 value bytes but only 4 present.
        let mut packet = request_header(8);
        packet.extend_from_slice(&[0x80, 0x22, 0, 8, b't', b'a', b'i', b'l']);
        assert_eq!(
            parse_binding_request(&packet),
            Err(StunError::MalformedAttributes)
        );
        assert_eq!(
            parse_generic_binding_request(&packet),
            Err(StunError::MalformedAttributes)
        );
    }

    #[test]
    fn fingerprint_must_be_last() {
        let tx = TxId(*b"fingerprints");
        let req = binding_request(&tx);
        // Move SOFTWARE after FINGERPRINT; the CRC is recomputed so only the order is wrong.
        let mut packet = request_header(20);
        packet[8..20].copy_from_slice(&tx.0);
        packet.extend_from_slice(&[0x80, 0x28, 0, 4]);
        let fp = fingerprint(&packet[..20]);
        packet.extend_from_slice(&fp.to_be_bytes());
        packet.extend_from_slice(&req[20..32]);
        assert_eq!(
            parse_binding_request(&packet),
            Err(StunError::NoFingerprint)
        );
        assert_eq!(
            parse_generic_binding_request(&packet),
            Err(StunError::FingerprintNotLast)
        );
    }

    #[test]
    fn generic_parser_skips_unknown_padded_attributes() {
        let mut packet = request_header(12);
        packet.extend_from_slice(&[0x80, 0x22, 0, 5, b'o', b't', b'h', b'e', b'r', 0, 0, 0]);
        assert_eq!(parse_generic_binding_request(&packet), Ok(tx_id(&packet)));
        assert_eq!(
            parse_binding_request(&packet),
            Err(StunError::WrongSoftware)
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let seed = binding_request(&TxId([3; 12]));
        let mut response = [0u8; MAX_RESPONSE_LEN];
        let n = binding_response(
            &TxId([3; 12]),
            "[2001:db8::2]:9".parse().unwrap(),
            &mut response,
        );
        for round in 0..20_000 {
            let len = (next(&mut state) % 64) as usize;
            // Half the inputs start from a valid message so the fuzzing reaches the attributes.
            let mut packet: Vec<u8> = match round % 4 {
                0 => seed.to_vec(),
                1 => response[..n].to_vec(),
                _ => (0..len).map(|_| next(&mut state) as u8).collect(),
            };
            if round % 4 < 2 {
                let flips = 1 + next(&mut state) % 3;
                for _ in 0..flips {
                    if packet.is_empty() {
                        break;
                    }
                    let at = (next(&mut state) as usize) % packet.len();
                    packet[at] ^= next(&mut state) as u8 | 1;
                }
                packet.truncate((next(&mut state) as usize) % (packet.len() + 1));
            }
            let _ = parse_binding_request(&packet);
            let _ = parse_generic_binding_request(&packet);
            let _ = parse_response(&packet);
        }
    }

    fn request_header(len: u16) -> Vec<u8> {
        let mut h = vec![0, 1];
        h.extend_from_slice(&len.to_be_bytes());
        h.extend_from_slice(&MAGIC_COOKIE);
        h.extend_from_slice(b"request-txid");
        h
    }

    fn response_with(tx: &TxId, body: &[u8]) -> Vec<u8> {
        let mut p = vec![0x01, 0x01];
        p.extend_from_slice(&(body.len() as u16).to_be_bytes());
        p.extend_from_slice(&MAGIC_COOKIE);
        p.extend_from_slice(&tx.0);
        p.extend_from_slice(body);
        p
    }

    fn with(packet: &[u8], at: usize, byte: u8) -> Vec<u8> {
        let mut p = packet.to_vec();
        p[at] = byte;
        p
    }

    /// splitmix64: a fixed-seed generator so failures reproduce.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
