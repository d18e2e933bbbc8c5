//! `float_matmul` of `ZeroBackend`: cuBLASLt for the CUDA tensors it can take, the inner
//! backend's matmul for everything else.
//!
//! The choice is made per call from the operands' metadata: CUDA f32/bf16/f16 tensors of equal
//! dtype whose matrices are row- or column-major (transposed views need no copy), batch dims
//! that broadcast and flatten to one stride, and at least [`MatmulPolicy::min_macs`]
//! multiply-adds. bf16/f16 accumulate in f32; f32 uses TF32 only with
//! [`MatmulPolicy::allow_tf32`].
//!
//! Ordering ([`MatmulPolicy::order`]): by default cubecl's thread issues the GEMM on burn's own
//! CUDA stream (the patched cubecl-cuda names it), between the kernels before and after it.
//! With `handshake`, cuBLASLt runs on its own stream and the two streams wait for each other
//! through flags in device memory (`stream_order.rs`); if the flag kernels cannot be loaded,
//! each call synchronizes. In every order the host never waits for the GPU. Behind burn's fusion (burn-cuda's default) a product is an operation of fusion's stream:
//! the caller registers it and goes on (`matmul_cuda.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use crate::config::GemmOrder;

/// How `ZeroBackend` runs matmuls (`burn_zero.matmul`): one engine's choice, read from the
/// dispatching thread's [`settings`](super::settings) and carried with each product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulPolicy {
    /// Route eligible CUDA matmuls to cuBLASLt (off: always the inner backend).
    pub cublaslt: bool,
    /// Let f32 matmuls use TF32 tensor cores in cuBLASLt.
    pub allow_tf32: bool,
    /// Smaller products (batch·m·n·k) stay on the inner backend, except f32 ones without
    /// [`allow_tf32`](Self::allow_tf32): burn-cuda multiplies f32 in TF32.
    pub min_macs: u64,
    /// Where GEMMs run and what orders them against burn's kernels.
    pub order: GemmOrder,
    /// GEMMs ordered by a handshake are planned for this many SMs fewer than the GPU has (0:
    /// all).
    pub sm_margin: u32,
    /// A new GEMM shape times cuBLASLt's top choices once and keeps the fastest.
    pub tune: bool,
    /// Each GEMM's GPU time is recorded ([`take_matmul_profile`]).
    pub profile: bool,
}

impl Default for MatmulPolicy {
    fn default() -> Self {
        Self {
            // On: ordered by device flags and run in fusion's stream, a product costs the host
            // no wait (see the module doc).
            cublaslt: true,
            allow_tf32: false,
            min_macs: 1 << 24,
            order: GemmOrder::Stream,
            sm_margin: 1,
            tune: true,
            profile: false,
        }
    }
}

static CUBLASLT_CALLS: AtomicU64 = AtomicU64::new(0);

/// Sets how matmuls dispatched from this thread run from now on.
pub fn set_matmul_policy(policy: MatmulPolicy) {
    super::settings::update(|s| s.matmul = policy);
}

/// How matmuls dispatched from this thread run now.
pub fn matmul_policy() -> MatmulPolicy {
    super::settings::with(|s| s.matmul)
}

/// Matmuls that ran through cuBLASLt in this process so far (those in fusion's stream count
/// once fusion ran them: after a read or a sync).
pub fn cublaslt_calls() -> u64 {
    CUBLASLT_CALLS.load(Ordering::Relaxed)
}

#[cfg(feature = "cuda")]
pub(crate) fn count_cublaslt_call() {
    CUBLASLT_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// Where the time of cuBLASLt calls went since the last [`take_matmul_profile`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MatmulProfile {
    /// cuBLASLt calls.
    pub calls: u64,
    /// Host microseconds per phase: operands (resolved through fusion, or taken from its
    /// handles when the product runs in fusion's stream), cubecl (output allocated,
    /// addresses, reached through one call into its thread), ordering before, the cuBLASLt
    /// call, ordering after (and, off fusion's stream, the output handed to fusion).
    pub host_us: [f64; 5],
    /// Summed GPU microseconds of the GEMMs themselves (with `BURN_ZERO_MATMUL_PROFILE=1`).
    pub gemm_gpu_us: f64,
}

pub(crate) static PROFILE: std::sync::Mutex<MatmulProfile> = std::sync::Mutex::new(MatmulProfile {
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

/// `ZeroBackend::float_matmul`, on the inner backend's primitives: [`matmul`], counted by the
/// FLOPs profiler.
pub(crate) fn float_matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    if !crate::profile::recording() {
        return matmul::<B>(lhs, rhs);
    }
    let k = *lhs.shape().last().unwrap_or(&0);
    let out = matmul::<B>(lhs, rhs);
    crate::profile::record_macs((out.shape().num_elements() * k) as u64);
    out
}

/// A matrix product through cuBLASLt where it takes it, else the inner backend's.
fn matmul<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    #[cfg(feature = "cuda")]
    if let Some(out) = crate::backend::matmul_cuda::try_cublaslt::<B>(&lhs, &rhs, matmul_policy()) {
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

/// For the FLOPs profiler, while it records: `a`'s elements × `outer()` MACs of a linear
/// layer's product (`a` is `[.., inner]`), and with a `bias` one add per output element.
fn record_linear<B: Backend>(a: &FloatTensor<B>, outer: impl FnOnce() -> usize, bias: bool) {
    if crate::profile::recording() {
        let shape = a.shape();
        let (outer, rows) = (
            outer(),
            shape.num_elements() / shape[shape.num_dims() - 1].max(1),
        );
        crate::profile::record_macs((shape.num_elements() * outer) as u64);
        crate::profile::record_elements(if bias { rows * outer } else { 0 } as u64);
    }
}

/// `ZeroBackend::linear`: `x·W (+ b)` through [`matmul`], so burn's `Linear` layers
/// reach cuBLASLt (the inner backend's `linear` would call its own matmul).
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    record_linear::<B>(&x, || *weight.shape().last().unwrap_or(&0), bias.is_some());
    linear_on_matmul::<B>(x, weight, bias)
}

fn linear_on_matmul<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let out = matmul::<B>(x, unsqueeze_leading::<B>(weight, rank));
    match bias {
        Some(bias) => B::float_add(out, unsqueeze_leading::<B>(bias, rank)),
        None => out,
    }
}

/// `ZeroBackend::linear_x_backward`: `dY·Wᵀ` through [`matmul`] (`Wᵀ` a strided view).
pub(crate) fn linear_x_backward<B: Backend>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    record_linear::<B>(&output_grad, || weight.shape()[0], false);
    linear_x_backward_on_matmul::<B>(weight, output_grad)
}

fn linear_x_backward_on_matmul<B: Backend>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let rank = output_grad.shape().num_dims();
    let weight_t = unsqueeze_leading::<B>(B::float_swap_dims(weight, 0, 1), rank);
    matmul::<B>(output_grad, weight_t)
}

/// `ZeroBackend::linear_weight_backward`: `Σ_batch xᵀ·dY` as one GEMM over the stacked rows
/// of every batch (`[in, rows]·[rows, out]`), not a batched GEMM and a sum.
pub(crate) fn linear_weight_backward<B: Backend>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    record_linear::<B>(&x, || *output_grad.shape().last().unwrap_or(&0), false);
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
    matmul::<B>(B::float_swap_dims(x, 0, 1), output_grad)
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
