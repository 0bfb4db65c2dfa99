//! `/bootstrap-dns`: addresses of names a client needs before its own DNS works, resolved by
//! the relay in the background and served as JSON, as derper's `--bootstrap-dns-names` and
//! `--unpublished-bootstrap-dns-names` do.
//!
//! Published names are all served in one document; unpublished ones only to a client that
//! asks for exactly that name with `?q=`, and an unpublished entry written `name/txt-name`
//! only to the share of clients the TXT record of `txt-name` names (0 to 100 per cent, the
//! same clients every time: the share is drawn from the client's address, see
//! [`address_in_rollout`]). The lists are resolved at start and again ten minutes after each
//! round; a name that fails to resolve is left out until a later round finds it.
//!
//! The resolver is given ([`Resolver`]): derpd passes the system's, tests a fake one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::Full;
use prometheus::{IntCounter, Registry};
use rand::seq::SliceRandom;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// A future a [`Resolver`] returns.
pub type LookupFuture<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// Name lookups for bootstrap DNS.
pub trait Resolver: Send + Sync + fmt::Debug {
    /// Every IPv4 and IPv6 address of `name` (an IP address literal resolves to itself).
    fn lookup_ip<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<IpAddr>>;
    /// The strings of `name`'s TXT records.
    fn lookup_txt<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<String>>;
}

/// What to resolve, as derper's flags give it: comma-separated lists, entries kept as they
/// are (no trimming; an empty entry is looked up, and fails, as in derper).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootstrapDnsConfig {
    /// `--bootstrap-dns-names`: served to everyone, in one document.
    pub published: String,
    /// `--unpublished-bootstrap-dns-names`: `name` or `name/txt-name`, served only to a
    /// client asking for `name` with `?q=` (and, with a TXT name, in the rollout share).
    pub unpublished: String,
}

/// Time between the end of one round of lookups and the start of the next.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(600);
/// Budget for resolving one whole list.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(60);
/// Distinct `?q=` names remembered for `bootstrap_dns_queried_domains` before the set is
/// cleared.
const MAX_QUERIED: usize = 500;
/// The longest name DNS allows, in its text form.
const MAX_NAME_LEN: usize = 253;

/// One resolved list.
#[derive(Debug, Default)]
struct Entries {
    /// Names that resolved, with their addresses; `None` when none did (served as `null`).
    ips: Option<BTreeMap<String, Vec<IpAddr>>>,
    /// Rollout share per name, 0.0 to 1.0; a name missing here has 0.
    percent: HashMap<String, f64>,
}

#[derive(Debug)]
struct Resolved {
    entries: Entries,
    /// The published document, built once per round.
    json: Bytes,
}

/// `/bootstrap-dns`'s state: the resolved lists, the refresh task's resolver and the
/// metrics. Shared by the relay (which serves it) and the task derpd runs
/// ([`BootstrapDns::run`]).
pub struct BootstrapDns {
    config: BootstrapDnsConfig,
    resolver: Arc<dyn Resolver>,
    published: ArcSwapOption<Resolved>,
    unpublished: ArcSwapOption<Entries>,
    queried: Mutex<HashSet<String>>,
    metrics: DnsMetrics,
}

impl fmt::Debug for BootstrapDns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BootstrapDns")
            .field("config", &self.config)
            .field("resolver", &self.resolver)
            .finish_non_exhaustive()
    }
}

/// derper's counters, under its names (top-level expvars there, so no `derp_` prefix).
#[derive(Debug)]
struct DnsMetrics {
    requests: IntCounter,
    published_hits: IntCounter,
    published_misses: IntCounter,
    unpublished_hits: IntCounter,
    unpublished_misses: IntCounter,
    unpublished_percent_misses: IntCounter,
    /// The size of the set of distinct `?q=` names. derper exports this as a counter too,
    /// though it drops to zero when the set is cleared.
    queried_domains: IntCounter,
}

impl DnsMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        Ok(Self {
            requests: counter("bootstrap_dns_requests", "requests to /bootstrap-dns")?,
            published_hits: counter(
                "bootstrap_dns_published_hits",
                "?q= names that are published and have addresses",
            )?,
            published_misses: counter(
                "bootstrap_dns_published_misses",
                "?q= names that are published and have no addresses",
            )?,
            unpublished_hits: counter(
                "bootstrap_dns_unpublished_hits",
                "?q= names that are unpublished and have addresses",
            )?,
            unpublished_misses: counter(
                "bootstrap_dns_unpublished_misses",
                "?q= names in neither list",
            )?,
            unpublished_percent_misses: counter(
                "bootstrap_dns_unpublished_percent_misses",
                "?q= names that are unpublished, for clients outside their rollout share",
            )?,
            queried_domains: counter(
                "bootstrap_dns_queried_domains",
                "distinct ?q= names seen (the set is cleared past 500)",
            )?,
        })
    }
}

impl BootstrapDns {
    /// Bootstrap DNS for `config`, resolving with `resolver`, its metrics registered on
    /// `registry`. Nothing is served until [`BootstrapDns::run`] has resolved the lists once.
    pub fn new(
        config: BootstrapDnsConfig,
        resolver: Arc<dyn Resolver>,
        registry: &Registry,
    ) -> Result<Self, prometheus::Error> {
        Ok(Self {
            config,
            resolver,
            published: ArcSwapOption::empty(),
            unpublished: ArcSwapOption::empty(),
            queried: Mutex::new(HashSet::new()),
            metrics: DnsMetrics::new(registry)?,
        })
    }

    /// Resolves the lists now, then [`REFRESH_INTERVAL`] after each round ends, until
    /// `shutdown`. Returns at once when both lists are empty.
    pub async fn run(&self, shutdown: CancellationToken) {
        if self.config.published.is_empty() && self.config.unpublished.is_empty() {
            return;
        }
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = self.refresh() => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(REFRESH_INTERVAL) => {}
            }
        }
    }

    /// One round: resolves each non-empty list and puts the result in service whole.
    pub async fn refresh(&self) {
        if !self.config.published.is_empty() {
            let mut entries = self.resolve_list(&self.config.published).await;
            // Shuffled so clients do not all prefer the resolver's first (often IPv6) address.
            if let Some(ips) = &mut entries.ips {
                for addrs in ips.values_mut() {
                    addrs.shuffle(&mut rand::thread_rng());
                }
            }
            let json = Bytes::from(document(entries.ips.as_ref()));
            self.published
                .store(Some(Arc::new(Resolved { entries, json })));
        }
        if !self.config.unpublished.is_empty() {
            let entries = self.resolve_list(&self.config.unpublished).await;
            self.unpublished.store(Some(Arc::new(entries)));
        }
    }

    /// Resolves `list` within [`LIST_TIMEOUT`]; lookups past the budget fail.
    async fn resolve_list(&self, list: &str) -> Entries {
        let deadline = tokio::time::Instant::now() + LIST_TIMEOUT;
        let mut out = Entries::default();
        for entry in list.split(',') {
            let (name, txt_name) = entry.split_once('/').unwrap_or((entry, ""));
            let addrs = match tokio::time::timeout_at(deadline, self.resolver.lookup_ip(name)).await
            {
                Ok(Ok(addrs)) => addrs,
                Ok(Err(e)) => {
                    warn!("bootstrap DNS lookup {name:?}: {e}");
                    continue;
                }
                Err(_) => {
                    warn!("bootstrap DNS lookup {name:?}: timed out");
                    continue;
                }
            };
            out.ips
                .get_or_insert_with(BTreeMap::new)
                .insert(name.to_owned(), addrs);
            if txt_name.is_empty() {
                out.percent.insert(name.to_owned(), 1.0);
                continue;
            }
            let values =
                match tokio::time::timeout_at(deadline, self.resolver.lookup_txt(txt_name)).await {
                    Ok(Ok(values)) => values,
                    Ok(Err(e)) => {
                        warn!("bootstrap DNS lookup {txt_name:?}: {e}");
                        continue;
                    }
                    Err(_) => {
                        warn!("bootstrap DNS lookup {txt_name:?}: timed out");
                        continue;
                    }
                };
            for value in values {
                if let Some(p) = parse_percent(&value) {
                    out.percent.insert(name.to_owned(), f64::from(p) / 100.0);
                }
            }
        }
        out
    }

    /// Answers one request: `q` is the request's `q` query parameter (empty when absent),
    /// `remote` the client's address.
    pub(crate) fn respond(&self, q: &str, remote: SocketAddr) -> Response<Full<Bytes>> {
        self.metrics.requests.inc();
        if q.len() > MAX_NAME_LEN {
            return name_too_long();
        }
        if !q.is_empty() {
            self.remember_query(q);
            if let Some(unpublished) = self.unpublished.load().as_ref()
                && let Some(addrs) = unpublished.ips.as_ref().and_then(|m| m.get(q))
                && !addrs.is_empty()
            {
                self.metrics.unpublished_hits.inc();
                let percent = unpublished.percent.get(q).copied().unwrap_or(0.0);
                if remote_in_rollout(remote.ip(), percent) {
                    let one = BTreeMap::from([(q.to_owned(), addrs.clone())]);
                    return json_response(Bytes::from(document(Some(&one))));
                }
                self.metrics.unpublished_percent_misses.inc();
            }
            let published = self.published.load();
            let found = published
                .as_ref()
                .and_then(|p| p.entries.ips.as_ref())
                .and_then(|m| m.get(q));
            match found {
                Some(addrs) if !addrs.is_empty() => self.metrics.published_hits.inc(),
                Some(_) => self.metrics.published_misses.inc(),
                None => self.metrics.unpublished_misses.inc(),
            }
        }
        let body = self
            .published
            .load()
            .as_ref()
            .map_or_else(Bytes::new, |p| p.json.clone());
        json_response(body)
    }

    fn remember_query(&self, q: &str) {
        let mut seen = self.queried.lock().unwrap_or_else(|e| e.into_inner());
        if seen.insert(q.to_owned()) {
            self.metrics.queried_domains.inc();
        }
        if seen.len() > MAX_QUERIED {
            seen.clear();
            self.metrics.queried_domains.reset();
        }
    }
}

/// `/bootstrap-dns` on the main listener, any method, no access control (as derper); with
/// nothing configured, an empty document. A `q` longer than a DNS name is refused either way.
pub(crate) fn serve<B>(
    dns: Option<&BootstrapDns>,
    req: &http::Request<B>,
    remote: SocketAddr,
) -> Response<Full<Bytes>> {
    let q = query_value(req.uri().query(), "q");
    match dns {
        Some(dns) => dns.respond(&q, remote),
        None if q.len() > MAX_NAME_LEN => name_too_long(),
        None => json_response(Bytes::new()),
    }
}

/// The answer to a `?q=` longer than any DNS name. derper takes any length and remembers it
/// for `bootstrap_dns_queried_domains` (500 names of up to a request head each); no client
/// asks for such a name, so it is refused before it is remembered or looked up.
fn name_too_long() -> Response<Full<Bytes>> {
    let body = format!("bootstrap-dns: name longer than {MAX_NAME_LEN} bytes\n");
    closing_response(
        StatusCode::BAD_REQUEST,
        "text/plain; charset=utf-8",
        body.into(),
    )
}

/// A TXT string as a rollout percentage: Go's `strconv.Atoi`, then 0..=100.
fn parse_percent(s: &str) -> Option<u8> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Past three digits only "-0…0" and "+0…0" style zeros could still be in range; parse
    // as a wide integer so any valid Atoi input is judged by its value.
    let value: i128 = s.parse().ok()?;
    u8::try_from(value).ok().filter(|v| *v <= 100)
}

/// Whether a client at `ip` is in a rollout of `percent` (0.0 to 1.0): never at 0, always at
/// 1; from loopback a coin toss per request (for trying it out by hand); otherwise decided
/// by the address alone, so a client gets the same answer every time and on every node.
fn remote_in_rollout(ip: IpAddr, percent: f64) -> bool {
    if percent == 0.0 {
        return false;
    }
    if percent == 1.0 {
        return true;
    }
    let ip = ip.to_canonical();
    if ip.is_loopback() {
        return rand::random::<f64>() < 0.5;
    }
    address_in_rollout(ip, percent)
}

/// The deterministic rollout test: the first `Float64` of Go's PCG generator seeded with the
/// address's 16-byte form (IPv4 as `::ffff:a.b.c.d`), as two little-endian 64-bit halves;
/// the address is in iff `percent` exceeds it. Computed exactly as derper does, so a
/// client falls on the same side of a rollout whichever node it asks.
pub fn address_in_rollout(ip: IpAddr, percent: f64) -> bool {
    percent > rollout_draw(ip)
}

/// The number in [0, 1) a client's address draws (see [`address_in_rollout`]).
fn rollout_draw(ip: IpAddr) -> f64 {
    let bytes = match ip.to_canonical() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    let half = |range: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[range]);
        u64::from_le_bytes(b)
    };
    let mut pcg = Pcg::new(half(0..8), half(8..16));
    (pcg.next_u64() & ((1 << 53) - 1)) as f64 / (1u64 << 53) as f64
}

/// Go's `math/rand/v2` PCG: a 128-bit LCG with the DXSM output function.
struct Pcg {
    state: u128,
}

impl Pcg {
    const MUL: u128 = (2549297995355413924u128 << 64) | 4865540595714422341;
    const INC: u128 = (6364136223846793005u128 << 64) | 1442695040888963407;

    fn new(seed1: u64, seed2: u64) -> Self {
        Self {
            state: (u128::from(seed1) << 64) | u128::from(seed2),
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_mul(Self::MUL).wrapping_add(Self::INC);
        let (mut hi, lo) = ((self.state >> 64) as u64, self.state as u64);
        hi ^= hi >> 32;
        hi = hi.wrapping_mul(0xda94_2042_e4dd_58b5);
        hi ^= hi >> 48;
        hi.wrapping_mul(lo | 1)
    }
}

/// The JSON document derper serves: Go's `json.MarshalIndent(map, "", "\t")` of name →
/// addresses (keys sorted, tab-indented, no trailing newline; `null` for no map).
fn document(ips: Option<&BTreeMap<String, Vec<IpAddr>>>) -> Vec<u8> {
    let Some(ips) = ips else {
        return b"null".to_vec();
    };
    if ips.is_empty() {
        return b"{}".to_vec();
    }
    let mut out = String::from("{");
    for (i, (name, addrs)) in ips.iter().enumerate() {
        out.push_str(if i == 0 { "\n\t" } else { ",\n\t" });
        go_json_string(name, &mut out);
        out.push_str(": ");
        if addrs.is_empty() {
            out.push_str("[]");
            continue;
        }
        out.push('[');
        for (j, addr) in addrs.iter().enumerate() {
            out.push_str(if j == 0 { "\n\t\t" } else { ",\n\t\t" });
            go_json_string(&go_ip_string(*addr), &mut out);
        }
        out.push_str("\n\t]");
    }
    out.push_str("\n}");
    out.into_bytes()
}

/// An address as Go's `net.IP.String` writes it: IPv4-mapped IPv6 addresses as IPv4.
fn go_ip_string(ip: IpAddr) -> String {
    ip.to_canonical().to_string()
}

/// A JSON string as Go's `encoding/json` writes it (HTML-safe: `<`, `>` and `&` escaped).
fn go_json_string(s: &str, out: &mut String) {
    use std::fmt::Write as _;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_response(body: Bytes) -> Response<Full<Bytes>> {
    closing_response(StatusCode::OK, "application/json", body)
}

/// Every answer of `/bootstrap-dns` closes its connection: it is asked across regions and
/// answered once, so the connection is not worth keeping.
fn closing_response(
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// The first value of `key` in a URL query string, decoded as Go's `url.ParseQuery` does
/// (`+` is a space, `%XX` escapes; a pair with a `;` or a bad escape is skipped). Empty when
/// absent.
pub(crate) fn query_value(query: Option<&str>, key: &str) -> String {
    let Some(query) = query else {
        return String::new();
    };
    for pair in query.split('&') {
        if pair.is_empty() || pair.contains(';') {
            continue;
        }
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(k), Some(v)) = (query_unescape(k), query_unescape(v)) else {
            continue;
        };
        if k == key {
            return v;
        }
    }
    String::new()
}

/// Go's `url.QueryUnescape`; `None` for a malformed escape. Bytes that do not form UTF-8
/// are replaced, as Go's JSON encoder would replace them later.
fn query_unescape(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers from a fixed table; anything else is "no such host".
    #[derive(Debug, Default)]
    pub(crate) struct FakeResolver {
        pub(crate) ips: HashMap<String, Vec<IpAddr>>,
        pub(crate) txt: HashMap<String, Vec<String>>,
    }

    impl Resolver for FakeResolver {
        fn lookup_ip<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<IpAddr>> {
            let found = name
                .parse::<IpAddr>()
                .ok()
                .map(|ip| vec![ip])
                .or_else(|| self.ips.get(name).cloned());
            Box::pin(async move {
                found.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such host"))
            })
        }

        fn lookup_txt<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<String>> {
            let found = self.txt.get(name).cloned();
            Box::pin(async move {
                found.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such host"))
            })
        }
    }

    fn loopback() -> Vec<IpAddr> {
        vec![IpAddr::from([127, 0, 0, 1])]
    }

    /// The names, lists and hosts file of the recorded derper run (spec'd in
    /// `testdata/bootstrap-dns/README.md`).
    fn recorded_setup() -> (BootstrapDns, Registry) {
        let mut resolver = FakeResolver::default();
        for name in ["localhost", "vm", "runsc"] {
            resolver.ips.insert(name.into(), loopback());
        }
        let registry = Registry::new();
        let dns = BootstrapDns::new(
            BootstrapDnsConfig {
                published: "localhost,vm,runsc,nonexistent.invalid,foo.localhost,127.0.0.1".into(),
                unpublished: "vm/txt.invalid,runsc,hidden.invalid".into(),
            },
            Arc::new(resolver),
            &registry,
        )
        .expect("metrics");
        (dns, registry)
    }

    fn testdata(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/testdata/bootstrap-dns/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    async fn body(resp: Response<Full<Bytes>>) -> Vec<u8> {
        use http_body_util::BodyExt;
        resp.into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes()
            .to_vec()
    }

    fn client() -> SocketAddr {
        "127.0.0.1:40000".parse().expect("addr")
    }

    #[tokio::test]
    async fn the_recorded_derper_answers_come_out_byte_for_byte() {
        let (dns, _registry) = recorded_setup();
        assert_eq!(
            body(dns.respond("", client())).await,
            b"",
            "before a refresh"
        );
        dns.refresh().await;
        let all = testdata("all.json");
        for q in ["", "vm", "localhost", "nothere"] {
            assert_eq!(body(dns.respond(q, client())).await, all, "q={q:?}");
        }
        assert_eq!(
            body(dns.respond("runsc", client())).await,
            testdata("q-runsc.json")
        );
    }

    #[tokio::test]
    async fn headers_are_derpers() {
        let (dns, _registry) = recorded_setup();
        dns.refresh().await;
        let resp = dns.respond("", client());
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(resp.headers()[header::CONNECTION], "close");
    }

    #[tokio::test]
    async fn no_name_resolving_serves_null_and_a_failed_txt_lookup_means_zero() {
        let mut resolver = FakeResolver::default();
        resolver.ips.insert("a.example".into(), loopback());
        resolver.ips.insert("b.example".into(), loopback());
        resolver.ips.insert("c.example".into(), loopback());
        resolver.ips.insert("d.example".into(), loopback());
        resolver.txt.insert(
            "pct.example".into(),
            vec!["200".into(), "70".into(), "abc".into()],
        );
        resolver
            .txt
            .insert("bad.example".into(), vec!["abc".into()]);
        let registry = Registry::new();
        let dns = BootstrapDns::new(
            BootstrapDnsConfig {
                published: "gone.invalid,".into(),
                unpublished: "a.example/pct.example,b.example/bad.example,c.example/,\
                              d.example/missing.example"
                    .into(),
            },
            Arc::new(resolver),
            &registry,
        )
        .expect("metrics");
        dns.refresh().await;
        assert_eq!(body(dns.respond("", client())).await, b"null");
        let unpublished = dns.unpublished.load_full().expect("resolved");
        assert_eq!(unpublished.percent.get("a.example"), Some(&0.7));
        assert_eq!(unpublished.percent.get("b.example"), None);
        assert_eq!(unpublished.percent.get("c.example"), Some(&1.0));
        assert_eq!(unpublished.percent.get("d.example"), None);
        // Out of the rollout: the published document instead.
        assert_eq!(body(dns.respond("b.example", client())).await, b"null");
        assert_eq!(dns.metrics.unpublished_percent_misses.get(), 1);
    }

    #[tokio::test]
    async fn the_counters_count_as_derpers_do() {
        let (dns, registry) = recorded_setup();
        dns.refresh().await;
        // The requests of the recorded derper run, and its counts. `vm` is unpublished at
        // 0 %: an unpublished hit, a percent miss, then a published hit.
        for q in ["runsc", "runsc", "vm", "localhost", "nothere", "", "", ""] {
            dns.respond(q, client());
        }
        let m = &dns.metrics;
        assert_eq!(m.requests.get(), 8);
        assert_eq!(m.unpublished_hits.get(), 3);
        assert_eq!(m.unpublished_percent_misses.get(), 1);
        assert_eq!(m.published_hits.get(), 2);
        assert_eq!(m.published_misses.get(), 0);
        assert_eq!(m.unpublished_misses.get(), 1);
        assert_eq!(m.queried_domains.get(), 4);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| {
                assert_eq!(f.get_field_type(), prometheus::proto::MetricType::COUNTER);
                f.name().to_owned()
            })
            .collect();
        assert_eq!(
            names,
            [
                "bootstrap_dns_published_hits",
                "bootstrap_dns_published_misses",
                "bootstrap_dns_queried_domains",
                "bootstrap_dns_requests",
                "bootstrap_dns_unpublished_hits",
                "bootstrap_dns_unpublished_misses",
                "bootstrap_dns_unpublished_percent_misses",
            ]
        );
    }

    async fn exchange(state: &Arc<crate::state::ServerState>, request: &str) -> String {
        crate::debug::ask(state, "127.0.0.1:5000", request).await
    }

    #[tokio::test]
    async fn with_derp_off_bootstrap_dns_is_still_served_with_derpers_headers() {
        let (dns, _registry) = recorded_setup();
        dns.refresh().await;
        let mut config = crate::ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        config.derp_enabled = false;
        config.bootstrap_dns = Some(Arc::new(dns));
        let state =
            Arc::new(crate::state::ServerState::new(config, &Registry::new()).expect("state"));
        let answer = exchange(
            &state,
            "GET /bootstrap-dns?q=runsc HTTP/1.1\r\nHost: derp\r\n\r\n",
        )
        .await;
        let (head, body) = answer.split_once("\r\n\r\n").expect("head");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        let mut lines: Vec<String> = head
            .lines()
            .skip(1)
            .map(str::to_ascii_lowercase)
            .filter(|l| !l.starts_with("date:"))
            .collect();
        lines.sort();
        // What the reference derper answered (recorded in testdata/bootstrap-dns/README.md).
        let mut expected = [
            "connection: close",
            "content-security-policy: default-src 'self'; frame-ancestors 'none'; \
             form-action 'self'; base-uri 'self'; block-all-mixed-content; object-src 'none'",
            "content-type: application/json",
            "strict-transport-security: max-age=63072000; includesubdomains",
            "x-content-type-options: nosniff",
            "x-frame-options: deny",
            "content-length: 32",
        ];
        expected.sort();
        assert_eq!(lines, expected);
        assert_eq!(body.as_bytes(), testdata("q-runsc.json"));
        let answer = exchange(
            &state,
            "GET /derp HTTP/1.1\r\nHost: derp\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
        assert!(answer.ends_with("derp server disabled\n"), "{answer}");
    }

    #[test]
    fn the_queried_set_is_cleared_past_500() {
        let (dns, _registry) = recorded_setup();
        for i in 0..=MAX_QUERIED {
            dns.remember_query(&format!("n{i}"));
        }
        assert_eq!(dns.metrics.queried_domains.get(), 0);
        dns.remember_query("again");
        assert_eq!(dns.metrics.queried_domains.get(), 1);
    }

    #[tokio::test]
    async fn names_longer_than_dns_allows_are_refused_and_not_remembered() {
        let (dns, _registry) = recorded_setup();
        dns.refresh().await;
        let longest = "a".repeat(MAX_NAME_LEN);
        let resp = dns.respond(&longest, client());
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(body(resp).await, testdata("all.json"));
        assert_eq!(dns.metrics.queried_domains.get(), 1);
        for len in [MAX_NAME_LEN + 1, 64 * 1024] {
            let resp = dns.respond(&"a".repeat(len), client());
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{len} bytes");
            assert_eq!(resp.headers()[header::CONNECTION], "close");
            assert_eq!(
                String::from_utf8(body(resp).await).expect("utf-8"),
                "bootstrap-dns: name longer than 253 bytes\n"
            );
        }
        assert_eq!(dns.metrics.queried_domains.get(), 1, "not remembered");
        assert_eq!(dns.metrics.requests.get(), 3, "counted as requests");
        assert_eq!(
            dns.metrics.unpublished_misses.get(),
            1,
            "only the first looked up"
        );
        assert_eq!(dns.queried.lock().expect("lock").len(), 1);
        let too_long = |q: &str| {
            let req = http::Request::get(format!("/bootstrap-dns?q={q}"))
                .body(())
                .expect("request");
            serve(None, &req, client()).status()
        };
        assert_eq!(too_long(&longest), StatusCode::OK, "nothing configured");
        assert_eq!(
            too_long(&format!("{longest}a")),
            StatusCode::BAD_REQUEST,
            "nothing configured"
        );
    }

    #[tokio::test]
    async fn the_bound_is_on_the_decoded_name_over_http_too() {
        let (dns, _registry) = recorded_setup();
        dns.refresh().await;
        let mut config = crate::ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        config.bootstrap_dns = Some(Arc::new(dns));
        let state =
            Arc::new(crate::state::ServerState::new(config, &Registry::new()).expect("state"));
        // 253 bytes once decoded, 759 as written.
        let escaped = "%61".repeat(MAX_NAME_LEN);
        let answer = exchange(
            &state,
            &format!("GET /bootstrap-dns?q={escaped} HTTP/1.1\r\nHost: derp\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        let answer = exchange(
            &state,
            &format!("GET /bootstrap-dns?q={escaped}b HTTP/1.1\r\nHost: derp\r\n\r\n"),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        assert!(
            answer.ends_with("\r\n\r\nbootstrap-dns: name longer than 253 bytes\n"),
            "{answer}"
        );
    }

    #[test]
    fn rollout_draws_match_derpers_vectors() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let mut pcg = Pcg::new(0, 0x0164_33c6_ffff_0000);
        assert_eq!(pcg.next_u64(), 0xb921_0c9f_af8d_7f67);
        let mut pcg = Pcg::new(0, 0x0264_33c6_ffff_0000);
        assert_eq!(pcg.next_u64(), 0xe479_1f8a_37b3_b1cf);
        let mut pcg = Pcg::new(0x0000_0100_b80d_0120, 0x0100_0000_0000_0000);
        assert_eq!(pcg.next_u64(), 0x7482_6730_f8b9_e100);
        assert_eq!(rollout_draw(ip("198.51.100.1")), 0.03279098785058643);
        assert_eq!(rollout_draw(ip("198.51.100.2")), 0.7851000869682653);
        assert_eq!(rollout_draw(ip("2001:db8:1::1")), 0.0750965936595378);
        assert_eq!(
            rollout_draw(ip("::ffff:198.51.100.2")),
            rollout_draw(ip("198.51.100.2"))
        );
        for (last, u) in [
            (3, 0.895276),
            (4, 0.801378),
            (5, 0.591775),
            (6, 0.255838),
            (7, 0.460837),
            (8, 0.337728),
            (9, 0.294073),
            (10, 0.738991),
            (14, 0.010125),
            (21, 0.965059),
        ] {
            let draw = rollout_draw(ip(&format!("198.51.100.{last}")));
            assert!((draw - u).abs() < 5e-7, ".{last}: {draw} vs {u}");
        }
        assert!((rollout_draw(ip("2001:db8:1::2")) - 0.114767).abs() < 5e-7);
        assert!(address_in_rollout(ip("198.51.100.1"), 0.5));
        assert!(!address_in_rollout(ip("198.51.100.2"), 0.5));
        assert!(remote_in_rollout(ip("198.51.100.2"), 1.0));
        assert!(!remote_in_rollout(ip("198.51.100.1"), 0.0));
    }

    /// Tailscale's own vectors for derper's rollout test (`TestRemoteAddrMatchesPercent` in
    /// `cmd/derper/bootstrap_dns_test.go`): 0 and 100 %, then a run of addresses at 50 %.
    #[test]
    fn tailscales_rollout_vectors_hold() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert!(!remote_in_rollout(ip("10.0.0.1"), 0.0));
        assert!(remote_in_rollout(ip("10.0.0.1"), 1.0));
        for (last, inside) in [
            (4, true),
            (5, true),
            (6, false),
            (7, true),
            (8, false),
            (9, true),
            (10, true),
        ] {
            let addr = ip(&format!("1.2.3.{last}"));
            assert_eq!(address_in_rollout(addr, 0.5), inside, "{addr}");
            assert_eq!(remote_in_rollout(addr, 0.5), inside, "{addr}");
            let mapped = IpAddr::V6(match addr {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            });
            assert_eq!(remote_in_rollout(mapped, 0.5), inside, "{mapped}");
        }
    }

    #[test]
    fn percentages_parse_as_atoi_then_range() {
        assert_eq!(parse_percent("70"), Some(70));
        assert_eq!(parse_percent("+70"), Some(70));
        assert_eq!(parse_percent("0"), Some(0));
        assert_eq!(parse_percent("-0"), Some(0));
        assert_eq!(parse_percent("007"), Some(7));
        assert_eq!(parse_percent("100"), Some(100));
        assert_eq!(parse_percent("101"), None);
        assert_eq!(parse_percent("-1"), None);
        assert_eq!(parse_percent(" 5"), None);
        assert_eq!(parse_percent("5%"), None);
        assert_eq!(parse_percent(""), None);
        assert_eq!(parse_percent("99999999999999999999999"), None);
    }

    #[test]
    fn documents_are_gos_marshal_indent() {
        let mut m = BTreeMap::new();
        m.insert(
            "b<&>".to_owned(),
            vec![
                "::ffff:10.0.0.1".parse().expect("ip"),
                "2001:db8::1".parse().expect("ip"),
            ],
        );
        m.insert("a\"\u{1}".to_owned(), vec![]);
        assert_eq!(
            String::from_utf8(document(Some(&m))).expect("utf-8"),
            "{\n\t\"a\\\"\\u0001\": [],\n\t\"b\\u003c\\u0026\\u003e\": [\n\t\t\"10.0.0.1\",\n\t\t\"2001:db8::1\"\n\t]\n}"
        );
        assert_eq!(document(None), b"null");
    }

    #[test]
    fn the_query_is_read_as_go_reads_it() {
        assert_eq!(query_value(Some("q=vm"), "q"), "vm");
        assert_eq!(query_value(Some("x=1&q=a%2Eb+c&q=second"), "q"), "a.b c");
        assert_eq!(query_value(Some("q=%zz&q=ok"), "q"), "ok");
        assert_eq!(query_value(Some("q=a;b&q=ok"), "q"), "ok");
        assert_eq!(query_value(Some("q"), "q"), "");
        assert_eq!(query_value(None, "q"), "");
    }
}
