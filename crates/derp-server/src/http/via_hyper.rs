//! A `/derp` upgrade that reached hyper (a later request on a keep-alive connection, or a
//! first one the fast path passed on): answered by the same rules as the first request of a
//! connection, and the upgraded connection taken back out of hyper as the transport it came
//! on, so that both kinds of upgrade run on the same streams.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tracing::debug;

use derp_io::Transport;
use derp_proto::upgrade::{self, NotUpgrade, UpgradeKind};

use super::{Body, GuardCell, HyperIo, method_not_allowed, refuse_subprotocol_frame, text};
use crate::conn::{self, Framing, Handover};
use crate::state::ServerState;

/// A `/derp` request that reached hyper: either not an upgrade, or a later request on a
/// keep-alive connection. The latter is upgraded through hyper (no fast start there), by the
/// same rules as the first request of a connection.
pub(super) fn derp_via_hyper(
    shared: &Arc<ServerState>,
    mut req: Request<Incoming>,
    remote: SocketAddr,
    forwarded: Option<std::net::IpAddr>,
    guard: &GuardCell,
) -> Response<Body> {
    if !shared.config.derp_enabled {
        return text(StatusCode::NOT_FOUND, "derp server disabled\n");
    }
    let headers = req.headers();
    let up = upgrade::classify_headers(req.method().as_str(), |name| {
        headers.get(name).and_then(|v| v.to_str().ok())
    });
    let up = match up {
        Ok(up) => up,
        Err(NotUpgrade::MissingWebSocketKey) => {
            return text(StatusCode::BAD_REQUEST, "missing Sec-WebSocket-Key\n");
        }
        Err(NotUpgrade::MethodNotAllowed { allow }) => {
            return method_not_allowed("method not allowed\n", allow);
        }
        Err(e) => {
            if let NotUpgrade::Unsupported(u) = &e {
                debug!(%remote, upgrade = u, "weird upgrade");
            }
            return text(
                StatusCode::UPGRADE_REQUIRED,
                "DERP requires connection upgrade\n",
            );
        }
    };
    let mut resp = Response::new(Body::default());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    let (framing, refuse) = match &up.kind {
        UpgradeKind::WebSocket { accept, derp_token } => {
            h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
            if let Ok(v) = HeaderValue::from_str(accept) {
                h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
            }
            if *derp_token {
                h.insert(
                    header::SEC_WEBSOCKET_PROTOCOL,
                    HeaderValue::from_static("derp"),
                );
            }
            (Framing::WebSocket, !derp_token)
        }
        UpgradeKind::Derp { .. } => {
            h.insert(header::UPGRADE, HeaderValue::from_static("DERP"));
            h.insert(
                "derp-version",
                HeaderValue::from(u16::from(derp_proto::frame::PROTOCOL_VERSION)),
            );
            if let Ok(v) = HeaderValue::from_str(&shared.public_key.to_untyped_hex()) {
                h.insert("derp-public-key", v);
            }
            (Framing::Raw, false)
        }
    };
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    let on_upgrade = hyper::upgrade::on(&mut req);
    let tracker = shared.tasks.clone();
    let shared = shared.clone();
    let guard = guard
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_default();
    if let Some(client) = forwarded {
        guard.relayed_for(client);
    }
    tracker.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) if refuse => {
                let mut io = TokioIo::new(upgraded);
                let close = refuse_subprotocol_frame();
                let _ = tokio::time::timeout(shared.config.handshake_timeout, io.write_all(&close))
                    .await;
            }
            Ok(upgraded) => {
                let (transport, initial) = unwrap_upgraded(upgraded);
                let handover = Handover {
                    transport,
                    initial,
                    remote,
                    preamble: Bytes::new(),
                    framing,
                    not_ideal: up.not_ideal,
                    quic: None,
                    guard,
                    detach: true,
                };
                conn::serve(shared, handover).await;
            }
            Err(e) => debug!(%remote, error = %e, "upgrade failed"),
        }
    });
    resp
}

/// The connection hyper upgraded, as the transport it was before hyper took it, and the bytes
/// already read from it that hyper did not use: the first bytes of the new protocol (DERP
/// frames, or WebSocket frames to decode), which go in front of the socket's.
///
/// Taken out of hyper, an upgraded connection is what one upgraded by its first request is:
/// plain TCP or derpd's TLS records rather than a boxed stream behind hyper's own, with
/// lock-free halves, a reader that can wait for the socket holding no buffer, a TCP socket
/// to sample, and state that can be carried on by another process. Should hyper ever hand
/// back another type, the connection is served boxed, as before.
pub(super) fn unwrap_upgraded(upgraded: hyper::upgrade::Upgraded) -> (Transport, BytesMut) {
    match upgraded.downcast::<HyperIo>() {
        Ok(parts) => {
            let (unread, transport) = parts.io.into_inner().into_parts();
            // hyper read through the replayed bytes before the socket's, so what it holds
            // comes before what it left of them.
            let mut initial = BytesMut::with_capacity(parts.read_buf.len() + unread.len());
            initial.extend_from_slice(&parts.read_buf);
            initial.extend_from_slice(&unread);
            (transport, initial)
        }
        Err(upgraded) => (
            Transport::Boxed(Box::new(TokioIo::new(upgraded))),
            BytesMut::new(),
        ),
    }
}
