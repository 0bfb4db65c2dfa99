//! Certificates for the node's own IP addresses (RFC 8738 identifiers), obtained on demand:
//! the first client that connects without a hostname makes the TLS front ask for one (the
//! configured address's with an IP hostname, else the address the client connected to; see
//! [`TlsOptions::ip_certs`](crate::TlsOptions::ip_certs)), and from then on this manager
//! keeps that address's certificate valid.
//!
//! As derper's `--acme-ip-certs`: HTTP-01 only (the CA connects to port 80 of the address,
//! so the port-80 listener must be reachable there), the CA's `shortlived` profile when its
//! directory offers it (Let's Encrypt's six-day certificates, the only ones it issues for
//! addresses), a certificate with the address as its only name, renewal when a third of its
//! lifetime is left, and after a failure no new attempt for a minute, doubling up to 30
//! minutes. Certificates are cached per address in the cert directory. Beyond derper, all
//! addresses together place at most [`IP_ORDERS_PER_HOUR`] orders in any hour, so a failing
//! address cannot spend the account's order limit that the hostname's renewals need.

use std::collections::VecDeque;
use std::future::Future;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use instant_acme::{Identifier, NewOrder};
use rcgen::{CertificateParams, DistinguishedName, SanType};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::TlsError;
use super::acme::{
    AcmeClient, AcmeConfig, ChallengeKind, ORDER_TIMEOUT, order_certificate, renewal_due,
    renewal_time,
};
use super::certs::{load_certs_pem, load_key_pem};
use super::front::{CertInfo, CertOrigin, TlsFront};

/// The certificate profile asked for when the CA offers it.
pub const SHORT_LIVED_PROFILE: &str = "shortlived";
/// The longest wait after failed attempts for one address.
const MAX_BACKOFF: Duration = Duration::from_secs(30 * 60);
/// Orders for IP certificates one manager places in any hour, over all addresses. They
/// share the account with the hostname's certificate, and a CA limits an account's orders
/// (Let's Encrypt: 300 new orders per 3 hours); addresses whose validation keeps failing
/// must not use up what the hostname's renewals need.
pub const IP_ORDERS_PER_HOUR: usize = 10;
const HOUR: Duration = Duration::from_secs(3600);

/// The orders placed in the last hour, against [`IP_ORDERS_PER_HOUR`].
#[derive(Debug)]
struct OrderBudget {
    per_hour: usize,
    placed: VecDeque<Instant>,
}

impl OrderBudget {
    fn new(per_hour: usize) -> Self {
        Self {
            per_hour,
            placed: VecDeque::new(),
        }
    }

    /// Takes a place for an order at `now`, or says how long until one is free.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        while self
            .placed
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= HOUR)
        {
            self.placed.pop_front();
        }
        if self.placed.len() < self.per_hour {
            self.placed.push_back(now);
            return Ok(());
        }
        let oldest = self.placed.front().copied().unwrap_or(now);
        Err((oldest + HOUR).saturating_duration_since(now))
    }
}

/// Gets and renews certificates for the addresses clients connect to, on a front made with
/// [`TlsOptions::ip_certs`](crate::TlsOptions::ip_certs).
#[derive(Clone, Debug)]
pub struct IpCertManager {
    front: TlsFront,
    client: Arc<AcmeClient>,
    budget: Arc<Mutex<OrderBudget>>,
}

impl IpCertManager {
    /// A manager with an account of its own, for a node with no hostname certificate.
    /// Only the HTTP-01 challenge is used, whatever `config.challenges` says.
    pub fn new(front: TlsFront, config: AcmeConfig) -> Result<Self, TlsError> {
        let client = Arc::new(AcmeClient::new(&front, config)?);
        Self::with_client(front, client)
    }

    pub(crate) fn with_client(front: TlsFront, client: Arc<AcmeClient>) -> Result<Self, TlsError> {
        if front.ip_slots().is_none() {
            return Err(TlsError::IpCertsNotEnabled);
        }
        Ok(Self {
            front,
            client,
            budget: Arc::new(Mutex::new(OrderBudget::new(IP_ORDERS_PER_HOUR))),
        })
    }

    /// Orders placed with the ACME server through this manager's account.
    pub fn orders_placed(&self) -> u64 {
        self.client.orders.load(Ordering::Relaxed)
    }

    /// The cached certificate chain of `ip`.
    pub fn cert_path(&self, ip: IpAddr) -> PathBuf {
        self.client.cache_file(&ip_file_name(ip), "crt")
    }

    /// The cached key of `ip`.
    pub fn key_path(&self, ip: IpAddr) -> PathBuf {
        self.client.cache_file(&ip_file_name(ip), "key")
    }

    /// Works until `shutdown`: for each address the front asks about, serves its cached
    /// certificate or orders one, then keeps it renewed.
    pub async fn run(&self, shutdown: CancellationToken) {
        let Some(slots) = self.front.ip_slots() else {
            return;
        };
        let Some(mut requests) = slots.take_requests() else {
            warn!("another IP certificate manager already runs for this front");
            return;
        };
        let mut addresses = tokio::task::JoinSet::new();
        loop {
            let ip = tokio::select! {
                _ = shutdown.cancelled() => break,
                ip = requests.recv() => match ip {
                    Some(ip) => ip,
                    None => break,
                },
            };
            let (this, shutdown) = (self.clone(), shutdown.clone());
            addresses.spawn(async move { this.keep(ip, shutdown).await });
        }
        addresses.shutdown().await;
    }

    /// Keeps `ip`'s certificate valid until `shutdown`.
    async fn keep(&self, ip: IpAddr, shutdown: CancellationToken) {
        let current = match self.load_cached(ip) {
            Ok(found) => found,
            Err(e) => {
                warn!(%ip, error = %e, "ignoring an unusable cached IP certificate");
                None
            }
        };
        self.keep_with(ip, current, shutdown, || self.obtain(ip))
            .await;
    }

    /// [`Self::keep`] with `order` placing each order: after a failure the address waits,
    /// doubling from the configured initial backoff up to [`MAX_BACKOFF`], and every order
    /// takes a place in the manager's hourly budget first.
    async fn keep_with<F, Fut>(
        &self,
        ip: IpAddr,
        mut current: Option<CertInfo>,
        shutdown: CancellationToken,
        order: F,
    ) where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<CertInfo, TlsError>>,
    {
        let config = &self.client.config;
        let mut backoff = config.initial_backoff;
        loop {
            if !renewal_due(current.as_ref(), &shutdown).await {
                return;
            }
            let (taken, per_hour) = {
                let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
                (budget.take(Instant::now()), budget.per_hour)
            };
            if let Err(wait) = taken {
                warn!(
                    %ip,
                    retry_in = ?wait,
                    per_hour,
                    "acme: this hour's IP certificate orders are used up; the rest of the \
                     account's order limit is left to the hostname's certificate"
                );
                self.report_failure(ip, wait);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            let result = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = tokio::time::timeout(ORDER_TIMEOUT, order()) => r,
            };
            let error = match result {
                Ok(Ok(info)) => {
                    let already_due = renewal_time(&info) <= SystemTime::now();
                    current = Some(info);
                    if !already_due {
                        backoff = config.initial_backoff;
                        continue;
                    }
                    "the new certificate is already due for renewal; check the clock".to_owned()
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => "the order timed out".to_owned(),
            };
            warn!(%ip, error, retry_in = ?backoff, "acme: no certificate for the address");
            self.report_failure(ip, backoff);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(config.max_backoff.min(MAX_BACKOFF));
        }
    }

    /// Tells handshakes waiting for `ip`'s certificate that none is coming for `retry_in`,
    /// so they fail at once instead of waiting out their deadline.
    fn report_failure(&self, ip: IpAddr, retry_in: Duration) {
        if let Ok(slot) = self.front.ip_slot(ip) {
            slot.status.send_modify(|s| {
                s.failures += 1;
                s.retry_at = Some(SystemTime::now() + retry_in);
            });
        }
    }

    /// Serves `ip`'s cached certificate, if there is one valid for it.
    fn load_cached(&self, ip: IpAddr) -> Result<Option<CertInfo>, TlsError> {
        let (Ok(cert_pem), Ok(key_pem)) = (
            std::fs::read(self.cert_path(ip)),
            std::fs::read(self.key_path(ip)),
        ) else {
            return Ok(None);
        };
        let chain = load_certs_pem(&cert_pem)?;
        let key = load_key_pem(&key_pem)?;
        let info = self
            .front
            .install_ip(ip, chain, key, CertOrigin::AcmeCache)?;
        info!(%ip, not_after = ?info.not_after, "acme: IP certificate loaded from cache");
        Ok(Some(info))
    }

    /// Places one order for `ip`, answers its HTTP-01 challenge on the port-80 listener,
    /// installs the certificate and caches it.
    pub async fn obtain(&self, ip: IpAddr) -> Result<CertInfo, TlsError> {
        let identifiers = [Identifier::Ip(ip)];
        let mut new_order = NewOrder::new(&identifiers);
        // Only when offered: a CA without profiles refuses an order naming one.
        let short_lived = self
            .client
            .account()
            .await?
            .profiles()
            .any(|p| p.name == SHORT_LIVED_PROFILE);
        if short_lived {
            new_order = new_order.profile(SHORT_LIVED_PROFILE);
        }
        // The address as the only name, no common name, as derper asks.
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![SanType::IpAddress(ip)];
        params.distinguished_name = DistinguishedName::new();
        let issued = order_certificate(
            &self.front,
            &self.client,
            &new_order,
            ChallengeKind::Http01,
            params,
        )
        .await?;
        let info = self.front.install_ip(
            ip,
            issued.chain.clone(),
            issued.key_der(),
            CertOrigin::AcmeIssued,
        )?;
        issued.cache(&self.key_path(ip), &self.cert_path(ip));
        info!(
            %ip,
            not_after = ?info.not_after,
            profile = if short_lived { SHORT_LIVED_PROFILE } else { "default" },
            "acme: got a certificate for the address; a DERP map node needs no CertName for \
             it: {{\"Name\":\"custom\",\"RegionID\":900,\"HostName\":\"{ip}\"}}"
        );
        Ok(info)
    }
}

/// An address as a file name: IPv6 colons become dots, as derper names its files.
fn ip_file_name(ip: IpAddr) -> String {
    ip.to_string().replace(':', ".")
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::{AcmeConfig, TlsOptions};
    use prometheus::Registry;

    #[test]
    fn the_budget_allows_so_many_orders_in_any_hour() {
        let mut budget = OrderBudget::new(3);
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        assert_eq!(budget.take(at(0)), Ok(()));
        assert_eq!(budget.take(at(600)), Ok(()));
        assert_eq!(budget.take(at(1200)), Ok(()));
        assert_eq!(budget.take(at(1800)), Err(Duration::from_secs(1800)));
        // The first order's place frees an hour after it, and only that one.
        assert_eq!(budget.take(at(3600)), Ok(()));
        assert_eq!(budget.take(at(3601)), Err(Duration::from_secs(599)));
        assert_eq!(budget.take(at(4200)), Ok(()));
    }

    /// A manager for a front with a DNS hostname and IP certificates on; its orders are the
    /// test's fake issuer, so the ACME settings are never used.
    fn manager(initial_backoff: Duration) -> IpCertManager {
        let options = TlsOptions {
            ip_certs: true,
            ..TlsOptions::new("derp.example.com")
        };
        let key = derp_testkit::server_secret().public_key();
        let front = TlsFront::new(&key, options, &Registry::new()).expect("front");
        let mut config = AcmeConfig::new(std::env::temp_dir().join("derp-tls-ipcert-unused"));
        config.initial_backoff = initial_backoff;
        IpCertManager::new(front, config).expect("manager")
    }

    /// Runs `manager.keep_with` for each of `ips` with an issuer that always fails, and
    /// returns each order's address and time (from the start) until `until`.
    async fn failing_orders(
        manager: &IpCertManager,
        ips: &[IpAddr],
        until: Duration,
    ) -> Vec<(IpAddr, Duration)> {
        let start = Instant::now();
        let shutdown = CancellationToken::new();
        let (placed, mut orders) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = tokio::task::JoinSet::new();
        for &ip in ips {
            let (manager, shutdown, placed) = (manager.clone(), shutdown.clone(), placed.clone());
            tasks.spawn(async move {
                let order = || {
                    let _ = placed.send((ip, start.elapsed()));
                    async { Err(TlsError::EmptyChain) }
                };
                manager.keep_with(ip, None, shutdown, order).await;
            });
        }
        let mut seen = Vec::new();
        while let Some((ip, at)) = orders.recv().await {
            if at >= until {
                break;
            }
            seen.push((ip, at));
        }
        shutdown.cancel();
        while tasks.join_next().await.is_some() {}
        seen
    }

    /// A failing address is tried again after a wait that doubles, up to the cap.
    #[tokio::test(start_paused = true)]
    async fn a_failing_address_backs_off_exponentially_up_to_the_cap() {
        let manager = manager(Duration::from_secs(60));
        let ip: IpAddr = "203.0.113.7".parse().expect("ip");
        let orders = failing_orders(&manager, &[ip], Duration::from_secs(4 * 3600)).await;
        let gaps: Vec<u64> = orders
            .windows(2)
            .map(|w| (w[1].1 - w[0].1).as_secs())
            .collect();
        assert_eq!(
            &gaps[..7],
            &[60, 120, 240, 480, 960, 1800, 1800],
            "{gaps:?}"
        );
        assert!(gaps[7..].iter().all(|g| *g == 1800), "{gaps:?}");
    }

    /// Addresses failing together place no more than the hourly budget in any hour, and
    /// are served again once places free up.
    #[tokio::test(start_paused = true)]
    async fn failing_addresses_together_stay_within_the_hourly_budget() {
        let manager = manager(Duration::from_secs(60));
        let ips: Vec<IpAddr> = (1..=3)
            .map(|n| format!("203.0.113.{n}").parse().expect("ip"))
            .collect();
        let orders = failing_orders(&manager, &ips, Duration::from_secs(4 * 3600)).await;
        let times: Vec<Duration> = orders.iter().map(|(_, at)| *at).collect();
        // Alone, each would order six times in the first hour: 18 together.
        assert_eq!(
            times.iter().filter(|t| **t < HOUR).count(),
            IP_ORDERS_PER_HOUR
        );
        for (i, t) in times.iter().enumerate() {
            let in_hour = times[i..].iter().filter(|u| **u < *t + HOUR).count();
            assert!(
                in_hour <= IP_ORDERS_PER_HOUR,
                "{in_hour} orders in the hour from {t:?}"
            );
        }
        for ip in &ips {
            assert!(
                orders.iter().any(|(o, at)| o == ip && *at >= HOUR),
                "{ip} is still tried after the first hour"
            );
        }
    }

    #[test]
    fn addresses_name_their_files_as_derper_does() {
        assert_eq!(ip_file_name("192.0.2.1".parse().expect("ip")), "192.0.2.1");
        assert_eq!(
            ip_file_name("2001:db8::1".parse().expect("ip")),
            "2001.db8..1"
        );
    }
}
