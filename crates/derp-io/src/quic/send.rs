//! A QUIC stream's sending half that takes a vectored write in one call.

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;

/// quinn's [`quinn::SendStream`], with vectored writes. quinn takes one slice per call, and
/// each call locks the connection, copies the slice and wakes the connection's driver; a
/// relayed packet is two slices (frame header, payload) and a batch many. This gathers the
/// slices of one write into a buffer and hands them over in one call.
#[derive(Debug)]
pub struct SendStream(pub quinn::SendStream);

/// Most bytes gathered for one call: about what quinn sends before the stream's flow
/// control or the congestion window pushes back anyway.
const MAX_GATHER: usize = 64 * 1024;

thread_local! {
    /// Where the slices are gathered; used only inside one synchronous call.
    static GATHER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl AsyncWrite for SendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.get_mut().0), cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let stream = &mut self.get_mut().0;
        let first = bufs.iter().position(|b| !b.is_empty());
        let Some(first) = first else {
            return Poll::Ready(Ok(0));
        };
        let bufs = &bufs[first..];
        if bufs.len() == 1 || bufs[0].len() >= MAX_GATHER {
            return AsyncWrite::poll_write(Pin::new(stream), cx, &bufs[0]);
        }
        GATHER.with_borrow_mut(|gather| {
            gather.clear();
            for b in bufs {
                let room = MAX_GATHER - gather.len();
                if room == 0 {
                    break;
                }
                gather.extend_from_slice(&b[..b.len().min(room)]);
            }
            // The bytes taken are a prefix of the slices: what quinn took of the buffer is
            // what was written.
            AsyncWrite::poll_write(Pin::new(stream), cx, gather)
        })
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.get_mut().0), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.get_mut().0), cx)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
    use rustls::pki_types::PrivateKeyDer;
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A QUIC server and a client connected to it on loopback, with the client's stream.
    async fn stream_pair() -> (
        quinn::Endpoint,
        quinn::Endpoint,
        quinn::SendStream,
        quinn::RecvStream,
    ) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("cert");
        let cert = key.cert.der().clone();
        let private = PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls 1.3")
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], private)
            .expect("server tls");
        tls.alpn_protocols = vec![b"test".to_vec()];
        let crypto = QuicServerConfig::try_from(tls).expect("quic server tls");
        let server = quinn::Endpoint::server(
            quinn::ServerConfig::with_crypto(Arc::new(crypto)),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        )
        .expect("server");

        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).expect("root");
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"test".to_vec()];
        let crypto = QuicClientConfig::try_from(tls).expect("quic client tls");
        let mut client =
            quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).expect("client");
        client.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));

        let addr = server.local_addr().expect("server address");
        let accept = async {
            let conn = server
                .accept()
                .await
                .expect("incoming")
                .await
                .expect("accept");
            conn.accept_bi().await.expect("stream")
        };
        let connect = async {
            let conn = client
                .connect(addr, "localhost")
                .expect("connect")
                .await
                .expect("handshake");
            let (mut send, recv) = conn.open_bi().await.expect("open");
            // A stream exists for the server once something arrives on it.
            send.write_all(b"x").await.expect("first byte");
            (send, recv)
        };
        let ((_, mut server_recv), (send, _)) = tokio::join!(accept, connect);
        let mut first = [0u8; 1];
        server_recv
            .read_exact(&mut first)
            .await
            .expect("first byte");
        (server, client, send, server_recv)
    }

    #[tokio::test]
    async fn a_vectored_write_goes_to_quinn_in_one_call_and_arrives_whole() {
        let (server, client, send, mut recv) = stream_pair().await;
        let mut send = SendStream(send);
        let header = [4u8, 0, 0, 0, 3];
        let payload = vec![7u8; 1400];
        let big = vec![9u8; MAX_GATHER + 100];
        let slices = [
            IoSlice::new(&[]),
            IoSlice::new(&header),
            IoSlice::new(&payload),
            IoSlice::new(&big),
        ];
        // One call takes the header, the payload and what fits of the next slice: quinn's
        // own stream would take only the header.
        let taken = std::future::poll_fn(|cx| Pin::new(&mut send).poll_write_vectored(cx, &slices))
            .await
            .expect("write");
        assert_eq!(taken, MAX_GATHER);
        let expected = [&header[..], &payload[..], &big[..]].concat();
        send.write_all(&expected[taken..]).await.expect("the rest");
        send.shutdown().await.expect("finish");

        let got = recv.read_to_end(1 << 20).await.expect("read");
        assert_eq!(got, expected);
        client.close(0u32.into(), b"");
        server.close(0u32.into(), b"");
    }
}
