//! cubecl-kernels: CubeCL kernels for burn-zero.
//!
//! [`adam`]: fused AdamW over a partition (one read and write of master, gradient and
//! moments). Tested on the CPU through wgpu on Mesa's lavapipe (`--features wgpu`, with the
//! environment `scripts/lavapipe.sh` prints); multi-tensor launches, LAMB and flash attention
//! with its own backward come next.
//! [`attention`]: flash attention forward and backward for training (no S×S tensor).
//! [`sparse`]: DeepSpeed's block-sparse attention layouts (dense, fixed, bslongformer), what a
//! block-sparse kernel will read.
#![warn(missing_docs)]

pub mod adam;
pub mod attention;
pub mod sparse;

#[cfg(all(test, feature = "wgpu"))]
mod tests;
