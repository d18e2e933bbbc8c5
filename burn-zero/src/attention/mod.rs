//! Flash attention for models trained through `ZeroBackend`: [`flash_attention`] runs the
//! CubeCL kernels of `cubecl-kernels` (forward keeping only the log-sum-exp, backward
//! recomputing, as a custom autodiff op) when the tensors are CUDA tensors of
//! `ZeroBackend<burn::backend::Cuda>`, with or without `Autodiff`. Elsewhere it answers `None`
//! and the caller runs its materialized attention; burn 0.21's own attention would
//! materialize the S×S scores in training. [`block_sparse_attention`] is the same with a
//! DeepSpeed `sparse_attention` layout ([`SparseLayout`]): tiles without a kept block are
//! skipped.

#[cfg(feature = "cuda")]
mod cuda;

mod dispatch;
pub use dispatch::*;
