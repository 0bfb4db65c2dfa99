//! Who is connected: the authoritative client map, its lock-free mirror, duplicate-key
//! bookkeeping, peer-gone watches and mesh watchers.
//!
//! Every change happens under one mutex, so the map, the duplicate sets, the gauges and the
//! watcher broadcasts stay consistent with each other. The packet path reads only the mirror
//! (a papaya map of each key's active connection) and per-connection `active` flags, so it never takes the
//! lock while the destination is connected.
//!
//! Design follows tailscale/derp derpserver.go (registerClient, unregisterClient, clientSet).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use derp_proto::{PeerGoneReason, PublicKey};

mod handover;

pub(crate) use handover::KeyMembers;

use crate::handle::ConnHandle;
use crate::metrics::Metrics;
use crate::queue::Control;

/// The lock-free mirror the packet path reads: each local key's active connection.
///
/// It mirrors the `active` slot of every entry in the authoritative map and is written only
/// under the registry mutex. Storing the active connection itself (rather than a set that
/// points at it) makes a hit one hash probe with no atomic read-modify-write: the caller
/// borrows the `Arc` for as long as its epoch guard lives.
pub(crate) type Mirror = papaya::HashMap<PublicKey, Arc<ConnHandle>, foldhash::fast::RandomState>;

/// Something that can carry packets to a sibling node of the region (a mesh peer).
///
/// `forward_packet` is called on the sending client's read loop and must not block; an
/// implementation queues the packet and drops by its own policy when it cannot keep up.
pub trait PacketForwarder: Send + Sync + fmt::Debug + 'static {
    /// Sends `packet` from `src` to `dst` through the sibling.
    fn forward_packet(&self, src: PublicKey, dst: PublicKey, packet: Bytes);
}

/// The forwarder currently used for one key. When the key's route changes (another
/// forwarder becomes preferred, the key connects locally, or the forwarder goes away) the
/// route is marked stale and replaced, so a cached route is revalidated with one load.
#[derive(Debug)]
pub(crate) struct ForwardRoute {
    pub(crate) forwarder: Arc<dyn PacketForwarder>,
    current: AtomicBool,
}

impl ForwardRoute {
    fn new(forwarder: Arc<dyn PacketForwarder>) -> Arc<Self> {
        Arc::new(Self {
            forwarder,
            current: AtomicBool::new(true),
        })
    }

    /// Whether this is still the key's route.
    pub(crate) fn is_current(&self) -> bool {
        self.current.load(Ordering::Acquire)
    }

    fn retire(&self) {
        self.current.store(false, Ordering::Release);
    }
}

/// What a lookup found for a destination key.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The key's active connection.
    Local(Arc<ConnHandle>),
    /// No local client, but a mesh peer has the key.
    Forward(Arc<ForwardRoute>),
    /// The key has several connections and none is active.
    Dup,
    /// Nobody with that key is here.
    Missing,
}

/// All forwarders known for one key; the earliest added is preferred.
#[derive(Debug)]
struct Forwarders {
    list: Vec<Arc<dyn PacketForwarder>>,
    route: Arc<ForwardRoute>,
}

#[derive(Debug)]
struct Entry {
    /// The member packets go to; `None` while no member is active.
    active: Option<Arc<ConnHandle>>,
    members: Members,
}

/// A key's connections. Almost every key has one, held without an allocation of its own;
/// what only duplicates need is boxed, so an entry (and every slot of the map, which has
/// more slots than entries) stays 24 bytes.
#[derive(Debug)]
enum Members {
    One(Arc<ConnHandle>),
    Dup(Box<Dups>),
}

/// A key with two or more connections.
#[derive(Debug)]
struct Dups {
    conns: Vec<Arc<ConnHandle>>,
    /// Connection id of the most recent member to register or speak.
    last: Option<u64>,
    /// Members that registered or spoke, adjacent repeats collapsed.
    history: Vec<u64>,
}

impl Members {
    fn as_slice(&self) -> &[Arc<ConnHandle>] {
        match self {
            Self::One(conn) => std::slice::from_ref(conn),
            Self::Dup(dups) => &dups.conns,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    clients: HashMap<PublicKey, Entry>,
    /// For each source key, the connections that have received packets from it and must be
    /// told when it leaves.
    peer_gone_watchers: HashMap<PublicKey, HashMap<u64, Arc<ConnHandle>>>,
    /// Mesh peers that asked for presence updates.
    watchers: HashMap<u64, Arc<ConnHandle>>,
    /// Keys present on sibling nodes, with the forwarders that reach them.
    forwarders: HashMap<PublicKey, Forwarders>,
    /// Keys reachable only through forwarders (not also local).
    remote_only: i64,
    /// Set once the server announced a restart; connections registering later hear it too.
    restarting: Option<Control>,
}

impl State {
    /// Every registered connection, duplicates included.
    fn conns(&self) -> impl Iterator<Item = &Arc<ConnHandle>> {
        self.clients
            .values()
            .flat_map(|entry| entry.members.as_slice())
    }
}

/// A registered connection, as [`Registry::summaries`] lists it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnSummary {
    pub(crate) key: PublicKey,
    pub(crate) tcp_socket: Option<crate::handle::TcpSocket>,
}

/// The server's client registry.
#[derive(Debug)]
pub(crate) struct Registry {
    state: Mutex<State>,
    mirror: Mirror,
    metrics: Metrics,
    server_key: PublicKey,
}

impl Registry {
    pub(crate) fn new(metrics: Metrics, server_key: PublicKey) -> Self {
        Self {
            state: Mutex::new(State::default()),
            mirror: papaya::HashMap::builder()
                .hasher(foldhash::fast::RandomState::default())
                .build(),
            metrics,
            server_key,
        }
    }

    pub(crate) fn mirror(&self) -> &Mirror {
        &self.mirror
    }

    /// Looks a destination up under the lock; the fallback when the mirror has no active set.
    pub(crate) fn lookup_locked(&self, dst: &PublicKey) -> Lookup {
        let state = self.lock();
        if let Some(entry) = state.clients.get(dst) {
            if let Some(conn) = &entry.active {
                return Lookup::Local(conn.clone());
            }
            // Local wins: a key with local connections is never forwarded, even while none
            // of them is active.
            if matches!(entry.members, Members::Dup(_)) {
                return Lookup::Dup;
            }
        }
        match state.forwarders.get(dst) {
            Some(f) => Lookup::Forward(f.route.clone()),
            None => Lookup::Missing,
        }
    }

    /// Adds a connection that completed its handshake. The newest connection of a key always
    /// becomes active.
    pub(crate) fn register(&self, conn: &Arc<ConnHandle>) {
        let mut state = self.lock();
        let m = &self.metrics;
        match state.clients.get_mut(&conn.key) {
            Some(entry) => {
                if let Members::One(first) = &entry.members {
                    m.current_dup_client_keys.inc();
                    m.current_dup_client_conns.add(2);
                    first.set_dup(true);
                    entry.members = Members::Dup(Box::new(Dups {
                        last: Some(first.id),
                        history: vec![first.id],
                        conns: vec![first.clone()],
                    }));
                } else {
                    m.current_dup_client_conns.inc();
                }
                m.total_dup_client_conns.inc();
                if let Members::Dup(dups) = &mut entry.members {
                    conn.set_dup(true);
                    dups.conns.push(conn.clone());
                    dups.last = Some(conn.id);
                    push_history(&mut dups.history, conn.id);
                }
                self.set_active(&mut entry.active, conn.key, Some(conn.clone()));
            }
            None => {
                let mut entry = Entry {
                    active: None,
                    members: Members::One(conn.clone()),
                };
                self.set_active(&mut entry.active, conn.key, Some(conn.clone()));
                state.clients.insert(conn.key, entry);
                if let Some(f) = state.forwarders.get(&conn.key) {
                    // Local now wins over the forwarder; cached routes must notice.
                    f.route.retire();
                    state.remote_only -= 1;
                }
                self.update_region_gauges(&state);
            }
        }
        m.current_connections.inc();
        let present = Control::PeerPresent {
            peer: conn.key,
            addr: conn.remote.get(),
            flags: conn.presence_flags,
        };
        broadcast(&state.watchers, || present.clone());
        if let Some(restarting) = &state.restarting {
            conn.queue.push_control(restarting.clone());
        }
    }

    /// Removes a connection. When it was the key's last one, everyone who received from the
    /// key and every mesh watcher is told it is gone.
    pub(crate) fn unregister(&self, conn: &Arc<ConnHandle>) {
        let mut state = self.lock();
        let m = &self.metrics;
        let Some(entry) = state.clients.get_mut(&conn.key) else {
            return;
        };
        if !entry.members.as_slice().iter().any(|c| c.id == conn.id) {
            return;
        }
        m.current_connections.dec();
        if conn.is_preferred() {
            m.current_home_connections.dec();
        }
        let Members::Dup(dups) = &mut entry.members else {
            self.set_active(&mut entry.active, conn.key, None);
            state.clients.remove(&conn.key);
            if let Some(f) = state.forwarders.get_mut(&conn.key) {
                // Still reachable through a sibling: not gone from the region.
                f.route = ForwardRoute::new(f.list[0].clone());
                state.remote_only += 1;
            } else {
                notify_peer_gone(&mut state, &conn.key);
            }
            self.update_region_gauges(&state);
            let key = conn.key;
            broadcast(&state.watchers, || {
                Control::PeerGone(key, PeerGoneReason::Disconnected)
            });
            return;
        };
        dups.conns.retain(|c| c.id != conn.id);
        dups.history.retain(|id| *id != conn.id);
        dups.history.dedup();
        if dups.last == Some(conn.id) {
            dups.last = dups.history.last().copied();
        }
        m.current_dup_client_conns.dec();
        if let [only] = dups.conns.as_slice() {
            let only = only.clone();
            only.set_dup(false);
            entry.members = Members::One(only.clone());
            self.set_active(&mut entry.active, conn.key, Some(only));
            m.current_dup_client_conns.dec();
            m.current_dup_client_keys.dec();
        } else {
            let last = dups
                .last
                .and_then(|id| dups.conns.iter().find(|c| c.id == id).cloned());
            self.set_active(&mut entry.active, conn.key, last);
        }
    }

    /// Changes a key's active connection, keeping each connection's `active` flag (which
    /// caches revalidate against) and the mirror in step. Called with the lock held.
    fn set_active(
        &self,
        slot: &mut Option<Arc<ConnHandle>>,
        key: PublicKey,
        new: Option<Arc<ConnHandle>>,
    ) {
        let mirror = self.mirror.pin();
        if let Some(old) = slot.take() {
            old.set_active(false);
            if new.is_none() {
                // Compare-and-delete: an entry that is not this connection's is never
                // removed.
                let _ = mirror.remove_if(&key, |_, v| Arc::ptr_eq(v, &old));
            }
        }
        if let Some(conn) = &new {
            conn.set_active(true);
            // Published only once the connection is marked active, so a reader never finds
            // an entry that fails revalidation.
            mirror.insert(key, conn.clone());
        }
        *slot = new;
    }

    /// Under the default last-writer-is-active policy, a duplicate member that speaks becomes
    /// the active one.
    pub(crate) fn note_activity(&self, conn: &Arc<ConnHandle>) {
        if conn.is_active() {
            // Already the active member: nothing changes, so no lock.
            return;
        }
        let mut state = self.lock();
        let Some(entry) = state.clients.get_mut(&conn.key) else {
            return;
        };
        match &mut entry.members {
            Members::One(only) if only.id == conn.id => {}
            Members::One(_) => return,
            Members::Dup(dups) => {
                if !dups.conns.iter().any(|c| c.id == conn.id) {
                    return;
                }
                dups.last = Some(conn.id);
                push_history(&mut dups.history, conn.id);
            }
        }
        let already = entry.active.as_ref().is_some_and(|a| a.id == conn.id);
        if !already {
            self.set_active(&mut entry.active, conn.key, Some(conn.clone()));
        }
    }

    /// Records that `receiver` got a packet from `src`, so it hears when `src` leaves.
    /// `forwarded` says the packet came from a mesh peer.
    pub(crate) fn watch_peer_gone(
        &self,
        src: PublicKey,
        forwarded: bool,
        receiver: &Arc<ConnHandle>,
    ) {
        let mut state = self.lock();
        // The writer registers after it wrote the packet, so a local source may have left the
        // region in between, its departure announced before this registration: the receiver
        // is told at once instead (the writer forgets a source once it writes PeerGone for
        // it, so that source's next packet registers again). A source behind a mesh peer is
        // different: the sibling forwards its packets as soon as it knows this node's
        // clients, which can be before this node has heard the sibling's PeerPresent for the
        // source. Telling the receiver it is gone would be false, so it is watched like any
        // other and hears PeerGone when the source leaves the region, as in the reference.
        if !forwarded && !state.clients.contains_key(&src) && !state.forwarders.contains_key(&src) {
            receiver
                .queue
                .push_control(Control::PeerGone(src, PeerGoneReason::Disconnected));
            return;
        }
        state
            .peer_gone_watchers
            .entry(src)
            .or_default()
            .insert(receiver.id, receiver.clone());
    }

    /// Drops every peer-gone registration a closing connection holds.
    pub(crate) fn unwatch_peer_gone<S>(&self, sources: &HashSet<PublicKey, S>, receiver_id: u64) {
        if sources.is_empty() {
            return;
        }
        let mut state = self.lock();
        for src in sources {
            if let Some(w) = state.peer_gone_watchers.get_mut(src) {
                w.remove(&receiver_id);
                if w.is_empty() {
                    state.peer_gone_watchers.remove(src);
                }
            }
        }
    }

    /// Subscribes a mesh peer to presence changes and tells it about everyone present now,
    /// itself included.
    pub(crate) fn add_watcher(&self, conn: &Arc<ConnHandle>) {
        // A server meshing with itself must not watch itself.
        if conn.key == self.server_key {
            return;
        }
        let mut state = self.lock();
        if state.watchers.insert(conn.id, conn.clone()).is_none() {
            self.metrics.watchers.inc();
        }
        for entry in state.clients.values() {
            if let Some(active) = &entry.active {
                conn.queue.push_control(Control::PeerPresent {
                    peer: active.key,
                    addr: active.remote.get(),
                    flags: active.presence_flags,
                });
            }
        }
    }

    pub(crate) fn remove_watcher(&self, conn_id: u64) {
        let mut state = self.lock();
        if state.watchers.remove(&conn_id).is_some() {
            self.metrics.watchers.dec();
        }
    }

    /// Queues a Restarting frame for every connection, and for every connection that
    /// registers from now on. Under the lock, so each connection hears it exactly once.
    pub(crate) fn announce_restart(&self, reconnect_in_ms: u32, try_for_ms: u32) {
        let mut state = self.lock();
        if state.restarting.is_some() {
            return;
        }
        let restarting = Control::Restarting {
            reconnect_in_ms,
            try_for_ms,
        };
        for member in state.conns() {
            member.queue.push_control(restarting.clone());
        }
        state.restarting = Some(restarting);
    }

    /// Whether every registered connection has handed everything queued to its socket.
    pub(crate) fn all_drained(&self) -> bool {
        self.lock().conns().all(|member| member.queue.is_drained())
    }

    /// Every registered connection (duplicates included) with what `/debug/traffic` needs.
    pub(crate) fn summaries(&self) -> Vec<ConnSummary> {
        self.collect_conns(|c| {
            Some(ConnSummary {
                key: c.key,
                tcp_socket: c.tcp_socket(),
            })
        })
    }

    /// What `pick` takes from each registered connection (duplicates included), in one pass
    /// under the lock, off the packet path. The list is allocated once, at its largest size:
    /// grown by doubling, a list made every sampling period would leave its smaller copies
    /// and up to half its length again to the allocator each time, in proportion to the
    /// connections.
    pub(crate) fn collect_conns<T>(
        &self,
        pick: impl FnMut(&Arc<ConnHandle>) -> Option<T>,
    ) -> Vec<T> {
        let state = self.lock();
        let mut out = Vec::with_capacity(state.conns().count());
        out.extend(state.conns().filter_map(pick));
        out
    }

    /// Checks that the client map, its lock-free mirror and the gauges agree, as
    /// `/debug/check` reports it (derper's `ConsistencyCheck`, for derpd's structures).
    /// Returns what disagrees, empty when all is well.
    pub(crate) fn consistency_check(&self) -> Vec<String> {
        let state = self.lock();
        let mirror = self.mirror.pin();
        let mut errs = Vec::new();
        let stale_active = state
            .clients
            .iter()
            .filter(|(key, entry)| match (&entry.active, mirror.get(*key)) {
                (Some(active), Some(published)) => {
                    !Arc::ptr_eq(active, published) || !active.is_active()
                }
                (None, None) => false,
                _ => true,
            })
            .count();
        if stale_active != 0 {
            errs.push(format!(
                "{stale_active} client map keys whose mirror entry is not their active connection"
            ));
        }
        let orphans = mirror
            .iter()
            .filter(|(key, _)| !state.clients.contains_key(*key))
            .count();
        if orphans != 0 {
            errs.push(format!("{orphans} mirror keys not in the client map"));
        }
        let conns = state.conns().count();
        let gauge = self.metrics.current_connections.get();
        if i64::try_from(conns).ok() != Some(gauge) {
            errs.push(format!(
                "derp_current_connections = {gauge} != client map says {conns}"
            ));
        }
        let dup_keys = state
            .clients
            .values()
            .filter(|e| matches!(e.members, Members::Dup(_)))
            .count();
        let gauge = self.metrics.current_dup_client_keys.get();
        if i64::try_from(dup_keys).ok() != Some(gauge) {
            errs.push(format!(
                "derp_current_dup_client_keys = {gauge} != client map says {dup_keys}"
            ));
        }
        errs
    }

    /// Cancels every registered connection (the server is shutting down).
    pub(crate) fn cancel_all(&self) {
        self.lock()
            .conns()
            .for_each(|member| member.cancel.cancel());
    }

    /// Wakes every registered connection's read loop, quiet or busy, to see that the server
    /// is draining.
    pub(crate) fn wake_quiet_all(&self) {
        self.lock()
            .conns()
            .for_each(|member| member.cancel.wake_quiet());
    }

    /// Closes every connection of `key` (a mesh peer's ClosePeer request).
    pub(crate) fn close_peer(&self, key: &PublicKey) -> bool {
        let state = self.lock();
        match state.clients.get(key) {
            Some(entry) => {
                for member in entry.members.as_slice() {
                    member.cancel.cancel();
                }
                true
            }
            None => false,
        }
    }

    /// Adds a forwarder for a key present on a sibling node. Adding the same forwarder twice
    /// changes nothing; a second, different one is kept as a fallback while the first stays
    /// preferred.
    pub(crate) fn add_forwarder(&self, key: PublicKey, fwd: Arc<dyn PacketForwarder>) {
        let mut state = self.lock();
        let local = state.clients.contains_key(&key);
        match state.forwarders.get_mut(&key) {
            Some(f) => {
                if f.list.iter().any(|x| Arc::ptr_eq(x, &fwd)) {
                    return;
                }
                if f.list.len() == 1 {
                    self.metrics.multiforwarder_created.inc();
                }
                f.list.push(fwd);
            }
            None => {
                state.forwarders.insert(
                    key,
                    Forwarders {
                        list: vec![fwd.clone()],
                        route: ForwardRoute::new(fwd),
                    },
                );
                if !local {
                    state.remote_only += 1;
                }
            }
        }
        self.update_region_gauges(&state);
    }

    /// Removes a forwarder. When it was the key's last route anywhere in the region, local
    /// clients that received from the key are told it is gone.
    pub(crate) fn remove_forwarder(&self, key: &PublicKey, fwd: &Arc<dyn PacketForwarder>) {
        let mut state = self.lock();
        let local = state.clients.contains_key(key);
        let Some(f) = state.forwarders.get_mut(key) else {
            self.metrics.packet_forwarder_delete_other_value.inc();
            return;
        };
        let Some(pos) = f.list.iter().position(|x| Arc::ptr_eq(x, fwd)) else {
            self.metrics.packet_forwarder_delete_other_value.inc();
            return;
        };
        f.list.remove(pos);
        if f.list.len() == 1 {
            self.metrics.multiforwarder_deleted.inc();
        }
        if pos == 0 {
            f.route.retire();
            if let Some(next) = f.list.first() {
                f.route = ForwardRoute::new(next.clone());
            }
        }
        if f.list.is_empty() {
            state.forwarders.remove(key);
            if !local {
                state.remote_only -= 1;
                notify_peer_gone(&mut state, key);
            }
        }
        self.update_region_gauges(&state);
    }

    fn update_region_gauges(&self, state: &State) {
        let local = state.clients.len() as i64;
        self.metrics.clients_local.set(local);
        self.metrics.clients_remote.set(state.remote_only);
        self.metrics.clients_total.set(local + state.remote_only);
    }

    /// Number of distinct local keys; for tests and consistency checks.
    pub(crate) fn local_keys(&self) -> usize {
        self.lock().clients.len()
    }

    /// Holds the registry lock, so tests can prove a path does not take it.
    #[cfg(test)]
    pub(crate) fn lock_for_test(&self) -> MutexGuard<'_, impl Sized> {
        self.lock()
    }

    /// Makes the mirror disagree with the authoritative map, so tests can tell which one a
    /// lookup read.
    #[cfg(test)]
    pub(crate) fn remove_from_mirror_for_test(&self, key: &PublicKey) {
        self.mirror.pin().remove(key);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent before any call that could
        // panic, so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Tells every connection that received from `key` that it left the region.
fn notify_peer_gone(state: &mut State, key: &PublicKey) {
    if let Some(watchers) = state.peer_gone_watchers.remove(key) {
        for w in watchers.values() {
            w.queue
                .push_control(Control::PeerGone(*key, PeerGoneReason::Disconnected));
        }
    }
}

/// Moves `id` to the end of the history. Each member appears at most once, so a client
/// alternating between its own duplicate connections cannot grow the history (the reference
/// appends on every switch); the most recent speaker is still last.
fn push_history(history: &mut Vec<u64>, id: u64) {
    if history.last() != Some(&id) {
        history.retain(|x| *x != id);
        history.push(id);
    }
}

fn broadcast(watchers: &HashMap<u64, Arc<ConnHandle>>, make: impl Fn() -> Control) {
    for w in watchers.values() {
        w.queue.push_control(make());
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn conn(id: u64) -> Arc<ConnHandle> {
        ConnHandle::for_tests(id, 5)
    }

    #[test]
    fn alternating_duplicates_do_not_grow_the_history() {
        let metrics = Metrics::new(&prometheus::Registry::new()).expect("metrics");
        let reg = Registry::new(metrics, PublicKey::from_bytes([0; 32]));
        let (a, b) = (conn(1), conn(2));
        reg.register(&a);
        reg.register(&b);
        for _ in 0..1000 {
            reg.note_activity(&a);
            reg.note_activity(&b);
        }
        let state = reg.lock();
        let entry = state.clients.get(&a.key).expect("entry");
        let Members::Dup(dups) = &entry.members else {
            panic!("two connections of one key are a duplicate set");
        };
        assert_eq!(dups.history, vec![1, 2]);
        assert_eq!(entry.active.as_ref().map(|c| c.id), Some(2));
        drop(state);
        // The last speaker leaving hands the role back to the other.
        reg.unregister(&b);
        assert!(a.is_active());
        assert!(!b.is_active());
    }

    #[test]
    fn the_consistency_check_passes_then_names_what_disagrees() {
        let metrics = Metrics::new(&prometheus::Registry::new()).expect("metrics");
        let reg = Registry::new(metrics.clone(), PublicKey::from_bytes([0; 32]));
        let (a, b, c) = (conn(1), conn(2), ConnHandle::for_tests(3, 6));
        reg.register(&a);
        reg.register(&b);
        reg.register(&c);
        assert_eq!(reg.consistency_check(), Vec::<String>::new());
        assert_eq!(reg.summaries().len(), 3);
        reg.unregister(&c);
        assert_eq!(reg.consistency_check(), Vec::<String>::new());

        metrics.current_connections.inc();
        reg.mirror.pin().insert(c.key, c.clone());
        reg.mirror.pin().insert(a.key, a.clone());
        assert_eq!(
            reg.consistency_check(),
            [
                "1 client map keys whose mirror entry is not their active connection",
                "1 mirror keys not in the client map",
                "derp_current_connections = 3 != client map says 2",
            ]
        );
    }
}
