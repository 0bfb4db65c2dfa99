//! A third-party STUN client (coturn's `turnutils_stunclient`) gets an answer from derpd when
//! generic STUN is enabled. `scripts/test` installs the tool (or says how); without it the
//! test fails rather than pass without having run.

use crate::support;

use std::process::Command;

use support::{Node, Process, require_tool};

const STUNCLIENT: &str = "turnutils_stunclient";

#[test]
fn third_party_stun_client_is_answered_in_generic_mode() {
    require_tool(STUNCLIENT, "coturn");
    let node = Node::start(&[
        "--dev",
        "-a",
        "127.0.0.1:0",
        "--stun-port",
        "0",
        "--stun-answer-generic",
    ]);
    let stun: std::net::SocketAddr = node.find_log("the STUN line", |v| {
        (v["fields"]["message"] == "STUN listening")
            .then(|| v["fields"]["addr"].as_str()?.parse().ok())?
    });
    let mut cmd = Command::new(STUNCLIENT);
    cmd.args(["-p", &stun.port().to_string(), "127.0.0.1"]);
    let client = Process::spawn(cmd);
    let line = client.wait_stdout("the STUN client's reflexive address", |l| {
        l.contains("reflexive addr").then(|| l.to_owned())
    });
    assert!(line.contains("127.0.0.1:"), "{line}");
}
