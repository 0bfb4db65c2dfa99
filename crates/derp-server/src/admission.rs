//! Admission control: who may use the relay.
//!
//! The relay asks each configured [`Admission`] check, in order, about every client that
//! completes the handshake (mesh peers excepted), before the client is registered. The checks
//! themselves (an HTTP admission server, the local tailscaled, a key list) live outside this
//! crate, so the relay library carries no HTTP client or Unix-socket code it does not need;
//! `derp-admission` has derpd's.

use std::fmt;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use derp_proto::PublicKey;

/// The client an admission check is asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AdmissionRequest {
    /// The node key the client proved it holds (it opened the handshake's box with it).
    pub key: PublicKey,
    /// The address the connection came from (IPv4-mapped IPv6 addresses are given as IPv4).
    pub source: IpAddr,
}

/// Why a client was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// Short, fixed label for `derp_admission_refused{reason}`: keep the set of values small.
    pub reason: &'static str,
    /// What happened, for the debug log.
    pub detail: String,
}

impl Refused {
    /// A refusal with `reason` as its metric label.
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

/// What a check decided.
pub type Verdict = Result<(), Refused>;

/// The future a check returns.
pub type VerdictFuture<'a> = Pin<Box<dyn Future<Output = Verdict> + Send + 'a>>;

/// One admission check. Runs on the connecting client's own task, so a slow check delays
/// only that client; the relay also bounds it by the handshake deadline.
pub trait Admission: Send + Sync + fmt::Debug {
    /// Decides whether `client` may use the relay.
    fn check(&self, client: AdmissionRequest) -> VerdictFuture<'_>;
}

/// Reason label used when the checks together took longer than the handshake deadline.
pub const REFUSED_TIMEOUT: &str = "timeout";
