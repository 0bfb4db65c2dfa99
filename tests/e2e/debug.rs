//! The `/debug/` pages and `derp_tcp_rtt` with real clients on loopback.

use std::collections::HashMap;
use std::time::Duration;

use derp_server::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::{RawClient, STEP, TestServer};
use crate::metrics::http_get;
use crate::tls::{TempDir, within};

/// The RTT labels derper counts samples under.
const RTT_LABELS: [&str; 8] = [
    "10ms", "20ms", "50ms", "100ms", "150ms", "250ms", "500ms", "inf",
];

fn rtt_samples(srv: &TestServer, label: &str) -> f64 {
    srv.metric_or_zero("derp_tcp_rtt", &[("le", label)])
}

#[tokio::test]
async fn live_connections_are_sampled_into_derp_tcp_rtt_and_listed_by_debug_traffic() {
    let srv = TestServer::start(ServerConfig {
        tcp_rtt_interval: Some(Duration::from_millis(50)),
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let mut a = RawClient::connect(srv.addr).await;
    let mut b = RawClient::connect(srv.addr).await;
    a.send_packet(b.key, b"hello").await;
    assert_eq!(b.recv_packet().await, (a.key, b"hello".to_vec()));

    // Each connection is checked once, then sampled every period.
    srv.eventually("two samples of each connection", |s| {
        RTT_LABELS.iter().map(|l| rtt_samples(s, l)).sum::<f64>() >= 4.0
    })
    .await;
    assert_eq!(rtt_samples(&srv, "error"), 0.0, "the kernel had statistics");
    assert_eq!(rtt_samples(&srv, "non-tcp"), 0.0, "both are TCP clients");
    // Which label a sample lands under depends on the round trip at the moment, which no
    // loopback test controls (the label for a given RTT is tcpinfo's unit test); what holds
    // whatever the timing is that every sample is under one of derper's labels.
    let counted = RTT_LABELS.iter().map(|l| rtt_samples(&srv, l)).sum::<f64>();
    let scrape = http_get(srv.addr, "/debug/varz", "").await.1;
    assert!(scrape.contains("# TYPE derp_tcp_rtt counter"), "{scrape}");
    let mut in_scrape = 0.0;
    for line in scrape.lines() {
        let Some(rest) = line.strip_prefix("derp_tcp_rtt{le=\"") else {
            continue;
        };
        let (label, value) = rest.split_once("\"} ").expect("a sample line");
        assert!(
            RTT_LABELS.contains(&label),
            "a sample under {label:?}: {scrape}"
        );
        in_scrape += value.parse::<f64>().expect("a count");
    }
    assert!(
        in_scrape >= counted && counted >= 4.0,
        "{in_scrape} in the scrape, {counted} before it"
    );

    // /debug/traffic: a line per connection with the kernel's byte counts, keyed by client.
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    s.write_all(b"GET /debug/traffic HTTP/1.1\r\nHost: derp\r\n\r\n")
        .await
        .expect("request");
    let mut seen: HashMap<String, (u64, u64)> = HashMap::new();
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    while seen.len() < 2 {
        let n = tokio::time::timeout(STEP, s.read(&mut buf))
            .await
            .expect("a report in time")
            .expect("read");
        assert!(n > 0, "stream ended: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
                continue;
            };
            let key = v["Key"].as_str().expect("Key").to_owned();
            let counts = (
                v["Sent"].as_u64().expect("Sent"),
                v["Recv"].as_u64().expect("Recv"),
            );
            seen.insert(key, counts);
        }
    }
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    for client in [&a, &b] {
        let (sent, recv) = seen[&client.key.to_string()];
        // Every client got at least the ServerKey and ServerInfo frames, and sent its
        // ClientInfo.
        assert!(sent > 40 && recv > 40, "{}: {sent} {recv}", client.key);
    }
    drop(s);

    let (status, body) = http_get(srv.addr, "/debug/check", "").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "derp.Server ConsistencyCheck okay")
    );
    drop((a, b));
    srv.stop().await;
}

/// The kernel's statistics are asked for by the ports the relay's connections were accepted
/// on: a listener added after the relay started (a TLS front, as derpd adds one) is covered
/// without being announced, and its connections are sampled like the first listener's.
#[tokio::test]
async fn connections_of_a_listener_added_later_are_sampled_too() {
    let srv = TestServer::start(ServerConfig {
        tcp_rtt_interval: Some(Duration::from_millis(50)),
        ..ServerConfig::new(derp_testkit::server_secret())
    })
    .await;
    let dir = TempDir::new("rtt-tls");
    let front = derp_tls::TlsFront::new(
        &srv.server.public_key(),
        derp_tls::TlsOptions::new("127.0.0.1"),
        &srv.registry,
    )
    .expect("front");
    let pin = derp_tls::ManualCerts::new(front.clone(), &dir.0)
        .load_or_generate()
        .expect("certificate")
        .expect("a self-signed certificate for an IP hostname")
        .pin;
    let tls_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let tls_addr = tls_listener.local_addr().expect("addr");
    let tls_task = {
        let server = srv.server.clone();
        tokio::spawn(async move { front.serve(&server, tls_listener).await.expect("tls serve") })
    };

    let plain = RawClient::connect(srv.addr).await;
    let tls_config = derp_client::ClientConfig::new(
        &format!("https://127.0.0.1:{}/derp", tls_addr.port()),
        derp_proto::SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_cert_name(pin)
    .with_connect_timeout(STEP);
    let tls = within("TLS client", derp_client::Client::connect(&tls_config))
        .await
        .expect("TLS 1.3 client");
    srv.eventually("both clients registered", |s| {
        s.metric("derp_current_connections", &[]) == 2.0
    })
    .await;
    // Two periods after both registered: each was checked (and found, or counted as an
    // error) at the first, and sampled at the second.
    let samples = |s: &TestServer| RTT_LABELS.iter().map(|l| rtt_samples(s, l)).sum::<f64>();
    let before = samples(&srv);
    srv.eventually("two more periods of samples, or an error", |s| {
        samples(s) >= before + 4.0 || rtt_samples(s, "error") > 0.0
    })
    .await;
    assert_eq!(
        rtt_samples(&srv, "error"),
        0.0,
        "the kernel's statistics of both listeners' connections were read"
    );
    assert_eq!(rtt_samples(&srv, "non-tcp"), 0.0, "both are TCP clients");
    drop((plain, tls));
    srv.stop().await;
    within("TLS listener stops", tls_task)
        .await
        .expect("TLS task");
}
