//! End-to-end tests: a real derpd relay on 127.0.0.1 with real sockets.

mod acme;
mod admission;
mod client;
mod debug;
mod handover;
mod harness;
mod hostile;
mod layout;
mod limits;
mod load;
mod mesh;
mod metrics;
mod quic;
mod relay;
mod tls;
mod tls_records;
mod vectors;
