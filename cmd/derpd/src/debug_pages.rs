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
    let disabled = std::env::var(DISABLE_RTT_ENV)
        .is_ok_and(|v| crate::goflags::parse_bool(v.as_ref()) == Some(true));
    config.tcp_rtt_interval = (!disabled).then_some(TCP_RTT_INTERVAL);
}
