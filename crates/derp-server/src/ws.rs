//! WebSocket transport: being written.
