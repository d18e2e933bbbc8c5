//! Pipeline schedules as pure instruction streams (DeepSpeed's `PipeSchedule`): for one rank
//! of a pipeline of `stages` ranks and one optimizer step of `micro_batches` micro-batches,
//! the ordered instructions its executor runs. Free of burn types, so the streams can be
//! checked on their own: every forward before its backward, every send matched by a receive
//! in the same order, the memory bound of each schedule, its bubble.
//!
//! A schedule is built in two steps: [`order`] gives each rank's computations (forwards,
//! backwards, and for zero-bubble schedules the backward split into its input-gradient and
//! weight-gradient halves), then [`links`] adds the loads, sends and receives around them.
//!
//! Sends are buffered: a send returns once its message is queued, and a receive waits for
//! its message (the thread-rank communicator's semantics; an NCCL executor groups each send
//! with the receive that follows it). Messages between two ranks arrive in the order they
//! were sent, whatever they carry, so a rank receives from a neighbour in the order that
//! neighbour sends.

mod links;
mod order;
mod simulate;

pub use simulate::{
    StageCosts, Timeline, measured_cost, peak_in_flight, simulate, simulate_ranked, simulate_timed,
    unit_cost,
};

/// One instruction of a rank's stream. `mb` is the micro-batch index within the step and
/// `chunk` the model chunk of this rank it runs on (always 0 but for interleaved schedules,
/// where rank `r` of `p` holds virtual stages `r, r + p, r + 2p, ...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instr {
    /// Load micro-batch `mb` from the data (inputs on the first stage, labels on the last).
    Load {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Receive `mb`'s activation from the previous stage.
    RecvActivation {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Run this chunk's forward on `mb` (keeping what its backward needs).
    Forward {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Send `mb`'s output activation to the next stage.
    SendActivation {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Receive the gradient of `mb`'s output from the next stage.
    RecvGrad {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Run this chunk's whole backward on `mb` (accumulating parameter gradients).
    Backward {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// The first half of a split backward: the gradient of `mb`'s input, what the previous
    /// stage waits for. Weight gradients the stage defers are left for [`Instr::BackwardWeight`].
    BackwardInput {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// The second half of a split backward: the deferred weight gradients of `mb`.
    BackwardWeight {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Send the gradient of `mb`'s input to the previous stage.
    SendGrad {
        /// Micro-batch.
        mb: usize,
        /// Model chunk.
        chunk: usize,
    },
    /// Reduce the accumulated gradients across the data-parallel group.
    ReduceGrads,
    /// Apply the optimizer.
    OptimizerStep,
}

impl Instr {
    /// The micro-batch and chunk this instruction is about, if any.
    pub fn at(self) -> Option<(usize, usize)> {
        match self {
            Instr::Load { mb, chunk }
            | Instr::RecvActivation { mb, chunk }
            | Instr::Forward { mb, chunk }
            | Instr::SendActivation { mb, chunk }
            | Instr::RecvGrad { mb, chunk }
            | Instr::Backward { mb, chunk }
            | Instr::BackwardInput { mb, chunk }
            | Instr::BackwardWeight { mb, chunk }
            | Instr::SendGrad { mb, chunk } => Some((mb, chunk)),
            Instr::ReduceGrads | Instr::OptimizerStep => None,
        }
    }

    /// For a message of `rank` in a pipeline of `ranks × chunks` virtual stages: the rank at
    /// the other end, and the receive that matches it (for a receive, itself). `None` for
    /// anything else, and for a message the first or last virtual stage has no peer for.
    pub fn peer(self, rank: usize, ranks: usize, chunks: usize) -> Option<(usize, Instr)> {
        let (mb, chunk) = self.at()?;
        let vs = chunk * ranks + rank;
        let last = ranks * chunks - 1;
        // The other end's virtual stage, and what this message's receive is.
        let (other, recv) = match self {
            Instr::RecvActivation { .. } if vs > 0 => (vs - 1, self),
            Instr::RecvGrad { .. } if vs < last => (vs + 1, self),
            Instr::SendActivation { .. } if vs < last => (
                vs + 1,
                Instr::RecvActivation {
                    mb,
                    chunk: (vs + 1) / ranks,
                },
            ),
            Instr::SendGrad { .. } if vs > 0 => (
                vs - 1,
                Instr::RecvGrad {
                    mb,
                    chunk: (vs - 1) / ranks,
                },
            ),
            _ => return None,
        };
        Some((other % ranks, recv))
    }

    /// Whether this instruction computes (forward or any part of a backward).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Instr::Forward { .. }
                | Instr::Backward { .. }
                | Instr::BackwardInput { .. }
                | Instr::BackwardWeight { .. }
        )
    }
}

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// GPipe (fill-drain): every forward, then every backward.
    GPipe,
    /// 1F1B (PipeDream-flush): after a warm-up of forwards, one forward and one backward in
    /// turn, so at most `stages - stage` micro-batches are alive on a stage.
    OneFOneB,
    /// Interleaved 1F1B (Megatron-LM's virtual pipeline): the model is cut into
    /// `stages × chunks` virtual stages and rank `r` runs `r, r + stages, ...`, which divides
    /// the bubble by `chunks` for `chunks` times the messages. Needs at least 2 ranks and a
    /// number of micro-batches that they divide.
    Interleaved {
        /// Model chunks (virtual stages) per rank.
        chunks: usize,
    },
    /// Zero-bubble ZB-H1 (Qi et al., 2023): each backward split into the input gradient, sent
    /// upstream at once, and the weight gradients, which rank `r` runs `r` micro-batches late,
    /// where 1F1B would wait. Every rank holds at most `stages` micro-batches (1F1B's peak; a
    /// micro-batch counts until its weight gradients are done); with forward, input and weight
    /// halves of equal cost, the bubble is a third of 1F1B's.
    ZeroBubbleH1,
}

impl std::str::FromStr for Schedule {
    type Err = String;

    /// `gpipe`, `1f1b`, `interleaved:V` (V chunks per rank) or `zb-h1`.
    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "gpipe" => return Ok(Schedule::GPipe),
            "1f1b" => return Ok(Schedule::OneFOneB),
            "zb-h1" | "zbh1" => return Ok(Schedule::ZeroBubbleH1),
            _ => {}
        }
        if let Some(v) = lower.strip_prefix("interleaved:") {
            return match v.parse() {
                Ok(chunks) if chunks > 0 => Ok(Schedule::Interleaved { chunks }),
                _ => Err(format!(
                    "schedule {s:?}: the chunks per rank after `interleaved:` must be a \
                     positive integer"
                )),
            };
        }
        Err(format!(
            "unknown pipeline schedule {s:?}: expected gpipe, 1f1b, interleaved:V or zb-h1"
        ))
    }
}

impl Schedule {
    /// Model chunks each rank holds.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved { chunks } => chunks,
            _ => 1,
        }
    }

    /// Why this schedule cannot run `micro_batches` over `stages` ranks, if it cannot.
    pub fn check(self, stages: usize, micro_batches: usize) -> Result<(), String> {
        if stages == 0 || micro_batches == 0 {
            return Err(format!(
                "{self:?}: a schedule needs ranks and micro-batches (got {stages} ranks, \
                 {micro_batches} micro-batches)"
            ));
        }
        if let Schedule::Interleaved { chunks } = self {
            if chunks == 0 {
                return Err("interleaved 1F1B needs at least one chunk per rank".into());
            }
            if stages < 2 {
                return Err(format!(
                    "interleaved 1F1B needs at least 2 pipeline ranks (got {stages})"
                ));
            }
            if !micro_batches.is_multiple_of(stages) {
                return Err(format!(
                    "interleaved 1F1B runs micro-batches in groups of the pipeline's {stages} \
                     ranks: {micro_batches} micro-batches is not a multiple of {stages}"
                ));
            }
        }
        Ok(())
    }

    /// The instruction stream of `stage` (0-based rank) for one optimizer step.
    ///
    /// # Panics
    /// If `stage >= stages` or [`Schedule::check`] refuses the shape.
    pub fn stream(self, stages: usize, micro_batches: usize, stage: usize) -> Vec<Instr> {
        assert!(stage < stages, "stage {stage} must be below {stages}");
        self.streams(stages, micro_batches).swap_remove(stage)
    }

    /// The fraction of the ranks' time this schedule leaves idle over `micro_batches` on
    /// `stages` ranks, simulated with [`unit_cost`]: its theoretical bubble.
    ///
    /// # Panics
    /// If [`Schedule::check`] refuses the shape.
    pub fn bubble(self, stages: usize, micro_batches: usize) -> f64 {
        simulate_timed(
            &self.streams(stages, micro_batches),
            unit_cost(self.chunks()),
        )
        .expect("a schedule's own streams run")
        .bubble()
    }

    /// The fraction of the ranks' time this schedule leaves idle over `micro_batches` on
    /// `costs.len()` ranks when rank `r`'s computations take `costs[r]` (measured, e.g. by
    /// [`crate::run_chunks_clocked`]): the bubble of these stages, unequal work included.
    ///
    /// # Panics
    /// If [`Schedule::check`] refuses the shape.
    pub fn bubble_with(self, micro_batches: usize, costs: &[StageCosts]) -> f64 {
        simulate_ranked(
            &self.streams(costs.len(), micro_batches),
            measured_cost(costs),
        )
        .expect("a schedule's own streams run")
        .bubble()
    }

    /// Every rank's stream.
    ///
    /// # Panics
    /// If [`Schedule::check`] refuses the shape.
    pub fn streams(self, stages: usize, micro_batches: usize) -> Vec<Vec<Instr>> {
        if let Err(e) = self.check(stages, micro_batches) {
            panic!("{e}");
        }
        let orders = order::orders(self, stages, micro_batches);
        links::with_messages(&orders, self.chunks())
            .into_iter()
            .map(|mut stream| {
                stream.extend([Instr::ReduceGrads, Instr::OptimizerStep]);
                stream
            })
            .collect()
    }
}
