//! STUN: the work the UDP loop does per datagram (parse a Tailscale binding request, build
//! the response), without the socket.
//!
//! Run: `cargo bench -p derp-benches --bench stun`

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use derp_proto::stun::{self, TxId};

fn stun(c: &mut Criterion) {
    let request = stun::binding_request(&TxId([7; 12]));
    let mut group = c.benchmark_group("stun");
    group.throughput(Throughput::Elements(1));
    for (name, from) in [
        (
            "ipv4",
            "192.0.2.1:41641".parse::<SocketAddr>().expect("addr"),
        ),
        (
            "ipv6",
            "[2001:db8::1]:41641".parse::<SocketAddr>().expect("addr"),
        ),
    ] {
        group.bench_function(format!("parse_and_respond/{name}"), |b| {
            let mut out = [0u8; stun::MAX_RESPONSE_LEN];
            b.iter(|| {
                let tx = stun::parse_binding_request(black_box(&request)).expect("valid");
                black_box(stun::binding_response(&tx, black_box(from), &mut out))
            })
        });
    }
    group.bench_function("reject_garbage", |b| {
        let garbage = [0x42u8; 48];
        b.iter(|| black_box(stun::parse_binding_request(black_box(&garbage)).is_err()))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = stun
}
criterion_main!(benches);
