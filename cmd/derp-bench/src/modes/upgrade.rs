//! `upgrade`: what clients feel of a server's upgrade in place. Pairs send a steady trickle
//! of timestamped packets; after a warm-up and a baseline the bench sends SIGUSR2 to the
//! server, waits for the old process to exit, lets traffic flow for a while more, and
//! reports the delays of packets sent before, during and after the upgrade, per packet and
//! per connection, and whether any packet was lost, repeated or reordered or any connection
//! broke.

use std::fmt::Write as _;

use anyhow::bail;
use derp_load::args::TargetArgs;
use derp_load::measure::sample_cpu;
use derp_load::report::CpuUse;
use derp_load::upgrade::{Account, PhaseFigures, Phases, TricklePairs, TrickleSpec, Upgradee};
use derp_load::{Ctx, Outcome};
use tokio::time::{Duration, Instant};

use crate::cli::UpgradeArgs;
use crate::progress::Progress;
use crate::report::{Spread, UpgradeConfig, UpgradePhase, UpgradeResult, table};

/// Time to set every sender's first instant after they are all spawned.
const START_LEAD: Duration = Duration::from_millis(50);

pub(crate) async fn run(
    ctx: &mut Ctx,
    target_args: &TargetArgs,
    args: &UpgradeArgs,
) -> anyhow::Result<Outcome> {
    if ctx.procs_asked > 1 {
        bail!("upgrade runs in one bench process: the delays need one clock (leave out --procs)");
    }
    if ctx.target.spawned {
        bail!(
            "upgrade needs a derpd process to upgrade (--url and --upgrade-pid), not the \
             in-process relay of --spawn-server"
        );
    }
    if ctx.target.peer_url.is_some() {
        bail!("upgrade upgrades one server: every connection goes to --url (leave out --peer-url)");
    }
    let interval = args.interval();
    derp_load::target::check_fd_budget(args.pairs as usize * 2, false)?;
    let upgradee = Upgradee::open(args.upgrade_pid)?;
    let pairs = TricklePairs::connect(&ctx.target, args.pairs, args.concurrency).await?;

    let progress = Progress::start(
        args.warmup + args.baseline + args.after + Duration::from_secs(1),
        "upgrade",
    );
    let clock = ctx.clock;
    let start = Instant::now() + START_LEAD;
    let running = pairs.start(
        TrickleSpec {
            run: Ctx::run_id(),
            size: args.size as usize,
            interval,
            start,
        },
        clock,
    );
    let measured_from = start + args.warmup;
    tokio::time::sleep_until(measured_from).await;
    let cpu_before = sample_cpu(&ctx.target);
    tokio::time::sleep_until(measured_from + args.baseline).await;

    progress.message("upgrading".to_owned());
    let signal_at = Instant::now();
    let signalled = upgradee.signal();
    let exited = signalled.is_ok() && upgradee.exited(args.upgrade_timeout).await;
    let exit_at = Instant::now();
    if exited {
        progress.message("after the upgrade".to_owned());
        tokio::time::sleep_until(exit_at + args.after).await;
    }
    let end = Instant::now();
    let cpu_after = sample_cpu(&ctx.target);
    let records = running.finish().await;
    progress.finish();
    signalled?;

    let phases = Phases {
        measured_from_ns: clock.ns(measured_from),
        signal_ns: clock.ns(signal_at),
        exit_ns: clock.ns(exit_at),
    };
    let account = Account::of(&records, &phases);
    let cpu = CpuUse::between(
        cpu_before,
        cpu_after,
        end.saturating_duration_since(measured_from).as_secs_f64(),
    );
    ctx.check_cpu("the run", &cpu);
    let result = UpgradeResult {
        old_process_exited: exited,
        upgrade_s: exit_at.saturating_duration_since(signal_at).as_secs_f64(),
        before: phase(&account.before),
        during: phase(&account.during),
        after: phase(&account.after),
        sent_packets: account.sent,
        delivered_packets: account.delivered,
        lost_packets: account.lost,
        duplicated_packets: account.duplicated,
        out_of_order_packets: account.out_of_order,
        unsent_packets: account.unsent,
        broken_connections: account.broken_connections,
        breaks: account.breaks.clone(),
        break_examples: account.examples.clone(),
        cpu,
    };
    let failure = failure(args, &account, exited);
    let human = human(args, interval, &result);
    let config = UpgradeConfig {
        upgrade_pid: args.upgrade_pid,
        pairs: args.pairs,
        connections: args.pairs * 2,
        interval_ms: interval.as_secs_f64() * 1e3,
        send_spacing_us: interval.as_secs_f64() * 1e6 / f64::from(args.pairs),
        size_bytes: args.size,
        warmup_s: args.warmup.as_secs_f64(),
        baseline_s: args.baseline.as_secs_f64(),
        after_s: args.after.as_secs_f64(),
        upgrade_timeout_s: args.upgrade_timeout.as_secs_f64(),
        allow_broken: args.allow_broken,
    };
    let report = ctx.report(target_args, "upgrade", config, result);
    Ok(Outcome {
        json: serde_json::to_value(&report)?,
        human,
        warnings: ctx.warnings.clone(),
        failure,
    })
}

fn phase(f: &PhaseFigures) -> UpgradePhase {
    UpgradePhase {
        sent_packets: f.sent,
        delivered_packets: f.delivered,
        lost_packets: f.lost,
        delay: Spread::of(&f.delay),
        connection_max_delay: Spread::of(&f.conn_max_delay),
        connection_longest_gap: Spread::of(&f.conn_longest_gap),
    }
}

/// Why the run fails: the old process never left, or (unless allowed) something was lost,
/// repeated, reordered or broken.
fn failure(args: &UpgradeArgs, a: &Account, exited: bool) -> Option<String> {
    if !exited {
        return Some(format!(
            "process {} did not exit within {:?} of SIGUSR2: the upgrade failed or was called \
             off (see its log)",
            args.upgrade_pid, args.upgrade_timeout
        ));
    }
    if a.clean() || args.allow_broken {
        return None;
    }
    let breaks: Vec<String> = a.breaks.iter().map(|(k, n)| format!("{k} {n}")).collect();
    Some(format!(
        "clients noticed the upgrade: {} of {} connections broke ({}), {} packets lost, {} \
         repeated, {} out of order, {} never sent",
        a.broken_connections,
        args.pairs * 2,
        if breaks.is_empty() {
            "none".to_owned()
        } else {
            breaks.join(", ")
        },
        a.lost,
        a.duplicated,
        a.out_of_order,
        a.unsent
    ))
}

fn human(args: &UpgradeArgs, interval: Duration, r: &UpgradeResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "upgrade: {} pairs ({} connections), a packet per pair every {:?} (the fleet: one every \
         {:.1} µs), {} B; SIGUSR2 to {} after {:?} + {:?}",
        args.pairs,
        args.pairs * 2,
        interval,
        interval.as_secs_f64() * 1e6 / f64::from(args.pairs),
        args.size,
        args.upgrade_pid,
        args.warmup,
        args.baseline,
    );
    if r.old_process_exited {
        let _ = writeln!(
            out,
            "the old process exited {:.3} s after the signal",
            r.upgrade_s
        );
    } else {
        let _ = writeln!(out, "the old process did not exit");
    }
    let ms = |v: f64| format!("{v:.2}");
    let rows: Vec<Vec<String>> = [
        ("before", &r.before),
        ("during", &r.during),
        ("after", &r.after),
    ]
    .into_iter()
    .map(|(name, p)| {
        vec![
            name.to_owned(),
            p.sent_packets.to_string(),
            p.lost_packets.to_string(),
            ms(p.delay.p50_ms),
            ms(p.delay.p99_ms),
            ms(p.delay.max_ms),
            p.connection_max_delay.count.to_string(),
            ms(p.connection_max_delay.p50_ms),
            ms(p.connection_max_delay.p99_ms),
            ms(p.connection_longest_gap.p50_ms),
            ms(p.connection_longest_gap.p99_ms),
            ms(p.connection_longest_gap.max_ms),
        ]
    })
    .collect();
    out.push_str(&table(
        &[
            "sent",
            "packets",
            "lost",
            "delay p50 ms",
            "p99",
            "max",
            "pairs",
            "pair max delay p50",
            "p99",
            "pair longest gap p50",
            "p99",
            "max",
        ],
        &rows,
    ));
    let breaks: Vec<String> = r.breaks.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let _ = writeln!(
        out,
        "{} lost, {} repeated, {} out of order of {} packets; {} of {} connections broke{}",
        r.lost_packets,
        r.duplicated_packets,
        r.out_of_order_packets,
        r.sent_packets,
        r.broken_connections,
        args.pairs * 2,
        if breaks.is_empty() {
            String::new()
        } else {
            format!(" ({})", breaks.join(", "))
        }
    );
    for e in &r.break_examples {
        let _ = writeln!(out, "  {e}");
    }
    out
}
