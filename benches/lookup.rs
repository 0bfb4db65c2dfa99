//! Destination lookup: one op is one lookup of one of 4 connected destinations, as in the
//! reference's BenchmarkLookupDestHashTrie / BenchmarkLookupDestPeerCache, for each lookup
//! mode and on 1 and 2 threads (each thread is one client connection with its own LRU).
//!
//! Run: `cargo bench -p derp-benches --bench lookup`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use derp_server::lookup_bench::LookupBench;
use derp_server::{LookupConfig, PeerCacheConfig};

fn modes() -> [(&'static str, LookupConfig); 3] {
    [
        (
            "authoritative",
            LookupConfig {
                mirror: false,
                peer_cache: None,
            },
        ),
        (
            "lru",
            LookupConfig {
                mirror: false,
                peer_cache: Some(PeerCacheConfig::default()),
            },
        ),
        (
            "mirror",
            LookupConfig {
                mirror: true,
                peer_cache: None,
            },
        ),
    ]
}

/// Runs `iters` lookups split over `threads` threads and returns the wall time, so the
/// reported time per op is wall time / total lookups (like Go's RunParallel). `batch` is how
/// many lookups share one epoch guard: 1 is the worst case (a socket read that carried one
/// frame), 32 models a busy connection whose reads carry many frames.
fn run(
    bench: &LookupBench,
    config: &LookupConfig,
    threads: u64,
    batch: u64,
    iters: u64,
) -> Duration {
    let per_thread = iters.div_ceil(threads);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut router = bench.router(config);
                // Warm the per-connection cache outside the timed region as far as
                // possible; the first four lookups of an LRU run are misses.
                for i in 0..4 {
                    router.lookup(i);
                }
                if batch == 1 {
                    for i in 0..per_thread {
                        assert!(black_box(router.lookup((i & 3) as usize)));
                    }
                } else {
                    for _ in 0..per_thread.div_ceil(batch) {
                        let n = batch as usize;
                        assert_eq!(black_box(router.lookup_batch(n)), n);
                    }
                }
            });
        }
    });
    start.elapsed()
}

fn lookup(c: &mut Criterion) {
    let bench = LookupBench::new(4);
    for threads in [1u64, 2] {
        let mut group = c.benchmark_group(format!("lookup/{threads}-thread"));
        for (name, config) in modes() {
            for batch in [1u64, 32] {
                group.bench_function(format!("{name}/batch-{batch}"), |b| {
                    b.iter_custom(|iters| run(&bench, &config, threads, batch, iters))
                });
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = lookup
}
criterion_main!(benches);
