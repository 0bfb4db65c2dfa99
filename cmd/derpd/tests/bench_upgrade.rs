//! derp-bench's `upgrade` mode against a real derpd: through an upgrade that hands the
//! connections over it finds nothing wrong, and through one that does not (the clients get
//! Restarting and are closed) it reports every connection broken and fails.

use std::process::Output;

use crate::support::{Node, STEP, TempDir};
use crate::tools::derp_bench;
use crate::upgrade::{install, start_with_env, started_successor};

const PAIRS: u32 = 25;

/// derp-bench's upgrade mode on the derpd `pid` serving `node`'s address, with its JSON
/// document.
fn bench_upgrade(node: &Node, pid: u32, more: &[&str]) -> (Output, serde_json::Value) {
    let pid = pid.to_string();
    let url = node.url();
    let pairs = PAIRS.to_string();
    let mut args = vec![
        "--json",
        "--url",
        &url,
        "upgrade",
        "--upgrade-pid",
        &pid,
        "--pairs",
        &pairs,
        "--interval",
        "5ms",
        "--warmup",
        "100ms",
        "--baseline",
        "200ms",
        "--after",
        "200ms",
    ];
    args.extend_from_slice(more);
    let out = std::process::Command::new(derp_bench())
        .args(&args)
        .output()
        .expect("running derp-bench");
    let doc = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "derp-bench printed no JSON document ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, doc)
}

fn count(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn derp_bench_sees_nothing_of_a_handover() {
    let dir = TempDir::new("bench-upgrade");
    let exe = install(&dir);
    let mut node = start_with_env(&exe, &dir, &[], &[]);
    let (out, doc) = bench_upgrade(&node, node.pid(), &[]);
    let successor = started_successor(&node);
    let r = &doc["result"];
    assert!(
        out.status.success(),
        "{}\n{r:#}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.log_text()
    );
    assert_eq!(r["old_process_exited"], true);
    assert_eq!(count(&r["broken_connections"]), 0, "{r:#}");
    assert_eq!(r["breaks"], serde_json::json!({}));
    let sent = count(&r["sent_packets"]);
    assert!(sent > 0, "{r:#}");
    assert_eq!(count(&r["delivered_packets"]), sent, "{r:#}");
    for field in ["lost_packets", "duplicated_packets", "out_of_order_packets"] {
        assert_eq!(count(&r[field]), 0, "{field}: {r:#}");
    }
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );
    successor.stop();
}

#[test]
fn derp_bench_reports_connections_an_upgrade_breaks_and_fails() {
    let dir = TempDir::new("bench-upgrade-restart");
    let exe = install(&dir);
    let mut node = start_with_env(&exe, &dir, &["--upgrade-connections=false"], &[]);
    let (out, doc) = bench_upgrade(&node, node.pid(), &[]);
    let successor = started_successor(&node);
    let r = &doc["result"];
    assert!(!out.status.success(), "{r:#}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("clients noticed the upgrade"), "{stderr}");
    // Every connection, each half of every pair, broke: told to reconnect, then closed.
    // Which of those each one counted first depends on how its reads met the close, so
    // the check is that all broke and that Restarting was seen.
    let all = u64::from(PAIRS) * 2;
    assert_eq!(count(&r["broken_connections"]), all, "{r:#}");
    assert!(count(&r["breaks"]["restarting"]) > 0, "{r:#}");
    assert_eq!(
        node.wait_status(STEP).code(),
        Some(0),
        "{}",
        node.log_text()
    );

    // With --allow-broken the same is reported and the run passes. The successor, started
    // with the same flags, serves the address now and upgrades the same way.
    let (out, doc) = bench_upgrade(&node, successor.0, &["--allow-broken"]);
    let third = started_successor(&node);
    let r = &doc["result"];
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(count(&r["broken_connections"]), all, "{r:#}");
    successor.wait_ended();
    third.stop();
}
