//! cubecl-kernels: CubeCL kernels for burn-zero.
//!
//! [`adam`]: fused AdamW over a partition (one read and write of master, gradient and
//! moments). Tested on the CPU through wgpu on Mesa's lavapipe (`--features wgpu`, with the
//! environment `scripts/lavapipe.sh` prints).
//! [`lamb`]: fused LAMB over a partition of many tensors, in two passes around the read-back of
//! the per-tensor norms (which ZeRO sums across ranks).
//! [`cast`]: values of any float dtype written into an f32 buffer, converted on the way.
//! [`norm`]: the sum of squares of a gradient in pieces, in one read and a fixed order.
//! [`attention`]: flash attention forward and backward for training (no S×S tensor), dense or
//! block-sparse.
//! [`fused`]: RMSNorm, RoPE and SwiGLU in one kernel each way.
//! [`sparse`]: DeepSpeed's block-sparse attention layouts (dense, fixed, bslongformer, bigbird,
//! variable) and [`sparse::SparseLayout`], what the block-sparse kernels read.
#![warn(missing_docs)]

pub mod adam;
pub mod attention;
pub mod cast;
pub mod fused;
pub mod lamb;
pub mod norm;
pub mod sparse;

#[cfg(all(test, feature = "wgpu"))]
mod tests;

/// Lanes per unit over `len` elements of buffers starting at `handles`: four where every start
/// is 16 bytes aligned and `len` divides by four, one otherwise (any offset is correct).
fn vector_of_four(len: usize, handles: &[&cubecl::server::Handle]) -> usize {
    let aligned = |h: &&cubecl::server::Handle| h.offset_start.unwrap_or(0).is_multiple_of(16);
    match len.is_multiple_of(4) && handles.iter().all(aligned) {
        true => 4,
        false => 1,
    }
}
