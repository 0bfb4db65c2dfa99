//! DERP over QUIC, the client side: the UDP endpoint, the QUIC handshake and the DERP
//! stream, then the same handshake code as over TCP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use derp_io::Transport;
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Endpoint, EndpointConfig, IdleTimeout, TransportConfig, VarInt};
use rustls::pki_types::CertificateDer;

use crate::Client;
use crate::config::ClientConfig;
use crate::connect::{Opening, establish, resolve, validate, with_budget};
use crate::error::ConnectError;
use crate::path::QuicPath;
use crate::tls;

/// Connects over QUIC and runs the DERP handshake on the connection's stream, all within
/// the connect budget.
pub(crate) async fn connect(config: &ClientConfig) -> Result<Client, ConnectError> {
    validate(config)?;
    with_budget(config, connect_inner(config)).await
}

async fn connect_inner(config: &ClientConfig) -> Result<Client, ConnectError> {
    let tls = tls::quic_client_config(config)?;
    let crypto = QuicClientConfig::try_from(tls).map_err(ConnectError::QuicTlsConfig)?;
    let client = quinn::ClientConfig::new(Arc::new(crypto));
    let addrs = resolve(config, config.quic_dial_port()).await?;
    let mut last_err = None;
    for addr in addrs {
        match connect_one(config, &client, addr).await {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::debug!(%addr, error = %e, "quic dial failed");
                last_err = Some(e);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| ConnectError::NoAddress {
        host: config.url.host().to_owned(),
    }))
}

async fn connect_one(
    config: &ClientConfig,
    client: &quinn::ClientConfig,
    addr: SocketAddr,
) -> Result<Client, ConnectError> {
    let local = config.local_addr.unwrap_or_else(|| {
        if addr.is_ipv4() {
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))
        } else {
            SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))
        }
    });
    let socket = std::net::UdpSocket::bind(local)?;
    tokio::runtime::Handle::try_current().map_err(ConnectError::NoRuntime)?;
    let runtime = Arc::new(quinn::TokioRuntime);
    let mut endpoint_config = EndpointConfig::default();
    endpoint_config.supported_versions(vec![QUIC_V1]);
    endpoint_config.cid_generator(|| {
        Box::new(quinn_proto::RandomConnectionIdGenerator::new(
            derp_io::quic::CLIENT_CID_LEN,
        ))
    });
    let mut client = client.clone();
    client.transport_config(Arc::new(transport_config(config, addr.ip())));
    let endpoint = Endpoint::new(endpoint_config, None, socket, runtime)?;
    let local_addr = endpoint.local_addr().ok();
    let connecting = endpoint
        .connect_with(client.clone(), addr, config.url.host())
        .map_err(|e| ConnectError::QuicConnect(Box::new(e)))?;
    let conn = connecting.await.map_err(quic_error)?;
    let meta_key = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| tls::meta_certificate_key(&chain));
    let (send, recv) = conn.open_bi().await.map_err(quic_error)?;
    let path = QuicPath::new(endpoint, conn.clone(), config.quic_datagrams);
    let fast;
    let config = match meta_key {
        // QUIC is always TLS 1.3: the meta certificate's key allows fast start.
        Some(key) if config.fast_start_key.is_none() => {
            fast = ClientConfig {
                fast_start_key: Some(key),
                ..config.clone()
            };
            &fast
        }
        _ => config,
    };
    establish(
        config,
        Transport::Halves(Box::new(recv), Box::new(derp_io::quic::SendStream(send))),
        local_addr,
        Opening::Quic(path),
    )
    .await
}

/// A QUIC error as a connect error: a failed TLS handshake (a CRYPTO_ERROR, 0x100-0x1ff:
/// untrusted certificate, no common ALPN) is [`ConnectError::QuicTls`], a TLS failure as over
/// TCP; the rest, including the server's application close codes,
/// [`ConnectError::QuicConnection`].
fn quic_error(e: quinn::ConnectionError) -> ConnectError {
    let code = match &e {
        quinn::ConnectionError::TransportError(t) => Some(u64::from(t.code)),
        quinn::ConnectionError::ConnectionClosed(c) => Some(u64::from(c.error_code)),
        _ => None,
    };
    match code {
        Some(code) if (0x100..0x200).contains(&code) => ConnectError::QuicTls(Box::new(e)),
        _ => ConnectError::QuicConnection(Box::new(e)),
    }
}

/// QUIC version 1 (RFC 9000), the only one spoken.
const QUIC_V1: u32 = 1;

/// The client's transport parameters (docs/protocol.md): no streams opened by the server,
/// datagrams accepted unless turned off, the same idle timeout and keep-alive as the server,
/// and the settings the server shares (`derp_io::quic`).
fn transport_config(config: &ClientConfig, server: IpAddr) -> TransportConfig {
    let datagrams = config.quic_datagrams;
    let mut t = TransportConfig::default();
    derp_io::quic::configure(&mut t, config.quic_congestion, server);
    t.max_concurrent_bidi_streams(VarInt::from_u32(0));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.max_idle_timeout(IdleTimeout::try_from(IDLE_TIMEOUT).ok());
    t.keep_alive_interval(Some(KEEP_ALIVE));
    // quinn refuses datagrams larger than this buffer; above 65535 plus overhead, the
    // advertised max_datagram_frame_size is the full 65535. None turns datagrams off in
    // both directions.
    t.datagram_receive_buffer_size(datagrams.then_some(DATAGRAM_RECEIVE_BUFFER));
    t
}

const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
const KEEP_ALIVE: Duration = Duration::from_secs(15);
const DATAGRAM_RECEIVE_BUFFER: usize = 128 * 1024;

#[cfg(test)]
mod tests {
    use quinn::{ConnectionClose, ConnectionError, TransportErrorCode};

    use super::*;

    fn closed_by_peer(code: TransportErrorCode) -> ConnectionError {
        ConnectionError::ConnectionClosed(ConnectionClose {
            error_code: code,
            frame_type: None,
            reason: bytes::Bytes::new(),
        })
    }

    #[test]
    fn tls_alerts_are_told_from_other_quic_failures_by_close_code() {
        // bad_certificate (42), as the server's TLS stack closes with it.
        let err = quic_error(closed_by_peer(TransportErrorCode::crypto(42)));
        assert!(matches!(err, ConnectError::QuicTls(_)), "{err:?}");
        // unknown_ca (48): the client's own TLS refusing the server's certificate.
        let local = quinn_proto::TransportError::from(TransportErrorCode::crypto(48));
        let err = quic_error(ConnectionError::TransportError(local));
        assert!(matches!(err, ConnectError::QuicTls(_)), "{err:?}");
        assert!(err.to_string().starts_with("tls: "), "{err}");

        let err = quic_error(closed_by_peer(TransportErrorCode::CONNECTION_REFUSED));
        assert!(
            matches!(
                &err,
                ConnectError::QuicConnection(e)
                    if matches!(
                        &**e,
                        ConnectionError::ConnectionClosed(c)
                            if c.error_code == TransportErrorCode::CONNECTION_REFUSED
                    )
            ),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("quic: "), "{err}");
        let err = quic_error(ConnectionError::TimedOut);
        assert!(
            matches!(&err, ConnectError::QuicConnection(e) if **e == ConnectionError::TimedOut),
            "{err:?}"
        );
    }
}
