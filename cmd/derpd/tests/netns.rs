//! The mesh across network namespaces: three derpd nodes, each in its own namespace with
//! its own address, joined by a bridge, so that links cross real (virtual) interfaces
//! rather than loopback. Needs root and CAP_NET_ADMIN for `ip netns`: without them the test
//! fails (it never passes without having run); `scripts/test` leaves it out when not run as
//! root, and says so.
//!
//! Addresses come from 198.18.0.0/24, the range set aside for network benchmarks
//! (RFC 2544); every one of them lives in a namespace this test made.

use crate::support;

use std::process::{Command, Stdio};

use support::{Launch, Node, TempDir, client, expect_gone, expect_packet, secret, write_mesh_key};

/// The namespaces and links of one run, removed on drop.
struct Lab {
    hub: String,
    nodes: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
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

impl Lab {
    /// A hub namespace with a bridge; one namespace per node with a veth into the bridge;
    /// and a veth from the test's own namespace, so the test's clients reach every node.
    fn build(nodes: usize) -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let mut lab = Self {
            hub: format!("derph{tag}"),
            nodes: Vec::new(),
        };
        ip(&["netns", "add", &lab.hub])?;
        let hub = lab.hub.clone();
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..nodes {
            let ns = format!("derpn{tag}{i}");
            ip(&["netns", "add", &ns])?;
            lab.nodes.push(ns.clone());
            let port = format!("p{i}");
            ip(&[
                "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(i)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        let root_if = format!("derpr{tag}");
        ip(&[
            "link", "add", &root_if, "type", "veth", "peer", "name", "uplink", "netns", &hub,
        ])?;
        ip(&["-n", &hub, "link", "set", "uplink", "master", "br0", "up"])?;
        ip(&["addr", "add", "198.18.0.1/24", "dev", &root_if])?;
        ip(&["link", "set", &root_if, "up"])?;
        Ok(lab)
    }

    fn addr(i: usize) -> String {
        format!("198.18.0.{}", 10 + i)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Deleting the hub takes the bridge and every veth with it, the test's own end too.
        for ns in self.nodes.iter().chain(std::iter::once(&self.hub)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_across_network_namespaces() {
    let lab = Lab::build(3).unwrap_or_else(|e| {
        panic!(
            "`ip netns` is not usable here (needs root, CAP_NET_ADMIN and iproute2; \
             scripts/test leaves this test out when not root): {e}"
        )
    });
    let dir = TempDir::new("netns");
    let mesh_key = dir.path("mesh.key");
    write_mesh_key(&mesh_key);
    let mesh_with = (0..3)
        .map(|i| format!("http://{}:3340/derp", Lab::addr(i)))
        .collect::<Vec<_>>()
        .join(",");
    let mut nodes: Vec<Node> = (0..3)
        .map(|i| {
            Node::start_with(
                &Launch::in_netns(&lab.nodes[i]),
                &[
                    "-a".into(),
                    format!("{}:3340", Lab::addr(i)),
                    "-c".into(),
                    dir.path(&format!("{i}.key")).display().to_string(),
                    "--mesh-psk-file".into(),
                    mesh_key.display().to_string(),
                    "--mesh-with".into(),
                    mesh_with.clone(),
                    // The test scrapes from 198.18.0.1, not loopback.
                    "--debug-allow-cidr".into(),
                    "198.18.0.0/24".into(),
                ],
                &[],
            )
        })
        .collect();
    for n in &nodes {
        n.wait_metric("derp_mesh_links_up", &[], |v| v == 2.0);
    }
    let secrets: Vec<_> = (0..3).map(|_| secret()).collect();
    let keys: Vec<_> = secrets.iter().map(|s| s.public_key()).collect();
    let mut clients = Vec::new();
    for (n, s) in nodes.iter().zip(&secrets) {
        clients.push(client(&n.url(), s.clone()).await);
    }
    for n in &nodes {
        n.wait_metric("derp_clients_total", &[], |v| v == 6.0);
    }
    for i in 0..3 {
        for j in 0..3 {
            if i != j {
                let payload = format!("ns{i} to ns{j}");
                clients[i]
                    .send_packet(keys[j], payload.as_bytes())
                    .await
                    .expect("send");
                expect_packet(&mut clients[j], keys[i], payload.as_bytes()).await;
            }
        }
    }
    // A node dies: its clients' peers in the other namespaces hear it.
    nodes[1].kill();
    expect_gone(&mut clients[0], keys[1]).await;
    expect_gone(&mut clients[2], keys[1]).await;
    nodes[0].wait_metric("derp_mesh_links_up", &[], |v| v == 1.0);
    drop(clients);
    drop(nodes);
    drop(lab);
}
