//! Per-address certificate slots for IP certificates on demand: what the TLS front serves
//! for each of the node's own addresses, and the queue of addresses that want one, which the
//! [`IpCertManager`](crate::IpCertManager) works through.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwapOption;
use rustls::ServerConfig;
use rustls::sign::CertifiedKey;
use tokio::sync::{mpsc, watch};

use crate::TlsError;

/// Slots a front keeps at most. Only the configured address and global ones the host's
/// sockets see (or a trusted balancer's header names) get one, so a real node needs a
/// handful; the cap bounds what a balancer's headers can make the node order.
pub(crate) const MAX_IP_SLOTS: usize = 8;

/// What happened to one address's certificate, for handshakes waiting on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct IpStatus {
    /// Certificates put into service so far.
    pub(crate) installs: u64,
    /// Issuance attempts that failed so far.
    pub(crate) failures: u64,
    /// After a failure: no new attempt before this.
    pub(crate) retry_at: Option<SystemTime>,
}

/// One of the node's addresses.
#[derive(Debug)]
pub(crate) struct IpSlot {
    /// The certificate in service for this address (leaf, chain, meta certificate).
    pub(crate) cert: Arc<ArcSwapOption<CertifiedKey>>,
    pub(crate) status: watch::Sender<IpStatus>,
    /// Configs whose resolver serves this address's certificate: for clients offering no
    /// ALPN we speak, and for those offering `http/1.1`.
    pub(crate) plain: Arc<ServerConfig>,
    pub(crate) http11: Arc<ServerConfig>,
}

/// Every address a client has connected to, and the addresses still to be handed to the
/// manager.
#[derive(Debug)]
pub(crate) struct IpSlots {
    slots: Mutex<HashMap<IpAddr, Arc<IpSlot>>>,
    requests: mpsc::UnboundedSender<IpAddr>,
    pending: Mutex<Option<mpsc::UnboundedReceiver<IpAddr>>>,
}

impl IpSlots {
    pub(crate) fn new() -> Self {
        let (requests, pending) = mpsc::unbounded_channel();
        Self {
            slots: Mutex::new(HashMap::new()),
            requests,
            pending: Mutex::new(Some(pending)),
        }
    }

    /// The slot of `ip`, made by `make` (and queued for the manager) the first time, while
    /// fewer than [`MAX_IP_SLOTS`] exist.
    pub(crate) fn get_or_create(
        &self,
        ip: IpAddr,
        make: impl FnOnce() -> Result<IpSlot, TlsError>,
    ) -> Result<Arc<IpSlot>, TlsError> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get(&ip) {
            return Ok(slot.clone());
        }
        if slots.len() >= MAX_IP_SLOTS {
            return Err(TlsError::IpSlotsFull {
                ip,
                max: MAX_IP_SLOTS,
            });
        }
        let slot = Arc::new(make()?);
        slots.insert(ip, slot.clone());
        // The manager may not run (a front used without one): the address then waits.
        let _ = self.requests.send(ip);
        Ok(slot)
    }

    /// How many addresses have a slot.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The queue of addresses wanting a certificate; only one manager can take it.
    pub(crate) fn take_requests(&self) -> Option<mpsc::UnboundedReceiver<IpAddr>> {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

/// Whether a CA may certify `ip`: a global unicast address. Loopback, link-local, private
/// (RFC 1918, which holds Docker's bridges, and fc00::/7), CGNAT (100.64.0.0/10), multicast
/// and reserved addresses never are, so ordering for them only spends the account's limits.
pub(crate) fn is_global_unicast(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => is_global_v6(v6),
    }
}

fn is_global_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_multicast()
        || a >= 240
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 198 && (18..20).contains(&b)))
}

fn is_global_v6(ip: Ipv6Addr) -> bool {
    // 2000::/3 is all IPv6 global unicast; loopback, link-local, unique local and
    // multicast lie outside it.
    ip.segments()[0] & 0xe000 == 0x2000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_global_unicast_addresses_may_have_a_certificate() {
        let global = [
            "8.8.8.8",
            "203.0.113.7",
            "100.63.255.255",
            "100.128.0.1",
            "172.32.0.1",
            "2606:4700::1111",
            "::ffff:8.8.4.4",
        ];
        let not = [
            "127.0.0.1",
            "127.0.0.2",
            "169.254.169.254",
            "10.0.0.5",
            "172.16.0.1",
            // Docker's default bridge.
            "172.17.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "fe80::1",
            "fc00::1",
            "fd7a:115c:a1e0::1",
            "ff02::1",
            "::ffff:10.1.2.3",
        ];
        for ip in global {
            assert!(is_global_unicast(ip.parse().expect("ip")), "{ip}");
        }
        for ip in not {
            assert!(!is_global_unicast(ip.parse().expect("ip")), "{ip}");
        }
    }
}
