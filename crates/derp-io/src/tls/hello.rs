//! The ClientHello reader: what the TLS front needs to know before it picks a path.

use super::record::{CONTENT_HANDSHAKE, HEADER_LEN};

/// What the TLS front needs from a ClientHello before it picks a path and a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientHello {
    /// The bytes hold the start of a ClientHello; read more.
    Incomplete,
    /// The bytes are not a well-formed ClientHello (or one this reader does not follow, such
    /// as one over many records): leave the connection to rustls, which refuses or handles it.
    Unknown,
    /// A whole ClientHello.
    Hello {
        /// It offers TLS 1.3 in its supported_versions extension.
        tls13: bool,
        /// The ALPN protocols it offers, in its order (empty when it offers none).
        alpn: Vec<Vec<u8>>,
    },
}

impl ClientHello {
    /// Reads the ClientHello at the start of `bytes`, as read from the socket (one or more
    /// handshake records). Bytes after the hello are ignored.
    pub fn parse(bytes: &[u8]) -> Self {
        // The records' headers first: nothing is copied until the hello is whole, so a hello
        // trickled in over many reads costs a few header reads per read.
        let mut parts: [&[u8]; MAX_HELLO_RECORDS] = [&[]; MAX_HELLO_RECORDS];
        let mut records = 0;
        let mut have = 0;
        let mut need = usize::MAX;
        let mut rest = bytes;
        while have < need {
            match *rest {
                [CONTENT_HANDSHAKE, _, _, hi, lo, ..] => {
                    let len = usize::from(u16::from_be_bytes([hi, lo]));
                    // Empty handshake records are forbidden (RFC 8446, section 5.1).
                    if len == 0 || records == MAX_HELLO_RECORDS {
                        return Self::Unknown;
                    }
                    let Some(payload) = rest.get(HEADER_LEN..HEADER_LEN + len) else {
                        return Self::Incomplete;
                    };
                    if records == 0 {
                        let [_, a, b, c, ..] = *payload else {
                            return Self::Unknown;
                        };
                        need = 4 + (usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c));
                        if need > MAX_CLIENT_HELLO {
                            return Self::Unknown;
                        }
                    }
                    parts[records] = payload;
                    records += 1;
                    have += len;
                    rest = &rest[HEADER_LEN + len..];
                }
                [CONTENT_HANDSHAKE, ..] | [] => return Self::Incomplete,
                _ => return Self::Unknown,
            }
        }
        let message = parts[..records].concat();
        Self::read_message(&message).unwrap_or(Self::Unknown)
    }

    /// Reads a ClientHello message (RFC 8446, section 4.1.2) for its supported_versions and
    /// application_layer_protocol_negotiation extensions.
    fn read_message(message: &[u8]) -> Option<Self> {
        const CLIENT_HELLO: u8 = 1;
        const ALPN: u16 = 16;
        const SUPPORTED_VERSIONS: u16 = 43;
        let mut r = Reader(message);
        if r.u8()? != CLIENT_HELLO {
            return None;
        }
        let len = r.u24()?;
        let mut r = Reader(r.take(len)?);
        r.take(2 + 32)?; // legacy_version, random
        let n = r.u8()?;
        r.take(usize::from(n))?; // legacy_session_id
        let n = r.u16()?;
        r.take(usize::from(n))?; // cipher_suites
        let n = r.u8()?;
        r.take(usize::from(n))?; // legacy_compression_methods
        let (mut tls13, mut alpn) = (false, Vec::new());
        if r.0.is_empty() {
            // No extensions at all: an old client.
            return Some(Self::Hello { tls13, alpn });
        }
        let n = r.u16()?;
        let mut extensions = Reader(r.take(usize::from(n))?);
        while !extensions.0.is_empty() {
            let kind = extensions.u16()?;
            let n = extensions.u16()?;
            let mut body = Reader(extensions.take(usize::from(n))?);
            match kind {
                SUPPORTED_VERSIONS => {
                    let n = body.u8()?;
                    let versions = body.take(usize::from(n))?;
                    tls13 = versions.chunks_exact(2).any(|v| v == [3, 4]);
                }
                ALPN => {
                    let n = body.u16()?;
                    let mut list = Reader(body.take(usize::from(n))?);
                    while !list.0.is_empty() {
                        let n = list.u8()?;
                        alpn.push(list.take(usize::from(n))?.to_vec());
                    }
                }
                _ => {}
            }
        }
        Some(Self::Hello { tls13, alpn })
    }
}

/// The random of the ClientHello at the start of `bytes` (one or more handshake records),
/// which rustls's key log names a handshake by; `None` until its first 38 bytes are here, or
/// if the bytes do not start with a ClientHello.
pub(super) fn client_random(bytes: &[u8]) -> Option<[u8; 32]> {
    const CLIENT_HELLO: u8 = 1;
    // The message's type and length (4), legacy_version (2), then the random (32).
    let mut head = [0u8; 38];
    let mut have = 0;
    let mut rest = bytes;
    while have < head.len() {
        let [CONTENT_HANDSHAKE, _, _, hi, lo, ref after @ ..] = *rest else {
            return None;
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        if len == 0 {
            return None;
        }
        // What of the record is here: the random may be whole before the record is.
        let payload = &after[..len.min(after.len())];
        let n = payload.len().min(head.len() - have);
        head[have..have + n].copy_from_slice(&payload[..n]);
        have += n;
        if payload.len() < len {
            break;
        }
        rest = &after[len..];
    }
    if have < head.len() || head[0] != CLIENT_HELLO {
        return None;
    }
    head[6..].try_into().ok()
}

/// Records a ClientHello may span here (one in practice); more is left to rustls.
pub(super) const MAX_HELLO_RECORDS: usize = 8;

/// A ClientHello's bytes read at most before it must be whole (a post-quantum key share
/// makes one about 1.8 KB; rustls refuses a handshake message over 64 KiB).
pub const MAX_CLIENT_HELLO: usize = 64 * 1024;

/// Big-endian fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u24(&mut self) -> Option<usize> {
        let b = self.take(3)?;
        Some(usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]))
    }
}
