//! `Σ g²` of f32 gradient pieces on burn-cuda: cubecl-kernels' sum of squares as an operation
//! of burn's fusion stream, one per piece (each piece read once; no squares written out; the
//! same bits every run).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::norm::{SquaresPiece, sum_of_squares as squares_kernel};

use crate::backend::fused_op::run_fused;
use crate::nn::downcast::float_as;

type Cuda = burn::backend::Cuda;

/// `Σ g²` over `grad` as a `[1]` f32 tensor, or `None` when the pieces are not burn-cuda f32
/// tensors (the caller sums with burn ops then).
pub(crate) fn sum_of_squares<I: Backend>(grad: &[Tensor<I, 1>]) -> Option<Tensor<I, 1>> {
    if grad.is_empty() || grad.iter().any(|g| g.dtype() != DType::F32) {
        return None;
    }
    let pieces: Vec<Tensor<Cuda, 1>> = grad
        .iter()
        .map(|g| float_as::<I, Cuda, 1>(g.clone()))
        .collect::<Option<_>>()?;
    let mut total: Option<Tensor<Cuda, 1>> = None;
    for piece in pieces {
        let fused = piece.into_primitive().tensor();
        let [squares] = run_fused(
            "burn_zero_sum_of_squares",
            [&fused],
            [(Shape::new([1]), DType::F32)],
            |[g]| {
                let g = into_contiguous(g);
                let len = g.meta.shape().num_elements();
                let piece = SquaresPiece {
                    handle: &g.handle,
                    len,
                };
                let out = squares_kernel::<CudaRuntime>(&g.client, &[piece]);
                [CubeTensor::new_contiguous(
                    g.client.clone(),
                    g.device.clone(),
                    [1].into(),
                    out,
                    DType::F32,
                )]
            },
        );
        let squares = Tensor::<Cuda, 1>::from_primitive(TensorPrimitive::Float(squares));
        total = Some(match total {
            Some(t) => t + squares,
            None => squares,
        });
    }
    float_as::<Cuda, I, 1>(total?)
}
