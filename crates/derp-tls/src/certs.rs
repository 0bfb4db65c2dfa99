//! Certificates from files: PEM loading, hostname checks, the self-signed IP certificate, and
//! manual mode with reloading.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::TlsError;
use super::front::{CertInfo, CertOrigin, TlsFront};
use super::temp_files::{remove_stale_temps, temp_path};
use super::x509::{Host, check_valid_for};

/// Parses every `CERTIFICATE` block of a PEM file, leaf first.
pub fn load_certs_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsError::PemCertificates)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    Ok(certs)
}

/// Parses the first private key (PKCS#8, PKCS#1 or SEC1) of a PEM file.
pub fn load_key_pem(pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(TlsError::PemKey)
}

/// The `sha256-raw:<hex>` pin of a certificate: what a DERP map's `CertName` carries for a
/// self-signed server.
pub fn cert_pin(cert: &CertificateDer<'_>) -> String {
    format!("sha256-raw:{}", hex::encode(Sha256::digest(cert.as_ref())))
}

/// The file-name form of a hostname, as derper builds it: only `[A-Za-z0-9.-]` are kept.
pub fn sanitize_hostname(hostname: &str) -> String {
    hostname
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
        .collect()
}

/// Generates a self-signed ECDSA P-256 certificate for an IP address, valid for a year.
/// Returns the certificate and key as PEM.
pub fn generate_self_signed(ip: IpAddr) -> Result<(String, String), TlsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = self_signed_for_key(ip, &key)?;
    Ok((cert, key.serialize_pem()))
}

/// A self-signed certificate for `ip` with an existing key, valid for a year, as PEM.
fn self_signed_for_key(ip: IpAddr, key: &KeyPair) -> Result<String, TlsError> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, ip.to_string());
    params
        .distinguished_name
        .push(DnType::OrganizationName, "derpd self-signed");
    params.subject_alt_names = vec![SanType::IpAddress(ip)];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(365);
    let cert = params.self_signed(key)?;
    Ok(cert.pem())
}

/// Writes `data` to `path` through a temporary file and a rename, so a reader never sees half
/// a file; `private` files get mode 0600.
pub(crate) fn write_atomic(path: &Path, data: &[u8], private: bool) -> Result<(), TlsError> {
    let err = |source| TlsError::File {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    // A stale temporary file from a crash may exist with looser permissions; remove it so the
    // new one is created (with the mode below) rather than reused. Those of processes that
    // were killed mid-write go too.
    let tmp = temp_path(path, std::process::id());
    let _ = std::fs::remove_file(&tmp);
    remove_stale_temps(path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let result = (|| {
        let mut file = options.open(&tmp)?;
        file.write_all(data)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        // Make the rename itself durable, so a power loss cannot empty the cache.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(err)
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::File {
        path: path.to_owned(),
        source,
    })
}

/// What [`ManualCerts::load_or_generate`] reports when it generated a self-signed certificate.
#[derive(Debug, Clone)]
pub struct SelfSigned {
    /// `sha256-raw:<hex>`, the value for the DERP map node's `CertName`.
    pub pin: String,
    /// Where the certificate was written.
    pub cert_path: PathBuf,
    /// Where the key was written.
    pub key_path: PathBuf,
}

/// What [`ManualCerts::check`] found.
#[derive(Debug, Clone)]
pub enum ManualCheck {
    /// The files hold a usable pair for the hostname; this is it.
    Loaded(CertInfo),
    /// Both files are missing and the hostname is this IP: a start would generate a
    /// self-signed certificate for it.
    WouldGenerate(IpAddr),
}

/// Manual certificate mode: `<certdir>/<hostname>.crt` and `.key`, reloaded when they change.
///
/// A reload swaps the certificate for new handshakes only; established connections keep the
/// session they negotiated. A bad pair on disk (unreadable, key not matching, wrong host) is
/// logged and the previous certificate stays in service.
#[derive(Debug)]
pub struct ManualCerts {
    front: TlsFront,
    cert_path: PathBuf,
    key_path: PathBuf,
    /// The file contents last installed, to tell whether a reload changes anything.
    loaded: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
}

impl ManualCerts {
    /// Manual mode for `front`'s hostname with files in `certdir`.
    pub fn new(front: TlsFront, certdir: &Path) -> Self {
        let base = sanitize_hostname(&front.hostname().to_string());
        Self {
            cert_path: certdir.join(format!("{base}.crt")),
            key_path: certdir.join(format!("{base}.key")),
            front,
            loaded: Mutex::new(None),
        }
    }

    /// The certificate file this mode reads.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// The key file this mode reads.
    pub fn key_path(&self) -> &Path {
        &self.key_path
    }

    /// Loads the files, or, when the hostname is an IP address and both are missing, writes a
    /// new self-signed certificate first and returns its pin. Fails if the files are missing
    /// for a DNS hostname or do not hold a usable pair for the hostname.
    ///
    /// The key is written before the certificate, so a write that fails (a full disk) or a
    /// process killed between the two leaves a key without a certificate, never the reverse.
    /// For an IP hostname that state is completed on the next start: a certificate is made
    /// for the key already on disk, so the key is never replaced.
    pub fn load_or_generate(&self) -> Result<Option<SelfSigned>, TlsError> {
        let mut generated = None;
        if let Some(ip) = self.would_generate()? {
            let cert_pem = if self.key_path.exists() {
                warn!(key = %self.key_path.display(), "certificate missing next to the key (an interrupted write?); making a self-signed one for that key");
                self_signed_for_key(ip, &self.existing_key()?)?
            } else {
                let (cert_pem, key_pem) = generate_self_signed(ip)?;
                write_atomic(&self.key_path, key_pem.as_bytes(), true)?;
                cert_pem
            };
            write_atomic(&self.cert_path, cert_pem.as_bytes(), false)?;
            let leaf = load_certs_pem(cert_pem.as_bytes())?.remove(0);
            generated = Some(SelfSigned {
                pin: cert_pin(&leaf),
                cert_path: self.cert_path.clone(),
                key_path: self.key_path.clone(),
            });
        }
        self.install_from_disk(true)?;
        Ok(generated)
    }

    /// What [`ManualCerts::load_or_generate`] would do, without writing anything: load and
    /// check the files (putting them into service on this front only), or report that a
    /// self-signed certificate would be generated. Fails where it would fail.
    pub fn check(&self) -> Result<ManualCheck, TlsError> {
        if let Some(ip) = self.would_generate()? {
            return Ok(ManualCheck::WouldGenerate(ip));
        }
        self.install_from_disk(true)?;
        Ok(ManualCheck::Loaded(
            self.front.cert_updates().borrow().clone(),
        ))
    }

    /// The IP address to generate a self-signed certificate for: the hostname is an IP and
    /// the certificate is missing, with its key missing too or left alone by an interrupted
    /// write.
    /// A key that cannot sign is an error here, where it is clearer than the missing
    /// certificate.
    fn would_generate(&self) -> Result<Option<IpAddr>, TlsError> {
        let Host::Ip(ip) = self.front.hostname() else {
            return Ok(None);
        };
        if self.cert_path.exists() {
            return Ok(None);
        }
        if self.key_path.exists() {
            self.existing_key()?;
        }
        Ok(Some(*ip))
    }

    /// The key on disk, to make a certificate for.
    fn existing_key(&self) -> Result<KeyPair, TlsError> {
        let key_pem = read(&self.key_path)?;
        KeyPair::from_pem(&String::from_utf8_lossy(&key_pem)).map_err(|source| {
            TlsError::KeyCannotSign {
                path: self.key_path.clone(),
                source,
            }
        })
    }

    /// Re-reads the files and installs them if their contents changed. Returns whether a new
    /// certificate went into service.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        self.install_from_disk(false)
    }

    /// Checks the files every `interval` until `shutdown`, installing changed ones. Errors are
    /// logged once per distinct error and the old certificate is kept.
    pub async fn watch(&self, interval: Duration, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut last_error = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.reload_if_changed() {
                Ok(_) => last_error = None,
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_ref() != Some(&text) {
                        warn!(error = %text, "manual certificate reload failed; keeping the old one");
                        last_error = Some(text);
                    }
                }
            }
        }
    }

    fn install_from_disk(&self, first: bool) -> Result<bool, TlsError> {
        // Held across read, compare and install, so a poll and a SIGHUP reload racing each
        // other cannot install the older of two reads last.
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let cert_pem = read(&self.cert_path)?;
        let key_pem = read(&self.key_path)?;
        if let Some((c, k)) = loaded.as_ref()
            && *c == cert_pem
            && *k == key_pem
        {
            return Ok(false);
        }
        // A file caught mid-write ends in a partial block, which the PEM reader would skip
        // silently, serving a truncated chain; wait for the next reload instead.
        for (path, pem) in [(&self.cert_path, &cert_pem), (&self.key_path, &key_pem)] {
            if !ends_with_complete_block(pem) {
                return Err(TlsError::IncompletePem {
                    path: path.to_path_buf(),
                });
            }
        }
        let chain = load_certs_pem(&cert_pem)?;
        let key = load_key_pem(&key_pem)?;
        check_valid_for(&chain[0], self.front.hostname())?;
        let self_signed = is_self_signed(&chain[0]);
        let origin = if self_signed {
            CertOrigin::SelfSigned
        } else {
            CertOrigin::Manual
        };
        let info = self.front.install(chain, key, origin)?;
        *loaded = Some((cert_pem, key_pem));
        info!(
            cert = %self.cert_path.display(),
            pin = %info.pin(),
            self_signed,
            reload = !first,
            "manual certificate in service"
        );
        Ok(true)
    }
}

/// Whether nothing but whitespace follows the last `-----END …-----` line.
fn ends_with_complete_block(pem: &[u8]) -> bool {
    let text = String::from_utf8_lossy(pem);
    let Some(end) = text.rfind("-----END ") else {
        return false;
    };
    let rest = &text[end + "-----END ".len()..];
    match rest.find("-----") {
        Some(close) => rest[close + 5..].trim().is_empty(),
        None => false,
    }
}

fn is_self_signed(leaf: &CertificateDer<'_>) -> bool {
    x509_parser::parse_x509_certificate(leaf.as_ref())
        .map(|(_, c)| c.subject() == c.issuer())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x509::validity;

    #[test]
    fn files_caught_mid_write_are_not_installed() {
        let (cert_pem, _) = generate_self_signed("127.0.0.1".parse().unwrap()).unwrap();
        assert!(ends_with_complete_block(cert_pem.as_bytes()));
        assert!(ends_with_complete_block(
            format!("{cert_pem}\n\n").as_bytes()
        ));
        let partial_second = format!("{cert_pem}-----BEGI");
        assert!(!ends_with_complete_block(partial_second.as_bytes()));
        let cut = &cert_pem[..cert_pem.len() - 10];
        assert!(!ends_with_complete_block(cut.as_bytes()));
        assert!(!ends_with_complete_block(b""));
    }

    #[test]
    fn hostnames_sanitize_like_derper() {
        assert_eq!(sanitize_hostname("derp.example.com"), "derp.example.com");
        assert_eq!(sanitize_hostname("../etc/passwd"), "..etcpasswd");
        assert_eq!(sanitize_hostname("2001:db8::1"), "2001db81");
        assert_eq!(sanitize_hostname("a_b c"), "abc");
    }

    #[test]
    fn self_signed_ip_certificate_is_valid_for_its_ip_only() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let (cert_pem, key_pem) = generate_self_signed(ip).unwrap();
        let chain = load_certs_pem(cert_pem.as_bytes()).unwrap();
        load_key_pem(key_pem.as_bytes()).unwrap();
        assert_eq!(chain.len(), 1);
        check_valid_for(&chain[0], &Host::Ip(ip)).unwrap();
        let err = check_valid_for(&chain[0], &Host::Ip("127.0.0.2".parse().unwrap())).unwrap_err();
        assert!(
            matches!(
                &err,
                TlsError::WrongHost { hostname, source: webpki::Error::CertNotValidForName(_) }
                    if hostname == "127.0.0.2"
            ),
            "{err:?}"
        );
        assert!(check_valid_for(&chain[0], &Host::Dns("localhost".into())).is_err());
        assert!(is_self_signed(&chain[0]));
        let (from, until) = validity(&chain[0]).unwrap();
        let days = until.duration_since(from).unwrap().as_secs() / 86400;
        assert_eq!(days, 365);
        let pin = cert_pin(&chain[0]);
        assert_eq!(pin.len(), "sha256-raw:".len() + 64);
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("derp-tls-certs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn ip_front() -> TlsFront {
        let registry = prometheus::Registry::new();
        let key = derp_proto::SecretKey::from_bytes([3; 32]).public_key();
        TlsFront::new(&key, crate::TlsOptions::new("127.0.0.1"), &registry).unwrap()
    }

    #[test]
    fn a_key_left_without_its_certificate_gets_one_and_is_kept() {
        let dir = temp_dir("key-only");
        let first = ManualCerts::new(ip_front(), &dir);
        let made = first.load_or_generate().unwrap().expect("generated");
        let key_pem = std::fs::read(first.key_path()).unwrap();
        // What a write cut off between the key and the certificate leaves behind.
        std::fs::remove_file(first.cert_path()).unwrap();

        let again = ManualCerts::new(ip_front(), &dir);
        let remade = again
            .load_or_generate()
            .unwrap()
            .expect("certificate made again");
        assert_eq!(
            std::fs::read(again.key_path()).unwrap(),
            key_pem,
            "key replaced"
        );
        assert_ne!(remade.pin, made.pin);
        let chain = load_certs_pem(&std::fs::read(again.cert_path()).unwrap()).unwrap();
        assert_eq!(cert_pin(&chain[0]), remade.pin);
        // The pair matches: installing it checks the key against the certificate.
        let served = again.front.cert_updates().borrow().clone();
        assert_eq!(served.pin(), remade.pin);

        // A key that cannot sign is an error, and nothing is written.
        std::fs::remove_file(again.cert_path()).unwrap();
        std::fs::write(again.key_path(), b"not a key").unwrap();
        let err = ManualCerts::new(ip_front(), &dir)
            .load_or_generate()
            .unwrap_err();
        assert!(err.to_string().contains("cannot sign"), "{err}");
        assert!(
            matches!(&err, TlsError::KeyCannotSign { path, .. } if path == again.key_path()),
            "{err:?}"
        );
        assert!(!again.cert_path().exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pem_errors_are_reported() {
        assert!(matches!(load_certs_pem(b""), Err(TlsError::NoCertificate)));
        assert!(matches!(
            load_certs_pem(b"-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n"),
            Err(TlsError::PemCertificates(_))
        ));
        assert!(matches!(
            load_key_pem(b"nothing here"),
            Err(TlsError::PemKey(_))
        ));
    }
}
