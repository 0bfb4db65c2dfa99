//! The server key file, in derper's format: `{"PrivateKey":"privkey:<hex>"}`.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use derp_proto::SecretKey;
use derp_tls::{remove_stale_temps, temp_path};

/// Loads the key at `path`, creating the file with a fresh key when it does not exist.
///
/// A file that exists but cannot be read or parsed is an error and is never overwritten: the
/// key is the server's identity, and replacing it would silently break every client's pin.
pub(crate) fn load_or_create(path: &Path) -> anyhow::Result<SecretKey> {
    // Left by starts killed while writing a new key; best effort, the key does not depend on it.
    remove_stale_temps(path);
    match fs::read(path) {
        Ok(bytes) => parse(&bytes).with_context(|| format!("config file {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = SecretKey::generate(&mut rand::rngs::OsRng);
            let created = write_new(path, &key)
                .with_context(|| format!("creating config file {}", path.display()))?;
            if created {
                tracing::info!(path = %path.display(), "created new server key");
                return Ok(key);
            }
            // Another process created the file while this one was writing; its key wins.
            let bytes = fs::read(path)
                .with_context(|| format!("reading config file {}", path.display()))?;
            parse(&bytes).with_context(|| format!("config file {}", path.display()))
        }
        Err(e) => Err(e).with_context(|| format!("reading config file {}", path.display())),
    }
}

/// Parsing lives in derp-proto ([`SecretKey::from_key_file`]) so the fuzzers can reach it.
fn parse(bytes: &[u8]) -> anyhow::Result<SecretKey> {
    Ok(SecretKey::from_key_file(bytes)?)
}

/// Writes a new key file, mode 0600, tab-indented as derper writes it. Returns false, having
/// written nothing, when a file appeared at `path` meanwhile.
///
/// The key goes to a temporary file that is synced and then hard-linked into place: a link
/// never replaces an existing file (unlike a rename), so a key file is never overwritten even
/// by a racing start, and a crash at any point leaves either no key file or a complete one.
fn write_new(path: &Path, key: &SecretKey) -> anyhow::Result<bool> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        fs::create_dir_all(dir)?;
    }
    let contents = key.to_key_file();
    let tmp = temp_path(path, std::process::id());
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let result = (|| {
        let mut f = opts.open(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        drop(f);
        let linked = match fs::hard_link(&tmp, path) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(e),
        };
        // Make the new name durable, so a power loss cannot lose a key clients already pin.
        if let Some(dir) = dir {
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(linked)
    })();
    let _ = fs::remove_file(&tmp);
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIV: &str = "privkey:1050eb254dc4ff1e762df3c9944e7960f36440775958a35cea4eb88b130ee34c";

    #[test]
    fn both_derper_forms_load() {
        let compact = format!("{{\"PrivateKey\":\"{PRIV}\"}}");
        let indented = format!("{{\n\t\"PrivateKey\": \"{PRIV}\"\n}}");
        for form in [compact, indented] {
            let key = parse(form.as_bytes()).expect("loads");
            assert_eq!(key.to_text(), PRIV);
        }
    }

    #[test]
    fn an_existing_key_file_is_never_replaced() {
        let dir = std::env::temp_dir().join(format!("derpd-keyfile-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("derper.key");
        let first = SecretKey::from_bytes([1; 32]);
        assert!(write_new(&path, &first).unwrap());
        // A second writer (a racing start) finds the file and leaves it alone.
        assert!(!write_new(&path, &SecretKey::from_bytes([2; 32])).unwrap());
        assert_eq!(load_or_create(&path).unwrap().to_bytes(), first.to_bytes());
        // Neither writer left its temporary file behind.
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["derper.key"]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_files_are_errors() {
        assert!(parse(b"not json").is_err());
        assert!(parse(b"{}").is_err());
        assert!(parse(b"{\"PrivateKey\":\"nodekey:00\"}").is_err());
    }
}
