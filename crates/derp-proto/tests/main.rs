//! derp-proto's tests against the reference vectors and its property tests, one test binary
//! (compiled and linked once). The allocation check is a binary of its own (`alloc.rs`: it
//! installs a counting global allocator).

mod props;
mod proxy_protocol;
mod resume;
mod vectors;
