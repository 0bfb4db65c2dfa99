//! Running real derpd processes on loopback for the multi-process tests: start, wait for
//! readiness by probing (log lines, metrics), signal, kill, restart, and clients.
//!
//! These tests live in derpd's package because Cargo hands the path of the built binary
//! (`CARGO_BIN_EXE_derpd`) only to the integration tests of the package that owns it.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::{PeerGoneReason, PublicKey, SecretKey};

pub mod faults;

pub const DERPD: &str = env!("CARGO_BIN_EXE_derpd");
/// How long any single expected event may take before a test fails.
pub const STEP: Duration = Duration::from_secs(20);

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "derpd-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `contents` to `name` (making its directories) and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path(name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("dir");
        }
        std::fs::write(&path, contents).expect("write");
        path
    }

    /// [`TempDir::write`], the path as a string for a command line.
    pub fn file(&self, name: &str, contents: &str) -> String {
        self.write(name, contents).display().to_string()
    }

    /// File names in the directory, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port on 127.0.0.1 that was free a moment ago, for nodes whose siblings must know their
/// address before they start.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A fresh mesh key file (64 hex digits and a newline, as operators write them).
pub fn write_mesh_key(path: &Path) -> String {
    let key: [u8; 32] = rand::random();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(path, format!("  {hex}\n")).expect("write mesh key");
    hex
}

/// A running derpd. Killed and reaped on drop.
pub struct Node {
    pub child: Option<Child>,
    /// The listening address it logged.
    pub addr: SocketAddr,
    /// The `--metrics-addr` listener, when started with one (TLS nodes are scraped there).
    pub metrics_addr: Option<SocketAddr>,
    /// Every stderr line so far, for diagnostics and log checks.
    log: Arc<Mutex<Vec<String>>>,
    lines: mpsc::Receiver<String>,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
}

impl Node {
    /// Starts derpd with `args` (which must include `-a`) and waits for its listening line.
    pub fn start(args: &[String]) -> Self {
        Self::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[String], envs: &[(String, String)]) -> Self {
        Self::start_wrapped(&[], args, envs)
    }

    /// Like [`Node::start_with_env`], with the command prefixed by `wrapper` (e.g.
    /// `ip netns exec NAME`).
    pub fn start_wrapped(wrapper: &[String], args: &[String], envs: &[(String, String)]) -> Self {
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(DERPD);
                c
            }
            None => Command::new(DERPD),
        };
        cmd.args(["--stun-port", "0", "--log-format", "json"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // An empty value removes the variable (e.g. SSL_CERT_DIR, for a known trust store).
        for (k, v) in envs {
            if v.is_empty() {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let mut child = cmd.spawn().expect("spawn derpd");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("log").push(line.clone());
                let _ = tx.send(line);
            }
        });
        let mut node = Self {
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_addr: None,
            log,
            lines: rx,
            args: args.to_vec(),
            envs: envs.to_vec(),
        };
        let addr = node.wait_log("the listening line", |v| {
            let msg = v["fields"]["message"].as_str()?;
            msg.starts_with("derpd listening")
                .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
        });
        node.addr = addr.parse().expect("listening address");
        if args.iter().any(|a| a == "--metrics-addr") {
            // Logged before or after the listening line, depending on the mode.
            let pick = |v: &serde_json::Value| {
                (v["fields"]["message"].as_str()? == "metrics listening at /metrics")
                    .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
            };
            let seen = node
                .log
                .lock()
                .expect("log")
                .iter()
                .find_map(|l| serde_json::from_str(l).ok().and_then(|v| pick(&v)));
            let found = match seen {
                Some(a) => a,
                None => node.wait_log("the metrics listener", pick),
            };
            node.metrics_addr = Some(found.parse().expect("metrics address"));
        }
        node
    }

    /// Waits for a JSON log line for which `pick` returns something.
    pub fn wait_log<T>(&mut self, what: &str, pick: impl Fn(&serde_json::Value) -> Option<T>) -> T {
        let deadline = Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(l) => l,
                Err(e) => panic!("waiting for {what}: {e}; log:\n{}", self.log_text()),
            };
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                && let Some(t) = pick(&v)
            {
                return t;
            }
        }
    }

    /// Waits for a log line whose message starts with `prefix`.
    pub fn wait_message(&mut self, prefix: &str) {
        self.wait_log(prefix, |v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(prefix))
                .then_some(())
        });
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }

    pub fn url(&self) -> String {
        format!("http://{}/derp", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends a signal by name ("TERM", "INT", "KILL").
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit, polling on a short interval, for at most `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "derpd did not exit within {within:?}; log:\n{}",
                self.log_text()
            );
            std::thread::park_timeout(Duration::from_millis(10));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().expect("try_wait").is_none())
    }

    /// Starts the same command again (same port, same key file).
    pub fn restart(&mut self) {
        self.kill();
        *self = Self::start_with_env(&self.args.clone(), &self.envs.clone());
    }

    /// Prometheus text from `/debug/varz` (loopback may read it), or from `/metrics` on the
    /// metrics listener when there is one.
    pub fn scrape(&self) -> String {
        let (addr, path) = match self.metrics_addr {
            Some(m) => (m, "/metrics"),
            None => (self.addr, "/debug/varz"),
        };
        let mut s = TcpStream::connect(addr).expect("connect for scrape");
        s.set_read_timeout(Some(STEP)).expect("timeout");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read scrape");
        out
    }

    /// Sum of the samples of `name` whose labels include every `labels` pair; None if there
    /// is no such sample.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        sample(&self.scrape(), name, labels)
    }

    /// Polls a metric until `ok` holds for it.
    pub fn wait_metric(&self, name: &str, labels: &[(&str, &str)], ok: impl Fn(f64) -> bool) {
        let deadline = Instant::now() + STEP;
        loop {
            let v = self.metric(name, labels);
            if v.is_some_and(&ok) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} {name}{labels:?} stayed at {v:?}; log:\n{}",
                self.addr,
                self.log_text()
            );
            std::thread::park_timeout(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sum of the samples of `name` with all of `labels` in a Prometheus text page.
pub fn sample(page: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_part, value) = if let Some(r) = rest.strip_prefix('{') {
            let Some((l, v)) = r.split_once('}') else {
                continue;
            };
            (l, v)
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue;
        };
        if !labels
            .iter()
            .all(|(k, v)| label_part.contains(&format!("{k}=\"{v}\"")))
        {
            continue;
        }
        if let Ok(v) = value.trim().parse::<f64>() {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// A region of `n` derpd nodes on 127.0.0.1, each listing every node (itself included) in
/// `--mesh-with` by URL.
pub struct Region {
    pub nodes: Vec<Node>,
    pub dir: TempDir,
}

impl Region {
    pub fn start(n: usize, extra: &[&str]) -> Self {
        let dir = TempDir::new("region");
        let mesh_key = dir.path("mesh.key");
        write_mesh_key(&mesh_key);
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let mesh_with = ports
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}/derp"))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let mut args: Vec<String> = vec![
                    "-a".into(),
                    format!("127.0.0.1:{port}"),
                    "-c".into(),
                    dir.path(&format!("node{i}.key")).display().to_string(),
                    "--mesh-psk-file".into(),
                    mesh_key.display().to_string(),
                    "--mesh-with".into(),
                    mesh_with.clone(),
                ];
                args.extend(extra.iter().map(|s| s.to_string()));
                Node::start(&args)
            })
            .collect();
        Self { nodes, dir }
    }

    /// Waits until every node has a link up to every other.
    pub fn wait_meshed(&self) {
        let others = (self.nodes.len() - 1) as f64;
        for node in &self.nodes {
            node.wait_metric("derp_mesh_links_up", &[], |v| v == others);
        }
    }

    /// Waits until every node knows `clients` keys region-wide besides the nodes' own: each
    /// node's own key reaches it through its siblings, so a region of n nodes and m clients
    /// counts n + m keys on every node.
    pub fn wait_known(&self, clients: usize) {
        let want = (self.nodes.len() + clients) as f64;
        for node in &self.nodes {
            node.wait_metric("derp_clients_total", &[], |v| v == want);
        }
    }
}

/// A client of a node, over plain HTTP.
pub async fn client(url: &str, secret: SecretKey) -> Client {
    let config = ClientConfig::new(url, secret)
        .expect("client config")
        .with_connect_timeout(STEP);
    Client::connect(&config).await.expect("client connects")
}

pub fn secret() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}

/// Receives until a frame `pick` accepts, within [`STEP`]; other frames are skipped.
pub async fn recv_until<T>(
    c: &mut Client,
    what: &str,
    mut pick: impl FnMut(&ReceivedFrame) -> Option<T>,
) -> T {
    let wait = async {
        loop {
            let frame = c
                .recv()
                .await
                .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
            if let Some(t) = pick(&frame) {
                return t;
            }
        }
    };
    tokio::time::timeout(STEP, wait)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// Waits for a packet from `src` with these bytes.
pub async fn expect_packet(c: &mut Client, src: PublicKey, payload: &[u8]) {
    recv_until(c, "a packet", |f| match f {
        ReceivedFrame::RecvPacket { src: s, packet } if *s == src && packet[..] == *payload => {
            Some(())
        }
        _ => None,
    })
    .await
}

/// Waits for PeerGone(peer, Disconnected).
pub async fn expect_gone(c: &mut Client, peer: PublicKey) {
    recv_until(c, "PeerGone", |f| match f {
        ReceivedFrame::PeerGone { peer: p, reason } if *p == peer => {
            assert_eq!(*reason, PeerGoneReason::Disconnected);
            Some(())
        }
        _ => None,
    })
    .await
}

/// Waits until the server ends the client's connection.
pub async fn expect_closed(c: &mut Client) {
    let wait = async {
        loop {
            if c.recv().await.is_err() {
                return;
            }
        }
    };
    tokio::time::timeout(STEP, wait)
        .await
        .expect("the server closed the connection");
}
