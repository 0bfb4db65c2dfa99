//! What derpd tells the relay for its `/debug/` pages and `derp_tcp_rtt`.

use derp_server::{ServerConfig, TCP_RTT_INTERVAL};

use crate::cli::Cli;

/// derper's switch for RTT sampling, honoured under the same name.
const DISABLE_RTT_ENV: &str = "TS_DERP_DISABLE_RTT_STATS";

/// Fills in the index page's lines and the RTT sampling period.
pub(crate) fn configure(cli: &Cli, tls: bool, config: &mut ServerConfig) {
    config.debug_info = vec![("Version".to_owned(), env!("CARGO_PKG_VERSION").to_owned())];
    if tls {
        config
            .debug_info
            .push(("TLS hostname".to_owned(), cli.tls.hostname.clone()));
    }
    let disabled = std::env::var(DISABLE_RTT_ENV).is_ok_and(|v| go_bool(&v) == Some(true));
    config.tcp_rtt_interval = (!disabled).then_some(TCP_RTT_INTERVAL);
}

/// Go's `strconv.ParseBool`, as derper's `envknob.Bool` reads the variable.
fn go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_as_go_reads_it() {
        assert_eq!(go_bool("true"), Some(true));
        assert_eq!(go_bool("1"), Some(true));
        assert_eq!(go_bool("False"), Some(false));
        assert_eq!(go_bool("yes"), None);
    }
}
