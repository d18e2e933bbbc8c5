//! `LocalComm`: N ranks as threads of one process, with checked sequence numbers.
//!
//! Each collective is a *round* keyed by its sequence number: every rank deposits its
//! signature and a copy of its input, waits (with a deadline) until all have arrived, then
//! computes its own result from all deposits in rank order, so every rank gets bitwise the
//! same reduction. The first disagreement or timeout aborts the whole group, so no rank
//! waits on a peer that has already failed.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::base::*;
use super::exchange::{Exchange, next_seq};
use super::flight::FlightRecorder;
use super::reduce::Payload;

/// The shared state of one group of thread ranks; makes its [`LocalComm`]s.
#[derive(Clone)]
pub struct LocalGroup {
    shared: Arc<Shared>,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    rounds: HashMap<u64, Round>,
    mailboxes: HashMap<(usize, usize), VecDeque<Message>>,
    aborted: Option<String>,
}

struct Round {
    calls: Vec<Option<OpSignature>>,
    inputs: Vec<Option<Arc<Payload>>>,
    arrived: usize,
    departed: usize,
    failure: Option<CommError>,
}

struct Message {
    seq: u64,
    call: OpSignature,
    payload: Payload,
}

impl LocalGroup {
    /// A group of `world_size` ranks with the default timeout.
    pub fn new(world_size: usize) -> Self {
        Self::with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// A group whose ranks fail a call after waiting `timeout` for the others.
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Self {
        assert!(
            world_size > 0,
            "a communicator group needs at least one rank"
        );
        Self {
            shared: Arc::new(Shared {
                world_size,
                timeout,
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
        }
    }

    /// The communicator of `rank`. Make exactly one per rank.
    pub fn comm(&self, rank: usize) -> LocalComm {
        assert!(
            rank < self.shared.world_size,
            "rank {rank} is outside the group"
        );
        LocalComm {
            rank,
            shared: self.shared.clone(),
            seq: AtomicU64::new(0),
            sent: Mutex::new(HashMap::new()),
            received: Mutex::new(HashMap::new()),
            flight: FlightRecorder::default(),
            timeout: TimeoutCell::new(self.shared.timeout),
        }
    }

    /// Fails every pending and future call of the group with `reason` (a rank died).
    pub fn abort(&self, reason: impl Into<String>) {
        self.shared.abort(reason.into());
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves consistent state behind: every
        // update below is completed before anything that can panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort(&self, reason: String) {
        let mut state = self.lock();
        state.aborted.get_or_insert(reason);
        self.changed.notify_all();
    }

    /// Stops the group because of `failure`, wakes every waiter, and returns the failure.
    fn fail(&self, state: &mut State, failure: CommError) -> CommError {
        state.aborted.get_or_insert(failure.to_string());
        self.changed.notify_all();
        failure
    }

    /// Waits until `poll` yields a result, the group aborts, or `deadline` passes (then the
    /// error from `on_timeout` stops the group).
    fn wait<R>(
        &self,
        mut state: MutexGuard<'_, State>,
        deadline: Instant,
        mut poll: impl FnMut(&mut State) -> Option<Result<R, CommError>>,
        on_timeout: impl FnOnce(&State) -> CommError,
    ) -> Result<R, CommError> {
        loop {
            if let Some(result) = poll(&mut state) {
                return result;
            }
            if let Some(reason) = &state.aborted {
                return Err(CommError::Aborted(reason.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                let failure = on_timeout(&state);
                return Err(self.fail(&mut state, failure));
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One rank's communicator in a [`LocalGroup`].
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    seq: AtomicU64,
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
    flight: FlightRecorder,
    /// This rank's own (the group's until set): ranks of one group may be held to different
    /// timeouts, as processes are.
    timeout: TimeoutCell,
}

impl LocalComm {
    /// Deposits this rank's input for the next collective and returns every rank's input.
    fn round(&self, call: OpSignature, input: Payload) -> Result<Vec<Arc<Payload>>, CommError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let world = self.shared.world_size;
        let deadline = Instant::now() + self.timeout.get();
        let mut state = self.shared.lock();
        if let Some(reason) = &state.aborted {
            return Err(CommError::Aborted(reason.clone()));
        }
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            calls: vec![None; world],
            inputs: vec![None; world],
            arrived: 0,
            departed: 0,
            failure: None,
        });
        if let Some((other, other_call)) = round
            .calls
            .iter()
            .enumerate()
            .find_map(|(r, c)| c.filter(|c| *c != call).map(|c| (r, c)))
        {
            let failure = CommError::Mismatch {
                seq,
                rank_a: other,
                call_a: other_call,
                rank_b: self.rank,
                call_b: call,
            };
            round.failure = Some(failure.clone());
            return Err(self.shared.fail(&mut state, failure));
        }
        round.calls[self.rank] = Some(call);
        round.inputs[self.rank] = Some(Arc::new(input));
        round.arrived += 1;
        self.shared.changed.notify_all();

        let poll = |st: &mut State| {
            let round = st
                .rounds
                .get_mut(&seq)
                .expect("a round lives until all depart");
            if let Some(failure) = &round.failure {
                return Some(Err(failure.clone()));
            }
            if round.arrived < world {
                return None;
            }
            let inputs = round
                .inputs
                .iter()
                .map(|i| i.clone().expect("arrived"))
                .collect();
            round.departed += 1;
            if round.departed == world {
                st.rounds.remove(&seq);
            }
            Some(Ok(inputs))
        };
        let on_timeout = |st: &State| CommError::Timeout {
            rank: self.rank,
            call,
            seq,
            missing: (0..world)
                .filter(|r| st.rounds[&seq].calls[*r].is_none())
                .collect(),
            timeout: self.timeout.get(),
            recent: Default::default(),
        };
        self.shared.wait(state, deadline, poll, on_timeout)
    }
}

impl Exchange for LocalComm {
    fn flight(&self) -> &FlightRecorder {
        &self.flight
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout)
    }

    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn exchange(&self, call: OpSignature, input: Payload) -> Result<Vec<Arc<Payload>>, CommError> {
        self.round(call, input)
    }

    fn post(&self, peer: usize, call: OpSignature, payload: Payload) -> Result<(), CommError> {
        let seq = next_seq(&self.sent, peer);
        let mut state = self.shared.lock();
        if let Some(reason) = &state.aborted {
            return Err(CommError::Aborted(reason.clone()));
        }
        let message = Message { seq, call, payload };
        state
            .mailboxes
            .entry((self.rank, peer))
            .or_default()
            .push_back(message);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn take(&self, peer: usize, call: OpSignature) -> Result<Payload, CommError> {
        let seq = next_seq(&self.received, peer);
        let deadline = Instant::now() + self.timeout.get();
        let state = self.shared.lock();
        let poll = |st: &mut State| {
            let message = st.mailboxes.get_mut(&(peer, self.rank))?.pop_front()?;
            debug_assert_eq!(message.seq, seq, "mailboxes are FIFO per pair");
            if message.call != call {
                let failure = CommError::Mismatch {
                    seq,
                    rank_a: peer,
                    call_a: message.call,
                    rank_b: self.rank,
                    call_b: call,
                };
                return Some(Err(self.shared.fail(st, failure)));
            }
            Some(Ok(message.payload))
        };
        let on_timeout = |_: &State| CommError::Timeout {
            rank: self.rank,
            call,
            seq,
            missing: vec![peer],
            timeout: self.timeout.get(),
            recent: Default::default(),
        };
        self.shared.wait(state, deadline, poll, on_timeout)
    }
}
