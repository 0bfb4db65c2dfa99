//! derper's `--verify-client-url`: ask an admission server about each client.

use std::time::Duration;

use bytes::Bytes;
use derp_server::{Admission, AdmissionRequest, Refused, VerdictFuture};
use rustls::pki_types::CertificateDer;
use tokio::time::Instant;
use tracing::warn;

use crate::AdmissionError;
use crate::cache::{CacheConfig, Decision, DecisionCache};
use crate::client::{Failure, PostClient, Target};
use crate::metrics::{AdmissionMetrics, WarnLimiter};

/// The reference's deadline for one admission request.
pub const DEFAULT_VERIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a response body that is read (the reference reads 4 KiB); a longer one is a
/// refusal.
pub const MAX_RESPONSE_BODY: usize = 4096;

/// Settings for [`VerifyUrl`].
#[derive(Clone, Debug)]
pub struct UrlOptions {
    /// Admit clients when the server cannot be reached (connection refused, TLS failure, no
    /// response head before the deadline). Off by default: derper's default is on, but a
    /// node meant for one tailnet should not open up when its admission server is down.
    /// Answers that arrive (any status, any body) are never overridden.
    pub fail_open: bool,
    /// Deadline for each request, from connecting to the last byte of the response.
    pub timeout: Duration,
    /// CA certificates to trust besides the system's, for an `https://` URL.
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// How decisions are remembered.
    pub cache: CacheConfig,
}

impl Default for UrlOptions {
    fn default() -> Self {
        Self {
            fail_open: false,
            timeout: DEFAULT_VERIFY_TIMEOUT,
            extra_roots: Vec::new(),
            cache: CacheConfig::default(),
        }
    }
}

/// Asks an admission server about each client: a POST of
/// `{"NodePublic":"nodekey:<hex>","Source":"<ip>"}`, admitted only on a 2xx answer whose
/// JSON body has `"Allow": true`.
///
/// Refusal reasons: `denied` (the server said no), `bad_response` (another status, a body
/// that is not that JSON, too large or too slow), `unavailable` (the server could not be
/// reached and `fail_open` is off).
#[derive(Debug)]
pub struct VerifyUrl {
    client: PostClient,
    options: UrlOptions,
    cache: DecisionCache,
    metrics: AdmissionMetrics,
    warn: WarnLimiter,
}

impl VerifyUrl {
    /// A check against `url` (`http://` or `https://`).
    pub fn new(
        url: &str,
        options: UrlOptions,
        metrics: &AdmissionMetrics,
    ) -> Result<Self, AdmissionError> {
        let target = Target::parse(url)?;
        Ok(Self {
            client: PostClient::new(target, &options.extra_roots)?,
            cache: DecisionCache::new(options.cache, metrics.cache_hit("url")),
            options,
            metrics: metrics.clone(),
            warn: WarnLimiter::new(),
        })
    }

    async fn ask(&self, req: AdmissionRequest) -> Decision {
        let body = serde_json::json!({
            "NodePublic": req.key.to_string(),
            "Source": req.source.to_string(),
        });
        let body = Bytes::from(body.to_string());
        let deadline = Instant::now() + self.options.timeout;
        let outcome = self
            .client
            .post_json(body, deadline, MAX_RESPONSE_BODY)
            .await;
        let refuse = |reason, detail: String| Decision {
            verdict: Err(Refused::new(reason, detail)),
            definite: false,
        };
        match outcome {
            Err(Failure::Unreachable(e)) => {
                self.metrics.request("url", "error");
                if let Some(held) = self.warn.allow() {
                    warn!(error = %e, fail_open = self.options.fail_open, suppressed = held,
                          "admission server unreachable");
                }
                if self.options.fail_open {
                    self.metrics.fail_open.inc();
                    Decision {
                        verdict: Ok(()),
                        definite: false,
                    }
                } else {
                    refuse("unavailable", e.to_string())
                }
            }
            Err(Failure::BadBody(e)) => {
                self.metrics.request("url", "error");
                refuse("bad_response", e.to_string())
            }
            Ok((status, _)) if !status.is_success() => {
                self.metrics.request("url", "error");
                refuse("bad_response", format!("status {status}"))
            }
            Ok((_, body)) => match parse_allow(&body) {
                Some(true) => {
                    self.metrics.request("url", "allow");
                    Decision {
                        verdict: Ok(()),
                        definite: true,
                    }
                }
                Some(false) => {
                    self.metrics.request("url", "deny");
                    Decision {
                        verdict: Err(Refused::new("denied", "the admission server said no")),
                        definite: true,
                    }
                }
                None => {
                    self.metrics.request("url", "error");
                    refuse(
                        "bad_response",
                        format!(
                            "not an admission response: {:?}",
                            String::from_utf8_lossy(&body[..body.len().min(200)])
                        ),
                    )
                }
            },
        }
    }
}

impl Admission for VerifyUrl {
    fn check(&self, client: AdmissionRequest) -> VerdictFuture<'_> {
        Box::pin(self.cache.decide(client, move || self.ask(client)))
    }
}

/// `Allow` from a JSON object, its name matched without regard to case as Go's decoder
/// does; `None` when the body is not a JSON object or `Allow` is not a boolean. A missing
/// `Allow` is false, as in Go.
fn parse_allow(body: &[u8]) -> Option<bool> {
    let serde_json::Value::Object(map) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    let mut allow = Some(false);
    for (k, v) in &map {
        if k.eq_ignore_ascii_case("allow") {
            allow = match v {
                serde_json::Value::Bool(b) => Some(*b),
                serde_json::Value::Null => Some(false),
                _ => None,
            };
        }
    }
    allow
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_is_read_like_go_does() {
        assert_eq!(parse_allow(br#"{"Allow":true}"#), Some(true));
        assert_eq!(parse_allow(br#"{"allow": true, "extra": [1]}"#), Some(true));
        assert_eq!(parse_allow(br#"{"Allow":false}"#), Some(false));
        assert_eq!(parse_allow(br#"{}"#), Some(false));
        assert_eq!(parse_allow(br#"{"Allow":"yes"}"#), None);
        assert_eq!(parse_allow(br#"[true]"#), None);
        assert_eq!(parse_allow(b"Allow: true"), None);
        assert_eq!(parse_allow(b""), None);
    }
}
