//! The header the bench puts at the front of every packet it sends.
//!
//! Layout (little endian, 32 bytes), followed by zero filler up to the packet size:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `DRPB` |
//! | 4 | 4 | run id (random per run, so stragglers from an earlier run are ignored) |
//! | 8 | 4 | pair id |
//! | 12 | 4 | kind: 0 load, 1 latency probe |
//! | 16 | 8 | sequence number, from 0 per pair and run |
//! | 24 | 8 | send time, nanoseconds since the bench started |
//!
//! The magic keeps the packet from looking like a Tailscale disco message, so the relay
//! counts it as `kind="other"`, like WireGuard data.

/// Size of the header; the smallest packet the bench sends.
pub const HEADER_LEN: usize = 32;

const MAGIC: [u8; 4] = *b"DRPB";

/// What a packet is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    /// Throughput load.
    Load = 0,
    /// A latency probe, echoed back to its sender.
    Probe = 1,
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The run id.
    pub run: u32,
    /// The pair id.
    pub pair: u32,
    /// Load or probe.
    pub kind: Kind,
    /// Sequence number, from 0 per pair and run.
    pub seq: u64,
    /// Send time, nanoseconds on the bench's clock.
    pub sent_ns: u64,
}

impl Header {
    /// Writes the header into the front of `buf`, which is at least [`HEADER_LEN`] long.
    pub fn write(&self, buf: &mut [u8]) {
        buf[0..4].copy_from_slice(&MAGIC);
        buf[4..8].copy_from_slice(&self.run.to_le_bytes());
        buf[8..12].copy_from_slice(&self.pair.to_le_bytes());
        buf[12..16].copy_from_slice(&(self.kind as u32).to_le_bytes());
        buf[16..24].copy_from_slice(&self.seq.to_le_bytes());
        buf[24..32].copy_from_slice(&self.sent_ns.to_le_bytes());
    }

    /// Reads a header; `None` for packets that are not the bench's.
    pub fn read(buf: &[u8]) -> Option<Self> {
        let head = buf.get(..HEADER_LEN)?;
        if head[0..4] != MAGIC {
            return None;
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&head[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let kind = match u32_at(12) {
            0 => Kind::Load,
            1 => Kind::Probe,
            _ => return None,
        };
        Some(Self {
            run: u32_at(4),
            pair: u32_at(8),
            kind,
            seq: u64_at(16),
            sent_ns: u64_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = Header {
            run: 0xdead_beef,
            pair: 7,
            kind: Kind::Probe,
            seq: u64::MAX - 1,
            sent_ns: 123_456_789,
        };
        let mut buf = vec![0u8; 570];
        h.write(&mut buf);
        assert_eq!(Header::read(&buf), Some(h));
        assert!(!derp_proto::frame::looks_like_disco(&buf));
    }

    #[test]
    fn foreign_packets_ignored() {
        assert_eq!(Header::read(b"short"), None);
        assert_eq!(Header::read(&[0u8; 64]), None);
        let mut buf = [0u8; HEADER_LEN];
        Header {
            run: 1,
            pair: 1,
            kind: Kind::Load,
            seq: 0,
            sent_ns: 0,
        }
        .write(&mut buf);
        buf[12] = 9;
        assert_eq!(Header::read(&buf), None);
    }
}
