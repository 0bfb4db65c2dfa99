//! What every mode measures with: the bench's clock, round-trip histograms (and how they
//! cross between processes), CPU samples and metric scrapes.

use std::collections::BTreeMap;

use tokio::time::Instant;

use crate::procfs::CpuSample;
use crate::prom::Scrape;
use crate::report::Drops;
use crate::target::Target;

/// Monotonic time since the bench started, as carried in packets.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    /// A clock whose zero is now.
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// `t` in nanoseconds since the clock's zero.
    pub fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.start).as_nanos() as u64
    }
}

/// Round-trip times of the probes sent in the window, in nanoseconds.
pub type RttHistogram = hdrhistogram::Histogram<u64>;

/// A histogram for nanoseconds up to a minute at 3 significant digits.
pub fn new_histogram() -> RttHistogram {
    // The bounds are constants that hdrhistogram accepts (low >= 1, high >= 2 * low), so
    // this cannot fail.
    hdrhistogram::Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap()
}

/// A histogram as (value, count) pairs, to carry it between bench processes without losing
/// anything: each value is the top of its bucket, so it lands in the same bucket again.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct HistWire(Vec<(u64, u64)>);

impl HistWire {
    /// Every bucket of `h`.
    pub fn of(h: &RttHistogram) -> Self {
        Self(
            h.iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        )
    }

    /// Adds the values to `h`.
    pub fn add_to(&self, h: &mut RttHistogram) {
        for &(value, count) in &self.0 {
            h.saturating_record_n(value, count);
        }
    }
}

/// The bench's, the server's and the machine's CPU time now.
pub fn sample_cpu(target: &Target) -> CpuSample {
    CpuSample {
        bench: target.bench_cpu(),
        server: target.server_cpu(),
        machine: target.machine_cpu(),
    }
}

/// Scrapes the server's metrics if a source is configured; a failed scrape is reported once
/// on stderr and leaves the figures out rather than failing the run.
pub async fn scrape(target: &Target) -> Option<Scrape> {
    let source = target.metrics.as_ref()?;
    match source.scrape().await {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("derp-bench: warning: {e:#}");
            None
        }
    }
}

/// The change of `derp_packets_dropped` by reason between two scrapes.
pub fn drops_between(before: Option<&Scrape>, after: Option<&Scrape>) -> Option<Drops> {
    let (before, after) = (before?, after?);
    after.sum("derp_packets_dropped")?;
    let earlier = before.sum_by("derp_packets_dropped", "reason");
    let mut by_reason = BTreeMap::new();
    let mut total = 0;
    for (reason, value) in after.sum_by("derp_packets_dropped", "reason") {
        let was = earlier
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0.0, |(_, v)| *v);
        let delta = (value - was).max(0.0) as u64;
        total += delta;
        by_reason.insert(reason, delta);
    }
    Some(Drops {
        total_packets: total,
        by_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_cross_processes_intact() {
        let mut h = new_histogram();
        for v in [
            1u64,
            999,
            1_000,
            1_001,
            45_678,
            45_679,
            1_000_000_007,
            59_000_000_000,
        ] {
            h.record_n(v, v % 7 + 1).unwrap();
        }
        let wire: HistWire =
            serde_json::from_str(&serde_json::to_string(&HistWire::of(&h)).unwrap()).unwrap();
        let mut back = new_histogram();
        wire.add_to(&mut back);
        assert_eq!(back.len(), h.len());
        for q in [0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0] {
            assert_eq!(back.value_at_quantile(q), h.value_at_quantile(q), "q {q}");
        }
        assert_eq!((back.min(), back.max()), (h.min(), h.max()));
        // Two processes' histograms merge into the histogram of all values.
        wire.add_to(&mut back);
        assert_eq!(back.len(), 2 * h.len());
        assert_eq!(back.value_at_quantile(0.5), h.value_at_quantile(0.5));
    }
}
