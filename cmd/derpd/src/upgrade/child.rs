//! The new process as the old one holds it: killed and reaped unless it took over, waited
//! for by its pidfd.

use std::process::Child;
use std::time::{Duration, Instant};

use derp_server::ExitWatch;
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

/// Waits up to `within` for process `pid` (a child, not yet reaped) to exit: woken by the
/// exit itself where the kernel has pidfds.
fn wait_for_exit(pid: u32, within: Duration) {
    if let Some(watch) = ExitWatch::open(pid) {
        watch.wait(within);
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
