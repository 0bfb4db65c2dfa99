//! derper's `--verify-clients`: admit only peers of the tailscaled running beside the relay.

use std::path::PathBuf;
use std::time::Duration;

use derp_server::{Admission, AdmissionRequest, Refused, VerdictFuture};
use http::StatusCode;
use tokio::time::Instant;
use tracing::warn;

use crate::cache::{CacheConfig, Decision, DecisionCache};
use crate::client::get_unix;
use crate::metrics::{AdmissionMetrics, WarnLimiter};

/// Where tailscaled listens on Linux unless told otherwise (derper's `--socket` default).
pub const DEFAULT_TAILSCALED_SOCKET: &str = "/var/run/tailscale/tailscaled.sock";

/// The Host header the LocalAPI requires, whatever the transport.
const LOCAL_API_HOST: &str = "local-tailscaled.sock";
/// The capability version sent with each request, as Tailscale's own client does.
const CAPABILITY_VERSION: &str = "100";
const TIMEOUT: Duration = Duration::from_secs(5);
/// A whois answer carries the node, its user and capabilities: a few KiB.
const MAX_BODY: usize = 256 * 1024;

/// Asks the local tailscaled, over its LocalAPI socket, whether a client's node key belongs
/// to a peer of this node (`GET /localapi/v0/whois?addr=nodekey:<hex>`).
///
/// Refusal reasons: `not_a_peer` (tailscaled does not know the key), `tailscaled_error`
/// (tailscaled could not be asked, or gave an answer that is not a whois response; a
/// tailscaled too old to look up node keys says so in the log).
#[derive(Debug)]
pub struct LocalTailscaled {
    socket: PathBuf,
    cache: DecisionCache,
    metrics: AdmissionMetrics,
    warn: WarnLimiter,
}

impl LocalTailscaled {
    /// A check against the LocalAPI at `socket`.
    pub fn new(socket: impl Into<PathBuf>, cache: CacheConfig, metrics: &AdmissionMetrics) -> Self {
        Self {
            socket: socket.into(),
            cache: DecisionCache::new(cache, metrics.cache_hit("tailscaled")),
            metrics: metrics.clone(),
            warn: WarnLimiter::new(),
        }
    }

    async fn ask(&self, req: AdmissionRequest) -> Decision {
        let path = format!("/localapi/v0/whois?addr={}", req.key);
        let outcome = get_unix(
            &self.socket,
            LOCAL_API_HOST,
            &path,
            &[("tailscale-cap", CAPABILITY_VERSION)],
            Instant::now() + TIMEOUT,
            MAX_BODY,
        )
        .await;
        let error = |detail: String| {
            self.metrics.request("tailscaled", "error");
            if let Some(held) = self.warn.allow() {
                warn!(error = %detail, socket = %self.socket.display(), suppressed = held,
                      "asking the local tailscaled failed");
            }
            Decision {
                verdict: Err(Refused::new("tailscaled_error", detail)),
                definite: false,
            }
        };
        match outcome {
            Err(e) => error(e.to_string()),
            Ok((StatusCode::NOT_FOUND, _)) => {
                self.metrics.request("tailscaled", "deny");
                Decision {
                    verdict: Err(Refused::new(
                        "not_a_peer",
                        "not found in the local tailscaled",
                    )),
                    definite: true,
                }
            }
            Ok((StatusCode::OK, body)) if is_whois(&body) => {
                self.metrics.request("tailscaled", "allow");
                Decision {
                    verdict: Ok(()),
                    definite: true,
                }
            }
            Ok((status, body)) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                if text.contains("invalid 'addr' parameter") {
                    error(format!(
                        "{status}: {text} (tailscaled is too old to look up node keys)"
                    ))
                } else {
                    error(format!("{status}: {text}"))
                }
            }
        }
    }
}

impl Admission for LocalTailscaled {
    fn check(&self, client: AdmissionRequest) -> VerdictFuture<'_> {
        Box::pin(self.cache.decide(client, move || self.ask(client)))
    }
}

/// A whois answer is a JSON object naming the node.
fn is_whois(body: &[u8]) -> bool {
    matches!(
        serde_json::from_slice::<serde_json::Value>(body),
        Ok(serde_json::Value::Object(m)) if m.get("Node").is_some_and(|n| n.is_object())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whois_answers_name_a_node() {
        assert!(is_whois(br#"{"Node":{"ID":1},"UserProfile":{}}"#));
        assert!(!is_whois(br#"{"Node":null}"#));
        assert!(!is_whois(br#"{}"#));
        assert!(!is_whois(b"ok"));
    }
}
