//! The system resolver behind `/bootstrap-dns`: addresses from the C library's
//! `getaddrinfo` (the hosts file, then DNS, as nsswitch says), TXT records from the
//! nameservers in /etc/resolv.conf by a small DNS client over UDP (the C library offers no
//! TXT lookup, and the rollout form needs one).

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use derp_server::{BootstrapDns, BootstrapDnsConfig, LookupFuture, Resolver};
use tokio::net::UdpSocket;
use tracing::info;

use crate::cli::Cli;

/// `/bootstrap-dns` as the flags configure it, with its metrics on `registry` (registered
/// whether or not names are given, as derper's are).
pub(crate) fn bootstrap_dns(
    cli: &Cli,
    registry: &prometheus::Registry,
) -> anyhow::Result<Arc<BootstrapDns>> {
    let config = config(cli);
    if !config.published.is_empty() || !config.unpublished.is_empty() {
        info!(
            published = %config.published,
            unpublished = %config.unpublished,
            "bootstrap DNS: resolving now and every 10 minutes"
        );
    }
    let dns = BootstrapDns::new(config, Arc::new(SystemResolver), registry)
        .context("bootstrap DNS metrics")?;
    Ok(Arc::new(dns))
}

/// The two lists, exactly as given (derper neither trims nor drops empty entries).
pub(crate) fn config(cli: &Cli) -> BootstrapDnsConfig {
    BootstrapDnsConfig {
        published: cli.bootstrap_dns_names.clone(),
        unpublished: cli.unpublished_bootstrap_dns_names.clone(),
    }
}

/// Lookups through the host's own configuration.
#[derive(Debug, Default)]
pub(crate) struct SystemResolver;

impl Resolver for SystemResolver {
    fn lookup_ip<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<IpAddr>> {
        Box::pin(async move {
            if name.is_empty() {
                return Err(io::Error::new(io::ErrorKind::NotFound, "no such host"));
            }
            let mut out: Vec<IpAddr> = Vec::new();
            for addr in tokio::net::lookup_host((name, 0)).await? {
                if !out.contains(&addr.ip()) {
                    out.push(addr.ip());
                }
            }
            Ok(out)
        })
    }

    fn lookup_txt<'a>(&'a self, name: &'a str) -> LookupFuture<'a, Vec<String>> {
        Box::pin(async move {
            let conf = std::fs::read_to_string(RESOLV_CONF).unwrap_or_default();
            let servers = nameservers(&conf);
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no nameserver answered");
            for server in servers {
                match query_txt(server, name).await {
                    Ok(txt) => return Ok(txt),
                    Err(e) => last = e,
                }
            }
            Err(last)
        })
    }
}

const RESOLV_CONF: &str = "/etc/resolv.conf";
/// How long one nameserver gets for one TXT question.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
const TYPE_TXT: u16 = 16;
const CLASS_IN: u16 = 1;

/// The `nameserver` lines of a resolv.conf, on port 53; the local host when there are none
/// (the C library's default, and Go's).
fn nameservers(conf: &str) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next())?
        })
        .filter_map(|addr| {
            // A link-local server may carry a zone, which a socket address cannot.
            let addr = addr.split('%').next()?;
            addr.parse::<IpAddr>().ok()
        })
        .map(|ip| SocketAddr::new(ip, 53))
        .collect();
    if out.is_empty() {
        out.push(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 53));
    }
    out
}

async fn query_txt(server: SocketAddr, name: &str) -> io::Result<Vec<String>> {
    let id: u16 = rand::random();
    let question = encode_query(id, name)?;
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).await?;
    socket.connect(server).await?;
    socket.send(&question).await?;
    let mut buf = vec![0u8; 4096];
    let answer = tokio::time::timeout(QUERY_TIMEOUT, async {
        loop {
            let n = socket.recv(&mut buf).await?;
            // Anything not answering this question (a stray or forged datagram) is skipped.
            if n >= 2 && buf[..2] == id.to_be_bytes() {
                return Ok::<_, io::Error>(n);
            }
        }
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("{server}: no answer")))??;
    parse_txt_answer(&buf[..answer], id)
}

/// A recursive query for `name`'s TXT records.
fn encode_query(id: u16, name: &str) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(name.len() + 18);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD; one question
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad DNS name {name:?}"),
        )
    };
    for label in name.trim_end_matches('.').split('.') {
        let len = u8::try_from(label.len())
            .ok()
            .filter(|l| (1..64).contains(l));
        out.push(len.ok_or_else(bad)?);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    if out.len() > 12 + 255 {
        return Err(bad());
    }
    out.extend_from_slice(&TYPE_TXT.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    Ok(out)
}

/// The TXT records of a response, one string per record: a record's character-strings
/// joined, as Go's `LookupTXT` joins them.
fn parse_txt_answer(msg: &[u8], id: u16) -> io::Result<Vec<String>> {
    let bad =
        |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("DNS answer: {what}"));
    let u16_at = |at: usize| -> io::Result<u16> {
        msg.get(at..at + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| bad("truncated"))
    };
    if u16_at(0)? != id {
        return Err(bad("wrong id"));
    }
    let flags = u16_at(2)?;
    if flags & 0x0200 != 0 {
        return Err(bad("truncated (TC)"));
    }
    match flags & 0x000f {
        0 => {}
        3 => return Err(io::Error::new(io::ErrorKind::NotFound, "no such host")),
        rcode => return Err(bad(&format!("server failure (rcode {rcode})"))),
    }
    let (questions, answers) = (u16_at(4)?, u16_at(6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(msg, at).ok_or_else(|| bad("bad question"))? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..answers {
        at = skip_name(msg, at).ok_or_else(|| bad("bad record name"))?;
        let (rtype, len) = (u16_at(at)?, usize::from(u16_at(at + 8)?));
        let data = msg
            .get(at + 10..at + 10 + len)
            .ok_or_else(|| bad("truncated"))?;
        at += 10 + len;
        if rtype != TYPE_TXT {
            continue;
        }
        let mut text = Vec::new();
        let mut rest = data;
        while let Some((&n, tail)) = rest.split_first() {
            let n = usize::from(n);
            let piece = tail.get(..n).ok_or_else(|| bad("bad TXT string"))?;
            text.extend_from_slice(piece);
            rest = &tail[n..];
        }
        out.push(String::from_utf8_lossy(&text).into_owned());
    }
    if out.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "no TXT record"));
    }
    Ok(out)
}

/// The offset just past the name at `at` (labels, ending in a zero or a pointer).
fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *msg.get(at)?;
        match len {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => return Some(at + 2),
            l if l < 64 => at += 1 + usize::from(l),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_nameservers() {
        let conf = "# comment\nsearch example\nnameserver 10.0.0.53\nnameserver fe80::1%eth0\n\
                    nameserver bogus\n";
        assert_eq!(
            nameservers(conf),
            vec![
                "10.0.0.53:53".parse::<SocketAddr>().expect("addr"),
                "[fe80::1]:53".parse().expect("addr"),
            ]
        );
        assert_eq!(
            nameservers(""),
            vec!["127.0.0.1:53".parse::<SocketAddr>().expect("addr")]
        );
    }

    /// A response to `query` with the given TXT records (each a list of strings).
    fn answer(query: &[u8], records: &[&[&str]]) -> Vec<u8> {
        let mut out = query.to_vec();
        out[2] = 0x81;
        out[3] = 0x80;
        out[7] = u8::try_from(records.len()).expect("few");
        for strings in records {
            out.extend_from_slice(&[0xc0, 12]);
            out.extend_from_slice(&TYPE_TXT.to_be_bytes());
            out.extend_from_slice(&CLASS_IN.to_be_bytes());
            out.extend_from_slice(&300u32.to_be_bytes());
            let data: Vec<u8> = strings
                .iter()
                .flat_map(|s| {
                    std::iter::once(u8::try_from(s.len()).expect("short")).chain(s.bytes())
                })
                .collect();
            out.extend_from_slice(&u16::try_from(data.len()).expect("short").to_be_bytes());
            out.extend_from_slice(&data);
        }
        out
    }

    #[test]
    fn txt_answers_parse() {
        let q = encode_query(0x1234, "rollout.example.com.").expect("query");
        assert_eq!(&q[12..20], b"\x07rollout");
        let msg = answer(&q, &[&["70"], &["ab", "c"]]);
        assert_eq!(
            parse_txt_answer(&msg, 0x1234).expect("parses"),
            vec!["70".to_owned(), "abc".to_owned()]
        );
        assert!(parse_txt_answer(&msg, 0x9999).is_err());
        let mut nx = answer(&q, &[]);
        nx[3] = 0x83;
        assert_eq!(
            parse_txt_answer(&nx, 0x1234).expect_err("nxdomain").kind(),
            io::ErrorKind::NotFound
        );
        assert!(parse_txt_answer(&msg[..msg.len() - 1], 0x1234).is_err());
        assert!(encode_query(1, "a..b").is_err());
        assert!(encode_query(1, &"a".repeat(64)).is_err());
    }

    /// A DNS server on loopback answering one TXT question.
    #[tokio::test]
    async fn a_txt_question_goes_to_the_server_and_back() {
        let server = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let addr = server.local_addr().expect("addr");
        let answering = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, from) = server.recv_from(&mut buf).await.expect("question");
            let reply = answer(&buf[..n], &[&["42"]]);
            server.send_to(&reply, from).await.expect("answer");
        });
        let txt = query_txt(addr, "pct.example").await.expect("answer");
        assert_eq!(txt, vec!["42".to_owned()]);
        answering.await.expect("server");
    }

    #[tokio::test]
    async fn addresses_come_from_the_system() {
        let r = SystemResolver;
        assert_eq!(
            r.lookup_ip("127.0.0.1").await.expect("literal"),
            vec![IpAddr::from([127, 0, 0, 1])]
        );
        assert!(r.lookup_ip("").await.is_err());
        assert!(
            !r.lookup_ip("localhost")
                .await
                .expect("localhost")
                .is_empty()
        );
    }
}
