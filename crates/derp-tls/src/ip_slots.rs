//! Per-address certificate slots for IP certificates on demand: what the TLS front serves
//! for each of the node's own addresses, and the queue of addresses that want one, which the
//! [`IpCertManager`](crate::IpCertManager) works through.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwapOption;
use rustls::ServerConfig;
use rustls::sign::CertifiedKey;
use tokio::sync::{mpsc, watch};

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

    /// The slot of `ip`, made by `make` (and queued for the manager) the first time.
    pub(crate) fn get_or_create<E>(
        &self,
        ip: IpAddr,
        make: impl FnOnce() -> Result<IpSlot, E>,
    ) -> Result<Arc<IpSlot>, E> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get(&ip) {
            return Ok(slot.clone());
        }
        let slot = Arc::new(make()?);
        slots.insert(ip, slot.clone());
        // The manager may not run (a front used without one): the address then waits.
        let _ = self.requests.send(ip);
        Ok(slot)
    }

    /// The queue of addresses wanting a certificate; only one manager can take it.
    pub(crate) fn take_requests(&self) -> Option<mpsc::UnboundedReceiver<IpAddr>> {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}
