//! Layers any burn model can call, with memory-saving forms on `ZeroBackend`.

mod checkpoint;
mod cross_entropy;
pub(crate) mod downcast;
mod fused;

pub use checkpoint::{checkpoint, checkpoint_then};
pub use cross_entropy::{VocabAxis, linear_cross_entropy, materialized_cross_entropy};
pub use fused::{RopePairs, RopeTable, add_rms_norm, rms_norm, rope, swiglu};
