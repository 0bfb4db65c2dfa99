//! One registered connection as the rest of the server sees it: who it is, its flags, the
//! switch that ends it, and its send queue.

use std::fmt;
use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::num::NonZeroU64;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, Ordering};
use std::task::Waker;

use derp_proto::{PublicKey, ws};
use tokio::sync::Notify;

use crate::queue::{Batch, SendQueue};

const WRITE_FAILED: u8 = 1;
const WRITE_TIMED_OUT: u8 = 2;

/// The bits of [`ConnHandle`]'s `standing`.
const DUP: u8 = 1;
const ACTIVE: u8 = 2;
const PREFERRED: u8 = 4;
/// Handed to a successor process: at its commit this process forgets the connection.
const HANDED: u8 = 8;
/// Taken over from a predecessor process: its read loop resumes from handed state.
const ADOPTED: u8 = 16;
/// Carried over QUIC, whose state lives in quinn: never handed over.
const QUIC: u8 = 32;

/// A connection's TCP socket, as the kernel's statistics (`tcpinfo`) find it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TcpSocket {
    pub(crate) cookie: NonZeroU64,
    /// The socket's local port: for an accepted connection, its listener's, which is what
    /// the statistics are asked for by.
    pub(crate) port: u16,
}

/// A registered connection, shared (as `Arc<ConnHandle>`) by the registry, the lookup layers
/// and its own read loop and writer.
#[derive(Debug)]
pub(crate) struct ConnHandle {
    pub(crate) id: u64,
    pub(crate) key: PublicKey,
    pub(crate) remote: ClientAddr,
    /// PeerPresent flags describing this connection to mesh watchers.
    pub(crate) presence_flags: u8,
    pub(crate) can_mesh: bool,
    /// Where the connection stands among its key's connections, a bit each: [`DUP`]
    /// ([`ConnHandle::is_dup`]), [`ACTIVE`] ([`ConnHandle::is_active`]) and [`PREFERRED`]
    /// ([`ConnHandle::is_preferred`]). One byte rather than a flag each, so that with
    /// `local_port` the handle still takes 352 bytes of malloc, not 368.
    standing: AtomicU8,
    /// WebSocket close code the writer sends when the connection ends.
    pub(crate) ws_close_code: AtomicU16,
    /// How the writer failed, if it did: [`WRITE_FAILED`] or [`WRITE_TIMED_OUT`], else 0.
    write_failure: AtomicU8,
    /// Cancelled when the connection must end, from either side or on server shutdown.
    pub(crate) cancel: Cancel,
    /// What other connections queue for this one to write.
    pub(crate) queue: SendQueue,
    /// The cookie of the connection's TCP socket, for reading the kernel's statistics
    /// (`tcpinfo`); `None` for WebSocket, QUIC and streams the relay does not hold as TCP.
    pub(crate) socket_cookie: Option<NonZeroU64>,
    /// The local port of that socket (0 without one): the kernel's statistics are asked for
    /// the sockets on the ports of registered connections only.
    pub(crate) local_port: u16,
    pub(crate) rtt_mark: RttMark,
}

impl ConnHandle {
    pub(crate) fn new(
        id: u64,
        key: PublicKey,
        remote: SocketAddr,
        presence_flags: u8,
        can_mesh: bool,
        depth: usize,
    ) -> Self {
        Self {
            id,
            key,
            remote: remote.into(),
            presence_flags,
            can_mesh,
            standing: AtomicU8::new(0),
            ws_close_code: AtomicU16::new(ws::close_code::INTERNAL_ERROR),
            write_failure: AtomicU8::new(0),
            cancel: Cancel::default(),
            queue: SendQueue::new(depth),
            socket_cookie: None,
            local_port: 0,
            rtt_mark: RttMark::default(),
        }
    }

    /// Records that writing to the client failed (and so ended the connection), for the
    /// end of the read side to count.
    pub(crate) fn note_write_failure(&self, timed_out: bool) {
        let how = if timed_out {
            WRITE_TIMED_OUT
        } else {
            WRITE_FAILED
        };
        self.write_failure.store(how, Ordering::Release);
    }

    /// Whether writing failed: `Some(timed_out)`.
    pub(crate) fn write_failure(&self) -> Option<bool> {
        match self.write_failure.load(Ordering::Acquire) {
            0 => None,
            how => Some(how == WRITE_TIMED_OUT),
        }
    }

    /// Member of a duplicate set; read on every frame, so it is kept here rather than looked
    /// up in the registry.
    pub(crate) fn is_dup(&self) -> bool {
        self.standing.load(Ordering::Relaxed) & DUP != 0
    }

    pub(crate) fn set_dup(&self, dup: bool) {
        self.set_standing(DUP, dup, Ordering::Relaxed);
    }

    /// True while this is its key's active connection; caches check it on every hit.
    pub(crate) fn is_active(&self) -> bool {
        self.standing.load(Ordering::Acquire) & ACTIVE != 0
    }

    /// The registry's, under its lock, as its key's active connection changes.
    pub(crate) fn set_active(&self, active: bool) {
        self.set_standing(ACTIVE, active, Ordering::Release);
    }

    /// The client called this connection its home (NotePreferred).
    pub(crate) fn is_preferred(&self) -> bool {
        self.standing.load(Ordering::Relaxed) & PREFERRED != 0
    }

    /// Sets whether the client calls this connection its home; returns what it was.
    pub(crate) fn swap_preferred(&self, preferred: bool) -> bool {
        self.set_standing(PREFERRED, preferred, Ordering::Relaxed)
    }

    /// Sets or clears `bit` alone: the registry and the read loop change different bits
    /// without a common lock. Returns whether it was set.
    fn set_standing(&self, bit: u8, on: bool, order: Ordering) -> bool {
        let was = if on {
            self.standing.fetch_or(bit, order)
        } else {
            self.standing.fetch_and(!bit, order)
        };
        was & bit != 0
    }

    /// Marks the connection as handed to a successor process (or not, on a rollback).
    pub(crate) fn set_handed(&self, handed: bool) {
        self.set_standing(HANDED, handed, Ordering::Release);
    }

    /// Whether the connection was handed to a successor process.
    pub(crate) fn is_handed(&self) -> bool {
        self.standing.load(Ordering::Acquire) & HANDED != 0
    }

    /// Marks the connection as taken over from a predecessor process.
    pub(crate) fn set_adopted(&self) {
        self.set_standing(ADOPTED, true, Ordering::Release);
    }

    /// Whether the connection was taken over from a predecessor process.
    pub(crate) fn is_adopted(&self) -> bool {
        self.standing.load(Ordering::Acquire) & ADOPTED != 0
    }

    /// Marks the connection as carried over QUIC.
    pub(crate) fn set_quic(&self) {
        self.set_standing(QUIC, true, Ordering::Relaxed);
    }

    /// Whether the connection is carried over QUIC.
    pub(crate) fn is_quic(&self) -> bool {
        self.standing.load(Ordering::Relaxed) & QUIC != 0
    }

    /// Records the connection's TCP socket (see [`ConnHandle::socket_cookie`]).
    pub(crate) fn with_tcp_socket(mut self, socket: Option<TcpSocket>) -> Self {
        self.socket_cookie = socket.map(|s| s.cookie);
        self.local_port = socket.map_or(0, |s| s.port);
        self
    }

    /// The connection's TCP socket, as [`ConnHandle::with_tcp_socket`] recorded it.
    pub(crate) fn tcp_socket(&self) -> Option<TcpSocket> {
        self.socket_cookie.map(|cookie| TcpSocket {
            cookie,
            port: self.local_port,
        })
    }

    /// Ends the connection: closes its queue (later pushes are dropped as
    /// `gone_disconnected`), cancels its tasks, and resumes a parked writer so it can close
    /// the socket. Returns what was still queued, for the caller to count.
    pub(crate) fn close(&self) -> Batch {
        let (rest, parked) = self.queue.close();
        self.cancel.cancel();
        if let Some(writer) = parked {
            writer.resume();
        }
        rest
    }
}

/// A client's address as its handle keeps it: what a [`SocketAddr`] shows and PeerPresent
/// sends (the IP, the port and an IPv6 scope, not the flow label, which neither uses), in 23
/// bytes of alignment 1, which share words with the handle's one-byte fields. Beside a
/// `SocketAddr` (32 bytes of alignment 4) those took words of their own, and the handle's
/// allocation was 16 bytes past one of malloc's size classes.
#[derive(Clone, Copy)]
pub(crate) struct ClientAddr {
    ip: IpAddr,
    // Byte arrays rather than integers keep the whole of alignment 1.
    port: [u8; 2],
    scope_id: [u8; 4],
}

impl ClientAddr {
    pub(crate) fn get(self) -> SocketAddr {
        let port = u16::from_ne_bytes(self.port);
        match self.ip {
            IpAddr::V6(ip) => {
                SocketAddrV6::new(ip, port, 0, u32::from_ne_bytes(self.scope_id)).into()
            }
            ip @ IpAddr::V4(_) => SocketAddr::new(ip, port),
        }
    }
}

impl From<SocketAddr> for ClientAddr {
    fn from(addr: SocketAddr) -> Self {
        let scope_id = match addr {
            SocketAddr::V6(v6) => v6.scope_id(),
            SocketAddr::V4(_) => 0,
        };
        Self {
            ip: addr.ip(),
            port: addr.port().to_ne_bytes(),
            scope_id: scope_id.to_ne_bytes(),
        }
    }
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.get().fmt(f)
    }
}

impl fmt::Debug for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.get(), f)
    }
}

/// Where a connection stands in `derp_tcp_rtt` sampling (not seen yet, sampled, never
/// sampled) in its low bits, and above them what the period's dump said of its socket, kept
/// here rather than in the period's list of connections. Only the sampler (`tcpinfo`) reads
/// or writes it, one period at a time.
#[derive(Debug)]
pub(crate) struct RttMark(AtomicU8);

impl RttMark {
    pub(crate) const UNSEEN: u8 = 0;
    pub(crate) const SAMPLED: u8 = 1;
    pub(crate) const NOT_SAMPLED: u8 = 2;
    const STATE: u8 = 0b11;
    /// A reading is stored as its bucket plus one; 0 is none.
    const READING_SHIFT: u8 = 2;

    pub(crate) fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed) & Self::STATE
    }

    /// Sets the state and clears any reading.
    pub(crate) fn set(&self, state: u8) {
        self.0.store(state, Ordering::Relaxed);
    }

    /// The dump listed the socket, with a round-trip time in bucket `bucket` (below 15).
    pub(crate) fn note(&self, bucket: usize) {
        let reading = u8::try_from(bucket + 1).unwrap_or(0) << Self::READING_SHIFT;
        self.set(self.get() | reading);
    }

    /// What this period's dump said, cleared for the next: the bucket of the socket's RTT,
    /// or `None` if it was not listed.
    pub(crate) fn take_reading(&self) -> Option<usize> {
        let mark = self.0.load(Ordering::Relaxed);
        self.set(mark & Self::STATE);
        usize::from(mark >> Self::READING_SHIFT).checked_sub(1)
    }
}

impl Default for RttMark {
    fn default() -> Self {
        Self(AtomicU8::new(Self::UNSEEN))
    }
}

/// The switch that ends one connection's tasks.
///
/// Not a child of the server's shutdown token: a child token is a separate allocation of
/// some 130 bytes per connection, and a future waiting on one is 72 bytes in the waiting
/// task. The server ends every registered connection itself on shutdown
/// ([`crate::registry::Registry::cancel_all`]). Tasks that wait with a future (the writer)
/// queue on `waiters`; the read loop leaves only its waker in `quiet`: its quiet wait, which
/// every idle connection's task is parked in, so that wait holds no waiter of its own, and
/// its busy stretch, so that a read registers no waiter under a lock.
#[derive(Debug, Default)]
pub(crate) struct Cancel {
    cancelled: AtomicBool,
    waiters: Notify,
    quiet: Mutex<Option<Waker>>,
}

impl Cancel {
    /// Ends the connection's tasks. Idempotent.
    pub(crate) fn cancel(&self) {
        if self.cancelled.swap(true, Ordering::AcqRel) {
            return;
        }
        self.waiters.notify_waiters();
        self.wake_quiet();
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Completes once [`Cancel::cancel`] was called.
    pub(crate) async fn cancelled(&self) {
        // A nudge wakes every waiter; only a cancel ends this wait.
        while !self.is_cancelled() {
            self.cancelled_or_nudged().await;
        }
    }

    /// Completes once [`Cancel::cancel`] or [`Cancel::nudge`] was called.
    pub(crate) async fn cancelled_or_nudged(&self) {
        // Created before the flag is read: a `Notified` receives every `notify_waiters` from
        // its creation on, polled or not, so a cancel after the read completes it. Nothing
        // is locked until the first poll (once per wait, as with a cancellation token).
        let notified = self.waiters.notified();
        if self.is_cancelled() {
            return;
        }
        notified.await;
    }

    /// Wakes the task whose waker was left with [`Cancel::register_quiet`], leaving the
    /// waker there: a busy read loop registers it once per stretch, and must still be woken
    /// by a later cancel after being woken for something it then ignored.
    pub(crate) fn poke_quiet(&self) {
        let quiet = self.quiet.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = &*quiet {
            w.wake_by_ref();
        }
    }

    /// Wakes whoever waits in [`Cancel::cancelled_or_nudged`] without cancelling: a writer
    /// blocked on a full socket then looks at why (a handover freezing its connection).
    pub(crate) fn nudge(&self) {
        self.waiters.notify_waiters();
    }

    /// Leaves `waker` to be woken by [`Cancel::cancel`] or [`Cancel::wake_quiet`], for a
    /// wait that polls [`Cancel::is_cancelled`] instead of holding a future. Returns whether
    /// the connection is cancelled already (read after the waker is in place, so a cancel
    /// cannot fall between the two).
    pub(crate) fn register_quiet(&self, waker: &Waker) -> bool {
        {
            let mut slot = self.quiet.lock().unwrap_or_else(|e| e.into_inner());
            match &mut *slot {
                Some(w) if w.will_wake(waker) => {}
                slot => *slot = Some(waker.clone()),
            }
        }
        self.is_cancelled()
    }

    /// Drops the waker left by [`Cancel::register_quiet`]: a waker keeps its task's memory
    /// alive, and this handle may outlive the task in other connections' caches.
    pub(crate) fn clear_quiet(&self) {
        let waker = self.quiet.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(waker);
    }

    /// Wakes the quiet wait, if one is parked, to look at the server's state again (a
    /// graceful shutdown beginning).
    pub(crate) fn wake_quiet(&self) {
        let waker = self.quiet.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

#[cfg(test)]
impl ConnHandle {
    /// A plain client connection with key `[key; 32]`, for tests.
    pub(crate) fn for_tests(id: u64, key: u8) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self::new(
            id,
            PublicKey::from_bytes([key; 32]),
            ([127, 0, 0, 1], 1).into(),
            0,
            false,
            32,
        ))
    }
}

#[cfg(test)]
impl Cancel {
    /// Whether a quiet wait's waker is parked here.
    pub(crate) fn holds_quiet_waker(&self) -> bool {
        self.quiet
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use super::*;

    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test]
    async fn every_waiter_ends_on_cancel_and_later_ones_at_once() {
        let cancel = Cancel::default();
        let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
        let waker = Waker::from(wakes.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut waiters: Vec<_> = (0..3).map(|_| Box::pin(cancel.cancelled())).collect();
        // Polled once each: every waiter has read the flag and waits on the notification.
        for w in &mut waiters {
            assert!(w.as_mut().poll(&mut cx).is_pending());
        }
        cancel.cancel();
        cancel.cancel();
        assert_eq!(wakes.0.load(Ordering::Relaxed), 3, "one wake per waiter");
        for w in &mut waiters {
            assert!(w.as_mut().poll(&mut cx).is_ready());
        }
        assert!(cancel.is_cancelled());
        cancel.cancelled().await;
    }

    #[test]
    fn the_quiet_waker_is_woken_once_by_cancel_and_can_be_taken_back() {
        let cancel = Cancel::default();
        let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
        let waker = Waker::from(wakes.clone());

        assert!(!cancel.register_quiet(&waker));
        cancel.clear_quiet();
        assert!(!cancel.holds_quiet_waker());
        cancel.cancel();
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            0,
            "a taken-back waker is not woken"
        );

        let cancel = Cancel::default();
        assert!(!cancel.register_quiet(&waker));
        assert!(
            !cancel.register_quiet(&waker),
            "registering again is harmless"
        );
        cancel.wake_quiet();
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1);
        assert!(!cancel.holds_quiet_waker(), "a wake hands the waker over");

        assert!(!cancel.register_quiet(&waker));
        cancel.cancel();
        assert_eq!(wakes.0.load(Ordering::Relaxed), 2);
        assert!(!cancel.holds_quiet_waker());
        assert!(
            cancel.register_quiet(&waker),
            "registering after the cancel says so"
        );
    }

    /// Every registered connection is one `Arc<ConnHandle>`: the handle and 16 bytes of
    /// counts, which glibc's malloc serves with an 8-byte header in 16-byte steps. A handle
    /// of at most 328 bytes takes a 352-byte chunk, eight bytes more a 368-byte one. The
    /// address is of alignment 1 so that it packs with the one-byte fields, and the
    /// duplicate, active and preferred flags share a byte, which leaves room for the socket's
    /// local port; a field added here must be paid for in the handle
    /// (docs/bench-log/2026-12.md, "Idle connections and RTT sampling").
    #[test]
    fn a_connections_handle_fits_a_352_byte_allocation() {
        let size = size_of::<ConnHandle>();
        assert!(
            size <= 328,
            "a connection's handle is {size} bytes; at most 328 fit a 352-byte malloc chunk"
        );
        assert_eq!((size_of::<ClientAddr>(), align_of::<ClientAddr>()), (23, 1));
    }

    #[test]
    fn a_client_address_reads_and_prints_as_the_socket_address_it_came_from() {
        for addr in [
            "192.0.2.7:41641",
            "[2001:db8::1]:443",
            "[fe80::1%3]:3478",
            "[::ffff:192.0.2.7]:0",
        ] {
            let addr: SocketAddr = addr.parse().expect("address");
            let kept = ClientAddr::from(addr);
            assert_eq!(kept.get(), addr);
            assert_eq!(kept.to_string(), addr.to_string());
            assert_eq!(format!("{kept:?}"), format!("{addr:?}"));
        }
    }
}
