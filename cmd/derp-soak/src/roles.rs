//! The roles soak clients play, each in its own loop until the run stops: closed-loop pairs,
//! floods (half of them into slow readers), churners and idle clients. The hostile clients
//! are in [`crate::hostile`].

use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use derp_client::ReceivedFrame;
use derp_load::packet::Header;
use derp_proto::SecretKey;
use rand::Rng;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use crate::client::{Conn, Shared, Stats, count_frame, new_key, packet};
use crate::hostile;

/// Packets a closed-loop sender may have in flight: far below the relay's queue depth (32),
/// so a correct relay never has a reason to drop one.
const WINDOW: u64 = 4;
/// A closed-loop packet not echoed within this long is lost.
pub(crate) const ECHO_DEADLINE: Duration = Duration::from_secs(10);
/// Size of closed-loop and churn packets.
const SMALL_PACKET: usize = 200;
/// Receive buffer of slow readers: small, so a pause fills it and the relay's queue quickly.
const SLOW_RCVBUF: u32 = 4096;
/// Size of flood packets.
const FLOOD_PACKET: usize = 1200;
/// Size of flood packets to slow readers: large enough that a pause of a few seconds fills
/// the relay's socket buffer (which grows to megabytes on loopback) and then its queue.
const SLOW_FLOOD_PACKET: usize = 8192;

/// How many clients play each role.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Roles {
    pub(crate) closed_pairs: usize,
    pub(crate) flood_pairs: usize,
    pub(crate) churners: usize,
    pub(crate) hostile: usize,
    pub(crate) idle: usize,
}

impl Roles {
    /// 40% closed-loop pairs, 10% floods (sender + receiver), 25% churn, 5% hostile, the rest
    /// idle.
    pub(crate) fn of(clients: usize) -> Self {
        let n = clients;
        let closed_pairs = (n * 40 / 100 / 2).max(1);
        let flood_pairs = (n * 10 / 100 / 2).max(1);
        let churners = (n * 25 / 100).max(2);
        let hostile = (n * 5 / 100).max(1);
        let idle = n.saturating_sub(closed_pairs * 2 + flood_pairs * 2 + churners + hostile);
        Self {
            closed_pairs,
            flood_pairs,
            churners,
            hostile,
            idle,
        }
    }

    /// Starts every client, each on its own source-address slot.
    pub(crate) fn spawn(
        &self,
        shared: &Arc<Shared>,
        closed_rate: f64,
        flood_rate: f64,
    ) -> JoinSet<()> {
        let mut tasks = JoinSet::new();
        let mut slot = 0usize;
        let mut next_slot = || {
            slot += 1;
            slot - 1
        };
        for flow in 0..self.closed_pairs {
            let slots = (next_slot(), next_slot());
            tasks.spawn(closed_pair(shared.clone(), flow as u32, slots, closed_rate));
        }
        for i in 0..self.flood_pairs {
            let slots = (next_slot(), next_slot());
            let flow = (self.closed_pairs + i) as u32;
            tasks.spawn(flood(shared.clone(), flow, slots, flood_rate, i % 2 == 1));
        }
        for i in 0..self.churners {
            tasks.spawn(churner(shared.clone(), i, next_slot()));
        }
        for i in 0..self.hostile {
            tasks.spawn(hostile::worker(shared.clone(), i));
        }
        for _ in 0..self.idle {
            tasks.spawn(idle(shared.clone(), next_slot()));
        }
        tasks
    }
}

/// A closed-loop pair: A sends, B echoes, A checks every echo comes back in order.
async fn closed_pair(sh: Arc<Shared>, flow: u32, slots: (usize, usize), rate: f64) {
    let (sa, sb) = (new_key(), new_key());
    let Some(mut a) = Conn::open(&sh, &sa, slots.0).await else {
        return;
    };
    let Some(mut b) = Conn::open(&sh, &sb, slots.1).await else {
        return;
    };
    let who = format!("closed pair {flow}");
    let mut send_tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.1)));
    send_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut ping_tick = tokio::time::interval(Duration::from_secs(5));
    ping_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (mut next_seq, mut next_echo) = (0u64, 0u64);
    let mut oldest_sent_at: Option<Instant> = None;
    let mut stopping = false;
    let mut drain_until = None;
    let outcome: anyhow::Result<()> = loop {
        let in_flight = next_seq - next_echo;
        if stopping && in_flight == 0 {
            break Ok(());
        }
        if let Some(since) = oldest_sent_at
            && in_flight > 0
            && since.elapsed() > ECHO_DEADLINE
        {
            break Err(anyhow!(
                "{who}: packet {next_echo} not echoed within {ECHO_DEADLINE:?}"
            ));
        }
        if drain_until.is_some_and(|d| Instant::now() >= d) {
            break Err(anyhow!(
                "{who}: {in_flight} packets still in flight at the end"
            ));
        }
        tokio::select! {
            f = a.reader.recv() => match f {
                Ok(ReceivedFrame::RecvPacket { src, packet }) => {
                    Stats::add(&sh.stats.received, 1);
                    let seq = Header::read(&packet).map(|h| h.seq);
                    if src != b.key || seq != Some(next_echo) {
                        break Err(anyhow!("{who}: expected echo {next_echo}, got {seq:?} from {src:?}"));
                    }
                    next_echo += 1;
                    Stats::add(&sh.stats.closed_echoed, 1);
                    oldest_sent_at = (next_echo < next_seq).then(Instant::now);
                }
                Ok(_) => {}
                Err(e) => break Err(anyhow!("{who}: A lost its connection: {e}")),
            },
            f = b.reader.recv() => match f {
                Ok(ReceivedFrame::RecvPacket { src, packet }) => {
                    Stats::add(&sh.stats.received, 1);
                    if src != a.key {
                        break Err(anyhow!("{who}: B got a packet from {src:?}"));
                    }
                    if let Err(e) = b.send(&sh, a.key, &packet).await {
                        break Err(anyhow!("{who}: B could not echo: {e}"));
                    }
                }
                Ok(_) => {}
                Err(e) => break Err(anyhow!("{who}: B lost its connection: {e}")),
            },
            _ = send_tick.tick(), if !stopping && in_flight < WINDOW => {
                if let Err(e) = a.send(&sh, b.key, &packet(flow, next_seq, SMALL_PACKET)).await {
                    break Err(anyhow!("{who}: A could not send: {e}"));
                }
                Stats::add(&sh.stats.closed_sent, 1);
                if next_echo == next_seq {
                    oldest_sent_at = Some(Instant::now());
                }
                next_seq += 1;
            },
            _ = ping_tick.tick(), if !stopping => {
                if let Err(e) = a.start_ping(&sh).await {
                    break Err(anyhow!("{who}: A could not ping: {e}"));
                }
            },
            r = Conn::ping_done(&mut a.ping) => {
                if let Err(e) = a.ponged(&sh, r) {
                    break Err(anyhow!("{who}: ping unanswered: {e}"));
                }
            },
            _ = sh.stopped(), if !stopping => {
                stopping = true;
                drain_until = Some(Instant::now() + ECHO_DEADLINE);
            },
        }
    };
    if let Err(what) = outcome {
        Stats::add(&sh.stats.closed_lost, next_seq - next_echo);
        sh.stats.violation(format!("{what:#}"));
    }
    for (name, mut c) in [("A", a), ("B", b)] {
        if let Err(e) = c.barrier(&sh).await {
            sh.stats
                .violation(format!("{who}: {name}'s closing ping failed: {e}"));
        }
        let _ = c.writer.close().await;
    }
}

/// An idle client that pings now and then.
async fn idle(sh: Arc<Shared>, slot: usize) {
    let secret = new_key();
    let Some(mut c) = Conn::open(&sh, &secret, slot).await else {
        return;
    };
    let first = Duration::from_millis(rand::thread_rng().gen_range(0..10_000));
    let mut ping_at = Instant::now() + first;
    let result: anyhow::Result<()> = loop {
        tokio::select! {
            f = c.reader.recv() => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(e) => break Err(anyhow!("idle client {slot} lost its connection: {e}")),
            },
            _ = tokio::time::sleep_until(ping_at) => {
                if let Err(e) = c.start_ping(&sh).await {
                    break Err(anyhow!("idle client {slot} could not ping: {e}"));
                }
                ping_at = Instant::now()
                    + Duration::from_millis(rand::thread_rng().gen_range(5_000..15_000));
            },
            r = Conn::ping_done(&mut c.ping) => {
                if let Err(e) = c.ponged(&sh, r) {
                    break Err(anyhow!("idle client {slot}: ping unanswered: {e}"));
                }
            },
            _ = sh.stopped() => break Ok(()),
        }
    };
    if let Err(what) = result {
        sh.stats.violation(format!("{what:#}"));
    }
    if let Err(e) = c.barrier(&sh).await {
        sh.stats
            .violation(format!("idle client {slot}: closing ping failed: {e}"));
    }
    let _ = c.writer.close().await;
}

/// A client that keeps coming and going.
async fn churner(sh: Arc<Shared>, index: usize, slot: usize) {
    let own = SecretKey::generate(&mut rand::rngs::OsRng);
    let mut seq = 0u64;
    while !sh.stopping() {
        // Mostly the same key again (a client reconnecting), sometimes a new one.
        let secret = if rand::thread_rng().gen_bool(0.7) {
            own.clone()
        } else {
            new_key()
        };
        let Some(mut c) = Conn::open(&sh, &secret, slot).await else {
            return;
        };
        Stats::add(&sh.stats.churn_sessions, 1);
        let mut dup = if rand::thread_rng().gen_bool(0.1) {
            Stats::add(&sh.stats.churn_duplicates, 1);
            Conn::open(&sh, &secret, slot).await
        } else {
            None
        };
        let session = Duration::from_millis(rand::thread_rng().gen_range(1_000..8_000));
        let end = tokio::time::sleep(session);
        tokio::pin!(end);
        let mut send_tick = tokio::time::interval(Duration::from_millis(
            rand::thread_rng().gen_range(100..500),
        ));
        send_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let result: anyhow::Result<()> = loop {
            tokio::select! {
                f = c.reader.recv() => match f {
                    Ok(f) => count_frame(&sh, &f),
                    Err(e) => break Err(anyhow!("churner {index} lost its connection: {e}")),
                },
                f = async { match dup.as_mut() {
                    Some(d) => d.reader.recv().await,
                    None => std::future::pending().await,
                } } => match f {
                    Ok(f) => count_frame(&sh, &f),
                    Err(e) => break Err(anyhow!("churner {index}'s duplicate lost its connection: {e}")),
                },
                _ = send_tick.tick() => {
                    let dst = sh.churn_keys[rand::thread_rng().gen_range(0..sh.churn_keys.len())];
                    seq += 1;
                    let from = match dup.as_mut() {
                        Some(d) if seq.is_multiple_of(2) => d,
                        _ => &mut c,
                    };
                    if let Err(e) = from.send(&sh, dst, &packet(u32::MAX - index as u32, seq, SMALL_PACKET)).await {
                        break Err(anyhow!("churner {index} could not send: {e}"));
                    }
                },
                _ = &mut end => break Ok(()),
                _ = sh.stopped() => break Ok(()),
            }
        };
        if let Err(what) = result {
            sh.stats.violation(format!("{what:#}"));
        }
        let abrupt = rand::thread_rng().gen_bool(0.5);
        for mut conn in std::iter::once(c).chain(dup) {
            if let Err(e) = conn.barrier(&sh).await {
                sh.stats
                    .violation(format!("churner {index}: closing ping failed: {e}"));
            }
            if abrupt {
                // Gone without a goodbye, possibly with packets unread.
                Stats::add(&sh.stats.churn_abrupt, 1);
                drop(conn);
            } else {
                let _ = conn.writer.close().await;
            }
        }
    }
}

/// An open-loop sender and its receiver, which is a slow reader when `slow`.
async fn flood(sh: Arc<Shared>, flow: u32, slots: (usize, usize), rate: f64, slow: bool) {
    let (ss, rs) = (new_key(), new_key());
    let Some(mut s) = Conn::open(&sh, &ss, slots.0).await else {
        return;
    };
    let rcvbuf = slow.then_some(SLOW_RCVBUF);
    let Some(mut r) = Conn::open_with(&sh, &rs, slots.1, rcvbuf).await else {
        return;
    };
    let who = format!("flood {flow}");
    let ticks_per_s = 50.0;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / ticks_per_s));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let per_tick = (rate / ticks_per_s).max(1.0).round() as u64;
    let mut reading = true;
    let mut toggle_at = Instant::now() + Duration::from_millis(500);
    let mut seq = 0u64;
    let mut r_alive = true;
    loop {
        tokio::select! {
            f = s.reader.recv() => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(e) => {
                    sh.stats.violation(format!("{who}: the sender lost its connection: {e}"));
                    break;
                }
            },
            f = r.reader.recv(), if reading && r_alive => match f {
                Ok(f) => count_frame(&sh, &f),
                Err(_) if slow => {
                    // The write deadline cut the paused reader off; it comes back.
                    Stats::add(&sh.stats.slow_cut_off, 1);
                    r_alive = false;
                }
                Err(e) => {
                    sh.stats.violation(format!("{who}: the receiver lost its connection: {e}"));
                    break;
                }
            },
            _ = tick.tick() => {
                if !r_alive {
                    match Conn::open_with(&sh, &rs, slots.1, rcvbuf).await {
                        Some(c) => { r = c; r_alive = true; reading = true; }
                        None => break,
                    }
                }
                for _ in 0..per_tick {
                    seq += 1;
                    let size = if slow { SLOW_FLOOD_PACKET } else { FLOOD_PACKET };
                    if let Err(e) = s.writer.queue_packet(r.key, packet(flow, seq, size)) {
                        sh.stats.violation(format!("{who}: queueing failed: {e}"));
                    }
                }
                if let Err(e) = s.writer.flush().await {
                    sh.stats.violation(format!("{who}: the sender could not write: {e}"));
                    break;
                }
                Stats::add(&sh.stats.sent, per_tick);
            },
            _ = tokio::time::sleep_until(toggle_at), if slow => {
                reading = !reading;
                let ms = if reading { 200..1_000 } else { 500..8_000 };
                toggle_at = Instant::now() + Duration::from_millis(rand::thread_rng().gen_range(ms));
            },
            _ = sh.stopped() => break,
        }
    }
    if let Err(e) = s.barrier(&sh).await {
        sh.stats
            .violation(format!("{who}: the sender's closing ping failed: {e}"));
    }
    let _ = s.writer.close().await;
    if r_alive {
        // A slow reader may be cut off by the deadline while it drains; that is fine.
        match r.barrier(&sh).await {
            Ok(()) => {}
            Err(_) if slow => {
                Stats::add(&sh.stats.slow_cut_off, 1);
                r.abandon_pings(&sh);
            }
            Err(e) => sh
                .stats
                .violation(format!("{who}: the receiver's closing ping failed: {e}")),
        }
        let _ = r.writer.close().await;
    }
}
