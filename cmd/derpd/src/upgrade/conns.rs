//! Client connections across an upgrade: the old process sends its frozen connections in
//! batches, each batch's state in a memfd (it may hold megabytes of queued packets, more
//! than a message carries) and its sockets beside it; the new process reads each batch and
//! says it took it, and once all are across, takes them over (inert until the commit) or
//! refuses. The state never touches a file system: a memfd is memory only the two processes
//! hold, and each is emptied as soon as its batch is taken.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Instant;

use anyhow::{Context, bail};
use derp_server::HandedConn;

use super::wire::{self, CONNS_PER_BATCH, Message};

/// Sends `conns` in batches; returns once the new process has taken them all over (inert)
/// and says how many.
pub(crate) fn send_all(
    channel: &OwnedFd,
    conns: &[HandedConn],
    deadline: Instant,
) -> anyhow::Result<u32> {
    let mut batches = 0u32;
    for batch in conns.chunks(CONNS_PER_BATCH) {
        let bytes = derp_server::encode_conns(batch);
        let memfd = rustix::fs::memfd_create("derpd-handover", rustix::fs::MemfdFlags::CLOEXEC)
            .context("creating a memfd for the connections' state")?;
        let mut file = std::fs::File::from(memfd);
        file.write_all(&bytes)
            .context("writing the connections' state")?;
        let mut fds = vec![file.as_fd()];
        fds.extend(batch.iter().map(HandedConn::fd));
        let message = Message::Conns {
            batch: batches,
            count: u32::try_from(batch.len()).unwrap_or(u32::MAX),
            bytes: bytes.len() as u64,
        };
        wire::send(channel, &message, &fds).context("sending connections")?;
        match wire::recv(channel, deadline) {
            Ok((Message::Took { batch }, _)) if batch == batches => {}
            Ok((Message::Refuse { reason }, _)) => bail!("refused the connections: {reason}"),
            Ok((other, _)) => bail!("sent {other:?} instead of taking batch {batches}"),
            Err(e) => return Err(e).context("waiting for the new process to take connections"),
        }
        // Taken: the pages (queued packets, and later TLS secrets) go now, not when both
        // processes have closed the memfd.
        let _ = file.set_len(0);
        batches += 1;
    }
    let count = u32::try_from(conns.len()).unwrap_or(u32::MAX);
    wire::send(
        channel,
        &Message::ConnsEnd {
            batches,
            conns: count,
        },
        &[],
    )
    .context("ending the connections")?;
    match wire::recv(channel, deadline) {
        Ok((Message::Adopted { conns }, _)) if conns == count => Ok(conns),
        Ok((Message::Refuse { reason }, _)) => bail!("refused the connections: {reason}"),
        Ok((other, _)) => bail!("sent {other:?} instead of taking the connections over"),
        Err(e) => Err(e).context("waiting for the new process to take the connections over"),
    }
}

/// Receives every batch up to `ConnsEnd` (`first` is the first message, already read),
/// answering each; the caller adopts them and says `Adopted` (or refuses).
pub(crate) fn receive_all(
    channel: &OwnedFd,
    first: (Message, Vec<OwnedFd>),
    deadline: Instant,
) -> anyhow::Result<Vec<HandedConn>> {
    let mut conns = Vec::new();
    let mut batches = 0u32;
    let mut next = Some(first);
    loop {
        let (message, mut fds) = match next.take() {
            Some(first) => first,
            None => wire::recv(channel, deadline).context("receiving connections")?,
        };
        match message {
            Message::Conns {
                batch,
                count,
                bytes,
            } => {
                if batch != batches || fds.len() != count as usize + 1 {
                    bail!(
                        "batch {batch} of {count} connections came {}th with {} descriptors",
                        batches,
                        fds.len()
                    );
                }
                let sockets = fds.split_off(1);
                let memfd = std::fs::File::from(fds.remove(0));
                let len = usize::try_from(bytes).context("batch size")?;
                if memfd.metadata().map(|m| m.len()).ok() != Some(bytes) {
                    bail!("batch {batch}: the memfd does not hold {bytes} bytes");
                }
                // TLS connections' traffic secrets are in it.
                let mut state = zeroize::Zeroizing::new(vec![0u8; len]);
                memfd
                    .read_exact_at(&mut state, 0)
                    .context("reading the connections' state")?;
                conns.extend(
                    derp_server::decode_conns(&state, sockets)
                        .with_context(|| format!("batch {batch}"))?,
                );
                wire::send(channel, &Message::Took { batch }, &[]).context("answering")?;
                batches += 1;
            }
            Message::ConnsEnd {
                batches: sent,
                conns: count,
            } => {
                if sent != batches || count as usize != conns.len() {
                    bail!(
                        "{sent} batches and {count} connections announced, {batches} and {} came",
                        conns.len()
                    );
                }
                return Ok(conns);
            }
            other => bail!("sent {other:?} while handing connections over"),
        }
    }
}
