//! Flash attention for models trained through `ZeroBackend`: [`flash_attention`] runs the
//! CubeCL kernels of `cubecl-kernels` (forward keeping only the log-sum-exp, backward
//! recomputing, as a custom autodiff op) when the tensors are CUDA tensors of
//! `ZeroBackend<burn::backend::Cuda>`, with or without `Autodiff`. Elsewhere it answers `None`
//! and the caller runs its materialized attention; burn 0.21's own attention would
//! materialize the S×S scores in training.

#[cfg(feature = "cuda")]
mod cuda;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

static ENABLED: AtomicBool = AtomicBool::new(true);
static DISABLED_BY_ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Switches the flash kernels on or off process-wide (`initialize` sets it from
/// `burn_zero.flash_attention`; `BURN_ZERO_FLASH_ATTENTION=0` in the environment keeps them
/// off whatever the config says).
pub fn set_flash_attention(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether [`flash_attention`] may run the kernels.
pub fn flash_attention_enabled() -> bool {
    let env_off = *DISABLED_BY_ENV
        .get_or_init(|| std::env::var("BURN_ZERO_FLASH_ATTENTION").is_ok_and(|v| v == "0"));
    ENABLED.load(Ordering::Relaxed) && !env_off
}

/// Attention calls the flash kernels ran in this process so far.
pub fn flash_attention_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// `softmax(scale·Q·Kᵀ) V` of `q` (`[batch, heads, seq_q, head_dim]`), `k` and `v`
/// (`[batch, kv_heads, seq_k, head_dim]`, `heads` a multiple of `kv_heads`: grouped-query
/// attention without repeating K/V), `scale = 1/√head_dim`, row `i` seeing keys `j ≤ i` when
/// `causal`. `Some` where the flash kernels ran (differentiable under `Autodiff`), `None`
/// where they do not apply (another backend, a dtype other than f32/bf16/f16, or switched
/// off): the caller then runs its own attention.
///
/// # Panics
/// On shapes attention cannot take, naming them.
pub fn flash_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
) -> Option<Tensor<B, 4>> {
    if !flash_attention_enabled() {
        return None;
    }
    #[cfg(feature = "cuda")]
    if let Some(out) = cuda::flash_attention(q, k, v, causal) {
        CALLS.fetch_add(1, Ordering::Relaxed);
        return Some(out);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (q, k, v, causal);
    None
}

/// Multiply-adds of attention over `q_shape`/`k_shape` (`[b, h, s, d]`) for the FLOPs
/// profiler: the forward's two products (`Q·Kᵀ`, `P·V`), every score counted as the
/// materialized path counts it (the causal half is not subtracted).
pub(crate) fn forward_macs(q_shape: &[usize], k_shape: &[usize]) -> u64 {
    (2 * q_shape.iter().product::<usize>() * k_shape[2]) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_the_cuda_backend_the_caller_runs_its_own_attention() {
        type B = burn::backend::NdArray;
        let device = Default::default();
        let t = || Tensor::<B, 4>::ones([1, 2, 3, 4], &device);
        assert!(flash_attention(t(), t(), t(), true).is_none());
        assert_eq!(forward_macs(&[1, 2, 3, 4], &[1, 1, 5, 4]), 2 * 24 * 5);
    }
}
