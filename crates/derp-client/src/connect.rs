//! Dialing, the HTTP upgrade and the DERP handshake.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use derp_io::{ReadHalf, Transport};
use derp_proto::upgrade::{self, RequestOptions};
use derp_proto::ws;
use derp_proto::{ClientHandshake, RelayToClient, ServerInfo};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

use crate::Client;
use crate::config::{ClientConfig, TransportKind};
use crate::error::ConnectError;
use crate::path::{PREAMBLE, QuicPath};
use crate::ping::PingTracker;
use crate::reader::ClientReader;
use crate::tls;
use crate::transport::{FrameReader, FrameWriter, WsShared};
use crate::writer::ClientWriter;

/// Dials the configured URL and runs the upgrade and handshake within the connect budget.
pub(crate) async fn connect(config: &ClientConfig) -> Result<Client, ConnectError> {
    validate(config)?;
    let tls = if config.url.scheme().is_tls() {
        // Built before dialing so a bad cert name or root fails without network traffic.
        Some(tls::client_config(config)?)
    } else {
        None
    };
    with_budget(config, async {
        let mut tcp = dial(config).await?;
        let local = tcp.local_addr().ok();
        if config.proxy_header {
            write_proxy_header(&mut tcp).await?;
        }
        let Some(tls) = tls else {
            return establish(config, Transport::Tcp(tcp), local, Opening::Http).await;
        };
        let (stream, meta_key) = tls::handshake(tls, config.url.host(), tcp).await?;
        match meta_key {
            Some(key)
                if config.fast_start_key.is_none()
                    && config.transport == TransportKind::Upgrade
                    && !config.probe_first =>
            {
                let mut fast = config.clone();
                fast.fast_start_key = Some(key);
                establish(
                    &fast,
                    Transport::Boxed(Box::new(stream)),
                    local,
                    Opening::Http,
                )
                .await
            }
            _ => {
                establish(
                    config,
                    Transport::Boxed(Box::new(stream)),
                    local,
                    Opening::Http,
                )
                .await
            }
        }
    })
    .await
}

/// Runs the upgrade and handshake over a stream the caller already connected (and perhaps
/// wrapped in TLS).
pub(crate) async fn connect_stream(
    config: &ClientConfig,
    stream: Transport,
) -> Result<Client, ConnectError> {
    validate(config)?;
    with_budget(config, establish(config, stream, None, Opening::Http)).await
}

pub(crate) async fn with_budget(
    config: &ClientConfig,
    fut: impl Future<Output = Result<Client, ConnectError>>,
) -> Result<Client, ConnectError> {
    tokio::time::timeout(config.connect_timeout, fut)
        .await
        .map_err(|_| ConnectError::Timeout(config.connect_timeout))?
}

pub(crate) fn validate(config: &ClientConfig) -> Result<(), ConnectError> {
    if config.fast_start_key.is_some() && config.transport == TransportKind::WebSocket {
        return Err(ConnectError::InvalidConfig(
            "fast start is not available over websocket",
        ));
    }
    if config.probe_first && config.fast_start_key.is_some() {
        return Err(ConnectError::InvalidConfig(
            "a probe first is not available with fast start",
        ));
    }
    if config.probe_first && config.uses_quic() {
        return Err(ConnectError::InvalidConfig(
            "a probe first is not available over quic",
        ));
    }
    if config.uses_quic() && config.transport == TransportKind::WebSocket {
        return Err(ConnectError::InvalidConfig(
            "websocket is not available over quic",
        ));
    }
    if let Some(node) = &config.ideal_node
        && !upgrade::valid_header_value(node)
    {
        return Err(ConnectError::InvalidConfig(
            "ideal node contains control characters",
        ));
    }
    Ok(())
}

/// The addresses to try for `port`, in resolver order: the configured dial address's IP, or
/// the URL host's addresses of the local address's family. (A QUIC port may differ from the
/// TCP port a dial address names.)
pub(crate) async fn resolve(
    config: &ClientConfig,
    port: u16,
) -> Result<Vec<SocketAddr>, ConnectError> {
    if let Some(addr) = config.dial_addr {
        return Ok(vec![SocketAddr::new(addr.ip(), port)]);
    }
    let addrs = tokio::net::lookup_host((config.url.host(), port)).await?;
    Ok(addrs
        .filter(|addr| {
            config
                .local_addr
                .is_none_or(|local| local.is_ipv4() == addr.is_ipv4())
        })
        .collect())
}

/// Resolves the host and connects to the first address that accepts, from the configured
/// local address if there is one.
async fn dial(config: &ClientConfig) -> Result<TcpStream, ConnectError> {
    if let Some(addr) = config.dial_addr {
        return Ok(dial_one(addr, config.local_addr).await?);
    }
    let host = config.url.host();
    let addrs = resolve(config, config.url.port()).await?;
    let mut last_err = None;
    for addr in addrs {
        match dial_one(addr, config.local_addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => {
                tracing::debug!(%addr, error = %e, "dial failed");
                last_err = Some(e);
            }
        }
    }
    Err(last_err.map_or_else(
        || ConnectError::NoAddress {
            host: host.to_owned(),
        },
        ConnectError::Io,
    ))
}

/// A PROXY protocol v2 header naming the connection's own ends, as a proxy's health check
/// would: the server sees this client's real address.
async fn write_proxy_header(tcp: &mut TcpStream) -> io::Result<()> {
    use derp_proto::proxy_protocol::{Addresses, Command, write_v2};
    use tokio::io::AsyncWriteExt;
    let addresses = Addresses::Tcp {
        source: tcp.local_addr()?,
        destination: tcp.peer_addr()?,
    };
    let mut header = Vec::new();
    write_v2(Command::Proxy, &addresses, &[], &mut header).map_err(io::Error::other)?;
    tcp.write_all(&header).await
}

async fn dial_one(addr: SocketAddr, local: Option<SocketAddr>) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(local) = local {
        socket.bind(local)?;
    }
    let stream = socket.connect(addr).await?;
    // DERP frames are small and latency matters; Go disables Nagle by default too.
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// How the DERP byte stream opens.
pub(crate) enum Opening {
    /// An HTTP upgrade request (and, unless fast start, its 101 response).
    Http,
    /// DERP over QUIC: the preamble on the connection's stream, no HTTP.
    Quic(QuicPath),
}

/// HTTP upgrade (or QUIC preamble) plus DERP handshake over a connected stream.
pub(crate) async fn establish(
    config: &ClientConfig,
    stream: Transport,
    local_addr: Option<SocketAddr>,
    opening: Opening,
) -> Result<Client, ConnectError> {
    let (mut read_half, write_half) = stream.split();
    let quic = match opening {
        Opening::Http => None,
        Opening::Quic(path) => Some(path),
    };
    let websocket = config.transport == TransportKind::WebSocket && quic.is_none();
    let ws_shared = websocket.then(|| Arc::new(WsShared::default()));
    let mut writer = FrameWriter::new(write_half, ws_shared.clone());

    let ws_key = websocket.then(|| ws::new_key(rand::random()));
    if quic.is_some() {
        writer.queue_raw(&PREAMBLE);
    } else {
        let mut head = BytesMut::new();
        if config.probe_first {
            head.extend_from_slice(b"HEAD /derp/probe HTTP/1.1\r\nHost: ");
            head.extend_from_slice(config.url.host_header().as_bytes());
            head.extend_from_slice(b"\r\n\r\n");
        }
        upgrade::write_request(
            &RequestOptions {
                path: config.url.path(),
                host: &config.url.host_header(),
                user_agent: USER_AGENT,
                fast_start: config.fast_start_key.is_some(),
                ideal_node: config.ideal_node.as_deref(),
                websocket_key: ws_key.as_deref(),
            },
            &mut head,
        );
        writer.queue_raw(&head);
    }

    let info = config.client_info();
    let secret = config.secret_key.clone();
    let mut handshake = match config.fast_start_key {
        Some(server_key) => ClientHandshake::fast_start(secret, info, server_key),
        None => ClientHandshake::new(secret, info),
    };

    let (mut reader, server_key) = if let Some(server_key) = config.fast_start_key {
        // Fast start: request and ClientInfo leave in one write, and no HTTP response comes
        // back; the server's first bytes are its ServerKey frame.
        queue_client_info(&mut handshake, &mut writer)?;
        writer.flush().await?;
        let reader = FrameReader::new(read_half, BytesMut::new(), None, config.read_timeout);
        (reader, server_key)
    } else {
        writer.flush().await?;
        let leftover = if quic.is_some() {
            BytesMut::new()
        } else {
            read_response(&mut read_half, ws_key.as_deref(), config.probe_first).await?
        };
        let mut reader = FrameReader::new(read_half, leftover, ws_shared, config.read_timeout);
        let server_key = match reader.next_frame().await? {
            RelayToClient::ServerKey(key) => key,
            other => {
                return Err(ConnectError::UnexpectedFrame {
                    frame_type: frame_type(&other),
                });
            }
        };
        handshake.handle_server_key(server_key)?;
        queue_client_info(&mut handshake, &mut writer)?;
        writer.flush().await?;
        (reader, server_key)
    };

    let server_info: ServerInfo = loop {
        match reader.next_frame().await? {
            RelayToClient::ServerInfo { sealed } => break handshake.handle_server_info(&sealed)?,
            // Fast start: the ServerKey the server still sends. Unknown: skipped, as in Go.
            RelayToClient::ServerKey(_) | RelayToClient::Unknown { .. } => {}
            other => {
                return Err(ConnectError::UnexpectedFrame {
                    frame_type: frame_type(&other),
                });
            }
        }
    };
    tracing::debug!(server = %server_key, ?server_info, "derp handshake complete");

    if let Some(path) = &quic {
        // Datagrams from here on: the server sends none before ServerInfo.
        reader.attach_quic(path.connection().clone(), path.counters());
        writer.attach_quic(path.connection().clone(), path.datagrams(), path.counters());
    }
    let pings = Arc::new(PingTracker::default());
    Ok(Client::from_parts(
        config.fast_start_key.is_some(),
        ClientReader::new(
            reader,
            pings.clone(),
            config.secret_key.clone(),
            server_key,
            server_info,
            local_addr,
            quic.clone(),
        ),
        ClientWriter::new(writer, pings, server_key, local_addr, quic),
    ))
}

/// Seals ClientInfo with a fresh random nonce and queues the frame.
fn queue_client_info(
    handshake: &mut ClientHandshake,
    writer: &mut FrameWriter,
) -> Result<(), ConnectError> {
    let mut frame = BytesMut::new();
    handshake.client_info_frame(rand::random(), &mut frame)?;
    writer.queue_encoded(&frame)?;
    Ok(())
}

/// Reads the response head, checks it, and returns the bytes that followed it. With `probe`,
/// the probe's answer (a head without a body) comes first and must be a 200.
async fn read_response(
    io: &mut ReadHalf,
    ws_key: Option<&str>,
    mut probe: bool,
) -> Result<BytesMut, ConnectError> {
    let mut buf = BytesMut::with_capacity(RESPONSE_READ);
    let head = loop {
        if let Some(head) = upgrade::parse_response(&buf).map_err(ConnectError::BadResponse)? {
            if !probe {
                break head;
            }
            if head.status != 200 {
                return Err(ConnectError::HttpStatus {
                    status: head.status,
                });
            }
            let _ = buf.split_to(head.len);
            probe = false;
            continue;
        }
        buf.reserve(RESPONSE_READ);
        if io.read_buf(&mut buf).await? == 0 {
            return Err(ConnectError::UnexpectedEof);
        }
    };
    if head.status != 101 {
        return Err(ConnectError::HttpStatus {
            status: head.status,
        });
    }
    if let Some(key) = ws_key {
        upgrade::check_websocket_response(&head, key).map_err(ConnectError::BadResponse)?;
    }
    let _ = buf.split_to(head.len);
    Ok(buf)
}

/// The wire type byte of a decoded frame, for error reports.
fn frame_type(frame: &RelayToClient) -> u8 {
    match (frame, frame.frame_type()) {
        (_, Some(ty)) => ty.as_u8(),
        (RelayToClient::Unknown { frame_type, .. }, None) => *frame_type,
        // Every other variant has a frame type.
        (_, None) => 0,
    }
}

/// Sent instead of Go's `Go-http-client/1.1`; servers ignore it.
const USER_AGENT: &str = concat!("derp-client/", env!("CARGO_PKG_VERSION"));
/// Read size while waiting for the response head.
const RESPONSE_READ: usize = 4096;
