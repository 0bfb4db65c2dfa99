//! Prometheus metrics, named as Tailscale's derper exports them under `/debug/varz`.
//!
//! Keeping derper's names (`derp_*`) means existing dashboards and alerts keep working when an
//! operator swaps the binary. Every labelled child is resolved once here, so the packet path
//! never formats a label or hashes a label set.
//!
//! Counting must not put a shared atomic on every packet: the per-connection read loops and
//! writers count into plain local integers ([`ReaderCounts`]) and fold them into these
//! registry counters once per socket read or write batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Why a packet was dropped; the `reason` label of `derp_packets_dropped`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// No client with that key is connected here.
    UnknownDest = 0,
    /// A mesh-forwarded packet whose destination is not connected here.
    UnknownDestOnFwd = 1,
    /// The destination disconnected before the packet was written.
    GoneDisconnected = 2,
    /// An older packet pushed out of a full queue to make room for a newer one.
    QueueHead = 3,
    /// A new packet refused because the queue stayed full.
    QueueTail = 4,
    /// Writing to the destination's socket failed (or missed its deadline) before the
    /// packet's frame was handed over in full.
    WriteError = 5,
    /// The destination key has several connections and none is active.
    DupClient = 6,
}

impl DropReason {
    /// Every reason, in label order.
    pub const ALL: [Self; 7] = [
        Self::UnknownDest,
        Self::UnknownDestOnFwd,
        Self::GoneDisconnected,
        Self::QueueHead,
        Self::QueueTail,
        Self::WriteError,
        Self::DupClient,
    ];

    /// The Prometheus label value, as derper spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownDest => "unknown_dest",
            Self::UnknownDestOnFwd => "unknown_dest_on_fwd",
            Self::GoneDisconnected => "gone_disconnected",
            Self::QueueHead => "queue_head",
            Self::QueueTail => "queue_tail",
            Self::WriteError => "write_error",
            Self::DupClient => "dup_client",
        }
    }
}

/// Whether a packet looks like a disco message; the `kind` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketKind {
    /// Tailscale's discovery messages (start with the disco magic).
    Disco = 0,
    /// Everything else (WireGuard data).
    Other = 1,
}

impl PacketKind {
    /// Classifies a packet the way the reference does.
    pub fn of(packet: &[u8]) -> Self {
        if derp_proto::frame::looks_like_disco(packet) {
            Self::Disco
        } else {
            Self::Other
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Disco => "disco",
            Self::Other => "other",
        }
    }
}

/// What a DERP connection runs over; the `transport` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportLabel {
    /// The HTTP upgrade on TCP (plain or TLS).
    Tcp = 0,
    /// WebSocket on TCP (plain or TLS).
    WebSocket = 1,
    /// DERP over QUIC.
    Quic = 2,
}

impl TransportLabel {
    /// Every transport, in label order.
    pub const ALL: [Self; 3] = [Self::Tcp, Self::WebSocket, Self::Quic];

    /// The Prometheus label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::WebSocket => "websocket",
            Self::Quic => "quic",
        }
    }
}

/// Why a RecvPacket over QUIC went on the stream rather than in a datagram; the `reason`
/// label of `derp_quic_stream_fallbacks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// The client did not enable datagrams.
    NoDatagrams = 0,
    /// The frame was larger than the current datagram limit.
    TooLarge = 1,
}

impl FallbackReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::NoDatagrams => "no_datagrams",
            Self::TooLarge => "too_large",
        }
    }
}

/// How a QUIC handshake ended; the `result` label of `derp_quic_handshakes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeResult {
    /// Completed.
    Ok = 0,
    /// Failed (a wrong ALPN, a TLS error, the client closed).
    Error = 1,
    /// Not finished within the handshake deadline.
    Timeout = 2,
    /// Answered with a Retry: too many were in flight and the client had not proven its
    /// address.
    Retry = 3,
    /// Refused: still too many, or the server is draining.
    Refused = 4,
}

impl HandshakeResult {
    const ALL: [Self; 5] = [
        Self::Ok,
        Self::Error,
        Self::Timeout,
        Self::Retry,
        Self::Refused,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Retry => "retry",
            Self::Refused => "refused",
        }
    }
}

/// The relay's metrics, registered on a registry the caller owns.
///
/// Fields are public so the server's modules can update them; they double as the metrics
/// reference (see `docs/operations.md`).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// `derp_accepts`: connections accepted for DERP, before the handshake.
    pub accepts: IntCounter,
    /// `derp_current_connections`: registered connections, duplicates included.
    pub current_connections: IntGauge,
    /// `derp_current_home_connections`: connections whose client said this is its home node.
    pub current_home_connections: IntGauge,
    /// `derp_current_notideal_connections`: connections that sent an `Ideal-Node` header.
    pub current_notideal_connections: IntGauge,
    /// `derp_clients_local`: distinct keys connected here.
    pub clients_local: IntGauge,
    /// `derp_clients_total`: distinct keys in the region (local and via mesh).
    pub clients_total: IntGauge,
    /// `derp_clients_remote`: keys reachable only via a mesh peer.
    pub clients_remote: IntGauge,
    /// `derp_current_dup_client_keys`: keys with two or more connections.
    pub current_dup_client_keys: IntGauge,
    /// `derp_current_dup_client_conns`: connections in duplicate sets.
    pub current_dup_client_conns: IntGauge,
    /// `derp_total_dup_client_conns`: connections accepted while their key was already present.
    pub total_dup_client_conns: IntCounter,
    /// `derp_watchers`: mesh peers subscribed to presence changes.
    pub watchers: IntGauge,
    /// `derp_packets_received`: SendPacket frames parsed (forwarded-in packets excluded).
    pub packets_received: IntCounter,
    /// `derp_bytes_received`: packet bytes of those frames (keys excluded).
    pub bytes_received: IntCounter,
    /// `derp_packets_received_kind{kind}`.
    pub packets_received_kind: [IntCounter; 2],
    /// `derp_packets_sent`: RecvPacket frames handed to the socket in full, including those a
    /// write got through before it failed.
    pub packets_sent: IntCounter,
    /// `derp_bytes_sent`: packet bytes of those frames (keys excluded).
    pub bytes_sent: IntCounter,
    /// `derp_packets_dropped{reason,kind}`, indexed `[reason][kind]`.
    pub packets_dropped: [[IntCounter; 2]; 7],
    /// `derp_bytes_dropped{reason,kind}`, indexed `[reason][kind]`.
    pub bytes_dropped: [[IntCounter; 2]; 7],
    /// `derp_unknown_frames`: frames of types the server does not handle (derper never counts
    /// these; we do).
    pub unknown_frames: IntCounter,
    /// `derp_home_moves_in`.
    pub home_moves_in: IntCounter,
    /// `derp_home_moves_out`.
    pub home_moves_out: IntCounter,
    /// `derp_got_ping`.
    pub got_ping: IntCounter,
    /// `derp_sent_pong`.
    pub sent_pong: IntCounter,
    /// `derp_peer_gone_disconnected_frames`.
    pub peer_gone_disconnected_frames: IntCounter,
    /// `derp_peer_gone_not_here_frames`.
    pub peer_gone_not_here_frames: IntCounter,
    /// `derp_packets_forwarded_out`.
    pub packets_forwarded_out: IntCounter,
    /// `derp_packets_forwarded_in`.
    pub packets_forwarded_in: IntCounter,
    /// `derp_multiforwarder_created`: keys that gained a second mesh forwarder.
    pub multiforwarder_created: IntCounter,
    /// `derp_multiforwarder_deleted`: keys back to a single mesh forwarder.
    pub multiforwarder_deleted: IntCounter,
    /// `derp_packet_forwarder_delete_other_value`: removals of a forwarder that was not
    /// registered for the key.
    pub packet_forwarder_delete_other_value: IntCounter,
    /// `derp_peer_lookup_cache_misses`: lookups the per-connection LRU could not answer and
    /// that fell back to the authoritative map. Counted only while the LRU is enabled; hits
    /// are `derp_packets_received` minus misses (no counter on the hit path).
    pub peer_lookup_cache_misses: IntCounter,
    /// `derp_peer_lookup_mirror_misses`: lookups the lock-free mirror could not answer (the
    /// destination is not connected here, or has no active connection). Counted only while
    /// the mirror is enabled.
    pub peer_lookup_mirror_misses: IntCounter,
    /// `derp_sclient_write_timeouts`: connections closed because a write missed its deadline.
    pub write_timeouts: IntCounter,
    /// `derp_average_queue_duration_ms`: moving average of the time packets wait in queues.
    /// The writers fold their batches into it with a compare-and-swap on a state kept apart
    /// (the gauge only shows it), so that writers finishing together lose nothing.
    pub average_queue_duration_ms: Gauge,
    /// The average's state, an `f64` in bits.
    queue_wait_average: Arc<AtomicU64>,
    /// `derp_buffered_write_frames`: frames written per flush.
    pub buffered_write_frames: Histogram,
    /// `derp_websocket_accepts`: DERP connections carried over WebSocket.
    pub websocket_accepts: IntCounter,
    /// `derp_handshake_failures`: ClientInfo frames that were refused: the box did not open,
    /// the JSON did not parse, or the client key is a low-order point (timeouts, early
    /// closes and malformed frames during the handshake are not counted here).
    pub handshake_failures: IntCounter,
    /// `derp_connection_errors{class,reason}`: DERP connections that ended with an error,
    /// by whose fault: `class="peer_misbehaved"` (reason `malformed_frame`, `handshake`,
    /// `low_order_key`, `websocket`, `not_mesh_peer`) or `class="local"` (reason `io`,
    /// `timeout`). The `low_order_key` series exists from the start, at zero, so an alert
    /// on it needs no `absent()`.
    pub connection_errors: IntCounterVec,
    /// `derp_accepts_by_transport{transport}`: `derp_accepts` split by transport, indexed by
    /// [`TransportLabel`].
    pub accepts_by_transport: [IntCounter; 3],
    /// `derp_current_connections_by_transport{transport}`: registered connections by
    /// transport, indexed by [`TransportLabel`].
    pub current_connections_by_transport: [IntGauge; 3],
    /// `derp_quic_handshakes{result}`: QUIC handshakes by result, indexed by
    /// [`HandshakeResult`] (every result exported from the start, at 0).
    pub quic_handshakes: [IntCounter; 5],
    /// `derp_quic_datagrams_received`: SendPacket frames that arrived in QUIC datagrams
    /// (also counted in `derp_packets_received`).
    pub quic_datagrams_received: IntCounter,
    /// `derp_quic_datagrams_sent`: RecvPacket frames sent in QUIC datagrams (also counted
    /// in `derp_packets_sent`).
    pub quic_datagrams_sent: IntCounter,
    /// `derp_quic_stream_fallbacks{reason}`: RecvPacket frames to QUIC clients that went on
    /// the stream instead of a datagram, indexed by [`FallbackReason`].
    pub quic_stream_fallbacks: [IntCounter; 2],
    /// `derp_quic_garbage_datagrams`: client datagrams that were not one well-formed
    /// SendPacket frame (dropped).
    pub quic_garbage_datagrams: IntCounter,
    /// `derp_quic_migrations`: QUIC clients seen, and validated, at a new address.
    pub quic_migrations: IntCounter,
    /// `derp_quic_packets_sent`: QUIC packets the server sent, every connection's (added
    /// every second while a client is registered, and when its connection ends).
    pub quic_packets_sent: IntCounter,
    /// `derp_quic_packets_lost`: of those, the ones QUIC loss detection declared lost.
    pub quic_packets_lost: IntCounter,
    /// `derp_quic_mtu_black_holes`: MTU black holes QUIC detected, each a fall back to
    /// 1200-byte packets until discovery probes again.
    pub quic_mtu_black_holes: IntCounter,
}

impl Metrics {
    /// Folds a batch's queueing times into `derp_average_queue_duration_ms`, as if each
    /// packet had been folded in turn (`average = 0.9 average + 0.1 waited`): `decay` is
    /// 0.9 to the batch's packet count and `sum` what its packets add after that decay.
    /// A compare-and-swap, so that two writers finishing together both count.
    pub(crate) fn fold_queue_waits(&self, decay: f64, sum: f64) {
        let state = &self.queue_wait_average;
        let mut old = state.load(Ordering::Relaxed);
        loop {
            let new = f64::from_bits(old) * decay + sum;
            match state.compare_exchange_weak(
                old,
                new.to_bits(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.average_queue_duration_ms.set(new);
                    return;
                }
                Err(now) => old = now,
            }
        }
    }

    /// Creates the metrics and registers them on `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let r = Reg(registry);
        let kind_vec = r.counter_vec(
            "derp_packets_received_kind",
            "SendPacket frames received, by kind",
            &["kind"],
        )?;
        let dropped = r.counter_vec(
            "derp_packets_dropped",
            "packets dropped, by reason and kind",
            &["reason", "kind"],
        )?;
        let bytes_dropped = r.counter_vec(
            "derp_bytes_dropped",
            "packet bytes dropped, by reason and kind",
            &["reason", "kind"],
        )?;
        let by_reason = |vec: &IntCounterVec| {
            DropReason::ALL.map(|reason| {
                [PacketKind::Disco, PacketKind::Other]
                    .map(|kind| vec.with_label_values(&[reason.as_str(), kind.as_str()]))
            })
        };
        let connection_errors = r.counter_vec(
            "derp_connection_errors",
            "DERP connections that ended with an error, by class (peer_misbehaved or local) and reason",
            &["class", "reason"],
        )?;
        connection_errors.with_label_values(&["peer_misbehaved", "low_order_key"]);
        let build_info = IntGaugeVec::new(
            Opts::new(
                "derp_build_info",
                "build information; the value is always 1",
            ),
            &["version"],
        )?;
        registry.register(Box::new(build_info.clone()))?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let buffered_write_frames = Histogram::with_opts(
            HistogramOpts::new("derp_buffered_write_frames", "frames written per flush").buckets(
                vec![
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0, 25.0, 50.0,
                    100.0,
                ],
            ),
        )?;
        registry.register(Box::new(buffered_write_frames.clone()))?;
        let average_queue_duration_ms = Gauge::new(
            "derp_average_queue_duration_ms",
            "moving average of the time packets wait in send queues",
        )?;
        registry.register(Box::new(average_queue_duration_ms.clone()))?;
        let accepts_by_transport = r.counter_vec(
            "derp_accepts_by_transport",
            "connections accepted for DERP, before the handshake, by transport",
            &["transport"],
        )?;
        let current_by_transport = IntGaugeVec::new(
            Opts::new(
                "derp_current_connections_by_transport",
                "registered connections, by transport",
            ),
            &["transport"],
        )?;
        registry.register(Box::new(current_by_transport.clone()))?;
        let quic_handshakes = r.counter_vec(
            "derp_quic_handshakes",
            "QUIC handshakes by result (ok, error, timeout, retry, refused)",
            &["result"],
        )?;
        let fallbacks = r.counter_vec(
            "derp_quic_stream_fallbacks",
            "RecvPacket frames to QUIC clients sent on the stream instead of a datagram, by reason",
            &["reason"],
        )?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        registry.register(Box::new(FdCollector::new()?))?;
        registry.register(Box::new(ProcessCount::new(
            "derp_tls_truncations",
            "TLS 1.3 connections on derpd's record layer whose client ended its stream \
             without close_notify (read as the end of the stream)",
            derp_io::tls::truncations,
        )?))?;
        registry.register(Box::new(ProcessCount::new(
            "derp_tls_uncaptured_handshakes",
            "TLS 1.3 handshakes on derpd's record layer whose traffic secrets were not \
             caught: served, but not handed over in an upgrade in place",
            derp_io::tls::uncaptured,
        )?))?;
        Ok(Self {
            accepts: r.counter("derp_accepts", "connections accepted, before the handshake")?,
            current_connections: r.gauge(
                "derp_current_connections",
                "registered connections, duplicates included",
            )?,
            current_home_connections: r.gauge(
                "derp_current_home_connections",
                "connections whose client prefers this node",
            )?,
            current_notideal_connections: r.gauge(
                "derp_current_notideal_connections",
                "connections that are not on their ideal node",
            )?,
            clients_local: r.gauge("derp_clients_local", "distinct keys connected here")?,
            clients_total: r.gauge("derp_clients_total", "distinct keys in the region")?,
            clients_remote: r.gauge("derp_clients_remote", "keys reachable via mesh peers")?,
            current_dup_client_keys: r.gauge(
                "derp_current_dup_client_keys",
                "keys with two or more connections",
            )?,
            current_dup_client_conns: r.gauge(
                "derp_current_dup_client_conns",
                "connections in duplicate sets",
            )?,
            total_dup_client_conns: r.counter(
                "derp_total_dup_client_conns",
                "connections accepted while their key was already connected",
            )?,
            watchers: r.gauge("derp_watchers", "mesh peers watching presence changes")?,
            packets_received: r.counter("derp_packets_received", "SendPacket frames received")?,
            bytes_received: r.counter("derp_bytes_received", "packet bytes received")?,
            packets_received_kind: [PacketKind::Disco, PacketKind::Other]
                .map(|k| kind_vec.with_label_values(&[k.as_str()])),
            packets_sent: r.counter("derp_packets_sent", "RecvPacket frames written")?,
            bytes_sent: r.counter("derp_bytes_sent", "packet bytes written")?,
            packets_dropped: by_reason(&dropped),
            bytes_dropped: by_reason(&bytes_dropped),
            unknown_frames: r.counter("derp_unknown_frames", "frames of unhandled types")?,
            home_moves_in: r.counter("derp_home_moves_in", "clients that made this node home")?,
            home_moves_out: r.counter("derp_home_moves_out", "clients that moved home away")?,
            got_ping: r.counter("derp_got_ping", "Ping frames received")?,
            sent_pong: r.counter("derp_sent_pong", "Pong frames written")?,
            peer_gone_disconnected_frames: r.counter(
                "derp_peer_gone_disconnected_frames",
                "PeerGone frames written with reason Disconnected",
            )?,
            peer_gone_not_here_frames: r.counter(
                "derp_peer_gone_not_here_frames",
                "PeerGone frames written with reason NotHere",
            )?,
            packets_forwarded_out: r.counter(
                "derp_packets_forwarded_out",
                "packets forwarded to mesh peers",
            )?,
            packets_forwarded_in: r.counter(
                "derp_packets_forwarded_in",
                "packets received from mesh peers",
            )?,
            multiforwarder_created: r.counter(
                "derp_multiforwarder_created",
                "keys that gained a second mesh forwarder",
            )?,
            multiforwarder_deleted: r.counter(
                "derp_multiforwarder_deleted",
                "keys back to a single mesh forwarder",
            )?,
            packet_forwarder_delete_other_value: r.counter(
                "derp_packet_forwarder_delete_other_value",
                "removals of a forwarder that was not registered for the key",
            )?,
            peer_lookup_cache_misses: r.counter(
                "derp_peer_lookup_cache_misses",
                "lookups the per-connection peer cache missed (hits = packets_received - misses)",
            )?,
            peer_lookup_mirror_misses: r.counter(
                "derp_peer_lookup_mirror_misses",
                "lookups the lock-free peer mirror missed",
            )?,
            write_timeouts: r.counter(
                "derp_sclient_write_timeouts",
                "connections closed because a write missed its deadline",
            )?,
            average_queue_duration_ms,
            queue_wait_average: Arc::new(AtomicU64::new(0f64.to_bits())),
            buffered_write_frames,
            websocket_accepts: r.counter(
                "derp_websocket_accepts",
                "DERP connections carried over WebSocket",
            )?,
            handshake_failures: r.counter(
                "derp_handshake_failures",
                "ClientInfo frames refused (box, JSON or low-order client key)",
            )?,
            accepts_by_transport: TransportLabel::ALL
                .map(|t| accepts_by_transport.with_label_values(&[t.as_str()])),
            current_connections_by_transport: TransportLabel::ALL
                .map(|t| current_by_transport.with_label_values(&[t.as_str()])),
            quic_handshakes: HandshakeResult::ALL
                .map(|h| quic_handshakes.with_label_values(&[h.as_str()])),
            quic_datagrams_received: r.counter(
                "derp_quic_datagrams_received",
                "SendPacket frames received in QUIC datagrams",
            )?,
            quic_datagrams_sent: r.counter(
                "derp_quic_datagrams_sent",
                "RecvPacket frames sent in QUIC datagrams",
            )?,
            quic_stream_fallbacks: [FallbackReason::NoDatagrams, FallbackReason::TooLarge]
                .map(|f| fallbacks.with_label_values(&[f.as_str()])),
            quic_garbage_datagrams: r.counter(
                "derp_quic_garbage_datagrams",
                "client datagrams that were not one well-formed SendPacket frame",
            )?,
            quic_migrations: r.counter(
                "derp_quic_migrations",
                "QUIC clients validated at a new address",
            )?,
            quic_packets_sent: r.counter(
                "derp_quic_packets_sent",
                "QUIC packets sent, every connection's",
            )?,
            quic_packets_lost: r.counter(
                "derp_quic_packets_lost",
                "QUIC packets sent that loss detection declared lost",
            )?,
            quic_mtu_black_holes: r.counter(
                "derp_quic_mtu_black_holes",
                "MTU black holes QUIC detected (each a fall back to 1200-byte packets)",
            )?,
            connection_errors,
        })
    }

    /// Adds a reader's or writer's locally accumulated counts to the registry and resets them.
    pub(crate) fn fold(&self, counts: &mut ReaderCounts) {
        if counts.is_empty() {
            return;
        }
        if counts.head_drop_waits > 0 {
            let n = i32::try_from(counts.head_drop_waits).unwrap_or(i32::MAX);
            self.fold_queue_waits(0.9f64.powi(n), counts.head_drop_wait_sum);
        }
        add(&self.packets_received, counts.packets_received);
        add(&self.bytes_received, counts.bytes_received);
        for kind in 0..2 {
            add(
                &self.packets_received_kind[kind],
                counts.packets_received_kind[kind],
            );
        }
        for reason in 0..DropReason::ALL.len() {
            for kind in 0..2 {
                add(
                    &self.packets_dropped[reason][kind],
                    counts.dropped[reason][kind],
                );
                add(
                    &self.bytes_dropped[reason][kind],
                    counts.dropped_bytes[reason][kind],
                );
            }
        }
        add(&self.unknown_frames, counts.unknown_frames);
        add(&self.got_ping, counts.got_ping);
        add(&self.packets_forwarded_out, counts.forwarded_out);
        add(&self.packets_forwarded_in, counts.forwarded_in);
        add(&self.peer_lookup_mirror_misses, counts.mirror_misses);
        add(&self.peer_lookup_cache_misses, counts.cache_misses);
        add(&self.quic_datagrams_received, counts.datagrams_in);
        add(&self.quic_garbage_datagrams, counts.garbage_datagrams);
        *counts = ReaderCounts::default();
    }

    /// Counts a single drop directly; for rare paths that have no local batch to fold into.
    pub(crate) fn drop_one(&self, reason: DropReason, kind: PacketKind, bytes: usize) {
        self.packets_dropped[reason as usize][kind as usize].inc();
        self.bytes_dropped[reason as usize][kind as usize].inc_by(bytes as u64);
    }
}

fn add(counter: &IntCounter, n: u64) {
    if n != 0 {
        counter.inc_by(n);
    }
}

/// Counts kept by one connection between folds into [`Metrics`]; plain integers, no atomics.
#[derive(Debug, Default)]
pub(crate) struct ReaderCounts {
    pub(crate) packets_received: u64,
    pub(crate) bytes_received: u64,
    pub(crate) packets_received_kind: [u64; 2],
    pub(crate) dropped: [[u64; 2]; 7],
    pub(crate) dropped_bytes: [[u64; 2]; 7],
    pub(crate) unknown_frames: u64,
    pub(crate) got_ping: u64,
    pub(crate) forwarded_out: u64,
    pub(crate) forwarded_in: u64,
    pub(crate) mirror_misses: u64,
    pub(crate) cache_misses: u64,
    /// SendPacket frames that came in QUIC datagrams.
    pub(crate) datagrams_in: u64,
    /// QUIC datagrams that were not a well-formed SendPacket frame.
    pub(crate) garbage_datagrams: u64,
    /// Frames handled since the last fold; used to fold at least this often on long bursts.
    pub(crate) frames: u64,
    /// Packets pushed out of full queues, and what their waits add to the queue-time
    /// average ([`ReaderCounts::head_dropped_after`]), folded in as a writer's batch is.
    pub(crate) head_drop_waits: u32,
    pub(crate) head_drop_wait_sum: f64,
}

impl ReaderCounts {
    pub(crate) fn is_empty(&self) -> bool {
        self.frames == 0
    }

    /// Packets this connection's batch pushed out of (or could not put into) full queues.
    pub(crate) fn queue_drops(&self) -> u64 {
        let head = &self.dropped[DropReason::QueueHead as usize];
        let tail = &self.dropped[DropReason::QueueTail as usize];
        head.iter().chain(tail).sum()
    }

    pub(crate) fn drop(&mut self, reason: DropReason, kind: PacketKind, bytes: usize) {
        self.dropped[reason as usize][kind as usize] += 1;
        self.dropped_bytes[reason as usize][kind as usize] += bytes as u64;
    }

    /// A packet pushed out of a full queue after waiting `waited`: it counts in the
    /// queue-time average as a written packet does (as derper counts it).
    pub(crate) fn head_dropped_after(&mut self, waited: std::time::Duration) {
        self.head_drop_waits += 1;
        self.head_drop_wait_sum = self.head_drop_wait_sum * 0.9 + waited.as_secs_f64() * 100.0;
    }
}

/// `derp_current_file_descriptors`, read from `/proc/self/fd` at scrape time (derper's
/// `gauge_current_file_descriptors`).
#[derive(Debug)]
struct FdCollector {
    gauge: IntGauge,
}

impl FdCollector {
    fn new() -> Result<Self, prometheus::Error> {
        Ok(Self {
            gauge: IntGauge::new(
                "derp_current_file_descriptors",
                "open file descriptors of the process",
            )?,
        })
    }
}

impl prometheus::core::Collector for FdCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            self.gauge.set(dir.count() as i64);
        }
        self.gauge.collect()
    }
}

/// A counter read from one of derp-io's process-wide counts at scrape time:
/// `derp_tls_truncations` (TLS 1.3 streams on derpd's record layer whose client ended its
/// sending without close_notify; the record layer reads such an end as the end of the
/// stream, since DERP frames delimit themselves, so this is where an operator sees the
/// clients that do it) and `derp_tls_uncaptured_handshakes` (handshakes whose traffic
/// secrets were not caught: served as usual, but not handed over in an upgrade in place).
#[derive(Debug)]
struct ProcessCount {
    counter: IntCounter,
    read: fn() -> u64,
    /// Held while the counter catches up, so that two scrapes at once add each event once.
    catching_up: std::sync::Mutex<()>,
}

impl ProcessCount {
    fn new(name: &str, help: &str, read: fn() -> u64) -> Result<Self, prometheus::Error> {
        Ok(Self {
            counter: IntCounter::new(name, help)?,
            read,
            catching_up: std::sync::Mutex::new(()),
        })
    }
}

impl prometheus::core::Collector for ProcessCount {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let _held = self.catching_up.lock().unwrap_or_else(|e| e.into_inner());
        let total = (self.read)();
        self.counter
            .inc_by(total.saturating_sub(self.counter.get()));
        self.counter.collect()
    }
}

/// Small helper that builds and registers metrics in one step.
struct Reg<'a>(&'a Registry);

impl Reg<'_> {
    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        let c = IntCounter::new(name, help)?;
        self.0.register(Box::new(c.clone()))?;
        Ok(c)
    }

    fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        let g = IntGauge::new(name, help)?;
        self.0.register(Box::new(g.clone()))?;
        Ok(g)
    }

    fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        let v = IntCounterVec::new(Opts::new(name, help), labels)?;
        self.0.register(Box::new(v.clone()))?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two batches fold in as their packets would one by one, whichever writer finishes
    /// first, and writers finishing together lose nothing.
    #[test]
    fn queue_waits_fold_in_without_losing_a_batch() {
        let m = Metrics::new(&Registry::new()).expect("metrics");
        // One packet that waited a second, twice: 0.1 × 1000, then 0.9 × 100 + 100.
        m.fold_queue_waits(0.9, 100.0);
        m.fold_queue_waits(0.9, 100.0);
        assert!((m.average_queue_duration_ms.get() - 190.0).abs() < 1e-9);

        let m = Metrics::new(&Registry::new()).expect("metrics");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        // A pure sum, so that a lost fold shows in the total.
                        m.fold_queue_waits(1.0, 1.0);
                    }
                });
            }
        });
        assert_eq!(
            f64::from_bits(m.queue_wait_average.load(Ordering::Relaxed)),
            40_000.0
        );
    }
}
