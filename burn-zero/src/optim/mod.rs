//! Optimizers over flat f32 partitions, free of burn types: what each rank runs on the slice
//! of the flattened parameters it owns. The math follows PyTorch/DeepSpeed (fp32 throughout).

#[cfg(feature = "cuda")]
mod fused_cuda;
mod lamb;
mod onebit;
mod tensor;
pub use onebit::{
    CommVolume, OneBitCompressor, SCALE_BLOCK, adam_update_bound, pack_signs, unpack_signs,
};
pub use tensor::{TensorBounds, TensorOptimizer};

mod flat;
pub use flat::*;
