//! The strict account at the end of a soak: once every client has left, the server must be
//! back where it started (gauges, descriptors, memory within bounds), its books must balance
//! and agree with what the clients counted, and it must still serve a new client.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use derp_client::Client;
use derp_load::procfs;
use derp_load::prom::Scrape;
use derp_load::target::{ServerProbe, Target};
use tokio::time::Instant;

use crate::SoakArgs;

use crate::client::{Stats, new_key};
use crate::report::{Check, Resources, ServerBooks, mib, opt_u};

/// The server before the run.
#[derive(Debug)]
pub(crate) struct Baseline {
    pub(crate) scrape: Scrape,
    pub(crate) resources: Resources,
}

/// What the account found.
#[derive(Debug)]
pub(crate) struct Account {
    pub(crate) checks: Vec<Check>,
    pub(crate) books: ServerBooks,
    pub(crate) resources_after: Resources,
    /// The peak seen during the run, and after it.
    pub(crate) peak: Resources,
    pub(crate) max_rss_bytes: u64,
    pub(crate) max_rss_after_bytes: u64,
}

/// The server's memory and descriptors now.
pub(crate) fn sample(target: &Target) -> Resources {
    let pid = match &target.probe {
        ServerProbe::Pids(pids) if pids.len() == 1 => pids[0].to_string(),
        ServerProbe::InProcess => "self".to_owned(),
        _ => return Resources::default(),
    };
    Resources {
        rss_bytes: procfs::process_rss(&pid),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
            .ok()
            .map(|d| d.count() as u64),
    }
}

/// Waits for the server to settle after the clients have left, then checks everything.
pub(crate) async fn settle_and_check(
    target: &Target,
    args: &SoakArgs,
    before: &Baseline,
    mut peak: Resources,
    stats: &Stats,
) -> anyhow::Result<Account> {
    let (before_scrape, resources_before) = (&before.scrape, before.resources);
    let mut checks = Vec::new();
    let mut check = |name: &str, ok: bool, detail: String| {
        checks.push(Check {
            name: name.to_owned(),
            ok,
            detail,
        });
    };

    // Gauges back to zero.
    let gauges = [
        "derp_current_connections",
        "derp_clients_local",
        "derp_current_dup_client_keys",
        "derp_current_dup_client_conns",
        "derp_current_home_connections",
        "derp_current_notideal_connections",
    ];
    let (after_scrape, settled) = scrape_until(target, args.settle, |s| {
        gauges.iter().all(|g| s.sum(g).unwrap_or(0.0) == 0.0)
    })
    .await?;
    let gauge_text: Vec<String> = gauges
        .iter()
        .map(|g| {
            format!(
                "{}={}",
                g.trim_start_matches("derp_"),
                after_scrape.sum(g).unwrap_or(0.0)
            )
        })
        .collect();
    check("connection gauges back to 0", settled, gauge_text.join(" "));

    // Descriptors back to the baseline.
    let deadline = Instant::now() + args.settle;
    let mut resources_after = sample(target);
    let mut fd_tick = tokio::time::interval(Duration::from_millis(200));
    while resources_after.fds > resources_before.fds && Instant::now() < deadline {
        fd_tick.tick().await;
        resources_after = sample(target);
    }
    check(
        "descriptors back to the baseline",
        resources_after.fds <= resources_before.fds,
        format!(
            "{} before, {} at peak, {} after",
            opt_u(resources_before.fds),
            opt_u(peak.fds),
            opt_u(resources_after.fds)
        ),
    );
    peak.rss_bytes = peak.rss_bytes.max(resources_after.rss_bytes);

    // The server's books.
    let after_scrape = must_scrape(target).await.unwrap_or(after_scrape);
    let books = ServerBooks {
        packets_received: delta(before_scrape, &after_scrape, "derp_packets_received"),
        packets_sent: delta(before_scrape, &after_scrape, "derp_packets_sent"),
        packets_dropped: delta(before_scrape, &after_scrape, "derp_packets_dropped"),
        dropped_by_reason: delta_by(
            before_scrape,
            &after_scrape,
            "derp_packets_dropped",
            "reason",
        ),
        forwarded_in: delta(before_scrape, &after_scrape, "derp_packets_forwarded_in"),
        forwarded_out: delta(before_scrape, &after_scrape, "derp_packets_forwarded_out"),
        accepts: delta(before_scrape, &after_scrape, "derp_accepts"),
        connection_errors: delta_by(
            before_scrape,
            &after_scrape,
            "derp_connection_errors",
            "reason",
        ),
    };
    let inflow = books.packets_received + books.forwarded_in;
    let outflow = books.packets_sent + books.packets_dropped + books.forwarded_out;
    check(
        "server: received = sent + dropped",
        inflow == outflow,
        format!(
            "{} received = {} sent + {} dropped ({})",
            books.packets_received,
            books.packets_sent,
            books.packets_dropped,
            books
                .dropped_by_reason
                .iter()
                .map(|(r, v)| format!("{r} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let client_sent = Stats::get(&stats.sent);
    let client_received = Stats::get(&stats.received);
    check(
        "server received every packet the clients sent",
        client_sent == books.packets_received,
        format!(
            "clients sent {client_sent}, server received {}",
            books.packets_received
        ),
    );
    check(
        "clients received no more than the server sent",
        client_received <= books.packets_sent,
        format!(
            "server sent {}, clients read {client_received} ({} were left unread by clients that \
             left or were cut off)",
            books.packets_sent,
            books.packets_sent.saturating_sub(client_received)
        ),
    );
    let (closed_sent, closed_echoed) = (
        Stats::get(&stats.closed_sent),
        Stats::get(&stats.closed_echoed),
    );
    check(
        "closed loop: zero loss",
        closed_sent == closed_echoed && Stats::get(&stats.closed_lost) == 0 && closed_sent > 0,
        format!("{closed_sent} sent, {closed_echoed} echoed"),
    );
    let (pings, pongs) = (Stats::get(&stats.pings), Stats::get(&stats.pongs));
    let (abandoned, ping_timeouts) = (
        Stats::get(&stats.pings_abandoned),
        Stats::get(&stats.ping_timeouts),
    );
    check(
        "every ping answered within 5 s",
        pings == pongs + abandoned && ping_timeouts == 0 && pings > 0,
        format!(
            "{pings} pings, {pongs} pongs, {ping_timeouts} timed out, {abandoned} outstanding \
             on slow readers when they were cut off"
        ),
    );
    let hostile = stats
        .hostile
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let hostile_failed = Stats::get(&stats.hostile_failed);
    check(
        "hostile connections answered and closed by the server",
        hostile_failed == 0 && !hostile.is_empty(),
        format!(
            "{} ({hostile_failed} not)",
            hostile
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    let violation_count = Stats::get(&stats.violation_count);
    check(
        "no client saw anything wrong",
        violation_count == 0,
        format!("{violation_count} violations"),
    );
    let max_rss = args.max_rss_mib << 20;
    check(
        "peak RSS within bound",
        peak.rss_bytes.is_some_and(|r| r <= max_rss),
        format!(
            "peak {} MiB, bound {} MiB",
            mib(peak.rss_bytes),
            args.max_rss_mib
        ),
    );
    let max_after = resources_before.rss_bytes.unwrap_or(0) + (args.max_rss_after_mib << 20);
    check(
        "RSS after the run within bound",
        resources_after.rss_bytes.is_some_and(|r| r <= max_after),
        format!(
            "{} MiB before, {} MiB after, bound before + {} MiB",
            mib(resources_before.rss_bytes),
            mib(resources_after.rss_bytes),
            args.max_rss_after_mib
        ),
    );
    let fresh = fresh_client(target).await;
    check(
        "a new client is served afterwards",
        fresh.is_ok(),
        fresh.map_or_else(|e| format!("{e:#}"), |()| "connected and pinged".to_owned()),
    );

    Ok(Account {
        checks,
        books,
        resources_after,
        peak,
        max_rss_bytes: max_rss,
        max_rss_after_bytes: max_after,
    })
}

fn delta(before: &Scrape, after: &Scrape, name: &str) -> u64 {
    (after.sum(name).unwrap_or(0.0) - before.sum(name).unwrap_or(0.0)).max(0.0) as u64
}

fn delta_by(before: &Scrape, after: &Scrape, name: &str, label: &str) -> BTreeMap<String, u64> {
    let earlier = before.sum_by(name, label);
    after
        .sum_by(name, label)
        .into_iter()
        .map(|(k, v)| {
            let was = earlier
                .iter()
                .find(|(e, _)| *e == k)
                .map_or(0.0, |(_, v)| *v);
            (k, (v - was).max(0.0) as u64)
        })
        .filter(|(_, v)| *v > 0)
        .collect()
}

async fn must_scrape(target: &Target) -> anyhow::Result<Scrape> {
    match &target.metrics {
        Some(source) => Ok(source.scrape().await?),
        None => anyhow::bail!("soak needs the server's metrics: give --metrics-url"),
    }
}

/// Polls until `cond` holds on a fresh scrape, for at most `within`; returns the last scrape.
pub(crate) async fn scrape_until(
    target: &Target,
    within: Duration,
    cond: impl Fn(&Scrape) -> bool,
) -> anyhow::Result<(Scrape, bool)> {
    let deadline = Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let s = must_scrape(target).await?;
        if cond(&s) {
            return Ok((s, true));
        }
        if Instant::now() >= deadline {
            return Ok((s, false));
        }
    }
}

/// Connects one more client and pings: the server still serves after everything.
async fn fresh_client(target: &Target) -> anyhow::Result<()> {
    let config = target.client_config(new_key(), None);
    let mut client = Client::connect(&config).await.context("connect")?;
    client.ping().await.context("ping")?;
    let _ = client.close().await;
    Ok(())
}
