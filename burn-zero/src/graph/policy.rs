//! When a step runs eagerly, is captured, or is replayed: decided from what the step looks like
//! (its inputs' shapes and its place in gradient accumulation), with no device in sight.

use std::collections::HashMap;

/// What identifies a step's graph: a replay is right only for a step that launches the same
/// kernels on the same shapes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Each input's shape.
    pub shapes: Vec<Vec<usize>>,
    /// Anything else the step's work depends on, in the caller's terms (the engine's: the
    /// micro-step's place in gradient accumulation and the loss scale's bits).
    pub variant: Vec<u64>,
    /// The closure's type name: another closure on inputs of the same shapes is another step.
    pub closure: &'static str,
}

/// What to do with one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphAction {
    /// Run eagerly on the caller's stream: graphs are off or this step's capture failed.
    Eager,
    /// Run eagerly on the graphs' stream, so its memory pool and libraries are ready.
    Warm,
    /// Capture the step, then replay it once.
    Capture,
    /// Replay the step's graph.
    Replay,
}

#[derive(Debug)]
struct Entry {
    warm_runs: usize,
    captured: bool,
    refused: bool,
    last_used: u64,
}

/// The decisions for every key seen: `warmup` eager runs on the graphs' stream, then a capture,
/// then replays; at most `max_graphs` graphs kept, the least recently used dropped first.
#[derive(Debug)]
pub struct GraphPolicy {
    warmup: usize,
    max_graphs: usize,
    clock: u64,
    entries: HashMap<GraphKey, Entry>,
}

impl GraphPolicy {
    /// `warmup` eager runs before a key is captured (at least 1: the graphs' stream must have
    /// run the step once); `max_graphs` at least 1.
    pub fn new(warmup: usize, max_graphs: usize) -> Self {
        Self {
            warmup: warmup.max(1),
            max_graphs: max_graphs.max(1),
            clock: 0,
            entries: HashMap::new(),
        }
    }

    /// What to do with a step of `key`.
    pub fn decide(&mut self, key: &GraphKey) -> GraphAction {
        self.clock += 1;
        let clock = self.clock;
        let warmup = self.warmup;
        let entry = self.entries.entry(key.clone()).or_insert(Entry {
            warm_runs: 0,
            captured: false,
            refused: false,
            last_used: clock,
        });
        entry.last_used = clock;
        if entry.refused {
            GraphAction::Eager
        } else if entry.captured {
            GraphAction::Replay
        } else if entry.warm_runs < warmup {
            entry.warm_runs += 1;
            GraphAction::Warm
        } else {
            GraphAction::Capture
        }
    }

    /// What [`GraphPolicy::decide`] would answer for `key` now, deciding nothing.
    pub fn peek(&self, key: &GraphKey) -> GraphAction {
        match self.entries.get(key) {
            Some(e) if e.refused => GraphAction::Eager,
            Some(e) if e.captured => GraphAction::Replay,
            Some(e) if e.warm_runs >= self.warmup => GraphAction::Capture,
            _ => GraphAction::Warm,
        }
    }

    /// Forgets `key`'s graph (not a refusal): its next step warms up and is captured anew.
    pub fn forget(&mut self, key: &GraphKey) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.captured = false;
            entry.warm_runs = 0;
        }
    }

    /// Records that `key`'s step was captured; returns the keys whose graphs to drop now to
    /// keep at most `max_graphs`.
    pub fn captured(&mut self, key: &GraphKey) -> Vec<GraphKey> {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.captured = true;
        }
        let mut held: Vec<(u64, GraphKey)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.captured)
            .map(|(k, e)| (e.last_used, k.clone()))
            .collect();
        held.sort_by_key(|(used, _)| *used);
        let excess = held.len().saturating_sub(self.max_graphs);
        held.into_iter()
            .take(excess)
            .map(|(_, k)| {
                // Dropped, not refused: seen again, it warms up and is captured anew.
                let entry = self.entries.get_mut(&k).expect("held");
                entry.captured = false;
                entry.warm_runs = 0;
                k
            })
            .collect()
    }

    /// Records that `key`'s step cannot be captured: it runs eagerly from now on.
    pub fn refuse(&mut self, key: &GraphKey) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.refused = true;
            entry.captured = false;
        }
    }

    /// Forgets every graph (the model or its parameters' memory changed): each key warms up and
    /// is captured anew; refusals stay.
    pub fn reset(&mut self) {
        for entry in self.entries.values_mut() {
            entry.captured = false;
            entry.warm_runs = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seq: usize, variant: u64) -> GraphKey {
        GraphKey {
            shapes: vec![vec![4, seq]],
            variant: vec![variant],
            closure: "step",
        }
    }

    #[test]
    fn warms_up_captures_once_then_replays() {
        let mut p = GraphPolicy::new(2, 4);
        let k = key(256, 0);
        assert_eq!(p.decide(&k), GraphAction::Warm);
        assert_eq!(p.decide(&k), GraphAction::Warm);
        assert_eq!(p.decide(&k), GraphAction::Capture);
        assert!(p.captured(&k).is_empty());
        for _ in 0..5 {
            assert_eq!(p.decide(&k), GraphAction::Replay);
        }
    }

    #[test]
    fn a_new_shape_is_captured_anew_not_replayed() {
        let mut p = GraphPolicy::new(1, 4);
        let (a, b) = (key(256, 0), key(512, 0));
        assert_eq!(p.decide(&a), GraphAction::Warm);
        assert_eq!(p.decide(&a), GraphAction::Capture);
        p.captured(&a);
        assert_eq!(p.decide(&b), GraphAction::Warm);
        assert_eq!(p.decide(&b), GraphAction::Capture);
        p.captured(&b);
        assert_eq!(p.decide(&a), GraphAction::Replay);
        assert_eq!(p.decide(&b), GraphAction::Replay);
        // The micro-step's place is part of the key too, and so is the closure.
        assert_eq!(p.decide(&key(256, 1)), GraphAction::Warm);
        let other = GraphKey {
            closure: "another step",
            ..key(256, 0)
        };
        assert_eq!(p.decide(&other), GraphAction::Warm);
    }

    #[test]
    fn peek_agrees_with_decide_and_forget_recaptures() {
        let mut p = GraphPolicy::new(2, 4);
        let k = key(64, 0);
        for _ in 0..3 {
            let peeked = p.peek(&k);
            assert_eq!(p.decide(&k), peeked);
        }
        p.captured(&k);
        assert_eq!(p.peek(&k), GraphAction::Replay);
        p.forget(&k);
        assert_eq!(p.peek(&k), GraphAction::Warm);
        assert_eq!(p.decide(&k), GraphAction::Warm);
    }

    #[test]
    fn keeps_at_most_max_graphs_dropping_the_least_recently_used() {
        let mut p = GraphPolicy::new(1, 2);
        let keys = [key(1, 0), key(2, 0), key(3, 0)];
        for k in &keys[..2] {
            p.decide(k);
            p.decide(k);
            assert!(p.captured(k).is_empty());
        }
        assert_eq!(p.decide(&keys[0]), GraphAction::Replay); // keys[1] is now the oldest
        p.decide(&keys[2]);
        assert_eq!(p.decide(&keys[2]), GraphAction::Capture);
        assert_eq!(p.captured(&keys[2]), vec![keys[1].clone()]);
        assert_eq!(p.decide(&keys[1]), GraphAction::Warm);
        assert_eq!(p.decide(&keys[0]), GraphAction::Replay);
    }

    #[test]
    fn a_refused_key_stays_eager_and_reset_recaptures_the_rest() {
        let mut p = GraphPolicy::new(1, 4);
        let (a, b) = (key(8, 0), key(8, 1));
        for k in [&a, &b] {
            p.decide(k);
            assert_eq!(p.decide(k), GraphAction::Capture);
        }
        p.refuse(&a);
        p.captured(&b);
        assert_eq!(p.decide(&a), GraphAction::Eager);
        assert_eq!(p.decide(&b), GraphAction::Replay);
        p.reset();
        assert_eq!(p.decide(&a), GraphAction::Eager);
        assert_eq!(p.decide(&b), GraphAction::Warm);
        assert_eq!(p.decide(&b), GraphAction::Capture);
    }
}
