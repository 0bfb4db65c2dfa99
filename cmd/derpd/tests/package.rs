//! The Debian package operators install: `scripts/package deb`, given the derpd these tests
//! run (a release build would take minutes), builds a package whose file list, modes and
//! control fields are exactly what they should be, whose unit verifies and keeps its sandbox,
//! whose binary runs and whose shipped flags `derpd --check` refuses until the hostname is
//! set (so the postinst does not start an unconfigured node), and which lintian passes.
//!
//! The tools (dpkg-dev, binutils, lintian, man-db, systemd) come from `scripts/test-tools
//! install`; a missing one fails the test with that line. Nothing is installed on the host:
//! the package is only built, read and extracted into a temporary directory.

use crate::support;
use crate::tools;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use support::{DERPD, TempDir};

/// Runs a command to completion: (success, stdout, stderr).
fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A command that must succeed; its stdout.
fn must(cmd: &mut Command) -> String {
    let shown = format!("{cmd:?}");
    let (ok, out, err) = run(cmd);
    assert!(ok, "{shown} failed:\n{out}{err}");
    out
}

fn tool(name: &str, package: &str) -> Command {
    Command::new(tools::debian(name, package))
}

/// Builds the package into `dir` from the derpd under test; its path. Both paths are given
/// relative to the directory the script is run in, as an operator may type them.
fn build(dir: &Path) -> PathBuf {
    let cwd = dir.parent().expect("a parent");
    let binary = cwd.join("derpd-under-test");
    if !binary.exists() {
        std::os::unix::fs::symlink(DERPD, &binary).expect("symlink");
    }
    let out = must(
        Command::new(tools::repo().join("scripts/package"))
            .current_dir(cwd)
            .arg("deb")
            .arg(dir.file_name().expect("a name"))
            .args(["--binary", "derpd-under-test"])
            // The Maintainer field as shipped, whatever the environment says.
            .env_remove("DEB_MAINTAINER"),
    );
    PathBuf::from(out.trim())
}

/// The paths and modes `dpkg-deb -c` lists: (mode, owner, path), directories ending in `/`.
fn listing(deb: &Path) -> BTreeSet<(String, String, String)> {
    must(tool("dpkg-deb", "dpkg").arg("-c").arg(deb))
        .lines()
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert!(words.len() >= 6, "unexpected listing line {line:?}");
            let path = words[5].trim_start_matches("./");
            (words[0].to_owned(), words[1].to_owned(), path.to_owned())
        })
        .collect()
}

const DIR: &str = "drwxr-xr-x";
const FILE: &str = "-rw-r--r--";
const EXEC: &str = "-rwxr-xr-x";

fn expected_listing() -> BTreeSet<(String, String, String)> {
    [
        (DIR, ""),
        (DIR, "etc/"),
        (DIR, "etc/default/"),
        (FILE, "etc/default/derpd"),
        (DIR, "lib/"),
        (DIR, "lib/systemd/"),
        (DIR, "lib/systemd/system/"),
        (FILE, "lib/systemd/system/derpd.service"),
        (DIR, "usr/"),
        (DIR, "usr/bin/"),
        (EXEC, "usr/bin/derpd"),
        (DIR, "usr/share/"),
        (DIR, "usr/share/doc/"),
        (DIR, "usr/share/doc/derpd/"),
        (FILE, "usr/share/doc/derpd/changelog.gz"),
        (FILE, "usr/share/doc/derpd/copyright"),
        (DIR, "usr/share/lintian/"),
        (DIR, "usr/share/lintian/overrides/"),
        (FILE, "usr/share/lintian/overrides/derpd"),
        (DIR, "usr/share/man/"),
        (DIR, "usr/share/man/man8/"),
        (FILE, "usr/share/man/man8/derpd.8.gz"),
    ]
    .into_iter()
    .map(|(mode, path)| (mode.to_owned(), "root/root".to_owned(), path.to_owned()))
    .collect()
}

/// The control fields of the package.
fn field(deb: &Path, name: &str) -> String {
    must(tool("dpkg-deb", "dpkg").arg("-f").arg(deb).arg(name))
        .trim()
        .to_owned()
}

/// `derpd --check` on the flags of the package's /etc/default/derpd, read as the postinst
/// reads them (the shell sources the file; the unquoted variable splits into words).
fn check_default_flags(derpd: &Path, default: &Path) -> (bool, String) {
    let (ok, out, err) = run(Command::new("sh")
        .arg("-c")
        .arg(". \"$1\" && exec \"$0\" --check $DERPD_ARGS")
        .arg(derpd)
        .arg(default));
    (ok, format!("{out}{err}"))
}

#[test]
fn the_debian_package_holds_what_it_should_and_passes_lintian() {
    let dir = TempDir::new("package");
    let deb = build(&dir.path("out"));
    let version = env!("CARGO_PKG_VERSION");
    let arch = must(tool("dpkg", "dpkg").arg("--print-architecture"))
        .trim()
        .to_owned();
    assert_eq!(
        deb.file_name().and_then(|n| n.to_str()),
        Some(format!("derpd_{version}_{arch}.deb").as_str())
    );

    // Exactly these paths, modes and owners.
    let listed = listing(&deb);
    let expected = expected_listing();
    assert_eq!(
        listed,
        expected,
        "unexpected: {:?}\nmissing: {:?}",
        listed.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&listed).collect::<Vec<_>>()
    );

    // The control fields.
    assert_eq!(field(&deb, "Package"), "derpd");
    assert_eq!(field(&deb, "Version"), version);
    assert_eq!(field(&deb, "Architecture"), arch);
    assert_eq!(field(&deb, "Section"), "net");
    assert_eq!(field(&deb, "Priority"), "optional");
    let depends = field(&deb, "Depends");
    // Computed by dpkg-shlibdeps from the binary: glibc with a version, and passwd for the
    // postinst's useradd.
    assert!(depends.starts_with("libc6 (>= 2."), "{depends}");
    assert!(depends.ends_with(", passwd"), "{depends}");
    let root = dir.path("root");
    must(tool("dpkg-deb", "dpkg").arg("-x").arg(&deb).arg(&root));
    let binary = root.join("usr/bin/derpd");
    let installed_kib: u64 = field(&deb, "Installed-Size").parse().expect("a number");
    let binary_kib = std::fs::metadata(&binary).expect("binary").len() / 1024;
    assert!(
        installed_kib >= binary_kib && installed_kib < binary_kib + 64,
        "Installed-Size {installed_kib} KiB for a {binary_kib} KiB binary"
    );
    // The control archive: these members, the maintainer scripts executable.
    let control = dir.path("control");
    must(tool("dpkg-deb", "dpkg").arg("-e").arg(&deb).arg(&control));
    let members: BTreeSet<(String, u32)> = std::fs::read_dir(&control)
        .expect("control")
        .map(|e| {
            let e = e.expect("entry");
            let mode = e.metadata().expect("metadata").permissions().mode() & 0o7777;
            (e.file_name().to_string_lossy().into_owned(), mode)
        })
        .collect();
    let want: BTreeSet<(String, u32)> = [
        ("conffiles", 0o644),
        ("control", 0o644),
        ("md5sums", 0o644),
        ("postinst", 0o755),
        ("postrm", 0o755),
        ("prerm", 0o755),
    ]
    .into_iter()
    .map(|(n, m)| (n.to_owned(), m))
    .collect();
    assert_eq!(members, want);
    assert_eq!(
        std::fs::read_to_string(control.join("conffiles")).expect("conffiles"),
        "/etc/default/derpd\n"
    );
    // The maintainer scripts are deploy/debian's, which the tests below run.
    for script in ["postinst", "prerm", "postrm"] {
        assert_eq!(
            std::fs::read(control.join(script)).expect("script"),
            std::fs::read(tools::repo().join("deploy/debian").join(script)).expect("script"),
            "{script}"
        );
    }
    // The checksums are those of the files as extracted.
    must(
        Command::new("md5sum")
            .args(["--check", "--quiet"])
            .arg(control.join("md5sums"))
            .current_dir(&root),
    );

    // The binary: stripped, and it runs.
    let sections = must(tool("readelf", "binutils").args(["-S", "-W"]).arg(&binary));
    assert!(
        [".symtab", ".debug_info", ".debug_line"]
            .iter()
            .all(|s| !sections.contains(s)),
        "the binary is not stripped:\n{sections}"
    );
    assert_eq!(
        must(Command::new(&binary).arg("--version")).trim(),
        format!("derpd {version}")
    );

    // The shipped flags: refused until --hostname is set, so the postinst does not start
    // the node; usable once it is (with the state directory somewhere writable).
    let default = root.join("etc/default/derpd");
    let (ok, out) = check_default_flags(&binary, &default);
    assert!(!ok && out.contains("--hostname \"\""), "{out}");
    let state = dir.path("state");
    let edited = dir.write(
        "default-edited",
        &std::fs::read_to_string(&default)
            .expect("default")
            .replace("--hostname= ", "--hostname=derp1.example.com ")
            .replace("/var/lib/derpd", &state.display().to_string()),
    );
    let (ok, out) = check_default_flags(&binary, &edited);
    assert!(ok, "{out}");
    assert!(out.contains("TLS for derp1.example.com"), "{out}");

    // The unit: verified with the binary and the man page it names, and as sandboxed as
    // deploy/systemd's.
    let unit_text =
        std::fs::read_to_string(root.join("lib/systemd/system/derpd.service")).expect("unit");
    for line in [
        "Type=notify",
        "EnvironmentFile=/etc/default/derpd",
        "ExecStart=/usr/bin/derpd $DERPD_ARGS $DERPD_MESH_ARGS",
        "NotifyAccess=all",
        "ExecReload=/bin/kill -USR2 $MAINPID",
        "User=derpd",
        "StateDirectory=derpd",
        // derp_tcp_rtt reads the kernel's TCP statistics over netlink.
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
    ] {
        assert!(
            unit_text.lines().any(|l| l == line),
            "the unit lost {line:?}"
        );
    }
    let units = TempDir::new("package-unit");
    let unit = units.write(
        "derpd.service",
        &unit_text.replace(
            "ExecStart=/usr/bin/derpd ",
            &format!("ExecStart={} ", binary.display()),
        ),
    );
    let analyze = || {
        let mut cmd = tool("systemd-analyze", "systemd");
        cmd.env("MANPATH", root.join("usr/share/man"));
        cmd
    };
    let (ok, out, err) = run(analyze().arg("verify").arg(&unit));
    assert!(
        ok && out.trim().is_empty() && err.trim().is_empty(),
        "the unit does not verify:\n{out}{err}"
    );
    must(
        analyze()
            .args(["security", "--offline=true", "--threshold=20"])
            .arg(&unit),
    );
    // deploy/systemd's mesh drop-in applies to the packaged unit as it is.
    units.write(
        "derpd.service.d/mesh.conf",
        &std::fs::read_to_string(tools::repo().join("deploy/systemd/derpd.service.d/mesh.conf"))
            .expect("drop-in"),
    );
    let (ok, out, err) = run(analyze().arg("verify").arg(&unit));
    assert!(
        ok && out.trim().is_empty() && err.trim().is_empty(),
        "the unit with the mesh drop-in does not verify:\n{out}{err}"
    );

    // lintian: no error. Its warnings and notes are printed (shown when the test fails, and
    // with --no-capture).
    tools::debian("man", "man-db");
    let (ok, out, err) = run(tool("lintian", "lintian")
        .args(["--fail-on", "error", "--display-info"])
        .arg(&deb));
    println!("lintian {}:\n{out}{err}", deb.display());
    assert!(ok, "lintian reports errors:\n{out}{err}");
    assert!(!out.lines().any(|l| l.starts_with("E: ")), "{out}");
}

/// The maintainer scripts of deploy/debian (those the package ships), run against a scratch
/// root (`$DPKG_ROOT`) with the commands that would change the host replaced by stubs that
/// log their arguments: useradd and the other account tools, chown, runuser (which runs its
/// command as the test's user), systemctl, deb-systemd-helper, deb-systemd-invoke and
/// policy-rc.d.
struct Scripts {
    dir: TempDir,
    root: PathBuf,
}

/// The account tools keep the derpd user and group as files in `$STUB_STATE`: `user` and
/// `group`. useradd fails as the real one does: exit 9 when --user-group would create a
/// group that exists, 6 when --gid names one that does not.
const STUBS: &[(&str, &str)] = &[
    (
        "useradd",
        "case \" $* \" in\n\
         *\" --user-group \"*) [ -e \"$STUB_STATE/group\" ] && exit 9; touch \"$STUB_STATE/group\" ;;\n\
         *\" --gid \"*) [ -e \"$STUB_STATE/group\" ] || exit 6 ;;\n\
         esac\n\
         touch \"$STUB_STATE/user\"",
    ),
    ("userdel", "rm -f \"$STUB_STATE/user\""),
    ("groupdel", "rm -f \"$STUB_STATE/group\""),
    (
        "getent",
        "case \"$1\" in passwd) f=user ;; *) f=$1 ;; esac\n[ -e \"$STUB_STATE/$f\" ]",
    ),
    ("chown", ""),
    (
        "runuser",
        "while [ \"$1\" != -- ]; do shift; done; shift; exec \"$@\"",
    ),
    ("systemctl", ""),
    ("deb-systemd-helper", ""),
    ("deb-systemd-invoke", ""),
    ("policy-rc.d", "exit \"${STUB_POLICY:-0}\""),
];

impl Scripts {
    /// A root with the binary under test, the shipped flags (or `flags`' edit of them) and,
    /// with `systemd`, the directory that says systemd runs.
    fn new(systemd: bool, edit_flags: impl Fn(&str, &Path) -> String) -> Self {
        let dir = TempDir::new("maintscripts");
        let root = dir.path("root");
        for sub in ["usr/bin", "etc/default", "var/lib", "stubs", "state"] {
            let base = if sub == "stubs" || sub == "state" {
                &dir.0
            } else {
                &root
            };
            std::fs::create_dir_all(base.join(sub)).expect("dir");
        }
        if systemd {
            std::fs::create_dir_all(root.join("run/systemd/system")).expect("dir");
        }
        std::os::unix::fs::symlink(DERPD, root.join("usr/bin/derpd")).expect("symlink");
        let shipped =
            std::fs::read_to_string(tools::repo().join("deploy/debian/default")).expect("flags");
        std::fs::write(root.join("etc/default/derpd"), edit_flags(&shipped, &root)).expect("flags");
        for (name, body) in STUBS {
            let path = dir.0.join("stubs").join(name);
            std::fs::write(
                &path,
                format!("#!/bin/sh\necho \"{name} $*\" >>\"$STUB_LOG\"\n{body}\n"),
            )
            .expect("stub");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        Self { dir, root }
    }

    fn user_exists(&self) -> bool {
        self.dir.0.join("state/user").exists()
    }

    fn group_exists(&self) -> bool {
        self.dir.0.join("state/group").exists()
    }

    /// Runs deploy/debian/`script` with `args`: (success, stdout and stderr, the stubs'
    /// log lines, cleared for the next run).
    fn run(&self, script: &str, args: &[&str], policy: i32) -> (bool, String, Vec<String>) {
        let path = format!(
            "{}:{}",
            self.dir.0.join("stubs").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = self.dir.0.join("stubs.log");
        let (ok, out, err) = run(Command::new("sh")
            .arg(tools::repo().join("deploy/debian").join(script))
            .args(args)
            .env("PATH", path)
            .env("DPKG_ROOT", &self.root)
            .env("STUB_LOG", &log)
            .env("STUB_STATE", self.dir.0.join("state"))
            .env("STUB_POLICY", policy.to_string()));
        let lines = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        let _ = std::fs::remove_file(&log);
        (ok, format!("{out}{err}"), lines)
    }
}

/// The shipped flags with --hostname set and the state directory in the scratch root.
fn configured(shipped: &str, root: &Path) -> String {
    shipped
        .replace("--hostname= ", "--hostname=derp1.example.com ")
        .replace(
            "/var/lib/derpd",
            &root.join("var/lib/derpd").display().to_string(),
        )
}

fn has(log: &[String], line: &str) -> bool {
    log.iter().any(|l| l == line)
}

fn starts(log: &[String]) -> Vec<&String> {
    log.iter()
        .filter(|l| l.starts_with("systemctl --no-block"))
        .collect()
}

#[test]
fn the_postinst_starts_a_first_install_only_when_its_flags_pass_check() {
    // As shipped: the user, the state directory and the enablement, but no start, and
    // the operator is told what to edit.
    let s = Scripts::new(true, |shipped, _| shipped.to_owned());
    let (ok, out, log) = s.run("postinst", &["configure"], 0);
    assert!(ok, "{out}");
    assert!(s.user_exists(), "{log:?}");
    assert!(
        log.iter()
            .any(|l| l.starts_with("useradd --system --user-group --home-dir /var/lib/derpd")),
        "{log:?}"
    );
    let state = s.root.join("var/lib/derpd");
    let mode = std::fs::metadata(&state)
        .expect("state dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    assert!(
        has(&log, &format!("chown derpd:derpd {}", state.display())),
        "{log:?}"
    );
    assert!(
        has(&log, "deb-systemd-helper enable derpd.service"),
        "{log:?}"
    );
    assert!(has(&log, "systemctl --system daemon-reload"), "{log:?}");
    assert!(
        log.iter()
            .any(|l| l.starts_with("runuser -u derpd -- sh -c")),
        "{log:?}"
    );
    assert!(starts(&log).is_empty(), "{log:?}");
    assert!(out.contains("ERROR tls       --hostname \"\""), "{out}");
    assert!(out.contains("enabled but not started"), "{out}");
    assert!(out.contains("/etc/default/derpd"), "{out}");

    // Configured: started, without waiting for readiness.
    let s = Scripts::new(true, configured);
    let (ok, out, log) = s.run("postinst", &["configure"], 0);
    assert!(ok, "{out}");
    assert!(has(&log, "policy-rc.d derpd.service start"), "{log:?}");
    assert_eq!(starts(&log), ["systemctl --no-block start derpd.service"]);
    assert!(out.contains("derpd: started"), "{out}");

    // Configured, but policy-rc.d forbids starting services (a chroot, an image build).
    let s = Scripts::new(true, configured);
    let (ok, out, log) = s.run("postinst", &["configure"], 101);
    assert!(ok, "{out}");
    assert!(starts(&log).is_empty(), "{log:?}");

    // Without systemd running: enabled for when it does, nothing started.
    let s = Scripts::new(false, configured);
    let (ok, out, log) = s.run("postinst", &["configure"], 0);
    assert!(ok, "{out}");
    assert!(
        has(&log, "deb-systemd-helper enable derpd.service"),
        "{log:?}"
    );
    assert!(!log.iter().any(|l| l.starts_with("systemctl")), "{log:?}");
}

#[test]
fn the_postinst_makes_the_user_in_a_derpd_group_left_without_one() {
    let s = Scripts::new(true, |shipped, _| shipped.to_owned());
    std::fs::write(s.dir.0.join("state/group"), "").expect("group");
    let (ok, out, log) = s.run("postinst", &["configure"], 0);
    assert!(ok, "{out}\n{log:?}");
    assert!(s.user_exists() && s.group_exists(), "{log:?}");
    assert!(
        log.iter()
            .any(|l| l.starts_with("useradd --system --gid derpd --home-dir /var/lib/derpd")),
        "{log:?}"
    );
    // Run again (a reconfigure): the user is there, nothing is added.
    let (ok, out, log) = s.run("postinst", &["configure"], 0);
    assert!(ok, "{out}");
    assert!(!log.iter().any(|l| l.starts_with("useradd")), "{log:?}");
}

#[test]
fn an_upgrade_reloads_a_running_derpd_and_a_purge_removes_its_state_but_not_its_user() {
    let s = Scripts::new(true, |shipped, _| shipped.to_owned());
    s.run("postinst", &["configure"], 0);
    assert!(s.user_exists());
    let state = s.root.join("var/lib/derpd");
    std::fs::write(state.join("derper.key"), "{}").expect("key");

    // An upgrade: the operator's enablement kept, no check (the node was configured once),
    // a running derpd reloaded (an upgrade in place: its connections go across), a stopped
    // one left.
    let (ok, out, log) = s.run("postinst", &["configure", "0.0.9"], 0);
    assert!(ok, "{out}");
    assert!(!log.iter().any(|l| l.starts_with("useradd")), "{log:?}");
    assert!(
        has(&log, "deb-systemd-helper update-state derpd.service"),
        "{log:?}"
    );
    assert!(!log.iter().any(|l| l.starts_with("runuser")), "{log:?}");
    assert_eq!(
        starts(&log),
        ["systemctl --no-block try-reload-or-restart derpd.service"]
    );

    // prerm: an upgrade leaves derpd running, a removal stops it.
    let (ok, _, log) = s.run("prerm", &["upgrade", "0.2.0"], 0);
    assert!(ok && log.is_empty(), "{log:?}");
    let (ok, _, log) = s.run("prerm", &["remove"], 0);
    assert!(ok, "{log:?}");
    assert_eq!(log, ["deb-systemd-invoke stop derpd.service"]);

    // Removal keeps the state and the user; purge deletes the state, and keeps the user.
    let (ok, _, log) = s.run("postrm", &["remove"], 0);
    assert!(ok, "{log:?}");
    assert!(state.join("derper.key").exists());
    assert!(s.user_exists());
    let (ok, out, log) = s.run("postrm", &["purge"], 0);
    assert!(ok, "{out}");
    assert!(!state.exists(), "the state directory survived the purge");
    assert!(s.user_exists() && s.group_exists(), "{log:?}");
    assert!(
        has(&log, "deb-systemd-helper purge derpd.service"),
        "{log:?}"
    );
    assert!(
        !log.iter()
            .any(|l| l.starts_with("userdel") || l.starts_with("groupdel")),
        "{log:?}"
    );
}
