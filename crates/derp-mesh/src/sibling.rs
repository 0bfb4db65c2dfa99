//! The siblings a node meshes with, as `--mesh-with` names them.
//!
//! An entry means what it means to derper: `host` is dialed as `https://host/derp`;
//! `host/dialhost` connects to `dialhost` instead (on the URL's port) while `host` stays the
//! URL's host, the TLS server name and the name the certificate must carry. An entry may also
//! be a full `http://` or `https://` URL, for plain-HTTP meshes on private networks and for
//! tests.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use derp_client::{Scheme, ServerUrl, UrlError};

/// One sibling node of the region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sibling {
    /// The entry as the operator wrote it; the `sibling` label of the mesh metrics.
    pub label: String,
    /// The URL dialed (its host is also the TLS name).
    pub url: ServerUrl,
    /// Where to connect instead of resolving the URL's host.
    pub dial: Option<DialHost>,
}

/// The `dialhost` half of a `host/dialhost` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DialHost {
    /// An address to connect to as is.
    Addr(SocketAddr),
    /// A name resolved at every connection attempt, with the port to use.
    Name(String, u16),
}

impl DialHost {
    /// Resolves to the address to connect to; names are looked up now, so a sibling whose
    /// address changes is found again on the next reconnect.
    pub async fn resolve(&self) -> std::io::Result<SocketAddr> {
        match self {
            Self::Addr(a) => Ok(*a),
            Self::Name(name, port) => tokio::net::lookup_host((name.as_str(), *port))
                .await?
                .next()
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("{name} resolves to no address"),
                    )
                }),
        }
    }
}

impl fmt::Display for Sibling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

/// Why a `--mesh-with` entry was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SiblingError {
    /// The entry, or the `https://host/derp` URL its host makes, is not a DERP URL.
    #[error("mesh entry {entry:?}: {source}")]
    Url {
        /// The entry as written.
        entry: String,
        /// Why the URL was refused.
        source: UrlError,
    },
    /// The entry is a URL of a scheme meshes do not use (ws://, wss://).
    #[error("mesh entry {entry:?}: mesh URLs must be http://, https:// or quic://")]
    Scheme {
        /// The entry as written.
        entry: String,
    },
    /// The `dialhost` of a `host/dialhost` entry is not usable.
    #[error("mesh entry {entry:?}: {source}")]
    DialHost {
        /// The entry as written.
        entry: String,
        /// What is wrong with the dial host.
        source: DialHostError,
    },
}

/// Why the `dialhost` of a `host/dialhost` entry was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DialHostError {
    /// Nothing follows the '/'.
    #[error("empty dial host after '/'")]
    Empty,
    /// The port is not a number in 1..=65535.
    #[error("bad port in dial host {0:?}")]
    Port(String),
    /// The host is neither an IP address nor a host name.
    #[error("dial host {0:?} is not a name or address")]
    NotANameOrAddress(String),
}

/// Parses a comma-separated `--mesh-with` list. Every entry is dialed, the node's own
/// included (derper's lists name every node of the region on every node): a link that finds
/// the node's own key answering stops for good. Unlike derper, surrounding spaces are trimmed
/// and empty entries ignored (derper would dial `https:///derp`, port 443 of no host,
/// forever).
pub fn parse_mesh_with(list: &str) -> Result<Vec<Sibling>, SiblingError> {
    list.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(parse_entry)
        .collect()
}

fn parse_entry(entry: &str) -> Result<Sibling, SiblingError> {
    let bad_url = |source| SiblingError::Url {
        entry: entry.to_owned(),
        source,
    };
    if entry.contains("://") {
        let url: ServerUrl = entry.parse().map_err(bad_url)?;
        if !matches!(url.scheme(), Scheme::Http | Scheme::Https | Scheme::Quic) {
            return Err(SiblingError::Scheme {
                entry: entry.to_owned(),
            });
        }
        return Ok(Sibling {
            label: entry.to_owned(),
            url,
            dial: None,
        });
    }
    let (host, dial) = match entry.split_once('/') {
        Some((host, dial)) => (host, Some(dial)),
        None => (entry, None),
    };
    let url: ServerUrl = format!("https://{host}/derp").parse().map_err(bad_url)?;
    let dial = dial
        .map(|d| parse_dial_host(d, url.port()))
        .transpose()
        .map_err(|source| SiblingError::DialHost {
            entry: entry.to_owned(),
            source,
        })?;
    Ok(Sibling {
        label: entry.to_owned(),
        url,
        dial,
    })
}

/// `dialhost`: an IP, `ip:port`, `[v6]:port`, a name or `name:port`. Without a port the
/// URL's is used, as derper's dialer keeps the port of the address it was asked for.
fn parse_dial_host(s: &str, default_port: u16) -> Result<DialHost, DialHostError> {
    if s.is_empty() {
        return Err(DialHostError::Empty);
    }
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(DialHost::Addr(addr));
    }
    let unbracketed = s
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(s);
    if let Ok(ip) = unbracketed.parse::<IpAddr>() {
        return Ok(DialHost::Addr(SocketAddr::new(ip, default_port)));
    }
    let (name, port) = match s.rsplit_once(':') {
        Some((name, port)) => {
            let port = port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| DialHostError::Port(s.to_owned()))?;
            (name, port)
        }
        None => (s, default_port),
    };
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if !valid {
        return Err(DialHostError::NotANameOrAddress(s.to_owned()));
    }
    Ok(DialHost::Name(name.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_mean_what_they_mean_to_derper() {
        let list = " derp1.example.com, derp2.example.com/10.0.0.2 ,,derp3.example.com:8443/derp3-internal,http://127.0.0.1:3340/derp,https://[::1]:8443,quic://derp4.example.com:443";
        let s = parse_mesh_with(list).expect("parses");
        assert_eq!(s.len(), 6);
        assert_eq!(s[0].url.to_string(), "https://derp1.example.com/derp");
        assert_eq!(s[0].dial, None);
        assert_eq!(s[0].label, "derp1.example.com");
        assert_eq!(s[1].url.host(), "derp2.example.com");
        assert_eq!(
            s[1].dial,
            Some(DialHost::Addr("10.0.0.2:443".parse().expect("addr")))
        );
        assert_eq!(s[2].url.port(), 8443);
        assert_eq!(
            s[2].dial,
            Some(DialHost::Name("derp3-internal".into(), 8443))
        );
        assert_eq!(s[3].url.scheme(), Scheme::Http);
        assert_eq!(s[3].url.port(), 3340);
        assert_eq!(s[4].url.host(), "::1");
        assert_eq!(s[4].url.path(), "/derp");
        assert_eq!(s[5].url.scheme(), Scheme::Quic);
        assert_eq!(s[5].url.host(), "derp4.example.com");
    }

    #[test]
    fn no_entry_is_skipped_by_name() {
        // A region's list, the same on each of its nodes: each node dials every entry and
        // tells itself apart by the key that answers, as derper does.
        let s =
            parse_mesh_with("localhost:8443,localhost:8444/127.0.0.1,c.example").expect("parses");
        let labels: Vec<_> = s.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            ["localhost:8443", "localhost:8444/127.0.0.1", "c.example"]
        );
    }

    #[test]
    fn dial_hosts_take_ports_and_v6() {
        assert_eq!(
            parse_dial_host("[fd00::2]:7000", 443),
            Ok(DialHost::Addr("[fd00::2]:7000".parse().expect("addr")))
        );
        assert_eq!(
            parse_dial_host("fd00::2", 443),
            Ok(DialHost::Addr("[fd00::2]:443".parse().expect("addr")))
        );
        assert_eq!(
            parse_dial_host("internal:99", 443),
            Ok(DialHost::Name("internal".into(), 99))
        );
    }

    #[test]
    fn bad_entries_are_refused_with_what_is_wrong() {
        let url = |entry: &str, source| SiblingError::Url {
            entry: entry.into(),
            source,
        };
        let dial = |entry: &str, source| SiblingError::DialHost {
            entry: entry.into(),
            source,
        };
        for (bad, want) in [
            (
                "ws://h/derp",
                SiblingError::Scheme {
                    entry: "ws://h/derp".into(),
                },
            ),
            ("ftp://h", url("ftp://h", UrlError::UnsupportedScheme)),
            ("h/", dial("h/", DialHostError::Empty)),
            (
                "h/bad name",
                dial(
                    "h/bad name",
                    DialHostError::NotANameOrAddress("bad name".into()),
                ),
            ),
            ("h/x:0", dial("h/x:0", DialHostError::Port("x:0".into()))),
            (
                "h/x:port",
                dial("h/x:port", DialHostError::Port("x:port".into())),
            ),
            ("bad host", url("bad host", UrlError::InvalidHost)),
            ("h:99999", url("h:99999", UrlError::InvalidPort)),
        ] {
            assert_eq!(parse_mesh_with(bad), Err(want), "{bad}");
        }
        assert_eq!(parse_mesh_with(" , ,"), Ok(Vec::new()));
    }

    #[test]
    fn a_url_that_does_not_parse_keeps_the_parse_error_as_its_source() {
        let err = parse_mesh_with("https://h:0/derp").expect_err("port 0");
        let source = std::error::Error::source(&err).expect("a source");
        assert_eq!(
            source.downcast_ref::<UrlError>(),
            Some(&UrlError::InvalidPort)
        );
        assert_eq!(
            err.to_string(),
            "mesh entry \"https://h:0/derp\": url port is not valid"
        );
    }
}
