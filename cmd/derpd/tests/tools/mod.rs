//! Finding the external programs some tests run. `scripts/test-tools install` puts them in
//! the repository's `.test-tools` (promtool, and a virtualenv with the PyPI ones) or installs
//! Debian packages; a test whose tool is missing fails with the line that installs it, so it
//! can never pass without having run.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

const INSTALL: &str = "run `scripts/test-tools install` (scripts/test does it when it can)";

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// A program from a Debian package, on PATH.
pub fn debian(name: &str, package: &str) -> PathBuf {
    on_path(name).unwrap_or_else(|| {
        panic!(
            "{name} is not installed: `apt-get install --no-install-recommends {package}`, or \
             {INSTALL}"
        )
    })
}

/// promtool: extracted into .test-tools/bin, or Debian's prometheus package on PATH.
pub fn promtool() -> PathBuf {
    let local = repo().join(".test-tools/bin/promtool");
    if local.is_file() {
        return local;
    }
    on_path("promtool").unwrap_or_else(|| {
        panic!("promtool is not installed (Debian package prometheus): {INSTALL}")
    })
}

/// A program of the pinned PyPI packages (scripts/test-tools.txt), only from the virtualenv:
/// a copy elsewhere on PATH may be another version.
pub fn venv(name: &str) -> PathBuf {
    let dir = repo().join(".test-tools/venv");
    let path = dir.join("bin").join(name);
    let current = std::fs::read(repo().join("scripts/test-tools.txt")).ok()
        == std::fs::read(dir.join("requirements.txt")).ok();
    if path.is_file() && current {
        return path;
    }
    panic!(
        "{name} is not installed in .test-tools/venv, or the virtualenv is older than \
         scripts/test-tools.txt: {INSTALL}"
    )
}

/// derp-bench, built beside this derpd: Cargo hands a package's tests the path of its own
/// binaries only, so a test that runs both programs finds derp-bench in the same target
/// directory. `cargo test --workspace` (scripts/test) builds it; `cargo test -p derpd` alone
/// does not, and a stale copy from an earlier build would test old code.
pub fn derp_bench() -> PathBuf {
    let path = Path::new(crate::support::DERPD).with_file_name("derp-bench");
    if path.is_file() {
        return path;
    }
    panic!(
        "no derp-bench at {}: build it with the same profile (`cargo build -p derp-bench`), or \
         run the workspace's tests",
        path.display()
    )
}
