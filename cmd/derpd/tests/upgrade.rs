//! Upgrading in place: SIGUSR2 starts the file now at derpd's path (a copy of the built
//! binary here, replaced by another copy as a package upgrade replaces it) and hands it every
//! listening socket and its plain TCP client connections; the new process serves on them at
//! once, the old one tells the clients it kept to reconnect and exits 0. A new binary that exits at once, refuses the handed sockets or never
//! confirms leaves the old process serving, its clients connected.

use crate::support;

use std::net::{SocketAddr, UdpSocket};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use derp_client::Client;
use support::{DERPD, Launch, Node, Process, STEP, TempDir, client, expect_packet, secret};

/// Copies the built derpd to `dir`/derpd and returns the path.
pub(crate) fn install(dir: &TempDir) -> PathBuf {
    let path = dir.path("derpd");
    std::fs::copy(DERPD, &path).expect("copy derpd");
    path
}

/// Puts `contents` (or a fresh copy of the built derpd) at `path` as a package upgrade does:
/// written beside it, then renamed over it, so the running file keeps its inode.
pub(crate) fn replace(path: &Path, contents: Option<&str>) {
    let before = std::fs::metadata(path).expect("installed").ino();
    let new = path.with_extension("new");
    match contents {
        Some(text) => std::fs::write(&new, text).expect("write"),
        None => {
            std::fs::copy(DERPD, &new).expect("copy derpd");
        }
    }
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&new, path).expect("rename");
    assert_ne!(std::fs::metadata(path).expect("replaced").ino(), before);
}

/// A dev node started from `exe`, with a key file in `dir` (the successor keeps the key).
fn start(exe: &Path, dir: &TempDir, more: &[&str]) -> Node {
    start_with_env(exe, dir, more, &[])
}

/// [`start`], with `envs` in the node's environment (and so its successor's).
pub(crate) fn start_with_env(
    exe: &Path,
    dir: &TempDir,
    more: &[&str],
    envs: &[(String, String)],
) -> Node {
    start_launched(
        &Launch::program(&exe.display().to_string()),
        dir,
        more,
        envs,
    )
}

/// [`start_with_env`], started as `launch` says (its program the installed copy).
pub(crate) fn start_launched(
    launch: &Launch,
    dir: &TempDir,
    more: &[&str],
    envs: &[(String, String)],
) -> Node {
    let key = dir.path("derp.key").display().to_string();
    let mut args = vec!["--dev", "-a", "127.0.0.1:0", "-c", &key];
    args.extend_from_slice(more);
    Node::start_with(launch, &args, envs)
}

/// The address of the STUN socket the node logged.
fn stun_addr(node: &Node) -> SocketAddr {
    node.find_log("the STUN line", |v| {
        (v["fields"]["message"] == "STUN listening")
            .then(|| v["fields"]["addr"].as_str()?.parse().ok())?
    })
}

/// A STUN binding request answered with the sender's address.
fn stun_answers(addr: SocketAddr) {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    socket.set_read_timeout(Some(STEP)).expect("timeout");
    let tx = derp_proto::stun::TxId::generate(&mut rand::rngs::OsRng);
    socket
        .send_to(&derp_proto::stun::binding_request(&tx), addr)
        .expect("send");
    let mut buf = [0u8; 1500];
    let n = socket.recv(&mut buf).expect("a STUN answer");
    let (got, mapped) = derp_proto::stun::parse_response(&buf[..n]).expect("a response");
    assert_eq!(got.as_bytes(), tx.as_bytes());
    assert_eq!(mapped, socket.local_addr().expect("addr"));
}

/// The inode of the socket listening (TCP) or bound (UDP) on 127.0.0.1:`port`.
fn socket_inode(proto: &str, port: u16) -> u64 {
    let table = std::fs::read_to_string(format!("/proc/net/{proto}")).expect("/proc/net");
    let local = format!("0100007F:{port:04X}");
    let state = if proto == "tcp" { "0A" } else { "07" };
    table
        .lines()
        .skip(1)
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.get(1) == Some(&local.as_str()) && f.get(3) == Some(&state))
                .then(|| f.get(9)?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("nothing on 127.0.0.1:{port}/{proto}"))
}

/// Whether process `pid` has the socket `inode` open.
fn holds(pid: u32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(Result::ok)
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|target| target.as_os_str() == want.as_str())
        })
        .unwrap_or(false)
}

/// Whether process `pid` has ended (gone, or a zombie nobody has reaped yet).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// The process that took over: not the test's child (the old derpd started it), so stopped
/// by its PID: SIGTERM in [`Successor::stop`], SIGKILL on drop.
pub(crate) struct Successor(pub(crate) u32);

impl Successor {
    pub(crate) fn signal(&self, sig: &str) {
        let _ = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.0.to_string()])
            .status();
    }

    pub(crate) fn wait_ended(&self) {
        assert!(
            support::exits_within(self.0, STEP),
            "{} did not exit",
            self.0
        );
    }

    pub(crate) fn stop(self) {
        self.signal("TERM");
        self.wait_ended();
    }
}

impl Drop for Successor {
    fn drop(&mut self) {
        if !ended(self.0) {
            self.signal("KILL");
            self.wait_ended();
        }
    }
}

/// A client and its key.
struct Peer {
    client: Client,
    key: derp_proto::PublicKey,
}

async fn peer(url: &str) -> Peer {
    let s = secret();
    let key = s.public_key();
    Peer {
        client: client(url, s).await,
        key,
    }
}

/// Two clients of `url` that can reach each other, proven by a packet each way.
async fn pair(url: &str) -> (Peer, Peer) {
    let mut a = peer(url).await;
    let mut b = peer(url).await;
    relays(&mut a, &mut b).await;
    (a, b)
}

/// A packet from `a` reaches `b` and one from `b` reaches `a`.
async fn relays(a: &mut Peer, b: &mut Peer) {
    let payload: [u8; 8] = rand::random();
    a.client
        .send_packet(b.key, payload.to_vec())
        .await
        .expect("send");
    expect_packet(&mut b.client, a.key, &payload).await;
    b.client
        .send_packet(a.key, payload.to_vec())
        .await
        .expect("send");
    expect_packet(&mut a.client, b.key, &payload).await;
}

/// Waits for the old process's log line that the upgrade failed; returns its error.
fn upgrade_failure(node: &Node) -> String {
    node.wait_log("the upgrade's failure", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("upgrade failed; this process keeps every listener")
            .then(|| v["fields"]["error"].as_str().map(str::to_owned))?
    })
}

/// After a failed upgrade: the node still runs, its clients still relay, a new client
/// connects and reaches an old one, and its listeners are its own alone.
async fn still_serving(node: &mut Node, a: &mut Peer, b: &mut Peer) {
    assert!(node.is_running(), "{}", node.log_text());
    relays(a, b).await;
    let mut c = peer(&node.url()).await;
    relays(a, &mut c).await;
    assert!(holds(node.pid(), socket_inode("tcp", node.addr.port())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_hands_every_port_to_the_new_file_at_the_path() {
    let dir = TempDir::new("upgrade");
    let exe = install(&dir);
    let mut node = start(&exe, &dir, &["--metrics-addr", "127.0.0.1:0"]);
    let stun = stun_addr(&node);
    let metrics = node.metrics_addr.expect("metrics address");
    let (mut a, mut b) = pair(&node.url()).await;

    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    let pid: u32 = node.wait_log("the takeover", |v| {
        (v["fields"]["message"] == "took over the listeners; this process is the service now")
            .then(|| v["fields"]["pid"].as_u64())?
            .map(|p| p as u32)
    });
    assert_eq!(pid, successor.0);
    assert_ne!(pid, node.pid());
    // The two processes' lines come in either order.
    node.find_log("the handover", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("handed every listener over")
            .then_some(())
    });
    // The new process is the new file: its path names a file, not a replaced one.
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe"),
        exe
    );
    // The old process's clients went across with their connections, and it exits 0.
    let status = node.wait_status(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
    relays(&mut a, &mut b).await;
    // Every port is the new process's: its sockets are the ones listening, and they serve.
    for (proto, port) in [
        ("tcp", node.addr.port()),
        ("udp", stun.port()),
        ("tcp", metrics.port()),
    ] {
        assert!(
            holds(pid, socket_inode(proto, port)),
            "{port}/{proto} is not the new process's"
        );
    }
    let (_c, _d) = pair(&node.url()).await;
    stun_answers(stun);
    assert!(support::http_get(metrics, "/metrics").starts_with("HTTP/1.1 200"));
    successor.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_process_accepts_nothing_more_while_it_drains() {
    let dir = TempDir::new("upgrade-drain");
    let exe = install(&dir);
    // Its stuck receiver stays with it rather than going across.
    let mut flags = vec![
        "--metrics-addr",
        "127.0.0.1:0",
        "--upgrade-connections=false",
    ];
    flags.extend(crate::restart::STUCK_FLAGS);
    let mut node = start(&exe, &dir, &flags);
    let stun = stun_addr(&node);
    let metrics = node.metrics_addr.expect("metrics address");
    // A receiver that never reads: the old process's drain waits on its queue.
    let stuck = crate::restart::stuck_receiver(&node).await;
    let inodes = [
        socket_inode("tcp", node.addr.port()),
        socket_inode("udp", stun.port()),
        socket_inode("tcp", metrics.port()),
    ];
    assert!(inodes.iter().all(|i| holds(node.pid(), *i)));

    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    let pid: u32 = node.wait_log("the handover", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("handed every listener over")
            .then(|| v["fields"]["to"].as_u64())?
            .map(|p| p as u32)
    });
    assert_eq!(pid, successor.0);
    // Draining, and none of the ports is the old process's any more: it closed every
    // listener before it logged the handover.
    for inode in inodes {
        assert!(holds(pid, inode), "the new process does not hold {inode}");
        assert!(
            !holds(node.pid(), inode),
            "the old process still holds {inode} after the handover"
        );
    }
    assert!(node.is_running(), "{}", node.log_text());
    let (_c, _d) = pair(&node.url()).await;
    // A new process that dies while the old one drains is reaped by it, not left a zombie.
    successor.signal("KILL");
    support::wait_until(
        STEP,
        || (!Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
        || format!("{pid} was not reaped"),
    );
    // A signal ends the old process's drain at once, as a second one does a shutdown's.
    node.signal("TERM");
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(1),
        "{}",
        node.log_text()
    );
    drop(stuck);
    drop(successor);
}

/// The address a log line with `message` names.
fn logged_addr(node: &Node, message: &'static str) -> SocketAddr {
    node.find_log(message, |v| {
        (v["fields"]["message"] == message).then(|| v["fields"]["addr"].as_str()?.parse().ok())?
    })
}

/// The next datagram on the notify socket.
fn notification(socket: &std::os::unix::net::UnixDatagram, node: &Process) -> String {
    let mut buf = [0u8; 4096];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no notification: {e}; log:\n{}", node.log_text()));
    String::from_utf8(buf[..n].to_vec()).expect("utf-8")
}

#[test]
fn a_tls_node_hands_its_port_80_and_quic_sockets_and_its_successor_tells_systemd_its_pid() {
    let dir = TempDir::new("upgrade-tls");
    let exe = install(&dir);
    let notify_path = dir.path("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).expect("bind");
    notify.set_read_timeout(Some(STEP)).expect("timeout");
    let certdir = dir.path("certs").display().to_string();
    let key = dir.path("derp.key").display().to_string();
    let mut args = support::manual_ip_args(&certdir);
    support::set_flag(&mut args, "--http-port", "0");
    args.extend(["-c", &key, "--quic-port", "0"]);
    let mut node = Node::start_with(
        &Launch::program(&exe.display().to_string()),
        &args,
        &[(
            "NOTIFY_SOCKET".to_owned(),
            notify_path.display().to_string(),
        )],
    );
    let http = logged_addr(&node, "port-80 listener (generate_204, acme, redirects)");
    let quic = logged_addr(&node, "QUIC listening (DERP over QUIC)");
    let stun = stun_addr(&node);
    let ready = notification(&notify, &node);
    assert!(ready.starts_with("READY=1\n"), "{ready:?}");

    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    let taken = notification(&notify, &node);
    let pid: u32 = taken
        .strip_prefix("MAINPID=")
        .and_then(|rest| rest.split_once('\n'))
        .and_then(|(pid, _)| pid.parse().ok())
        .unwrap_or_else(|| panic!("{taken:?}"));
    assert_eq!(pid, successor.0);
    assert!(
        taken.contains("\nREADY=1\nSTATUS=serving DERP over TLS on"),
        "{taken:?}"
    );
    let status = node.wait_status(STEP);
    assert_eq!(status.code(), Some(0), "{}", node.log_text());
    for (proto, port) in [
        ("tcp", node.addr.port()),
        ("tcp", http.port()),
        ("udp", quic.port()),
        ("udp", stun.port()),
    ] {
        assert!(
            holds(pid, socket_inode(proto, port)),
            "{port}/{proto} is not the new process's"
        );
    }
    assert!(support::http_get(http, "/generate_204").starts_with("HTTP/1.1 204"));
    stun_answers(stun);
    // The old process said nothing to systemd after its successor did: the next word is
    // the successor's own, when it stops.
    successor.signal("TERM");
    let stopping = notification(&notify, &node);
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    successor.wait_ended();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_file_that_exits_at_once_leaves_the_old_process_serving() {
    let dir = TempDir::new("upgrade-exits");
    let exe = install(&dir);
    let mut node = start(&exe, &dir, &[]);
    let (mut a, mut b) = pair(&node.url()).await;
    replace(&exe, Some("#!/bin/sh\nexit 3\n"));
    node.signal("USR2");
    let error = upgrade_failure(&node);
    // Whether it ended before or after the listeners were sent is the scheduler's choice.
    assert!(error.contains("exited: exit status: 3"), "{error}");
    still_serving(&mut node, &mut a, &mut b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_whose_flags_need_other_listeners_refuses_and_the_old_serves_on() {
    let dir = TempDir::new("upgrade-refuses");
    let exe = install(&dir);
    let mut node = start(&exe, &dir, &[]);
    let (mut a, mut b) = pair(&node.url()).await;
    // A wrapper that adds a listener the running process does not have.
    replace(
        &exe,
        Some(&format!(
            "#!/bin/sh\nexec {DERPD} \"$@\" --metrics-addr 127.0.0.1:0\n"
        )),
    );
    node.signal("USR2");
    let error = upgrade_failure(&node);
    assert!(
        error.contains("exited: exit status: 1: refused the handover"),
        "{error}"
    );
    assert!(
        error.contains("these flags need a metrics listener (TCP)"),
        "{error}"
    );
    still_serving(&mut node, &mut a, &mut b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigusr2_is_ignored_and_a_silent_new_process_is_killed_at_the_deadline() {
    let dir = TempDir::new("upgrade-silent");
    let exe = install(&dir);
    let mut node = start(&exe, &dir, &["--upgrade-timeout", "10s"]);
    let (mut a, mut b) = pair(&node.url()).await;
    // Starts, takes the channel, and never says a word.
    replace(&exe, Some("#!/bin/sh\nexec sleep 600\n"));
    node.signal("USR2");
    let child = started_successor(&node);
    node.signal("USR2");
    node.wait_message("SIGUSR2 ignored: an upgrade is under way");
    let error = upgrade_failure(&node);
    assert!(error.contains("did not confirm within 10s"), "{error}");
    assert!(error.contains("was killed"), "{error}");
    // Killed and reaped by the old process.
    assert!(!Path::new(&format!("/proc/{}", child.0)).exists());
    still_serving(&mut node, &mut a, &mut b).await;
}

/// Starts derpd as the new process of an upgrade whose old process is this test: derpd gets
/// its end of the handover channel as standard input, and the test keeps the other end,
/// whose reads time out after [`STEP`].
fn as_new_process(cmd: std::process::Command) -> (std::os::fd::OwnedFd, Process) {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let (mine, theirs) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair");
    rustix::net::sockopt::set_socket_timeout(
        &mine,
        rustix::net::sockopt::Timeout::Recv,
        Some(STEP),
    )
    .expect("timeout");
    let mut cmd = cmd;
    cmd.env("DERPD_TAKEOVER_FROM", std::process::id().to_string());
    let derpd = Process::spawn_with_stdin(cmd, std::process::Stdio::from(theirs));
    (mine, derpd)
}

/// The test as the old process: a hello of a format version this derpd does not read is
/// refused on the channel, with the reason, and the new process exits.
#[test]
fn a_hello_of_an_unknown_version_is_refused() {
    use rustix::net::{RecvFlags, SendFlags};
    let (mine, mut derpd) = as_new_process(support::derpd_command(
        &Launch::plain(),
        &["--log-format", "json", "--dev", "-a", "127.0.0.1:0"],
    ));
    let hello = br#"{"type":"hello","version":2,"pid":1,"listeners":[]}"#;
    rustix::net::send(&mine, hello, SendFlags::empty()).expect("send");
    let mut buf = [0u8; 4096];
    let (n, _) = rustix::net::recv(&mine, &mut buf, RecvFlags::empty()).expect("an answer");
    let answer: serde_json::Value = serde_json::from_slice(&buf[..n]).expect("json");
    assert_eq!(answer["type"], "refuse", "{answer}");
    assert_eq!(
        answer["reason"], "handover format version 2; this derpd reads version 1 only",
        "{answer}"
    );
    let status = derpd.wait_exit(STEP);
    assert_eq!(status.code(), Some(1), "{}", derpd.log_text());
    assert!(
        derpd.log_text().contains("handover format version 2"),
        "{}",
        derpd.log_text()
    );
}

/// The new process the old one started, from its log line: guarded at once, so a test that
/// fails later still stops it.
pub(crate) fn started_successor(node: &Node) -> Successor {
    Successor(node.wait_log("the upgrade's start", |v| {
        v["fields"]["message"]
            .as_str()?
            .starts_with("upgrade: started the new binary")
            .then(|| v["fields"]["child"].as_u64())?
            .map(|p| p as u32)
    }))
}

/// What the test puts in the notify socket's queue so that the next process to notify
/// blocks until the test reads.
const FILLER: &str = "X-DERPD-TEST=filler";

/// Fills the queue of the notify socket at `path`: whoever notifies next blocks in its send
/// (datagrams to a full Unix socket wait for room) until [`after_fillers`] makes room.
fn fill_notify_queue(path: &Path) -> usize {
    let socket = std::os::unix::net::UnixDatagram::unbound().expect("socket");
    socket.set_nonblocking(true).expect("nonblocking");
    let mut sent = 0;
    loop {
        match socket.send_to(FILLER.as_bytes(), path) {
            Ok(_) => sent += 1,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return sent,
            Err(e) => panic!("filling the notify queue: {e}"),
        }
    }
}

/// Reads the `fillers` and returns the notification that comes after them.
fn after_fillers(
    socket: &std::os::unix::net::UnixDatagram,
    node: &Process,
    fillers: usize,
) -> String {
    for _ in 0..fillers {
        assert_eq!(notification(socket, node), FILLER);
    }
    notification(socket, node)
}

/// A dev node started from `exe` that notifies the socket at `notify` (bound by the test),
/// once it has said READY=1.
fn start_notifying(
    exe: &Path,
    dir: &TempDir,
    notify: &Path,
    more: &[&str],
) -> (Node, std::os::unix::net::UnixDatagram) {
    let socket = std::os::unix::net::UnixDatagram::bind(notify).expect("bind");
    socket.set_read_timeout(Some(STEP)).expect("timeout");
    let key = dir.path("derp.key").display().to_string();
    let mut args = vec!["--dev", "-a", "127.0.0.1:0", "-c", &key];
    args.extend_from_slice(more);
    let node = Node::start_with(
        &Launch::program(&exe.display().to_string()),
        &args,
        &[("NOTIFY_SOCKET".to_owned(), notify.display().to_string())],
    );
    let ready = notification(&socket, &node);
    assert!(ready.starts_with("READY=1\n"), "{ready:?}");
    (node, socket)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_that_dies_after_the_commit_leaves_the_old_one_the_service() {
    let dir = TempDir::new("upgrade-dies-committed");
    let exe = install(&dir);
    let notify_path = dir.path("notify");
    // Connections handed to a process that dies are gone with it: kept here, they show the
    // old process serving on.
    let (mut node, notify) =
        start_notifying(&exe, &dir, &notify_path, &["--upgrade-connections=false"]);
    let (mut a, mut b) = pair(&node.url()).await;
    replace(&exe, None);
    // The new process, once committed, blocks telling systemd its PID: it dies there,
    // before it can say it is done.
    let fillers = fill_notify_queue(&notify_path);
    node.signal("USR2");
    let successor = started_successor(&node);
    node.wait_message("upgrade: committed");
    successor.signal("KILL");
    let said = after_fillers(&notify, &node, fillers);
    assert!(
        said.starts_with(&format!("MAINPID={}\nREADY=1\n", node.pid())),
        "{said:?}; log:\n{}",
        node.log_text()
    );
    let error = upgrade_failure(&node);
    assert!(
        error.contains("after the handover was committed"),
        "{error}"
    );
    assert!(error.contains("signal: 9"), "{error}");
    successor.wait_ended();
    still_serving(&mut node, &mut a, &mut b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_committed_upgrade_leaves_the_new_process_the_service() {
    let dir = TempDir::new("upgrade-term-committed");
    let exe = install(&dir);
    let notify_path = dir.path("notify");
    let (mut node, notify) = start_notifying(&exe, &dir, &notify_path, &[]);
    let (mut a, mut b) = pair(&node.url()).await;
    replace(&exe, None);
    let fillers = fill_notify_queue(&notify_path);
    node.signal("USR2");
    let successor = started_successor(&node);
    node.wait_message("upgrade: committed");
    node.signal("TERM");
    node.wait_message("signal during an upgrade that is committed");
    let said = after_fillers(&notify, &node, fillers);
    assert!(
        said.starts_with(&format!("MAINPID={}\nREADY=1\n", successor.0)),
        "{said:?}; log:\n{}",
        node.log_text()
    );
    // The old process hands over, its clients with it, and exits as after any upgrade.
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    relays(&mut a, &mut b).await;
    assert!(!ended(successor.0));
    let (_c, _d) = pair(&node.url()).await;
    // Nothing from the old process after the new one's MAINPID: the next word is the new
    // process's own, when it stops.
    successor.signal("TERM");
    let stopping = notification(&notify, &node);
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    successor.wait_ended();
}

/// Sends `body` with `fds` attached, as the old process does.
fn send_with_fds(
    channel: &impl std::os::fd::AsFd,
    body: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space =
        vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    rustix::net::sendmsg(
        channel,
        &[std::io::IoSlice::new(body)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .expect("sendmsg");
}

/// The next message on the channel, as JSON.
fn recv_message(channel: &impl std::os::fd::AsFd, derpd: &Process) -> serde_json::Value {
    let mut buf = [0u8; 4096];
    let (n, _) = rustix::net::recv(channel, &mut buf, rustix::net::RecvFlags::empty())
        .unwrap_or_else(|e| panic!("no message: {e}; log:\n{}", derpd.log_text()));
    serde_json::from_slice(&buf[..n]).expect("json")
}

/// The test as the old process, which commits and then cannot hear the new process's Done
/// (its end no longer reads): the new process has told systemd it is the main process and
/// serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_new_process_serves_on_when_its_done_cannot_be_sent() {
    use rustix::net::SendFlags;
    use std::os::fd::AsFd;
    let dir = TempDir::new("upgrade-done-lost");
    let notify_path = dir.path("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).expect("bind");
    notify.set_read_timeout(Some(STEP)).expect("timeout");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut cmd = support::derpd_command(
        &Launch::plain(),
        &[
            "--log-format",
            "json",
            "--dev",
            "-a",
            "127.0.0.1:0",
            "-stun=false",
        ],
    );
    cmd.env("NOTIFY_SOCKET", &notify_path);
    let (mine, mut derpd) = as_new_process(cmd);
    let hello = serde_json::json!({
        "type": "hello",
        "version": 1,
        "pid": std::process::id(),
        "listeners": [{"kind": "main", "addr": addr.to_string()}],
    });
    send_with_fds(&mine, hello.to_string().as_bytes(), &[listener.as_fd()]);
    drop(listener);
    let ready = recv_message(&mine, &derpd);
    assert_eq!(ready["type"], "ready", "{ready}");
    assert_eq!(ready["pid"], derpd.pid(), "{ready}");
    // The new process's sends fail from now on; what it is sent still arrives.
    rustix::net::shutdown(&mine, rustix::net::Shutdown::Read).expect("shutdown");
    rustix::net::send(&mine, br#"{"type":"commit"}"#, SendFlags::NOSIGNAL).expect("commit");
    let said = notification(&notify, &derpd);
    assert!(
        said.starts_with(&format!("MAINPID={}\nREADY=1\n", derpd.pid())),
        "{said:?}"
    );
    derpd.wait_message("could not tell the old derpd the takeover is done");
    derpd.wait_message("took over the listeners; this process is the service now");
    assert!(derpd.is_running(), "{}", derpd.log_text());
    let (_a, _b) = pair(&format!("http://{addr}/derp")).await;
    derpd.signal("TERM");
    assert_eq!(
        derpd.wait_exit(STEP).code(),
        Some(0),
        "{}",
        derpd.log_text()
    );
}

/// The test as the old process, keeping its copies of the sockets it hands: until it
/// commits, every connection and datagram that arrives is its own, and the new process,
/// which has confirmed it would serve, takes none of them; after the commit it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_takes_no_connection_or_datagram_before_the_commit() {
    use rustix::net::SendFlags;
    use std::os::fd::AsFd;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stun = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let stun_addr = stun.local_addr().expect("addr");
    let (mine, mut derpd) = as_new_process(support::derpd_command(
        &Launch::plain(),
        &[
            "--log-format",
            "json",
            "--dev",
            "-a",
            "127.0.0.1:0",
            "--stun-port",
            "0",
        ],
    ));
    let hello = serde_json::json!({
        "type": "hello",
        "version": 1,
        "pid": std::process::id(),
        "listeners": [
            {"kind": "main", "addr": addr.to_string()},
            {"kind": "stun", "addr": stun_addr.to_string()},
        ],
    });
    send_with_fds(
        &mine,
        hello.to_string().as_bytes(),
        &[listener.as_fd(), stun.as_fd()],
    );
    let ready = recv_message(&mine, &derpd);
    assert_eq!(ready["type"], "ready", "{ready}");

    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
    let mut conns = Vec::new();
    for _ in 0..8 {
        conns.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        tokio::time::timeout(STEP, listener.accept())
            .await
            .expect("the connection is the old process's to accept")
            .expect("accept");
    }
    let client = UdpSocket::bind("127.0.0.1:0").expect("bind");
    stun.set_read_timeout(Some(STEP)).expect("timeout");
    let mut buf = [0u8; 1500];
    for i in 0..8u8 {
        client.send_to(&[i; 32], stun_addr).expect("send");
        let (n, _) = stun
            .recv_from(&mut buf)
            .expect("the datagram is the old process's to read");
        assert_eq!(&buf[..n], &[i; 32]);
    }

    rustix::net::send(&mine, br#"{"type":"commit"}"#, SendFlags::NOSIGNAL).expect("commit");
    let done = recv_message(&mine, &derpd);
    assert_eq!(done["type"], "done", "{done}");
    // What the test does not take from now on is the new process's.
    drop((listener, stun));
    let (_a, _b) = pair(&format!("http://{addr}/derp")).await;
    stun_answers(stun_addr);
    derpd.signal("TERM");
    assert_eq!(
        derpd.wait_exit(STEP).code(),
        Some(0),
        "{}",
        derpd.log_text()
    );
}

/// The old process's QUIC clients are sent Restarting and closed, as on SIGTERM; new QUIC
/// clients are the new process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_process_tells_its_quic_clients_to_reconnect_and_the_new_one_serves_quic() {
    let dir = TempDir::new("upgrade-quic");
    let exe = install(&dir);
    let certdir = dir.path("certs").display().to_string();
    let key = dir.path("derp.key").display().to_string();
    let mut args = support::manual_ip_args(&certdir);
    args.extend(["-c", &key, "--quic-port", "0"]);
    let mut node = Node::start_with(&Launch::program(&exe.display().to_string()), &args, &[]);
    let mut old = support::quic_client(&node, secret()).await;
    old.ping().await.expect("ping");
    replace(&exe, None);
    node.signal("USR2");
    let successor = started_successor(&node);
    // The new process's reset may come first: both derive it from the node key.
    support::expect_quic_shutdown(&mut old, true).await;
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    let (sa, sb) = (secret(), secret());
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut a = Peer {
        client: support::quic_client(&node, sa).await,
        key: ka,
    };
    let mut b = Peer {
        client: support::quic_client(&node, sb).await,
        key: kb,
    };
    relays(&mut a, &mut b).await;
    successor.stop();
}
