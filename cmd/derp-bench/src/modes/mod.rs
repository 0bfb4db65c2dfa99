//! The seven measurements.

pub(crate) mod connect;
pub(crate) mod fleets;
pub(crate) mod idle;
pub(crate) mod latency;
pub(crate) mod pingpong;
pub(crate) mod sweep;
pub(crate) mod throughput;
pub(crate) mod upgrade;
