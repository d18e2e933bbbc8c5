//! This rank's `Σ g²` over its gradient pieces, which the engine adds across ranks for the
//! global norm (clipping and the overflow check). On burn-cuda one CubeCL pass per piece in a
//! fixed order (`norm_cuda`); elsewhere burn ops in pieces.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `Σ g²` over every element of `grad` (f32 pieces) as a `[1]` f32 tensor on `device`, in a
/// fixed order when `deterministic` (and always on CUDA).
pub(crate) fn sum_of_squares<I: Backend>(
    grad: &[Tensor<I, 1>],
    deterministic: bool,
    device: &I::Device,
) -> Tensor<I, 1> {
    #[cfg(feature = "cuda")]
    if let Some(squares) = super::norm_cuda::sum_of_squares(grad) {
        return squares;
    }
    // In pieces: `grad · grad` of a whole partition is a second partition-sized buffer, which
    // a large model has no room for.
    const PIECE: usize = 1 << 26;
    let mut squares = Tensor::<I, 1>::zeros([1], (device, burn::tensor::DType::F32));
    for g in grad {
        let n = g.dims()[0];
        for start in (0..n).step_by(PIECE) {
            let piece = g.clone().slice(start..(start + PIECE).min(n));
            squares =
                squares + crate::backend::reduce::sum(piece.clone().mul(piece), deterministic);
        }
    }
    squares
}
