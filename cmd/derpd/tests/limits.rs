//! The derpd binary under pressure and reconfiguration: running out of file descriptors, a
//! burst of connections against the listen backlog, and SIGHUP reloads of the rate config
//! and the allow-keys file.

use crate::support;

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Instant;

use derp_client::{Client, ClientConfig};
use derp_proto::SecretKey;
use support::{Launch, Node, STEP, TempDir};

/// Starts `derpd --dev` on ephemeral ports with `extra` flags, with at most `nofile` open
/// files if given, and waits until it listens.
fn start(extra: &[&str], nofile: Option<u32>) -> Node {
    let launch = match nofile {
        Some(n) => Launch::with_setup(&format!("ulimit -n {n}")),
        None => Launch::plain(),
    };
    let mut args = vec!["--dev", "-a", "127.0.0.1:0", "--stun=false"];
    args.extend_from_slice(extra);
    Node::start_with(&launch, &args, &[])
}

fn message(v: &serde_json::Value) -> &str {
    v["fields"]["message"].as_str().unwrap_or_default()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn is_accept_failure(v: &serde_json::Value, listener: &str) -> bool {
    message(v) == "accept failed" && v["fields"]["listener"] == listener
}

/// How the backoff waits and how rarely it logs are unit tests of `AcceptErrors` (on a paused
/// clock); this shows the metrics listener of the real process uses it: out of descriptors it
/// logs the first failure with the shortest retry wait, accounts for every failure (logged,
/// or counted as left out), and serves again once descriptors come back.
#[test]
fn the_metrics_listener_backs_off_when_out_of_file_descriptors() {
    const NOFILE: u32 = 64;
    let r = start(&["--metrics-addr", "127.0.0.1:0"], Some(NOFILE));
    let metrics = r.metrics_addr.expect("metrics address");
    // Connections to /metrics that say nothing hold a descriptor each in derpd until the
    // limit is reached; the rest wait in the backlog, so every accept fails at once.
    let free = (NOFILE as usize).saturating_sub(open_fds(r.pid()));
    let mut held = Vec::new();
    for _ in 0..free + 8 {
        held.push(TcpStream::connect(metrics).expect("connect"));
    }
    let first = r.wait_log("the first accept failure", |v| {
        is_accept_failure(v, "metrics").then(|| v.clone())
    });
    assert_eq!(
        first["fields"]["retry_in_ms"].as_u64(),
        Some(5),
        "the first retry waits the shortest backoff: {first}"
    );
    let mut logged = 1;
    let mut left_out = first["fields"]["suppressed"].as_u64().expect("suppressed");

    // Descriptors come back: it accepts again and says how many failures it did not log.
    drop(held);
    let deadline = Instant::now() + STEP;
    loop {
        let Some(v) = r.next_log(deadline) else {
            panic!("no recovery logged:\n{}", r.log_text());
        };
        if is_accept_failure(&v, "metrics") {
            logged += 1;
            left_out += v["fields"]["suppressed"].as_u64().expect("suppressed");
        } else if message(&v) == "accepting again" && v["fields"]["listener"] == "metrics" {
            left_out += v["fields"]["suppressed"].as_u64().expect("suppressed");
            break;
        }
    }
    let text = r.scrape();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let errors = support::sample(&text, "derp_accept_errors", &[("listener", "metrics")])
        .expect("derp_accept_errors");
    assert_eq!(
        errors,
        (logged + left_out) as f64,
        "every failed accept is counted: {logged} logged, {left_out} left out"
    );
}

/// The backlog the kernel gives derpd's listening socket, as `ss` reports it: for a socket in
/// LISTEN, Send-Q is the accept queue's limit. Read from the kernel rather than measured by
/// filling the queue while derpd is stopped, which a loaded machine makes unreliable (the
/// server may handle a handshake's last ACK only after the next SYN was answered).
fn listen_backlog(addr: SocketAddr) -> usize {
    let port = addr.port();
    let out = Command::new("ss")
        .args(["-Hltn", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2; scripts/test-tools install)");
    assert!(out.status.success(), "ss failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .next()
        .unwrap_or_else(|| panic!("no listener on {addr}: {text}"));
    // State, Recv-Q, Send-Q, local address, peer address.
    line.split_whitespace()
        .nth(2)
        .and_then(|q| q.parse().ok())
        .unwrap_or_else(|| panic!("unexpected ss output: {line}"))
}

#[test]
fn the_listen_backlog_is_the_flag_or_the_system_cap() {
    let r = start(&["--listen-backlog", "8"], None);
    assert_eq!(listen_backlog(r.addr), 8);
    drop(r);

    // By default the system's cap, not the 128 a plain bind gives.
    let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .expect("somaxconn")
        .trim()
        .parse()
        .expect("somaxconn is a number");
    let r = start(&[], None);
    assert_eq!(listen_backlog(r.addr), somaxconn);
}

#[tokio::test]
async fn sighup_reloads_the_rate_config_and_the_allow_list_keeping_the_old_on_errors() {
    let dir = TempDir::new("sighup");
    let rate = dir.path("rate.json");
    let allow = dir.path("allow.txt");
    let (a, b) = (
        SecretKey::generate(&mut rand::rngs::OsRng),
        SecretKey::generate(&mut rand::rngs::OsRng),
    );
    std::fs::write(&rate, r#"{"PerClientRateLimitBytesPerSec": 1000000}"#).expect("write");
    std::fs::write(&allow, format!("{}\n", a.public_key())).expect("write");
    let mut r = start(
        &[
            "--rate-config",
            rate.to_str().expect("utf8"),
            "--allow-keys-file",
            allow.to_str().expect("utf8"),
            "--allow-keys-reload-interval",
            "0",
        ],
        None,
    );
    let varz = |r: &Node, name: &str| r.metric(name, &[]);
    assert_eq!(
        varz(&r, "derp_rate_limit_per_client_bytes_per_second"),
        Some(1e6)
    );
    assert_eq!(
        varz(&r, "derp_rate_limit_per_client_burst_bytes"),
        Some(65573.0)
    );
    let url = format!("http://{}/derp", r.addr);
    let connects = |key: &SecretKey| {
        let cfg = ClientConfig::new(&url, key.clone())
            .expect("config")
            .with_connect_timeout(STEP);
        async move { Client::connect(&cfg).await.is_ok() }
    };
    assert!(connects(&a).await, "a listed key was refused");
    assert!(!connects(&b).await, "an unlisted key was let in");

    std::fs::write(
        &rate,
        r#"{"PerClientRateLimitBytesPerSec": 2000000, "PerClientRateBurstBytes": 4000000}"#,
    )
    .expect("write");
    std::fs::write(&allow, format!("# now b\n{}\n", b.public_key())).expect("write");
    r.signal("HUP");
    r.wait_log("rate reload", |v| {
        (message(v) == "SIGHUP: rate config reloaded").then_some(())
    });
    r.wait_log("allow-keys reload", |v| {
        (message(v) == "allow-keys file loaded").then_some(())
    });
    assert_eq!(
        varz(&r, "derp_rate_limit_per_client_bytes_per_second"),
        Some(2e6)
    );
    assert_eq!(
        varz(&r, "derp_rate_limit_per_client_burst_bytes"),
        Some(4e6)
    );
    assert!(connects(&b).await);
    assert!(!connects(&a).await);

    // Broken files: both errors are reported (the bad line by number), the old ones stay.
    std::fs::write(&rate, "{not json").expect("write");
    std::fs::write(&allow, format!("{}\nnodekey:00\n", a.public_key())).expect("write");
    r.signal("HUP");
    r.wait_log("rate reload failure", |v| {
        message(v)
            .starts_with("SIGHUP: rate config not reloaded")
            .then_some(())
    });
    let error = r.wait_log("allow-keys failure", |v| {
        message(v)
            .starts_with("allow-keys file not loaded")
            .then(|| v["fields"]["error"].as_str().map(str::to_owned))
            .flatten()
    });
    assert!(error.contains("allow.txt:2:"), "{error}");
    assert_eq!(
        varz(&r, "derp_rate_limit_per_client_bytes_per_second"),
        Some(2e6)
    );
    assert!(connects(&b).await);
    assert!(!connects(&a).await);
    assert!(r.is_running(), "derpd exited");
}

/// The soft and hard limits on open files of process `pid`, from `/proc`.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-files line");
    let mut fields = line["Max open files".len()..].split_whitespace();
    let soft = fields.next().expect("soft").to_owned();
    let hard = fields.next().expect("hard").to_owned();
    (soft, hard)
}

#[test]
fn the_soft_descriptor_limit_is_raised_to_the_hard_one_as_go_programs_do() {
    // A shell's usual soft limit, under a higher hard one: a derper started so serves more
    // clients than 1,024, and so must derpd.
    let mut args = vec!["--dev", "-a", "127.0.0.1:0", "--stun=false"];
    args.push("--metrics-addr");
    args.push("127.0.0.1:0");
    let node = Node::start_with(&Launch::with_setup("ulimit -Sn 256"), &args, &[]);
    let (soft, hard) = open_files_limits(node.pid());
    assert_eq!(soft, hard, "soft limit {soft}, hard {hard}");
    assert!(soft.parse::<u64>().is_ok_and(|n| n > 256), "{soft}");
    node.find_log("the raise", |v| {
        (message(v) == "raised the open-descriptor limit to the hard limit"
            && v["fields"]["from"] == 256)
            .then_some(())
    });
}
