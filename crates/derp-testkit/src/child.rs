//! A helper program a test runs beside the code under test (a proxy, an ACME server), its
//! output in a file, killed and reaped however the test ends.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process writing stdout and stderr to one file; killed and reaped on drop.
#[derive(Debug)]
pub struct LoggedChild {
    child: Child,
    log: PathBuf,
}

impl LoggedChild {
    /// Starts `cmd` with no stdin and its output in `log` (created or truncated). Panics,
    /// naming the command, when it cannot start: the test cannot go on without it.
    pub fn spawn(cmd: &mut Command, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
        Self { child, log }
    }

    /// What it has written so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `port` on 127.0.0.1 accepts a connection, for at most `within`; panics
    /// with the log if the process exits first or the time runs out.
    pub fn wait_listening(&mut self, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("exited ({status}):\n{}", self.log());
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not listening on {port}:\n{}",
                self.log()
            );
            std::thread::park_timeout(Duration::from_millis(10));
        }
    }

    /// Kills and reaps it now (a second call does nothing more).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LoggedChild {
    fn drop(&mut self) {
        self.stop();
    }
}
