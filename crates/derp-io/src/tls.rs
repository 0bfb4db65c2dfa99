//! TLS 1.3 with the record layer in derpd's hands: rustls runs the handshake (through its
//! unbuffered API, on buffers this module owns); once the handshake is done, records are
//! sealed and opened here, in place, with the traffic keys rustls hands over, and the key
//! schedule after the handshake (RFC 8446's KeyUpdate) runs here, from the traffic secrets
//! caught through rustls's key log during the handshake. This is what kernel TLS does, in
//! user space: kernel TLS is missing on many hosts (no `tls` module), and without it rustls's
//! buffered connection keeps a 4 KiB record buffer and its whole connection state in every
//! idle connection, copies every received record twice and allocates for every record it
//! receives or sends.
//!
//! What it does: [`configure`] readies a rustls server config (secret extraction, and the
//! process's [`SecretCapture`] as its key log); [`accept`] finishes a handshake whose
//! ClientHello has already been read, takes the handshake's traffic secrets from the
//! capture, and yields a [`TlsStream`] that splits without a lock into a [`TlsRead`] and a
//! [`TlsWrite`], each holding its direction's key and traffic secret. rustls's connection
//! state is dropped there; a handshake whose secrets were not captured (counted:
//! [`uncaptured`]) keeps it, shared by the halves, for its key updates. Received records
//! are decrypted where they were read and handed over with one copy; sent bytes are copied
//! once into the record buffer and sealed there. An idle connection holds no record buffer
//! in either direction ([`TlsRead::release_idle`], [`TlsWrite::shrink_idle`]), and its
//! reader can wait for the socket to become readable without reading. Key updates work
//! both ways: a peer's KeyUpdate is followed (and answered before the next data when it
//! asks), and the sending side updates its own key before the negotiated suite's
//! confidentiality limit, as rustls gives it. Traffic secrets are zeroed when dropped. The
//! three TLS 1.3 suites rustls offers are implemented ([`SUPPORTED_SUITES`]); a server
//! config must offer no other. A peer's records are held to RFC 8446 as rustls holds them (but for the
//! header's legacy version, which RFC 8446 says to ignore and rustls checks): a run of more
//! than 32 records without data is refused, a user_canceled warning is passed over,
//! close_notify ends the stream (as does the end of the stream between records, logged and
//! counted as a truncation: [`truncations`]). A failed handshake sends the alert rustls
//! chose; a refused record later gets the one RFC 8446 asks for, sealed under the current
//! key, before the connection closes. The error is returned to the caller by every read
//! from then on, and writes are refused, as they are after this side's close_notify.
//!
//! A live connection can be handed to another process without the peer noticing: each
//! half's state (its direction's traffic secret and sequence number, the records read and
//! not opened, the plaintext opened and not handed over, the records sealed and not written,
//! a KeyUpdate owed, the run of records without data) is copied out between polls
//! ([`TlsRead::snapshot`], [`TlsWrite::snapshot`]), carried in a compact, versioned binary
//! form ([`RxSnapshot::encode`], [`RxSnapshot::decode`] and the same for [`TxSnapshot`];
//! the secrets are in it, so it belongs in memory only the two processes share, never in a
//! file or a log), and the stream is rebuilt on a duplicate of the socket
//! ([`TlsStream::resume`]), which writes the old stream's unwritten records before anything
//! else. The old halves are then [`forget`](TlsWrite::forget)ten: dropped without
//! close_notify and without the `shutdown(2)` a dropped tokio write half makes. A connection
//! that ended, failed, or whose secrets were not captured is not handable
//! ([`NotHandable`]).
//!
//! What it does not do: TLS 1.2 (a client that cannot speak TLS 1.3 is served by rustls's
//! buffered connection instead), early data (not enabled), the client side, or handshake
//! messages split over records after the handshake (a KeyUpdate must come whole, as every
//! library sends it).
//!
//! With the cargo feature `fuzzing`, the module `fuzzing` opens records under known secrets
//! without a socket, for the fuzz targets; nothing that serves enables it.

mod capture;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod handshake;
mod hello;
mod keys;
mod known;
mod record;
mod snapshot;
mod stream;

pub use capture::{SecretCapture, configure};
pub use handshake::{AcceptError, FinishedHandshake, accept, uncaptured};
pub use hello::{ClientHello, MAX_CLIENT_HELLO};
pub use known::{Suite, TrafficSecret};
pub use record::{SUPPORTED_SUITES, supports};
pub use snapshot::{
    MAX_SNAPSHOT_BUFFER, NotHandable, ResumeError, RxSnapshot, SnapshotError, TxSnapshot,
};
pub use stream::{TlsRead, TlsStream, TlsWrite, truncations};

#[cfg(test)]
mod tests;
