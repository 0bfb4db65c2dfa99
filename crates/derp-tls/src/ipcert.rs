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
//! minutes. Certificates are cached per address in the cert directory.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use instant_acme::{Identifier, NewOrder};
use rcgen::{CertificateParams, DistinguishedName, SanType};
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

/// Gets and renews certificates for the addresses clients connect to, on a front made with
/// [`TlsOptions::ip_certs`](crate::TlsOptions::ip_certs).
#[derive(Clone, Debug)]
pub struct IpCertManager {
    front: TlsFront,
    client: Arc<AcmeClient>,
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
        Ok(Self { front, client })
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
        let mut current = match self.load_cached(ip) {
            Ok(found) => found,
            Err(e) => {
                warn!(%ip, error = %e, "ignoring an unusable cached IP certificate");
                None
            }
        };
        let config = &self.client.config;
        let mut backoff = config.initial_backoff;
        loop {
            if !renewal_due(current.as_ref(), &shutdown).await {
                return;
            }
            let result = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = tokio::time::timeout(ORDER_TIMEOUT, self.obtain(ip)) => r,
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
            if let Ok(slot) = self.front.ip_slot(ip) {
                slot.status.send_modify(|s| {
                    s.failures += 1;
                    s.retry_at = Some(SystemTime::now() + backoff);
                });
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(config.max_backoff.min(MAX_BACKOFF));
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

    #[test]
    fn addresses_name_their_files_as_derper_does() {
        assert_eq!(ip_file_name("192.0.2.1".parse().expect("ip")), "192.0.2.1");
        assert_eq!(
            ip_file_name("2001:db8::1".parse().expect("ip")),
            "2001.db8..1"
        );
    }
}
