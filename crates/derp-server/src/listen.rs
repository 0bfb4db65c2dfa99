//! What a listener lets in: the accept rate, the cap on open connections and the budget of
//! unproven connections.
//!
//! **Unproven connections** are those that have not yet shown they are a client: a TLS
//! handshake, an HTTP request head, a DERP handshake (and its admission check) in progress,
//! or a plain HTTP exchange. They cost memory and, for TLS, CPU, and an attacker can open them
//! from many addresses at no cost of its own. They are held in a budget with two limits:
//!
//! - at most `per_source` from one source (an IPv4 address or an IPv6 /64): a new one from a
//!   source at its cap evicts that source's oldest, so one host only ever competes with
//!   itself. Loopback sources are not capped: on this host they are a local proxy or load
//!   generator speaking for many clients, not an attacker;
//! - at most `capacity` in all: when full, a new one evicts the oldest of all.
//!
//! A connection from a proxy (PROXY protocol, a trusted HTTP proxy's forwarded headers) counts
//! as the client's the proxy names, once it has named it, capped whatever the address;
//! until then a listed proxy's connection is in the budget but not capped per source.
//!
//! Nothing is ever refused for want of room, and the newest connections are the last to go.
//! A flood of stalled handshakes from many addresses therefore does not lock a good client
//! out: the good client's connection is evicted only if `capacity` newer unproven
//! connections arrive before it completes its handshake, so an attacker must open
//! connections faster than `capacity` divided by a good handshake's duration (thousands per
//! second for a handshake of a few hundred milliseconds) merely to slow good clients down,
//! and the accept rate limit caps that rate. Refusing new connections when the budget is
//! full, as a semaphore does, instead lets the attacker lock everyone out with `capacity`
//! connections per handshake timeout.
//!
//! The same holds at the **cap on open connections**: a new connection that finds every
//! place taken evicts the oldest unproven connection and takes its place (the count may
//! run over the cap for the moment the evicted one takes to close). Only when every open
//! connection is a proven client is a new one refused.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use derp_io::TcpOptions;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Default [`ConnLimits::max_unproven`].
pub const DEFAULT_MAX_UNPROVEN: usize = 1024;
/// Default [`ConnLimits::max_unproven_per_source`].
pub const DEFAULT_MAX_UNPROVEN_PER_SOURCE: usize = 16;

/// Limits on the connections a listener accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConnLimits {
    /// New connections per second (a token bucket); `None` for no limit. Connections over it
    /// are closed at once and counted; the listener keeps accepting.
    pub accept_rate: Option<AcceptRate>,
    /// Most connections open at once, proven or not; `None` for no cap. Connections over it
    /// are closed at once and counted.
    pub max_connections: Option<usize>,
    /// Size of the unproven-connection budget (see the module docs).
    pub max_unproven: usize,
    /// Unproven connections one source may hold.
    pub max_unproven_per_source: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            accept_rate: None,
            max_connections: None,
            max_unproven: DEFAULT_MAX_UNPROVEN,
            max_unproven_per_source: DEFAULT_MAX_UNPROVEN_PER_SOURCE,
        }
    }
}

/// How the connections a listener accepts get their socket options ([`derp_io::tune_socket`]).
///
/// Set once on the listener where the system passes them on to accepted connections, which
/// saves several system calls per connection; the first connection accepted is checked, and
/// if it did not inherit them every connection is tuned on its own, as without a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SocketOptions {
    options: TcpOptions,
    state: Inheritance,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inheritance {
    /// Set on the listener and seen on an accepted connection.
    Inherited,
    /// Set on the listener; no connection checked yet.
    Unchecked,
    /// Set on every connection.
    PerConnection,
}

impl SocketOptions {
    pub(crate) fn for_listener(listener: &tokio::net::TcpListener, options: &TcpOptions) -> Self {
        let state = if derp_io::tune_listener(listener, options) {
            Inheritance::Unchecked
        } else {
            Inheritance::PerConnection
        };
        Self {
            options: *options,
            state,
        }
    }

    /// Makes sure a just-accepted connection has the options.
    pub(crate) fn apply(&mut self, stream: &tokio::net::TcpStream) {
        match self.state {
            Inheritance::Inherited => {}
            Inheritance::Unchecked if derp_io::is_tuned(stream, &self.options) => {
                self.state = Inheritance::Inherited;
            }
            Inheritance::Unchecked => {
                warn!("accepted connections do not inherit the listener's socket options");
                derp_io::tune_socket(stream, &self.options);
                self.state = Inheritance::PerConnection;
            }
            Inheritance::PerConnection => derp_io::tune_socket(stream, &self.options),
        }
    }
}

/// A token bucket on accepts: `per_sec` new connections per second, `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AcceptRate {
    /// Sustained connections per second.
    pub per_sec: f64,
    /// Connections accepted at once after a quiet period (at least 1).
    pub burst: u64,
}

/// Counters and gauges of the main listener's limits.
#[derive(Clone, Debug)]
pub(crate) struct ListenMetrics {
    refused_rate: IntCounter,
    refused_max: IntCounter,
    open: IntGauge,
    pub(crate) accept_errors: IntCounterVec,
}

impl ListenMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let refused = IntCounterVec::new(
            Opts::new(
                "derp_accept_refused",
                "connections closed right after accept, by reason (rate_limit, max_connections)",
            ),
            &["reason"],
        )?;
        let open = IntGauge::new(
            "derp_open_connections",
            "connections accepted by the server's listeners and still open, proven or not",
        )?;
        let accept_errors = IntCounterVec::new(
            Opts::new(
                "derp_accept_errors",
                "failed accept calls (such as running out of file descriptors), by listener",
            ),
            &["listener"],
        )?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(open.clone()))?;
        registry.register(Box::new(accept_errors.clone()))?;
        for l in ["main", "metrics"] {
            accept_errors.with_label_values(&[l]);
        }
        Ok(Self {
            refused_rate: refused.with_label_values(&["rate_limit"]),
            refused_max: refused.with_label_values(&["max_connections"]),
            open,
            accept_errors,
        })
    }
}

/// The main listener's gate: every accepted connection passes it before anything is read.
#[derive(Debug)]
pub(crate) struct Gate {
    rate: Option<Mutex<Bucket>>,
    max_connections: Option<usize>,
    open: Arc<OpenCount>,
    budget: UnprovenBudget,
    pub(crate) metrics: ListenMetrics,
}

#[derive(Debug)]
struct OpenCount {
    n: AtomicUsize,
    gauge: IntGauge,
}

#[derive(Debug)]
struct Bucket {
    per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Why a connection was closed at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Over the accept rate.
    RateLimit,
    /// At the cap on open connections.
    MaxConnections,
}

impl Gate {
    pub(crate) fn new(limits: &ConnLimits, registry: &Registry) -> Result<Self, prometheus::Error> {
        let metrics = ListenMetrics::new(registry)?;
        let budget = UnprovenBudget::new(
            limits.max_unproven,
            limits.max_unproven_per_source,
            BudgetMetrics::register(registry, "derp")?,
        );
        Ok(Self {
            rate: limits.accept_rate.map(|r| {
                let burst = r.burst.max(1) as f64;
                Mutex::new(Bucket {
                    per_sec: r.per_sec.max(0.0),
                    burst,
                    tokens: burst,
                    last: Instant::now(),
                })
            }),
            max_connections: limits.max_connections,
            open: Arc::new(OpenCount {
                n: AtomicUsize::new(0),
                gauge: metrics.open.clone(),
            }),
            budget,
            metrics,
        })
    }

    /// Ends the unproven phase of every connection the gate let in, now and from now on
    /// ([`UnprovenBudget::close`]).
    pub(crate) fn close(&self) {
        self.budget.close();
    }

    /// How many connections are unproven now.
    #[cfg(test)]
    pub(crate) fn unproven(&self) -> usize {
        self.budget.inner.lock().members.len()
    }

    /// Lets a just-accepted connection from `remote` in, or says why not (and counts it).
    pub(crate) fn admit(&self, remote: SocketAddr) -> Result<ConnGuard, Refusal> {
        self.admit_as(remote, false)
    }

    /// [`Gate::admit`] for a connection from a proxy (a listed balancer, a trusted HTTP
    /// proxy), before it names the client: in the budget, but not capped per source
    /// ([`UnprovenBudget::admit_proxy`]).
    pub(crate) fn admit_proxy(&self, remote: SocketAddr) -> Result<ConnGuard, Refusal> {
        self.admit_as(remote, true)
    }

    fn admit_as(&self, remote: SocketAddr, proxy: bool) -> Result<ConnGuard, Refusal> {
        if let Some(rate) = &self.rate {
            let ok = rate
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(Instant::now());
            if !ok {
                self.metrics.refused_rate.inc();
                return Err(Refusal::RateLimit);
            }
        }
        let open = match OpenPermit::acquire(&self.open, self.max_connections) {
            Some(open) => open,
            // Its place comes free as soon as the evicted connection closes.
            None if self.budget.evict_oldest_for_cap() => {
                OpenPermit::acquire(&self.open, None).expect("an unlimited count always has room")
            }
            None => {
                self.metrics.refused_max.inc();
                return Err(Refusal::MaxConnections);
            }
        };
        let unproven = if proxy {
            self.budget
                .admit_source(IpAddr::from([0, 0, 0, 0]), false, true)
        } else {
            let ip = remote.ip();
            self.budget
                .admit_source(ip, !ip.to_canonical().is_loopback(), true)
        };
        Ok(ConnGuard {
            unproven: Some(unproven),
            _open: Some(open),
            proxied: proxy,
        })
    }
}

/// A place among the open connections; given back when dropped.
#[derive(Debug)]
pub(crate) struct OpenPermit(Arc<OpenCount>);

impl OpenPermit {
    fn acquire(count: &Arc<OpenCount>, max: Option<usize>) -> Option<Self> {
        let max = max.unwrap_or(usize::MAX);
        count
            .n
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        count.gauge.inc();
        Some(Self(count.clone()))
    }
}

impl Drop for OpenPermit {
    fn drop(&mut self) {
        self.0.n.fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
    }
}

/// What an admitted connection holds: its place among the open connections (for its whole
/// life) and, until it proves itself, its place in the unproven budget.
#[derive(Debug, Default)]
pub struct ConnGuard {
    unproven: Option<Unproven>,
    _open: Option<OpenPermit>,
    /// Admitted from a listed proxy (PROXY protocol).
    proxied: bool,
}

impl ConnGuard {
    /// A guard that limits nothing, for connections handed over without passing a gate.
    pub fn none() -> Self {
        Self::default()
    }

    /// Completes when the connection is evicted from the unproven budget; never, once it is
    /// proven or if it was never in the budget.
    pub async fn evicted(&self) {
        match &self.unproven {
            Some(u) => u.evicted().await,
            None => std::future::pending().await,
        }
    }

    /// Whether the connection came from a proxy (a listed PROXY protocol balancer, or a
    /// trusted HTTP proxy): whatever it says, it is not a direct connection.
    pub fn via_proxy(&self) -> bool {
        self.proxied
    }

    /// A proxy's header (or a trusted proxy's forwarded headers) named the client: from now
    /// on the connection counts as `client`'s in the unproven budget
    /// ([`Unproven::relayed_for`]).
    pub fn relayed_for(&self, client: IpAddr) {
        if let Some(u) = &self.unproven {
            u.relayed_for(client);
        }
    }

    /// A token cancelled on eviction, for code that cannot borrow the guard.
    pub(crate) fn eviction_token(&self) -> CancellationToken {
        match &self.unproven {
            Some(u) => u.evict.clone(),
            None => CancellationToken::new(),
        }
    }

    /// The connection has shown it is a client: it leaves the unproven budget, and what it
    /// keeps is its place among the open connections, to hold until it ends.
    pub(crate) fn prove(self) -> Option<OpenPermit> {
        self._open
    }
}

/// A guard holding only a place in a budget, for a listener that caps no open connections
/// and serves no DERP (the port-80 listener); its [`ConnGuard::via_proxy`] is always false.
impl From<Unproven> for ConnGuard {
    fn from(unproven: Unproven) -> Self {
        Self {
            unproven: Some(unproven),
            _open: None,
            proxied: false,
        }
    }
}

/// The counters of one unproven budget.
#[derive(Clone, Debug)]
pub struct BudgetMetrics {
    current: IntGauge,
    evicted_full: IntCounter,
    evicted_source: IntCounter,
    evicted_cap: IntCounter,
}

impl BudgetMetrics {
    /// Registers `<prefix>_unproven_connections` and `<prefix>_unproven_evicted{cause}` on
    /// `registry`.
    pub fn register(registry: &Registry, prefix: &str) -> Result<Self, prometheus::Error> {
        let current = IntGauge::new(
            format!("{prefix}_unproven_connections"),
            "connections still in a TLS, HTTP or DERP handshake (or a plain HTTP exchange)",
        )?;
        let evicted = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_unproven_evicted"),
                "unproven connections closed to make room for newer ones, by cause \
                 (budget: the budget was full; per_source: their source was at its cap; \
                 max_connections: every open connection's place was taken)",
            ),
            &["cause"],
        )?;
        registry.register(Box::new(current.clone()))?;
        registry.register(Box::new(evicted.clone()))?;
        Ok(Self {
            current,
            evicted_full: evicted.with_label_values(&["budget"]),
            evicted_source: evicted.with_label_values(&["per_source"]),
            evicted_cap: evicted.with_label_values(&["max_connections"]),
        })
    }
}

/// A budget of unproven connections; see the module docs for the policy. Cheap to clone.
#[derive(Clone, Debug)]
pub struct UnprovenBudget {
    inner: Arc<BudgetInner>,
}

#[derive(Debug)]
struct BudgetInner {
    capacity: usize,
    per_source: usize,
    state: Mutex<BudgetState>,
    metrics: BudgetMetrics,
}

#[derive(Debug, Default)]
struct BudgetState {
    /// Closed by a shutdown: every member was told to leave, and newcomers leave at once.
    closed: bool,
    next_seq: u64,
    /// Every member by admission order; the first is the oldest.
    members: BTreeMap<u64, Member>,
    /// Each capped source's members, oldest first. Uncapped (loopback) sources are not listed:
    /// nothing would read their list, and a local proxy's one list of every connection it
    /// carries would make each removal a scan of up to `capacity` entries.
    by_source: HashMap<IpAddr, VecDeque<u64>>,
}

#[derive(Debug)]
struct Member {
    /// The source, when it is capped (and so in `by_source`).
    capped: Option<IpAddr>,
    /// It holds a place among the open connections of the [`Gate`] that admitted it (the
    /// port-80 listener's connections are in the budget without one).
    counted: bool,
    evict: CancellationToken,
}

impl BudgetState {
    fn remove(&mut self, seq: u64) -> Option<Member> {
        let member = self.members.remove(&seq)?;
        self.remove_from_source(seq, member.capped);
        Some(member)
    }

    /// Takes `seq` off its source's list, if it is capped.
    fn remove_from_source(&mut self, seq: u64, capped: Option<IpAddr>) {
        if let Some(source) = capped
            && let Some(list) = self.by_source.get_mut(&source)
        {
            list.retain(|s| *s != seq);
            if list.is_empty() {
                self.by_source.remove(&source);
            }
        }
    }
}

/// A connection's place in an [`UnprovenBudget`]; leaving is dropping it.
#[derive(Debug)]
pub struct Unproven {
    budget: Arc<BudgetInner>,
    seq: u64,
    evict: CancellationToken,
}

impl Unproven {
    /// Completes when a newer connection took this one's place.
    pub async fn evicted(&self) {
        self.evict.cancelled().await;
    }

    /// The connection came through a proxy, which named `client` as whose it is: from now on
    /// it counts against `client`'s source, capped whatever the address (loopback too: the
    /// proxy already said who the client is, so it is not a local proxy speaking for many).
    /// A source at its cap loses its oldest other connection, as on admission. Nothing
    /// happens to a connection already evicted.
    pub fn relayed_for(&self, client: IpAddr) {
        let source = source_of(client);
        let inner = &self.budget;
        let mut state = inner.lock();
        let Some(member) = state.members.get(&self.seq) else {
            return;
        };
        if member.capped == Some(source) {
            return;
        }
        let before = member.capped;
        state.remove_from_source(self.seq, before);
        let full = state
            .by_source
            .get(&source)
            .filter(|list| list.len() >= inner.per_source)
            .and_then(|list| list.front().copied());
        if let Some(oldest) = full
            && let Some(victim) = state.remove(oldest)
        {
            victim.evict.cancel();
            inner.metrics.evicted_source.inc();
            inner.metrics.current.dec();
        }
        if let Some(member) = state.members.get_mut(&self.seq) {
            member.capped = Some(source);
        }
        state
            .by_source
            .entry(source)
            .or_default()
            .push_back(self.seq);
    }
}

impl Drop for Unproven {
    fn drop(&mut self) {
        let mut state = self.budget.lock();
        if state.remove(self.seq).is_some() {
            self.budget.metrics.current.dec();
        }
    }
}

impl UnprovenBudget {
    /// A budget of `capacity` connections, at most `per_source` of them from one source (both
    /// at least 1).
    pub fn new(capacity: usize, per_source: usize, metrics: BudgetMetrics) -> Self {
        Self {
            inner: Arc::new(BudgetInner {
                capacity: capacity.max(1),
                per_source: per_source.max(1),
                state: Mutex::new(BudgetState::default()),
                metrics,
            }),
        }
    }

    /// Admits a connection from `ip`, evicting an older one if there is no room.
    pub fn admit(&self, ip: IpAddr) -> Unproven {
        self.admit_source(ip, !ip.to_canonical().is_loopback(), false)
    }

    /// Admits a connection from a trusted proxy whose header has not named the client yet
    /// ([`Unproven::relayed_for`] does, once read): it takes a place in the budget, evicting
    /// the oldest if full, but is not capped per source, since the proxy speaks for many
    /// clients.
    pub fn admit_proxy(&self) -> Unproven {
        self.admit_source(IpAddr::from([0, 0, 0, 0]), false, false)
    }

    /// Tells every unproven connection to leave, as an eviction does but without counting
    /// one, and every connection admitted from now on at once: a shutdown must not wait for
    /// handshakes that may take until their deadline.
    pub fn close(&self) {
        let mut state = self.inner.lock();
        state.closed = true;
        for member in state.members.values() {
            member.evict.cancel();
        }
    }

    /// Evicts the oldest unproven connection that holds a place among the open connections,
    /// to free it for a newer one. Returns whether there was one.
    fn evict_oldest_for_cap(&self) -> bool {
        let inner = &self.inner;
        let mut state = inner.lock();
        if state.closed {
            return false;
        }
        let oldest = state
            .members
            .iter()
            .find(|(_, m)| m.counted)
            .map(|(s, _)| *s);
        let Some(seq) = oldest else {
            return false;
        };
        let Some(member) = state.remove(seq) else {
            return false;
        };
        member.evict.cancel();
        inner.metrics.evicted_cap.inc();
        inner.metrics.current.dec();
        true
    }

    fn admit_source(&self, ip: IpAddr, capped: bool, counted: bool) -> Unproven {
        let source = source_of(ip);
        let inner = &self.inner;
        let mut state = inner.lock();
        if state.closed {
            let evict = CancellationToken::new();
            evict.cancel();
            // Never a member, so dropping it removes nothing and the gauge is not moved.
            let seq = state.next_seq;
            state.next_seq += 1;
            return Unproven {
                budget: inner.clone(),
                seq,
                evict,
            };
        }
        let listed = if capped {
            state.by_source.get(&source)
        } else {
            None
        };
        let victim = match listed {
            Some(list) if list.len() >= inner.per_source => list
                .front()
                .copied()
                .map(|s| (s, &inner.metrics.evicted_source)),
            _ if state.members.len() >= inner.capacity => state
                .members
                .first_key_value()
                .map(|(s, _)| (*s, &inner.metrics.evicted_full)),
            _ => None,
        };
        if let Some((seq, counter)) = victim
            && let Some(member) = state.remove(seq)
        {
            member.evict.cancel();
            counter.inc();
            inner.metrics.current.dec();
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        let evict = CancellationToken::new();
        state.members.insert(
            seq,
            Member {
                capped: capped.then_some(source),
                counted,
                evict: evict.clone(),
            },
        );
        if capped {
            state.by_source.entry(source).or_default().push_back(seq);
        }
        inner.metrics.current.inc();
        Unproven {
            budget: inner.clone(),
            seq,
            evict,
        }
    }
}

impl BudgetInner {
    fn lock(&self) -> MutexGuard<'_, BudgetState> {
        // Plain bookkeeping; a panic elsewhere cannot leave it inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The source a connection is counted under: an IPv4 address, or an IPv6 /64 (one host
/// usually owns a whole /64).
fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(capacity: usize, per_source: usize) -> (UnprovenBudget, Registry) {
        let r = Registry::new();
        let m = BudgetMetrics::register(&r, "t").expect("metrics");
        (UnprovenBudget::new(capacity, per_source, m), r)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn evicted(u: &Unproven) -> bool {
        u.evict.is_cancelled()
    }

    async fn accept_one(listener: &tokio::net::TcpListener) -> [tokio::net::TcpStream; 2] {
        let addr = listener.local_addr().expect("address");
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        [client.expect("connect"), accepted.expect("accept").0]
    }

    #[tokio::test]
    async fn accepted_connections_get_the_options_from_the_listener_or_one_by_one() {
        let tcp = TcpOptions {
            keepalive_idle: Some(std::time::Duration::from_secs(90)),
            user_timeout: Some(std::time::Duration::from_secs(7)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut options = SocketOptions::for_listener(&listener, &tcp);
        let expected = if cfg!(target_os = "linux") {
            Inheritance::Inherited
        } else {
            Inheritance::PerConnection
        };
        for _ in 0..2 {
            let [_client, accepted] = accept_one(&listener).await;
            options.apply(&accepted);
            assert_eq!(options.state, expected);
            assert!(derp_io::is_tuned(&accepted, &tcp));
        }

        // A listener that passes nothing on: the check on the first connection notices, and
        // from then on each connection is tuned on its own.
        let bare = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut options = SocketOptions {
            options: tcp,
            state: Inheritance::Unchecked,
        };
        for _ in 0..2 {
            let [_client, accepted] = accept_one(&bare).await;
            assert!(!derp_io::is_tuned(&accepted, &tcp));
            options.apply(&accepted);
            assert_eq!(options.state, Inheritance::PerConnection);
            assert!(derp_io::is_tuned(&accepted, &tcp));
        }
    }

    #[test]
    fn a_full_budget_evicts_the_oldest_and_admits_the_newest() {
        let (b, _r) = budget(3, 10);
        let a = b.admit(ip("192.0.2.1"));
        let c = b.admit(ip("192.0.2.2"));
        let d = b.admit(ip("192.0.2.3"));
        assert!(![&a, &c, &d].iter().any(|u| evicted(u)));
        let e = b.admit(ip("192.0.2.4"));
        assert!(evicted(&a), "the oldest goes");
        assert!(!evicted(&c) && !evicted(&d) && !evicted(&e));
        // A released slot is room again: nobody is evicted.
        drop(c);
        let f = b.admit(ip("192.0.2.5"));
        assert!(!evicted(&d) && !evicted(&e) && !evicted(&f));
        let g = b.admit(ip("192.0.2.6"));
        assert!(evicted(&d));
        assert!(!evicted(&g));
    }

    #[test]
    fn a_closed_budget_sends_every_member_away_and_admits_nobody_to_stay() {
        let (b, r) = budget(3, 10);
        let a = b.admit(ip("192.0.2.1"));
        let c = b.admit(ip("127.0.0.1"));
        b.close();
        assert!(evicted(&a) && evicted(&c));
        let late = b.admit(ip("192.0.2.2"));
        assert!(
            evicted(&late),
            "a connection admitted after the close leaves at once"
        );
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&r.gather())
            .expect("metrics");
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("t_unproven_evicted") && !l.ends_with(" 0")),
            "a shutdown is not an eviction:\n{text}"
        );
        drop((a, c, late));
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&r.gather())
            .expect("metrics");
        assert!(
            text.lines().any(|l| l == "t_unproven_connections 0"),
            "the members left the gauge, and the late one never joined it:\n{text}"
        );
    }

    #[test]
    fn a_source_at_its_cap_evicts_only_its_own() {
        let (b, r) = budget(100, 2);
        let other = b.admit(ip("198.51.100.7"));
        let a1 = b.admit(ip("192.0.2.1"));
        let a2 = b.admit(ip("192.0.2.1"));
        let a3 = b.admit(ip("192.0.2.1"));
        assert!(evicted(&a1));
        assert!(!evicted(&a2) && !evicted(&a3));
        assert!(!evicted(&other), "another source is never touched");
        // An IPv6 /64 is one source; mapped IPv4 is IPv4.
        let v1 = b.admit(ip("2001:db8:1:2::1"));
        let _v2 = b.admit(ip("2001:db8:1:2::2"));
        let _v3 = b.admit(ip("2001:db8:1:2::3"));
        assert!(evicted(&v1));
        let _m = b.admit(ip("::ffff:192.0.2.1"));
        assert!(evicted(&a2));
        // Loopback is one trusted source (a local proxy): not capped.
        let local: Vec<Unproven> = (0..5).map(|_| b.admit(ip("127.0.0.1"))).collect();
        let local6: Vec<Unproven> = (0..5).map(|_| b.admit(ip("::1"))).collect();
        assert!(!local.iter().chain(&local6).any(evicted));
        let families = r.gather();
        let by_cause: Vec<(String, f64)> = families
            .iter()
            .filter(|f| f.name() == "t_unproven_evicted")
            .flat_map(|f| f.get_metric())
            .map(|m| {
                (
                    m.get_label()[0].value().to_owned(),
                    m.get_counter().get_value(),
                )
            })
            .collect();
        assert!(
            by_cause.contains(&("per_source".to_owned(), 3.0)),
            "{by_cause:?}"
        );
    }

    #[test]
    fn loopback_members_share_the_budget_but_keep_no_source_list() {
        let (b, _r) = budget(3, 1);
        let remote = b.admit(ip("192.0.2.1"));
        let l1 = b.admit(ip("127.0.0.1"));
        let l2 = b.admit(ip("::1"));
        assert!(![&remote, &l1, &l2].iter().any(|u| evicted(u)));
        {
            let state = b.inner.lock();
            assert_eq!(state.members.len(), 3);
            let listed: Vec<&IpAddr> = state.by_source.keys().collect();
            assert_eq!(listed, [&ip("192.0.2.1")]);
        }
        // A full budget evicts the oldest, whatever its source.
        let l3 = b.admit(ip("127.0.0.1"));
        assert!(evicted(&remote));
        assert!(b.inner.lock().by_source.is_empty());
        let l4 = b.admit(ip("127.0.0.1"));
        assert!(evicted(&l1));
        assert!(!evicted(&l2) && !evicted(&l3) && !evicted(&l4));
        // Leaving in any order leaves nothing behind.
        drop(l3);
        drop(remote);
        drop(l1);
        drop(l4);
        drop(l2);
        let state = b.inner.lock();
        assert!(state.members.is_empty() && state.by_source.is_empty());
    }

    #[test]
    fn a_proxied_connection_counts_as_the_client_it_was_relayed_for() {
        let (b, r) = budget(10, 2);
        // Before their headers, a proxy's connections are not capped, even from one address.
        let p: Vec<Unproven> = (0..4).map(|_| b.admit_proxy()).collect();
        assert!(!p.iter().any(evicted));
        // Named: two clients on loopback addresses (a local proxy's clients), each capped on
        // its own, as a remote source is.
        p[0].relayed_for(ip("127.0.0.2"));
        p[1].relayed_for(ip("127.0.0.3"));
        p[2].relayed_for(ip("127.0.0.2"));
        assert!(!p.iter().any(evicted));
        p[3].relayed_for(ip("127.0.0.2"));
        assert!(evicted(&p[0]), "127.0.0.2's oldest made room");
        assert!(!evicted(&p[1]) && !evicted(&p[2]) && !evicted(&p[3]));
        // A direct connection from the same address shares the cap (loopback, as admitted
        // directly, is not capped, so a remote address here).
        let q = b.admit_proxy();
        q.relayed_for(ip("192.0.2.7"));
        let d1 = b.admit(ip("192.0.2.7"));
        let d2 = b.admit(ip("192.0.2.7"));
        assert!(evicted(&q) && !evicted(&d1) && !evicted(&d2));
        // Naming the same source again changes nothing; an evicted connection stays out.
        p[3].relayed_for(ip("127.0.0.2"));
        p[0].relayed_for(ip("127.0.0.9"));
        {
            let state = b.inner.lock();
            let twos = state.by_source.get(&ip("127.0.0.2")).map(VecDeque::len);
            assert_eq!(twos, Some(2));
            assert!(!state.by_source.contains_key(&ip("127.0.0.9")));
        }
        let gauge = r
            .gather()
            .iter()
            .find(|f| f.name() == "t_unproven_connections")
            .map(|f| f.get_metric()[0].get_gauge().get_value());
        assert_eq!(gauge, Some(5.0));
        drop(p);
        drop((d1, d2, q));
        let state = b.inner.lock();
        assert!(state.members.is_empty() && state.by_source.is_empty());
    }

    #[test]
    fn the_gauge_follows_members() {
        let (b, r) = budget(2, 2);
        let gauge = || {
            r.gather()
                .iter()
                .find(|f| f.name() == "t_unproven_connections")
                .map(|f| f.get_metric()[0].get_gauge().get_value())
                .expect("gauge")
        };
        let a = b.admit(ip("192.0.2.1"));
        let c = b.admit(ip("192.0.2.2"));
        let d = b.admit(ip("192.0.2.3"));
        assert_eq!(gauge(), 2.0);
        drop(a); // already evicted: no double count
        assert_eq!(gauge(), 2.0);
        drop(c);
        drop(d);
        assert_eq!(gauge(), 0.0);
    }

    #[tokio::test]
    async fn gate_enforces_the_accept_rate_and_the_open_cap() {
        let r = Registry::new();
        let gate = Gate::new(
            &ConnLimits {
                accept_rate: Some(AcceptRate {
                    per_sec: 0.0,
                    burst: 5,
                }),
                max_connections: Some(2),
                ..ConnLimits::default()
            },
            &r,
        )
        .expect("gate");
        let remote: SocketAddr = "192.0.2.1:1".parse().expect("addr");
        let a = gate.admit(remote).expect("first").prove().expect("a place");
        let b = gate.admit(remote).expect("second");
        // At the cap a newcomer takes the place of the oldest unproven connection...
        let c = gate
            .admit(remote)
            .expect("third, in the unproven one's place");
        assert!(b.eviction_token().is_cancelled());
        assert_eq!(evicted_for_cap(&r), 1.0);
        drop(b);
        // ... and with every place held by a proven client, it is refused.
        let _c = c.prove().expect("a place");
        assert_eq!(gate.admit(remote).err(), Some(Refusal::MaxConnections));
        drop(a);
        // The refusal above took a token too: the fifth and last goes to this one.
        let _d = gate.admit(remote).expect("room again");
        assert_eq!(gate.admit(remote).err(), Some(Refusal::RateLimit));
    }

    /// The port-80 listener's connections are in the budget without a place among the open
    /// connections: evicting one would free none.
    #[tokio::test]
    async fn at_the_cap_only_connections_holding_a_place_are_evicted() {
        let r = Registry::new();
        let gate = Gate::new(
            &ConnLimits {
                max_connections: Some(1),
                ..ConnLimits::default()
            },
            &r,
        )
        .expect("gate");
        let remote: SocketAddr = "192.0.2.1:1".parse().expect("addr");
        let port80 = gate.budget.admit(remote.ip());
        let a = gate.admit(remote).expect("first").prove().expect("a place");
        assert_eq!(gate.admit(remote).err(), Some(Refusal::MaxConnections));
        assert!(!port80.evict.is_cancelled());
        assert_eq!(evicted_for_cap(&r), 0.0);
        drop(a);
    }

    fn evicted_for_cap(r: &Registry) -> f64 {
        r.gather()
            .iter()
            .filter(|f| f.name() == "derp_unproven_evicted")
            .flat_map(|f| f.get_metric())
            .filter(|m| m.get_label().iter().any(|l| l.value() == "max_connections"))
            .map(|m| m.get_counter().get_value())
            .sum()
    }
}
