//! NaCl box (X25519, HSalsa20, XSalsa20-Poly1305) in the layout DERP uses:
//! nonce(24) || tag(16) || ciphertext, i.e. libsodium's `crypto_box_easy` output with the
//! nonce in front.
//!
//! The box is built in two steps, as NaCl's `crypto_box_beforenm` does: X25519 gives the
//! shared secret, HSalsa20 turns it into the secretbox key. Keeping the steps apart lets a
//! server see the shared secret it already computed and refuse a peer key that forces it to
//! zero (see [`BoxKey::is_contributory`]) without a second Diffie-Hellman.

use crypto_secretbox::XSalsa20Poly1305;
use crypto_secretbox::aead::generic_array::GenericArray;
use crypto_secretbox::aead::{AeadInPlace, KeyInit};

use crate::keys::{KeyPair, PublicKey, SecretKey, SharedSecret};

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

/// The precomputed box state between one secret key and one peer key.
///
/// Both directions use the same key, so one `BoxKey` opens what the peer sealed and seals
/// what the peer opens. The key material is wiped when it is dropped.
#[derive(Clone)]
pub struct BoxKey {
    cipher: XSalsa20Poly1305,
    contributory: bool,
}

impl std::fmt::Debug for BoxKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoxKey")
            .field("contributory", &self.contributory)
            .finish_non_exhaustive()
    }
}

impl BoxKey {
    /// Runs X25519 between `secret` and `peer` and derives the box key from the result.
    pub fn new(secret: &SecretKey, peer: &PublicKey) -> Self {
        Self::from_shared(&secret.diffie_hellman(peer))
    }

    /// The same box key as [`BoxKey::new`] with the pair's secret, computed the faster way
    /// [`KeyPair`] keeps ready: what a server uses once per handshake.
    pub fn with_key_pair(keys: &KeyPair, peer: &PublicKey) -> Self {
        Self::from_shared(&keys.diffie_hellman(peer))
    }

    fn from_shared(shared: &SharedSecret) -> Self {
        // Checked in constant time: for an honest peer the shared secret is secret.
        let contributory = shared.was_contributory();
        let key = salsa20::hsalsa::<salsa20::cipher::consts::U10>(
            GenericArray::from_slice(shared.as_bytes()),
            &GenericArray::default(),
        );
        Self {
            cipher: XSalsa20Poly1305::new(&key),
            contributory,
        }
    }

    /// Whether the peer key contributed to the shared secret. A low-order peer key (one of
    /// the handful of points of small order, in any of their encodings) makes X25519 output
    /// all zeros whatever the secret key is, so anyone can seal and open boxes "from" that
    /// key without holding a private key for it.
    pub fn is_contributory(&self) -> bool {
        self.contributory
    }

    /// Seals `plaintext`; returns nonce || tag || ciphertext.
    pub fn seal(&self, nonce: &[u8; NONCE_LEN], plaintext: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(BOX_OVERHEAD + plaintext.len());
        out.extend_from_slice(nonce);
        out.extend_from_slice(&[0u8; TAG_LEN]);
        out.extend_from_slice(plaintext);
        let (head, body) = out.split_at_mut(BOX_OVERHEAD);
        let tag = self
            .cipher
            .encrypt_in_place_detached(GenericArray::from_slice(nonce), b"", body);
        match tag {
            Ok(tag) => head[NONCE_LEN..].copy_from_slice(&tag),
            // Unreachable: encryption only fails for non-empty associated data (we pass none)
            // or a message longer than the XSalsa20 keystream (2^70 bytes), which no slice can
            // be. Zeroing the output still guarantees the box can never open.
            Err(_) => out.iter_mut().for_each(|b| *b = 0),
        }
        out
    }

    /// Opens a box (nonce || tag || ciphertext).
    pub fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, BoxError> {
        if sealed.len() < BOX_OVERHEAD {
            return Err(BoxError::TooShort);
        }
        let (nonce, rest) = sealed.split_at(NONCE_LEN);
        let (tag, ciphertext) = rest.split_at(TAG_LEN);
        let mut plaintext = ciphertext.to_vec();
        self.cipher
            .decrypt_in_place_detached(
                GenericArray::from_slice(nonce),
                b"",
                &mut plaintext,
                GenericArray::from_slice(tag),
            )
            .map_err(|_| BoxError::Open)?;
        Ok(plaintext)
    }
}

/// Seals `plaintext` from `secret` to `peer`; returns nonce || tag || ciphertext.
pub fn seal(secret: &SecretKey, peer: &PublicKey, nonce: &[u8; 24], plaintext: &[u8]) -> Vec<u8> {
    BoxKey::new(secret, peer).seal(nonce, plaintext)
}

/// Opens a box (nonce || tag || ciphertext) that `peer` sealed to `secret`.
pub fn open(secret: &SecretKey, peer: &PublicKey, sealed: &[u8]) -> Result<Vec<u8>, BoxError> {
    if sealed.len() < BOX_OVERHEAD {
        return Err(BoxError::TooShort);
    }
    BoxKey::new(secret, peer).open(sealed)
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
