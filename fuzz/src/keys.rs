//! Key text forms and derper's key file.

use base64::Engine as _;
use derp_proto::{KeyFileError, MeshKey, PublicKey, SecretKey};
use serde::de::IgnoredAny;
use serde_json::Value;

/// 64 ASCII hex digits, either case: the only hex part every key parser accepts.
fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Parses the input (lossily, if not UTF-8) as each key type; the raw bytes, if 32 or more,
/// also make a public key.
///
/// - Each parser accepts exactly its documented form (checked with an independent predicate):
///   public `[nodekey:]<64 hex>`, private `privkey:<64 hex>`, mesh `<64 hex>` after trimming.
/// - Printing a parsed key gives the lowercase canonical form of the input, which parses back
///   to the same key; private keys come out clamped.
/// - `short()` is `[` + the first five standard-base64 characters of the key + `]`.
pub fn key_text(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let s: &str = &text;

    let hex_part = s.strip_prefix("nodekey:").unwrap_or(s);
    match s.parse::<PublicKey>() {
        Ok(key) => {
            assert!(is_hex64(hex_part), "accepted public key {s:?}");
            let canonical = hex_part.to_ascii_lowercase();
            assert_eq!(key.to_string(), format!("nodekey:{canonical}"));
            assert_eq!(key.to_untyped_hex(), canonical);
            assert_eq!(key.to_string().parse::<PublicKey>(), Ok(key));
            assert_eq!(key.to_untyped_hex().parse::<PublicKey>(), Ok(key));
        }
        Err(e) => assert!(!is_hex64(hex_part), "refused public key {s:?}: {e}"),
    }

    match (s.parse::<SecretKey>(), s.strip_prefix("privkey:")) {
        (Ok(key), Some(hex_part)) => {
            assert!(is_hex64(hex_part), "accepted private key {s:?}");
            let mut raw = [0u8; 32];
            hex::decode_to_slice(hex_part, &mut raw).expect("checked hex");
            raw[0] &= 248;
            raw[31] = (raw[31] & 127) | 64;
            assert_eq!(
                key.to_bytes(),
                raw,
                "private key not clamped as Curve25519 needs"
            );
            assert_eq!(key.to_text(), format!("privkey:{}", hex::encode(raw)));
            let again: SecretKey = key.to_text().parse().expect("printed private key parses");
            assert_eq!(again.to_bytes(), raw);
        }
        (Ok(_), None) => panic!("accepted private key without prefix {s:?}"),
        (Err(e), hex_part) => assert!(
            !hex_part.is_some_and(is_hex64),
            "refused private key {s:?}: {e}"
        ),
    }

    match s.parse::<MeshKey>() {
        Ok(key) => {
            assert!(is_hex64(s.trim()), "accepted mesh key {s:?}");
            assert_eq!(key.to_hex(), s.trim().to_ascii_lowercase());
            assert_eq!(key.to_hex().parse::<MeshKey>(), Ok(key));
            assert_eq!(key.is_zero(), key.as_bytes() == &[0; 32]);
        }
        Err(e) => assert!(!is_hex64(s.trim()), "refused mesh key {s:?}: {e}"),
    }

    assert_eq!(PublicKey::from_slice(data).is_some(), data.len() == 32);
    if let Some(raw) = data.get(..32) {
        let key = PublicKey::from_slice(raw).expect("32 bytes");
        assert_eq!(key.to_string().parse::<PublicKey>(), Ok(key));
        let b64 = base64::engine::general_purpose::STANDARD.encode(raw);
        assert_eq!(key.short(), format!("[{}]", &b64[..5]));
    }
}

/// derper's key file, `{"PrivateKey":"privkey:<hex>"}`, as [`SecretKey::from_key_file`] reads
/// it for derpd.
///
/// - An accepted file is a JSON object (as Go's `json.Unmarshal` into derper's config struct
///   requires) whose `PrivateKey` member is a string holding the key's text form.
/// - The file derpd writes for that key reads back as the same key.
/// - Refusals are classified right: syntax errors as JSON errors, a missing key as such.
pub fn key_file(data: &[u8]) {
    let result = SecretKey::from_key_file(data);
    // serde_json skips an ignored member's string without checking its UTF-8 (Go reads
    // invalid UTF-8 as U+FFFD), so the reference reads the input the same lossy way.
    let text = String::from_utf8_lossy(data);
    let value = serde_json::from_str::<Value>(&text);
    // Whether the text is JSON at all. `Value` also refuses numbers beyond f64's range,
    // which an ignored member may hold (Go skips it unconverted, and so does derpd), so
    // syntax is judged by skipping the whole value instead.
    let syntax_ok = serde_json::from_str::<IgnoredAny>(&text).is_ok();
    if value.is_ok() {
        assert!(syntax_ok, "Value read what IgnoredAny refused");
    }
    match &result {
        Ok(key) if value.is_err() => {
            // Valid JSON that Value cannot hold: only the round trip can be checked.
            assert!(syntax_ok, "accepted a key file that is not JSON");
            let written = key.to_key_file();
            let again = SecretKey::from_key_file(written.as_bytes()).expect("written file reads");
            assert_eq!(again.to_bytes(), key.to_bytes());
        }
        Ok(key) => {
            let Ok(Value::Object(map)) = &value else {
                panic!("accepted a key file that is not a JSON object: {value:?}");
            };
            let Some(Value::String(text)) = map.get("PrivateKey") else {
                panic!("accepted a key file without a PrivateKey string");
            };
            let named: SecretKey = text.parse().expect("accepted key text parses");
            assert_eq!(named.to_bytes(), key.to_bytes());
            let written = key.to_key_file();
            let again = SecretKey::from_key_file(written.as_bytes()).expect("written file reads");
            assert_eq!(again.to_bytes(), key.to_bytes());
        }
        Err(KeyFileError::MissingPrivateKey) => {
            if let Ok(Value::Object(map)) = &value {
                assert!(
                    map.get("PrivateKey").is_none_or(Value::is_null),
                    "PrivateKey present but reported missing"
                );
            }
        }
        Err(KeyFileError::Key(_)) if value.is_err() => {
            assert!(syntax_ok, "key error for a file that is not JSON");
        }
        Err(KeyFileError::Key(_)) => {
            let Ok(Value::Object(map)) = &value else {
                panic!("key error for a file that is not a JSON object");
            };
            assert!(
                map.get("PrivateKey").is_some_and(Value::is_string),
                "key error without a PrivateKey string"
            );
        }
        Err(KeyFileError::Json(_)) => {}
    }
    if !syntax_ok {
        assert!(
            matches!(result, Err(KeyFileError::Json(_))),
            "invalid JSON gave {result:?}"
        );
    }
}
