//! The JSON bodies sealed inside the handshake boxes: [`ClientInfo`] and [`ServerInfo`].
//!
//! Encoding produces exactly the bytes Go's `encoding/json` produces for the reference structs
//! (field order, omission rules, HTML-safe string escaping). Decoding follows Go's
//! `json.Unmarshal` into those structs: keys match case-insensitively (an exact match wins),
//! unknown keys are ignored, `null` leaves a field unchanged, and wrong value types, trailing
//! data and malformed JSON are refused.

use serde::Deserialize;
use serde::de::{MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::keys::MeshKey;

/// Errors from decoding a ClientInfo or ServerInfo JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InfoError {
    /// Not well-formed JSON, or data after the top-level value.
    #[error("malformed JSON")]
    Syntax,
    /// Well-formed JSON whose top-level value is not an object (or `null`).
    #[error("JSON body is not an object")]
    NotObject,
    /// A known field held a value of the wrong JSON type or out of range.
    #[error("wrong JSON type for field {field}")]
    WrongType {
        /// The field's JSON name.
        field: &'static str,
    },
    /// `meshKey` was not a string of 64 hex digits (this includes `null` and `""`).
    #[error("invalid mesh key")]
    InvalidMeshKey,
}

/// What a client tells the server about itself, sealed inside the ClientInfo frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientInfo {
    /// Mesh pre-shared key; `None` for ordinary clients. A zero key decodes as `None`.
    pub mesh_key: Option<MeshKey>,
    /// Protocol version the client was built with (the server ignores it).
    pub version: i64,
    /// The client answers server pings with pongs.
    pub can_ack_pings: bool,
    /// The client is a monitoring prober.
    pub is_prober: bool,
    /// Opaque application name, for stats.
    pub app_name: String,
}

const CLIENT_FIELDS: [&str; 5] = ["meshKey", "version", "CanAckPings", "IsProber", "AppName"];

impl ClientInfo {
    /// Encodes as Go does: `meshKey` (omitted if absent or zero), `version` (omitted if 0),
    /// `CanAckPings` (always), `IsProber` (omitted if false), `AppName` (omitted if empty).
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.app_name.len());
        let mut obj = JsonObject::new(&mut out);
        if let Some(key) = self.mesh_key.as_ref().filter(|k| !k.is_zero()) {
            obj.key("meshKey").push(b'"');
            obj.out.extend_from_slice(key.to_hex().as_bytes());
            obj.out.push(b'"');
        }
        if self.version != 0 {
            obj.key("version")
                .extend_from_slice(self.version.to_string().as_bytes());
        }
        obj.key("CanAckPings")
            .extend_from_slice(bool_text(self.can_ack_pings));
        if self.is_prober {
            obj.key("IsProber").extend_from_slice(b"true");
        }
        if !self.app_name.is_empty() {
            write_go_string(obj.key("AppName"), &self.app_name);
        }
        obj.finish();
        out
    }

    /// Decodes with Go's rules (see the module docs). `{}` and `null` give the default value.
    pub fn from_json(json: &[u8]) -> Result<Self, InfoError> {
        let mut info = Self::default();
        for_each_field(json, &CLIENT_FIELDS, |index, raw| {
            match index {
                0 => info.mesh_key = Some(parse_mesh_key(raw)?).filter(|k| !k.is_zero()),
                1 => set_if_some(&mut info.version, parse_int(raw, CLIENT_FIELDS[1])?),
                2 => set_if_some(&mut info.can_ack_pings, parse_bool(raw, CLIENT_FIELDS[2])?),
                3 => set_if_some(&mut info.is_prober, parse_bool(raw, CLIENT_FIELDS[3])?),
                _ => set_if_some(&mut info.app_name, parse_string(raw, CLIENT_FIELDS[4])?),
            }
            Ok(())
        })?;
        Ok(info)
    }
}

/// What the server tells the client, sealed inside the ServerInfo frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerInfo {
    /// Server protocol version (the reference server sends 2).
    pub version: i64,
    /// Advisory client send rate in bytes per second; 0 means unlimited.
    pub token_bucket_bytes_per_second: i64,
    /// Advisory burst for the send rate.
    pub token_bucket_bytes_burst: i64,
}

const SERVER_FIELDS: [&str; 3] = [
    "version",
    "TokenBucketBytesPerSecond",
    "TokenBucketBytesBurst",
];

impl ServerInfo {
    /// [`ServerInfo::default_server`] encoded, for a server that sends it on every handshake.
    pub const DEFAULT_SERVER_JSON: &'static [u8] = br#"{"version":2}"#;

    /// What the reference server sends: version 2 and no rate advice.
    pub const fn default_server() -> Self {
        Self {
            version: crate::frame::PROTOCOL_VERSION as i64,
            token_bucket_bytes_per_second: 0,
            token_bucket_bytes_burst: 0,
        }
    }

    /// Encodes as Go does, omitting zero fields; the reference form is exactly `{"version":2}`.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(80);
        let mut obj = JsonObject::new(&mut out);
        let values = [
            self.version,
            self.token_bucket_bytes_per_second,
            self.token_bucket_bytes_burst,
        ];
        for (name, value) in SERVER_FIELDS.iter().zip(values) {
            if value != 0 {
                obj.key(name)
                    .extend_from_slice(value.to_string().as_bytes());
            }
        }
        obj.finish();
        out
    }

    /// Decodes with Go's rules (see the module docs).
    pub fn from_json(json: &[u8]) -> Result<Self, InfoError> {
        let mut info = Self::default();
        for_each_field(json, &SERVER_FIELDS, |index, raw| {
            let value = parse_int(raw, SERVER_FIELDS[index])?;
            let slot = match index {
                0 => &mut info.version,
                1 => &mut info.token_bucket_bytes_per_second,
                _ => &mut info.token_bucket_bytes_burst,
            };
            set_if_some(slot, value);
            Ok(())
        })?;
        Ok(info)
    }
}

fn set_if_some<T>(slot: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *slot = value;
    }
}

fn bool_text(value: bool) -> &'static [u8] {
    if value { b"true" } else { b"false" }
}

/// Writes `{`, comma-separated `"key":` prefixes, and `}`.
struct JsonObject<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl<'a> JsonObject<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        out.push(b'{');
        Self { out, first: true }
    }

    /// Starts a member and returns the buffer to write its value into.
    fn key(&mut self, name: &str) -> &mut Vec<u8> {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        self.out.push(b'"');
        self.out.extend_from_slice(name.as_bytes());
        self.out.extend_from_slice(b"\":");
        self.out
    }

    fn finish(self) {
        self.out.push(b'}');
    }
}

/// Writes a JSON string the way Go's `json.Marshal` does, including its HTML-safe escapes of
/// `<`, `>`, `&` and the U+2028/U+2029 line separators.
fn write_go_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\u{0}'..='\u{1f}' | '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let code = u32::from(c);
                out.extend_from_slice(b"\\u");
                for shift in [12, 8, 4, 0] {
                    out.push(HEX[((code >> shift) & 0xf) as usize]);
                }
            }
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// The members of the top-level object, in input order, with their raw (validated) values.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(MembersVisitor)
    }
}

struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Members<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    /// Go's `json.Unmarshal` of a top-level `null` into a struct is a successful no-op.
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Members(Vec::new()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::new();
        while let Some(MemberName(key)) = map.next_key()? {
            let value: &'de RawValue = map.next_value()?;
            members.push((key, value));
        }
        Ok(Members(members))
    }
}

/// A member name. Read as raw bytes because Go accepts lone surrogate escapes (`"\ud800"`)
/// in names, which serde_json refuses when it decodes to `str`; such a name can never match a
/// field, so a lossy conversion is enough.
struct MemberName(String);

impl<'de> Deserialize<'de> for MemberName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_bytes(MemberNameVisitor)
    }
}

struct MemberNameVisitor;

impl Visitor<'_> for MemberNameVisitor {
    type Value = MemberName;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object member name")
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Ok(MemberName(String::from_utf8_lossy(v).into_owned()))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(MemberName(v.to_owned()))
    }
}

/// Parses `json` as an object and calls `apply` for every member whose key names one of
/// `fields` (by index), in input order so later duplicates win as in Go.
fn for_each_field(
    json: &[u8],
    fields: &[&'static str],
    mut apply: impl FnMut(usize, &str) -> Result<(), InfoError>,
) -> Result<(), InfoError> {
    // Go replaces invalid UTF-8 inside strings with U+FFFD instead of failing; outside strings
    // any non-ASCII byte is a syntax error either way, so a lossy conversion changes nothing else.
    let text = String::from_utf8_lossy(json);
    let members: Members<'_> = serde_json::from_str(&text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => InfoError::NotObject,
        _ => InfoError::Syntax,
    })?;
    for (key, raw) in &members.0 {
        if let Some(index) = match_field(key, fields) {
            apply(index, raw.get())?;
        }
    }
    Ok(())
}

/// Go's rule: an exact name match wins, otherwise a case-insensitive one.
fn match_field(key: &str, fields: &[&'static str]) -> Option<usize> {
    fields
        .iter()
        .position(|name| *name == key)
        .or_else(|| fields.iter().position(|name| fold_eq(key, name)))
}

/// Case-insensitive comparison against an ASCII field name using Go's folding
/// (`ToUpper(ToLower(r))`), under which a few non-ASCII letters fold onto ASCII ones.
fn fold_eq(key: &str, ascii_name: &str) -> bool {
    let mut chars = key.chars();
    for expected in ascii_name.bytes() {
        let folded = match chars.next() {
            Some(c) if c.is_ascii() => c.to_ascii_uppercase(),
            Some('\u{17f}') => 'S',             // LATIN SMALL LETTER LONG S
            Some('\u{212a}') => 'K',            // KELVIN SIGN
            Some('\u{131}' | '\u{130}') => 'I', // dotless i, I with dot above
            _ => return false,
        };
        if folded != char::from(expected.to_ascii_uppercase()) {
            return false;
        }
    }
    chars.next().is_none()
}

/// A Go `int` field: `null` leaves it unchanged; only integer literals that fit are accepted.
fn parse_int(raw: &str, field: &'static str) -> Result<Option<i64>, InfoError> {
    if raw == "null" {
        return Ok(None);
    }
    let is_number = raw.starts_with(|c: char| c == '-' || c.is_ascii_digit());
    if !is_number || raw.contains(['.', 'e', 'E']) {
        return Err(InfoError::WrongType { field });
    }
    raw.parse::<i64>()
        .map(Some)
        .map_err(|_| InfoError::WrongType { field })
}

/// A Go `bool` field.
fn parse_bool(raw: &str, field: &'static str) -> Result<Option<bool>, InfoError> {
    match raw {
        "null" => Ok(None),
        "true" => Ok(Some(true)),
        "false" => Ok(Some(false)),
        _ => Err(InfoError::WrongType { field }),
    }
}

/// A Go `string` field.
fn parse_string(raw: &str, field: &'static str) -> Result<Option<String>, InfoError> {
    if raw == "null" {
        return Ok(None);
    }
    unquote(raw).map(Some).ok_or(InfoError::WrongType { field })
}

/// The mesh key: must be a string of exactly 32 hex-encoded bytes; `null` is refused too,
/// because Go hands `null` to the key's own decoder, which sees zero bytes.
fn parse_mesh_key(raw: &str) -> Result<MeshKey, InfoError> {
    let text = unquote(raw).ok_or(InfoError::InvalidMeshKey)?;
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(text.as_bytes(), &mut bytes).map_err(|_| InfoError::InvalidMeshKey)?;
    Ok(MeshKey::from_bytes(bytes))
}

/// Decodes a validated JSON string literal as Go does (lone surrogates become U+FFFD).
/// Returns `None` if `raw` is not a string literal.
fn unquote(raw: &str) -> Option<String> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut rest = inner;
    while let Some(pos) = rest.find('\\') {
        out.push_str(&rest[..pos]);
        let escape = &rest[pos + 1..];
        let kind = escape.chars().next()?;
        rest = &escape[kind.len_utf8()..];
        let c = match kind {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let unit = hex4(rest)?;
                rest = &rest[4..];
                if (0xd800..0xdc00).contains(&unit) {
                    let low = rest.strip_prefix("\\u").and_then(hex4);
                    match low {
                        Some(low) if (0xdc00..0xe000).contains(&low) => {
                            rest = &rest[6..];
                            let code = 0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00);
                            char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER)
                        }
                        _ => char::REPLACEMENT_CHARACTER,
                    }
                } else {
                    char::from_u32(unit).unwrap_or(char::REPLACEMENT_CHARACTER)
                }
            }
            _ => return None,
        };
        out.push(c);
    }
    out.push_str(rest);
    Some(out)
}

/// Parses the four hex digits at the start of `s`.
fn hex4(s: &str) -> Option<u32> {
    let digits = s.get(..4)?;
    if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MESH_HEX: &str = "e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";

    fn mesh() -> MeshKey {
        MESH_HEX.parse().unwrap()
    }

    fn client(json: &str) -> Result<ClientInfo, InfoError> {
        ClientInfo::from_json(json.as_bytes())
    }

    /// Go's TestClientInfoUnmarshal.
    #[test]
    fn go_client_info_unmarshal_cases() {
        assert_eq!(client("{}"), Ok(ClientInfo::default()));
        let want = ClientInfo {
            mesh_key: Some(mesh()),
            version: 5,
            ..ClientInfo::default()
        };
        assert_eq!(
            client(&format!(r#"{{"Version":5,"MeshKey":"{MESH_HEX}"}}"#)),
            Ok(want.clone())
        );
        assert_eq!(
            client(&format!(r#"{{"version":5,"meshKey":"{MESH_HEX}"}}"#)),
            Ok(want)
        );
        assert_eq!(
            client(&format!(r#"{{"meshKey":"{}"}}"#, &MESH_HEX[..62])),
            Err(InfoError::InvalidMeshKey)
        );
        assert_eq!(
            client(&format!(r#"{{"meshKey":"{MESH_HEX}00"}}"#)),
            Err(InfoError::InvalidMeshKey)
        );
    }

    #[test]
    fn client_info_encodes_like_go() {
        assert_eq!(ClientInfo::default().to_json(), br#"{"CanAckPings":false}"#);
        let normal = ClientInfo {
            version: 2,
            can_ack_pings: true,
            ..ClientInfo::default()
        };
        assert_eq!(normal.to_json(), br#"{"version":2,"CanAckPings":true}"#);
        let full = ClientInfo {
            mesh_key: Some(mesh()),
            version: -7,
            can_ack_pings: false,
            is_prober: true,
            app_name: "app".to_owned(),
        };
        assert_eq!(
            String::from_utf8(full.to_json()).unwrap(),
            format!(
                r#"{{"meshKey":"{MESH_HEX}","version":-7,"CanAckPings":false,"IsProber":true,"AppName":"app"}}"#
            )
        );
        // A zero mesh key is omitted (Go's omitzero).
        let zero = ClientInfo {
            mesh_key: Some(MeshKey([0; 32])),
            ..ClientInfo::default()
        };
        assert_eq!(zero.to_json(), br#"{"CanAckPings":false}"#);
    }

    #[test]
    fn strings_are_escaped_like_go() {
        let mut out = Vec::new();
        write_go_string(
            &mut out,
            "a\"b\\c\n\r\t\u{8}\u{c}\u{1}\u{1f}<>&\u{2028}\u{2029}\u{7f}é😀",
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#""a\"b\\c\n\r\t\b\f\u0001\u001f\u003c\u003e\u0026\u2028\u2029"#.to_owned()
                + "\u{7f}é😀\""
        );
    }

    #[test]
    fn key_matching_is_case_insensitive_with_go_folding() {
        let info = client(r#"{"VERSION":3,"canackpings":true,"isPROBER":true,"appname":"x"}"#);
        assert_eq!(
            info,
            Ok(ClientInfo {
                version: 3,
                can_ack_pings: true,
                is_prober: true,
                app_name: "x".to_owned(),
                ..ClientInfo::default()
            })
        );
        // KELVIN SIGN folds to K and LONG S to S under Go's rules.
        let info = client(&format!(
            "{{\"mesh\u{212a}ey\":\"{MESH_HEX}\",\"I\u{17f}Prober\":true}}"
        ))
        .unwrap();
        assert_eq!(info.mesh_key, Some(mesh()));
        assert!(info.is_prober);
        // Escaped key names are compared after unescaping.
        assert_eq!(client(r#"{"\u0076ersion":4}"#).unwrap().version, 4);
        // Near misses are unknown keys and ignored.
        assert_eq!(
            client(r#"{"versio":4,"versionn":5}"#),
            Ok(ClientInfo::default())
        );
        assert!(fold_eq("ıSPROBER", "IsProber"));
        assert!(!fold_eq("IsProbe", "IsProber"));
        assert!(!fold_eq("IsProberr", "IsProber"));
        assert_eq!(match_field("version", &SERVER_FIELDS), Some(0));
        assert_eq!(
            match_field("tokenbucketbytesburst", &SERVER_FIELDS),
            Some(2)
        );
    }

    #[test]
    fn later_duplicates_win_and_null_leaves_fields_alone() {
        assert_eq!(client(r#"{"version":1,"Version":2}"#).unwrap().version, 2);
        assert_eq!(client(r#"{"Version":2,"version":1}"#).unwrap().version, 1);
        let info = client(r#"{"version":7,"version":null,"CanAckPings":null,"AppName":null}"#);
        assert_eq!(
            info,
            Ok(ClientInfo {
                version: 7,
                ..ClientInfo::default()
            })
        );
        // A top-level null is a successful no-op in Go.
        assert_eq!(client("null"), Ok(ClientInfo::default()));
        assert_eq!(client(" \t\r\n{} \n"), Ok(ClientInfo::default()));
    }

    #[test]
    fn lone_surrogates_in_member_names_are_unknown_keys() {
        assert_eq!(client(r#"{"\ud800":1,"version":3}"#).unwrap().version, 3);
        assert_eq!(client(r#"{"\u0041ppName":"x"}"#).unwrap().app_name, "x");
    }

    #[test]
    fn unknown_fields_of_any_shape_are_ignored() {
        let json = r#"{"x":{"a":[1,{"b":null}],"c":"\u00e9"},"y":-1.5e3,"z":[],"version":2}"#;
        assert_eq!(client(json).unwrap().version, 2);
    }

    #[test]
    fn wrong_types_and_bad_json_are_refused() {
        let wrong = |field| Err(InfoError::WrongType { field });
        assert_eq!(client(r#"{"version":"2"}"#), wrong("version"));
        assert_eq!(client(r#"{"version":2.0}"#), wrong("version"));
        assert_eq!(client(r#"{"version":1e2}"#), wrong("version"));
        assert_eq!(client(r#"{"version":true}"#), wrong("version"));
        assert_eq!(
            client(r#"{"version":9223372036854775808}"#),
            wrong("version")
        );
        assert_eq!(client(r#"{"version":[]}"#), wrong("version"));
        assert_eq!(client(r#"{"CanAckPings":"yes"}"#), wrong("CanAckPings"));
        assert_eq!(client(r#"{"CanAckPings":1}"#), wrong("CanAckPings"));
        assert_eq!(client(r#"{"IsProber":{}}"#), wrong("IsProber"));
        assert_eq!(client(r#"{"AppName":5}"#), wrong("AppName"));
        assert_eq!(
            client(r#"{"meshKey":null}"#),
            Err(InfoError::InvalidMeshKey)
        );
        assert_eq!(client(r#"{"meshKey":""}"#), Err(InfoError::InvalidMeshKey));
        assert_eq!(
            client(r#"{"meshKey":"badf00d"}"#),
            Err(InfoError::InvalidMeshKey)
        );
        assert_eq!(client(r#"{"meshKey":12}"#), Err(InfoError::InvalidMeshKey));
        let not_hex = format!(r#"{{"meshKey":"{}zz"}}"#, &MESH_HEX[..62]);
        assert_eq!(client(&not_hex), Err(InfoError::InvalidMeshKey));

        for bad in [
            "",
            "hello",
            "{",
            r#"{"version":2}{}"#,
            r#"{"version":2} x"#,
            "{,}",
            "{'a':1}",
        ] {
            assert_eq!(client(bad), Err(InfoError::Syntax), "{bad:?}");
        }
        for not_object in ["[]", "2", "\"s\"", "true"] {
            assert_eq!(
                client(not_object),
                Err(InfoError::NotObject),
                "{not_object:?}"
            );
        }
    }

    #[test]
    fn integers_follow_go_parsing() {
        assert_eq!(client(r#"{"version":-0}"#).unwrap().version, 0);
        assert_eq!(client(r#"{"version":-12}"#).unwrap().version, -12);
        assert_eq!(
            client(r#"{"version":-9223372036854775808}"#)
                .unwrap()
                .version,
            i64::MIN
        );
    }

    #[test]
    fn strings_decode_like_go() {
        let name = |json: &[u8]| ClientInfo::from_json(json).unwrap().app_name;
        assert_eq!(
            name(br#"{"AppName":"a\"\\\/\b\f\n\r\t\u00e9"}"#),
            "a\"\\/\u{8}\u{c}\n\r\té"
        );
        assert_eq!(name(br#"{"AppName":"\ud83d\ude00"}"#), "😀");
        // Lone surrogates and invalid UTF-8 become U+FFFD rather than errors.
        assert_eq!(name(br#"{"AppName":"a\ud800b"}"#), "a\u{fffd}b");
        assert_eq!(
            name(br#"{"AppName":"\udc00\ud800\u0041"}"#),
            "\u{fffd}\u{fffd}A"
        );
        assert_eq!(name(b"{\"AppName\":\"a\xffb\"}"), "a\u{fffd}b");
        // Invalid bytes outside strings are still syntax errors.
        assert_eq!(ClientInfo::from_json(b"{\xff}"), Err(InfoError::Syntax));
    }

    #[test]
    fn unquote_refuses_bad_escapes_without_panicking() {
        assert_eq!(unquote(r#""a\é""#), None);
        assert_eq!(unquote(r#""\u12""#), None);
        assert_eq!(unquote(r#""\""#), None);
        assert_eq!(unquote("\"not closed"), None);
        assert_eq!(unquote(r#""ok\u00e9""#).as_deref(), Some("oké"));
    }

    #[test]
    fn client_info_round_trips_through_json() {
        let info = ClientInfo {
            mesh_key: Some(mesh()),
            version: 2,
            can_ack_pings: true,
            is_prober: true,
            app_name: "a <b> & \"c\"\n\u{0}é".to_owned(),
        };
        assert_eq!(ClientInfo::from_json(&info.to_json()), Ok(info));
        let zero = ClientInfo {
            mesh_key: Some(MeshKey([0; 32])),
            ..ClientInfo::default()
        };
        assert_eq!(
            client(&format!(
                r#"{{"meshKey":"{}"}}"#,
                zero.mesh_key.unwrap().to_hex()
            )),
            Ok(ClientInfo::default())
        );
    }

    #[test]
    fn server_info_encoding() {
        assert_eq!(ServerInfo::default_server().to_json(), br#"{"version":2}"#);
        assert_eq!(
            ServerInfo::default_server().to_json(),
            ServerInfo::DEFAULT_SERVER_JSON
        );
        assert_eq!(ServerInfo::default().to_json(), b"{}");
        let limited = ServerInfo {
            version: 2,
            token_bucket_bytes_per_second: 1,
            token_bucket_bytes_burst: 2048,
        };
        assert_eq!(
            limited.to_json(),
            br#"{"version":2,"TokenBucketBytesPerSecond":1,"TokenBucketBytesBurst":2048}"#
        );
        assert_eq!(ServerInfo::from_json(&limited.to_json()), Ok(limited));
    }

    #[test]
    fn server_info_decoding() {
        let server = |json: &str| ServerInfo::from_json(json.as_bytes());
        assert_eq!(server(r#"{"version":2}"#), Ok(ServerInfo::default_server()));
        assert_eq!(server("{}"), Ok(ServerInfo::default()));
        assert_eq!(
            server(r#"{"tokenbucketbytespersecond":10,"other":"x"}"#),
            Ok(ServerInfo {
                token_bucket_bytes_per_second: 10,
                ..ServerInfo::default()
            })
        );
        assert_eq!(
            server(r#"{"TokenBucketBytesBurst":"10"}"#),
            Err(InfoError::WrongType {
                field: "TokenBucketBytesBurst"
            })
        );
        assert_eq!(server(r#"{"version":2}x"#), Err(InfoError::Syntax));
        assert_eq!(server("[1]"), Err(InfoError::NotObject));
    }
}
