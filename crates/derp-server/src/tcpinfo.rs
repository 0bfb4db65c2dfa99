//! The kernel's view of the relay's TCP connections (Linux): each socket's smoothed round
//! trip time and byte counts, for `derp_tcp_rtt` and `/debug/traffic`.
//!
//! Read in one netlink `sock_diag` dump of the host's TCP sockets with their `tcp_info`
//! (what `ss -i` reads), and matched to connections by socket cookie, which the kernel gives
//! every socket and never reuses while it runs. One dump covers every connection, so the
//! cost is one batch of system calls per sampling period, whatever the number of clients,
//! and nothing on the packet path. `getsockopt(TCP_INFO)` per socket would need the file
//! descriptors of every connection's halves, and a safe wrapper that neither `socket2` nor
//! `rustix` offers.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;

use derp_io::Transport;
use prometheus::IntCounterVec;

use crate::registry::ConnSummary;

/// What the kernel says about one TCP socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcpStats {
    /// `tcpi_rtt`: smoothed round-trip time, in microseconds.
    pub(crate) rtt_us: u32,
    /// `tcpi_bytes_sent` (Linux 4.19 and later; else `tcpi_bytes_acked`).
    pub(crate) bytes_sent: u64,
    /// `tcpi_bytes_received`.
    pub(crate) bytes_received: u64,
}

/// The socket cookie of a connection's TCP socket: `None` for transports that are not one
/// TCP socket the relay holds directly (QUIC, a boxed stream such as rustls's TLS 1.2).
pub(crate) fn cookie(transport: &Transport) -> Option<u64> {
    let tcp = match transport {
        Transport::Tcp(s) => s,
        Transport::Tls(s) => s.tcp(),
        Transport::Boxed(_) | Transport::Halves(..) => return None,
    };
    socket_cookie(tcp)
}

#[cfg(target_os = "linux")]
fn socket_cookie(fd: impl AsFd) -> Option<u64> {
    rustix::net::sockopt::socket_cookie(fd).ok()
}

#[cfg(not(target_os = "linux"))]
fn socket_cookie(_fd: impl AsFd) -> Option<u64> {
    None
}

/// Every TCP socket of the host that is not listening, by cookie. Blocking (a few system
/// calls); callers run it off the runtime's workers.
#[cfg(target_os = "linux")]
pub(crate) fn dump() -> io::Result<HashMap<u64, TcpStats>> {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};

    let fd = rustix::net::socket(
        AddressFamily::NETLINK,
        SocketType::RAW,
        Some(netlink::SOCK_DIAG),
    )?;
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    for (seq, family) in [(1u32, AF_INET), (2, AF_INET6)] {
        rustix::net::send(&fd, &dump_request(seq, family), SendFlags::empty())?;
        'messages: loop {
            let (n, _) = rustix::net::recv(&fd, &mut buf[..], RecvFlags::empty())?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "sock_diag: no answer",
                ));
            }
            for msg in Messages(&buf[..n]) {
                match msg? {
                    Message::Done => break 'messages,
                    Message::Socket { cookie, stats } => {
                        out.insert(cookie, stats);
                    }
                    Message::Other => {}
                }
            }
        }
    }
    Ok(out)
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn dump() -> io::Result<HashMap<u64, TcpStats>> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "TCP statistics are read on Linux only",
    ))
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IPPROTO_TCP: u8 = 6;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// The `INET_DIAG_INFO` attribute carries `struct tcp_info`.
const INET_DIAG_INFO: u16 = 2;
const TCP_LISTEN: u32 = 10;
const NLMSG_HDR_LEN: usize = 16;
/// `struct inet_diag_msg`.
const DIAG_MSG_LEN: usize = 72;

/// A dump request (`inet_diag_req_v2`) for every non-listening TCP socket of `family`,
/// with `tcp_info`.
fn dump_request(seq: u32, family: u8) -> Vec<u8> {
    let mut req = Vec::with_capacity(NLMSG_HDR_LEN + 56);
    let len = u32::try_from(NLMSG_HDR_LEN + 56).unwrap_or(u32::MAX);
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[family, IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0]);
    let states: u32 = 0xfff & !(1 << TCP_LISTEN);
    req.extend_from_slice(&states.to_ne_bytes());
    req.extend_from_slice(&[0u8; 48]);
    req
}

enum Message {
    Done,
    Socket { cookie: u64, stats: TcpStats },
    Other,
}

/// The netlink messages of one datagram.
struct Messages<'a>(&'a [u8]);

impl Iterator for Messages<'_> {
    type Item = io::Result<Message>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.len() < NLMSG_HDR_LEN {
            return None;
        }
        let len = usize::try_from(u32_at(self.0, 0)?).ok()?;
        if len < NLMSG_HDR_LEN || len > self.0.len() {
            self.0 = &[];
            return Some(Err(bad("message length")));
        }
        let kind = u16::from_ne_bytes([self.0[4], self.0[5]]);
        let body = &self.0[NLMSG_HDR_LEN..len];
        self.0 = self.0.get(align4(len)..).unwrap_or(&[]);
        Some(match kind {
            NLMSG_DONE => Ok(Message::Done),
            NLMSG_ERROR => {
                let errno = body
                    .get(..4)
                    .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                Err(io::Error::from_raw_os_error(-errno))
            }
            SOCK_DIAG_BY_FAMILY => parse_socket(body),
            _ => Ok(Message::Other),
        })
    }
}

/// One `inet_diag_msg` and its attributes.
fn parse_socket(body: &[u8]) -> io::Result<Message> {
    if body.len() < DIAG_MSG_LEN {
        return Err(bad("short inet_diag_msg"));
    }
    let cookie_lo = u32_at(body, 44).ok_or_else(|| bad("cookie"))?;
    let cookie_hi = u32_at(body, 48).ok_or_else(|| bad("cookie"))?;
    let cookie = u64::from(cookie_lo) | (u64::from(cookie_hi) << 32);
    let mut attrs = &body[DIAG_MSG_LEN..];
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if len < 4 || len > attrs.len() {
            return Err(bad("attribute length"));
        }
        if kind == INET_DIAG_INFO {
            return Ok(Message::Socket {
                cookie,
                stats: parse_tcp_info(&attrs[4..len]),
            });
        }
        attrs = attrs.get(align4(len)..).unwrap_or(&[]);
    }
    // A socket without tcp_info (not one of ours to sample).
    Ok(Message::Other)
}

/// The fields of `struct tcp_info` we use; absent fields (older kernels) read as zero.
fn parse_tcp_info(info: &[u8]) -> TcpStats {
    let u64_at = |at: usize| {
        info.get(at..at + 8).map_or(0, |b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_ne_bytes(a)
        })
    };
    let bytes_sent = if info.len() >= 208 {
        u64_at(200)
    } else {
        u64_at(120)
    };
    TcpStats {
        rtt_us: u32_at(info, 68).unwrap_or(0),
        bytes_sent,
        bytes_received: u64_at(128),
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 4)?;
    Some(u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: bad {what}"))
}

/// derper's `derp_tcp_rtt` label for a round-trip time.
pub(crate) fn rtt_label(rtt_us: u32) -> &'static str {
    match rtt_us {
        0..=10_000 => "10ms",
        10_001..=20_000 => "20ms",
        20_001..=50_000 => "50ms",
        50_001..=100_000 => "100ms",
        100_001..=150_000 => "150ms",
        150_001..=250_000 => "250ms",
        250_001..=500_000 => "500ms",
        _ => "inf",
    }
}

/// `derp_tcp_rtt` as derper counts it: each connection is checked once when first seen
/// (`non-tcp` when it is not a TCP socket the relay holds, `error` when the kernel has no
/// statistics for it, and then it is never sampled), and at every later sampling period
/// adds one to the label of its current smoothed RTT.
#[derive(Debug)]
pub(crate) struct RttSampler {
    metric: IntCounterVec,
    /// Connection ids seen before, and whether they are sampled.
    seen: HashMap<u64, bool>,
}

impl RttSampler {
    pub(crate) fn new(metric: IntCounterVec) -> Self {
        Self {
            metric,
            seen: HashMap::new(),
        }
    }

    /// One sampling period over the registered connections `conns`, with the kernel's
    /// statistics `sockets` (or why they could not be read).
    pub(crate) fn tick(
        &mut self,
        conns: &[ConnSummary],
        sockets: Result<&HashMap<u64, TcpStats>, &io::Error>,
    ) {
        let mut seen = HashMap::with_capacity(conns.len());
        for conn in conns {
            let stats = conn
                .socket_cookie
                .and_then(|c| sockets.ok().and_then(|s| s.get(&c.get())));
            let sampled = match self.seen.get(&conn.id) {
                Some(&sampled) => {
                    if sampled && let Some(stats) = stats {
                        self.metric
                            .with_label_values(&[rtt_label(stats.rtt_us)])
                            .inc();
                    }
                    sampled
                }
                None if conn.socket_cookie.is_none() => {
                    self.metric.with_label_values(&["non-tcp"]).inc();
                    false
                }
                None if stats.is_none() => {
                    self.metric.with_label_values(&["error"]).inc();
                    false
                }
                None => true,
            };
            seen.insert(conn.id, sampled);
        }
        // Connections that left are forgotten.
        self.seen = seen;
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

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
            let server_cookie = cookie(&Transport::Tcp(server)).expect("cookie");
            let sockets = tokio::task::spawn_blocking(dump)
                .await
                .expect("task")
                .expect("dump");
            let stats = sockets.get(&server_cookie).expect("our socket is listed");
            assert_eq!(stats.bytes_received, 1000, "{bind}");
            assert_eq!(stats.bytes_sent, 300, "{bind}");
            assert!(stats.rtt_us < 1_000_000, "{bind}: {stats:?}");
        }
    }

    #[test]
    fn each_connection_is_checked_once_then_sampled_every_period() {
        use std::num::NonZeroU64;
        let metric = IntCounterVec::new(prometheus::Opts::new("derp_tcp_rtt", "rtt"), &["le"])
            .expect("metric");
        let mut sampler = RttSampler::new(metric.clone());
        let conn = |id: u64, cookie: u64| ConnSummary {
            id,
            key: derp_proto::PublicKey::from_bytes([id as u8; 32]),
            socket_cookie: NonZeroU64::new(cookie),
        };
        let sockets = HashMap::from([
            (
                11,
                TcpStats {
                    rtt_us: 30,
                    ..TcpStats::default()
                },
            ),
            (
                12,
                TcpStats {
                    rtt_us: 120_000,
                    ..TcpStats::default()
                },
            ),
        ]);
        let conns = [conn(1, 11), conn(2, 12), conn(3, 0), conn(4, 99)];
        let count = |label: &str| metric.with_label_values(&[label]).get();
        sampler.tick(&conns, Ok(&sockets));
        assert_eq!((count("non-tcp"), count("error"), count("10ms")), (1, 1, 0));
        sampler.tick(&conns, Ok(&sockets));
        sampler.tick(&conns, Ok(&sockets));
        assert_eq!((count("10ms"), count("150ms")), (2, 2));
        assert_eq!((count("non-tcp"), count("error")), (1, 1), "counted once");
        let failed = io::Error::other("no netlink");
        sampler.tick(&[conn(1, 11), conn(5, 13)], Err(&failed));
        assert_eq!((count("10ms"), count("error")), (2, 2));
        assert_eq!(sampler.seen.len(), 2, "connections that left are forgotten");
    }

    #[test]
    fn labels_are_derpers() {
        assert_eq!(rtt_label(0), "10ms");
        assert_eq!(rtt_label(10_000), "10ms");
        assert_eq!(rtt_label(10_001), "20ms");
        assert_eq!(rtt_label(150_000), "150ms");
        assert_eq!(rtt_label(500_000), "500ms");
        assert_eq!(rtt_label(500_001), "inf");
    }

    #[test]
    fn broken_messages_are_errors_not_panics() {
        let mut msg = dump_request(1, AF_INET);
        msg[0] = 200;
        assert!(Messages(&msg).next().expect("one").is_err());
        let mut short = dump_request(1, AF_INET);
        short[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert!(Messages(&short).next().expect("one").is_err());
        assert!(Messages(&[1, 2, 3]).next().is_none());
    }
}
