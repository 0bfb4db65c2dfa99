//! derper's `--rate-config` file.

use derp_proto::rate_config::RateConfig;
use serde_json::Value;

/// Parses the input (when it is UTF-8, as the file must be) as a rate configuration.
///
/// - Anything accepted is a JSON object whose matching fields are absent, null or unsigned
///   integers, and the numbers are exactly those fields' values (names compared without
///   case; of several that match, the one sorting last).
/// - Anything refused is not JSON, not an object, or has a matching field of another kind.
/// - What is accepted prints back to a file that parses to the same numbers.
pub fn rate_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = RateConfig::parse(text);
    let model = model(text);
    match (&parsed, &model) {
        (Ok(got), Some(want)) => assert_eq!(got, want, "{text:?}"),
        (Err(_), None) => {}
        _ => panic!("parser {parsed:?} and model {model:?} disagree on {text:?}"),
    }
    if let Ok(config) = parsed {
        assert_eq!(RateConfig::parse(&config.to_json()), Ok(config));
    }
}

/// What the parser must make of `text`, computed another way.
fn model(text: &str) -> Option<RateConfig> {
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(text) else {
        return None;
    };
    let field = |name: &str| {
        let mut value = Some(0);
        for (k, v) in &map {
            if k.eq_ignore_ascii_case(name) {
                value = match v {
                    Value::Null => Some(0),
                    Value::Number(n) => n.as_u64(),
                    _ => None,
                };
            }
        }
        value
    };
    Some(RateConfig {
        bytes_per_sec: field("PerClientRateLimitBytesPerSec")?,
        burst_bytes: field("PerClientRateBurstBytes")?,
    })
}
