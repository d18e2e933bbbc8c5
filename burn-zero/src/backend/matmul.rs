//! `float_matmul` of `ZeroBackend`: cuBLASLt for the CUDA tensors it can take, the inner
//! backend's matmul for everything else.
//!
//! The choice is made per call from the operands' metadata: CUDA f32/bf16/f16 tensors of equal
//! dtype whose matrices are row- or column-major (transposed views need no copy), batch dims
//! that broadcast and flatten to one stride, and at least [`MatmulPolicy::min_macs`]
//! multiply-adds. bf16/f16 accumulate in f32; f32 uses TF32 only with
//! [`MatmulPolicy::allow_tf32`].
//!
//! Ordering: cubecl 0.10 does not expose its compute stream, so the call synchronizes it
//! (`Backend::sync`), runs cuBLASLt on its own stream and waits for it before returning: correct
//! for any following kernel, at the price of a host round trip per call (hence `min_macs`).

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

/// How `ZeroBackend` runs matmuls. Process-wide; `initialize` sets it from the config's
/// `burn_zero.matmul` section; `BURN_ZERO_CUBLASLT=1` in the environment switches cuBLASLt on
/// by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulPolicy {
    /// Route eligible CUDA matmuls to cuBLASLt (off: always the inner backend).
    pub cublaslt: bool,
    /// Let f32 matmuls use TF32 tensor cores in cuBLASLt.
    pub allow_tf32: bool,
    /// Smaller products (batch·m·n·k) stay on the inner backend.
    pub min_macs: u64,
}

impl Default for MatmulPolicy {
    fn default() -> Self {
        Self {
            // Off until the two streams are ordered without a host round trip per call: today
            // cuBLASLt pays a synchronization each call (see the module doc).
            cublaslt: std::env::var("BURN_ZERO_CUBLASLT").is_ok_and(|v| v == "1"),
            allow_tf32: false,
            min_macs: 1 << 24,
        }
    }
}

static POLICY: RwLock<Option<MatmulPolicy>> = RwLock::new(None);
static CUBLASLT_CALLS: AtomicU64 = AtomicU64::new(0);

/// Sets how matmuls run from now on.
pub fn set_matmul_policy(policy: MatmulPolicy) {
    *POLICY.write().unwrap_or_else(|e| e.into_inner()) = Some(policy);
}

/// How matmuls run now (the default, environment included, is read once).
pub fn matmul_policy() -> MatmulPolicy {
    if let Some(policy) = *POLICY.read().unwrap_or_else(|e| e.into_inner()) {
        return policy;
    }
    *POLICY
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(MatmulPolicy::default)
}

/// Matmuls that ran through cuBLASLt in this process so far.
pub fn cublaslt_calls() -> u64 {
    CUBLASLT_CALLS.load(Ordering::Relaxed)
}

/// `ZeroBackend::float_matmul`, on the inner backend's primitives.
pub(crate) fn float_matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    #[cfg(feature = "cuda")]
    if let Some(out) = cuda::try_cublaslt::<B>(&lhs, &rhs, matmul_policy()) {
        CUBLASLT_CALLS.fetch_add(1, Ordering::Relaxed);
        return out;
    }
    B::float_matmul(lhs, rhs)
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn_backend::{Backend, TensorMetadata, tensor::FloatTensor};

    use super::MatmulPolicy;
    use crate::backend::cublaslt::{self, Gemm, Operand};
    use crate::backend::cuda::{CudaView, cuda_view};

    /// A matrix `rows × cols` with strides `(rs, cs)` as the column-major operand that yields
    /// its transpose (`cols × rows`) in cuBLASLt, or `None` if neither dim is unit-stride.
    fn transposed_operand(view: &CudaView, rows: usize, cols: usize) -> Option<(i64, bool)> {
        let r = view.shape.len();
        let (rs, cs) = (view.strides[r - 2], view.strides[r - 1]);
        if cs == 1 || cols == 1 {
            // Row-major: stored column-major as its transpose, leading dimension = row stride.
            let ld = if rows == 1 { cols } else { rs };
            (ld >= cols.max(1)).then_some((ld as i64, false))
        } else if rs == 1 || rows == 1 {
            let ld = if cols == 1 { rows } else { cs };
            (ld >= rows.max(1)).then_some((ld as i64, true))
        } else {
            None
        }
    }

    /// The stride between consecutive matrices of `view` over the output's batch dims `out`,
    /// if its batch dims are all 1 (stride 0) or equal to `out` and flatten to one stride.
    fn batch_stride(view: &CudaView, out: &[usize]) -> Option<i64> {
        let dims = &view.shape[..view.shape.len() - 2];
        let strides = &view.strides[..dims.len()];
        if dims.iter().all(|d| *d == 1) {
            return Some(0);
        }
        if dims != out {
            return None;
        }
        let kept: Vec<(usize, usize)> = dims
            .iter()
            .zip(strides)
            .filter(|(d, _)| **d > 1)
            .map(|(d, s)| (*d, *s))
            .collect();
        let inner = kept.last()?.1;
        kept.windows(2)
            .all(|w| w[0].1 == w[1].1 * w[1].0)
            .then_some(inner as i64)
    }

    pub(super) fn try_cublaslt<B: Backend>(
        lhs: &FloatTensor<B>,
        rhs: &FloatTensor<B>,
        policy: MatmulPolicy,
    ) -> Option<FloatTensor<B>> {
        if !policy.cublaslt {
            return None;
        }
        let (ls, rs) = (lhs.shape(), rhs.shape());
        let rank = ls.num_dims();
        if rank < 2 || rs.num_dims() != rank || lhs.dtype() != rhs.dtype() {
            return None;
        }
        let (ld, rd): (Vec<usize>, Vec<usize>) =
            (ls.iter().copied().collect(), rs.iter().copied().collect());
        let (m, k, n) = (ld[rank - 2], ld[rank - 1], rd[rank - 1]);
        if rd[rank - 2] != k || m == 0 || n == 0 || k == 0 {
            return None;
        }
        let mut out_batch = Vec::with_capacity(rank - 2);
        for (a, b) in ld[..rank - 2].iter().zip(&rd[..rank - 2]) {
            match (a, b) {
                (a, b) if a == b => out_batch.push(*a),
                (1, b) => out_batch.push(*b),
                (a, 1) => out_batch.push(*a),
                _ => return None,
            }
        }
        let batch: usize = out_batch.iter().product();
        if ((batch * m * n * k) as u64) < policy.min_macs || batch > i32::MAX as usize {
            return None;
        }
        // Cheap checks passed: materialize and look at the memory.
        let a = cuda_view::<B>(lhs)?;
        let b = cuda_view::<B>(rhs)?;
        // C = A·B row-major is Cᵀ = Bᵀ·Aᵀ column-major: cuBLASLt's A is our rhs.
        let (b_ld, b_trans) = transposed_operand(&b, k, n)?;
        let (a_ld, a_trans) = transposed_operand(&a, m, k)?;
        let (a_stride, b_stride) = (batch_stride(&a, &out_batch)?, batch_stride(&b, &out_batch)?);
        let device = B::float_device(lhs);
        let mut shape = out_batch.clone();
        shape.extend([m, n]);
        let out = B::float_empty(shape.into(), &device, lhs.dtype().into());
        // cubecl pitches the rows of 2-D+ allocations: take the output's real strides.
        let d = cuda_view::<B>(&out)?;
        let (d_ld, d_trans) = transposed_operand(&d, m, n)?;
        let d_batch_stride = batch_stride(&d, &out_batch)?;
        if d_trans {
            return None;
        }
        let gemm = Gemm {
            m: n as u64,
            n: m as u64,
            k: k as u64,
            batch: batch as i32,
            a: Operand {
                ptr: b.ptr,
                ld: b_ld,
                trans: b_trans,
                batch_stride: b_stride,
            },
            b: Operand {
                ptr: a.ptr,
                ld: a_ld,
                trans: a_trans,
                batch_stride: a_stride,
            },
            d: d.ptr,
            d_ld,
            d_batch_stride: if batch > 1 { d_batch_stride } else { 0 },
            dtype: a.dtype,
            tf32: policy.allow_tf32,
        };
        B::sync(&device).ok()?;
        // SAFETY: the three views hold their memory; the inputs are complete (synchronized
        // above); the output is a fresh contiguous allocation of batch·m·n elements.
        match unsafe { cublaslt::run(a.ordinal, &gemm) } {
            Ok(()) => Some(out),
            Err(e) => {
                crate::log::warn(&format!(
                    "cuBLASLt failed, using the inner backend's matmul: {e}"
                ));
                None
            }
        }
    }
}
