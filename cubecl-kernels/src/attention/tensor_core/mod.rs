//! Flash attention on tensor cores: the same contract as the CUDA-core kernels (inputs,
//! results, masks, block layouts, grouped-query attention), with every matrix product on
//! 16×16×16 f16/bf16 fragments accumulating in f32. Taken for f16/bf16 inputs with a head
//! dimension that is a multiple of 16 (up to 128) on a runtime with such fragments and
//! 32-unit planes (CUDA); anything else runs on the CUDA-core kernels.

mod backward;
mod forward;
mod group_sum;
mod mma_backward;
mod mma_forward;
mod mma_tiles;
mod tiles;

mod launch;
pub use launch::*;
