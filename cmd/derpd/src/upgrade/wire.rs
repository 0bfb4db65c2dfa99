//! The handover channel's messages: one JSON object per `SOCK_SEQPACKET` message (the socket
//! keeps each message whole, and a closed end reads as the end of the channel), file
//! descriptors riding along with `SCM_RIGHTS`.
//!
//! The running process speaks first, with [`Message::Hello`]: the format's version and the
//! listening sockets it hands, each fd described by the listener at the same index. The
//! version is read before anything else, so a process that cannot read a newer format says
//! so ([`Message::Refuse`]) instead of failing on a field it does not know.
//!
//! The exchange, old process → new process (`>`) and back (`<`):
//!
//! ```text
//! > Hello { version, pid, listeners, conns }   + the listeners' fds
//! < Ready { pid, conn_format }           the new process serves on them
//!   or Refuse { reason }                 it cannot (then exits)
//! > Conns { batch, count, bytes }        + a memfd with their state, and their sockets
//! < Took { batch }                       (repeated for each batch)
//! > ConnsEnd { batches, conns }
//! < Adopted { conns }                    or Refuse { reason }
//! > Commit                               the old process will not take them back
//! < Done                                 systemd knows the new main PID
//! ```
//!
//! Client connections go across only when both sides speak the same connection format:
//! the old process offers its format in the hello (`conns`), and the new one names it in
//! `conn_format` if it reads it. A process that does not know of connections (or reads
//! another format) leaves the fields out, and the old process then hands the listeners
//! only, as before: the connection messages are skipped. The listener exchange keeps its
//! version, so such processes still upgrade to each other.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// The version of the format this derpd writes and the only one it reads.
pub(crate) const VERSION: u32 = 1;

/// The most bytes one message may take: far more than a hello with every listener needs.
const MAX_MESSAGE: usize = 64 * 1024;

/// The most fds one message may carry (each listener derpd has, with room to spare).
const MAX_FDS: usize = 1 + CONNS_PER_BATCH;

/// The most client connections one `Conns` message carries (the kernel takes up to 253
/// fds in one message).
pub(crate) const CONNS_PER_BATCH: usize = 128;

/// What a listening socket that goes across is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum ListenerKind {
    /// `--addr`: DERP over plain HTTP or TLS, TCP.
    Main,
    /// `--http-port`: the TLS node's port-80 listener, TCP.
    HttpPort,
    /// `--metrics-addr`, TCP.
    Metrics,
    /// `--stun-port`, UDP.
    Stun,
    /// `--quic-port`: DERP over QUIC, UDP.
    Quic,
}

impl ListenerKind {
    /// How the log and `--check` name it.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Main => "main listener (TCP)",
            Self::HttpPort => "port-80 listener (TCP)",
            Self::Metrics => "metrics listener (TCP)",
            Self::Stun => "STUN socket (UDP)",
            Self::Quic => "QUIC socket (UDP)",
        }
    }

    pub(crate) fn is_udp(self) -> bool {
        matches!(self, Self::Stun | Self::Quic)
    }
}

/// One handed socket: what it is for and the address it is bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Listener {
    pub(crate) kind: ListenerKind,
    pub(crate) addr: SocketAddr,
}

/// Sockets as they go across: each described, with its fd.
pub(crate) type Handed = Vec<(Listener, OwnedFd)>;

/// A message of the exchange (the module's docs give its order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub(crate) enum Message {
    Hello {
        version: u32,
        pid: u32,
        listeners: Vec<Listener>,
        /// The connection format the old process writes, if it hands connections over.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        conns: Option<u16>,
    },
    Ready {
        pid: u32,
        /// The connection format the new process reads, if it takes connections over.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        conn_format: Option<u16>,
    },
    /// A batch of client connections: a memfd holding `bytes` of state, then `count`
    /// sockets.
    Conns {
        batch: u32,
        count: u32,
        bytes: u64,
    },
    Took {
        batch: u32,
    },
    ConnsEnd {
        batches: u32,
        conns: u32,
    },
    Adopted {
        conns: u32,
    },
    Refuse {
        reason: String,
    },
    Commit,
    Done,
}

/// Why a message did not arrive.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RecvError {
    #[error("the other process closed the channel")]
    Closed,
    #[error("nothing came within {0:?}")]
    TimedOut(Duration),
    #[error("handover format version {0}; this derpd reads version {VERSION} only")]
    Version(u64),
    #[error("unreadable message: {0}")]
    Malformed(String),
    #[error("reading the channel")]
    Io(#[from] std::io::Error),
}

/// Sends `message` with `fds` attached.
pub(crate) fn send(
    channel: &OwnedFd,
    message: &Message,
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let body = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other("too many fds for one message"));
    }
    let sent = rustix::net::sendmsg(
        channel,
        &[IoSlice::new(&body)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != body.len() {
        return Err(std::io::Error::other("message cut short"));
    }
    Ok(())
}

/// Receives the next message and the fds that came with it, waiting until `deadline`. A
/// hello of another version is [`RecvError::Version`], whatever else it holds.
pub(crate) fn recv(
    channel: &OwnedFd,
    deadline: Instant,
) -> Result<(Message, Vec<OwnedFd>), RecvError> {
    let (body, fds) = recv_raw(channel, deadline)?;
    Ok((decode(&body)?, fds))
}

/// The message's bytes and fds, without decoding.
fn recv_raw(channel: &OwnedFd, deadline: Instant) -> Result<(Vec<u8>, Vec<OwnedFd>), RecvError> {
    let wait = deadline.saturating_duration_since(Instant::now());
    let mut body = vec![0u8; MAX_MESSAGE];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        // Again on each try: a signal's interruption must not start the wait over.
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RecvError::TimedOut(wait));
        }
        rustix::net::sockopt::set_socket_timeout(
            channel,
            rustix::net::sockopt::Timeout::Recv,
            Some(left),
        )
        .map_err(std::io::Error::from)?;
        match rustix::net::recvmsg(
            channel.as_fd(),
            &mut [IoSliceMut::new(&mut body)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return Err(RecvError::TimedOut(wait)),
            // What a closed end with unread messages reads as.
            Err(rustix::io::Errno::CONNRESET) => return Err(RecvError::Closed),
            Err(e) => return Err(RecvError::Io(e.into())),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 && fds.is_empty() {
        return Err(RecvError::Closed);
    }
    if got
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(RecvError::Malformed(
            "longer than a message may be, or with more fds".to_owned(),
        ));
    }
    body.truncate(got.bytes);
    Ok((body, fds))
}

/// Decodes a message, reading a hello's version first.
pub(crate) fn decode(body: &[u8]) -> Result<Message, RecvError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| RecvError::Malformed(e.to_string()))?;
    if value["type"] == "hello" {
        match value["version"].as_u64() {
            Some(v) if v == u64::from(VERSION) => {}
            Some(v) => return Err(RecvError::Version(v)),
            None => return Err(RecvError::Malformed("a hello without a version".to_owned())),
        }
    }
    serde_json::from_value(value).map_err(|e| RecvError::Malformed(e.to_string()))
}

/// A connected pair for the exchange; the old process keeps the first end, and the new one
/// gets the second as its standard input.
pub(crate) fn pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn messages_and_fds_cross_whole() {
        let (a, b) = pair().expect("pair");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hello = Message::Hello {
            version: VERSION,
            pid: 7,
            listeners: vec![Listener {
                kind: ListenerKind::Main,
                addr,
            }],
            conns: None,
        };
        send(&a, &hello, &[listener.as_fd()]).expect("send");
        send(&a, &Message::Commit, &[]).expect("send");
        let (got, fds) = recv(&b, soon()).expect("recv");
        assert_eq!(got, hello);
        assert_eq!(fds.len(), 1);
        let adopted = std::net::TcpListener::from(fds.into_iter().next().expect("fd"));
        assert_eq!(adopted.local_addr().expect("addr"), addr);
        let (got, fds) = recv(&b, soon()).expect("recv");
        assert_eq!(got, Message::Commit);
        assert!(fds.is_empty());
        drop(a);
        assert!(matches!(recv(&b, soon()), Err(RecvError::Closed)));
    }

    #[test]
    fn a_hello_of_another_version_is_refused_by_its_version() {
        let newer = br#"{"type":"hello","version":2,"pid":1,"connections":[]}"#;
        let e = decode(newer).expect_err("version 2");
        assert!(matches!(e, RecvError::Version(2)));
        assert_eq!(
            e.to_string(),
            "handover format version 2; this derpd reads version 1 only"
        );
        assert!(matches!(
            decode(br#"{"type":"hello","pid":1,"listeners":[]}"#),
            Err(RecvError::Malformed(_))
        ));
        assert!(matches!(decode(b"not json"), Err(RecvError::Malformed(_))));
        // Other messages carry no version.
        assert_eq!(decode(br#"{"type":"done"}"#).expect("done"), Message::Done);
    }

    #[test]
    fn the_wire_form_is_stable() {
        let hello = Message::Hello {
            version: 1,
            pid: 42,
            listeners: vec![Listener {
                kind: ListenerKind::HttpPort,
                addr: "[::]:80".parse().expect("addr"),
            }],
            conns: None,
        };
        assert_eq!(
            serde_json::to_string(&hello).expect("json"),
            r#"{"type":"hello","version":1,"pid":42,"listeners":[{"kind":"http-port","addr":"[::]:80"}]}"#
        );
    }

    #[test]
    fn a_process_without_connection_handover_reads_the_new_fields_as_absent() {
        // What a derpd that hands listeners only sends, and reads.
        let ready = decode(br#"{"type":"ready","pid":5}"#).expect("ready");
        assert_eq!(
            ready,
            Message::Ready {
                pid: 5,
                conn_format: None
            }
        );
        let hello = decode(br#"{"type":"hello","version":1,"pid":1,"listeners":[],"conns":1}"#)
            .expect("hello");
        assert!(matches!(hello, Message::Hello { conns: Some(1), .. }));
        assert_eq!(
            serde_json::to_string(&Message::Conns {
                batch: 0,
                count: 2,
                bytes: 300
            })
            .expect("json"),
            r#"{"type":"conns","batch":0,"count":2,"bytes":300}"#
        );
    }

    #[test]
    fn a_full_batch_of_sockets_crosses_in_one_message() {
        let (a, b) = pair().expect("pair");
        let sockets: Vec<std::net::UdpSocket> = (0..MAX_FDS)
            .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind"))
            .collect();
        let fds: Vec<_> = sockets.iter().map(AsFd::as_fd).collect();
        let message = Message::Conns {
            batch: 3,
            count: CONNS_PER_BATCH as u32,
            bytes: 0,
        };
        send(&a, &message, &fds).expect("send");
        let (got, received) = recv(&b, soon()).expect("recv");
        assert_eq!(got, message);
        assert_eq!(received.len(), MAX_FDS);
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_a, b) = pair().expect("pair");
        let e = recv(&b, Instant::now() + Duration::from_millis(20)).expect_err("nothing sent");
        assert!(matches!(e, RecvError::TimedOut(_)), "{e}");
    }
}
