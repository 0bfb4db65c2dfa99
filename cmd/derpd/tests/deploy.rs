//! The deploy files, checked offline by the tools their formats have: `systemd-analyze` on the
//! unit and its drop-in, hadolint on the Dockerfile (and its health check run against a live
//! derpd), promtool on the alerting rules and every Grafana query, the Kubernetes schemas on
//! every manifest kustomize renders, the Prometheus operator's models on its resources, and
//! `derpd --check` on the command line each deploy file gives derpd. Each tool check also runs
//! on a deliberately broken file, so a check that cannot fail would be noticed.
//!
//! The tools come from `scripts/test-tools install`; a missing one fails the test with that
//! line.

use crate::tools;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::support;

use support::{DERPD, Node, STEP, TempDir};

fn deploy(rel: &str) -> PathBuf {
    tools::repo().join("deploy").join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs a command to completion: (success, stdout and stderr together).
fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn must(cmd: &mut Command) -> String {
    let shown = format!("{cmd:?}");
    let (ok, out) = run(cmd);
    assert!(ok, "{shown} failed:\n{out}");
    out
}

fn check_py() -> Command {
    let mut cmd = Command::new(tools::venv("python"));
    cmd.arg(tools::repo().join("cmd/derpd/tests/deploy/check.py"));
    cmd
}

/// `derpd --check` with `args`; the report.
fn derpd_check(args: &[String]) -> String {
    let (ok, out) = run(Command::new(DERPD).arg("--check").args(args));
    assert!(ok, "derpd --check {args:?} failed:\n{out}");
    out
}

/// Starts derpd with `args` plus a metrics listener, and waits until it reports itself ready
/// there (listening; with TLS, a certificate in service). Returns it and the metrics address.
fn start_derpd(args: &[&str]) -> (Node, SocketAddr) {
    let mut all = args.to_vec();
    all.extend(["--metrics-addr", "127.0.0.1:0"]);
    let node = Node::start(&all);
    let metrics = node.metrics_addr.expect("metrics address");
    // Asks the readiness endpoint until it says 200; each answer is one round trip.
    let deadline = Instant::now() + STEP;
    while http_get(metrics, "/derp/probe").0 != 200 {
        assert!(Instant::now() < deadline, "derpd never became ready");
    }
    (node, metrics)
}

/// A GET on a new connection: the status and the body.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let out = support::http_get(addr, path);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
    (status, body.unwrap_or_default())
}

// ---------------------------------------------------------------------------------------
// systemd

/// The unit with ExecStart pointing at the derpd under test, in a directory of its own (the
/// file keeps its name: systemd refuses other names).
fn unit_copy(dir: &TempDir, extra: &str) -> PathBuf {
    let unit = read(&deploy("systemd/derpd.service"));
    assert!(unit.contains("ExecStart=/usr/local/bin/derpd "));
    let unit = unit.replace(
        "ExecStart=/usr/local/bin/derpd ",
        &format!("ExecStart={DERPD} "),
    );
    dir.write("derpd.service", &format!("{unit}{extra}"))
}

/// `systemd-analyze verify`: it reports parse errors as warnings and still exits 0, so any
/// output at all is a failure.
fn verify(unit: &Path) -> (bool, String) {
    let (ok, out) = run(Command::new(tools::debian("systemd-analyze", "systemd"))
        .arg("verify")
        .arg(unit));
    (ok && out.trim().is_empty(), out)
}

#[test]
fn systemd_unit_and_mesh_drop_in_verify_cleanly_and_stay_hardened() {
    let dir = TempDir::new("unit");
    let unit = unit_copy(&dir, "");
    let (ok, out) = verify(&unit);
    assert!(ok, "the unit does not verify:\n{out}");
    // Exposure 2.0 or less ("OK"); the unit scores 2.0 (1.8 without AF_NETLINK).
    must(
        Command::new(tools::debian("systemd-analyze", "systemd"))
            .args(["security", "--offline=true", "--threshold=20"])
            .arg(&unit),
    );
    let unit_text = read(&unit);
    for line in [
        "Type=notify",
        "NotifyAccess=all",
        "ExecReload=/bin/kill -USR2 $MAINPID",
        "SystemCallFilter=@system-service",
        "TimeoutStopSec=15",
        "--drain-timeout 10s",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        // derp_tcp_rtt reads the kernel's TCP statistics over netlink.
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
    ] {
        assert!(unit_text.contains(line), "the unit lost {line:?}");
    }

    // The mesh drop-in, as installed beside the unit.
    dir.write(
        "derpd.service.d/mesh.conf",
        &read(&deploy("systemd/derpd.service.d/mesh.conf")),
    );
    let (ok, out) = verify(&unit);
    assert!(ok, "the unit with the mesh drop-in does not verify:\n{out}");

    // The check has teeth: a misspelt key is only a warning to systemd, and fails here.
    let bad = TempDir::new("unit-bad");
    let unit = unit_copy(&bad, "NoNewPrivilege=yes\n");
    let (ok, out) = verify(&unit);
    assert!(!ok && out.contains("NoNewPrivilege"), "{out}");
}

/// The words of ExecStart, continuation lines joined.
fn exec_start_args(unit: &str) -> Vec<String> {
    let start = unit.find("\nExecStart=").expect("ExecStart") + "\nExecStart=".len();
    let mut command = String::new();
    for line in unit[start..].lines() {
        match line.trim_end().strip_suffix('\\') {
            Some(part) => command.push_str(part),
            None => {
                command.push_str(line);
                break;
            }
        }
        command.push(' ');
    }
    command
        .split_whitespace()
        .skip(1)
        .map(str::to_owned)
        .collect()
}

#[test]
fn systemd_unit_and_drop_in_arguments_pass_derpd_check() {
    let unit = read(&deploy("systemd/derpd.service"));
    let args = exec_start_args(&unit);
    assert_eq!(args.last().map(String::as_str), Some("$DERPD_MESH_ARGS"));
    assert!(unit.contains("\nEnvironment=DERPD_MESH_ARGS=\n"));
    let dir = TempDir::new("unit-check");
    // The unit's state directory, here a temporary one.
    let state = dir.path("state").display().to_string();
    let local = |args: &[String]| -> Vec<String> {
        args.iter()
            .filter(|a| *a != "$DERPD_MESH_ARGS")
            .map(|a| a.replace("/var/lib/derpd", &state))
            .collect()
    };
    let out = derpd_check(&local(&args));
    assert!(
        out.contains("[::]:443/tcp (every interface, IPv4 and IPv6; TLS for derp.example.com"),
        "{out}"
    );
    assert!(out.contains("127.0.0.1:9090/tcp"), "{out}");

    // With the drop-in: its variable in place of $DERPD_MESH_ARGS, %d its credentials.
    let dropin = read(&deploy("systemd/derpd.service.d/mesh.conf"));
    let value = dropin
        .lines()
        .find_map(|l| l.strip_prefix("Environment=\"DERPD_MESH_ARGS="))
        .and_then(|v| v.strip_suffix('"'))
        .expect("the drop-in sets DERPD_MESH_ARGS");
    assert!(dropin.contains("\nLoadCredential=mesh.key:/etc/derpd/mesh.key\n"));
    let creds = dir.path("credentials");
    std::fs::create_dir_all(&creds).expect("dir");
    std::fs::write(creds.join("mesh.key"), format!("{}\n", "ab".repeat(32))).expect("key");
    let mut with_mesh = local(&args);
    with_mesh.extend(
        value
            .replace("%d", &creds.display().to_string())
            .split_whitespace()
            .map(str::to_owned),
    );
    let out = derpd_check(&with_mesh);
    assert!(out.contains("3 entries, each dialed"), "{out}");
    assert!(out.contains("https://derp2.example.com/derp"), "{out}");
}

// ---------------------------------------------------------------------------------------
// Container image

#[test]
fn dockerfile_lints_clean_and_builds_the_pinned_toolchain_as_non_root() {
    let hadolint = tools::venv("hadolint");
    let dockerfile = deploy("Dockerfile");
    let out = must(Command::new(&hadolint).arg("--no-color").arg(&dockerfile));
    assert!(out.trim().is_empty(), "hadolint findings:\n{out}");
    // It has teeth: an unpinned base image and `cd` in RUN are findings.
    let dir = TempDir::new("docker");
    let bad = dir.write("Dockerfile", "FROM debian\nRUN cd /tmp && ls\n");
    let (ok, out) = run(Command::new(&hadolint).arg("--no-color").arg(&bad));
    assert!(
        !ok && out.contains("DL3006") && out.contains("DL3003"),
        "{out}"
    );

    let text = read(&dockerfile);
    // The toolchain the workspace pins.
    let manifest = read(&tools::repo().join("Cargo.toml"));
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("rust-version");
    assert!(
        text.contains(&format!("\nFROM rust:{version}-")),
        "the build stage must use rust:{version}"
    );
    let user = text
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("USER");
    let uid: u32 = user
        .split(':')
        .next()
        .and_then(|u| u.parse().ok())
        .expect("a numeric USER, which runAsNonRoot can verify");
    assert_ne!(uid, 0);
    assert!(text.contains("setcap cap_net_bind_service=+ep"));
    // Build from the repository root without sending build output or test tools.
    let ignore = read(&tools::repo().join(".dockerignore"));
    for entry in ["target", ".test-tools", ".git"] {
        assert!(
            ignore.lines().any(|l| l == entry),
            ".dockerignore lacks {entry}"
        );
    }

    // The ENTRYPOINT's flags, plus what an operator adds, pass derpd --check.
    let entry = text
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(entry).expect("exec form");
    assert_eq!(entry[0], "/usr/local/bin/derpd");
    let state = dir.path("state").display().to_string();
    let mut args: Vec<String> = entry[1..]
        .iter()
        .map(|a| a.replace("/var/lib/derpd", &state))
        .collect();
    args.extend(["--hostname".into(), "derp.example.com".into()]);
    let out = derpd_check(&args);
    assert!(out.contains("127.0.0.1:9090/tcp"), "{out}");
}

/// The HEALTHCHECK's command, with its port replaced.
fn healthcheck(port: u16) -> Vec<String> {
    let text = read(&deploy("Dockerfile"));
    let start = text.find("\nHEALTHCHECK ").expect("HEALTHCHECK");
    let cmd = text[start..]
        .split_once("CMD ")
        .map(|(_, rest)| rest.lines().next().unwrap_or(""))
        .expect("CMD");
    let argv: Vec<String> = serde_json::from_str(cmd).expect("exec form");
    argv.into_iter()
        .map(|a| a.replace("/9090", &format!("/{port}")))
        .collect()
}

#[test]
fn dockerfile_healthcheck_passes_on_a_ready_derpd_only() {
    let (_derpd, metrics) = start_derpd(&["--dev", "-a", "127.0.0.1:0"]);
    let argv = healthcheck(metrics.port());
    must(Command::new(&argv[0]).args(&argv[1..]));
    // Nothing listening: unhealthy.
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = free.local_addr().expect("addr").port();
    drop(free);
    let argv = healthcheck(port);
    let (ok, _) = run(Command::new(&argv[0]).args(&argv[1..]));
    assert!(!ok, "the health check passed with nothing listening");
}

// ---------------------------------------------------------------------------------------
// Prometheus and Grafana

#[test]
fn alerting_rules_pass_promtool_and_their_unit_tests() {
    let promtool = tools::promtool();
    let alerts = deploy("prometheus/alerts.yml");
    must(
        Command::new(&promtool)
            .args(["check", "rules"])
            .arg(&alerts),
    );
    must(
        Command::new(&promtool)
            .args(["test", "rules"])
            .arg(deploy("prometheus/alerts_test.yml")),
    );
    // Every alert has a unit test, and a runbook entry.
    let text = read(&alerts);
    let tests = read(&deploy("prometheus/alerts_test.yml"));
    let runbook = read(&tools::repo().join("docs/operations.md"));
    for name in text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "{name} has no unit test"
        );
        assert!(
            runbook.contains(&format!("#### {name}\n")),
            "{name} has no runbook entry in docs/operations.md"
        );
    }

    // The PrometheusRule holds the same groups, and they pass promtool as it reads them.
    let rule = deploy("kubernetes/components/prometheus-operator/prometheusrule.yaml");
    must(check_py().arg("same-rules").arg(&alerts).arg(&rule));
    let dir = TempDir::new("rules");
    let spec = must(check_py().arg("rule-spec").arg(&rule));
    let spec = dir.write("spec.yml", &spec);
    must(Command::new(&promtool).args(["check", "rules"]).arg(&spec));

    // promtool has teeth.
    let bad = dir.write(
        "bad.yml",
        "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(x[5m])\n",
    );
    let (ok, out) = run(Command::new(&promtool).args(["check", "rules"]).arg(&bad));
    assert!(!ok, "{out}");
}

/// The metric names a PromQL expression reads: identifiers that are not functions,
/// aggregations, keywords, label names (inside `{}`, `by (…)`, `on (…)`…) or durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
        // Aggregations, which may be followed by `by (…)` before their parenthesis.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut braces, mut brackets) = (0, 0, 0);
    let mut label_list_depth: Option<usize> = None;
    let mut parens = 0usize;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                // A string: skip to its end.
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            '{' => braces += 1,
            '}' => braces -= 1,
            '[' => brackets += 1,
            ']' => brackets -= 1,
            '(' => parens += 1,
            ')' => {
                if label_list_depth == Some(parens) {
                    label_list_depth = None;
                }
                parens = parens.saturating_sub(1);
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i + 1 < chars.len()
                    && (chars[i + 1].is_ascii_alphanumeric()
                        || chars[i + 1] == '_'
                        || chars[i + 1] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..=i].iter().collect();
                let preceded_by_digit = start > 0 && chars[start - 1].is_ascii_digit();
                let mut j = i + 1;
                while j < chars.len() && chars[j] == ' ' {
                    j += 1;
                }
                let next = chars.get(j).copied();
                let lower = word.to_ascii_lowercase();
                if matches!(
                    lower.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) && next == Some('(')
                {
                    // The list that follows names labels.
                    label_list_depth = Some(parens + 1);
                } else if braces == 0
                    && brackets == 0
                    && label_list_depth.is_none()
                    && !preceded_by_digit
                    && next != Some('(')
                    && !KEYWORDS.contains(&lower.as_str())
                {
                    names.insert(word);
                }
            }
            _ => {}
        }
        i += 1;
    }
    names
}

#[test]
fn the_promql_reader_finds_metric_names_only() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            r#"sum by (instance) (rate(derp_packets_received{job=~"$job", x="a b"}[5m])) / clamp_min(sum without (kind) (rate(derp_packets_dropped[$__rate_interval])), 1) > 0.01"#
        ),
        ["derp_packets_dropped", "derp_packets_received"]
    );
    assert_eq!(
        names("up{job=\"derpd\"} == 0 and on (instance) process_open_fds offset 5m > 1e3"),
        ["process_open_fds", "up"]
    );
    assert_eq!(
        names("derp_tls_cert_not_after_seconds - time() < 14 * 86400"),
        ["derp_tls_cert_not_after_seconds"]
    );
}

/// Every query of the dashboard (panels, nested panels, and template variables'
/// `label_values(...)` selectors), with Grafana's interval variables replaced so promtool
/// can parse them.
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read(&deploy("grafana/derpd.json"))).expect("dashboard JSON");
    fn walk(panels: &serde_json::Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("").to_owned();
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((title.clone(), e.to_owned()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let query = v["query"].as_str().unwrap_or("");
        if let Some(inner) = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .and_then(|q| q.rsplit_once(','))
        {
            out.push((format!("variable {}", v["name"]), inner.0.trim().to_owned()));
        }
    }
    out.into_iter()
        .map(|(t, e)| {
            let e = e
                .replace("$__rate_interval", "5m")
                .replace("$__interval", "1m")
                .replace("$__range", "1h");
            (t, e)
        })
        .collect()
}

#[test]
fn dashboard_and_alert_queries_parse_and_read_only_metrics_derpd_exports() {
    // A derpd with every family registered: TLS (a self-signed IP certificate), STUN, and a
    // mesh link (to a sibling that is not there).
    let dir = TempDir::new("scrape");
    let key = dir.path("derper.key").display().to_string();
    let certs = dir.path("certs").display().to_string();
    let mesh = dir
        .write("mesh.key", &format!("{}\n", "cd".repeat(32)))
        .display()
        .to_string();
    let mut args = support::manual_ip_args(&certs);
    args.extend([
        "-c",
        &key,
        "--mesh-psk-file",
        &mesh,
        "--mesh-with",
        "http://127.0.0.1:9/derp",
    ]);
    let (_derpd, metrics) = start_derpd(&args);
    let (status, body) = http_get(metrics, "/metrics");
    assert_eq!(status, 200);
    let exported: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    assert!(
        exported.contains("derp_tls_cert_not_after_seconds"),
        "{exported:?}"
    );
    // Series Prometheus makes itself for every target.
    let synthetic = ["up"];

    let queries = dashboard_queries();
    assert!(
        queries.len() > 30,
        "the dashboard has {} queries",
        queries.len()
    );
    let mut alerts = Vec::new();
    for line in read(&deploy("prometheus/alerts.yml")).lines() {
        if let Some(e) = line.trim().strip_prefix("expr: ") {
            alerts.push(("alert".to_owned(), e.to_owned()));
        }
    }
    for (what, expr) in queries.iter().chain(&alerts) {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{what}: no metric in {expr}");
        for name in names {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| exported.contains(*f)))
                .unwrap_or(&name);
            assert!(
                exported.contains(family) || synthetic.contains(&family),
                "{what}: {expr} reads {name}, which derpd does not export"
            );
        }
    }

    // Each dashboard query parses: promtool checks them as recording rules.
    let rules = serde_json::json!({
        "groups": [{
            "name": "grafana",
            "rules": queries
                .iter()
                .enumerate()
                .map(|(i, (_, e))| serde_json::json!({"record": format!("grafana:query_{i}"), "expr": e}))
                .collect::<Vec<_>>(),
        }]
    });
    let file = dir.write("dashboard-rules.yml", &rules.to_string());
    let out = must(
        Command::new(tools::promtool())
            .args(["check", "rules"])
            .arg(&file),
    );
    assert!(
        out.contains(&format!("{} rules found", queries.len())),
        "{out}"
    );
}

// ---------------------------------------------------------------------------------------
// Kubernetes

const K8S_VERSION: &str = "1.33.0";

/// Every kustomization: the base and each overlay.
fn kustomizations() -> Vec<PathBuf> {
    let mut dirs = vec![deploy("kubernetes/base")];
    let overlays = deploy("kubernetes/overlays");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&overlays)
        .expect("overlays")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .collect();
    found.sort();
    assert!(found.len() >= 2, "overlays: {found:?}");
    dirs.extend(found);
    dirs
}

fn render(dir: &Path, out: &TempDir) -> PathBuf {
    let name = dir
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let yaml = must(
        Command::new(tools::venv("kubectl"))
            .arg("kustomize")
            .arg(dir),
    );
    out.write(&format!("{name}.yaml"), &yaml)
}

#[test]
fn kubernetes_manifests_render_and_validate_against_the_schemas() {
    let dir = TempDir::new("k8s");
    let mut files: Vec<PathBuf> = kustomizations().iter().map(|d| render(d, &dir)).collect();
    // The files as written, too (the base's and the component's, outside kustomize).
    for sub in [
        "kubernetes/base",
        "kubernetes/components/prometheus-operator",
    ] {
        for entry in std::fs::read_dir(deploy(sub)).expect("dir") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "yaml")
                && path.file_name().is_some_and(|n| n != "kustomization.yaml")
            {
                files.push(path);
            }
        }
    }
    // A broken manifest among them, which must be the only one refused.
    let broken = dir.write(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  ports:\n    - port: 443\n      targetPor: https\n",
    );
    files.push(broken.clone());
    let (ok, out) = run(Command::new(tools::venv("kubernetes-validate"))
        .args(["--strict", "-k", K8S_VERSION])
        .args(&files));
    assert!(!ok, "the broken manifest passed:\n{out}");
    let mut passed = 0;
    for line in out.lines() {
        if line.starts_with("INFO") && line.contains(" passed for resource ") {
            passed += 1;
        } else if line.starts_with("WARN") {
            // Kinds without a bundled schema pass silently; only the operator's are
            // expected, and they are checked below against its own models.
            assert!(
                line.contains("kind PrometheusRule with api version monitoring.coreos.com/v1")
                    || line
                        .contains("kind ServiceMonitor with api version monitoring.coreos.com/v1"),
                "{line}"
            );
        } else if line.starts_with("ERROR") {
            assert!(line.contains(&*broken.to_string_lossy()), "refused: {line}");
            assert!(line.contains("targetPor"), "{line}");
        }
    }
    assert!(passed >= 30, "only {passed} resources validated:\n{out}");

    // The operator's resources, rendered and as written, against its models; with a typo
    // in one more, which must be refused.
    let typo = dir.write(
        "typo.yaml",
        "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata:\n  name: t\nspec:\n  selector: {}\n  endpoints:\n    - port: metrics\n      intervall: 30s\n",
    );
    let mut crd_files = files;
    crd_files.retain(|f| f != &broken);
    crd_files.push(typo);
    let (ok, out) = run(check_py().arg("crds").args(&crd_files));
    assert!(!ok, "the typo passed:\n{out}");
    let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{out}");
    assert!(errors[0].contains("intervall"), "{out}");
    assert!(
        out.lines().filter(|l| l.starts_with("OK")).count() >= 6,
        "too few custom resources checked:\n{out}"
    );
}

#[test]
fn every_region_hangs_together_and_its_pods_arguments_pass_derpd_check() {
    let dir = TempDir::new("region");
    let mesh_key = dir.write("mesh.key", &format!("{}\n", "ef".repeat(32)));
    let state = dir.path("state").display().to_string();
    for kustomization in kustomizations() {
        let rendered = render(&kustomization, &dir);
        for pod in [0, 1] {
            let info = must(check_py().arg("region").arg(&rendered).arg(pod.to_string()));
            let info: serde_json::Value = serde_json::from_str(&info).expect("JSON");
            let replicas = info["replicas"].as_u64().expect("replicas");
            // The grace period outlasts the drain and derpd's closing margin.
            let args: Vec<String> = info["args"]
                .as_array()
                .expect("args")
                .iter()
                .map(|a| a.as_str().expect("string").to_owned())
                .collect();
            let drain = args
                .iter()
                .find_map(|a| a.strip_prefix("--drain-timeout="))
                .and_then(|d| d.strip_suffix('s'))
                .and_then(|d| d.parse::<u64>().ok())
                .expect("--drain-timeout in seconds");
            assert!(info["grace"].as_u64().expect("grace") > drain + 3);
            assert_eq!(args[0], "/usr/local/bin/derpd");
            let local: Vec<String> = args[1..]
                .iter()
                .map(|a| {
                    a.replace("/var/lib/derpd", &state)
                        .replace("/etc/derpd/mesh/mesh.key", &mesh_key.to_string_lossy())
                })
                .collect();
            let out = derpd_check(&local);
            let what = kustomization.display();
            assert!(
                // Every pod is listed, its own entry too: it knows itself by its key.
                out.contains(&format!("{replicas} entries, each dialed")),
                "{what}:\n{out}"
            );
            assert!(
                out.contains(&format!(
                    "TLS for derpd-{pod}.{}",
                    info["domain"].as_str().expect("domain")
                )),
                "{what}:\n{out}"
            );
            if kustomization.ends_with("proxy-protocol") {
                assert!(
                    out.contains("PROXY protocol (v1, v2) required on --addr and --http-port"),
                    "{what}:\n{out}"
                );
            }
        }
    }
    // The DERP map for the base region lists exactly its nodes.
    let base = render(&deploy("kubernetes/base"), &dir);
    must(
        check_py()
            .arg("derpmap")
            .arg(deploy("kubernetes/derpmap.json"))
            .arg(&base),
    );
}
