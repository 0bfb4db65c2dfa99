//! The temporary files a file is written through: `<file>.tmp<pid>` beside it, named after
//! the writing process so that writers never share one, and the sweep that removes those
//! left behind by processes killed mid-write. Used for the certificate files and ACME cache
//! here, and by derpd for its key file.

use std::path::{Path, PathBuf};

/// The temporary file a process with id `pid` writes `path` through.
pub fn temp_path(path: &Path, pid: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp{pid}"));
    PathBuf::from(name)
}

/// Removes the temporary files of `path` ([`temp_path`]) whose process is gone. Those of
/// running processes, this one included, are left alone. Best effort: a file that cannot be
/// listed or removed is left where it is.
pub fn remove_stale_temps(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}.tmp", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_temporary_files_of_processes_that_are_gone_are_removed() {
        let dir = std::env::temp_dir().join(format!("derp-tls-temp-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("derper.key");
        let dead = temp_path(&path, u32::MAX - 1);
        let this = temp_path(&path, std::process::id());
        // A running process other than this one: the parent, which outlives the test.
        let other = temp_path(&path, std::os::unix::process::parent_id());
        // Not temporary files of `path`: another file's, and names that only look alike.
        let unrelated = [
            temp_path(&dir.join("derper.key2"), u32::MAX - 1),
            dir.join("derper.key.tmp"),
            dir.join("derper.key.tmpx1"),
            path.clone(),
        ];
        for f in [&dead, &this, &other].into_iter().chain(&unrelated) {
            std::fs::write(f, "x").unwrap();
        }
        assert_eq!(dead, dir.join(format!("derper.key.tmp{}", u32::MAX - 1)));

        remove_stale_temps(&path);
        assert!(!dead.exists());
        let mut left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        left.sort();
        let mut expected: Vec<_> = [this, other].into_iter().chain(unrelated).collect();
        expected.sort();
        assert_eq!(left, expected);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
