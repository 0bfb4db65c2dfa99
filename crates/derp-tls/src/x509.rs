//! What a certificate is for and when: hostname parsing and the checks the front and the
//! certificate sources both apply to a leaf certificate.

use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rustls::pki_types::{CertificateDer, ServerName};

use super::TlsError;

/// A hostname, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Host {
    /// Lowercase, without a trailing dot.
    Dns(String),
    Ip(IpAddr),
}

impl Host {
    pub(crate) fn parse(s: &str) -> Result<Self, TlsError> {
        let bare = s.strip_prefix('[').and_then(|r| r.strip_suffix(']'));
        if let Ok(ip) = bare.unwrap_or(s).parse::<IpAddr>() {
            return Ok(Self::Ip(ip));
        }
        let name = s.trim_end_matches('.').to_ascii_lowercase();
        let valid = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if valid {
            Ok(Self::Dns(name))
        } else {
            Err(TlsError::InvalidHostname(s.to_owned()))
        }
    }

    /// Whether a ClientHello with this SNI may get the server's certificate.
    pub(crate) fn accepts_sni(&self, sni: Option<&str>) -> bool {
        match self {
            Self::Ip(_) => true,
            Self::Dns(name) => {
                sni.is_some_and(|s| s.trim_end_matches('.').eq_ignore_ascii_case(name))
            }
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dns(name) => f.write_str(name),
            Self::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Checks that `leaf` is valid for `host` (DNS name or IP SAN). Expiry is not checked here.
pub(crate) fn check_valid_for(leaf: &CertificateDer<'_>, host: &Host) -> Result<(), TlsError> {
    let wrong = |source| TlsError::WrongHost {
        hostname: host.to_string(),
        source,
    };
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(wrong)?;
    let name = match host {
        Host::Dns(name) => ServerName::try_from(name.clone())
            .map_err(|_| TlsError::InvalidHostname(name.clone()))?,
        Host::Ip(ip) => ServerName::IpAddress((*ip).into()),
    };
    cert.verify_is_valid_for_subject_name(&name).map_err(wrong)
}

/// The validity window of a certificate, or `None` if it does not parse.
pub(crate) fn validity(leaf: &CertificateDer<'_>) -> Option<(SystemTime, SystemTime)> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    let at = |t: i64| {
        let secs = u64::try_from(t).ok()?;
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
    };
    Some((
        at(cert.validity().not_before.timestamp())?,
        at(cert.validity().not_after.timestamp())?,
    ))
}
