//! derper's flags for Tailscale's own infrastructure: accepted, so a derper command line
//! still parses, and each answered with what derpd does instead.
//!
//! - `-secrets-url`: derper fetches the mesh key from a setec server. derpd refuses to start
//!   with it (outside `-dev`, where derper ignores it too): starting without the region's
//!   mesh key would silently split the region, so the operator writes the key to a file and
//!   passes `-mesh-psk-file`.
//! - `-secrets-path-prefix`, `-secrets-cache-dir`: only used with `-secrets-url`; ignored
//!   (wrappers pass their defaults).
//! - `-ace`: derper's experimental embedded CONNECT proxy to Tailscale's control plane.
//!   `-ace=false` is accepted; `-ace` (true) is refused, since clients told to use a proxy
//!   that is not there would fail without a word.

use std::path::PathBuf;

use clap::Args;

use crate::goflags::{GoKind, GoKinds};

/// The flags, flattened into the main command line.
#[derive(Debug, Args)]
#[command(next_help_heading = "derper flags for Tailscale's own infrastructure (not served)")]
pub(crate) struct CompatArgs {
    /// derper fetches the mesh key from this setec server. derpd refuses to start with it
    /// (except with --dev, which ignores it): write the key to a file for --mesh-psk-file.
    #[arg(long, default_value = "")]
    pub(crate) secrets_url: String,

    /// derper's setec path prefix for the mesh key ("prod/derp"). Ignored.
    #[arg(long)]
    pub(crate) secrets_path_prefix: Option<String>,

    /// derper's setec cache directory. Ignored.
    #[arg(long, value_parser = crate::goflags::go_path())]
    pub(crate) secrets_cache_dir: Option<PathBuf>,

    /// derper's experimental embedded ACE (CONNECT) proxy. derpd has none: only
    /// --ace=false is accepted.
    #[arg(long)]
    pub(crate) ace: bool,
}

/// The Go kind of each flag above ([`crate::goflags::GoKind`]), in their order.
pub(crate) const GO_KINDS: &GoKinds = &[
    ("secrets-url", GoKind::String),
    ("secrets-path-prefix", GoKind::String),
    ("secrets-cache-dir", GoKind::String),
    ("ace", GoKind::Bool),
];

impl CompatArgs {
    /// What stops a start: each a line naming the flag and what to do instead.
    pub(crate) fn errors(&self, dev: bool) -> Vec<String> {
        let mut errors = Vec::new();
        if !self.secrets_url.is_empty() && !dev {
            errors.push(
                "-secrets-url: derpd does not fetch the mesh key from a setec server; write \
                 the key (64 hex digits) to a file and pass -mesh-psk-file instead"
                    .to_owned(),
            );
        }
        if self.ace {
            errors.push(
                "-ace: derpd has no embedded ACE (CONNECT) proxy; remove the flag (or pass \
                 -ace=false)"
                    .to_owned(),
            );
        }
        errors
    }

    /// What is accepted and ignored, to be logged.
    pub(crate) fn ignored(&self, dev: bool) -> Vec<String> {
        let mut notes = Vec::new();
        if !self.secrets_url.is_empty() && dev {
            notes.push(
                "-secrets-url is ignored in -dev mode (as derper does): the mesh key comes \
                 from TAILSCALE_DERPER_MESH_KEY"
                    .to_owned(),
            );
        }
        let mut unused = Vec::new();
        if self.secrets_path_prefix.is_some() {
            unused.push("-secrets-path-prefix");
        }
        if self.secrets_cache_dir.is_some() {
            unused.push("-secrets-cache-dir");
        }
        if !unused.is_empty() {
            notes.push(format!(
                "{} ignored: derpd reads the mesh key from -mesh-psk-file",
                unused.join(" and ")
            ));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use crate::cli::try_parse_from;

    #[test]
    fn setec_and_ace_are_refused_with_the_alternative_or_ignored() {
        let cli = try_parse_from([
            "derpd",
            "-secrets-url=https://setec.example",
            "-secrets-path-prefix",
            "prod/derp",
            "-secrets-cache-dir=/var/cache/derper-secrets",
            "-ace",
        ])
        .expect("parses");
        let errors = cli.compat.errors(false);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].contains("-mesh-psk-file"), "{errors:?}");
        assert!(errors[1].starts_with("-ace:"), "{errors:?}");
        // In -dev, derper ignores -secrets-url: so does derpd, and says so.
        assert_eq!(cli.compat.errors(true).len(), 1);
        let notes = cli.compat.ignored(true);
        assert_eq!(notes.len(), 2, "{notes:?}");

        let cli = try_parse_from(["derpd", "-ace=false", "-secrets-path-prefix=x"]).expect("ok");
        assert!(cli.compat.errors(false).is_empty());
        assert_eq!(
            cli.compat.ignored(false),
            ["-secrets-path-prefix ignored: derpd reads the mesh key from -mesh-psk-file"]
        );
    }
}
