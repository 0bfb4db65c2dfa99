//! systemd's readiness protocol as a `Type=notify` unit sees it: derpd, started with
//! `$NOTIFY_SOCKET` naming a datagram socket the test binds, says `READY=1` once its ports
//! accept connections (and, with TLS, a certificate is in service), and `STOPPING=1` when
//! SIGTERM starts the graceful shutdown.

use crate::support;

use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;

use support::{Process, STEP, TempDir, derpd_command};

/// The next datagram, within [`STEP`].
fn receive(socket: &UnixDatagram, node: &Process) -> String {
    let mut buf = [0u8; 4096];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no notification from derpd: {e}; log:\n{}", node.log_text()));
    String::from_utf8(buf[..n].to_vec()).expect("utf-8")
}

fn bound(socket: UnixDatagram) -> UnixDatagram {
    socket.set_read_timeout(Some(STEP)).expect("timeout");
    socket
}

/// derpd with `args` and `$NOTIFY_SOCKET` set to `notify_socket`.
fn start(args: &[&str], notify_socket: &str) -> Process {
    let mut all = vec!["--log-format", "json", "--stun-port", "0"];
    all.extend(args);
    let mut cmd = derpd_command(&support::Launch::plain(), &all);
    cmd.env("NOTIFY_SOCKET", notify_socket);
    Process::spawn(cmd)
}

/// The address READY=1's status line says derpd serves on: `serving DERP over ... on
/// <addr>`, then the end or ` for <hostname> ...`.
fn served_addr(ready: &str) -> String {
    let after = ready
        .split_once(" on ")
        .unwrap_or_else(|| panic!("no address in {ready:?}"))
        .1;
    after.split(' ').next().unwrap_or(after).to_owned()
}

/// The metrics listener's address, as derpd logged it (before it said READY=1).
fn metrics_addr(node: &Process) -> String {
    node.find_log("the metrics listener", |v| {
        (v["fields"]["message"] == "metrics listening at /metrics")
            .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
    })
}

/// Whether `/derp/probe` on the metrics listener answers 200 (ready) right now.
fn probe_ok(metrics: &str) -> bool {
    let out = support::http_get(metrics.parse().expect("addr"), "/derp/probe");
    out.starts_with("HTTP/1.1 200")
}

/// SIGTERM: the next notification says the service is stopping, and derpd exits 0.
fn stops_gracefully(node: &mut Process, socket: &UnixDatagram) {
    node.signal("TERM");
    let stopping = receive(socket, node);
    assert!(
        stopping.starts_with("STOPPING=1\nSTATUS=shutting down: telling 0 clients to reconnect"),
        "{stopping:?}"
    );
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
}

#[test]
fn ready_once_the_port_accepts_then_stopping_on_sigterm() {
    let dir = TempDir::new("notify");
    let path = dir.path("notify");
    let socket = bound(UnixDatagram::bind(&path).expect("bind"));
    // Ephemeral ports: READY=1's status line names the one to connect to.
    let mut node = start(
        &[
            "--dev",
            "-a",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        path.to_str().expect("utf-8 path"),
    );
    let ready = receive(&socket, &node);
    assert!(
        ready.starts_with("READY=1\nSTATUS=serving DERP over plain HTTP on 127.0.0.1:"),
        "{ready:?}"
    );
    let addr = served_addr(&ready);
    let metrics = metrics_addr(&node);
    TcpStream::connect(&addr).unwrap_or_else(|e| panic!("READY=1, yet {addr} refuses: {e}"));
    assert!(probe_ok(&metrics), "READY=1, yet /derp/probe is not 200");
    stops_gracefully(&mut node, &socket);
}

#[cfg(target_os = "linux")]
#[test]
fn a_tls_node_is_ready_with_its_certificate_on_an_abstract_socket() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("derpd-test-notify-{}", std::process::id());
    let abstract_addr = std::os::unix::net::SocketAddr::from_abstract_name(&name).expect("addr");
    let socket = bound(UnixDatagram::bind_addr(&abstract_addr).expect("bind"));
    let dir = TempDir::new("notify-tls");
    let certdir = dir.path("certs").display().to_string();
    let mut args = support::manual_ip_args(&certdir);
    args.extend(["--metrics-addr", "127.0.0.1:0"]);
    let mut node = start(&args, &format!("@{name}"));
    let ready = receive(&socket, &node);
    assert!(
        ready.starts_with("READY=1\nSTATUS=serving DERP over TLS on 127.0.0.1:"),
        "{ready:?}"
    );
    let addr = served_addr(&ready);
    assert!(
        ready.ends_with(&format!(" on {addr} for 127.0.0.1 (--certmode manual)")),
        "{ready:?}"
    );
    let metrics = metrics_addr(&node);
    TcpStream::connect(&addr).unwrap_or_else(|e| panic!("READY=1, yet {addr} refuses: {e}"));
    assert!(probe_ok(&metrics), "READY=1, yet /derp/probe is not 200");
    stops_gracefully(&mut node, &socket);
}

#[test]
fn an_unusable_notify_socket_is_logged_and_derpd_serves_on() {
    let dir = TempDir::new("notify-gone");
    // No one listens there: the send fails.
    let gone = dir.path("nobody").display().to_string();
    let mut node = start(
        &[
            "--dev",
            "-a",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        gone.as_str(),
    );
    let metrics = metrics_addr(&node);
    let error = node.wait_log("the failed notification", |v| {
        let msg = v["fields"]["message"].as_str()?;
        msg.starts_with("telling systemd")
            .then(|| v["fields"]["error"].as_str().map(str::to_owned))?
    });
    assert!(!error.is_empty());
    assert!(probe_ok(&metrics), "derpd stopped serving");
    node.signal("TERM");
    let status = node.wait_exit(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
}
