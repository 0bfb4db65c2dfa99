//! Replacing the running binary without closing its ports: on SIGUSR2 derpd starts the file
//! at the path it was started from (the new binary a package upgrade has just put there)
//! with the same arguments and environment, hands it every listening socket over a socket
//! pair, and once the new process serves on them and has told systemd it is the main
//! process, stops accepting and ends its own connections as a graceful shutdown does.
//!
//! What goes across, and how, is [`wire`]'s; which sockets a process binds or takes over,
//! [`sockets`]'; the client connections that can go (plain TCP), [`conns`]' and
//! `derp_server`'s. The rest the old process tells to reconnect (a Restarting frame) and
//! drains, and the ports never stop accepting.
//!
//! The channel is a `SOCK_SEQPACKET` socket pair, the new process's end given to it as its
//! standard input, named by [`TAKEOVER_ENV`] in its environment: nothing has a name on the
//! file system, and only the two processes hold an end. (Standard input, because a process
//! takes an inherited descriptor under a number of its own choosing only with `unsafe` code,
//! which the workspace forbids; the new process puts `/dev/null` there once it has its copy.)
//!
//! If the new process cannot be started, exits, refuses (a handover format it cannot read,
//! or flags that need other listeners), or does not confirm within `--upgrade-timeout`, the
//! old one kills and reaps it, logs why, and goes on serving: it never stopped accepting.
//! Once the old process has committed, the new one is the service: it is never killed for
//! what goes wrong after that (a lost `Done`, a signal to the old process); only if it has
//! exited does the old one tell systemd that it is the main process again, and serve on.

mod conns;
pub(crate) mod sockets;
pub(crate) mod wire;

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tracing::{error, info, warn};

use crate::sd_notify::Notifier;
use sockets::Sockets;
use wire::{Handed, Listener, Message, RecvError};

/// Set in the new process's environment: the old process's PID, and that its standard input
/// is the handover channel.
pub(crate) const TAKEOVER_ENV: &str = "DERPD_TAKEOVER_FROM";

/// How long the new process waits for the old one's hello, sent as soon as it has started.
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How long the old process waits for `Done` once it has committed: the new process only has
/// to tell systemd its PID.
const DONE_WAIT: Duration = Duration::from_secs(10);
/// How long a refusing new process may take to exit before it is killed.
const EXIT_WAIT: Duration = Duration::from_secs(5);
/// How long the new process waits for the old one's commit after confirming; the old one's
/// `--upgrade-timeout` ends the wait sooner (it kills the new process).
const COMMIT_WAIT: Duration = Duration::from_secs(3600);
/// How long the old process waits for its connections to stop where they are before it
/// hands over those that did (the rest stay and are told to reconnect).
const FREEZE_WAIT: Duration = Duration::from_secs(2);
/// Set (to anything) in a new process's environment, it refuses the connections once they
/// have all come across: how the tests make a successor that refuses the handed state.
const REFUSE_CONNS_ENV: &str = "DERPD_TEST_REFUSE_CONNECTIONS";

/// The file this process was started from, found at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Executable {
    pub(crate) path: PathBuf,
    /// How it was found, for the log and `--check`.
    pub(crate) source: &'static str,
}

/// The path to start an upgrade from, decided once at start-up (before the file can have
/// been replaced, and with the start-up directory and `PATH`).
///
/// `argv[0]`, made absolute against the working directory or found in `PATH` as the shell
/// found it, is the path the operator or the service manager ran. It is used as it is, its
/// symbolic links not resolved, so that a link switched to another version
/// (`/usr/local/bin/derpd -> /opt/derpd-1.3/derpd`) starts the version it now points to;
/// and because a package upgrade replaces the file at that path, starting the path starts
/// the new file. It is trusted only if it names the very file running now (same device and
/// inode as `/proc/self/exe` at start-up): `argv[0]` is whatever the parent wrote there.
/// Otherwise the target of `/proc/self/exe` is the path, without the " (deleted)" the kernel
/// appends once the file has been replaced; that target has every link resolved.
pub(crate) fn executable() -> anyhow::Result<Executable> {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let cwd = std::env::current_dir().ok();
    let path_var = std::env::var_os("PATH");
    let named = resolve_argv0(&argv0, cwd.as_deref(), path_var.as_deref(), is_executable);
    let running = std::fs::metadata("/proc/self/exe").ok();
    if let (Some(path), Some(running)) = (&named, &running)
        && let Ok(m) = std::fs::metadata(path)
        && m.dev() == running.dev()
        && m.ino() == running.ino()
    {
        return Ok(Executable {
            path: path.clone(),
            source: "argv[0]",
        });
    }
    let link = std::fs::read_link("/proc/self/exe")
        .context("neither argv[0] nor /proc/self/exe names the running binary")?;
    Ok(Executable {
        path: strip_deleted(link),
        source: "/proc/self/exe",
    })
}

/// `argv[0]` as an absolute path: with a slash, against `cwd`; without, the first
/// executable file of that name in `path_var`'s directories.
fn resolve_argv0(
    argv0: &OsStr,
    cwd: Option<&Path>,
    path_var: Option<&OsStr>,
    is_executable: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    if argv0.is_empty() {
        return None;
    }
    // `.` components go (the kernel resolves the path the same way without them); `..` stay,
    // as they may cross a symbolic link.
    let absolute = |p: PathBuf| match cwd {
        _ if p.is_absolute() => Some(p.components().collect()),
        Some(cwd) => Some(cwd.join(p).components().collect()),
        None => None,
    };
    if argv0.as_bytes().contains(&b'/') {
        return absolute(PathBuf::from(argv0));
    }
    std::env::split_paths(path_var?)
        .map(|dir| {
            // An empty entry is the working directory, as for the shell.
            if dir.as_os_str().is_empty() {
                PathBuf::from(".").join(argv0)
            } else {
                dir.join(argv0)
            }
        })
        .find(|p| is_executable(p))
        .and_then(absolute)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `/proc/self/exe`'s target without the kernel's mark of a replaced file.
fn strip_deleted(link: PathBuf) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    match link.as_os_str().as_bytes().strip_suffix(b" (deleted)") {
        Some(path) => PathBuf::from(OsStr::from_bytes(path)),
        None => link,
    }
}

/// What the old process does for an upgrade.
#[derive(Debug)]
pub(crate) struct Upgrader {
    exe: anyhow::Result<Executable>,
    args: Vec<OsString>,
    timeout: Duration,
    sockets: Sockets,
    notify: Notifier,
    /// The attempt under way: whether it has committed, or a signal ended it first.
    phase: Arc<Mutex<Phase>>,
    /// The relay whose client connections go across too; without it, listeners only.
    server: Option<derp_server::Server>,
}

/// Where an attempt stands, decided once under a lock: either the handover commits or a
/// signal cancels it, never both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Open,
    Committed,
    Cancelled,
}

/// How the old process's side of the exchange failed.
#[derive(Debug)]
enum ExchangeError {
    /// Nothing was committed: the new process goes.
    Before(anyhow::Error),
    /// After Commit: the new process `pid` may be the service already.
    After { pid: u32, error: anyhow::Error },
}

/// How an upgrade ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The process `pid` serves on every listener and is systemd's main process; `conns`
    /// client connections went to it.
    HandedOver { pid: u32, conns: u32 },
    /// This process keeps everything.
    Failed(anyhow::Error),
}

impl Upgrader {
    pub(crate) fn new(
        exe: anyhow::Result<Executable>,
        timeout: Duration,
        sockets: Sockets,
        notify: Notifier,
    ) -> Self {
        Self {
            exe,
            args: std::env::args_os().skip(1).collect(),
            timeout,
            sockets,
            notify,
            phase: Arc::new(Mutex::new(Phase::Open)),
            server: None,
        }
    }

    /// Hands `server`'s client connections over too (those it can; see
    /// `derp_server::Frozen`).
    pub(crate) fn with_connections(mut self, server: derp_server::Server) -> Self {
        self.server = Some(server);
        self
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the attempt under way before it commits (a signal): `false` if it has committed
    /// already, and its outcome must be awaited instead (the new process is the service, or
    /// about to be).
    pub(crate) fn cancel(&self) -> bool {
        let mut phase = self.phase();
        match *phase {
            Phase::Committed => false,
            _ => {
                *phase = Phase::Cancelled;
                true
            }
        }
    }

    /// Starts the new process, hands it the listeners and waits for it to take over.
    pub(crate) async fn run(&self) -> Outcome {
        match self.try_run().await {
            Ok((pid, conns)) => Outcome::HandedOver { pid, conns },
            Err(e) => Outcome::Failed(e),
        }
    }

    async fn try_run(&self) -> anyhow::Result<(u32, u32)> {
        let exe = match &self.exe {
            Ok(exe) => exe,
            Err(e) => bail!("no path to start: {e:#}"),
        };
        *self.phase() = Phase::Open;
        let listeners = self.sockets.for_successor()?;
        let (mine, theirs) = wire::pair().context("creating the handover channel")?;
        let child = Command::new(&exe.path)
            .args(&self.args)
            .env(TAKEOVER_ENV, std::process::id().to_string())
            .stdin(Stdio::from(theirs))
            .spawn()
            .with_context(|| format!("starting {}", exe.path.display()))?;
        let mut child = ChildGuard(Some(child));
        info!(
            path = %exe.path.display(),
            child = child.id(),
            listeners = %self.sockets.describe(),
            timeout = ?self.timeout,
            "upgrade: started the new binary; handing it the listeners"
        );
        let (timeout, phase) = (self.timeout, self.phase.clone());
        // The channel closes when the exchange ends: a new process still waiting on it after a
        // failure reads that as the end, and exits.
        let relay = self
            .server
            .clone()
            .map(|s| (s, tokio::runtime::Handle::current()));
        let exchange =
            tokio::task::spawn_blocking(move || exchange(&mine, listeners, relay, timeout, &phase))
                .await
                .context("the handover thread")?;
        match exchange {
            Ok(handed) => {
                child.disarm();
                Ok(handed)
            }
            Err(ExchangeError::Before(e)) => {
                // A process that refused exits by itself; give it the moment to, so its
                // status says what it said.
                let status = tokio::task::spawn_blocking(move || child.finish())
                    .await
                    .context("the handover thread")?;
                Err(e.context(format!("the new process {status}")))
            }
            Err(ExchangeError::After { pid, error }) => {
                let notify = self.notify.clone();
                tokio::task::spawn_blocking(move || after_commit(child, pid, error, &notify))
                    .await
                    .context("the handover thread")?
                    .map(|pid| (pid, 0))
            }
        }
    }
}

/// A committed handover whose `Done` did not come: the new process is the service if it
/// runs (it may have told systemd already, and nothing can take that back but itself); if
/// it has exited, this process tells systemd it is the main process again.
fn after_commit(
    mut child: ChildGuard,
    pid: u32,
    error: anyhow::Error,
    notify: &Notifier,
) -> anyhow::Result<u32> {
    // A closed channel is most often a process on its way out: its descriptors close before
    // it can be reaped. One that serves on stays up.
    match child.exited_within(EXIT_WAIT) {
        Ok(None) => {
            child.disarm();
            warn!(
                pid,
                error = %format!("{error:#}"),
                "upgrade: the new process did not say it was done, but it runs: it is the service"
            );
            Ok(pid)
        }
        ended => {
            let how = match ended {
                Ok(Some(status)) => format!("exited: {status}"),
                Err(e) => format!("cannot be waited for: {e}"),
                Ok(None) => unreachable!("matched above"),
            };
            notify.main_pid(
                std::process::id(),
                "serving on: the new process exited after the upgrade was committed",
            );
            Err(error.context(format!(
                "the new process (pid {pid}) {how} after the handover was committed; this \
                 process told systemd it is the main process again"
            )))
        }
    }
}

/// The old process's side of the exchange: the new process's PID once it has taken over.
fn exchange(
    channel: &OwnedFd,
    listeners: Handed,
    relay: Option<(derp_server::Server, tokio::runtime::Handle)>,
    timeout: Duration,
    phase: &Mutex<Phase>,
) -> Result<(u32, u32), ExchangeError> {
    let deadline = Instant::now() + timeout;
    let offer = relay.as_ref().map(|_| derp_server::HANDOVER_FORMAT);
    let (pid, format) =
        confirmed(channel, listeners, offer, deadline, timeout).map_err(ExchangeError::Before)?;
    // Frozen until the commit; dropped on any failure before it, which lets them go on.
    let mut frozen = None;
    let mut handed = 0;
    if let (Some((server, runtime)), Some(format)) = (relay, format) {
        if format != derp_server::HANDOVER_FORMAT {
            return Err(ExchangeError::Before(anyhow::anyhow!(
                "named connection format {format}, which was not offered"
            )));
        }
        let mut f = runtime.block_on(server.freeze_for_handover(FREEZE_WAIT));
        info!(
            handed = f.handed(),
            staying = f.staying(),
            "upgrade: connections stopped where they are; handing them over"
        );
        handed =
            conns::send_all(channel, f.take_conns(), deadline).map_err(ExchangeError::Before)?;
        frozen = Some(f);
    }
    {
        let mut phase = phase.lock().unwrap_or_else(|e| e.into_inner());
        if *phase == Phase::Cancelled {
            return Err(ExchangeError::Before(anyhow::anyhow!(
                "a signal ended the upgrade before it was committed"
            )));
        }
        // Committed from here on, even if the message is lost: a signal now waits for the
        // outcome instead of killing the new process.
        *phase = Phase::Committed;
    }
    if let Err(e) = wire::send(channel, &Message::Commit, &[]) {
        // Not delivered (a datagram socket sends all or nothing): nothing was committed,
        // whatever the phase says.
        return Err(ExchangeError::Before(
            anyhow::Error::from(e).context("committing the handover"),
        ));
    }
    // The new process serves them from now on: this one lets go without a word to them.
    if let Some(frozen) = frozen {
        frozen.commit();
    }
    info!(
        pid,
        handed, "upgrade: committed; the new process is the service"
    );
    match wire::recv(channel, Instant::now() + DONE_WAIT) {
        Ok((Message::Done, _)) => Ok((pid, handed)),
        Ok((other, _)) => Err(ExchangeError::After {
            pid,
            error: anyhow::anyhow!("sent {other:?} instead of Done"),
        }),
        Err(e) => Err(ExchangeError::After {
            pid,
            error: anyhow::Error::from(e)
                .context("waiting for the new process to finish taking over"),
        }),
    }
}

/// Hands the listeners and waits for the new process's confirmation: its PID.
fn confirmed(
    channel: &OwnedFd,
    listeners: Handed,
    conns: Option<u16>,
    deadline: Instant,
    timeout: Duration,
) -> anyhow::Result<(u32, Option<u16>)> {
    let (described, fds): (Vec<Listener>, Vec<OwnedFd>) = listeners.into_iter().unzip();
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    let hello = Message::Hello {
        version: wire::VERSION,
        pid: std::process::id(),
        listeners: described,
        conns,
    };
    wire::send(channel, &hello, &borrowed).context("sending the listeners")?;
    drop(fds);
    let pid = match wire::recv(channel, deadline) {
        Ok((Message::Ready { pid, conn_format }, _)) => (pid, conn_format),
        Ok((Message::Refuse { reason }, _)) => bail!("refused the handover: {reason}"),
        Ok((other, _)) => bail!("sent {other:?} instead of confirming"),
        Err(RecvError::TimedOut(_)) => {
            bail!("did not confirm within {timeout:?} (--upgrade-timeout)")
        }
        Err(RecvError::Closed) => bail!("ended before confirming"),
        Err(e) => return Err(e).context("waiting for the new process to confirm"),
    };
    Ok(pid)
}

/// The new process, killed and reaped unless it took over.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// The process's status if it exits within `within` (reaped then), `None` if it runs on.
    fn exited_within(
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

    fn disarm(&mut self) {
        // Not killed: it is the service now, and outlives this process. Reaped by a thread
        // of its own should it exit while this process drains, rather than left a zombie
        // until this one exits.
        if let Some(child) = self.0.take() {
            reap_later(child);
        }
    }

    /// Waits (a short while) for the process to exit, then kills it if it has not, reaps
    /// it, and says how it ended.
    fn finish(mut self) -> String {
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

/// The new process's side: the channel to the old process, until the takeover is over.
#[derive(Clone, Debug)]
pub(crate) struct Takeover {
    channel: Arc<Mutex<Option<OwnedFd>>>,
    from: u32,
}

/// Whether this process was started to take over, and if so the channel and what it was
/// handed. A hello this derpd cannot read is refused (the old process is told why).
pub(crate) fn takeover_from_env() -> anyhow::Result<Option<(Takeover, Handed)>> {
    let Some(from) = std::env::var_os(TAKEOVER_ENV) else {
        return Ok(None);
    };
    let from: u32 = from
        .to_str()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{TAKEOVER_ENV}={from:?}: not a process id"))?;
    let channel = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .context("taking the handover channel")?;
    // Standard input must not keep the channel open once this process is done with it: the
    // old process reads its end's close as this one having exited.
    let null = std::fs::File::open("/dev/null").context("opening /dev/null")?;
    rustix::stdio::dup2_stdin(&null).context("putting /dev/null on standard input")?;
    let takeover = Takeover {
        channel: Arc::new(Mutex::new(Some(channel))),
        from,
    };
    let received = {
        let guard = takeover.lock();
        let Some(channel) = guard.as_ref() else {
            bail!("the handover channel is gone");
        };
        wire::recv(channel, Instant::now() + HELLO_WAIT)
    };
    let (listeners, fds) = match received {
        Ok((Message::Hello { listeners, .. }, fds)) => (listeners, fds),
        Ok((other, _)) => {
            let e = format!("the running derpd (pid {from}) sent {other:?} instead of its hello");
            takeover.refuse(&e);
            bail!("{e}");
        }
        Err(e) => {
            takeover.refuse(&error_text(&e));
            return Err(e).with_context(|| {
                format!(
                    "taking over from the running derpd (pid {from}), which was told so; \
                     it keeps serving"
                )
            });
        }
    };
    if listeners.len() != fds.len() {
        let e = format!(
            "the hello describes {} listeners but carries {} descriptors",
            listeners.len(),
            fds.len()
        );
        takeover.refuse(&e);
        bail!("{e}");
    }
    info!(
        from,
        listeners = listeners.len(),
        "taking over from the running derpd"
    );
    Ok(Some((takeover, listeners.into_iter().zip(fds).collect())))
}

/// Receives the old process's connections, the first message of them already read, and
/// takes them over, inert until the commit; says so, or refuses.
fn take_conns(
    channel: &OwnedFd,
    first: (Message, Vec<OwnedFd>),
    server: &derp_server::Server,
    runtime: &tokio::runtime::Handle,
) -> anyhow::Result<derp_server::Adopted> {
    let refuse = |reason: String| {
        let refusal = Message::Refuse {
            reason: reason.clone(),
        };
        let _ = wire::send(channel, &refusal, &[]);
        anyhow::anyhow!("{reason}")
    };
    let conns = conns::receive_all(channel, first, Instant::now() + COMMIT_WAIT)
        .map_err(|e| refuse(format!("{e:#}")))?;
    if std::env::var_os(REFUSE_CONNS_ENV).is_some() {
        return Err(refuse(format!("{REFUSE_CONNS_ENV} is set")));
    }
    let adopted = {
        let _runtime = runtime.enter();
        server.adopt(conns).map_err(|e| refuse(e.to_string()))?
    };
    let count = u32::try_from(adopted.len()).unwrap_or(u32::MAX);
    wire::send(channel, &Message::Adopted { conns: count }, &[])
        .context("confirming the connections")?;
    Ok(adopted)
}

/// An error and its sources, as one line.
fn error_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl Takeover {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<OwnedFd>> {
        self.channel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the old process this one will not take over, and why; it keeps serving. Does
    /// nothing once the takeover is over.
    pub(crate) fn refuse(&self, reason: &str) {
        if let Some(channel) = self.lock().take() {
            let refusal = Message::Refuse {
                reason: reason.to_owned(),
            };
            if let Err(e) = wire::send(&channel, &refusal, &[]) {
                warn!(error = %e, "telling the running derpd that this one does not take over");
            }
        }
    }

    /// Confirms to the old process that this one serves, waits for its commit, tells
    /// systemd this process is the service's main one, and ends the exchange. `false` if
    /// this process refused first (a signal to shut down): it confirms nothing then.
    fn confirm(
        &self,
        notify: &Notifier,
        status: &str,
        relay: Option<(derp_server::Server, tokio::runtime::Handle)>,
    ) -> anyhow::Result<bool> {
        let pid = std::process::id();
        let conn_format = relay.as_ref().map(|_| derp_server::HANDOVER_FORMAT);
        let channel = {
            // Held while Ready goes, so a refusal comes wholly before it or after it.
            let mut guard = self.lock();
            let Some(channel) = guard.take() else {
                return Ok(false);
            };
            let ready = Message::Ready { pid, conn_format };
            wire::send(&channel, &ready, &[]).context("confirming")?;
            channel
        };
        // Before the commit, or instead of it when the old process hands listeners only.
        let mut received = wire::recv(&channel, Instant::now() + COMMIT_WAIT);
        let mut adopted = None;
        if let Some((server, runtime)) = relay
            && matches!(&received, Ok((m, _)) if *m != Message::Commit)
        {
            let first = received.context("receiving connections")?;
            adopted = Some((take_conns(&channel, first, &server, &runtime)?, runtime));
            received = wire::recv(&channel, Instant::now() + COMMIT_WAIT);
        }
        match received {
            Ok((Message::Commit, _)) => {}
            Ok((other, _)) => bail!("the running derpd sent {other:?} instead of committing"),
            Err(e) => return Err(e).context("waiting for the running derpd to commit"),
        }
        // Committed: the old process will not take the listeners back, so from here on
        // this process serves whatever else goes wrong.
        if let Some((adopted, runtime)) = adopted {
            let _runtime = runtime.enter();
            let count = adopted.len();
            let mut holds = adopted.start();
            holds.sort_unstable();
            let at = |q: f64| {
                let i = (holds.len() as f64 * q) as usize;
                holds.get(i.min(holds.len().saturating_sub(1))).copied()
            };
            info!(
                conns = count,
                hold_p50 = ?at(0.5).unwrap_or_default(),
                hold_p99 = ?at(0.99).unwrap_or_default(),
                hold_max = ?holds.last().copied().unwrap_or_default(),
                "took over the client connections; each was held from its copy in the old \
                 process until now"
            );
        }
        notify.main_pid(pid, status);
        if let Err(e) = wire::send(&channel, &Message::Done, &[]) {
            warn!(
                error = %e,
                "could not tell the old derpd the takeover is done; it was committed, so this \
                 process serves on"
            );
        }
        Ok(true)
    }
}

/// Saying that this process serves: to systemd (`READY=1`), and for a process that takes
/// over, to the old process first, then to systemd with `MAINPID=`. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Readiness {
    notify: Notifier,
    takeover: Option<Takeover>,
    sockets: Sockets,
    /// Set while this process takes over: an upgrade of its own must wait until it has.
    taking_over: Arc<AtomicBool>,
    /// `true` once this process may accept and read on its sockets: at once, or for one
    /// that takes over, once the old process has committed. Until then the sockets are the
    /// old process's alone, so a new process that fails takes nothing from it.
    serving: Arc<tokio::sync::watch::Sender<bool>>,
    /// The relay that takes the old process's client connections over.
    server: Arc<std::sync::OnceLock<derp_server::Server>>,
}

impl Readiness {
    pub(crate) fn new(notify: Notifier, takeover: Option<Takeover>, sockets: Sockets) -> Self {
        let taking_over = Arc::new(AtomicBool::new(takeover.is_some()));
        let serving = Arc::new(tokio::sync::watch::Sender::new(takeover.is_none()));
        Self {
            notify,
            takeover,
            sockets,
            taking_over,
            serving,
            server: Arc::default(),
        }
    }

    /// Takes the old process's client connections over into `server` (when it sends them).
    pub(crate) fn take_connections_into(&self, server: derp_server::Server) {
        let _ = self.server.set(server);
    }

    /// Returns once this process may accept and read on its sockets (for one that takes
    /// over, once the old process has committed; one that does not exits first).
    pub(crate) async fn may_serve(&self) {
        let mut rx = self.serving.subscribe();
        // The sender lives as long as `self`.
        let _ = rx.wait_for(|serving| *serving).await;
    }

    pub(crate) fn notifier(&self) -> &Notifier {
        &self.notify
    }

    /// A process still taking over tells the old one it will not (it shuts down): the old
    /// one keeps serving. Nothing once it has confirmed.
    pub(crate) fn refuse(&self, reason: &str) {
        if let Some(takeover) = &self.takeover {
            takeover.refuse(reason);
        }
    }

    /// Whether this process is still taking over from another.
    pub(crate) fn taking_over(&self) -> bool {
        self.taking_over.load(Ordering::Acquire)
    }

    /// Every listener is bound and serving; `status` says what it serves. A process that
    /// takes over and cannot (flags that leave a handed listener unused, or the old process
    /// gone) exits: the old process keeps or has taken back everything.
    pub(crate) fn ready(&self, status: String) {
        let Some(takeover) = self.takeover.clone() else {
            self.notify.ready(&status);
            return;
        };
        let (notify, sockets, flag, serving) = (
            self.notify.clone(),
            self.sockets.clone(),
            self.taking_over.clone(),
            self.serving.clone(),
        );
        let relay = self.server.get().cloned();
        tokio::spawn(async move {
            if let Err(e) = sockets.check_all_taken() {
                takeover.refuse(&format!("{e:#}"));
                error!(error = %format!("{e:#}"), "not taking over: the running derpd keeps serving");
                std::process::exit(1);
            }
            let t = takeover.clone();
            let relay = relay.map(|s| (s, tokio::runtime::Handle::current()));
            let confirmed =
                tokio::task::spawn_blocking(move || t.confirm(&notify, &status, relay)).await;
            match confirmed {
                // Refused on the way to a shutdown, which says so.
                Ok(Ok(false)) => {}
                Ok(Ok(true)) => {
                    flag.store(false, Ordering::Release);
                    serving.send_replace(true);
                    info!(
                        pid = std::process::id(),
                        from = takeover.from,
                        listeners = %sockets.describe(),
                        "took over the listeners; this process is the service now"
                    );
                }
                Ok(Err(e)) => {
                    error!(error = %format!("{e:#}"), "taking over failed: the running derpd keeps serving");
                    std::process::exit(1);
                }
                Err(e) => {
                    error!(error = %e, "taking over failed: the running derpd keeps serving");
                    std::process::exit(1);
                }
            }
        });
    }
}

/// SIGUSR2, listened for from start-up on, so that its default action (to end the process)
/// never applies.
#[derive(Debug)]
pub(crate) struct UpgradeSignal(tokio::signal::unix::Signal);

impl UpgradeSignal {
    pub(crate) fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self(
            signal(SignalKind::user_defined2()).context("listening for SIGUSR2")?,
        ))
    }

    pub(crate) async fn recv(&mut self) {
        if self.0.recv().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv0_is_made_absolute_as_the_shell_found_it() {
        let cwd = Path::new("/srv");
        let path = OsStr::new("/usr/local/bin:/usr/bin");
        let only = |want: &'static str| move |p: &Path| p == Path::new(want);
        let r = |a: &str, f: &dyn Fn(&Path) -> bool| {
            resolve_argv0(OsStr::new(a), Some(cwd), Some(path), f)
        };
        assert_eq!(
            r("/usr/bin/derpd", &only("none")),
            Some(PathBuf::from("/usr/bin/derpd"))
        );
        assert_eq!(
            r("bin/derpd", &only("none")),
            Some(PathBuf::from("/srv/bin/derpd"))
        );
        assert_eq!(
            r("./derpd", &only("none")),
            Some(PathBuf::from("/srv/derpd"))
        );
        assert_eq!(
            r("../bin/derpd", &only("none")),
            Some(PathBuf::from("/srv/../bin/derpd"))
        );
        assert_eq!(
            r("derpd", &only("/usr/bin/derpd")),
            Some(PathBuf::from("/usr/bin/derpd"))
        );
        assert_eq!(
            r("derpd", &only("/usr/local/bin/derpd")),
            Some(PathBuf::from("/usr/local/bin/derpd"))
        );
        assert_eq!(r("derpd", &only("/opt/derpd")), None);
        assert_eq!(r("", &only("/usr/bin/derpd")), None);
        // An empty PATH entry is the working directory.
        assert_eq!(
            resolve_argv0(
                OsStr::new("derpd"),
                Some(cwd),
                Some(OsStr::new(":/usr/bin")),
                |p: &Path| p == Path::new("./derpd")
            ),
            Some(PathBuf::from("/srv/derpd"))
        );
    }

    #[test]
    fn a_replaced_files_mark_is_stripped() {
        assert_eq!(
            strip_deleted(PathBuf::from("/usr/bin/derpd (deleted)")),
            PathBuf::from("/usr/bin/derpd")
        );
        assert_eq!(
            strip_deleted(PathBuf::from("/usr/bin/derpd")),
            PathBuf::from("/usr/bin/derpd")
        );
    }

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

    #[test]
    fn the_running_test_binary_is_found() {
        let exe = executable().expect("found");
        let running = std::fs::metadata("/proc/self/exe").expect("exe");
        let found = std::fs::metadata(&exe.path).expect("path");
        assert_eq!((found.dev(), found.ino()), (running.dev(), running.ino()));
    }
}
