//! Lookup layers under every flag combination, and metrics read through real scrapes.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use derp_server::{LookupConfig, PeerCacheConfig, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::{RawClient, STEP, TestServer};

/// GETs `path` over a fresh connection and returns (status code, body).
pub(crate) async fn http_get(addr: SocketAddr, path: &str, extra_headers: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra_headers}\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(STEP, s.read_to_end(&mut out))
        .await
        .expect("response in time")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of an unlabelled sample in Prometheus text.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            (n == name).then(|| v.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("{name} not in scrape"))
}

/// Metric family names in a scrape (histogram series folded to their family).
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with("# TYPE "))
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .collect()
}

async fn scrape(srv: &TestServer) -> String {
    let (status, body) = http_get(srv.addr, "/debug/varz", "").await;
    assert_eq!(status, 200);
    body
}

#[tokio::test]
async fn every_lookup_mode_relays_the_same_traffic_and_counts_its_misses() {
    // (mirror, lru, expected mirror misses, expected LRU misses) for the traffic below:
    // three flows between local clients plus one packet to an absent key.
    let modes = [
        (false, false, 0.0, 0.0),
        (false, true, 0.0, 4.0),
        (true, false, 1.0, 0.0),
        (true, true, 1.0, 1.0),
    ];
    for (mirror, lru, want_mirror, want_lru) in modes {
        let config = ServerConfig {
            lookup: LookupConfig {
                mirror,
                peer_cache: lru.then(PeerCacheConfig::default),
            },
            ..ServerConfig::new(derp_testkit::server_secret())
        };
        let srv = TestServer::start(config).await;
        let mut a = RawClient::connect(srv.addr).await;
        let mut b = RawClient::connect(srv.addr).await;
        let mut c = RawClient::connect(srv.addr).await;
        for i in 0..10u8 {
            a.send_packet(b.key, &[i; 100]).await;
            a.send_packet(c.key, &[i; 200]).await;
        }
        for i in 0..5u8 {
            b.send_packet(a.key, &[i; 300]).await;
        }
        a.send_packet(derp_proto::PublicKey::from_bytes([0xee; 32]), b"nobody")
            .await;
        for i in 0..10u8 {
            assert_eq!(b.recv_packet().await, (a.key, vec![i; 100]));
            assert_eq!(c.recv_packet().await, (a.key, vec![i; 200]));
        }
        for i in 0..5u8 {
            assert_eq!(a.recv_packet().await, (b.key, vec![i; 300]));
        }
        // Counters are folded after each read batch; wait for all 26 to show.
        let mut text = scrape(&srv).await;
        let deadline = tokio::time::Instant::now() + STEP;
        while sample(&text, "derp_packets_received") < 26.0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "counts never folded"
            );
            tokio::task::yield_now().await;
            text = scrape(&srv).await;
        }
        let what = format!("mirror={mirror} lru={lru}");
        assert_eq!(sample(&text, "derp_packets_received"), 26.0, "{what}");
        assert_eq!(
            sample(&text, "derp_peer_lookup_mirror_misses"),
            want_mirror,
            "{what}"
        );
        assert_eq!(
            sample(&text, "derp_peer_lookup_cache_misses"),
            want_lru,
            "{what}"
        );
        srv.stop().await;
    }
}

#[tokio::test]
async fn debug_varz_is_refused_through_proxies_and_metrics_listener_serves() {
    let srv = TestServer::start_default().await;
    // A reverse proxy on this host connects from loopback; whichever header it adds, and in
    // whatever case, the request is refused.
    for (i, header) in [
        "X-Forwarded-For: 127.0.0.1",
        "X-Forwarded-Host: derp.example.com",
        "X-Forwarded-Proto: https",
        "Forwarded: for=192.0.2.60;proto=https",
        "Via: 1.1 proxy",
        "X-Real-IP: 192.0.2.60",
        "True-Client-IP: 192.0.2.60",
        "X-Client-IP: 192.0.2.60",
        "Client-IP: 192.0.2.60",
        "CF-Connecting-IP: 192.0.2.60",
        "Fastly-Client-IP: 192.0.2.60",
        "X-Cluster-Client-IP: 192.0.2.60",
        "X-Original-Forwarded-For: 192.0.2.60",
        "X-Envoy-External-Address: 192.0.2.60",
    ]
    .into_iter()
    .enumerate()
    {
        let header = match i % 3 {
            0 => header.to_owned(),
            1 => header.to_lowercase(),
            _ => header.to_uppercase(),
        };
        let (status, body) = http_get(srv.addr, "/debug/varz", &format!("{header}\r\n")).await;
        assert_eq!(status, 403, "{header}");
        assert!(!body.contains("derp_"), "{header}: {body}");
    }
    // Without them, loopback is served.
    assert!(scrape(&srv).await.contains("derp_accepts"));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let maddr = listener.local_addr().expect("addr");
    let server = srv.server.clone();
    let task = tokio::spawn(async move { server.serve_metrics(listener).await });
    let (status, body) = http_get(maddr, "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(body.contains("derp_build_info{version="));
    assert_eq!(http_get(maddr, "/debug/varz", "").await.0, 404);
    srv.stop().await;
    task.await.expect("join").expect("metrics listener");
}

#[tokio::test]
async fn debug_varz_honours_allowed_networks() {
    // Loopback is always allowed; an allow-list that excludes loopback changes nothing for
    // it, and the handler answers 403 for everything else (checked in the unit tests of the
    // CIDR type). Here: a scrape from loopback works with a non-matching allow-list.
    let srv = TestServer::start(ServerConfig {
        debug_allow: vec!["100.64.0.0/10".parse().expect("cidr")],
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    assert!(scrape(&srv).await.contains("derp_accepts"));
    srv.stop().await;
}

#[tokio::test]
async fn every_metric_the_dashboard_and_alerts_query_exists_in_a_real_scrape() {
    let dashboard: serde_json::Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/derpd.json"
    )))
    .expect("dashboard is JSON");
    let srv = TestServer::start_default().await;
    // STUN counters live on the same registry in derpd; register them as derpd does.
    let _stun = derp_server::StunMetrics::new(&srv.registry).expect("stun metrics");
    // And the TLS front's, on a TLS node.
    let _tls = derp_tls::TlsFront::new(
        &srv.server.public_key(),
        derp_tls::TlsOptions::new("127.0.0.1"),
        &srv.registry,
    )
    .expect("tls metrics");
    // So do the mesh's, with one link (here to the node itself, which it recognises).
    let mesh = derp_mesh::Mesh::start(
        &srv.server,
        derp_mesh::MeshConfig::new(
            derp_testkit::server_secret(),
            derp_proto::MeshKey::from_bytes([1; 32]),
        ),
        derp_mesh::parse_mesh_with(&format!("http://{}/derp", srv.addr)).expect("entry"),
        &srv.registry,
    )
    .expect("mesh metrics");
    // Some traffic, so every family has samples.
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    a.send_packet(b.key, b"hello").await;
    b.recv_packet().await;
    let scraped = families(&scrape(&srv).await);

    let mut queried = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        // Rows group panels and query nothing.
        let no_targets = Vec::new();
        let targets = match panel["type"].as_str() {
            Some("row") => &no_targets,
            _ => panel["targets"].as_array().expect("targets"),
        };
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if token.starts_with("derp_")
                    || token.starts_with("process_")
                    || token.starts_with("stun_")
                {
                    queried.insert(token.to_owned());
                }
            }
        }
    }
    assert!(
        queried.len() > 15,
        "dashboard queries too little: {queried:?}"
    );
    // The alerting rules shipped beside it must query real metrics too.
    let alerts = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/prometheus/alerts.yml"
    ));
    for line in alerts
        .lines()
        .filter(|l| l.trim_start().starts_with("expr:"))
    {
        for token in line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if token.starts_with("derp_") || token.starts_with("process_") {
                queried.insert(token.to_owned());
            }
        }
    }
    for name in &queried {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            scraped.contains(family),
            "dashboard queries {name}, which the server does not export"
        );
    }
    mesh.shutdown().await;
    srv.stop().await;
}

#[tokio::test]
async fn metrics_listener_answers_readiness_and_liveness() {
    let srv = TestServer::start_default().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let maddr = listener.local_addr().expect("addr");
    let server = srv.server.clone();
    let task = tokio::spawn(async move { server.serve_metrics(listener).await });
    // Not ready until the embedder says so (derpd: listening, and a certificate with TLS);
    // alive all along.
    assert_eq!(http_get(maddr, "/derp/probe", "").await.0, 503);
    assert_eq!(http_get(maddr, "/healthz", "").await.0, 200);
    srv.server.set_ready(true);
    assert_eq!(http_get(maddr, "/derp/probe", "").await.0, 200);
    assert_eq!(http_get(maddr, "/healthz", "").await.0, 200);
    srv.server.set_ready(false);
    assert_eq!(http_get(maddr, "/derp/probe", "").await.0, 503);
    srv.stop().await;
    task.await.expect("join").expect("metrics listener");
}
