//! A relayed packet's destination lookup allocates nothing in steady state, in every lookup
//! mode that can answer without the lock. Its own test binary: it installs a counting global
//! allocator.

use std::alloc::System;

use derp_server::lookup_bench::LookupBench;
use derp_server::{LookupConfig, PeerCacheConfig};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const LOOKUPS: usize = 10_000;

#[test]
fn steady_state_lookups_allocate_nothing() {
    let bench = LookupBench::new(4);
    let modes = [
        ("mirror", true, None),
        ("lru", false, Some(PeerCacheConfig::default())),
        ("mirror+lru", true, Some(PeerCacheConfig::default())),
    ];
    for (name, mirror, peer_cache) in modes {
        let config = LookupConfig { mirror, peer_cache };
        let mut router = bench.router(&config);
        for i in 0..8 {
            assert!(router.lookup(i), "{name}: warm-up lookup {i}");
        }
        // The counter is process-wide; take the best of a few runs so a stray allocation by
        // the harness's other threads cannot fail the test, while a per-lookup allocation
        // would show in every run.
        let mut fewest = usize::MAX;
        for _ in 0..3 {
            let region = Region::new(GLOBAL);
            for i in 0..LOOKUPS {
                assert!(router.lookup(i & 3));
            }
            let change = region.change();
            fewest = fewest.min(change.allocations + change.reallocations);
        }
        assert_eq!(fewest, 0, "{name}: allocations during {LOOKUPS} lookups");
    }
}
