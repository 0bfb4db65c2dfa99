//! The five measurements.

pub(crate) mod connect;
pub(crate) mod idle;
pub(crate) mod latency;
pub(crate) mod sweep;
pub(crate) mod throughput;
