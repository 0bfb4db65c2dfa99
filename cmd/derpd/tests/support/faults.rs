//! Running derpd under a fault: a shell wrapper sets resource limits or signal dispositions
//! before `exec`, so the limits apply to derpd alone and not to the test; strace injects
//! signals at chosen system calls.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use super::{DERPD, STEP};

/// A derpd process, killed and reaped on drop, with its stderr lines collected.
pub struct Derpd {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Derpd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How derpd is started: shell lines run first (e.g. `ulimit -n 64`), then an optional
/// wrapper that execs it in turn (e.g. `prlimit --fsize=0`). The process id stays derpd's.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    pub setup: String,
    pub wrapper: String,
}

impl Launch {
    /// Plain: no limits.
    pub fn plain() -> Self {
        Self::default()
    }

    /// With `setup` run by the shell first.
    pub fn with_setup(setup: &str) -> Self {
        Self {
            setup: setup.to_owned(),
            wrapper: String::new(),
        }
    }

    /// A disk that takes only `bytes` more bytes per file: writes past that fail with EFBIG,
    /// as they would with ENOSPC on a full disk (RLIMIT_FSIZE, with SIGXFSZ ignored so the
    /// write returns the error instead of killing the process).
    pub fn full_disk(bytes: u64) -> Self {
        require_tool("prlimit", "util-linux");
        Self {
            setup: "trap '' XFSZ".to_owned(),
            wrapper: format!("prlimit --fsize={bytes}"),
        }
    }
}

/// A command that runs `launch.setup` in `sh`, then execs derpd with `args` (through
/// `launch.wrapper`, if any).
pub fn derpd_command(launch: &Launch, args: &[&str]) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "{}\nexec {} \"$0\" \"$@\"",
            launch.setup, launch.wrapper
        ))
        .arg(DERPD)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

impl Derpd {
    /// Spawns `cmd` (stderr piped) and collects its stderr lines.
    pub fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn derpd");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                keep.lock().expect("log").push(line.clone());
                let _ = tx.send(line);
            }
        });
        Self {
            child,
            lines: rx,
            log,
        }
    }

    /// Starts derpd in plain-HTTP dev mode on ephemeral loopback ports with JSON logs.
    pub fn start_dev(launch: &Launch, extra: &[&str]) -> (Self, String) {
        let mut args = vec![
            "--dev",
            "-a",
            "127.0.0.1:0",
            "--stun-port",
            "0",
            "--log-format",
            "json",
        ];
        args.extend_from_slice(extra);
        let d = Self::spawn(derpd_command(launch, &args));
        let addr = d.wait_log("the listening line", |v| {
            (v["fields"]["message"] == "derpd listening (plain HTTP)")
                .then(|| v["fields"]["addr"].as_str().map(str::to_owned))?
        });
        // The STUN socket is opened after the listening line; wait for it so that descriptor
        // counts taken now are the steady state.
        d.wait_log("the STUN line", |v| {
            (v["fields"]["message"] == "STUN listening").then_some(())
        });
        (d, addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a JSON log line for which `pick` returns something.
    pub fn wait_log<T>(&self, what: &str, pick: impl Fn(&serde_json::Value) -> Option<T>) -> T {
        let deadline = Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|e| {
                panic!("waiting for {what}: {e}; log so far:\n{}", self.log_text())
            });
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                && let Some(t) = pick(&v)
            {
                return t;
            }
        }
    }

    /// The first line logged so far (not only the unread ones) for which `pick` returns
    /// something; waits for new lines when none has yet.
    pub fn find_log<T>(&self, what: &str, pick: impl Fn(&serde_json::Value) -> Option<T>) -> T {
        let seen = self.log.lock().expect("log").clone();
        for line in seen {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                && let Some(t) = pick(&v)
            {
                return t;
            }
        }
        self.wait_log(what, pick)
    }

    /// Marks every line logged so far as read, so [`Derpd::wait_log`] sees only later ones.
    pub fn skip_log(&self) {
        while self.lines.try_recv().is_ok() {}
    }

    /// Everything derpd wrote to stderr so far.
    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // Let the reader thread take the last lines.
                let _ = self.lines.recv_timeout(Duration::from_millis(200));
                return status;
            }
            assert!(Instant::now() < deadline, "derpd did not exit");
            std::thread::park_timeout(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

/// Open descriptors of process `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .count()
}

/// What each open descriptor of process `pid` refers to, for failure messages.
pub fn describe_fds(pid: u32) -> String {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            let target = std::fs::read_link(e.path())
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            out.push(format!("{} -> {target}", e.file_name().to_string_lossy()));
        }
    }
    out.sort();
    out.join("\n")
}

/// Runs derpd to completion; returns its exit status and stderr.
pub fn run_to_exit(launch: &Launch, args: &[&str]) -> (ExitStatus, String) {
    let mut d = Derpd::spawn(derpd_command(launch, args));
    let status = d.wait_exit();
    (status, d.log_text())
}

/// Whether `tool` is on PATH; if not, fails the test with the line that installs it. Never
/// skips: a test that cannot run must not pass.
pub fn require_tool(tool: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{tool} is not installed (Debian package {package}); run `scripts/test-tools install` \
         (scripts/test does it when it can)"
    );
}

/// Reads a file, or `None` when it does not exist.
pub fn read_opt(path: &Path) -> Option<String> {
    match std::fs::read_to_string(path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("reading {}: {e}", path.display()),
    }
}

/// The state letter of process `pid` (`R`, `S`, `T` for stopped...), or `None` once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state follows the command name, which is in parentheses and may contain spaces.
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
}

/// Whether process `pid` is being traced.
fn traced(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .map(|v| v.trim() != "0")
        })
        .unwrap_or(false)
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + STEP;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::park_timeout(Duration::from_millis(5));
    }
}

/// A derpd whose first `syscalls` call on the file `path_of(pid)` gets `signal`, so a test can
/// kill or freeze it at an exact step of a file write. strace delivers the signal as the call
/// is entered: SIGKILL keeps the call from running at all; SIGSTOP takes effect once it
/// returns. derpd is started stopped, so strace is attached before it runs a single
/// instruction of its own.
pub struct Traced {
    pub derpd: Derpd,
    strace: Child,
    /// strace's own output: the traced calls and the signals it delivered.
    output: PathBuf,
}

impl Drop for Traced {
    fn drop(&mut self) {
        let _ = self.strace.kill();
        let _ = self.strace.wait();
        let _ = std::fs::remove_file(&self.output);
    }
}

impl Traced {
    pub fn start(
        syscalls: &str,
        signal: &str,
        path_of: impl FnOnce(u32) -> PathBuf,
        args: &[&str],
    ) -> Self {
        require_tool("strace", "strace");
        let launch = Launch::with_setup("kill -STOP $$");
        let derpd = Derpd::spawn(derpd_command(&launch, args));
        let pid = derpd.pid();
        wait_until("derpd to stop itself", || process_state(pid) == Some('T'));
        let path = path_of(pid);
        let output = std::env::temp_dir().join(format!("derpd-faults-strace-{pid}"));
        let strace = Command::new("strace")
            .args(["-qq", "-f", "-p", &pid.to_string()])
            .arg("-o")
            .arg(&output)
            .arg("-P")
            .arg(&path)
            .args(["-e", &format!("trace={syscalls}")])
            .args(["-e", &format!("inject={syscalls}:signal={signal}:when=1")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strace");
        wait_until("strace to attach", || traced(pid));
        let status = Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status()
            .expect("kill -CONT");
        assert!(status.success());
        Self {
            derpd,
            strace,
            output,
        }
    }

    /// What strace printed so far.
    pub fn output_text(&self) -> String {
        std::fs::read_to_string(&self.output).unwrap_or_default()
    }

    /// Waits until derpd is held stopped by the signal strace delivered (`signal=STOP`).
    pub fn wait_frozen(&self) {
        // The first stop strace reports is the one derpd started in; the one that counts
        // follows the signal strace sent itself (si_code SI_KERNEL).
        wait_until("derpd to freeze at the traced call", || {
            let out = self.output_text();
            out.find("--- SIGSTOP {si_signo=SIGSTOP, si_code=SI_KERNEL}")
                .is_some_and(|at| out[at..].contains("--- stopped by SIGSTOP ---"))
        });
    }
}
