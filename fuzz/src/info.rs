//! ClientInfo and ServerInfo JSON decoding (both parsers on the same input).
//!
//! - A decoded value encodes to JSON that decodes back to the same value, and encoding is
//!   stable (encode ∘ decode ∘ encode = encode).
//! - A ClientInfo never carries the zero mesh key.
//! - Against serde_json as a reference: input serde_json reads as an object or `null` is never
//!   a syntax or not-an-object error; any other JSON value is refused as not an object.

use derp_proto::{ClientInfo, InfoError, ServerInfo};
use serde_json::Value;

/// Fuzz target.
pub fn info_json(data: &[u8]) {
    let client = ClientInfo::from_json(data);
    let server = ServerInfo::from_json(data);

    if let Ok(info) = &client {
        assert!(
            info.mesh_key.is_none_or(|k| !k.is_zero()),
            "zero mesh key kept"
        );
        let json = info.to_json();
        assert_eq!(
            ClientInfo::from_json(&json).as_ref(),
            Ok(info),
            "ClientInfo round trip"
        );
        let reparsed: Value = serde_json::from_slice(&json).expect("ClientInfo JSON is valid");
        assert!(reparsed.is_object());
        assert!(reparsed.get("CanAckPings").is_some_and(Value::is_boolean));
    }
    if let Ok(info) = &server {
        let json = info.to_json();
        assert_eq!(
            ServerInfo::from_json(&json).as_ref(),
            Ok(info),
            "ServerInfo round trip"
        );
        assert!(
            serde_json::from_slice::<Value>(&json).is_ok_and(|v| v.is_object()),
            "ServerInfo JSON is valid"
        );
    }

    // Go (and derp-proto) read invalid UTF-8 inside strings as U+FFFD; do the same before
    // asking serde_json.
    let text = String::from_utf8_lossy(data);
    if let Ok(value) = serde_json::from_str::<Value>(&text) {
        for (name, result) in [
            ("ClientInfo", client.as_ref().err()),
            ("ServerInfo", server.as_ref().err()),
        ] {
            let Some(err) = result else {
                assert!(
                    value.is_object() || value.is_null(),
                    "{name} accepted non-object JSON {value}"
                );
                continue;
            };
            if value.is_object() || value.is_null() {
                assert!(
                    !matches!(err, InfoError::Syntax | InfoError::NotObject),
                    "{name} refused valid JSON object with {err:?}"
                );
            } else {
                assert_eq!(*err, InfoError::NotObject, "{name} on {value}");
            }
        }
    }
}
