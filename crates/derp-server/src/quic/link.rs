//! One QUIC connection as the relay's connection code sees it: the datagrams in both
//! directions, the migration gate, and how the connection ended.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::conn::{Conn, DatagramError, DatagramSender};

use super::gate::{Gate, Sample, Verdict};
use crate::handle::ConnHandle;
use crate::metrics::Metrics;
use crate::queue::Control;

/// A QUIC connection's side of the relay, shared by its read loop, writer and path watcher.
#[derive(Debug)]
pub(crate) struct QuicLink {
    conn: Conn,
    gate: Mutex<Gate>,
    /// The client finished (or reset) its DERP stream: it is leaving.
    client_finished: AtomicBool,
    /// The writer gave up on a write that missed its deadline.
    write_timed_out: AtomicBool,
    /// The DERP handshake completed and the client was registered.
    registered: AtomicBool,
    /// The last check found the address unvalidated: relayed packets are held back.
    held: AtomicBool,
    /// Tells the path watcher that a check found the address unvalidated.
    watch: tokio::sync::Notify,
}

/// Datagrams the read loop takes at once after the first, so a burst is routed as one batch.
const MAX_DATAGRAM_BATCH: usize = 64;
/// How often an idle connection's address is checked for a migration.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// How often, while a new address is being validated, the gate is checked and a KeepAlive
/// is written: quinn only shows that validation succeeded by sending a packet without a
/// challenge, so something must be sent.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);

impl QuicLink {
    /// The link for a connection whose QUIC handshake completed from `trusted`, the address
    /// the handshake validated.
    pub(crate) fn new(conn: Conn, trusted: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            conn,
            gate: Mutex::new(Gate::new(trusted)),
            client_finished: AtomicBool::new(false),
            write_timed_out: AtomicBool::new(false),
            registered: AtomicBool::new(false),
            held: AtomicBool::new(false),
            watch: tokio::sync::Notify::new(),
        })
    }

    /// The last validated client address (what ObservedAddr reports).
    pub(crate) fn trusted_addr(&self) -> SocketAddr {
        self.lock_gate().trusted()
    }

    fn lock_gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        // The gate is two plain fields; a panic elsewhere cannot leave them inconsistent.
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the migration gate. Returns whether relayed packets may be handed to quinn now;
    /// when the client has just been validated at a new address, queues ObservedAddr for it.
    pub(crate) fn check_path(&self, handle: &ConnHandle, metrics: &Metrics) -> bool {
        let current = self.conn.remote_address();
        let verdict = self.lock_gate().check(current, || {
            let stats = self.conn.stats();
            Sample {
                udp_tx: stats.udp_tx.datagrams,
                path_challenges: stats.frame_tx.path_challenge,
            }
        });
        let open = match verdict {
            Verdict::Open => true,
            Verdict::Validated(addr) => {
                metrics.quic_migrations.inc();
                handle.queue.push_control(Control::ObservedAddr(addr));
                true
            }
            Verdict::Pending => false,
        };
        if open {
            // Packets were held back. The writer waits for something queued before it
            // looks again, so give it something (quinn going back to the trusted address
            // queues nothing of its own).
            if self.held.load(Ordering::Relaxed) && self.held.swap(false, Ordering::Relaxed) {
                handle.queue.push_control(Control::KeepAlive);
            }
        } else if !self.held.swap(true, Ordering::Relaxed) {
            // Newly held back (the writer usually sees it first): the watcher starts probing
            // now, not at its next idle check.
            self.watch.notify_one();
        }
        open
    }

    /// Watches the client's address for as long as the connection lives (the caller drops
    /// the future): every second while nothing happens, and every few milliseconds, with a
    /// KeepAlive each time, while a new address is being validated. Each time it also adds
    /// what the path counted to the relay's metrics.
    pub(crate) async fn watch_path(&self, handle: &ConnHandle, metrics: &Metrics) -> Infallible {
        loop {
            self.conn.fold_path_counts(metrics);
            let open = self.check_path(handle, metrics);
            if !open {
                handle.queue.push_control(Control::KeepAlive);
            }
            let pause = if open { WATCH_INTERVAL } else { PROBE_INTERVAL };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.watch.notified() => {}
            }
        }
    }

    /// The largest DERP frame a datagram can carry right now, or `None` when the client does
    /// not accept datagrams.
    pub(crate) fn max_datagram_frame(&self) -> Option<usize> {
        self.conn.max_datagram_size()
    }

    /// Waits for the next datagram from the client, then takes those already waiting behind
    /// it (up to a batch) into `out`. Returns the bytes taken; an error once the connection
    /// is gone.
    pub(crate) async fn read_datagrams(&self, out: &mut Vec<Bytes>) -> io::Result<usize> {
        let first = std::future::poll_fn(|cx| self.conn.poll_datagram(cx))
            .await
            .map_err(|e| io::Error::new(io::ErrorKind::ConnectionAborted, e))?;
        let before = out.len();
        out.push(first);
        self.conn.take_datagrams(out, MAX_DATAGRAM_BATCH);
        let n: usize = out[before..].iter().map(Bytes::len).sum();
        // A zero-length datagram still counts as input (0 would read as the end).
        Ok(n.max(1))
    }

    /// The DERP handshake is done and the client registered: from now on its datagrams are
    /// relayed. Drops those it sent before (the protocol forbids them); returns how many.
    pub(crate) fn registered(&self) -> u64 {
        self.registered.store(true, Ordering::Relaxed);
        let mut dropped = Vec::new();
        while self.conn.take_datagrams(&mut dropped, MAX_DATAGRAM_BATCH) > 0 {}
        dropped.len() as u64
    }

    /// Hands datagrams to quinn under one lock while its buffer has room, without waiting
    /// ([`DatagramSender::try_send`]); those it has no room for go with
    /// [`QuicLink::send_datagram`].
    pub(crate) fn datagram_sender(&self) -> DatagramSender<'_> {
        self.conn.datagram_sender()
    }

    /// Sends one datagram, waiting while quinn's datagram buffer is full (the congestion
    /// controller decides how fast it drains), so derpd's own queues and drop policy stay in
    /// charge rather than quinn's drop-oldest buffer.
    pub(crate) async fn send_datagram(&self, frame: Bytes) -> Result<(), DatagramError> {
        let mut frame = Some(frame);
        std::future::poll_fn(|cx| self.conn.poll_send_datagram(cx, &mut frame)).await
    }

    /// Has the endpoint's driver route the client's datagrams as `handle` (or stop).
    pub(crate) fn route_in_driver(&self, handle: Option<Arc<ConnHandle>>) {
        self.conn.route_in_driver(handle);
    }

    /// Records that the client's stream ended.
    pub(crate) fn note_client_finished(&self) {
        self.client_finished.store(true, Ordering::Relaxed);
    }

    pub(crate) fn client_finished(&self) -> bool {
        self.client_finished.load(Ordering::Relaxed)
    }

    /// Records that the writer gave up on a write past its deadline.
    pub(crate) fn note_write_timeout(&self) {
        self.write_timed_out.store(true, Ordering::Relaxed);
    }

    pub(crate) fn write_timed_out(&self) -> bool {
        self.write_timed_out.load(Ordering::Relaxed)
    }

    pub(crate) fn was_registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }
}
