//! cubecl-kernels: CubeCL kernels for burn-zero.
//!
//! [`adam`]: fused AdamW over a partition (one read and write of master, gradient and
//! moments). Tested on the CPU through wgpu on Mesa's lavapipe (`--features wgpu`, with the
//! environment `scripts/lavapipe.sh` prints); multi-tensor launches, LAMB and flash attention
//! with its own backward come next.
#![warn(missing_docs)]

pub mod adam;

#[cfg(all(test, feature = "wgpu"))]
mod tests;
