//! The derpd binary as an operator runs it: flags, key files, startup and shutdown.

use std::os::unix::fs::PermissionsExt;

use support::{Launch, Node, STEP, TempDir, flags_that_cannot_act_together, http_get, run_to_exit};

use crate::support;

/// Runs derpd to completion and returns (exit success, stderr).
fn run(args: &[&str]) -> (bool, String) {
    let (status, stderr) = run_to_exit(&Launch::plain(), args);
    (status.success(), stderr)
}

/// Starts derpd on ephemeral ports and waits for its "listening" log line.
fn start(extra: &[&str]) -> Node {
    let mut args = vec!["-a", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Node::start(&args)
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
        assert!(http_get(r.addr, "/derp/probe").starts_with("HTTP/1.1 200"));
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(r.addr).expect("connect");
        s.set_read_timeout(Some(STEP)).expect("timeout");
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
    let resp = http_get(r.addr, "/");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let varz = http_get(r.addr, "/debug/varz");
    assert!(varz.contains("derp_build_info"), "{varz}");
    // SIGHUP (a systemd reload) must not end it, in any mode.
    r.signal("HUP");
    assert!(
        http_get(r.addr, "/derp/probe").starts_with("HTTP/1.1 200"),
        "derpd died on SIGHUP"
    );
    assert!(r.is_running());
    r.signal("TERM");
    let exit = r.wait_exit(STEP);
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn a_listen_host_name_binds_its_first_ipv4_address_as_go_does() {
    // localhost is 127.0.0.1 (and ::1) in /etc/hosts: Go binds the IPv4 address alone.
    let node = Node::start(&["--a=localhost:0", "-dev"]);
    assert_eq!(node.addr.ip(), std::net::Ipv4Addr::LOCALHOST);
    assert!(http_get(node.addr, "/derp/probe").starts_with("HTTP/1.1 200"));
}

#[test]
fn a_start_refuses_flags_that_cannot_act_together_before_binding_or_writing() {
    let dir = TempDir::new("cli-together");
    let key = dir.path("derper.key");
    let key_text = key.display().to_string();
    for (args, want) in flags_that_cannot_act_together() {
        let mut all = vec!["-c", &key_text];
        all.extend(args.iter().copied());
        let (ok, stderr) = run(&all);
        assert!(!ok, "{args:?} started");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: want one line, got {stderr}");
        assert!(
            lines[0].starts_with("derpd: ") && lines[0].contains(want),
            "{args:?}: want {want:?} in {stderr}"
        );
        assert!(!key.exists(), "{args:?}: a refused start created the key");
    }
}
