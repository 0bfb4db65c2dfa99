//! A progress bar for long runs, drawn only when stderr is a terminal so piped or captured
//! output stays clean.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A time-based bar: it fills as the expected duration of the run elapses.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: ProgressBar,
    ticker: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts a bar for a run expected to take `expected`; hidden unless stderr is a
    /// terminal. Runs shorter than two seconds get no bar either.
    pub(crate) fn start(expected: Duration, what: &str) -> Self {
        let visible = std::io::stderr().is_terminal() && expected >= Duration::from_secs(2);
        if !visible {
            return Self {
                bar: ProgressBar::hidden(),
                ticker: None,
            };
        }
        let total_ms = expected.as_millis() as u64;
        let bar = ProgressBar::with_draw_target(Some(total_ms), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:40}] {elapsed} of about {prefix}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(format!("{}s", expected.as_secs()));
        bar.set_message(what.to_owned());
        let ticking = bar.clone();
        let start = Instant::now();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let done = start.elapsed().as_millis() as u64;
                // A run that overruns its estimate keeps the bar full rather than growing it.
                ticking.set_position(done.min(total_ms));
            }
        });
        Self {
            bar,
            ticker: Some(ticker),
        }
    }

    /// Updates the message next to the bar (e.g. "step 3").
    pub(crate) fn message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    /// Removes the bar.
    pub(crate) fn finish(self) {
        if let Some(t) = &self.ticker {
            t.abort();
        }
        self.bar.finish_and_clear();
    }
}
