//! derp-load: what the load generator (`derp-bench`) and the soak test (`derp-soak`) are
//! made of, so that each program is only its command line and its modes.
//!
//! What it does:
//! - names the server under test and observes it ([`target`], [`args`]): its DERP URL and
//!   how to trust its certificate, a relay started in this process (`--spawn-server`), its
//!   CPU and memory from `/proc` ([`procfs`]) and its Prometheus metrics ([`prom`]);
//! - generates load with DERP clients: sender/receiver pairs with paced or unpaced senders
//!   ([`fleet`], [`pacing`]), closed loops with one thread per side ([`closed_loop`]),
//!   connection storms and held connections ([`connections`]), every packet carrying the
//!   bench's header ([`packet`]), and pairs carrying a trickle of packets through a
//!   server's upgrade in place, with the signal that asks for it ([`upgrade`]);
//! - measures: the run's clock, round-trip histograms, CPU samples, drops between two
//!   scrapes ([`measure`]), and the JSON pieces every mode's report is built from
//!   ([`report`]);
//! - spreads a run over several processes ([`procs`] for the plumbing, [`worker`] for what
//!   the processes say to each other and do);
//! - runs a mode from start to end: the in-process relay, a handshake before anything else,
//!   a time bound, the report's envelope, the bottleneck warnings ([`ctx`]);
//! - serves the floor relay ([`floor`]), the least a relay can do, to measure against.
//!
//! What it does not do: parse a program's command line beyond the flags every program
//! shares ([`args::TargetArgs`]), choose what a mode reports or how it is shown, or test a
//! relay's correctness (the soak's checks are `derp-soak`'s).

pub mod args;
pub mod closed_loop;
pub mod connections;
pub mod ctx;
pub mod fleet;
pub mod floor;
pub mod measure;
pub mod pacing;
pub mod packet;
pub mod procfs;
pub mod procs;
pub mod prom;
pub mod report;
pub mod target;
pub mod upgrade;
pub mod worker;

pub use ctx::{Ctx, Outcome, Tool};
