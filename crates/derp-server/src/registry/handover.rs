//! The registry's part in handing connections to a successor process: what a key's
//! connections are, copied out; taken in again on the other side; and forgotten here once
//! handed, all without the PeerPresent and PeerGone broadcasts a connection coming or going
//! makes. Nobody came or went: the clients are where they were, only served by another
//! process.

use std::collections::HashSet;
use std::sync::Arc;

use derp_proto::PublicKey;

use super::{Dups, Entry, ForwardRoute, Members, Registry};
use crate::handle::ConnHandle;

/// One key's connections as a handover sees them.
#[derive(Debug)]
pub(crate) struct KeyMembers {
    pub(crate) key: PublicKey,
    /// In the order they registered; the active one, if any, is marked.
    pub(crate) members: Vec<(Arc<ConnHandle>, bool)>,
}

impl Registry {
    /// Every key with its connections, and the ids of the mesh watchers.
    pub(crate) fn handover_view(&self) -> (Vec<KeyMembers>, HashSet<u64>) {
        let state = self.lock();
        let keys = state
            .clients
            .iter()
            .map(|(key, entry)| KeyMembers {
                key: *key,
                members: entry
                    .members
                    .as_slice()
                    .iter()
                    .map(|c| {
                        let active = entry.active.as_ref().is_some_and(|a| a.id == c.id);
                        (c.clone(), active)
                    })
                    .collect(),
            })
            .collect();
        (keys, state.watchers.keys().copied().collect())
    }

    /// Wakes every registered connection's read loop to look at a handover beginning or
    /// ending, leaving each its waker (see [`crate::handle::Cancel::poke_quiet`]).
    pub(crate) fn poke_all(&self) {
        self.lock()
            .conns()
            .for_each(|member| member.cancel.poke_quiet());
    }

    /// Takes in connections a predecessor process handed over: each key with its members in
    /// their order and its active one, and the mesh watchers among them. Nothing is
    /// broadcast: the watchers (handed over too) already know every key.
    pub(crate) fn adopt(&self, keys: Vec<KeyMembers>, watchers: &[Arc<ConnHandle>]) {
        let mut state = self.lock();
        let m = &self.metrics;
        for KeyMembers { key, members } in keys {
            if members.is_empty() || state.clients.contains_key(&key) {
                continue;
            }
            let active = members.iter().find(|(_, a)| *a).map(|(c, _)| c.clone());
            m.current_connections.add(members.len() as i64);
            for (conn, _) in &members {
                if conn.is_preferred() {
                    m.current_home_connections.inc();
                }
            }
            let members = if let [(only, _)] = members.as_slice() {
                Members::One(only.clone())
            } else {
                m.current_dup_client_keys.inc();
                m.current_dup_client_conns.add(members.len() as i64);
                let conns: Vec<_> = members.into_iter().map(|(c, _)| c).collect();
                for c in &conns {
                    c.set_dup(true);
                }
                let history: Vec<u64> = conns.iter().map(|c| c.id).collect();
                Members::Dup(Box::new(Dups {
                    last: active.as_ref().map(|a| a.id).or(history.last().copied()),
                    history,
                    conns,
                }))
            };
            let mut entry = Entry {
                active: None,
                members,
            };
            self.set_active(&mut entry.active, key, active);
            state.clients.insert(key, entry);
            if let Some(f) = state.forwarders.get(&key) {
                f.route.retire();
                state.remote_only -= 1;
            }
        }
        for w in watchers {
            if state.watchers.insert(w.id, w.clone()).is_none() {
                m.watchers.inc();
            }
        }
        self.update_region_gauges(&state);
    }

    /// Removes connections handed to a successor process, silently: every connection of
    /// each of their keys, their PeerGone watches and their watcher places.
    pub(crate) fn forget(&self, conns: &[Arc<ConnHandle>]) {
        let mut state = self.lock();
        let m = &self.metrics;
        let ids: HashSet<u64> = conns.iter().map(|c| c.id).collect();
        for conn in conns {
            let Some(entry) = state.clients.get_mut(&conn.key) else {
                continue;
            };
            if !entry.members.as_slice().iter().any(|c| c.id == conn.id) {
                continue;
            }
            m.current_connections.dec();
            if conn.is_preferred() {
                m.current_home_connections.dec();
            }
            match &mut entry.members {
                Members::One(_) => {
                    self.set_active(&mut entry.active, conn.key, None);
                    state.clients.remove(&conn.key);
                }
                Members::Dup(dups) => {
                    dups.conns.retain(|c| c.id != conn.id);
                    dups.history.retain(|id| *id != conn.id);
                    m.current_dup_client_conns.dec();
                    if entry.active.as_ref().is_some_and(|a| a.id == conn.id) {
                        self.set_active(&mut entry.active, conn.key, None);
                    }
                    if dups.conns.is_empty() {
                        m.current_dup_client_keys.dec();
                        state.clients.remove(&conn.key);
                    }
                }
            }
            if !state.clients.contains_key(&conn.key)
                && let Some(f) = state.forwarders.get_mut(&conn.key)
            {
                // Still reachable through a sibling, as after an unregister.
                f.route = ForwardRoute::new(f.list[0].clone());
                state.remote_only += 1;
            }
            if state.watchers.remove(&conn.id).is_some() {
                m.watchers.dec();
            }
        }
        state.peer_gone_watchers.retain(|_, receivers| {
            receivers.retain(|id, _| !ids.contains(id));
            !receivers.is_empty()
        });
        self.update_region_gauges(&state);
    }
}
