//! `rms_norm`: RMSNorm over the last axis, one kernel each way on CUDA.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};

use super::dispatch::{FusedOp, apply};

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
    let dims = x.dims();
    let hidden = dims[D - 1];
    let x = x.reshape([dims[..D - 1].iter().product(), hidden]);
    apply(RmsNorm { eps }, [x, weight.reshape([1, hidden])]).reshape(dims)
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

/// The op on `[rows, hidden]` rows and a `[1, hidden]` weight; keeps `rstd` (`[rows, 1]` f32).
#[derive(Clone, Copy, Debug)]
struct RmsNorm {
    eps: f64,
}

impl FusedOp<2, 2> for RmsNorm {
    fn forward<Z: Backend>(&self, [x, w]: &[Tensor<Z, 2>; 2]) -> (Tensor<Z, 2>, Vec<Tensor<Z, 2>>) {
        #[cfg(feature = "cuda")]
        if let Some((y, rstd)) = super::cuda::rms_forward(x, w, self.eps) {
            return (y, vec![rstd]);
        }
        // The reference's own operations (the same bits off CUDA), keeping 1/rms.
        let rms = (x.clone().cast(DType::F32).square().mean_dim(1) + self.eps).sqrt();
        let y = (x.clone() / rms.clone().cast(x.dtype())) * w.clone();
        (y, vec![rms.recip()])
    }

    fn backward<Z: Backend>(
        &self,
        [x, w]: &[Tensor<Z, 2>; 2],
        saved: &[Tensor<Z, 2>],
        dy: Tensor<Z, 2>,
    ) -> [Option<Tensor<Z, 2>>; 2] {
        let hidden = x.dims()[1];
        let rstd = &saved[0];
        #[cfg(feature = "cuda")]
        if let Some((dx, dw)) = super::cuda::rms_backward(x, w, rstd, &dy) {
            return [Some(dx), Some(dw)];
        }
        let f32 = FloatDType::F32;
        let (x32, dy32, w32) = (x.clone().cast(f32), dy.cast(f32), w.clone().cast(f32));
        // dx = r·w·dy − r³·x·Σ(dy·w·x)/hidden, dw = Σ_rows dy·x·r
        let dot = (dy32.clone() * w32.clone() * x32.clone()).sum_dim(1);
        let c = rstd.clone().powi_scalar(3) * dot / hidden as f64;
        let dx = dy32.clone() * w32 * rstd.clone() - x32.clone() * c;
        let dw = (dy32 * x32 * rstd.clone()).sum_dim(0);
        [Some(dx.cast(x.dtype())), Some(dw.cast(w.dtype()))]
    }
}
