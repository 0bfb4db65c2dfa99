//! How many worker threads run connections, why, and the runtime that runs them.

/// How many worker threads run connections, and why.
pub(crate) struct Workers {
    pub(crate) count: usize,
    /// What the count was derived from: `--workers`, or the CPUs this process may use.
    cpus: Option<usize>,
}

impl Workers {
    /// `--workers N`, or for 0 the default: one worker where the process may use at most
    /// two CPUs, else one per CPU. On two CPUs one worker spends less CPU per packet than
    /// two (nothing crosses threads, and the other CPU is left to the kernel's network work
    /// and TLS handshakes); docs/operations.md has the measurements and the trade-off.
    pub(crate) fn of(flag: usize) -> Self {
        if flag > 0 {
            return Self {
                count: flag,
                cpus: None,
            };
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            count: default_workers(cpus),
            cpus: Some(cpus),
        }
    }

    pub(crate) fn describe(&self) -> String {
        let runtime = if self.count == 1 {
            "one worker thread (current-thread runtime)".to_owned()
        } else {
            format!("{} worker threads (multi-thread runtime)", self.count)
        };
        match self.cpus {
            None => format!("{runtime}, as --workers says"),
            Some(cpus) => format!("{runtime}: the default for {cpus} usable CPU(s)"),
        }
    }
}

/// The default worker count for `cpus` usable CPUs.
fn default_workers(cpus: usize) -> usize {
    if cpus <= 2 { 1 } else { cpus }
}

impl Workers {
    /// The runtime for this count. One worker runs on a current-thread runtime: every task
    /// on the thread that drives the sockets, with none of the multi-threaded scheduler's
    /// work stealing, idle-worker bookkeeping and per-batch clock reads, which buy nothing
    /// with a single worker.
    pub(crate) fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = if self.count == 1 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(self.count);
            b
        };
        builder.enable_all().build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_on_two_cpus_or_fewer_else_one_per_cpu() {
        assert_eq!(default_workers(1), 1);
        assert_eq!(default_workers(2), 1);
        assert_eq!(default_workers(3), 3);
        assert_eq!(default_workers(16), 16);
        assert_eq!(Workers::of(2).count, 2, "--workers is taken as given");
        assert_eq!(Workers::of(1).count, 1);
    }
}
