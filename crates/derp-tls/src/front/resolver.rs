//! The rustls server configs the front serves, and the resolver that picks each handshake's
//! certificate: the hostname's, an ACME validation certificate, or one of the node's own
//! IP addresses'.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{Acceptor, ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::debug;

use super::{ACME_TLS_ALPN, TlsRecords};
use crate::TlsError;
use crate::x509::Host;

/// Certificates the resolver can hand out; shared with the rustls configs.
#[derive(Debug)]
pub(super) struct CertState {
    pub(super) host: Host,
    pub(super) current: ArcSwapOption<CertifiedKey>,
    /// TLS-ALPN-01 validation certificates, by lowercase hostname.
    pub(super) alpn_challenges: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

#[derive(Debug)]
pub(super) struct Resolver {
    pub(super) certs: Arc<CertState>,
    /// Answer TLS-ALPN-01 validation handshakes (the TCP listener only: ACME validates over
    /// TCP, and QUIC's ALPN is `derp` alone).
    pub(super) acme: bool,
    /// For connections to one of the node's addresses, with IP certificates on: that
    /// address and its certificate, served to clients that name no host (or the address).
    pub(super) ip: Option<(IpAddr, Arc<ArcSwapOption<CertifiedKey>>)>,
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let sni = hello.server_name();
        if self.acme && offers_alpn(&hello, ACME_TLS_ALPN) {
            let name = sni?.trim_end_matches('.').to_ascii_lowercase();
            let challenges = self
                .certs
                .alpn_challenges
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            return challenges.get(&name).cloned();
        }
        if let Some((ip, cert)) = &self.ip {
            match sni.map(|name| name.trim_start_matches('[').trim_end_matches(']')) {
                None => return cert.load_full(),
                Some(name) => match name.parse::<IpAddr>() {
                    Ok(named) if named.to_canonical() == *ip => return cert.load_full(),
                    Ok(named) => {
                        debug!(%named, %ip, "refusing a certificate for another address");
                        return None;
                    }
                    // A DNS name: the hostname's certificate, if there is one.
                    Err(_) if matches!(self.certs.host, Host::Ip(_)) => {
                        debug!(sni, "this node has IP address certificates only");
                        return None;
                    }
                    Err(_) => {}
                },
            }
        }
        if !self.certs.host.accepts_sni(sni) {
            debug!(sni, "refusing tls handshake for another name");
            return None;
        }
        self.certs.current.load_full()
    }
}

pub(super) fn offers_alpn(hello: &ClientHello<'_>, proto: &[u8]) -> bool {
    hello
        .alpn()
        .is_some_and(|mut offered| offered.any(|p| p == proto))
}

/// A rustls server config with `resolver` choosing the certificate.
pub(super) fn server_config(
    provider: &Arc<CryptoProvider>,
    resolver: Resolver,
    alpn: &[&[u8]],
    quic: bool,
    records: TlsRecords,
) -> Result<Arc<ServerConfig>, TlsError> {
    let versions: &[&rustls::SupportedProtocolVersion] = if quic {
        &[&rustls::version::TLS13]
    } else {
        &[&rustls::version::TLS13, &rustls::version::TLS12]
    };
    let mut config = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // TLS 1.3 connections hand their traffic keys to derpd's record layer, and their traffic
    // secrets, caught through the key log, for the key schedule it runs.
    if !quic && records == TlsRecords::Derpd {
        derp_io::tls::configure(&mut config);
    }
    Ok(Arc::new(config))
}

/// The server name a ClientHello asks for, read by rustls's acceptor from a copy of the
/// bytes (derp-io's reader does not keep it). `None` when there is none or it cannot be
/// read.
pub(super) fn sni_of(received: &[u8]) -> Option<String> {
    let mut acceptor = Acceptor::default();
    let mut rest = received;
    while !rest.is_empty() {
        acceptor.read_tls(&mut rest).ok()?;
    }
    let accepted = acceptor.accept().ok()??;
    accepted.client_hello().server_name().map(str::to_owned)
}

/// `base` with only the TLS 1.3 suites derpd's record layer seals and opens
/// ([`derp_io::tls::SUPPORTED_SUITES`]): another provider, or a new suite in this one, cannot
/// make a handshake settle on a suite whose records nothing here can open. TLS 1.2 suites
/// are rustls's to serve and stay as they are.
pub(super) fn serving_provider(mut base: CryptoProvider) -> CryptoProvider {
    base.cipher_suites
        .retain(|s| s.tls13().is_none() || derp_io::tls::supports(s.suite()));
    base
}
