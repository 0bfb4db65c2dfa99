//! Writes seed inputs for every fuzz target into `corpus/<target>/`, taken from the vendored
//! vectors in crates/derp-proto/testdata (plus a few hand-made edge cases, named `hand-*`).
//!
//! `cargo run --bin seeds` (scripts/fuzz seeds). Existing files are overwritten by name;
//! other files in the corpus directories are left alone.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde_json::Value;

type Seeds = BTreeMap<&'static str, Vec<(String, Vec<u8>)>>;

fn load(dir: &Path, name: &str) -> Value {
    let path = dir.join(name);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn str_field<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("no string {field} in {v}"))
}

fn hex_field(v: &Value, field: &str) -> Vec<u8> {
    hex::decode(str_field(v, field)).unwrap_or_else(|e| panic!("{field}: {e}"))
}

fn slug(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_owned()
}

fn frame(ty: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![ty];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn with_prefix(prefix: &[u8], rest: &[u8]) -> Vec<u8> {
    [prefix, rest].concat()
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let testdata = root.join("../crates/derp-proto/testdata");
    let mut seeds = Seeds::new();
    let mut add = |target: &'static str, name: String, bytes: Vec<u8>| {
        seeds.entry(target).or_default().push((name, bytes));
    };

    // Frame decoders: `flags | chunk seed | stream`. Flags 1 = chunks of up to 7 bytes,
    // 0 = one byte at a time, 4 = server before the handshake.
    let frames = load(&testdata, "frames.json");
    for f in frames["frames"].as_array().expect("frames") {
        let bytes = hex_field(f, "frame_hex");
        let name = format!("vec-{}", slug(str_field(f, "name")));
        if str_field(f, "direction").starts_with("client_to_server") {
            add("server_frames", name, with_prefix(&[1, 0], &bytes));
        } else {
            add("client_frames", name, with_prefix(&[1, 0], &bytes));
        }
    }
    let handshake = load(&testdata, "handshake.json");
    let session = load(&testdata, "session.json");
    for (i, client) in session["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .enumerate()
    {
        let mut c2s = Vec::new();
        let mut s2c = Vec::new();
        for entry in client["transcript"].as_array().expect("transcript") {
            if entry["kind"] != "derp_frame" || entry["hex_is_truncated"] == true {
                continue;
            }
            let bytes = hex_field(entry, "hex");
            if entry["dir"] == "c2s" {
                &mut c2s
            } else {
                &mut s2c
            }
            .extend_from_slice(&bytes);
        }
        add(
            "server_frames",
            format!("vec-session-{i}"),
            with_prefix(&[4 | 1, 7], &c2s),
        );
        add(
            "client_frames",
            format!("vec-session-{i}"),
            with_prefix(&[1, 7], &s2c),
        );
    }
    add(
        "client_frames",
        "vec-server-key".into(),
        with_prefix(
            &[0, 0],
            &hex_field(&handshake["server_key_frame"], "frame_hex"),
        ),
    );
    add(
        "client_frames",
        "vec-server-info".into(),
        with_prefix(
            &[2, 3],
            &hex_field(&handshake["server_info_frame"], "frame_hex"),
        ),
    );
    // Unknown frames from a client are skipped whatever their length; a client Pong, a
    // second ClientInfo and an unassigned type, then a Ping, then a header promising 4 GiB.
    let mut skipped = frame(0x13, &[1; 8]);
    skipped.extend(frame(0x02, &[2; 60]));
    skipped.extend(frame(0x0b, &[3; 20]));
    skipped.extend(frame(0x12, &[4; 8]));
    skipped.extend([0xff, 0xff, 0xff, 0xff, 0xff, 0xaa, 0xbb]);
    add(
        "server_frames",
        "hand-skipped".into(),
        with_prefix(&[1, 9], &skipped),
    );
    // Known client frames that break a size rule; a ping with extra bytes.
    add(
        "server_frames",
        "hand-short-send".into(),
        with_prefix(&[3, 0], &frame(0x04, &[0; 31])),
    );
    add(
        "server_frames",
        "hand-long-ping".into(),
        with_prefix(&[2, 0], &frame(0x12, &[5; 20])),
    );
    add(
        "server_frames",
        "hand-ping-too-long".into(),
        with_prefix(&[3, 0], &[0x12, 0, 0, 3, 0xe9]),
    );
    // Relay frames the Go client drops when short, and one over the 1 MiB cap.
    let mut short = frame(0x08, &[1; 10]);
    short.extend(frame(0x09, &[2; 40]));
    short.extend(frame(0x15, &[0; 4]));
    short.extend(frame(0x06, &[0; 3]));
    short.extend([0x05, 0x00, 0x10, 0x00, 0x01]);
    add(
        "client_frames",
        "hand-short-and-huge".into(),
        with_prefix(&[1, 2], &short),
    );

    // Handshake: mode 0 raw frames, 1 sealed JSON, 2 tamper mask.
    for f in handshake["client_info_frames"]
        .as_array()
        .expect("client_info_frames")
    {
        let name = slug(str_field(f, "case"));
        add(
            "server_handshake",
            format!("vec-raw-{name}"),
            with_prefix(&[0], &hex_field(f, "frame_hex")),
        );
        let json = str_field(f, "plaintext_json").as_bytes().to_vec();
        add(
            "server_handshake",
            format!("vec-json-{name}"),
            with_prefix(&[1], &json),
        );
        add("info_json", format!("vec-client-{name}"), json);
    }
    for f in handshake["negative_cases"]
        .as_array()
        .expect("negative_cases")
    {
        let name = slug(str_field(f, "case"));
        add(
            "server_handshake",
            format!("vec-raw-{name}"),
            with_prefix(&[0], &hex_field(f, "frame_hex")),
        );
    }
    let variants = &handshake["client_info_json_variants"]["variants"];
    for (i, v) in variants.as_array().expect("variants").iter().enumerate() {
        let json = str_field(v, "plaintext_json").as_bytes().to_vec();
        add(
            "server_handshake",
            format!("vec-json-variant-{i}"),
            with_prefix(&[1], &json),
        );
        add("info_json", format!("vec-variant-{i}"), json);
    }
    // A low-order key: its box opens for anyone, so the server must refuse the key itself.
    let zero_key = derp_proto::PublicKey::from_bytes([0; 32]);
    let forged = derp_proto::SecretKey::from_bytes([9; 32]).seal_to(
        &zero_key,
        &[5; 24],
        br#"{"version":2}"#,
    );
    let mut low_order = Vec::new();
    derp_proto::ClientToRelay::ClientInfo {
        key: zero_key,
        sealed: forged.into(),
    }
    .encode(&mut low_order);
    add(
        "server_handshake",
        "hand-raw-low-order-key".into(),
        with_prefix(&[0], &low_order),
    );
    add("server_handshake", "hand-tamper-none".into(), vec![2]);
    add(
        "server_handshake",
        "hand-tamper-key".into(),
        vec![2, 0, 0, 0, 0, 0, 1],
    );
    let server_info = str_field(&handshake["server_info_frame"], "plaintext_json");
    add(
        "info_json",
        "vec-server-info".into(),
        server_info.as_bytes().to_vec(),
    );
    add(
        "info_json",
        "hand-server-info-rates".into(),
        br#"{"version":2,"TokenBucketBytesPerSecond":1000,"tokenbucketbytesburst":-5,"x":null}"#
            .to_vec(),
    );

    // STUN datagrams.
    let stun = load(&testdata, "stun.json");
    for family in ["ipv4", "ipv6"] {
        add(
            "stun",
            format!("vec-{family}-request"),
            hex_field(&stun[family], "request_hex"),
        );
        add(
            "stun",
            format!("vec-{family}-response"),
            hex_field(&stun[family], "response_hex"),
        );
    }
    for r in stun["ignored_requests"]
        .as_array()
        .expect("ignored_requests")
    {
        add(
            "stun",
            format!("vec-ignored-{}", slug(str_field(r, "name"))),
            hex_field(r, "request_hex"),
        );
    }

    // Keys.
    let keys = load(&testdata, "keys.json");
    for k in keys["keys"].as_array().expect("keys") {
        let name = slug(str_field(k, "name"));
        for field in ["private_text", "public_text", "public_untyped_hex"] {
            let text = str_field(k, field);
            add(
                "key_text",
                format!("vec-{name}-{}", slug(field)),
                text.as_bytes().to_vec(),
            );
        }
    }
    let mesh = str_field(&keys["mesh_key"], "text");
    add("key_text", "vec-mesh".into(), mesh.as_bytes().to_vec());
    add(
        "key_text",
        "hand-mesh-upper-padded".into(),
        format!(" {}\n", mesh.to_uppercase()).into_bytes(),
    );
    let config = &keys["derper_config"];
    add(
        "key_file",
        "vec-compact".into(),
        str_field(config, "compact_json").as_bytes().to_vec(),
    );
    add(
        "key_file",
        "vec-as-derper-writes".into(),
        hex_field(config, "file_contents_as_derper_writes_it_hex"),
    );

    // derper's rate configuration file: the documented form, case and null variations.
    for (name, text) in [
        (
            "hand-derper",
            r#"{"PerClientRateLimitBytesPerSec": 1250000, "PerClientRateBurstBytes": 2500000}"#,
        ),
        (
            "hand-lowercase",
            r#"{"perclientratelimitbytespersec": 1000}"#,
        ),
        (
            "hand-null-burst",
            r#"{"PerClientRateBurstBytes": null, "Other": [1]}"#,
        ),
        ("hand-empty", "{}"),
    ] {
        add("rate_config", name.into(), text.as_bytes().to_vec());
    }

    // HTTP upgrade heads, relay side: `flags | bytes` (flags 0x40 pads the head to near the
    // limit, 0x80 makes the bytes a `name:value` list).
    let http = load(&testdata, "http.json");
    for exchange in ["plain_upgrade", "fast_start", "websocket"] {
        let ex = &http[exchange];
        let name = slug(exchange);
        // The client's first write: the head, and with fast start its ClientInfo too.
        let first = hex_field(&ex["transcript"][0], "hex");
        add(
            "upgrade_request",
            format!("vec-{name}"),
            with_prefix(&[0], &first),
        );
        add(
            "upgrade_request",
            format!("vec-{name}-padded"),
            with_prefix(&[0x40 | 0x20], &first),
        );
        let head = str_field(ex, "request_text");
        let list: String = head
            .lines()
            .skip(1)
            .filter(|l| !l.is_empty())
            .map(|l| format!("{l}\n"))
            .collect();
        add(
            "upgrade_request",
            format!("vec-{name}-headers"),
            with_prefix(&[0x80], list.as_bytes()),
        );
    }
    for (name, head) in [
        (
            "absolute-form",
            "GET http://relay.test/derp?x=1 HTTP/1.1\r\nUpgrade: DERP\r\n\r\n",
        ),
        ("probe", "GET /derp/probe HTTP/1.1\r\nUpgrade: DERP\r\n\r\n"),
        (
            "h2c",
            "GET /derp HTTP/1.1\r\nUpgrade: h2c\r\nIdeal-Node: n2\r\n\r\n",
        ),
        (
            "ws-no-key",
            "GET /derp/x HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Protocol: derp\r\n\r\n",
        ),
        (
            "ws-notderp",
            "GET /derp HTTP/1.1\r\nupgrade:  WebSocket \r\nsec-websocket-protocol: notderp, chat\r\n\
             Sec-WebSocket-Key:\tdGhlIHNhbXBsZSBub25jZQ== \r\n\r\n",
        ),
        (
            "lf-only-fast-start",
            "GET /derp HTTP/1.1\nUpgrade: derp\nDerp-Fast-Start:  1\nIdeal-Node:\n\n\x02\x00",
        ),
    ] {
        add(
            "upgrade_request",
            format!("hand-{name}"),
            with_prefix(&[0], head.as_bytes()),
        );
    }

    // Upgrade responses, client side: `key length | Sec-WebSocket-Key | response`.
    let ws_request = str_field(&http["websocket"], "request_text");
    let ws_key = ws_request
        .lines()
        .find_map(|l| l.strip_prefix("Sec-Websocket-Key: "))
        .expect("recorded WebSocket key");
    for exchange in ["plain_upgrade", "websocket"] {
        // The relay's first write: the 101 head and, for plain DERP, ServerKey.
        let first = hex_field(&http[exchange]["transcript"][1], "hex");
        let key = if exchange == "websocket" { ws_key } else { "" };
        let mut seed = vec![key.len() as u8];
        seed.extend_from_slice(key.as_bytes());
        seed.extend_from_slice(&first);
        add("upgrade_response", format!("vec-{}", slug(exchange)), seed);
    }
    for (name, response) in [
        (
            "not-found",
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "wrong-subprotocol",
            "HTTP/1.1 101 Switching Protocols\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\
             Sec-WebSocket-Protocol: chat\r\n\r\n",
        ),
    ] {
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let mut seed = vec![key.len() as u8];
        seed.extend_from_slice(key.as_bytes());
        seed.extend_from_slice(response.as_bytes());
        add("upgrade_response", format!("hand-{name}"), seed);
    }

    // WebSocket decoders: `flags | chunk seed | body`; flags bit 0 = program, bits 1-2 =
    // chunk size. Raw seeds are the recorded streams after the 101.
    let ws_exchange = &http["websocket"];
    let mut c2s = Vec::new();
    let mut s2c = Vec::new();
    for (i, chunk) in ws_exchange["transcript"]
        .as_array()
        .expect("transcript")
        .iter()
        .enumerate()
    {
        // Chunks 0 and 1 are the two heads.
        if i < 2 {
            continue;
        }
        if chunk["dir"] == "c2s" {
            &mut c2s
        } else {
            &mut s2c
        }
        .extend(hex_field(chunk, "hex"));
    }
    for (flags, seed) in [(2, 0), (6, 3)] {
        add(
            "ws_server",
            format!("vec-client-stream-{flags}"),
            with_prefix(&[flags, seed], &c2s),
        );
        add(
            "ws_client",
            format!("vec-server-stream-{flags}"),
            with_prefix(&[flags, seed], &s2c),
        );
    }
    // Programs: a message, a fragmented one with a ping inside, a pong, a ping, then a
    // close with a reason; once masked (bit 7 of the op) and with a long frame.
    let program: &[u8] = &[
        0x00, 0, 0, 5, // binary, 5 bytes
        0x01, 1, 0, 0, 3, 1, 7, 0, 0, 2, 0, 0, 0, 9, // 3 fragments, ping after the first
        0x03, 30, 1, 2, 3, 4, // pong
        0x02, 150, 5, 6, 7, 8, // ping (over 125: cut by control_frame)
        0x04, 0, 12, b'g', b'o', b'i', b'n', b'g', b' ', b'a', b'w', b'a', b'y', 0xc3,
        0xa9, // close
        0x82, 0x00, 0x00, 0x00, // trailing bytes after the close
    ];
    let long: &[u8] = &[0x80, 9, 9, 9, 9, 2, 0, 3, 0x00, 1, 0, 0, 0x05, 1, 2, 3, 4];
    for (target, role) in [("ws_server", "server"), ("ws_client", "client")] {
        add(
            target,
            format!("hand-program-{role}"),
            with_prefix(&[3, 1], program),
        );
        add(
            target,
            format!("hand-program-long-{role}"),
            with_prefix(&[7, 2], long),
        );
    }

    // Snapshots, `n | snapshot | stream`: inside a masked payload (two bytes to go, the mask
    // rotated past three), then the rest of that frame and a close; and a client's between
    // frames, then a server's unmasked frame.
    let inside: &[u8] = &[
        1, 0, 3, 0, 0, 0, 0, 0, 0x11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0x44, 0x11, 0x22, 0x33,
    ];
    let rest = [0x6c ^ 0x44, 0x6f ^ 0x11, 0x88, 0x80, 1, 2, 3, 4];
    add(
        "ws_snapshot",
        "hand-inside-payload".into(),
        [&[inside.len() as u8], inside, &rest].concat(),
    );
    let between: &[u8] = &[1, 1, 0, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
    add(
        "ws_snapshot",
        "hand-client-between-frames".into(),
        [&[between.len() as u8], between, &[0x82, 2, b'h', b'i']].concat(),
    );

    // The live relay: `mode | seed | bytes` (see fuzz/src/relay.rs for the mode bits).
    let a_key = hex::decode(str_field(&session, "client_a_public_hex")).expect("hex");
    let hostile = derp_fuzz::relay::hostile_key().0;
    for (i, client) in session["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .enumerate()
    {
        let mut frames = Vec::new();
        let mut after_info = Vec::new();
        for entry in client["transcript"].as_array().expect("transcript") {
            if entry["dir"] != "c2s"
                || entry["kind"] != "derp_frame"
                || entry["hex_is_truncated"] == true
            {
                continue;
            }
            let bytes = hex_field(entry, "hex");
            if entry["frame"] != "ClientInfo" {
                after_info.extend_from_slice(&bytes);
            }
            frames.extend_from_slice(&bytes);
        }
        for (mode, what) in [
            (0x04, "accept"),
            (0x46, "derp-upgrade-2-pieces"),
            (0x26 | 0x08, "fast-start-prober"),
            (0x27 | 0x10, "websocket-wrapped-mesh-key"),
            (0xc4 | 0x18, "accept-4-pieces"),
        ] {
            add(
                "server_stream",
                format!("vec-session-{i}-{what}"),
                with_prefix(&[mode, 5], &after_info),
            );
        }
        // As recorded, ClientInfo included: sealed to another relay key, so refused.
        add(
            "server_stream",
            format!("vec-session-{i}-replayed"),
            with_prefix(&[0x00, 0], &frames),
        );
    }
    for exchange in ["plain_upgrade", "fast_start", "websocket"] {
        let mut sent = Vec::new();
        for chunk in http[exchange]["transcript"].as_array().expect("transcript") {
            if chunk["dir"] == "c2s" {
                sent.extend(hex_field(chunk, "hex"));
            }
        }
        add(
            "server_stream",
            format!("vec-http-{}", slug(exchange)),
            with_prefix(&[0x01, 0], &sent),
        );
    }
    // The recorded WebSocket close, after a valid handshake over WebSocket.
    add(
        "server_stream",
        "vec-websocket-close".into(),
        with_prefix(&[0x07, 0], &hex::decode("8882884ed9cc8ba6").expect("hex")),
    );
    // Hand-made: what a hostile client can do after authenticating.
    let disco = [b"TS\xf0\x9f\x92\xac".as_slice(), &[7; 40]].concat();
    let mut after = frame(0x04, &[[9; 32].as_slice(), &disco].concat()); // disco to nobody
    after.extend(frame(0x04, &[hostile.as_slice(), b"to myself"].concat()));
    after.extend(frame(0x04, &[a_key.as_slice(), &disco].concat())); // disco to A
    after.extend(frame(0x07, &[1])); // NotePreferred
    after.extend(frame(0x12, &[1, 2, 3, 4, 5, 6, 7, 8])); // Ping
    after.extend(frame(0x0b, &[1; 20])); // unassigned type
    add(
        "server_stream",
        "hand-after-handshake".into(),
        with_prefix(&[0x84, 9], &after),
    );
    add(
        "server_stream",
        "hand-watch-conns-refused".into(),
        with_prefix(&[0x14, 0], &frame(0x10, &[])),
    );
    // Raw HTTP: pipelined requests, then a DERP upgrade on the same connection (hyper's
    // path) carrying the hostile's own ClientInfo and a packet to A.
    let mut http_raw = b"GET / HTTP/1.1\r\nHost: relay.test\r\n\r\n\
        HEAD /derp/probe HTTP/1.1\r\n\r\n\
        GET /generate_204 HTTP/1.1\r\nX-Tailscale-Challenge: abc\r\n\r\n\
        GET /derp HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: DERP\r\n\r\n"
        .to_vec();
    http_raw.extend(derp_fuzz::relay::hostile_client_info(0));
    http_raw.extend(frame(0x04, &[a_key.as_slice(), b"hello A"].concat()));
    add(
        "server_stream",
        "hand-http-keepalive-then-upgrade".into(),
        with_prefix(&[0x01, 0], &http_raw),
    );
    let mut fast = b"GET /derp HTTP/1.1\r\nUpgrade: DERP\r\nDerp-Fast-Start: 1\r\n\r\n".to_vec();
    fast.extend(derp_fuzz::relay::hostile_client_info(1));
    fast.extend(frame(0x04, &[a_key.as_slice(), b"hello A"].concat()));
    add(
        "server_stream",
        "hand-http-fast-start".into(),
        with_prefix(&[0x01, 0], &fast),
    );

    // PROXY protocol headers: the hand-written vectors, valid and not, and a header in front
    // of what a DERP client sends first.
    let proxy = load(&testdata, "proxy_protocol.json");
    for kind in ["valid", "invalid"] {
        for v in proxy[kind].as_array().expect("proxy vectors") {
            let name = format!("vec-{kind}-{}", slug(str_field(v, "name")));
            add("proxy_protocol", name, hex_field(v, "hex"));
        }
    }
    let mut v1 = b"PROXY TCP4 203.0.113.9 192.0.2.1 61000 443\r\n".to_vec();
    v1.extend_from_slice(b"GET /derp HTTP/1.1\r\nUpgrade: DERP\r\n\r\n");
    add("proxy_protocol", "hand-v1-then-upgrade".into(), v1);

    // The record layer: `suite | chunk seed (8) | ...`, one seed of each kind per suite.
    for suite_byte in 0..3u8 {
        use derp_fuzz::records::{Sealer, peer_secret, suite};
        let suite = suite(suite_byte);
        let name = format!("{suite:?}").to_lowercase();
        let prefix = [suite_byte, 1, 2, 3, 4, 5, 6, 7, 8];
        // Raw records: data of several sizes (empty and padded too), a KeyUpdate asking for
        // one back, data under the next key, close_notify.
        let mut sealer = Sealer::new(peer_secret(suite));
        let mut stream = Vec::new();
        for (len, padding) in [(0, 0), (1, 0), (100, 7), (1 << 14, 0), (0, 40)] {
            stream.extend(sealer.data(&vec![b'd'; len], padding));
        }
        stream.extend(sealer.key_update(1));
        stream.extend(sealer.data(b"under the next key", 0));
        stream.extend(sealer.alert(1, 0));
        add(
            "tls_records",
            format!("hand-{name}-records"),
            with_prefix(&prefix, &stream),
        );
        // The same, cut inside the big record and with a byte of the third record changed.
        let mut cut = stream[..2000].to_vec();
        cut[140] ^= 0x20;
        add(
            "tls_records",
            format!("hand-{name}-tampered-cut"),
            with_prefix(&prefix, &cut),
        );
        // A run of 33 empty records.
        let mut sealer = Sealer::new(peer_secret(suite));
        let flood: Vec<u8> = (0..33).flat_map(|_| sealer.data(b"", 0)).collect();
        add(
            "tls_records",
            format!("hand-{name}-empty-flood"),
            with_prefix(&prefix, &flood),
        );

        // Programs (fuzz/src/records.rs): data (len, padding bytes), empty, KeyUpdate
        // (request), alert (level, description), raw inner plaintext, tamper (record,
        // offset, XOR), cut.
        let program: &[u8] = &[
            0, 0, 10, 3, 1, // 10 bytes, 3 of padding
            2, 5, // an empty record, 5 of padding
            3, 1, // KeyUpdate, update_requested
            0, 0x40, 0x00, 0, 0, // 2^14 bytes
            5, 3, b'h', b'i', 23, // raw: "hi", application data
            4, 1, 90, // user_canceled warning
            0, 0, 3, 0, 0, // 3 bytes
            4, 1, 0, // close_notify
        ];
        add(
            "tls_records_sealed",
            format!("hand-{name}-program"),
            with_prefix(&prefix, program),
        );
        let tampered = [program, &[6, 2, 0, 9, 0x80]].concat(); // the KeyUpdate's body
        add(
            "tls_records_sealed",
            format!("hand-{name}-program-tampered"),
            with_prefix(&prefix, &tampered),
        );
        let cut = [program, &[7, 0, 10]].concat(); // cut at byte 40
        add(
            "tls_records_sealed",
            format!("hand-{name}-program-cut"),
            with_prefix(&prefix, &cut),
        );
        let refused: &[u8] = &[3, 0, 3, 2, 0, 0, 1, 0, 0]; // a KeyUpdate with request 2
        add(
            "tls_records_sealed",
            format!("hand-{name}-bad-key-update"),
            with_prefix(&prefix, refused),
        );
    }

    let corpus = root.join("corpus");
    let mut total = 0;
    for (target, files) in &seeds {
        assert!(
            derp_fuzz::target(target).is_some(),
            "no target named {target}"
        );
        let dir = corpus.join(target);
        fs::create_dir_all(&dir).expect("create corpus dir");
        for (name, bytes) in files {
            fs::write(dir.join(name), bytes).expect("write seed");
            total += 1;
        }
    }
    for (name, _) in derp_fuzz::TARGETS {
        // tls_client_hello's seeds are OpenSSL's ClientHellos, captured once and committed.
        let committed = fs::read_dir(corpus.join(name)).is_ok_and(|mut d| d.next().is_some());
        assert!(
            seeds.contains_key(name) || committed,
            "no seeds for target {name}"
        );
    }
    println!("wrote {total} seeds under {}", corpus.display());
}
