//! One side of a pair on a blocking socket speaking DERP itself (`--client blocking`): plain
//! http:// only, one write per packet and one read per arriving frame.

use std::io::{ErrorKind, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use derp_client::ClientConfig;
use derp_proto::frame::{FRAME_HEADER_LEN, FrameType, KEY_LEN, PROTOCOL_VERSION};
use derp_proto::{ClientInfo, SecretKey};
use derp_testkit::raw::{BlockingClient, UpgradeRequest};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::packet::{HEADER_LEN, Header, Kind};

use super::{Books, LoopSpec, LoopWindow, PACKET_FRAME_HEAD, STALL, Setup, SideError};

fn raw_connect(
    config: &ClientConfig,
    secret: &SecretKey,
    timeout: Duration,
) -> Result<BlockingClient, SideError> {
    let (host, port) = (config.url.host(), config.url.port());
    let resolve_error = |source| SideError::Resolve {
        host: host.to_owned(),
        source,
    };
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(resolve_error)?
        .next()
        .ok_or_else(|| resolve_error(ErrorKind::NotFound.into()))?;
    let host_header = if port == 80 {
        host.to_owned()
    } else {
        format!("{host}:{port}")
    };
    let request = UpgradeRequest {
        host: &host_header,
        path: config.url.path(),
        extra_headers: "User-Agent: derp-bench\r\n",
    };
    let info = ClientInfo {
        version: i64::from(PROTOCOL_VERSION),
        app_name: "derp-bench".into(),
        ..ClientInfo::default()
    };
    BlockingClient::connect(addr, &request, secret, info, timeout)
        .map_err(|source| SideError::RawConnect { addr, source })
}

pub(super) fn blocking_sender(
    config: ClientConfig,
    secret: SecretKey,
    timeout: Duration,
    setup: Setup,
) {
    let Setup {
        dst,
        pair,
        spec,
        clock,
        ready,
        commands,
    } = setup;
    let mut conn = match raw_connect(&config, &secret, timeout) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if let Err(e) = conn.stream.set_read_timeout(Some(STALL)) {
        let _ = ready.send(Err(e.into()));
        return;
    }
    let _ = ready.send(Ok(()));
    // One SendPacket frame, built once; only the bench header changes between packets.
    let size = spec.size.max(HEADER_LEN);
    let mut frame = vec![0u8; PACKET_FRAME_HEAD + size];
    frame[0] = FrameType::SendPacket as u8;
    frame[1..FRAME_HEADER_LEN].copy_from_slice(&((KEY_LEN + size) as u32).to_be_bytes());
    frame[FRAME_HEADER_LEN..PACKET_FRAME_HEAD].copy_from_slice(dst.as_bytes());
    while let Ok((window, reply)) = commands.recv() {
        let mut books = Books::new(pair, &window, clock);
        let outcome = blocking_window(&mut conn, &spec, &window, &mut books, &mut frame);
        let mut result = books.result;
        let failed = outcome.is_err();
        result.error = outcome.err().map(|e| e.to_string());
        let _ = reply.send(result);
        if failed {
            return;
        }
    }
}

fn blocking_window(
    conn: &mut BlockingClient,
    spec: &LoopSpec,
    window: &LoopWindow,
    books: &mut Books,
    frame: &mut [u8],
) -> Result<(), std::io::Error> {
    std::thread::sleep(window.start.saturating_duration_since(Instant::now()));
    books.last_progress = Instant::now();
    loop {
        if Instant::now() < window.end {
            while books.outstanding < spec.in_flight {
                books.stamp(&mut frame[PACKET_FRAME_HEAD..]);
                (&conn.stream).write_all(frame)?;
            }
        } else if books.outstanding == 0 {
            return Ok(());
        }
        match conn.next_frame() {
            Ok((ty, range)) if ty == FrameType::RecvPacket as u8 => {
                if range.len() >= PACKET_FRAME_HEAD {
                    books.echoed(&conn.buf[range.start + PACKET_FRAME_HEAD..range.end]);
                }
            }
            Ok((ty, range)) if ty == FrameType::Ping as u8 => {
                conn.buf[range.start] = FrameType::Pong as u8;
                (&conn.stream).write_all(&conn.buf[range])?;
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if books.last_progress.elapsed() >= STALL {
                    books.stalled();
                    if Instant::now() >= window.end {
                        return Ok(());
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
}

pub(super) fn blocking_echo(
    config: ClientConfig,
    secret: SecretKey,
    timeout: Duration,
    ready: oneshot::Sender<Result<Option<TcpStream>, SideError>>,
    stopping: Arc<AtomicBool>,
    error: Arc<Mutex<Option<SideError>>>,
) {
    let mut conn = match raw_connect(&config, &secret, timeout) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    match conn.stream.try_clone() {
        Ok(s) => {
            let _ = ready.send(Ok(Some(s)));
        }
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    }
    let outcome: std::io::Result<()> = (|| {
        loop {
            let (ty, range) = conn.next_frame()?;
            // A RecvPacket from A becomes a SendPacket back to A by its type byte alone: the
            // key after the header is A's either way.
            let is_probe = ty == FrameType::RecvPacket as u8
                && range.len() >= PACKET_FRAME_HEAD
                && Header::read(&conn.buf[range.start + PACKET_FRAME_HEAD..range.end])
                    .is_some_and(|h| h.kind == Kind::Probe);
            let answer = if is_probe {
                conn.buf[range.start] = FrameType::SendPacket as u8;
                true
            } else if ty == FrameType::Ping as u8 {
                conn.buf[range.start] = FrameType::Pong as u8;
                true
            } else {
                false
            };
            if answer {
                (&conn.stream).write_all(&conn.buf[range])?;
            }
        }
    })();
    if let Err(e) = outcome
        && !stopping.load(Ordering::Relaxed)
    {
        *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.into());
    }
}
