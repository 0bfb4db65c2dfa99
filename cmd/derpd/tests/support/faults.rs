//! Running derpd under a fault: a shell wrapper sets resource limits or signal dispositions
//! before `exec`, so the limits apply to derpd alone and not to the test; strace injects
//! signals at chosen system calls.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Launch, Node, Process, STEP, derpd_command, require_tool};

/// derpd in plain-HTTP dev mode on ephemeral loopback ports, started as `launch` says, once
/// its STUN socket is open too, so that descriptor counts taken now are the steady state.
pub fn start_dev(launch: &Launch, extra: &[&str]) -> Node {
    let mut args = vec!["--dev", "-a", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let node = Node::start_with(launch, &args, &[]);
    node.find_log("the STUN line", |v| {
        (v["fields"]["message"] == "STUN listening").then_some(())
    });
    node
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
    pub derpd: Process,
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
        let derpd = Process::spawn(derpd_command(&launch, args));
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
        // Guarded before anything can panic, so a failed start still stops strace.
        let started = Self {
            derpd,
            strace,
            output,
        };
        wait_until("strace to attach", || traced(pid));
        let status = Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status()
            .expect("kill -CONT");
        assert!(status.success());
        started
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
