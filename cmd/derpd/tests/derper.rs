//! derper's command line, as operators and wrappers write it, read by derpd: every flag of
//! derper's list (`tests/data/derper-flags.txt`, from derper 1.103.0) in each of Go's forms,
//! the migration table of docs/operations.md held to that list, the README's flag table, and
//! real derper command lines from Tailscale's docs and the Docker images people run it in.
//! Nearly everything runs `derpd --check`, which binds nothing and writes nothing; the table's
//! refused and ignored rows also start derpd (on an ephemeral loopback port, with its key in a
//! temporary directory), since what they claim of a start is not --check's to show.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use crate::support;

use support::{DERPD, Launch, Node, TempDir, run_to_exit};

/// One flag of derper's list.
#[derive(Debug)]
struct DerperFlag {
    name: String,
    kind: String,
    default: String,
}

fn derper_flags() -> Vec<DerperFlag> {
    let text = include_str!("data/derper-flags.txt");
    let flags: Vec<DerperFlag> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let fields: Vec<&str> = l.split('\t').collect();
            assert_eq!(fields.len(), 3, "name, type, default: {l:?}");
            DerperFlag {
                name: fields[0].to_owned(),
                kind: fields[1].to_owned(),
                default: fields[2].to_owned(),
            }
        })
        .collect();
    assert_eq!(flags.len(), 34, "derper 1.103.0 has 34 flags");
    for f in &flags {
        assert!(
            ["bool", "string", "int", "float", "duration"].contains(&f.kind.as_str()),
            "{f:?}"
        );
    }
    flags
}

/// Files a command line can name, in a temporary directory.
struct Files {
    dir: TempDir,
    key: String,
    certs: String,
    mesh_key: String,
    rate: String,
}

impl Files {
    fn new(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let key = dir.path("derper.key").display().to_string();
        let certs = dir.path("certs").display().to_string();
        std::fs::create_dir_all(&certs).expect("certdir");
        let mesh_key = dir.file(
            "mesh.key",
            "f00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeedf00dfeed\n",
        );
        let rate = dir.file(
            "rate.json",
            r#"{"PerClientRateLimitBytesPerSec": 1000000, "PerClientRateBurstBytes": 2000000}"#,
        );
        Self {
            dir,
            key,
            certs,
            mesh_key,
            rate,
        }
    }

    /// A certificate and key for `name` in the certificate directory, as manual mode reads.
    fn manual_cert(&self, name: &str) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let dir = std::path::Path::new(&self.certs);
        std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).expect("crt");
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("key");
    }

    /// What every run starts with: plain HTTP on a loopback address, a key file that would be
    /// created, manual certificates for an IP (self-signed, would be generated) and a mesh key.
    fn base(&self) -> Vec<String> {
        [
            "-a",
            "127.0.0.1:3340",
            "-c",
            &self.key,
            "-hostname",
            "127.0.0.1",
            "-certdir",
            &self.certs,
            "-mesh-psk-file",
            &self.mesh_key,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// A value that means something for each non-boolean derper flag, and a line `--check`
    /// prints for it (when it shows the value). Extra flags the value needs come third.
    fn value(&self, name: &str) -> (String, Option<&'static str>, Vec<&'static str>) {
        let v = |s: &str| s.to_owned();
        match name {
            // Another port than the base's, so that what --check shows is this value's.
            "a" => (
                v("localhost:3341"),
                Some("127.0.0.1:3341/tcp (plain HTTP"),
                vec![],
            ),
            "http-port" => (
                v("8080"),
                Some("127.0.0.1:8080/tcp: /generate_204"),
                vec!["-certmode=manual"],
            ),
            "stun-port" => (v("3479"), Some("127.0.0.1:3479/udp"), vec![]),
            "c" => (
                self.key.clone(),
                Some("would create it with a new key"),
                vec![],
            ),
            "certmode" => (v("manual"), Some("TLS for 127.0.0.1"), vec![]),
            "certdir" => (self.certs.clone(), None, vec![]),
            "hostname" => (v("derp.example.com"), None, vec![]),
            "acme-eab-kid" => (v("kid-1"), None, vec![]),
            "acme-eab-key" => (
                v("zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W"),
                None,
                vec![],
            ),
            "acme-email" => (v("ops@example.com"), None, vec![]),
            "home" => (v("https://example.com/"), None, vec![]),
            "mesh-psk-file" => (
                self.mesh_key.clone(),
                Some("the mesh key lets siblings in"),
                vec![],
            ),
            "mesh-with" => (
                v("derp2.example.com,derp3.example.com/10.0.0.3"),
                Some("2 entries, each dialed"),
                vec![],
            ),
            // Refused outside -dev (tested below); accepted and ignored in it, as in derper.
            "secrets-url" => (
                v("https://setec.example.com"),
                Some("-secrets-url is ignored in -dev mode"),
                vec!["-dev"],
            ),
            "secrets-path-prefix" => (v("prod/derp"), Some("-secrets-path-prefix ignored"), vec![]),
            "secrets-cache-dir" => (
                self.dir.path("secrets").display().to_string(),
                Some("-secrets-cache-dir ignored"),
                vec![],
            ),
            "bootstrap-dns-names" => (v("derp.example.com"), None, vec![]),
            "unpublished-bootstrap-dns-names" => {
                (v("canary.example.com/rollout.example.com"), None, vec![])
            }
            "verify-client-url" => (
                v("https://headscale.example.com/verify"),
                Some("https://headscale.example.com/verify (fail closed)"),
                vec![],
            ),
            "socket" => (v("/run/tailscale/tailscaled.sock"), None, vec![]),
            "accept-connection-limit" => (v("50"), Some("accept 50/s, burst 50"), vec![]),
            "accept-connection-burst" => (
                v("100"),
                Some("accept 50/s, burst 100"),
                vec!["-accept-connection-limit=50"],
            ),
            "rate-config" => (
                self.rate.clone(),
                Some("receive 1000000 bytes/s per client, burst 2000000"),
                vec![],
            ),
            "tcp-keepalive-time" => (v("5m"), Some("keepalive after 300s idle"), vec![]),
            "tcp-user-timeout" => (v("30s"), Some("user timeout 30s"), vec![]),
            "tcp-write-timeout" => (v("1m30s"), Some("write timeout 90s"), vec![]),
            other => panic!("no test value for derper's -{other}: add one"),
        }
    }
}

/// `derpd <args>`: (exit code, stdout, stderr).
fn derpd(args: &[String]) -> (i32, String, String) {
    let out = Command::new(DERPD)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run derpd");
    (
        out.status.code().expect("exited"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const USABLE: &str = "derpd --check: the configuration is usable";

/// The forms Go's flag package takes for a flag: booleans only with `=`.
fn forms(name: &str, bool_value: Option<bool>, value: &str) -> Vec<Vec<String>> {
    let s = |parts: &[String]| parts.to_vec();
    match bool_value {
        Some(true) => vec![
            s(&[format!("-{name}")]),
            s(&[format!("--{name}")]),
            s(&[format!("-{name}=true")]),
            s(&[format!("--{name}=1")]),
        ],
        Some(false) => vec![s(&[format!("-{name}=false")]), s(&[format!("--{name}=F")])],
        None => vec![
            s(&[format!("-{name}"), value.to_owned()]),
            s(&[format!("--{name}"), value.to_owned()]),
            s(&[format!("-{name}={value}")]),
            s(&[format!("--{name}={value}")]),
        ],
    }
}

/// One run of `derpd --check` with one form of a flag.
struct Case {
    form: Vec<String>,
    /// A line `--check` prints for the value.
    shows: Option<&'static str>,
    /// Flags the value needs.
    extra: Vec<&'static str>,
    /// For a boolean, the value the form gives.
    on: bool,
}

#[test]
fn every_derper_flag_is_accepted_in_every_go_form() {
    let files = Files::new("derper-forms");
    let mut checked = 0;
    for flag in derper_flags() {
        let name = flag.name.as_str();
        let cases: Vec<Case> = if flag.kind == "bool" {
            [true, false]
                .into_iter()
                .flat_map(|on| {
                    forms(name, Some(on), "").into_iter().map(move |form| Case {
                        form,
                        shows: None,
                        extra: vec![],
                        on,
                    })
                })
                .collect()
        } else {
            let (value, shows, extra) = files.value(name);
            // -a's long name is derpd's own, read as the same flag.
            let names: &[&str] = if name == "a" { &["a", "addr"] } else { &[name] };
            names
                .iter()
                .flat_map(|n| forms(n, None, &value))
                .map(|form| Case {
                    form,
                    shows,
                    extra: extra.clone(),
                    on: true,
                })
                .collect()
        };
        for Case {
            form,
            shows,
            extra,
            on,
        } in cases
        {
            let mut args = vec!["--check".to_owned()];
            args.extend(files.base());
            args.extend(extra.iter().map(|s| s.to_string()));
            args.extend(form.iter().cloned());
            let (code, out, err) = derpd(&args);
            let what = format!("{form:?}: exit {code}\n{out}{err}");
            assert!(
                !err.contains("flag provided but not defined") && code != 2,
                "{what}"
            );
            match (name, on) {
                // Printed before anything is checked, as derper prints it.
                ("version", true) => {
                    assert_eq!(code, 0, "{what}");
                    assert!(out.starts_with("derpd "), "{what}");
                }
                // derper's CONNECT proxy: refused with what to do, as a start would.
                ("ace", true) => {
                    assert_eq!(code, 1, "{what}");
                    assert!(
                        out.contains("ERROR derper    -ace: derpd has no embedded ACE"),
                        "{what}"
                    );
                }
                _ => {
                    assert_eq!(code, 0, "{what}");
                    assert!(out.contains(USABLE), "{what}");
                    if let Some(shows) = shows {
                        assert!(out.contains(shows), "want {shows:?}: {what}");
                    }
                    if name == "a" {
                        assert!(!out.contains(":3340/"), "the base's -a took effect: {what}");
                    }
                }
            }
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} forms checked");
    // Every certificate mode derper has is a mode derpd has.
    for mode in ["letsencrypt", "manual", "gcp"] {
        let mut args = vec!["--check".to_owned()];
        args.extend(files.base());
        args.push(format!("-certmode={mode}"));
        let (code, out, err) = derpd(&args);
        assert_eq!(code, 0, "-certmode={mode}: {out}{err}");
    }
}

#[test]
fn flags_for_tailscales_own_infrastructure_are_refused_with_the_alternative() {
    let files = Files::new("derper-refused");
    let run = |extra: &[&str]| {
        let mut args = vec!["--check".to_owned()];
        args.extend(files.base());
        args.extend(extra.iter().map(|s| s.to_string()));
        derpd(&args)
    };
    let (code, out, _) = run(&["-secrets-url=https://setec.example.com"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("-secrets-url: derpd does not fetch the mesh key from a setec server")
            && out.contains("pass -mesh-psk-file instead"),
        "{out}"
    );
    let (code, out, _) = run(&["-ace"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("remove the flag"), "{out}");
    // A start refuses them too, before it binds or writes anything.
    let (code, _, err) = derpd(&[
        "-a".into(),
        "127.0.0.1:0".into(),
        "-c".into(),
        files.key.clone(),
        "-ace=true".into(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("derpd: -ace:"), "{err}");
    assert!(!std::path::Path::new(&files.key).exists());
}

#[test]
fn unknown_flags_and_stray_values_exit_2_naming_them() {
    for (args, want) in [
        (
            vec!["-nosuch"],
            "derpd: flag provided but not defined: -nosuch",
        ),
        (
            vec!["--nosuch=3"],
            "derpd: flag provided but not defined: -nosuch",
        ),
        // One name: never short options run together.
        (
            vec!["-acme-ip-certsx"],
            "flag provided but not defined: -acme-ip-certsx",
        ),
        (
            vec!["-hostnme", "x"],
            "flag provided but not defined: -hostnme (did you mean -hostname?)",
        ),
        (
            vec!["-verify-clients", "false"],
            "unexpected argument \"false\" after -verify-clients",
        ),
        (
            vec!["-dev", "foo", "-nosuch"],
            "unexpected argument \"foo\"",
        ),
        (vec!["-a"], "flag needs an argument: -a"),
        (vec!["---dev"], "bad flag syntax: ---dev"),
        (vec!["-stun=yes"], "invalid boolean value \"yes\" for -stun"),
        (
            vec!["-http-port=5.0"],
            "invalid value \"5.0\" for flag -http-port: parse error",
        ),
        (
            vec!["-tcp-keepalive-time=5"],
            "missing unit in duration \"5\"",
        ),
    ] {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let (code, out, err) = derpd(&args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got {err}");
        assert!(lines[0].contains(want), "{args:?}: want {want:?} in {err}");
    }
    // Help in every form goes to stdout, exit 0.
    for form in ["-h", "-help", "--help", "-h=1"] {
        let (code, out, _) = derpd(&[form.to_owned()]);
        assert_eq!(code, 0, "{form}");
        assert!(out.contains("--tcp-keepalive-time"), "{form}: {out}");
    }
}

/// The rows of the table under "## Migrating from derper": (flag, default, what derpd does).
fn migration_table() -> (Vec<(String, String, String)>, String) {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/operations.md"
    ))
    .expect("docs/operations.md");
    let start = doc
        .find("\n## Migrating from derper\n")
        .expect("the migration section");
    let section = &doc[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let header = "| derper flag | derper default | derpd |";
    let table_start = section.find(header).expect("the table's header");
    let rows = section[table_start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 3, "three cells: {l}");
            (
                cells[0].to_owned(),
                cells[1].to_owned(),
                cells[2].to_owned(),
            )
        })
        .collect();
    (rows, section.to_owned())
}

/// A command line whose `--check` shows what a "differs" row of the migration table says.
struct Claim {
    flag: &'static str,
    /// Whether the arguments follow `Files::base()` (and so override it where they repeat it).
    base: bool,
    args: Vec<String>,
    code: i32,
    /// Text stdout and stderr together hold.
    shows: &'static str,
}

impl Claim {
    fn new(flag: &'static str, args: &[&str], code: i32, shows: &'static str) -> Self {
        Self {
            flag,
            base: true,
            args: args.iter().map(|s| s.to_string()).collect(),
            code,
            shows,
        }
    }
}

/// For each "differs" row, what of its text `--check` can show.
fn differs_claims(files: &Files) -> Vec<Claim> {
    // A TLS listener with a name a CA would certify, so the ACME flags are read.
    let tls = |rest: &[&str]| -> Vec<String> {
        ["-a", "127.0.0.1:443", "-hostname", "derp.example.com"]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };
    let gcp = |key: &str| {
        tls(&[
            "-certmode=gcp",
            "-acme-email=ops@example.com",
            "-acme-eab-kid=kid-1",
            &format!("-acme-eab-key={key}"),
        ])
    };
    let dev = |rest: &[&str]| Claim {
        flag: "dev",
        base: false,
        args: ["-dev", "-c", &files.key]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect(),
        code: 0,
        shows: "",
    };
    vec![
        Claim {
            shows: "127.0.0.1:3340/tcp (plain HTTP",
            ..dev(&[])
        },
        Claim {
            shows: "quic      off",
            ..dev(&[])
        },
        Claim {
            shows: "127.0.0.1:3340/tcp (plain HTTP",
            ..dev(&["-a", ":443"])
        },
        Claim {
            shows: "127.0.0.1:3345/tcp (plain HTTP",
            ..dev(&["-a", "127.0.0.1:3345"])
        },
        Claim {
            shows: "mesh key lets siblings in",
            ..dev(&["-mesh-psk-file", &files.mesh_key])
        },
        Claim {
            base: false,
            ..Claim::new("version", &["-version"], 0, "derpd ")
        },
        Claim {
            base: false,
            ..Claim::new(
                "version",
                &["-version", "-nosuch"],
                2,
                "flag provided but not defined: -nosuch",
            )
        },
        Claim::new(
            "http-port",
            &["-certmode=manual", "-http-port=65536"],
            1,
            "--http-port 65536: not a port",
        ),
        Claim::new(
            "http-port",
            &["-certmode=manual", "-http-port=-5"],
            0,
            "port-80 listener off",
        ),
        Claim::new(
            "stun-port",
            &["-stun-port=65536"],
            2,
            "65536 is not in 0..=65535",
        ),
        Claim {
            args: ["-a", "127.0.0.1:443", "-certmode=manual", "-stun-port=443"]
                .map(str::to_owned)
                .to_vec(),
            ..Claim::new(
                "stun-port",
                &[],
                0,
                "warn  quic      off: STUN has UDP port 443",
            )
        },
        // Plain HTTP: derper would not look at the mode at all.
        Claim::new(
            "certmode",
            &["-certmode=bogus"],
            2,
            "invalid value \"bogus\" for flag -certmode",
        ),
        // Where it is read: on a plain-HTTP listener --certdir is ignored, as in derper.
        Claim::new(
            "certdir",
            &["-certmode=manual", "-certdir="],
            1,
            "--certdir is empty",
        ),
        Claim::new(
            "hostname",
            &["-certmode=manual"],
            0,
            "would generate a self-signed one for 127.0.0.1",
        ),
        Claim {
            args: tls(&["-certmode=gcp", "-acme-email=ops@example.com"]),
            ..Claim::new(
                "acme-eab-kid",
                &[],
                1,
                "--certmode=gcp requires --acme-eab-kid and --acme-eab-key",
            )
        },
        Claim {
            args: tls(&[
                "-certmode=letsencrypt",
                "-acme-eab-kid=kid-1",
                "-acme-eab-key=zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W",
            ]),
            ..Claim::new("acme-eab-kid", &[], 0, "is bound with EAB key ID \"kid-1\"")
        },
        // derper's two encodings: standard with padding, URL-safe without.
        Claim {
            args: gcp("+/v7+/v7+/v7+/v7+/v7+/v7+/v7+/v7+/v7+/v7+/s="),
            ..Claim::new("acme-eab-key", &[], 0, "is bound with EAB key ID \"kid-1\"")
        },
        Claim {
            args: gcp("-_v7-_v7-_v7-_v7-_v7-_v7-_v7-_v7-_v7-_v7-_s"),
            ..Claim::new("acme-eab-key", &[], 0, "is bound with EAB key ID \"kid-1\"")
        },
        Claim {
            args: tls(&["-hostname", "derp.tailscale.com"]),
            ..Claim::new("acme-email", &[], 0, "no --acme-email")
        },
        Claim::new(
            "acme-ip-certs",
            &["-certmode=manual", "-acme-ip-certs"],
            1,
            "--acme-ip-certs requires --certmode=letsencrypt",
        ),
        Claim {
            args: tls(&["-certmode=gcp", "-acme-ip-certs"]),
            ..Claim::new(
                "acme-ip-certs",
                &[],
                1,
                "--acme-ip-certs requires --certmode=letsencrypt",
            )
        },
        Claim::new(
            "acme-ip-certs",
            &["-acme-ip-certs"],
            0,
            "--acme-ip-certs are ignored",
        ),
        Claim {
            args: tls(&["-acme-ip-certs", "-http-port=-1"]),
            ..Claim::new(
                "acme-ip-certs",
                &[],
                1,
                "--acme-ip-certs needs the port-80 listener",
            )
        },
        Claim::new(
            "mesh-psk-file",
            &["-mesh-psk-file="],
            0,
            "off (no --mesh-with, no mesh key)",
        ),
        Claim::new(
            "mesh-with",
            &["-mesh-with= a.example.com, ,b.example.com,"],
            0,
            "2 entries, each dialed (an entry that turns out to be this node, by the key that \
             answers, is dropped): https://a.example.com/derp, https://b.example.com/derp",
        ),
        Claim::new(
            "verify-client-url-fail-open",
            &["-verify-client-url=https://headscale.example.com/verify"],
            0,
            "only https://headscale.example.com/verify (fail closed)",
        ),
        Claim::new(
            "verify-client-url-fail-open",
            &[
                "-verify-client-url=https://headscale.example.com/verify",
                "-verify-client-url-fail-open",
            ],
            0,
            "only https://headscale.example.com/verify (fail open)",
        ),
        // base() is plain HTTP, where derper sets no limit.
        Claim::new(
            "accept-connection-limit",
            &["-accept-connection-limit=50"],
            0,
            "accept 50/s, burst 50",
        ),
        Claim::new(
            "accept-connection-limit",
            &["-accept-connection-limit=0"],
            2,
            "the rate must be positive",
        ),
        Claim::new(
            "accept-connection-limit",
            &["-accept-connection-limit=-3"],
            2,
            "the rate must be positive",
        ),
        Claim::new(
            "accept-connection-limit",
            &["-accept-connection-limit=NaN"],
            2,
            "the rate must be positive",
        ),
        Claim::new(
            "accept-connection-burst",
            &["-accept-connection-burst=10"],
            0,
            "--accept-connection-burst has no effect without --accept-connection-limit",
        ),
        Claim::new(
            "accept-connection-burst",
            &["-accept-connection-limit=5", "-accept-connection-burst=0"],
            2,
            "invalid value \"0\" for flag -accept-connection-burst",
        ),
        Claim::new(
            "accept-connection-burst",
            &["-accept-connection-limit=5", "-accept-connection-burst=-1"],
            2,
            "invalid value \"-1\" for flag -accept-connection-burst",
        ),
        Claim::new(
            "tcp-write-timeout",
            &["-tcp-write-timeout=-1s"],
            2,
            "\"-1s\" is negative",
        ),
        Claim::new(
            "tcp-write-timeout",
            &["-tcp-write-timeout=0s"],
            0,
            "write timeout none",
        ),
    ]
}

/// The names `derpd --help` lists (long names and single letters), each line's names together.
fn derpd_flag_names() -> Vec<Vec<String>> {
    let (code, help, _) = derpd(&["--help".to_owned()]);
    assert_eq!(code, 0);
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .map(|l| {
            let spec = l.split("  ").next().unwrap_or(l);
            spec.split(", ")
                .map(|n| {
                    n.trim_start_matches('-')
                        .split(['[', ' ', '='])
                        .next()
                        .unwrap_or("")
                        .to_owned()
                })
                .collect()
        })
        .collect()
}

#[test]
fn the_migration_table_holds_every_derper_flag_once_and_says_true_things() {
    let flags = derper_flags();
    let by_name: BTreeMap<&str, &DerperFlag> = flags.iter().map(|f| (f.name.as_str(), f)).collect();
    let (rows, section) = migration_table();
    let files = Files::new("derper-table");
    let claims = differs_claims(&files);
    let check = |extra: &[String]| {
        let mut args = vec!["--check".to_owned()];
        args.extend(files.base());
        args.extend(extra.iter().cloned());
        let (code, out, err) = derpd(&args);
        (code, format!("{out}{err}"))
    };
    let mut seen = BTreeSet::new();
    for (flag, default, derpd_says) in &rows {
        let name = flag
            .strip_prefix("`-")
            .and_then(|f| f.strip_suffix('`'))
            .unwrap_or_else(|| panic!("one flag per row, as `-name`: {flag}"));
        let Some(derper) = by_name.get(name) else {
            panic!("the table names -{name}, which derper 1.103.0 does not have");
        };
        assert!(seen.insert(name), "-{name} has two rows");
        assert_eq!(
            default.trim_matches('`'),
            derper.default,
            "-{name}: the table's default is not derper's"
        );
        let verdict = derpd_says
            .trim_start_matches("**")
            .split(|c: char| !c.is_ascii_alphabetic())
            .next()
            .unwrap_or("");
        assert!(
            ["same", "differs", "refused", "ignored"].contains(&verdict),
            "-{name}: say same, differs, refused or ignored first: {derpd_says}"
        );
        // Every form of a value the row speaks of: a boolean's non-default value (its
        // default is what a command line without the flag already runs with), or the test
        // value of the every-form test.
        let (value, extra) = if derper.kind == "bool" {
            (String::new(), vec![])
        } else {
            let (value, _, extra) = files.value(name);
            (value, extra)
        };
        let non_default = (derper.kind == "bool").then(|| derper.default != "true");
        let forms = forms(name, non_default, &value);
        match verdict {
            "same" => {
                for form in &forms {
                    let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
                    args.extend(form.iter().cloned());
                    let (code, out) = check(&args);
                    assert_eq!(code, 0, "-{name} is called the same; {form:?}: {out}");
                    assert!(out.contains(USABLE), "{form:?}: {out}");
                }
            }
            // The value that turns the refused thing on, without what else the every-form
            // test adds (-secrets-url's -dev, where it is ignored).
            "refused" => {
                let refusal = format!("-{name}: derpd");
                for form in &forms {
                    let (code, out) = check(form);
                    assert_eq!(code, 1, "-{name} is called refused; {form:?}: {out}");
                    assert!(
                        out.contains(&refusal) && out.contains("derpd would not start"),
                        "want {refusal:?}: {form:?}: {out}"
                    );
                }
                let dir = TempDir::new("derper-table-refused");
                let key = dir.path("derper.key").display().to_string();
                let mut args = files.base();
                args.extend(["-a", "127.0.0.1:0", "-c", &key].map(str::to_owned));
                args.extend(forms[0].iter().cloned());
                let (status, log) = run_to_exit(
                    &Launch::plain(),
                    &args.iter().map(String::as_str).collect::<Vec<_>>(),
                );
                assert_eq!(
                    status.code(),
                    Some(1),
                    "-{name}: a start refuses too: {log}"
                );
                assert!(log.contains(&format!("derpd: -{name}:")), "{log}");
                assert!(
                    !std::path::Path::new(&key).exists(),
                    "-{name}: refused after writing the key"
                );
            }
            "ignored" => {
                let says = format!("-{name} ignored");
                for form in &forms {
                    let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
                    args.extend(form.iter().cloned());
                    let (code, out) = check(&args);
                    assert_eq!(code, 0, "-{name} is called ignored; {form:?}: {out}");
                    assert!(out.contains(&says), "want {says:?}: {form:?}: {out}");
                }
                let dir = TempDir::new("derper-table-ignored");
                let key = dir.path("derper.key").display().to_string();
                let mut args = files.base();
                args.extend(["-a", "127.0.0.1:0", "-c", &key].map(str::to_owned));
                args.extend(forms[0].iter().cloned());
                let node = Node::start(&args);
                node.find_log(&says, |v| {
                    v["fields"]["message"]
                        .as_str()?
                        .starts_with(&says)
                        .then_some(())
                });
            }
            "differs" => {
                let mine: Vec<&Claim> = claims.iter().filter(|c| c.flag == name).collect();
                assert!(
                    !mine.is_empty(),
                    "-{name} is called different: add a claim of what --check shows for it"
                );
                for claim in mine {
                    let (code, out) = if claim.base {
                        check(&claim.args)
                    } else {
                        let mut args = vec!["--check".to_owned()];
                        args.extend(claim.args.iter().cloned());
                        let (code, out, err) = derpd(&args);
                        (code, format!("{out}{err}"))
                    };
                    let what = format!("-{name}: {:?}: exit {code}\n{out}", claim.args);
                    assert_eq!(code, claim.code, "{what}");
                    assert!(out.contains(claim.shows), "want {:?}: {what}", claim.shows);
                }
                if non_default.is_some() {
                    for form in &forms {
                        let (code, out) = check(form);
                        assert_eq!(code, 0, "-{name}; {form:?}: {out}");
                        if name == "version" {
                            assert!(out.starts_with("derpd "), "{form:?}: {out}");
                        } else {
                            assert!(out.contains(USABLE), "{form:?}: {out}");
                        }
                    }
                }
            }
            _ => unreachable!("checked above"),
        }
    }
    for claim in &claims {
        assert!(
            rows.iter()
                .any(|(f, _, says)| *f == format!("`-{}`", claim.flag)
                    && says.starts_with("**differs**")),
            "a claim for -{}, which has no \"differs\" row",
            claim.flag
        );
    }
    let missing: Vec<&str> = by_name
        .keys()
        .filter(|n| !seen.contains(*n))
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "derper flags without a row: {missing:?}"
    );

    // derpd's own flags are all named in the paragraph after the table, and only those.
    let derper_names: BTreeSet<&str> = by_name.keys().copied().collect();
    let own_paragraph = section
        .split("\n\n")
        .find(|p| p.starts_with("derpd's own flags"))
        .expect("the paragraph of derpd's own flags");
    for names in derpd_flag_names() {
        if names
            .iter()
            .any(|n| derper_names.contains(n.as_str()) || n == "help")
        {
            continue;
        }
        for name in names.iter().filter(|n| n.len() > 1) {
            assert!(
                own_paragraph.contains(&format!("`--{name}`")),
                "--{name} is derpd's own flag and missing from the paragraph after the table"
            );
        }
    }
}

#[test]
fn the_readmes_flag_table_names_flags_derpd_has() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    let known: BTreeSet<String> = derpd_flag_names().into_iter().flatten().collect();
    let table = &readme[readme
        .find("| flag | default | meaning |")
        .expect("the flag table")..];
    let mut named = 0;
    for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
        let first = row
            .trim_start_matches('|')
            .split(" | ")
            .next()
            .unwrap_or("");
        for name in first.split('`').filter(|s| s.starts_with('-')) {
            let name = name.trim_start_matches('-');
            assert!(
                known.contains(name),
                "the README names -{name}, which derpd does not have"
            );
            named += 1;
        }
    }
    assert!(named > 30, "only {named} flags found in the README's table");
}

/// A derper command line as a wrapper writes it: a shell line run with `$DERPER` for the
/// binary and the wrapper's environment.
struct Wrapper {
    source: &'static str,
    line: &'static str,
    env: Vec<(&'static str, String)>,
    /// A line that only shows what it should on TLS: the certificate it names.
    shows: &'static str,
}

fn run_wrapper(w: &Wrapper) -> (i32, String, String) {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("{} --check", w.line))
        .env("DERPER", DERPD)
        .env("RUST_LOG", "info")
        .envs(w.env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run sh");
    (
        out.status.code().expect("exited"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// fredliang44/derper-docker's Dockerfile ENV defaults (its certificate directory replaced).
fn fredliang44_env(certs: &str) -> Vec<(&'static str, String)> {
    [
        ("DERP_DOMAIN", "your-hostname.com"),
        ("DERP_CERT_MODE", "letsencrypt"),
        ("DERP_CERT_DIR", certs),
        ("DERP_ADDR", ":443"),
        ("DERP_STUN", "true"),
        ("DERP_HTTP_PORT", "80"),
        ("DERP_VERIFY_CLIENTS", "false"),
    ]
    .map(|(k, v)| (k, v.to_owned()))
    .to_vec()
}

#[test]
fn real_derper_command_lines_pass_check() {
    let files = Files::new("derper-lines");
    files.manual_cert("derp.example.com");
    files.manual_cert("your-hostname.com");
    let key = files.key.clone();
    let certs = &files.certs;
    let wrappers = [
        Wrapper {
            // Tailscale's docs (kb/1118): `sudo derper --hostname your-hostname.com`, which as
            // root keeps its key in /var/lib/derper; the test names a key file instead.
            source: "tailscale.com/kb/1118",
            line: "$DERPER --hostname your-hostname.com -c $KEY",
            env: vec![("KEY", key.clone())],
            shows: "[::]:443/tcp (every interface, IPv4 and IPv6; TLS for your-hostname.com",
        },
        Wrapper {
            source: "issue: a manual-certificate node",
            line: "$DERPER -hostname=derp.example.com -certmode=manual -certdir=$CERTS -a=:443 \
                   -http-port=80 -stun-port=3478 -verify-clients=false -c=$KEY",
            env: vec![("KEY", key.clone()), ("CERTS", certs.clone())],
            shows: "TLS for derp.example.com",
        },
        Wrapper {
            // fredliang44/derper-docker's Dockerfile CMD (2024), with its ENV defaults.
            source: "fredliang44/derper-docker",
            line: "$DERPER --hostname=$DERP_DOMAIN \
                   --certmode=$DERP_CERT_MODE \
                   --certdir=$DERP_CERT_DIR \
                   --a=$DERP_ADDR \
                   --stun=$DERP_STUN  \
                   --stun-port=$DERP_STUN_PORT \
                   --http-port=$DERP_HTTP_PORT \
                   --verify-clients=$DERP_VERIFY_CLIENTS \
                   --verify-client-url=$DERP_VERIFY_CLIENT_URL -c $KEY",
            env: fredliang44_env(certs)
                .into_iter()
                .chain([
                    ("DERP_STUN_PORT", "3478".into()),
                    ("DERP_VERIFY_CLIENT_URL", String::new()),
                    ("KEY", key.clone()),
                ])
                .collect(),
            shows: "would order one from https://acme-v02.api.letsencrypt.org/directory",
        },
        Wrapper {
            // jiz4oh/derper's entrypoint.sh with its Dockerfile's ENV (DERP_HOME unset).
            source: "jiz4oh/derper",
            line: "$DERPER --hostname=$DERP_HOST \
                   --certmode=manual \
                   --certdir=$DERP_CERTS \
                   --stun=$DERP_STUN  \
                   --a=$DERP_ADDR \
                   --http-port=$DERP_HTTP_PORT \
                   --verify-clients=$DERP_VERIFY_CLIENTS \
                   --home=$DERP_HOME -c $KEY",
            env: vec![
                ("DERP_ADDR", ":443".into()),
                ("DERP_HTTP_PORT", "80".into()),
                ("DERP_HOST", "127.0.0.1".into()),
                ("DERP_CERTS", certs.clone()),
                ("DERP_STUN", "true".into()),
                ("DERP_VERIFY_CLIENTS", "false".into()),
                ("KEY", key.clone()),
            ],
            shows: "would generate a self-signed one for 127.0.0.1",
        },
        Wrapper {
            // mchlwong/derp's Dockerfile CMD: a bare boolean among valued flags.
            source: "mchlwong/derp",
            line: "$DERPER -hostname $DERP_DOMAIN -certmode manual -certdir $CERTS -stun \
                   -verify-clients=$DERP_VERIFY_CLIENTS -c $KEY",
            env: vec![
                ("DERP_DOMAIN", "your-hostname.com".into()),
                ("DERP_VERIFY_CLIENTS", "false".into()),
                ("CERTS", certs.clone()),
                ("KEY", key.clone()),
            ],
            shows: "TLS for your-hostname.com",
        },
        Wrapper {
            // XavierAlpha/derper (camllia/derper): every derper flag, each with "=", many
            // empty, with its Dockerfile's ENV (CONFIG_PATH and CERT_DIR pointed at the test's).
            source: "XavierAlpha/derper",
            line: "$DERPER --a=$ADDR --accept-connection-limit=$ACCEPT_CONNECTION_LIMIT \
                   --accept-connection-burst=$ACCEPT_CONNECTION_BURST \
                   --bootstrap-dns-names=$BOOTSTRAP_DNS --c=$CONFIG_PATH --certdir=$CERT_DIR \
                   --certmode=$CERT_MODE --derp=$RUN_DERP --dev=$DEV --home=$FLAGHOME \
                   --hostname=$HOSTNAME --http-port=$HTTP_PORT --mesh-psk-file=$MESH_PSKFILE \
                   --mesh-with=$MESH_WITH --secrets-cache-dir=$SECRETS_CACHEDIR \
                   --secrets-path-prefix=$SECRET_PREFIX --secrets-url=$SECRETS_URL \
                   --socket=$SOCKET --stun=$RUN_STUN --stun-port=$STUN_PORT \
                   --tcp-keepalive-time=$TCP_KEEPALIVE_TIME --tcp-user-timeout=$TCP_USER_TIMEOUT \
                   --tcp-write-timeout=$TCP_WRITE_TIMEOUT \
                   --unpublished-bootstrap-dns-names=$UNPUBLISHED_DNS  \
                   --verify-client-url=$VERIFY_CLIENT_URL \
                   --verify-client-url-fail-open=$VERIFY_FAIL_OPEN \
                   --verify-clients=$VERIFY_CLIENTS --version=$VERSION_FLAG",
            env: [
                ("DEV", "false"),
                ("VERSION_FLAG", "false"),
                ("ADDR", ":443"),
                ("HTTP_PORT", "80"),
                ("STUN_PORT", "3478"),
                ("CERT_MODE", "manual"),
                ("HOSTNAME", "127.0.0.1"),
                ("RUN_STUN", "true"),
                ("RUN_DERP", "true"),
                ("FLAGHOME", ""),
                ("MESH_PSKFILE", ""),
                ("MESH_WITH", ""),
                ("SECRETS_URL", ""),
                ("SECRET_PREFIX", "prod/derp"),
                ("SECRETS_CACHEDIR", "derper-secrets"),
                ("BOOTSTRAP_DNS", ""),
                ("UNPUBLISHED_DNS", ""),
                ("VERIFY_CLIENTS", "true"),
                ("VERIFY_CLIENT_URL", ""),
                ("VERIFY_FAIL_OPEN", "true"),
                ("SOCKET", ""),
                ("ACCEPT_CONNECTION_LIMIT", "+Inf"),
                ("ACCEPT_CONNECTION_BURST", "9223372036854775807"),
                ("TCP_KEEPALIVE_TIME", "10m0s"),
                ("TCP_USER_TIMEOUT", "15s"),
                ("TCP_WRITE_TIMEOUT", "2s"),
            ]
            .into_iter()
            .map(|(k, v)| (k, v.to_owned()))
            .chain([("CONFIG_PATH", key), ("CERT_DIR", certs.clone())])
            .collect(),
            shows: "peers of the local tailscaled (/var/run/tailscale/tailscaled.sock)",
        },
    ];
    for w in &wrappers {
        let (code, out, err) = run_wrapper(w);
        let what = format!("{}: exit {code}\n{out}{err}", w.source);
        assert_eq!(code, 0, "{what}");
        assert!(out.contains(USABLE), "{what}");
        assert!(out.contains(w.shows), "want {:?}: {what}", w.shows);
    }

    // fredliang44/derper-docker's CMD of December 2021 gave booleans a separate value. derper
    // stopped reading at "true" and ignored --http-port and --verify-clients; derpd says so.
    let old = Wrapper {
        source: "fredliang44/derper-docker, 2021-12-24",
        line: "$DERPER --hostname $DERP_DOMAIN --certmode $DERP_CERT_MODE --certdir $DERP_CERT_DIR \
               --a $DERP_ADDR --stun $DERP_STUN  --http-port $DERP_HTTP_PORT \
               --verify-clients $DERP_VERIFY_CLIENTS",
        env: fredliang44_env(certs),
        shows: "",
    };
    let (code, out, err) = run_wrapper(&old);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("unexpected argument \"true\" after -stun: a boolean flag takes its value after \"=\" (-stun=true)"),
        "{err}"
    );
}
