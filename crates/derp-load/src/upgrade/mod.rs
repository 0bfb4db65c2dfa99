//! Pairs carrying a trickle of timestamped packets through a server's upgrade in place, and
//! the server process the upgrade is asked of.
//!
//! Each pair is two connections, the sender writing to the receiver's key one packet every
//! interval; the pairs' send instants are spread evenly over the interval, so the whole fleet
//! sends at a steady rate and some pair sends every `interval / pairs`. Sender and receiver
//! are in this process, so one clock stamps the send and the arrival. Every connection's
//! reading half is watched: a Restarting or health frame, a ServerInfo after the handshake, a
//! PeerGone, an EOF or an error marks the connection as broken. The clients never reconnect,
//! so a connection that would need a new handshake shows as its EOF or reset.
//!
//! What is made of the records (delays, gaps, loss, duplicates, order) is [`account`]'s.

pub mod account;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use derp_client::{Client, ClientError, ClientReader, ClientWriter, ReceivedFrame};
use derp_proto::PublicKey;
use derp_server::ExitWatch;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use crate::connections::{ConnectionShare, Opening};
use crate::measure::Clock;
use crate::packet::{HEADER_LEN, Header, Kind};
use crate::target::Target;

pub use account::{Account, Arrival, PairRecord, PhaseFigures, Phases};

/// Once the senders stop, stop waiting for packets after this long without one...
const DRAIN_IDLE: Duration = Duration::from_millis(500);
/// ...or after this long in all.
const DRAIN_MAX: Duration = Duration::from_secs(5);

/// Connected pairs, not sending yet.
#[derive(Debug)]
pub struct TricklePairs {
    pairs: Vec<Connected>,
}

#[derive(Debug)]
struct Connected {
    dst: PublicKey,
    sender: Client,
    receiver: Client,
}

/// How the pairs send.
#[derive(Clone, Copy, Debug)]
pub struct TrickleSpec {
    /// The run id packets carry.
    pub run: u32,
    /// Packet size (at least the header's).
    pub size: usize,
    /// Each pair sends one packet this often.
    pub interval: Duration,
    /// When the first pair sends its first packet.
    pub start: Instant,
}

impl TricklePairs {
    /// Opens `pairs` pairs, `concurrency` connections opening at once; fails unless every
    /// connection opens, saying how many did not and why.
    pub async fn connect(
        target: &Target,
        pairs: u32,
        concurrency: u32,
    ) -> Result<Self, UpgradeError> {
        let n = pairs * 2;
        let opening = Opening::prepare(target, ConnectionShare::all(n, concurrency));
        let keys = opening.public_keys();
        let (clients, failures) = opening.open().await;
        if !failures.is_empty() {
            return Err(UpgradeError::Open {
                failed: failures.values().sum(),
                asked: u64::from(n),
                kinds: failures.keys().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        // Every connection opened, so the clients are in the keys' order.
        let mut it = clients.into_iter().zip(keys);
        let mut out = Vec::with_capacity(pairs as usize);
        while let (Some((sender, _)), Some((receiver, dst))) = (it.next(), it.next()) {
            out.push(Connected {
                dst,
                sender,
                receiver,
            });
        }
        Ok(Self { pairs: out })
    }

    /// Pairs connected.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Starts every pair's sender and both connections' readers.
    pub fn start(self, spec: TrickleSpec, clock: Clock) -> Running {
        let (stop_send, send_rx) = watch::channel(false);
        let (stop_read, read_rx) = watch::channel(false);
        let count = self.pairs.len().max(1) as u32;
        let mut pairs = Vec::with_capacity(self.pairs.len());
        for (i, p) in self.pairs.into_iter().enumerate() {
            let pair = i as u32;
            let progress = Arc::new(PairProgress::default());
            let (sreader, swriter) = p.sender.split();
            let (rreader, rwriter) = p.receiver.split();
            // Pair i sends at i/count of the interval, so the fleet's sends are spread evenly.
            let phase = spec.interval * pair / count;
            let send = SendJob {
                run: spec.run,
                pair,
                size: spec.size.max(HEADER_LEN),
                interval: spec.interval,
                first: spec.start + phase,
                dst: p.dst,
            };
            pairs.push(RunningPair {
                sender: tokio::spawn(send_loop(
                    swriter,
                    send,
                    clock,
                    progress.clone(),
                    send_rx.clone(),
                )),
                watcher: tokio::spawn(watch_loop(sreader, clock, read_rx.clone())),
                receiver: tokio::spawn(receive_loop(
                    rreader,
                    (spec.run, pair),
                    clock,
                    progress.clone(),
                    read_rx.clone(),
                )),
                receiver_writer: rwriter,
                progress,
            });
        }
        Running {
            pairs,
            stop_send,
            stop_read,
        }
    }
}

/// Pairs sending.
#[derive(Debug)]
pub struct Running {
    pairs: Vec<RunningPair>,
    stop_send: watch::Sender<bool>,
    stop_read: watch::Sender<bool>,
}

#[derive(Debug)]
struct RunningPair {
    sender: JoinHandle<SendDone>,
    watcher: JoinHandle<Breaks>,
    receiver: JoinHandle<(Vec<Arrival>, Breaks)>,
    /// Unused, but dropping a writer half shuts the socket's sending side down, which the
    /// server takes as the client leaving: kept until the readers stop.
    receiver_writer: ClientWriter,
    progress: Arc<PairProgress>,
}

#[derive(Debug, Default)]
struct PairProgress {
    sent: AtomicU64,
    /// Distinct packets of the pair's that arrived.
    received: AtomicU64,
}

impl Running {
    /// Stops the senders, waits for what they sent (until every pair has it all, nothing
    /// arrives for a while, or a bound), then stops the readers; every pair's record.
    pub async fn finish(self) -> Vec<PairRecord> {
        let _ = self.stop_send.send(true);
        let mut sent = Vec::with_capacity(self.pairs.len());
        let mut writers = Vec::with_capacity(self.pairs.len());
        let mut rest = Vec::with_capacity(self.pairs.len());
        for p in self.pairs {
            let done = p.sender.await.unwrap_or_else(|e| SendDone {
                writer: None,
                sent_ns: Vec::new(),
                error: Some((u64::MAX, format!("task: {e}"))),
            });
            writers.push(done.writer);
            sent.push((done.sent_ns, done.error));
            rest.push((p.watcher, p.receiver, p.receiver_writer, p.progress));
        }
        drain(rest.iter().map(|r| &r.3)).await;
        let _ = self.stop_read.send(true);
        let mut records = Vec::with_capacity(rest.len());
        for ((watcher, receiver, _writer, _), (sent_ns, send_error)) in rest.into_iter().zip(sent) {
            let mut sender_breaks = watcher.await.unwrap_or_else(|e| Breaks::task(&e));
            if let Some((at, e)) = send_error {
                sender_breaks.note("write_error", at, e);
            }
            let (arrivals, receiver_breaks) = receiver
                .await
                .unwrap_or_else(|e| (Vec::new(), Breaks::task(&e)));
            records.push(PairRecord {
                sent_ns,
                arrivals,
                sender_breaks: sender_breaks.kinds,
                receiver_breaks: receiver_breaks.kinds,
                first_break: [sender_breaks.first, receiver_breaks.first],
            });
        }
        // The connections close only now, after every reader has stopped.
        drop(writers);
        records
    }
}

/// Waits until every pair has received what it sent, or nothing has arrived for
/// [`DRAIN_IDLE`], or [`DRAIN_MAX`] has passed.
async fn drain<'a>(progress: impl Iterator<Item = &'a Arc<PairProgress>> + Clone) {
    crate::fleet::drain_until(DRAIN_IDLE, DRAIN_MAX, || {
        progress.clone().fold((false, 0), |(missing, total), p| {
            let received = p.received.load(Ordering::Relaxed);
            (
                missing || received < p.sent.load(Ordering::Relaxed),
                total + received,
            )
        })
    })
    .await;
}

/// What broke a connection: each kind seen once, the first with its time and words.
#[derive(Debug, Default)]
struct Breaks {
    kinds: Vec<&'static str>,
    first: Option<(u64, String)>,
}

impl Breaks {
    /// Notes a break at `at_ns` (`u64::MAX`: unknown); the earliest is kept in words.
    fn note(&mut self, kind: &'static str, at_ns: u64, what: String) {
        if !self.kinds.contains(&kind) {
            self.kinds.push(kind);
        }
        if self.first.as_ref().is_none_or(|(first, _)| at_ns < *first) {
            self.first = Some((at_ns, what));
        }
    }

    fn task(e: &tokio::task::JoinError) -> Self {
        let mut b = Self::default();
        b.note("task", u64::MAX, e.to_string());
        b
    }
}

/// The kind of break a frame is, if it is one: whatever a client of a relay that is only
/// being upgraded should never see.
fn frame_break(frame: &ReceivedFrame) -> Option<&'static str> {
    match frame {
        ReceivedFrame::Restarting { .. } => Some("restarting"),
        ReceivedFrame::Health { .. } => Some("health"),
        ReceivedFrame::ServerInfo(_) => Some("server_info"),
        ReceivedFrame::PeerGone { .. } => Some("peer_gone"),
        ReceivedFrame::RecvPacket { .. }
        | ReceivedFrame::PeerPresent { .. }
        | ReceivedFrame::KeepAlive
        | ReceivedFrame::Ping(_)
        | ReceivedFrame::Pong(_)
        | ReceivedFrame::ObservedAddr(_) => None,
    }
}

/// The kind of break an error on a connection is.
fn error_break(e: &ClientError) -> &'static str {
    match e {
        ClientError::Closed => "eof",
        ClientError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionReset => "reset",
        ClientError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => "eof",
        ClientError::Io(_) => "io_error",
        ClientError::ReadTimeout(_) => "read_timeout",
        _ => "protocol_error",
    }
}

#[derive(Debug)]
struct SendJob {
    run: u32,
    pair: u32,
    size: usize,
    interval: Duration,
    first: Instant,
    dst: PublicKey,
}

#[derive(Debug)]
struct SendDone {
    /// Kept open until the readers are done.
    writer: Option<ClientWriter>,
    /// Each packet's send time, by sequence number.
    sent_ns: Vec<u64>,
    /// When a write failed, and how.
    error: Option<(u64, String)>,
}

async fn send_loop(
    mut writer: ClientWriter,
    job: SendJob,
    clock: Clock,
    progress: Arc<PairProgress>,
    mut stop: watch::Receiver<bool>,
) -> SendDone {
    let mut buf = vec![0u8; job.size];
    let mut sent_ns = Vec::new();
    let mut tick = tokio::time::interval_at(job.first, job.interval);
    // A sender held up (the bench's own CPU) keeps to its grid rather than bursting.
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            _ = tick.tick() => {}
        }
        let now_ns = clock.ns(Instant::now());
        Header {
            run: job.run,
            pair: job.pair,
            kind: Kind::Probe,
            seq: sent_ns.len() as u64,
            sent_ns: now_ns,
        }
        .write(&mut buf);
        if let Err(e) = writer.send_packet(job.dst, &buf).await {
            return SendDone {
                writer: Some(writer),
                sent_ns,
                error: Some((
                    clock.ns(Instant::now()),
                    format!("write: {} ({e})", error_break(&e)),
                )),
            };
        }
        sent_ns.push(now_ns);
        progress.sent.store(sent_ns.len() as u64, Ordering::Relaxed);
    }
    SendDone {
        writer: Some(writer),
        sent_ns,
        error: None,
    }
}

/// The sending connection's reading half: it should hear nothing but keepalives.
async fn watch_loop(
    mut reader: ClientReader,
    clock: Clock,
    mut stop: watch::Receiver<bool>,
) -> Breaks {
    let mut breaks = Breaks::default();
    loop {
        let frame = tokio::select! {
            biased;
            _ = stop.changed() => return breaks,
            f = reader.recv() => f,
        };
        let at = clock.ns(Instant::now());
        match frame {
            Ok(f) => {
                if let Some(kind) = frame_break(&f) {
                    breaks.note(kind, at, format!("{f:?}"));
                }
            }
            Err(e) => {
                breaks.note(error_break(&e), at, e.to_string());
                return breaks;
            }
        }
    }
}

async fn receive_loop(
    mut reader: ClientReader,
    (run, pair): (u32, u32),
    clock: Clock,
    progress: Arc<PairProgress>,
    mut stop: watch::Receiver<bool>,
) -> (Vec<Arrival>, Breaks) {
    let mut arrivals = Vec::new();
    let mut seen = account::SeqSet::default();
    let mut breaks = Breaks::default();
    loop {
        let frame = tokio::select! {
            biased;
            _ = stop.changed() => break,
            f = reader.recv() => f,
        };
        let recv_ns = clock.ns(Instant::now());
        match frame {
            Ok(ReceivedFrame::RecvPacket { packet, .. }) => {
                let Some(h) = Header::read(&packet) else {
                    continue;
                };
                if h.run != run || h.pair != pair || h.kind != Kind::Probe {
                    continue;
                }
                arrivals.push(Arrival {
                    seq: h.seq,
                    sent_ns: h.sent_ns,
                    recv_ns,
                });
                if seen.insert(h.seq) {
                    progress.received.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(f) => {
                if let Some(kind) = frame_break(&f) {
                    breaks.note(kind, recv_ns, format!("{f:?}"));
                }
            }
            Err(e) => {
                breaks.note(error_break(&e), recv_ns, e.to_string());
                break;
            }
        }
    }
    (arrivals, breaks)
}

/// The server process asked to upgrade: SIGUSR2 to it, then its exit awaited. Through a
/// pidfd where the kernel has them, so the signal cannot reach another process that took
/// the number, and the exit itself wakes the wait; else by the number and `/proc`, in short
/// steps.
#[derive(Debug)]
pub struct Upgradee(Arc<ExitWatch>);

impl Upgradee {
    /// The process `pid`, which must exist.
    pub fn open(pid: u32) -> Result<Self, UpgradeError> {
        match ExitWatch::open(pid) {
            Some(watch) if !watch.exited() => Ok(Self(Arc::new(watch))),
            _ => Err(UpgradeError::NoProcess { pid }),
        }
    }

    /// Asks it to upgrade in place.
    pub fn signal(&self) -> Result<(), UpgradeError> {
        self.0
            .signal(rustix::process::Signal::USR2)
            .map_err(|source| UpgradeError::Signal {
                pid: self.0.pid(),
                source,
            })
    }

    /// Waits up to `within` for it to exit; whether it did.
    pub async fn exited(&self, within: Duration) -> bool {
        // A blocking wait on its own thread: tokio registers no pidfd without `unsafe`.
        let watch = self.0.clone();
        tokio::task::spawn_blocking(move || watch.wait(within))
            .await
            .unwrap_or(false)
    }
}

/// Why the pairs or the upgrade could not be run.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// Not every connection opened.
    #[error("{failed} of {asked} connections failed to open ({kinds})")]
    Open {
        /// Connections that failed.
        failed: u64,
        /// Connections asked for.
        asked: u64,
        /// Their failures' kinds.
        kinds: String,
    },
    /// No such process to upgrade.
    #[error("no process {pid} to upgrade")]
    NoProcess {
        /// The number given.
        pid: u32,
    },
    /// The signal could not be sent.
    #[error("sending SIGUSR2 to process {pid}")]
    Signal {
        /// The process.
        pid: u32,
        /// Why.
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_an_upgrade_must_never_show_a_client_is_a_break() {
        let restarting = ReceivedFrame::Restarting {
            reconnect_in: Duration::from_secs(2),
            try_for: Duration::from_secs(60),
        };
        assert_eq!(frame_break(&restarting), Some("restarting"));
        let health = ReceivedFrame::Health {
            problem: String::new(),
        };
        assert_eq!(frame_break(&health), Some("health"));
        assert_eq!(frame_break(&ReceivedFrame::KeepAlive), None);
        assert_eq!(error_break(&ClientError::Closed), "eof");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(error_break(&reset.into()), "reset");
        assert_eq!(
            error_break(&ClientError::ReadTimeout(Duration::from_secs(1))),
            "read_timeout"
        );
    }

    #[test]
    fn the_earliest_break_is_the_one_described() {
        let mut b = Breaks::default();
        b.note("eof", 20, "eof".to_owned());
        b.note("write_error", 10, "write".to_owned());
        b.note("restarting", 15, "restarting".to_owned());
        b.note("eof", 5, "again".to_owned());
        assert_eq!(b.kinds, ["eof", "write_error", "restarting"]);
        assert_eq!(b.first, Some((5, "again".to_owned())));
    }
}
