//! The float primitive of [`ZeroBackend`](super::ZeroBackend).

#[cfg(feature = "zero3")]
use std::sync::Arc;

use burn_backend::{Backend, DType, Shape, TensorMetadata};

#[cfg(feature = "zero3")]
use super::sharded::{ShardedParam, ShardedView};
use super::view::ViewOp;

/// A float tensor as `ZeroBackend` holds it.
///
/// Every op reads its operands through [`ZeroTensor::into_inner`] / [`ZeroTensor::inner`] and
/// wraps its results with [`ZeroTensor::local`]: that is the single place where a sharded
/// parameter (ZeRO-3) is gathered on demand, without touching the forwarding code.
#[derive(Clone, Debug)]
pub struct ZeroTensor<B: Backend> {
    repr: Repr<B>,
}

/// Where the values of a [`ZeroTensor`] live.
#[derive(Clone, Debug)]
enum Repr<B: Backend> {
    /// The full tensor, held by the inner backend on this rank.
    Local(B::FloatTensorPrimitive),
    /// A ZeRO-3 parameter: this rank's partition, gathered by every op that reads it.
    #[cfg(feature = "zero3")]
    Sharded(ShardedView<B>),
}

impl<B: Backend> ZeroTensor<B> {
    /// Wraps a full tensor of the inner backend.
    pub fn local(tensor: B::FloatTensorPrimitive) -> Self {
        Self {
            repr: Repr::Local(tensor),
        }
    }

    /// A handle on a sharded parameter.
    #[cfg(feature = "zero3")]
    pub fn sharded(param: Arc<ShardedParam<B>>) -> Self {
        let shape = param.shape.clone();
        Self {
            repr: Repr::Sharded(ShardedView {
                param,
                views: Vec::new(),
                shape,
            }),
        }
    }

    /// The sharded parameter behind this handle, when it is one and no view was taken of it.
    #[cfg(feature = "zero3")]
    pub fn as_sharded(&self) -> Option<&Arc<ShardedParam<B>>> {
        match &self.repr {
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) if s.views.is_empty() => Some(&s.param),
            _ => None,
        }
    }

    /// The full tensor of the inner backend, consuming the handle (a sharded parameter is
    /// gathered).
    pub fn into_inner(self) -> B::FloatTensorPrimitive {
        match self.repr {
            Repr::Local(tensor) => tensor,
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => s.materialize(),
        }
    }

    /// The full tensor of the inner backend, borrowed.
    ///
    /// # Panics
    /// On a sharded parameter, which has no full tensor to borrow: read it by value.
    pub fn inner(&self) -> &B::FloatTensorPrimitive {
        match &self.repr {
            Repr::Local(tensor) => tensor,
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => panic!(
                "parameter #{} is a ZeRO-3 shard: it can be read by value only",
                s.param.slot
            ),
        }
    }

    /// A tensor of the inner backend on the same device: the tensor itself, or a sharded
    /// parameter's partition (for queries such as `float_device`; a partition's dtype may be
    /// wider than the parameter's, see [`ShardedParam::dtype`](super::ShardedParam)).
    pub fn inner_for_metadata(&self) -> &B::FloatTensorPrimitive {
        match &self.repr {
            Repr::Local(tensor) => tensor,
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => &s.param.partition,
        }
    }

    /// The full tensor of the inner backend, mutably borrowed (gradient hooks replace it).
    ///
    /// # Panics
    /// On a sharded parameter (gradients are never sharded handles).
    pub fn inner_mut(&mut self) -> &mut B::FloatTensorPrimitive {
        match &mut self.repr {
            Repr::Local(tensor) => tensor,
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => panic!(
                "parameter #{} is a ZeRO-3 shard and cannot be modified in place",
                s.param.slot
            ),
        }
    }

    /// Whether the full tensor is present on this rank.
    pub fn is_local(&self) -> bool {
        matches!(self.repr, Repr::Local(_))
    }

    /// A shape-only op: applied now to a local tensor, recorded on a sharded handle.
    pub(crate) fn view(self, op: ViewOp) -> Self {
        match self.repr {
            Repr::Local(t) => Self::local(op.apply::<B>(t)),
            #[cfg(feature = "zero3")]
            Repr::Sharded(mut s) => {
                s.shape = op.shape(&s.shape);
                s.views.push(op);
                Self {
                    repr: Repr::Sharded(s),
                }
            }
        }
    }
}

impl<B: Backend> TensorMetadata for ZeroTensor<B> {
    fn dtype(&self) -> DType {
        match &self.repr {
            Repr::Local(t) => t.dtype(),
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => s.param.dtype,
        }
    }

    fn shape(&self) -> Shape {
        match &self.repr {
            Repr::Local(t) => t.shape(),
            #[cfg(feature = "zero3")]
            Repr::Sharded(s) => s.shape.clone(),
        }
    }

    fn rank(&self) -> usize {
        self.shape().num_dims()
    }
}
