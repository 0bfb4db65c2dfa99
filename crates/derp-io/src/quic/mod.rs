//! DERP over QUIC: the transport settings derpd and derp-client share, so that both ends of
//! a connection run the same congestion controller. Each end's controller governs what it
//! sends: a client's uplink to the relay, and the relay's downlink to each client.
//!
//! The controllers are [`Congestion`]'s; docs/protocol.md ("Congestion control") says why
//! the default is [`Congestion::LossFilter`]. [`configure`] applies the shared settings;
//! [`SendStream`] is quinn's send stream with vectored writes.

mod loss_filter;
mod send;

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, CubicConfig};
use quinn::{AckFrequencyConfig, MtuDiscoveryConfig, TransportConfig, VarInt};

pub use loss_filter::{
    ACK_DELAY_ALLOWANCE, EXCESS_BETA, EXCESS_SIGMAS, LOSS_THRESHOLD, LossFilter, LossFilterConfig,
    MIN_RTT_EXPIRY, QUEUE_FLOOR, WINDOW_GAIN,
};
pub use send::SendStream;

/// Which congestion controller a DERP-over-QUIC endpoint runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Congestion {
    /// CUBIC that answers only losses that come with evidence of congestion (a standing
    /// queue, a loss rate no random loss explains, more losses than the path's random loss
    /// while the window is full, persistent congestion, ECN); see [`LossFilter`].
    #[default]
    LossFilter,
    /// quinn's CUBIC: every loss halves (×0.7) the window, random loss included.
    Cubic,
    /// quinn's BBR, which quinn marks experimental.
    Bbr,
    /// No congestion control at all: a window no traffic fills, and no pacing. For
    /// benchmarks only, as a reference; never for deployment (RFC 9298 §7: a tunnel may not
    /// drop congestion control unless its inner traffic is known to be controlled, which a
    /// relay cannot know).
    None,
}

impl Congestion {
    /// Every controller, in the order a comparison lists them.
    pub const ALL: [Self; 4] = [Self::LossFilter, Self::Cubic, Self::Bbr, Self::None];

    /// The name on command lines and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::LossFilter => "loss-filter",
            Self::Cubic => "cubic",
            Self::Bbr => "bbr",
            Self::None => "none",
        }
    }

    /// The factory quinn builds each path's controller with.
    pub fn factory(self) -> Arc<dyn ControllerFactory + Send + Sync> {
        match self {
            Self::LossFilter => Arc::new(LossFilterConfig::default()),
            Self::Cubic => Arc::new(CubicConfig::default()),
            Self::Bbr => Arc::new(BbrConfig::default()),
            Self::None => Arc::new(Uncontrolled),
        }
    }
}

impl fmt::Display for Congestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Congestion {
    type Err = UnknownCongestion;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| UnknownCongestion(s.to_owned()))
    }
}

/// A congestion controller name [`Congestion`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown congestion controller {0:?} (one of: loss-filter, cubic, bbr, none)")]
pub struct UnknownCongestion(pub String);

/// Applies the settings both ends of DERP over QUIC share to `t`, for a connection to or
/// from `peer`: the congestion controller, how many datagram bytes may wait for the
/// controller's room, how often the peer is asked to acknowledge, how far path MTU
/// discovery probes ([`mtu_upper_bound`]) and how soon it tries again after a suspected
/// black hole.
pub fn configure(t: &mut TransportConfig, congestion: Congestion, peer: IpAddr) {
    t.congestion_controller_factory(congestion.factory());
    t.datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    let mut ack = AckFrequencyConfig::default();
    ack.ack_eliciting_threshold(VarInt::from_u32(ACK_ELICITING_THRESHOLD));
    t.ack_frequency_config(Some(ack));
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.black_hole_cooldown(BLACK_HOLE_COOLDOWN);
    mtu.upper_bound(mtu_upper_bound(peer));
    t.mtu_discovery_config(Some(mtu));
}

/// The largest UDP payload path MTU discovery probes for with `peer`: what a 1500-byte
/// Ethernet link carries, 1472 bytes over IPv4 and 1452 over IPv6 (quinn's default bound,
/// 1452, is the IPv6 one for both). Larger probes on a path that cannot carry them are
/// lost and cost nothing else; over IPv4 the 20 bytes more let a 1,400-byte DERP packet
/// travel as a datagram (see [`SERVER_CID_LEN`]).
pub fn mtu_upper_bound(peer: IpAddr) -> u16 {
    if peer.to_canonical().is_ipv4() {
        1472
    } else {
        1452
    }
}

/// The length of the connection IDs a DERP-over-QUIC server issues. Every packet a client
/// sends carries one, so each byte is a byte less for a datagram: 4 bytes rather than
/// quinn's 8 is what lets a 1,400-byte packet's 1,437-byte frame fit a datagram in a
/// 1472-byte UDP payload (a datagram's overhead is the 1-byte header, the connection ID, a
/// packet number of up to 4 bytes, the 16-byte tag and 9 bytes of frame header). Four
/// random bytes are plenty to tell one server's connections apart (quinn-proto never issues
/// one twice at a time).
pub const SERVER_CID_LEN: usize = 4;

/// The length of the connection IDs a client issues: none. A client's endpoint carries one
/// connection, so an ID routes nothing; leaving it out saves its bytes in every packet the
/// server sends to the client.
pub const CLIENT_CID_LEN: usize = 0;

/// How long after quinn took losses for an MTU black hole (and fell back to 1200 bytes) it
/// probes the path MTU again; quinn's default is a minute. Random loss on a busy path looks
/// like a black hole to quinn's detector (a few bursts of lost full-size packets), and at
/// 1200 bytes a full-size DERP packet no longer fits a datagram and goes on the stream,
/// where one loss holds back every packet behind it. Probing again is cheap: only acknowledged
/// probes raise the MTU, so a real black hole keeps it low.
pub const BLACK_HOLE_COOLDOWN: Duration = Duration::from_secs(5);

/// Packets the peer may take before it must acknowledge (the QUIC ACK frequency extension;
/// a peer without it acknowledges every second packet). Each ACK is a UDP packet both ends
/// encrypt, send and handle, so with QUIC's default every relayed packet costs the relay an
/// extra packet in and out. The peer still acknowledges within its max_ack_delay (25 ms), at
/// once when packets arrive out of order (a loss), and whenever the sender asks (its probes).
pub const ACK_ELICITING_THRESHOLD: u32 = 9;

/// Datagram bytes quinn holds while the congestion controller has no room: about 46
/// full-size packets, 1.4 times one of derpd's per-client queues. A sender that finds it full
/// waits (derpd's and derp-client's writers do), so its own queue and drop policy decide what
/// is dropped; a larger buffer would only hold packets back longer (quinn's default, 1 MiB,
/// is seconds of traffic on a slow link).
pub const DATAGRAM_SEND_BUFFER: usize = 64 * 1024;

/// [`Congestion::None`]'s controller: a window above `u32::MAX` bytes, which quinn's pacer
/// also reads as "do not pace".
#[derive(Clone, Copy, Debug)]
struct Uncontrolled;

const UNCONTROLLED_WINDOW: u64 = 1 << 40;

impl ControllerFactory for Uncontrolled {
    fn build(self: Arc<Self>, _now: Instant, _mtu: u16) -> Box<dyn Controller> {
        Box::new(Uncontrolled)
    }
}

impl Controller for Uncontrolled {
    fn on_congestion_event(
        &mut self,
        _now: Instant,
        _sent: Instant,
        _persistent: bool,
        _lost_bytes: u64,
    ) {
    }

    fn on_mtu_update(&mut self, _new_mtu: u16) {}

    fn window(&self) -> u64 {
        UNCONTROLLED_WINDOW
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(*self)
    }

    fn initial_window(&self) -> u64 {
        UNCONTROLLED_WINDOW
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_probes_as_far_as_a_1500_byte_link_carries_per_family() {
        let bound = |s: &str| mtu_upper_bound(s.parse().expect("ip"));
        assert_eq!(bound("192.0.2.1"), 1472);
        // A dual-stack socket sees IPv4 peers in mapped form.
        assert_eq!(bound("::ffff:192.0.2.1"), 1472);
        assert_eq!(bound("2001:db8::1"), 1452);
        // The frame of a 1,400-byte packet fits a datagram over IPv4 either way.
        let overhead = |cid: usize| 1 + cid + 4 + 16 + 9;
        let frame = 1400 + 37;
        assert!(frame <= 1472 - overhead(SERVER_CID_LEN));
        assert!(frame <= 1472 - overhead(CLIENT_CID_LEN));
    }

    #[test]
    fn names_round_trip() {
        for c in Congestion::ALL {
            assert_eq!(c.name().parse::<Congestion>(), Ok(c));
            assert_eq!(c.to_string(), c.name());
        }
        assert_eq!(
            "reno".parse::<Congestion>(),
            Err(UnknownCongestion("reno".into()))
        );
        assert_eq!(Congestion::default(), Congestion::LossFilter);
    }

    #[test]
    fn every_factory_builds_a_controller_with_a_window() {
        let now = Instant::now();
        for c in Congestion::ALL {
            let controller = c.factory().build(now, 1200);
            assert!(controller.window() >= 2 * 1200, "{c}");
        }
        let none = Congestion::None.factory().build(now, 1200);
        assert!(none.window() > u64::from(u32::MAX));
    }
}
