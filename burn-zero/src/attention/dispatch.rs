//! Which attention runs: flash or block-sparse kernels on CUDA per the engine's settings, burn ops
//! elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
pub use cubecl_kernels::sparse::SparseLayout;

use cubecl_kernels::attention::tensor_core::tensor_core_head;

use crate::backend::settings;
use crate::config::SparseAttentionConfig;

static CALLS: AtomicU64 = AtomicU64::new(0);

/// Sets when the flash kernels run for attention dispatched from this thread (an engine's
/// thread has its config's `burn_zero.flash_attention`): `Some(true)` always, `Some(false)`
/// never, `None` where they are measured faster ([`flash_chosen`]).
pub fn set_flash_attention(choice: Option<bool>) {
    settings::update(|s| s.flash_attention = choice);
}

/// Whether the kernels run for heads of `head_dim` over `seq` tokens, in half precision
/// (f16/bf16) or not. Automatic: for half-precision heads the tensor-core kernels take (head
/// dims that are multiples of 16, up to 128), for head dims up to 64, for sequences of 4096
/// tokens or more, and always when `sparse_attention` is set. Measured on one H200 end to end
/// (ZeRO-2, seq 1024, commit d3ed431): the 3B Llama (head dim 128, bf16) ran 4,675 tokens/s
/// on the tensor-core kernels against 4,160 materialized; the 1B (head dim 64) 8,793 against
/// 7,386. The CUDA-core kernels (f32) at head dim 128 were slower than materialized (3B:
/// 0.669 s against 0.439 s a step); at seq 8192 the materialized path reserved 29 GB for one
/// attention call, the kernels 1 GB.
pub fn flash_chosen(head_dim: usize, seq: usize, half_precision: bool) -> bool {
    let (choice, sparse) = settings::with(|s| (s.flash_attention, s.sparse_attention.is_some()));
    match choice {
        Some(choice) => choice,
        None => {
            let tensor_cores = half_precision && tensor_core_head(head_dim);
            sparse || tensor_cores || head_dim <= 64 || seq >= 4096
        }
    }
}

/// Whether the tensor-core kernels may run where they apply for attention dispatched from
/// this thread (`burn_zero.attention_tensor_cores`; false keeps the CUDA-core kernels).
pub fn tensor_cores_allowed() -> bool {
    settings::with(|s| s.attention_tensor_cores)
}

/// Whether the tensor-core kernels keep the scores in registers where they apply, for
/// attention dispatched from this thread (`burn_zero.attention_register_scores`).
pub fn register_scores_allowed() -> bool {
    settings::with(|s| s.attention_register_scores)
}

/// Makes [`flash_attention`] dispatched from this thread block-sparse with `config`'s layouts
/// (an engine's thread has its config's `sparse_attention`); `None`: dense.
pub fn set_sparse_attention(config: Option<SparseAttentionConfig>) {
    settings::update(|s| s.sparse_attention = config);
}

/// The configured layout for `heads` heads over `seq` tokens (made once per shape).
///
/// # Panics
/// When the configuration does not fit the shape (a sequence not a multiple of the block,
/// say), naming the setting.
fn configured_layout(heads: usize, seq: usize) -> Option<Arc<SparseLayout>> {
    settings::sparse_layout(heads, seq)
}

/// Says once that `sparse_attention` is configured but the kernels did not run.
fn warn_sparse_not_applied() {
    if settings::take_sparse_warning() {
        crate::log::warn(
            "sparse_attention is set but the flash kernels do not apply here (not \
             ZeroBackend<Cuda>, a dtype other than f32/bf16/f16, or flash attention off): \
             attention runs dense",
        );
    }
}

/// Attention calls the flash kernels ran in this process so far.
pub fn flash_attention_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// `softmax(scale·Q·Kᵀ) V` of `q` (`[batch, heads, seq_q, head_dim]`), `k` and `v`
/// (`[batch, kv_heads, seq_k, head_dim]`, `heads` a multiple of `kv_heads`: grouped-query
/// attention without repeating K/V), `scale = 1/√head_dim`, row `i` seeing keys `j ≤ i` when
/// `causal`. `Some` where the flash kernels ran (differentiable under `Autodiff`), `None`
/// where they do not apply (another backend, a dtype other than f32/bf16/f16, or not chosen
/// for this shape: [`flash_chosen`]): the caller then runs its own attention. With a
/// `sparse_attention` section in force ([`set_sparse_attention`]) it is block-sparse with
/// that layout.
///
/// # Panics
/// On shapes attention cannot take, naming them.
pub fn flash_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
) -> Option<Tensor<B, 4>> {
    let [_, heads, seq, head_dim] = q.dims();
    let half = matches!(q.dtype(), DType::BF16 | DType::F16);
    if !flash_chosen(head_dim, seq, half) {
        warn_sparse_not_applied();
        return None;
    }
    let layout = configured_layout(heads, seq);
    let out = run(q, k, v, causal, layout.as_deref());
    if out.is_none() {
        warn_sparse_not_applied();
    }
    out
}

/// [`flash_attention`] restricted to the tiles `layout` keeps (block-sparse attention, forward
/// and backward); `None` where the kernels do not apply.
///
/// # Panics
/// On shapes attention cannot take, or a layout that does not cover them, naming them.
pub fn block_sparse_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    layout: &SparseLayout,
    causal: bool,
) -> Option<Tensor<B, 4>> {
    run(q, k, v, causal, Some(layout))
}

fn run<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    layout: Option<&SparseLayout>,
) -> Option<Tensor<B, 4>> {
    #[cfg(feature = "cuda")]
    if let Some(out) = super::cuda::flash_attention(q, k, v, causal, layout) {
        CALLS.fetch_add(1, Ordering::Relaxed);
        return Some(out);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (q, k, v, causal, layout);
    None
}

/// Multiply-adds of attention over `q_shape`/`k_shape` (`[b, h, s, d]`) for the FLOPs
/// profiler: the forward's two products (`Q·Kᵀ`, `P·V`), every score counted as the
/// materialized path counts it (the causal half is not subtracted).
#[cfg(any(feature = "cuda", test))]
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

    #[test]
    fn the_automatic_choice_follows_the_measurements() {
        // The environment variable is not set in the test runs.
        set_flash_attention(None);
        assert!(flash_chosen(64, 1024, false) && flash_chosen(128, 8192, false));
        assert!(!flash_chosen(128, 1024, false) && flash_chosen(128, 1024, true));
        assert!(!flash_chosen(136, 1024, true) && !flash_chosen(120, 1024, true));
        set_flash_attention(Some(true));
        assert!(flash_chosen(128, 1024, false));
        set_flash_attention(Some(false));
        assert!(!flash_chosen(64, 8192, true));
        set_flash_attention(None);
    }
}
