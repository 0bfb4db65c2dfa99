//! `--allow-keys-file`: a plain list of the node keys that may use the relay.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use derp_proto::PublicKey;
use derp_server::{Admission, AdmissionRequest, Refused, VerdictFuture};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::AdmissionMetrics;

/// Why an allow-keys file was not put in force.
#[derive(Debug, thiserror::Error)]
pub enum AllowKeysError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A line is not a node key.
    #[error("{}:{line}: {reason}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// What identifies a version of the file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

/// The allowed keys, one per line in a file: `nodekey:<64 hex>` (or the bare 64 hex), blank
/// lines and `#` comments (whole lines or the rest of a line) ignored.
///
/// [`AllowKeys::reload`] re-reads it; if the new contents have a bad line the error names
/// the line and the old list stays in force. Refusal reason: `not_listed`.
#[derive(Debug)]
pub struct AllowKeys {
    path: PathBuf,
    keys: ArcSwap<HashSet<PublicKey>>,
    stamp: Mutex<Option<Stamp>>,
    metrics: AdmissionMetrics,
}

impl AllowKeys {
    /// Reads the list from `path`; a missing file or a bad line is an error.
    pub fn load(
        path: impl Into<PathBuf>,
        metrics: &AdmissionMetrics,
    ) -> Result<Self, AllowKeysError> {
        let path = path.into();
        let stamp = stamp(&path);
        let keys = read(&path)?;
        metrics.allow_keys.set(keys.len() as i64);
        if keys.is_empty() {
            warn!(path = %path.display(), "the allow-keys file lists no keys: no client will be admitted");
        }
        Ok(Self {
            keys: ArcSwap::from_pointee(keys),
            stamp: Mutex::new(stamp),
            path,
            metrics: metrics.clone(),
        })
    }

    /// The file the list comes from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many keys are in force.
    pub fn len(&self) -> usize {
        self.keys.load().len()
    }

    /// Whether no key is in force (nobody is admitted).
    pub fn is_empty(&self) -> bool {
        self.keys.load().is_empty()
    }

    /// Re-reads the file and puts the new list in force; on error the old list stays and
    /// the error (with the line number of a bad line) is returned and counted.
    pub fn reload(&self) -> Result<usize, AllowKeysError> {
        let stamp = stamp(&self.path);
        match read(&self.path) {
            Ok(keys) => {
                let n = keys.len();
                self.keys.store(Arc::new(keys));
                self.metrics.allow_keys.set(n as i64);
                *self.stamp.lock().unwrap_or_else(|e| e.into_inner()) = stamp;
                Ok(n)
            }
            Err(e) => {
                self.metrics.allow_keys_reload_errors.inc();
                // Remember the failed version too, so polling reports it once, not forever.
                *self.stamp.lock().unwrap_or_else(|e| e.into_inner()) = stamp;
                Err(e)
            }
        }
    }

    /// Re-reads the file if it changed since it was last read (by size, time, inode).
    /// `Ok(None)` when unchanged.
    pub fn reload_if_changed(&self) -> Result<Option<usize>, AllowKeysError> {
        let now = stamp(&self.path);
        let last = *self.stamp.lock().unwrap_or_else(|e| e.into_inner());
        // A file still missing is unchanged too: reported once, when it went.
        if now == last {
            return Ok(None);
        }
        self.reload().map(Some)
    }

    /// Checks the file for changes every `every` until `shutdown`, logging what happens.
    pub async fn watch(self: Arc<Self>, every: Duration, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.reload_and_log("changed");
        }
    }

    /// Re-reads the file now (for SIGHUP) and logs the outcome.
    pub fn reload_and_log(&self, why: &str) {
        let result = if why == "changed" {
            self.reload_if_changed()
        } else {
            self.reload().map(Some)
        };
        match result {
            Ok(None) => {}
            Ok(Some(n)) => {
                info!(path = %self.path.display(), keys = n, why, "allow-keys file loaded")
            }
            Err(e) => {
                warn!(error = %e, why, "allow-keys file not loaded; the previous list stays in force")
            }
        }
    }
}

impl Admission for AllowKeys {
    fn check(&self, client: AdmissionRequest) -> VerdictFuture<'_> {
        let listed = self.keys.load().contains(&client.key);
        Box::pin(async move {
            if listed {
                Ok(())
            } else {
                Err(Refused::new("not_listed", "not in the allow-keys file"))
            }
        })
    }
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime: m.mtime(),
        mtime_nsec: m.mtime_nsec(),
    })
}

fn read(path: &Path) -> Result<HashSet<PublicKey>, AllowKeysError> {
    let text = std::fs::read_to_string(path).map_err(|source| AllowKeysError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(&text).map_err(|(line, reason)| AllowKeysError::Line {
        path: path.to_owned(),
        line,
        reason,
    })
}

fn parse(text: &str) -> Result<HashSet<PublicKey>, (usize, String)> {
    let mut keys = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let key: PublicKey = line.parse().map_err(|_| {
            let shown: String = line.chars().take(80).collect();
            (i + 1, format!("not a node key: {shown:?}"))
        })?;
        keys.insert(key);
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "nodekey:1111111111111111111111111111111111111111111111111111111111111111";
    const K2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn keys_comments_and_blank_lines() {
        let keys = parse(&format!("# staff\n{K1}\n\n  {K2}  # laptop\n")).expect("parses");
        assert_eq!(keys.len(), 2);
        assert!(keys.contains(&PublicKey::from_bytes([0x11; 32])));
        assert!(keys.contains(&PublicKey::from_bytes([0x22; 32])));
        assert_eq!(parse("").expect("empty").len(), 0);
    }

    #[test]
    fn a_file_that_went_missing_is_reported_once_and_read_again_when_back() {
        let dir = std::env::temp_dir().join(format!("derp-allow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("allow.txt");
        std::fs::write(&path, format!("{K1}\n")).expect("write");
        let metrics = AdmissionMetrics::register(&prometheus::Registry::new()).expect("metrics");
        let allow = AllowKeys::load(&path, &metrics).expect("load");
        std::fs::remove_file(&path).expect("remove");
        assert!(allow.reload_if_changed().is_err());
        assert_eq!(allow.reload_if_changed().expect("unchanged"), None);
        assert_eq!(metrics.allow_keys_reload_errors.get(), 1);
        assert_eq!(allow.len(), 1, "the old list stays in force");
        std::fs::write(&path, format!("{K1}\n{K2}\n")).expect("write");
        assert_eq!(allow.reload_if_changed().expect("back"), Some(2));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_bad_line_is_named_by_number() {
        let err = parse(&format!("{K1}\n# ok\nnodekey:12\n")).expect_err("bad");
        assert_eq!(err.0, 3);
        assert!(err.1.contains("nodekey:12"), "{}", err.1);
        assert_eq!(parse("privkey:00").expect_err("bad").0, 1);
    }
}
