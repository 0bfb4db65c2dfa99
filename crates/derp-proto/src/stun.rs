//! STUN codec: being written.
