//! Fuzz target bodies, in one place: derp-proto's parsers (the PROXY protocol's among them),
//! derp-io's ClientHello check and TLS record layer, and
//! (in [`relay`]) a live derp-server fed a hostile connection's bytes.
//!
//! Each target is a plain `fn(&[u8])` that panics when an invariant breaks. The libFuzzer
//! binary (`src/bin/derp-fuzz.rs`) runs the one named by `DERP_FUZZ_TARGET`; the replay test
//! (`tests/replay.rs`) feeds every file in `corpus/<target>/` and `regressions/<target>/`
//! through the same functions without a fuzzer.
//!
//! Adding a target: write `pub fn name(data: &[u8])` in a module here, add one line to
//! [`TARGETS`], and put at least one seed in `corpus/<name>/` (the replay test insists);
//! scripts/fuzz, its CI run and its long runs pick the new target up from there. The code
//! under test must be in a library crate this one can depend on.
#![forbid(unsafe_code)]

pub mod frames;
pub mod handshake;
pub mod info;
pub mod keys;
pub mod proxy;
pub mod rate_config;
pub mod records;
pub mod relay;
pub mod stun;
pub mod tls;
pub mod upgrade;
pub mod ws;

/// A fuzz target: panics if `data` breaks an invariant.
pub type Target = fn(&[u8]);

/// Every target by name. The name is also the directory under `corpus/`, `regressions/`
/// and `artifacts/`.
pub const TARGETS: &[(&str, Target)] = &[
    ("server_frames", frames::server_frames),
    ("client_frames", frames::client_frames),
    ("server_handshake", handshake::server_handshake),
    ("info_json", info::info_json),
    ("stun", stun::stun),
    ("key_text", keys::key_text),
    ("key_file", keys::key_file),
    ("rate_config", rate_config::rate_config),
    ("upgrade_request", upgrade::upgrade_request),
    ("upgrade_response", upgrade::upgrade_response),
    ("ws_server", ws::ws_server),
    ("ws_client", ws::ws_client),
    ("ws_snapshot", ws::ws_snapshot),
    ("server_stream", relay::server_stream),
    ("tls_client_hello", tls::tls_client_hello),
    ("proxy_protocol", proxy::proxy_protocol),
    ("tls_records", records::tls_records),
    ("tls_records_sealed", records::tls_records_sealed),
];

/// Looks a target up by name.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// A tiny deterministic generator (xorshift64*) for choices derived from fuzz input, such as
/// where to cut a byte stream into chunks. Same seed, same sequence, so a crash replays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from up to eight bytes; every seed is usable (zero is remapped).
    pub fn new(seed: &[u8]) -> Self {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for &b in seed.iter().take(8) {
            s = (s << 8) ^ u64::from(b) ^ (s >> 56);
        }
        Self(s | 1)
    }

    /// The next value in `1..=max` (`max` at least 1).
    pub fn below_incl(&mut self, max: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        1 + (x % max.max(1) as u64) as usize
    }
}
