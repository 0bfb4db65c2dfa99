//! The path an upgrade starts: decided at start-up, while the file at that path is still the
//! one running.

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The file this process was started from, found at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Executable {
    pub(crate) path: PathBuf,
    /// How it was found, for the log and `--check`.
    pub(crate) source: &'static str,
}

/// The path to start an upgrade from, decided once at start-up (before the file can have
/// been replaced, and with the start-up directory and `PATH`).
///
/// `argv[0]`, made absolute against the working directory or found in `PATH` as the shell
/// found it, is the path the operator or the service manager ran. It is used as it is, its
/// symbolic links not resolved, so that a link switched to another version
/// (`/usr/local/bin/derpd -> /opt/derpd-1.3/derpd`) starts the version it now points to;
/// and because a package upgrade replaces the file at that path, starting the path starts
/// the new file. It is trusted only if it names the very file running now (same device and
/// inode as `/proc/self/exe` at start-up): `argv[0]` is whatever the parent wrote there.
/// Otherwise the target of `/proc/self/exe` is the path, without the " (deleted)" the kernel
/// appends once the file has been replaced; that target has every link resolved.
pub(crate) fn executable() -> anyhow::Result<Executable> {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let cwd = std::env::current_dir().ok();
    let path_var = std::env::var_os("PATH");
    let named = resolve_argv0(&argv0, cwd.as_deref(), path_var.as_deref(), is_executable);
    let running = std::fs::metadata("/proc/self/exe").ok();
    if let (Some(path), Some(running)) = (&named, &running)
        && let Ok(m) = std::fs::metadata(path)
        && m.dev() == running.dev()
        && m.ino() == running.ino()
    {
        return Ok(Executable {
            path: path.clone(),
            source: "argv[0]",
        });
    }
    let link = std::fs::read_link("/proc/self/exe")
        .context("neither argv[0] nor /proc/self/exe names the running binary")?;
    Ok(Executable {
        path: strip_deleted(link),
        source: "/proc/self/exe",
    })
}

/// `argv[0]` as an absolute path: with a slash, against `cwd`; without, the first
/// executable file of that name in `path_var`'s directories.
fn resolve_argv0(
    argv0: &OsStr,
    cwd: Option<&Path>,
    path_var: Option<&OsStr>,
    is_executable: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    if argv0.is_empty() {
        return None;
    }
    // `.` components go (the kernel resolves the path the same way without them); `..` stay,
    // as they may cross a symbolic link.
    let absolute = |p: PathBuf| match cwd {
        _ if p.is_absolute() => Some(p.components().collect()),
        Some(cwd) => Some(cwd.join(p).components().collect()),
        None => None,
    };
    if argv0.as_bytes().contains(&b'/') {
        return absolute(PathBuf::from(argv0));
    }
    std::env::split_paths(path_var?)
        .map(|dir| {
            // An empty entry is the working directory, as for the shell.
            if dir.as_os_str().is_empty() {
                PathBuf::from(".").join(argv0)
            } else {
                dir.join(argv0)
            }
        })
        .find(|p| is_executable(p))
        .and_then(absolute)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `/proc/self/exe`'s target without the kernel's mark of a replaced file.
fn strip_deleted(link: PathBuf) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    match link.as_os_str().as_bytes().strip_suffix(b" (deleted)") {
        Some(path) => PathBuf::from(OsStr::from_bytes(path)),
        None => link,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv0_is_made_absolute_as_the_shell_found_it() {
        let cwd = Path::new("/srv");
        let path = OsStr::new("/usr/local/bin:/usr/bin");
        let only = |want: &'static str| move |p: &Path| p == Path::new(want);
        let r = |a: &str, f: &dyn Fn(&Path) -> bool| {
            resolve_argv0(OsStr::new(a), Some(cwd), Some(path), f)
        };
        assert_eq!(
            r("/usr/bin/derpd", &only("none")),
            Some(PathBuf::from("/usr/bin/derpd"))
        );
        assert_eq!(
            r("bin/derpd", &only("none")),
            Some(PathBuf::from("/srv/bin/derpd"))
        );
        assert_eq!(
            r("./derpd", &only("none")),
            Some(PathBuf::from("/srv/derpd"))
        );
        assert_eq!(
            r("../bin/derpd", &only("none")),
            Some(PathBuf::from("/srv/../bin/derpd"))
        );
        assert_eq!(
            r("derpd", &only("/usr/bin/derpd")),
            Some(PathBuf::from("/usr/bin/derpd"))
        );
        assert_eq!(
            r("derpd", &only("/usr/local/bin/derpd")),
            Some(PathBuf::from("/usr/local/bin/derpd"))
        );
        assert_eq!(r("derpd", &only("/opt/derpd")), None);
        assert_eq!(r("", &only("/usr/bin/derpd")), None);
        // An empty PATH entry is the working directory.
        assert_eq!(
            resolve_argv0(
                OsStr::new("derpd"),
                Some(cwd),
                Some(OsStr::new(":/usr/bin")),
                |p: &Path| p == Path::new("./derpd")
            ),
            Some(PathBuf::from("/srv/derpd"))
        );
    }

    #[test]
    fn a_replaced_files_mark_is_stripped() {
        assert_eq!(
            strip_deleted(PathBuf::from("/usr/bin/derpd (deleted)")),
            PathBuf::from("/usr/bin/derpd")
        );
        assert_eq!(
            strip_deleted(PathBuf::from("/usr/bin/derpd")),
            PathBuf::from("/usr/bin/derpd")
        );
    }

    #[test]
    fn the_running_test_binary_is_found() {
        let exe = executable().expect("found");
        let running = std::fs::metadata("/proc/self/exe").expect("exe");
        let found = std::fs::metadata(&exe.path).expect("path");
        assert_eq!((found.dev(), found.ino()), (running.dev(), running.ino()));
    }
}
