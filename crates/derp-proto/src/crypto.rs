//! NaCl box (X25519, HSalsa20, XSalsa20-Poly1305) in the layout DERP uses:
//! nonce(24) || tag(16) || ciphertext, i.e. libsodium's `crypto_box_easy` output with the
//! nonce in front.

use crypto_box::aead::AeadInPlace;
use crypto_box::aead::generic_array::GenericArray;

use crate::keys::{PublicKey, SecretKey};

/// Length of a box nonce.
pub const NONCE_LEN: usize = 24;
/// Length of the Poly1305 tag.
pub const TAG_LEN: usize = 16;
/// Bytes a sealed box adds to its plaintext: nonce plus tag.
pub const BOX_OVERHEAD: usize = NONCE_LEN + TAG_LEN;

/// Errors from opening a box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BoxError {
    /// Shorter than nonce plus tag, so it cannot be a box.
    #[error("sealed box too short")]
    TooShort,
    /// Authentication failed: wrong key, or the box was altered.
    #[error("failed to open box")]
    Open,
}

fn salsa_box(secret: &SecretKey, peer: &PublicKey) -> crypto_box::SalsaBox {
    crypto_box::SalsaBox::new(
        &crypto_box::PublicKey::from(*peer.as_bytes()),
        &crypto_box::SecretKey::from(secret.to_bytes()),
    )
}

/// Seals `plaintext` from `secret` to `peer`; returns nonce || tag || ciphertext.
pub fn seal(secret: &SecretKey, peer: &PublicKey, nonce: &[u8; 24], plaintext: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(BOX_OVERHEAD + plaintext.len());
    out.extend_from_slice(nonce);
    out.extend_from_slice(&[0u8; TAG_LEN]);
    out.extend_from_slice(plaintext);
    let (head, body) = out.split_at_mut(BOX_OVERHEAD);
    let tag = salsa_box(secret, peer).encrypt_in_place_detached(
        GenericArray::from_slice(nonce),
        b"",
        body,
    );
    match tag {
        Ok(tag) => head[NONCE_LEN..].copy_from_slice(&tag),
        // Unreachable: encryption only fails for non-empty associated data (we pass none) or
        // a message longer than the XSalsa20 keystream (2^70 bytes), which no slice can be.
        // Zeroing the output still guarantees the box can never open.
        Err(_) => out.iter_mut().for_each(|b| *b = 0),
    }
    out
}

/// Opens a box (nonce || tag || ciphertext) that `peer` sealed to `secret`.
pub fn open(secret: &SecretKey, peer: &PublicKey, sealed: &[u8]) -> Result<Vec<u8>, BoxError> {
    if sealed.len() < BOX_OVERHEAD {
        return Err(BoxError::TooShort);
    }
    let (nonce, rest) = sealed.split_at(NONCE_LEN);
    let (tag, ciphertext) = rest.split_at(TAG_LEN);
    let mut plaintext = ciphertext.to_vec();
    salsa_box(secret, peer)
        .decrypt_in_place_detached(
            GenericArray::from_slice(nonce),
            b"",
            &mut plaintext,
            GenericArray::from_slice(tag),
        )
        .map_err(|_| BoxError::Open)?;
    Ok(plaintext)
}

/// The box operations as methods of the key that seals or opens.
impl SecretKey {
    /// Seals `plaintext` to `peer` with NaCl box; returns nonce(24) || tag(16) || ciphertext.
    pub fn seal_to(&self, peer: &PublicKey, nonce: &[u8; 24], plaintext: &[u8]) -> Vec<u8> {
        seal(self, peer, nonce, plaintext)
    }

    /// Opens a NaCl box (nonce || tag || ciphertext) that `peer` sealed to this key.
    pub fn open_from(&self, peer: &PublicKey, sealed: &[u8]) -> Result<Vec<u8>, BoxError> {
        open(self, peer, sealed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_nonce_then_tag_then_ciphertext() {
        let a = SecretKey::from_bytes([1; 32]);
        let b = SecretKey::from_bytes([2; 32]);
        let nonce = [9; NONCE_LEN];
        let sealed = seal(&a, &b.public_key(), &nonce, b"payload");
        assert_eq!(sealed.len(), BOX_OVERHEAD + 7);
        assert_eq!(sealed[..NONCE_LEN], nonce);
        // Same key pair and nonce give the same box from either side's view.
        assert_eq!(sealed, seal(&a, &b.public_key(), &nonce, b"payload"));
        assert_eq!(open(&b, &a.public_key(), &sealed).unwrap(), b"payload");
        // The tag covers the ciphertext: truncating the ciphertext fails authentication.
        assert_eq!(
            open(&b, &a.public_key(), &sealed[..sealed.len() - 1]),
            Err(BoxError::Open)
        );
        // A different nonce gives a different ciphertext.
        let other = seal(&a, &b.public_key(), &[8; NONCE_LEN], b"payload");
        assert_ne!(sealed[NONCE_LEN..], other[NONCE_LEN..]);
    }
}
