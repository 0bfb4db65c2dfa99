//! derper's per-client rate configuration file (`--rate-config`).
//!
//! A JSON object with two unsigned integers, `PerClientRateLimitBytesPerSec` and
//! `PerClientRateBurstBytes`. As Go's decoder does, names match without regard to case,
//! either may be left out or null (meaning 0), and other fields are ignored. What the numbers
//! mean (0 disables limiting, the burst is raised to one maximal frame) is the relay's
//! business, not this parser's.

use std::fmt::Write as _;

/// The two numbers of a rate configuration file, as written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateConfig {
    /// `PerClientRateLimitBytesPerSec`.
    pub bytes_per_sec: u64,
    /// `PerClientRateBurstBytes`.
    pub burst_bytes: u64,
}

/// Why a rate configuration file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateConfigError {
    /// The text is not JSON.
    #[error("not JSON: {0}")]
    Json(String),
    /// The JSON is not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// A known field holds something other than an unsigned integer.
    #[error("{field} must be an unsigned integer, got {value}")]
    BadValue {
        /// The field's name as written.
        field: String,
        /// Its value, as JSON.
        value: String,
    },
}

impl RateConfig {
    /// Parses the file's contents.
    pub fn parse(text: &str) -> Result<Self, RateConfigError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| RateConfigError::Json(e.to_string()))?;
        let serde_json::Value::Object(map) = value else {
            return Err(RateConfigError::NotAnObject);
        };
        let field = |name: &str| -> Result<u64, RateConfigError> {
            // Of several keys equal but for case, the one sorting last wins here, where Go
            // takes the last in the file; no real config spells a name twice.
            match map.iter().rfind(|(k, _)| k.eq_ignore_ascii_case(name)) {
                None | Some((_, serde_json::Value::Null)) => Ok(0),
                Some((k, v)) => v.as_u64().ok_or_else(|| RateConfigError::BadValue {
                    field: k.clone(),
                    value: v.to_string(),
                }),
            }
        };
        Ok(Self {
            bytes_per_sec: field("PerClientRateLimitBytesPerSec")?,
            burst_bytes: field("PerClientRateBurstBytes")?,
        })
    }

    /// The file's contents for these numbers, in derper's field names.
    pub fn to_json(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "{{\"PerClientRateLimitBytesPerSec\":{},\"PerClientRateBurstBytes\":{}}}",
            self.bytes_per_sec, self.burst_bytes
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_like_derper() {
        let c = RateConfig::parse(
            r#"{"PerClientRateLimitBytesPerSec": 1250000, "PerClientRateBurstBytes": 2500000}"#,
        )
        .expect("ok");
        assert_eq!(
            c,
            RateConfig {
                bytes_per_sec: 1_250_000,
                burst_bytes: 2_500_000
            }
        );
        let c = RateConfig::parse(r#"{"perclientratelimitbytespersec": 1000, "Other": 1}"#)
            .expect("ok");
        assert_eq!((c.bytes_per_sec, c.burst_bytes), (1000, 0));
        assert_eq!(RateConfig::parse("{}"), Ok(RateConfig::default()));
        assert_eq!(
            RateConfig::parse(r#"{"PerClientRateBurstBytes": null}"#),
            Ok(RateConfig::default())
        );
        for bad in [
            "",
            "[1]",
            r#"{"PerClientRateLimitBytesPerSec": -1}"#,
            r#"{"PerClientRateLimitBytesPerSec": 1.5}"#,
            r#"{"PerClientRateBurstBytes": "x"}"#,
        ] {
            assert!(RateConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn writes_what_it_reads() {
        let c = RateConfig {
            bytes_per_sec: u64::MAX,
            burst_bytes: 7,
        };
        assert_eq!(RateConfig::parse(&c.to_json()), Ok(c));
    }
}
