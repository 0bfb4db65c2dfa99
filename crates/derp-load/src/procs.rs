//! Several bench processes as one load generator (`--procs N`): the parent starts N copies
//! of itself as workers and talks to each over its stdin and stdout, one JSON document per
//! line.
//!
//! The parent sends a job (its share of the pairs or connections), waits until every worker
//! has connected, then sends commands that carry a common start time as Unix nanoseconds, so
//! every worker's window opens at the same instant; each worker answers with its own figures
//! and the parent merges them. This module is only the plumbing: processes, lines and
//! clocks. What the lines mean is up to the modes.
//!
//! A worker whose parent goes away sees its stdin close and exits; the parent kills the
//! workers it started when it is done with them, or when it fails.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The hidden subcommand a worker runs.
pub const WORKER_SUBCOMMAND: &str = "worker";

/// How far ahead of "now" a common start time is set, so every worker has the command
/// before the moment comes.
pub const START_LEAD: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::UnboundedReceiver<String>,
}

/// The worker processes of one run.
#[derive(Debug)]
pub struct Workers {
    workers: Vec<Worker>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.workers {
            // Closing stdin asks a worker to leave; the kill makes sure it does.
            w.stdin = None;
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

impl Workers {
    /// Starts one worker per job and waits (up to `timeout`) until each has answered the
    /// job with `ready` of type `R`.
    pub async fn start<J: Serialize, R: DeserializeOwned>(
        jobs: &[J],
        timeout: Duration,
    ) -> Result<(Self, Vec<R>), ProcsError> {
        let exe = std::env::current_exe().map_err(ProcsError::OwnExe)?;
        let mut workers = Self {
            workers: Vec::new(),
        };
        for (i, job) in jobs.iter().enumerate() {
            let mut child = Command::new(&exe)
                .arg(WORKER_SUBCOMMAND)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|source| ProcsError::Start { index: i, source })?;
            let stdout = child.stdout.take().ok_or(ProcsError::NoStdout(i))?;
            let (tx, lines) = mpsc::unbounded_channel();
            std::thread::Builder::new()
                .name("derp-bench-procs".into())
                .spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { return };
                        if tx.send(line).is_err() {
                            return;
                        }
                    }
                })
                .map_err(ProcsError::Thread)?;
            let stdin = child.stdin.take();
            workers.workers.push(Worker {
                child,
                stdin,
                lines,
            });
            workers.send(i, job)?;
        }
        let ready = workers.recv_all(timeout).await?;
        Ok((workers, ready))
    }

    /// Sends worker `i` one message.
    pub fn send<C: Serialize>(&mut self, i: usize, msg: &C) -> Result<(), ProcsError> {
        let mut line = serde_json::to_vec(msg).map_err(ProcsError::Encode)?;
        line.push(b'\n');
        let w = &mut self.workers[i];
        let stdin = w.stdin.as_mut().ok_or(ProcsError::Closed(i))?;
        stdin
            .write_all(&line)
            .and_then(|()| stdin.flush())
            .map_err(|source| ProcsError::Write { index: i, source })
    }

    /// Sends every worker the same message.
    pub fn send_all<C: Serialize>(&mut self, msg: &C) -> Result<(), ProcsError> {
        for i in 0..self.workers.len() {
            self.send(i, msg)?;
        }
        Ok(())
    }

    /// One answer from every worker, in worker order, within `timeout` in all. A worker that
    /// reports an error, exits or says nothing in time fails the call.
    pub async fn recv_all<R: DeserializeOwned>(
        &mut self,
        timeout: Duration,
    ) -> Result<Vec<R>, ProcsError> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(self.workers.len());
        for (i, w) in self.workers.iter_mut().enumerate() {
            let line = match tokio::time::timeout_at(deadline, w.lines.recv()).await {
                Ok(Some(line)) => line,
                Ok(None) => {
                    let status = w
                        .child
                        .try_wait()
                        .ok()
                        .flatten()
                        .map_or_else(|| "closed its output".to_owned(), |s| s.to_string());
                    return Err(ProcsError::Stopped { index: i, status });
                }
                Err(_) => return Err(ProcsError::Silent { index: i, timeout }),
            };
            let answer: Result<R, RemoteError> = match serde_json::from_str(&line) {
                Ok(a) => a,
                Err(source) => {
                    return Err(ProcsError::BadLine {
                        index: i,
                        line,
                        source,
                    });
                }
            };
            out.push(answer.map_err(|source| ProcsError::Failed { index: i, source })?);
        }
        Ok(out)
    }
}

/// A worker's side of the conversation: commands from stdin, answers to stdout.
#[derive(Debug)]
pub struct Parent {
    lines: mpsc::UnboundedReceiver<String>,
}

impl Parent {
    /// Reads the job, the first line on stdin, before any runtime exists (the job says how
    /// many threads the runtime gets).
    pub fn read_job<J: DeserializeOwned>() -> Result<J, ProcsError> {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .map_err(ProcsError::ReadJob)?;
        if line.is_empty() {
            return Err(ProcsError::NoJob);
        }
        serde_json::from_str(&line).map_err(ProcsError::ParseJob)
    }

    /// Starts reading the commands that follow the job.
    pub fn listen() -> Result<Self, ProcsError> {
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("derp-bench-parent".into())
            .spawn(move || {
                for line in std::io::stdin().lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })
            .map_err(ProcsError::Thread)?;
        Ok(Self { lines })
    }

    /// The next command; `None` when the parent has closed stdin (time to leave).
    pub async fn recv<C: DeserializeOwned>(&mut self) -> Result<Option<C>, ProcsError> {
        match self.lines.recv().await {
            None => Ok(None),
            Some(line) => match serde_json::from_str(&line) {
                Ok(c) => Ok(Some(c)),
                Err(source) => Err(ProcsError::BadCommand { line, source }),
            },
        }
    }

    /// Answers the last command.
    pub fn answer<R: Serialize>(answer: &Result<R, RemoteError>) -> Result<(), ProcsError> {
        let mut line = serde_json::to_vec(answer).map_err(ProcsError::Encode)?;
        line.push(b'\n');
        let mut out = std::io::stdout().lock();
        out.write_all(&line)
            .and_then(|()| out.flush())
            .map_err(ProcsError::Answer)
    }
}

/// What went wrong in a worker, as its parent hears it: the worker's error, in words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{0}")]
pub struct RemoteError(pub String);

/// Why talking to the other processes failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcsError {
    /// The parent cannot find its own program to start workers from.
    #[error("finding the program's own executable")]
    OwnExe(#[source] std::io::Error),
    /// A worker did not start.
    #[error("starting bench process {index}")]
    Start {
        /// Which worker.
        index: usize,
        /// Why.
        source: std::io::Error,
    },
    /// A worker started without a pipe for its answers.
    #[error("bench process {0} has no stdout")]
    NoStdout(usize),
    /// No thread to read a pipe with.
    #[error("starting a thread to read a pipe")]
    Thread(#[source] std::io::Error),
    /// A message that would not encode.
    #[error("encoding a message")]
    Encode(#[source] serde_json::Error),
    /// A worker already let go.
    #[error("bench process {0} is closed")]
    Closed(usize),
    /// Writing to a worker failed.
    #[error("writing to bench process {index}")]
    Write {
        /// Which worker.
        index: usize,
        /// Why.
        source: std::io::Error,
    },
    /// A worker exited or closed its output.
    #[error("bench process {index} stopped ({status})")]
    Stopped {
        /// Which worker.
        index: usize,
        /// Its exit status, if it has one.
        status: String,
    },
    /// A worker said nothing in time.
    #[error("bench process {index} did not answer within {timeout:?}")]
    Silent {
        /// Which worker.
        index: usize,
        /// How long the parent waited.
        timeout: Duration,
    },
    /// A worker said something that is no answer.
    #[error("bench process {index} said {line:?}")]
    BadLine {
        /// Which worker.
        index: usize,
        /// What it said.
        line: String,
        /// Why that does not parse.
        source: serde_json::Error,
    },
    /// A worker reported an error.
    #[error("bench process {index}")]
    Failed {
        /// Which worker.
        index: usize,
        /// Its error.
        source: RemoteError,
    },
    /// The worker's stdin could not be read.
    #[error("reading the job")]
    ReadJob(#[source] std::io::Error),
    /// The worker's stdin was empty.
    #[error("no job on stdin: `worker` is started by derp-bench --procs, not by hand")]
    NoJob,
    /// The job does not parse.
    #[error("parsing the job")]
    ParseJob(#[source] serde_json::Error),
    /// A command does not parse.
    #[error("parsing command {line:?}")]
    BadCommand {
        /// The command line.
        line: String,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// Writing an answer to stdout failed.
    #[error("writing an answer")]
    Answer(#[source] std::io::Error),
}

/// Now, as Unix nanoseconds: the clock every process on the machine shares.
pub fn unix_ns_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The local instant of a Unix time in nanoseconds (now, if it has passed).
pub fn instant_at(unix_ns: u64) -> Instant {
    instant_from(unix_ns, unix_ns_now(), Instant::now())
}

/// The local instant of `unix_ns`, given that `now_unix_ns` is `now`.
fn instant_from(unix_ns: u64, now_unix_ns: u64, now: Instant) -> Instant {
    now + Duration::from_nanos(unix_ns.saturating_sub(now_unix_ns))
}

/// `total` split into `parts` near-equal shares, the larger ones first.
pub fn split(total: u64, parts: usize) -> Vec<u64> {
    let parts = parts.max(1) as u64;
    (0..parts)
        .map(|i| total / parts + u64::from(i < total % parts))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up() {
        assert_eq!(split(10, 3), [4, 3, 3]);
        assert_eq!(split(2, 4), [1, 1, 0, 0]);
        assert_eq!(split(0, 2), [0, 0]);
        assert_eq!(split(7, 0), [7]);
        for (total, parts) in [(1000, 7), (5, 5), (64, 3)] {
            assert_eq!(split(total, parts).iter().sum::<u64>(), total);
        }
    }

    #[test]
    fn a_start_maps_onto_the_local_clock() {
        let now = Instant::now();
        let now_unix = 1_700_000_000_000_000_000;
        // Past (or this very moment): now.
        assert_eq!(instant_from(now_unix - 1_000_000_000, now_unix, now), now);
        assert_eq!(instant_from(now_unix, now_unix, now), now);
        // Ahead: as far ahead on the local clock, to the nanosecond.
        assert_eq!(
            instant_from(now_unix + 500_000_000, now_unix, now),
            now + Duration::from_millis(500)
        );
        assert_eq!(
            instant_from(now_unix + 1, now_unix, now),
            now + Duration::from_nanos(1)
        );
    }
}
