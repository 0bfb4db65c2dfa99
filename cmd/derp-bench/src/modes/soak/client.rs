//! One soak client: a connection with its pings, the counters every client adds to, and what
//! the role tasks share.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use derp_client::{Client, ClientError, ClientReader, ClientWriter, ReceivedFrame};
use derp_load::packet::{HEADER_LEN, Header, Kind};
use derp_load::target::{ClientTemplate, SourceAddrs, connect_error_kind};
use derp_proto::{PublicKey, SecretKey};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};

/// Violations kept verbatim for the report; the rest are only counted.
const MAX_VIOLATIONS_KEPT: usize = 30;

/// What the run counts as it goes.
#[derive(Debug, Default)]
pub(super) struct Stats {
    /// SendPacket frames the clients wrote (counted once the write succeeded).
    pub(super) sent: AtomicU64,
    /// RecvPacket frames the clients read.
    pub(super) received: AtomicU64,
    pub(super) closed_sent: AtomicU64,
    pub(super) closed_echoed: AtomicU64,
    pub(super) closed_lost: AtomicU64,
    pub(super) pings: AtomicU64,
    pub(super) pongs: AtomicU64,
    /// Pings outstanding on slow readers when the server cut them off (expected).
    pub(super) pings_abandoned: AtomicU64,
    /// Pings not answered within 5 s on a connection that stayed up.
    pub(super) ping_timeouts: AtomicU64,
    pub(super) connects: AtomicU64,
    /// Slow readers the server cut off (expected: the write deadline at work).
    pub(super) slow_cut_off: AtomicU64,
    pub(super) churn_sessions: AtomicU64,
    pub(super) churn_duplicates: AtomicU64,
    pub(super) churn_abrupt: AtomicU64,
    pub(super) hostile_failed: AtomicU64,
    pub(super) violation_count: AtomicU64,
    pub(super) violations: Mutex<Vec<String>>,
    pub(super) connect_failures: Mutex<BTreeMap<String, u64>>,
    pub(super) hostile: Mutex<BTreeMap<&'static str, u64>>,
}

impl Stats {
    pub(super) fn violation(&self, what: String) {
        self.violation_count.fetch_add(1, Ordering::Relaxed);
        let mut kept = self.violations.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < MAX_VIOLATIONS_KEPT {
            kept.push(what);
        }
    }

    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// What every role task shares.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) template: ClientTemplate,
    pub(super) sources: SourceAddrs,
    /// `host:port` of the relay, for the hostile clients' raw sockets.
    pub(super) addr: String,
    /// For https:// and wss:// nodes: TLS over those sockets, checked as the clients check
    /// it, with the URL's host as SNI.
    pub(super) tls: Option<(Arc<derp_client::rustls::ClientConfig>, String)>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) stats: Stats,
    pub(super) connect_gate: Semaphore,
    /// Keys churners use most of the time; packets go to these whether their owner is
    /// connected or not.
    pub(super) churn_keys: Vec<PublicKey>,
}

/// A socket, or TLS over one.
pub(super) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

impl Shared {
    /// TLS over a connected socket for a TLS node; the socket itself otherwise.
    pub(super) async fn secure(
        &self,
        tcp: TcpStream,
    ) -> Result<Box<dyn Stream>, derp_client::ConnectError> {
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some((tls, host)) => {
                let (stream, _) = derp_client::tls::handshake(tls.clone(), host, tcp).await?;
                Ok(Box::new(stream))
            }
        }
    }

    pub(super) fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    pub(super) async fn stopped(&self) {
        let mut stop = self.stop.clone();
        let _ = stop.wait_for(|s| *s).await;
    }
}

pub(super) type PingWait = Pin<Box<dyn Future<Output = Result<Duration, ClientError>> + Send>>;

/// One client connection, driven by a single task.
pub(super) struct Conn {
    pub(super) reader: ClientReader,
    pub(super) writer: ClientWriter,
    pub(super) key: PublicKey,
    pub(super) ping: Option<PingWait>,
    pub(super) pings: u64,
    pub(super) pongs: u64,
    pub(super) ping_timeouts: u64,
}

impl Conn {
    /// Connects, retrying (and counting failures) until it works or the run stops.
    pub(super) async fn open(sh: &Shared, secret: &SecretKey, slot: usize) -> Option<Self> {
        Self::open_with(sh, secret, slot, None).await
    }

    /// Like [`Conn::open`], with the socket's receive buffer set to `rcvbuf` bytes when given
    /// (a slow reader then pushes back on the relay within a few kilobytes).
    pub(super) async fn open_with(
        sh: &Shared,
        secret: &SecretKey,
        slot: usize,
        rcvbuf: Option<u32>,
    ) -> Option<Self> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if sh.stopping() {
                return None;
            }
            let local = sh.sources.for_index(slot);
            let config = sh.template.config(secret.clone(), local);
            let result = {
                let _permit = sh.connect_gate.acquire().await.ok()?;
                match rcvbuf {
                    None => Client::connect(&config).await,
                    Some(size) => connect_small_rcvbuf(sh, &config, local, size).await,
                }
            };
            match result {
                Ok(client) => {
                    Stats::add(&sh.stats.connects, 1);
                    let (reader, writer) = client.split();
                    return Some(Self {
                        reader,
                        writer,
                        key: secret.public_key(),
                        ping: None,
                        pings: 0,
                        pongs: 0,
                        ping_timeouts: 0,
                    });
                }
                Err(e) => {
                    *sh.stats
                        .connect_failures
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(connect_error_kind(&e))
                        .or_default() += 1;
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = sh.stopped() => return None,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Waits for the outstanding ping, if any, reading meanwhile; counts its pong.
    pub(super) async fn finish_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        while self.ping.is_some() {
            tokio::select! {
                r = Self::ping_done(&mut self.ping) => self.ponged(sh, r)?,
                f = self.reader.recv() => count_frame(sh, &f?),
            }
        }
        Ok(())
    }

    /// Counts the outcome of a tracked ping.
    pub(super) fn ponged(
        &mut self,
        sh: &Shared,
        r: Result<Duration, ClientError>,
    ) -> Result<(), ClientError> {
        match r {
            Ok(_) => {
                self.pongs += 1;
                Stats::add(&sh.stats.pongs, 1);
                Ok(())
            }
            Err(e) => {
                if matches!(e, ClientError::PingTimeout) {
                    self.ping_timeouts += 1;
                    Stats::add(&sh.stats.ping_timeouts, 1);
                }
                Err(e)
            }
        }
    }

    /// Pings of this connection that were never answered, for a connection whose loss is
    /// expected.
    pub(super) fn abandon_pings(&self, sh: &Shared) {
        Stats::add(&sh.stats.pings_abandoned, self.pings - self.pongs);
        sh.stats
            .ping_timeouts
            .fetch_sub(self.ping_timeouts, Ordering::Relaxed);
    }

    /// Starts a tracked ping unless one is outstanding.
    pub(super) async fn start_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        if self.ping.is_none() {
            let pending = self.writer.start_ping().await?;
            self.pings += 1;
            Stats::add(&sh.stats.pings, 1);
            self.ping = Some(Box::pin(pending.wait()));
        }
        Ok(())
    }

    /// Resolves when the outstanding ping (if any) is answered or fails.
    pub(super) async fn ping_done(ping: &mut Option<PingWait>) -> Result<Duration, ClientError> {
        match ping {
            Some(wait) => {
                let result = wait.await;
                *ping = None;
                result
            }
            None => std::future::pending().await,
        }
    }

    /// Writes one packet to `dst` and counts it once written.
    pub(super) async fn send(
        &mut self,
        sh: &Shared,
        dst: PublicKey,
        packet: &[u8],
    ) -> Result<(), ClientError> {
        self.writer.queue_packet(dst, packet)?;
        self.writer.flush().await?;
        Stats::add(&sh.stats.sent, 1);
        Ok(())
    }

    /// Pings and waits for the pong while reading whatever else arrives, so that once it
    /// returns the server has handled every frame this client sent. Three tries.
    pub(super) async fn barrier(&mut self, sh: &Shared) -> Result<(), ClientError> {
        self.finish_ping(sh).await?;
        let mut last = ClientError::PingTimeout;
        for _ in 0..3 {
            self.ping = None;
            self.start_ping(sh).await?;
            loop {
                tokio::select! {
                    r = Self::ping_done(&mut self.ping) => match self.ponged(sh, r) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            last = e;
                            break;
                        }
                    },
                    f = self.reader.recv() => count_frame(sh, &f?),
                }
            }
        }
        Err(last)
    }
}

/// Dials with a small receive buffer, then upgrades and handshakes over that socket.
async fn connect_small_rcvbuf(
    sh: &Shared,
    config: &derp_client::ClientConfig,
    local: Option<std::net::SocketAddr>,
    size: u32,
) -> Result<Client, derp_client::ConnectError> {
    let addr: std::net::SocketAddr = sh.addr.parse().map_err(|_| {
        derp_client::ConnectError::Io(std::io::Error::other("the soak needs an IP address"))
    })?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_recv_buffer_size(size)?;
    if let Some(local) = local {
        socket.bind(local)?;
    }
    let timeout = Duration::from_secs(10);
    let work = async {
        let stream = sh.secure(socket.connect(addr).await?).await?;
        Client::connect_stream(config, stream).await
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| derp_client::ConnectError::Timeout(timeout))?
}

pub(super) fn count_frame(sh: &Shared, frame: &ReceivedFrame) {
    if matches!(frame, ReceivedFrame::RecvPacket { .. }) {
        Stats::add(&sh.stats.received, 1);
    }
}

pub(super) fn packet(flow: u32, seq: u64, size: usize) -> Vec<u8> {
    let mut p = vec![0u8; size.max(HEADER_LEN)];
    Header {
        run: 0,
        pair: flow,
        kind: Kind::Load,
        seq,
        sent_ns: 0,
    }
    .write(&mut p);
    p
}

pub(super) fn new_key() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}
