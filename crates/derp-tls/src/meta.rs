//! The DERP meta certificate: a throwaway self-signed certificate appended to the served chain
//! that carries the server's DERP public key, so a TLS 1.3 client can skip the 101 and the wait
//! for ServerKey (fast start).

use derp_proto::PublicKey;
use rcgen::{CertificateParams, CustomExtension, DistinguishedName, DnType, KeyPair, SerialNumber};
use rustls::pki_types::CertificateDer;
use time::{Duration, OffsetDateTime};

use super::TlsError;

/// Builds the meta certificate for `server_key`, as derper's `initMetacert` does:
/// - a fresh ed25519 key (nothing is ever signed with it);
/// - serial number = DERP protocol version (2);
/// - subject CN = `derpkey` + 64 lowercase hex digits of the key;
/// - valid from 30 days ago to 30 days ahead;
/// - exactly one extension: BasicConstraints, critical, CA false.
pub fn meta_certificate(server_key: &PublicKey) -> Result<CertificateDer<'static>, TlsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("derpkey{}", server_key.to_untyped_hex()),
    );
    params.serial_number = Some(SerialNumber::from_slice(&[
        derp_proto::frame::PROTOCOL_VERSION,
    ]));
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(30);
    params.not_after = now + Duration::days(30);
    // rcgen's own BasicConstraints support adds a SubjectKeyIdentifier as well; Go clients do
    // not care, but the reference certificate has exactly one extension, so write it by hand:
    // an empty SEQUENCE is "cA = FALSE, no path length".
    let mut basic_constraints =
        CustomExtension::from_oid_content(BASIC_CONSTRAINTS_OID, vec![0x30, 0x00]);
    basic_constraints.set_criticality(true);
    params.custom_extensions = vec![basic_constraints];
    Ok(params.self_signed(&key)?.der().clone())
}

const BASIC_CONSTRAINTS_OID: &[u64] = &[2, 5, 29, 19];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_certificate_matches_the_reference_shape() {
        let key = PublicKey::from_bytes([0x42; 32]);
        let der = meta_certificate(&key).unwrap();
        let (rest, cert) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
        assert!(rest.is_empty());
        assert_eq!(cert.tbs_certificate.raw_serial(), &[2]);
        let cn = cert
            .subject()
            .iter_common_name()
            .next()
            .unwrap()
            .as_str()
            .unwrap();
        assert_eq!(cn, format!("derpkey{}", "42".repeat(32)));
        assert_eq!(cert.subject(), cert.issuer());
        let exts = cert.extensions();
        assert_eq!(exts.len(), 1, "{exts:?}");
        assert_eq!(exts[0].oid.to_id_string(), "2.5.29.19");
        assert!(exts[0].critical);
        let bc = cert.basic_constraints().unwrap().unwrap().value;
        assert!(!bc.ca);
        assert_eq!(bc.path_len_constraint, None);
        let validity = cert.validity();
        let span = validity.not_after.timestamp() - validity.not_before.timestamp();
        assert_eq!(span, 60 * 24 * 3600);
        assert_eq!(
            cert.public_key().algorithm.algorithm.to_id_string(),
            "1.3.101.112",
            "ed25519"
        );
    }
}
