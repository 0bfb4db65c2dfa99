//! derpd under faults of its environment: running out of file descriptors, a full disk
//! while writing the key file or the certificate cache, and SIGKILL in the middle of those
//! writes. Each fault is set up for the derpd process alone (resource limits applied by a
//! shell before `exec`, signals injected by strace), never for the test.

use crate::support;

use std::io::{Read, Write};
use std::time::Duration;

use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::{PublicKey, SecretKey};

use support::faults::{self as fault, open_fds, read_opt};
use support::{Launch, Process, STEP, TempDir, derpd_command, run_to_exit};

/// A connected client and its key.
struct Peer {
    client: Client,
    key: PublicKey,
}

impl Peer {
    async fn connect(addr: &str) -> Result<Self, derp_client::ConnectError> {
        Self::connect_url(&format!("http://{addr}/derp"), None).await
    }

    /// Over TLS, trusting the certificate with `pin` only.
    async fn connect_pinned(addr: &str, pin: &str) -> Self {
        Self::connect_url(&format!("https://{addr}/derp"), Some(pin))
            .await
            .expect("pinned TLS client")
    }

    async fn connect_url(url: &str, pin: Option<&str>) -> Result<Self, derp_client::ConnectError> {
        let secret = SecretKey::generate(&mut rand::rngs::OsRng);
        let key = secret.public_key();
        let mut config =
            ClientConfig::new(url, secret)?.with_connect_timeout(Duration::from_secs(2));
        if let Some(pin) = pin {
            config = config.with_cert_name(pin);
        }
        Ok(Self {
            client: Client::connect(&config).await?,
            key,
        })
    }

    /// Sends `what` to `to` and waits until `to` has it.
    async fn relay_to(&mut self, to: &mut Peer, what: &[u8]) {
        self.client.send_packet(to.key, what).await.expect("send");
        loop {
            let frame = tokio::time::timeout(STEP, to.client.recv())
                .await
                .expect("packet in time")
                .expect("recv");
            if let ReceivedFrame::RecvPacket { src, packet } = frame {
                assert_eq!((src, &packet[..]), (self.key, what));
                return;
            }
        }
    }
}

/// A plain HTTP GET on a fresh connection; `None` when no answer came within `wait`.
fn http_get(addr: &str, path: &str, wait: Duration) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(wait)).expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    // A timeout leaves whatever arrived; an empty answer is no answer.
    let _ = s.read_to_string(&mut out);
    (!out.is_empty()).then_some(out)
}

/// With its descriptors used up, derpd keeps running and keeps relaying for the clients it
/// has; new connections wait in the listen queue instead of crashing anything, and once
/// clients leave, the waiting connection and new ones are served.
#[tokio::test]
async fn descriptor_exhaustion_is_survived_and_serving_resumes() {
    let mut derpd = fault::start_dev(&Launch::with_setup("ulimit -n 48"), &[]);
    let addr = derpd.addr.to_string();
    let baseline = open_fds(derpd.pid());
    let at_start = fault::describe_fds(derpd.pid());
    let mut a = Peer::connect(&addr).await.expect("first client");
    let mut b = Peer::connect(&addr).await.expect("second client");
    a.relay_to(&mut b, b"before").await;

    // Fill every descriptor with real clients until one cannot get in.
    let mut fillers = Vec::new();
    loop {
        assert!(fillers.len() < 64, "the descriptor limit never bit");
        match Peer::connect(&addr).await {
            Ok(p) => fillers.push(p),
            Err(_) => break,
        }
    }
    assert!(fillers.len() >= 10, "only {} clients fit", fillers.len());
    derpd.wait_log("an accept failure logged", |v| {
        let msg = v["fields"]["message"].as_str()?;
        let err = v["fields"]["error"].as_str()?;
        (msg == "accept failed" && err.contains("Too many open files")).then_some(())
    });

    // A connection that arrives now waits; nothing breaks meanwhile.
    let addr2 = addr.clone();
    let waiting = std::thread::spawn(move || http_get(&addr2, "/derp/probe", STEP));
    a.relay_to(&mut b, b"while full").await;
    let (first, rest) = fillers.split_at_mut(1);
    rest[0].relay_to(&mut first[0], b"filler to filler").await;
    assert!(derpd.is_running());

    // Clients leave: the waiting connection is served, and so are new ones.
    let filled = fillers.len();
    drop(fillers);
    let probe = tokio::task::spawn_blocking(move || waiting.join().expect("join"))
        .await
        .expect("join");
    let probe = probe.expect("the queued connection was never served");
    assert!(probe.starts_with("HTTP/1.1 200 "), "{probe}");
    let mut c = Peer::connect(&addr).await.expect("a client after recovery");
    c.relay_to(&mut a, b"after").await;
    a.relay_to(&mut c, b"and back").await;
    let varz = http_get(&addr, "/debug/varz", STEP).expect("metrics after recovery");
    assert!(
        varz.contains("derp_current_connections 3"),
        "{filled} filled;\n{varz}"
    );

    // Every descriptor comes back once the clients are gone.
    drop((a, b, c));
    let deadline = std::time::Instant::now() + STEP;
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    while open_fds(derpd.pid()) > baseline {
        assert!(
            std::time::Instant::now() < deadline,
            "descriptors: {} open, {baseline} at start:\n{at_start}\nnow:\n{}",
            open_fds(derpd.pid()),
            fault::describe_fds(derpd.pid())
        );
        poll.tick().await;
    }
    assert!(derpd.is_running());
}

/// The one line derpd printed before exiting with an error.
fn error_line(log: &str) -> &str {
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("derpd: ")).collect();
    assert_eq!(lines.len(), 1, "want one error line:\n{log}");
    lines[0]
}

/// A key file that cannot be written (nothing fits, or only part of it) is a clear error
/// naming the file, and leaves no file behind, neither a truncated key nor a temporary file.
/// An existing key is read, never rewritten, so a full disk does not stop a restart.
#[test]
fn a_key_file_the_disk_cannot_take_is_a_clear_error_and_leaves_nothing() {
    let dir = TempDir::new("key-full");
    let key = dir.path("derper.key");
    let key_arg = key.to_str().expect("utf8");
    let args = ["-c", key_arg, "-a", "127.0.0.1:0", "--stun-port", "0"];
    // 0: the first write fails; 40: the first write is cut short, the next one fails.
    for room in [0, 40] {
        let (status, log) = run_to_exit(&Launch::full_disk(room), &args);
        assert!(!status.success(), "room {room}: derpd started:\n{log}");
        let line = error_line(&log);
        assert!(
            line.contains(&format!("creating config file {key_arg}"))
                && line.contains("File too large"),
            "room {room}: {line}"
        );
        assert!(
            dir.names().is_empty(),
            "room {room}: left {:?}",
            dir.names()
        );
    }

    let derpd = fault::start_dev(&Launch::plain(), &["-c", key_arg]);
    drop(derpd);
    let written = read_opt(&key).expect("key file");
    let derpd = fault::start_dev(&Launch::full_disk(0), &["-c", key_arg]);
    drop(derpd);
    assert_eq!(read_opt(&key).as_deref(), Some(written.as_str()));
    assert_eq!(dir.names(), ["derper.key"]);
}

/// support's manual IP node, for a derpd started without [`support::Node`]: JSON logs, STUN
/// on an ephemeral port.
fn manual_ip_args(certdir: &str) -> Vec<&str> {
    let mut args = support::manual_ip_args(certdir);
    args.extend(["--stun-port", "0", "--log-format", "json"]);
    args
}

/// The self-signed certificate of an IP-only node is written key first, then certificate.
/// A disk that takes neither, or only the key, gives a clear error naming the file, and no
/// truncated file stays behind; with room again, derpd completes the pair for the key already
/// on disk (keeping it) and serves it.
#[tokio::test]
async fn a_certificate_cache_the_disk_cannot_take_is_a_clear_error_and_recovers() {
    let dir = TempDir::new("cert-full");
    let certdir = dir.0.to_str().expect("utf8");
    let args = manual_ip_args(certdir);

    let (status, log) = run_to_exit(&Launch::full_disk(0), &args);
    assert!(!status.success());
    let line = error_line(&log);
    assert!(
        line.contains("127.0.0.1.key") && line.contains("File too large"),
        "{line}"
    );
    assert!(dir.names().is_empty(), "left {:?}", dir.names());

    // The key (241 bytes) fits; the certificate (about 600) does not.
    let (status, log) = run_to_exit(&Launch::full_disk(400), &args);
    assert!(!status.success());
    let line = error_line(&log);
    assert!(
        line.contains("127.0.0.1.crt") && line.contains("File too large"),
        "{line}"
    );
    assert_eq!(dir.names(), ["127.0.0.1.key"]);
    let key = read_opt(&dir.path("127.0.0.1.key")).expect("key");
    assert!(
        key.trim_end().ends_with("-----END PRIVATE KEY-----"),
        "{key}"
    );

    let derpd = Process::spawn(derpd_command(&Launch::plain(), &args));
    let pin = derpd.wait_log("the certificate in service", |v| {
        (v["fields"]["message"] == "manual certificate in service")
            .then(|| v["fields"]["pin"].as_str().map(str::to_owned))?
    });
    let addr = derpd.wait_log("the listening line", |v| {
        (v["fields"]["message"] == "derpd listening (TLS)")
            .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
    });
    assert_eq!(
        read_opt(&dir.path("127.0.0.1.key")),
        Some(key),
        "key replaced"
    );
    assert_eq!(dir.names(), ["127.0.0.1.crt", "127.0.0.1.key"]);
    let config = ClientConfig::new(
        &format!("https://{addr}/derp"),
        SecretKey::generate(&mut rand::rngs::OsRng),
    )
    .expect("config")
    .with_cert_name(&pin)
    .with_connect_timeout(STEP);
    let client = Client::connect(&config).await.expect("pinned TLS client");
    drop(client);
}

/// The temporary file derpd with process id `pid` writes a new key to.
fn key_temp(key: &std::path::Path, pid: u32) -> std::path::PathBuf {
    key.with_file_name(format!("derper.key.tmp{pid}"))
}

fn dev_args(key: &str) -> Vec<&str> {
    vec![
        "--dev",
        "-a",
        "127.0.0.1:0",
        "--stun-port",
        "0",
        "--log-format",
        "json",
        "-c",
        key,
    ]
}

/// The public key derpd logged when it started listening.
fn served_key(derpd: &Process) -> String {
    derpd.find_log("the listening line", |v| {
        (v["fields"]["message"] == "derpd listening (plain HTTP)")
            .then(|| v["fields"]["key"].as_str().map(str::to_owned))?
    })
}

/// The public key of the key file at `path`, as derpd logs it.
fn public_of(path: &std::path::Path) -> String {
    let text = read_opt(path).expect("key file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("key file JSON");
    let secret: SecretKey = v["PrivateKey"]
        .as_str()
        .expect("PrivateKey")
        .parse()
        .expect("private key");
    secret.public_key().to_string()
}

/// SIGKILL at every step of creating the key file: writing the temporary file, syncing it,
/// linking it into place, removing the temporary name. Before the link there is no key file;
/// after it, a complete one. The next start takes over from there: it creates the key, or
/// serves the one already in place, and clears away the dead process's temporary file.
#[test]
fn sigkill_while_the_key_file_is_created_never_leaves_a_partial_key() {
    for (syscalls, on_temp, in_place) in [
        ("write", true, false),
        ("fsync", true, false),
        ("link,linkat", false, false),
        ("unlink,unlinkat", true, true),
    ] {
        let dir = TempDir::new("key-kill");
        let key = dir.path("derper.key");
        let key_arg = key.to_str().expect("utf8");
        let mut traced = fault::Traced::start(
            syscalls,
            "KILL",
            |pid| {
                if on_temp {
                    key_temp(&key, pid)
                } else {
                    key.clone()
                }
            },
            &dev_args(key_arg),
        );
        let status = traced.derpd.wait_exit(STEP);
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "{syscalls}: {status:?}\n{}",
            traced.derpd.log_text()
        );
        let killed_pid = traced.derpd.pid();
        drop(traced);
        let left = read_opt(&key);
        assert_eq!(left.is_some(), in_place, "{syscalls}: {left:?}");
        let before = left.as_ref().map(|_| public_of(&key));
        assert!(
            key_temp(&key, killed_pid).exists(),
            "{syscalls}: {:?}",
            dir.names()
        );

        let derpd = fault::start_dev(&Launch::plain(), &["-c", key_arg]);
        let served = served_key(&derpd);
        assert_eq!(served, public_of(&key), "{syscalls}");
        if let Some(before) = before {
            assert_eq!(served, before, "{syscalls}: the key in place was replaced");
        }
        assert_eq!(dir.names(), ["derper.key"], "{syscalls}");
    }
}

/// A key file that appears while derpd is creating one (another start racing this one) is
/// never overwritten: derpd, frozen just before putting its own key in place, finds the file
/// there when it resumes and serves that key instead.
#[test]
fn a_key_file_that_appears_during_creation_survives() {
    let dir = TempDir::new("key-race");
    let key = dir.path("derper.key");
    let key_arg = key.to_str().expect("utf8");
    // A stop delivered on entering the sync takes effect when the sync returns: the key is
    // written and synced, not yet linked.
    let traced = fault::Traced::start(
        "fsync",
        "STOP",
        |pid| key_temp(&key, pid),
        &dev_args(key_arg),
    );
    let pid = traced.derpd.pid();
    traced.wait_frozen();
    assert!(
        key_temp(&key, pid).exists() && read_opt(&key).is_none(),
        "{:?} state {:?}\n{}",
        dir.names(),
        fault::process_state(pid),
        traced.output_text()
    );
    let other = SecretKey::generate(&mut rand::rngs::OsRng);
    let other_file = format!("{{\"PrivateKey\":\"{}\"}}", other.to_text());
    std::fs::write(&key, &other_file).expect("write the other key");
    let status = std::process::Command::new("kill")
        .args(["-CONT", &pid.to_string()])
        .status()
        .expect("kill -CONT");
    assert!(status.success());
    assert_eq!(served_key(&traced.derpd), other.public_key().to_string());
    assert_eq!(read_opt(&key).as_deref(), Some(other_file.as_str()));
    assert!(!key_temp(&key, pid).exists(), "{:?}", dir.names());
}

/// SIGKILL while an IP-only node writes its self-signed pair: before the key is in place,
/// nothing is; between the key and the certificate, the key is. Either way the next start
/// serves a matching pair (keeping a key already in place) and clears the dead process's
/// temporary files.
#[tokio::test]
async fn sigkill_while_the_certificate_cache_is_written_is_recovered_from() {
    for (syscalls, file, key_in_place) in [
        ("write", "127.0.0.1.key", false),
        ("rename,renameat,renameat2", "127.0.0.1.key", false),
        ("write", "127.0.0.1.crt", true),
        ("rename,renameat,renameat2", "127.0.0.1.crt", true),
    ] {
        let dir = TempDir::new("cert-kill");
        let certdir = dir.0.to_str().expect("utf8");
        let args = manual_ip_args(certdir);
        let mut traced = fault::Traced::start(
            syscalls,
            "KILL",
            |pid| dir.path(&format!("{file}.tmp{pid}")),
            &args,
        );
        let status = traced.derpd.wait_exit(STEP);
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "{syscalls} {file}: {status:?}\n{}",
            traced.derpd.log_text()
        );
        drop(traced);
        let key = read_opt(&dir.path("127.0.0.1.key"));
        assert_eq!(key.is_some(), key_in_place, "{syscalls} {file}");
        assert!(read_opt(&dir.path("127.0.0.1.crt")).is_none());

        let derpd = Process::spawn(derpd_command(&Launch::plain(), &args));
        let pin = derpd.wait_log("the certificate in service", |v| {
            (v["fields"]["message"] == "manual certificate in service")
                .then(|| v["fields"]["pin"].as_str().map(str::to_owned))?
        });
        let addr = derpd.wait_log("the listening line", |v| {
            (v["fields"]["message"] == "derpd listening (TLS)")
                .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
        });
        if let Some(key) = key {
            assert_eq!(
                read_opt(&dir.path("127.0.0.1.key")),
                Some(key),
                "key replaced"
            );
        }
        assert_eq!(
            dir.names(),
            ["127.0.0.1.crt", "127.0.0.1.key"],
            "{syscalls} {file}"
        );
        let config = ClientConfig::new(
            &format!("https://{addr}/derp"),
            SecretKey::generate(&mut rand::rngs::OsRng),
        )
        .expect("config")
        .with_cert_name(&pin)
        .with_connect_timeout(STEP);
        Client::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("{syscalls} {file}: pinned TLS client: {e}"));
    }
}

/// libfaketime, preloaded into derpd so a test can move its clocks.
fn libfaketime() -> &'static str {
    const PATHS: [&str; 3] = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ];
    PATHS
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is not installed (Debian package faketime); run \
                 `scripts/test-tools install` (scripts/test does it when it can)"
            )
        })
}

/// derpd with its clocks at the offset written in `offset_file` (e.g. `+75s`), re-read at
/// most once a second. `wall_only` leaves the monotonic clock alone.
fn faketime_command(
    offset_file: &std::path::Path,
    wall_only: bool,
    args: &[&str],
) -> std::process::Command {
    std::fs::write(offset_file, "+0s").expect("offset file");
    let mut cmd = derpd_command(&Launch::plain(), args);
    cmd.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME_TIMESTAMP_FILE", offset_file)
        .env("FAKETIME_CACHE_DURATION", "1");
    if wall_only {
        cmd.env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    cmd
}

/// The monotonic clock leaping forward (a paused VM resumed, say) makes every timer due at
/// once. For derpd that means keepalives to idle clients, now rather than in a minute, and
/// nothing else: no client is cut off, and relaying and pings carry on.
#[tokio::test]
async fn a_monotonic_clock_leap_sends_keepalives_and_drops_no_one() {
    let dir = TempDir::new("leap");
    let offset = dir.path("offset");
    let args = [
        "--dev",
        "-a",
        "127.0.0.1:0",
        "--stun-port",
        "0",
        "--log-format",
        "json",
    ];
    let derpd = Process::spawn(faketime_command(&offset, false, &args));
    let addr = derpd.find_log("the listening line", |v| {
        (v["fields"]["message"] == "derpd listening (plain HTTP)")
            .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
    });
    let mut a = Peer::connect(&addr).await.expect("a");
    let mut b = Peer::connect(&addr).await.expect("b");
    let mut c = Peer::connect(&addr).await.expect("c");
    a.relay_to(&mut b, b"before").await;

    // Keepalives are due 60-65 s after connecting; the clock moves 2 minutes ahead. derpd
    // notices when something wakes it (the offset file is re-read at most once a second), so
    // a pings until the keepalives have arrived.
    std::fs::write(&offset, "+120s").expect("leap");
    let mut seen = [false; 3];
    let deadline = tokio::time::Instant::now() + STEP;
    while seen != [true; 3] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "keepalives seen: {seen:?}"
        );
        a.client.send_ping([7; 8]).await.expect("ping");
        for (i, p) in [&mut a, &mut b, &mut c].into_iter().enumerate() {
            while let Ok(frame) =
                tokio::time::timeout(Duration::from_millis(100), p.client.recv()).await
            {
                if matches!(frame.expect("recv"), ReceivedFrame::KeepAlive) {
                    seen[i] = true;
                }
            }
        }
    }
    a.relay_to(&mut c, b"after").await;
    c.relay_to(&mut b, b"and on").await;
    tokio::time::timeout(STEP, b.client.ping())
        .await
        .expect("pong in time")
        .expect("ping");
    let varz = http_get(&addr, "/debug/varz", STEP).expect("metrics");
    assert!(varz.contains("derp_current_connections 3"), "{varz}");
    assert!(varz.contains("derp_sclient_write_timeouts 0"), "{varz}");
}

/// The wall clock jumping a year ahead or back (a bad NTP step, a VM restored from a
/// snapshot) changes nothing for the relay, whose timers all run on the monotonic clock:
/// connections stay, packets and pings flow, and new TLS clients are served the same
/// certificate.
#[tokio::test]
async fn wall_clock_jumps_change_nothing_for_clients() {
    let dir = TempDir::new("wall");
    let offset = dir.path("offset");
    let certdir = dir.path("certs");
    let args = manual_ip_args(certdir.to_str().expect("utf8"));
    let mut cmd = faketime_command(&offset, true, &args);
    // Connection lines (debug) carry derpd's idea of the time, which shows the jump took.
    cmd.env("RUST_LOG", "info,derp_server=debug");
    let derpd = Process::spawn(cmd);
    let year_now = 1970
        + std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs()
            / 31_556_952;
    let pin = derpd.wait_log("the certificate in service", |v| {
        (v["fields"]["message"] == "manual certificate in service")
            .then(|| v["fields"]["pin"].as_str().map(str::to_owned))?
    });
    let addr = derpd.wait_log("the listening line", |v| {
        (v["fields"]["message"] == "derpd listening (TLS)")
            .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
    });
    let mut a = Peer::connect_pinned(&addr, &pin).await;
    let mut b = Peer::connect_pinned(&addr, &pin).await;
    a.relay_to(&mut b, b"before").await;
    for (jump, tag, ahead) in [
        ("+400d", &b"a year ahead"[..], true),
        ("-400d", b"a year back", false),
    ] {
        std::fs::write(&offset, jump).expect("jump");
        // derpd re-reads the offset file at most once a second. Traffic keeps flowing until
        // a new client's connection line shows the jumped clock.
        let deadline = std::time::Instant::now() + STEP;
        let mut c = loop {
            a.relay_to(&mut b, tag).await;
            b.relay_to(&mut a, tag).await;
            tokio::time::timeout(STEP, a.client.ping())
                .await
                .expect("pong in time")
                .expect("ping");
            derpd.skip_log();
            let c = Peer::connect_pinned(&addr, &pin).await;
            let logged_year: u64 = derpd.wait_log("the new connection line", |v| {
                (v["fields"]["message"] == "client connected")
                    .then(|| v["timestamp"].as_str()?.get(..4)?.parse().ok())?
            });
            let moved = if ahead {
                logged_year > year_now
            } else {
                logged_year < year_now
            };
            if moved {
                break c;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{jump}: derpd's clock still says {logged_year}"
            );
        };
        c.relay_to(&mut a, tag).await;
        b.relay_to(&mut c, tag).await;
    }
    assert!(
        !derpd.log_text().contains("\"level\":\"WARN\""),
        "{}",
        derpd.log_text()
    );
}
