//! Who is connected: the authoritative client map, its lock-free mirror, duplicate-key
//! bookkeeping, peer-gone watches and mesh watchers.
//!
//! Every change happens under one mutex, so the map, the duplicate sets, the gauges and the
//! watcher broadcasts stay consistent with each other. The packet path reads only the mirror
//! (a papaya map) and each set's atomically swapped active connection, so it never takes the
//! lock while the destination is connected.
//!
//! Design follows tailscale/derp derpserver.go (registerClient, unregisterClient, clientSet).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwapOption;
use derp_proto::{PeerGoneReason, PublicKey};

use crate::metrics::Metrics;
use crate::queue::{ConnHandle, Control};

/// The lock-free map from key to client set that the packet path reads.
pub(crate) type Mirror = papaya::HashMap<PublicKey, Arc<ClientSet>, foldhash::fast::RandomState>;

/// All connections of one key. The set object lives as long as the key has any connection,
/// so caches that hold it see changes of the active connection directly.
#[derive(Debug)]
pub(crate) struct ClientSet {
    /// The connection packets go to; `None` while no member is active.
    pub(crate) active: ArcSwapOption<ConnHandle>,
}

impl ClientSet {
    /// The active connection, if any. The guard borrows nothing shared and takes no lock.
    pub(crate) fn load_active(&self) -> arc_swap::Guard<Option<Arc<ConnHandle>>> {
        self.active.load()
    }
}

/// What a lookup found for a destination key.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// A connected client.
    Local(Arc<ConnHandle>),
    /// The key has several connections and none is active.
    Dup,
    /// Nobody with that key is here.
    Missing,
}

#[derive(Debug)]
struct Entry {
    set: Arc<ClientSet>,
    members: Vec<Arc<ConnHandle>>,
    /// Connection id of the most recent member to register or speak.
    last: Option<u64>,
    /// Members that registered or spoke, adjacent repeats collapsed.
    history: Vec<u64>,
}

#[derive(Debug, Default)]
struct State {
    clients: HashMap<PublicKey, Entry>,
    /// For each source key, the connections that have received packets from it and must be
    /// told when it leaves.
    peer_gone_watchers: HashMap<PublicKey, HashMap<u64, Arc<ConnHandle>>>,
    /// Mesh peers that asked for presence updates.
    watchers: HashMap<u64, Arc<ConnHandle>>,
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
        match state.clients.get(dst) {
            Some(entry) => match entry.set.active.load_full() {
                Some(conn) => Lookup::Local(conn),
                None if entry.members.len() > 1 => Lookup::Dup,
                None => Lookup::Missing,
            },
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
                if entry.members.len() == 1 {
                    m.current_dup_client_keys.inc();
                    m.current_dup_client_conns.add(2);
                    entry.history = entry.members.iter().map(|c| c.id).collect();
                } else {
                    m.current_dup_client_conns.inc();
                }
                m.total_dup_client_conns.inc();
                for member in &entry.members {
                    member.is_dup.store(true, Ordering::Relaxed);
                }
                conn.is_dup.store(true, Ordering::Relaxed);
                entry.members.push(conn.clone());
                entry.last = Some(conn.id);
                push_history(&mut entry.history, conn.id);
                entry.set.active.store(Some(conn.clone()));
            }
            None => {
                let set = Arc::new(ClientSet {
                    active: ArcSwapOption::from(Some(conn.clone())),
                });
                state.clients.insert(
                    conn.key,
                    Entry {
                        set: set.clone(),
                        members: vec![conn.clone()],
                        last: Some(conn.id),
                        history: Vec::new(),
                    },
                );
                // Published only once the set has its active connection, so a reader of the
                // mirror never sees a half-built set.
                self.mirror.pin().insert(conn.key, set);
                m.clients_local.inc();
                m.clients_total.inc();
            }
        }
        m.current_connections.inc();
        let present = Control::PeerPresent {
            peer: conn.key,
            addr: conn.remote,
            flags: conn.presence_flags,
        };
        broadcast(&state.watchers, || present.clone());
    }

    /// Removes a connection. When it was the key's last one, everyone who received from the
    /// key and every mesh watcher is told it is gone.
    pub(crate) fn unregister(&self, conn: &Arc<ConnHandle>) {
        let mut state = self.lock();
        let m = &self.metrics;
        let Some(entry) = state.clients.get_mut(&conn.key) else {
            return;
        };
        let Some(pos) = entry.members.iter().position(|c| c.id == conn.id) else {
            return;
        };
        m.current_connections.dec();
        if conn.preferred.load(Ordering::Relaxed) {
            m.current_home_connections.dec();
        }
        if entry.members.len() == 1 {
            entry.set.active.store(None);
            let set = entry.set.clone();
            state.clients.remove(&conn.key);
            // Compare-and-delete: a newer set for the same key must never be removed.
            let _ = self
                .mirror
                .pin()
                .remove_if(&conn.key, |_, v| Arc::ptr_eq(v, &set));
            m.clients_local.dec();
            m.clients_total.dec();
            if let Some(watchers) = state.peer_gone_watchers.remove(&conn.key) {
                for w in watchers.values() {
                    w.push_control(Control::PeerGone(conn.key, PeerGoneReason::Disconnected));
                }
            }
            let key = conn.key;
            broadcast(&state.watchers, || {
                Control::PeerGone(key, PeerGoneReason::Disconnected)
            });
            return;
        }
        entry.members.remove(pos);
        entry.history.retain(|id| *id != conn.id);
        entry.history.dedup();
        if entry.last == Some(conn.id) {
            entry.last = entry.history.last().copied();
        }
        m.current_dup_client_conns.dec();
        if entry.members.len() == 1 {
            let only = entry.members[0].clone();
            only.is_dup.store(false, Ordering::Relaxed);
            entry.last = Some(only.id);
            entry.history.clear();
            entry.set.active.store(Some(only));
            m.current_dup_client_conns.dec();
            m.current_dup_client_keys.dec();
        } else {
            let last = entry
                .last
                .and_then(|id| entry.members.iter().find(|c| c.id == id).cloned());
            entry.set.active.store(last);
        }
    }

    /// Under the default last-writer-is-active policy, a duplicate member that speaks becomes
    /// the active one.
    pub(crate) fn note_activity(&self, conn: &Arc<ConnHandle>) {
        let mut state = self.lock();
        let Some(entry) = state.clients.get_mut(&conn.key) else {
            return;
        };
        if !entry.members.iter().any(|c| c.id == conn.id) {
            return;
        }
        entry.last = Some(conn.id);
        push_history(&mut entry.history, conn.id);
        let already = entry
            .set
            .active
            .load()
            .as_ref()
            .is_some_and(|a| a.id == conn.id);
        if !already {
            entry.set.active.store(Some(conn.clone()));
        }
    }

    /// Records that `receiver` got a packet from `src`, so it hears when `src` leaves.
    pub(crate) fn watch_peer_gone(&self, src: PublicKey, receiver: &Arc<ConnHandle>) {
        let mut state = self.lock();
        // A source that already left gets no registration: nothing would ever remove it.
        if !state.clients.contains_key(&src) {
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
            if let Some(active) = entry.set.active.load_full() {
                conn.push_control(Control::PeerPresent {
                    peer: active.key,
                    addr: active.remote,
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

    /// Closes every connection of `key` (a mesh peer's ClosePeer request).
    pub(crate) fn close_peer(&self, key: &PublicKey) -> bool {
        let state = self.lock();
        match state.clients.get(key) {
            Some(entry) => {
                for member in &entry.members {
                    member.cancel.cancel();
                }
                true
            }
            None => false,
        }
    }

    /// Number of distinct local keys; for tests and consistency checks.
    pub(crate) fn local_keys(&self) -> usize {
        self.lock().clients.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent before any call that could
        // panic, so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn push_history(history: &mut Vec<u64>, id: u64) {
    if history.last() != Some(&id) {
        history.push(id);
    }
}

fn broadcast(watchers: &HashMap<u64, Arc<ConnHandle>>, make: impl Fn() -> Control) {
    for w in watchers.values() {
        w.push_control(make());
    }
}
