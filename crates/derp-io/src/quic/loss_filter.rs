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
///   trip may be the link's own (a radio, a lossy hop);
/// - a loss rate, smoothed over rounds, of at least [`LOSS_THRESHOLD`], which no random loss
///   a path that works at all is likely to have explains: a bottleneck with almost no buffer;
/// - more losses than the path's random loss explains while the sender fills its window,
///   once the path has shown a bottleneck without a queue (a loss rate of
///   [`LOSS_THRESHOLD`] taken for congestion: how slow start ends against one).
///   Random loss does not depend on how fast the sender sends; a bottleneck with no queue
///   (a shallow drop-tail buffer, a token-bucket policer, an AQM whose target is small
///   beside the round trip) drops only once the sender exceeds its rate. So the random
///   loss rate is learned where the sender cannot be the cause, in rounds where it had
///   less to send than its window allowed, and a loss in a round where it filled its window
///   counts when the round's losses lie beyond that rate by more than chance allows
///   ([`EXCESS_SIGMAS`] standard deviations). On a path without random loss any such loss
///   counts, as for CUBIC. Such a loss cuts the window in use to [`EXCESS_BETA`] of it,
///   deeper than CUBIC's 0.7: without a queue, what the sender sends past the rate is lost
///   together with the packets of whatever shares the bottleneck.
///
/// Everything else (slow start, growth, no growth while the sender does not fill its window,
/// how far any other loss cuts) is CUBIC's, so against real congestion it yields as TCP CUBIC does.
/// A round is the time from sending a packet until it is acknowledged, counted by packet
/// numbers. Round trips are compared as measured, the peer's ACK delay included on both
/// sides, and the path's minimum is the lowest of the last [`MIN_RTT_EXPIRY`] to twice that,
/// so a path that changed does not keep its old minimum.
///
/// With random losses held back, nothing would end CUBIC's slow start: the window would keep
/// doubling whenever the sender fills it, far past what the path carries, and quinn paces
/// at the window's rate. A relay fills it in bursts (a backlog after a stall), so it would
/// send at many times the path's rate and overflow the first queue on the way. So the
/// window is held to [`WINDOW_GAIN`] times the most the path delivered in a recent round:
/// room for the relay's load to double each round, as in slow start, but never a window
/// the path has not come near. A cut for congestion applies to the window in use, the
/// lower of CUBIC's and that cap.
#[derive(Clone, Debug)]
pub struct LossFilter {
    inner: Cubic,
    /// The initial window quinn was configured with (a rebased `inner` reports another).
    initial_window: u64,
    mtu: u64,
    /// The smallest round trip seen on this path: the lower of this period's and the last.
    min_rtt: WindowedMin,
    /// A smoothed round trip of the samples as measured (the peer's ACK delay included, as
    /// in every other round trip here).
    srtt: Option<Duration>,
    /// The largest packet number sent so far.
    last_sent: u64,
    round: Round,
    /// The last round that had samples: its smallest, how many, how many were acknowledged
    /// while the sender filled its window, and its own losses and deliveries.
    last_round_min: Option<Duration>,
    last_round: RoundCounts,
    /// Lost bytes over lost and acknowledged bytes, smoothed over rounds.
    loss_rate: f64,
    /// The loss rate of rounds in which the sender did not fill its window, smoothed over
    /// packets: the path's random loss. `None` before any such round.
    random_loss: Option<f64>,
    /// The most bytes acknowledged in one recent round: the largest round's, losing an
    /// eighth each round since.
    delivered: u64,
    /// When the last loss passed on to CUBIC was detected: losses of packets sent before it
    /// belong to the same event.
    recovery_start: Option<Instant>,
    /// Whether a loss has been passed on to CUBIC (the connection has left slow start).
    cut_once: bool,
    /// Whether the path has shown a bottleneck that drops without a queue: a loss rate of
    /// [`LOSS_THRESHOLD`] passed on to CUBIC.
    queueless: bool,
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
    /// This round's own counts (`acked` and `lost` pool small rounds).
    counts: RoundCounts,
}

#[derive(Clone, Copy, Debug, Default)]
struct RoundCounts {
    /// Bytes acknowledged and lost.
    delivered: u64,
    lost: u64,
    /// Round-trip samples, and those acknowledging a packet sent while the sender filled
    /// its window (quinn's `app_limited` false).
    samples: u64,
    window_limited: u64,
}

impl RoundCounts {
    fn add(self, other: Self) -> Self {
        Self {
            delivered: self.delivered + other.delivered,
            lost: self.lost + other.lost,
            samples: self.samples + other.samples,
            window_limited: self.window_limited + other.window_limited,
        }
    }

    /// Whether most samples came while the sender filled its window.
    fn window_limited(&self) -> bool {
        self.samples > 0 && 2 * self.window_limited > self.samples
    }
}

/// The minimum over two periods of [`MIN_RTT_EXPIRY`]: the current and the last.
#[derive(Clone, Copy, Debug, Default)]
struct WindowedMin {
    current: Option<Duration>,
    last: Option<Duration>,
    since: Option<Instant>,
}

impl WindowedMin {
    fn update(&mut self, now: Instant, sample: Duration) {
        let since = *self.since.get_or_insert(now);
        if now.saturating_duration_since(since) >= MIN_RTT_EXPIRY {
            self.last = self.current.take();
            self.since = Some(now);
        }
        self.current = Some(self.current.map_or(sample, |m| m.min(sample)));
    }

    fn get(&self) -> Option<Duration> {
        match (self.current, self.last) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
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
/// The random loss rate is smoothed over about this many packets.
const RANDOM_LOSS_PACKETS: f64 = 1000.0;
/// Losses beyond the random loss rate count as congestion once they exceed what it
/// explains by this many standard deviations: with binomial losses, chance passes that in
/// about one round of a thousand.
pub const EXCESS_SIGMAS: f64 = 4.0;
/// The path's minimum round trip is the lowest of the last one to two of these.
pub const MIN_RTT_EXPIRY: Duration = Duration::from_secs(10);
/// The window is at most this many times the most bytes a recent round delivered.
pub const WINDOW_GAIN: u64 = 2;
/// How far a loss the excess-loss rule takes for congestion cuts the window in use (CUBIC
/// cuts to 0.7, RFC 9438's β_cubic). Such a bottleneck has no queue to absorb what the
/// sender sends past its rate, so each loss there is also a loss of whatever shares it (a TCP flow
/// beside it loses packets at the same moments); a sender that backs off only to 0.7 took
/// more than the TCP flow beside it through a policer (`scripts/bench-quic fairness`).
pub const EXCESS_BETA: f64 = 0.5;
/// quinn's CUBIC's multiplicative decrease (RFC 9438's β_cubic).
const CUBIC_BETA: f64 = 0.7;
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
            initial_window: inner.initial_window(),
            inner,
            mtu: u64::from(mtu),
            min_rtt: WindowedMin::default(),
            srtt: None,
            last_sent: 0,
            round: Round::default(),
            last_round_min: None,
            last_round: RoundCounts::default(),
            loss_rate: 0.0,
            random_loss: None,
            delivered: 0,
            recovery_start: None,
            cut_once: false,
            queueless: false,
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
        let min = self.min_rtt.get()?;
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

    /// The loss rate of rounds in which the sender did not fill its window, taken for the
    /// path's random loss; `None` before any such round.
    pub fn random_loss(&self) -> Option<f64> {
        self.random_loss
    }

    /// The most the window may be now: [`WINDOW_GAIN`] times the most a recent round
    /// delivered (this one so far included), and never below the initial window or twice
    /// the packets after which the peer acknowledges. Below that, a sender held by its
    /// window would wait for the peer's acknowledgement timer (25 ms) every round, as
    /// happens on a path whose round trip is short: its rounds deliver little each, and the
    /// cap comes down an eighth a round.
    pub fn window_cap(&self) -> u64 {
        let delivered = self.delivered.max(self.round.counts.delivered);
        let acked_on_count = 2 * (u64::from(super::ACK_ELICITING_THRESHOLD) + 1) * self.mtu;
        (WINDOW_GAIN * delivered)
            .max(self.initial_window)
            .max(acked_on_count)
    }

    /// Records one acknowledged packet: when, its round trip `sample` (as measured, ACK
    /// delay included), its size, and whether the sender was short of data when it went.
    fn on_sample(&mut self, now: Instant, sample: Duration, bytes: u64, app_limited: bool) {
        self.min_rtt.update(now, sample);
        self.round.min = Some(self.round.min.map_or(sample, |m| m.min(sample)));
        self.round.acked += bytes;
        self.round.counts.delivered += bytes;
        self.round.counts.samples += 1;
        if !app_limited {
            self.round.counts.window_limited += 1;
        }
        // RFC 6298's gain, on the samples as measured.
        self.srtt = Some(self.srtt.map_or(sample, |s| (s * 7 + sample) / 8));
    }

    /// Closes the round: its minimum becomes the last round's, and its loss counts into the
    /// smoothed rates once enough packets have been seen.
    fn end_round(&mut self) {
        let counts = std::mem::take(&mut self.round.counts);
        if self.round.min.is_some() {
            self.last_round_min = self.round.min.take();
            self.last_round = counts;
        }
        self.delivered = counts.delivered.max(self.delivered - self.delivered / 8);
        let total = self.round.acked + self.round.lost;
        if total >= MIN_ROUND_PACKETS * self.mtu {
            let rate = self.round.lost as f64 / total as f64;
            self.loss_rate += (rate - self.loss_rate) * LOSS_GAIN;
            self.round.acked = 0;
            self.round.lost = 0;
        }
        // Only this round's own packets, only a round the sender did not fill (in one that
        // it did, losses may be its own congestion), and only once it has cut for
        // congestion: in slow start a sender short of data can still send at twice what
        // the path delivered (the cap), and a bottleneck's losses then would pass for the
        // path's random loss.
        let own = counts.delivered + counts.lost;
        if self.cut_once
            && counts.samples > 0
            && !counts.window_limited()
            && own >= MIN_ROUND_PACKETS * self.mtu
        {
            let rate = counts.lost as f64 / own as f64;
            let gain = (own as f64 / self.mtu as f64 / RANDOM_LOSS_PACKETS).min(0.5);
            self.random_loss = Some(
                self.random_loss
                    .map_or(rate, |floor| floor + (rate - floor) * gain),
            );
        }
        self.round.end = Some(self.last_sent);
    }

    /// Whether the losses of the last round and this one so far exceed what the path's
    /// random loss explains, while the sender filled its window.
    fn excess_loss(&self) -> bool {
        let recent = self.last_round.add(self.round.counts);
        if !recent.window_limited() || recent.lost == 0 {
            return false;
        }
        let mtu = self.mtu as f64;
        let packets = (recent.delivered + recent.lost) as f64 / mtu;
        let lost = recent.lost as f64 / mtu;
        let p = self.random_loss.unwrap_or(0.0);
        let expected = p * packets;
        // Up to one loss more where some are expected: with few expected, binomial losses
        // have a longer tail than the deviation says. Where none are (no random loss seen),
        // any loss counts, as for CUBIC.
        lost > expected + EXCESS_SIGMAS * (expected * (1.0 - p)).sqrt() + expected.min(1.0)
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
        if self.queueless && self.excess_loss() {
            return Some(Cause::Excess);
        }
        let (Some(min), Some(queue)) = (self.min_rtt.get(), self.queue_delay()) else {
            // Nothing measured yet: no evidence either way, so CUBIC decides.
            return Some(Cause::Unmeasured);
        };
        let initial = self.initial_window;
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
        let sparse = u128::from(self.last_round.samples) * ACK_DELAY_ALLOWANCE.as_nanos()
            < u128::from(per_allowance) * min.as_nanos();
        if sparse {
            // Its round trips can be the peer's acknowledgement timer rather than a queue.
            threshold += ACK_DELAY_ALLOWANCE;
        }
        (queue >= threshold).then_some(Cause::Queue)
    }

    /// Cuts for congestion from the window in use: when the cap hides part of CUBIC's
    /// window, CUBIC starts over from the capped window, as if it had grown no further, so
    /// that the cut takes the window below what the sender used. With `beta`, the cut takes
    /// the window to that share of the one in use rather than to CUBIC's 0.7 of it.
    fn cut(
        &mut self,
        now: Instant,
        sent: Instant,
        persistent: bool,
        lost_bytes: u64,
        beta: Option<f64>,
    ) {
        let in_recovery = self.recovery_start.is_some_and(|start| sent <= start);
        let in_use = self.window();
        let base = match beta {
            // CUBIC cuts what it starts from to 0.7 of it.
            Some(beta) => ((in_use as f64 * beta / CUBIC_BETA) as u64).max(2 * self.mtu),
            None => in_use,
        };
        if !persistent && !in_recovery && self.inner.window() > base {
            let mut config = CubicConfig::default();
            config.initial_window(base);
            self.inner = Cubic::new(Arc::new(config), now, self.mtu as u16);
        }
        if !in_recovery {
            self.recovery_start = Some(now);
        }
        self.cut_once = true;
        self.inner
            .on_congestion_event(now, sent, persistent, lost_bytes);
    }
}

/// What made a loss count as congestion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    Persistent,
    Ecn,
    LossRate,
    Excess,
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
        self.on_sample(now, now.saturating_duration_since(sent), bytes, app_limited);
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
        self.round.counts.lost += lost_bytes;
        if let Some(cause) = self.congestion_cause(is_persistent_congestion, lost_bytes) {
            self.passed += 1;
            tracing::debug!(
                ?cause,
                lost_bytes,
                window = self.window(),
                loss_rate = self.loss_rate,
                random_loss = self.random_loss,
                queue_ms = self.queue_delay().map(|d| d.as_secs_f64() * 1e3),
                min_rtt_ms = self.min_rtt.get().map(|d| d.as_secs_f64() * 1e3),
                srtt_ms = self.srtt.map(|d| d.as_secs_f64() * 1e3),
                last_round_min_ms = self.last_round_min.map(|d| d.as_secs_f64() * 1e3),
                round_min_ms = self.round.min.map(|d| d.as_secs_f64() * 1e3),
                "loss taken as congestion"
            );
            if cause == Cause::LossRate {
                self.queueless = true;
            }
            let beta = (cause == Cause::Excess).then_some(EXCESS_BETA);
            self.cut(now, sent, is_persistent_congestion, lost_bytes, beta);
        } else {
            self.ignored += 1;
            let recent = self.last_round.add(self.round.counts);
            tracing::trace!(
                lost_bytes,
                window = self.window(),
                loss_rate = self.loss_rate,
                random_loss = self.random_loss,
                left_slow_start = self.cut_once,
                recent_lost = recent.lost,
                recent_delivered = recent.delivered,
                recent_samples = recent.samples,
                recent_window_limited = recent.window_limited,
                queue_ms = self.queue_delay().map(|d| d.as_secs_f64() * 1e3),
                "loss taken as random"
            );
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
        let mut metrics = self.inner.metrics();
        metrics.congestion_window = self.window();
        metrics
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.initial_window
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
        /// Whether the sender fills its window (quinn's `app_limited` false on every ACK).
        window_limited: bool,
    }

    impl Link {
        fn new() -> Self {
            let now = Instant::now();
            let cubic = Cubic::new(Arc::new(CubicConfig::default()), now, MTU);
            Self {
                cc: LossFilter::new(cubic, MTU),
                now,
                next_pn: 0,
                window_limited: false,
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
                self.cc
                    .on_sample(self.now, rtt, PACKET, !self.window_limited);
            }
            self.cc
                .on_end_acks(self.now, 0, false, Some(self.next_pn - 1));
            if lost > 0 {
                self.cc.on_congestion_event(self.now, start, false, lost);
            }
        }

        /// One round of `per_round` packets in which each is lost with probability
        /// `p` (drawn from `rng`), then a pause of a millisecond, so that the next round's
        /// packets are sent after this round's loss events.
        fn random_round(&mut self, per_round: u64, p: f64, rtt: Duration, rng: &mut Rng) {
            let start = self.now;
            let first = self.next_pn;
            for i in 0..per_round {
                self.cc.on_sent(start, PACKET, first + i);
            }
            self.next_pn += per_round;
            self.now = start + rtt;
            // Each loss is detected as the packets after it are acknowledged, within the
            // round, as quinn detects them.
            for _ in 0..per_round {
                if rng.next() < p {
                    self.cc.on_congestion_event(self.now, start, false, PACKET);
                } else {
                    self.cc
                        .on_sample(self.now, rtt, PACKET, !self.window_limited);
                }
            }
            self.cc
                .on_end_acks(self.now, 0, false, Some(self.next_pn - 1));
            self.now += Duration::from_millis(1);
        }
    }

    /// Slow start past a policer at half the offered rate, the round trip unchanged, until
    /// the loss rate ends it; then rounds without loss, the sender short of data.
    fn overshoot(link: &mut Link) {
        let mut rounds = 0;
        while link.cc.decisions().0 == 0 {
            link.round(20, 2, BASE_RTT);
            link.now += Duration::from_millis(1);
            rounds += 1;
            assert!(
                rounds < 20,
                "half the packets lost for {rounds} rounds, no reaction"
            );
        }
        for _ in 0..20 {
            link.round(20, 0, BASE_RTT);
            link.now += Duration::from_millis(1);
        }
    }

    /// xorshift64: reproducible draws in [0, 1).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
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
        link.cc.on_sample(link.now, BASE_RTT * 3, PACKET, true);
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

    #[test]
    fn a_policer_without_a_queue_cuts_once_slow_start_is_over() {
        let mut link = Link::new();
        link.window_limited = true;
        // Slow start overshoots a policer at half the offered rate: half the packets lost,
        // the round trip unchanged, until the loss rate says congestion.
        let mut rounds = 0;
        while link.cc.decisions().0 == 0 {
            link.round(20, 2, BASE_RTT);
            link.now += Duration::from_millis(1);
            rounds += 1;
            assert!(
                rounds < 20,
                "half the packets lost for {rounds} rounds, no reaction"
            );
        }
        // Now at about the policer's rate: a loss a round where the sender goes past it, no
        // queue and a loss rate far below the threshold. Each such round cuts, as CUBIC
        // would.
        let mut rng = Rng(7);
        for _ in 0..30 {
            link.random_round(20, 0.0, BASE_RTT, &mut rng);
        }
        let before = link.cc.window();
        let passed = link.cc.decisions().0;
        for _ in 0..3 {
            link.round(20, 20, BASE_RTT);
            link.now += Duration::from_millis(1);
        }
        assert_eq!(link.cc.decisions().0, passed + 3);
        assert!(link.cc.window() < before);
        assert!(link.cc.queue_delay() == Some(Duration::ZERO));
        assert!(link.cc.loss_rate() < LOSS_THRESHOLD);
    }

    #[test]
    fn an_excess_loss_halves_the_window_in_use() {
        let mut link = Link::new();
        link.window_limited = true;
        overshoot(&mut link);
        let mut rng = Rng(11);
        for _ in 0..30 {
            link.random_round(20, 0.0, BASE_RTT, &mut rng);
        }
        let in_use = link.cc.window();
        let passed = link.cc.decisions().0;
        // One loss in a full window, no queue, no random loss learned: the excess rule.
        link.round(20, 20, BASE_RTT);
        assert_eq!(link.cc.decisions().0, passed + 1);
        let cut = link.cc.window();
        let expected = in_use / 2;
        assert!(
            cut.abs_diff(expected) <= 2,
            "{in_use} cut to {cut}, not {expected}"
        );
        // A cut for a queue is still CUBIC's.
        let mut link = Link::new();
        for _ in 0..10 {
            link.round(20, 0, BASE_RTT);
        }
        let in_use = link.cc.window();
        link.round(20, 20, BASE_RTT + Duration::from_millis(20));
        let expected = (in_use as f64 * 0.7) as u64;
        assert!(
            link.cc.window().abs_diff(expected) <= 2,
            "{}",
            link.cc.window()
        );
    }

    #[test]
    fn random_loss_while_the_window_is_full_does_not_collapse_it() {
        for p in [0.05, 0.10] {
            let mut link = Link::new();
            let mut rng = Rng(0x5eed);
            // Slow start ends against a bottleneck without a queue (the loss rate).
            overshoot(&mut link);
            let after_cut = link.cc.window();
            // The relay's load leaves room in the window: the path's random loss is learned.
            for _ in 0..60 {
                link.random_round(40, p, BASE_RTT, &mut rng);
            }
            let learned = link.cc.random_loss().unwrap();
            assert!((learned - p).abs() < p / 2.0, "learned {learned} for {p}");
            // Then the load fills the window, with the same random loss.
            let passed = link.cc.decisions().0;
            link.window_limited = true;
            for _ in 0..200 {
                link.random_round(40, p, BASE_RTT, &mut rng);
            }
            assert_eq!(
                link.cc.decisions().0,
                passed,
                "random loss {p} taken for congestion"
            );
            assert!(link.cc.window() >= after_cut);
        }
    }

    #[test]
    fn with_little_random_loss_learned_a_full_windows_losses_are_congestion() {
        let mut link = Link::new();
        let mut rng = Rng(3);
        overshoot(&mut link);
        for _ in 0..200 {
            link.random_round(40, 0.0, BASE_RTT, &mut rng);
        }
        let learned = link.cc.random_loss().unwrap();
        assert!(learned < 0.001, "{learned}");
        let (passed, ignored) = link.cc.decisions();
        // A loss while the sender has room in its window says nothing of its own rate.
        link.window_limited = false;
        link.round(40, 40, BASE_RTT);
        link.now += Duration::from_millis(1);
        assert_eq!(link.cc.decisions(), (passed, ignored + 1));
        // Two while it fills the window are congestion.
        link.window_limited = true;
        link.round(40, 0, BASE_RTT);
        link.round(40, 20, BASE_RTT);
        assert_eq!(link.cc.decisions(), (passed + 1, ignored + 1));
    }

    #[test]
    fn a_cut_applies_to_the_window_in_use() {
        let mut link = Link::new();
        link.window_limited = true;
        // A load of 100 packets a round grew CUBIC's window in slow start (the Link does not
        // drive CUBIC's growth: it stands in a CUBIC grown to 400 packets); then the load
        // falls to 10, and the cap comes down with what the path delivers, CUBIC's window
        // not.
        let mut grown = CubicConfig::default();
        grown.initial_window(400 * PACKET);
        link.cc.inner = Cubic::new(Arc::new(grown), link.now, MTU);
        for _ in 0..10 {
            link.round(100, 0, BASE_RTT);
        }
        for _ in 0..40 {
            link.round(10, 0, BASE_RTT);
        }
        let in_use = link.cc.window();
        assert_eq!(in_use, link.cc.window_cap());
        assert!(link.cc.inner.window() > 2 * in_use);
        link.cc.on_congestion_event(link.now, link.now, false, 0);
        let cut = (in_use as f64 * 0.7) as u64;
        assert_eq!(link.cc.window(), cut);
        assert_eq!(link.cc.inner.window(), cut);
        // Further losses of the same flight are the same event.
        let sent = link.now;
        link.now += BASE_RTT;
        link.cc.on_congestion_event(link.now, sent, false, PACKET);
        assert_eq!(link.cc.window(), cut);
    }

    #[test]
    fn the_paths_minimum_round_trip_expires() {
        let mut link = Link::new();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // The path changes: twice the round trip from now on. At first that reads as a
        // queue; once the old minimum has expired, as the path's minimum.
        link.round(20, 0, BASE_RTT * 2);
        link.round(20, 0, BASE_RTT * 2);
        assert!(link.cc.queue_delay().unwrap() > BASE_RTT * 9 / 10);
        let rounds = (2 * MIN_RTT_EXPIRY.as_millis() / (2 * BASE_RTT.as_millis())) as usize;
        for _ in 0..rounds {
            link.round(20, 0, BASE_RTT * 2);
        }
        assert_eq!(link.cc.queue_delay(), Some(Duration::ZERO));
        let window = link.cc.window();
        link.round(20, 10, BASE_RTT * 2);
        assert_eq!(link.cc.window(), window);
    }

    #[test]
    fn round_trips_are_compared_as_measured_on_both_sides() {
        let mut link = Link::new();
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // Every sample of the next rounds holds 15 ms of queue beside the peer's usual ACK
        // delay: the smoothed round trip the queue is read from is these samples', not one
        // with the ACK delay taken out (which would read lower than the minimum's samples).
        for _ in 0..3 {
            link.round(20, 0, BASE_RTT + Duration::from_millis(15));
        }
        let queue = link.cc.queue_delay().unwrap();
        assert!(queue > Duration::from_millis(14), "{queue:?}");
        assert!(queue <= Duration::from_millis(15), "{queue:?}");
    }

    #[test]
    fn slow_starts_losses_are_not_learned_as_random() {
        let mut link = Link::new();
        // In slow start the relay sends what it has, short of the window the cap allows but
        // past a policer's rate: an eighth of the packets lost, rounds not full, below the
        // loss rate that ends slow start.
        for _ in 0..30 {
            link.round(32, 8, BASE_RTT);
            link.now += Duration::from_millis(1);
        }
        assert_eq!(link.cc.decisions().0, 0);
        assert_eq!(link.cc.random_loss(), None);
    }

    #[test]
    fn a_cut_for_a_queue_does_not_arm_the_excess_rule() {
        let mut link = Link::new();
        link.window_limited = true;
        for _ in 0..5 {
            link.round(20, 0, BASE_RTT);
        }
        // A queue (or a host's stall that looks like one) ends slow start; random loss
        // while the window is full, with no random loss learned yet, is still random.
        link.round(20, 0, BASE_RTT * 3 / 2);
        link.round(20, 10, BASE_RTT * 3 / 2);
        link.now += Duration::from_millis(1);
        assert_eq!(link.cc.decisions(), (1, 0));
        for _ in 0..5 {
            link.round(20, 10, BASE_RTT);
            link.now += Duration::from_millis(1);
        }
        assert_eq!(link.cc.decisions(), (1, 5));
    }
}
