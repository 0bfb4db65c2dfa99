//! Taking connections off a listener: the step every accept loop repeats, with what to do
//! when `accept` fails.
//!
//! A failure that concerns only the connection it would have returned (the peer gave up
//! while it waited in the queue, or the kernel passed on a network error of that
//! connection) is counted and the next accept is tried at once: the queue moved on. Any
//! other failure (out of file descriptors, out of memory) is counted and the next accept
//! waits, from 5 ms doubling to 1 s while the failures go on, since trying again at once
//! would fail again at once and spin the loop on a full core. Those are logged as one
//! warning per 10 s at most, which says how many were left out since the last one; the
//! first accept that succeeds after them says so too.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use prometheus::IntCounter;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Where a [`Listener`] takes its connections from: a [`TcpListener`], or a listener of
/// another kind.
pub trait Accept {
    /// An accepted connection.
    type Conn;

    /// Waits for the next connection and its peer's address. Must be cancel-safe: dropping
    /// the future before it completes loses no connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<(Self::Conn, SocketAddr)>> + Send;
}

impl Accept for TcpListener {
    type Conn = TcpStream;

    fn accept(&mut self) -> impl Future<Output = io::Result<(TcpStream, SocketAddr)>> + Send {
        TcpListener::accept(self)
    }
}

/// A listener whose [`accept`](Listener::accept) never fails: it handles failures of the
/// underlying accept as the module docs describe, counting each in a metric and naming the
/// listener in its logs.
#[derive(Debug)]
pub struct Listener<A = TcpListener> {
    inner: A,
    errors: AcceptErrors,
}

impl<A: Accept> Listener<A> {
    /// Wraps `inner`; `name` is the listener's name in logs, and every failed accept is
    /// counted in `failures`.
    pub fn new(inner: A, name: &'static str, failures: IntCounter) -> Self {
        Self {
            inner,
            errors: AcceptErrors::new(name, failures),
        }
    }

    /// The next connection. Cancel-safe, also while it waits after a failure: a loop can
    /// race it against its shutdown signal.
    pub async fn accept(&mut self) -> (A::Conn, SocketAddr) {
        loop {
            match self.inner.accept().await {
                Ok(accepted) => {
                    self.errors.succeeded();
                    return accepted;
                }
                Err(error) => {
                    if let Some(wait) = self.errors.failed(&error) {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        }
    }

    /// The underlying listener.
    pub fn get_ref(&self) -> &A {
        &self.inner
    }
}

/// Whether a failed accept concerns only the connection it would have returned, so that the
/// next one can be tried at once. Linux's accept(2) passes on a new connection's pending
/// network error; such a connection has left the queue. Anything unknown is taken for a
/// failure that may last: waiting costs a few milliseconds, spinning costs a core.
fn concerns_one_connection(error: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        error.kind(),
        ConnectionAborted
            | ConnectionReset
            | ConnectionRefused
            | Interrupted
            | NetworkDown
            | NetworkUnreachable
            | HostUnreachable
    )
}

const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The state of a listener's failures: the current wait and the warnings' rate limit.
#[derive(Debug)]
struct AcceptErrors {
    listener: &'static str,
    counter: IntCounter,
    delay: Duration,
    last_warning: Option<Instant>,
    left_out: u64,
}

impl AcceptErrors {
    fn new(listener: &'static str, counter: IntCounter) -> Self {
        Self {
            listener,
            counter,
            delay: Duration::ZERO,
            last_warning: None,
            left_out: 0,
        }
    }

    /// Notes a failed accept; returns how long to wait before the next, if at all.
    fn failed(&mut self, error: &io::Error) -> Option<Duration> {
        self.counter.inc();
        if concerns_one_connection(error) {
            debug!(listener = self.listener, %error, "accept failed for one connection");
            return None;
        }
        self.delay = (self.delay * 2).clamp(BACKOFF_MIN, BACKOFF_MAX);
        if let Some(suppressed) = self.warning_due(Instant::now()) {
            warn!(
                listener = self.listener,
                %error,
                suppressed,
                retry_in_ms = self.delay.as_millis() as u64,
                "accept failed"
            );
        }
        Some(self.delay)
    }

    /// Whether a failure at `now` is to be logged; if so, how many were left out since the
    /// last one logged.
    fn warning_due(&mut self, now: Instant) -> Option<u64> {
        let due = self
            .last_warning
            .is_none_or(|t| now.saturating_duration_since(t) >= WARN_EVERY);
        if !due {
            self.left_out += 1;
            return None;
        }
        self.last_warning = Some(now);
        Some(std::mem::take(&mut self.left_out))
    }

    /// Notes a successful accept: the wait starts over, and after failures that waited it
    /// says that the listener accepts again, and how many warnings were left out since the
    /// last one logged.
    fn succeeded(&mut self) {
        if self.delay.is_zero() {
            return;
        }
        self.delay = Duration::ZERO;
        info!(
            listener = self.listener,
            suppressed = self.left_out,
            "accepting again"
        );
        self.left_out = 0;
        self.last_warning = None;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    // Linux's numbers.
    const EMFILE: i32 = 24;
    const ENFILE: i32 = 23;
    const ENOBUFS: i32 = 105;
    const ENOMEM: i32 = 12;
    const ECONNABORTED: i32 = 103;
    const ECONNRESET: i32 = 104;

    /// An accept that plays a script: each call takes the next result, and records when it
    /// was made. Past the end of the script it waits forever.
    struct Script {
        results: VecDeque<Result<u32, i32>>,
        calls: Vec<Instant>,
    }

    impl Accept for Script {
        type Conn = u32;

        fn accept(&mut self) -> impl Future<Output = io::Result<(u32, SocketAddr)>> + Send {
            self.calls.push(Instant::now());
            let next = self.results.pop_front();
            async move {
                let addr: SocketAddr = ([127, 0, 0, 1], 1).into();
                match next {
                    Some(Ok(conn)) => Ok((conn, addr)),
                    Some(Err(errno)) => Err(io::Error::from_raw_os_error(errno)),
                    None => std::future::pending().await,
                }
            }
        }
    }

    fn listener(results: impl IntoIterator<Item = Result<u32, i32>>) -> Listener<Script> {
        let counter = IntCounter::new("accept_errors", "test").expect("counter");
        Listener::new(
            Script {
                results: results.into_iter().collect(),
                calls: Vec::new(),
            },
            "test",
            counter,
        )
    }

    /// The time between one accept call and the next.
    fn waits(l: &Listener<Script>) -> Vec<Duration> {
        let calls = &l.get_ref().calls;
        calls.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn only_errors_of_one_connection_are_retried_at_once() {
        for errno in [ECONNABORTED, ECONNRESET] {
            assert!(concerns_one_connection(&io::Error::from_raw_os_error(
                errno
            )));
        }
        for errno in [EMFILE, ENFILE, ENOBUFS, ENOMEM] {
            assert!(!concerns_one_connection(&io::Error::from_raw_os_error(
                errno
            )));
        }
        assert!(!concerns_one_connection(&io::Error::other("unknown")));
    }

    #[tokio::test(start_paused = true)]
    async fn resource_errors_back_off_from_5_ms_doubling_to_1_s() {
        let mut l = listener(
            [EMFILE, ENFILE, ENOBUFS, ENOMEM]
                .into_iter()
                .cycle()
                .take(10)
                .map(Err)
                .chain([Ok(7)]),
        );
        assert_eq!(l.accept().await.0, 7);
        assert_eq!(
            waits(&l),
            ms(&[5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000])
        );
        assert_eq!(l.errors.counter.get(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn errors_of_one_connection_do_not_wait() {
        let mut l = listener([Err(ECONNABORTED), Err(ECONNRESET), Ok(1)]);
        let start = Instant::now();
        assert_eq!(l.accept().await.0, 1);
        assert_eq!(Instant::now(), start, "no time passed");
        assert_eq!(waits(&l), ms(&[0, 0]));
        // Between resource errors they neither wait nor start the backoff over.
        let mut l = listener([
            Err(EMFILE),
            Err(ECONNRESET),
            Err(EMFILE),
            Err(ECONNABORTED),
            Ok(2),
        ]);
        assert_eq!(l.accept().await.0, 2);
        assert_eq!(waits(&l), ms(&[5, 0, 10, 0]));
        assert_eq!(l.errors.counter.get(), 4, "every failure is counted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_starts_the_backoff_over() {
        let mut l = listener([Err(EMFILE), Err(EMFILE), Ok(1), Err(EMFILE), Ok(2)]);
        assert_eq!(l.accept().await.0, 1);
        assert_eq!(l.accept().await.0, 2);
        assert_eq!(waits(&l), ms(&[5, 10, 0, 5]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_accept_can_be_cancelled() {
        let mut l = listener([Err(EMFILE), Ok(1)]);
        // Dropped while it waits out the failure: the connection behind it is not lost.
        assert!(
            tokio::time::timeout(Duration::from_millis(1), l.accept())
                .await
                .is_err()
        );
        assert_eq!(l.accept().await.0, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn warnings_are_rate_limited_and_count_those_left_out() {
        let counter = IntCounter::new("c", "c").expect("counter");
        let mut e = AcceptErrors::new("test", counter);
        let start = Instant::now();
        assert_eq!(e.warning_due(start), Some(0), "the first is logged");
        for s in 1..10 {
            assert_eq!(e.warning_due(start + Duration::from_secs(s)), None);
        }
        assert_eq!(e.warning_due(start + WARN_EVERY), Some(9));
        assert_eq!(e.warning_due(start + WARN_EVERY), None);
        // Through the listener: ten failures within 3.3 s are one warning and nine left
        // out, which the first success reports.
        let mut l = listener((0..10).map(|_| Err(EMFILE)));
        assert!(
            tokio::time::timeout(Duration::from_secs(5), l.accept())
                .await
                .is_err()
        );
        assert_eq!(l.errors.left_out, 9);
        l.inner.results.push_back(Ok(1));
        assert_eq!(l.accept().await.0, 1);
        assert_eq!(l.errors.left_out, 0);
        assert_eq!(
            l.errors.last_warning, None,
            "the next failure is logged at once"
        );
    }
}
