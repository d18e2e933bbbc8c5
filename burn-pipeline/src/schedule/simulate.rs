//! Running a set of streams without a model: deadlocks, messages out of order, the memory a
//! stream holds, and, given a cost per computation, each rank's busy and idle time (the
//! schedule's theoretical bubble).

use std::collections::{HashMap, VecDeque};

use super::Instr;

/// The most micro-batches alive at once on a rank, over all its chunks: forwarded and not yet
/// done with (by a whole backward, or by the weight half of a split one). What its
/// activation memory holds.
pub fn peak_in_flight(stream: &[Instr]) -> usize {
    let (mut alive, mut peak) = (0usize, 0usize);
    for instr in stream {
        match instr {
            Instr::Forward { .. } => {
                alive += 1;
                peak = peak.max(alive);
            }
            Instr::Backward { .. } | Instr::BackwardWeight { .. } => alive -= 1,
            _ => {}
        }
    }
    peak
}

/// A run of every rank's stream: the global order the simulator executed, and per rank the
/// time its last instruction ended and the time it computed.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// `(rank, instruction)` in the order the simulator ran them.
    pub order: Vec<(usize, Instr)>,
    /// When each rank finished.
    pub end: Vec<f64>,
    /// How long each rank computed.
    pub busy: Vec<f64>,
}

impl Timeline {
    /// The step's length: when the last rank finished.
    pub fn makespan(&self) -> f64 {
        self.end.iter().copied().fold(0.0, f64::max)
    }

    /// The fraction of the ranks' time over the step spent waiting: `1 − Σ busy / (ranks ·
    /// makespan)`.
    pub fn bubble(&self) -> f64 {
        let total = self.makespan() * self.end.len() as f64;
        if total == 0.0 {
            return 0.0;
        }
        1.0 - self.busy.iter().sum::<f64>() / total
    }
}

/// The costs a schedule's theoretical bubble assumes: a forward and each half of a split
/// backward one unit, a whole backward two, each divided by the chunks per rank (a chunk is
/// that share of a rank's layers); messages cost nothing.
pub fn unit_cost(chunks: usize) -> impl Fn(Instr) -> f64 {
    let share = 1.0 / chunks as f64;
    move |i: Instr| match i {
        Instr::Forward { .. } | Instr::BackwardInput { .. } | Instr::BackwardWeight { .. } => share,
        Instr::Backward { .. } => 2.0 * share,
        _ => 0.0,
    }
}

/// Runs every rank's stream against buffered, ordered links with every computation taking
/// one unit of time; see [`simulate_timed`].
pub fn simulate(streams: &[Vec<Instr>]) -> Result<Vec<(usize, Instr)>, String> {
    simulate_timed(streams, |i| if i.is_compute() { 1.0 } else { 0.0 }).map(|t| t.order)
}

/// Runs every rank's stream against buffered links, one per ordered pair of ranks (a send
/// queues its message, a receive takes the oldest message of its link or waits), one
/// runnable instruction at a time, each taking `cost(instr)` of its rank's time and a receive
/// also waiting for its message's send. Returns the timeline, or the instructions each rank
/// is stuck at when none can move (a deadlock), or a message received out of order, or one
/// sent and never received.
pub fn simulate_timed(
    streams: &[Vec<Instr>],
    cost: impl Fn(Instr) -> f64,
) -> Result<Timeline, String> {
    simulate_ranked(streams, |_, instr| cost(instr))
}

/// The seconds a rank's computations take, each kind's mean: forward, whole backward, backward
/// input half, weight half (what [`crate::ComputeClock::means`] measures).
pub type StageCosts = [f64; 4];

/// A cost per computation from each rank's measured [`StageCosts`] (messages cost nothing).
pub fn measured_cost(costs: &[StageCosts]) -> impl Fn(usize, Instr) -> f64 + '_ {
    move |rank, instr| {
        let c = costs[rank];
        match instr {
            Instr::Forward { .. } => c[0],
            Instr::Backward { .. } => c[1],
            Instr::BackwardInput { .. } => c[2],
            Instr::BackwardWeight { .. } => c[3],
            _ => 0.0,
        }
    }
}

/// [`simulate_timed`] with a cost that depends on the rank too (stages of unequal work).
pub fn simulate_ranked(
    streams: &[Vec<Instr>],
    cost: impl Fn(usize, Instr) -> f64,
) -> Result<Timeline, String> {
    let ranks = streams.len();
    let chunks = 1 + streams
        .iter()
        .flatten()
        .filter_map(|i| i.at().map(|(_, c)| c))
        .max()
        .unwrap_or(0);
    // links[(from, to)]: messages in flight as (the receive they match, when they were sent).
    let mut links: HashMap<(usize, usize), VecDeque<(Instr, f64)>> = HashMap::new();
    let mut next = vec![0usize; ranks];
    let mut clock = vec![0.0f64; ranks];
    let mut busy = vec![0.0f64; ranks];
    let mut order = Vec::new();
    loop {
        let mut moved = false;
        for s in 0..ranks {
            while let Some(&instr) = streams[s].get(next[s]) {
                let no_peer = || format!("rank {s} has no peer for {instr:?}");
                match instr {
                    Instr::RecvActivation { .. } | Instr::RecvGrad { .. } => {
                        let (from, _) = instr.peer(s, ranks, chunks).ok_or_else(no_peer)?;
                        let link = links.entry((from, s)).or_default();
                        match link.front() {
                            None => break,
                            Some(&(m, _)) if m != instr => {
                                return Err(format!(
                                    "rank {s} expects {instr:?} but {m:?} is first on its link \
                                     from rank {from}"
                                ));
                            }
                            Some(&(_, sent)) => {
                                link.pop_front();
                                clock[s] = clock[s].max(sent);
                            }
                        }
                    }
                    Instr::SendActivation { .. } | Instr::SendGrad { .. } => {
                        let (to, recv) = instr.peer(s, ranks, chunks).ok_or_else(no_peer)?;
                        links
                            .entry((s, to))
                            .or_default()
                            .push_back((recv, clock[s]));
                    }
                    _ => {}
                }
                let spent = cost(s, instr);
                clock[s] += spent;
                busy[s] += spent;
                order.push((s, instr));
                next[s] += 1;
                moved = true;
            }
        }
        if next.iter().zip(streams).all(|(n, s)| *n == s.len()) {
            return match links.values().any(|l| !l.is_empty()) {
                true => Err("messages were sent that nobody received".into()),
                false => Ok(Timeline {
                    order,
                    end: clock,
                    busy,
                }),
            };
        }
        if !moved {
            let stuck: Vec<String> = (0..ranks)
                .map(|s| format!("rank {s} at {:?}", streams[s].get(next[s])))
                .collect();
            return Err(format!("deadlock: {}", stuck.join(", ")));
        }
    }
}
