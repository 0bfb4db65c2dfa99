//! The migration gate: which client address may be handed relayed packets.
//!
//! quinn (0.11) switches a connection to a new peer address as soon as a packet arrives from
//! it, before path validation (RFC 9000 §8.2) has proven that the client really is there,
//! and it reports neither the switch nor the validation. An attacker who forwards one of a
//! client's packets from another address could therefore have relayed packets sent there.
//! The gate keeps relayed packets back while the address quinn uses is not known to be
//! validated, and it infers validation from what quinn does expose: on an unvalidated path
//! quinn puts a PATH_CHALLENGE frame into every packet it sends, and stops once validation
//! has succeeded. UDP datagrams sent while the address stayed the same and no challenge went
//! with them therefore mean the address is validated. A path that fails validation makes
//! quinn return to the previous address, which the gate sees as the address changing back.
//!
//! One interval between two checks is not enough evidence: quinn can, between them, give up
//! on the new path, send on the old one (no challenge), and switch to the new address again
//! on the client's next packet, with nothing sent there yet. Checked rarely (a busy host),
//! that looks exactly like a validation. So the gate asks for [`CLEAN_INTERVALS`] intervals
//! in a row, each with datagrams sent and none with a challenge; such a cycle takes quinn a
//! path-validation timeout, and a real validation passes the test within a few checks.
//!
//! This rests on quinn-proto 0.11's behaviour; `tests/e2e/quic.rs` pins it (a migrated
//! client gets its packets and its new address; a forwarded one does not).

use std::net::SocketAddr;

/// What quinn reports at one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sample {
    /// UDP datagrams sent on the connection so far.
    pub(crate) udp_tx: u64,
    /// PATH_CHALLENGE frames sent so far.
    pub(crate) path_challenges: u64,
}

/// The result of a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The current address is the trusted one: relay to it.
    Open,
    /// The current address has just been validated and is now the trusted one: relay to it
    /// and tell the client.
    Validated(SocketAddr),
    /// The current address is not validated yet: hold relayed packets back.
    Pending,
}

/// Intervals between checks, in a row, in which quinn sent datagrams to the new address and
/// no challenge, before the gate takes the address as validated.
pub(crate) const CLEAN_INTERVALS: u32 = 2;

/// Per-connection gate state.
#[derive(Debug)]
pub(crate) struct Gate {
    /// The last address known to be validated (the handshake's, at first).
    trusted: SocketAddr,
    /// The unvalidated address seen at the last check.
    pending: Option<Pending>,
}

/// An address the gate is watching.
#[derive(Debug)]
struct Pending {
    addr: SocketAddr,
    /// quinn's counts at the last check.
    last: Sample,
    /// Intervals in a row with datagrams sent and no challenge among them.
    clean: u32,
}

impl Gate {
    /// A gate for a connection whose handshake came from `trusted` (the handshake validates
    /// the address it completes on).
    pub(crate) fn new(trusted: SocketAddr) -> Self {
        Self {
            trusted,
            pending: None,
        }
    }

    /// The last validated address.
    pub(crate) fn trusted(&self) -> SocketAddr {
        self.trusted
    }

    /// Checks the address quinn currently sends to. `sample` is only called when the address
    /// is not the trusted one (it takes quinn's connection lock).
    pub(crate) fn check(
        &mut self,
        current: SocketAddr,
        sample: impl FnOnce() -> Sample,
    ) -> Verdict {
        if current == self.trusted {
            self.pending = None;
            return Verdict::Open;
        }
        let now = sample();
        match &mut self.pending {
            Some(p) if p.addr == current => {
                if now.path_challenges != p.last.path_challenges {
                    p.clean = 0;
                } else if now.udp_tx > p.last.udp_tx {
                    p.clean += 1;
                }
                // An interval with nothing sent teaches nothing and breaks no run.
                p.last = now;
                if p.clean >= CLEAN_INTERVALS {
                    self.trusted = current;
                    self.pending = None;
                    return Verdict::Validated(current);
                }
            }
            _ => {
                self.pending = Some(Pending {
                    addr: current,
                    last: now,
                    clean: 0,
                });
            }
        }
        Verdict::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn s(udp_tx: u64, path_challenges: u64) -> Sample {
        Sample {
            udp_tx,
            path_challenges,
        }
    }

    #[test]
    fn the_handshake_address_is_open_without_sampling() {
        let mut g = Gate::new(addr(1));
        assert_eq!(g.check(addr(1), || unreachable!()), Verdict::Open);
    }

    #[test]
    fn a_new_address_opens_after_a_send_without_a_challenge() {
        let mut g = Gate::new(addr(1));
        assert_eq!(g.check(addr(2), || s(10, 0)), Verdict::Pending);
        // Packets went out, each with a challenge: still unvalidated.
        assert_eq!(g.check(addr(2), || s(12, 2)), Verdict::Pending);
        // Nothing sent at all: nothing learned.
        assert_eq!(g.check(addr(2), || s(12, 2)), Verdict::Pending);
        // Packets without a challenge: not yet enough.
        assert_eq!(g.check(addr(2), || s(13, 2)), Verdict::Pending);
        // An idle interval between two clean ones does not break the run.
        assert_eq!(g.check(addr(2), || s(13, 2)), Verdict::Pending);
        // A second interval without a challenge: validated.
        assert_eq!(g.check(addr(2), || s(15, 2)), Verdict::Validated(addr(2)));
        assert_eq!(g.trusted(), addr(2));
        assert_eq!(g.check(addr(2), || unreachable!()), Verdict::Open);
    }

    #[test]
    fn one_clean_interval_after_a_challenge_is_not_enough() {
        let mut g = Gate::new(addr(1));
        assert_eq!(g.check(addr(2), || s(10, 1)), Verdict::Pending);
        // Unseen between the checks: quinn gave up on addr(2), sent on addr(1) without a
        // challenge, then moved to addr(2) again and has sent nothing there yet.
        assert_eq!(g.check(addr(2), || s(14, 1)), Verdict::Pending);
        // Its next packets there carry a challenge again: the run starts over.
        assert_eq!(g.check(addr(2), || s(16, 3)), Verdict::Pending);
        assert_eq!(g.check(addr(2), || s(17, 3)), Verdict::Pending);
        assert_eq!(g.check(addr(2), || s(18, 4)), Verdict::Pending);
        assert_eq!(g.trusted(), addr(1));
    }

    #[test]
    fn a_failed_validation_returns_to_the_trusted_address() {
        let mut g = Gate::new(addr(1));
        assert_eq!(g.check(addr(2), || s(10, 0)), Verdict::Pending);
        assert_eq!(g.check(addr(2), || s(11, 1)), Verdict::Pending);
        // quinn gave up on the new path and went back.
        assert_eq!(g.check(addr(1), || unreachable!()), Verdict::Open);
        // Counts from another address never validate this one.
        assert_eq!(g.check(addr(3), || s(20, 1)), Verdict::Pending);
        assert_eq!(g.check(addr(2), || s(21, 1)), Verdict::Pending);
        assert_eq!(g.trusted(), addr(1));
    }
}
