//! Connections opened for their own sake, shared by connect and idle: a storm (dial,
//! upgrade, handshake, close, as fast as the concurrency allows) and an opening (dial and
//! handshake, then hold). Each works on a [`ConnectionShare`], all of a run's connections or
//! one process's part of them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use derp_client::Client;
use derp_proto::{PublicKey, SecretKey};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::measure::{RttHistogram, new_histogram};
use crate::target::{ClientTemplate, SourceAddrs, Target, connect_error_kind};

/// `count` connections, numbered from `first` of `total` (source addresses are chosen by
/// number), `concurrency` of them opening at once.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct ConnectionShare {
    /// Connections in this share.
    pub count: usize,
    /// The number of the first.
    pub first: usize,
    /// Connections in the whole run.
    pub total: usize,
    /// How many of this share open at once.
    pub concurrency: u32,
}

impl ConnectionShare {
    /// All `connections` in one process.
    pub fn all(connections: u32, concurrency: u32) -> Self {
        let n = connections as usize;
        Self {
            count: n,
            first: 0,
            total: n,
            concurrency,
        }
    }

    /// `connections` opened `concurrency` at a time, split over up to `procs` processes:
    /// both divided as evenly as they go, no process with nothing to do.
    pub fn split(connections: u32, concurrency: u32, procs: u32) -> Vec<Self> {
        let n = connections as usize;
        let procs = (procs as usize).min(n).min(concurrency as usize).max(1);
        let counts = crate::procs::split(n as u64, procs);
        let concurrencies = crate::procs::split(u64::from(concurrency), procs);
        let mut first = 0;
        counts
            .iter()
            .zip(&concurrencies)
            .map(|(&count, &c)| {
                let share = Self {
                    count: count as usize,
                    first,
                    total: n,
                    concurrency: c as u32,
                };
                first += count as usize;
                share
            })
            .collect()
    }
}

/// A storm ready to go: keys made (that is the client's share of the handshake work, done
/// before the clock starts) and source addresses chosen.
#[derive(Debug)]
pub struct Storm {
    keys: Arc<Vec<SecretKey>>,
    share: ConnectionShare,
    sources: SourceAddrs,
    template: ClientTemplate,
}

/// What a storm did.
#[derive(Debug)]
pub struct StormDone {
    /// Connections tried.
    pub attempted: u64,
    /// Handshake times of those that succeeded.
    pub handshakes: RttHistogram,
    /// Failures by kind.
    pub failures: BTreeMap<String, u64>,
    /// When the last connection completed (or failed).
    pub end: Instant,
}

impl Storm {
    /// Makes the keys and chooses the source addresses for `share`.
    pub fn prepare(target: &Target, share: ConnectionShare) -> Self {
        Self {
            keys: Arc::new(
                (0..share.count)
                    .map(|_| SecretKey::generate(&mut rand::rngs::OsRng))
                    .collect(),
            ),
            share,
            sources: target.source_addrs(share.total),
            template: target.template(),
        }
    }

    /// Runs the storm from `start` (now, or a start shared with other processes).
    pub async fn run(self, start: Instant, max_duration: Duration) -> StormDone {
        let next = Arc::new(AtomicUsize::new(0));
        let deadline = start + max_duration;
        let mut workers = Vec::new();
        for _ in 0..(self.share.concurrency as usize).min(self.share.count) {
            let keys = self.keys.clone();
            let next = next.clone();
            let template = self.template.clone();
            let (sources, first) = (self.sources, self.share.first);
            workers.push(tokio::spawn(async move {
                let mut hist = new_histogram();
                let mut failures: BTreeMap<String, u64> = BTreeMap::new();
                let mut attempted = 0u64;
                let mut last_done = start;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= keys.len() || Instant::now() >= deadline {
                        break;
                    }
                    attempted += 1;
                    let config = template.config(keys[i].clone(), sources.for_index(first + i));
                    let t0 = Instant::now();
                    match Client::connect(&config).await {
                        Ok(client) => {
                            let took = t0.elapsed();
                            hist.saturating_record((took.as_nanos() as u64).max(1));
                            drop(client);
                        }
                        Err(e) => *failures.entry(connect_error_kind(&e)).or_default() += 1,
                    }
                    last_done = Instant::now();
                }
                (hist, failures, attempted, last_done)
            }));
        }
        let mut done = StormDone {
            attempted: 0,
            handshakes: new_histogram(),
            failures: BTreeMap::new(),
            end: start,
        };
        for w in workers {
            match w.await {
                Ok((h, f, a, last)) => {
                    let _ = done.handshakes.add(&h);
                    for (k, v) in f {
                        *done.failures.entry(k).or_default() += v;
                    }
                    done.attempted += a;
                    done.end = done.end.max(last);
                }
                Err(e) => *done.failures.entry(format!("task_{e}")).or_default() += 1,
            }
        }
        done
    }
}

/// Connections about to be opened: keys made and addresses chosen.
#[derive(Debug)]
pub struct Opening {
    configs: Vec<derp_client::ClientConfig>,
    concurrency: usize,
}

impl Opening {
    /// Makes the keys and client configs for `share`.
    pub fn prepare(target: &Target, share: ConnectionShare) -> Self {
        let sources = target.source_addrs(share.total);
        let template = target.template();
        Self {
            configs: (0..share.count)
                .map(|i| {
                    let key = SecretKey::generate(&mut rand::rngs::OsRng);
                    template.config(key, sources.for_index(share.first + i))
                })
                .collect(),
            concurrency: share.concurrency as usize,
        }
    }

    /// Each connection's public key, in the order [`Opening::open`] returns the clients
    /// (those that opened keep their order).
    pub fn public_keys(&self) -> Vec<PublicKey> {
        self.configs
            .iter()
            .map(|c| c.secret_key.public_key())
            .collect()
    }

    /// Opens them all, `concurrency` at a time; the clients and the failures by kind.
    pub async fn open(self) -> (Vec<Client>, BTreeMap<String, u64>) {
        let gate = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let mut tasks = Vec::with_capacity(self.configs.len());
        for config in self.configs {
            let gate = gate.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire_owned().await;
                Client::connect(&config).await
            }));
        }
        let mut clients = Vec::with_capacity(tasks.len());
        let mut failures: BTreeMap<String, u64> = BTreeMap::new();
        for t in tasks {
            match t.await {
                Ok(Ok(c)) => clients.push(c),
                Ok(Err(e)) => *failures.entry(connect_error_kind(&e)).or_default() += 1,
                Err(e) => *failures.entry(format!("task_{e}")).or_default() += 1,
            }
        }
        (clients, failures)
    }
}
