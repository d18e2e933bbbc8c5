//! Pipeline schedules as pure instruction streams (DeepSpeed's `PipeSchedule`): for one
//! stage of a pipeline of `stages` stages and one optimizer step of `micro_batches`
//! micro-batches, the ordered instructions its executor runs. Free of burn types, so the
//! streams can be checked on their own: every forward before its backward, every send
//! matched by a receive in the same order, the memory bound of 1F1B.
//!
//! Sends are buffered: a send returns once its message is queued, and a receive waits for
//! its message (the thread-rank communicator's semantics; an NCCL executor groups each send
//! with the receive that follows it).

/// One instruction of a stage's stream. `mb` is the micro-batch index within the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instr {
    /// Load micro-batch `mb` from the data (inputs on the first stage, labels on the last).
    Load {
        /// Micro-batch.
        mb: usize,
    },
    /// Receive `mb`'s activation from the previous stage.
    RecvActivation {
        /// Micro-batch.
        mb: usize,
    },
    /// Run this stage's forward on `mb` (keeping what its backward needs).
    Forward {
        /// Micro-batch.
        mb: usize,
    },
    /// Send `mb`'s output activation to the next stage.
    SendActivation {
        /// Micro-batch.
        mb: usize,
    },
    /// Receive the gradient of `mb`'s output from the next stage.
    RecvGrad {
        /// Micro-batch.
        mb: usize,
    },
    /// Run this stage's backward on `mb` (accumulating parameter gradients).
    Backward {
        /// Micro-batch.
        mb: usize,
    },
    /// Send the gradient of `mb`'s input to the previous stage.
    SendGrad {
        /// Micro-batch.
        mb: usize,
    },
    /// Reduce the accumulated gradients across the data-parallel group.
    ReduceGrads,
    /// Apply the optimizer.
    OptimizerStep,
}

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// GPipe (fill-drain): every forward, then every backward.
    GPipe,
    /// 1F1B (PipeDream-flush): after a warm-up of forwards, one forward and one backward in
    /// turn, so at most `stages - stage` micro-batches are alive on a stage.
    OneFOneB,
}

/// The forward of `mb` on `stage` with its communication.
fn forward(out: &mut Vec<Instr>, stage: usize, stages: usize, mb: usize) {
    if stage == 0 || stage == stages - 1 {
        out.push(Instr::Load { mb });
    }
    if stage > 0 {
        out.push(Instr::RecvActivation { mb });
    }
    out.push(Instr::Forward { mb });
    if stage < stages - 1 {
        out.push(Instr::SendActivation { mb });
    }
}

/// The backward of `mb` on `stage` with its communication.
fn backward(out: &mut Vec<Instr>, stage: usize, stages: usize, mb: usize) {
    if stage < stages - 1 {
        out.push(Instr::RecvGrad { mb });
    }
    out.push(Instr::Backward { mb });
    if stage > 0 {
        out.push(Instr::SendGrad { mb });
    }
}

impl Schedule {
    /// The instruction stream of `stage` (0-based) for one optimizer step.
    ///
    /// # Panics
    /// If `stage >= stages` or there are no stages or micro-batches.
    pub fn stream(self, stages: usize, micro_batches: usize, stage: usize) -> Vec<Instr> {
        assert!(
            stages > 0 && micro_batches > 0 && stage < stages,
            "a schedule needs stages and micro-batches, and stage {stage} must be below {stages}"
        );
        let mut out = Vec::new();
        match self {
            Schedule::GPipe => {
                (0..micro_batches).for_each(|mb| forward(&mut out, stage, stages, mb));
                (0..micro_batches).for_each(|mb| backward(&mut out, stage, stages, mb));
            }
            Schedule::OneFOneB => {
                let warmup = (stages - stage - 1).min(micro_batches);
                (0..warmup).for_each(|mb| forward(&mut out, stage, stages, mb));
                for i in 0..micro_batches - warmup {
                    forward(&mut out, stage, stages, warmup + i);
                    backward(&mut out, stage, stages, i);
                }
                (micro_batches - warmup..micro_batches)
                    .for_each(|mb| backward(&mut out, stage, stages, mb));
            }
        }
        out.push(Instr::ReduceGrads);
        out.push(Instr::OptimizerStep);
        out
    }

    /// Every stage's stream.
    pub fn streams(self, stages: usize, micro_batches: usize) -> Vec<Vec<Instr>> {
        (0..stages)
            .map(|s| self.stream(stages, micro_batches, s))
            .collect()
    }
}

/// The most micro-batches alive at once on a stage (forwarded, not yet backwarded): what
/// its activation memory holds.
pub fn peak_in_flight(stream: &[Instr]) -> usize {
    let (mut alive, mut peak) = (0usize, 0usize);
    for instr in stream {
        match instr {
            Instr::Forward { .. } => {
                alive += 1;
                peak = peak.max(alive);
            }
            Instr::Backward { .. } => alive -= 1,
            _ => {}
        }
    }
    peak
}

/// Runs every stage's stream against buffered links (a send queues, a receive takes the
/// oldest message of its link or waits), one runnable instruction at a time; returns the
/// global order of execution, or the instructions each stage is stuck at when no stage can
/// move (a deadlock), or a message received out of order.
pub fn simulate(streams: &[Vec<Instr>]) -> Result<Vec<(usize, Instr)>, String> {
    use std::collections::VecDeque;
    let stages = streams.len();
    // Activations travel s → s+1 on `down[s]`, gradients s+1 → s on `up[s]`.
    let mut down: Vec<VecDeque<usize>> = vec![VecDeque::new(); stages];
    let mut up: Vec<VecDeque<usize>> = vec![VecDeque::new(); stages];
    let mut next = vec![0usize; stages];
    let mut order = Vec::new();
    loop {
        let mut moved = false;
        for s in 0..stages {
            while let Some(&instr) = streams[s].get(next[s]) {
                let link_in = |link: &mut VecDeque<usize>, mb: usize| match link.front() {
                    None => Ok(false),
                    Some(&m) if m == mb => {
                        link.pop_front();
                        Ok(true)
                    }
                    Some(&m) => Err(format!(
                        "stage {s} expects micro-batch {mb} but micro-batch {m} is first on its link ({instr:?})"
                    )),
                };
                let ran = match instr {
                    Instr::RecvActivation { mb } if s > 0 => link_in(&mut down[s - 1], mb)?,
                    Instr::RecvGrad { mb } if s + 1 < stages => link_in(&mut up[s], mb)?,
                    Instr::SendActivation { mb } if s + 1 < stages => {
                        down[s].push_back(mb);
                        true
                    }
                    Instr::SendGrad { mb } if s > 0 => {
                        up[s - 1].push_back(mb);
                        true
                    }
                    Instr::RecvActivation { .. }
                    | Instr::RecvGrad { .. }
                    | Instr::SendActivation { .. }
                    | Instr::SendGrad { .. } => {
                        return Err(format!("stage {s} has no peer for {instr:?}"));
                    }
                    _ => true,
                };
                if !ran {
                    break;
                }
                order.push((s, instr));
                next[s] += 1;
                moved = true;
            }
        }
        if next.iter().zip(streams).all(|(n, s)| *n == s.len()) {
            let leftover = down.iter().chain(&up).any(|l| !l.is_empty());
            return match leftover {
                true => Err("messages were sent that nobody received".into()),
                false => Ok(order),
            };
        }
        if !moved {
            let stuck: Vec<String> = (0..stages)
                .map(|s| format!("stage {s} at {:?}", streams[s].get(next[s])))
                .collect();
            return Err(format!("deadlock: {}", stuck.join(", ")));
        }
    }
}
