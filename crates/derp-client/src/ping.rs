//! Matching pongs to outstanding pings across the reader and writer halves.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::ClientError;

/// Outstanding pings, shared by the writer (registers) and the reader (completes).
#[derive(Debug, Default)]
pub(crate) struct PingTracker {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Few entries at a time, so a vector beats a map.
    waiting: Vec<([u8; 8], oneshot::Sender<Instant>)>,
    /// The reader died: no pong will ever be seen again.
    dead: bool,
}

impl PingTracker {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The critical sections only push, remove or drain entries, so a poisoned lock still
        // holds a consistent vector.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers interest in the pong for `data`; `None` once the reader is dead.
    pub(crate) fn register(&self, data: [u8; 8]) -> Option<oneshot::Receiver<Instant>> {
        let mut inner = self.lock();
        if inner.dead {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        inner.waiting.push((data, tx));
        Some(rx)
    }

    /// Called by the reader for each pong; true if it answered one of our pings.
    pub(crate) fn complete(&self, data: [u8; 8]) -> bool {
        let mut inner = self.lock();
        let Some(i) = inner.waiting.iter().position(|(d, _)| *d == data) else {
            return false;
        };
        let (_, tx) = inner.waiting.swap_remove(i);
        // The pinger may have given up already; the pong is still ours.
        let _ = tx.send(Instant::now());
        true
    }

    /// Forgets a ping whose waiter gave up or went away.
    pub(crate) fn remove(&self, data: [u8; 8]) {
        self.lock().waiting.retain(|(d, _)| *d != data);
    }

    /// Fails every outstanding and future ping: the reader hit a fatal error.
    pub(crate) fn fail_all(&self) {
        let mut inner = self.lock();
        inner.dead = true;
        inner.waiting.clear();
    }
}

/// A ping that has been sent and whose pong has not been awaited yet.
///
/// The pong is recognised by whichever task drives the reader (see
/// [`ClientReader::recv`](crate::ClientReader::recv)); dropping this forgets the ping.
#[derive(Debug)]
pub struct PendingPing {
    data: [u8; 8],
    sent_at: Instant,
    rx: oneshot::Receiver<Instant>,
    tracker: Arc<PingTracker>,
}

impl PendingPing {
    pub(crate) fn new(
        data: [u8; 8],
        sent_at: Instant,
        rx: oneshot::Receiver<Instant>,
        tracker: Arc<PingTracker>,
    ) -> Self {
        Self {
            data,
            sent_at,
            rx,
            tracker,
        }
    }

    /// The 8 random bytes the ping carried.
    pub fn data(&self) -> [u8; 8] {
        self.data
    }

    /// Waits up to 5 s for the pong and returns the round-trip time.
    ///
    /// Fails with [`ClientError::PingTimeout`] if no pong arrives in time, or
    /// [`ClientError::Closed`] if the reader dies first.
    pub async fn wait(mut self) -> Result<Duration, ClientError> {
        self.wait_ref().await
    }

    /// Like [`PendingPing::wait`] but borrows, so a select loop can poll it repeatedly.
    pub(crate) async fn wait_ref(&mut self) -> Result<Duration, ClientError> {
        self.wait_within(PING_TIMEOUT).await
    }

    /// Waits until `timeout` after the ping was sent, borrowing, so a select loop can poll
    /// it alongside other work. Fails as [`PendingPing::wait`] does.
    pub async fn wait_within(&mut self, timeout: Duration) -> Result<Duration, ClientError> {
        let deadline = self.sent_at + timeout;
        match tokio::time::timeout_at(deadline, &mut self.rx).await {
            Ok(Ok(received_at)) => Ok(received_at.saturating_duration_since(self.sent_at)),
            Ok(Err(_)) => Err(ClientError::Closed),
            Err(_) => Err(ClientError::PingTimeout),
        }
    }
}

impl Drop for PendingPing {
    fn drop(&mut self) {
        self.tracker.remove(self.data);
    }
}

/// How long a ping waits for its pong, as in the Go client.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_only_registered_pings_once() {
        let t = PingTracker::default();
        let mut rx = t.register([1; 8]).unwrap();
        assert!(!t.complete([2; 8]));
        assert!(t.complete([1; 8]));
        assert!(!t.complete([1; 8]));
        assert!(rx.try_recv().is_ok());
    }

    #[test]
    fn dead_tracker_refuses_and_fails_waiters() {
        let t = PingTracker::default();
        let mut rx = t.register([1; 8]).unwrap();
        t.fail_all();
        assert!(rx.try_recv().is_err());
        assert!(t.register([3; 8]).is_none());
        assert!(!t.complete([1; 8]));
    }

    #[tokio::test(start_paused = true)]
    async fn pending_ping_times_out_and_unregisters_on_drop() {
        let t = Arc::new(PingTracker::default());
        let rx = t.register([4; 8]).unwrap();
        let ping = PendingPing::new([4; 8], Instant::now(), rx, t.clone());
        assert!(matches!(ping.wait().await, Err(ClientError::PingTimeout)));
        // Dropped by `wait`: a late pong is no longer ours.
        assert!(!t.complete([4; 8]));
    }
}
