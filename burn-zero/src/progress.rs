//! A progress bar for training, evaluation and long saves, without a dependency: on a terminal
//! one line redrawn in place (carriage return), otherwise (a log, the launcher's pipes, CI) plain
//! lines, at most about [`Progress::max_lines`] of them, so logs stay readable.
//!
//! ```
//! use burn_zero::progress::Progress;
//! let mut out = Vec::new();
//! let mut bar = Progress::new(&mut out, "train", 4, false).max_lines(2);
//! for step in 1..=4 {
//!     bar.update(step, step as f64, &format!("loss {:.2}", 5.0 - step as f64)).unwrap();
//! }
//! bar.finish(4.0, "loss 1.00").unwrap();
//! assert_eq!(
//!     String::from_utf8(out).unwrap(),
//!     "train 2/4 [##########----------] loss 3.00  ETA 2s\n\
//!      train 4/4 [####################] loss 1.00  ETA 0s\n\
//!      train: 4/4 in 4s: loss 1.00\n"
//! );
//! ```

use std::io::{IsTerminal, Stdout, Write};

/// Characters of the bar.
const WIDTH: usize = 20;

/// Least time between two redraws on a terminal (the last one is always drawn).
const REDRAW_SECS: f64 = 0.1;

/// One task's progress: `done` of `total` units, with the caller's own figures (loss, LR,
/// tokens/s) and an ETA from the time so far.
pub struct Progress<W: Write> {
    out: W,
    label: String,
    total: u64,
    redraw: bool,
    every: u64,
    /// Units done before this run started (a resumed training): not counted in the ETA.
    base: u64,
    /// The time of the last redraw, and the length of what it drew (to blank it out).
    drawn: Option<(f64, usize)>,
}

impl Progress<Stdout> {
    /// On stdout: redrawn in place when stdout is a terminal.
    pub fn stdout(label: impl Into<String>, total: u64) -> Self {
        let redraw = std::io::stdout().is_terminal();
        Self::new(std::io::stdout(), label, total, redraw)
    }
}

impl<W: Write> Progress<W> {
    /// `label` starts every line; `redraw`: one line rewritten with `\r` (a terminal) instead
    /// of one line per update.
    pub fn new(out: W, label: impl Into<String>, total: u64, redraw: bool) -> Self {
        Self {
            out,
            label: label.into(),
            total: total.max(1),
            redraw,
            every: 1,
            base: 0,
            drawn: None,
        }
    }

    /// Without a terminal, writes only every `total / lines`-th update (and the last).
    pub fn max_lines(mut self, lines: u64) -> Self {
        self.every = self.total.div_ceil(lines.max(1));
        self
    }

    /// Counts from `done` (a resumed run): the ETA is from the units done since.
    pub fn starting_at(mut self, done: u64) -> Self {
        self.base = done.min(self.total);
        self
    }

    /// Whether lines are redrawn in place.
    pub fn redraws(&self) -> bool {
        self.redraw
    }

    /// `done` units after `elapsed` seconds (the caller's clock: time it should not count,
    /// such as checkpoint writing, left out); `fields` are shown before the ETA.
    pub fn update(&mut self, done: u64, elapsed: f64, fields: &str) -> std::io::Result<()> {
        let done = done.min(self.total);
        let last = done == self.total;
        if self.redraw {
            if let Some((at, _)) = self.drawn
                && elapsed - at < REDRAW_SECS
                && !last
            {
                return Ok(());
            }
        } else if !(last || done.is_multiple_of(self.every)) {
            return Ok(());
        }
        let eta = if done <= self.base {
            "?".to_string()
        } else {
            duration(elapsed / (done - self.base) as f64 * (self.total - done) as f64)
        };
        let filled = (WIDTH as u64 * done / self.total) as usize;
        let bar = format!("{}{}", "#".repeat(filled), "-".repeat(WIDTH - filled));
        let sep = if fields.is_empty() { "" } else { "  " };
        let line = format!(
            "{} {done}/{} [{bar}] {fields}{sep}ETA {eta}",
            self.label, self.total
        );
        if self.redraw {
            let pad = self
                .drawn
                .map_or(0, |(_, len)| len.saturating_sub(line.len()));
            write!(self.out, "\r{line}{}", " ".repeat(pad))?;
            // What is on screen now: the padding too.
            self.drawn = Some((elapsed, line.len() + pad));
        } else {
            writeln!(self.out, "{line}")?;
        }
        self.out.flush()
    }

    /// On a terminal, `LABEL ...` until the first update: a task that reports no units
    /// (a save) shows that it runs. Nothing otherwise.
    pub fn start(&mut self) -> std::io::Result<()> {
        if self.redraw {
            let line = format!("{} ...", self.label);
            write!(self.out, "\r{line}")?;
            self.drawn = Some((f64::NEG_INFINITY, line.len()));
        }
        self.out.flush()
    }

    /// Blanks the bar on a terminal, so that other output starts on a clean line; the next
    /// update draws it again. Nothing otherwise.
    pub fn clear(&mut self) -> std::io::Result<()> {
        if self.redraw
            && let Some((_, len)) = self.drawn.take()
        {
            write!(self.out, "\r{}\r", " ".repeat(len))?;
        }
        self.out.flush()
    }

    /// The summary line after `elapsed` seconds (replacing the bar on a terminal):
    /// `LABEL: DONE/TOTAL in TIME: SUMMARY`, or `LABEL: done in TIME: SUMMARY` for a task of
    /// one unit.
    pub fn finish(&mut self, elapsed: f64, summary: &str) -> std::io::Result<()> {
        self.clear()?;
        let sep = if summary.is_empty() { "" } else { ": " };
        let count = if self.total == 1 {
            "done".to_string()
        } else {
            format!("{}/{}", self.total, self.total)
        };
        writeln!(
            self.out,
            "{}: {count} in {}{sep}{summary}",
            self.label,
            duration(elapsed)
        )?;
        self.out.flush()
    }
}

/// `42s`, `3m05s`, `2h07m`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "?".into();
    }
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_at_most_every_nth_update_and_the_last() {
        let mut out = Vec::new();
        let mut bar = Progress::new(&mut out, "train", 5, false).max_lines(2);
        for step in 1..=5u64 {
            let fields = format!("loss {:.2}  {} tokens/s", 4.0 - step as f64 * 0.5, 100);
            bar.update(step, step as f64 * 2.0, &fields).unwrap();
        }
        bar.finish(10.0, "loss 1.50, 100 tokens/s").unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            vec![
                "train 3/5 [############--------] loss 2.50  100 tokens/s  ETA 4s",
                "train 5/5 [####################] loss 1.50  100 tokens/s  ETA 0s",
                "train: 5/5 in 10s: loss 1.50, 100 tokens/s",
            ]
        );
        assert!(!text.contains('\r'));
    }

    #[test]
    fn a_terminal_gets_one_line_redrawn_and_blanked() {
        let mut out = Vec::new();
        let mut bar = Progress::new(&mut out, "eval", 2, true);
        bar.update(1, 100.0, "window").unwrap();
        // Too soon after the last redraw, and not the last: skipped.
        bar.update(1, 100.05, "window").unwrap();
        bar.update(2, 200.0, "").unwrap();
        bar.finish(200.0, "").unwrap();
        let text = String::from_utf8(out).unwrap();
        let first = "eval 1/2 [##########----------] window  ETA 1m40s";
        let second = "eval 2/2 [####################] ETA 0s";
        let pad = " ".repeat(first.len() - second.len());
        let blank = " ".repeat(first.len());
        assert_eq!(
            text,
            format!("\r{first}\r{second}{pad}\r{blank}\reval: 2/2 in 3m20s\n")
        );
    }

    #[test]
    fn a_resumed_run_counts_its_eta_from_where_it_started() {
        let mut out = Vec::new();
        let mut bar = Progress::new(&mut out, "train", 8, false).starting_at(4);
        bar.update(6, 10.0, "").unwrap();
        let mut save = Progress::new(&mut out, "save checkpoint", 1, false);
        save.start().unwrap();
        save.finish(2.4, "runs/x").unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "train 6/8 [###############-----] ETA 10s\nsave checkpoint: done in 2s: runs/x\n"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(duration(0.4), "0s");
        assert_eq!(duration(59.6), "1m00s");
        assert_eq!(duration(125.0), "2m05s");
        assert_eq!(duration(7620.0), "2h07m");
        assert_eq!(duration(f64::NAN), "?");
    }
}
