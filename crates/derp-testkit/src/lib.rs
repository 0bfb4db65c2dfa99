//! Test fixtures shared by derpd's test suites.
//!
//! What it provides: the reference vectors (bytes recorded from Tailscale's Go implementation,
//! vendored under `crates/derp-proto/testdata/`) and loaders for the parts more than one
//! suite reads, the three fixed node keys they use, a once-per-binary tracing setup, and a
//! DERP client that speaks the wire format itself over plain TCP ([`raw`]: an async one for
//! tests, a blocking one for derp-load's closed loop), and a helper program run beside a
//! test with its output in a file ([`child`]), and an HTTP peer's reads of a response head and
//! of everything until the close ([`http`]). What it does not provide: servers,
//! TLS, WebSocket or QUIC clients; those live in the crates under test, so this crate can
//! depend on `derp-proto` alone (and tokio) and be a dev-dependency of everything else
//! without cycles (and a dependency of `derp-load`, whose closed loop runs the blocking client).

pub mod child;
pub mod http;
pub mod raw;

use std::sync::Once;

use derp_proto::{PublicKey, SecretKey};
use serde_json::Value;

/// Parsed reference vector files, by file stem.
pub mod vectors {
    use super::Value;

    macro_rules! vector_file {
        ($(#[$doc:meta])* $name:ident, $file:literal) => {
            $(#[$doc])*
            pub fn $name() -> Value {
                let text = include_str!(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../derp-proto/testdata/",
                    $file
                ));
                serde_json::from_str(text).expect(concat!($file, " is valid JSON"))
            }
        };
    }

    vector_file!(
        /// `keys.json`: the three node keys and their text forms.
        keys,
        "keys.json"
    );
    vector_file!(
        /// `handshake.json`: ServerKey, ClientInfo and ServerInfo frames.
        handshake,
        "handshake.json"
    );
    vector_file!(
        /// `frames.json`: one vector per frame type.
        frames,
        "frames.json"
    );
    vector_file!(
        /// `http.json`: recorded upgrade exchanges (plain, fast start, WebSocket).
        http,
        "http.json"
    );
    vector_file!(
        /// `session.json`: a recorded relay session between two clients.
        session,
        "session.json"
    );
    vector_file!(
        /// `stun.json`: recorded STUN exchanges.
        stun,
        "stun.json"
    );

    /// The recorded STUN binding exchanges, IPv4 then IPv6.
    pub fn stun_exchanges() -> Vec<Value> {
        let v = stun();
        vec![v["ipv4"].clone(), v["ipv6"].clone()]
    }

    /// The STUN requests Tailscale's server ignores, as (name, request bytes).
    pub fn stun_ignored_requests() -> Vec<(String, Vec<u8>)> {
        stun()["ignored_requests"]
            .as_array()
            .expect("ignored_requests")
            .iter()
            .map(|r| {
                let name = r["name"].as_str().expect("name").to_owned();
                let request = super::unhex(r["request_hex"].as_str().expect("request_hex"));
                (name, request)
            })
            .collect()
    }
}

/// Decodes a lowercase hex string from a vector, panicking with the offending text if it is bad.
pub fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap_or_else(|e| panic!("bad hex in vector ({e}): {s}"))
}

/// Returns the `private_hex` of the named key (`server`, `client_a` or `client_b`).
fn private_bytes(name: &str) -> [u8; 32] {
    let keys = vectors::keys();
    let entry = keys["keys"]
        .as_array()
        .expect("keys array")
        .iter()
        .find(|k| k["name"] == name)
        .unwrap_or_else(|| panic!("no key named {name}"));
    unhex(entry["private_hex"].as_str().expect("private_hex"))
        .try_into()
        .expect("32-byte key")
}

/// The secret key the reference server used for every vector.
pub fn server_secret() -> SecretKey {
    SecretKey::from_bytes(private_bytes("server"))
}

/// The first client's secret key (`client_a`).
pub fn client_a_secret() -> SecretKey {
    SecretKey::from_bytes(private_bytes("client_a"))
}

/// The second client's secret key (`client_b`).
pub fn client_b_secret() -> SecretKey {
    SecretKey::from_bytes(private_bytes("client_b"))
}

/// Returns the public key of a named vector key.
pub fn public_key(name: &str) -> PublicKey {
    SecretKey::from_bytes(private_bytes(name)).public_key()
}

/// Every encoding of a Curve25519 point of small order that the literature lists (libsodium's
/// blocklist; cr.yp.to/ecdh.html): 0, 1, the two points of order 8, p - 1, and p and p + 1
/// (non-canonical encodings of 0 and 1), each also with the top bit set, which X25519
/// ignores. Little-endian, as keys travel. X25519 of any of them with any secret is zero.
pub fn low_order_points() -> Vec<[u8; 32]> {
    let hex32 = |h: &str| -> [u8; 32] { unhex(h).try_into().expect("32 bytes") };
    let canonical = [
        hex32("0000000000000000000000000000000000000000000000000000000000000000"),
        hex32("0100000000000000000000000000000000000000000000000000000000000000"),
        hex32("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
        hex32("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
        hex32("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
        hex32("edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
        hex32("eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    ];
    let top_bit = canonical.map(|mut k| {
        k[31] |= 0x80;
        k
    });
    canonical.into_iter().chain(top_bit).collect()
}

/// Installs a tracing subscriber that writes through the test harness, once per binary.
///
/// The level comes from `RUST_LOG` and defaults to `warn`, so passing tests stay quiet.
pub fn init_tracing() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .init();
    });
}
