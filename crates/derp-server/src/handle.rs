//! One registered connection as the rest of the server sees it: who it is, its flags, the
//! token that ends it, and its send queue.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16};

use derp_proto::{PublicKey, ws};
use tokio_util::sync::CancellationToken;

use crate::queue::{Batch, SendQueue};

/// A registered connection, shared (as `Arc<ConnHandle>`) by the registry, the lookup layers
/// and its own read loop and writer.
#[derive(Debug)]
pub(crate) struct ConnHandle {
    pub(crate) id: u64,
    pub(crate) key: PublicKey,
    pub(crate) remote: SocketAddr,
    /// PeerPresent flags describing this connection to mesh watchers.
    pub(crate) presence_flags: u8,
    pub(crate) can_mesh: bool,
    /// Member of a duplicate set; read on every frame, so it is a plain flag rather than a
    /// lookup in the registry.
    pub(crate) is_dup: AtomicBool,
    /// True while this is its key's active connection; caches check it on every hit.
    pub(crate) active: AtomicBool,
    pub(crate) preferred: AtomicBool,
    /// WebSocket close code the writer sends when the connection ends.
    pub(crate) ws_close_code: AtomicU16,
    /// Cancelled when the connection must end, from either side or on server shutdown.
    pub(crate) cancel: CancellationToken,
    /// What other connections queue for this one to write.
    pub(crate) queue: SendQueue,
}

impl ConnHandle {
    pub(crate) fn new(
        id: u64,
        key: PublicKey,
        remote: SocketAddr,
        presence_flags: u8,
        can_mesh: bool,
        depth: usize,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            id,
            key,
            remote,
            presence_flags,
            can_mesh,
            is_dup: AtomicBool::new(false),
            active: AtomicBool::new(false),
            preferred: AtomicBool::new(false),
            ws_close_code: AtomicU16::new(ws::close_code::INTERNAL_ERROR),
            cancel,
            queue: SendQueue::new(depth),
        }
    }

    /// Ends the connection: closes its queue (later pushes are dropped as
    /// `gone_disconnected`), cancels its tasks, and resumes a parked writer so it can close
    /// the socket. Returns what was still queued, for the caller to count.
    pub(crate) fn close(&self) -> Batch {
        let (rest, parked) = self.queue.close();
        self.cancel.cancel();
        if let Some(writer) = parked {
            writer.resume();
        }
        rest
    }
}
