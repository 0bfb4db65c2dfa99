//! The new process's side of an upgrade: the hello it reads, the listeners and connections
//! it takes, and [`Readiness`], through which a process says it serves (to systemd, and to
//! the old process when it takes over).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, bail};
use tracing::{error, info, warn};

use super::sockets::Sockets;
use super::wire::{self, Handed, Message};
use super::{COMMIT_WAIT, HELLO_WAIT, MESH_SETTLE_WAIT, REFUSE_CONNS_ENV, TAKEOVER_ENV, conns};
use crate::sd_notify::Notifier;

/// The new process's side: the channel to the old process, until the takeover is over.
#[derive(Clone, Debug)]
pub(crate) struct Takeover {
    channel: Arc<Mutex<Option<OwnedFd>>>,
    from: u32,
    /// The connection format the old process offered, if any.
    offered: Option<u16>,
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
        offered: None,
    };
    let received = {
        let guard = takeover.lock();
        let Some(channel) = guard.as_ref() else {
            bail!("the handover channel is gone");
        };
        wire::recv(channel, Instant::now() + HELLO_WAIT)
    };
    let (listeners, fds, offered) = match received {
        Ok((
            Message::Hello {
                listeners, conns, ..
            },
            fds,
        )) => (listeners, fds, conns),
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
    let takeover = Takeover {
        offered,
        ..takeover
    };
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
        // Connections come across only in the format this build reads; a predecessor that
        // offers another (or none) hands the listeners only.
        let relay = relay.filter(|_| self.offered == Some(derp_server::HANDOVER_FORMAT));
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
    /// The mesh links a process that takes over brings up before it confirms.
    mesh: Arc<std::sync::OnceLock<Arc<derp_mesh::Mesh>>>,
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
            mesh: Arc::default(),
        }
    }

    /// Takes the old process's client connections over into `server` (when it sends them).
    pub(crate) fn take_connections_into(&self, server: derp_server::Server) {
        let _ = self.server.set(server);
    }

    /// A process that takes over confirms only once `mesh`'s links are up with their
    /// siblings' clients in the forwarder table (or [`MESH_SETTLE_WAIT`] has passed): the
    /// connections it takes over then reach every client of the region from their first
    /// packet, as they did through the old process's links.
    pub(crate) fn settle_mesh_first(&self, mesh: Arc<derp_mesh::Mesh>) {
        let _ = self.mesh.set(mesh);
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
        let mesh = self.mesh.get().cloned();
        tokio::spawn(async move {
            if let Err(e) = sockets.check_all_taken() {
                takeover.refuse(&format!("{e:#}"));
                error!(error = %format!("{e:#}"), "not taking over: the running derpd keeps serving");
                std::process::exit(1);
            }
            if let Some(mesh) = mesh {
                let unsettled = mesh.wait_settled(MESH_SETTLE_WAIT).await;
                if unsettled.is_empty() {
                    info!("mesh links up, with the siblings' clients; taking over");
                } else {
                    warn!(
                        siblings = %unsettled.join(","),
                        waited = ?MESH_SETTLE_WAIT,
                        "taking over with mesh links not up: packets to those siblings' \
                         clients are dropped until they are"
                    );
                }
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
