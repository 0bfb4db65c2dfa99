//! The TLS front's ClientHello check (does the hello offer TLS 1.3, so derpd's own record
//! layer serves the connection) on arbitrary bytes as read from a socket.
//!
//! - It never panics, whatever the bytes.
//! - A whole ClientHello decides alone: bytes after it (the next record, garbage) never
//!   change a yes.

/// Fuzz target.
pub fn tls_client_hello(data: &[u8]) {
    if derp_io::tls::client_hello_offers_tls13(data) {
        let mut longer = data.to_vec();
        longer.extend_from_slice(&[0x17, 0x03, 0x03, 0xff]);
        assert!(
            derp_io::tls::client_hello_offers_tls13(&longer),
            "trailing bytes changed the answer"
        );
    }
}
