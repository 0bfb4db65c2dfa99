//! Where derpd's listening sockets come from: bound here, or taken from the process this
//! one takes over from; and a copy of each kept, to hand to the process that may one day
//! take over from this one.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, bail};

use super::wire::{Handed, Listener, ListenerKind};

/// The listening sockets of this process. Cheap to clone: the TLS setup binds some of them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sockets {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// What the previous process handed and nothing has taken yet; `None` when this process
    /// binds its own.
    handed: Option<Handed>,
    /// A duplicate of every socket in service, for a successor; `None` once handed over.
    held: Option<Handed>,
}

impl Sockets {
    /// Sockets this process binds itself.
    pub(crate) fn bind_here() -> Self {
        Self::with(None)
    }

    /// Sockets handed by the previous process, taken by kind.
    pub(crate) fn adopting(handed: Handed) -> Self {
        Self::with(Some(handed))
    }

    fn with(handed: Option<Handed>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                handed,
                held: Some(Vec::new()),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding it leaves nothing half-changed: each change is one push or
        // one removal.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A listening TCP socket for `kind` on `want` (port 0: any port), bound by `bind` or
    /// taken over (then given `backlog` again, if the flags set one, as a fresh listener
    /// would be).
    pub(crate) fn tcp(
        &self,
        kind: ListenerKind,
        want: SocketAddr,
        backlog: Option<u32>,
        bind: impl FnOnce() -> anyhow::Result<tokio::net::TcpListener>,
    ) -> anyhow::Result<tokio::net::TcpListener> {
        let listener = match self.take(kind, want)? {
            Some(fd) => {
                if let Some(backlog) = backlog {
                    rustix::net::listen(&fd, i32::try_from(backlog).unwrap_or(i32::MAX))
                        .with_context(|| format!("the handed {}", kind.describe()))?;
                }
                let std = std::net::TcpListener::from(fd);
                std.set_nonblocking(true)?;
                tokio::net::TcpListener::from_std(std)?
            }
            None => bind()?,
        };
        self.hold(kind, listener.local_addr()?, listener.as_fd())?;
        Ok(listener)
    }

    /// A bound UDP socket for `kind` on `want` (port 0: any port), bound by `bind` or taken
    /// over.
    pub(crate) fn udp(
        &self,
        kind: ListenerKind,
        want: SocketAddr,
        bind: impl FnOnce() -> anyhow::Result<std::net::UdpSocket>,
    ) -> anyhow::Result<std::net::UdpSocket> {
        let socket = match self.take(kind, want)? {
            Some(fd) => {
                let socket = std::net::UdpSocket::from(fd);
                socket.set_nonblocking(true)?;
                socket
            }
            None => bind()?,
        };
        self.hold(kind, socket.local_addr()?, socket.as_fd())?;
        Ok(socket)
    }

    /// The handed socket for `kind`, if this process takes over; an error if there is none
    /// or it is not the one these flags ask for.
    fn take(&self, kind: ListenerKind, want: SocketAddr) -> anyhow::Result<Option<OwnedFd>> {
        let mut inner = self.lock();
        let Some(handed) = &mut inner.handed else {
            return Ok(None);
        };
        let Some(at) = handed.iter().position(|(l, _)| l.kind == kind) else {
            bail!(
                "these flags need a {} on {want}, which the running derpd does not have \
                 (flags changed? restart instead)",
                kind.describe()
            );
        };
        let (listener, fd) = handed.remove(at);
        if !fits(want, listener.addr) {
            bail!(
                "these flags need the {} on {want}, but the running derpd's is on {} (flags \
                 changed? restart instead)",
                kind.describe(),
                listener.addr
            );
        }
        let socket_type = rustix::net::sockopt::socket_type(&fd)?;
        let expected = if kind.is_udp() {
            rustix::net::SocketType::DGRAM
        } else {
            rustix::net::SocketType::STREAM
        };
        if socket_type != expected {
            bail!("the handed {} is another kind of socket", kind.describe());
        }
        Ok(Some(fd))
    }

    fn hold(&self, kind: ListenerKind, addr: SocketAddr, fd: BorrowedFd<'_>) -> anyhow::Result<()> {
        let copy = fd
            .try_clone_to_owned()
            .with_context(|| format!("keeping a copy of the {}", kind.describe()))?;
        if let Some(held) = &mut self.lock().held {
            held.push((Listener { kind, addr }, copy));
        }
        Ok(())
    }

    /// An error naming what was handed and not taken: flags that no longer ask for a
    /// listener the running process has (the port would stop being served).
    pub(crate) fn check_all_taken(&self) -> anyhow::Result<()> {
        let inner = self.lock();
        let left: Vec<String> = inner
            .handed
            .iter()
            .flatten()
            .map(|(l, _)| format!("{} on {}", l.kind.describe(), l.addr))
            .collect();
        if !left.is_empty() {
            bail!(
                "the running derpd has a {} that these flags do not use (flags changed? \
                 restart instead)",
                left.join(", ")
            );
        }
        Ok(())
    }

    /// The sockets in service, described, with duplicates of their fds for a successor.
    pub(crate) fn for_successor(&self) -> anyhow::Result<Handed> {
        let inner = self.lock();
        let Some(held) = &inner.held else {
            bail!("the listeners were handed over already");
        };
        held.iter()
            .map(|(l, fd)| Ok((*l, fd.try_clone().context("duplicating a listener")?)))
            .collect()
    }

    /// What is in service, for the log.
    pub(crate) fn describe(&self) -> String {
        let inner = self.lock();
        inner
            .held
            .iter()
            .flatten()
            .map(|(l, _)| format!("{} on {}", l.kind.describe(), l.addr))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Closes this process's copies: the sockets belong to its successor now.
    pub(crate) fn release(&self) {
        self.lock().held = None;
    }
}

/// Whether a socket bound to `have` is what flags asking for `want` would bind: the same
/// address, and the same port unless they ask for any. Every interface over IPv6 (`[::]`)
/// may have been bound as IPv4's `0.0.0.0` on a host without IPv6; the reverse is not what
/// the flags ask for (a dual-stack socket where they ask for IPv4 only).
fn fits(want: SocketAddr, have: SocketAddr) -> bool {
    let v4_for_any = want.is_ipv6()
        && want.ip().is_unspecified()
        && have.ip() == std::net::IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED);
    let same_ip = want.ip() == have.ip() || v4_for_any;
    same_ip && (want.port() == 0 || want.port() == have.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handed_socket_fits_the_same_address_and_port() {
        let at = |s: &str| s.parse::<SocketAddr>().expect("addr");
        assert!(fits(at("127.0.0.1:0"), at("127.0.0.1:4711")));
        assert!(fits(at("[::]:443"), at("[::]:443")));
        assert!(!fits(at("[::]:443"), at("[::]:8443")));
        assert!(!fits(at("127.0.0.1:443"), at("[::]:443")));
        assert!(fits(at("[::]:443"), at("0.0.0.0:443")));
        assert!(!fits(at("0.0.0.0:443"), at("[::]:443")));
    }

    fn listener() -> (SocketAddr, OwnedFd) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        (l.local_addr().expect("addr"), OwnedFd::from(l))
    }

    #[tokio::test]
    async fn takes_by_kind_and_names_what_is_missing_or_left() {
        let (addr, fd) = listener();
        let (maddr, mfd) = listener();
        let sockets = Sockets::adopting(vec![
            (
                Listener {
                    kind: ListenerKind::Main,
                    addr,
                },
                fd,
            ),
            (
                Listener {
                    kind: ListenerKind::Metrics,
                    addr: maddr,
                },
                mfd,
            ),
        ]);
        let want: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let main = sockets
            .tcp(ListenerKind::Main, want, Some(128), || {
                panic!("binds nothing")
            })
            .expect("adopted");
        assert_eq!(main.local_addr().expect("addr"), addr);
        let e = sockets
            .udp(ListenerKind::Stun, want, || panic!("binds nothing"))
            .expect_err("no STUN handed");
        assert!(e.to_string().contains("STUN socket (UDP)"), "{e}");
        let e = sockets.check_all_taken().expect_err("metrics left");
        assert!(e.to_string().contains("metrics listener (TCP)"), "{e}");
        let held = sockets.for_successor().expect("held");
        assert_eq!(held.len(), 1);
        assert_eq!(
            held[0].0,
            Listener {
                kind: ListenerKind::Main,
                addr
            }
        );
        sockets.release();
        assert!(sockets.for_successor().is_err());
    }

    #[tokio::test]
    async fn a_socket_of_the_wrong_address_is_refused() {
        let (addr, fd) = listener();
        let sockets = Sockets::adopting(vec![(
            Listener {
                kind: ListenerKind::Main,
                addr,
            },
            fd,
        )]);
        let other: SocketAddr = format!("127.0.0.1:{}", addr.port().wrapping_add(1))
            .parse()
            .expect("addr");
        let e = sockets
            .tcp(ListenerKind::Main, other, None, || panic!("binds nothing"))
            .expect_err("another port");
        assert!(
            e.to_string().contains("but the running derpd's is on"),
            "{e}"
        );
    }
}
