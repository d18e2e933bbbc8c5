//! Flash attention for training, in CubeCL: a forward that keeps only each row's
//! log-sum-exp, and a backward that recomputes the probabilities tile by tile. No tensor of
//! size S×S is ever allocated.
//!
//! Layout: `q`, `out`, `d_out`, `dq` are `[batch, heads, seq_q, head_dim]`; `k`, `v`, `dk`,
//! `dv` are `[batch, kv_heads, seq_k, head_dim]` with `heads` a multiple of `kv_heads`
//! (grouped-query attention: query head `h` reads K/V head `h / (heads / kv_heads)`); `lse`
//! and the backward's `delta` scratch are `[batch, heads, seq_q]` f32. Any strides. Inputs in
//! f32, f16 or bf16, arithmetic in f32. `causal` lets row `i` see keys `j ≤ i` (top-left
//! aligned, as burn's `tril_mask` and torch's `is_causal`).
//!
//! Block-sparse attention is the same kernels with a [`BlockSparsity`] layout: tiles without a
//! kept block are skipped, pairs outside kept blocks masked.
//!
//! Two implementations: [`tensor_core`] (f16/bf16, head dimension a multiple of 16 up to 128,
//! on CUDA) with every product on tensor-core fragments, and the CUDA-core kernels for the rest
//! (any float type, any head dimension up to 256; the only ones WGSL can run): a row per
//! `lanes` units, each holding `head_dim / lanes` elements in registers.

mod backward;
mod forward;
mod lanes;
mod sparse;
pub mod tensor_core;

mod launch;
pub use launch::*;
