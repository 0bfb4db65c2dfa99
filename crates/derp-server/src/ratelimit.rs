//! Per-client receive rate limiting: a token bucket kept by each read loop.
//!
//! Nothing is dropped: a client over its rate is simply read more slowly, so TCP flow control
//! pushes back on the sender. The clock is read and the bucket refilled once per read batch;
//! each frame handled then takes its bytes from the bucket (one subtraction), and once the
//! bucket is in debt the loop stops handling frames and reads nothing more until the debt is
//! paid and a quantum of tokens has built up. Frames therefore leave at the rate in steady
//! sub-batches of about [`QUANTUM`] bytes, never in read-sized bursts that would overflow a
//! receiver's queue.
//!
//! The configuration can change at any time ([`RateLimits::set`], on SIGHUP in derpd): each
//! connection notices the new generation at its next batch, duplicates included.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge, Registry};
use tokio::time::Instant;

/// The largest frame a client can send: the 5-byte header, a 32-byte key and a 64 KiB packet.
/// The burst is never smaller, so that a maximal SendPacket always fits.
pub const MIN_RATE_BURST: u64 = 5 + 32 + 65536;

/// A per-client receive limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Bytes per second each client may send; 0 disables limiting.
    pub bytes_per_sec: u64,
    /// Bytes a client may send at once after being quiet.
    pub burst_bytes: u64,
}

impl RateLimit {
    /// No limit.
    pub const OFF: Self = Self {
        bytes_per_sec: 0,
        burst_bytes: 0,
    };

    /// A limit of `bytes_per_sec` with `burst_bytes`, the burst raised to at least
    /// [`MIN_RATE_BURST`]. A rate of 0 is [`RateLimit::OFF`].
    pub fn new(bytes_per_sec: u64, burst_bytes: u64) -> Self {
        if bytes_per_sec == 0 {
            return Self::OFF;
        }
        Self {
            bytes_per_sec,
            burst_bytes: burst_bytes.max(MIN_RATE_BURST),
        }
    }

    /// Whether this limits anything.
    pub fn is_on(&self) -> bool {
        self.bytes_per_sec > 0
    }
}

/// The limit in force, shared by every connection.
#[derive(Debug)]
pub(crate) struct RateLimits {
    /// Bumped on every change, so read loops notice with one atomic load.
    generation: AtomicU64,
    current: Mutex<RateLimit>,
    metrics: Option<RateMetrics>,
}

/// Published only when rate limiting was configured at start, as derper does.
#[derive(Debug)]
struct RateMetrics {
    bytes_per_second: IntGauge,
    burst_bytes: IntGauge,
    waited: IntCounter,
}

impl RateLimits {
    /// `initial` is `None` when rate limiting is not configured at all: the metrics are then
    /// not registered.
    pub(crate) fn new(
        initial: Option<RateLimit>,
        registry: &Registry,
    ) -> Result<Self, prometheus::Error> {
        let metrics = match initial {
            None => None,
            Some(_) => {
                let m = RateMetrics {
                    bytes_per_second: IntGauge::new(
                        "derp_rate_limit_per_client_bytes_per_second",
                        "per-client receive rate limit in bytes per second (0: off)",
                    )?,
                    burst_bytes: IntGauge::new(
                        "derp_rate_limit_per_client_burst_bytes",
                        "per-client receive burst in bytes",
                    )?,
                    waited: IntCounter::new(
                        "derp_rate_limit_per_client_waited",
                        "times a client's read loop waited for its rate limit",
                    )?,
                };
                registry.register(Box::new(m.bytes_per_second.clone()))?;
                registry.register(Box::new(m.burst_bytes.clone()))?;
                registry.register(Box::new(m.waited.clone()))?;
                Some(m)
            }
        };
        let this = Self {
            generation: AtomicU64::new(1),
            current: Mutex::new(RateLimit::OFF),
            metrics,
        };
        this.set(initial.unwrap_or(RateLimit::OFF));
        Ok(this)
    }

    /// Puts `limit` in force for every connection, existing ones included.
    pub(crate) fn set(&self, limit: RateLimit) {
        let limit = RateLimit::new(limit.bytes_per_sec, limit.burst_bytes);
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = limit;
        self.generation.fetch_add(1, Ordering::Release);
        if let Some(m) = &self.metrics {
            m.bytes_per_second
                .set(i64::try_from(limit.bytes_per_sec).unwrap_or(i64::MAX));
            m.burst_bytes
                .set(i64::try_from(limit.burst_bytes).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn get(&self) -> RateLimit {
        *self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn note_wait(&self) {
        if let Some(m) = &self.metrics {
            m.waited.inc();
        }
    }
}

/// How many bytes of frames a paced client gets handled at a time (or the burst, if
/// smaller): small enough that a sub-batch of full-size packets fits a default send queue,
/// large enough that pacing costs a timer per 16 KiB, not per frame.
pub(crate) const QUANTUM: f64 = 16.0 * 1024.0;

/// One connection's bucket. Only its read loop touches it.
#[derive(Debug)]
pub(crate) struct ClientLimiter {
    generation: u64,
    /// Bytes per second; 0 when the limit is off.
    rate: f64,
    burst: f64,
    /// Negative when the last frame handled took more than was left.
    tokens: f64,
    /// When `tokens` was last refilled.
    last: Instant,
}

impl ClientLimiter {
    /// A full bucket under the limit in force now.
    pub(crate) fn new(limits: &RateLimits, now: Instant) -> Self {
        let mut l = Self {
            generation: 0,
            rate: 0.0,
            burst: 0.0,
            tokens: 0.0,
            last: now,
        };
        l.sync(limits);
        l.tokens = l.burst;
        l
    }

    /// Picks up a changed configuration. Saved-up tokens are kept up to the new burst.
    fn sync(&mut self, limits: &RateLimits) {
        let generation = limits.generation();
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        let limit = limits.get();
        self.rate = limit.bytes_per_sec as f64;
        self.burst = limit.burst_bytes as f64;
        self.tokens = self.tokens.min(self.burst);
    }

    /// Starts a batch at `now`: the configuration in force, and the tokens earned since the
    /// last batch.
    pub(crate) fn begin_batch(&mut self, limits: &RateLimits, now: Instant) {
        self.sync(limits);
        if self.rate <= 0.0 {
            return;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
    }

    /// Takes a handled frame's bytes.
    pub(crate) fn charge(&mut self, bytes: usize) {
        if self.rate > 0.0 {
            self.tokens -= bytes as f64;
        }
    }

    /// Whether the bucket is in debt: no more frames until [`ClientLimiter::resume_at`].
    pub(crate) fn in_debt(&self) -> bool {
        self.rate > 0.0 && self.tokens < 0.0
    }

    /// When in debt, the time at which the debt is paid and a quantum has built up (and the
    /// wait is counted); `None` when frames may be handled now.
    pub(crate) fn resume_at(&self, limits: &RateLimits) -> Option<Instant> {
        if !self.in_debt() {
            return None;
        }
        limits.note_wait();
        let target = QUANTUM.min(self.burst);
        Some(self.last + Duration::from_secs_f64((target - self.tokens) / self.rate))
    }

    /// The bucket's tokens as of `now`, for a successor process to continue from.
    pub(crate) fn tokens_at(&self, now: Instant) -> f64 {
        if self.rate <= 0.0 {
            return self.tokens;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        (self.tokens + elapsed * self.rate).min(self.burst)
    }

    /// A bucket holding `tokens` (a predecessor process's, see [`ClientLimiter::tokens_at`])
    /// under the limit in force now.
    pub(crate) fn resumed(limits: &RateLimits, tokens: f64, now: Instant) -> Self {
        let mut l = Self::new(limits, now);
        if tokens.is_finite() {
            l.tokens = tokens.min(l.burst);
        }
        l
    }

    #[cfg(test)]
    pub(crate) fn limit(&self) -> (f64, f64) {
        (self.rate, self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rate: u64, burst: u64) -> RateLimits {
        RateLimits::new(Some(RateLimit::new(rate, burst)), &Registry::new()).expect("metrics")
    }

    #[test]
    fn burst_is_at_least_one_maximal_frame_and_zero_rate_is_off() {
        assert_eq!(RateLimit::new(1000, 10).burst_bytes, MIN_RATE_BURST);
        assert_eq!(RateLimit::new(1000, 1 << 20).burst_bytes, 1 << 20);
        assert_eq!(RateLimit::new(0, 1 << 20), RateLimit::OFF);
        assert!(!RateLimit::OFF.is_on());
    }

    /// Handles `frames` frames of `size` bytes as a read loop would, from `now`: returns how
    /// many were handled before the bucket went into debt.
    fn handle(
        c: &mut ClientLimiter,
        l: &RateLimits,
        now: Instant,
        frames: usize,
        size: usize,
    ) -> usize {
        c.begin_batch(l, now);
        let mut n = 0;
        while n < frames && !c.in_debt() {
            c.charge(size);
            n += 1;
        }
        n
    }

    #[test]
    fn a_full_bucket_passes_the_burst_then_paces_in_quanta() {
        let l = limits(100_000, 200_000);
        let t0 = Instant::now();
        let mut c = ClientLimiter::new(&l, t0);
        // 200 000 tokens: 200 frames of 1000 bytes pass, the 201st puts it in debt.
        assert_eq!(handle(&mut c, &l, t0, 500, 1000), 201);
        let at = c.resume_at(&l).expect("must wait");
        // 1000 bytes of debt plus a 16 KiB quantum at 100 000 B/s.
        let want = (1000.0 + QUANTUM) / 100_000.0;
        assert!(((at - t0).as_secs_f64() - want).abs() < 1e-6);
        // Then a quantum at a time, never more.
        let handled = handle(&mut c, &l, at, 500, 1000);
        assert_eq!(handled, 17, "16 KiB of tokens pass 17 frames of 1000 bytes");
        // Over a long run the rate holds: 1000 more frames take 10 s.
        let (mut t, mut done) = (at, 0);
        while done < 1000 {
            t = c.resume_at(&l).expect("paced");
            done += handle(&mut c, &l, t, 1000 - done, 1000);
        }
        let secs = (t - at).as_secs_f64();
        assert!((secs - 10.0).abs() < 0.2, "{secs}");
    }

    /// What the limit grants a client that always has frames waiting, on an injected clock:
    /// by every batch, the burst plus the rate times the time since the start, never more
    /// and never less by more than the one frame that put the bucket in debt; and a batch at
    /// [`ClientLimiter::resume_at`] handles one quantum (and that frame). Batches come at the
    /// times the limiter names and at others in between, as a reader woken by new bytes
    /// begins one early.
    #[test]
    fn a_busy_client_is_granted_the_burst_plus_the_rate_and_a_quantum_per_refill() {
        let (rate, burst) = (1_000_000u64, 100_000u64);
        let l = limits(rate, burst);
        let t0 = Instant::now();
        let mut c = ClientLimiter::new(&l, t0);
        let sizes = [1037usize, 60, 65573, 300, 4000, 5];
        let largest = *sizes.iter().max().expect("sizes") as f64;
        let (mut t, mut granted, mut k) = (t0, 0u64, 0usize);
        for step in 0u64..3000 {
            let due = c.resume_at(&l);
            let on_time = step % 3 != 1;
            t = match due {
                Some(at) if on_time => at,
                // Early, by a varying amount: before the debt is paid, or not long after.
                _ => t + Duration::from_micros(step * 7919 % 20_000),
            };
            c.begin_batch(&l, t);
            let mut batch = 0u64;
            while !c.in_debt() {
                let size = sizes[k % sizes.len()];
                k += 1;
                c.charge(size);
                batch += size as u64;
            }
            granted += batch;
            let promised = burst as f64 + rate as f64 * (t - t0).as_secs_f64();
            let got = granted as f64;
            assert!(
                got >= promised - 1.0 && got <= promised + largest + 1.0,
                "step {step}: granted {got}, promised {promised}"
            );
            if on_time && due.is_some_and(|at| at == t) {
                let b = batch as f64;
                assert!(
                    b >= QUANTUM - 1.0 && b <= QUANTUM + largest + 1.0,
                    "step {step}: a refill handled {b} bytes"
                );
            }
        }
        let secs = (t - t0).as_secs_f64();
        assert!(secs > 1.0, "the run covered {secs} s of the clock");
    }

    #[test]
    fn a_quiet_client_saves_up_no_more_than_the_burst() {
        let l = limits(100_000, 200_000);
        let t0 = Instant::now();
        let mut c = ClientLimiter::new(&l, t0);
        assert_eq!(handle(&mut c, &l, t0, 200, 1000), 200);
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(handle(&mut c, &l, later, 1000, 1000), 201);
    }

    #[test]
    fn changes_reach_existing_buckets_at_their_next_batch() {
        let l = limits(100_000, 200_000);
        let t0 = Instant::now();
        let mut a = ClientLimiter::new(&l, t0);
        let mut b = ClientLimiter::new(&l, t0);
        l.set(RateLimit::new(1_000_000, 0));
        a.begin_batch(&l, t0);
        assert_eq!(a.limit(), (1_000_000.0, MIN_RATE_BURST as f64));
        l.set(RateLimit::OFF);
        assert_eq!(
            handle(&mut b, &l, t0, 100_000, 1000),
            100_000,
            "off never waits"
        );
        assert_eq!(b.resume_at(&l), None);
        assert_eq!(b.limit().0, 0.0);
    }

    #[test]
    fn metrics_exist_only_when_configured() {
        let r = Registry::new();
        let _ = RateLimits::new(None, &r).expect("ok");
        assert!(r.gather().is_empty());
        let r = Registry::new();
        let l = RateLimits::new(Some(RateLimit::new(5000, 0)), &r).expect("ok");
        let names: Vec<String> = r.gather().iter().map(|f| f.name().to_owned()).collect();
        assert_eq!(names.len(), 3, "{names:?}");
        let t0 = Instant::now();
        let mut c = ClientLimiter::new(&l, t0);
        c.begin_batch(&l, t0);
        c.charge(MIN_RATE_BURST as usize + 1);
        assert!(c.resume_at(&l).is_some());
        let waited = r
            .gather()
            .into_iter()
            .find(|f| f.name() == "derp_rate_limit_per_client_waited")
            .expect("waited");
        assert_eq!(waited.get_metric()[0].get_counter().get_value(), 1.0);
    }
}
