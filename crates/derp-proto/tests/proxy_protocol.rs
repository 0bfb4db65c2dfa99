//! The PROXY protocol parser: the hand-written vectors of testdata/proxy_protocol.json (both
//! versions, from the specification), and properties: what the writers produce parses back,
//! no split of the bytes changes the outcome, `needed` never asks for more than the header
//! lacks, bytes after a header are never part of it, and a refusal is final.

use std::net::{IpAddr, SocketAddr};

use derp_proto::proxy_protocol::{
    self, Addresses, Command, Header, Parsed, ProxyError, V1_MAX_LEN, V2_SIGNATURE, Version,
    write_v1, write_v2,
};
use proptest::collection::vec;
use proptest::prelude::*;
use serde_json::Value;

fn vectors() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/proxy_protocol.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read vectors")).expect("json")
}

fn hex(v: &Value) -> Vec<u8> {
    hex::decode(v["hex"].as_str().expect("hex")).expect("hex digits")
}

fn addr(v: &Value, field: &str) -> SocketAddr {
    v[field]
        .as_str()
        .expect("address")
        .parse()
        .expect("socket address")
}

fn expected(v: &Value) -> Header {
    let a = &v["addresses"];
    Header {
        version: match v["version"].as_str() {
            Some("v1") => Version::V1,
            _ => Version::V2,
        },
        command: match v["command"].as_str() {
            Some("local") => Command::Local,
            _ => Command::Proxy,
        },
        addresses: match a["kind"].as_str().expect("kind") {
            "tcp" => Addresses::Tcp {
                source: addr(a, "source"),
                destination: addr(a, "destination"),
            },
            "udp" => Addresses::Udp {
                source: addr(a, "source"),
                destination: addr(a, "destination"),
            },
            "unix" => Addresses::Unix,
            _ => Addresses::Unspecified,
        },
    }
}

#[test]
fn every_valid_vector_parses_to_what_it_says_and_only_its_own_bytes() {
    let v = vectors();
    let cases = v["valid"].as_array().expect("valid");
    assert!(cases.len() >= 20);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let bytes = hex(case);
        let len = case["len"].as_u64().expect("len") as usize;
        assert_eq!(
            proxy_protocol::parse(&bytes),
            Ok(Parsed::Complete {
                header: expected(case),
                len
            }),
            "{name}"
        );
        // The header alone parses the same; each shorter prefix asks for more.
        assert_eq!(
            proxy_protocol::parse(&bytes[..len]),
            proxy_protocol::parse(&bytes),
            "{name}"
        );
        for cut in 0..len {
            match proxy_protocol::parse(&bytes[..cut]) {
                Ok(Parsed::Incomplete { needed }) => {
                    assert!(
                        needed >= 1 && cut + needed <= len,
                        "{name} at {cut}: {needed}"
                    )
                }
                other => panic!("{name}: the first {cut} bytes gave {other:?}"),
            }
        }
    }
}

#[test]
fn every_invalid_vector_is_refused_with_its_kind() {
    let v = vectors();
    let cases = v["invalid"].as_array().expect("invalid");
    assert!(cases.len() >= 25);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let got = proxy_protocol::parse(&hex(case));
        match case["error"].as_str() {
            Some("not_proxy") => assert_eq!(got, Err(ProxyError::NotProxy), "{name}"),
            _ => assert!(
                matches!(got, Err(ProxyError::Malformed(_))),
                "{name}: {got:?}"
            ),
        }
    }
}

#[test]
fn the_lengths_the_specification_names() {
    let mut out = Vec::new();
    let max = "ffff:".repeat(7) + "ffff";
    let line = format!("PROXY UNKNOWN {max} {max} 65535 65535\r\n");
    assert_eq!(line.len(), V1_MAX_LEN);
    out.extend_from_slice(line.as_bytes());
    assert!(matches!(
        proxy_protocol::parse(&out),
        Ok(Parsed::Complete { len: 107, .. })
    ));
    // One byte more before the CRLF and the line is too long, refused at 107 bytes.
    let long = format!("PROXY UNKNOWN {max} {max} 65535 655350\r\n");
    assert!(proxy_protocol::parse(&long.as_bytes()[..V1_MAX_LEN]).is_err());
    // A version 2 header says its length after 16 bytes.
    let mut v2 = V2_SIGNATURE.to_vec();
    v2.extend_from_slice(&[0x21, 0x11, 0x01, 0x00]);
    assert_eq!(
        proxy_protocol::parse(&v2),
        Ok(Parsed::Incomplete { needed: 256 })
    );
    assert_eq!(
        proxy_protocol::parse(&V2_SIGNATURE[..5]),
        Ok(Parsed::Incomplete { needed: 11 })
    );
}

fn arb_ip(v4: bool) -> BoxedStrategy<IpAddr> {
    if v4 {
        any::<[u8; 4]>().prop_map(IpAddr::from).boxed()
    } else {
        any::<[u8; 16]>().prop_map(IpAddr::from).boxed()
    }
}

/// Addresses that survive both writers: both ends of one family (the writers map a mixed
/// pair to IPv6).
fn arb_addresses() -> impl Strategy<Value = Addresses> {
    let pair = any::<bool>().prop_flat_map(|v4| {
        (arb_ip(v4), any::<u16>(), arb_ip(v4), any::<u16>())
            .prop_map(|(s, sp, d, dp)| (SocketAddr::new(s, sp), SocketAddr::new(d, dp)))
    });
    prop_oneof![
        Just(Addresses::Unspecified),
        Just(Addresses::Unix),
        pair.clone()
            .prop_map(|(source, destination)| Addresses::Tcp {
                source,
                destination
            }),
        pair.prop_map(|(source, destination)| Addresses::Udp {
            source,
            destination
        }),
    ]
}

fn arb_tlvs() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    vec((any::<u8>(), vec(any::<u8>(), 0..40)), 0..5)
}

/// What a header says once parsed: LOCAL carries no addresses, and version 1 knows only TCP.
fn as_received(version: Version, command: Command, addresses: Addresses) -> Header {
    let addresses = match (version, command, addresses) {
        (_, Command::Local, _) => Addresses::Unspecified,
        (Version::V1, _, a @ Addresses::Tcp { .. }) => a,
        (Version::V1, _, _) => Addresses::Unspecified,
        (Version::V2, _, a) => a,
    };
    Header {
        version,
        command,
        addresses,
    }
}

/// Feeds `data` one prefix at a time: the outcomes run through Incomplete (each `needed`
/// within what is left of the header) to one Complete or one refusal, never changing after.
fn check_prefixes(data: &[u8]) {
    let whole = proxy_protocol::parse(data);
    let mut settled: Option<Result<Parsed, ProxyError>> = None;
    for cut in 0..=data.len() {
        let got = proxy_protocol::parse(&data[..cut]);
        match (&settled, got) {
            (None, Ok(Parsed::Incomplete { needed })) => {
                assert!(needed >= 1);
                if let Ok(Parsed::Complete { len, .. }) = whole {
                    assert!(cut + needed <= len, "needed {needed} at {cut} of {len}");
                }
            }
            (None, other) => settled = Some(other),
            (Some(Err(e)), got) => {
                assert!(
                    got.is_err(),
                    "refused ({e:?}) at a shorter prefix, then {got:?}"
                );
            }
            (Some(first), got) => assert_eq!(&got, first, "more bytes changed a header"),
        }
    }
    if let Ok(Parsed::Complete { len, .. }) = whole {
        assert!(len <= data.len());
    }
}

proptest! {
    #[test]
    fn written_headers_parse_back(
        addresses in arb_addresses(),
        local in any::<bool>(),
        tlvs in arb_tlvs(),
        after in vec(any::<u8>(), 0..32),
    ) {
        let command = if local { Command::Local } else { Command::Proxy };
        let tlvs: Vec<(u8, &[u8])> = tlvs.iter().map(|(t, v)| (*t, v.as_slice())).collect();
        let mut bytes = Vec::new();
        write_v2(command, &addresses, &tlvs, &mut bytes).expect("fits");
        let len = bytes.len();
        bytes.extend_from_slice(&after);
        prop_assert_eq!(
            proxy_protocol::parse(&bytes),
            Ok(Parsed::Complete { header: as_received(Version::V2, command, addresses), len })
        );
        check_prefixes(&bytes);

        let mut line = Vec::new();
        write_v1(&addresses, &mut line);
        let len = line.len();
        prop_assert!(len <= V1_MAX_LEN);
        line.extend_from_slice(&after);
        prop_assert_eq!(
            proxy_protocol::parse(&line),
            Ok(Parsed::Complete { header: as_received(Version::V1, Command::Proxy, addresses), len })
        );
        check_prefixes(&line);
    }

    #[test]
    fn mangled_headers_never_panic_and_settle_once(
        addresses in arb_addresses(),
        v1 in any::<bool>(),
        flips in vec((any::<usize>(), any::<u8>()), 1..4),
        cut in any::<usize>(),
        after in vec(any::<u8>(), 0..16),
    ) {
        let mut bytes = Vec::new();
        if v1 {
            write_v1(&addresses, &mut bytes);
        } else {
            write_v2(Command::Proxy, &addresses, &[(4, b"pad")], &mut bytes).expect("fits");
        }
        for (at, b) in flips {
            let at = at % bytes.len();
            bytes[at] = b;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        bytes.extend_from_slice(&after);
        check_prefixes(&bytes);
    }

    #[test]
    fn bytes_after_a_signature_never_panic_and_settle_once(
        v1 in any::<bool>(),
        tail in vec(any::<u8>(), 0..300),
    ) {
        let mut bytes = if v1 { b"PROXY ".to_vec() } else { V2_SIGNATURE.to_vec() };
        bytes.extend_from_slice(&tail);
        check_prefixes(&bytes);
    }

    #[test]
    fn text_shaped_lines_never_panic_and_settle_once(
        line in "PROXY (TCP4|TCP6|UNKNOWN)?[ 0-9a-fA-F.:]{0,100}(\r\n)?",
    ) {
        check_prefixes(line.as_bytes());
    }

    #[test]
    fn anything_else_is_no_header(data in vec(any::<u8>(), 1..64)) {
        prop_assume!(data[0] != b'P' && data[0] != b'\r');
        prop_assert_eq!(proxy_protocol::parse(&data), Err(ProxyError::NotProxy));
    }
}
