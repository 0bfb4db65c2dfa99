//! Running real derpd processes on loopback for the multi-process tests: start (under limits
//! or in a namespace, too), wait for readiness by probing (log lines, metrics), signal, kill,
//! restart, and clients; temporary directories.
//!
//! These tests live in derpd's package because Cargo hands the path of the built binary
//! (`CARGO_BIN_EXE_derpd`) only to the integration tests of the package that owns it.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::{PeerGoneReason, PublicKey, SecretKey};

pub mod faults;
mod process;

#[allow(unused_imports)]
pub use process::{Launch, Process, derpd_command, require_tool, run_to_exit};

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

/// Flags for an IP-only dev node on an ephemeral loopback port in manual mode, its
/// self-signed certificate in `certdir`: no port-80 listener, no periodic reload.
pub fn manual_ip_args(certdir: &str) -> Vec<&str> {
    vec![
        "--dev",
        "-a",
        "127.0.0.1:0",
        "--certmode",
        "manual",
        "--hostname",
        "127.0.0.1",
        "--http-port",
        "-1",
        "--cert-reload-interval",
        "0",
        "--certdir",
        certdir,
    ]
}

/// Sets `flag` to `value` in `args`: its value replaced where it is given, else both added.
pub fn set_flag<'a>(args: &mut Vec<&'a str>, flag: &'a str, value: &'a str) {
    match args.iter().position(|a| *a == flag) {
        Some(at) if at + 1 < args.len() => args[at + 1] = value,
        _ => args.extend([flag, value]),
    }
}

/// A running derpd, with the addresses it logged. Killed and reaped on drop; everything a
/// [`Process`] does, it does.
pub struct Node {
    pub process: Process,
    /// The listening address it logged.
    pub addr: SocketAddr,
    /// The `--metrics-addr` listener, when started with one (TLS nodes are scraped there).
    pub metrics_addr: Option<SocketAddr>,
    pub launch: Launch,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
}

impl Deref for Node {
    type Target = Process;

    fn deref(&self) -> &Process {
        &self.process
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Process {
        &mut self.process
    }
}

impl Node {
    /// Starts derpd with `args` (which must include `-a`) and waits for its listening line.
    pub fn start(args: &[impl AsRef<str>]) -> Self {
        Self::start_with(&Launch::plain(), args, &[])
    }

    pub fn start_with_env(args: &[impl AsRef<str>], envs: &[(String, String)]) -> Self {
        Self::start_with(&Launch::plain(), args, envs)
    }

    /// Starts derpd as `launch` says, with `args` and the environment changed by `envs` (an
    /// empty value removes the variable, e.g. SSL_CERT_DIR, for a known trust store). Logs
    /// are JSON; STUN is on an ephemeral port unless `args` set STUN up themselves.
    pub fn start_with(
        launch: &Launch,
        args: &[impl AsRef<str>],
        envs: &[(String, String)],
    ) -> Self {
        let args: Vec<String> = args.iter().map(|a| a.as_ref().to_owned()).collect();
        let mut full = vec!["--log-format".to_owned(), "json".to_owned()];
        if !args.iter().any(|a| a.starts_with("--stun")) {
            full.extend(["--stun-port".to_owned(), "0".to_owned()]);
        }
        full.extend(args.iter().cloned());
        let mut cmd = derpd_command(launch, &full);
        for (k, v) in envs {
            if v.is_empty() {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let process = Process::spawn(cmd);
        let addr = process.wait_log("the listening line", |v| {
            let msg = v["fields"]["message"].as_str()?;
            msg.starts_with("derpd listening")
                .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
        });
        let metrics_addr = args.iter().any(|a| a == "--metrics-addr").then(|| {
            // Logged before or after the listening line, depending on the mode.
            let found = process.find_log("the metrics listener", |v| {
                (v["fields"]["message"].as_str()? == "metrics listening at /metrics")
                    .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
            });
            found.parse().expect("metrics address")
        });
        Self {
            process,
            addr: addr.parse().expect("listening address"),
            metrics_addr,
            launch: launch.clone(),
            args,
            envs: envs.to_vec(),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/derp", self.addr)
    }

    /// Starts the same command again (same port, same key file).
    pub fn restart(&mut self) {
        self.kill();
        *self = Self::start_with(&self.launch.clone(), &self.args.clone(), &self.envs.clone());
    }

    /// Prometheus text from `/debug/varz` (loopback may read it), or from `/metrics` on the
    /// metrics listener when there is one; the HTTP head included.
    pub fn scrape(&self) -> String {
        match self.metrics_addr {
            Some(m) => http_get(m, "/metrics"),
            None => http_get(self.addr, "/debug/varz"),
        }
    }

    /// Sum of the samples of `name` whose labels include every `labels` pair; None if there
    /// is no such sample.
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        sample(&self.scrape(), name, labels)
    }

    /// Polls a metric until `ok` holds for it.
    pub fn wait_metric(&self, name: &str, labels: &[(&str, &str)], ok: impl Fn(f64) -> bool) {
        let last = std::cell::Cell::new(None);
        wait_until(
            STEP,
            || {
                let v = self.metric(name, labels);
                last.set(v);
                v.is_some_and(&ok).then_some(())
            },
            || {
                format!(
                    "{} {name}{labels:?} stayed at {:?}; log:\n{}",
                    self.addr,
                    last.get(),
                    self.log_text()
                )
            },
        );
    }
}

/// Waits up to `within` for process `pid` to exit, woken by the exit itself (a pidfd turns
/// readable then, reaped or not); `false` if it still runs. Falls back to polling where the
/// kernel has no pidfds.
pub fn exits_within(pid: u32, within: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let pidfd = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .map(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()));
    let pidfd = match pidfd {
        Some(Ok(fd)) => fd,
        // Gone already (reaped).
        Some(Err(rustix::io::Errno::SRCH)) => return true,
        _ => {
            let deadline = Instant::now() + within;
            let gone = || !Path::new(&format!("/proc/{pid}")).exists();
            while !gone() && Instant::now() < deadline {
                std::thread::park_timeout(Duration::from_millis(10));
            }
            return gone();
        }
    };
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout = Timespec::try_from(left).expect("a timeout");
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(n) => return n > 0,
            Err(rustix::io::Errno::INTR) if !left.is_zero() => {}
            Err(e) => panic!("waiting for {pid}: {e}"),
        }
    }
}

/// Polls `poll` until it returns something, for at most `within`, then fails with
/// `failure`'s message: for what no event of the test's own announces (another process's
/// state, a metric).
pub fn wait_until<T>(
    within: Duration,
    mut poll: impl FnMut() -> Option<T>,
    failure: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = poll() {
            return t;
        }
        assert!(Instant::now() < deadline, "{}", failure());
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// A plain HTTP GET on a new connection, answered within [`STEP`]: the whole response.
pub fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(STEP)).expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the response");
    out
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
        Self::start_in(TempDir::new("region"), n, extra, |_| Launch::plain())
    }

    /// [`Region::start`] in `dir`, node `i` started as `launch(i)` says.
    pub fn start_in(
        dir: TempDir,
        n: usize,
        extra: &[&str],
        launch: impl Fn(usize) -> Launch,
    ) -> Self {
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
                Node::start_with(&launch(i), &args, &[])
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

/// Command lines whose flags cannot act together, each with what its refusal says: derpd
/// refuses each at start and in `--check` (besides `-c`, each is complete).
pub fn flags_that_cannot_act_together() -> Vec<(Vec<&'static str>, &'static str)> {
    const GCP: [&str; 10] = [
        "-a",
        "127.0.0.1:443",
        "--certmode",
        "gcp",
        "--hostname",
        "derp.example.com",
        "--acme-eab-kid",
        "kid-1",
        "--acme-eab-key",
        "c2VjcmV0LWtleQ==",
    ];
    let gcp = |more: &[&'static str]| [&GCP[..], more].concat();
    let manual = |more: &[&'static str]| {
        [
            &[
                "-a",
                "127.0.0.1:0",
                "--certmode",
                "manual",
                "--hostname",
                "127.0.0.1",
            ][..],
            more,
        ]
        .concat()
    };
    let acme = |more: &[&'static str]| {
        [
            &["-a", "127.0.0.1:443", "--hostname", "derp.example.com"][..],
            more,
        ]
        .concat()
    };
    let plain = |more: &[&'static str]| [&["-a", "127.0.0.1:0"][..], more].concat();
    vec![
        (
            manual(&["--acme-ip-certs"]),
            "--acme-ip-certs requires --certmode=letsencrypt: --certmode manual serves only \
             the files in --certdir",
        ),
        (
            gcp(&["--acme-email", "ops@example.com", "--acme-ip-certs"]),
            "--acme-ip-certs requires --certmode=letsencrypt",
        ),
        (
            acme(&["--acme-ip-certs", "--http-port=-1"]),
            "--acme-ip-certs needs the port-80 listener",
        ),
        (
            vec!["-a", "127.0.0.1:443", "--hostname", "192.0.2.1"],
            "--hostname is an IP address; use --certmode=manual",
        ),
        (
            vec![
                "-a",
                "127.0.0.1:443",
                "--certmode",
                "gcp",
                "--hostname",
                "192.0.2.1",
            ],
            "--certmode=gcp requires --hostname to be a DNS name",
        ),
        (
            vec![
                "-a",
                "127.0.0.1:443",
                "--certmode",
                "gcp",
                "--hostname",
                "derp.example.com",
                "--acme-email",
                "ops@example.com",
            ],
            "--certmode=gcp requires --acme-eab-kid and --acme-eab-key flags",
        ),
        (gcp(&[]), "--certmode=gcp requires --acme-email flag"),
        (
            gcp(&[
                "--acme-email",
                "ops@example.com",
                "--acme-directory",
                "https://ca.example/dir",
            ]),
            "--certmode=gcp uses Google Trust Services' directory",
        ),
        (
            acme(&["--acme-eab-kid", "kid-1"]),
            "--acme-eab-kid and --acme-eab-key are given together or not at all",
        ),
        (
            acme(&["--acme-challenge", "http-01", "--http-port", "-1"]),
            "--acme-challenge http-01 needs the port-80 listener",
        ),
        (
            acme(&["--cert-reload-interval", "1m"]),
            "--cert-reload-interval is for --certmode manual's files",
        ),
        (
            manual(&[
                "--acme-directory",
                "https://ca.example/dir",
                "--acme-ca-cert",
                "/nonexistent/ca.pem",
            ]),
            "--acme-directory and --acme-ca-cert are for ACME, which --certmode manual does \
             not use",
        ),
        (
            plain(&["--tls-records", "rustls", "--acme-challenge=tls-alpn-01"]),
            "--acme-challenge and --tls-records are for TLS, but the listener serves plain HTTP",
        ),
        (plain(&["--quic-port", "4433"]), "--quic-port needs TLS"),
        (
            manual(&["--quic-port", "3478"]),
            "--quic-port 3478 is also the STUN port",
        ),
        (
            manual(&["--quic-port=-1", "--quic-congestion", "bbr"]),
            "--quic-congestion is for DERP over QUIC, which is off (--quic-port=-1)",
        ),
        (
            plain(&["--quic-congestion", "cubic"]),
            "--quic-congestion is for DERP over QUIC, which is off (no TLS)",
        ),
        (
            plain(&[
                "--mesh-ping-interval",
                "1s",
                "--mesh-ca-file",
                "/nonexistent/ca.pem",
            ]),
            "--mesh-ca-file and --mesh-ping-interval are for the mesh links this node dials, \
             and --mesh-with names none",
        ),
        (
            plain(&[
                "--mesh-with",
                "http://127.0.0.1:9/derp",
                "--mesh-ca-file",
                "/nonexistent/ca.pem",
            ]),
            "--mesh-ca-file is trusted by https:// and quic:// mesh links only",
        ),
        (
            plain(&["--forwarded-header", "x-real-ip"]),
            "--forwarded-header is for the HTTP proxies of --trust-forwarded-from, which names \
             none",
        ),
    ]
}

/// A QUIC client told that its server goes away: the Restarting frame, then the server's
/// close; or the close with the shutdown code (6) alone (or, with `reset_too`, a stateless
/// reset), which can overtake the frame (a
/// QUIC client drops stream data it has not read yet when the connection closes), where TCP
/// delivers what came before the FIN. Within [`STEP`] either way, where a server that said
/// nothing would leave the client to its 30 s idle timeout.
pub async fn expect_quic_shutdown(c: &mut Client, reset_too: bool) {
    let wait = async {
        loop {
            match c.recv().await {
                Ok(ReceivedFrame::Restarting { .. }) => return expect_closed(c).await,
                Ok(_) => {}
                Err(e) => {
                    let e = e.to_string();
                    // Or, after an upgrade, the new process's stateless reset (the node's
                    // own, so believed) of a packet of this connection that it read.
                    assert!(
                        e.ends_with("closed by peer: 6")
                            || (reset_too && e.ends_with("reset by peer")),
                        "closed otherwise: {e}"
                    );
                    return;
                }
            }
        }
    };
    tokio::time::timeout(STEP, wait)
        .await
        .expect("told of the shutdown in time");
}

/// A DERP-over-QUIC client of a node started with [`manual_ip_args`] and `--quic-port`,
/// trusting its self-signed certificate by the pin it logged.
pub async fn quic_client(node: &Process, secret: SecretKey) -> Client {
    let quic: SocketAddr = node.find_log("the QUIC line", |v| {
        (v["fields"]["message"] == "QUIC listening (DERP over QUIC)")
            .then(|| v["fields"]["addr"].as_str()?.parse().ok())?
    });
    let pin: String = node.find_log("the certificate's pin", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("self-signed certificate for an IP address")
            .then(|| v["fields"]["cert_name"].as_str().map(str::to_owned))?
    });
    let config = ClientConfig::new(&format!("quic://{quic}"), secret)
        .expect("client config")
        .with_cert_name(pin)
        .with_local_addr("127.0.0.1:0".parse().expect("addr"))
        .with_connect_timeout(STEP);
    Client::connect(&config)
        .await
        .expect("QUIC client connects")
}
