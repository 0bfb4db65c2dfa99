//! A child process with its output collected line by line, and how derpd is started.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{DERPD, STEP};

/// A child process, killed and reaped on drop, with its stderr and stdout collected line by
/// line: derpd (JSON logs on stderr, the DERP map node line on stdout) or a tool a test runs.
pub struct Process {
    child: Option<Child>,
    pid: u32,
    /// Every stderr line so far, for diagnostics and for [`Process::find_log`].
    log: Arc<Mutex<Vec<String>>>,
    /// Stderr lines not read yet by a wait.
    lines: mpsc::Receiver<String>,
    stdout: mpsc::Receiver<String>,
    readers: Vec<JoinHandle<()>>,
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends each line of `r` to a channel (and, with `log`, keeps it there too).
fn read_lines(
    r: impl Read + Send + 'static,
    log: Option<Arc<Mutex<Vec<String>>>>,
) -> (mpsc::Receiver<String>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if let Some(log) = &log {
                log.lock().expect("log").push(line.clone());
            }
            let _ = tx.send(line);
        }
    });
    (rx, reader)
}

/// Parses a JSON log line; `None` for anything else (a panic message, say).
fn json(line: &str) -> Option<serde_json::Value> {
    serde_json::from_str(line).ok()
}

impl Process {
    /// Spawns `cmd` with stdout and stderr piped (stdin closed) and starts collecting both.
    pub fn spawn(cmd: Command) -> Self {
        Self::spawn_with_stdin(cmd, Stdio::null())
    }

    /// [`Process::spawn`] with `stdin` as standard input.
    pub fn spawn_with_stdin(mut cmd: Command, stdin: Stdio) -> Self {
        let mut child = cmd
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (lines, err_reader) =
            read_lines(child.stderr.take().expect("stderr"), Some(log.clone()));
        let (stdout, out_reader) = read_lines(child.stdout.take().expect("stdout"), None);
        Self {
            pid: child.id(),
            child: Some(child),
            log,
            lines,
            stdout,
            readers: vec![err_reader, out_reader],
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends a signal by name ("TERM", "HUP", "STOP", ...).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().expect("try_wait").is_none())
    }

    /// Waits for the process to exit on its own, for at most `within`; then for the last of
    /// its output.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let status = self.wait_status(within);
        // The pipes reach EOF once the process is gone.
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        status
    }

    /// Waits for the process to exit on its own, for at most `within`, without waiting for
    /// the end of its output: a process it started (an upgrade's successor) holds the same
    /// pipes and may write to them long after.
    pub fn wait_status(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        super::exits_within(self.pid, within);
        // A process under a tracer (strace) is the tracer's to reap first: its exit reaches
        // this, its parent, a moment after the pidfd says it has exited.
        let (pid, log) = (self.pid, self.log.clone());
        let child = self.child.as_mut().expect("running");
        let status = super::wait_until(
            deadline.saturating_duration_since(Instant::now()),
            || child.try_wait().expect("try_wait"),
            || {
                format!(
                    "{pid} did not exit within {within:?}; log:\n{}",
                    log.lock().expect("log").join("\n")
                )
            },
        );
        self.child = None;
        status
    }

    /// Waits for a JSON stderr line for which `pick` returns something, within [`STEP`].
    pub fn wait_log<T>(&self, what: &str, pick: impl Fn(&serde_json::Value) -> Option<T>) -> T {
        let deadline = Instant::now() + STEP;
        loop {
            let Some(v) = self.next_log(deadline) else {
                panic!("waiting for {what}; log:\n{}", self.log_text());
            };
            if let Some(t) = pick(&v) {
                return t;
            }
        }
    }

    /// Waits for a log line whose message starts with `prefix`.
    pub fn wait_message(&self, prefix: &str) {
        self.wait_log(prefix, |v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(prefix))
                .then_some(())
        });
    }

    /// The next JSON stderr line not read yet, or `None` if none comes before `deadline`.
    pub fn next_log(&self, deadline: Instant) -> Option<serde_json::Value> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            if let Some(v) = json(&line) {
                return Some(v);
            }
        }
    }

    /// The first line logged so far (not only the unread ones) for which `pick` returns
    /// something; waits for new lines when none has yet.
    pub fn find_log<T>(&self, what: &str, pick: impl Fn(&serde_json::Value) -> Option<T>) -> T {
        let seen = self.log.lock().expect("log").clone();
        seen.iter()
            .filter_map(|l| json(l))
            .find_map(|v| pick(&v))
            .unwrap_or_else(|| self.wait_log(what, pick))
    }

    /// Marks every line logged so far as read, so [`Process::wait_log`] sees only later ones.
    pub fn skip_log(&self) {
        while self.lines.try_recv().is_ok() {}
    }

    /// Everything written to stderr so far.
    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }

    /// Waits for a stdout line for which `pick` returns something, within [`STEP`].
    pub fn wait_stdout<T>(&self, what: &str, pick: impl Fn(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.stdout.recv_timeout(left).unwrap_or_else(|e| {
                panic!(
                    "waiting for {what} on stdout: {e}; log:\n{}",
                    self.log_text()
                )
            });
            if let Some(t) = pick(&line) {
                return t;
            }
        }
    }
}

/// How derpd is started: shell lines run first (e.g. `ulimit -n 64`), then an optional
/// wrapper that execs it in turn (e.g. `prlimit --fsize=0`, `ip netns exec NS`). The process
/// id stays derpd's.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    pub setup: String,
    pub wrapper: String,
    /// The file to run instead of the built derpd (a copy of it elsewhere, say).
    pub program: Option<String>,
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
            ..Self::default()
        }
    }

    /// The file at `path` (started by that path, which becomes its `argv[0]`).
    pub fn program(path: &str) -> Self {
        Self {
            program: Some(path.to_owned()),
            ..Self::default()
        }
    }

    /// In network namespace `ns` (needs root).
    pub fn in_netns(ns: &str) -> Self {
        Self {
            wrapper: format!("ip netns exec {ns}"),
            ..Self::default()
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
            ..Self::default()
        }
    }
}

/// A command that runs `launch.setup` in `sh`, then execs derpd with `args` (through
/// `launch.wrapper`, if any), logging at info.
pub fn derpd_command(launch: &Launch, args: &[impl AsRef<str>]) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "{}\nexec {} \"$0\" \"$@\"",
            launch.setup, launch.wrapper
        ))
        .arg(launch.program.as_deref().unwrap_or(DERPD))
        .args(args.iter().map(AsRef::as_ref))
        .env("RUST_LOG", "info");
    cmd
}

/// Runs derpd to completion; returns its exit status and stderr.
pub fn run_to_exit(launch: &Launch, args: &[&str]) -> (ExitStatus, String) {
    let mut d = Process::spawn(derpd_command(launch, args));
    let status = d.wait_exit(STEP);
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
