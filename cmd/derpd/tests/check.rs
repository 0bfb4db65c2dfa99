//! `derpd --check`: it validates what a start would (flags, key file, certificates, mesh key
//! and siblings, CA files), prints what would run, exits 1 on any error, and binds and
//! writes nothing.

use std::net::{TcpListener, UdpSocket};
use std::path::Path;
use std::process::Command;

use crate::support;

use support::{DERPD, TempDir, flags_that_cannot_act_together};

/// Runs derpd to completion: (exit success, stdout, stderr).
fn derpd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(DERPD)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run derpd");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn check(args: &[&str]) -> (bool, String) {
    let mut all = vec!["--check"];
    all.extend_from_slice(args);
    let (ok, stdout, _) = derpd(&all);
    (ok, stdout)
}

const MESH_KEY: &str = "f00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeed\n";

/// A certificate and key for `name` (a DNS name or an IP), valid from `from` to `until`
/// (years), self-signed.
fn cert_pair(name: &str, from: i32, until: i32) -> (String, String) {
    let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params");
    params.not_before = rcgen::date_time_ymd(from, 1, 1);
    params.not_after = rcgen::date_time_ymd(until, 1, 1);
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("cert");
    (cert.pem(), key.serialize_pem())
}

#[test]
fn check_binds_nothing_writes_nothing_and_says_what_would_run() {
    let dir = TempDir::new("binds");
    // Every port the configuration names is taken by this test, so a start must fail...
    let tcp = TcpListener::bind("127.0.0.1:0").expect("bind");
    let metrics = TcpListener::bind("127.0.0.1:0").expect("bind");
    let udp = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addr = tcp.local_addr().expect("addr").to_string();
    let metrics_addr = metrics.local_addr().expect("addr").to_string();
    let stun_port = udp.local_addr().expect("addr").port().to_string();
    let key = dir.path("state/derper.key");
    let key_text = key.display().to_string();
    let mesh_key = dir.file("mesh.key", MESH_KEY);
    let args = [
        "-a",
        &addr,
        "--stun-port",
        &stun_port,
        "--metrics-addr",
        &metrics_addr,
        "-c",
        &key_text,
        "--mesh-psk-file",
        &mesh_key,
        "--mesh-with",
        "derp1.example.com,derp2.example.com/10.0.0.2:8443,http://127.0.0.1:9/derp",
        "--hostname",
        "derp1.example.com",
    ];
    let (ok, _, stderr) = derpd(&args);
    assert!(!ok, "a start with every port taken must fail");
    assert!(stderr.contains("listening on"), "{stderr}");
    // The failed start created the key: remove it, so the check's "would create" shows.
    std::fs::remove_dir_all(dir.path("state")).expect("rm");

    // ...while the check passes, and leaves the key file uncreated.
    let (ok, out) = check(&args);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("{addr}/tcp (plain HTTP")),
        "listen line: {out}"
    );
    assert!(out.contains(&format!("127.0.0.1:{stun_port}/udp")), "{out}");
    assert!(out.contains(&format!("{metrics_addr}/tcp")), "{out}");
    assert!(out.contains("would create it with a new key"), "{out}");
    assert!(
        out.contains("3 entries, each dialed (an entry that turns out to be this node"),
        "{out}"
    );
    assert!(
        out.contains("https://derp2.example.com/derp via 10.0.0.2:8443"),
        "{out}"
    );
    assert!(out.contains("drain up to 10s"), "{out}");
    assert!(
        out.contains(&format!(
            "SIGUSR2 to a derpd started as this one was starts {DERPD} (found by argv[0]) \
             with these flags and hands it {addr}/tcp, 127.0.0.1:{stun_port}/udp (STUN), {metrics_addr}/tcp \
             (metrics); it has 30s to serve on them"
        )),
        "{out}"
    );
    assert!(
        out.contains("usable CPU(s)"),
        "the default worker count: {out}"
    );
    let (ok, pinned) = check(&[&args[..], &["--workers", "3"]].concat());
    assert!(ok, "{pinned}");
    assert!(
        pinned.contains("3 worker threads (multi-thread runtime), as --workers says"),
        "{pinned}"
    );
    assert!(
        out.ends_with(
            "derpd --check: the configuration is usable (nothing was bound or written)\n"
        ),
        "{out}"
    );
    assert!(
        !dir.path("state").exists(),
        "--check created the key's directory"
    );
    // The ports are still this test's.
    drop((tcp, metrics, udp));
}

#[test]
fn check_reads_an_existing_key_and_a_valid_manual_certificate() {
    let dir = TempDir::new("manual");
    let key = dir.file(
        "derper.key",
        "{\"PrivateKey\":\"privkey:1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c\"}",
    );
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let certs = dir.path("certs");
    std::fs::create_dir_all(&certs).expect("certs");
    let (cert, cert_key) = cert_pair("derp.test", 2020, 2090);
    std::fs::write(certs.join("derp.test.crt"), cert).expect("write");
    std::fs::write(certs.join("derp.test.key"), cert_key).expect("write");
    let certdir = certs.display().to_string();
    let (ok, out) = check(&[
        "-a",
        "127.0.0.1:0",
        "-c",
        &key,
        "--certmode",
        "manual",
        "--hostname",
        "derp.test",
        "--certdir",
        &certdir,
    ]);
    assert!(ok, "{out}");
    // The public key of derper's reference key file.
    assert!(out.contains("public key nodekey:"), "{out}");
    assert!(out.contains("TLS for derp.test"), "{out}");
    assert!(out.contains("valid until 2090-01-01"), "{out}");
    assert!(out.contains("pin sha256-raw:"), "{out}");
    assert!(!out.contains("warn "), "{out}");

    // An IP hostname without files: a start would generate a certificate; the check only
    // says so.
    let empty = dir.path("empty").display().to_string();
    let mut args = support::manual_ip_args(&empty);
    args.extend(["-c", &key]);
    let (ok, out) = check(&args);
    assert!(ok, "{out}");
    assert!(
        out.contains("would generate a self-signed one for 127.0.0.1"),
        "{out}"
    );
    assert!(!Path::new(&empty).exists(), "--check wrote the certificate");
}

#[test]
fn check_fails_on_every_error_a_start_would_hit() {
    let dir = TempDir::new("errors");
    let good_key = dir.path("good.key").display().to_string();
    let bad_key = dir.file("bad.key", "{\"PrivateKey\":\"nodekey:00\"}");
    let bad_mesh = dir.file("bad-mesh.key", "not hex\n");
    let zero_mesh = dir.file("zero-mesh.key", &"0".repeat(64));
    let missing_mesh = dir.path("missing-mesh.key").display().to_string();
    let bad_allow = dir.file(
        "bad-allow.txt",
        &format!("# allowed\nnodekey:{}\nnot a key\n", "ab".repeat(32)),
    );
    let missing_allow = dir.path("missing-allow.txt").display().to_string();
    let bad_rate = dir.file(
        "bad-rate.json",
        "{\"PerClientRateLimitBytesPerSec\": \"fast\"}",
    );
    let mesh = dir.file("mesh.key", MESH_KEY);
    let garbage_pem = dir.file("garbage.pem", "-----BEGIN CERTIFICATE-----\nnope\n");
    let certs = dir.path("certs");
    std::fs::create_dir_all(&certs).expect("certs");
    let (cert, key) = cert_pair("other.test", 2020, 2090);
    std::fs::write(certs.join("derp.test.crt"), cert).expect("write");
    std::fs::write(certs.join("derp.test.key"), key).expect("write");
    let (cert, key) = cert_pair("old.test", 2000, 2001);
    std::fs::write(certs.join("old.test.crt"), cert).expect("write");
    std::fs::write(certs.join("old.test.key"), key).expect("write");
    let certdir = certs.display().to_string();
    let base = ["-a", "127.0.0.1:0", "-c", &good_key];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["-a", "nonsense"],
            "invalid listen address (-a) \"nonsense\": missing port",
        ),
        (
            vec!["-a", ":nosuchservice"],
            "unknown port \"nosuchservice\"",
        ),
        (
            vec!["-a", "[fe80::1%nosuchif0]:1"],
            "no network interface named",
        ),
        (vec!["--home", "ftp://x"], "invalid --home"),
        (vec!["--quic-port", "4433"], "--quic-port needs TLS"),
        (vec!["-c", &bad_key], "bad.key"),
        (vec!["--mesh-psk-file", &bad_mesh], "bad-mesh.key"),
        (
            vec!["--mesh-psk-file", &missing_mesh, "--mesh-with", "a.example"],
            "missing-mesh.key",
        ),
        (
            vec!["--allow-keys-file", &bad_allow],
            "bad-allow.txt:3: not a node key",
        ),
        (vec!["--allow-keys-file", &missing_allow], "missing-allow"),
        (vec!["--rate-config", &bad_rate], "bad-rate.json"),
        (
            vec!["--verify-client-url", "ftp://admission.example/verify"],
            "--verify-client-url",
        ),
        (
            vec!["--mesh-psk-file", &zero_mesh, "--mesh-with", "a.example"],
            "all zeros",
        ),
        (
            vec!["--mesh-with", "a.example"],
            "--mesh-with needs a mesh key",
        ),
        (
            vec![
                "--mesh-psk-file",
                &mesh,
                "--mesh-with",
                "ftp://a.example/derp",
            ],
            "--mesh-with",
        ),
        (
            vec![
                "--mesh-psk-file",
                &mesh,
                "--mesh-with",
                "a.example",
                "--mesh-ca-file",
                &garbage_pem,
            ],
            "--mesh-ca-file",
        ),
        (
            vec![
                "--certmode",
                "manual",
                "--hostname",
                "missing.test",
                "--certdir",
                &certdir,
            ],
            "missing.test.crt",
        ),
        (
            vec![
                "--certmode",
                "manual",
                "--hostname",
                "derp.test",
                "--certdir",
                &certdir,
            ],
            "derp.test",
        ),
        (
            vec![
                "--certmode",
                "manual",
                "--hostname",
                "old.test",
                "--certdir",
                &certdir,
            ],
            "expired",
        ),
        (
            vec!["-a", "127.0.0.1:443", "--acme-ca-cert", &garbage_pem],
            "--acme-ca-cert",
        ),
        (
            vec![
                "-a",
                "127.0.0.1:443",
                "--acme-challenge",
                "http-01",
                "--http-port",
                "-1",
            ],
            "needs the port-80 listener",
        ),
        (
            vec!["-a", "127.0.0.1:443", "--hostname", "192.0.2.1"],
            "--hostname is an IP address; use --certmode=manual",
        ),
    ];
    for (extra, want) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra.iter().copied());
        let (ok, out) = check(&args);
        assert!(!ok, "{extra:?} passed the check:\n{out}");
        let error = out
            .lines()
            .find(|l| l.starts_with("ERROR"))
            .unwrap_or_else(|| panic!("{extra:?}: no ERROR line:\n{out}"));
        assert!(
            error.contains(want),
            "{extra:?}: want {want:?} in {error:?}"
        );
        assert!(
            out.ends_with("derpd would not start\n"),
            "{extra:?}: no verdict:\n{out}"
        );
    }
    assert!(!Path::new(&good_key).exists(), "--check created the key");

    // Every problem is reported, not only the first.
    let (ok, out) = check(&["-a", "nonsense", "-c", &bad_key, "--mesh-with", "a.example"]);
    assert!(!ok);
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ERROR")).count(),
        3,
        "{out}"
    );
    assert!(out.contains("3 error(s)"), "{out}");
}

#[test]
fn check_warns_about_a_key_file_others_can_read() {
    let dir = TempDir::new("perm");
    let key = dir.file(
        "derper.key",
        "{\"PrivateKey\":\"privkey:1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c\"}",
    );
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    let (ok, out) = check(&["-a", "127.0.0.1:0", "-c", &key]);
    assert!(ok, "a warning is not an error: {out}");
    assert!(
        out.contains("readable by group or others (mode 644)"),
        "{out}"
    );
}

#[test]
fn check_reports_the_admission_checks_and_limits_a_start_would_use() {
    let dir = TempDir::new("admission");
    let key = dir.path("derp.key").display().to_string();
    let allow = dir.file("allow.txt", &format!("nodekey:{}\n", "cd".repeat(32)));
    let rate = dir.file(
        "rate.json",
        "{\"PerClientRateLimitBytesPerSec\": 125000, \"PerClientRateBurstBytes\": 250000}",
    );
    let (ok, out) = check(&[
        "-a",
        "127.0.0.1:0",
        "-c",
        &key,
        "--allow-keys-file",
        &allow,
        "--verify-client-url",
        "http://127.0.0.1:9/verify",
        "--rate-config",
        &rate,
        "--max-connections",
        "5000",
    ]);
    assert!(ok, "{out}");
    let line = |what: &str| {
        out.lines()
            .find(|l| l.starts_with("ok") && l.split_whitespace().nth(1) == Some(what))
            .unwrap_or_else(|| panic!("no {what} line:\n{out}"))
            .to_owned()
    };
    let admission = line("admission");
    assert!(admission.contains("allow.txt"), "{admission}");
    assert!(
        admission.contains("http://127.0.0.1:9/verify (fail closed)"),
        "{admission}"
    );
    let limits = line("limits");
    assert!(
        limits.contains("receive 125000 bytes/s per client, burst 250000"),
        "{limits}"
    );
    assert!(limits.contains("at most 5000 connections"), "{limits}");
}

#[test]
fn check_resolves_the_listen_address_as_a_start_would() {
    let dir = TempDir::new("listen");
    let key = dir.path("derper.key").display().to_string();
    let certdir = dir.path("certs").display().to_string();
    for (addr, want) in [
        // A name binds its first IPv4 address; the STUN listener follows it.
        ("localhost:0", "127.0.0.1:0/tcp (plain HTTP"),
        ("[localhost]:0", "127.0.0.1:0/tcp (plain HTTP"),
        ("[::ffff:127.0.0.1]:0", "127.0.0.1:0/tcp (plain HTTP"),
        // TLS by the port's text, as derper decides it.
        ("127.0.0.1:https", "127.0.0.1:443/tcp (TLS for"),
        ("127.0.0.1:0443", "127.0.0.1:443/tcp (plain HTTP"),
        ("127.0.0.1:", "127.0.0.1:0/tcp (plain HTTP"),
    ] {
        let (ok, out) = check(&["-a", addr, "-c", &key, "-certdir", &certdir, "-stun-port=0"]);
        assert!(ok, "{addr}: {out}");
        assert!(out.contains(want), "{addr}: want {want:?} in {out}");
        assert!(out.contains("127.0.0.1:0/udp"), "{addr}: STUN: {out}");
    }
}

#[test]
fn check_refuses_flags_that_cannot_act_together_saying_why() {
    let dir = TempDir::new("together");
    let key = dir.path("derper.key").display().to_string();
    for (args, want) in flags_that_cannot_act_together() {
        let mut all = vec!["-c", &key];
        all.extend(args.iter().copied());
        let (ok, out) = check(&all);
        assert!(!ok, "{args:?} passed the check:\n{out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("ERROR flags") && l.contains(want)),
            "{args:?}: want an ERROR flags line with {want:?}:\n{out}"
        );
        assert!(out.ends_with("derpd would not start\n"), "{args:?}:\n{out}");
    }
    assert!(!Path::new(&key).exists(), "--check created the key");
}

#[test]
fn check_names_derpers_flags_that_derper_ignores_too() {
    let dir = TempDir::new("ignored");
    let key = dir.path("derper.key").display().to_string();
    // A derper command line for a plain-HTTP node behind a proxy: derper ignores the TLS
    // flags there, and so does derpd, saying so.
    let (ok, out) = check(&[
        "-c",
        &key,
        "-a",
        "127.0.0.1:0",
        "-hostname",
        "derp.example.com",
        "-acme-ip-certs",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains(
            "warn  flags     --hostname and --acme-ip-certs are ignored, as in derper: the \
             listener serves plain HTTP"
        ),
        "{out}"
    );
}

#[test]
fn check_shows_a_list_flag_given_twice_narrowed_to_its_last_list() {
    let dir = TempDir::new("narrowed");
    let key = dir.path("derper.key").display().to_string();
    // An image's entrypoint trusts a wide range; the operator's later flag narrows it.
    let (ok, out) = check(&[
        "-c",
        &key,
        "-a",
        "127.0.0.1:0",
        "--trust-forwarded-from",
        "10.0.0.0/8,172.16.0.0/12",
        "--trust-forwarded-from",
        "192.0.2.1/32",
    ]);
    assert!(ok, "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("X-Forwarded-For (and no other header) names DERP clients"))
        .unwrap_or_else(|| panic!("no forwarded-headers line:\n{out}"));
    assert!(
        line.ends_with("on connections from 192.0.2.1/32"),
        "want only the last list: {line}"
    );
}
