//! Block-sparse attention layouts as DeepSpeed's `sparse_attention` defines them: which
//! `block × block` tiles of the attention matrix each head computes. `Dense` keeps every tile;
//! `BsLongformer` a sliding window plus global blocks in both directions;
//! `Fixed` (Sparse Transformers, as DeepSpeed customizes it) keeps local windows of
//! `num_local_blocks` blocks plus, per window, `num_global_blocks` representative blocks that
//! every row attends to (and that attend to every column, with horizontal global attention);
//! `BigBird` random blocks, a sliding window and leading global blocks; `Variable` random
//! blocks, local windows of listed sizes and global blocks or ranges.
//! Free of GPU types: the block-sparse attention kernels read these masks.

mod layouts;

pub use layouts::{BigBirdConfig, VariableConfig};

mod sparsity;
pub use sparsity::*;
