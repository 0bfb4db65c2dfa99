//! Durations on the command line, written as Go's `time.ParseDuration` reads them, since
//! operators copy values from derper command lines: a sign, then one or more decimal
//! numbers each with a unit (`ns`, `us`, `µs`, `μs`, `ms`, `s`, `m`, `h`), or a bare `0`.

use std::time::Duration;

/// Parses a duration exactly as Go's `time.ParseDuration` does, into signed nanoseconds
/// (Go's `time.Duration`). The messages name the same faults as Go's.
pub(crate) fn parse_go_duration(orig: &str) -> Result<i64, String> {
    let invalid = || format!("invalid duration {orig:?}");
    let mut s = orig.as_bytes();
    let mut neg = false;
    if let Some((&c, rest)) = s.split_first()
        && (c == b'-' || c == b'+')
    {
        neg = c == b'-';
        s = rest;
    }
    if s == b"0" {
        return Ok(0);
    }
    if s.is_empty() {
        return Err(invalid());
    }
    const LIMIT: u64 = 1 << 63;
    let mut total: u64 = 0;
    while !s.is_empty() {
        if !(s[0] == b'.' || s[0].is_ascii_digit()) {
            return Err(invalid());
        }
        let before = s.len();
        let (whole, rest) = leading_int(s).ok_or_else(invalid)?;
        s = rest;
        let pre = before != s.len();
        let (mut frac, mut scale, mut post) = (0u64, 1f64, false);
        if let Some(rest) = s.strip_prefix(b".") {
            let before = rest.len();
            (frac, scale, s) = leading_fraction(rest);
            post = before != s.len();
        }
        if !pre && !post {
            return Err(invalid());
        }
        let unit_len = s
            .iter()
            .position(|&c| c == b'.' || c.is_ascii_digit())
            .unwrap_or(s.len());
        if unit_len == 0 {
            return Err(format!("missing unit in duration {orig:?}"));
        }
        let unit_text = &s[..unit_len];
        s = &s[unit_len..];
        let unit: u64 = match unit_text {
            b"ns" => 1,
            // "µs" is U+00B5 (micro sign), "μs" U+03BC (Greek mu): Go takes both.
            b"us" | b"\xc2\xb5s" | b"\xce\xbcs" => 1_000,
            b"ms" => 1_000_000,
            b"s" => 1_000_000_000,
            b"m" => 60_000_000_000,
            b"h" => 3_600_000_000_000,
            other => {
                return Err(format!(
                    "unknown unit {:?} in duration {orig:?}",
                    String::from_utf8_lossy(other)
                ));
            }
        };
        if whole > LIMIT / unit {
            return Err(invalid());
        }
        let mut v = whole * unit;
        if frac > 0 {
            // As Go: through a float, exact to the nanosecond for fractions of an hour.
            v += (frac as f64 * (unit as f64 / scale)) as u64;
            if v > LIMIT {
                return Err(invalid());
            }
        }
        // Go adds in a uint64 that wraps: two parts of 2^63 make 0, which it then takes.
        total = total.wrapping_add(v);
        if total > LIMIT {
            return Err(invalid());
        }
    }
    if neg {
        // total <= 2^63, so its negation fits.
        return Ok((total as i128).wrapping_neg() as i64);
    }
    i64::try_from(total).map_err(|_| invalid())
}

/// The leading decimal digits of `s` as an integer, and the rest; `None` past 2^63.
fn leading_int(s: &[u8]) -> Option<(u64, &[u8])> {
    let mut x: u64 = 0;
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if x > (1 << 63) / 10 {
            return None;
        }
        x = x * 10 + u64::from(s[i] - b'0');
        if x > 1 << 63 {
            return None;
        }
        i += 1;
    }
    Some((x, &s[i..]))
}

/// The leading digits of a fraction: their value, the power of ten that divides it, and the
/// rest. Digits past what 63 bits hold are skipped, as Go does.
fn leading_fraction(s: &[u8]) -> (u64, f64, &[u8]) {
    let (mut x, mut scale, mut overflow) = (0u64, 1f64, false);
    let mut i = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        if !overflow {
            if x > ((1u64 << 63) - 1) / 10 {
                overflow = true;
            } else {
                let y = x * 10 + u64::from(s[i] - b'0');
                if y > 1 << 63 {
                    overflow = true;
                } else {
                    x = y;
                    scale *= 10.0;
                }
            }
        }
        i += 1;
    }
    (x, scale, &s[i..])
}

/// A Go duration that must not be negative (`-0` is zero), for flags where a negative value
/// has no meaning.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let nanos = parse_go_duration(s)?;
    u64::try_from(nanos)
        .map(Duration::from_nanos)
        .map_err(|_| format!("{s:?} is negative; this flag takes a duration of 0 or more"))
}

/// A Go duration with its sign kept, for flags where a negative value means something (as
/// derper's `-tcp-keepalive-time`, where it turns keepalives off).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SignedDuration {
    /// Nanoseconds, as Go's `time.Duration`.
    pub(crate) nanos: i64,
}

impl SignedDuration {
    /// The duration if it is not negative.
    pub(crate) fn non_negative(self) -> Option<Duration> {
        u64::try_from(self.nanos).ok().map(Duration::from_nanos)
    }
}

impl std::fmt::Display for SignedDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.non_negative() {
            Some(d) => write!(f, "{d:?}"),
            None => write!(f, "-{:?}", Duration::from_nanos(self.nanos.unsigned_abs())),
        }
    }
}

/// [`parse_go_duration`] for clap.
pub(crate) fn parse_signed_duration(s: &str) -> Result<SignedDuration, String> {
    parse_go_duration(s).map(|nanos| SignedDuration { nanos })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: i64 = 1;
    const US: i64 = 1_000;
    const MS: i64 = 1_000_000;
    const S: i64 = 1_000_000_000;
    const M: i64 = 60 * S;
    const H: i64 = 60 * M;

    #[test]
    fn go_durations_parse_as_go_reads_them() {
        // Cases from Go's own time package tests.
        for (text, want) in [
            ("0", 0),
            // Go's sum wraps in 64 bits: 2^63 twice is 0.
            ("9223372036854775808ns9223372036854775808ns", 0),
            ("5s", 5 * S),
            ("30s", 30 * S),
            ("1478s", 1478 * S),
            ("-5s", -5 * S),
            ("+5s", 5 * S),
            ("-0", 0),
            ("+0", 0),
            ("5.0s", 5 * S),
            ("5.6s", 5 * S + 600 * MS),
            ("5.s", 5 * S),
            (".5s", 500 * MS),
            ("1.0s", S),
            ("1.00s", S),
            ("1.004s", S + 4 * MS),
            ("1.0040s", S + 4 * MS),
            ("100.00100s", 100 * S + MS),
            ("10ns", 10 * NS),
            ("11us", 11 * US),
            ("12µs", 12 * US),
            ("12μs", 12 * US),
            ("13ms", 13 * MS),
            ("14s", 14 * S),
            ("15m", 15 * M),
            ("16h", 16 * H),
            ("3h30m", 3 * H + 30 * M),
            ("10.5s4m", 4 * M + 10 * S + 500 * MS),
            ("-2m3.4s", -(2 * M + 3 * S + 400 * MS)),
            (
                "1h2m3s4ms5us6ns",
                H + 2 * M + 3 * S + 4 * MS + 5 * US + 6 * NS,
            ),
            ("39h9m14.425s", 39 * H + 9 * M + 14 * S + 425 * MS),
            ("52763797000ns", 52_763_797_000),
            ("0.3333333333333333333h", 20 * M),
            ("9007199254740993ns", (1 << 53) + 1),
            ("9223372036854775807ns", i64::MAX),
            ("9223372036854775.807us", i64::MAX),
            ("9223372036s854ms775us807ns", i64::MAX),
            ("-9223372036854775808ns", i64::MIN),
            ("-9223372036854775.808us", i64::MIN),
            ("-2562047h", -2_562_047 * H),
            ("2562047h", 2_562_047 * H),
            ("0.100000000000000000000h", 6 * M),
            (
                "0.830103483285477580700h",
                49 * M + 48 * S + 372_539_827 * NS,
            ),
        ] {
            assert_eq!(parse_go_duration(text), Ok(want), "{text}");
        }
        for bad in [
            "",
            "3",
            "-",
            "s",
            ".",
            "-.",
            ".s",
            "+.s",
            "1d",
            "1S",
            " 1s",
            "1s ",
            "\u{85}\u{85}",
            "\u{ff}",
            "9223372036854775808ns",
            "9223372036854775.808us",
            "2562048h",
            "-9223372036854775809ns",
            "1e3s",
        ] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} should fail");
        }
        assert_eq!(
            parse_go_duration("3").unwrap_err(),
            "missing unit in duration \"3\""
        );
        assert_eq!(
            parse_go_duration("1d").unwrap_err(),
            "unknown unit \"d\" in duration \"1d\""
        );
    }

    #[test]
    fn unsigned_and_signed_flags() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("-0"), Ok(Duration::ZERO));
        assert!(parse_duration("-5m").unwrap_err().contains("negative"));
        let d = parse_signed_duration("-1s").expect("ok");
        assert_eq!(d.non_negative(), None);
        assert_eq!(d.to_string(), "-1s");
        assert_eq!(
            parse_signed_duration("10m").expect("ok").non_negative(),
            Some(Duration::from_secs(600))
        );
    }
}
