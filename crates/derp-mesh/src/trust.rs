//! Which certificates `https` mesh links trust: the system's store, as derper's Go TLS stack
//! does (including `SSL_CERT_FILE` and `SSL_CERT_DIR`), plus any private CA the operator
//! names. When the system store is empty or missing, Mozilla's roots stand in for it, as
//! Tailscale's dialer falls back to roots built into the binary.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;

/// What went into a trust store, for the startup log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrustSummary {
    /// Roots taken from the system store (or `SSL_CERT_FILE`/`SSL_CERT_DIR`).
    pub system: usize,
    /// System entries that could not be used.
    pub system_rejected: usize,
    /// Whether Mozilla's roots were used because the system store gave none.
    pub fallback: bool,
    /// Roots from the caller (`--mesh-ca-file`).
    pub extra: usize,
}

/// Why a trust store could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// A certificate given by the caller is not a usable root.
    #[error("CA certificate {index} is not usable as a root: {reason}")]
    BadRoot {
        /// Its position in the list (from 0).
        index: usize,
        /// What rustls said about it.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("tls configuration: {0}")]
    Config(String),
}

/// A rustls client configuration for mesh links trusting the system's roots and `extra`.
pub fn mesh_tls_config(
    extra: &[CertificateDer<'static>],
) -> Result<(Arc<rustls::ClientConfig>, TrustSummary), TrustError> {
    let mut roots = RootCertStore::empty();
    let mut summary = TrustSummary::default();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        if roots.add(cert).is_ok() {
            summary.system += 1;
        } else {
            summary.system_rejected += 1;
        }
    }
    if summary.system == 0 {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        summary.fallback = true;
    }
    for (index, cert) in extra.iter().enumerate() {
        roots.add(cert.clone()).map_err(|e| TrustError::BadRoot {
            index,
            reason: e.to_string(),
        })?;
        summary.extra += 1;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TrustError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((Arc::new(config), summary))
}
