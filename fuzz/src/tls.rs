//! The TLS front's ClientHello reader (does the hello offer TLS 1.3, so derpd's own record
//! layer serves the connection, and which ALPN protocols does it offer) on arbitrary bytes
//! as read from a socket.
//!
//! - It never panics, whatever the bytes.
//! - A whole ClientHello decides alone: bytes after it (the next record, garbage) never
//!   change what was read from it.
//! - A prefix of the bytes never reads as a different hello: it is incomplete, unknown or
//!   the same hello.

use derp_io::tls::ClientHello;

/// Fuzz target.
pub fn tls_client_hello(data: &[u8]) {
    let hello = ClientHello::parse(data);
    if let ClientHello::Hello { alpn, .. } = &hello {
        assert!(alpn.iter().all(|p| p.len() < 256));
        let mut longer = data.to_vec();
        longer.extend_from_slice(&[0x17, 0x03, 0x03, 0xff]);
        assert_eq!(
            ClientHello::parse(&longer),
            hello,
            "trailing bytes changed the hello"
        );
        let cut = ClientHello::parse(&data[..data.len() / 2]);
        assert!(
            matches!(cut, ClientHello::Incomplete | ClientHello::Unknown) || cut == hello,
            "a prefix read as another hello: {cut:?}"
        );
    }
}
