//! The server key file, in derper's format: `{"PrivateKey":"privkey:<hex>"}`.

use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::Context;
use derp_proto::SecretKey;

/// Loads the key at `path`, creating the file with a fresh key when it does not exist.
///
/// A file that exists but cannot be read or parsed is an error and is never overwritten: the
/// key is the server's identity, and replacing it would silently break every client's pin.
pub(crate) fn load_or_create(path: &Path) -> anyhow::Result<SecretKey> {
    match fs::read(path) {
        Ok(bytes) => parse(&bytes).with_context(|| format!("config file {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = SecretKey::generate(&mut rand::rngs::OsRng);
            write_new(path, &key)
                .with_context(|| format!("creating config file {}", path.display()))?;
            tracing::info!(path = %path.display(), "created new server key");
            Ok(key)
        }
        Err(e) => Err(e).with_context(|| format!("reading config file {}", path.display())),
    }
}

/// Parsing lives in derp-proto ([`SecretKey::from_key_file`]) so the fuzzers can reach it.
fn parse(bytes: &[u8]) -> anyhow::Result<SecretKey> {
    Ok(SecretKey::from_key_file(bytes)?)
}

/// Writes the file atomically, mode 0600, tab-indented as derper writes it.
fn write_new(path: &Path, key: &SecretKey) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)?;
    }
    let contents = key.to_key_file();
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let result = (|| {
        let mut f = opts.open(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
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
    fn bad_files_are_errors() {
        assert!(parse(b"not json").is_err());
        assert!(parse(b"{}").is_err());
        assert!(parse(b"{\"PrivateKey\":\"nodekey:00\"}").is_err());
    }
}
