//! Watching another process for its exit, which both sides of an upgrade need: the old
//! process waits for a successor that failed, and a load test waits for the relay it
//! upgraded. A pidfd where the kernel has one (Linux 5.3 and later): readable once the
//! process exits, whoever its parent is. Without one, the process's state in `/proc`, a
//! step at a time.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::process::{Pid, PidfdFlags, Signal};

/// How often the `/proc` fallback looks.
const STEP: Duration = Duration::from_millis(2);

/// A process watched for its exit.
#[derive(Debug)]
pub struct ExitWatch {
    pid: u32,
    raw: Pid,
    pidfd: Option<OwnedFd>,
}

impl ExitWatch {
    /// Watches process `pid`; `None` when no process could have that id (0, or above
    /// `i32::MAX`). A process that has already exited is watched too, and has exited.
    pub fn open(pid: u32) -> Option<Self> {
        let raw = i32::try_from(pid).ok().and_then(Pid::from_raw)?;
        let pidfd = rustix::process::pidfd_open(raw, PidfdFlags::empty()).ok();
        Some(Self { pid, raw, pidfd })
    }

    /// The process's id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends `signal` to the process, through the pidfd when there is one, so that a
    /// process that exited and whose id was reused is never the one signalled.
    pub fn signal(&self, signal: Signal) -> std::io::Result<()> {
        match &self.pidfd {
            Some(fd) => rustix::process::pidfd_send_signal(fd, signal)?,
            None => rustix::process::kill_process(self.raw, signal)?,
        }
        Ok(())
    }

    /// Whether the process has exited (a zombie not yet reaped, or gone).
    pub fn exited(&self) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            // The state follows the command's name, which is in parentheses and may hold
            // any byte, a ')' included: the last ')' ends it.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
            Err(_) => true,
        }
    }

    /// Blocks up to `within` for the process to exit; whether it did.
    pub fn wait(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let Some(fd) = &self.pidfd else {
            while !self.exited() {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::park_timeout(STEP);
            }
            return true;
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(timeout) = Timespec::try_from(left) else {
                return false;
            };
            let mut fds = [PollFd::new(fd, PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(0) => return false,
                Ok(_) => return true,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return self.exited(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn an_exit_is_seen_and_a_running_process_is_left_running() {
        let mut done = Command::new("true").spawn().expect("true");
        let watch = ExitWatch::open(done.id()).expect("a pid");
        assert!(watch.wait(Duration::from_secs(30)));
        assert!(watch.exited(), "a zombie has exited");
        done.wait().expect("reap");
        assert!(watch.exited(), "a reaped process has exited");

        let mut running = Command::new("sleep").arg("60").spawn().expect("sleep");
        let watch = ExitWatch::open(running.id()).expect("a pid");
        assert!(!watch.wait(Duration::from_millis(50)));
        assert!(!watch.exited());
        watch.signal(Signal::KILL).expect("kill");
        assert!(watch.wait(Duration::from_secs(30)));
        running.wait().expect("reap");
    }

    #[test]
    fn no_process_has_id_zero_or_one_beyond_i32() {
        assert!(ExitWatch::open(0).is_none());
        assert!(ExitWatch::open(u32::MAX).is_none());
    }
}
