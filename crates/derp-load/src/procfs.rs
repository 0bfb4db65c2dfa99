//! CPU time and memory from Linux's `/proc`, without a libc binding.
//!
//! The bench reports its own CPU use next to the server's so that a reader can tell which one
//! ran out of CPU first. Everything here returns `None` (or an error the caller turns into a
//! warning) on systems without `/proc`.

use std::path::Path;

/// CPU time of a process or thread, user plus system.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTime {
    /// Seconds spent in user space.
    pub user_s: f64,
    /// Seconds spent in the kernel.
    pub system_s: f64,
}

impl CpuTime {
    /// User plus system.
    pub fn total(self) -> f64 {
        self.user_s + self.system_s
    }

    /// What was used since `earlier` (never negative).
    pub fn since(self, earlier: Self) -> Self {
        Self {
            user_s: (self.user_s - earlier.user_s).max(0.0),
            system_s: (self.system_s - earlier.system_s).max(0.0),
        }
    }
}

/// Clock ticks per second for `/proc/*/stat`. `sysconf(_SC_CLK_TCK)` needs libc, but the
/// kernel also hands the value to every process in its auxiliary vector (`AT_CLKTCK`).
pub fn clock_ticks_per_second() -> f64 {
    const AT_CLKTCK: u64 = 17;
    if let Ok(auxv) = std::fs::read("/proc/self/auxv") {
        for entry in auxv.chunks_exact(16) {
            let (key, value) = entry.split_at(8);
            let key = u64::from_ne_bytes(key.try_into().unwrap_or([0; 8]));
            let value = u64::from_ne_bytes(value.try_into().unwrap_or([0; 8]));
            if key == AT_CLKTCK && value > 0 {
                return value as f64;
            }
        }
    }
    // USER_HZ has been 100 on every mainstream Linux architecture.
    100.0
}

/// Parses utime and stime out of a `/proc/*/stat` line.
///
/// The command name (field 2) is in parentheses and may itself contain spaces and
/// parentheses, so fields are counted from the last `)`.
pub fn parse_stat(stat: &str, ticks_per_s: f64) -> Option<(String, CpuTime)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let rest: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14 and stime field 15.
    let utime: u64 = rest.get(11)?.parse().ok()?;
    let stime: u64 = rest.get(12)?.parse().ok()?;
    Some((
        comm,
        CpuTime {
            user_s: utime as f64 / ticks_per_s,
            system_s: stime as f64 / ticks_per_s,
        },
    ))
}

/// CPU time of a whole process (all its threads, live and exited).
pub fn process_cpu(pid: &str, ticks_per_s: f64) -> Option<CpuTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat, ticks_per_s).map(|(_, cpu)| cpu)
}

/// CPU time of this process's live threads whose name starts with `prefix`.
pub fn own_threads_cpu(prefix: &str, ticks_per_s: f64) -> Option<CpuTime> {
    let mut total = CpuTime::default();
    for entry in std::fs::read_dir(Path::new("/proc/self/task")).ok()? {
        let Ok(entry) = entry else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            // The thread exited between listing and reading.
            continue;
        };
        if let Some((comm, cpu)) = parse_stat(&stat, ticks_per_s)
            && comm.starts_with(prefix)
        {
            total.user_s += cpu.user_s;
            total.system_s += cpu.system_s;
        }
    }
    Some(total)
}

/// Machine-wide CPU time from the first line of `/proc/stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MachineCpu {
    /// Every non-idle state: user, nice, system, irq, softirq, steal.
    pub busy_s: f64,
    /// Softirq alone: loopback TCP delivery runs there, and with IRQ time accounting it is
    /// charged to no process.
    pub softirq_s: f64,
}

/// Parses the aggregate `cpu` line of `/proc/stat`.
pub fn parse_proc_stat(stat: &str, ticks_per_s: f64) -> Option<MachineCpu> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let at = |i: usize| v.get(i).copied().unwrap_or(0) as f64 / ticks_per_s;
    if v.len() < 7 {
        return None;
    }
    Some(MachineCpu {
        busy_s: at(0) + at(1) + at(2) + at(5) + at(6) + at(7),
        softirq_s: at(6),
    })
}

/// Machine-wide CPU time so far.
pub fn machine_cpu(ticks_per_s: f64) -> Option<MachineCpu> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?, ticks_per_s)
}

/// Resident set size in bytes from a `/proc/*/status` text (`VmRSS:  1234 kB`).
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let value: u64 = parts.next()?.parse().ok()?;
    let scale = match parts.next() {
        Some("kB") | None => 1024,
        Some("mB") => 1024 * 1024,
        Some(_) => return None,
    };
    Some(value * scale)
}

/// Resident set size of a process, in bytes.
pub fn process_rss(pid: &str) -> Option<u64> {
    parse_vm_rss(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// The soft limit on open files, from a `/proc/*/limits` text.
pub fn parse_open_files_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(u64::MAX);
    }
    soft.parse().ok()
}

/// This process's soft limit on open files, if it can be read.
pub fn open_files_limit() -> Option<u64> {
    parse_open_files_limit(&std::fs::read_to_string("/proc/self/limits").ok()?)
}

/// The ephemeral port range (`net.ipv4.ip_local_port_range`); how many client connections one
/// source address can hold to one server address.
pub fn ephemeral_ports() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|p| p.parse::<u32>());
            match (it.next(), it.next()) {
                (Some(Ok(lo)), Some(Ok(hi))) if hi >= lo => Some(hi - lo + 1),
                _ => None,
            }
        })
        // Linux's default range, 32768-60999.
        .unwrap_or(28_232)
}

/// Bench and server CPU at one instant.
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    /// The bench's CPU, less an in-process relay's.
    pub bench: Option<CpuTime>,
    /// The server's, when it can be observed.
    pub server: Option<CpuTime>,
    /// The whole machine's.
    pub machine: Option<MachineCpu>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_name() {
        let line = "4242 (derp d) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 \
                    4 0 1000 1000000 300 18446744073709551615";
        let (comm, cpu) = parse_stat(line, 100.0).unwrap();
        assert_eq!(comm, "derp d) (x)");
        assert!((cpu.user_s - 2.5).abs() < 1e-9);
        assert!((cpu.system_s - 0.75).abs() < 1e-9);
        assert!((cpu.total() - 3.25).abs() < 1e-9);
    }

    #[test]
    fn stat_truncated_is_none() {
        assert!(parse_stat("1 (x) S 1 2 3", 100.0).is_none());
        assert!(parse_stat("garbage", 100.0).is_none());
    }

    #[test]
    fn own_process_has_cpu_and_rss() {
        let ticks = clock_ticks_per_second();
        assert!(ticks >= 1.0);
        assert!(process_cpu("self", ticks).is_some());
        assert!(process_rss("self").unwrap() > 0);
        assert!(open_files_limit().unwrap() > 0);
        assert!(ephemeral_ports() > 0);
    }

    #[test]
    fn machine_stat() {
        let text = "cpu  100 5 50 1000 7 3 20 2 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        let m = parse_proc_stat(text, 100.0).unwrap();
        assert!((m.busy_s - 1.80).abs() < 1e-9, "{m:?}");
        assert!((m.softirq_s - 0.20).abs() < 1e-9);
        assert!(parse_proc_stat("cpu  1 2\n", 100.0).is_none());
        assert!(machine_cpu(clock_ticks_per_second()).unwrap().busy_s > 0.0);
    }

    #[test]
    fn vm_rss_and_limits() {
        assert_eq!(
            parse_vm_rss("Name:\tx\nVmRSS:\t  2048 kB\nVmData: 1 kB\n"),
            Some(2048 * 1024)
        );
        assert_eq!(parse_vm_rss("Name: x\n"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_open_files_limit(limits), Some(1024));
        assert_eq!(
            parse_open_files_limit("Max open files unlimited unlimited files"),
            Some(u64::MAX)
        );
    }

    #[test]
    fn cpu_since_never_negative() {
        let a = CpuTime {
            user_s: 1.0,
            system_s: 2.0,
        };
        let b = CpuTime {
            user_s: 0.5,
            system_s: 3.0,
        };
        let d = b.since(a);
        assert_eq!(d.user_s, 0.0);
        assert_eq!(d.system_s, 1.0);
    }
}
