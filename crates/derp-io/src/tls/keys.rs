//! One direction's traffic keys: the AEAD key, the IV and the next record's sequence
//! number, and the nonce they give each record. Both key schedules (rustls's and the known
//! one of tests and fuzzing) end here, so this sits below them and the record layer.

use ring::aead::{
    AES_128_GCM, AES_256_GCM, Algorithm, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey,
};
use rustls::ConnectionTrafficSecrets;

/// One direction's traffic key, its IV and the next record's sequence number.
pub(super) struct Keys {
    pub(super) key: LessSafeKey,
    iv: [u8; 12],
    pub(super) seq: u64,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").field("seq", &self.seq).finish()
    }
}

impl Keys {
    /// The keys rustls handed over, if their AEAD is one this layer implements.
    pub(super) fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> Option<Self> {
        let (alg, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return None,
        };
        Self::from_parts(alg, key.as_ref(), iv.as_ref(), seq)
    }

    /// Keys for `alg` from raw key and IV bytes; `None` if their lengths are wrong.
    pub(super) fn from_parts(
        alg: &'static Algorithm,
        key: &[u8],
        iv: &[u8],
        seq: u64,
    ) -> Option<Self> {
        Some(Self {
            key: LessSafeKey::new(UnboundKey::new(alg, key).ok()?),
            iv: iv.try_into().ok()?,
            seq,
        })
    }

    /// The per-record nonce: the IV with the sequence number XORed into its last 8 bytes
    /// (RFC 8446, section 5.3).
    pub(super) fn nonce(&self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        Nonce::assume_unique_for_key(n)
    }
}
