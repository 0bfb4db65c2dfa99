//! The QUIC endpoint and the one task that drives it.
//!
//! quinn runs a task for the endpoint and one for every connection, so a relayed datagram
//! passes through four tasks (the endpoint's, the sender's connection's, the read loop,
//! the receiver's connection's), each hand-over a wake-up. Here a single driver task owns
//! the socket and quinn-proto's endpoint and does every connection's socket and timer
//! work: it reads a batch of UDP datagrams, hands each to its connection, wakes the tasks
//! waiting on what arrived, and sends what every connection has to send, several datagrams
//! per system call, as far as each connection's pacer lets it (`pace.rs`). The
//! connections' own tasks (handshake, read loop, writer) call into their quinn-proto
//! connection directly ([`super::conn`]) and mark it for the driver.
//!
//! Lock order: the endpoint's state, then a connection's. Tasks take only a connection's.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use quinn_proto::{ConnectionError, ConnectionHandle, DatagramEvent, EndpointConfig, ServerConfig};
use quinn_udp::{RecvMeta, UdpSocketState};
use tokio::io::Interest;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, trace};

use super::conn::{Conn, ConnShared, Marks};
use super::pace::Rate;
use crate::handle::ConnHandle;
use crate::lookup::Router;
use crate::route::{NotHereLimiter, Routing, route_datagrams};
use crate::state::ServerState;

/// New connection attempts waiting for the accept loop; beyond this they are refused.
const INCOMING_QUEUE: usize = 1024;
/// Receive batches (each up to `BATCH_SIZE` messages) the driver takes before it sends
/// what they caused, so one busy socket cannot starve the connections' output.
const RECV_BATCHES_PER_PASS: usize = 8;
/// One receive slot: the most a single message can carry with GRO (64 KiB).
const RECV_SLOT: usize = 64 * 1024;
/// Datagrams of one connection routed in one pass; the rest wait for the next.
const MAX_ROUTED_PER_PASS: usize = 256;

/// The driver's maps are keyed by connection handles, small integers no client chooses:
/// a fast hash is enough, and they are looked up several times per packet.
type HandleMap<V> = HashMap<ConnectionHandle, V, foldhash::fast::RandomState>;

/// The UDP socket with quinn-udp's segmentation offload and batched receive.
#[derive(Debug)]
struct Io {
    socket: tokio::net::UdpSocket,
    state: UdpSocketState,
}

impl Io {
    /// Sends one transmit without waiting. `false` when the socket buffer is full.
    fn try_send(&self, t: &quinn_proto::Transmit, buf: &[u8]) -> bool {
        let tx = quinn_udp::Transmit {
            destination: t.destination,
            ecn: t.ecn.map(udp_ecn),
            contents: &buf[..t.size],
            segment_size: t.segment_size,
            src_ip: t.src_ip,
        };
        match self.socket.try_io(Interest::WRITABLE, || {
            self.state.send((&self.socket).into(), &tx)
        }) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) => {
                // As a lost packet: QUIC recovers, and one bad destination must not stop
                // the others.
                debug!(error = %e, to = %t.destination, "quic send failed");
                true
            }
        }
    }
}

/// The endpoint's state, shared by the driver and the accept loop.
#[derive(Debug)]
struct EndpointState {
    proto: quinn_proto::Endpoint,
    conns: HandleMap<Arc<ConnShared>>,
    /// Closing: new connection attempts are refused.
    closing: bool,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<EndpointState>,
    /// The server config for clients that come over IPv4 (the endpoint's own is for IPv6).
    server_v4: Arc<ServerConfig>,
    io: Io,
    marks: Arc<Marks>,
    /// Signalled when the last connection is gone.
    idle: Notify,
    local_addr: SocketAddr,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, EndpointState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A QUIC server endpoint on one UDP socket, with its driver task once started. Dropping
/// it stops the driver (close and [`Endpoint::wait_idle`] first to say goodbye).
#[derive(Debug)]
pub(crate) struct Endpoint {
    inner: Arc<Inner>,
    /// The driver until it is started.
    driver: Option<Driver>,
    task: Option<JoinHandle<()>>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// A client's first packet, for the accept loop to accept, retry or refuse.
#[derive(Debug)]
pub(crate) struct Incoming {
    proto: Option<quinn_proto::Incoming>,
    inner: Arc<Inner>,
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if let Some(i) = self.proto.take() {
            self.inner.lock().proto.ignore(i);
        }
    }
}

impl Incoming {
    fn proto(&self) -> &quinn_proto::Incoming {
        self.proto
            .as_ref()
            .expect("an Incoming is consumed only by value")
    }

    pub(crate) fn remote_address(&self) -> SocketAddr {
        self.proto().remote_address()
    }

    /// The client proved its address (it echoed a Retry token).
    pub(crate) fn remote_address_validated(&self) -> bool {
        self.proto().remote_address_validated()
    }

    pub(crate) fn may_retry(&self) -> bool {
        self.proto().may_retry()
    }

    /// Starts the handshake; [`Conn::handshake`] completes with it.
    pub(crate) fn accept(mut self) -> Result<Conn, ConnectionError> {
        let incoming = self.proto.take().expect("not consumed");
        let inner = self.inner.clone();
        let mut st = inner.lock();
        let mut buf = Vec::new();
        let config = incoming
            .remote_address()
            .ip()
            .to_canonical()
            .is_ipv4()
            .then(|| inner.server_v4.clone());
        match st.proto.accept(incoming, Instant::now(), &mut buf, config) {
            Ok((handle, proto)) => {
                let shared = Arc::new(ConnShared::new(handle, proto, inner.marks.clone()));
                st.conns.insert(handle, shared.clone());
                drop(st);
                // The driver sends the handshake's answer.
                shared.mark();
                Ok(Conn::new(shared))
            }
            Err(e) => {
                drop(st);
                if let Some(t) = e.response {
                    inner.io.try_send(&t, &buf);
                }
                Err(e.cause)
            }
        }
    }

    /// Refuses with CONNECTION_REFUSED.
    pub(crate) fn refuse(mut self) {
        let incoming = self.proto.take().expect("not consumed");
        let mut buf = Vec::new();
        let t = self.inner.lock().proto.refuse(incoming, &mut buf);
        self.inner.io.try_send(&t, &buf);
    }

    /// Answers with a Retry, which makes the client prove its address.
    pub(crate) fn retry(mut self) {
        let incoming = self.proto.take().expect("not consumed");
        let mut buf = Vec::new();
        let mut st = self.inner.lock();
        match st.proto.retry(incoming, &mut buf) {
            Ok(t) => {
                drop(st);
                self.inner.io.try_send(&t, &buf);
            }
            Err(e) => st.proto.ignore(e.into_incoming()),
        }
    }
}

impl Endpoint {
    /// Serves on `socket` and starts the driver. Must run inside a tokio runtime. Returns
    /// the endpoint and where connection attempts arrive.
    pub(crate) fn new(
        socket: std::net::UdpSocket,
        config: EndpointConfig,
        server: Arc<ServerConfig>,
        server_v4: Arc<ServerConfig>,
    ) -> io::Result<(Self, mpsc::Receiver<Incoming>)> {
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        let local_addr = socket.local_addr()?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let proto =
            quinn_proto::Endpoint::new(Arc::new(config), Some(server), !state.may_fragment(), None);
        let inner = Arc::new(Inner {
            state: Mutex::new(EndpointState {
                proto,
                conns: HandleMap::default(),
                closing: false,
            }),
            server_v4,
            io: Io { socket, state },
            marks: Arc::new(Marks::default()),
            idle: Notify::new(),
            local_addr,
        });
        let (tx, rx) = mpsc::channel(INCOMING_QUEUE);
        let driver = Some(Driver::new(inner.clone(), tx));
        Ok((
            Self {
                inner,
                driver,
                task: None,
            },
            rx,
        ))
    }

    /// Starts the driver, which routes registered clients' datagrams on `shared`.
    pub(crate) fn start(&mut self, shared: Arc<ServerState>) {
        if let Some(driver) = self.driver.take() {
            self.task = Some(tokio::spawn(driver.run(shared)));
        }
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Closes every connection with `code` and refuses new ones.
    pub(crate) fn close(&self, code: u32) {
        let conns: Vec<_> = {
            let mut st = self.inner.lock();
            st.closing = true;
            st.conns.values().cloned().collect()
        };
        for c in conns {
            c.close(code);
        }
    }

    /// Waits until every connection is gone (closed ones linger for their drain period).
    pub(crate) async fn wait_idle(&self) {
        loop {
            let idle = self.inner.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.inner.lock().conns.is_empty() {
                return;
            }
            idle.await;
        }
    }
}

fn proto_ecn(e: quinn_udp::EcnCodepoint) -> quinn_proto::EcnCodepoint {
    match e {
        quinn_udp::EcnCodepoint::Ect0 => quinn_proto::EcnCodepoint::Ect0,
        quinn_udp::EcnCodepoint::Ect1 => quinn_proto::EcnCodepoint::Ect1,
        quinn_udp::EcnCodepoint::Ce => quinn_proto::EcnCodepoint::Ce,
    }
}

fn udp_ecn(e: quinn_proto::EcnCodepoint) -> quinn_udp::EcnCodepoint {
    match e {
        quinn_proto::EcnCodepoint::Ect0 => quinn_udp::EcnCodepoint::Ect0,
        quinn_proto::EcnCodepoint::Ect1 => quinn_udp::EcnCodepoint::Ect1,
        quinn_proto::EcnCodepoint::Ce => quinn_udp::EcnCodepoint::Ce,
    }
}

/// A transmit the socket had no room for, sent once it has.
struct Blocked {
    transmit: quinn_proto::Transmit,
    buf: Vec<u8>,
    conn: Option<Arc<ConnShared>>,
}

struct Driver {
    inner: Arc<Inner>,
    incoming: mpsc::Sender<Incoming>,
    recv_buf: Box<[u8]>,
    metas: Vec<RecvMeta>,
    tx_buf: Vec<u8>,
    touched: Vec<Arc<ConnShared>>,
    /// Each connection's next timeout as last scheduled; heap entries that no longer
    /// match are stale and skipped.
    scheduled: HandleMap<Instant>,
    timers: BinaryHeap<Reverse<(Instant, ConnectionHandle)>>,
    blocked: Option<Blocked>,
    /// The last pass stopped receiving before the socket was empty.
    more: bool,
    /// Datagrams taken this pass from connections the driver routes for.
    collected: Vec<(ConnectionHandle, Arc<ConnHandle>, Vec<Bytes>)>,
    /// Connections gone this pass.
    removed: Vec<ConnectionHandle>,
    /// Spare vectors for `collected`.
    spare: Vec<Vec<Bytes>>,
    /// Another process reads the socket too: packets of connections this endpoint does not
    /// know are that process's, and are neither answered (no stateless reset, which would
    /// be valid for that process's clients when both derive it from one key; no version
    /// negotiation) nor taken (a connection attempt goes unanswered, and its resend may
    /// reach the other process).
    quiet: bool,
}

/// How the driver routes one client's datagrams: its own lookup cache and PeerGone(NotHere)
/// limiter, beside those of the client's read loop (which routes what comes on the stream).
struct FastPath<'a> {
    handle: Arc<ConnHandle>,
    router: Router<'a>,
    not_here: Option<Box<NotHereLimiter>>,
}

impl Driver {
    fn new(inner: Arc<Inner>, incoming: mpsc::Sender<Incoming>) -> Self {
        let batch = quinn_udp::BATCH_SIZE;
        Self {
            inner,
            incoming,
            recv_buf: vec![0; RECV_SLOT * batch].into_boxed_slice(),
            metas: vec![RecvMeta::default(); batch],
            tx_buf: Vec::with_capacity(64 * 1024),
            touched: Vec::new(),
            scheduled: HandleMap::default(),
            timers: BinaryHeap::new(),
            blocked: None,
            more: false,
            collected: Vec::new(),
            removed: Vec::new(),
            spare: Vec::new(),
            quiet: false,
        }
    }

    async fn run(mut self, shared: Arc<ServerState>) {
        let inner = self.inner.clone();
        let mut fast: HandleMap<FastPath<'_>> = HandleMap::default();
        loop {
            if let Some(b) = self.blocked.take() {
                if inner.io.socket.writable().await.is_err() {
                    return;
                }
                if !inner.io.try_send(&b.transmit, &b.buf) {
                    self.blocked = Some(b);
                    continue;
                }
                if let Some(c) = b.conn {
                    c.mark();
                }
            }
            if self.more {
                // More is waiting, but the tasks this pass woke (and every other task on
                // this worker) run first: a busy socket must not keep the driver from
                // ever giving its thread back.
                tokio::task::yield_now().await;
            } else {
                let next = self.timers.peek().map(|Reverse((t, _))| *t);
                let sleep = async {
                    match next {
                        Some(t) => tokio::time::sleep_until(t.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    r = inner.io.socket.readable() => if r.is_err() { return },
                    _ = inner.marks.notified() => {}
                    _ = sleep => {}
                }
            }
            let draining = shared.draining.is_cancelled();
            self.quiet = shared.udp_handed_over.load(Ordering::Acquire);
            inner.marks.set_busy(true);
            self.take_in(draining);
            self.route(&shared, &mut fast);
            self.send_out();
            inner.marks.set_busy(false);
            // A mark that came while busy did not wake the driver.
            self.more |= inner.marks.pending();
            for handle in self.removed.drain(..) {
                fast.remove(&handle);
            }
        }
    }

    /// The first half of a pass: what arrived, what timed out and what tasks marked, each
    /// connection's events dispatched to its tasks, and the datagrams to route taken.
    fn take_in(&mut self, draining: bool) {
        let inner = self.inner.clone();
        let mut st = inner.lock();
        self.more = false;
        for _ in 0..RECV_BATCHES_PER_PASS {
            match self.receive(&mut st) {
                Ok(true) => self.more = true,
                Ok(false) => {
                    self.more = false;
                    break;
                }
                Err(e) => {
                    debug!(error = %e, "quic receive failed");
                    break;
                }
            }
        }
        let now = Instant::now();
        while let Some(Reverse((t, handle))) = self.timers.peek().copied() {
            if t > now {
                break;
            }
            self.timers.pop();
            if self.scheduled.get(&handle) != Some(&t) {
                // Superseded by an earlier deadline, already handled.
                continue;
            }
            self.scheduled.remove(&handle);
            if let Some(c) = st.conns.get(&handle) {
                let mut s = c.lock();
                // The deadline may have moved later since it was scheduled; `flush`
                // schedules the one that holds now.
                if s.proto.poll_timeout().is_some_and(|d| d <= now) {
                    s.proto.handle_timeout(now);
                }
                drop(s);
                self.touched.push(c.clone());
            }
        }
        inner.marks.take(&mut self.touched);
        // A connection its tasks marked after it was drained is gone from the endpoint (and
        // its handle may already name another).
        self.touched.retain(|c| is_current(&st, c));
        for c in &self.touched {
            let mut s = c.lock();
            forward_endpoint_events(&mut st, c.handle, &mut s.proto);
            s.dispatch();
            // While the server drains, nothing more is read: datagrams wait in quinn's
            // buffer, as stream bytes wait in the socket.
            let Some(handle) = s.route_as.clone().filter(|_| !draining) else {
                continue;
            };
            let mut datagrams = self.spare.pop().unwrap_or_default();
            while datagrams.len() < MAX_ROUTED_PER_PASS {
                match s.proto.datagrams().recv() {
                    Some(d) => datagrams.push(d),
                    None => break,
                }
            }
            if datagrams.is_empty() {
                self.spare.push(datagrams);
            } else {
                if datagrams.len() == MAX_ROUTED_PER_PASS {
                    // More wait: the next pass takes them.
                    inner.marks.push(c.clone());
                }
                self.collected.push((c.handle, handle, datagrams));
            }
        }
    }

    /// Routes the datagrams taken, outside the endpoint's lock: the writers of idle
    /// destinations are written inline, and QUIC ones queue their datagrams and mark their
    /// connections, which [`Driver::send_out`] then sends in this same pass.
    fn route<'a>(&mut self, shared: &'a ServerState, fast: &mut HandleMap<FastPath<'a>>) {
        for (conn, handle, mut datagrams) in self.collected.drain(..) {
            let path = fast
                .entry(conn)
                .and_modify(|p| {
                    if p.handle.id != handle.id {
                        *p = FastPath::new(shared, handle.clone());
                    }
                })
                .or_insert_with(|| FastPath::new(shared, handle.clone()));
            let mut routing = Routing {
                shared,
                handle: &path.handle,
                router: &mut path.router,
                not_here: &mut path.not_here,
            };
            route_datagrams(&mut routing, &mut datagrams);
            self.spare.push(datagrams);
        }
    }

    /// The second half of a pass: every connection touched, or marked while routing,
    /// sends what it has and schedules its next timeout.
    fn send_out(&mut self) {
        let inner = self.inner.clone();
        let mut st = inner.lock();
        // Read after routing: quinn-proto stamps each packet with it, and a send time from
        // the start of a long pass would add the pass to every round trip it measures.
        let now = Instant::now();
        inner.marks.take(&mut self.touched);
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable_by_key(|c| c.handle);
        touched.dedup_by_key(|c| c.handle);
        for c in touched.drain(..) {
            c.marked.store(false, Ordering::Release);
            if is_current(&st, &c) {
                self.flush(&mut st, &c, now);
            }
        }
        self.touched = touched;
        if self.timers.len() > 4 * self.scheduled.len() + 1024 {
            self.timers = self
                .scheduled
                .iter()
                .map(|(h, t)| Reverse((*t, *h)))
                .collect();
        }
        if st.conns.is_empty() {
            inner.idle.notify_waiters();
        }
    }

    /// Takes one batch off the socket. `Ok(true)` when it was a full batch (more may wait).
    fn receive(&mut self, st: &mut EndpointState) -> io::Result<bool> {
        let io = &self.inner.io;
        let mut slots = self.recv_buf.chunks_mut(RECV_SLOT).map(IoSliceMut::new);
        let mut iovs: [IoSliceMut<'_>; quinn_udp::BATCH_SIZE] =
            std::array::from_fn(|_| slots.next().expect("BATCH_SIZE slots"));
        let n = loop {
            match io.socket.try_io(Interest::READABLE, || {
                io.state
                    .recv((&io.socket).into(), &mut iovs, &mut self.metas)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                // ICMP errors from earlier sends: meaningless for QUIC, and forgeable.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => continue,
                Err(e) => return Err(e),
            }
        };
        // Read per batch, after it arrived: one from the start of the pass would make an
        // acknowledgement that arrived while the pass ran look that much earlier, and
        // quinn-proto and the congestion controller would measure round trips shorter than
        // the path's (a pass can take milliseconds).
        let now = Instant::now();
        let mut response = Vec::new();
        for (i, meta) in self.metas.iter().enumerate().take(n) {
            let start = i * RECV_SLOT;
            // Each UDP datagram of a coalesced (GRO) message gets a buffer of its own: a
            // small allocation rather than one of up to 64 KiB, and a relayed packet waiting
            // in a slow destination's queue keeps only its own datagram's bytes alive.
            let message = &self.recv_buf[start..start + meta.len];
            for segment in message.chunks(meta.stride.max(1)) {
                let datagram = BytesMut::from(segment);
                response.clear();
                match st.proto.handle(
                    now,
                    meta.addr,
                    meta.dst_ip,
                    meta.ecn.map(proto_ecn),
                    datagram,
                    &mut response,
                ) {
                    Some(DatagramEvent::NewConnection(incoming)) if self.quiet => {
                        st.proto.ignore(incoming);
                    }
                    Some(DatagramEvent::Response(_)) if self.quiet => {}
                    Some(DatagramEvent::NewConnection(incoming)) => {
                        if st.closing {
                            let t = st.proto.refuse(incoming, &mut response);
                            io.try_send(&t, &response);
                            continue;
                        }
                        let offer = Incoming {
                            proto: Some(incoming),
                            inner: self.inner.clone(),
                        };
                        if let Err(e) = self.incoming.try_send(offer) {
                            // The accept loop is behind (or gone): refuse rather than queue.
                            let mut offer = match e {
                                mpsc::error::TrySendError::Full(o)
                                | mpsc::error::TrySendError::Closed(o) => o,
                            };
                            let incoming = offer.proto.take().expect("not consumed");
                            let t = st.proto.refuse(incoming, &mut response);
                            io.try_send(&t, &response);
                        }
                    }
                    Some(DatagramEvent::ConnectionEvent(handle, event)) => {
                        if let Some(c) = st.conns.get(&handle) {
                            c.lock().proto.handle_event(event);
                            self.touched.push(c.clone());
                        }
                    }
                    Some(DatagramEvent::Response(t)) => {
                        io.try_send(&t, &response);
                    }
                    None => {}
                }
            }
        }
        Ok(n == self.metas.len())
    }

    /// Lets one connection send what it has, then schedules its next timeout or, once it
    /// is drained, lets it go.
    fn flush(&mut self, st: &mut EndpointState, c: &Arc<ConnShared>, now: Instant) {
        let io = &self.inner.io;
        let mut s = c.lock();
        let mut drained = forward_endpoint_events(st, c.handle, &mut s.proto);
        s.dispatch();
        if self.blocked.is_some() {
            // Looked at again once the socket has room.
            drop(s);
            c.marked.store(true, Ordering::Release);
            self.inner.marks.push(c.clone());
            return;
        }
        let max = io.state.max_gso_segments();
        let rate = pacing_rate(&s.proto);
        let mut held = false;
        loop {
            let allowed = s.pacer.allowance(now, rate);
            if allowed == 0 {
                held = true;
                break;
            }
            self.tx_buf.clear();
            let Some(t) = s
                .proto
                .poll_transmit(now, max.min(allowed), &mut self.tx_buf)
            else {
                // Everything written before a close has gone: the close can follow it.
                match s.close_pending.take() {
                    Some(code) => {
                        s.proto
                            .close(now, quinn_proto::VarInt::from_u32(code), Bytes::new());
                        continue;
                    }
                    None => break,
                }
            };
            // Counted whether it goes now or once the socket has room: it is built.
            s.pacer.on_sent(t.size);
            if !io.try_send(&t, &self.tx_buf) {
                trace!("quic socket full: waiting to send");
                self.blocked = Some(Blocked {
                    transmit: t,
                    buf: std::mem::replace(&mut self.tx_buf, Vec::with_capacity(64 * 1024)),
                    conn: Some(c.clone()),
                });
                break;
            }
        }
        drained |= forward_endpoint_events(st, c.handle, &mut s.proto);
        // Sending can unblock datagram senders.
        s.dispatch();
        // A connection's deadline moves on almost every packet, mostly later. The heap
        // gets a new entry only when it moves earlier; an entry that comes due early looks
        // again (see `take_in`), so the heap does not fill with stale entries. A connection
        // the pacer held is looked at again when its next datagram may go.
        let release = rate.filter(|_| held).map(|r| s.pacer.next_release(now, r));
        let deadline = match (s.proto.poll_timeout(), release) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match deadline {
            Some(t) if !drained => {
                let earlier = self.scheduled.get(&c.handle).is_none_or(|old| t < *old);
                if earlier {
                    self.scheduled.insert(c.handle, t);
                    self.timers.push(Reverse((t, c.handle)));
                }
            }
            _ => {
                self.scheduled.remove(&c.handle);
            }
        }
        if drained || s.proto.is_drained() {
            st.conns.remove(&c.handle);
            self.scheduled.remove(&c.handle);
            self.removed.push(c.handle);
        }
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl<'a> FastPath<'a> {
    fn new(shared: &'a ServerState, handle: Arc<ConnHandle>) -> Self {
        Self {
            handle,
            router: Router::new(&shared.config.lookup),
            not_here: None,
        }
    }
}

/// What the driver paces a connection at (`pace.rs`): none during the handshake, whose
/// round trip is not known yet (quinn-proto's initial estimate, 333 ms, would hold the
/// server's first flight for tens of milliseconds).
fn pacing_rate(proto: &quinn_proto::Connection) -> Option<Rate> {
    if proto.is_handshaking() {
        return None;
    }
    Rate::of(
        proto.congestion_state().window(),
        proto.rtt(),
        proto.current_mtu(),
    )
}

/// Whether `c` is still the endpoint's connection under its handle.
fn is_current(st: &EndpointState, c: &Arc<ConnShared>) -> bool {
    st.conns.get(&c.handle).is_some_and(|x| Arc::ptr_eq(x, c))
}

/// Hands a connection's endpoint events (new and retired connection IDs, its end) to the
/// endpoint. Returns whether the connection is drained and gone from the endpoint.
fn forward_endpoint_events(
    st: &mut EndpointState,
    handle: ConnectionHandle,
    proto: &mut quinn_proto::Connection,
) -> bool {
    let mut drained = false;
    while let Some(event) = proto.poll_endpoint_events() {
        drained |= event.is_drained();
        if let Some(back) = st.proto.handle_event(handle, event) {
            proto.handle_event(back);
        }
    }
    drained
}
