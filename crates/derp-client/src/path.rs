//! A QUIC connection's path as the client's halves share it: datagram limit, addresses, and
//! migration to a new local socket.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use quinn::{Connection, Endpoint};

/// The 8 bytes a client writes first on the DERP stream ("DERP🔑", the ServerKey magic).
pub const PREAMBLE: [u8; 8] = derp_proto::frame::MAGIC;

/// A QUIC connection's path: its datagrams' current size limit, its addresses, and moving
/// it to a new local socket (connection migration). Cheap to clone; every clone is the same
/// connection.
#[derive(Clone, Debug)]
pub struct QuicPath {
    endpoint: Endpoint,
    conn: Connection,
    /// This client accepts and sends datagrams ([`ClientConfig::quic_datagrams`](crate::ClientConfig::quic_datagrams)).
    datagrams: bool,
    /// What the connection's halves carried, and how.
    counters: Arc<QuicCounters>,
}

/// How many packets a DERP-over-QUIC connection has carried in datagrams and on its stream,
/// in each direction, since it connected ([`QuicPath::counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuicCounts {
    /// SendPacket frames quinn took as datagrams.
    pub datagrams_sent: u64,
    /// SendPacket frames written on the stream (datagrams off, or the frame did not fit).
    pub stream_packets_sent: u64,
    /// RecvPacket frames that arrived as datagrams.
    pub datagrams_received: u64,
    /// RecvPacket frames that arrived on the stream.
    pub stream_packets_received: u64,
}

/// The live counters behind [`QuicCounts`], shared by a connection's reader and writer.
#[derive(Debug, Default)]
pub(crate) struct QuicCounters {
    datagrams_sent: AtomicU64,
    stream_packets_sent: AtomicU64,
    datagrams_received: AtomicU64,
    stream_packets_received: AtomicU64,
}

impl QuicCounters {
    pub(crate) fn sent(&self, datagram: bool) {
        let c = if datagram {
            &self.datagrams_sent
        } else {
            &self.stream_packets_sent
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn received(&self, datagram: bool) {
        let c = if datagram {
            &self.datagrams_received
        } else {
            &self.stream_packets_received
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> QuicCounts {
        QuicCounts {
            datagrams_sent: self.datagrams_sent.load(Ordering::Relaxed),
            stream_packets_sent: self.stream_packets_sent.load(Ordering::Relaxed),
            datagrams_received: self.datagrams_received.load(Ordering::Relaxed),
            stream_packets_received: self.stream_packets_received.load(Ordering::Relaxed),
        }
    }
}

impl QuicPath {
    pub(crate) fn new(endpoint: Endpoint, conn: Connection, datagrams: bool) -> Self {
        Self {
            endpoint,
            conn,
            datagrams,
            counters: Arc::default(),
        }
    }

    /// Packets carried so far, in datagrams and on the stream, each way.
    pub fn counts(&self) -> QuicCounts {
        self.counters.snapshot()
    }

    pub(crate) fn counters(&self) -> Arc<QuicCounters> {
        self.counters.clone()
    }

    /// Moves the connection to a new UDP socket bound to `local` (port 0 lets the kernel
    /// choose), as a network change would: the registration, queues and stream carry on,
    /// and the server reports the new address with an ObservedAddr frame once it has
    /// validated it. Returns the new local address.
    pub fn rebind(&self, local: SocketAddr) -> io::Result<SocketAddr> {
        let socket = std::net::UdpSocket::bind(local)?;
        let addr = socket.local_addr()?;
        self.endpoint.rebind(socket)?;
        Ok(addr)
    }

    /// The local UDP address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The server's address.
    pub fn remote_addr(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    /// The largest DERP frame a datagram can carry now, or `None` when datagrams are off on
    /// either side.
    pub fn max_datagram_frame(&self) -> Option<usize> {
        self.conn.max_datagram_size().filter(|_| self.datagrams)
    }

    /// Whether this client uses datagrams at all.
    pub(crate) fn datagrams(&self) -> bool {
        self.datagrams
    }

    /// The underlying quinn connection (statistics, close reason).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}
