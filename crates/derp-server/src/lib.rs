//! placeholder
mod stun;
mod ws;
