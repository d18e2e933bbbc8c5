//! A flight recorder of one rank's last collectives: what a rank says when a call times out, so
//! a hang is diagnosed from the error alone (which call each rank was in, which completed and
//! how long they took), as torch's NCCL flight recorder does.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::base::OpSignature;

/// Calls a record keeps.
pub const FLIGHT_RECORD_LEN: usize = 16;

/// One call: its signature, its number among this communicator's calls, its bytes, and how
/// long it took (`None` while it has not returned).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlightEntry {
    /// Number of the call among this rank's calls on this communicator, from 0.
    pub seq: u64,
    /// The call.
    pub call: OpSignature,
    /// Bytes this rank contributed.
    pub bytes: usize,
    /// How long after the recorder's start the call began.
    pub started: Duration,
    /// How long it took; `None` while in flight (or when it failed).
    pub took: Option<Duration>,
}

/// The last [`FLIGHT_RECORD_LEN`] calls of a rank, oldest first (empty when none was recorded).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlightRecord(pub Vec<FlightEntry>);

impl fmt::Display for FlightRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return Ok(());
        }
        write!(f, "; its last {} calls, oldest first:", self.0.len())?;
        for e in &self.0 {
            write!(
                f,
                "\n  #{} {} ({} bytes) at +{:.3} s: ",
                e.seq,
                e.call,
                e.bytes,
                e.started.as_secs_f64()
            )?;
            match e.took {
                Some(took) => write!(f, "done in {:.3} ms", took.as_secs_f64() * 1e3)?,
                None => f.write_str("did not complete")?,
            }
        }
        Ok(())
    }
}

/// Records calls as they start and end (a few nanoseconds of locking per call).
#[derive(Debug)]
pub struct FlightRecorder {
    origin: Instant,
    state: Mutex<(u64, VecDeque<FlightEntry>)>,
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            state: Mutex::new((0, VecDeque::with_capacity(FLIGHT_RECORD_LEN))),
        }
    }
}

impl FlightRecorder {
    /// Notes that `call` starts; returns its number for [`FlightRecorder::end`].
    pub fn start(&self, call: OpSignature) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let seq = state.0;
        state.0 += 1;
        if state.1.len() == FLIGHT_RECORD_LEN {
            state.1.pop_front();
        }
        state.1.push_back(FlightEntry {
            seq,
            call,
            bytes: call.count * call.dtype.size(),
            started: self.origin.elapsed(),
            took: None,
        });
        seq
    }

    /// Notes that call `seq` returned successfully.
    pub fn end(&self, seq: u64) {
        let elapsed = self.origin.elapsed();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = state.1.iter_mut().rev().find(|e| e.seq == seq) {
            e.took = Some(elapsed.saturating_sub(e.started));
        }
    }

    /// The calls kept, oldest first.
    pub fn record(&self) -> FlightRecord {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        FlightRecord(state.1.iter().cloned().collect())
    }
}
