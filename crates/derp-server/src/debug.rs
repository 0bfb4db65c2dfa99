//! What the `/debug/` pages show: the index, the node's own health verdict
//! (`/debug/check`) and the live per-connection traffic (`/debug/traffic`). The HTTP front
//! (`http/`) routes to these behind `/debug/varz`'s access rule.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::channel::{Channel, Sender};

use crate::state::ServerState;
use crate::tcpinfo::{self, TcpStats};

/// `/debug/check`'s answer when all is well: derper's words, so probes that look for them
/// carry over.
pub(crate) const CHECK_OK: &str = "derp.Server ConsistencyCheck okay";
/// How often `/debug/traffic` reports, as derper.
const TRAFFIC_PERIOD: Duration = Duration::from_secs(2);

/// The `/debug/` index: what this node is, then links to the other pages.
pub(crate) fn index(shared: &ServerState) -> String {
    let mut out = String::from("<html><body><h1>derpd debug</h1><ul>");
    let mut item = |label: &str, value: &str| {
        let _ = write!(
            out,
            "<li><b>{}:</b> {}</li>",
            html_escape(label),
            html_escape(value)
        );
    };
    item("Uptime", &go_seconds(shared.started.elapsed()));
    item("Machine", &hostname());
    for (label, value) in &shared.config.debug_info {
        item(label, value);
    }
    item(
        "Mesh key",
        if shared.config.mesh_key.is_some() {
            "true"
        } else {
            "false"
        },
    );
    for (path, what) in [
        ("/debug/varz", "Metrics (Prometheus)"),
        ("/debug/check", "Consistency check"),
        ("/debug/traffic", "Traffic check"),
    ] {
        let _ = write!(out, "<li><a href=\"{path}\">{path}</a> ({what})</li>");
    }
    out.push_str("</ul></body></html>\n");
    out
}

/// The node's own verdict on itself: `Err` with what is wrong, derper's way (the problems
/// joined by ", ").
pub(crate) fn check(shared: &ServerState) -> Result<(), String> {
    let errs = shared.registry.consistency_check();
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join(", "))
    }
}

/// `/debug/traffic`'s body: every [`TRAFFIC_PERIOD`], one JSON line per client connection
/// whose socket sent or received since the last report (`{"Sent":…,"Recv":…,"Key":…}`, the
/// kernel's running totals), then an empty line. Runs until the client goes away or the
/// server shuts down.
pub(crate) fn traffic(shared: &Arc<ServerState>) -> Channel<Bytes> {
    let (sender, body) = Channel::new(4);
    let shutdown = shared.shutdown.clone();
    let state = Arc::downgrade(shared);
    shared.tasks.spawn(async move {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            () = report_traffic(state, sender) => {}
        }
    });
    body
}

async fn report_traffic(state: std::sync::Weak<ServerState>, mut sender: Sender<Bytes>) {
    let mut before: HashMap<u64, TcpStats> = HashMap::new();
    loop {
        let Some((conns, diag)) = state
            .upgrade()
            .map(|s| (s.registry.summaries(), s.sock_diag.clone()))
        else {
            return;
        };
        let ports = tcpinfo::ports(&conns);
        let sockets = match tokio::task::spawn_blocking(move || diag.dump(&ports)).await {
            Ok(Ok(sockets)) => sockets,
            Ok(Err(e)) => {
                let _ = sender
                    .send_data(Bytes::from(format!("reading TCP statistics failed: {e}\n")))
                    .await;
                return;
            }
            Err(_) => return,
        };
        let mut out = String::new();
        let mut now = HashMap::with_capacity(conns.len());
        for conn in conns {
            let Some(cookie) = conn.tcp_socket.map(|t| t.cookie.get()) else {
                continue;
            };
            let Some(stats) = sockets.get(&cookie) else {
                continue;
            };
            let last = before.get(&cookie).copied().unwrap_or_default();
            if last.bytes_sent < stats.bytes_sent || last.bytes_received < stats.bytes_received {
                let _ = writeln!(
                    out,
                    "{{\"Sent\":{},\"Recv\":{},\"Key\":\"{}\"}}",
                    stats.bytes_sent, stats.bytes_received, conn.key
                );
            }
            now.insert(cookie, *stats);
        }
        before = now;
        out.push('\n');
        if sender.send_data(Bytes::from(out)).await.is_err() {
            return;
        }
        tokio::time::sleep(TRAFFIC_PERIOD).await;
    }
}

/// A whole number of seconds as Go's `time.Duration` prints it (`6s`, `1m30s`, `2h0m5s`).
fn go_seconds(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, min, sec) => format!("{min}m{sec}s"),
        (h, min, sec) => format!("{h}h{min}m{sec}s"),
    }
}

/// The host's name, as the kernel has it.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The HTTP exchange the tests of this and other modules run against the front.
#[cfg(test)]
pub(crate) use tests::ask;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uptime_reads_as_go_prints_it() {
        assert_eq!(go_seconds(Duration::from_millis(6400)), "6s");
        assert_eq!(go_seconds(Duration::from_secs(90)), "1m30s");
        assert_eq!(go_seconds(Duration::from_secs(7205)), "2h0m5s");
    }

    /// Sends `request` over loopback to the HTTP front, which is told the client is at
    /// `remote`, and returns what comes back (up to the first blank line after the head's
    /// body starts, for the streamed page).
    pub(crate) async fn ask(state: &Arc<ServerState>, remote: &str, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (stream, _) = accepted.expect("accept");
        tokio::spawn(crate::http::serve_conn(
            state.clone(),
            derp_io::Transport::Tcp(stream),
            remote.parse().expect("remote"),
            crate::listen::ConnGuard::none(),
            bytes::BytesMut::new(),
        ));
        let mut client = client.expect("connect");
        client.write_all(request.as_bytes()).await.expect("send");
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        let complete = |a: &[u8]| {
            let text = String::from_utf8_lossy(a);
            match text.split_once("\r\n\r\n") {
                // A chunked stream: its first report ends with an empty line.
                Some((head, body)) if head.contains("transfer-encoding: chunked") => {
                    body.contains("\n\r\n")
                }
                Some((head, body)) => head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|n| n.parse::<usize>().ok())
                    .is_some_and(|n| body.len() >= n),
                None => false,
            }
        };
        while !complete(&answer) {
            let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
                .await
                .expect("answer in time")
                .expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(answer).expect("text")
    }

    #[tokio::test]
    async fn every_page_serves_allowed_clients_and_refuses_others() {
        let mut config = crate::ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        config.debug_allow = vec!["10.0.0.0/8".parse().expect("cidr")];
        let state =
            Arc::new(ServerState::new(config, &prometheus::Registry::new()).expect("state"));
        let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: derp\r\n\r\n");
        for (path, body) in [
            ("/debug/", "<h1>derpd debug</h1>"),
            ("/debug/varz", "# TYPE derp_accepts counter"),
            ("/debug/check", CHECK_OK),
            ("/debug/traffic", "\r\n1\r\n\n\r\n"),
        ] {
            for remote in ["127.0.0.1:5000", "[::1]:5000", "10.1.2.3:5000"] {
                let answer = ask(&state, remote, &get(path)).await;
                assert!(
                    answer.starts_with("HTTP/1.1 200 OK\r\n"),
                    "{path} {remote}: {answer}"
                );
                assert!(answer.contains(body), "{path} {remote}: {answer}");
            }
            for remote in ["192.0.2.1:5000", "[2001:db8::1]:5000", "11.0.0.1:5000"] {
                let answer = ask(&state, remote, &get(path)).await;
                assert!(
                    answer.starts_with("HTTP/1.1 403 Forbidden\r\n"),
                    "{path} {remote}: {answer}"
                );
                assert!(
                    answer.ends_with("\r\n\r\ndebug access denied\n"),
                    "{path}: {answer}"
                );
            }
            // Through a proxy on the same host: refused as well.
            let proxied =
                format!("GET {path} HTTP/1.1\r\nHost: derp\r\nX-Forwarded-For: 192.0.2.1\r\n\r\n");
            let answer = ask(&state, "127.0.0.1:5000", &proxied).await;
            assert!(
                answer.starts_with("HTTP/1.1 403"),
                "{path} proxied: {answer}"
            );
        }
        let answer = ask(&state, "192.0.2.1:5000", &get("/debug")).await;
        assert!(answer.starts_with("HTTP/1.1 307"), "{answer}");
        assert!(answer.contains("location: /debug/\r\n"), "{answer}");
        let answer = ask(&state, "127.0.0.1:5000", &get("/debug/nosuch")).await;
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
        let answer = ask(&state, "192.0.2.1:5000", &get("/debug/nosuch")).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        state.shutdown.cancel();
    }

    #[tokio::test]
    async fn the_check_fails_with_a_500_naming_what_disagrees() {
        let state = ServerState::for_tests();
        state.metrics.current_connections.inc();
        let answer = ask(
            &state,
            "127.0.0.1:5000",
            "GET /debug/check HTTP/1.1\r\nHost: d\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
        assert!(
            answer.ends_with("\r\n\r\nderp_current_connections = 1 != client map says 0\n"),
            "{answer}"
        );
    }

    #[test]
    fn the_index_names_the_node_and_links_every_page() {
        let mut config = crate::ServerConfig::new(derp_proto::SecretKey::from_bytes([1; 32]));
        config.debug_info = vec![("TLS hostname".into(), "derp<1>.example".into())];
        let state = ServerState::new(config, &prometheus::Registry::new()).expect("state");
        let page = index(&state);
        assert!(page.starts_with("<html><body><h1>derpd debug</h1><ul><li><b>Uptime:</b> "));
        assert!(page.contains("<li><b>TLS hostname:</b> derp&lt;1&gt;.example</li>"));
        assert!(page.contains("<li><b>Mesh key:</b> false</li>"));
        for path in ["/debug/varz", "/debug/check", "/debug/traffic"] {
            assert!(
                page.contains(&format!("<a href=\"{path}\">{path}</a>")),
                "{path}"
            );
        }
    }
}
