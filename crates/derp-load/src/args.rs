//! The flags both programs take to name the server under test and to observe it, and the
//! bounds every run keeps to.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};

/// Most connections a run may open.
pub const MAX_CONNECTIONS: i64 = 200_000;
/// No single window may be longer than this.
pub const MAX_WINDOW: Duration = Duration::from_secs(3600);

/// Which server to test and how to observe it.
#[derive(Clone, Debug, Args, Serialize, Deserialize)]
pub struct TargetArgs {
    /// DERP URL: http://host:port/derp, ws://host:port/derp for WebSocket, https:// or
    /// wss:// over TLS, or quic://host:port for DERP over QUIC.
    #[arg(long, global = true)]
    pub url: Option<String>,

    /// TLS and QUIC: how to check the server's certificate, as a DERP map's CertName: a
    /// `sha256-raw:<hex>` pin (self-signed nodes; derpd prints it) or the name the
    /// certificate must be valid for.
    #[arg(long, global = true)]
    pub cert_name: Option<String>,

    /// TLS and QUIC: PEM file of extra CA certificates to trust, for nodes whose
    /// certificate comes from a private CA (`--ca-cert` is the same flag).
    #[arg(
        long = "ca",
        visible_alias = "ca-cert",
        global = true,
        value_name = "FILE"
    )]
    pub ca: Option<PathBuf>,

    /// With an https:// URL: connect over QUIC to this UDP port of the same host instead
    /// (the node's --quic-port).
    #[arg(long, global = true)]
    pub quic_port: Option<u16>,

    /// QUIC: send and accept packets on the stream only, no datagrams.
    #[arg(long, global = true)]
    pub quic_no_datagrams: bool,

    /// QUIC: the clients' congestion controller: loss-filter (derpd's default), cubic, bbr,
    /// or none (a reference for benchmarks only). The server's is derpd's --quic-congestion.
    #[arg(long, global = true, default_value = "loss-filter")]
    #[serde(with = "by_name")]
    pub quic_congestion: derp_client::QuicCongestion,

    /// Start an in-process derpd relay on 127.0.0.1 (random port) and test it. Its CPU is
    /// measured per thread; its memory is shared with the bench's.
    #[arg(long, global = true, conflicts_with = "url")]
    pub spawn_server: bool,

    /// A second server for the receiving half of every pair (the echoing half in latency
    /// mode): senders connect to --url, receivers here, so every packet crosses between the
    /// two, e.g. two meshed nodes of one region.
    #[arg(long, global = true, conflicts_with = "spawn_server")]
    pub peer_url: Option<String>,

    /// Prometheus text endpoint of the server (e.g. http://127.0.0.1:9090/metrics or
    /// http://127.0.0.1:3340/debug/varz), scraped before and after each run for drop counters,
    /// connection counts and process_resident_memory_bytes.
    #[arg(long, global = true)]
    pub metrics_url: Option<String>,

    /// Process id of the server when it runs on this machine: its CPU time and RSS are read
    /// from /proc/PID (the honest per-packet CPU figure). Repeat (or comma-separate) for
    /// several processes, e.g. both nodes with --peer-url: their CPU is added up.
    #[arg(long, global = true, value_delimiter = ',')]
    pub server_pid: Vec<u32>,

    /// Open every connection with a `HEAD /derp/probe` request ahead of the upgrade, so that
    /// the upgrade is the second request of a keep-alive connection: the path a relay serves
    /// those on (derpd's hyper front) instead of its first-request path. Not with QUIC or
    /// `--client blocking`.
    #[arg(long, global = true)]
    #[serde(default)]
    pub probe_first: bool,

    /// Budget for each connection's dial, upgrade and handshake.
    #[arg(long, global = true, default_value = "5s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
}

/// A value that has a name (`Display` and `FromStr`), written as its name.
mod by_name {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<T: Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub(super) fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr<Err: Display>,
        D: Deserializer<'de>,
    {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Parses "5s", "250ms", "1m", "1.5" (seconds).
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let text = s.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (num, unit) = text.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| DurationError::Invalid(text.to_owned()))?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "m" => 60.0,
        _ => {
            return Err(DurationError::Unit {
                unit: unit.to_owned(),
                text: text.to_owned(),
            });
        }
    };
    let d = Duration::try_from_secs_f64(value * scale)
        .map_err(|_| DurationError::OutOfRange(text.to_owned()))?;
    if d > MAX_WINDOW {
        return Err(DurationError::TooLong(text.to_owned()));
    }
    Ok(d)
}

/// A duration flag that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// No number in front.
    #[error("invalid duration {0:?} (want e.g. 5s, 250ms)")]
    Invalid(String),
    /// A unit other than `ms`, `us`, `s` or `m`.
    #[error("unknown unit {unit:?} in duration {text:?}")]
    Unit {
        /// The unit given.
        unit: String,
        /// The whole flag.
        text: String,
    },
    /// Too large (or negative) to be a duration at all.
    #[error("duration {0:?} out of range")]
    OutOfRange(String),
    /// Longer than any window may be.
    #[error("duration {0:?} exceeds the {MAX_WINDOW:?} bound")]
    TooLong(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(
            parse_duration("5h"),
            Err(DurationError::Unit {
                unit: "h".into(),
                text: "5h".into()
            })
        );
        assert_eq!(
            parse_duration("61m"),
            Err(DurationError::TooLong("61m".into()))
        );
        assert_eq!(parse_duration(""), Err(DurationError::Invalid("".into())));
    }
}
