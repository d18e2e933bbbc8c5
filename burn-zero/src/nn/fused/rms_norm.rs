//! `rms_norm`: RMSNorm over the last axis, one kernel each way on CUDA.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};

use super::dispatch::{AfterAdd, AfterAddOut, FusedOp, apply, apply_after_add};

/// `x / √(mean(x²) + eps) · weight` over the last axis of `x`, the mean in f32 whatever the
/// dtype of `x` (what burn's `RmsNorm::forward` computes). On `ZeroBackend<Cuda>` (with or
/// without `Autodiff`; `burn_zero.fused_kernels.rms_norm`, default on) one kernel forward and
/// one backward (plus a deterministic sum for the weight's gradient); elsewhere burn ops.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    if !super::enabled(|f| f.rms_norm) {
        return reference(x, weight, eps);
    }
    // `x` keeps its rank (the kernels read it as `[rows, hidden]`): a reshape there and back
    // would be two more ops of autodiff and fusion per call, four with the backward's.
    apply(RmsNorm { eps }, [x, weight_of_rank(weight)])
}

/// `(x + residual, rms_norm(x + residual, weight, eps))`: a transformer block's residual add and
/// the norm after it. On `ZeroBackend<Cuda>` one kernel reads both addends and writes the sum
/// and the norm (the sum rounded once to the dtype, as the add rounds it); elsewhere, or with
/// `burn_zero.fused_kernels.rms_norm` off, the add and then [`rms_norm`]. `x` and `residual`
/// have one shape.
pub fn add_rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    if !super::enabled(|f| f.rms_norm) {
        let sum = x + residual;
        return (sum.clone(), reference(sum, weight, eps));
    }
    apply_after_add(RmsNorm { eps }, x, residual, weight_of_rank(weight))
}

/// The `[hidden]` weight as `[1, …, 1, hidden]`, of the input's rank (the op's inputs share one).
fn weight_of_rank<B: Backend, const D: usize>(weight: Tensor<B, 1>) -> Tensor<B, D> {
    let mut shape = [1; D];
    shape[D - 1] = weight.dims()[0];
    weight.reshape(shape)
}

/// burn's formula (`RmsNorm::forward`): the path with the kernels switched off.
fn reference<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + eps).sqrt();
    (x / rms.cast(dtype)) * weight.unsqueeze()
}

/// The op on `x` of any rank (rows over its leading axes) and a `[1, …, 1, hidden]` weight;
/// keeps `rstd` (f32, `x`'s shape with 1 last).
#[derive(Clone, Copy, Debug)]
struct RmsNorm {
    eps: f64,
}

impl<const D: usize> FusedOp<2, D> for RmsNorm {
    fn forward<Z: Backend>(&self, [x, w]: &[Tensor<Z, D>; 2]) -> (Tensor<Z, D>, Vec<Tensor<Z, D>>) {
        #[cfg(feature = "cuda")]
        if let Some((y, rstd)) = super::cuda::rms_forward(x, w, self.eps) {
            return (y, vec![rstd]);
        }
        // The reference's own operations (the same bits off CUDA), keeping 1/rms.
        let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + self.eps).sqrt();
        let y = (x.clone() / rms.clone().cast(x.dtype())) * w.clone();
        (y, vec![rms.recip()])
    }

    fn backward<Z: Backend>(
        &self,
        [x, w]: &[Tensor<Z, D>; 2],
        saved: &[Tensor<Z, D>],
        dy: Tensor<Z, D>,
    ) -> [Option<Tensor<Z, D>>; 2] {
        let dims = x.dims();
        let hidden = dims[D - 1];
        let rstd = &saved[0];
        #[cfg(feature = "cuda")]
        if let Some((dx, dw)) = super::cuda::rms_backward(x, w, rstd, &dy) {
            return [Some(dx), Some(dw)];
        }
        // In rows: the weight's gradient is a sum over every leading axis.
        let rows = dims[..D - 1].iter().product::<usize>();
        let f32 = FloatDType::F32;
        let x32 = x.clone().cast(f32).reshape([rows, hidden]);
        let dy32 = dy.cast(f32).reshape([rows, hidden]);
        let w32 = w.clone().cast(f32).reshape([1, hidden]);
        let rstd = rstd.clone().reshape([rows, 1]);
        // dx = r·w·dy − r³·x·Σ(dy·w·x)/hidden, dw = Σ_rows dy·x·r
        let dot = (dy32.clone() * w32.clone() * x32.clone()).sum_dim(1);
        let c = rstd.clone().powi_scalar(3) * dot / hidden as f64;
        let dx = dy32.clone() * w32 * rstd.clone() - x32.clone() * c;
        let dw = (dy32 * x32 * rstd).sum_dim(0);
        [
            Some(dx.cast(x.dtype()).reshape(dims)),
            Some(dw.cast(w.dtype()).reshape(w.dims())),
        ]
    }
}

impl<const D: usize> AfterAdd<D> for RmsNorm {
    #[allow(unused_variables)] // all read on CUDA only
    fn fused_after_add<Z: Backend>(
        &self,
        x: &Tensor<Z, D>,
        residual: &Tensor<Z, D>,
        w: &Tensor<Z, D>,
    ) -> Option<AfterAddOut<Z, D>> {
        #[cfg(feature = "cuda")]
        if let Some((sum, y, rstd)) = super::cuda::rms_add_forward(x, residual, w, self.eps) {
            return Some((sum, y, vec![rstd]));
        }
        None
    }
}
