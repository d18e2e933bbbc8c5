//! The float primitive of [`ZeroBackend`](super::ZeroBackend).

use burn_backend::{Backend, DType, Shape, TensorMetadata};

/// A float tensor as `ZeroBackend` holds it.
///
/// Every op reads its operands through [`ZeroTensor::into_inner`] / [`ZeroTensor::inner`] and
/// wraps its results with [`ZeroTensor::local`]: that is the single place where a future
/// sharded parameter (ZeRO-3) is gathered on demand, without touching the forwarding code.
#[derive(Clone, Debug)]
pub struct ZeroTensor<B: Backend> {
    repr: Repr<B>,
}

/// Where the values of a [`ZeroTensor`] live.
#[derive(Clone, Debug)]
enum Repr<B: Backend> {
    /// The full tensor, held by the inner backend on this rank.
    Local(B::FloatTensorPrimitive),
}

impl<B: Backend> ZeroTensor<B> {
    /// Wraps a full tensor of the inner backend.
    pub fn local(tensor: B::FloatTensorPrimitive) -> Self {
        Self {
            repr: Repr::Local(tensor),
        }
    }

    /// The full tensor of the inner backend, consuming the handle.
    pub fn into_inner(self) -> B::FloatTensorPrimitive {
        match self.repr {
            Repr::Local(tensor) => tensor,
        }
    }

    /// The full tensor of the inner backend, borrowed.
    pub fn inner(&self) -> &B::FloatTensorPrimitive {
        match &self.repr {
            Repr::Local(tensor) => tensor,
        }
    }

    /// The full tensor of the inner backend, mutably borrowed (gradient hooks replace it).
    pub fn inner_mut(&mut self) -> &mut B::FloatTensorPrimitive {
        match &mut self.repr {
            Repr::Local(tensor) => tensor,
        }
    }

    /// Whether the full tensor is present on this rank.
    pub fn is_local(&self) -> bool {
        matches!(self.repr, Repr::Local(_))
    }
}

impl<B: Backend> TensorMetadata for ZeroTensor<B> {
    fn dtype(&self) -> DType {
        self.inner().dtype()
    }

    fn shape(&self) -> Shape {
        self.inner().shape()
    }

    fn rank(&self) -> usize {
        self.inner().rank()
    }
}
