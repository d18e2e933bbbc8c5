//! Shape-only ops (reshape, transpose, swap, permute) of `ZeroBackend`: applied at once to a
//! local tensor, recorded on a ZeRO-3 handle and replayed after its gather.

use burn_backend::{Backend, Shape};

use super::ZeroTensor;

/// A shape-only op, recorded on a sharded handle and replayed after the gather.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ViewOp {
    Reshape(Shape),
    Transpose,
    SwapDims(usize, usize),
    Permute(Vec<usize>),
}

impl ViewOp {
    /// The shape of the view of a tensor of shape `shape`.
    pub(crate) fn shape(&self, shape: &Shape) -> Shape {
        let mut dims = shape.to_vec();
        match self {
            ViewOp::Reshape(to) => return to.clone(),
            ViewOp::Transpose => {
                let n = dims.len();
                dims.swap(n - 2, n - 1);
            }
            ViewOp::SwapDims(a, b) => dims.swap(*a, *b),
            ViewOp::Permute(axes) => dims = axes.iter().map(|&a| shape[a]).collect(),
        }
        Shape::from(dims)
    }

    /// The op on a tensor of the inner backend.
    pub(crate) fn apply<B: Backend>(&self, t: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
        match self {
            ViewOp::Reshape(to) => B::float_reshape(t, to.clone()),
            ViewOp::Transpose => B::float_transpose(t),
            ViewOp::SwapDims(a, b) => B::float_swap_dims(t, *a, *b),
            ViewOp::Permute(axes) => B::float_permute(t, axes),
        }
    }
}

// The ops routed here (see `ops_list`) take and return `ZeroBackend`'s primitive unconverted.

pub(crate) fn float_reshape<B: Backend>(tensor: ZeroTensor<B>, shape: Shape) -> ZeroTensor<B> {
    tensor.view(ViewOp::Reshape(shape))
}

pub(crate) fn float_transpose<B: Backend>(tensor: ZeroTensor<B>) -> ZeroTensor<B> {
    tensor.view(ViewOp::Transpose)
}

pub(crate) fn float_swap_dims<B: Backend>(
    tensor: ZeroTensor<B>,
    dim1: usize,
    dim2: usize,
) -> ZeroTensor<B> {
    tensor.view(ViewOp::SwapDims(dim1, dim2))
}

pub(crate) fn float_permute<B: Backend>(tensor: ZeroTensor<B>, axes: &[usize]) -> ZeroTensor<B> {
    tensor.view(ViewOp::Permute(axes.to_vec()))
}
