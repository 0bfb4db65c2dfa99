//! CUBIC that tells random loss from congestion.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics, Cubic, CubicConfig};
use quinn_proto::RttEstimator;

/// quinn's CUBIC, told of a loss only when something says the loss is congestion:
///
/// - persistent congestion (RFC 9002 §7.6), or an ECN congestion mark;
/// - a standing queue: the round trip at its lowest over the last round (and the smoothed
///   one) lies at least [`QUEUE_FLOOR`], or a quarter of the path's minimum round trip if
///   that is more, above that minimum ([`ACK_DELAY_ALLOWANCE`] more after a round too sparse
///   for the peer to acknowledge but on its timer; never while the connection is still
///   within its initial window). A bottleneck's queue fills before it overflows, so a
///   loss that comes with a full queue is congestion, while one at the path's unloaded round
///   trip is the link's own (a radio, a lossy hop) and says nothing about its capacity;
/// - a loss rate, smoothed over rounds, of at least [`LOSS_THRESHOLD`], which no random loss
///   a path that works at all is likely to have explains: a bottleneck with almost no buffer.
///
/// Everything else (slow start, growth, no growth while the sender does not fill its window,
/// how far a loss cuts) is CUBIC's, so against real congestion it yields as TCP CUBIC does.
/// A round is the time from sending a packet until it is acknowledged, counted by packet
/// numbers.
///
/// With random losses held back, nothing would end CUBIC's slow start: the window would keep
/// doubling whenever the sender fills it, far past what the path carries, and quinn paces
/// at the window's rate. A relay fills it in bursts (a backlog after a stall), so it would
/// send at many times the path's rate and overflow the first queue on the way. So the
/// window is held to [`WINDOW_GAIN`] times the most the path delivered in a recent round:
/// room for the relay's load to double each round, as in slow start, but never a window
/// the path has not come near.
#[derive(Clone, Debug)]
pub struct LossFilter {
    inner: Cubic,
    mtu: u64,
    /// The smallest round trip seen on this path.
    min_rtt: Option<Duration>,
    /// quinn's smoothed round trip at the last acknowledgement (peer's ACK delay removed).
    srtt: Option<Duration>,
    /// The largest packet number sent so far.
    last_sent: u64,
    round: Round,
    /// The smallest round-trip sample of the last round that had one, and how many samples
    /// that round had.
    last_round_min: Option<Duration>,
    last_round_samples: u64,
    /// Lost bytes over lost and acknowledged bytes, smoothed over rounds.
    loss_rate: f64,
    /// The most bytes acknowledged in one recent round: the largest round's, losing an
    /// eighth each round since.
    delivered: u64,
    /// Losses passed on to CUBIC, and ones held back (for tests and diagnostics).
    passed: u64,
    ignored: u64,
}

#[derive(Clone, Debug, Default)]
struct Round {
    /// The round ends once this packet number is acknowledged.
    end: Option<u64>,
    min: Option<Duration>,
    acked: u64,
    lost: u64,
    /// Bytes acknowledged in this round alone (`acked` pools small rounds).
    delivered: u64,
    /// Round-trip samples taken in this round.
    samples: u64,
}

/// A queue below this is no evidence of congestion, whatever the round trip (scheduling and
/// timer jitter on a host reach a few milliseconds).
pub const QUEUE_FLOOR: Duration = Duration::from_millis(4);
/// A smoothed loss rate from which losses count as congestion without a queue: twice the
/// 10 % per direction DERP over QUIC is meant to carry through.
pub const LOSS_THRESHOLD: f64 = 0.2;
/// The weight of one round in the smoothed loss rate.
const LOSS_GAIN: f64 = 1.0 / 8.0;
/// Rounds that carried fewer packets than this are added to the next before they count.
const MIN_ROUND_PACKETS: u64 = 8;
/// The window is at most this many times the most bytes a recent round delivered.
pub const WINDOW_GAIN: u64 = 2;
/// The peer acknowledges once it has one packet more than
/// [`ACK_ELICITING_THRESHOLD`](super::ACK_ELICITING_THRESHOLD), or once its max_ack_delay
/// has passed. In a sparse round fewer packets than that came in a max_ack_delay, so the
/// peer acknowledged on its timer, and even the round's smallest sample may hold that
/// wait: up to this much, quinn's default max_ack_delay, which both ends of DERP over QUIC
/// keep.
pub const ACK_DELAY_ALLOWANCE: Duration = Duration::from_millis(25);

impl LossFilter {
    /// Wraps `inner`, a fresh CUBIC for a path whose MTU is `mtu`.
    pub fn new(inner: Cubic, mtu: u16) -> Self {
        Self {
            inner,
            mtu: u64::from(mtu),
            min_rtt: None,
            srtt: None,
            last_sent: 0,
            round: Round::default(),
            last_round_min: None,
            last_round_samples: 0,
            loss_rate: 0.0,
            delivered: 0,
            passed: 0,
            ignored: 0,
        }
    }

    /// Losses passed on to CUBIC so far, and losses held back as random.
    pub fn decisions(&self) -> (u64, u64) {
        (self.passed, self.ignored)
    }

    /// How far the round trip lies above the path's minimum, at its lowest of the last round,
    /// this round so far and the smoothed one; `None` before any sample.
    pub fn queue_delay(&self) -> Option<Duration> {
        let min = self.min_rtt?;
        let recent = [self.last_round_min, self.round.min, self.srtt]
            .into_iter()
            .flatten()
            .min()?;
        Some(recent.saturating_sub(min))
    }

    /// The smoothed loss rate.
    pub fn loss_rate(&self) -> f64 {
        self.loss_rate
    }

    /// The most the window may be now: [`WINDOW_GAIN`] times the most a recent round
    /// delivered (this one so far included), and never below the initial window or twice
    /// the packets after which the peer acknowledges. Below that, a sender held by its
    /// window would wait for the peer's acknowledgement timer (25 ms) every round, as
    /// happens on a path whose round trip is short: its rounds deliver little each, and the
    /// cap comes down an eighth a round.
    pub fn window_cap(&self) -> u64 {
        let delivered = self.delivered.max(self.round.delivered);
        let acked_on_count = 2 * (u64::from(super::ACK_ELICITING_THRESHOLD) + 1) * self.mtu;
        (WINDOW_GAIN * delivered)
            .max(self.inner.initial_window())
            .max(acked_on_count)
    }

    /// Records one acknowledged packet: its round trip `sample` (as measured, ACK delay
    /// included), its size, and quinn's smoothed round trip.
    fn on_sample(&mut self, sample: Duration, bytes: u64, srtt: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(sample, |m| m.min(sample)));
        self.round.min = Some(self.round.min.map_or(sample, |m| m.min(sample)));
        self.round.acked += bytes;
        self.round.delivered += bytes;
        self.round.samples += 1;
        self.srtt = Some(srtt);
    }

    /// Closes the round: its minimum becomes the last round's, and its loss counts into the
    /// smoothed rate once enough packets have been seen.
    fn end_round(&mut self) {
        if self.round.min.is_some() {
            self.last_round_min = self.round.min.take();
            self.last_round_samples = std::mem::take(&mut self.round.samples);
        }
        let delivered = std::mem::take(&mut self.round.delivered);
        self.delivered = delivered.max(self.delivered - self.delivered / 8);
        let total = self.round.acked + self.round.lost;
        if total >= MIN_ROUND_PACKETS * self.mtu {
            let rate = self.round.lost as f64 / total as f64;
            self.loss_rate += (rate - self.loss_rate) * LOSS_GAIN;
            self.round.acked = 0;
            self.round.lost = 0;
        }
        self.round.end = Some(self.last_sent);
    }

    /// Why a loss event is congestion; `None` when it is taken as random.
    fn congestion_cause(&self, persistent: bool, lost_bytes: u64) -> Option<Cause> {
        if persistent {
            return Some(Cause::Persistent);
        }
        if lost_bytes == 0 {
            return Some(Cause::Ecn);
        }
        if self.loss_rate >= LOSS_THRESHOLD {
            return Some(Cause::LossRate);
        }
        let (Some(min), Some(queue)) = (self.min_rtt, self.queue_delay()) else {
            // Nothing measured yet: no evidence either way, so CUBIC decides.
            return Some(Cause::Unmeasured);
        };
        let initial = self.inner.initial_window();
        if self.inner.window() <= initial && self.delivered <= initial {
            // A connection that has neither grown its window nor had a round deliver more
            // than what any new connection may send unasked: it is no standing queue's
            // cause, and its round trips are the handshake's (a lossy handshake's
            // retransmissions stretch the first sample to seconds) and its first packets'
            // (each acknowledged on the peer's timer).
            return None;
        }
        let mut threshold = QUEUE_FLOOR.max(min / 4);
        let per_allowance = u64::from(super::ACK_ELICITING_THRESHOLD) + 1;
        let sparse = u128::from(self.last_round_samples) * ACK_DELAY_ALLOWANCE.as_nanos()
            < u128::from(per_allowance) * min.as_nanos();
        if sparse {
            // Its round trips can be the peer's acknowledgement timer rather than a queue.
            threshold += ACK_DELAY_ALLOWANCE;
        }
        (queue >= threshold).then_some(Cause::Queue)
    }
}

/// What made a loss count as congestion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    Persistent,
    Ecn,
    LossRate,
    Queue,
    Unmeasured,
}

impl Controller for LossFilter {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.last_sent = self.last_sent.max(last_packet_number);
        if self.round.end.is_none() {
            self.round.end = Some(last_packet_number);
        }
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.on_sample(now.saturating_duration_since(sent), bytes, rtt.get());
        // At the cap CUBIC does not grow, as when the sender does not fill its window: a
        // window grown out of sight above the cap would make a later cut for congestion
        // cut nothing that is used.
        let capped = self.inner.window() >= self.window_cap();
        self.inner
            .on_ack(now, sent, bytes, app_limited || capped, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        if let (Some(acked), Some(end)) = (largest_packet_num_acked, self.round.end)
            && acked >= end
        {
            self.end_round();
        }
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.round.lost += lost_bytes;
        if let Some(cause) = self.congestion_cause(is_persistent_congestion, lost_bytes) {
            self.passed += 1;
            tracing::debug!(
                ?cause,
                lost_bytes,
                window = self.window(),
                loss_rate = self.loss_rate,
                queue_ms = self.queue_delay().map(|d| d.as_secs_f64() * 1e3),
                min_rtt_ms = self.min_rtt.map(|d| d.as_secs_f64() * 1e3),
                srtt_ms = self.srtt.map(|d| d.as_secs_f64() * 1e3),
                last_round_min_ms = self.last_round_min.map(|d| d.as_secs_f64() * 1e3),
                round_min_ms = self.round.min.map(|d| d.as_secs_f64() * 1e3),
                "loss taken as congestion"
            );
            self.inner
                .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
        } else {
            self.ignored += 1;
        }
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = u64::from(new_mtu);
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.inner.window().min(self.window_cap())
    }

    fn metrics(&self) -> ControllerMetrics {
        self.inner.metrics()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Builds a [`LossFilter`] for each path.
#[derive(Clone, Debug, Default)]
pub struct LossFilterConfig {
    cubic: Arc<CubicConfig>,
}

impl ControllerFactory for LossFilterConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(LossFilter::new(
            Cubic::new(self.cubic.clone(), now, current_mtu),
            current_mtu,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MTU: u16 = 1200;
    const PACKET: u64 = 1200;
    const BASE_RTT: Duration = Duration::from_millis(40);

    /// The window of a fresh plain CUBIC after one loss.
    fn cubic_after_one_loss() -> u64 {
        let now = Instant::now();
        let mut cubic = Cubic::new(Arc::new(CubicConfig::default()), now, MTU);
        cubic.on_congestion_event(now, now, false, PACKET);
        cubic.window()
    }

    /// Drives a controller through rounds of packets, as quinn would: each round sends
    /// `per_round` packets, acknowledges those that arrive with round trip `rtt`, and reports
    /// the lost ones in one loss event at the end of the round.
    struct Link {
        cc: LossFilter,
        now: Instant,
        next_pn: u64,
    }

    impl Link {
        fn new() -> Self {
            let now = Instant::now();
            let cubic = Cubic::new(Arc::new(CubicConfig::default()), now, MTU);
            Self {
                cc: LossFilter::new(cubic, MTU),
                now,
                next_pn: 0,
            }
        }

        /// One round; `lost` is every how many packets one is lost (0: none).
        fn round(&mut self, per_round: u64, lost_every: u64, rtt: Duration) {
            let start = self.now;
            let first = self.next_pn;
            for i in 0..per_round {
                self.cc.on_sent(start, PACKET, first + i);
            }
            self.next_pn += per_round;
            self.now = start + rtt;
            let mut lost = 0;
            for i in 0..per_round {
                if lost_every > 0 && i % lost_every == lost_every - 1 {
                    lost += PACKET;
                    continue;
                }
                self.cc.on_sample(rtt, PACKET, rtt);
            }
            self.cc
                .on_end_acks(self.now, 0, false, Some(self.next_pn - 1));
            if lost > 0 {
                self.cc.on_congestion_event(self.now, start, false, lost);
            }
        }
    }

    #[test]
    fn random_loss_at_the_paths_round_trip_does_not_shrink_the_window() {
        let mut link = Link::new();
        let window = link.cc.window();
        // 10 % loss, 20 rounds of 20 packets, the round trip never above its minimum.
        for _ in 0..20 {
            link.round(20, 10, BASE_RTT);
        }
        assert_eq!(link.cc.window(), window);
        assert_eq!(link.cc.decisions(), (0, 20));
        assert!(link.cc.loss_rate() < LOSS_THRESHOLD);
    }

    #[test]
    fn loss_with_a_standing_queue_shrinks_the_window_as_cubic_does() {
        let mut link = Link::new();
        let window = link.cc.window();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // The queue builds (the round trip grows by half), then the bottleneck drops.
        link.round(20, 0, BASE_RTT * 3 / 2);
        link.round(20, 10, BASE_RTT * 3 / 2);
        assert_eq!(link.cc.decisions(), (1, 0));
        assert!(link.cc.window() < window);
        assert_eq!(link.cc.window(), cubic_after_one_loss());
    }

    #[test]
    fn a_delay_spike_in_one_sample_is_not_a_queue() {
        let mut link = Link::new();
        let window = link.cc.window();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // One late ACK (scheduling, a timer) among prompt ones, then a loss.
        link.cc.on_sample(BASE_RTT * 3, PACKET, BASE_RTT);
        link.round(20, 10, BASE_RTT);
        assert_eq!(link.cc.window(), window);
        assert_eq!(link.cc.decisions(), (0, 1));
    }

    #[test]
    fn persistent_congestion_collapses_the_window() {
        let mut link = Link::new();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        let sent = link.now;
        link.now += BASE_RTT * 10;
        link.cc
            .on_congestion_event(link.now, sent, true, 20 * PACKET);
        assert_eq!(link.cc.window(), 2 * PACKET);
    }

    #[test]
    fn an_ecn_mark_shrinks_the_window() {
        let mut link = Link::new();
        let window = link.cc.window();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        link.cc.on_congestion_event(link.now, link.now, false, 0);
        assert!(link.cc.window() < window);
        assert_eq!(link.cc.window(), cubic_after_one_loss());
    }

    #[test]
    fn a_loss_rate_no_random_loss_explains_counts_without_a_queue() {
        let mut link = Link::new();
        let window = link.cc.window();
        // A bufferless bottleneck at half the offered rate: every other packet lost, the
        // round trip unchanged.
        let mut rounds = 0;
        while link.cc.window() == window {
            link.round(20, 2, BASE_RTT);
            rounds += 1;
            assert!(
                rounds < 20,
                "half the packets lost for {rounds} rounds, no reaction"
            );
        }
        assert!(link.cc.loss_rate() >= LOSS_THRESHOLD);
        assert!(link.cc.window() < window);
    }

    #[test]
    fn the_window_is_held_near_what_the_path_delivered() {
        let mut link = Link::new();
        let floor = link.cc.window_cap();
        // Nothing delivered yet: room for the peer to acknowledge twice on its count of
        // packets (more than the initial window).
        let acked_on_count = 2 * (u64::from(crate::quic::ACK_ELICITING_THRESHOLD) + 1) * PACKET;
        assert_eq!(floor, acked_on_count);
        assert!(floor >= link.cc.inner.initial_window());
        // A steady load of 100 packets a round: room for twice that, not more.
        for _ in 0..10 {
            link.round(100, 0, BASE_RTT);
        }
        assert_eq!(link.cc.window_cap(), WINDOW_GAIN * 100 * PACKET);
        // The load doubles: the cap follows within the round.
        link.round(200, 0, BASE_RTT);
        assert_eq!(link.cc.window_cap(), WINDOW_GAIN * 200 * PACKET);
        // The load falls away: the cap comes down an eighth a round, never below the floor.
        link.round(10, 0, BASE_RTT);
        assert_eq!(link.cc.window_cap(), WINDOW_GAIN * (200 * PACKET * 7 / 8));
        for _ in 0..100 {
            link.round(1, 0, BASE_RTT);
        }
        assert_eq!(link.cc.window_cap(), floor);
        assert!(link.cc.window() <= link.cc.window_cap());
    }

    #[test]
    fn a_sparse_rounds_acknowledgement_delay_is_not_a_queue() {
        let mut link = Link::new();
        let window = link.cc.window();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // A few packets a round: the peer acknowledges each on its timer, so every sample
        // carries up to its max_ack_delay. A loss then is random.
        link.round(4, 0, BASE_RTT + ACK_DELAY_ALLOWANCE);
        link.round(4, 4, BASE_RTT + ACK_DELAY_ALLOWANCE);
        assert_eq!(link.cc.window(), window);
        assert_eq!(link.cc.decisions(), (0, 1));
        // A queue beyond that delay still counts.
        link.round(4, 0, BASE_RTT + ACK_DELAY_ALLOWANCE * 2);
        link.round(4, 4, BASE_RTT + ACK_DELAY_ALLOWANCE * 2);
        assert_eq!(link.cc.decisions(), (1, 1));
        // As does the same delay in a dense round, where acknowledgements are prompt.
        let mut link = Link::new();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        link.round(20, 0, BASE_RTT + ACK_DELAY_ALLOWANCE);
        link.round(20, 10, BASE_RTT + ACK_DELAY_ALLOWANCE);
        assert_eq!(link.cc.decisions(), (1, 0));
    }

    #[test]
    fn a_connection_still_at_its_initial_window_is_not_cut_for_a_queue() {
        let mut link = Link::new();
        let window = link.cc.window();
        // One prompt sample, then the first packets' round trips stretched (the handshake's
        // retransmissions, the peer's acknowledgement timer) well past any allowance.
        link.round(1, 0, BASE_RTT);
        link.round(4, 0, BASE_RTT * 3);
        link.round(4, 4, BASE_RTT * 3);
        assert_eq!(link.cc.window(), window);
        assert_eq!(link.cc.decisions(), (0, 1));
    }

    #[test]
    fn small_rounds_are_pooled_before_their_loss_counts() {
        let mut link = Link::new();
        // Two packets a round, one lost: each round alone would read as 50 % loss.
        link.round(2, 2, BASE_RTT);
        assert_eq!(link.cc.loss_rate(), 0.0);
        for _ in 0..3 {
            link.round(2, 0, BASE_RTT);
        }
        // Eight packets seen, one lost: the first rate that counts is 1/8.
        assert!((link.cc.loss_rate() - LOSS_GAIN / 8.0).abs() < 1e-9);
    }

    #[test]
    fn before_any_round_trip_sample_a_loss_is_cubics_call() {
        let mut link = Link::new();
        let window = link.cc.window();
        link.cc.on_sent(link.now, PACKET, 0);
        link.cc
            .on_congestion_event(link.now, link.now, false, PACKET);
        assert!(link.cc.window() < window);
        assert_eq!(link.cc.window(), cubic_after_one_loss());
    }
}
