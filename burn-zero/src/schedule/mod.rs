//! DeepSpeed's learning-rate schedules (0.19 semantics) and progressive layer dropping's,
//! free of burn types.
//!
//! DeepSpeed counts `last_batch_iteration` (here `iteration`) from −1 at construction; the
//! engine steps the scheduler once per optimizer step, after that step. So optimizer step 1
//! uses the construction value, step k ≥ 2 uses the value at iteration k − 2.

mod params;
mod pld;
pub use pld::{PldConfig, ProgressiveLayerDrop};

mod lr;
pub use lr::*;
