//! Replacing the running binary without closing its ports: on SIGUSR2 derpd starts the file
//! at the path it was started from (the new binary a package upgrade has just put there)
//! with the same arguments and environment, hands it every listening socket over a socket
//! pair, and once the new process serves on them and has told systemd it is the main
//! process, stops accepting and ends its own connections as a graceful shutdown does.
//!
//! What goes across, and how, is [`wire`]'s; which sockets a process binds or takes over,
//! [`sockets`]'; the client connections that can go (all but QUIC and rustls TLS), [`conns`]' and
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

mod child;
mod conns;
mod exe;
pub(crate) mod sockets;
mod takeover;
pub(crate) mod wire;

use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tracing::{info, warn};

use crate::sd_notify::Notifier;
use child::ChildGuard;
pub(crate) use exe::{Executable, executable};
use sockets::Sockets;
pub(crate) use takeover::{Readiness, takeover_from_env};
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
/// How long a new process that meshes waits for its links to come up with their siblings'
/// clients before it confirms (the old process serves meanwhile); well inside the default
/// `--upgrade-timeout`.
const MESH_SETTLE_WAIT: Duration = Duration::from_secs(5);
/// How long the old process waits for its connections to stop where they are before it
/// hands over those that did (the rest stay and are told to reconnect).
const FREEZE_WAIT: Duration = Duration::from_secs(2);
/// Set (to anything) in a new process's environment, it refuses the connections once they
/// have all come across: how the tests make a successor that refuses the handed state.
const REFUSE_CONNS_ENV: &str = "DERPD_TEST_REFUSE_CONNECTIONS";

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
        let f = runtime.block_on(server.freeze_for_handover(FREEZE_WAIT));
        info!(
            handed = f.handed(),
            staying = f.staying(),
            "upgrade: connections stopped where they are; handing them over"
        );
        handed = conns::send_all(channel, f.conns(), deadline).map_err(ExchangeError::Before)?;
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
