//! The `sock_diag` netlink wire: the dump request with its port filter, the messages of
//! the answer, and the `tcp_info` fields the relay reads from each socket.

use std::collections::BTreeSet;
use std::io;
#[cfg(target_os = "linux")]
use std::os::fd::AsFd;

/// What the kernel says about one TCP socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcpStats {
    /// `tcpi_rtt`: smoothed round-trip time, in microseconds.
    pub(crate) rtt_us: u32,
    /// `tcpi_bytes_sent` (Linux 4.19 and later; else `tcpi_bytes_acked`).
    pub(crate) bytes_sent: u64,
    /// `tcpi_bytes_received`.
    pub(crate) bytes_received: u64,
    /// The socket's local port (`idiag_sport`).
    pub(crate) port: u16,
}

/// What the kernel answered a dump request.
pub(super) enum Answer {
    /// The dump, each socket handed over as it came.
    Listed,
    /// An error message instead of a dump: the request itself was refused.
    Refused(io::Error),
}

/// Dumps IPv4 then IPv6 TCP sockets on the `sock_diag` socket `fd`, filtered by `program`,
/// into `each`.
#[cfg(target_os = "linux")]
pub(super) fn query(
    fd: &impl AsFd,
    program: Option<&[u8]>,
    each: &mut impl FnMut(u64, TcpStats),
) -> io::Result<Answer> {
    use rustix::net::{RecvFlags, SendFlags};

    let mut listed = false;
    let mut buf = vec![0u8; DUMP_READ];
    for (seq, family) in [(1u32, AF_INET), (2, AF_INET6)] {
        let request = dump_request(seq, family, program)?;
        rustix::net::send(fd, &request, SendFlags::empty())?;
        'messages: loop {
            let (n, _) = rustix::net::recv(fd, &mut buf[..], RecvFlags::empty())?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "sock_diag: no answer",
                ));
            }
            for msg in Messages(&buf[..n]) {
                match msg? {
                    Message::Done => break 'messages,
                    // The filter is checked when the first request arrives, before any
                    // socket is sent; an error later is the dump's, not a refusal.
                    Message::Error(e) if seq == 1 && !listed => {
                        return Ok(Answer::Refused(e));
                    }
                    Message::Error(e) => return Err(e),
                    Message::Socket { cookie, stats } => {
                        listed = true;
                        each(cookie, stats);
                    }
                    Message::Other => {}
                }
            }
        }
    }
    Ok(Answer::Listed)
}

/// The buffer a dump is read into. The kernel fills each read of a dump up to the reader's
/// buffer and never beyond it (at most 32 KiB, at least NLMSG_GOODSIZE: a page or 8 KiB,
/// less overhead), so a smaller buffer loses nothing and costs only more reads; the heap of
/// the thread that reads it keeps it resident after every period.
pub(super) const DUMP_READ: usize = 16 * 1024;

pub(super) const AF_INET: u8 = 2;
pub(super) const AF_INET6: u8 = 10;
pub(super) const IPPROTO_TCP: u8 = 6;
pub(super) const SOCK_DIAG_BY_FAMILY: u16 = 20;
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
/// The `INET_DIAG_INFO` attribute carries `struct tcp_info`.
pub(super) const INET_DIAG_INFO: u16 = 2;
/// The request attribute that carries a filter program.
pub(super) const INET_DIAG_REQ_BYTECODE: u16 = 1;
pub(super) const TCP_LISTEN: u32 = 10;
pub(super) const NLMSG_HDR_LEN: usize = 16;
/// `struct inet_diag_req_v2`.
pub(super) const DIAG_REQ_LEN: usize = 56;
/// `struct inet_diag_msg`.
pub(super) const DIAG_MSG_LEN: usize = 72;

/// Operations of the filter program (`enum` in `linux/inet_diag.h`).
pub(super) const BC_JMP: u8 = 1;
pub(super) const BC_S_GE: u8 = 2;
pub(super) const BC_S_LE: u8 = 3;
/// The program of one port: `sport >= p && sport <= p`, each comparison an operation and
/// an operand (the port, in the operand's `no` field).
pub(super) const PORT_TEST_LEN: usize = 16;
/// The operation after each port's test but the last: a match jumps to the end.
pub(super) const JMP_LEN: usize = 4;

/// An `inet_diag` filter program that accepts a socket whose local port is one of `ports`
/// (`None` for no ports, or too many for one request).
///
/// The kernel runs a program from its first operation; each operation moves `yes` or `no`
/// bytes ahead, and the socket is accepted when the program ends exactly at its end (a jump
/// past it, by 4, rejects). The ports are tested in turn: a failed comparison goes on to the
/// next port's test (past the last one, a rejection); a port's test that holds falls
/// through to a jump to the end. Built of `>=` and `<=` rather than `==`, which kernels
/// before 4.16 do not know. The kernel also checks that every `no` lands on an operation
/// reached by following `yes` from the start, which this layout meets.
pub(super) fn port_filter(ports: &BTreeSet<u16>) -> Option<Vec<u8>> {
    let len = ports
        .len()
        .checked_mul(PORT_TEST_LEN + JMP_LEN)?
        .checked_sub(JMP_LEN)?;
    // The attribute's length is 16-bit (its header is 4 bytes), and so are the jumps.
    if len > usize::from(u16::MAX) - 4 {
        return None;
    }
    let op = |prog: &mut Vec<u8>, code: u8, yes: u8, no: usize| {
        prog.extend_from_slice(&[code, yes]);
        prog.extend_from_slice(&u16::try_from(no).unwrap_or(u16::MAX).to_ne_bytes());
    };
    let next_test = PORT_TEST_LEN + JMP_LEN;
    let mut prog = Vec::with_capacity(len);
    for &port in ports {
        op(&mut prog, BC_S_GE, 8, next_test);
        op(&mut prog, 0, 0, usize::from(port));
        op(&mut prog, BC_S_LE, 8, next_test - 8);
        op(&mut prog, 0, 0, usize::from(port));
        let rest = len - prog.len();
        if rest > 0 {
            op(&mut prog, BC_JMP, 4, rest);
        }
    }
    Some(prog)
}

/// A dump request (`inet_diag_req_v2`) for every non-listening TCP socket of `family`
/// that `program` accepts, with `tcp_info`.
pub(super) fn dump_request(seq: u32, family: u8, program: Option<&[u8]>) -> io::Result<Vec<u8>> {
    let attr_len = program.map_or(0, |p| 4 + p.len());
    let total = NLMSG_HDR_LEN + DIAG_REQ_LEN + attr_len;
    let too_long = || io::Error::new(io::ErrorKind::InvalidInput, "sock_diag: filter too long");
    let len = u32::try_from(total).map_err(|_| too_long())?;
    let mut req = Vec::with_capacity(total);
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[family, IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0]);
    let states: u32 = 0xfff & !(1 << TCP_LISTEN);
    req.extend_from_slice(&states.to_ne_bytes());
    req.extend_from_slice(&[0u8; 48]);
    if let Some(program) = program {
        let attr_len = u16::try_from(attr_len).map_err(|_| too_long())?;
        req.extend_from_slice(&attr_len.to_ne_bytes());
        req.extend_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
        req.extend_from_slice(program);
        req.resize(align4(req.len()), 0);
    }
    Ok(req)
}

pub(super) enum Message {
    Done,
    /// The kernel's error (`NLMSG_ERROR`) instead of, or in the middle of, a dump.
    Error(io::Error),
    Socket {
        cookie: u64,
        stats: TcpStats,
    },
    Other,
}

/// The netlink messages of one datagram.
pub(super) struct Messages<'a>(pub(super) &'a [u8]);

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
                // Zero is an acknowledgement, which these requests do not ask for.
                Ok(if errno == 0 {
                    Message::Other
                } else {
                    Message::Error(io::Error::from_raw_os_error(-errno))
                })
            }
            SOCK_DIAG_BY_FAMILY => parse_socket(body),
            _ => Ok(Message::Other),
        })
    }
}

/// One `inet_diag_msg` and its attributes.
pub(super) fn parse_socket(body: &[u8]) -> io::Result<Message> {
    if body.len() < DIAG_MSG_LEN {
        return Err(bad("short inet_diag_msg"));
    }
    let cookie_lo = u32_at(body, 44).ok_or_else(|| bad("cookie"))?;
    let cookie_hi = u32_at(body, 48).ok_or_else(|| bad("cookie"))?;
    let cookie = u64::from(cookie_lo) | (u64::from(cookie_hi) << 32);
    // `idiag_sport`, in network byte order.
    let port = u16::from_be_bytes([body[4], body[5]]);
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
                stats: TcpStats {
                    port,
                    ..parse_tcp_info(&attrs[4..len])
                },
            });
        }
        attrs = attrs.get(align4(len)..).unwrap_or(&[]);
    }
    // A socket without tcp_info (not one of ours to sample).
    Ok(Message::Other)
}

/// The fields of `struct tcp_info` we use; absent fields (older kernels) read as zero. The
/// port is not among them.
pub(super) fn parse_tcp_info(info: &[u8]) -> TcpStats {
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
        port: 0,
    }
}

pub(super) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 4)?;
    Some(u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

pub(super) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

pub(super) fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("sock_diag: bad {what}"))
}

/// The sock_diag netlink socket, closed on exec: a process started meanwhile (an upgrade's
/// successor) must not inherit it.
#[cfg(target_os = "linux")]
pub(super) fn diag_socket() -> io::Result<rustix::fd::OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, netlink};
    Ok(rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::RAW,
        SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )?)
}
