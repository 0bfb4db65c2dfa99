//! What the pairs' records say: per-packet delays and per-connection holds in each phase of
//! the run (before the upgrade, while it runs, after it), and whether every packet arrived
//! once and in order on connections that never broke.

use std::collections::BTreeMap;

use crate::measure::{RttHistogram, new_histogram};

/// Highest sequence number a receiver keeps track of: a pair sending every millisecond
/// reaches it after four hours, beyond any run, and a packet claiming more (which only a
/// broken relay could deliver) costs no memory.
pub const MAX_SEQ: u64 = 1 << 24;

/// One packet's arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// Its sequence number.
    pub seq: u64,
    /// When it was sent, on the run's clock.
    pub sent_ns: u64,
    /// When it was read.
    pub recv_ns: u64,
}

/// Everything one pair saw.
#[derive(Debug, Default)]
pub struct PairRecord {
    /// Each packet's send time, by sequence number.
    pub sent_ns: Vec<u64>,
    /// Arrivals in the order they were read.
    pub arrivals: Vec<Arrival>,
    /// What broke the sending connection (its frames, its read and write errors).
    pub sender_breaks: Vec<&'static str>,
    /// What broke the receiving connection.
    pub receiver_breaks: Vec<&'static str>,
    /// The first break of each connection (sender, receiver): when, and what.
    pub first_break: [Option<(u64, String)>; 2],
}

/// The run's phases on its clock: warm-up until `measured_from`, then before the upgrade
/// until `signal` (the signal sent), during it until `exit` (the old process gone), after it
/// until the senders stop.
#[derive(Clone, Copy, Debug)]
pub struct Phases {
    /// End of the warm-up.
    pub measured_from_ns: u64,
    /// The upgrade asked for.
    pub signal_ns: u64,
    /// The old process gone.
    pub exit_ns: u64,
}

/// A phase of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Warmup,
    Before,
    During,
    After,
}

impl Phases {
    fn of(&self, ns: u64) -> Phase {
        if ns < self.measured_from_ns {
            Phase::Warmup
        } else if ns < self.signal_ns {
            Phase::Before
        } else if ns < self.exit_ns {
            Phase::During
        } else {
            Phase::After
        }
    }
}

/// The figures of one phase, by packets sent in it.
#[derive(Debug)]
pub struct PhaseFigures {
    /// Packets sent.
    pub sent: u64,
    /// Of those, packets that arrived (each once).
    pub delivered: u64,
    /// Sent less delivered.
    pub lost: u64,
    /// Each delivered packet's delay, send to arrival, nanoseconds.
    pub delay: RttHistogram,
    /// Per pair: the longest delay of its packets sent in the phase.
    pub conn_max_delay: RttHistogram,
    /// Per pair: the longest time between two consecutive arrivals, the later one sent in the
    /// phase.
    pub conn_longest_gap: RttHistogram,
}

impl PhaseFigures {
    fn new() -> Self {
        Self {
            sent: 0,
            delivered: 0,
            lost: 0,
            delay: new_histogram(),
            conn_max_delay: new_histogram(),
            conn_longest_gap: new_histogram(),
        }
    }
}

/// The whole run's account.
#[derive(Debug)]
pub struct Account {
    /// Before the upgrade: the baseline.
    pub before: PhaseFigures,
    /// From the signal to the old process's exit.
    pub during: PhaseFigures,
    /// After it.
    pub after: PhaseFigures,
    /// Packets sent in the whole run, warm-up included.
    pub sent: u64,
    /// Of those, packets that arrived.
    pub delivered: u64,
    /// Sent less delivered.
    pub lost: u64,
    /// Arrivals of a packet that had arrived already.
    pub duplicated: u64,
    /// Arrivals behind a later packet of the same pair.
    pub out_of_order: u64,
    /// Arrivals of packets never sent (a sequence number beyond the sender's).
    pub unsent: u64,
    /// Connections that broke (either half of a pair counts on its own).
    pub broken_connections: u64,
    /// Connections that saw each kind of break.
    pub breaks: BTreeMap<String, u64>,
    /// The first few broken connections' first break, in words.
    pub examples: Vec<String>,
}

/// How many broken connections the account describes in words.
const EXAMPLES: usize = 5;

impl Account {
    /// The account of `records` over `phases`.
    pub fn of(records: &[PairRecord], phases: &Phases) -> Self {
        let mut a = Self {
            before: PhaseFigures::new(),
            during: PhaseFigures::new(),
            after: PhaseFigures::new(),
            sent: 0,
            delivered: 0,
            lost: 0,
            duplicated: 0,
            out_of_order: 0,
            unsent: 0,
            broken_connections: 0,
            breaks: BTreeMap::new(),
            examples: Vec::new(),
        };
        for (i, r) in records.iter().enumerate() {
            a.add_pair(i, r, phases);
        }
        a
    }

    /// Whether nothing was lost, repeated, reordered or broken.
    pub fn clean(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.out_of_order == 0
            && self.unsent == 0
            && self.broken_connections == 0
    }

    fn add_pair(&mut self, pair: usize, r: &PairRecord, phases: &Phases) {
        for (side, kinds) in [
            ("sender", &r.sender_breaks),
            ("receiver", &r.receiver_breaks),
        ] {
            if kinds.is_empty() {
                continue;
            }
            self.broken_connections += 1;
            for k in kinds {
                *self.breaks.entry((*k).to_owned()).or_default() += 1;
            }
            let first = &r.first_break[usize::from(side == "receiver")];
            if self.examples.len() < EXAMPLES
                && let Some((at, what)) = first
            {
                let at = if *at == u64::MAX {
                    String::new()
                } else {
                    format!(" at {:.3} s", *at as f64 / 1e9)
                };
                self.examples
                    .push(format!("pair {pair} {side}{at}: {what}"));
            }
        }

        let sent = r.sent_ns.len() as u64;
        let mut seen = SeqSet::default();
        let mut highest: Option<u64> = None;
        let mut max_delay = [0u64; 3];
        let mut delivered = 0;
        for arrival in &r.arrivals {
            if arrival.seq >= sent {
                self.unsent += 1;
                continue;
            }
            if !seen.insert(arrival.seq) {
                self.duplicated += 1;
                continue;
            }
            delivered += 1;
            if highest.is_some_and(|h| arrival.seq < h) {
                self.out_of_order += 1;
            }
            highest = highest.max(Some(arrival.seq));
            // The send time the sender kept, not the packet's copy of it.
            let sent_ns = r.sent_ns[arrival.seq as usize];
            let delay = arrival.recv_ns.saturating_sub(sent_ns).max(1);
            if let Some((i, figures)) = self.phase_mut(phases.of(sent_ns)) {
                figures.delay.saturating_record(delay);
                max_delay[i] = max_delay[i].max(delay);
            }
        }
        self.sent += sent;
        self.delivered += delivered;
        self.lost += sent - delivered;
        for (seq, &sent_ns) in r.sent_ns.iter().enumerate() {
            if let Some((_, figures)) = self.phase_mut(phases.of(sent_ns)) {
                figures.sent += 1;
                if seen.contains(seq as u64) {
                    figures.delivered += 1;
                } else {
                    figures.lost += 1;
                }
            }
        }
        let gaps = longest_gaps(&r.arrivals, &r.sent_ns, phases);
        for (i, phase) in [Phase::Before, Phase::During, Phase::After]
            .into_iter()
            .enumerate()
        {
            let Some((_, figures)) = self.phase_mut(phase) else {
                continue;
            };
            if max_delay[i] > 0 {
                figures.conn_max_delay.saturating_record(max_delay[i]);
            }
            if gaps[i] > 0 {
                figures.conn_longest_gap.saturating_record(gaps[i]);
            }
        }
    }

    fn phase_mut(&mut self, phase: Phase) -> Option<(usize, &mut PhaseFigures)> {
        match phase {
            Phase::Warmup => None,
            Phase::Before => Some((0, &mut self.before)),
            Phase::During => Some((1, &mut self.during)),
            Phase::After => Some((2, &mut self.after)),
        }
    }
}

/// For each measured phase (before, during, after), the longest time between two
/// consecutive arrivals where the later packet was sent in the phase: the gap a hold leaves
/// ends with the first packet sent after the connection froze, so it belongs to the phase
/// the hold began in, not to the one before.
fn longest_gaps(arrivals: &[Arrival], sent_ns: &[u64], phases: &Phases) -> [u64; 3] {
    let mut gaps = [0u64; 3];
    for w in arrivals.windows(2) {
        let Some(&sent) = sent_ns.get(w[1].seq as usize) else {
            continue;
        };
        let i = match phases.of(sent) {
            Phase::Warmup => continue,
            Phase::Before => 0,
            Phase::During => 1,
            Phase::After => 2,
        };
        gaps[i] = gaps[i].max(w[1].recv_ns.saturating_sub(w[0].recv_ns).max(1));
    }
    gaps
}

/// Sequence numbers seen, below [`MAX_SEQ`].
#[derive(Debug, Default)]
pub struct SeqSet(Vec<u64>);

impl SeqSet {
    /// Adds `seq`; whether it is new. Numbers from [`MAX_SEQ`] on are never new.
    pub fn insert(&mut self, seq: u64) -> bool {
        if seq >= MAX_SEQ {
            return false;
        }
        let (word, bit) = ((seq / 64) as usize, 1u64 << (seq % 64));
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        let new = self.0[word] & bit == 0;
        self.0[word] |= bit;
        new
    }

    /// Whether `seq` was added.
    pub fn contains(&self, seq: u64) -> bool {
        self.0
            .get((seq / 64) as usize)
            .is_some_and(|w| w & (1u64 << (seq % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Phases: warm-up to 100 ms, before to 1 s, during to 1.5 s, after that.
    fn phases() -> Phases {
        Phases {
            measured_from_ns: 100 * MS,
            signal_ns: 1000 * MS,
            exit_ns: 1500 * MS,
        }
    }

    /// A pair sending every 10 ms from 0 to 2 s, each packet arriving after `delay(sent)`.
    fn pair(delay: impl Fn(u64) -> u64) -> PairRecord {
        let sent_ns: Vec<u64> = (0..200).map(|i| i * 10 * MS).collect();
        let mut arrivals: Vec<Arrival> = sent_ns
            .iter()
            .enumerate()
            .map(|(seq, &s)| Arrival {
                seq: seq as u64,
                sent_ns: s,
                recv_ns: s + delay(s),
            })
            .collect();
        arrivals.sort_by_key(|a| a.recv_ns);
        PairRecord {
            sent_ns,
            arrivals,
            ..PairRecord::default()
        }
    }

    /// Held from the signal (1 s) to 1.12 s: what was sent then arrives at 1.12 s.
    fn held(s: u64) -> u64 {
        let base = 50_000;
        if (1000 * MS..1120 * MS).contains(&s) {
            1120 * MS - s + base
        } else {
            base
        }
    }

    #[test]
    fn a_hold_shows_in_the_delays_and_gaps_of_its_phase_only() {
        let a = Account::of(&[pair(held), pair(|_| 50_000)], &phases());
        assert!(a.clean(), "{a:?}");
        assert_eq!((a.sent, a.delivered, a.lost), (400, 400, 0));
        // 90 packets before, 50 during, 50 after per pair.
        assert_eq!(
            (a.before.sent, a.during.sent, a.after.sent),
            (180, 100, 100)
        );
        // Every packet before took the base delay (one bucket of the histogram).
        let before = &a.before.delay;
        assert!(before.equivalent(before.min(), before.max()), "{before:?}");
        // The packet sent at 1 s waited the whole hold.
        let hold = 120 * MS + 50_000;
        assert!(a.during.delay.max().abs_diff(hold) < hold / 500);
        assert!(a.during.conn_max_delay.max().abs_diff(hold) < hold / 500);
        // One pair held, one not: the per-connection figures say so.
        assert_eq!(a.during.conn_max_delay.len(), 2);
        assert!(a.during.conn_max_delay.min() < MS);
        // The held pair's longest gap, from the last packet sent before the signal (at
        // 0.99 s) to the hold's end, is the upgrade's, not the baseline's.
        let gap = 1120 * MS - 990 * MS;
        assert!(a.during.conn_longest_gap.max().abs_diff(gap) < gap / 500);
        assert!(a.before.conn_longest_gap.max().abs_diff(10 * MS) < MS / 100);
        assert!(a.after.conn_longest_gap.max().abs_diff(10 * MS) < MS / 100);
    }

    #[test]
    fn loss_duplicates_and_reordering_are_counted() {
        let mut r = pair(|_| 50_000);
        // Packet 120 (sent at 1.2 s, during) lost, packet 5 (warm-up) lost, packet 150
        // twice, packets 160 and 161 swapped.
        r.arrivals.retain(|a| a.seq != 120 && a.seq != 5);
        let dup = *r.arrivals.iter().find(|a| a.seq == 150).unwrap();
        r.arrivals.push(dup);
        let i = r.arrivals.iter().position(|a| a.seq == 160).unwrap();
        r.arrivals.swap(i, i + 1);
        r.arrivals.push(Arrival {
            seq: 999,
            sent_ns: 0,
            recv_ns: 0,
        });
        let a = Account::of(&[r], &phases());
        assert_eq!(
            (a.lost, a.duplicated, a.out_of_order, a.unsent),
            (2, 1, 1, 1)
        );
        assert_eq!((a.during.sent, a.during.lost), (50, 1));
        assert_eq!(a.before.lost, 0);
        assert!(!a.clean());
    }

    #[test]
    fn a_broken_connection_is_counted_by_kind_and_described() {
        let mut r = pair(|_| 50_000);
        r.receiver_breaks = vec!["restarting", "eof"];
        r.first_break[1] = Some((1_250 * MS, "Restarting".to_owned()));
        let mut clean = pair(|_| 50_000);
        clean.sender_breaks = vec!["eof"];
        let a = Account::of(&[r, clean], &phases());
        assert_eq!(a.broken_connections, 2);
        assert_eq!(a.breaks["eof"], 2);
        assert_eq!(a.breaks["restarting"], 1);
        assert_eq!(a.examples[0], "pair 0 receiver at 1.250 s: Restarting");
        assert!(!a.clean());
    }

    #[test]
    fn sequence_numbers_past_the_bound_take_no_memory() {
        let mut s = SeqSet::default();
        assert!(s.insert(3) && !s.insert(3) && s.contains(3));
        assert!(!s.insert(u64::MAX) && !s.contains(u64::MAX));
        assert!(!s.insert(MAX_SEQ));
        assert_eq!(s.0.len(), 1);
    }
}
