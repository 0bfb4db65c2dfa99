//! RFC 8446's key schedule for application traffic, run here from the traffic secrets: the
//! key and IV a traffic secret yields and the secret a KeyUpdate moves to (sections 7.2 and
//! 7.3). Every connection whose secrets were captured at its handshake keeps each
//! direction's current secret in that direction's half and updates it here, so the halves
//! need no lock for a key update and a half's state can be copied out whole (a rustls key
//! schedule has no export); tests and fuzz targets open and seal records under secrets they
//! know with the same code.

use ring::aead::{AES_128_GCM, AES_256_GCM, Algorithm, CHACHA20_POLY1305};
use ring::hkdf;
use rustls::CipherSuite;
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use super::keys::Keys;

/// A TLS 1.3 suite of [`SUPPORTED_SUITES`](super::SUPPORTED_SUITES).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// TLS_AES_128_GCM_SHA256.
    Aes128Gcm,
    /// TLS_AES_256_GCM_SHA384.
    Aes256Gcm,
    /// TLS_CHACHA20_POLY1305_SHA256.
    Chacha20Poly1305,
}

impl Suite {
    /// Every suite, in [`SUPPORTED_SUITES`](super::SUPPORTED_SUITES)'s order.
    pub const ALL: [Self; 3] = [Self::Aes128Gcm, Self::Aes256Gcm, Self::Chacha20Poly1305];

    /// The suite's IANA name in rustls.
    pub fn cipher_suite(self) -> CipherSuite {
        match self {
            Self::Aes128Gcm => CipherSuite::TLS13_AES_128_GCM_SHA256,
            Self::Aes256Gcm => CipherSuite::TLS13_AES_256_GCM_SHA384,
            Self::Chacha20Poly1305 => CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
        }
    }

    /// The suite named `suite`, if it is one of these.
    pub fn from_cipher_suite(suite: CipherSuite) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.cipher_suite() == suite)
    }

    /// The suite's AEAD in ring.
    pub fn aead(self) -> &'static Algorithm {
        match self {
            Self::Aes128Gcm => &AES_128_GCM,
            Self::Aes256Gcm => &AES_256_GCM,
            Self::Chacha20Poly1305 => &CHACHA20_POLY1305,
        }
    }

    /// The length of its traffic secrets: its hash's output.
    pub fn secret_len(self) -> usize {
        match self {
            Self::Aes256Gcm => 48,
            Self::Aes128Gcm | Self::Chacha20Poly1305 => 32,
        }
    }

    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            Self::Aes256Gcm => hkdf::HKDF_SHA384,
            Self::Aes128Gcm | Self::Chacha20Poly1305 => hkdf::HKDF_SHA256,
        }
    }
}

/// One direction's application traffic secret. Zeroed when dropped; its `Debug` shows the
/// suite alone.
#[derive(Clone, PartialEq, Eq)]
pub struct TrafficSecret {
    suite: Suite,
    secret: [u8; 48],
}

impl Drop for TrafficSecret {
    fn drop(&mut self) {
        self.secret.zeroize();
    }
}

impl ZeroizeOnDrop for TrafficSecret {}

impl std::fmt::Debug for TrafficSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrafficSecret")
            .field("suite", &self.suite)
            .finish_non_exhaustive()
    }
}

impl TrafficSecret {
    /// The secret `bytes` of `suite`; `None` unless it has the suite's hash length.
    pub fn new(suite: Suite, bytes: &[u8]) -> Option<Self> {
        if bytes.len() != suite.secret_len() {
            return None;
        }
        let mut secret = [0; 48];
        secret[..bytes.len()].copy_from_slice(bytes);
        Some(Self { suite, secret })
    }

    /// The suite.
    pub fn suite(&self) -> Suite {
        self.suite
    }

    /// The secret's bytes (the suite's hash length).
    pub(super) fn as_bytes(&self) -> &[u8] {
        &self.secret[..self.suite.secret_len()]
    }

    /// The record key: HKDF-Expand-Label(secret, "key", "", key length).
    pub fn key(&self) -> Zeroizing<Vec<u8>> {
        let mut key = Zeroizing::new(vec![0; self.suite.aead().key_len()]);
        self.expand_label(b"key", &mut key);
        key
    }

    /// The record IV: HKDF-Expand-Label(secret, "iv", "", 12).
    pub fn iv(&self) -> [u8; 12] {
        let mut iv = [0; 12];
        self.expand_label(b"iv", &mut iv);
        iv
    }

    /// The secret after a KeyUpdate: HKDF-Expand-Label(secret, "traffic upd", "", hash
    /// length).
    pub fn next(&self) -> Self {
        let mut next = Self {
            suite: self.suite,
            secret: [0; 48],
        };
        self.expand_label(b"traffic upd", &mut next.secret[..self.suite.secret_len()]);
        next
    }

    /// The record layer's keys for this secret, starting at sequence number `seq`.
    pub(super) fn keys(&self, seq: u64) -> Keys {
        Keys::from_parts(self.suite.aead(), &self.key(), &self.iv(), seq)
            .unwrap_or_else(|| unreachable!("key and IV lengths come from the suite"))
    }

    fn expand_label(&self, label: &[u8], out: &mut [u8]) {
        // HkdfLabel (RFC 8446, section 7.1): length, "tls13 " + label, an empty context.
        let [hi, lo] = u16::try_from(out.len())
            .unwrap_or_else(|_| unreachable!("outputs are under 64 bytes"))
            .to_be_bytes();
        let label_len =
            u8::try_from(6 + label.len()).unwrap_or_else(|_| unreachable!("labels are short"));
        let info: [&[u8]; 5] = [&[hi, lo], &[label_len], b"tls13 ", label, &[0]];
        let prk =
            hkdf::Prk::new_less_safe(self.suite.hkdf(), &self.secret[..self.suite.secret_len()]);
        prk.expand(&info, Len(out.len()))
            .and_then(|okm| okm.fill(out))
            .unwrap_or_else(|_| unreachable!("outputs are far below HKDF's limit"));
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}
