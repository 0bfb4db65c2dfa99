//! The byte streams a DERP connection runs over, for the server and the client alike, split
//! into independently owned halves so a reader and a writer can run as separate tasks.
//!
//! What it does: the [`Transport`] enum (plain TCP, TLS 1.3 over TCP with derpd's own record
//! layer, any boxed stream such as rustls's TLS 1.2 or a hyper upgrade, or a pair of
//! separately owned halves such as a QUIC stream's), its lock-free split into [`ReadHalf`]
//! and [`WriteHalf`], the socket options a relay connection wants ([`TcpOptions`], set by
//! [`tune_socket`], or [`tune_listener`] once for every connection a listener accepts, and
//! the descriptor limit a program with many connections raises, [`raise_descriptor_limit`]), the
//! TLS 1.3 record layer that takes over from rustls after the handshake, whose state can be
//! copied out to hand a live connection to another process ([`tls`]), a way to drop either
//! half without a word to the peer or a `shutdown(2)` of the socket ([`ReadHalf::forget`],
//! [`WriteHalf::forget`]), and the QUIC transport settings both ends of DERP over QUIC
//! share, its congestion controllers among them, with the QUIC stream's send half that takes
//! a vectored write in one call ([`quic`]).
//!
//! What it does not do: framing, HTTP, certificates, or anything else above the byte stream;
//! the TLS handshake itself is rustls's, and QUIC itself is quinn's. Nor does it pass a
//! socket or a state to another process: it copies the state out and takes it back in.
//!
//! Plain TCP and TLS 1.3 are kept unboxed in the halves' sense: they split without a lock, and
//! the read loop can wait for readability before it allocates a buffer, so an idle connection
//! holds no read buffer (and no record buffer) at all. Anything else is boxed.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

pub mod quic;
pub mod tls;

use tls::{TlsRead, TlsStream, TlsWrite};

/// The TCP options a relay connection is given besides `TCP_NODELAY`: derper's
/// `-tcp-keepalive-time` and `-tcp-user-timeout`. [`TcpOptions::default`] is derper's
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Idle time before the kernel's first keepalive probe; `None` leaves keepalive off. Set
    /// in whole seconds, rounded up (at least one). Probes then follow every
    /// [`KEEPALIVE_INTERVAL`] and give up after [`KEEPALIVE_COUNT`], as Go's defaults do.
    /// Long by default to spare mobile clients' batteries: DERP has its own keepalive frames.
    pub keepalive_idle: Option<Duration>,
    /// `TCP_USER_TIMEOUT` (Linux): how long sent data may stay unacknowledged, probes
    /// included, before the kernel drops the connection, so a peer that vanished without a
    /// FIN or RST is noticed even while nothing is written to it. Whole milliseconds; `None`
    /// (or under a millisecond) leaves the kernel's default (off).
    pub user_timeout: Option<Duration>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            keepalive_idle: Some(Duration::from_secs(600)),
            user_timeout: Some(Duration::from_secs(15)),
        }
    }
}

/// Seconds between keepalive probes once they start (Go's default, which derper keeps).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
/// Unanswered keepalive probes before the connection is dropped (Go's default).
pub const KEEPALIVE_COUNT: u32 = 9;
/// The longest keepalive idle time Linux takes (`MAX_TCP_KEEPIDLE`, about 9 hours); a
/// longer one is held as this.
pub const MAX_KEEPALIVE_IDLE: Duration = Duration::from_secs(32_767);

impl TcpOptions {
    /// The keepalive idle time as the kernel holds it: whole seconds, rounded up, and at
    /// most [`MAX_KEEPALIVE_IDLE`], which Linux refuses to go beyond.
    fn idle_secs(&self) -> Option<Duration> {
        self.keepalive_idle.map(|d| {
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            Duration::from_secs(secs.clamp(1, MAX_KEEPALIVE_IDLE.as_secs()))
        })
    }

    /// The user timeout as the kernel holds it: whole milliseconds, zero meaning off.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn user_timeout_millis(&self) -> Option<Duration> {
        self.user_timeout
            .map(|d| Duration::from_millis(d.as_millis().min(u128::from(u32::MAX)) as u64))
            .filter(|d| !d.is_zero())
    }

    fn keepalive(&self) -> Option<socket2::TcpKeepalive> {
        let keepalive = socket2::TcpKeepalive::new().with_time(self.idle_secs()?);
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let keepalive = keepalive
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_COUNT);
        Some(keepalive)
    }

    /// Sets every option on `sock`; one the system refuses does not keep the others from
    /// being set. Returns the first refusal.
    fn set(&self, sock: &socket2::SockRef<'_>) -> io::Result<()> {
        let nodelay = sock.set_tcp_nodelay(true);
        let keepalive = match self.keepalive() {
            Some(keepalive) => sock.set_tcp_keepalive(&keepalive),
            None => sock.set_keepalive(false),
        };
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let user_timeout = sock.set_tcp_user_timeout(self.user_timeout_millis());
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let user_timeout = Ok(());
        nodelay.and(keepalive).and(user_timeout)
    }
}

/// Sets the socket options a relay connection needs, as derper does: `TCP_NODELAY` (relayed
/// packets must not wait for Nagle), and `options`' keepalive and user timeout. Failures are
/// ignored: the connection still works without them.
pub fn tune_socket(stream: &TcpStream, options: &TcpOptions) {
    let _ = options.set(&socket2::SockRef::from(stream));
}

/// Raises this process's soft limit on open descriptors to the hard one, as Go's runtime
/// does at start for every Go program (derper among them): each connection is a
/// descriptor, and a shell's usual soft limit of 1,024 would refuse connections far below
/// the hard limit the system (or a unit's `LimitNOFILE`) allows. For a program's start, a
/// relay's or a load generator's. Returns the soft limit before and after when it changed;
/// a limit that cannot be raised is left as it is.
pub fn raise_descriptor_limit() -> Option<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    // `None` is "unlimited": a hard limit Linux does not give descriptors in practice, and
    // no number to raise the soft one to.
    let (Some(current), Some(maximum)) = (limit.current, limit.maximum) else {
        return None;
    };
    if current >= maximum {
        return None;
    }
    let raised = Rlimit {
        current: Some(maximum),
        maximum: Some(maximum),
    };
    setrlimit(Resource::Nofile, raised).ok()?;
    Some((current, maximum))
}

/// Sets [`tune_socket`]'s options on a listening socket, where Linux copies them into every
/// connection it accepts (the accepted socket is a clone of the listener's, and none of these
/// options is reset on the way): several system calls once instead of per connection, which
/// is a measurable share of a reconnect storm. Returns whether accepted connections carry
/// them; when it returns false (another system, or an option the listener refused), call
/// [`tune_socket`] on each accepted connection instead. [`is_tuned`] checks a connection.
pub fn tune_listener(listener: &tokio::net::TcpListener, options: &TcpOptions) -> bool {
    #[cfg(target_os = "linux")]
    {
        options.set(&socket2::SockRef::from(listener)).is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (listener, options);
        false
    }
}

/// Whether a connection carries every option [`tune_socket`] sets (several system calls: use
/// it to check what a listener passed on, not on every connection).
pub fn is_tuned(stream: &TcpStream, options: &TcpOptions) -> bool {
    let sock = socket2::SockRef::from(stream);
    let keepalive = match options.idle_secs() {
        None => sock.keepalive().ok() == Some(false),
        Some(idle) => {
            let probes = {
                #[cfg(any(target_os = "linux", target_os = "android"))]
                {
                    sock.tcp_keepalive_interval().ok() == Some(KEEPALIVE_INTERVAL)
                        && sock.tcp_keepalive_retries().ok() == Some(KEEPALIVE_COUNT)
                }
                #[cfg(not(any(target_os = "linux", target_os = "android")))]
                {
                    true
                }
            };
            sock.keepalive().ok() == Some(true)
                && sock.tcp_keepalive_time().ok() == Some(idle)
                && probes
        }
    };
    let user_timeout = {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            sock.tcp_user_timeout().ok() == Some(options.user_timeout_millis())
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            true
        }
    };
    stream.nodelay().unwrap_or(false) && keepalive && user_timeout
}

/// A stream other than plain TCP.
pub trait BoxedIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> BoxedIo for T {}

/// The receiving half of a stream that comes already split (a QUIC stream).
pub trait BoxedRead: AsyncRead + Send + Unpin + 'static {}

impl<T: AsyncRead + Send + Unpin + 'static> BoxedRead for T {}

/// The sending half of a stream that comes already split (a QUIC stream).
pub trait BoxedWrite: AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncWrite + Send + Unpin + 'static> BoxedWrite for T {}

/// A connection's byte stream.
pub enum Transport {
    /// Plain TCP.
    Tcp(TcpStream),
    /// TLS 1.3 over TCP, records sealed and opened by [`tls`].
    Tls(Box<TlsStream>),
    /// Any other stream.
    Boxed(Box<dyn BoxedIo>),
    /// A stream whose two directions are separate objects (a QUIC stream's receive and send
    /// halves): split without a lock.
    Halves(Box<dyn BoxedRead>, Box<dyn BoxedWrite>),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(s) => f.debug_tuple("Tcp").field(s).finish(),
            Self::Tls(s) => f.debug_tuple("Tls").field(s.tcp()).finish(),
            Self::Boxed(_) => f.write_str("Boxed"),
            Self::Halves(..) => f.write_str("Halves"),
        }
    }
}

impl Transport {
    /// Sets `TCP_NODELAY` where the stream is plain TCP; relayed packets must not wait for
    /// Nagle's algorithm. (A TLS stream's socket is configured before it is boxed.)
    pub fn set_nodelay(&self) {
        if let Self::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }

    /// Splits the stream so reading and writing can proceed on different tasks.
    pub fn split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Self::Tcp(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Self::Tls(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tls(Box::new(r)), WriteHalf::Tls(Box::new(w)))
            }
            Self::Boxed(b) => {
                let (r, w) = tokio::io::split(b);
                (ReadHalf::Boxed(r), WriteHalf::Boxed(w))
            }
            Self::Halves(r, w) => (ReadHalf::Halves(r), WriteHalf::Halves(w)),
        }
    }
}

/// The read half of a [`Transport`].
pub enum ReadHalf {
    /// Plain TCP, split without a lock.
    Tcp(OwnedReadHalf),
    /// TLS 1.3, split without a lock.
    Tls(Box<TlsRead>),
    /// Any other stream, split through tokio's lock.
    Boxed(tokio::io::ReadHalf<Box<dyn BoxedIo>>),
    /// The receiving half of a stream that came split.
    Halves(Box<dyn BoxedRead>),
}

impl std::fmt::Debug for ReadHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcp(_) => "ReadHalf::Tcp",
            Self::Tls(_) => "ReadHalf::Tls",
            Self::Boxed(_) => "ReadHalf::Boxed",
            Self::Halves(_) => "ReadHalf::Halves",
        })
    }
}

impl ReadHalf {
    /// Whether [`ReadHalf::ready`] really waits for the socket (plain TCP, TLS 1.3), rather
    /// than returning at once because the stream cannot tell without reading.
    pub fn tells_readiness(&self) -> bool {
        matches!(self, Self::Tcp(_) | Self::Tls(_))
    }

    /// Drops the half without touching the connection, for a connection handed to another
    /// process: no reading half's drop does anything but close (see [`WriteHalf::forget`]).
    pub fn forget(self) {
        match self {
            Self::Tls(r) => r.forget(),
            Self::Tcp(_) | Self::Boxed(_) | Self::Halves(_) => {}
        }
    }

    /// Gives back buffers the stream holds while nothing is buffered in them (TLS 1.3's
    /// record buffer), so an idle connection keeps none.
    pub fn release_idle(&mut self) {
        if let Self::Tls(r) = self {
            r.release_idle();
        }
    }

    /// Waits until a read would make progress, where the stream can tell without reading.
    ///
    /// Polls the socket's read readiness directly rather than awaiting `readable()`: the
    /// waker goes into the socket's own slot, so the wait has no state of its own (a
    /// `readable()` future is a waiter node of some 180 bytes, in every idle connection's
    /// task) and no waiter list is locked on every wait.
    pub async fn ready(&mut self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_ready(cx)).await
    }

    /// Like [`ReadHalf::poll_ready`], but ready only when a read would return bytes or the
    /// end of the stream, which a one-byte peek checks (one system call).
    ///
    /// Readiness alone can be stale: it stays set until a read meets `WouldBlock` or comes
    /// back short, so a socket not read yet, or one whose last read exactly filled its
    /// buffer, still says readable with nothing to read. A wait that parks a connection for
    /// long, and frees its read state while parked, uses this so that it is not woken at
    /// once for nothing (and then kept busy for a keepalive period).
    pub fn poll_readable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Self::Tcp(r) => poll_peek_one(r.as_ref(), cx),
            Self::Tls(r) => r.poll_readable(cx),
            Self::Boxed(_) | Self::Halves(_) => Poll::Ready(Ok(())),
        }
    }

    /// The TCP socket under this half, plain or under derpd's TLS records, to pass the
    /// connection to another process; `None` for any other stream, whose state is not only
    /// in the kernel and the relay.
    pub fn tcp_socket(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match self {
            Self::Tcp(r) => {
                let stream: &TcpStream = r.as_ref();
                Some(stream.as_fd())
            }
            Self::Tls(r) => Some(r.tcp().as_fd()),
            Self::Boxed(_) | Self::Halves(_) => None,
        }
    }

    /// A half that holds no stream and reads as ended: what is left in a reader whose
    /// half was lent out (to a handover) until it is given back. Allocates nothing.
    pub fn vacant() -> Self {
        Self::Halves(Box::new(tokio::io::empty()))
    }

    /// [`ReadHalf::ready`] as a poll, for a caller's own hand-written wait.
    pub fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Self::Tcp(r) => {
                let stream: &TcpStream = r.as_ref();
                stream.poll_read_ready(cx)
            }
            Self::Tls(r) => r.poll_ready(cx),
            Self::Boxed(_) | Self::Halves(_) => Poll::Ready(Ok(())),
        }
    }
}

/// Ready once `stream` has a byte to read or has reached its end; registers for readiness
/// (and clears a stale report) otherwise.
fn poll_peek_one(stream: &TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    let mut byte = [std::mem::MaybeUninit::uninit()];
    let mut buf = ReadBuf::uninit(&mut byte);
    stream.poll_peek(cx, &mut buf).map_ok(|_| ())
}

/// The write half of a [`Transport`].
pub enum WriteHalf {
    /// Plain TCP, split without a lock.
    Tcp(OwnedWriteHalf),
    /// TLS 1.3, split without a lock.
    Tls(Box<TlsWrite>),
    /// Any other stream, split through tokio's lock.
    Boxed(tokio::io::WriteHalf<Box<dyn BoxedIo>>),
    /// The sending half of a stream that came split.
    Halves(Box<dyn BoxedWrite>),
}

impl std::fmt::Debug for WriteHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcp(_) => "WriteHalf::Tcp",
            Self::Tls(_) => "WriteHalf::Tls",
            Self::Boxed(_) => "WriteHalf::Boxed",
            Self::Halves(_) => "WriteHalf::Halves",
        })
    }
}

impl WriteHalf {
    /// Drops the half without a word to the peer and, for plain TCP and TLS 1.3, without the
    /// `shutdown(2)` of the socket's sending side their drop makes: the socket is closed
    /// with a plain `close(2)` once the reading half is gone too, which leaves a duplicate
    /// of it (the process a connection was handed to holds one) open and untouched. Nothing
    /// still buffered is written (TLS 1.3's sealed records go with
    /// [`tls::TlsWrite::snapshot`]). Other streams are dropped as they are: none of them is
    /// handed over.
    pub fn forget(self) {
        match self {
            Self::Tcp(w) => w.forget(),
            Self::Tls(w) => w.forget(),
            Self::Boxed(_) | Self::Halves(_) => {}
        }
    }

    /// Gives back buffers the stream holds while they are empty (TLS 1.3's record buffer),
    /// so an idle connection keeps none.
    pub fn shrink_idle(&mut self) {
        if let Self::Tls(w) = self {
            w.shrink_idle();
        }
    }
}

/// Implements `AsyncRead` for an enum by delegating to the stream each pattern binds to `$s`.
macro_rules! delegate_async_read {
    ($ty:ty, $s:ident: $($p:pat),+) => {
        impl AsyncRead for $ty {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($p => Pin::new($s).poll_read(cx, buf),)+
                }
            }
        }
    };
}

/// Implements `AsyncWrite` (vectored writes included) for an enum by delegating to the
/// stream each pattern binds to `$s`.
macro_rules! delegate_async_write {
    ($ty:ty, $s:ident: $($p:pat),+) => {
        impl AsyncWrite for $ty {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $($p => Pin::new($s).poll_write(cx, buf),)+
                }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $($p => Pin::new($s).poll_write_vectored(cx, bufs),)+
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $($p => $s.is_write_vectored(),)+
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($p => Pin::new($s).poll_flush(cx),)+
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $($p => Pin::new($s).poll_shutdown(cx),)+
                }
            }
        }
    };
}

delegate_async_read!(Transport, s: Self::Tcp(s), Self::Tls(s), Self::Boxed(s), Self::Halves(s, _));
delegate_async_write!(Transport, s: Self::Tcp(s), Self::Tls(s), Self::Boxed(s), Self::Halves(_, s));
delegate_async_read!(ReadHalf, s: Self::Tcp(s), Self::Tls(s), Self::Boxed(s), Self::Halves(s));
delegate_async_write!(WriteHalf, s: Self::Tcp(s), Self::Tls(s), Self::Boxed(s), Self::Halves(s));

#[cfg(test)]
mod tests {
    use super::*;

    async fn accept_one(listener: &tokio::net::TcpListener) -> (TcpStream, TcpStream) {
        let addr = listener.local_addr().expect("listener address");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.expect("connect"), accepted.expect("accept").0)
    }

    #[tokio::test]
    async fn accepted_sockets_carry_the_listeners_options_on_linux() {
        let options = TcpOptions::default();
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let (_client, accepted) = accept_one(&plain).await;
        // The kernel's defaults are not what a relay wants, so the check below can fail.
        assert!(!is_tuned(&accepted, &options));
        tune_socket(&accepted, &options);
        assert!(is_tuned(&accepted, &options));

        let tuned = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let inherited = tune_listener(&tuned, &options);
        assert_eq!(inherited, cfg!(target_os = "linux"));
        if inherited {
            for _ in 0..3 {
                let (_client, accepted) = accept_one(&tuned).await;
                assert!(is_tuned(&accepted, &options));
            }
        }
    }

    /// What the kernel holds for an accepted socket, read back with getsockopt.
    #[cfg(target_os = "linux")]
    fn read_back(stream: &TcpStream) -> (bool, bool, Duration, Duration, u32, Option<Duration>) {
        let sock = socket2::SockRef::from(stream);
        (
            stream.nodelay().expect("nodelay"),
            sock.keepalive().expect("keepalive"),
            sock.tcp_keepalive_time().expect("idle"),
            sock.tcp_keepalive_interval().expect("interval"),
            sock.tcp_keepalive_retries().expect("count"),
            sock.tcp_user_timeout().expect("user timeout"),
        )
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_options_given_are_the_options_set() {
        let custom = TcpOptions {
            // Rounded up to whole seconds, as Go does.
            keepalive_idle: Some(Duration::from_millis(4_200)),
            user_timeout: Some(Duration::from_millis(2_500)),
        };
        let off = TcpOptions {
            keepalive_idle: None,
            user_timeout: None,
        };
        for via_listener in [false, true] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            if via_listener {
                assert!(tune_listener(&listener, &custom));
            }
            let (_client, accepted) = accept_one(&listener).await;
            if !via_listener {
                tune_socket(&accepted, &custom);
            }
            let (nodelay, keepalive, idle, interval, count, user) = read_back(&accepted);
            assert!(nodelay && keepalive, "via listener: {via_listener}");
            assert_eq!(idle, Duration::from_secs(5));
            assert_eq!(interval, Duration::from_secs(15));
            assert_eq!(count, 9);
            assert_eq!(user, Some(Duration::from_millis(2_500)));
            assert!(is_tuned(&accepted, &custom));
            assert!(!is_tuned(&accepted, &TcpOptions::default()));

            // Turned off again: no keepalive, the kernel's user timeout (none).
            tune_socket(&accepted, &off);
            let (_, keepalive, _, _, _, user) = read_back(&accepted);
            assert!(!keepalive);
            assert_eq!(user, None);
            assert!(is_tuned(&accepted, &off));
        }
    }

    /// A forgotten plain TCP connection leaves a duplicate of its socket as it was: the peer
    /// reads what the duplicate writes. Dropped, its write half shuts the socket's sending
    /// side down under the duplicate, and the peer reads the end of the stream.
    #[tokio::test]
    async fn forgotten_halves_leave_a_duplicate_of_the_socket_untouched() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        for forget in [true, false] {
            let (mut client, accepted) = accept_one(&listener).await;
            let std = socket2::SockRef::from(&accepted).try_clone().expect("dup");
            let mut dup = TcpStream::from_std(std.into()).expect("register");
            let (r, w) = Transport::Tcp(accepted).split();
            if forget {
                r.forget();
                w.forget();
            } else {
                drop((r, w));
            }
            // Refused once the sending side is shut down: the peer's read tells.
            let _ = dup.write_all(b"still here").await;
            let mut got = [0u8; 10];
            let read = client.read_exact(&mut got).await;
            if forget {
                read.expect("the duplicate's bytes");
                assert_eq!(&got, b"still here");
            } else {
                let e = read.expect_err("the end of the stream");
                assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
            }
        }
    }

    #[tokio::test]
    async fn an_idle_time_beyond_the_kernels_limit_is_held_at_it_and_the_rest_is_set() {
        let long = TcpOptions {
            keepalive_idle: Some(Duration::from_secs(36_000)),
            user_timeout: Some(Duration::from_millis(2_500)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        assert!(tune_listener(&listener, &long));
        let (_client, accepted) = accept_one(&listener).await;
        let (nodelay, keepalive, idle, _, _, user) = read_back(&accepted);
        assert!(nodelay && keepalive);
        assert_eq!(idle, MAX_KEEPALIVE_IDLE);
        assert_eq!(user, Some(Duration::from_millis(2_500)));
        assert!(is_tuned(&accepted, &long));
    }
}
