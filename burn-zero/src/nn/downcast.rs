//! A tensor of a generic backend seen as one of a concrete backend when the two are the same
//! type: how a generic `Backend` function reaches a custom autodiff op of `Autodiff<Z>`.

use core::any::Any;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorPrimitive};

/// `t` as a tensor of backend `C`, when `A` is `C`.
pub(crate) fn float_as<A: Backend, C: Backend, const D: usize>(
    t: Tensor<A, D>,
) -> Option<Tensor<C, D>> {
    let any: Box<dyn Any> = Box::new(t.into_primitive());
    any.downcast::<TensorPrimitive<C>>()
        .ok()
        .map(|p| Tensor::from_primitive(*p))
}

pub(crate) fn int_as<A: Backend, C: Backend, const D: usize>(
    t: Tensor<A, D, Int>,
) -> Option<Tensor<C, D, Int>> {
    let any: Box<dyn Any> = Box::new(t.into_primitive());
    any.downcast::<C::IntTensorPrimitive>()
        .ok()
        .map(|p| Tensor::from_primitive(*p))
}
