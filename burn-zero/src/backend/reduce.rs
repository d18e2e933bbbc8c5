//! Whole-tensor sums: `ZeroBackend::float_sum` (the model's, on the engine's thread) and
//! [`sum`] (the engine's own, on inner-backend tensors: the gradient norm), each the inner
//! backend's or, under `burn_zero.deterministic`, one whose order does not change from run to
//! run.
//!
//! burn-cuda 0.21 sums a whole tensor with an autotuned choice that includes one kernel whose
//! cubes add their partial sums into the result with atomics (`shared_sum`): the order of
//! those additions, and so the last bits, differ between runs. The gradient norm that clipping
//! divides by is such a sum. Reductions along a dimension have no atomic variant, so the
//! deterministic sum is two of those: rows of [`COLUMNS`] elements, then the row sums (and a
//! ragged tail on its own).

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

/// Elements per row of the first pass.
const COLUMNS: usize = 4096;

/// `ZeroBackend::float_sum` on the inner backend's primitive.
pub(crate) fn float_sum<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    if !super::settings::with(|s| s.deterministic) {
        return B::float_sum(tensor);
    }
    deterministic_sum::<B>(tensor)
}

/// The sum of every element of `tensor` as a `[1]` tensor, in a fixed order when
/// `deterministic`.
pub(crate) fn sum<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    deterministic: bool,
) -> Tensor<B, 1> {
    if !deterministic {
        return tensor.sum();
    }
    let primitive = tensor.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(deterministic_sum::<B>(primitive)))
}

/// The sum of every element of `tensor` as a `[1]` tensor, by reductions along dimensions only.
fn deterministic_sum<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    use burn_backend::TensorMetadata;
    let n = tensor.shape().num_elements();
    if n == 0 {
        return B::float_sum(tensor);
    }
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        tensor,
        [n].into(),
    )));
    let rows = n / COLUMNS;
    let main = (rows > 0).then(|| {
        flat.clone()
            .slice(0..rows * COLUMNS)
            .reshape([rows, COLUMNS])
            .sum_dim(1)
            .reshape([rows])
            .sum_dim(0)
    });
    let tail = (rows * COLUMNS < n).then(|| flat.slice(rows * COLUMNS..n).sum_dim(0));
    let total = match (main, tail) {
        (Some(main), Some(tail)) => main + tail,
        (Some(sum), None) | (None, Some(sum)) => sum,
        (None, None) => unreachable!("n > 0"),
    };
    total.into_primitive().tensor()
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    use super::*;

    /// Sizes below, at and around a row, and several rows with a tail: the sum of integers
    /// (exact in f32) equals the arithmetic one.
    #[test]
    fn deterministic_sum_adds_every_element_once() {
        let device = Default::default();
        for n in [
            1usize,
            7,
            COLUMNS - 1,
            COLUMNS,
            COLUMNS + 1,
            3 * COLUMNS + 17,
        ] {
            let values: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let want: f32 = values.iter().sum();
            let t = Tensor::<NdArray, 2>::from_data(TensorData::new(values, [1, n]), &device);
            let sum = deterministic_sum::<NdArray>(t.into_primitive().tensor());
            let got = Tensor::<NdArray, 1>::from_primitive(TensorPrimitive::Float(sum));
            assert_eq!(got.dims(), [1], "n = {n}");
            assert_eq!(got.into_scalar(), want, "n = {n}");
        }
    }
}
