//! The tracer: records the step's order of uses, replays it and proposes prefetch batches.

/// A sharded parameter, as the coordinator names it (burn's `ParamId` value).
pub type HandleId = u64;

/// The budgets of DeepSpeed's `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`,
/// in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceConfig {
    /// Elements gathered ahead of use and not yet used: a batch is proposed once at most half
    /// of this is in flight, and filled while less than this is (the last handle may overshoot
    /// it). 0: no prefetch.
    pub prefetch_bucket_size: usize,
    /// Elements of full parameters alive (in use or prefetched), at most, counting prefetches;
    /// an on-demand gather is never refused.
    pub max_live_parameters: usize,
    /// `stage3_max_reuse_distance`: a released parameter that the trace uses again within
    /// this many elements of gathers is kept instead of freed and gathered again.
    pub max_reuse_distance: usize,
}

/// What the tracer knows about the order of the current step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceMode {
    /// No usable trace: uses are recorded, nothing is prefetched.
    Record,
    /// The previous step's order is replayed and prefetched.
    Replay,
}

/// The answer to one use of a handle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Use {
    /// The full tensor was prefetched: use it, do not gather.
    pub prefetched: bool,
    /// Handles to start gathering now, in order.
    pub prefetch: Vec<HandleId>,
    /// Prefetched handles that the invalidated trace will not use: free them.
    pub evict: Vec<HandleId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Live {
    Prefetched,
    /// Released by its last use but reused soon by the trace: kept, no gather in flight.
    Kept,
    /// Held by this many uses not yet released.
    InUse(usize),
}

/// Records, replays and budgets the gathers of sharded parameters.
#[derive(Debug)]
pub struct GatherTracer {
    config: TraceConfig,
    /// The order to replay (valid in [`TraceMode::Replay`]).
    trace: Vec<(HandleId, usize)>,
    /// This step's uses so far.
    recording: Vec<(HandleId, usize)>,
    mode: TraceMode,
    /// Position in `trace` of the next expected use.
    cursor: usize,
    live: std::collections::HashMap<HandleId, (usize, Live)>,
    live_numel: usize,
    in_flight_numel: usize,
    peak_live_numel: usize,
    invalidations: usize,
}

impl GatherTracer {
    /// A tracer with nothing recorded.
    pub fn new(config: TraceConfig) -> Self {
        Self {
            config,
            trace: Vec::new(),
            recording: Vec::new(),
            mode: TraceMode::Record,
            cursor: 0,
            live: Default::default(),
            live_numel: 0,
            in_flight_numel: 0,
            peak_live_numel: 0,
            invalidations: 0,
        }
    }

    /// Starts a step: the uses recorded in the last step become the trace, unless that step
    /// replayed the trace to its end already (then it stays). A replay that stopped short of
    /// the end is a change of order too: it is re-recorded.
    pub fn begin_step(&mut self) {
        let recorded = std::mem::take(&mut self.recording);
        match self.mode {
            TraceMode::Record if !recorded.is_empty() => {
                self.trace = recorded;
                self.mode = TraceMode::Replay;
            }
            TraceMode::Replay if self.cursor != self.trace.len() => {
                self.invalidations += 1;
                self.trace = recorded;
                self.mode = if self.trace.is_empty() {
                    TraceMode::Record
                } else {
                    TraceMode::Replay
                };
            }
            _ => {}
        }
        self.cursor = 0;
    }

    /// A use of handle `id` (`numel` elements when full): whether it is already gathered,
    /// what to prefetch, what to evict. The caller gathers it when not `prefetched`, and calls
    /// [`GatherTracer::release`] when done with the full tensor.
    pub fn on_use(&mut self, id: HandleId, numel: usize) -> Use {
        self.recording.push((id, numel));
        let mut answer = Use::default();
        match self.live.get_mut(&id) {
            Some((_, state)) => {
                *state = match *state {
                    Live::Prefetched => {
                        self.in_flight_numel -= numel;
                        Live::InUse(1)
                    }
                    Live::Kept => Live::InUse(1),
                    // Used again while alive (tied weights): the live gather serves it.
                    Live::InUse(n) => Live::InUse(n + 1),
                };
                answer.prefetched = true;
            }
            None => {
                self.live.insert(id, (numel, Live::InUse(1)));
                self.add_live(numel);
            }
        }
        if self.mode == TraceMode::Replay {
            if self.trace.get(self.cursor).map(|e| e.0) == Some(id) {
                self.cursor += 1;
                answer.prefetch = self.plan_prefetch();
            } else {
                answer.evict = self.invalidate();
            }
        }
        answer
    }

    /// One use of `id` is done with the full tensor (or a prefetch of it is dropped). Returns
    /// whether the caller should free it now: not while other uses hold it, nor when the
    /// trace uses it again within `max_reuse_distance` (it then counts as prefetched).
    pub fn release(&mut self, id: HandleId) -> bool {
        let Some(&(numel, state)) = self.live.get(&id) else {
            return true;
        };
        match state {
            Live::InUse(n) if n > 1 => {
                self.live.insert(id, (numel, Live::InUse(n - 1)));
                false
            }
            // Keeping it adds no live elements and no traffic.
            Live::InUse(_) if self.reused_soon(id) => {
                self.live.insert(id, (numel, Live::Kept));
                false
            }
            _ => {
                self.forget(id);
                true
            }
        }
    }

    /// Whether the replayed trace uses `id` again within `max_reuse_distance` elements.
    fn reused_soon(&self, id: HandleId) -> bool {
        if self.mode != TraceMode::Replay {
            return false;
        }
        let mut distance = 0;
        for &(next, numel) in &self.trace[self.cursor..] {
            if next == id {
                return true;
            }
            distance += numel;
            if distance > self.config.max_reuse_distance {
                return false;
            }
        }
        false
    }

    /// Forgets every live handle (their values are stale once the parameters change); the
    /// trace itself is kept.
    pub fn drop_live(&mut self) {
        let ids: Vec<HandleId> = self.live.keys().copied().collect();
        for id in ids {
            self.forget(id);
        }
    }

    /// Whether the current step replays a trace.
    pub fn mode(&self) -> TraceMode {
        self.mode
    }

    /// Elements of full parameters alive now.
    pub fn live_numel(&self) -> usize {
        self.live_numel
    }

    /// The most elements alive at once so far.
    pub fn peak_live_numel(&self) -> usize {
        self.peak_live_numel
    }

    /// How many times a change of order dropped the trace.
    pub fn invalidations(&self) -> usize {
        self.invalidations
    }

    /// Stops tracking `id`: its elements leave the live (and in-flight) counts.
    fn forget(&mut self, id: HandleId) {
        if let Some((numel, state)) = self.live.remove(&id) {
            self.live_numel -= numel;
            if state == Live::Prefetched {
                self.in_flight_numel -= numel;
            }
        }
    }

    fn add_live(&mut self, numel: usize) {
        self.live_numel += numel;
        self.peak_live_numel = self.peak_live_numel.max(self.live_numel);
    }

    /// The next handles of the trace, in order, as one batch (the caller gathers a batch with
    /// one collective): nothing while more than half the bucket is in flight; otherwise
    /// handles while less than the bucket is in flight, so the last may overshoot it by one
    /// handle, as DeepSpeed's prefetch does (a parameter larger than the bucket is still
    /// prefetched). The batches are then about half a bucket, issued half a bucket to a bucket
    /// ahead of use. The live budget is never exceeded; the first handle that does not fit it
    /// ends the batch (prefetching out of order would spend the budget on later layers).
    fn plan_prefetch(&mut self) -> Vec<HandleId> {
        let bucket = self.config.prefetch_bucket_size;
        let mut issued = Vec::new();
        if self.in_flight_numel.saturating_mul(2) > bucket {
            return issued;
        }
        for i in self.cursor..self.trace.len() {
            let (id, numel) = self.trace[i];
            if self.live.contains_key(&id) {
                continue;
            }
            if self.in_flight_numel >= bucket
                || self.live_numel + numel > self.config.max_live_parameters
            {
                break;
            }
            self.live.insert(id, (numel, Live::Prefetched));
            self.in_flight_numel += numel;
            self.add_live(numel);
            issued.push(id);
        }
        issued
    }

    /// Drops the trace for the rest of this step; prefetched handles not yet used go.
    fn invalidate(&mut self) -> Vec<HandleId> {
        self.invalidations += 1;
        self.mode = TraceMode::Record;
        self.trace.clear();
        let mut evict: Vec<HandleId> = self
            .live
            .iter()
            .filter(|(_, (_, s))| matches!(s, Live::Prefetched | Live::Kept))
            .map(|(id, _)| *id)
            .collect();
        evict.sort_unstable();
        for id in &evict {
            self.forget(*id);
        }
        evict
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
