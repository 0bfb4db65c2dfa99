//! Token-bucket pacing for senders.
//!
//! An unpaced sender measures how fast TCP backpressure lets it write, which mixes the
//! relay's speed with the bench's. A paced sender offers a known load, so what the relay
//! fails to deliver is visible as loss or shortfall.

use std::time::Duration;

use tokio::time::Instant;

/// A token bucket: `rate` tokens per second, holding at most `burst`.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A bucket that starts empty at `now`. The burst covers a few timer ticks (tokio's timer
    /// wakes at millisecond granularity), so coarse wakeups do not lose offered load, but a
    /// sender stalled by backpressure cannot catch up with a large burst later.
    pub fn new(rate: f64, now: Instant) -> Self {
        let burst = (rate * BURST_WINDOW.as_secs_f64()).max(1.0);
        Self {
            rate,
            burst,
            tokens: 0.0,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = now;
    }

    /// Takes up to `max` whole tokens.
    pub fn take(&mut self, now: Instant, max: u64) -> u64 {
        self.refill(now);
        let n = (self.tokens.floor() as u64).min(max);
        self.tokens -= n as f64;
        n
    }

    /// When the next whole token will be there.
    pub fn next_ready(&self, now: Instant) -> Instant {
        let missing = (1.0 - self.tokens).max(0.0);
        now + Duration::from_secs_f64(missing / self.rate)
    }
}

const BURST_WINDOW: Duration = Duration::from_millis(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn paces_at_the_rate_over_time() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(10_000.0, start);
        let mut sent = 0;
        let end = start + Duration::from_secs(1);
        loop {
            let now = Instant::now();
            if now >= end {
                break;
            }
            let n = bucket.take(now, 64);
            sent += n;
            if n == 0 {
                tokio::time::sleep_until(bucket.next_ready(now).min(end)).await;
            }
        }
        assert!((9_900..=10_001).contains(&sent), "sent {sent}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_does_not_allow_a_big_burst() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(1000.0, start);
        tokio::time::advance(Duration::from_secs(10)).await;
        // 10 ms worth at 1000/s.
        assert_eq!(bucket.take(Instant::now(), u64::MAX), 10);
        assert_eq!(bucket.take(Instant::now(), u64::MAX), 0);
        let ready = bucket.next_ready(Instant::now());
        assert_eq!(ready - Instant::now(), Duration::from_millis(1));
    }

    #[test]
    fn low_rates_still_get_a_token() {
        let now = Instant::now();
        let mut bucket = TokenBucket::new(0.5, now);
        assert_eq!(bucket.take(now + Duration::from_secs(2), 10), 1);
    }
}
