//! DERP over QUIC against DERP over TLS/TCP across a lossy, delayed link: derpd runs in a
//! network namespace of its own behind a veth pair with `tc netem` (1 % loss, 20 ms delay
//! each way), and clients in this process relay packets through it over each transport.
//!
//! It needs root (CAP_NET_ADMIN), iproute2 and a kernel with `sch_netem`, which many
//! machines (this project's CI among them) lack, so it is ignored by default rather than
//! passing without having run; run it where netem exists with
//! `cargo test -p derpd --test netem -- --ignored`, and it fails if the link cannot be made.
//! It prints delivered packets/s and round-trip times for both transports and asserts only
//! that packets get through: speed is measured by `scripts/bench-quic`, not asserted here.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use derp_client::{Client, ClientConfig, ReceivedFrame};
use derp_proto::SecretKey;

const DERPD: &str = env!("CARGO_BIN_EXE_derpd");
const STEP: Duration = Duration::from_secs(20);
const SERVER_IP: &str = "10.202.0.1";
const CLIENT_IP: &str = "10.202.0.2";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespace and veth pair; removed on drop.
struct Link {
    ns: String,
    veth: String,
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

fn make_link() -> Result<Link, String> {
    let id = std::process::id() % 100_000;
    let link = Link {
        ns: format!("derpd-netem-{id}"),
        veth: format!("dnetem{id}"),
    };
    let peer = format!("dnetemp{id}");
    ip(&["netns", "add", &link.ns])?;
    ip(&[
        "link", "add", &link.veth, "type", "veth", "peer", "name", &peer,
    ])?;
    ip(&["link", "set", &peer, "netns", &link.ns])?;
    let netem = ["root", "netem", "delay", "20ms", "loss", "1%"];
    let mut here = vec!["qdisc", "add", "dev", link.veth.as_str()];
    here.extend_from_slice(&netem);
    run_tc(&here, None)?;
    let mut there = vec!["qdisc", "add", "dev", peer.as_str()];
    there.extend_from_slice(&netem);
    run_tc(&there, Some(&link.ns))?;
    ip(&["addr", "add", &format!("{CLIENT_IP}/30"), "dev", &link.veth])?;
    ip(&["link", "set", &link.veth, "up"])?;
    let ns = link.ns.as_str();
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{SERVER_IP}/30"),
        "dev",
        &peer,
    ])?;
    ip(&["-n", ns, "link", "set", &peer, "up"])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    Ok(link)
}

fn run_tc(args: &[&str], ns: Option<&str>) -> Result<(), String> {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "tc"]);
            c
        }
        None => Command::new("tc"),
    };
    let out = cmd.args(args).output().map_err(|e| format!("tc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// derpd in the namespace, killed on drop.
struct Derpd(Child);

impl Drop for Derpd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn lines(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Starts derpd (TLS, self-signed for the server IP, QUIC on the same port) in `ns`.
/// Returns it and the certificate pin.
fn start_derpd(ns: &str, certdir: &std::path::Path) -> (Derpd, String) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, DERPD, "--dev", "-a"])
        .arg(format!("{SERVER_IP}:8443"))
        .args([
            "--stun=false",
            "--certmode",
            "manual",
            "--hostname",
            SERVER_IP,
        ])
        .args(["--http-port", "-1", "--cert-reload-interval", "0"])
        .args(["--quic-port", "8443", "--log-format", "json", "--certdir"])
        .arg(certdir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn derpd");
    let stdout = lines(child.stdout.take().expect("stdout"));
    let stderr = lines(child.stderr.take().expect("stderr"));
    let derpd = Derpd(child);
    let deadline = Instant::now() + STEP;
    let pin = loop {
        let line = stdout
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("derpd's DERP map node line");
        if let Ok(node) = serde_json::from_str::<serde_json::Value>(line.trim())
            && let Some(pin) = node["CertName"].as_str()
        {
            break pin.to_owned();
        }
    };
    loop {
        let line = stderr
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("derpd's QUIC line");
        if line.contains("QUIC listening") {
            break;
        }
    }
    (derpd, pin)
}

/// Relays timestamped packets A -> B -> A for `window` at `rate` per second. Returns
/// (packets echoed per second, RTT p50, RTT p99).
async fn measure(config: impl Fn() -> ClientConfig, window: Duration) -> (f64, Duration, Duration) {
    let (sa, sb) = (
        SecretKey::generate(&mut rand::rngs::OsRng),
        SecretKey::generate(&mut rand::rngs::OsRng),
    );
    let (ka, kb) = (sa.public_key(), sb.public_key());
    let mut ca = config();
    ca.secret_key = sa;
    let mut cb = config();
    cb.secret_key = sb;
    let a = Client::connect(&ca).await.expect("connect a");
    let b = Client::connect(&cb).await.expect("connect b");
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
    let start = Instant::now();
    let sender = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        while start.elapsed() < window {
            tick.tick().await;
            let mut packet = [0u8; 570];
            let sent = start.elapsed().as_nanos() as u64;
            packet[..8].copy_from_slice(&sent.to_be_bytes());
            if a_tx.send_packet(kb, packet).await.is_err() {
                return;
            }
        }
    });
    let mut rtts = Vec::new();
    let stop = start + window + Duration::from_secs(1);
    while let Ok(Ok(frame)) =
        tokio::time::timeout_at(tokio::time::Instant::from_std(stop), a_rx.recv()).await
    {
        if let ReceivedFrame::RecvPacket { packet, .. } = frame
            && packet.len() >= 8
        {
            let sent = u64::from_be_bytes(packet[..8].try_into().expect("8 bytes"));
            let now = start.elapsed().as_nanos() as u64;
            rtts.push(Duration::from_nanos(now.saturating_sub(sent)));
        }
    }
    sender.abort();
    echo.abort();
    rtts.sort();
    let pick = |q: f64| {
        rtts.get(((rtts.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    (
        rtts.len() as f64 / window.as_secs_f64(),
        pick(0.5),
        pick(0.99),
    )
}

#[tokio::test]
#[ignore = "needs root, iproute2 and sch_netem: cargo test -p derpd --test netem -- --ignored"]
async fn quic_and_tcp_under_netem_loss_and_delay() {
    let link = make_link().unwrap_or_else(|why| panic!("cannot make the netem link: {why}"));
    let certdir = std::env::temp_dir().join(format!("derpd-netem-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&certdir);
    let (_derpd, pin) = start_derpd(&link.ns, &certdir);
    let local: std::net::SocketAddr = format!("{CLIENT_IP}:0").parse().expect("addr");
    let window = Duration::from_secs(2);
    let base = |url: String| {
        let pin = pin.clone();
        move || {
            ClientConfig::new(&url, SecretKey::generate(&mut rand::rngs::OsRng))
                .expect("config")
                .with_cert_name(pin.clone())
                .with_local_addr(local)
                .with_connect_timeout(STEP)
        }
    };
    let tcp = measure(base(format!("https://{SERVER_IP}:8443/derp")), window).await;
    let quic = measure(base(format!("quic://{SERVER_IP}:8443")), window).await;
    println!("netem 1 % loss, 20 ms each way, 200 packets/s of 570 bytes:");
    println!(
        "  tls/tcp: {:.0} echoed/s, rtt p50 {:?}, p99 {:?}",
        tcp.0, tcp.1, tcp.2
    );
    println!(
        "  quic:    {:.0} echoed/s, rtt p50 {:?}, p99 {:?}",
        quic.0, quic.1, quic.2
    );
    assert!(tcp.0 > 0.0, "nothing got through over TCP");
    assert!(quic.0 > 0.0, "nothing got through over QUIC");
    let _ = std::fs::remove_dir_all(&certdir);
}
