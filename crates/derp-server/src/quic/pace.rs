//! Each connection's pacing below quinn-proto's own pacer.
//!
//! quinn-proto paces in bursts of at least ten full-size packets (a bucket of 2 ms of the
//! rate, never less than ten packets), and nothing in its API makes them smaller. A
//! bottleneck with little buffer overflows on every such burst whatever the congestion
//! controller does: at 10 Mbit/s a 2 ms drop-tail queue holds two packets and a token-bucket
//! policer of 10 ms about ten, while a TCP flow beside it paces one or two packets at a
//! time. So the driver asks a connection for packets only as [`Pacer`] allows: bursts of
//! [`MIN_BURST`] datagrams at low rates, [`BURST_TIME`] of the rate at high ones (where the
//! timer's millisecond could not release smaller bursts often enough), at [`GAIN`] times
//! the congestion window per smoothed round trip.
//!
//! Packets are held before quinn-proto builds them, not after: quinn-proto stamps a packet
//! when it builds it, and a packet held after that would add its wait to every round trip
//! the congestion controller measures (which loss-filter would read as a queue).

use std::time::{Duration, Instant};

/// Datagrams per burst at low rates: what a TCP sender's pacing sends at once.
pub(super) const MIN_BURST: u64 = 2;
/// The rate's bytes per burst at high rates: a timer fires about every millisecond, so
/// smaller bursts would hold a fast path below its rate.
pub(super) const BURST_TIME: Duration = Duration::from_millis(1);
/// The pacing rate over the window per smoothed round trip: RFC 9002 §7.7's N = 1.25 less
/// a little, so that quinn-proto's pacer (at 1.25, same window and round trip) always
/// has a burst ready when this one releases. When it has not, it holds until its whole
/// 10-packet bucket has refilled, a gap this pacer cannot make up (its bucket is smaller).
pub(super) const GAIN: f64 = 1.2;

/// A token bucket in bytes for one connection.
#[derive(Debug, Default)]
pub(crate) struct Pacer {
    /// Bytes that may go; below zero after a transmit larger than what was left.
    tokens: f64,
    /// When the tokens were last counted; `None` while unpaced (the next paced release
    /// starts with a full bucket).
    last: Option<Instant>,
}

/// What the pacer needs of the connection: its pacing rate and largest datagram.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rate {
    /// Bytes per second.
    pub(crate) bytes_per_sec: f64,
    pub(crate) mtu: u16,
}

impl Rate {
    /// [`GAIN`] times `window` per `srtt`; `None` (no pacing) without a round trip.
    pub(crate) fn of(window: u64, srtt: Duration, mtu: u16) -> Option<Self> {
        let secs = srtt.as_secs_f64();
        if secs <= 0.0 || window == 0 || mtu == 0 {
            return None;
        }
        Some(Self {
            bytes_per_sec: window as f64 * GAIN / secs,
            mtu,
        })
    }

    /// The largest burst: [`MIN_BURST`] datagrams, or [`BURST_TIME`] of the rate if more.
    fn capacity(&self) -> f64 {
        (MIN_BURST as f64 * f64::from(self.mtu)).max(self.bytes_per_sec * BURST_TIME.as_secs_f64())
    }
}

impl Pacer {
    /// How many datagrams of up to `rate.mtu` bytes may go now (`usize::MAX` when `rate`
    /// is `None`: not paced). 0: none until [`Pacer::next_release`].
    pub(crate) fn allowance(&mut self, now: Instant, rate: Option<Rate>) -> usize {
        let Some(rate) = rate else {
            self.last = None;
            return usize::MAX;
        };
        let capacity = rate.capacity();
        self.tokens = match self.last {
            None => capacity,
            Some(last) => {
                let elapsed = now.saturating_duration_since(last).as_secs_f64();
                (self.tokens + elapsed * rate.bytes_per_sec).min(capacity)
            }
        };
        self.last = Some(now);
        let mtu = f64::from(rate.mtu);
        if self.tokens < mtu {
            return 0;
        }
        // Truncates: whole datagrams only.
        (self.tokens / mtu) as usize
    }

    /// Counts a transmit of `bytes` (a GSO batch's whole size).
    pub(crate) fn on_sent(&mut self, bytes: usize) {
        if self.last.is_some() {
            self.tokens -= bytes as f64;
        }
    }

    /// When the next datagram may go at `rate`, after an [`Pacer::allowance`] of 0.
    pub(crate) fn next_release(&self, now: Instant, rate: Rate) -> Instant {
        let last = self.last.unwrap_or(now);
        let missing = (f64::from(rate.mtu) - self.tokens).max(0.0);
        // Rounded up, and a nanosecond more: woken at the deadline, the tokens are there
        // (a deadline a rounding short would wake to an allowance of 0, and again, and spin).
        let nanos = (missing / rate.bytes_per_sec * 1e9)
            .ceil()
            .min(u64::MAX as f64) as u64;
        last + Duration::from_nanos(nanos.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MTU: u16 = 1200;

    /// 10 Mbit/s at a 40 ms round trip: the window of one bandwidth-delay product.
    fn slow() -> Rate {
        Rate::of(50_000, Duration::from_millis(40), MTU).unwrap()
    }

    /// Sends as much as the pacer allows at each of `wakes`, in full-size datagrams, as
    /// the driver does; returns each release's datagram count.
    fn drive(p: &mut Pacer, rate: Rate, wakes: impl IntoIterator<Item = Instant>) -> Vec<usize> {
        let mut released = Vec::new();
        for now in wakes {
            let n = p.allowance(now, Some(rate));
            // A sender with an unlimited backlog takes all of it.
            p.on_sent(n * usize::from(rate.mtu));
            released.push(n);
        }
        released
    }

    #[test]
    fn rate_is_the_window_per_round_trip_times_the_gain() {
        let r = slow();
        assert!((r.bytes_per_sec - 50_000.0 * GAIN / 0.040).abs() < 1e-6);
        assert_eq!(Rate::of(50_000, Duration::ZERO, MTU), None);
        assert_eq!(Rate::of(0, Duration::from_millis(40), MTU), None);
    }

    #[test]
    fn bursts_at_low_rates_are_two_datagrams() {
        let mut p = Pacer::default();
        let t0 = Instant::now();
        let rate = slow();
        // Woken late, after 100 ms idle: still no more than the bucket.
        let released = drive(&mut p, rate, [t0, t0 + Duration::from_millis(100)]);
        assert_eq!(released, [2, 2]);
        // Right after a release, nothing more.
        assert_eq!(p.allowance(t0 + Duration::from_millis(100), Some(rate)), 0);
    }

    #[test]
    fn releases_are_spaced_at_the_rate() {
        let mut p = Pacer::default();
        let t0 = Instant::now();
        let rate = slow();
        assert_eq!(p.allowance(t0, Some(rate)), 2);
        p.on_sent(2 * usize::from(MTU));
        let mut now = t0;
        let mut sent = 0usize;
        for _ in 0..1000 {
            let next = p.next_release(now, rate);
            assert!(next > now, "a release waits for its tokens");
            now = next;
            let n = p.allowance(now, Some(rate));
            // Woken at the release time, exactly one datagram's tokens are there.
            assert_eq!(n, 1);
            p.on_sent(n * usize::from(MTU));
            sent += n;
        }
        // 1,000 datagrams after the first burst took 1,000 datagrams' time at the rate.
        let secs = now.duration_since(t0).as_secs_f64();
        let expected = sent as f64 * f64::from(MTU) / rate.bytes_per_sec;
        assert!(
            (secs - expected).abs() < 1e-3,
            "{secs} s against {expected} s"
        );
    }

    #[test]
    fn a_millisecond_timer_keeps_the_rate_with_small_bursts() {
        let mut p = Pacer::default();
        let t0 = Instant::now();
        let rate = slow();
        // Woken every millisecond, as the runtime's timer does, for a second.
        let wakes = (0..=1000).map(|ms| t0 + Duration::from_millis(ms));
        let released = drive(&mut p, rate, wakes);
        assert!(released.iter().all(|&n| n <= 2), "{released:?}");
        let bytes = released.iter().sum::<usize>() as f64 * f64::from(MTU);
        // The rate, less at most the one datagram left in the bucket, plus the first burst.
        assert!(
            bytes <= rate.bytes_per_sec + 2.0 * f64::from(MTU),
            "{bytes}"
        );
        assert!(bytes >= rate.bytes_per_sec - f64::from(MTU), "{bytes}");
    }

    #[test]
    fn bursts_grow_with_the_rate() {
        // 1 Gbit/s at 1 ms: 1 ms of the rate is about 100 full-size datagrams.
        let rate = Rate::of(125_000, Duration::from_millis(1), MTU).unwrap();
        let mut p = Pacer::default();
        let t0 = Instant::now();
        let wakes = (0..=100).map(|ms| t0 + Duration::from_millis(ms));
        let released = drive(&mut p, rate, wakes);
        let burst = (rate.bytes_per_sec * 1e-3 / f64::from(MTU)) as usize;
        assert!(burst > 100);
        assert!(released.iter().all(|&n| n <= burst), "{released:?}");
        let bytes = released.iter().sum::<usize>() as f64 * f64::from(MTU);
        assert!(
            bytes >= rate.bytes_per_sec * 0.1 - f64::from(MTU),
            "{bytes}"
        );
    }

    #[test]
    fn unpaced_allows_everything_and_restarts_full() {
        let mut p = Pacer::default();
        let t0 = Instant::now();
        assert_eq!(p.allowance(t0, None), usize::MAX);
        p.on_sent(100_000);
        assert_eq!(p.allowance(t0, Some(slow())), 2);
    }

    #[test]
    fn small_transmits_cost_their_size() {
        let mut p = Pacer::default();
        let t0 = Instant::now();
        let rate = slow();
        assert_eq!(p.allowance(t0, Some(rate)), 2);
        // An acknowledgement alone.
        p.on_sent(50);
        assert_eq!(p.allowance(t0, Some(rate)), 1);
    }
}
