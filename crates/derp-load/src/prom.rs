//! Reading a relay's Prometheus metrics: a small HTTP GET and a text-format parser.
//!
//! Only what the bench needs: plain-HTTP scrapes of `/metrics` or `/debug/varz` in the
//! Prometheus text format, and the in-process registry of a `--spawn-server` relay.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The metric's name.
    pub name: String,
    /// Its labels, in the order written.
    pub labels: Vec<(String, String)>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed scrape.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// Every sample, in the order served.
    pub samples: Vec<Sample>,
}

impl Scrape {
    /// Sum of every sample of `name`, or `None` when the metric is absent.
    pub fn sum(&self, name: &str) -> Option<f64> {
        let mut found = false;
        let mut total = 0.0;
        for s in self.samples.iter().filter(|s| s.name == name) {
            found = true;
            total += s.value;
        }
        found.then_some(total)
    }

    /// Sums `name` grouped by the value of `label`, in first-seen order.
    pub fn sum_by(&self, name: &str, label: &str) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for s in self.samples.iter().filter(|s| s.name == name) {
            let key = s.label(label).unwrap_or("").to_owned();
            match out.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => *v += s.value,
                None => out.push((key, s.value)),
            }
        }
        out
    }
}

/// Parses the Prometheus text exposition format. Lines that do not parse are skipped, so a
/// server with unusual extra lines still yields the metrics the bench needs.
pub fn parse_text(text: &str) -> Scrape {
    let samples = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(parse_line)
        .collect();
    Scrape { samples }
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after)?;
        labels = parsed;
        rest = remaining;
    }
    let value_text = rest.split_whitespace().next()?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",...}` and returns the labels and what follows the closing brace.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_owned();
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        s = &s[end + 1..];
    }
}

/// Where the server's metrics come from.
#[derive(Clone, Debug)]
pub enum MetricsSource {
    /// A plain-HTTP URL serving the text format.
    Http(String),
    /// The registry of the relay this process spawned.
    InProcess(prometheus::Registry),
}

impl MetricsSource {
    /// Reads the metrics once.
    pub async fn scrape(&self) -> Result<Scrape, ScrapeError> {
        match self {
            Self::Http(url) => {
                let body =
                    http_get(url, SCRAPE_TIMEOUT)
                        .await
                        .map_err(|source| ScrapeError::Http {
                            url: url.clone(),
                            source,
                        })?;
                Ok(parse_text(&body))
            }
            Self::InProcess(registry) => {
                let text = prometheus::TextEncoder::new()
                    .encode_to_string(&registry.gather())
                    .map_err(ScrapeError::Encode)?;
                Ok(parse_text(&text))
            }
        }
    }

    /// Where the metrics come from, for the report.
    pub fn describe(&self) -> String {
        match self {
            Self::Http(url) => url.clone(),
            Self::InProcess(_) => "in-process registry".to_owned(),
        }
    }
}

const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// Refuse scrapes larger than this; a metrics page is kilobytes.
const MAX_BODY: usize = 32 << 20;

/// Fetches `url` (plain `http://` only) and returns the body of a 200 response.
pub async fn http_get(url: &str, timeout: Duration) -> Result<String, HttpError> {
    tokio::time::timeout(timeout, http_get_inner(url))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn http_get_inner(url: &str) -> Result<String, HttpError> {
    let rest = match url.split_once("://") {
        Some(("http", rest)) => rest,
        Some((scheme, _)) => return Err(HttpError::Scheme(scheme.to_owned())),
        None => return Err(HttpError::NoScheme(url.to_owned())),
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| !p.contains(']'))
    {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let mut stream = match TcpStream::connect(&addr).await {
        Ok(s) => s,
        Err(source) => return Err(HttpError::Connect { addr, source }),
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\n\
         User-Agent: derp-bench\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    (&mut stream)
        .take(MAX_BODY as u64 + 1)
        .read_to_end(&mut raw)
        .await?;
    if raw.len() > MAX_BODY {
        return Err(HttpError::TooLarge);
    }
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or(HttpError::NoHead)?;
    let head = std::str::from_utf8(&raw[..head_end]).map_err(|_| HttpError::NotUtf8("head"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::StatusLine(status_line.to_owned()))?;
    if status != 200 {
        return Err(HttpError::Status(status));
    }
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
        })
    });
    let body = &raw[head_end + 4..];
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    String::from_utf8(body).map_err(|_| HttpError::NotUtf8("body"))
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, HttpError> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or(HttpError::Chunk("truncated chunk size"))?;
        let size_text = std::str::from_utf8(&body[..line_end])
            .map_err(|_| HttpError::Chunk("chunk size is not text"))?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size =
            usize::from_str_radix(size_text, 16).map_err(|_| HttpError::Chunk("bad chunk size"))?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = body
            .get(..size)
            .ok_or(HttpError::Chunk("truncated chunk"))?;
        out.extend_from_slice(chunk);
        body = body.get(size + 2..).unwrap_or(&[]);
    }
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The metrics URL did not give a page.
    #[error("scraping metrics from {url}")]
    Http {
        /// The `--metrics-url`.
        url: String,
        /// What went wrong.
        source: HttpError,
    },
    /// The in-process registry could not be written out.
    #[error("encoding in-process metrics")]
    Encode(#[source] prometheus::Error),
}

/// Why a plain-HTTP GET failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// No whole answer in time.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Not `http://`.
    #[error("metrics URL scheme {0:?} is not supported (use http://)")]
    Scheme(String),
    /// No scheme at all.
    #[error("metrics URL {0:?} has no scheme (want http://host:port/path)")]
    NoScheme(String),
    /// The connection failed.
    #[error("connecting to {addr}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// Writing the request or reading the answer failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A page larger than any metrics page.
    #[error("response larger than {MAX_BODY} bytes")]
    TooLarge,
    /// The answer ended inside its head.
    #[error("no complete HTTP response head")]
    NoHead,
    /// The head or the body is not text.
    #[error("response {0} is not UTF-8")]
    NotUtf8(&'static str),
    /// The status line does not parse.
    #[error("bad status line {0:?}")]
    StatusLine(String),
    /// Anything but 200.
    #[error("HTTP status {0}")]
    Status(u16),
    /// A chunked body that does not decode.
    #[error("{0}")]
    Chunk(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP derp_packets_dropped packets dropped, by reason and kind
# TYPE derp_packets_dropped counter
derp_packets_dropped{kind="disco",reason="queue_head"} 1
derp_packets_dropped{kind="other",reason="queue_head"} 41
derp_packets_dropped{kind="other",reason="unknown_dest"} 2
derp_current_connections 20
process_resident_memory_bytes 1.2e+07
weird{a="x\"y\\z",b="new\nline"} 3 1700000000
bad line without value
"#;

    #[test]
    fn parses_counters_labels_and_escapes() {
        let s = parse_text(TEXT);
        assert_eq!(s.sum("derp_current_connections"), Some(20.0));
        assert_eq!(s.sum("process_resident_memory_bytes"), Some(12e6));
        assert_eq!(s.sum("derp_packets_dropped"), Some(44.0));
        assert_eq!(s.sum("missing"), None);
        assert_eq!(
            s.sum_by("derp_packets_dropped", "reason"),
            vec![
                ("queue_head".to_owned(), 42.0),
                ("unknown_dest".to_owned(), 2.0)
            ]
        );
        let weird = s.samples.iter().find(|x| x.name == "weird").unwrap();
        assert_eq!(weird.label("a"), Some("x\"y\\z"));
        assert_eq!(weird.label("b"), Some("new\nline"));
        assert_eq!(weird.value, 3.0);
    }

    #[test]
    fn chunked_bodies() {
        let body = b"4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\n\r\n";
        assert_eq!(dechunk(body).unwrap(), b"abcdefg");
        assert!(dechunk(b"zz\r\n").is_err());
        assert!(dechunk(b"10\r\nshort").is_err());
    }

    #[tokio::test]
    async fn scrapes_the_in_process_registry_and_rejects_https() {
        let registry = prometheus::Registry::new();
        let c = prometheus::IntCounter::new("derp_accepts", "x").unwrap();
        registry.register(Box::new(c.clone())).unwrap();
        c.inc_by(5);
        let scrape = MetricsSource::InProcess(registry).scrape().await.unwrap();
        assert_eq!(scrape.sum("derp_accepts"), Some(5.0));
        let err = http_get("https://127.0.0.1:1/metrics", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not supported"), "{err}");
    }
}
