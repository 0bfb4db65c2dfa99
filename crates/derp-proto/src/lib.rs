//! placeholder: being written (see /tmp/derpd/proto-api.md)
pub mod stun;
