//! TLS for `https://` and `wss://` servers.
//!
//! What the Go client does, and so what this does:
//! - SNI is the URL's host (none for an IP literal) and no ALPN is offered.
//! - The chain is verified against Mozilla's roots (the `webpki-roots` crate) plus any roots
//!   the caller adds, unless `cert_name` says otherwise: `sha256-raw:<hex>` pins the SHA-256 of
//!   the leaf certificate (for self-signed IP-only servers), any other value is the name the
//!   certificate must be valid for instead of the URL's host.
//! - Over TLS 1.3, a certificate in the peer chain whose CN is `derpkey<64 hex>` and whose
//!   serial is a non-zero 8-bit number (the "meta certificate") carries the server's DERP key,
//!   so the client can use fast start and skip the 101 and the wait for ServerKey.

use std::sync::{Arc, OnceLock};

use derp_proto::PublicKey;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, ProtocolVersion, RootCertStore};
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::config::ClientConfig;
use crate::error::ConnectError;

/// Prefix of a `cert_name` that pins the leaf certificate's SHA-256.
pub const SHA256_RAW_PREFIX: &str = "sha256-raw:";

/// Prefix of the common name of a DERP meta certificate.
const META_CN_PREFIX: &str = "derpkey";

/// How the server's certificate is checked, from `DERPNode.CertName`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertName {
    /// Accept exactly the leaf certificate with this SHA-256 (`sha256-raw:<64 hex>`); no chain
    /// or name checks, as for a self-signed certificate.
    Pin([u8; 32]),
    /// Verify the chain as usual, but for this name instead of the URL's host (SNI still
    /// carries the URL's host).
    Name(String),
}

impl CertName {
    /// Parses a `DERPNode.CertName` value. An empty string means "no override".
    pub fn parse(s: &str) -> Result<Option<Self>, ConnectError> {
        if s.is_empty() {
            return Ok(None);
        }
        if let Some(hex_part) = s.strip_prefix(SHA256_RAW_PREFIX) {
            let mut pin = [0u8; 32];
            hex::decode_to_slice(hex_part, &mut pin).map_err(|_| {
                ConnectError::InvalidConfig("cert name sha256-raw: wants 64 hex digits")
            })?;
            return Ok(Some(Self::Pin(pin)));
        }
        ServerName::try_from(s)
            .map_err(|_| ConnectError::InvalidConfig("cert name is not a valid host name"))?;
        Ok(Some(Self::Name(s.to_owned())))
    }
}

/// The `sha256-raw:<hex>` form that pins `cert`, as a DERP map's `CertName` carries it.
pub fn cert_pin(cert: &CertificateDer<'_>) -> String {
    format!(
        "{SHA256_RAW_PREFIX}{}",
        hex::encode(Sha256::digest(cert.as_ref()))
    )
}

/// The server key carried by a DERP meta certificate in `chain`, if there is one.
///
/// This looks only at the certificates; callers must also check that the connection is TLS 1.3
/// (see [`fast_start_key`]), because fast start is never used over TLS 1.2.
pub fn meta_certificate_key(chain: &[CertificateDer<'_>]) -> Option<PublicKey> {
    chain.iter().find_map(|der| meta_key_of(der.as_ref()))
}

/// The key for fast start on an established TLS connection: present only over TLS 1.3 with a
/// meta certificate in the peer chain.
pub fn fast_start_key(conn: &rustls::ClientConnection) -> Option<PublicKey> {
    if conn.protocol_version() != Some(ProtocolVersion::TLSv1_3) {
        return None;
    }
    meta_certificate_key(conn.peer_certificates()?)
}

fn meta_key_of(der: &[u8]) -> Option<PublicKey> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    // The serial is the protocol version: it must fit in 8 bits and not be zero.
    let serial = cert.tbs_certificate.raw_serial();
    let serial = match serial {
        [v] | [0, v] => *v,
        _ => return None,
    };
    if serial == 0 {
        return None;
    }
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let hex_part = cn.strip_prefix(META_CN_PREFIX)?;
    let mut key = [0u8; 32];
    hex::decode_to_slice(hex_part, &mut key).ok()?;
    Some(PublicKey::from_bytes(key))
}

/// The crypto provider: ring, the only one compiled in.
fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// Mozilla's roots, parsed once per process.
fn webpki_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    })
}

/// Builds the rustls client config for `config`: its own `tls_config` if it has one, otherwise
/// TLS 1.2 and 1.3 with the verifier `cert_name` and `extra_roots` ask for.
///
/// With [`handshake`], for callers that dial the socket themselves (to set socket options
/// the client does not) and then hand the TLS stream to
/// [`Client::connect_stream`](crate::Client::connect_stream).
pub fn client_config(config: &ClientConfig) -> Result<Arc<rustls::ClientConfig>, ConnectError> {
    if let Some(custom) = &config.tls_config {
        return Ok(custom.clone());
    }
    build(config, false)
}

/// The rustls config for DERP over QUIC: the same verification as [`client_config`], TLS 1.3
/// only and ALPN `derp`. A caller's own `tls_config` gets that ALPN.
pub(crate) fn quic_client_config(
    config: &ClientConfig,
) -> Result<Arc<rustls::ClientConfig>, ConnectError> {
    if let Some(custom) = &config.tls_config {
        let mut tls = (**custom).clone();
        tls.alpn_protocols = vec![QUIC_ALPN.to_vec()];
        return Ok(Arc::new(tls));
    }
    build(config, true)
}

/// The ALPN protocol of DERP over QUIC.
pub const QUIC_ALPN: &[u8] = b"derp";

fn build(config: &ClientConfig, quic: bool) -> Result<Arc<rustls::ClientConfig>, ConnectError> {
    let cert_name = match &config.cert_name {
        Some(s) => CertName::parse(s)?,
        None => None,
    };
    let provider = provider();
    let verifier: Arc<dyn ServerCertVerifier> = match cert_name {
        Some(CertName::Pin(pin)) => Arc::new(PinVerifier {
            pin,
            provider: provider.clone(),
        }),
        other => {
            let mut roots = webpki_roots().clone();
            for root in &config.extra_roots {
                roots
                    .add(root.clone())
                    .map_err(|e| ConnectError::ExtraRoot {
                        source: Box::new(e),
                    })?;
            }
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| ConnectError::Verifier {
                        source: Box::new(e),
                    })?;
            match other {
                Some(CertName::Name(name)) => {
                    let name = ServerName::try_from(name).map_err(|_| {
                        ConnectError::InvalidConfig("cert name is not a valid host name")
                    })?;
                    Arc::new(NameOverrideVerifier {
                        inner: webpki,
                        name,
                    })
                }
                _ => webpki,
            }
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider);
    let builder = if quic {
        builder.with_protocol_versions(&[&rustls::version::TLS13])
    } else {
        builder.with_safe_default_protocol_versions()
    };
    let mut tls = builder
        .map_err(|e| ConnectError::TlsVersions(Box::new(e)))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    if quic {
        tls.alpn_protocols = vec![QUIC_ALPN.to_vec()];
    }
    Ok(Arc::new(tls))
}

/// Runs the TLS handshake on a connected socket, with `host` as SNI (none for an IP
/// literal). Returns the stream and, if the server showed a meta certificate over TLS 1.3,
/// its DERP key.
pub async fn handshake(
    tls: Arc<rustls::ClientConfig>,
    host: &str,
    tcp: TcpStream,
) -> Result<(TlsStream<TcpStream>, Option<PublicKey>), ConnectError> {
    let server_name = ServerName::try_from(host.to_owned())
        .map_err(|_| ConnectError::InvalidConfig("url host is not a valid tls server name"))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(server_name, tcp)
        .await
        .map_err(handshake_error)?;
    let key = fast_start_key(stream.get_ref().1);
    Ok((stream, key))
}

/// tokio-rustls reports rustls's refusals inside an `io::Error`; they are taken out so that
/// callers can tell an untrusted certificate from a reset socket.
fn handshake_error(e: std::io::Error) -> ConnectError {
    match e.downcast::<rustls::Error>() {
        Ok(tls) => ConnectError::TlsHandshake(Box::new(tls)),
        Err(io) => ConnectError::TlsIo(io),
    }
}

/// Accepts exactly one leaf certificate, by hash; handshake signatures are still checked.
#[derive(Debug)]
struct PinVerifier {
    pin: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if got == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Verifies the chain for a fixed name instead of the name the connection was made to.
#[derive(Debug)]
struct NameOverrideVerifier {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NameOverrideVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use derp_testkit::client_a_secret;

    use super::*;

    #[test]
    fn cert_names_parse_like_derp_map_values() {
        assert_eq!(CertName::parse("").unwrap(), None);
        let pin = format!("sha256-raw:{}", "ab".repeat(32));
        assert_eq!(
            CertName::parse(&pin).unwrap(),
            Some(CertName::Pin([0xab; 32]))
        );
        // A pin with too few digits, too many, or digits that are not hex is refused as a
        // pin, never taken for a host name.
        for bad in [
            "sha256-raw:abc".to_owned(),
            format!("sha256-raw:{}", "ab".repeat(33)),
            format!("sha256-raw:{}", "zz".repeat(32)),
            "sha256-raw:".to_owned(),
        ] {
            assert!(
                matches!(
                    CertName::parse(&bad),
                    Err(ConnectError::InvalidConfig(
                        "cert name sha256-raw: wants 64 hex digits"
                    ))
                ),
                "{bad}: {:?}",
                CertName::parse(&bad)
            );
        }
        assert_eq!(
            CertName::parse("derp.example.com").unwrap(),
            Some(CertName::Name("derp.example.com".into()))
        );
        assert!(matches!(
            CertName::parse("bad name"),
            Err(ConnectError::InvalidConfig(
                "cert name is not a valid host name"
            ))
        ));
    }

    /// A pin accepts the one certificate it names and refuses any other as a certificate
    /// the application rejected, whatever its chain or names.
    #[test]
    fn a_pin_accepts_its_certificate_and_refuses_others_by_that_reason() {
        let pinned = cert("derp.example.com", &[1]);
        let other = cert("derp.example.com", &[1]);
        let verifier = PinVerifier {
            pin: Sha256::digest(pinned.as_ref()).into(),
            provider: provider(),
        };
        let name = ServerName::try_from("derp.example.com").expect("name");
        let check = |leaf: &CertificateDer<'_>| {
            verifier.verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
        };
        assert!(check(&pinned).is_ok());
        assert!(
            matches!(
                check(&other),
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::ApplicationVerificationFailure
                ))
            ),
            "{:?}",
            check(&other).err()
        );
    }

    fn cert(cn: &str, serial: &[u8]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.serial_number = Some(rcgen::SerialNumber::from_slice(serial));
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn meta_certificate_rules_match_go() {
        let key = PublicKey::from_bytes([0x5a; 32]);
        let cn = format!("derpkey{}", key.to_untyped_hex());
        let leaf = cert("derp.example.com", &[7]);
        // Found anywhere in the chain.
        assert_eq!(
            meta_certificate_key(&[leaf.clone(), cert(&cn, &[2])]),
            Some(key)
        );
        assert_eq!(meta_certificate_key(&[cert(&cn, &[255])]), Some(key));
        // Serial zero or wider than 8 bits: not a meta certificate.
        assert_eq!(meta_certificate_key(&[cert(&cn, &[0])]), None);
        assert_eq!(meta_certificate_key(&[cert(&cn, &[1, 0])]), None);
        // CN that is not derpkey + 64 hex digits.
        assert_eq!(meta_certificate_key(&[cert("derpkeyzz", &[2])]), None);
        assert_eq!(meta_certificate_key(&[cert(&cn[..70], &[2])]), None);
        assert_eq!(meta_certificate_key(&[leaf]), None);
    }

    #[test]
    fn pins_are_sha256_of_the_der() {
        let der = CertificateDer::from(b"not really a certificate".to_vec());
        let pin = cert_pin(&der);
        assert_eq!(
            CertName::parse(&pin).unwrap(),
            Some(CertName::Pin(Sha256::digest(der.as_ref()).into()))
        );
    }

    #[test]
    fn an_extra_root_that_does_not_parse_is_refused_with_rustls_reason() {
        let config = ClientConfig::new("https://derp.example.com/derp", client_a_secret())
            .unwrap()
            .with_extra_root(CertificateDer::from(b"not a certificate".to_vec()));
        let err = client_config(&config).unwrap_err();
        assert!(
            matches!(
                &err,
                ConnectError::ExtraRoot { source }
                    if matches!(
                        **source,
                        rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
                    )
            ),
            "{err:?}"
        );
        assert!(std::error::Error::source(&err).is_some());
        assert!(
            err.to_string().starts_with("tls: extra root rejected: "),
            "{err}"
        );
    }

    #[test]
    fn garbage_is_not_a_meta_certificate() {
        assert_eq!(meta_key_of(b""), None);
        assert_eq!(meta_key_of(&[0x30, 0x82, 0xff, 0xff, 0x01]), None);
        assert_eq!(
            meta_certificate_key(&[CertificateDer::from(vec![0u8; 100])]),
            None
        );
    }
}
