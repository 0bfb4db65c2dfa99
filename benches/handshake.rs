//! The server's CPU per DERP handshake outside the kernel: the request head, the one X25519
//! (with the HSalsa20 step that turns it into the box key), opening ClientInfo, its JSON, and
//! sealing ServerInfo. The whole-process figure, kernel included, comes from
//! `derp-bench connect`; this says how much of it is the cryptography.
//!
//! Run: `cargo bench -p derp-benches --bench handshake`

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{Criterion, criterion_group, criterion_main};
use derp_proto::crypto::BoxKey;
use derp_proto::upgrade::{self, RequestOptions};
use derp_proto::{ClientHandshake, ClientInfo, ClientToRelay, ServerDecoder, ServerHandshake};
use derp_proto::{KeyPair, PublicKey, SecretKey};

fn server_secret() -> SecretKey {
    SecretKey::from_bytes([0x11; 32])
}

fn client_secret() -> SecretKey {
    SecretKey::from_bytes([0x22; 32])
}

/// What Tailscale's client puts in ClientInfo.
fn client_info() -> ClientInfo {
    ClientInfo {
        version: 2,
        can_ack_pings: true,
        ..ClientInfo::default()
    }
}

/// A ClientInfo frame as a client sends it: its key and the sealed JSON.
fn client_info_frame(server_key: PublicKey) -> (PublicKey, Vec<u8>) {
    let mut client = ClientHandshake::fast_start(client_secret(), client_info(), server_key);
    let mut wire = BytesMut::new();
    client
        .client_info_frame([7; 24], &mut wire)
        .expect("client info");
    match ServerDecoder::new().decode(&mut wire) {
        Ok(Some(ClientToRelay::ClientInfo { key, sealed })) => (key, sealed.to_vec()),
        other => panic!("expected ClientInfo, got {other:?}"),
    }
}

fn crypto(c: &mut Criterion) {
    let server = server_secret();
    let client_key = client_secret().public_key();
    let (_, sealed) = client_info_frame(server.public_key());
    let json = client_info().to_json();
    let box_key = BoxKey::new(&server, &client_key);
    // The server's way (aws-lc, through the KeyPair it keeps) and the portable one
    // (x25519-dalek, what clients use).
    let pair = KeyPair::new(server.clone());
    c.bench_function("x25519_box_key", |b| {
        b.iter(|| BoxKey::with_key_pair(black_box(&pair), black_box(&client_key)))
    });
    c.bench_function("x25519_box_key_portable", |b| {
        b.iter(|| BoxKey::new(black_box(&server), black_box(&client_key)))
    });
    c.bench_function("public_key_from_secret", |b| {
        b.iter(|| black_box(&server).public_key())
    });
    c.bench_function("box_open_client_info", |b| {
        b.iter(|| box_key.open(black_box(&sealed)).expect("opens"))
    });
    c.bench_function("box_seal_server_info", |b| {
        b.iter(|| box_key.seal(black_box(&[3; 24]), black_box(br#"{"version":2}"#)))
    });
    c.bench_function("client_info_json", |b| {
        b.iter(|| ClientInfo::from_json(black_box(&json)).expect("parses"))
    });
}

/// The server side of one handshake without IO, with the server's keys derived beforehand as
/// the relay keeps them: ServerKey, ClientInfo, ServerInfo.
fn server_handshake(c: &mut Criterion) {
    let keys = KeyPair::new(server_secret());
    let (key, sealed) = client_info_frame(keys.public());
    c.bench_function("server_handshake", |b| {
        b.iter(|| {
            let mut out = BytesMut::with_capacity(256);
            let mut hs = ServerHandshake::with_keys(keys.clone());
            hs.server_key_frame(&mut out);
            let info = hs
                .handle_client_info(key, black_box(&sealed))
                .expect("accepted");
            hs.server_info_frame([5; 24], &mut out)
                .expect("server info");
            black_box((info, out))
        })
    });
}

fn request_head(c: &mut Criterion) {
    let mut head = BytesMut::new();
    upgrade::write_request(
        &RequestOptions {
            path: "/derp",
            host: "derp1.example.com",
            user_agent: "tailscale/1.80.0",
            fast_start: false,
            ideal_node: None,
            websocket_key: None,
        },
        &mut head,
    );
    c.bench_function("request_head_parse_and_classify", |b| {
        b.iter(|| {
            let n = upgrade::request_head_len(black_box(&head))
                .expect("valid")
                .expect("complete");
            upgrade::classify_request(black_box(&head[..n]), true)
        })
    });
}

criterion_group!(benches, crypto, server_handshake, request_head);
criterion_main!(benches);
