//! Closed-loop pairs for `pingpong`: A sends a timestamped packet to B through the relay, B
//! echoes it the moment it reads it, A times the round trip and sends the next one, keeping
//! `in_flight` packets outstanding.
//!
//! The client side bounds what can be measured, so it is kept lean: each side of each pair
//! has its own OS thread, with either a current-thread tokio runtime driving a
//! [`derp_client`] connection (`--client tokio`: every URL scheme) or a blocking socket
//! speaking DERP directly ([`derp_testkit::raw::BlockingClient`], `--client blocking`: plain
//! http:// only).
//! Neither side shares a runtime, a lock or a queue with anything else; TCP_NODELAY is on,
//! and each packet leaves in its own write as soon as it is made.

mod blocking_client;
mod tokio_client;

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use clap::ValueEnum;
use derp_client::{ClientError, ConnectError, Scheme, ServerUrl};
use derp_proto::frame::{FRAME_HEADER_LEN, KEY_LEN};
use derp_proto::{PublicKey, SecretKey};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::measure::{Clock, RttHistogram, new_histogram};
use crate::packet::{Header, Kind};
use crate::report::error_text;
use crate::target::{Target, describe_connect_error};

use self::blocking_client::{blocking_echo, blocking_sender};
use self::tokio_client::{tokio_echo, tokio_sender};

/// A sender that hears nothing back for this long gives its outstanding packets up as lost
/// and starts again with new ones.
pub const STALL: Duration = Duration::from_secs(2);
/// The blocking client writes and reads on one thread, so everything in flight must fit in
/// the sockets' buffers or both ends could wait on each other's writes.
const BLOCKING_MAX_IN_FLIGHT_BYTES: usize = 64 << 10;
/// RecvPacket and SendPacket frames: header and key before the packet.
const PACKET_FRAME_HEAD: usize = FRAME_HEADER_LEN + KEY_LEN;

/// Which client the closed loop runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum ClientKind {
    /// derp-client on a current-thread runtime per side; every URL scheme.
    Tokio,
    /// A blocking socket speaking DERP itself; plain http:// only.
    Blocking,
}

impl ClientKind {
    /// The flag's value, for the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tokio => "tokio",
            Self::Blocking => "blocking",
        }
    }
}

/// What each pair does.
#[derive(Clone, Copy, Debug)]
pub struct LoopSpec {
    /// Packet size in bytes.
    pub size: usize,
    /// Packets each pair keeps outstanding.
    pub in_flight: u32,
    /// The client each side runs on.
    pub client: ClientKind,
}

impl LoopSpec {
    /// Refuses combinations the client cannot do.
    pub fn check(&self, target: &Target) -> Result<(), LoopError> {
        if self.client == ClientKind::Blocking {
            let plain = |s: Scheme| s == Scheme::Http;
            if !plain(target.url.scheme())
                || target.peer_url.as_ref().is_some_and(|p| !plain(p.scheme()))
                || target.probe_first()
            {
                return Err(LoopError::BlockingNeedsHttp);
            }
            let bytes = self.in_flight as usize * (self.size + PACKET_FRAME_HEAD);
            if bytes > BLOCKING_MAX_IN_FLIGHT_BYTES {
                return Err(LoopError::BlockingInFlight);
            }
        }
        Ok(())
    }
}

/// One measured window, in the bench's clock.
#[derive(Clone, Copy, Debug)]
pub struct LoopWindow {
    /// The run id packets carry.
    pub run: u32,
    /// When the warm-up starts.
    pub start: Instant,
    /// When the measured window starts.
    pub warm_end: Instant,
    /// When it ends.
    pub end: Instant,
}

/// What one pair did in a window. Round trips count when their packet left inside the
/// window.
#[derive(Debug)]
pub struct LoopResult {
    /// The pair's number.
    pub pair: u32,
    /// Packets sent in the window.
    pub sent: u64,
    /// Of those, packets that came back.
    pub round_trips: u64,
    /// Packets given up after [`STALL`] without an answer (any time in the run).
    pub lost: u64,
    /// Round trips of the packets sent in the window, nanoseconds.
    pub rtt: RttHistogram,
    /// What stopped the pair, if anything did.
    pub error: Option<String>,
}

impl LoopResult {
    fn new(pair: u32) -> Self {
        Self {
            pair,
            sent: 0,
            round_trips: 0,
            lost: 0,
            rtt: new_histogram(),
            error: None,
        }
    }

    fn failed(pair: u32, error: &SideError) -> Self {
        Self {
            error: Some(error_text(error)),
            ..Self::new(pair)
        }
    }
}

type Command = (LoopWindow, oneshot::Sender<LoopResult>);

#[derive(Debug)]
enum EchoStop {
    Signal(watch::Sender<bool>),
    Socket(TcpStream),
}

#[derive(Debug)]
struct LoopPair {
    id: u32,
    commands: Option<mpsc::Sender<Command>>,
    sender: Option<JoinHandle<()>>,
    echo_stop: EchoStop,
    echo_stopping: Arc<AtomicBool>,
    echo: Option<JoinHandle<()>>,
    echo_error: Arc<Mutex<Option<SideError>>>,
}

/// Connected closed-loop pairs, reused across windows.
#[derive(Debug)]
pub struct LoopPairs {
    pairs: Vec<LoopPair>,
}

impl Drop for LoopPairs {
    fn drop(&mut self) {
        for p in &mut self.pairs {
            // The sender's thread ends when its command channel closes; the echo's when told.
            p.commands = None;
            p.echo_stopping.store(true, Ordering::Relaxed);
            match &p.echo_stop {
                EchoStop::Signal(tx) => {
                    let _ = tx.send(true);
                }
                EchoStop::Socket(s) => {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        for p in &mut self.pairs {
            for t in [p.sender.take(), p.echo.take()].into_iter().flatten() {
                let _ = t.join();
            }
        }
    }
}

impl LoopPairs {
    /// Connects `pairs` pairs numbered from `first_pair`: the echoing sides first, then the
    /// senders.
    pub async fn connect(
        target: &Target,
        spec: LoopSpec,
        first_pair: u32,
        pairs: u32,
        clock: Clock,
    ) -> Result<Self, LoopError> {
        spec.check(target)?;
        let mut echoes = Vec::new();
        for i in 0..pairs {
            let secret = SecretKey::generate(&mut rand::rngs::OsRng);
            let public = secret.public_key();
            let config = target.peer_client_config(secret.clone(), None);
            let stopping = Arc::new(AtomicBool::new(false));
            let error = Arc::new(Mutex::new(None));
            let (ready_tx, ready_rx) = oneshot::channel();
            let (stop_tx, stop_rx) = watch::channel(false);
            let thread = {
                let (stopping, error) = (stopping.clone(), error.clone());
                let timeout = target.connect_timeout;
                spawn(&format!("echo {}", first_pair + i), move || {
                    match spec.client {
                        ClientKind::Tokio => tokio_echo(config, ready_tx, stop_rx, error),
                        ClientKind::Blocking => {
                            blocking_echo(config, secret, timeout, ready_tx, stopping, error)
                        }
                    }
                })?
            };
            echoes.push((public, stopping, error, thread, stop_tx, ready_rx));
        }
        let mut out = Vec::new();
        let mut failure = None;
        for (i, (public, stopping, error, thread, stop_tx, ready_rx)) in
            echoes.into_iter().enumerate()
        {
            let echo_stop = match ready_rx.await {
                Ok(Ok(Some(socket))) => EchoStop::Socket(socket),
                Ok(Ok(None)) => EchoStop::Signal(stop_tx),
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                    EchoStop::Signal(stop_tx)
                }
                Err(_) => {
                    failure.get_or_insert(SideError::Gone("an echo"));
                    EchoStop::Signal(stop_tx)
                }
            };
            out.push((
                first_pair + i as u32,
                public,
                stopping,
                error,
                thread,
                echo_stop,
            ));
        }
        // Built before checking for failures, so that dropping it stops every thread.
        let mut built = Self { pairs: Vec::new() };
        let mut senders = Vec::new();
        for (id, dst, stopping, error, thread, echo_stop) in out {
            let (cmd_tx, cmd_rx) = mpsc::channel::<Command>();
            let (ready_tx, ready_rx) = oneshot::channel();
            let sender = if failure.is_none() {
                let secret = SecretKey::generate(&mut rand::rngs::OsRng);
                let config = target.client_config(secret.clone(), None);
                let timeout = target.connect_timeout;
                Some(spawn(&format!("sender {id}"), move || {
                    let setup = Setup {
                        dst,
                        pair: id,
                        spec,
                        clock,
                        ready: ready_tx,
                        commands: cmd_rx,
                    };
                    match spec.client {
                        ClientKind::Tokio => tokio_sender(config, setup),
                        ClientKind::Blocking => blocking_sender(config, secret, timeout, setup),
                    }
                })?)
            } else {
                None
            };
            if sender.is_some() {
                senders.push(ready_rx);
            }
            built.pairs.push(LoopPair {
                id,
                commands: Some(cmd_tx),
                sender,
                echo_stop,
                echo_stopping: stopping,
                echo: Some(thread),
                echo_error: error,
            });
        }
        for ready in senders {
            match ready.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                }
                Err(_) => {
                    failure.get_or_insert(SideError::Gone("a sender"));
                }
            }
        }
        if let Some(source) = failure {
            return Err(LoopError::Connect {
                url: target.url.clone(),
                source,
            });
        }
        Ok(built)
    }

    /// Runs one window on every pair; one result per pair.
    pub async fn run_window(&mut self, window: LoopWindow) -> Vec<LoopResult> {
        let mut waiting = Vec::new();
        for p in &self.pairs {
            let (tx, rx) = oneshot::channel();
            let sent = p
                .commands
                .as_ref()
                .is_some_and(|c| c.send((window, tx)).is_ok());
            waiting.push((p, sent.then_some(rx)));
        }
        let mut out = Vec::new();
        for (p, rx) in waiting {
            let mut result = match rx {
                Some(rx) => rx
                    .await
                    .unwrap_or_else(|_| LoopResult::failed(p.id, &SideError::Gone("the sender's"))),
                None => LoopResult::failed(p.id, &SideError::EarlierRun),
            };
            if let Some(e) = p
                .echo_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                let e = format!("echo: {}", error_text(e));
                result.error = Some(match result.error.take() {
                    Some(s) => format!("{s}; {e}"),
                    None => e,
                });
            }
            out.push(result);
        }
        out
    }
}

fn spawn(what: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, LoopError> {
    std::thread::Builder::new()
        .name("derp-bench-loop".into())
        .spawn(f)
        .map_err(|source| LoopError::Thread {
            what: what.to_owned(),
            source,
        })
}

/// What a sender's thread starts with.
struct Setup {
    dst: PublicKey,
    pair: u32,
    spec: LoopSpec,
    clock: Clock,
    ready: oneshot::Sender<Result<(), SideError>>,
    commands: mpsc::Receiver<Command>,
}

/// The sender's book-keeping within one window.
struct Books {
    clock: Clock,
    result: LoopResult,
    run: u32,
    window_ns: (u64, u64),
    seq: u64,
    /// Packets with a lower sequence number were given up; their late echoes are ignored.
    floor: u64,
    outstanding: u32,
    last_progress: Instant,
}

impl Books {
    fn new(pair: u32, window: &LoopWindow, clock: Clock) -> Self {
        Self {
            clock,
            result: LoopResult::new(pair),
            run: window.run,
            window_ns: (clock.ns(window.warm_end), clock.ns(window.end)),
            seq: 0,
            floor: 0,
            outstanding: 0,
            last_progress: Instant::now(),
        }
    }

    fn in_window(&self, ns: u64) -> bool {
        ns >= self.window_ns.0 && ns < self.window_ns.1
    }

    /// Stamps the next packet into `buf` and counts it.
    fn stamp(&mut self, buf: &mut [u8]) {
        let sent_ns = self.clock.ns(Instant::now());
        Header {
            run: self.run,
            pair: self.result.pair,
            kind: Kind::Probe,
            seq: self.seq,
            sent_ns,
        }
        .write(buf);
        self.seq += 1;
        self.outstanding += 1;
        if self.in_window(sent_ns) {
            self.result.sent += 1;
        }
    }

    /// Times an echo, if it is one of this window's.
    fn echoed(&mut self, packet: &[u8]) {
        let now = Instant::now();
        let Some(h) = Header::read(packet) else {
            return;
        };
        if h.run != self.run
            || h.pair != self.result.pair
            || h.kind != Kind::Probe
            || h.seq < self.floor
        {
            return;
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        self.last_progress = now;
        if self.in_window(h.sent_ns) {
            let rtt = self.clock.ns(now).saturating_sub(h.sent_ns).max(1);
            self.result.rtt.saturating_record(rtt);
            self.result.round_trips += 1;
        }
    }

    /// Nothing came back for [`STALL`]: what is outstanding is lost.
    fn stalled(&mut self) {
        self.result.lost += u64::from(self.outstanding);
        self.outstanding = 0;
        self.floor = self.seq;
        self.last_progress = Instant::now();
    }
}

/// Why closed-loop pairs could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    /// `--client blocking` with a TLS, WebSocket or QUIC target, or `--probe-first`.
    #[error(
        "--client blocking speaks plain http:// only, upgrading at once; use --client tokio for \
         TLS, WebSocket, QUIC and --probe-first"
    )]
    BlockingNeedsHttp,
    /// `--client blocking` with more in flight than the sockets' buffers hold.
    #[error(
        "--client blocking keeps at most {} KiB in flight (--in-flight x --size); use --client \
         tokio for more",
        BLOCKING_MAX_IN_FLIGHT_BYTES >> 10
    )]
    BlockingInFlight,
    /// No thread for a side.
    #[error("starting the thread of pingpong {what}")]
    Thread {
        /// Which side of which pair.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// A side failed to connect.
    #[error("connecting pingpong pairs to {url}")]
    Connect {
        /// The server.
        url: ServerUrl,
        /// The first side that failed, and how.
        source: SideError,
    },
}

/// What stopped one side of a pair.
#[derive(Debug, thiserror::Error)]
pub enum SideError {
    /// Its runtime.
    #[error("starting a runtime")]
    Runtime(#[source] std::io::Error),
    /// Its connection, with derp-client.
    #[error("{}", describe_connect_error(.0))]
    Connect(ConnectError),
    /// The target's host, for the blocking client.
    #[error("resolving {host}: {source}")]
    Resolve {
        /// The host name resolved.
        host: String,
        /// Why it gave no address.
        #[source]
        source: std::io::Error,
    },
    /// Its connection, with the blocking client.
    #[error("connecting to {addr}: {source}")]
    RawConnect {
        /// The address dialled.
        addr: std::net::SocketAddr,
        /// What failed.
        #[source]
        source: derp_testkit::raw::ConnectError,
    },
    /// The connection, once up.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The blocking client's socket.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The side's thread ended without a word.
    #[error("{0} thread stopped")]
    Gone(&'static str),
    /// The sender failed in an earlier window and is not coming back.
    #[error("the sender failed in an earlier run")]
    EarlierRun,
}
