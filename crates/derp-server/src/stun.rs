//! STUN server: being written.
