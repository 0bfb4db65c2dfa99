//! Per-source caps on connections that have not proven anything yet (TLS handshakes, port-80
//! requests), so one host cannot use up a listener's global cap and lock everyone else out.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Counts in-flight connections per source: an IPv4 address, or an IPv6 /64 (one host
/// usually owns a whole /64).
#[derive(Debug)]
pub(crate) struct SourceLimiter {
    per_source: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted connection; releases its slot when dropped.
#[derive(Debug)]
pub(crate) struct SourcePermit {
    limiter: Arc<SourceLimiter>,
    source: IpAddr,
}

impl SourceLimiter {
    pub(crate) fn new(per_source: usize) -> Arc<Self> {
        Arc::new(Self {
            per_source: per_source.max(1),
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// Admits one more connection from `ip`, or `None` when its source is at the cap.
    pub(crate) fn try_acquire(self: &Arc<Self>, ip: IpAddr) -> Option<SourcePermit> {
        let source = source_of(ip);
        let mut counts = self.lock();
        let n = counts.entry(source).or_insert(0);
        if *n >= self.per_source {
            return None;
        }
        *n += 1;
        Some(SourcePermit {
            limiter: self.clone(),
            source,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        // Counters only; a panic elsewhere cannot leave them inconsistent.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for SourcePermit {
    fn drop(&mut self) {
        let mut counts = self.limiter.lock();
        if let Some(n) = counts.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.source);
            }
        }
    }
}

fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_capped_separately_and_slots_come_back() {
        let limiter = SourceLimiter::new(2);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let p1 = limiter.try_acquire(a).expect("first");
        let _p2 = limiter.try_acquire(a).expect("second");
        assert!(limiter.try_acquire(a).is_none(), "third from the same host");
        assert!(
            limiter.try_acquire(b).is_some(),
            "another host is not affected"
        );
        drop(p1);
        assert!(
            limiter.try_acquire(a).is_some(),
            "a released slot is reusable"
        );
    }

    #[test]
    fn an_ipv6_slash_64_is_one_source_and_mapped_v4_is_v4() {
        let limiter = SourceLimiter::new(1);
        let _p = limiter
            .try_acquire("2001:db8:1:2::1".parse().unwrap())
            .expect("first");
        assert!(
            limiter
                .try_acquire("2001:db8:1:2::ffff".parse().unwrap())
                .is_none()
        );
        assert!(
            limiter
                .try_acquire("2001:db8:1:3::1".parse().unwrap())
                .is_some()
        );
        let _v4 = limiter
            .try_acquire("10.0.0.1".parse().unwrap())
            .expect("v4");
        assert!(
            limiter
                .try_acquire("::ffff:10.0.0.1".parse().unwrap())
                .is_none()
        );
    }
}
