//! Proves the decoders' hot path allocates nothing per frame once warmed up.
//!
//! This is its own test binary because it installs a counting global allocator. The counter
//! is process-wide, so the binary has a single test function (no concurrent test threads) and
//! each measurement is repeated with the best run taken: a decoder that allocated per frame
//! would show at least one allocation per frame in every run, while a stray allocation by the
//! harness's main thread could only spoil one run.

use std::alloc::System;

use bytes::{Bytes, BytesMut};
use derp_proto::frame::{FrameType, parse_header, write_header};
use derp_proto::{ClientDecoder, ClientToRelay, PublicKey, RelayToClient, ServerDecoder};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const FRAMES: usize = 1000;
const WARM_UP: usize = 8;
const ATTEMPTS: usize = 3;

/// Builds a buffer holding `WARM_UP + FRAMES` frames written by `encode`.
fn stream(encode: impl Fn(usize, &mut BytesMut)) -> BytesMut {
    let mut buf = BytesMut::with_capacity((FRAMES + WARM_UP) * 1300);
    for i in 0..FRAMES + WARM_UP {
        encode(i, &mut buf);
    }
    buf
}

/// Decodes a fresh buffer with `next` (which decodes and checks one frame, returning false
/// when the buffer is exhausted): `WARM_UP` frames first, then the rest while counting. Returns
/// the fewest allocations (plus reallocations) seen over [`ATTEMPTS`] runs.
fn steady_state_allocations(
    mut fresh: impl FnMut() -> BytesMut,
    mut next: impl FnMut(&mut BytesMut) -> bool,
) -> usize {
    let mut best = usize::MAX;
    for _ in 0..ATTEMPTS {
        let mut buf = fresh();
        // The first split turns the buffer's storage into shared storage, once.
        for _ in 0..WARM_UP {
            assert!(next(&mut buf));
        }
        let region = Region::new(GLOBAL);
        let mut decoded = 0;
        while next(&mut buf) {
            decoded += 1;
        }
        let change = region.change();
        assert_eq!(decoded, FRAMES);
        assert!(buf.is_empty());
        best = best.min(change.allocations + change.reallocations);
    }
    best
}

fn packet() -> Bytes {
    Bytes::from(vec![0x5au8; 1200])
}

/// One test function, so no other test thread allocates while this binary measures.
#[test]
fn hot_paths_allocate_nothing_in_steady_state() {
    send_packets();
    recv_packets();
    frame_headers();
}

fn send_packets() {
    let packet = packet();
    let fresh = || {
        stream(|i, buf| {
            ClientToRelay::SendPacket {
                dst: PublicKey::from_bytes([i as u8; 32]),
                packet: packet.clone(),
            }
            .encode(buf);
        })
    };
    let mut decoder = ServerDecoder::after_handshake();
    let allocs = steady_state_allocations(fresh, |buf| match decoder.decode(buf).expect("valid") {
        Some(ClientToRelay::SendPacket { packet, .. }) => {
            assert_eq!(packet.len(), 1200);
            true
        }
        Some(other) => panic!("expected SendPacket, got {other:?}"),
        None => false,
    });
    assert_eq!(allocs, 0, "steady-state SendPacket decoding allocated");
}

fn recv_packets() {
    let packet = packet();
    let fresh = || {
        stream(|i, buf| {
            RelayToClient::RecvPacket {
                src: PublicKey::from_bytes([i as u8; 32]),
                packet: packet.clone(),
            }
            .encode(buf);
        })
    };
    let mut decoder = ClientDecoder::new();
    let allocs = steady_state_allocations(fresh, |buf| match decoder.decode(buf).expect("valid") {
        Some(RelayToClient::RecvPacket { packet, .. }) => {
            assert_eq!(packet.len(), 1200);
            true
        }
        Some(other) => panic!("expected RecvPacket, got {other:?}"),
        None => false,
    });
    assert_eq!(allocs, 0, "steady-state RecvPacket decoding allocated");
}

/// Go's TestReadFrameHeader / TestWriteFrameHeader also assert zero allocations.
fn frame_headers() {
    let mut best = usize::MAX;
    for _ in 0..ATTEMPTS {
        let mut out = [0u8; 5];
        let region = Region::new(GLOBAL);
        for len in [1024u32, 0, u32::MAX] {
            let mut slot: &mut [u8] = &mut out;
            write_header(&mut slot, FrameType::RecvPacket, len);
            assert_eq!(parse_header(&out), (0x05, len));
        }
        let change = region.change();
        best = best.min(change.allocations + change.reallocations);
    }
    assert_eq!(best, 0);
}
