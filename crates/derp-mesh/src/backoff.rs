//! Reconnect delays: capped exponential back-off with full jitter.
//!
//! Each wait is drawn uniformly from zero to the current ceiling, and the ceiling doubles up
//! to its cap. Jitter keeps the nodes of a region from reconnecting to a restarted sibling
//! in lockstep; the cap keeps a node that was down for long from waiting long once it is
//! back (derper retries every 5 s, which is the default cap).

use std::time::Duration;

use rand::Rng;

/// Back-off parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffConfig {
    /// Ceiling of the first wait.
    pub initial: Duration,
    /// Largest ceiling.
    pub max: Duration,
    /// A link that stayed up this long starts again from `initial` when it breaks.
    pub reset_after: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
            reset_after: Duration::from_secs(10),
        }
    }
}

/// The state of one link's back-off.
#[derive(Debug)]
pub(crate) struct Backoff {
    config: BackoffConfig,
    ceiling: Duration,
}

impl Backoff {
    pub(crate) fn new(config: BackoffConfig) -> Self {
        Self {
            config,
            ceiling: config.initial,
        }
    }

    /// The next wait, drawn from `[0, ceiling]`; doubles the ceiling up to the cap.
    pub(crate) fn next(&mut self, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling.min(self.config.max);
        self.ceiling = (ceiling * 2).min(self.config.max);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.gen_range(0..=nanos))
    }

    /// Starts again from the initial ceiling.
    pub(crate) fn reset(&mut self) {
        self.ceiling = self.config.initial;
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn ceilings_double_to_the_cap_and_reset() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut b = Backoff::new(BackoffConfig::default());
        let ceilings: Vec<u64> = (0..8)
            .map(|_| {
                let c = b.ceiling.min(b.config.max);
                let wait = b.next(&mut rng);
                assert!(wait <= c, "{wait:?} above its ceiling {c:?}");
                c.as_millis() as u64
            })
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        b.reset();
        assert!(b.next(&mut rng) <= Duration::from_millis(100));
    }

    #[test]
    fn waits_are_spread_over_the_whole_range() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let config = BackoffConfig {
            initial: Duration::from_secs(5),
            ..BackoffConfig::default()
        };
        let waits: Vec<Duration> = (0..200)
            .map(|_| Backoff::new(config).next(&mut rng))
            .collect();
        let low = waits
            .iter()
            .filter(|w| **w < Duration::from_secs(1))
            .count();
        let high = waits
            .iter()
            .filter(|w| **w > Duration::from_secs(4))
            .count();
        assert!(low > 10 && high > 10, "low {low}, high {high}");
    }
}
