//! Finding where a packet goes: the lock-free mirror, a per-connection LRU, and the
//! authoritative map under its lock, in that order.
//!
//! Each layer can be switched off (`derpd --peer-mirror=false`, `--peer-cache-max-entries -1`)
//! to compare and to debug. Whatever is on, the result is the same: local wins over a mesh
//! forwarder, and a connection or forwarder found in a cache is revalidated before use.
//!
//! Only misses are counted. Hits are `packets_received - misses`; a counter on the hit path
//! would cost every packet a write.
//!
//! The LRU's design follows tailscale/derp derpserver/peer_cache.go (branch
//! bradfitz/derp_peer_cache), extended to cache mesh forwarders too.

use std::num::NonZeroUsize;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use derp_proto::PublicKey;
use lru::LruCache;
use tokio::time::Instant;

use crate::handle::ConnHandle;
use crate::registry::{ForwardRoute, Lookup, Registry};

/// Which lookup layers run, and how the LRU is bounded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupConfig {
    /// Consult the lock-free mirror first.
    pub mirror: bool,
    /// The per-connection LRU; `None` disables it.
    pub peer_cache: Option<PeerCacheConfig>,
}

impl Default for LookupConfig {
    fn default() -> Self {
        Self {
            mirror: true,
            peer_cache: Some(PeerCacheConfig::default()),
        }
    }
}

/// Bounds of the per-connection LRU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCacheConfig {
    /// Most destinations one connection caches.
    pub max_entries: NonZeroUsize,
    /// Entries unused for this long are removed when the client next pings.
    pub max_idle: Duration,
}

impl PeerCacheConfig {
    /// Builds the config from derper-style flag values: `max_entries` 0 means the default
    /// (100) and negative disables the cache; `max_idle` zero means the default (10 min).
    pub fn from_flags(max_entries: i64, max_idle: Duration) -> Option<Self> {
        if max_entries < 0 {
            return None;
        }
        let max_entries = usize::try_from(max_entries)
            .ok()
            .and_then(NonZeroUsize::new)
            .unwrap_or(DEFAULT_PEER_CACHE_MAX_ENTRIES);
        let max_idle = if max_idle.is_zero() {
            DEFAULT_PEER_CACHE_MAX_IDLE
        } else {
            max_idle
        };
        Some(Self {
            max_entries,
            max_idle,
        })
    }

    /// How often a hit refreshes an entry's last-used time: coarse, so hits stay cheap.
    pub fn refresh_interval(&self) -> Duration {
        self.max_idle.min(LAST_USED_REFRESH)
    }
}

impl Default for PeerCacheConfig {
    fn default() -> Self {
        Self {
            max_entries: DEFAULT_PEER_CACHE_MAX_ENTRIES,
            max_idle: DEFAULT_PEER_CACHE_MAX_IDLE,
        }
    }
}

/// Where a packet goes. Borrows from the caller's epoch guard or from the router's cache
/// where it can, so a hit changes no reference count.
#[derive(Debug)]
pub(crate) enum Route<'a> {
    /// A local connection.
    Local(ArcRef<'a, ConnHandle>),
    /// A mesh peer that has the destination.
    Forward(ArcRef<'a, ForwardRoute>),
    /// The key has several connections and none is active.
    Dup,
    /// Nobody has the key.
    Missing,
}

/// An `Arc` borrowed (from the mirror or the cache) or owned (from the locked fallback).
#[derive(Debug)]
pub(crate) enum ArcRef<'a, T> {
    Borrowed(&'a Arc<T>),
    Owned(Arc<T>),
}

impl<T> Deref for ArcRef<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            Self::Borrowed(a) => a,
            Self::Owned(a) => a,
        }
    }
}

/// Misses counted by one connection between folds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Misses {
    pub(crate) mirror: u64,
    pub(crate) cache: u64,
}

#[derive(Debug)]
enum Cached {
    Local(Arc<ConnHandle>),
    Forward(Arc<ForwardRoute>),
}

#[derive(Debug)]
struct CachedPeer {
    target: Cached,
    last_used: Instant,
}

/// One connection's lookup state. Touched only by that connection's read loop: no lock.
///
/// Every idle connection's task holds one, so it borrows the server's configuration
/// rather than copying it, and its cache is allocated on first use.
#[derive(Debug)]
pub(crate) struct Router<'a> {
    config: &'a LookupConfig,
    entries: Option<Box<PeerCache>>,
    pub(crate) misses: Misses,
}

type PeerCache = LruCache<PublicKey, CachedPeer, foldhash::fast::RandomState>;

impl<'a> Router<'a> {
    pub(crate) fn new(config: &'a LookupConfig) -> Self {
        Self {
            config,
            entries: None,
            misses: Misses::default(),
        }
    }

    /// Finds where a packet for `dst` goes and hands the route to `use_route`.
    ///
    /// The route borrows from the mirror's epoch guard or from this router's cache for the
    /// duration of the call, so a hit takes no reference count and probes each layer's hash
    /// table once.
    pub(crate) fn route_with<R>(
        &mut self,
        registry: &Registry,
        guard: &impl papaya::Guard,
        dst: &PublicKey,
        now: Instant,
        use_route: impl FnOnce(Route<'_>) -> R,
    ) -> R {
        if self.config.mirror {
            // Entries are published only after their connection is marked active, and a
            // connection that stops being active is replaced or removed under the registry
            // lock; a reader racing with that delivers to a connection that just lost the
            // role, which then drops or writes it, as the reference's lock-free read does.
            if let Some(conn) = registry.mirror().get(dst, guard) {
                return use_route(Route::Local(ArcRef::Borrowed(conn)));
            }
            self.misses.mirror += 1;
        }
        let Some(config) = &self.config.peer_cache else {
            return use_route(fallback(registry, dst, None, now));
        };
        if let Some(entries) = self.entries.as_mut()
            && let Some(peer) = entries.peek_mut(dst)
        {
            // `peek_mut` does not reorder: recency is refreshed coarsely, which keeps the
            // list ordered by last-used time for `trim` and the hit path to one probe.
            let valid = match &peer.target {
                Cached::Local(conn) => conn.is_active(),
                Cached::Forward(route) => route.is_current(),
            };
            if valid {
                let promote =
                    now.saturating_duration_since(peer.last_used) >= config.refresh_interval();
                if promote {
                    peer.last_used = now;
                }
                let result = use_route(match &peer.target {
                    Cached::Local(conn) => Route::Local(ArcRef::Borrowed(conn)),
                    Cached::Forward(route) => Route::Forward(ArcRef::Borrowed(route)),
                });
                if promote {
                    entries.promote(dst);
                }
                return result;
            }
        }
        self.misses.cache += 1;
        use_route(fallback(
            registry,
            dst,
            Some((&mut self.entries, config)),
            now,
        ))
    }

    /// Removes cache entries idle past the limit; called when the client pings, so trimming
    /// needs no timer task and no lock.
    pub(crate) fn trim(&mut self, now: Instant) {
        // Entries exist only where the cache is configured.
        let (Some(entries), Some(config)) = (&mut self.entries, &self.config.peer_cache) else {
            return;
        };
        let max_idle = config.max_idle;
        while let Some((_, peer)) = entries.peek_lru() {
            if now.saturating_duration_since(peer.last_used) > max_idle {
                entries.pop_lru();
            } else {
                break;
            }
        }
        if entries.is_empty() {
            self.entries = None;
        }
    }

    /// Number of cached destinations; for tests.
    #[cfg(test)]
    fn cached(&self) -> usize {
        self.entries.as_ref().map_or(0, |e| e.len())
    }

    /// Last-used time of a cached destination; for tests.
    #[cfg(test)]
    fn last_used(&self, dst: &PublicKey) -> Option<Instant> {
        self.entries
            .as_ref()
            .and_then(|e| e.peek(dst))
            .map(|p| p.last_used)
    }
}

/// The authoritative lookup under the registry lock, caching what it finds.
fn fallback<'a>(
    registry: &Registry,
    dst: &PublicKey,
    cache: Option<(&mut Option<Box<PeerCache>>, &PeerCacheConfig)>,
    now: Instant,
) -> Route<'a> {
    match registry.lookup_locked(dst) {
        Lookup::Local(conn) => {
            if let Some((entries, config)) = cache {
                insert(entries, config, *dst, Cached::Local(conn.clone()), now);
            }
            Route::Local(ArcRef::Owned(conn))
        }
        Lookup::Forward(route) => {
            if let Some((entries, config)) = cache {
                insert(entries, config, *dst, Cached::Forward(route.clone()), now);
            }
            Route::Forward(ArcRef::Owned(route))
        }
        Lookup::Dup => Route::Dup,
        Lookup::Missing => Route::Missing,
    }
}

fn insert(
    entries: &mut Option<Box<PeerCache>>,
    config: &PeerCacheConfig,
    dst: PublicKey,
    target: Cached,
    now: Instant,
) {
    // Unbounded as far as the lru crate knows, so nothing is preallocated per connection;
    // the bound is enforced here.
    let entries = entries
        .get_or_insert_with(|| Box::new(LruCache::unbounded_with_hasher(Default::default())));
    entries.put(
        dst,
        CachedPeer {
            target,
            last_used: now,
        },
    );
    while entries.len() > config.max_entries.get() {
        entries.pop_lru();
    }
}

/// Default bound of the per-connection LRU (derper's `--peer-cache-max-entries`).
pub const DEFAULT_PEER_CACHE_MAX_ENTRIES: NonZeroUsize = match NonZeroUsize::new(100) {
    Some(n) => n,
    None => unreachable!(),
};
/// Default idle limit of LRU entries (derper's `--peer-cache-max-idle`).
pub const DEFAULT_PEER_CACHE_MAX_IDLE: Duration = Duration::from_secs(600);
const LAST_USED_REFRESH: Duration = Duration::from_secs(30);

/// Drives the real lookup path without sockets, for benchmarks and allocation tests. Not
/// part of the relay's API: it exists so those measure the code the relay runs, and only the
/// `bench` feature (which `benches/` enables) compiles it.
#[cfg(any(test, feature = "bench"))]
// Without the feature only this crate's own tests use it, and not all of it.
#[cfg_attr(not(feature = "bench"), allow(dead_code, unreachable_pub))]
pub mod bench {
    use std::sync::Arc;

    use derp_proto::PublicKey;
    use tokio::time::Instant;

    use super::{LookupConfig, Route, Router};
    use crate::handle::ConnHandle;
    use crate::metrics::Metrics;
    use crate::registry::Registry;

    /// A registry with `destinations` connected clients whose keys are `[2; 32]`, `[3; 32]`, ….
    #[derive(Debug)]
    pub struct LookupBench {
        registry: Registry,
        conns: Vec<Arc<ConnHandle>>,
    }

    impl LookupBench {
        /// Registers the destinations.
        pub fn new(destinations: usize) -> Self {
            let metrics = Metrics::new(&prometheus::Registry::new()).unwrap_or_else(|e| {
                unreachable!("a fresh registry has no name clashes: {e}");
            });
            let registry = Registry::new(metrics, PublicKey::from_bytes([0; 32]));
            let conns = (0..destinations)
                .map(|i| {
                    let conn = Arc::new(ConnHandle::new(
                        i as u64 + 1,
                        PublicKey::from_bytes([(i + 2) as u8; 32]),
                        ([127, 0, 0, 1], 1).into(),
                        0,
                        false,
                        32,
                    ));
                    registry.register(&conn);
                    conn
                })
                .collect();
            Self { registry, conns }
        }

        /// The key of destination `i`.
        pub fn key(&self, i: usize) -> PublicKey {
            self.conns[i % self.conns.len()].key
        }

        /// A per-connection lookup state, as one client's read loop holds it.
        pub fn router<'a>(&'a self, config: &'a LookupConfig) -> BenchRouter<'a> {
            BenchRouter {
                bench: self,
                router: Router::new(config),
                now: Instant::now(),
            }
        }
    }

    /// One simulated connection's router.
    #[derive(Debug)]
    pub struct BenchRouter<'a> {
        bench: &'a LookupBench,
        router: Router<'a>,
        now: Instant,
    }

    impl BenchRouter<'_> {
        /// Looks up destination `i` and reports whether the expected connection was found.
        pub fn lookup(&mut self, i: usize) -> bool {
            let b = self.bench;
            // Callers pass in-range indices; avoid a division in the measured loop.
            let want = match b.conns.get(i) {
                Some(c) => c,
                None => &b.conns[i % b.conns.len()],
            };
            let guard = b.registry.mirror().guard();
            self.router.route_with(
                &b.registry,
                &guard,
                &want.key,
                self.now,
                |route| match route {
                    Route::Local(conn) => conn.id == want.id,
                    _ => false,
                },
            )
        }

        /// Looks up `n` destinations (cycling through them) under one epoch guard, as the
        /// relay's read loop does for the frames of one socket read; returns how many were
        /// found.
        pub fn lookup_batch(&mut self, n: usize) -> usize {
            let b = self.bench;
            let guard = b.registry.mirror().guard();
            let mut found = 0;
            for want in b.conns.iter().cycle().take(n) {
                found += usize::from(self.router.route_with(
                    &b.registry,
                    &guard,
                    &want.key,
                    self.now,
                    |route| matches!(route, Route::Local(conn) if conn.id == want.id),
                ));
            }
            found
        }

        /// Lookups that missed the mirror and the LRU so far.
        pub fn misses(&self) -> (u64, u64) {
            (self.router.misses.mirror, self.router.misses.cache)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use derp_proto::PublicKey;

    use super::*;
    use crate::metrics::Metrics;
    use crate::registry::PacketForwarder;

    fn registry() -> Registry {
        let metrics = Metrics::new(&prometheus::Registry::new()).expect("metrics");
        Registry::new(metrics, PublicKey::from_bytes([0; 32]))
    }

    fn conn(id: u64, key: u8) -> Arc<ConnHandle> {
        ConnHandle::for_tests(id, key)
    }

    fn config(mirror: bool, cache: bool) -> LookupConfig {
        LookupConfig {
            mirror,
            peer_cache: cache.then(PeerCacheConfig::default),
        }
    }

    /// What a lookup found, detached from the guard it borrowed from.
    #[derive(Debug)]
    enum Found {
        Local(u64),
        Forward(Arc<dyn PacketForwarder>),
        Dup,
        Missing,
    }

    fn route(router: &mut Router, reg: &Registry, dst: &PublicKey, now: Instant) -> Found {
        let guard = reg.mirror().guard();
        router.route_with(reg, &guard, dst, now, |route| match route {
            Route::Local(c) => Found::Local(c.id),
            Route::Forward(r) => Found::Forward(r.forwarder.clone()),
            Route::Dup => Found::Dup,
            Route::Missing => Found::Missing,
        })
    }

    fn local_id(r: Found) -> Option<u64> {
        match r {
            Found::Local(id) => Some(id),
            _ => None,
        }
    }

    #[derive(Debug)]
    struct TestForwarder;

    impl PacketForwarder for TestForwarder {
        fn forward_packet(&self, _: PublicKey, _: PublicKey, _: bytes::Bytes) {}
    }

    #[test]
    fn flag_values_follow_derper() {
        let d = PeerCacheConfig::from_flags(0, Duration::ZERO).expect("enabled");
        assert_eq!(d.max_entries.get(), 100);
        assert_eq!(d.max_idle, Duration::from_secs(600));
        assert_eq!(d.refresh_interval(), Duration::from_secs(30));
        assert_eq!(PeerCacheConfig::from_flags(-1, Duration::ZERO), None);
        let c = PeerCacheConfig::from_flags(8, Duration::from_secs(2)).expect("enabled");
        assert_eq!(c.max_entries.get(), 8);
        assert_eq!(c.refresh_interval(), Duration::from_secs(2));
    }

    #[test]
    fn cached_lookups_complete_while_the_authoritative_lock_is_held() {
        for mirror in [false, true] {
            let reg = Arc::new(registry());
            let dst = conn(1, 2);
            reg.register(&dst);
            // The router moves to another thread, so its configuration must outlive this one.
            let router_config: &'static LookupConfig = Box::leak(Box::new(config(mirror, true)));
            let mut router = Router::new(router_config);
            let now = Instant::now();
            // Prime the LRU (or rely on the mirror).
            assert_eq!(local_id(route(&mut router, &reg, &dst.key, now)), Some(1));
            let misses_before = router.misses;

            let held = reg.lock_for_test();
            let (tx, rx) = mpsc::channel();
            let reg2 = reg.clone();
            let key = dst.key;
            let handle = std::thread::spawn(move || {
                let r = local_id(route(&mut router, &reg2, &key, now));
                tx.send((r, router.misses)).expect("send");
            });
            // A lookup that needed the lock would block here until the timeout fails it.
            let (found, misses) = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("lookup must not wait for the lock");
            drop(held);
            handle.join().expect("thread");
            assert_eq!(found, Some(1));
            assert_eq!(misses, misses_before, "mirror={mirror}: no new miss");
        }
    }

    #[test]
    fn stale_cached_set_falls_back_and_finds_the_new_connection() {
        let reg = registry();
        let old = conn(1, 2);
        reg.register(&old);
        let router_config = config(false, true);
        let mut router = Router::new(&router_config);
        let now = Instant::now();
        assert_eq!(local_id(route(&mut router, &reg, &old.key, now)), Some(1));
        assert_eq!(router.misses.cache, 1);
        reg.unregister(&old);
        let new = conn(2, 2);
        reg.register(&new);
        assert_eq!(local_id(route(&mut router, &reg, &new.key, now)), Some(2));
        assert_eq!(router.misses.cache, 2, "the stale entry counted as a miss");
        assert_eq!(local_id(route(&mut router, &reg, &new.key, now)), Some(2));
        assert_eq!(router.misses.cache, 2, "and the new set is cached");
    }

    #[test]
    fn forwarders_are_cached_revalidated_and_local_wins() {
        let reg = registry();
        let key = PublicKey::from_bytes([7; 32]);
        let f1: Arc<dyn PacketForwarder> = Arc::new(TestForwarder);
        let f2: Arc<dyn PacketForwarder> = Arc::new(TestForwarder);
        reg.add_forwarder(key, f1.clone());
        let router_config = config(true, true);
        let mut router = Router::new(&router_config);
        let now = Instant::now();
        let fwd_of = |r: Found| match r {
            Found::Forward(f) => Some(f),
            _ => None,
        };
        let first = fwd_of(route(&mut router, &reg, &key, now)).expect("forwarded");
        assert!(Arc::ptr_eq(&first, &f1));
        assert_eq!(
            router.misses,
            Misses {
                mirror: 1,
                cache: 1
            }
        );
        // A cache hit: the mirror misses (no local set) but the LRU answers.
        let again = fwd_of(route(&mut router, &reg, &key, now)).expect("forwarded");
        assert!(Arc::ptr_eq(&again, &f1));
        assert_eq!(
            router.misses,
            Misses {
                mirror: 2,
                cache: 1
            }
        );

        // The preferred forwarder changes: the next packet sees the new one.
        reg.add_forwarder(key, f2.clone());
        reg.remove_forwarder(&key, &f1);
        let changed = fwd_of(route(&mut router, &reg, &key, now)).expect("forwarded");
        assert!(Arc::ptr_eq(&changed, &f2));
        assert_eq!(router.misses.cache, 2);

        // The key connects locally: local wins over the cached forwarder.
        let local = conn(1, 7);
        reg.register(&local);
        assert_eq!(local_id(route(&mut router, &reg, &key, now)), Some(1));
        let no_mirror_config = config(false, true);
        let mut no_mirror = Router::new(&no_mirror_config);
        assert_eq!(local_id(route(&mut no_mirror, &reg, &key, now)), Some(1));
    }

    #[test]
    fn last_used_is_refreshed_coarsely() {
        let reg = registry();
        let dst = conn(1, 2);
        reg.register(&dst);
        let router_config = config(false, true);
        let mut router = Router::new(&router_config);
        let t0 = Instant::now();
        route(&mut router, &reg, &dst.key, t0);
        assert_eq!(router.last_used(&dst.key), Some(t0));
        let t1 = t0 + Duration::from_secs(15);
        route(&mut router, &reg, &dst.key, t1);
        assert_eq!(
            router.last_used(&dst.key),
            Some(t0),
            "15 s is within the interval"
        );
        let t2 = t1 + Duration::from_secs(30);
        route(&mut router, &reg, &dst.key, t2);
        assert_eq!(router.last_used(&dst.key), Some(t2));
    }

    #[test]
    fn trim_removes_only_idle_entries() {
        let reg = registry();
        let old = conn(1, 2);
        let fresh = conn(2, 3);
        reg.register(&old);
        reg.register(&fresh);
        let router_config = config(false, true);
        let mut router = Router::new(&router_config);
        let t0 = Instant::now();
        route(&mut router, &reg, &old.key, t0);
        let t1 = t0 + Duration::from_secs(600);
        route(&mut router, &reg, &fresh.key, t1);
        assert_eq!(router.cached(), 2);
        router.trim(t0 + Duration::from_secs(601));
        assert_eq!(router.cached(), 1);
        assert!(router.last_used(&fresh.key).is_some());
        assert!(router.last_used(&old.key).is_none());
    }

    #[test]
    fn cache_is_bounded() {
        let reg = registry();
        let conns: Vec<_> = (0..10).map(|i| conn(i + 1, i as u8 + 2)).collect();
        for c in &conns {
            reg.register(c);
        }
        let router_config = LookupConfig {
            mirror: false,
            peer_cache: PeerCacheConfig::from_flags(4, Duration::ZERO),
        };
        let mut router = Router::new(&router_config);
        let now = Instant::now();
        for c in &conns {
            assert_eq!(local_id(route(&mut router, &reg, &c.key, now)), Some(c.id));
        }
        assert_eq!(router.cached(), 4);
    }

    #[test]
    fn disabled_layers_are_never_touched() {
        let reg = registry();
        let dst = conn(1, 2);
        reg.register(&dst);
        let now = Instant::now();
        // LRU off: nothing cached, no LRU misses counted.
        let router_config = config(true, false);
        let mut router = Router::new(&router_config);
        route(&mut router, &reg, &dst.key, now);
        route(&mut router, &reg, &PublicKey::from_bytes([9; 32]), now);
        assert_eq!(router.cached(), 0);
        assert_eq!(
            router.misses,
            Misses {
                mirror: 1,
                cache: 0
            }
        );
        // Mirror off: a key only the mirror holds is not found, and no mirror miss counts.
        reg.remove_from_mirror_for_test(&dst.key);
        let router_config = config(false, false);
        let mut router = Router::new(&router_config);
        assert_eq!(local_id(route(&mut router, &reg, &dst.key, now)), Some(1));
        assert_eq!(router.misses, Misses::default());
        // Mirror on and hitting: the LRU is not consulted, so it stays empty.
        let reg = registry();
        reg.register(&dst);
        let router_config = config(true, true);
        let mut router = Router::new(&router_config);
        route(&mut router, &reg, &dst.key, now);
        assert_eq!(router.cached(), 0);
        assert_eq!(router.misses, Misses::default());
    }

    #[test]
    fn every_mode_finds_every_destination() {
        let bench = bench::LookupBench::new(4);
        for (mirror, cache) in [(false, false), (false, true), (true, false), (true, true)] {
            let router_config = config(mirror, cache);
            let mut r = bench.router(&router_config);
            for i in 0..16 {
                assert!(r.lookup(i), "mirror={mirror} cache={cache} i={i}");
            }
        }
    }
}
