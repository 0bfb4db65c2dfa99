//! The new process as the old one holds it: killed and reaped unless it took over, waited
//! for by its pidfd.

use std::process::Child;
use std::time::{Duration, Instant};

use tracing::warn;

use super::EXIT_WAIT;

/// The new process, killed and reaped unless it took over.
pub(super) struct ChildGuard(pub(super) Option<Child>);

impl ChildGuard {
    pub(super) fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// The process's status if it exits within `within` (reaped then), `None` if it runs on.
    pub(super) fn exited_within(
        &mut self,
        within: Duration,
    ) -> std::io::Result<Option<std::process::ExitStatus>> {
        let Some(child) = &mut self.0 else {
            return Ok(None);
        };
        let deadline = Instant::now() + within;
        wait_for_exit(child.id(), within);
        // Under a tracer (strace -f), the exit reaches this process, its parent, a moment
        // after the pidfd shows it.
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::park_timeout(Duration::from_millis(10));
        }
    }

    pub(super) fn disarm(&mut self) {
        // Not killed: it is the service now, and outlives this process. Reaped by a thread
        // of its own should it exit while this process drains, rather than left a zombie
        // until this one exits.
        if let Some(child) = self.0.take() {
            reap_later(child);
        }
    }

    /// Waits (a short while) for the process to exit, then kills it if it has not, reaps
    /// it, and says how it ended.
    pub(super) fn finish(mut self) -> String {
        let pid = self.id();
        if let Ok(Some(status)) = self.exited_within(EXIT_WAIT) {
            self.0 = None;
            return format!("(pid {pid}) exited: {status}");
        }
        let Some(mut child) = self.0.take() else {
            return "is gone".to_owned();
        };
        let _ = child.kill();
        match child.wait() {
            Ok(_) => format!("(pid {pid}) was killed"),
            Err(e) => format!("(pid {pid}) was killed; reaping it: {e}"),
        }
    }
}

/// Waits up to `within` for process `pid` (a child, not yet reaped) to exit, on a pidfd:
/// woken by the exit itself. Where the kernel has no pidfds (before Linux 5.3), in short
/// steps.
fn wait_for_exit(pid: u32, within: Duration) {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let deadline = Instant::now() + within;
    let pidfd = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .and_then(|pid| {
            rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
        });
    let Some(pidfd) = pidfd else {
        // No pidfd: a step at a time, checking the process's state in /proc.
        while Instant::now() < deadline && !exited(pid) {
            std::thread::park_timeout(Duration::from_millis(10));
        }
        return;
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(timeout) = Timespec::try_from(left) else {
            return;
        };
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            // Readable once the process has exited.
            Ok(_) => return,
            Err(rustix::io::Errno::INTR) if !left.is_zero() => continue,
            Err(_) => return,
        }
    }
}

/// Whether process `pid` has exited (a zombie, or gone).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            // Dropped on a runtime worker (an upgrade ended by a signal): not waited for here.
            reap_later(child);
        }
    }
}

/// Reaps `child` whenever it exits, on a thread of its own, so that it is not left a zombie
/// and nothing waits for it.
fn reap_later(mut child: Child) {
    let reaper = std::thread::Builder::new()
        .name("derpd-reaper".to_owned())
        .spawn(move || {
            let _ = child.wait();
        });
    if let Err(e) = reaper {
        warn!(error = %e, "no thread to reap the new process with");
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn an_exit_is_waited_for_and_a_running_process_is_left_running() {
        let mut done = Command::new("true").spawn().expect("true");
        wait_for_exit(done.id(), Duration::from_secs(30));
        assert!(done.try_wait().expect("try_wait").is_some());
        let mut running = Command::new("sleep").arg("60").spawn().expect("sleep");
        wait_for_exit(running.id(), Duration::from_millis(50));
        assert!(running.try_wait().expect("try_wait").is_none());
        running.kill().expect("kill");
        running.wait().expect("reap");
    }
}
