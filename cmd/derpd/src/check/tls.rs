//! `--check`'s certificate step: the certificates a start would serve, loaded or planned
//! as the start would, and how long each has left.

use std::time::{Duration, SystemTime};

use derp_proto::SecretKey;
use derp_tls::{AcmeManager, CertInfo, ManualCerts, ManualCheck, TlsFront, TlsOptions};

use super::{Report, creatable};
use crate::cli::Cli;
use crate::tls_setup::CertMode;

/// Certificates closer than this to expiry are reported as a warning.
const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 86_400);

pub(super) fn check_tls(cli: &Cli, key: &SecretKey, listen_port: u16, r: &mut Report) {
    let args = &cli.tls;
    // The front only holds certificates in memory; its metrics go to a throwaway registry.
    let front = match TlsFront::new(
        &key.public_key(),
        TlsOptions::new(args.hostname.clone()),
        &prometheus::Registry::new(),
    ) {
        Ok(front) => front,
        Err(e) => {
            r.error("tls", format!("--hostname {:?}: {e}", args.hostname));
            return;
        }
    };
    let certdir = match args.certdir() {
        Ok(dir) => dir,
        Err(e) => {
            r.error("tls", e);
            return;
        }
    };
    match args.certmode {
        CertMode::Manual => {
            let manual = ManualCerts::new(front, &certdir);
            match manual.check() {
                Ok(ManualCheck::Loaded(info)) => {
                    cert_expiry(&info, &manual.cert_path().display().to_string(), r);
                }
                Ok(ManualCheck::WouldGenerate(ip)) => match creatable(manual.cert_path()) {
                    Ok(()) => r.ok(
                        "tls",
                        format!(
                            "no certificate in {}: would generate a self-signed one for {ip} \
                             and print its CertName pin",
                            certdir.display()
                        ),
                    ),
                    Err(why) => r.error(
                        "tls",
                        format!("would generate a certificate for {ip} but cannot: {why}"),
                    ),
                },
                Err(e) => r.error(
                    "tls",
                    format!(
                        "manual certificate ({} and {}): {e}",
                        manual.cert_path().display(),
                        manual.key_path().display()
                    ),
                ),
            }
        }
        CertMode::Letsencrypt | CertMode::Gcp => {
            let extras = crate::acme_extras(cli);
            let config = match crate::tls_setup::acme_config(args, &extras, &certdir, listen_port) {
                Ok(config) => config,
                Err(e) => {
                    r.error("tls", e);
                    return;
                }
            };
            if let Some(eab) = &config.external_account {
                r.ok(
                    "acme",
                    format!(
                        "a new account at {} is bound with EAB key ID {:?}",
                        config.directory_url, eab.key_id
                    ),
                );
            }
            if extras.ip_certs {
                r.ok(
                    "acme",
                    format!(
                        "certificates for the node's IP addresses on demand from {} (HTTP-01 \
                         on the port-80 listener; cached in {})",
                        config.directory_url,
                        certdir.display()
                    ),
                );
                if crate::tls_setup::hostname_is_ip(&args.hostname) {
                    return;
                }
            }
            let directory = config.directory_url.clone();
            let challenges = config
                .challenges
                .iter()
                .map(|c| match c {
                    derp_tls::ChallengeKind::TlsAlpn01 => "tls-alpn-01",
                    derp_tls::ChallengeKind::Http01 => "http-01",
                })
                .collect::<Vec<_>>()
                .join(", ");
            let manager = match AcmeManager::new(front, config) {
                Ok(m) => m,
                Err(e) => {
                    r.error("tls", format!("acme: {e}"));
                    return;
                }
            };
            match manager.load_cached() {
                Ok(Some(info)) => {
                    cert_expiry(&info, &manager.cert_path().display().to_string(), r);
                    r.ok(
                        "acme",
                        format!("renews from {} (challenges {challenges})", directory),
                    );
                }
                Ok(None) => r.ok(
                    "acme",
                    format!(
                        "no cached certificate in {}: would order one from {} \
                         (challenges {challenges}); not ready until it is issued",
                        certdir.display(),
                        directory
                    ),
                ),
                Err(e) => r.warn(
                    "acme",
                    format!(
                        "the cached certificate {} is unusable and would be replaced: {e}",
                        manager.cert_path().display()
                    ),
                ),
            }
            if args.acme_email.is_none() {
                r.warn(
                    "acme",
                    "no --acme-email: the CA cannot warn you about expiry or revocation",
                );
            }
        }
    }
}

/// Reports a certificate that would be served: an error when it has expired (every client
/// would refuse it), a warning when it expires soon.
fn cert_expiry(info: &CertInfo, path: &str, r: &mut Report) {
    let now = SystemTime::now();
    let Some(not_after) = info.not_after else {
        r.ok(
            "tls",
            format!("{path}: {:?}, pin {}", info.origin, info.pin()),
        );
        return;
    };
    let what = format!(
        "{path}: valid until {} ({:?}, pin {})",
        utc_date(not_after),
        info.origin,
        info.pin()
    );
    match not_after.duration_since(now) {
        Err(_) => r.error("tls", format!("{what}: expired")),
        Ok(left) if left < EXPIRY_WARNING => r.warn(
            "tls",
            format!("{what}: expires in {} days", left.as_secs() / 86_400),
        ),
        Ok(_) => r.ok("tls", what),
    }
    if info.not_before.is_some_and(|t| t > now) {
        r.error("tls", format!("{path}: not valid yet"));
    }
}

/// `YYYY-MM-DD` in UTC (days to civil date, after Howard Hinnant's algorithm).
fn utc_date(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        let at = |secs: u64| utc_date(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "1970-01-01");
        assert_eq!(at(951_782_400), "2000-02-29");
        assert_eq!(at(1_798_761_599), "2026-12-31");
        assert_eq!(at(4_102_444_800), "2100-01-01");
    }
}
