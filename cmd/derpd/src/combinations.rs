//! Flags that mean something only beside another setting: the certificate mode, TLS, DERP
//! over QUIC, the mesh links, trusted HTTP proxies. Every combination in which a flag cannot
//! act is found here, in one place, which the start and `--check` both run before anything
//! branches on those settings.
//!
//! Such a combination is refused when derper refuses it, or when the flag is derpd's own (no
//! derper command line carries it, and an operator who wrote it expects it to act). derper's
//! own flags that derper takes and then ignores in that combination (`-hostname` on a
//! plain-HTTP node behind a proxy, `-acme-email` with manual certificates) are only named as
//! ignored, so that a derper command line still starts.

use crate::cli::Cli;
use crate::tls_setup::{AcmeChallenge, CertMode, hostname_is_ip};

/// What [`review`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Review {
    /// Combinations that stop a start, each naming its flags and why.
    pub(crate) errors: Vec<String>,
    /// derper's flags that have nothing to act on here, each saying why.
    pub(crate) ignored: Vec<String>,
}

// The flags that act only with TLS, manual certificates, ACME, QUIC or mesh links, by clap's
// id: derpd's own, refused where they cannot act, and derper's, ignored there as derper
// ignores them.
const TLS_OWN: &[&str] = &[
    "acme_directory",
    "acme_ca_cert",
    "acme_challenge",
    "cert_reload_interval",
    "tls_records",
];
const TLS_DERPERS: &[&str] = &[
    "certmode",
    "certdir",
    "hostname",
    "http_port",
    "acme_email",
    "acme_eab_kid",
    "acme_eab_key",
    "acme_ip_certs",
];
const ACME_OWN: &[&str] = &["acme_directory", "acme_ca_cert", "acme_challenge"];
const ACME_DERPERS: &[&str] = &["acme_email", "acme_eab_kid", "acme_eab_key"];
const MANUAL_OWN: &[&str] = &["cert_reload_interval"];
const QUIC_OWN: &[&str] = &["quic_congestion"];
const MESH_OWN: &[&str] = &["mesh_ca_file", "mesh_ping_interval"];
const FORWARDED_OWN: &[&str] = &["forwarded_header"];

/// Why TLS is off, as the messages say it.
const NO_TLS: &str = "the listener serves plain HTTP (TLS is served only when --addr's port \
                      is written 443 or https, or with --certmode manual)";

/// The combinations of `cli`'s flags, with the main listener serving TLS or not (`tls`) on
/// `listen_port`.
pub(crate) fn review(cli: &Cli, tls: bool, listen_port: u16) -> Review {
    let mut r = Review::default();
    if tls {
        match cli.tls.certmode {
            CertMode::Manual => manual(cli, &mut r),
            CertMode::Letsencrypt | CertMode::Gcp => acme(cli, &mut r),
        }
    } else {
        plain(cli, &mut r);
    }
    quic(cli, tls, listen_port, &mut r);
    mesh(cli, &mut r);
    forwarded(cli, &mut r);
    r
}

/// The flags among `ids` (clap's ids) given on the command line, as their flags' names.
fn given(cli: &Cli, ids: &[&str]) -> Vec<String> {
    ids.iter()
        .filter(|id| cli.given(id))
        .map(|id| format!("--{}", id.replace('_', "-")))
        .collect()
}

/// `--a`, `--a and --b`, `--a, --b and --c`.
fn names(flags: &[String]) -> String {
    match flags {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// "is" or "are", after [`names`].
fn is_are(flags: &[String]) -> &'static str {
    if flags.len() == 1 { "is" } else { "are" }
}

/// A plain-HTTP listener: nothing about certificates can act.
fn plain(cli: &Cli, r: &mut Review) {
    let own = given(cli, TLS_OWN);
    if !own.is_empty() {
        r.errors.push(format!(
            "{} {} for TLS, but {NO_TLS}",
            names(&own),
            is_are(&own)
        ));
    }
    if cli.quic_port.is_some_and(|p| p >= 0) {
        r.errors.push(
            "--quic-port needs TLS (QUIC always encrypts): listen on port 443 or use \
             --certmode manual, or leave QUIC off"
                .to_owned(),
        );
    }
    let derpers = given(cli, TLS_DERPERS);
    if !derpers.is_empty() {
        r.ignored.push(format!(
            "{} {} ignored, as in derper: {NO_TLS}",
            names(&derpers),
            is_are(&derpers)
        ));
    }
}

/// Certificates from files in --certdir: nothing is ordered from a CA.
fn manual(cli: &Cli, r: &mut Review) {
    if cli.acme_ip_certs {
        r.errors.push(
            "--acme-ip-certs requires --certmode=letsencrypt: --certmode manual serves only \
             the files in --certdir, so no certificate for the node's IP addresses would \
             ever come, and every client connecting by address (no SNI) would wait out its \
             TLS handshake and fail"
                .to_owned(),
        );
    }
    let own = given(cli, ACME_OWN);
    if !own.is_empty() {
        r.errors.push(format!(
            "{} {} for ACME, which --certmode manual does not use (it serves the files in \
             --certdir)",
            names(&own),
            is_are(&own)
        ));
    }
    let derpers = given(cli, ACME_DERPERS);
    if !derpers.is_empty() {
        r.ignored.push(format!(
            "{} {} ignored, as in derper: --certmode manual orders no certificate",
            names(&derpers),
            is_are(&derpers)
        ));
    }
}

/// Certificates from an ACME server: the rules derper applies, and derpd's own flags.
fn acme(cli: &Cli, r: &mut Review) {
    let args = &cli.tls;
    let extras = crate::acme_extras(cli);
    let gcp = args.certmode == CertMode::Gcp;
    if extras.ip_certs && gcp {
        r.errors
            .push("--acme-ip-certs requires --certmode=letsencrypt".to_owned());
    }
    let ip_hostname = hostname_is_ip(&args.hostname);
    if ip_hostname && gcp {
        r.errors.push(
            "--certmode=gcp requires --hostname to be a DNS name, not an IP address".to_owned(),
        );
    } else if ip_hostname && !extras.ip_certs {
        r.errors.push(
            "--hostname is an IP address; use --certmode=manual for a self-signed cert, or set \
             --acme-ip-certs to get ACME certificates for the node's IP addresses"
                .to_owned(),
        );
    }
    if extras.ip_certs && args.http_port < 0 {
        r.errors.push(
            "--acme-ip-certs needs the port-80 listener, where the CA validates each address \
             (HTTP-01); --http-port is -1"
                .to_owned(),
        );
    }
    if args.acme_challenge == AcmeChallenge::Http01 && args.http_port < 0 {
        r.errors.push(
            "--acme-challenge http-01 needs the port-80 listener (--http-port is -1)".to_owned(),
        );
    }
    if gcp {
        if extras.eab_kid.is_none() || extras.eab_key.is_none() {
            r.errors
                .push("--certmode=gcp requires --acme-eab-kid and --acme-eab-key flags".to_owned());
        }
        if args.acme_email.is_none() {
            r.errors
                .push("--certmode=gcp requires --acme-email flag".to_owned());
        }
        if args.acme_directory != derp_tls::LETS_ENCRYPT_PRODUCTION {
            r.errors.push(
                "--certmode=gcp uses Google Trust Services' directory; --acme-directory is for \
                 --certmode=letsencrypt (which binds an account with --acme-eab-kid/-key too)"
                    .to_owned(),
            );
        }
    } else if extras.eab_kid.is_some() != extras.eab_key.is_some() {
        r.errors
            .push("--acme-eab-kid and --acme-eab-key are given together or not at all".to_owned());
    }
    let own = given(cli, MANUAL_OWN);
    if !own.is_empty() {
        r.errors.push(format!(
            "{} is for --certmode manual's files; ACME certificates are renewed by derpd on \
             their own schedule",
            names(&own)
        ));
    }
}

/// Why DERP over QUIC is off, or `None` when it runs; [`crate::quic_port`] picks its port.
pub(crate) fn quic_off(cli: &Cli, tls: bool, listen_port: u16) -> Option<&'static str> {
    match cli.quic_port {
        Some(-1) => Some("--quic-port=-1"),
        Some(_) if !tls => Some("no TLS"),
        Some(_) => None,
        None if crate::quic_yields_to_stun(cli, tls, listen_port) => {
            Some("STUN has its UDP port; --quic-port picks another")
        }
        None if !tls => Some("no TLS"),
        None if cli.dev => Some("--dev without --quic-port"),
        None => None,
    }
}

fn quic(cli: &Cli, tls: bool, listen_port: u16, r: &mut Review) {
    if let Some(port) = cli.quic_port.and_then(|p| u16::try_from(p).ok())
        && tls
        && cli.stun
        && port != 0
        && port == cli.stun_port
    {
        r.errors.push(format!(
            "--quic-port {port} is also the STUN port; they need different UDP ports"
        ));
    }
    if let Some(why) = quic_off(cli, tls, listen_port) {
        let own = given(cli, QUIC_OWN);
        if !own.is_empty() {
            r.errors.push(format!(
                "{} is for DERP over QUIC, which is off ({why})",
                names(&own)
            ));
        }
    }
}

fn mesh(cli: &Cli, r: &mut Review) {
    // A list that does not parse is reported where it is read; nothing more to say here.
    let Ok(siblings) = derp_mesh::parse_mesh_with(&cli.mesh_with) else {
        return;
    };
    if siblings.is_empty() {
        let own = given(cli, MESH_OWN);
        if !own.is_empty() {
            r.errors.push(format!(
                "{} {} for the mesh links this node dials, and --mesh-with names none",
                names(&own),
                is_are(&own)
            ));
        }
    } else if cli.given(MESH_OWN[0]) && !siblings.iter().any(|s| s.url.scheme().is_tls()) {
        r.errors.push(
            "--mesh-ca-file is trusted by https:// and quic:// mesh links only, and --mesh-with \
             names only http:// siblings"
                .to_owned(),
        );
    }
}

/// A header is believed only from the proxies `--trust-forwarded-from` lists: without them,
/// naming the header would look like a setting that acts when nothing reads it.
fn forwarded(cli: &Cli, r: &mut Review) {
    let own = given(cli, FORWARDED_OWN);
    if cli.trust_forwarded_from.is_empty() && !own.is_empty() {
        r.errors.push(format!(
            "{} {} for the HTTP proxies of --trust-forwarded-from, which names none",
            names(&own),
            is_are(&own)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The review of a command line, the listener's TLS decided as a start decides it.
    fn review_of(args: &[&str]) -> Review {
        let cli = crate::cli::try_parse_from(std::iter::once("derpd").chain(args.iter().copied()))
            .expect("parses");
        let listen =
            crate::listen::ListenAddr::parse(&crate::listen_addr_text(&cli)).expect("listen");
        review(&cli, cli.tls.tls_enabled(&listen), listen.port)
    }

    fn errors(args: &[&str]) -> Vec<String> {
        review_of(args).errors
    }

    #[test]
    fn every_flag_named_is_a_flag() {
        let cmd = crate::cli::command();
        for id in [
            TLS_OWN,
            TLS_DERPERS,
            ACME_OWN,
            ACME_DERPERS,
            MANUAL_OWN,
            QUIC_OWN,
            MESH_OWN,
            FORWARDED_OWN,
        ]
        .concat()
        {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id() == id)
                .unwrap_or_else(|| panic!("{id} is no flag"));
            assert_eq!(arg.get_long(), Some(id.replace('_', "-").as_str()));
        }
    }

    #[test]
    fn ip_certificates_need_letsencrypt_and_port_80() {
        let manual = errors(&["--certmode", "manual", "--acme-ip-certs", "-a", ":8443"]);
        assert_eq!(manual.len(), 1, "{manual:?}");
        assert!(
            manual[0].starts_with("--acme-ip-certs requires --certmode=letsencrypt: "),
            "{manual:?}"
        );
        assert!(manual[0].contains("no SNI"), "{manual:?}");
        // Without TLS derper ignores it, and a derper command line must still start.
        let plain = review_of(&["-a", ":8080", "--acme-ip-certs"]);
        assert!(plain.errors.is_empty(), "{plain:?}");
        assert_eq!(
            plain.ignored,
            [format!(
                "--acme-ip-certs is ignored, as in derper: {NO_TLS}"
            )]
        );
        assert!(errors(&["--acme-ip-certs", "--hostname", "203.0.113.7"]).is_empty());
        assert!(errors(&["--acme-ip-certs=false", "--certmode", "manual"]).is_empty());
        assert_eq!(
            errors(&["--acme-ip-certs", "--http-port=-1"]),
            [
                "--acme-ip-certs needs the port-80 listener, where the CA validates each address \
              (HTTP-01); --http-port is -1"
            ]
        );
    }

    #[test]
    fn tls_flags_without_tls_are_refused_or_named_as_ignored() {
        let r = review_of(&[
            "-a",
            ":8080",
            "--tls-records",
            "rustls",
            "--cert-reload-interval=0",
            "--hostname",
            "derp.example.com",
            "--http-port=-1",
        ]);
        assert_eq!(
            r.errors,
            [format!(
                "--cert-reload-interval and --tls-records are for TLS, but {NO_TLS}"
            )]
        );
        assert_eq!(
            r.ignored,
            [format!(
                "--hostname and --http-port are ignored, as in derper: {NO_TLS}"
            )]
        );
        // What a default leaves is nothing given.
        assert_eq!(review_of(&["-a", ":8080"]), Review::default());
        assert_eq!(review_of(&[]), Review::default());
    }

    #[test]
    fn acme_flags_with_manual_certificates_are_refused_and_derpers_ignored() {
        let r = review_of(&[
            "--certmode=manual",
            "--acme-directory",
            "https://ca.example/dir",
            "--acme-challenge=http-01",
            "--acme-email",
            "ops@example.com",
        ]);
        assert_eq!(
            r.errors,
            [
                "--acme-directory and --acme-challenge are for ACME, which --certmode manual does \
              not use (it serves the files in --certdir)"
            ]
        );
        assert_eq!(
            r.ignored,
            ["--acme-email is ignored, as in derper: --certmode manual orders no certificate"]
        );
        assert_eq!(
            errors(&["--cert-reload-interval", "1m"]),
            [
                "--cert-reload-interval is for --certmode manual's files; ACME certificates are \
              renewed by derpd on their own schedule"
            ]
        );
        assert!(errors(&["--certmode=manual", "--cert-reload-interval", "1m"]).is_empty());
    }

    #[test]
    fn quic_flags_need_quic() {
        assert_eq!(
            errors(&["-a", ":8080", "--quic-port", "4433"]),
            [
                "--quic-port needs TLS (QUIC always encrypts): listen on port 443 or use \
              --certmode manual, or leave QUIC off"
            ]
        );
        assert!(errors(&["-a", ":8080", "--quic-port=-1"]).is_empty());
        assert_eq!(
            errors(&["--quic-port", "3478"]),
            ["--quic-port 3478 is also the STUN port; they need different UDP ports"]
        );
        assert!(errors(&["--quic-port", "3478", "--stun=false"]).is_empty());
        for (args, why) in [
            (&["--quic-port=-1"][..], "--quic-port=-1"),
            (&["-a", ":8080"], "no TLS"),
            (
                &["--dev", "--certmode", "manual"],
                "--dev without --quic-port",
            ),
            (
                &["-stun-port", "443"],
                "STUN has its UDP port; --quic-port picks another",
            ),
        ] {
            let mut all = args.to_vec();
            all.extend(["--quic-congestion", "cubic"]);
            assert_eq!(
                errors(&all),
                [format!(
                    "--quic-congestion is for DERP over QUIC, which is off ({why})"
                )],
                "{args:?}"
            );
        }
        assert!(errors(&["--quic-congestion", "cubic"]).is_empty());
    }

    #[test]
    fn mesh_flags_need_links_to_act_on() {
        assert_eq!(
            errors(&["--mesh-ca-file", "/ca.pem", "--mesh-ping-interval", "1s"]),
            [
                "--mesh-ca-file and --mesh-ping-interval are for the mesh links this node dials, \
              and --mesh-with names none"
            ]
        );
        assert!(
            errors(&[
                "--mesh-with",
                "http://10.0.0.2:8080",
                "--mesh-ca-file",
                "/ca.pem"
            ])[0]
                .starts_with("--mesh-ca-file is trusted by https:// and quic:// mesh links only")
        );
        assert!(
            errors(&[
                "--mesh-with",
                "http://10.0.0.2:8080,quic://b.example:443",
                "--mesh-ca-file",
                "/ca.pem",
                "--mesh-ping-interval=0",
            ])
            .is_empty()
        );
    }

    #[test]
    fn the_forwarded_header_needs_trusted_proxies() {
        assert_eq!(
            errors(&["--forwarded-header", "x-real-ip"]),
            [
                "--forwarded-header is for the HTTP proxies of --trust-forwarded-from, which \
              names none"
            ]
        );
        // Given with its default value, it is still given.
        assert_eq!(errors(&["--forwarded-header=x-forwarded-for"]).len(), 1);
        assert!(
            errors(&[
                "--trust-forwarded-from",
                "127.0.0.1/32",
                "--forwarded-header",
                "x-real-ip"
            ])
            .is_empty()
        );
    }
}
