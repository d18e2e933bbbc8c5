//! One strategy per ZeRO stage, behind [`Strategy`]: what the stage does with gradients as
//! backward produces them, with the norm, with the new parameters after a step, in a
//! checkpoint and in memory. `initialize` picks one ([`ZeroStage`]) and nothing outside this
//! module asks which stage runs.
//!
//! - [`Replicated`] (stage 0): every rank holds everything; gradients are all-reduced.
//! - `Partitioned` (stages 1 and 2, Cargo features `zero1`, `zero2`): the optimizer owns a
//!   chunk of the flat parameters; gradients are all-reduced (1) or reduce-scattered (2), the
//!   new chunks all-gathered.
//! - `Sharded` (stage 3, Cargo feature `zero3`): parameters are sharded handles gathered
//!   for their use; gradients reduce-scatter into each parameter's chunk.
//!
//! A stage whose feature is off is not compiled: the config refuses it by name.

mod gathers;
mod intake;
#[cfg(feature = "zero1")]
mod partitioned;
mod replicated;
mod setup;
#[cfg(feature = "zero3")]
mod sharded;
mod strategy;

pub use gathers::{GatherEvent, GatherStats};
#[cfg(feature = "zero1")]
pub(crate) use partitioned::Partitioned;
pub(crate) use replicated::Replicated;
pub(crate) use setup::Setup;
#[cfg(feature = "zero3")]
pub(crate) use sharded::Sharded;
pub(crate) use strategy::{CheckpointLayout, Held, Master, ParamSource, Strategy, owned_segments};
