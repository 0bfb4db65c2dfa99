//! The application traffic secrets of TLS 1.3 handshakes, caught through rustls's key log as
//! rustls derives them, for [`accept`](super::accept) to take when its handshake is done.
//! rustls hands the traffic keys over after a handshake, but keeps the secrets they come
//! from, and those are what a KeyUpdate needs, and what a connection's state must carry to
//! be rebuilt in another process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rustls::KeyLog;
use rustls::server::ServerConfig;
use zeroize::Zeroize;

/// rustls's key log labels (the NSS key log format's) of the first application traffic
/// secrets, each direction's.
const CLIENT_LABEL: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_LABEL: &str = "SERVER_TRAFFIC_SECRET_0";

/// The longest traffic secret: SHA-384's output.
const MAX_SECRET: usize = 48;

/// Handshakes whose secrets are held at most. An entry lives from the server's first flight
/// to the client's Finished (a round trip, at most the handshake timeout), or until it is
/// swept when the handshake failed; this bounds what failed handshakes leave, some 3 MB.
const MAX_ENTRIES: usize = 16 * 1024;

/// Age after which an entry is swept: its handshake failed or was served another way. Well
/// above derpd's handshake timeout (10 s by default); a handshake slower than this is still
/// served, but its secrets are gone.
const MAX_AGE: Duration = Duration::from_secs(60);

/// The application traffic secrets TLS 1.3 handshakes logged, keyed by the ClientHello's
/// random, until [`accept`](super::accept) takes its handshake's.
///
/// A rustls config shares one key log among all its handshakes, so this is one map with a
/// lock, touched three times per handshake (two secrets logged, one entry taken). It is
/// bounded: an entry older than a minute (a handshake that failed, or that rustls served
/// instead) is swept when a new one comes, and a new one is refused while 16,384 are held.
/// A refused or swept handshake is still served; its connection only cannot be handed to
/// another process. Secrets are zeroed when their entry goes. The `Debug` output shows how
/// many entries are held, never a secret.
pub struct SecretCapture {
    entries: Mutex<Entries>,
    max_entries: usize,
    max_age: Duration,
}

#[derive(Default)]
struct Entries {
    /// Boxed so that the map moves only pointers when it grows, and leaves no copy of a
    /// secret behind in memory it frees.
    logged: HashMap<[u8; 32], Box<Logged>>,
    next_sweep: Option<Instant>,
}

/// The secrets one handshake logged so far.
struct Logged {
    at: Instant,
    client: ([u8; MAX_SECRET], u8),
    server: ([u8; MAX_SECRET], u8),
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.client.0.zeroize();
        self.server.0.zeroize();
    }
}

/// One handshake's application traffic secrets as logged: the client's and the server's
/// first, each the suite's hash length. Zeroed when dropped.
pub(super) struct Captured(Box<Logged>);

impl Captured {
    pub(super) fn client(&self) -> &[u8] {
        let (bytes, len) = &self.0.client;
        &bytes[..usize::from(*len)]
    }

    pub(super) fn server(&self) -> &[u8] {
        let (bytes, len) = &self.0.server;
        &bytes[..usize::from(*len)]
    }
}

impl std::fmt::Debug for SecretCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretCapture")
            .field("entries", &self.len())
            .field("max_entries", &self.max_entries)
            .field("max_age", &self.max_age)
            .finish()
    }
}

impl SecretCapture {
    /// This process's capture, the one [`accept`](super::accept) takes secrets from and
    /// [`configure`] installs. A ClientHello's random is 32 random bytes, so the handshakes
    /// of every config can share it.
    pub fn process() -> &'static Arc<SecretCapture> {
        static PROCESS: OnceLock<Arc<SecretCapture>> = OnceLock::new();
        PROCESS.get_or_init(|| Arc::new(Self::with_bounds(MAX_ENTRIES, MAX_AGE)))
    }

    pub(super) fn with_bounds(max_entries: usize, max_age: Duration) -> Self {
        Self {
            entries: Mutex::new(Entries::default()),
            max_entries,
            max_age,
        }
    }

    /// Handshakes whose secrets are held: in progress, or failed and not swept yet.
    pub fn len(&self) -> usize {
        self.lock().logged.len()
    }

    /// Whether no handshake's secrets are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the secrets the handshake with this ClientHello random logged, if it logged
    /// both and they were kept.
    pub(super) fn take(&self, client_random: &[u8; 32]) -> Option<Captured> {
        let logged = self.lock().logged.remove(client_random)?;
        (logged.client.1 > 0 && logged.server.1 > 0).then_some(Captured(logged))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl KeyLog for SecretCapture {
    fn log(&self, label: &str, client_random: &[u8], secret: &[u8]) {
        let client = match label {
            CLIENT_LABEL => true,
            SERVER_LABEL => false,
            _ => return,
        };
        let (Ok(random), Ok(len)) = (
            <[u8; 32]>::try_from(client_random),
            u8::try_from(secret.len()),
        ) else {
            return;
        };
        if secret.is_empty() || secret.len() > MAX_SECRET {
            return;
        }
        let now = Instant::now();
        let mut entries = self.lock();
        let Entries { logged, next_sweep } = &mut *entries;
        if !logged.contains_key(&random) {
            if next_sweep.is_none_or(|at| now >= at) {
                logged.retain(|_, e| now.saturating_duration_since(e.at) < self.max_age);
                *next_sweep = Some(now + self.max_age / 2);
            }
            if logged.len() >= self.max_entries {
                return;
            }
        }
        let entry = logged.entry(random).or_insert_with(|| {
            Box::new(Logged {
                at: now,
                client: ([0; MAX_SECRET], 0),
                server: ([0; MAX_SECRET], 0),
            })
        });
        let (bytes, held) = if client {
            &mut entry.client
        } else {
            &mut entry.server
        };
        bytes[..secret.len()].copy_from_slice(secret);
        *held = len;
    }

    fn will_log(&self, label: &str) -> bool {
        matches!(label, CLIENT_LABEL | SERVER_LABEL)
    }
}

/// Sets what [`accept`](super::accept) needs of a rustls server config: secret extraction
/// (the traffic keys handed over after the handshake), and this process's
/// [`SecretCapture`] as its key log (the secrets they come from). The config's key log is
/// replaced.
pub fn configure(config: &mut ServerConfig) {
    config.enable_secret_extraction = true;
    config.key_log = SecretCapture::process().clone();
}
