//! DERP over QUIC and DERP over TLS/TCP across a lossy, delayed link: derpd runs in a network
//! namespace of its own at the far end of a link that loses 1 % of packets and delays each by
//! 20 ms, each way, and clients in this process relay packets through it over each transport.
//!
//! The link is `tc netem` on a veth pair where the kernel has `sch_netem`, and otherwise
//! `scripts/lossy-link.py`, which does the same in user space on a TUN pair (python3). It
//! needs root (CAP_NET_ADMIN) and iproute2: without them the test fails (it never passes
//! without having run); `scripts/test` leaves it out when not run as root, and says so. It
//! checks that round trips get through on both transports, that none came back faster than
//! the link's delay allows and that the link did drop packets (a link that quietly stopped
//! delaying or losing would otherwise leave the test passing while testing nothing), and how
//! many took a resend; speed across the link is measured by `scripts/bench-quic loss`, not
//! asserted here.

use crate::support;
use crate::tools;

use std::process::Command;
use std::time::{Duration, Instant};

use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::SecretKey;
use support::{Launch, Node, Process, STEP, TempDir};

const SERVER_IP: &str = "10.202.0.1";
const CLIENT_IP: &str = "10.202.0.2";
/// The link's one-way delay, each way.
const DELAY_MS: u64 = 20;
/// A relayed round trip crosses the link four times (A to derpd, derpd to B, and back), each
/// after the full delay; the slack is for timer granularity, never for a shorter path.
const RTT_FLOOR: Duration = Duration::from_millis(4 * DELAY_MS - 5);
/// Datagrams sent across the link to nowhere after the round trips, so that 1 % loss drops
/// some with near certainty (none in 2000 has odds of about 2e-9) whatever the round trips
/// happened to send.
const FILLER_DATAGRAMS: usize = 2000;
/// Round trips each transport must complete.
const ROUND_TRIPS: u32 = 30;
/// How long a client waits for an echo before it sends the packet again: a datagram lost on
/// the link is not resent by anyone else.
const RESEND_AFTER: Duration = Duration::from_secs(1);

fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespace derpd runs in and the link to it; removed on drop.
struct Link {
    ns: String,
    /// The veth end in this namespace (netem), or the user-space link's process.
    kind: LinkKind,
}

enum LinkKind {
    Netem { veth: String },
    UserSpace { forwarder: Process },
}

impl Drop for Link {
    fn drop(&mut self) {
        if let LinkKind::Netem { veth } = &self.kind {
            let _ = ip(&["link", "del", veth]);
        }
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

impl Link {
    /// Packets the link has dropped so far, both directions together.
    fn dropped(&self) -> u64 {
        match &self.kind {
            LinkKind::Netem { veth } => {
                let there = veth.replacen("dnetem", "dnetemp", 1);
                netem_dropped(&["qdisc", "show", "dev", veth])
                    + netem_dropped(&["-n", &self.ns, "qdisc", "show", "dev", &there])
            }
            LinkKind::UserSpace { forwarder } => {
                forwarder.signal("USR1");
                let line = forwarder.wait_stdout("the user-space link's counts", |l| {
                    l.starts_with("counts ").then(|| l.to_owned())
                });
                line.split_whitespace()
                    .filter_map(|f| f.strip_prefix("lost="))
                    .map(|n| n.parse::<u64>().unwrap_or_else(|_| panic!("{line}")))
                    .sum()
            }
        }
    }

    fn name(&self) -> &'static str {
        match self.kind {
            LinkKind::Netem { .. } => "tc netem",
            LinkKind::UserSpace { .. } => "scripts/lossy-link.py",
        }
    }
}

/// Makes the namespace and the link: netem if the kernel has it, else the user-space link.
fn make_link() -> Result<Link, String> {
    let id = std::process::id() % 100_000;
    let ns = format!("derpd-netem-{id}");
    ip(&["netns", "add", &ns])?;
    let mut link = Link {
        ns,
        kind: LinkKind::Netem {
            veth: format!("dnetem{id}"),
        },
    };
    match netem_link(&link.ns, id) {
        Ok(()) => Ok(link),
        Err(e) if e.contains("Specified qdisc kind is unknown") => {
            let LinkKind::Netem { veth } = &link.kind else {
                unreachable!("made as netem")
            };
            let _ = ip(&["link", "del", veth]);
            link.kind = LinkKind::UserSpace {
                forwarder: user_space_link(&link.ns, id),
            };
            Ok(link)
        }
        Err(e) => Err(e),
    }
}

/// The "dropped" count of the netem qdisc `tc -s <args>` shows.
fn netem_dropped(args: &[&str]) -> u64 {
    let mut all = vec!["-s"];
    all.extend_from_slice(args);
    let out = Command::new("tc").args(&all).output().expect("tc -s");
    let text = String::from_utf8_lossy(&out.stdout);
    let netem = text
        .split("qdisc ")
        .find(|q| q.starts_with("netem "))
        .unwrap_or_else(|| panic!("no netem qdisc in tc {}: {text}", all.join(" ")));
    let after = netem
        .split_once("(dropped ")
        .unwrap_or_else(|| panic!("no dropped count: {netem}"))
        .1;
    after
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("dropped count: {netem}"))
}

/// A veth pair into `ns` with netem on both ends.
fn netem_link(ns: &str, id: u32) -> Result<(), String> {
    let (here, there) = (format!("dnetem{id}"), format!("dnetemp{id}"));
    ip(&["link", "add", &here, "type", "veth", "peer", "name", &there])?;
    ip(&["link", "set", &there, "netns", ns])?;
    let delay = format!("{DELAY_MS}ms");
    let netem = ["root", "netem", "delay", delay.as_str(), "loss", "1%"];
    let mut on_here = vec!["qdisc", "add", "dev", here.as_str()];
    on_here.extend_from_slice(&netem);
    run("tc", &on_here)?;
    let mut on_there = vec!["-n", ns, "qdisc", "add", "dev", there.as_str()];
    on_there.extend_from_slice(&netem);
    run("tc", &on_there)?;
    ip(&["addr", "add", &format!("{CLIENT_IP}/30"), "dev", &here])?;
    ip(&["link", "set", &here, "up"])?;
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{SERVER_IP}/30"),
        "dev",
        &there,
    ])?;
    ip(&["-n", ns, "link", "set", &there, "up"])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])
}

/// scripts/lossy-link.py between `ns` (derpd's end) and this namespace, once it is ready.
fn user_space_link(ns: &str, id: u32) -> Process {
    let script = tools::repo().join("scripts/lossy-link.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script).args([
        ns,
        SERVER_IP,
        "-",
        CLIENT_IP,
        &DELAY_MS.to_string(),
        "1",
        "1",
        &format!("dnl{id}"),
    ]);
    let forwarder = Process::spawn(cmd);
    forwarder.wait_stdout("the user-space link", |l| (l == "ready").then_some(()));
    forwarder
}

/// Relays `ROUND_TRIPS` numbered packets A -> B -> A, one at a time, resending one whose
/// echo has not come back after [`RESEND_AFTER`]. Returns how many sends it took and the
/// shortest round trip, each timed from its first send.
async fn round_trips(config: impl Fn(SecretKey) -> ClientConfig) -> (u32, Duration) {
    let (sa, sb) = (
        SecretKey::generate(&mut rand::rngs::OsRng),
        SecretKey::generate(&mut rand::rngs::OsRng),
    );
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let a = Client::connect(&config(sa)).await.expect("connect a");
    let b = Client::connect(&config(sb)).await.expect("connect b");
    let (mut a_rx, mut a_tx) = a.split();
    let (mut b_rx, mut b_tx) = b.split();
    let echo = tokio::spawn(async move {
        while let Ok(frame) = b_rx.recv().await {
            if let ReceivedFrame::RecvPacket { packet, .. } = frame
                && b_tx.send_packet(ka, &packet).await.is_err()
            {
                return;
            }
        }
    });
    let mut sends = 0;
    let mut shortest = Duration::MAX;
    let deadline = tokio::time::Instant::now() + 3 * STEP;
    for i in 0..ROUND_TRIPS {
        let payload = i.to_be_bytes();
        let first_send = Instant::now();
        'resend: loop {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{i} of {ROUND_TRIPS} round trips done after {sends} sends"
            );
            a_tx.send_packet(kb, payload).await.expect("send");
            sends += 1;
            let wait = tokio::time::Instant::now() + RESEND_AFTER;
            loop {
                match tokio::time::timeout_at(wait, a_rx.recv()).await {
                    Err(_) => continue 'resend,
                    Ok(Ok(ReceivedFrame::RecvPacket { packet, .. })) if packet[..] == payload => {
                        shortest = shortest.min(first_send.elapsed());
                        break 'resend;
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => panic!("connection died at packet {i}: {e}"),
                }
            }
        }
    }
    echo.abort();
    (sends, shortest)
}

#[tokio::test]
async fn quic_and_tcp_across_a_lossy_delayed_link() {
    let link = make_link().unwrap_or_else(|why| panic!("cannot make the lossy link: {why}"));
    let certdir = TempDir::new("netem");
    let node = Node::start_with(
        &Launch::in_netns(&link.ns),
        &[
            "--dev",
            "-a",
            &format!("{SERVER_IP}:8443"),
            "--stun=false",
            "--certmode",
            "manual",
            "--hostname",
            SERVER_IP,
            "--http-port",
            "-1",
            "--cert-reload-interval",
            "0",
            "--quic-port",
            "8443",
            "--certdir",
            certdir.0.to_str().expect("utf8"),
        ],
        &[],
    );
    let pin: String = node.wait_stdout("the DERP map node line", |l| {
        let v: serde_json::Value = serde_json::from_str(l.trim()).ok()?;
        v["CertName"].as_str().map(str::to_owned)
    });
    node.find_log("the QUIC listener", |v| {
        let msg = v["fields"]["message"].as_str()?;
        msg.starts_with("QUIC listening").then_some(())
    });
    let local: std::net::SocketAddr = format!("{CLIENT_IP}:0").parse().expect("addr");
    let config = |url: String| {
        let pin = pin.clone();
        move |secret: SecretKey| {
            ClientConfig::new(&url, secret)
                .expect("config")
                .with_cert_name(pin.clone())
                .with_local_addr(local)
                .with_connect_timeout(STEP)
        }
    };
    let (tcp, tcp_rtt) = round_trips(config(format!("https://{SERVER_IP}:8443/derp"))).await;
    let (quic, quic_rtt) = round_trips(config(format!("quic://{SERVER_IP}:8443"))).await;
    // Which link ran, and how often a loss cost a resend: context, not a check.
    println!(
        "over {}: {ROUND_TRIPS} round trips took {tcp} sends over TLS/TCP (shortest \
         {tcp_rtt:?}), {quic} over QUIC (shortest {quic_rtt:?})",
        link.name()
    );
    for (transport, rtt) in [("TLS/TCP", tcp_rtt), ("QUIC", quic_rtt)] {
        assert!(
            rtt >= RTT_FLOOR,
            "a round trip over {transport} took {rtt:?}: the {} link did not delay it \
             ({DELAY_MS} ms each way, four crossings)",
            link.name()
        );
    }
    let filler = std::net::UdpSocket::bind(format!("{CLIENT_IP}:0")).expect("bind filler");
    for i in 0..FILLER_DATAGRAMS {
        // The discard port: nothing in derpd's namespace answers, the link only carries it.
        let _ = filler.send_to(&i.to_be_bytes(), format!("{SERVER_IP}:9"));
    }
    // The user-space link counts a loss when it reads the datagram, which can be after
    // send_to returns, so the count is read until it moves rather than once.
    let deadline = Instant::now() + STEP;
    let dropped = loop {
        let dropped = link.dropped();
        if dropped > 0 || Instant::now() > deadline {
            break dropped;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    };
    println!("the link dropped {dropped} packets");
    assert!(
        dropped > 0,
        "the {} link dropped nothing of {FILLER_DATAGRAMS} datagrams and the round trips",
        link.name()
    );
}
