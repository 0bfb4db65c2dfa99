//! systemd's readiness protocol: with `Type=notify`, systemd passes a datagram socket in
//! `$NOTIFY_SOCKET` and waits for `READY=1` on it before it counts the service as started (so
//! `systemctl start` and units ordered after derpd wait for a node that serves). derpd also
//! says `STOPPING=1` when a graceful shutdown begins and a `STATUS=` line `systemctl status`
//! shows.
//!
//! The protocol is one datagram per message, newline-separated `KEY=value` lines, to a path
//! or (a leading `@`) an abstract socket address; std's `UnixDatagram` speaks it, no library
//! needed. Without the variable every call does nothing. A failed send is logged and
//! otherwise ignored: a node that serves must not stop because its supervisor went away.
//!
//! The variable stays in derpd's environment (removing it takes `unsafe` code, which the
//! workspace forbids). The one program derpd starts is its successor in an upgrade
//! (`upgrade/`), which is given it deliberately: it tells systemd its PID with `MAINPID=`.

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;

use tracing::warn;

/// The environment variable systemd sets for a `Type=notify` service.
const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Where systemd listens, or nowhere. Cheap to clone: the tasks that report share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Notifier {
    target: Option<Arc<Target>>,
}

#[derive(Debug)]
struct Target {
    socket: UnixDatagram,
    addr: std::os::unix::net::SocketAddr,
    /// As given, for the log.
    text: String,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`; a value that cannot be used is logged and ignored.
    pub(crate) fn from_env() -> Self {
        match std::env::var_os(NOTIFY_SOCKET) {
            Some(v) => Self::new(&v.to_string_lossy()),
            None => Self::default(),
        }
    }

    /// For the socket named by `value`, as `$NOTIFY_SOCKET` gives it.
    pub(crate) fn new(value: &str) -> Self {
        if value.is_empty() {
            return Self::default();
        }
        match target(value) {
            Ok(target) => Self {
                target: Some(Arc::new(target)),
            },
            Err(e) => {
                warn!(socket = value, error = %e, "{NOTIFY_SOCKET}: not telling systemd of readiness");
                Self::default()
            }
        }
    }

    /// Startup is over: every listener is bound and serving. `status` says what it serves.
    pub(crate) fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    /// A line for `systemctl status`.
    pub(crate) fn status(&self, status: &str) {
        self.send(&format!("STATUS={status}"));
    }

    /// A graceful shutdown has begun; `status` says what it waits for.
    pub(crate) fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={status}"));
    }

    /// Tells systemd that `pid` is now the service's main process, as a process that takes
    /// over from another one must (with `NotifyAccess=all`, since it is not the main process
    /// yet when it says so).
    pub(crate) fn main_pid(&self, pid: u32, status: &str) {
        self.send(&format!("MAINPID={pid}\nREADY=1\nSTATUS={status}"));
    }

    fn send(&self, message: &str) {
        let Some(t) = &self.target else { return };
        if let Err(e) = t.socket.send_to_addr(message.as_bytes(), &t.addr) {
            warn!(socket = %t.text, error = %e, "telling systemd {:?}", first_line(message));
        }
    }
}

fn first_line(message: &str) -> &str {
    message.lines().next().unwrap_or_default()
}

fn target(value: &str) -> std::io::Result<Target> {
    let addr = socket_addr(value)?;
    Ok(Target {
        socket: UnixDatagram::unbound()?,
        addr,
        text: value.to_owned(),
    })
}

/// A path, or with `@` first an abstract address (Linux only), as systemd writes it.
fn socket_addr(value: &str) -> std::io::Result<std::os::unix::net::SocketAddr> {
    if let Some(name) = value.strip_prefix('@') {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            use std::os::linux::net::SocketAddrExt;
            return std::os::unix::net::SocketAddr::from_abstract_name(name);
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            let _ = name;
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "abstract socket addresses are Linux's",
            ));
        }
    }
    if value.starts_with('/') {
        return std::os::unix::net::SocketAddr::from_pathname(value);
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        "neither an absolute path nor an abstract address (@name)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("recv");
        String::from_utf8(buf[..n].to_vec()).expect("utf-8")
    }

    #[test]
    fn messages_reach_a_path_socket() {
        let dir = std::env::temp_dir().join(format!("derpd-sd-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind");
        let n = Notifier::new(path.to_str().expect("utf-8 path"));
        n.ready("serving");
        assert_eq!(receive(&socket), "READY=1\nSTATUS=serving");
        n.status("draining 3 clients");
        assert_eq!(receive(&socket), "STATUS=draining 3 clients");
        n.stopping("draining");
        assert_eq!(receive(&socket), "STOPPING=1\nSTATUS=draining");
        n.main_pid(4242, "serving");
        assert_eq!(receive(&socket), "MAINPID=4242\nREADY=1\nSTATUS=serving");
        drop(socket);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn messages_reach_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("derpd-sd-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name).expect("addr");
        let socket = UnixDatagram::bind_addr(&addr).expect("bind");
        Notifier::new(&format!("@{name}")).ready("serving");
        assert_eq!(receive(&socket), "READY=1\nSTATUS=serving");
    }

    #[test]
    fn unusable_values_mean_no_notifications() {
        assert!(Notifier::new("").target.is_none());
        assert!(Notifier::new("relative/path").target.is_none());
        assert!(Notifier::new("vsock:2:1234").target.is_none());
        // A socket that is gone: the send fails, is logged, and nothing else happens.
        Notifier::new("/nonexistent/derpd-notify").ready("serving");
    }
}
