//! The derpd binary serving TLS: an IP-only node in manual mode prints the pin clients need,
//! and SIGHUP puts rotated certificate files into service without a restart.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use derp_client::{Client, ClientConfig};
use derp_proto::SecretKey;

const DERPD: &str = env!("CARGO_BIN_EXE_derpd");
const STEP: Duration = Duration::from_secs(20);

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("derpd-tls-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running derpd, killed on drop, with its stdout and stderr lines on channels.
struct Running {
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lines(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits for a line for which `pick` returns something.
fn wait_line<T>(rx: &mpsc::Receiver<String>, what: &str, pick: impl Fn(&str) -> Option<T>) -> T {
    let deadline = Instant::now() + STEP;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
        if let Some(v) = pick(&line) {
            return v;
        }
    }
}

fn start_ip_node(certdir: &Path) -> (Running, String, String) {
    let mut child = Command::new(DERPD)
        .args([
            "--dev",
            "-a",
            "127.0.0.1:0",
            "--stun-port",
            "0",
            "--log-format",
            "json",
        ])
        .args([
            "--certmode",
            "manual",
            "--hostname",
            "127.0.0.1",
            "--http-port",
            "-1",
        ])
        .args(["--cert-reload-interval", "0", "--certdir"])
        .arg(certdir)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn derpd");
    let stdout = lines(child.stdout.take().expect("stdout"));
    let stderr = lines(child.stderr.take().expect("stderr"));
    let running = Running {
        child,
        stdout,
        stderr,
    };
    let node: serde_json::Value = wait_line(&running.stdout, "DERP map node", |l| {
        serde_json::from_str(l.trim()).ok()
    });
    let pin = node["CertName"].as_str().expect("CertName").to_owned();
    let addr = wait_line(&running.stderr, "listening line", |l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v["fields"]["message"] == "derpd listening (TLS)")
            .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
    });
    assert_eq!(node["HostName"], "127.0.0.1");
    assert_eq!(
        node["DERPPort"].as_u64(),
        addr.rsplit(':').next().and_then(|p| p.parse().ok())
    );
    (running, addr, pin)
}

fn client(addr: &str, pin: &str) -> ClientConfig {
    let port = addr.rsplit(':').next().expect("port");
    ClientConfig::new(
        &format!("https://127.0.0.1:{port}/derp"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_cert_name(pin)
    .with_connect_timeout(STEP)
}

#[tokio::test]
async fn ip_node_prints_its_pin_and_sighup_rotates_the_certificate() {
    let dir = TempDir::new("sighup");
    let (running, addr, pin) = start_ip_node(&dir.0);
    assert!(dir.0.join("127.0.0.1.crt").exists() && dir.0.join("127.0.0.1.key").exists());

    let mut old = Client::connect(&client(&addr, &pin))
        .await
        .expect("pinned client");
    assert!(
        old.used_fast_start(),
        "TLS 1.3 with the meta certificate means fast start"
    );

    // Replace the pair on disk, then SIGHUP.
    let ip = "127.0.0.1".parse().expect("ip");
    let (cert_pem, key_pem) = derp_tls::generate_self_signed(ip).expect("generate");
    std::fs::write(dir.0.join("127.0.0.1.key"), &key_pem).expect("write key");
    std::fs::write(dir.0.join("127.0.0.1.crt"), &cert_pem).expect("write crt");
    let leaf = derp_tls::load_certs_pem(cert_pem.as_bytes()).expect("pem");
    let new_pin = derp_tls::cert_pin(&leaf[0]);
    let status = Command::new("kill")
        .args(["-HUP", &running.child.id().to_string()])
        .status()
        .expect("kill -HUP");
    assert!(status.success());
    wait_line(&running.stderr, "reload log line", |l| {
        l.contains("SIGHUP: new certificate in service")
            .then_some(())
    });

    // New connections need the new pin; the old connection is still up.
    Client::connect(&client(&addr, &new_pin))
        .await
        .expect("client pinned to the new certificate");
    assert!(Client::connect(&client(&addr, &pin)).await.is_err());
    let rtt = old.ping().await.expect("old connection still works");
    assert!(rtt < STEP);
    drop(running);
}
