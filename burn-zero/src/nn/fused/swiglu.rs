//! `swiglu`: `silu(gate) · up`, one kernel each way on CUDA.

use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

use super::dispatch::{FusedOp, apply};

/// `silu(gate) · up` (Llama's MLP activation), in f32 arithmetic on CUDA. On
/// `ZeroBackend<Cuda>` (`burn_zero.fused_kernels.swiglu`, default on) one kernel forward and
/// one backward that recomputes the sigmoid (nothing kept but the inputs); elsewhere burn ops.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu: gate {:?} and up {:?} differ in shape",
        gate.dims(),
        up.dims()
    );
    if !super::enabled(|f| f.swiglu) {
        return silu(gate) * up;
    }
    apply(Swiglu, [gate, up])
}

#[derive(Clone, Copy, Debug)]
struct Swiglu;

impl<const D: usize> FusedOp<2, D> for Swiglu {
    fn forward<Z: Backend>(
        &self,
        [gate, up]: &[Tensor<Z, D>; 2],
    ) -> (Tensor<Z, D>, Vec<Tensor<Z, D>>) {
        #[cfg(feature = "cuda")]
        if let Some(out) = super::cuda::swiglu_forward_op(gate, up) {
            return (out, Vec::new());
        }
        (silu(gate.clone()) * up.clone(), Vec::new())
    }

    fn backward<Z: Backend>(
        &self,
        [gate, up]: &[Tensor<Z, D>; 2],
        _: &[Tensor<Z, D>],
        d_out: Tensor<Z, D>,
    ) -> [Option<Tensor<Z, D>>; 2] {
        #[cfg(feature = "cuda")]
        if let Some((dg, du)) = super::cuda::swiglu_backward_op(gate, up, &d_out) {
            return [Some(dg), Some(du)];
        }
        let f32 = FloatDType::F32;
        let (g, u, d) = (
            gate.clone().cast(f32),
            up.clone().cast(f32),
            d_out.cast(f32),
        );
        let s = sigmoid(g.clone());
        let dg = d.clone() * u * s.clone() * ((-s.clone() + 1.0) * g.clone() + 1.0);
        let du = d * g * s;
        [Some(dg.cast(gate.dtype())), Some(du.cast(up.dtype()))]
    }
}
