//! A third-party STUN client (coturn's `turnutils_stunclient`) gets an answer from derpd when
//! generic STUN is enabled. `scripts/test` installs the tool (or says how); without it the
//! test fails rather than pass without having run.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const DERPD: &str = env!("CARGO_BIN_EXE_derpd");
const STUNCLIENT: &str = "turnutils_stunclient";

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tool_available() -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {STUNCLIENT}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts derpd with generic STUN on ephemeral ports; returns it and its STUN port.
fn start_derpd() -> (Running, u16) {
    let mut running = Running(
        Command::new(DERPD)
            .args(["--dev", "-a", "127.0.0.1:0", "--stun-port", "0"])
            .args(["--stun-answer-generic", "--log-format", "json"])
            .env("RUST_LOG", "info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn derpd"),
    );
    let stderr = running.0.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("derpd logged its STUN address");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v["fields"]["message"] == "STUN listening" {
            let addr: std::net::SocketAddr = v["fields"]["addr"]
                .as_str()
                .and_then(|a| a.parse().ok())
                .expect("addr field");
            return (running, addr.port());
        }
    }
}

#[test]
fn third_party_stun_client_is_answered_in_generic_mode() {
    assert!(
        tool_available(),
        "{STUNCLIENT} is not installed: `apt-get install --no-install-recommends coturn`, or \
         run `scripts/test-tools install` (scripts/test does it when it can)"
    );
    let (_derpd, port) = start_derpd();
    let mut client = Running(
        Command::new(STUNCLIENT)
            .args(["-p", &port.to_string(), "127.0.0.1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run stun client"),
    );
    let stdout = client.0.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the STUN client printed its reflexive address");
        if line.contains("reflexive addr") {
            break line;
        }
    };
    assert!(line.contains("127.0.0.1:"), "{line}");
}
