//! The kernel's view of the relay's TCP connections (Linux): each socket's smoothed round
//! trip time and byte counts, for `derp_tcp_rtt` and `/debug/traffic`.
//!
//! Read in one netlink `sock_diag` dump of TCP sockets with their `tcp_info` (what `ss -i`
//! reads), and matched to connections by socket cookie, which the kernel gives every socket
//! and never reuses while it runs. One dump covers every connection, so the cost is one batch
//! of system calls per sampling period, whatever the number of clients, and nothing on the
//! packet path. `getsockopt(TCP_INFO)` per socket would need the file descriptors of every
//! connection's halves, and a safe wrapper that neither `socket2` nor `rustix` offers.
//!
//! The dump asks the kernel only for sockets whose local port is one the relay's connections
//! were accepted on (an `inet_diag` bytecode filter), so the statistics of other programs'
//! connections on the host are never read, and a busy host's other sockets cost nothing.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::num::NonZeroU64;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use derp_io::Transport;
use prometheus::IntCounterVec;

use crate::handle::{ConnHandle, RttMark, TcpSocket};
use crate::registry::{ConnSummary, Registry};

mod netlink;

pub(crate) use netlink::TcpStats;
#[cfg(target_os = "linux")]
use netlink::{Answer, diag_socket, port_filter, query};

/// The TCP socket of a connection: `None` for transports that are not one TCP socket the
/// relay holds directly (QUIC, a boxed stream such as rustls's TLS 1.2).
pub(crate) fn tcp_socket(transport: &Transport) -> Option<TcpSocket> {
    let tcp = match transport {
        Transport::Tcp(s) => s,
        Transport::Tls(s) => s.tcp(),
        Transport::Boxed(_) | Transport::Halves(..) => return None,
    };
    Some(TcpSocket {
        cookie: NonZeroU64::new(socket_cookie(tcp)?)?,
        port: tcp.local_addr().ok()?.port(),
    })
}

/// The local ports of `conns`' TCP sockets: what a dump for them asks the kernel for.
pub(crate) fn ports(conns: &[ConnSummary]) -> BTreeSet<u16> {
    conns
        .iter()
        .filter_map(|c| c.tcp_socket)
        .map(|s| s.port)
        .collect()
}

#[cfg(target_os = "linux")]
fn socket_cookie(fd: impl AsFd) -> Option<u64> {
    rustix::net::sockopt::socket_cookie(fd).ok()
}

#[cfg(not(target_os = "linux"))]
fn socket_cookie(_fd: impl AsFd) -> Option<u64> {
    None
}

/// Reads the kernel's statistics of the relay's TCP sockets. Cheap to clone: the clones share
/// what was learnt about the kernel.
#[derive(Clone, Debug, Default)]
pub(crate) struct SockDiag {
    /// The kernel refused the port filter once; it would again, so later dumps ask for
    /// every socket without it and keep only the relay's ports themselves.
    filter_refused: Arc<AtomicBool>,
}

impl SockDiag {
    /// The non-listening TCP sockets whose local port is one of `ports`, by cookie, with
    /// their statistics. Blocking (a few system calls); callers run it off the runtime's
    /// workers.
    pub(crate) fn dump(&self, ports: &BTreeSet<u16>) -> io::Result<HashMap<u64, TcpStats>> {
        let mut out = HashMap::new();
        self.each(ports, |cookie, stats| {
            out.insert(cookie, stats);
        })?;
        Ok(out)
    }

    /// Notes the RTT of each of `due`'s connections (sorted by cookie, as
    /// [`RttSampler::due`] lists them) whose socket the kernel lists, from one dump of the
    /// sockets on their ports. Blocking, as [`SockDiag::dump`].
    pub(crate) fn read_rtts(&self, due: &[Due]) -> io::Result<()> {
        let ports = due.iter().map(|d| d.conn.local_port).collect();
        self.each(&ports, |cookie, stats| found(due, cookie, stats.rtt_us))
    }

    /// Hands each non-listening TCP socket whose local port is one of `ports` to `each`, as
    /// the kernel lists them, keeping none.
    fn each(&self, ports: &BTreeSet<u16>, each: impl FnMut(u64, TcpStats)) -> io::Result<()> {
        self.each_with(ports, port_filter(ports), each)
    }

    /// [`SockDiag::each`] with the filter `program` (none: read every socket).
    #[cfg(target_os = "linux")]
    fn each_with(
        &self,
        ports: &BTreeSet<u16>,
        program: Option<Vec<u8>>,
        mut each: impl FnMut(u64, TcpStats),
    ) -> io::Result<()> {
        if ports.is_empty() {
            return Ok(());
        }
        let fd = diag_socket()?;
        let program = program.filter(|_| !self.filter_refused.load(Ordering::Relaxed));
        let refused = match program {
            Some(program) => match query(&fd, Some(&program), &mut each)? {
                Answer::Listed => return Ok(()),
                Answer::Refused(why) => Some(why),
            },
            None => None,
        };
        let mut ours = |cookie, stats: TcpStats| {
            if ports.contains(&stats.port) {
                each(cookie, stats);
            }
        };
        if let Answer::Refused(e) = query(&fd, None, &mut ours)? {
            return Err(e);
        }
        // The filter is given up only once the same request without it was answered: a
        // refusal of that too says nothing about the filter.
        if let Some(why) = refused
            && !self.filter_refused.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                error = %why,
                "the kernel refused sock_diag's port filter; reading every TCP \
                 socket of the host for derp_tcp_rtt and /debug/traffic instead"
            );
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn each_with(
        &self,
        _ports: &BTreeSet<u16>,
        _program: Option<Vec<u8>>,
        _each: impl FnMut(u64, TcpStats),
    ) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "TCP statistics are read on Linux only",
        ))
    }
}

/// derper's `derp_tcp_rtt` labels: the round-trip times' buckets, then [`ERROR`].
const LABELS: [&str; 9] = [
    "10ms", "20ms", "50ms", "100ms", "150ms", "250ms", "500ms", "inf", "error",
];
const ERROR: usize = LABELS.len() - 1;

/// Where in [`LABELS`] a round-trip time is counted.
fn rtt_bucket(rtt_us: u32) -> usize {
    match rtt_us {
        0..=10_000 => 0,
        10_001..=20_000 => 1,
        20_001..=50_000 => 2,
        50_001..=100_000 => 3,
        100_001..=150_000 => 4,
        150_001..=250_000 => 5,
        250_001..=500_000 => 6,
        _ => 7,
    }
}

/// `derp_tcp_rtt` as derper counts it: each connection is checked once when first seen
/// (`non-tcp` when it is not a TCP socket the relay holds, `error` when the kernel has no
/// statistics for it, and then it is never sampled), and at every later sampling period
/// adds one to the label of its current smoothed RTT.
///
/// Where each connection stands is kept in its handle ([`RttMark`]) rather than in a map of
/// the connections seen, and a period hands the kernel's statistics of its own connections
/// straight to them ([`SockDiag::read_rtts`]): a map of the sockets dumped and one of the
/// connections, remade every period, cost an idle relay several hundred bytes per
/// connection that the allocator kept after each period.
#[derive(Debug)]
pub(crate) struct RttSampler {
    metric: IntCounterVec,
}

/// A connection whose TCP socket a sampling period reads.
#[derive(Debug)]
pub(crate) struct Due {
    cookie: u64,
    conn: Arc<ConnHandle>,
}

impl RttSampler {
    pub(crate) fn new(metric: IntCounterVec) -> Self {
        Self { metric }
    }

    /// A period's first half, under the registry lock: connections seen for the first time
    /// without a TCP socket are counted (`non-tcp`) and never looked at again; the others
    /// still sampled, or not yet seen, are listed by socket cookie for
    /// [`SockDiag::read_rtts`].
    pub(crate) fn due(&self, registry: &Registry) -> Vec<Due> {
        let mut non_tcp = 0;
        let mut due = registry.collect_conns(|conn| {
            let mark = conn.rtt_mark.get();
            match conn.socket_cookie {
                _ if mark == RttMark::NOT_SAMPLED => None,
                Some(cookie) => Some(Due {
                    cookie: cookie.get(),
                    conn: conn.clone(),
                }),
                None => {
                    non_tcp += 1;
                    conn.rtt_mark.set(RttMark::NOT_SAMPLED);
                    None
                }
            }
        });
        if non_tcp != 0 {
            self.metric.with_label_values(&["non-tcp"]).inc_by(non_tcp);
        }
        due.sort_unstable_by_key(|d| d.cookie);
        due
    }

    /// A period's second half, once [`SockDiag::read_rtts`] has read `due` (`read`: whether
    /// the kernel's statistics could be read at all).
    pub(crate) fn count(&self, due: &[Due], read: Result<(), &io::Error>) {
        let mut counts = [0u64; LABELS.len()];
        for d in due {
            let reading = d.conn.rtt_mark.take_reading().filter(|_| read.is_ok());
            match (d.conn.rtt_mark.get(), reading) {
                (RttMark::SAMPLED, Some(bucket)) => counts[bucket] += 1,
                (RttMark::UNSEEN, Some(_)) => d.conn.rtt_mark.set(RttMark::SAMPLED),
                (RttMark::UNSEEN, None) => {
                    counts[ERROR] += 1;
                    d.conn.rtt_mark.set(RttMark::NOT_SAMPLED);
                }
                // A sampled socket the kernel did not list this time, as derper skips it.
                _ => {}
            }
        }
        for (label, n) in LABELS.iter().zip(counts) {
            if n != 0 {
                self.metric.with_label_values(&[label]).inc_by(n);
            }
        }
    }
}

/// The kernel listed socket `cookie`: if it is one of `due`'s, that is its RTT.
fn found(due: &[Due], cookie: u64, rtt_us: u32) {
    if let Ok(i) = due.binary_search_by_key(&cookie, |d| d.cookie) {
        due[i].conn.rtt_mark.note(rtt_bucket(rtt_us));
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::netlink::*;
    use super::*;

    #[test]
    fn the_diag_socket_is_closed_on_exec() {
        let fd = diag_socket().expect("netlink socket");
        let flags = rustix::io::fcntl_getfd(&fd).expect("fcntl");
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
    }

    #[tokio::test]
    async fn the_dump_finds_our_sockets_with_their_byte_counts() {
        for bind in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = tokio::net::TcpListener::bind(bind).await else {
                assert!(bind.contains("::1"), "IPv4 loopback must be available");
                continue;
            };
            let addr = listener.local_addr().expect("addr");
            let (client, accepted) =
                tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
            let (mut server, _) = accepted.expect("accept");
            let mut client = client.expect("connect");
            client.write_all(&[7; 1000]).await.expect("write");
            server.read_exact(&mut [0; 1000]).await.expect("read");
            server.write_all(&[8; 300]).await.expect("write");
            client.read_exact(&mut [0; 300]).await.expect("read");
            let socket = tcp_socket(&Transport::Tcp(server)).expect("a TCP socket");
            assert_eq!(socket.port, addr.port(), "the listener's port");
            let ports = BTreeSet::from([socket.port]);
            let sockets = tokio::task::spawn_blocking(move || SockDiag::default().dump(&ports))
                .await
                .expect("task")
                .expect("dump");
            let stats = sockets
                .get(&socket.cookie.get())
                .expect("our socket is listed");
            assert_eq!(stats.bytes_received, 1000, "{bind}");
            assert_eq!(stats.bytes_sent, 300, "{bind}");
            assert!(stats.rtt_us < 1_000_000, "{bind}: {stats:?}");
        }
    }

    /// A connected pair on a new listener: (its port, the accepted socket, the client's).
    fn connected_pair(bind: &str) -> io::Result<(u16, std::net::TcpStream, std::net::TcpStream)> {
        let listener = std::net::TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let client = std::net::TcpStream::connect(addr)?;
        let (accepted, _) = listener.accept()?;
        Ok((addr.port(), accepted, client))
    }

    fn cookie_of(socket: &std::net::TcpStream) -> u64 {
        socket_cookie(socket).expect("cookie")
    }

    /// The cookies of the sockets that `diag` hands over for `ports`, with the filter
    /// `program`.
    fn listed(
        diag: &SockDiag,
        ports: &BTreeSet<u16>,
        program: Option<Vec<u8>>,
    ) -> io::Result<std::collections::HashSet<u64>> {
        let mut cookies = std::collections::HashSet::new();
        diag.each_with(ports, program, |cookie, _| {
            cookies.insert(cookie);
        })?;
        Ok(cookies)
    }

    #[test]
    fn the_dump_holds_the_relays_ports_and_no_other_programs_sockets() {
        for bind in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(ours) = connected_pair(bind) else {
                assert!(bind.contains("::1"), "IPv4 loopback must be available");
                continue;
            };
            // A second listener of the relay (TLS beside plain, say), and another program's
            // connection on a port of its own.
            let ours_too = connected_pair(bind).expect("a second pair");
            let theirs = connected_pair(bind).expect("another program's pair");
            // The ports next to the other program's, and more, make a long program whose
            // comparisons must be exact.
            let mut ports = BTreeSet::from([ours.0, ours_too.0]);
            ports.extend([theirs.0 - 1, theirs.0 + 1]);
            ports.extend(1..40);
            ports.remove(&theirs.0);
            let diag = SockDiag::default();
            let sockets = listed(&diag, &ports, port_filter(&ports)).expect("dump");
            assert!(sockets.contains(&cookie_of(&ours.1)), "{bind}: ours");
            assert!(
                sockets.contains(&cookie_of(&ours_too.1)),
                "{bind}: ours too"
            );
            for (what, socket) in [
                ("the other program's accepted socket", &theirs.1),
                ("the other program's client", &theirs.2),
                ("the client end of ours, on a port of its own", &ours.2),
            ] {
                assert!(
                    !sockets.contains(&cookie_of(socket)),
                    "{bind}: {what} was read"
                );
            }
            assert!(
                !diag.filter_refused.load(Ordering::Relaxed),
                "the kernel took the filter"
            );
        }
    }

    #[test]
    fn more_ports_than_one_request_holds_are_sorted_here() {
        let ours = connected_pair("127.0.0.1:0").expect("pair");
        let theirs = connected_pair("127.0.0.1:0").expect("another program's pair");
        let mut ports: BTreeSet<u16> = (1..=u16::MAX).collect();
        ports.remove(&theirs.0);
        assert!(port_filter(&ports).is_none(), "too long for one attribute");
        assert!(port_filter(&BTreeSet::new()).is_none());
        let sockets = listed(&SockDiag::default(), &ports, None).expect("dump");
        assert!(sockets.contains(&cookie_of(&ours.1)));
        assert!(!sockets.contains(&cookie_of(&theirs.1)));
    }

    /// Log lines written while a test runs its closure on this thread.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_refused_filter_falls_back_to_the_whole_dump_with_one_warning() {
        let ours = connected_pair("127.0.0.1:0").expect("pair");
        let theirs = connected_pair("127.0.0.1:0").expect("another program's pair");
        let diag = SockDiag::default();
        let ports = BTreeSet::from([ours.0]);
        // An operation code no kernel knows: the request is refused (EINVAL).
        let refused = vec![255, 4, 4, 0];
        let captured = Captured::default();
        let logger = tracing_subscriber::fmt()
            .with_writer({
                let captured = captured.clone();
                move || captured.clone()
            })
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(logger, || {
            for round in 0..3 {
                let sockets = listed(&diag, &ports, Some(refused.clone()))
                    .expect("the dump without the filter");
                assert!(sockets.contains(&cookie_of(&ours.1)), "round {round}");
                assert!(
                    !sockets.contains(&cookie_of(&theirs.1))
                        && !sockets.contains(&cookie_of(&theirs.2)),
                    "round {round}: another program's sockets are left out here instead"
                );
            }
        });
        assert!(diag.filter_refused.load(Ordering::Relaxed));
        let logs = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(
            logs.matches("WARN").count(),
            1,
            "one warning, not one per period: {logs}"
        );
        assert!(logs.contains("refused"), "{logs}");
    }

    #[tokio::test]
    async fn a_dump_longer_than_one_read_lists_every_socket() {
        let mut pairs = Vec::new();
        for _ in 0..100 {
            pairs.push(loopback_pair().await);
        }
        // Both ends of every pair, each on a port of its own: 200 ports, and as many
        // sockets.
        let sockets: Vec<(u64, u16)> = pairs
            .iter()
            .flat_map(|(a, b)| [a, b])
            .map(|s| {
                let port = s.local_addr().expect("addr").port();
                (socket_cookie(s).expect("cookie"), port)
            })
            .collect();
        let ports = sockets.iter().map(|&(_, port)| port).collect();
        let mut listed = Vec::new();
        SockDiag::default()
            .each(&ports, |cookie, _| listed.push(cookie))
            .expect("dump");
        assert!(
            listed.len() * (NLMSG_HDR_LEN + DIAG_MSG_LEN) > DUMP_READ,
            "{} sockets fit one read",
            listed.len()
        );
        for (cookie, _) in sockets {
            assert!(listed.contains(&cookie), "socket {cookie} listed");
        }
    }

    async fn loopback_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"));
        let (client, accepted) = tokio::join!(client, listener.accept());
        (accepted.expect("accept").0, client.expect("connect"))
    }

    /// A connection of key `id` registered in `registry`, with TCP socket `socket`.
    fn registered(registry: &Registry, id: u8, socket: Option<TcpSocket>) -> Arc<ConnHandle> {
        let conn = Arc::new(
            ConnHandle::new(
                u64::from(id),
                derp_proto::PublicKey::from_bytes([id; 32]),
                ([127, 0, 0, 1], 1).into(),
                0,
                false,
                8,
            )
            .with_tcp_socket(socket),
        );
        registry.register(&conn);
        conn
    }

    /// A socket of cookie `cookie` (0: none) on the relay's port.
    fn socket(cookie: u64) -> Option<TcpSocket> {
        NonZeroU64::new(cookie).map(|cookie| TcpSocket { cookie, port: 443 })
    }

    fn registry() -> Registry {
        let metrics = crate::Metrics::new(&prometheus::Registry::new()).expect("metrics");
        Registry::new(metrics, derp_proto::PublicKey::from_bytes([0; 32]))
    }

    #[test]
    fn each_connection_is_checked_once_then_sampled_every_period() {
        let metric = IntCounterVec::new(prometheus::Opts::new("derp_tcp_rtt", "rtt"), &["le"])
            .expect("metric");
        let sampler = RttSampler::new(metric.clone());
        let registry = registry();
        // The kernel knows sockets 11 and 12 (and one that is not the relay's).
        let period = |read: Result<(), &io::Error>| {
            let due = sampler.due(&registry);
            for (cookie, rtt_us) in [(12, 120_000), (7, 1), (11, 30)] {
                found(&due, cookie, rtt_us);
            }
            sampler.count(&due, read);
            due.len()
        };
        let conns =
            [(1, 11), (2, 12), (3, 0), (4, 99)].map(|(id, c)| registered(&registry, id, socket(c)));
        let count = |label: &str| metric.with_label_values(&[label]).get();
        assert_eq!(
            period(Ok(())),
            3,
            "every TCP connection is read when first seen"
        );
        assert_eq!((count("non-tcp"), count("error"), count("10ms")), (1, 1, 0));
        assert_eq!(period(Ok(())), 2, "only sampled connections are read again");
        period(Ok(()));
        assert_eq!((count("10ms"), count("150ms")), (2, 2));
        assert_eq!((count("non-tcp"), count("error")), (1, 1), "counted once");

        for conn in &conns[1..] {
            registry.unregister(conn);
        }
        let late = registered(&registry, 5, socket(13));
        let failed = io::Error::other("no netlink");
        assert_eq!(
            period(Err(&failed)),
            2,
            "connections that left are not read"
        );
        assert_eq!((count("10ms"), count("error")), (2, 2));
        assert_eq!(late.rtt_mark.get(), RttMark::NOT_SAMPLED);
        assert_eq!(conns[0].rtt_mark.get(), RttMark::SAMPLED);
    }

    #[tokio::test]
    async fn a_period_reads_its_connections_rtt_from_the_kernel() {
        let (server, _client) = loopback_pair().await;
        let registry = registry();
        let server = Transport::Tcp(server);
        let conn = registered(&registry, 1, tcp_socket(&server));
        let sampler = RttSampler::new(
            IntCounterVec::new(prometheus::Opts::new("derp_tcp_rtt", "rtt"), &["le"])
                .expect("metric"),
        );
        let due = sampler.due(&registry);
        let due =
            tokio::task::spawn_blocking(move || SockDiag::default().read_rtts(&due).map(|()| due))
                .await
                .expect("task")
                .expect("dump");
        assert!(Arc::ptr_eq(&due[0].conn, &conn));
        sampler.count(&due, Ok(()));
        assert_eq!(
            conn.rtt_mark.get(),
            RttMark::SAMPLED,
            "our socket is listed"
        );
    }

    /// A sampling period lists every TCP connection, and the allocator keeps the list's
    /// memory after it: 16 bytes a connection, its RTT noted in the connection's mark.
    #[test]
    fn a_period_lists_each_connection_in_16_bytes() {
        assert_eq!(size_of::<Due>(), 16);
    }

    #[test]
    fn labels_are_derpers() {
        let label = |rtt_us| LABELS[rtt_bucket(rtt_us)];
        assert_eq!(label(0), "10ms");
        assert_eq!(label(10_000), "10ms");
        assert_eq!(label(10_001), "20ms");
        assert_eq!(label(150_000), "150ms");
        assert_eq!(label(500_000), "500ms");
        assert_eq!(label(500_001), "inf");
    }

    #[test]
    fn broken_messages_are_errors_not_panics() {
        let mut msg = dump_request(1, AF_INET, None).expect("request");
        msg[0] = 200;
        assert!(Messages(&msg).next().expect("one").is_err());
        let mut short = dump_request(1, AF_INET, None).expect("request");
        short[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert!(Messages(&short).next().expect("one").is_err());
        assert!(Messages(&[1, 2, 3]).next().is_none());
    }
}
