//! Handing live connections to a successor process, and taking them over from one: the
//! relay's half of an upgrade in place. Moving the bytes and the sockets between the two
//! processes is the caller's (derpd's upgrade exchange); this module freezes connections
//! where they are, copies their state out, rebuilds them on the other side, and lets the
//! old process either forget them or go on as if nothing happened.
//!
//! What is handed over: connections over plain TCP or derpd's TLS 1.3 records, bare DERP or
//! WebSocket, with everything behind them (the client's key and standing, bytes read and not
//! yet handled, packets and frames queued, the rest of a batch half written, PeerGone
//! watches, the rate limit's bucket, the key's duplicate set and which member is active,
//! mesh watchers, the WebSocket decoder's state, both directions of the TLS record layer).
//! What is not, and stays with the old process to be told to reconnect: QUIC connections,
//! TLS on rustls's records, any stream an embedder passed in, a connection that is closing,
//! and every connection of a key that has one of those among its connections. Connections still in their handshake are
//! not frozen; they finish it in the old process.
//!
//! The order of things (see `docs/architecture.md`, "Upgrading in place"):
//! 1. [`crate::Server::freeze_for_handover`]: every read loop but QUIC's stops where it is
//!    (no frame half handled: a loop parks only between reads), leaving a copy of what it
//!    holds; then the queues of the connections that can go are frozen and their writers
//!    park, a batch half written and all. Nothing is taken from a connection: its state is
//!    copied, and its transport lent until the verdict (no second descriptor is made).
//! 2. [`Frozen::conns`] hands out the copies; [`encode_conns`] turns them into bytes.
//! 3. On the other side [`decode_conns`] and [`crate::Server::adopt`] rebuild them, inert.
//! 4. The old process [`Frozen::commit`]s (forgets every handed connection without a byte
//!    to its peer), and the new one [`Adopted::start`]s them; or the old one
//!    [`Frozen::resume`]s (or drops the [`Frozen`]) and goes on, and the new one drops its
//!    [`Adopted`], letting go of the sockets just as silently.

mod exit;

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use derp_proto::PublicKey;
use tokio::time::Instant;
use tracing::{debug, warn};
use zeroize::Zeroizing;

use crate::conn::AdoptedConn;
use crate::handed as record;
pub(crate) use crate::handed::{ConnRecord, LentSocket, PacketRecord, ReadExport, ReadResume};
pub use crate::handed::{FORMAT, RecordError};
use crate::handle::ConnHandle;
use crate::queue::{Control, QueueExport};
use crate::registry::{KeyMembers, Lookup};
use crate::state::ServerState;
pub use exit::ExitWatch;

/// One connection ready to go to a successor process, or arrived from a predecessor: its
/// state and its socket.
#[derive(Debug)]
pub struct HandedConn {
    pub(crate) record: ConnRecord,
    pub(crate) socket: HandedSocket,
}

/// Where a handed connection's socket is.
#[derive(Debug)]
pub(crate) enum HandedSocket {
    /// Still this process's: lent by the parked read loop, which gets it back if the
    /// handover is called off. No second descriptor is made for it: passing it to the
    /// successor makes the successor's.
    Lent(LentSocket),
    /// Received from the predecessor.
    Received(OwnedFd),
}

impl HandedConn {
    /// The socket, to pass with [`encode_conns`]'s bytes (in the same order).
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.socket {
            HandedSocket::Lent(socket) => socket.fd(),
            HandedSocket::Received(fd) => fd.as_fd(),
        }
    }

    /// The client's key.
    pub fn key(&self) -> PublicKey {
        self.record.key
    }
}

/// The state of `conns` as bytes (their sockets go beside, in the same order). TLS
/// connections' traffic secrets are among them: the bytes are zeroed when dropped.
pub fn encode_conns(conns: &[HandedConn]) -> Zeroizing<Vec<u8>> {
    let records: Vec<&ConnRecord> = conns.iter().map(|c| &c.record).collect();
    let mut out = Zeroizing::new(Vec::new());
    record::encode(&records, &mut out);
    out
}

/// Reads what [`encode_conns`] wrote, pairing each record with its socket.
pub fn decode_conns(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Vec<HandedConn>, RecordError> {
    let records = record::decode(bytes)?;
    if records.len() != fds.len() {
        return Err(RecordError::Sockets {
            records: records.len(),
            sockets: fds.len(),
        });
    }
    Ok(records
        .into_iter()
        .zip(fds)
        .map(|(record, fd)| HandedConn {
            record,
            socket: HandedSocket::Received(fd),
        })
        .collect())
}

/// A server whose connections are frozen for a handover. Dropping it without
/// [`Frozen::commit`] resumes them, as [`Frozen::resume`] does.
#[derive(Debug)]
pub struct Frozen {
    shared: Arc<ServerState>,
    /// Every connection whose read loop parked.
    parked: Vec<Arc<ConnHandle>>,
    /// Those that go.
    handed: Vec<Arc<ConnHandle>>,
    /// Their copies, with the lent transports.
    conns: Vec<HandedConn>,
    /// Connections that stay (closing, a transport that cannot go, or late to park).
    staying: usize,
    done: bool,
}

impl Frozen {
    /// How many connections go to the successor.
    pub fn handed(&self) -> usize {
        self.handed.len()
    }

    /// How many registered connections stay with this process (and get a Restarting frame
    /// when it drains).
    pub fn staying(&self) -> usize {
        self.staying
    }

    /// The copies of the connections that go, to send. Their sockets are this process's
    /// own descriptors, lent by the parked loops: the successor gets its own by being sent
    /// them, and nothing is made twice here.
    pub fn conns(&self) -> &[HandedConn] {
        &self.conns
    }

    /// The successor serves the handed connections now: forgets them without a word to
    /// their peers (no FIN, no close frame; queued packets are the successor's to write, not
    /// drops here) and lets every other connection go on.
    pub fn commit(mut self) {
        self.done = true;
        let handles = std::mem::take(&mut self.handed);
        for h in &handles {
            h.set_handed(true);
            h.queue.forget();
        }
        self.shared.registry.forget(&handles);
        self.release();
        debug!(handed = handles.len(), "connections handed over");
    }

    /// Calls the handover off: every frozen connection goes on from where it stopped.
    pub fn resume(mut self) {
        self.resume_now();
    }

    fn resume_now(&mut self) {
        self.done = true;
        let conns = std::mem::take(&mut self.conns);
        for (h, conn) in self.handed.iter().zip(conns) {
            h.set_handed(false);
            h.queue.thaw();
            if let HandedSocket::Lent(socket) = conn.socket {
                self.shared.handover.give_back(h.id, socket);
            }
        }
        self.release();
    }

    /// Ends the freeze: parked read loops look at their verdict (their handle's handed bit)
    /// and take back what they lent, unless it went.
    fn release(&mut self) {
        let state = &self.shared.handover;
        state.end();
        for h in &self.parked {
            h.cancel.poke_quiet();
        }
        // Loops that had not parked yet when the freeze was given up on.
        self.shared.registry.poke_all();
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if !self.done {
            self.resume_now();
        }
    }
}

/// Freezes the server's connections (see the module docs), waiting up to `within` for
/// them to park; connections that have not parked by then stay.
pub(crate) async fn freeze(shared: &Arc<ServerState>, within: Duration) -> Frozen {
    let deadline = Instant::now() + within;
    let state = &shared.handover;
    lock(&state.parked).clear();
    state.begun.store(true, Ordering::Release);
    shared.registry.poke_all();

    // Read loops first: they are what puts packets into queues.
    let registered = || -> Vec<Arc<ConnHandle>> {
        let (keys, _) = shared.registry.handover_view();
        keys.into_iter()
            .flat_map(|k| k.members.into_iter().map(|(c, _)| c))
            .filter(|c| !c.is_quic())
            .collect()
    };
    // Each check looks only at the loops not seen parked yet: a deposit wakes it, and at
    // tens of thousands of connections a full pass per deposit would be quadratic.
    // Connections registering meanwhile are looked for too, once the first pass is done.
    let mut waiting = registered();
    let mut rechecked = false;
    state
        .wait_for(deadline, || {
            let parked = lock(&state.parked);
            waiting.retain(|c| !parked.contains_key(&c.id));
            if waiting.is_empty() && !rechecked {
                drop(parked);
                rechecked = true;
                waiting = registered();
                let parked = lock(&state.parked);
                waiting.retain(|c| !parked.contains_key(&c.id));
            }
            waiting.is_empty()
        })
        .await;
    let mut exports: HashMap<u64, ReadExport> = lock(&state.parked)
        .iter_mut()
        .filter_map(|(id, e)| Some((*id, e.take()?)))
        .collect();
    let (keys, watchers) = shared.registry.handover_view();
    let mut frozen = Frozen {
        shared: shared.clone(),
        parked: Vec::new(),
        handed: Vec::new(),
        conns: Vec::new(),
        staying: 0,
        done: false,
    };
    for k in &keys {
        for (c, _) in &k.members {
            if lock(&state.parked).contains_key(&c.id) {
                frozen.parked.push(c.clone());
            }
            if exports.contains_key(&c.id) && !c.cancel.is_cancelled() {
                c.queue.freeze();
                c.cancel.nudge();
            }
        }
    }

    // Then the writers of the connections that may go.
    // Most writers are parked already; the rest are looked at again as each parks.
    let mut moving: Vec<&Arc<ConnHandle>> = keys
        .iter()
        .flat_map(|k| &k.members)
        .map(|(c, _)| c)
        .filter(|c| exports.contains_key(&c.id))
        .collect();
    state
        .wait_for(deadline, || {
            moving.retain(|c| !(c.queue.is_still() || c.cancel.is_cancelled()));
            moving.is_empty()
        })
        .await;

    let parked_at_ns = monotonic_ns();
    for KeyMembers { key, members } in keys {
        let queues: Option<Vec<_>> = members
            .iter()
            .map(|(c, _)| {
                let read = exports.get(&c.id)?;
                if c.cancel.is_cancelled() || !c.queue.is_still() {
                    return None;
                }
                let queue = c.queue.export()?;
                // Both halves of the TLS record layer go, or the connection stays.
                if read.tls_rx.is_some() != queue.writer.tls_tx.is_some() {
                    return None;
                }
                Some(queue)
            })
            .collect();
        let Some(queues) = queues else {
            // One connection of the key cannot go, so none does: a key's connections are
            // served by one process. What their loops lent goes back with the rest below.
            for (c, _) in &members {
                if c.queue.is_frozen() {
                    c.queue.thaw();
                }
            }
            frozen.staying += members.len();
            debug!(key = %key.short(), "connection stays: cannot be handed over");
            continue;
        };
        for ((c, active), mut queue) in members.into_iter().zip(queues) {
            let Some(ReadExport {
                socket,
                read_buf,
                resume,
                tls_rx,
                ws,
            }) = exports.remove(&c.id)
            else {
                continue;
            };
            let watcher = watchers.contains(&c.id);
            let tls_tx = queue.writer.tls_tx.take();
            let mut record =
                ConnRecord::of(&c, active, watcher, read_buf, resume, queue, parked_at_ns);
            record.tls = tls_rx.zip(tls_tx);
            record.ws = ws;
            frozen.conns.push(HandedConn {
                record,
                socket: HandedSocket::Lent(socket),
            });
            frozen.handed.push(c);
        }
    }
    // Loops that parked with a copy but whose connection stays get their transport back
    // when the freeze ends.
    for (id, export) in exports {
        state.give_back(id, export.socket);
    }
    let late = registered().len().saturating_sub(frozen.parked.len());
    if late > 0 {
        warn!(
            late,
            "connections did not stop in time for the handover and stay"
        );
    }
    frozen
}

impl ConnRecord {
    fn of(
        c: &ConnHandle,
        active: bool,
        watcher: bool,
        read_buf: Vec<u8>,
        resume: ReadResume,
        queue: QueueExport,
        parked_at_ns: u64,
    ) -> Self {
        let now = Instant::now();
        let packets = [(true, &queue.batch.disco), (false, &queue.batch.other)]
            .into_iter()
            .flat_map(|(disco, q)| {
                q.iter().map(move |p| PacketRecord {
                    disco,
                    src: p.src,
                    forwarded: p.forwarded,
                    age_us: u64::try_from(now.saturating_duration_since(p.enqueued).as_micros())
                        .unwrap_or(u64::MAX),
                    data: p.data.clone(),
                })
            })
            .collect();
        Self {
            key: c.key,
            remote: c.remote.get(),
            presence_flags: c.presence_flags,
            can_mesh: c.can_mesh,
            preferred: c.is_preferred(),
            active,
            watcher,
            rtt_mark: c.rtt_mark.get(),
            read_buf,
            resume,
            tail: queue.writer.tail,
            sent_from: queue.writer.sent_from,
            packets,
            control: queue
                .batch
                .control
                .into_iter()
                .filter(|c| !matches!(c, Control::KeepAlive))
                .collect(),
            pong: queue.batch.pong,
            parked_at_ns,
            tls: None,
            ws: None,
        }
    }
}

/// Why handed connections could not be taken over.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// A handed socket is not a connected TCP socket.
    #[error("handed socket of {key}: {error}")]
    Socket {
        key: String,
        #[source]
        error: std::io::Error,
    },
    /// The same key came twice in separate groups, or is already connected here.
    #[error("key {0} handed over twice or already connected")]
    Duplicate(String),
}

/// Connections taken over from a predecessor process, registered and inert until
/// [`Adopted::start`]. Dropping it unstarted lets go of every socket without a word to the
/// peers (the predecessor keeps serving them) and unregisters them.
#[derive(Debug)]
pub struct Adopted {
    shared: Arc<ServerState>,
    conns: Vec<AdoptedConn>,
    /// The longest any of them was held: from its read loop parking in the predecessor to
    /// now. Measured at start.
    parked_at_ns: Vec<u64>,
    started: bool,
}

impl Adopted {
    /// How many connections were taken over.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// Whether none were.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Serves every adopted connection from where its predecessor left it. Returns how long
    /// each was held (from its read loop parking in the predecessor to now), in the order
    /// they were handed.
    pub fn start(mut self) -> Vec<Duration> {
        self.started = true;
        let now = monotonic_ns();
        let holds = self
            .parked_at_ns
            .iter()
            .map(|at| Duration::from_nanos(now.saturating_sub(*at)))
            .collect();
        let readers: Vec<_> = std::mem::take(&mut self.conns)
            .into_iter()
            .map(AdoptedConn::start_writer)
            .collect();
        for reader in readers {
            reader.start(&self.shared);
        }
        holds
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        if self.started {
            return;
        }
        let conns = std::mem::take(&mut self.conns);
        let handles: Vec<_> = conns.iter().map(|c| c.handle().clone()).collect();
        let ids: HashSet<u64> = handles.iter().map(|h| h.id).collect();
        lock(&self.shared.handover.resume).retain(|id, _| !ids.contains(id));
        self.shared.registry.forget(&handles);
        for conn in conns {
            conn.forget();
        }
    }
}

/// Rebuilds handed connections on `shared` (see [`crate::Server::adopt`]).
pub(crate) fn adopt(
    shared: &Arc<ServerState>,
    conns: Vec<HandedConn>,
) -> Result<Adopted, AdoptError> {
    let mut adopted = Adopted {
        shared: shared.clone(),
        conns: Vec::with_capacity(conns.len()),
        parked_at_ns: Vec::with_capacity(conns.len()),
        started: false,
    };
    let mut keys: Vec<KeyMembers> = Vec::new();
    let mut index: HashMap<PublicKey, usize> = HashMap::new();
    let mut watchers = Vec::new();
    let mut seen = HashSet::new();
    for HandedConn { record, socket } in conns {
        let key = record.key;
        // A key's members arrive together; the same key again later is a second group.
        let group = match index.get(&key) {
            Some(&i) if i + 1 == keys.len() => i,
            Some(_) => return Err(AdoptError::Duplicate(key.to_string())),
            None => {
                if !seen.insert(key)
                    || matches!(
                        shared.registry.lookup_locked(&key),
                        Lookup::Local(_) | Lookup::Dup
                    )
                {
                    return Err(AdoptError::Duplicate(key.to_string()));
                }
                keys.push(KeyMembers {
                    key,
                    members: Vec::new(),
                });
                index.insert(key, keys.len() - 1);
                keys.len() - 1
            }
        };
        let (active, watcher) = (record.active, record.watcher);
        adopted.parked_at_ns.push(record.parked_at_ns);
        let resume = record.resume;
        let fd = match socket {
            HandedSocket::Received(fd) => Ok(fd),
            // Taken over within one process: the lender closes its own descriptor.
            HandedSocket::Lent(socket) => socket.fd().try_clone_to_owned(),
        };
        let conn = fd
            .and_then(|fd| AdoptedConn::build(shared, record, fd))
            .map_err(|error| AdoptError::Socket {
                key: key.to_string(),
                error,
            })?;
        let handle = conn.handle().clone();
        lock(&shared.handover.resume).insert(handle.id, resume);
        if watcher {
            watchers.push(handle.clone());
        }
        keys[group].members.push((handle, active));
        adopted.conns.push(conn);
    }
    shared.registry.adopt(keys, &watchers);
    for conn in &adopted.conns {
        conn.watch_sources(shared);
    }
    Ok(adopted)
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for both processes of a handover.
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section here is an insert, a remove or a clear.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
