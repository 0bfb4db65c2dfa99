//! One side of a pair on derp-client (`--client tokio`): a current-thread runtime of its
//! own per side, every URL scheme.

use std::net::TcpStream;
use std::sync::{Arc, Mutex, PoisonError};

use derp_client::{Client, ClientConfig, ClientError, ClientReader, ClientWriter, ReceivedFrame};
use derp_proto::{ClientToRelay, PublicKey};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::packet::{HEADER_LEN, Header, Kind};
use crate::report::error_text;

use super::{Books, LoopSpec, LoopWindow, STALL, Setup, SideError};

fn current_thread_runtime() -> Result<tokio::runtime::Runtime, SideError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SideError::Runtime)
}

/// One side of a pair: a current-thread runtime of its own and a client connected on it.
fn connect_lean(
    config: &ClientConfig,
) -> Result<(tokio::runtime::Runtime, ClientReader, ClientWriter), SideError> {
    let rt = current_thread_runtime()?;
    let client = rt
        .block_on(Client::connect(config))
        .map_err(SideError::Connect)?;
    let (reader, writer) = client.split();
    Ok((rt, reader, writer))
}

pub(super) fn tokio_sender(config: ClientConfig, setup: Setup) {
    let Setup {
        dst,
        pair,
        spec,
        clock,
        ready,
        commands,
    } = setup;
    let (rt, mut reader, mut writer) = match connect_lean(&config) {
        Ok(connected) => connected,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut buf = vec![0u8; spec.size.max(HEADER_LEN)];
    while let Ok((window, reply)) = commands.recv() {
        let mut books = Books::new(pair, &window, clock);
        let outcome = rt.block_on(tokio_window(
            &mut reader,
            &mut writer,
            dst,
            &spec,
            &window,
            &mut books,
            &mut buf,
        ));
        let mut result = books.result;
        let failed = outcome.is_err();
        result.error = outcome.err().map(|e| error_text(&e));
        let _ = reply.send(result);
        if failed {
            return;
        }
    }
}

async fn tokio_window(
    reader: &mut ClientReader,
    writer: &mut ClientWriter,
    dst: PublicKey,
    spec: &LoopSpec,
    window: &LoopWindow,
    books: &mut Books,
    buf: &mut [u8],
) -> Result<(), ClientError> {
    tokio::time::sleep_until(window.start).await;
    books.last_progress = Instant::now();
    loop {
        if Instant::now() < window.end {
            while books.outstanding < spec.in_flight {
                books.stamp(buf);
                writer.queue_packet(dst, &*buf)?;
            }
        } else if books.outstanding == 0 {
            return Ok(());
        }
        // Keep reading while a write waits, so neither end can block the other.
        while writer.buffered_len() > 0 {
            let frame = tokio::select! {
                biased;
                r = writer.flush() => {
                    r?;
                    break;
                }
                f = reader.recv() => f,
            };
            on_sender_frame(frame?, writer, books)?;
        }
        match tokio::time::timeout_at(books.last_progress + STALL, reader.recv()).await {
            Ok(frame) => on_sender_frame(frame?, writer, books)?,
            Err(_) => {
                books.stalled();
                if Instant::now() >= window.end {
                    return Ok(());
                }
            }
        }
    }
}

fn on_sender_frame(
    frame: ReceivedFrame,
    writer: &mut ClientWriter,
    books: &mut Books,
) -> Result<(), ClientError> {
    match frame {
        ReceivedFrame::RecvPacket { packet, .. } => books.echoed(&packet),
        ReceivedFrame::Ping(data) => writer.queue_frame(&ClientToRelay::Pong(data))?,
        _ => {}
    }
    Ok(())
}

pub(super) fn tokio_echo(
    config: ClientConfig,
    ready: oneshot::Sender<Result<Option<TcpStream>, SideError>>,
    mut stop: watch::Receiver<bool>,
    error: Arc<Mutex<Option<SideError>>>,
) {
    let (rt, mut reader, mut writer) = match connect_lean(&config) {
        Ok(connected) => connected,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(None));
    let outcome: Result<(), ClientError> = rt.block_on(async {
        loop {
            let frame = tokio::select! {
                biased;
                _ = stop.changed() => return Ok(()),
                f = reader.recv() => f?,
            };
            echo(frame, &mut writer)?;
            while writer.buffered_len() > 0 {
                let frame = tokio::select! {
                    biased;
                    r = writer.flush() => {
                        r?;
                        break;
                    }
                    f = reader.recv() => f?,
                };
                echo(frame, &mut writer)?;
            }
        }
    });
    if let Err(e) = outcome
        && !*stop.borrow()
    {
        *error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.into());
    }
}

/// Queues the echo of a probe (or the answer to a ping).
fn echo(frame: ReceivedFrame, writer: &mut ClientWriter) -> Result<(), ClientError> {
    match frame {
        ReceivedFrame::RecvPacket { src, packet }
            if Header::read(&packet).is_some_and(|h| h.kind == Kind::Probe) =>
        {
            writer.queue_packet(src, &packet)?;
        }
        ReceivedFrame::Ping(data) => writer.queue_frame(&ClientToRelay::Pong(data))?,
        _ => {}
    }
    Ok(())
}
