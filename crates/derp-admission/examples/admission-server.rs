//! A minimal admission server for `--verify-client-url`, for trying the flag out and for
//! benchmarking handshakes with admission on: it answers every POST with `{"Allow":true}`,
//! or, given a file of node keys (one per line), allows only those.
//!
//!     cargo run --release -p derp-admission --example admission-server -- 127.0.0.1:9099 [KEYS]
//!     derpd ... --verify-client-url http://127.0.0.1:9099/verify

use std::collections::HashSet;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:9099".to_owned());
    let allowed: Option<Arc<HashSet<String>>> = match args.next() {
        Some(path) => Some(Arc::new(
            std::fs::read_to_string(path)?
                .lines()
                .map(|l| l.trim().to_owned())
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .collect(),
        )),
        None => None,
    };
    let listener = TcpListener::bind(&addr).await?;
    eprintln!(
        "admission server on http://{}/verify",
        listener.local_addr()?
    );
    loop {
        let (mut s, _) = listener.accept().await?;
        let allowed = allowed.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                // One request: the head, then Content-Length bytes of JSON.
                let (end, len) = loop {
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break (end, len);
                        }
                    }
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                };
                let body = &buf[end + 4..end + 4 + len];
                let allow = match &allowed {
                    None => true,
                    Some(keys) => serde_json::from_slice::<serde_json::Value>(body)
                        .ok()
                        .and_then(|v| v["NodePublic"].as_str().map(|k| keys.contains(k)))
                        .unwrap_or(false),
                };
                buf.drain(..end + 4 + len);
                let body = format!("{{\"Allow\":{allow}}}");
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                if s.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}
