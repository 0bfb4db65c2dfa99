//! The STUN responder on derper's UDP port (3478 by default).
//!
//! It answers Binding requests with the client's address as seen from here, and nothing else.
//! By default only Tailscale's requests are answered, as derper does (PROTOCOL §4.4); operators
//! can opt in to answering any RFC 5389/8489 client with [`StunConfig::answer_generic`]. Nothing
//! is rate limited: a response is never larger than its request plus 4 bytes, so the responder
//! is not useful for amplification, and it must keep up with a flood of real clients.
//!
//! Design follows tailscale `net/stunserver/stunserver.go`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;

use derp_proto::stun::{self, MAX_RESPONSE_LEN};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::net::UdpSocket;

/// Counters for the STUN responder, registered on a caller-supplied registry.
///
/// The names and labels match derper's `/debug/varz` lines. Every label value exists from
/// construction, at zero, so scrapes see the full set before the first packet.
#[derive(Debug, Clone)]
pub struct StunMetrics {
    /// `stun_requests{disposition="read_error"}`: failed socket reads (not "would block").
    read_error: IntCounter,
    /// `stun_requests{disposition="not_stun"}`: datagrams dropped unanswered because they are
    /// not a binding request this server answers. Includes well-formed non-Tailscale requests
    /// unless generic answering is on.
    not_stun: IntCounter,
    /// `stun_requests{disposition="write_error"}`: responses the socket refused to send.
    write_error: IntCounter,
    /// `stun_requests{disposition="success"}`: responses sent.
    success: IntCounter,
    /// `stun_addrfamily{family="ipv4"}`: accepted requests answered with an IPv4 address,
    /// including IPv4 clients seen as `::ffff:a.b.c.d` on a dual-stack socket.
    ipv4: IntCounter,
    /// `stun_addrfamily{family="ipv6"}`: accepted requests answered with an IPv6 address.
    ipv6: IntCounter,
}

impl StunMetrics {
    /// Creates the counters and registers them on `registry`.
    ///
    /// Fails if `registry` already holds metrics with these names, for example when two STUN
    /// listeners share one registry.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "stun_requests",
                "STUN datagrams received, by what became of them",
            ),
            &["disposition"],
        )?;
        let family = IntCounterVec::new(
            Opts::new(
                "stun_addrfamily",
                "Accepted STUN binding requests, by the address family answered",
            ),
            &["family"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(family.clone()))?;
        // Resolved once here so the per-packet path is a bare atomic increment.
        Ok(StunMetrics {
            read_error: requests.with_label_values(&["read_error"]),
            not_stun: requests.with_label_values(&["not_stun"]),
            write_error: requests.with_label_values(&["write_error"]),
            success: requests.with_label_values(&["success"]),
            ipv4: family.with_label_values(&["ipv4"]),
            ipv6: family.with_label_values(&["ipv6"]),
        })
    }
}

/// What the STUN responder answers.
#[derive(Debug, Clone, Copy, Default)]
pub struct StunConfig {
    /// Also answer binding requests from non-Tailscale STUN clients (any well-formed RFC
    /// 5389/8489 request). Off by default, like derper, which answers only Tailscale clients.
    pub answer_generic: bool,
}

/// Binds the STUN UDP socket, with the kernel's default receive buffer.
///
/// An IPv6 socket takes IPv4 too (`IPV6_V6ONLY` off, whatever the system's default, as Go's
/// are), so binding `[::]` serves both families; IPv4 clients then appear as IPv4-mapped
/// addresses and are answered as IPv4.
///
/// # Panics
///
/// Panics if called outside a tokio runtime, as [`UdpSocket::from_std`] does.
pub fn bind_stun(addr: SocketAddr) -> io::Result<UdpSocket> {
    let socket = stun_socket(addr)?;
    socket.bind(&addr.into())?;
    socket.set_nonblocking(true)?;
    UdpSocket::from_std(socket.into())
}

/// The unbound socket for `addr`'s family.
fn stun_socket(addr: SocketAddr) -> io::Result<socket2::Socket> {
    let domain = socket2::Domain::for_address(addr);
    let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    Ok(socket)
}

/// Answers STUN binding requests on `socket` until `shutdown` completes.
///
/// Each wakeup drains the socket with non-blocking receives before waiting again, and the only
/// per-packet work is a parse, a 32- or 44-byte response built on the stack, a send and two
/// counter increments; nothing is allocated. Read errors are counted and the loop carries on.
/// It also returns, after logging, if the socket's reactor is gone, which only happens while
/// the runtime itself shuts down.
pub async fn serve_stun(
    socket: UdpSocket,
    config: StunConfig,
    metrics: StunMetrics,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = pin!(shutdown);
    let mut buf = [0u8; RECV_BUF_LEN];
    let mut out = [0u8; MAX_RESPONSE_LEN];
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => return,
            ready = socket.readable() => {
                if let Err(error) = ready {
                    tracing::warn!(%error, "STUN socket is no longer pollable; stopping");
                    return;
                }
            }
        }
        // Bounded so a flood still lets this task pass through the select above (which checks
        // shutdown and spends tokio's cooperative budget) every MAX_BATCH datagrams.
        for _ in 0..MAX_BATCH {
            let (n, src) = match socket.try_recv_from(&mut buf) {
                Ok(received) => received,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    metrics.read_error.inc();
                    tracing::debug!(%error, "STUN read error");
                    continue;
                }
            };
            let Some(len) = respond(&buf[..n], src, config, &metrics, &mut out) else {
                continue;
            };
            let sent = match socket.try_send_to(&out[..len], src) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The send buffer is full: wait for room rather than drop an answer, as
                    // derper's blocking write does, but never past shutdown.
                    tokio::select! {
                        biased;
                        () = &mut shutdown => return,
                        sent = socket.send_to(&out[..len], src) => sent,
                    }
                }
                other => other,
            };
            match sent {
                Ok(_) => metrics.success.inc(),
                Err(error) => {
                    metrics.write_error.inc();
                    tracing::debug!(%error, %src, "STUN write error");
                }
            }
        }
    }
}

/// Parses one datagram and, if it is a request this server answers, writes the response into
/// `out` and returns its length. Counts `not_stun` and the address family.
fn respond(
    packet: &[u8],
    src: SocketAddr,
    config: StunConfig,
    metrics: &StunMetrics,
    out: &mut [u8; MAX_RESPONSE_LEN],
) -> Option<usize> {
    let parsed = if config.answer_generic {
        stun::parse_generic_binding_request(packet)
    } else {
        stun::parse_binding_request(packet)
    };
    let tx = match parsed {
        Ok(tx) => tx,
        Err(error) => {
            metrics.not_stun.inc();
            // Peers control this volume, so it stays at trace.
            tracing::trace!(%error, %src, "ignoring UDP datagram on the STUN port");
            return None;
        }
    };
    let len = stun::binding_response(&tx, src, out);
    // The response length tells the family actually answered, which already accounts for
    // IPv4-mapped sources being answered as IPv4.
    if len == IPV4_RESPONSE_LEN {
        metrics.ipv4.inc();
    } else {
        metrics.ipv6.inc();
    }
    Some(len)
}

/// Receive buffer size. Binding requests are far smaller; a longer datagram is truncated by the
/// kernel, no longer matches its header length, and is dropped as `not_stun`.
const RECV_BUF_LEN: usize = 2048;

/// Datagrams handled per readiness wakeup before yielding back to the select.
const MAX_BATCH: usize = 64;

/// Length of a response carrying an IPv4 address (IPv6 ones are 44 bytes).
const IPV4_RESPONSE_LEN: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    use derp_proto::stun::{TxId, binding_request, parse_response};
    use derp_testkit::vectors;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;

    struct Running {
        addr: SocketAddr,
        metrics: StunMetrics,
        registry: Registry,
        stop: oneshot::Sender<()>,
        task: JoinHandle<()>,
    }

    impl Running {
        /// Stops the server and waits for it, so every counter update has happened.
        async fn stop(self) -> (StunMetrics, Registry) {
            self.stop.send(()).expect("server still running");
            tokio::time::timeout(TIMEOUT, self.task)
                .await
                .expect("server stops on shutdown")
                .expect("server task did not panic");
            (self.metrics, self.registry)
        }
    }

    /// Starts a server on `ip`. A host that cannot bind it fails the test, never skips it:
    /// where [::1] cannot be bound, `scripts/test` leaves the IPv6 test out and names it in
    /// its NOT RUN list.
    fn start(ip: IpAddr, config: StunConfig) -> Running {
        let socket = bind_stun(SocketAddr::new(ip, 0)).unwrap_or_else(|e| panic!("bind {ip}: {e}"));
        let addr = socket.local_addr().expect("local addr");
        let registry = Registry::new();
        let metrics = StunMetrics::new(&registry).expect("register metrics");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_stun(socket, config, metrics.clone(), async move {
            let _ = stopped.await;
        }));
        Running {
            addr,
            metrics,
            registry,
            stop,
            task,
        }
    }

    async fn client_for(server: SocketAddr) -> UdpSocket {
        let ip = if server.is_ipv4() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            IpAddr::V6(Ipv6Addr::LOCALHOST)
        };
        let client = UdpSocket::bind(SocketAddr::new(ip, 0))
            .await
            .expect("bind client");
        client.connect(server).await.expect("connect client");
        client
    }

    async fn recv(client: &UdpSocket) -> Vec<u8> {
        let mut buf = [0u8; 1500];
        let n = tokio::time::timeout(TIMEOUT, client.recv(&mut buf))
            .await
            .expect("a response within the timeout")
            .expect("recv");
        buf[..n].to_vec()
    }

    /// Sends a Tailscale request and checks the answer names the client with the same txid.
    async fn exchange(client: &UdpSocket, tx: TxId) {
        client.send(&binding_request(&tx)).await.expect("send");
        let response = recv(client).await;
        let me = client.local_addr().expect("client addr");
        assert_eq!(parse_response(&response), Ok((tx, me)));
    }

    /// Sends `request`, then a valid request, and checks the first reply is the valid one's:
    /// the server handles datagrams in order, so `request` got no reply.
    async fn assert_ignored(client: &UdpSocket, name: &str, request: &[u8], tx: TxId) {
        client.send(request).await.expect("send ignored");
        client
            .send(&binding_request(&tx))
            .await
            .expect("send valid");
        let response = recv(client).await;
        let (got, _) = parse_response(&response).expect("a STUN response");
        assert_eq!(got, tx, "{name} must not be answered");
    }

    fn counts(m: &StunMetrics) -> [u64; 6] {
        [
            m.read_error.get(),
            m.not_stun.get(),
            m.write_error.get(),
            m.success.get(),
            m.ipv4.get(),
            m.ipv6.get(),
        ]
    }

    async fn answers_tailscale_and_ignores_the_rest(ip: IpAddr) {
        let server = start(ip, StunConfig::default());
        let client = client_for(server.addr).await;
        exchange(&client, TxId(*b"derp-vectors")).await;
        for (i, (name, request)) in vectors::stun_ignored_requests().iter().enumerate() {
            assert_ignored(&client, name, request, TxId([i as u8; 12])).await;
        }
        let (metrics, _) = server.stop().await;
        let (v4, v6) = if ip.is_ipv4() { (5, 0) } else { (0, 5) };
        // [read_error, not_stun, write_error, success, ipv4, ipv6]
        assert_eq!(counts(&metrics), [0, 4, 0, 5, v4, v6]);
    }

    #[tokio::test]
    async fn ipv4_tailscale_requests_are_answered_and_others_ignored() {
        answers_tailscale_and_ignores_the_rest(IpAddr::V4(Ipv4Addr::LOCALHOST)).await;
    }

    #[tokio::test]
    async fn ipv6_tailscale_requests_are_answered_and_others_ignored() {
        answers_tailscale_and_ignores_the_rest(IpAddr::V6(Ipv6Addr::LOCALHOST)).await;
    }

    /// An IPv6 socket is dual-stack whatever `net.ipv6.bindv6only` says, so `[::]` serves
    /// IPv4 clients too. Checked before the bind: tests bind loopback only, and some kernels
    /// report a socket bound to `[::1]` as IPv6-only.
    #[test]
    fn ipv6_sockets_are_dual_stack() {
        let socket = stun_socket(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))).expect("socket");
        assert!(!socket.only_v6().expect("getsockopt"));
    }

    #[tokio::test]
    async fn generic_mode_answers_plain_rfc5389_requests() {
        let requests = vectors::stun_ignored_requests();
        let bare = &requests
            .iter()
            .find(|(name, _)| name == "no_attributes")
            .expect("no_attributes vector")
            .1;
        let bare_tx = TxId(bare[8..20].try_into().expect("txid"));

        let default = start(IpAddr::V4(Ipv4Addr::LOCALHOST), StunConfig::default());
        let client = client_for(default.addr).await;
        assert_ignored(&client, "bare request", bare, TxId([0xaa; 12])).await;
        default.stop().await;

        let config = StunConfig {
            answer_generic: true,
        };
        let generic = start(IpAddr::V4(Ipv4Addr::LOCALHOST), config);
        let client = client_for(generic.addr).await;
        client.send(bare).await.expect("send bare");
        let me = client.local_addr().expect("client addr");
        assert_eq!(parse_response(&recv(&client).await), Ok((bare_tx, me)));
        // A corrupted FINGERPRINT is still refused, and Tailscale clients are still served.
        for (name, request) in &requests {
            if name == "bad_fingerprint" {
                assert_ignored(&client, name, request, TxId([0xbb; 12])).await;
            }
        }
        exchange(&client, TxId([0xcc; 12])).await;
        let (metrics, _) = generic.stop().await;
        assert_eq!(counts(&metrics), [0, 1, 0, 3, 3, 0]);
    }

    #[tokio::test]
    async fn metrics_start_at_zero_with_every_label() {
        let registry = Registry::new();
        let _metrics = StunMetrics::new(&registry).expect("register");
        // Read through the text format so the check does not depend on prometheus's model types.
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encode");
        let mut samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        samples.sort_unstable();
        assert_eq!(
            samples,
            [
                r#"stun_addrfamily{family="ipv4"} 0"#,
                r#"stun_addrfamily{family="ipv6"} 0"#,
                r#"stun_requests{disposition="not_stun"} 0"#,
                r#"stun_requests{disposition="read_error"} 0"#,
                r#"stun_requests{disposition="success"} 0"#,
                r#"stun_requests{disposition="write_error"} 0"#,
            ]
        );
        // A second responder cannot silently share the same registry.
        assert!(StunMetrics::new(&registry).is_err());
    }

    #[tokio::test]
    async fn shutdown_stops_an_idle_server() {
        let server = start(IpAddr::V4(Ipv4Addr::LOCALHOST), StunConfig::default());
        let (metrics, _) = server.stop().await;
        assert_eq!(counts(&metrics), [0; 6]);
    }

    const TIMEOUT: Duration = Duration::from_secs(10);
}
