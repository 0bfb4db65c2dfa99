//! derpd's process-level tests, one test binary: each module runs the `derpd` binary (and,
//! where a module says so, the programs of scripts/test-tools beside it) as an operator
//! would. One binary rather than one per module, so the suite is compiled and linked once.

mod support;
mod tools;

mod bench_upgrade;
mod check;
mod cli;
mod deploy;
mod derper;
mod faults;
mod handover;
mod limits;
mod mesh;
mod netem;
mod netns;
mod notify;
mod package;
mod proxy;
mod restart;
mod stun_client;
mod tls;
mod upgrade;
