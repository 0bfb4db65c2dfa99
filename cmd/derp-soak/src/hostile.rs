//! The soak's hostile clients: raw sockets that break the protocol in one way each, and check
//! that the relay answers as it should (a 400 or 405 where HTTP allows an answer) and closes
//! the connection within its deadlines.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use derp_proto::{
    ClientDecoder, ClientHandshake, ClientInfo, ClientToRelay, PublicKey, RelayToClient, SecretKey,
};
use rand::{Rng, RngCore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::{Shared, Stats, Stream};

/// The relay's handshake and request-head deadline is 10 s; allow for a loaded machine.
const CLOSE_DEADLINE: Duration = Duration::from_secs(20);

/// Every way a hostile client misbehaves, in the order the workers cycle through them.
const KINDS: [&str; 10] = [
    "garbage_request",
    "bad_method",
    "low_order_key",
    "unopenable_client_info",
    "oversize_send_packet",
    "short_send_packet",
    "long_ping",
    "mesh_frame",
    "truncated_frame",
    "slowloris",
];

/// Runs hostile attempts one after another until the run stops.
pub(crate) async fn worker(sh: Arc<Shared>, index: usize) {
    let mut round = index;
    while !sh.stopping() {
        let kind = KINDS[round % KINDS.len()];
        round += 1;
        // Slowloris ties a connection up for the whole deadline; do it rarely.
        if kind == "slowloris" && round % (KINDS.len() * 5) >= KINDS.len() {
            continue;
        }
        let attempt = tokio::select! {
            r = attempt(&sh, kind) => r,
            _ = sh.stopped() => return,
        };
        match attempt {
            Ok(()) => {
                *sh.stats
                    .hostile
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(kind)
                    .or_default() += 1;
            }
            Err(what) => {
                Stats::add(&sh.stats.hostile_failed, 1);
                sh.stats.violation(format!("hostile {kind}: {what}"));
            }
        }
        // A short pause between attempts: a steady trickle, not a connection storm.
        let pause = Duration::from_millis(rand::thread_rng().gen_range(50..500));
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = sh.stopped() => return,
        }
    }
}

async fn attempt(sh: &Shared, kind: &str) -> Result<(), Failure> {
    let tcp = TcpStream::connect(&sh.addr)
        .await
        .map_err(Failure::Connect)?;
    let _ = tcp.set_nodelay(true);
    let mut s = sh.secure(tcp).await.map_err(Failure::Tls)?;
    match kind {
        "garbage_request" => {
            let mut junk = vec![0u8; 64];
            rand::thread_rng().fill_bytes(&mut junk);
            junk[0] = 0;
            write(&mut s, &junk).await?;
            expect_answer_then_close(&mut s, "HTTP/1.1 400 ").await
        }
        "bad_method" => {
            write(
                &mut s,
                b"FOO /derp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nUpgrade: DERP\r\n\r\n",
            )
            .await?;
            expect_answer_then_close(&mut s, "HTTP/1.1 405 ").await
        }
        "low_order_key" => {
            let mut buf = upgrade(&mut s).await?;
            let key = PublicKey::from_bytes([0; 32]);
            let forger = SecretKey::generate(&mut rand::rngs::OsRng);
            let sealed = forger.seal_to(&key, &[1; 24], br#"{"version":2}"#);
            let mut out = BytesMut::new();
            ClientToRelay::ClientInfo {
                key,
                sealed: sealed.into(),
            }
            .encode(&mut out);
            write(&mut s, &out).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "unopenable_client_info" => {
            let mut buf = upgrade(&mut s).await?;
            let mut body = vec![0u8; 32 + 24 + 16 + 20];
            rand::thread_rng().fill_bytes(&mut body);
            write(&mut s, &frame(0x02, &body)).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "oversize_send_packet" => {
            let mut buf = handshaken(&mut s).await?;
            write(&mut s, &[0x04, 0xff, 0xff, 0xff, 0xff]).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "short_send_packet" => {
            let mut buf = handshaken(&mut s).await?;
            write(&mut s, &frame(0x04, &[7; 31])).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "long_ping" => {
            let mut buf = handshaken(&mut s).await?;
            write(&mut s, &frame(0x12, &[1; 2000])).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "mesh_frame" => {
            let mut buf = handshaken(&mut s).await?;
            // WatchConns needs the mesh key.
            write(&mut s, &frame(0x10, &[])).await?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "truncated_frame" => {
            let mut buf = handshaken(&mut s).await?;
            let mut partial = frame(0x04, &[]);
            partial[1..5].copy_from_slice(&(32u32 + 100).to_be_bytes());
            partial.extend_from_slice(&[9; 40]);
            write(&mut s, &partial).await?;
            s.shutdown().await.map_err(Failure::Shutdown)?;
            expect_silent_close(&mut s, &mut buf).await
        }
        "slowloris" => {
            write(&mut s, b"GET /derp HTTP/1.1\r\nHost: x\r\nUpgr").await?;
            expect_silent_close(&mut s, &mut BytesMut::new()).await
        }
        other => Err(Failure::UnknownKind(other.to_owned())),
    }
}

fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(ty);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

async fn write(s: &mut Box<dyn Stream>, bytes: &[u8]) -> Result<(), Failure> {
    tokio::time::timeout(CLOSE_DEADLINE, s.write_all(bytes))
        .await
        .map_err(|_| Failure::WriteTimeout)?
        .map_err(Failure::Write)
}

async fn read_more(s: &mut Box<dyn Stream>, buf: &mut BytesMut) -> Result<usize, Failure> {
    buf.reserve(4096);
    tokio::time::timeout(CLOSE_DEADLINE, s.read_buf(buf))
        .await
        .map_err(|_| Failure::Silent)?
        .map_err(Failure::Read)
}

/// Upgrades with `Upgrade: DERP` and reads the 101 head and the ServerKey frame; returns
/// what followed.
async fn upgrade(s: &mut Box<dyn Stream>) -> Result<BytesMut, Failure> {
    write(
        s,
        b"GET /derp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n",
    )
    .await?;
    let mut buf = BytesMut::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if read_more(s, &mut buf).await? == 0 {
            return Err(Failure::Closed("before the 101"));
        }
    };
    if !buf.starts_with(b"HTTP/1.1 101 ") {
        return Err(Failure::Expected {
            expected: "101".to_owned(),
            got: format!("{:?}", String::from_utf8_lossy(&buf[..head_end])),
        });
    }
    let _ = buf.split_to(head_end);
    let mut decoder = ClientDecoder::new();
    loop {
        match decoder.decode(&mut buf) {
            Ok(Some(RelayToClient::ServerKey(_))) => return Ok(buf),
            Ok(Some(other)) => {
                return Err(Failure::Expected {
                    expected: "ServerKey".to_owned(),
                    got: format!("{other:?}"),
                });
            }
            Ok(None) => {
                if read_more(s, &mut buf).await? == 0 {
                    return Err(Failure::Closed("before ServerKey"));
                }
            }
            Err(error) => {
                return Err(Failure::Decode {
                    what: "decoding ServerKey",
                    error,
                });
            }
        }
    }
}

/// A full, valid handshake (up to ServerInfo) with a fresh key.
async fn handshaken(s: &mut Box<dyn Stream>) -> Result<BytesMut, Failure> {
    let mut buf = BytesMut::new();
    write(
        s,
        b"GET /derp HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n",
    )
    .await?;
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if read_more(s, &mut buf).await? == 0 {
            return Err(Failure::Closed("before the 101"));
        }
    };
    let _ = buf.split_to(head_end);
    let secret = SecretKey::generate(&mut rand::rngs::OsRng);
    let mut hs = ClientHandshake::new(
        secret,
        ClientInfo {
            version: 2,
            ..ClientInfo::default()
        },
    );
    let mut decoder = ClientDecoder::new();
    loop {
        match decoder.decode(&mut buf) {
            Ok(Some(RelayToClient::ServerKey(key))) => {
                hs.handle_server_key(key)
                    .map_err(|error| Failure::Handshake {
                        step: "server key",
                        error,
                    })?;
                let mut nonce = [0u8; 24];
                rand::rngs::OsRng.fill_bytes(&mut nonce);
                let mut out = BytesMut::new();
                hs.client_info_frame(nonce, &mut out)
                    .map_err(|error| Failure::Handshake {
                        step: "client info",
                        error,
                    })?;
                write(s, &out).await?;
            }
            Ok(Some(RelayToClient::ServerInfo { sealed })) => {
                hs.handle_server_info(&sealed)
                    .map_err(|error| Failure::Handshake {
                        step: "server info",
                        error,
                    })?;
                return Ok(buf);
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                if read_more(s, &mut buf).await? == 0 {
                    return Err(Failure::Closed("during the handshake"));
                }
            }
            Err(error) => {
                return Err(Failure::Decode {
                    what: "decoding the handshake",
                    error,
                });
            }
        }
    }
}

/// The server must close without sending anything more (keepalives excepted).
async fn expect_silent_close(s: &mut Box<dyn Stream>, buf: &mut BytesMut) -> Result<(), Failure> {
    let mut decoder = ClientDecoder::new();
    loop {
        loop {
            match decoder.decode(buf) {
                Ok(Some(RelayToClient::KeepAlive)) => continue,
                Ok(Some(other)) => return Err(Failure::Answered(format!("{other:?}"))),
                Ok(None) => break,
                Err(error) => {
                    return Err(Failure::Decode {
                        what: "the server sent bytes that are no frame",
                        error,
                    });
                }
            }
        }
        match read_more(s, buf).await {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            // A reset is a close too.
            Err(Failure::Read(_)) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// The server must answer with `status` and then close.
async fn expect_answer_then_close(s: &mut Box<dyn Stream>, status: &str) -> Result<(), Failure> {
    let mut buf = BytesMut::new();
    loop {
        match read_more(s, &mut buf).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(Failure::Read(_)) => break,
            Err(e) => return Err(e),
        }
    }
    if buf.starts_with(status.as_bytes()) {
        Ok(())
    } else {
        Err(Failure::Expected {
            expected: format!("{status:?}"),
            got: format!("{:?}", String::from_utf8_lossy(&buf[..buf.len().min(80)])),
        })
    }
}

/// How a hostile attempt went wrong: the server did not answer and close as it should, or
/// the attempt itself failed.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("TLS handshake: {0}")]
    Tls(derp_client::ConnectError),
    #[error("write timed out")]
    WriteTimeout,
    #[error("write: {0}")]
    Write(std::io::Error),
    #[error("the server neither answered nor closed")]
    Silent,
    /// A read error: the server reset the connection, which counts as closing it.
    #[error("read: {0}")]
    Read(std::io::Error),
    #[error("shutdown: {0}")]
    Shutdown(std::io::Error),
    #[error("closed {0}")]
    Closed(&'static str),
    #[error("expected {expected}, got {got}")]
    Expected { expected: String, got: String },
    #[error("the server answered with {0}")]
    Answered(String),
    #[error("{what}: {error}")]
    Decode {
        what: &'static str,
        error: derp_proto::DecodeError,
    },
    #[error("{step}: {error}")]
    Handshake {
        step: &'static str,
        error: derp_proto::HandshakeError,
    },
    #[error("unknown kind {0}")]
    UnknownKind(String),
}
