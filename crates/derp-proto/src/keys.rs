//! Node keys (Curve25519) and the mesh pre-shared key, with the text forms Tailscale uses.
//!
//! Text forms: a public key prints as `nodekey:<64 lowercase hex>` and also has an untyped
//! 64-hex form (HTTP headers, certificate CN) and a short `[xxxxx]` log form. A secret key
//! prints as `privkey:<64 hex>`. Parsing accepts upper- and lower-case hex.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use aws_lc_rs::agreement;
use rand_core::CryptoRngCore;
use subtle::ConstantTimeEq;
use zeroize::Zeroize;

/// Length in bytes of every key type in this module.
const KEY_BYTES: usize = 32;

/// Prefix of the typed public key text form.
const NODEKEY_PREFIX: &str = "nodekey:";
/// Prefix of the typed private key text form.
const PRIVKEY_PREFIX: &str = "privkey:";

/// Errors from parsing key text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The text did not carry the prefix this key type requires.
    #[error("missing key prefix {expected:?}")]
    MissingPrefix {
        /// The prefix that was expected.
        expected: &'static str,
    },
    /// The hex part had the wrong number of digits.
    #[error("key must be 64 hex digits, got {len}")]
    WrongLength {
        /// The number of characters found.
        len: usize,
    },
    /// The hex part contained a non-hex character.
    #[error("key contains a non-hex character")]
    InvalidHex,
}

/// Decodes exactly 64 hex digits (either case) into 32 bytes.
fn decode_key_hex(text: &str) -> Result<[u8; KEY_BYTES], KeyError> {
    if text.len() != KEY_BYTES * 2 {
        return Err(KeyError::WrongLength { len: text.len() });
    }
    let mut out = [0u8; KEY_BYTES];
    hex::decode_to_slice(text, &mut out).map_err(|_| KeyError::InvalidHex)?;
    Ok(out)
}

/// A node's public key: 32 raw bytes, exactly as they travel on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    /// Wraps 32 raw key bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw key bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Reads a key from a slice that must be exactly 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }

    /// The untyped form: 64 lowercase hex digits, no prefix (used in `Derp-Public-Key`).
    pub fn to_untyped_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The log short form: `[` + the first 5 characters of the standard base64 encoding + `]`.
    pub fn short(&self) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        // Five base64 characters need 30 bits, so the first 4 bytes are enough.
        let bits = u32::from_be_bytes([self.0[0], self.0[1], self.0[2], self.0[3]]);
        let mut out = String::with_capacity(7);
        out.push('[');
        for i in 0..5 {
            let index = (bits >> (26 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[index as usize]));
        }
        out.push(']');
        out
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(NODEKEY_PREFIX)?;
        let mut buf = [0u8; KEY_BYTES * 2];
        // Cannot fail: the buffer is exactly twice the key length.
        if hex::encode_to_slice(self.0, &mut buf).is_err() {
            return Err(fmt::Error);
        }
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.short())
    }
}

impl FromStr for PublicKey {
    type Err = KeyError;

    /// Accepts `nodekey:<64 hex>` or the untyped 64-hex form, in either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex_part = s.strip_prefix(NODEKEY_PREFIX).unwrap_or(s);
        decode_key_hex(hex_part).map(Self)
    }
}

/// Applies Curve25519 clamping, as Tailscale does when it creates node keys.
const fn clamp(mut bytes: [u8; 32]) -> [u8; 32] {
    bytes[0] &= 248;
    bytes[31] = (bytes[31] & 127) | 64;
    bytes
}

/// A node's private key: 32 clamped bytes.
///
/// `Debug` never shows the key material.
#[derive(Clone)]
pub struct SecretKey(x25519_dalek::StaticSecret);

impl SecretKey {
    /// Creates a fresh random key from the caller's RNG.
    pub fn generate(rng: &mut impl CryptoRngCore) -> Self {
        let mut bytes = [0u8; 32];
        rng.fill_bytes(&mut bytes);
        Self::from_bytes(bytes)
    }

    /// Builds a key from 32 bytes, clamping them.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(x25519_dalek::StaticSecret::from(clamp(bytes)))
    }

    /// The clamped key bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0.to_bytes()
    }

    /// The matching public key: X25519(self, basepoint).
    pub fn public_key(&self) -> PublicKey {
        PublicKey(x25519_dalek::PublicKey::from(&self.0).to_bytes())
    }

    /// The typed text form `privkey:<64 lowercase hex>` (the derper config file form).
    pub fn to_text(&self) -> String {
        format!("{PRIVKEY_PREFIX}{}", hex::encode(self.0.as_bytes()))
    }

    /// The raw X25519 shared secret with `peer` (before the NaCl HSalsa20 step).
    pub fn shared_secret(&self, peer: &PublicKey) -> [u8; 32] {
        *self.diffie_hellman(peer).as_bytes()
    }

    /// X25519 with `peer`, keeping what can tell a non-contributory result.
    pub(crate) fn diffie_hellman(&self, peer: &PublicKey) -> SharedSecret {
        let shared = self
            .0
            .diffie_hellman(&x25519_dalek::PublicKey::from(peer.0));
        SharedSecret(*shared.as_bytes())
    }
}

/// The raw X25519 output between a secret key and a peer key; wiped when dropped.
pub(crate) struct SharedSecret([u8; KEY_BYTES]);

impl SharedSecret {
    pub(crate) fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// False for the all-zero output a low-order peer key forces, whatever the secret key;
    /// compared in constant time, since for an honest peer the output is secret.
    pub(crate) fn was_contributory(&self) -> bool {
        !bool::from(self.0.ct_eq(&[0u8; KEY_BYTES]))
    }
}

impl Drop for SharedSecret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

/// A secret key and its public key, derived once, ready for the X25519 of many handshakes.
///
/// Deriving a public key is an X25519 base-point multiplication, about a quarter of the CPU a
/// server handshake spends on cryptography; a server that runs one handshake per connection
/// keeps a `KeyPair` instead of deriving its public key each time. The only way to build one
/// is from the secret, so the two always match.
///
/// The pair also holds the secret in aws-lc's form, which [`KeyPair::shared_secret`] and
/// [`BoxKey::with_key_pair`](crate::crypto::BoxKey::with_key_pair) use:
/// aws-lc's X25519 (hand-written assembly using the CPU's MULX and ADX instructions) takes about
/// 24 µs on the machines the benchmarks ran on, where x25519-dalek's portable ladder takes
/// 54 µs, and that one X25519 was the largest single cost of a server handshake. Loading the
/// key into aws-lc costs as much as a handshake's X25519, so it is done here, once, and
/// shared by clones.
#[derive(Clone)]
pub struct KeyPair {
    secret: SecretKey,
    public: PublicKey,
    /// `None` only if aws-lc refused the key, which it does not for 32 bytes; the pair then
    /// uses x25519-dalek, which gives the same results.
    agreement: Option<Arc<agreement::PrivateKey>>,
}

impl KeyPair {
    /// Derives the public key of `secret`.
    pub fn new(secret: SecretKey) -> Self {
        let public = secret.public_key();
        let bytes = zeroize::Zeroizing::new(secret.to_bytes());
        let agreement = agreement::PrivateKey::from_private_key(&agreement::X25519, &*bytes)
            .ok()
            .map(Arc::new);
        Self {
            secret,
            public,
            agreement,
        }
    }

    /// The secret key.
    pub fn secret(&self) -> &SecretKey {
        &self.secret
    }

    /// The public key of [`KeyPair::secret`].
    pub fn public(&self) -> PublicKey {
        self.public
    }

    /// X25519 between this pair's secret and `peer`: the same bytes as
    /// [`SecretKey::shared_secret`], computed faster.
    pub fn shared_secret(&self, peer: &PublicKey) -> [u8; 32] {
        *self.diffie_hellman(peer).as_bytes()
    }

    pub(crate) fn diffie_hellman(&self, peer: &PublicKey) -> SharedSecret {
        let Some(key) = &self.agreement else {
            return self.secret.diffie_hellman(peer);
        };
        let peer = agreement::UnparsedPublicKey::new(&agreement::X25519, &peer.0);
        // aws-lc fails exactly where the result is all zeros (a low-order peer key; a peer
        // key is always 32 bytes), so that failure is the non-contributory result.
        agreement::agree(key, peer, (), |shared| {
            shared.try_into().map(SharedSecret).map_err(|_| ())
        })
        .unwrap_or(SharedSecret([0; KEY_BYTES]))
    }
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPair")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl FromStr for SecretKey {
    type Err = KeyError;

    /// Accepts `privkey:<64 hex>` in either case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex_part = s
            .strip_prefix(PRIVKEY_PREFIX)
            .ok_or(KeyError::MissingPrefix {
                expected: PRIVKEY_PREFIX,
            })?;
        decode_key_hex(hex_part).map(Self::from_bytes)
    }
}

/// Errors from reading a server key file (see [`SecretKey::from_key_file`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyFileError {
    /// Not a JSON object of the expected shape (includes a non-string `PrivateKey`).
    #[error("invalid JSON: {0}")]
    Json(String),
    /// The object has no `PrivateKey` member, or it is `null`.
    #[error("no PrivateKey field")]
    MissingPrivateKey,
    /// `PrivateKey` is not `privkey:<64 hex>`.
    #[error("invalid PrivateKey: {0}")]
    Key(KeyError),
}

/// The key file's JSON shape; other members are ignored, as derper does.
#[derive(serde::Deserialize)]
struct KeyFile {
    #[serde(rename = "PrivateKey")]
    private_key: Option<String>,
}

impl SecretKey {
    /// Parses a server key file in derper's format: `{"PrivateKey":"privkey:<hex>"}`.
    pub fn from_key_file(bytes: &[u8]) -> Result<Self, KeyFileError> {
        // serde also reads a struct from a JSON array (`["privkey:…"]`); derper's
        // json.Unmarshal into its config struct takes only an object, and so do we.
        let first = bytes
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        if first.is_some_and(|b| *b != b'{') {
            return Err(KeyFileError::Json("expected a JSON object".to_owned()));
        }
        let file: KeyFile =
            serde_json::from_slice(bytes).map_err(|e| KeyFileError::Json(e.to_string()))?;
        let text = file.private_key.ok_or(KeyFileError::MissingPrivateKey)?;
        text.parse().map_err(KeyFileError::Key)
    }

    /// The key file text exactly as derper writes it: tab-indented, no trailing newline.
    pub fn to_key_file(&self) -> String {
        format!("{{\n\t\"PrivateKey\": \"{}\"\n}}", self.to_text())
    }
}

/// The 32-byte pre-shared key that grants mesh privileges.
///
/// Equality is constant-time; `Debug` never shows the key.
#[derive(Clone, Copy)]
pub struct MeshKey(pub [u8; 32]);

impl MeshKey {
    /// Wraps 32 raw key bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw key bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Constant-time comparison, so a prober cannot learn the key byte by byte from timing.
    pub fn ct_eq(&self, other: &Self) -> bool {
        let diff = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// Whether every byte is zero. The zero key is "no key" and never authorizes.
    pub fn is_zero(&self) -> bool {
        self.ct_eq(&Self([0; 32]))
    }

    /// The 64 lowercase hex digit text form.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl PartialEq for MeshKey {
    fn eq(&self, other: &Self) -> bool {
        self.ct_eq(other)
    }
}

impl Eq for MeshKey {}

impl fmt::Debug for MeshKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MeshKey(<redacted>)")
    }
}

impl FromStr for MeshKey {
    type Err = KeyError;

    /// Exactly 64 hex digits (either case) after trimming surrounding whitespace.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        decode_key_hex(s.trim()).map(Self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::BoxError;

    const HEX: &str = "a5cc7c231e1ccce44f37e2fafeff3f1520fdf68d7eccd28d45e78f668ee93e29";

    #[test]
    fn public_key_parsing_accepts_typed_untyped_and_upper_case() {
        let typed: PublicKey = format!("nodekey:{HEX}").parse().unwrap();
        let untyped: PublicKey = HEX.parse().unwrap();
        let upper: PublicKey = HEX.to_uppercase().parse().unwrap();
        assert_eq!(typed, untyped);
        assert_eq!(typed, upper);
        assert_eq!(typed.to_string(), format!("nodekey:{HEX}"));
        assert_eq!(typed.to_untyped_hex(), HEX);
        assert_eq!(typed.short(), "[pcx8I]");
        assert_eq!(format!("{typed:?}"), "PublicKey([pcx8I])");
    }

    #[test]
    fn public_key_parsing_refuses_bad_text() {
        assert_eq!(
            HEX[..63].parse::<PublicKey>(),
            Err(KeyError::WrongLength { len: 63 })
        );
        assert_eq!(
            format!("{HEX}00").parse::<PublicKey>(),
            Err(KeyError::WrongLength { len: 66 })
        );
        let bad = format!("{}g", &HEX[..63]);
        assert_eq!(bad.parse::<PublicKey>(), Err(KeyError::InvalidHex));
        // A private key's prefix is not a public key's.
        assert!(format!("privkey:{HEX}").parse::<PublicKey>().is_err());
        assert!("".parse::<PublicKey>().is_err());
        // Multi-byte characters must not confuse the length check.
        assert!("é".repeat(32).parse::<PublicKey>().is_err());
    }

    #[test]
    fn public_key_from_slice_needs_exactly_32_bytes() {
        assert_eq!(PublicKey::from_slice(&[7; 32]), Some(PublicKey([7; 32])));
        assert_eq!(PublicKey::from_slice(&[7; 31]), None);
        assert_eq!(PublicKey::from_slice(&[7; 33]), None);
        assert_eq!(PublicKey::from_bytes([9; 32]).as_bytes(), &[9; 32]);
    }

    #[test]
    fn short_form_uses_standard_base64() {
        // 0xfb 0xff 0xbf... encodes as "+/+/" in standard base64 (not URL-safe "-_").
        let key = PublicKey([
            0xfb, 0xff, 0xbf, 0xfb, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0,
        ]);
        assert_eq!(key.short(), "[+/+/+]");
        assert_eq!(PublicKey([0; 32]).short(), "[AAAAA]");
    }

    #[test]
    fn secret_keys_are_clamped() {
        let secret = SecretKey::from_bytes([0xff; 32]);
        let bytes = secret.to_bytes();
        assert_eq!(bytes[0], 0xf8);
        assert_eq!(bytes[31], 0x7f);
        assert!(bytes[1..31].iter().all(|&b| b == 0xff));
        let secret = SecretKey::from_bytes([0; 32]);
        assert_eq!(secret.to_bytes()[31], 0x40);

        let mut rng = rand::thread_rng();
        for _ in 0..16 {
            let bytes = SecretKey::generate(&mut rng).to_bytes();
            assert_eq!(bytes[0] & 7, 0);
            assert_eq!(bytes[31] & 0xc0, 0x40);
        }
    }

    #[test]
    fn secret_key_text_round_trips_and_needs_prefix() {
        let secret = SecretKey::generate(&mut rand::thread_rng());
        let text = secret.to_text();
        assert!(text.starts_with("privkey:"));
        let parsed: SecretKey = text.parse().unwrap();
        assert_eq!(parsed.to_bytes(), secret.to_bytes());
        assert_eq!(parsed.public_key(), secret.public_key());
        let upper = format!("privkey:{}", text["privkey:".len()..].to_uppercase());
        assert_eq!(
            upper.parse::<SecretKey>().unwrap().to_bytes(),
            secret.to_bytes()
        );
        assert_eq!(
            text["privkey:".len()..].parse::<SecretKey>().err(),
            Some(KeyError::MissingPrefix {
                expected: "privkey:"
            })
        );
        assert!(format!("nodekey:{HEX}").parse::<SecretKey>().is_err());
    }

    #[test]
    fn key_pair_holds_the_derived_public_key() {
        let secret = SecretKey::from_bytes([0x5a; 32]);
        let pair = KeyPair::new(secret.clone());
        assert_eq!(pair.public(), secret.public_key());
        assert_eq!(pair.secret().to_bytes(), secret.to_bytes());
        let shown = format!("{pair:?}");
        assert!(
            shown.contains(&format!("{:?}", secret.public_key())),
            "{shown}"
        );
        assert!(!shown.contains(&hex::encode(secret.to_bytes())), "{shown}");
    }

    #[test]
    fn secret_key_debug_hides_the_key() {
        let secret = SecretKey::from_bytes([0x5a; 32]);
        let debug = format!("{secret:?}");
        assert!(!debug.contains("5a"), "{debug}");
        assert!(!debug.contains(&hex::encode(secret.to_bytes())));
        assert_eq!(debug, "SecretKey(<redacted>)");
    }

    /// aws-lc's X25519 (the server's, through `KeyPair`) must give x25519-dalek's answer
    /// (everyone else's, and RFC 7748's) for every 32-byte peer key.
    #[test]
    fn key_pair_x25519_matches_the_portable_one_on_any_peer_key() {
        let mut rng = rand::thread_rng();
        let check = |pair: &KeyPair, peer: [u8; 32]| {
            let fast = pair.diffie_hellman(&PublicKey(peer));
            let portable = pair.secret().diffie_hellman(&PublicKey(peer));
            assert_eq!(fast.as_bytes(), portable.as_bytes(), "peer {peer:02x?}");
            assert_eq!(
                fast.was_contributory(),
                portable.was_contributory(),
                "peer {peer:02x?}"
            );
            fast.was_contributory()
        };
        for i in 0..400u32 {
            let pair = KeyPair::new(SecretKey::generate(&mut rng));
            assert!(pair.agreement.is_some());
            let mut peer = SecretKey::generate(&mut rng).public_key().0;
            if i % 2 == 1 {
                // Any 32 bytes: about half are points of the twist rather than the curve,
                // and some are not reduced mod p.
                rand::RngCore::fill_bytes(&mut rng, &mut peer);
            }
            if i % 5 == 0 {
                peer[31] |= 0x80; // X25519 ignores the top bit
            }
            assert!(check(&pair, peer));
        }

        let pair = KeyPair::new(SecretKey::generate(&mut rng));
        // p − 1 (u = −1, on the twist), p + 2 (2, unreduced), all ones, and small u.
        let near_p = |low: u8| {
            let mut u = [0xff; 32];
            u[0] = low;
            u[31] = 0x7f;
            u
        };
        for peer in [near_p(0xec), near_p(0xef), [0xff; 32], [2; 32], [9; 32]] {
            check(&pair, peer);
        }
        for peer in derp_testkit::low_order_points() {
            assert!(!check(&pair, peer), "peer {peer:02x?}");
            assert_eq!(pair.shared_secret(&PublicKey(peer)), [0; 32]);
        }
    }

    #[test]
    fn seal_and_open_between_two_keys() {
        let mut rng = rand::thread_rng();
        let alice = SecretKey::generate(&mut rng);
        let bob = SecretKey::generate(&mut rng);
        let nonce = [3u8; 24];
        let sealed = alice.seal_to(&bob.public_key(), &nonce, b"hello");
        assert_eq!(sealed.len(), 24 + 16 + 5);
        assert_eq!(sealed[..24], nonce);
        assert_eq!(
            bob.open_from(&alice.public_key(), &sealed).unwrap(),
            b"hello"
        );
        // Both ends derive the same shared secret.
        assert_eq!(
            alice.shared_secret(&bob.public_key()),
            bob.shared_secret(&alice.public_key())
        );

        // Wrong peer, tampering anywhere, and truncation all fail.
        let eve = SecretKey::generate(&mut rng);
        assert_eq!(
            eve.open_from(&alice.public_key(), &sealed),
            Err(BoxError::Open)
        );
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x80;
            assert_eq!(
                bob.open_from(&alice.public_key(), &bad),
                Err(BoxError::Open),
                "flip at {i}"
            );
        }
        assert_eq!(
            bob.open_from(&alice.public_key(), &sealed[..39]),
            Err(BoxError::TooShort)
        );
        // An empty plaintext still carries nonce and tag.
        let empty = alice.seal_to(&bob.public_key(), &nonce, b"");
        assert_eq!(empty.len(), 40);
        assert_eq!(bob.open_from(&alice.public_key(), &empty).unwrap(), b"");
    }

    #[test]
    fn key_file_forms() {
        const PRIV: &str =
            "privkey:1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c";
        let compact = format!("{{\"PrivateKey\":\"{PRIV}\"}}");
        let indented = format!("{{\n\t\"PrivateKey\": \"{PRIV}\"\n}}");
        for form in [&compact, &indented] {
            let key = SecretKey::from_key_file(form.as_bytes()).expect("loads");
            assert_eq!(key.to_text(), PRIV);
            assert_eq!(key.to_key_file(), indented);
        }
        assert!(matches!(
            SecretKey::from_key_file(b"not json"),
            Err(KeyFileError::Json(_))
        ));
        // Found by the key_file fuzz target: serde reads a struct from an array as well.
        for not_object in [
            format!("[\"{PRIV}\"]"),
            format!(" \n[\"{PRIV}\"]"),
            "[\"\"]".into(),
        ] {
            assert_eq!(
                SecretKey::from_key_file(not_object.as_bytes()).unwrap_err(),
                KeyFileError::Json("expected a JSON object".to_owned()),
                "{not_object}"
            );
        }
        assert!(matches!(
            SecretKey::from_key_file(b""),
            Err(KeyFileError::Json(_))
        ));
        assert_eq!(
            SecretKey::from_key_file(b"{}").unwrap_err(),
            KeyFileError::MissingPrivateKey
        );
        assert_eq!(
            SecretKey::from_key_file(b"{\"PrivateKey\":\"nodekey:00\"}").unwrap_err(),
            KeyFileError::Key(KeyError::MissingPrefix {
                expected: PRIVKEY_PREFIX
            })
        );
    }

    #[test]
    fn mesh_key_parsing_trims_whitespace_and_needs_64_hex() {
        let text = "e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";
        let key: MeshKey = format!("  {text}\n").parse().unwrap();
        assert_eq!(key.to_hex(), text);
        assert_eq!(text.to_uppercase().parse::<MeshKey>().unwrap(), key);
        assert!(text[..62].parse::<MeshKey>().is_err());
        assert!(format!("{text}00").parse::<MeshKey>().is_err());
        assert!(format!("{}zz", &text[..62]).parse::<MeshKey>().is_err());
        assert!(format!("nodekey:{text}").parse::<MeshKey>().is_err());
    }

    #[test]
    fn mesh_key_comparison_and_zero() {
        let a = MeshKey::from_bytes([1; 32]);
        let mut b_bytes = [1; 32];
        assert!(a.ct_eq(&MeshKey(b_bytes)));
        b_bytes[31] = 2;
        assert!(!a.ct_eq(&MeshKey(b_bytes)));
        assert_ne!(a, MeshKey(b_bytes));
        assert!(MeshKey([0; 32]).is_zero());
        assert!(!a.is_zero());
        assert_eq!(a.as_bytes(), &[1; 32]);
        assert_eq!(format!("{a:?}"), "MeshKey(<redacted>)");
    }
}
