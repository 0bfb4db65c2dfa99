//! Frame codec: decoding client SendPacket frames from a buffer (the relay's read path) and
//! building RecvPacket headers (its write path), at production-like packet sizes.
//!
//! Run: `cargo bench -p derp-benches --bench codec`

use std::hint::black_box;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use derp_proto::{ClientToRelay, PublicKey, ServerDecoder, frame};

const FRAMES: usize = 64;

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_send_packet");
    for size in [64usize, 570, 1400] {
        let mut stream = BytesMut::new();
        for i in 0..FRAMES {
            ClientToRelay::SendPacket {
                dst: PublicKey::from_bytes([i as u8; 32]),
                packet: Bytes::from(vec![7u8; size]),
            }
            .encode(&mut stream);
        }
        let stream = stream.freeze();
        group.throughput(Throughput::Elements(FRAMES as u64));
        group.bench_function(format!("{size}B"), |b| {
            b.iter(|| {
                let mut buf = BytesMut::from(&stream[..]);
                let mut dec = ServerDecoder::after_handshake();
                let mut n = 0;
                while let Some(f) = dec.decode(&mut buf).expect("valid stream") {
                    black_box(&f);
                    n += 1;
                }
                assert_eq!(n, FRAMES);
            })
        });
    }
    group.finish();
}

fn recv_header(c: &mut Criterion) {
    let src = PublicKey::from_bytes([3; 32]);
    c.bench_function("recv_packet_header", |b| {
        b.iter(|| black_box(frame::recv_packet_header(black_box(&src), black_box(1400))))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = decode, recv_header
}
criterion_main!(benches);
