//! Shared test scaffolding: a real server on 127.0.0.1:0, and helpers for raw HTTP and
//! floods from many loopback sources.
//!
//! The byte-level DERP client is derp-testkit's ([`RawClient`]), so tests can check exact
//! bytes and send malformed input; higher-level tests use `derp-client`.

use std::net::SocketAddr;
use std::time::Duration;

use derp_server::{Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

pub(crate) use derp_testkit::raw::{RawClient, STEP, plain_info};

pub(crate) struct TestServer {
    pub(crate) server: Server,
    pub(crate) addr: SocketAddr,
    pub(crate) registry: prometheus::Registry,
    task: JoinHandle<()>,
}

impl TestServer {
    pub(crate) async fn start(config: ServerConfig) -> Self {
        derp_testkit::init_tracing();
        let registry = prometheus::Registry::new();
        let server = Server::new(config, &registry).expect("server");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s = server.clone();
        let task = tokio::spawn(async move {
            s.serve(listener).await.expect("serve");
        });
        Self {
            server,
            addr,
            registry,
            task,
        }
    }

    /// A server with the reference vectors' key and default settings.
    pub(crate) async fn start_default() -> Self {
        Self::start(ServerConfig::new(derp_testkit::server_secret())).await
    }

    /// Value of a metric sample, e.g. `metric("derp_packets_dropped", &[("reason","queue_head"),("kind","other")])`.
    pub(crate) fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        for family in self.registry.gather() {
            if family.name() != name {
                continue;
            }
            for m in family.get_metric() {
                let matches = labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                });
                if !matches {
                    continue;
                }
                return match family.get_field_type() {
                    prometheus::proto::MetricType::COUNTER => m.get_counter().get_value(),
                    prometheus::proto::MetricType::GAUGE => m.get_gauge().get_value(),
                    other => panic!("metric {name} has unsupported type {other:?}"),
                };
            }
        }
        panic!("metric {name} {labels:?} not found");
    }

    /// Like [`TestServer::metric`], but 0 for a labelled counter not created yet.
    pub(crate) fn metric_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let exists = self.registry.gather().iter().any(|f| {
            f.name() == name
                && f.get_metric().iter().any(|m| {
                    labels.iter().all(|(k, v)| {
                        m.get_label()
                            .iter()
                            .any(|l| l.name() == *k && l.value() == *v)
                    })
                })
        });
        if exists {
            self.metric(name, labels)
        } else {
            0.0
        }
    }

    /// Waits until `cond` holds, polling the server's state; fails the test after [`STEP`].
    pub(crate) async fn eventually(&self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + STEP;
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        while !cond(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tick.tick().await;
        }
    }

    pub(crate) async fn stop(self) {
        self.server.shutdown().await;
        self.task.abort();
    }
}

/// A packet that looks like a disco message to the server (magic + at least 62 bytes).
pub(crate) fn disco_packet() -> Vec<u8> {
    let mut p = "TS💬".as_bytes().to_vec();
    p.resize(62, 7);
    p
}

/// A complete frame: 5-byte header for type `ty` and `body`.
pub(crate) fn raw_frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(ty);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// A parsed HTTP response.
#[derive(Debug)]
pub(crate) struct HttpResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `request` verbatim on a new connection and reads the response until the server
/// closes (requests should carry `Connection: close`). Bodies are read by Content-Length
/// when given, so HEAD and 204 responses work too.
pub(crate) async fn http_exchange(addr: SocketAddr, request: &str) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(STEP, stream.read_to_end(&mut raw))
        .await
        .expect("timed out reading response")
        .expect("read response");
    parse_http_response(&raw)
}

/// Parses one HTTP/1.1 response from `raw` (head and the rest as body).
pub(crate) fn parse_http_response(raw: &[u8]) -> HttpResponse {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    HttpResponse {
        status,
        headers,
        body: raw[end + 4..].to_vec(),
    }
}

/// Opens a TCP connection to `addr` from `source` (any 127.0.0.0/8 address works on
/// loopback), so that tests can play many distinct hosts.
pub(crate) async fn connect_from(addr: SocketAddr, source: std::net::Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from((source, 0)))
        .expect("bind to a loopback source");
    socket.connect(addr).await.expect("connect")
}

/// The `i`th of a round of flood sources: 127.<round+1>.<i / 250>.<i % 250 + 2>, never
/// 127.0.0.1, which the good clients use.
pub(crate) fn flood_source(round: u8, i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, round + 1, (i / 250) as u8, (i % 250) as u8 + 2)
}

/// Reads until EOF or reset; fails if the server keeps the connection open past [`STEP`].
pub(crate) async fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    let closed = async {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    };
    tokio::time::timeout(STEP, closed)
        .await
        .expect("server kept the connection open");
    got
}
