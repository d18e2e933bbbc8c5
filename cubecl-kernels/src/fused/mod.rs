//! Fused transformer kernels (DeepSpeed's transformer kernels, for burn models): RMSNorm,
//! RoPE and SwiGLU, each one kernel forward and one backward (RMSNorm's weight gradient a
//! second, deterministic, pass), and the cross-entropy of a chunk of logits with their
//! gradient written in place. Contiguous operands; statistics and arithmetic in f32 for
//! f16/bf16 elements.

mod cross_entropy;
mod rms_norm;
mod rope;
mod swiglu;

pub use cross_entropy::{cross_entropy, scale};
pub use rms_norm::{
    backward_chunk, backward_scratch_bytes, rms_norm_add_forward, rms_norm_backward,
    rms_norm_forward, row_pitch,
};
pub use rope::{RopeDims, RopePairs, rope};
pub use swiglu::{swiglu_backward, swiglu_forward};

use cubecl::prelude::*;

/// `handle` as a kernel's array argument of `len` elements.
fn array<R: Runtime>(handle: &cubecl::server::Handle, len: usize) -> ArrayArg<R> {
    // SAFETY (of every use): the caller's handles hold `len` elements of the stated type.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// Elements per vector for elements of `bytes` over rows of `len` elements: the widest the
/// runtime loads in one access that divides `len` (so rows start on vectors).
fn vector_of<R: Runtime>(client: &ComputeClient<R>, bytes: usize, len: usize) -> usize {
    client
        .io_optimized_vector_sizes(bytes)
        .find(|v| len.is_multiple_of(*v))
        .unwrap_or(1)
}

#[cfg(all(test, feature = "wgpu"))]
mod gpu_tests;
