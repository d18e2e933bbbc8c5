//! `float_matmul` of `ZeroBackend`: cuBLASLt for the CUDA tensors it can take, the inner
//! backend's matmul for everything else.
//!
//! The choice is made per call from the operands' metadata: CUDA f32/bf16/f16 tensors of equal
//! dtype whose matrices are row- or column-major (transposed views need no copy), batch dims
//! that broadcast and flatten to one stride, and at least [`MatmulPolicy::min_macs`]
//! multiply-adds. bf16/f16 accumulate in f32; f32 uses TF32 only with
//! [`MatmulPolicy::allow_tf32`].
//!
//! Ordering: cubecl 0.10 does not expose its compute stream, so cuBLASLt runs on its own and
//! the two streams wait for each other through flags in device memory (`stream_order.rs`): the
//! host never waits for the GPU. If the flag kernels cannot be loaded, each call synchronizes.

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

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

/// Where the time of cuBLASLt calls went since the last [`take_matmul_profile`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MatmulProfile {
    /// cuBLASLt calls.
    pub calls: u64,
    /// Host microseconds per phase: operand addresses, output allocation, ordering before,
    /// the cuBLASLt call, ordering after.
    pub host_us: [f64; 5],
    /// Summed GPU microseconds of the GEMMs themselves (with `BURN_ZERO_MATMUL_PROFILE=1`).
    pub gemm_gpu_us: f64,
}

static PROFILE: std::sync::Mutex<MatmulProfile> = std::sync::Mutex::new(MatmulProfile {
    calls: 0,
    host_us: [0.0; 5],
    gemm_gpu_us: 0.0,
});

/// The profile of cuBLASLt calls on GPU `ordinal` since the last call, reset. Waits for the
/// GEMMs when their GPU time is recorded.
pub fn take_matmul_profile(ordinal: usize) -> MatmulProfile {
    let profile = std::mem::take(&mut *PROFILE.lock().unwrap_or_else(|e| e.into_inner()));
    #[cfg(feature = "cuda")]
    let profile = MatmulProfile {
        gemm_gpu_us: f64::from(
            crate::backend::cublaslt::take_gpu_ms(ordinal)
                .iter()
                .sum::<f32>(),
        ) * 1e3,
        ..profile
    };
    #[cfg(not(feature = "cuda"))]
    let _ = ordinal;
    profile
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

/// Prepends 1-dims to `tensor` up to `rank`.
fn unsqueeze_leading<B: Backend>(tensor: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
    let shape = tensor.shape();
    if shape.num_dims() >= rank {
        return tensor;
    }
    let mut dims = vec![1; rank - shape.num_dims()];
    dims.extend(shape.iter().copied());
    B::float_reshape(tensor, dims.into())
}

/// `ZeroBackend::linear`: `x·W (+ b)` through [`float_matmul`], so burn's `Linear` layers
/// reach cuBLASLt (the inner backend's `linear` would call its own matmul).
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    if !matmul_policy().cublaslt {
        return B::linear(x, weight, bias);
    }
    linear_on_matmul::<B>(x, weight, bias)
}

fn linear_on_matmul<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let out = float_matmul::<B>(x, unsqueeze_leading::<B>(weight, rank));
    match bias {
        Some(bias) => B::float_add(out, unsqueeze_leading::<B>(bias, rank)),
        None => out,
    }
}

/// `ZeroBackend::linear_x_backward`: `dY·Wᵀ` through [`float_matmul`] (`Wᵀ` a strided view).
pub(crate) fn linear_x_backward<B: Backend>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if !matmul_policy().cublaslt {
        return B::linear_x_backward(weight, output_grad);
    }
    linear_x_backward_on_matmul::<B>(weight, output_grad)
}

fn linear_x_backward_on_matmul<B: Backend>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let rank = output_grad.shape().num_dims();
    let weight_t = unsqueeze_leading::<B>(B::float_swap_dims(weight, 0, 1), rank);
    float_matmul::<B>(output_grad, weight_t)
}

/// `ZeroBackend::linear_weight_backward`: `Σ_batch xᵀ·dY` as one GEMM over the stacked rows
/// of every batch (`[in, rows]·[rows, out]`), not a batched GEMM and a sum.
pub(crate) fn linear_weight_backward<B: Backend>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if !matmul_policy().cublaslt {
        return B::linear_weight_backward(x, output_grad);
    }
    linear_weight_backward_on_matmul::<B>(x, output_grad)
}

fn linear_weight_backward_on_matmul<B: Backend>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let (xs, gs) = (x.shape(), output_grad.shape());
    let (d_in, d_out) = (xs[xs.num_dims() - 1], gs[gs.num_dims() - 1]);
    let rows = xs.num_elements() / d_in.max(1);
    let x = B::float_reshape(x, [rows, d_in].into());
    let output_grad = B::float_reshape(output_grad, [rows, d_out].into());
    float_matmul::<B>(B::float_swap_dims(x, 0, 1), output_grad)
}

/// Host time per phase of one cuBLASLt call, added to [`PROFILE`] when it succeeds.
#[cfg(feature = "cuda")]
struct PhaseClock {
    last: std::time::Instant,
    us: [f64; 5],
}

#[cfg(feature = "cuda")]
impl PhaseClock {
    fn start() -> Self {
        Self {
            last: std::time::Instant::now(),
            us: [0.0; 5],
        }
    }

    fn lap(&mut self, phase: usize) {
        let now = std::time::Instant::now();
        self.us[phase] += (now - self.last).as_secs_f64() * 1e6;
        self.last = now;
    }

    fn record(&self) {
        let mut p = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
        p.calls += 1;
        for (total, us) in p.host_us.iter_mut().zip(self.us) {
            *total += us;
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn_backend::{Backend, TensorMetadata, tensor::FloatTensor};

    use super::{MatmulPolicy, PhaseClock};
    use crate::backend::cublaslt::{self, Gemm, Operand};
    use crate::backend::cuda::{CudaView, cuda_view};
    use crate::backend::stream_order;

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

    /// `BURN_ZERO_CUBLASLT_ORDER=sync` (read once): order by host synchronization even where the
    /// handshake works, to compare the two.
    fn host_sync_forced() -> bool {
        static SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SYNC.get_or_init(|| std::env::var("BURN_ZERO_CUBLASLT_ORDER").is_ok_and(|v| v == "sync"))
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
        let mut clock = PhaseClock::start();
        let a = cuda_view::<B>(lhs)?;
        let b = cuda_view::<B>(rhs)?;
        // C = A·B row-major is Cᵀ = Bᵀ·Aᵀ column-major: cuBLASLt's A is our rhs.
        let (b_ld, b_trans) = transposed_operand(&b, k, n)?;
        let (a_ld, a_trans) = transposed_operand(&a, m, k)?;
        let (a_stride, b_stride) = (batch_stride(&a, &out_batch)?, batch_stride(&b, &out_batch)?);
        let device = B::float_device(lhs);
        let mut shape = out_batch.clone();
        shape.extend([m, n]);
        clock.lap(0);
        let out = B::float_empty(shape.into(), &device, lhs.dtype().into());
        // cubecl pitches the rows of 2-D+ allocations: take the output's real strides.
        let d = cuda_view::<B>(&out)?;
        let (d_ld, d_trans) = transposed_operand(&d, m, n)?;
        let d_batch_stride = batch_stride(&d, &out_batch)?;
        if d_trans {
            return None;
        }
        // A row-major lhs whose matrices follow each other times a shared rhs (a Linear's
        // `[batch, tokens, in]·[in, out]`) is one GEMM of batch·m rows, not a batched one.
        let fold = batch > 1
            && b_stride == 0
            && !a_trans
            && a_stride == m as i64 * a_ld
            && d_batch_stride == m as i64 * d_ld;
        let (rows, batch) = if fold { (batch * m, 1) } else { (m, batch) };
        let gemm = Gemm {
            m: n as u64,
            n: rows as u64,
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
        clock.lap(1);
        let client = &d.keep.client;
        let ordered =
            !host_sync_forced() && cublaslt::supports_handshake(a.ordinal).unwrap_or(false);
        let handshake = if ordered {
            Some(stream_order::begin(client, a.ordinal)?)
        } else {
            B::sync(&device).ok()?;
            None
        };
        clock.lap(2);
        // SAFETY: the three views hold their memory until the call is ordered before burn's
        // next kernels (`end` below, or the synchronization inside `run`); the inputs are
        // complete once `ready` is raised (or after the sync above); the output has the
        // extents described.
        match unsafe { cublaslt::run(a.ordinal, &gemm, handshake) } {
            Ok(()) => {
                clock.lap(3);
                if let Some(h) = handshake {
                    stream_order::end(client, a.ordinal, h);
                }
                clock.lap(4);
                clock.record();
                Some(out)
            }
            Err(e) => {
                crate::log::warn(&format!(
                    "cuBLASLt failed, using the inner backend's matmul: {e}"
                ));
                None
            }
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn_backend::{TensorData, TensorPrimitive, ops::FloatTensorOps, ops::ModuleOps};

    use super::*;

    type B = NdArray;

    fn tensor(shape: &[usize], seed: usize) -> FloatTensor<B> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + seed * 101) % 23) as f32 / 11.0 - 1.0)
            .collect();
        B::float_from_data(TensorData::new(values, shape.to_vec()), &Default::default())
    }

    fn values(t: FloatTensor<B>) -> (Vec<usize>, Vec<f32>) {
        let shape: Vec<usize> = t.shape().iter().copied().collect();
        let flat = B::float_reshape(t, [shape.iter().product::<usize>()].into());
        let flat = burn::tensor::Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat));
        (shape, flat.into_data().to_vec().unwrap())
    }

    fn assert_close(got: FloatTensor<B>, want: FloatTensor<B>) {
        let ((gs, g), (ws, w)) = (values(got), values(want));
        assert_eq!(gs, ws, "shape");
        for (a, b) in g.iter().zip(&w) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    /// The Linear routes (one GEMM over stacked rows for the weight gradient) equal burn's
    /// own `linear` ops, on a 3-D input of odd sizes.
    #[test]
    fn linear_on_matmul_equals_burn_linear() {
        let (x, w, b, g) = (
            tensor(&[2, 5, 7], 1),
            tensor(&[7, 3], 2),
            tensor(&[3], 3),
            tensor(&[2, 5, 3], 4),
        );
        assert_close(
            linear_on_matmul::<B>(x.clone(), w.clone(), Some(b.clone())),
            B::linear(x.clone(), w.clone(), Some(b)),
        );
        assert_close(
            linear_on_matmul::<B>(x.clone(), w.clone(), None),
            B::linear(x.clone(), w.clone(), None),
        );
        assert_close(
            linear_x_backward_on_matmul::<B>(w.clone(), g.clone()),
            B::linear_x_backward(w, g.clone()),
        );
        assert_close(
            linear_weight_backward_on_matmul::<B>(x.clone(), g.clone()),
            B::linear_weight_backward(x, g),
        );
    }
}
