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
pub(crate) struct Stats {
    /// SendPacket frames the clients wrote (counted once the write succeeded).
    pub(crate) sent: AtomicU64,
    /// RecvPacket frames the clients read.
    pub(crate) received: AtomicU64,
    pub(crate) closed_sent: AtomicU64,
    pub(crate) closed_echoed: AtomicU64,
    pub(crate) closed_lost: AtomicU64,
    pub(crate) pings: AtomicU64,
    pub(crate) pongs: AtomicU64,
    /// Pings outstanding on slow readers when the server cut them off (expected).
    pub(crate) pings_abandoned: AtomicU64,
    /// Pings not answered within 5 s on a connection that stayed up.
    pub(crate) ping_timeouts: AtomicU64,
    pub(crate) connects: AtomicU64,
    /// Slow readers the server cut off (expected: the write deadline at work).
    pub(crate) slow_cut_off: AtomicU64,
    pub(crate) churn_sessions: AtomicU64,
    pub(crate) churn_duplicates: AtomicU64,
    pub(crate) churn_abrupt: AtomicU64,
    pub(crate) hostile_failed: AtomicU64,
    pub(crate) violation_count: AtomicU64,
    pub(crate) violations: Mutex<Vec<String>>,
    pub(crate) connect_failures: Mutex<BTreeMap<String, u64>>,
    pub(crate) hostile: Mutex<BTreeMap<&'static str, u64>>,
}

impl Stats {
    pub(crate) fn violation(&self, what: String) {
        self.violation_count.fetch_add(1, Ordering::Relaxed);
        let mut kept = self.violations.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < MAX_VIOLATIONS_KEPT {
            kept.push(what);
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// What every role task shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) template: ClientTemplate,
    pub(crate) sources: SourceAddrs,
    /// `host:port` of the relay, for the hostile clients' raw sockets.
    pub(crate) addr: String,
    /// For https:// and wss:// nodes: TLS over those sockets, checked as the clients check
    /// it, with the URL's host as SNI.
    pub(crate) tls: Option<(Arc<derp_client::rustls::ClientConfig>, String)>,
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) stats: Stats,
    pub(crate) connect_gate: Semaphore,
    /// Keys churners use most of the time; packets go to these whether their owner is
    /// connected or not.
    pub(crate) churn_keys: Vec<PublicKey>,
}

/// A socket, or TLS over one.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

impl Shared {
    /// TLS over a connected socket for a TLS node; the socket itself otherwise.
    pub(crate) async fn secure(
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

    pub(crate) fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    pub(crate) async fn stopped(&self) {
        let mut stop = self.stop.clone();
        let _ = stop.wait_for(|s| *s).await;
    }
}

pub(crate) type PingWait = Pin<Box<dyn Future<Output = Result<Duration, ClientError>> + Send>>;

/// One client connection, driven by a single task.
pub(crate) struct Conn {
    pub(crate) reader: ClientReader,
    pub(crate) writer: ClientWriter,
    pub(crate) key: PublicKey,
    pub(crate) ping: Option<PingWait>,
    pub(crate) pings: u64,
    pub(crate) pongs: u64,
    pub(crate) ping_timeouts: u64,
}

impl Conn {
    /// Connects, retrying (and counting failures) until it works or the run stops.
    pub(crate) async fn open(sh: &Shared, secret: &SecretKey, slot: usize) -> Option<Self> {
        Self::open_with(sh, secret, slot, None).await
    }

    /// Like [`Conn::open`], with the socket's receive buffer set to `rcvbuf` bytes when given
    /// (a slow reader then pushes back on the relay within a few kilobytes).
    pub(crate) async fn open_with(
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
    pub(crate) async fn finish_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        while self.ping.is_some() {
            tokio::select! {
                r = Self::ping_done(&mut self.ping) => self.ponged(sh, r)?,
                f = self.reader.recv() => count_frame(sh, &f?),
            }
        }
        Ok(())
    }

    /// Counts the outcome of a tracked ping.
    pub(crate) fn ponged(
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
    pub(crate) fn abandon_pings(&self, sh: &Shared) {
        Stats::add(&sh.stats.pings_abandoned, self.pings - self.pongs);
        sh.stats
            .ping_timeouts
            .fetch_sub(self.ping_timeouts, Ordering::Relaxed);
    }

    /// Starts a tracked ping unless one is outstanding.
    pub(crate) async fn start_ping(&mut self, sh: &Shared) -> Result<(), ClientError> {
        if self.ping.is_none() {
            let pending = self.writer.start_ping().await?;
            self.pings += 1;
            Stats::add(&sh.stats.pings, 1);
            self.ping = Some(Box::pin(pending.wait()));
        }
        Ok(())
    }

    /// Resolves when the outstanding ping (if any) is answered or fails.
    pub(crate) async fn ping_done(ping: &mut Option<PingWait>) -> Result<Duration, ClientError> {
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
    pub(crate) async fn send(
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
    pub(crate) async fn barrier(&mut self, sh: &Shared) -> Result<(), ClientError> {
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

pub(crate) fn count_frame(sh: &Shared, frame: &ReceivedFrame) {
    if matches!(frame, ReceivedFrame::RecvPacket { .. }) {
        Stats::add(&sh.stats.received, 1);
    }
}

pub(crate) fn packet(flow: u32, seq: u64, size: usize) -> Vec<u8> {
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

pub(crate) fn new_key() -> SecretKey {
    SecretKey::generate(&mut rand::rngs::OsRng)
}
