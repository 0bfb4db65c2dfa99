//! Replays every committed corpus file and every regression input through its target, without
//! a fuzzer, so anything a fuzzer once found stays fixed.
//!
//! Layout: `corpus/<target>/*` (seeds) and `regressions/<target>/*` (inputs that once crashed
//! a target; copy them there from `artifacts/<target>/`). Every target must have seeds, there
//! must be regression inputs, and every directory must name a target.

use std::fs;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

fn replay_dir(kind: &str, required: bool) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind);
    let mut failures = Vec::new();
    let mut count = 0;
    if let Ok(entries) = fs::read_dir(&root) {
        for entry in entries {
            let dir = entry.expect("dir entry").path();
            let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            assert!(
                derp_fuzz::target(name).is_some(),
                "{} names no fuzz target",
                dir.display()
            );
        }
    }
    for (name, target) in derp_fuzz::TARGETS {
        let dir = root.join(name);
        let mut files: Vec<_> = match fs::read_dir(&dir) {
            Ok(entries) => entries.map(|e| e.expect("dir entry").path()).collect(),
            Err(_) if !required => continue,
            Err(e) => panic!("{}: {e}", dir.display()),
        };
        files.sort();
        assert!(!required || !files.is_empty(), "{} is empty", dir.display());
        for file in files {
            let data = fs::read(&file).expect("read input");
            count += 1;
            if catch_unwind(AssertUnwindSafe(|| target(&data))).is_err() {
                failures.push(file.display().to_string());
            }
        }
    }
    assert!(failures.is_empty(), "inputs that fail: {failures:#?}");
    count
}

#[test]
fn corpus_replays_clean() {
    let n = replay_dir("corpus", true);
    assert!(n >= derp_fuzz::TARGETS.len());
}

#[test]
fn regressions_replay_clean() {
    // Not every target has regressions, but the suite has some: none found means the
    // directory moved or was emptied, and the replay would pass having replayed nothing.
    let n = replay_dir("regressions", false);
    assert!(n >= 1, "no regression inputs under regressions/");
}
