//! The derpd binary as an operator runs it: flags, key files, startup and shutdown.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::TempDir;

mod support;

const DERPD: &str = env!("CARGO_BIN_EXE_derpd");

/// Runs derpd to completion and returns (exit success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(DERPD)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run derpd");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A running derpd that is killed when dropped.
struct Running {
    child: Child,
    addr: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts derpd on ephemeral ports and waits for its "listening" log line.
fn start(extra: &[&str]) -> Running {
    // Wrapped at once, so the process is killed and reaped on every path, panics included.
    let mut running = Running {
        child: Command::new(DERPD)
            .args([
                "-a",
                "127.0.0.1:0",
                "--stun-port",
                "0",
                "--log-format",
                "json",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn derpd"),
        addr: String::new(),
    };
    let stderr = running.child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = rx.recv_timeout(left).expect("derpd logged its address");
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        if v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("derpd listening"))
        {
            running.addr = v["fields"]["addr"].as_str().expect("addr field").to_owned();
            return running;
        }
    }
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn bad_flags_fail_with_one_clear_line() {
    for args in [
        vec!["--no-such-flag"],
        vec!["--tcp-write-timeout", "soon"],
        vec!["--send-queue-depth", "0"],
        vec!["--home", "ftp://x", "--dev"],
        vec!["-a", "not-an-address", "--dev"],
        vec!["--debug-allow-cidr", "10.0.0.0/40", "--dev"],
    ] {
        let (ok, stderr) = run(&args);
        assert!(!ok, "{args:?} should fail");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: want one line, got {stderr}");
        assert!(lines[0].starts_with("derpd: "), "{args:?}: {stderr}");
    }
}

#[test]
fn an_unreadable_or_malformed_mesh_key_fails_with_one_line() {
    let dir = TempDir::new("cli-mesh-psk");
    let key = dir.path("derp.key");
    let bad = dir.path("mesh.key");
    std::fs::write(&bad, "f00d not hex\n").expect("write");
    let missing = dir.path("no-such-mesh.key");
    for (psk, want) in [(&bad, "mesh.key"), (&missing, "no-such-mesh.key")] {
        let args = [
            "--dev",
            "-a",
            "127.0.0.1:0",
            "-c",
            key.to_str().expect("utf8"),
            "--mesh-psk-file",
            psk.to_str().expect("utf8"),
        ];
        let (ok, stderr) = run(&args);
        assert!(!ok, "{args:?} should fail");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: want one line, got {stderr}");
        assert!(
            lines[0].starts_with("derpd: ") && lines[0].contains(want),
            "{args:?}: {stderr}"
        );
        assert!(
            !key.exists(),
            "{args:?}: a failed start left a new key behind"
        );
    }
}

#[test]
fn missing_key_file_is_created_private_and_reused() {
    let dir = TempDir::new("cli-create");
    let path = dir.path("sub/derper.key");
    let p = path.to_str().expect("utf8");
    let key1 = {
        let r = start(&["-c", p]);
        let text = std::fs::read_to_string(&path).expect("key file written");
        drop(r);
        text
    };
    let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(
        key1.starts_with("{\n\t\"PrivateKey\": \"privkey:"),
        "{key1}"
    );
    let r = start(&["-c", p]);
    drop(r);
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        key1,
        "key reused"
    );
}

#[test]
fn corrupt_key_file_is_an_error_and_left_alone() {
    let dir = TempDir::new("cli-corrupt");
    let path = dir.path("derper.key");
    for contents in ["{not json", "{}", "{\"PrivateKey\":\"privkey:1234\"}"] {
        std::fs::write(&path, contents).expect("write");
        let (ok, stderr) = run(&["-c", path.to_str().expect("utf8"), "-a", "127.0.0.1:0"]);
        assert!(!ok, "{contents}: should fail");
        assert!(stderr.contains("config file"), "{stderr}");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), contents);
    }
}

#[test]
fn reference_key_file_loads_in_both_forms() {
    let dir = TempDir::new("cli-reference");
    let path = dir.path("derper.key");
    let private = "privkey:1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c";
    let public = "a5cc7c231e1ccce44f37e2fafeff3f1520fdf68d7eccd28d45e78f668ee93e29";
    for contents in [
        format!("{{\"PrivateKey\":\"{private}\"}}"),
        format!("{{\n\t\"PrivateKey\": \"{private}\"\n}}"),
    ] {
        std::fs::write(&path, &contents).expect("write");
        let r = start(&["-c", path.to_str().expect("utf8")]);
        // The probe answers, and the home page is served; the key shows in the 101 head.
        assert!(http_get(&r.addr, "/derp/probe").starts_with("HTTP/1.1 200"));
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&r.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(
            b"GET /derp HTTP/1.1\r\nHost: x\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n\r\n",
        )
        .expect("write");
        let mut buf = vec![0u8; 512];
        let n = s.read(&mut buf).expect("read");
        let head = String::from_utf8_lossy(&buf[..n]);
        assert!(
            head.contains(&format!("Derp-Public-Key: {public}")),
            "{head}"
        );
    }
}

#[test]
fn dev_mode_serves_survives_sighup_and_stops_cleanly_on_sigterm() {
    let mut r = start(&["--dev", "--home", "blank"]);
    let resp = http_get(&r.addr, "/");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let varz = http_get(&r.addr, "/debug/varz");
    assert!(varz.contains("derp_build_info"), "{varz}");
    // SIGHUP (a systemd reload) must not end it, in any mode.
    let status = Command::new("kill")
        .args(["-HUP", &r.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    assert!(
        http_get(&r.addr, "/derp/probe").starts_with("HTTP/1.1 200"),
        "derpd died on SIGHUP"
    );
    assert!(r.child.try_wait().expect("try_wait").is_none());
    let status = Command::new("kill")
        .args(["-TERM", &r.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    // Wait for the exit, bounded: poll try_wait on a short interval.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = r.child.try_wait().expect("try_wait") {
            break exit;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "derpd ignored SIGTERM"
        );
        std::thread::park_timeout(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
}
