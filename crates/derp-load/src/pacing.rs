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

/// Packets per flush when a sender is not paced: enough to amortise the write call, small
/// enough that one connection does not hog a worker.
pub const UNPACED_BATCH: u64 = 16;
/// Most packets a paced sender queues before flushing. Kept well under the relay's
/// per-client queue depth (32 in derper and derpd): a relay reads a whole write at once, and a
/// burst larger than the destination's queue would be dropped even at a low average rate,
/// which would measure the bench's burstiness instead of the relay.
pub const PACED_BATCH: u64 = 8;

/// What a sender may send, and when: a sender asks at each instant it is free how many
/// packets are due, sends them and flushes, and sleeps until [`Pacer::next`] when none is.
#[derive(Debug)]
pub enum Pacer {
    /// As fast as the connection takes them, [`UNPACED_BATCH`] per flush.
    Unpaced,
    /// At the bucket's rate, at most [`PACED_BATCH`] per flush.
    Paced(TokenBucket),
}

impl Pacer {
    /// Paced at `rate_pps` packets per second from `now`, or unpaced without a rate.
    pub fn new(rate_pps: Option<f64>, now: Instant) -> Self {
        match rate_pps {
            Some(rate) => Self::Paced(TokenBucket::new(rate, now)),
            None => Self::Unpaced,
        }
    }

    /// How many packets are due at `now`; they count as sent.
    pub fn due(&mut self, now: Instant) -> u64 {
        match self {
            Self::Unpaced => UNPACED_BATCH,
            Self::Paced(bucket) => bucket.take(now, PACED_BATCH),
        }
    }

    /// When the next packet is due, for a sender that was just told none is; `None` when
    /// unpaced (one always is).
    pub fn next(&self, now: Instant) -> Option<Instant> {
        match self {
            Self::Unpaced => None,
            Self::Paced(bucket) => Some(bucket.next_ready(now)),
        }
    }

    /// Whether the sender is held to a rate.
    pub fn is_paced(&self) -> bool {
        matches!(self, Self::Paced(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A paced sender asked every `step` from `start` until `end`: what is due at each
    /// instant asked.
    fn schedule(pacer: &mut Pacer, start: Instant, step: Duration, end: Duration) -> Vec<u64> {
        let mut due = Vec::new();
        let mut at = start;
        while at <= start + end {
            due.push(pacer.due(at));
            at += step;
        }
        due
    }

    #[test]
    fn a_paced_sender_is_due_one_packet_per_interval_from_an_empty_bucket() {
        let start = Instant::now();
        // 1000 packets/s: one due per millisecond, none at the start.
        let mut pacer = Pacer::new(Some(1000.0), start);
        let due = schedule(&mut pacer, start, MS, 600 * MS);
        assert_eq!(due[0], 0);
        assert!(due[1..].iter().all(|&n| n == 1), "{due:?}");
        // Every packet of the window is due, and no more.
        assert_eq!(due.iter().sum::<u64>(), 600);
    }

    #[test]
    fn what_is_due_between_two_asks_is_the_time_between_them() {
        let start = Instant::now();
        let mut pacer = Pacer::new(Some(400.0), start);
        // 400 packets/s: one every 2.5 ms.
        assert_eq!(pacer.due(start + 2 * MS), 0);
        assert_eq!(pacer.next(start + 2 * MS), Some(start + 2 * MS + MS / 2));
        assert_eq!(pacer.due(start + 3 * MS), 1);
        assert_eq!(pacer.due(start + 8 * MS), 2);
        // Two asks at the same instant: the second finds nothing left.
        assert_eq!(pacer.due(start + 8 * MS), 0);
        // 800 packets/s for two pairs over 600 ms asked every 5 ms: 240 per pair.
        let start = Instant::now();
        let mut pacer = Pacer::new(Some(400.0), start);
        let due = schedule(&mut pacer, start, 5 * MS, 600 * MS);
        assert_eq!(due.iter().sum::<u64>(), 240);
        assert!(due[1..].iter().all(|&n| n == 2), "{due:?}");
    }

    #[test]
    fn a_stalled_sender_gets_a_burst_and_no_more_in_batches_the_relay_can_queue() {
        let start = Instant::now();
        let mut pacer = Pacer::new(Some(1000.0), start);
        // A sender held up for a second by the connection: the bucket holds 10 ms of tokens,
        // handed out at most a batch per flush.
        let later = start + Duration::from_secs(1);
        assert_eq!(pacer.due(later), PACED_BATCH);
        assert_eq!(pacer.due(later), 10 - PACED_BATCH);
        assert_eq!(pacer.due(later), 0);
        assert_eq!(pacer.next(later), Some(later + MS));
        assert_eq!(pacer.due(later + MS), 1);
    }

    #[test]
    fn an_unpaced_sender_always_has_a_batch_due() {
        let start = Instant::now();
        let mut pacer = Pacer::new(None, start);
        assert!(!pacer.is_paced());
        assert_eq!(pacer.due(start), UNPACED_BATCH);
        assert_eq!(pacer.due(start), UNPACED_BATCH);
        assert_eq!(pacer.next(start), None);
    }

    #[test]
    fn low_rates_still_get_a_token() {
        let now = Instant::now();
        let mut bucket = TokenBucket::new(0.5, now);
        assert_eq!(bucket.take(now + Duration::from_secs(2), 10), 1);
    }
}
