//! burn-pipeline: pipeline and 3D parallelism for burn-zero.
//!
//! [`schedule`]: pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as pure
//! instruction streams, with a simulator that checks a set of streams runs without deadlock
//! and with matched messages, and measures its bubble.
//! [`topology`]: the (pipe, data, model) process grid, its coordinates and its axis groups.
//! [`split`](mod@split): layers into stages, uniformly or balanced by parameter count.
//! [`executor`]: runs a rank's stream on its burn modules (one per model chunk), with gradients
//! averaged over the data axis (pipe × data).
//! [`weight_split`]: the backward split into input and weight halves for zero-bubble schedules.
//! [`checkpoint`]: activation checkpointing of a stage's micro-batches (partitioned over the
//! model axis, or in host memory, as the config says).
//! [`optimizer`]: a stage's optimizer step over the data axis: replicated, ZeRO-1 or ZeRO-2.
//! [`tensor_parallel`]: column/row-parallel linear layers, a vocab-parallel embedding and
//! cross-entropy over the model axis, with the two model-parallel autodiff ops.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod executor;
pub mod optimizer;
pub mod schedule;
pub mod split;
pub mod tensor_parallel;
pub mod topology;
pub mod weight_split;

pub use checkpoint::Checkpointing;
pub use executor::{ComputeClock, PipeStage, StageSpec, run_chunks, run_chunks_clocked, run_step};
pub use optimizer::{Replicated, StageOptimizer, Zero1, Zero2, flatten_params, unflatten_params};
pub use schedule::{
    Instr, Schedule, StageCosts, Timeline, measured_cost, peak_in_flight, simulate,
    simulate_ranked, simulate_timed, unit_cost,
};
pub use split::{SplitMethod, split};
pub use tensor_parallel::{
    ColumnParallelLinear, ModelGroup, ModelParallelBackend, RowParallelLinear,
    VocabParallelEmbedding, copy_to_group, reduce_from_group, vocab_parallel_cross_entropy,
};
pub use topology::{Topology, pipeline_links};
pub use weight_split::{RecomputeSplit, WeightSplit};

#[cfg(test)]
mod tests;
