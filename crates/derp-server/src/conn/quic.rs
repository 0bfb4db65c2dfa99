//! How a QUIC connection enters the relay: its QUIC handshake under a deadline and a cap,
//! its DERP stream and preamble, then the same [`serve`](super::serve_counted) as every
//! TCP connection, and finally a CONNECTION_CLOSE with the code that says why it ended.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use derp_io::Transport;
use tokio::sync::OwnedSemaphorePermit;
use tracing::debug;

use super::{ConnError, Framing, Handover, LocalError, PeerMisbehaved};
use crate::listen::ConnGuard;
use crate::metrics::{HandshakeResult, TransportLabel};
use crate::quic::{Conn, Incoming, PREAMBLE, QuicLink, QuicListener, close_code};
use crate::state::ServerState;

/// Accepts QUIC connections until the server shuts down, then closes the endpoint. While
/// the server drains (graceful shutdown) new connections are refused (CONNECTION_REFUSED,
/// so a client tries elsewhere at once) and established ones keep their connection until the
/// drain is over.
pub(crate) async fn accept_loop(shared: Arc<ServerState>, listener: QuicListener) {
    let QuicListener {
        mut endpoint,
        incoming: mut offers,
        config,
        handshakes,
    } = listener;
    endpoint.start(shared.clone());
    loop {
        let incoming = tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            i = offers.recv() => match i {
                Some(i) => i,
                None => break,
            },
        };
        let results = &shared.metrics.quic_handshakes;
        if shared.draining.is_cancelled() {
            // Without a server config quinn would answer with a stateless reset, which a
            // client cannot tell from noise before its handshake: it would retry until its
            // own deadline.
            results[HandshakeResult::Refused as usize].inc();
            incoming.refuse();
            continue;
        }
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            // Over the cap: make an unproven source prove its address first (a Retry costs
            // the server no state), and refuse one that already did.
            if !incoming.remote_address_validated() && incoming.may_retry() {
                results[HandshakeResult::Retry as usize].inc();
                incoming.retry();
            } else {
                results[HandshakeResult::Refused as usize].inc();
                incoming.refuse();
            }
            continue;
        };
        shared.tasks.spawn(serve_incoming(
            shared.clone(),
            incoming,
            permit,
            config.handshake_timeout,
        ));
    }
    // Attempts that arrive from now on are refused by the endpoint itself.
    drop(offers);
    endpoint.close(close_code::SHUTDOWN);
    // Give the CONNECTION_CLOSE frames a moment to leave before the socket goes away.
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
}

/// Runs one QUIC handshake, holding a slot of the in-flight cap until it is done, then the
/// DERP connection.
async fn serve_incoming(
    shared: Arc<ServerState>,
    incoming: Incoming,
    permit: OwnedSemaphorePermit,
    timeout: Duration,
) {
    // The QUIC handshake and the DERP stream's opening share one deadline: loss slows both
    // (a client that needed many tries for its handshake has backed off far by the time it
    // sends its stream), and the client's own budget covers both.
    let deadline = tokio::time::Instant::now() + timeout;
    let remote = incoming.remote_address();
    let results = &shared.metrics.quic_handshakes;
    let conn = match incoming.accept() {
        Ok(c) => c,
        Err(e) => {
            results[HandshakeResult::Error as usize].inc();
            debug!(%remote, error = %e, "quic handshake refused");
            return;
        }
    };
    serve_accepted(&shared, &conn, remote, permit, deadline).await;
    // The rest of what the path counted (while the client was registered, its path watcher
    // added it every second).
    conn.fold_path_counts(&shared.metrics);
}

/// [`serve_incoming`] once quinn handover the connection: the handshake, the DERP
/// connection, the close and its log line.
async fn serve_accepted(
    shared: &Arc<ServerState>,
    conn: &Conn,
    remote: SocketAddr,
    permit: OwnedSemaphorePermit,
    deadline: tokio::time::Instant,
) {
    let results = &shared.metrics.quic_handshakes;
    tokio::select! {
        _ = shared.shutdown.cancelled() => return,
        r = tokio::time::timeout_at(deadline, conn.handshake()) => match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                results[HandshakeResult::Error as usize].inc();
                debug!(%remote, error = %e, "quic handshake failed");
                return;
            }
            Err(_) => {
                // Dropping the half-done connection closes it.
                results[HandshakeResult::Timeout as usize].inc();
                debug!(%remote, "quic handshake timed out");
                return;
            }
        },
    }
    results[HandshakeResult::Ok as usize].inc();
    drop(permit);
    let code = serve_connection(shared, conn, remote, deadline).await;
    conn.close(code);
    if tracing::enabled!(tracing::Level::DEBUG) {
        // How the path to this client fared, from the server's side: what a client's own
        // statistics cannot show (the window the server sent under, its MTU, its losses,
        // how many DATAGRAM frames shared a UDP datagram).
        let stats = conn.stats();
        let path = stats.path;
        let filter = conn.loss_filter();
        let (passed, ignored) = filter.as_ref().map_or((0, 0), |f| f.decisions());
        debug!(
            %remote,
            code,
            rtt_ms = path.rtt.as_secs_f64() * 1e3,
            cwnd = path.cwnd,
            congestion_events = path.congestion_events,
            sent_packets = path.sent_packets,
            lost_packets = path.lost_packets,
            udp_sent = stats.udp_tx.datagrams,
            udp_received = stats.udp_rx.datagrams,
            datagram_frames_sent = stats.frame_tx.datagram,
            datagram_frames_received = stats.frame_rx.datagram,
            acks_sent = stats.frame_tx.acks,
            acks_received = stats.frame_rx.acks,
            mtu = path.current_mtu,
            black_holes = path.black_holes_detected,
            losses_passed = passed,
            losses_ignored = ignored,
            loss_rate = filter.as_ref().map(|f| f.loss_rate()),
            random_loss = filter.as_ref().and_then(|f| f.random_loss()),
            queue_ms = filter.as_ref().and_then(|f| f.queue_delay()).map(|d| d.as_secs_f64() * 1e3),
            "quic connection closed"
        );
    }
}

/// Takes the DERP stream and its preamble (by `deadline`), then serves DERP on it. Returns
/// the close code. `remote` is the address the QUIC handshake came from and so validated:
/// by the time the preamble is read, quinn may already follow a packet forwarded from
/// elsewhere, and `conn.remote_address()` says where quinn sends now, validated or not.
async fn serve_connection(
    shared: &Arc<ServerState>,
    conn: &Conn,
    remote: SocketAddr,
    deadline: tokio::time::Instant,
) -> u32 {
    let opened = tokio::select! {
        _ = shared.shutdown.cancelled() => return close_code::SHUTDOWN,
        r = tokio::time::timeout_at(deadline, async {
            let (mut recv, send) = conn
                .accept_bi()
                .await
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::ConnectionAborted, e))?;
            let mut preamble = [0u8; PREAMBLE.len()];
            recv.read_exact(&mut preamble).await?;
            Ok::<_, std::io::Error>((send, recv, preamble))
        }) => r,
    };
    let (send, recv) = match opened {
        Ok(Ok((send, recv, preamble))) if preamble == PREAMBLE => (send, recv),
        Ok(Ok(_)) => {
            early_failure(shared, PeerMisbehaved::Preamble.into());
            return close_code::HANDSHAKE_FAILED;
        }
        Ok(Err(e)) => {
            early_failure(shared, e.into());
            return close_code::NO_ERROR;
        }
        Err(_) => {
            early_failure(shared, LocalError::HandshakeTimeout.into());
            return close_code::HANDSHAKE_TIMEOUT;
        }
    };
    let link = QuicLink::new(conn.clone(), remote);
    let handover = Handover {
        transport: Transport::Halves(Box::new(recv), Box::new(send)),
        initial: BytesMut::new(),
        remote,
        preamble: Bytes::new(),
        framing: Framing::Raw,
        not_ideal: false,
        quic: Some(link.clone()),
        // The QUIC listener bounds its own handshakes (an in-flight cap, then Retry).
        guard: ConnGuard::none(),
        detach: false,
    };
    let result = super::serve_counted(shared.clone(), handover).await;
    close_code_for(shared, &link, &result)
}

/// Counts a connection that failed before it reached the DERP handshake proper, as
/// [`super::serve_counted`] counts every other.
fn early_failure(shared: &ServerState, error: ConnError) {
    let m = &shared.metrics;
    m.accepts.inc();
    m.accepts_by_transport[TransportLabel::Quic as usize].inc();
    m.connection_errors.with_label_values(&error.labels()).inc();
    debug!(error = %error, "quic connection ended before the derp handshake");
}

/// The application close code that says why a DERP-over-QUIC connection ended.
fn close_code_for(shared: &ServerState, link: &QuicLink, result: &Result<(), ConnError>) -> u32 {
    if shared.shutdown.is_cancelled() {
        return close_code::SHUTDOWN;
    }
    if link.write_timed_out() {
        return close_code::WRITE_TIMEOUT;
    }
    match result {
        Err(ConnError::Local(LocalError::HandshakeTimeout)) => close_code::HANDSHAKE_TIMEOUT,
        Err(ConnError::Peer(_)) if !link.was_registered() => close_code::HANDSHAKE_FAILED,
        Err(ConnError::Peer(_)) => close_code::PROTOCOL_ERROR,
        // The client's stream or connection went away under us.
        Err(ConnError::Local(_)) => close_code::NO_ERROR,
        Ok(()) if link.client_finished() => close_code::NO_ERROR,
        // Ended from this side: a mesh peer's ClosePeer, or the writer gave up.
        Ok(()) => close_code::CLOSED,
    }
}
