//! Short-lived memory of admission decisions, and merging of concurrent questions.
//!
//! Keyed by node key *and* source address: the admission server is told the source and may
//! decide by it, so a decision for one address is not reused for another. Only definite
//! answers are kept (an explicit allow or deny); failures to get an answer are never cached,
//! so the next client tries again. Questions about a client that is already being asked about
//! wait for that answer instead of sending their own.

use std::collections::HashMap;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use derp_server::{AdmissionRequest, Verdict};
use lru::LruCache;
use prometheus::IntCounter;
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// How long decisions are remembered, and how many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// How long an allow is reused. A key revoked at the admission server can still connect
    /// for this long.
    pub allow_ttl: Duration,
    /// How long a deny is reused.
    pub deny_ttl: Duration,
    /// Most decisions kept; the least recently used go first. 0 disables the cache (requests
    /// already in flight are still shared).
    pub max_entries: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            allow_ttl: Duration::from_secs(30),
            deny_ttl: Duration::from_secs(10),
            max_entries: 10_000,
        }
    }
}

/// A decision and whether it may be remembered.
pub(crate) struct Decision {
    pub(crate) verdict: Verdict,
    pub(crate) definite: bool,
}

type InFlight = Arc<OnceCell<Verdict>>;

#[derive(Debug)]
pub(crate) struct DecisionCache {
    config: CacheConfig,
    hits: IntCounter,
    entries: Mutex<Option<LruCache<AdmissionRequest, (Verdict, Instant)>>>,
    in_flight: Mutex<HashMap<AdmissionRequest, InFlight>>,
}

impl DecisionCache {
    pub(crate) fn new(config: CacheConfig, hits: IntCounter) -> Self {
        Self {
            entries: Mutex::new(NonZeroUsize::new(config.max_entries).map(LruCache::new)),
            config,
            hits,
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    /// The remembered decision for `req`, or the one `ask` comes to (shared with every other
    /// caller asking about `req` meanwhile).
    pub(crate) async fn decide<F, Fut>(&self, req: AdmissionRequest, ask: F) -> Verdict
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Decision>,
    {
        if let Some(v) = self.remembered(&req) {
            self.hits.inc();
            return v;
        }
        let (cell, leader) = {
            let mut map = lock(&self.in_flight);
            match map.get(&req) {
                Some(cell) => (cell.clone(), false),
                None => {
                    let cell = InFlight::default();
                    map.insert(req, cell.clone());
                    (cell, true)
                }
            }
        };
        if !leader {
            self.hits.inc();
        }
        // Whether answered or abandoned (its client hung up, or was evicted, mid-question),
        // the question leaves the map unless another caller still waits on it.
        let leave = Leave {
            map: &self.in_flight,
            req,
            cell,
        };
        // If the task that started the question goes away, the next waiter runs `ask`
        // itself: OnceCell hands initialisation on.
        leave
            .cell
            .get_or_init(|| async {
                let d = ask().await;
                if d.definite {
                    self.remember(req, &d.verdict);
                }
                d.verdict
            })
            .await
            .clone()
    }

    #[cfg(test)]
    fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    fn remembered(&self, req: &AdmissionRequest) -> Option<Verdict> {
        let mut entries = lock(&self.entries);
        let lru = entries.as_mut()?;
        match lru.get(req) {
            Some((v, expires)) if *expires > Instant::now() => Some(v.clone()),
            Some(_) => {
                lru.pop(req);
                None
            }
            None => None,
        }
    }

    fn remember(&self, req: AdmissionRequest, verdict: &Verdict) {
        let ttl = if verdict.is_ok() {
            self.config.allow_ttl
        } else {
            self.config.deny_ttl
        };
        if ttl.is_zero() {
            return;
        }
        if let Some(lru) = lock(&self.entries).as_mut() {
            lru.put(req, (verdict.clone(), Instant::now() + ttl));
        }
    }
}

/// One caller's hold on a question in flight. Dropped, it removes the question from the map
/// once it is answered, or when no other caller holds it any more (only the map's handle and
/// this one are left): an abandoned question nobody waits for would otherwise stay for good,
/// one entry per client key, which clients choose freely.
struct Leave<'a> {
    map: &'a Mutex<HashMap<AdmissionRequest, InFlight>>,
    req: AdmissionRequest,
    cell: InFlight,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut map = lock(self.map);
        // Under the map's lock no other caller can take a new handle meanwhile.
        let done = self.cell.initialized() || Arc::strong_count(&self.cell) <= 2;
        if done
            && map
                .get(&self.req)
                .is_some_and(|c| Arc::ptr_eq(c, &self.cell))
        {
            map.remove(&self.req);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain maps; a panic elsewhere cannot leave them inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use derp_proto::PublicKey;
    use derp_server::Refused;

    use super::*;

    fn req(k: u8) -> AdmissionRequest {
        AdmissionRequest {
            key: PublicKey::from_bytes([k; 32]),
            source: "192.0.2.1".parse().expect("ip"),
        }
    }

    fn cache(max_entries: usize) -> DecisionCache {
        DecisionCache::new(
            CacheConfig {
                allow_ttl: Duration::from_secs(30),
                deny_ttl: Duration::from_secs(10),
                max_entries,
            },
            IntCounter::new("hits", "hits").expect("counter"),
        )
    }

    async fn ask(
        c: &DecisionCache,
        r: AdmissionRequest,
        asked: &AtomicUsize,
        d: Decision,
    ) -> Verdict {
        c.decide(r, || async {
            asked.fetch_add(1, Ordering::SeqCst);
            d
        })
        .await
    }

    fn allow() -> Decision {
        Decision {
            verdict: Ok(()),
            definite: true,
        }
    }

    fn deny(definite: bool) -> Decision {
        Decision {
            verdict: Err(Refused::new("denied", "no")),
            definite,
        }
    }

    /// A client that goes away mid-question (evicted, timed out) leaves nothing behind when
    /// nobody else waits on the question; one that others wait on is taken over by them.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_question_leaves_nothing_in_flight() {
        let c = cache(100);
        for k in 0..50u8 {
            let q = c.decide(req(k), std::future::pending::<Decision>);
            assert!(
                tokio::time::timeout(Duration::from_secs(1), q)
                    .await
                    .is_err()
            );
        }
        assert_eq!(c.in_flight(), 0);

        // Abandoned by the first caller while a second waits: the second asks and answers.
        let asked = AtomicUsize::new(0);
        let mut first = Box::pin(c.decide(req(1), std::future::pending::<Decision>));
        let mut second = Box::pin(ask(
            &c,
            req(1),
            &asked,
            Decision {
                verdict: Ok(()),
                definite: true,
            },
        ));
        // Both start; the first is then dropped mid-question.
        assert!(futures_poll(first.as_mut()).is_pending());
        assert!(futures_poll(second.as_mut()).is_pending());
        assert_eq!(c.in_flight(), 1);
        drop(first);
        assert!(second.await.is_ok());
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert_eq!(c.in_flight(), 0);
    }

    /// Polls `f` once with a waker that does nothing.
    fn futures_poll<F: Future>(f: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
        f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test(start_paused = true)]
    async fn definite_answers_are_reused_until_they_expire() {
        let c = cache(100);
        let asked = AtomicUsize::new(0);
        assert!(ask(&c, req(1), &asked, allow()).await.is_ok());
        assert!(
            ask(&c, req(1), &asked, deny(true)).await.is_ok(),
            "cached allow"
        );
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert!(ask(&c, req(2), &asked, deny(true)).await.is_err());
        assert!(
            ask(&c, req(2), &asked, allow()).await.is_err(),
            "cached deny"
        );
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(
            ask(&c, req(2), &asked, allow()).await.is_ok(),
            "deny expired"
        );
        assert!(
            ask(&c, req(1), &asked, deny(true)).await.is_ok(),
            "allow lasts longer"
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            ask(&c, req(1), &asked, deny(true)).await.is_err(),
            "allow expired"
        );
        assert_eq!(asked.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_not_remembered_and_the_size_is_bounded() {
        let c = cache(2);
        let asked = AtomicUsize::new(0);
        assert!(ask(&c, req(1), &asked, deny(false)).await.is_err());
        assert!(ask(&c, req(1), &asked, allow()).await.is_ok());
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        ask(&c, req(2), &asked, allow()).await.expect("allow");
        ask(&c, req(3), &asked, allow()).await.expect("allow");
        // req(1) was the least recently used and made room.
        assert!(ask(&c, req(1), &asked, deny(true)).await.is_err());
        assert_eq!(asked.load(Ordering::SeqCst), 5);
        let off = cache(0);
        ask(&off, req(1), &asked, allow()).await.expect("allow");
        assert!(ask(&off, req(1), &asked, deny(true)).await.is_err());
    }

    #[tokio::test]
    async fn concurrent_questions_share_one_answer() {
        let c = Arc::new(cache(0));
        let asked = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Notify::new());
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let (c, asked, gate) = (c.clone(), asked.clone(), gate.clone());
            tasks.spawn(async move {
                c.decide(req(1), || async move {
                    asked.fetch_add(1, Ordering::SeqCst);
                    gate.notified().await;
                    allow()
                })
                .await
            });
        }
        // Every task is waiting on the one question before it is answered: the map's cell
        // is held by the map and by each of the ten callers.
        let holders = || lock(&c.in_flight).get(&req(1)).map_or(0, Arc::strong_count);
        while holders() < 11 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        while let Some(v) = tasks.join_next().await {
            assert!(v.expect("task").is_ok());
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert!(lock(&c.in_flight).is_empty());
    }
}
