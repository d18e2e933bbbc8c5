//! The one line a rank prints when one of its collectives times out or is stopped by the
//! watchdog, and the launcher's reading of the ranks' lines: which rank fell behind first.
//!
//! A hang shows on the ranks that wait, not on the rank that caused it (that one is asleep,
//! stuck on its device, or dead), so the diagnosis needs every rank's view: each waiting rank
//! says which call it was in and whom it waited for, and the launcher, which sees every rank's
//! output, names the rank the others waited for (torch's flight-recorder analysis does the
//! same from dumped files).

use serde::{Deserialize, Serialize};

use super::base::CommError;
use super::flight::FlightRecord;

/// What starts a flight line in a rank's standard error.
pub const FLIGHT_LINE: &str = "burn-zero flight: ";

/// One rank's account of the call it was stopped in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlightReport {
    /// The rank.
    pub rank: usize,
    /// How the call ended: `timeout` (it waited for other ranks), `watchdog` (a device
    /// collective did not complete in time) or `device error`.
    pub what: String,
    /// Number of the call among the rank's calls on the communicator.
    pub seq: u64,
    /// The call, as the error names it.
    pub call: String,
    /// The ranks it waited for, when the communicator knows them.
    pub waiting_for: Vec<usize>,
    /// The last call this rank started, and the last it saw complete.
    pub last_started: Option<u64>,
    /// See `last_started`.
    pub last_completed: Option<u64>,
}

impl FlightReport {
    /// A report of call `seq` (`call`) of `rank`, with what its flight record says.
    pub fn new(
        rank: usize,
        what: &str,
        (seq, call): (u64, String),
        waiting_for: Vec<usize>,
        record: &FlightRecord,
    ) -> Self {
        Self {
            rank,
            what: what.into(),
            seq,
            call,
            waiting_for,
            last_started: record.0.iter().map(|e| e.seq).max(),
            last_completed: record
                .0
                .iter()
                .filter(|e| e.took.is_some())
                .map(|e| e.seq)
                .max(),
        }
    }

    /// The line to print ([`FLIGHT_LINE`] and the report as JSON).
    pub fn line(&self) -> String {
        format!(
            "{FLIGHT_LINE}{}",
            serde_json::to_string(self).expect("a report serializes")
        )
    }

    /// The report in `line`, if it carries one (anywhere in it: the launcher prefixes lines).
    pub fn parse(line: &str) -> Option<Self> {
        let at = line.find(FLIGHT_LINE)? + FLIGHT_LINE.len();
        serde_json::from_str(&line[at..]).ok()
    }

    /// Prints the line to standard error.
    pub fn print(&self) {
        eprintln!("{}", self.line());
    }
}

/// `error` with `recent` as its flight record when it is a timeout, whose report is printed
/// when `print` (a process-level communicator); any other error as it is.
pub(crate) fn with_record(error: CommError, recent: FlightRecord, print: bool) -> CommError {
    match error {
        CommError::Timeout {
            rank,
            call,
            seq,
            missing,
            timeout,
            ..
        } => {
            if print {
                let at = (seq, call.to_string());
                FlightReport::new(rank, "timeout", at, missing.clone(), &recent).print();
            }
            CommError::Timeout {
                rank,
                call,
                seq,
                missing,
                timeout,
                recent,
            }
        }
        other => other,
    }
}

fn ranks(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(usize::to_string).collect();
    match list.len() {
        1 => format!("rank {}", names[0]),
        _ => format!("ranks {}", names.join(", ")),
    }
}

/// Which rank fell behind first, from the `reports` of a job of `world` ranks; `None` without
/// reports.
pub fn verdict(reports: &[FlightReport], world: usize) -> Option<String> {
    let first = reports.iter().min_by_key(|r| (r.seq, r.rank))?;
    let reporting: Vec<usize> = reports.iter().map(|r| r.rank).collect();
    let silent: Vec<usize> = (0..world).filter(|r| !reporting.contains(r)).collect();
    let mut waited: Vec<usize> = reports
        .iter()
        .flat_map(|r| r.waiting_for.iter().copied())
        .collect();
    waited.sort_unstable();
    waited.dedup();
    let waiters = |who: usize| -> Vec<usize> {
        let mut list: Vec<usize> = reports
            .iter()
            .filter(|r| r.waiting_for.contains(&who))
            .map(|r| r.rank)
            .collect();
        list.sort_unstable();
        list
    };
    let last_of = |rank: usize| reports.iter().find(|r| r.rank == rank);
    // The rank others waited for: one that left no report never reached their call; among
    // those that did report, the one whose last started call is the oldest.
    let behind = waited
        .iter()
        .copied()
        .find(|r| silent.contains(r))
        .or_else(|| {
            waited
                .iter()
                .copied()
                .min_by_key(|r| last_of(*r).and_then(|l| l.last_started))
        });
    if let Some(rank) = behind {
        let waited_in = reports
            .iter()
            .find(|r| r.waiting_for.contains(&rank))
            .unwrap_or(first);
        let its = match last_of(rank) {
            None => "it left no flight record (it never reached that call: stuck, asleep or \
                     stopped before it)"
                .to_string(),
            Some(l) => format!(
                "its own last call was #{} ({}, {})",
                l.last_started.unwrap_or(l.seq),
                l.call,
                l.what
            ),
        };
        return Some(format!(
            "rank {rank} fell behind first: {} waited for it in {} (#{}); {its}",
            ranks(&waiters(rank)),
            waited_in.call,
            waited_in.seq
        ));
    }
    // Device collectives: no rank knows whom it waits for.
    if !silent.is_empty() {
        return Some(format!(
            "{} left no flight record while {} waited in {} (#{}): the first of them fell behind \
             (stuck, or stopped before the watchdog fired)",
            ranks(&silent),
            ranks(&reporting),
            first.call,
            first.seq
        ));
    }
    let oldest = reports
        .iter()
        .min_by_key(|r| (r.last_started.unwrap_or(r.seq), r.rank))?;
    let newest = reports
        .iter()
        .map(|r| r.last_started.unwrap_or(r.seq))
        .max()?;
    if oldest.last_started.unwrap_or(oldest.seq) == newest {
        return Some(format!(
            "no rank fell behind: every rank started {} (#{}) and none saw it complete (a device \
             or link that stopped, or calls that differ between ranks)",
            first.call, first.seq
        ));
    }
    Some(format!(
        "rank {} fell behind first: its last call was #{} while others had started #{newest}",
        oldest.rank,
        oldest.last_started.unwrap_or(oldest.seq)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rank: usize, seq: u64, waiting_for: Vec<usize>, last: u64) -> FlightReport {
        FlightReport {
            rank,
            what: "timeout".into(),
            seq,
            call: "all_gather(bf16 × 8)".into(),
            waiting_for,
            last_started: Some(last),
            last_completed: Some(last.saturating_sub(1)),
        }
    }

    #[test]
    fn a_line_round_trips_through_the_launchers_prefix() {
        let r = report(2, 57, vec![1], 57);
        let line = format!("[rank 2] {}", r.line());
        assert_eq!(FlightReport::parse(&line), Some(r));
        assert_eq!(FlightReport::parse("[rank 2] step 3: loss 1.0"), None);
    }

    #[test]
    fn the_rank_everyone_waited_for_and_that_said_nothing_is_named() {
        let reports = [report(0, 57, vec![1], 57), report(2, 57, vec![1], 57)];
        let v = verdict(&reports, 3).unwrap();
        assert!(
            v.starts_with("rank 1 fell behind first: ranks 0, 2 waited for it in all_gather"),
            "{v}"
        );
        assert!(v.contains("(#57)"), "{v}");
        assert!(v.contains("left no flight record"), "{v}");
    }

    #[test]
    fn among_reporting_ranks_the_oldest_call_is_behind() {
        // Rank 1 waits in #40 for rank 0, which waits in #41 for rank 1 (it went on by a call).
        let reports = [report(0, 41, vec![1], 41), report(1, 40, vec![0], 40)];
        let v = verdict(&reports, 2).unwrap();
        assert!(v.starts_with("rank 1 fell behind first"), "{v}");
        assert!(v.contains("its own last call was #40"), "{v}");
    }

    #[test]
    fn device_hangs_without_a_laggard_say_so() {
        let mut a = report(0, 9, vec![], 9);
        let mut b = report(1, 9, vec![], 9);
        a.what = "watchdog".into();
        b.what = "watchdog".into();
        let v = verdict(&[a.clone(), b], 2).unwrap();
        assert!(
            v.starts_with("no rank fell behind: every rank started"),
            "{v}"
        );
        let v = verdict(&[a], 2).unwrap();
        assert!(
            v.starts_with("rank 1 left no flight record while rank 0 waited"),
            "{v}"
        );
        assert_eq!(verdict(&[], 2), None);
    }
}
