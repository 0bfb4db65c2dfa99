//! The admission checks' own counters (the relay counts refusals itself, in
//! `derp_admission_refused{reason}`).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Counters shared by the checks of one server; register once per registry.
#[derive(Clone, Debug)]
pub struct AdmissionMetrics {
    requests: IntCounterVec,
    cache_hits: IntCounterVec,
    pub(crate) fail_open: IntCounter,
    pub(crate) allow_keys: IntGauge,
    pub(crate) allow_keys_reload_errors: IntCounter,
}

impl AdmissionMetrics {
    /// Creates the counters and registers them on `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "derp_admission_requests",
                "questions sent to an admission service (check: url or tailscaled), by result \
                 (allow, deny, error)",
            ),
            &["check", "result"],
        )?;
        let cache_hits = IntCounterVec::new(
            Opts::new(
                "derp_admission_cache_hits",
                "admission decisions answered from the cache or by a request already in flight",
            ),
            &["check"],
        )?;
        let fail_open = IntCounter::new(
            "derp_admission_fail_open",
            "clients admitted because the admission server could not be reached (fail-open)",
        )?;
        let allow_keys = IntGauge::new("derp_allow_keys", "keys in the allow-keys file in force")?;
        let allow_keys_reload_errors = IntCounter::new(
            "derp_allow_keys_reload_errors",
            "re-reads of the allow-keys file that failed (the old list stayed in force)",
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(cache_hits.clone()))?;
        registry.register(Box::new(fail_open.clone()))?;
        registry.register(Box::new(allow_keys.clone()))?;
        registry.register(Box::new(allow_keys_reload_errors.clone()))?;
        Ok(Self {
            requests,
            cache_hits,
            fail_open,
            allow_keys,
            allow_keys_reload_errors,
        })
    }

    /// Counters for a registry nobody reads (tests, embedders without metrics).
    pub fn unregistered() -> Self {
        Self::register(&Registry::new()).unwrap_or_else(|_| unreachable!("fresh registry"))
    }

    pub(crate) fn request(&self, check: &str, result: &str) {
        self.requests.with_label_values(&[check, result]).inc();
    }

    pub(crate) fn cache_hit(&self, check: &str) -> IntCounter {
        self.cache_hits.with_label_values(&[check])
    }
}

/// Lets a repeated warning through at most once per period and counts the rest, so an
/// admission server that is down does not flood the log with one line per client.
#[derive(Debug)]
pub(crate) struct WarnLimiter {
    state: std::sync::Mutex<(Option<tokio::time::Instant>, u64)>,
}

const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl WarnLimiter {
    pub(crate) fn new() -> Self {
        Self {
            state: std::sync::Mutex::new((None, 0)),
        }
    }

    /// `Some(n)` when a warning may be logged now, `n` being how many were held back since
    /// the last one.
    pub(crate) fn allow(&self) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        if s.0
            .is_none_or(|t| now.saturating_duration_since(t) >= WARN_EVERY)
        {
            let held = s.1;
            *s = (Some(now), 0);
            Some(held)
        } else {
            s.1 += 1;
            None
        }
    }
}
