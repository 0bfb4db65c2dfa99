//! The libFuzzer entry point for every target in `derp_fuzz::TARGETS`.
//!
//! `DERP_FUZZ_TARGET=<name> derp-fuzz [libFuzzer flags] [corpus dirs or files]`; scripts/fuzz
//! sets it up. Build with the sancov RUSTFLAGS in scripts/fuzz, or coverage is missing.
#![no_main]

use std::sync::OnceLock;

static TARGET: OnceLock<derp_fuzz::Target> = OnceLock::new();

fn pick_target() {
    let name = std::env::var("DERP_FUZZ_TARGET").unwrap_or_default();
    let Some(target) = derp_fuzz::target(&name) else {
        let names: Vec<&str> = derp_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!(
            "derp-fuzz: set DERP_FUZZ_TARGET to one of: {} (got {name:?})",
            names.join(", ")
        );
        std::process::exit(2);
    };
    let _ = TARGET.set(target);
}

libfuzzer_sys::fuzz_target!(init: pick_target(), |data: &[u8]| {
    if let Some(target) = TARGET.get() {
        target(data);
    }
});
