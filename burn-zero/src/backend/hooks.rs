//! Gradient hooks: where `ZeroBackend` hands each final gradient to the ZeRO engine.
//!
//! burn's autodiff (with the `distributed` feature) calls `DistributedBackend` functions of
//! `ZeroBackend` during `backward()`; they are routed to the [`GradientHook`] installed on the
//! calling thread for that inner backend. One thread drives one rank (a thread rank on CPU,
//! the process's main thread on a GPU), so a thread-local registry needs no rank lookup.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, backend::AutodiffBackend};
use burn_backend::{Backend, distributed::DistributedParamId};

use super::ZeroTensor;

/// Receives the gradient events of one backward pass on this thread.
pub trait GradientHook<B: Backend>: Send {
    /// A backward pass begins that will produce gradients for these parameters.
    fn on_backward_start(&mut self, params: &[DistributedParamId]) {
        let _ = params;
    }

    /// The gradient of `param` is final (every use has contributed). The hook may replace it
    /// in place, e.g. with its reduced partition.
    fn on_gradient_final(&mut self, param: DistributedParamId, grad: &mut ZeroTensor<B>);

    /// Every gradient of this backward pass has been submitted.
    fn on_backward_end(&mut self) {}
}

/// Per-thread registry of the objects `ZeroBackend` calls back into: gradient hooks and
/// parameter gatherers, one of each kind per inner backend, keyed by the boxed trait object's
/// type. One thread drives one rank, so no lookup by rank is needed.
pub mod registry {
    use core::any::{Any, TypeId};
    use std::cell::RefCell;

    thread_local! {
        static SLOTS: RefCell<Vec<(TypeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
    }

    /// Keeps an object installed on this thread; dropping it uninstalls the object.
    #[must_use = "the object is uninstalled when the guard is dropped"]
    pub struct Guard<T: ?Sized + 'static> {
        _kind: core::marker::PhantomData<(Box<T>, *const ())>,
    }

    impl<T: ?Sized + 'static> Drop for Guard<T> {
        fn drop(&mut self) {
            SLOTS.with(|s| {
                s.borrow_mut()
                    .retain(|(id, _)| *id != TypeId::of::<Box<T>>())
            });
        }
    }

    /// Installs `value` on this thread, replacing an earlier one of its kind.
    pub fn install<T: ?Sized + 'static>(value: Box<T>) -> Guard<T> {
        SLOTS.with(|s| {
            let mut s = s.borrow_mut();
            s.retain(|(id, _)| *id != TypeId::of::<Box<T>>());
            s.push((TypeId::of::<Box<T>>(), Box::new(Some(value))));
        });
        Guard {
            _kind: core::marker::PhantomData,
        }
    }

    /// Whether an object of this kind is installed on this thread.
    pub fn is_installed<T: ?Sized + 'static>() -> bool {
        SLOTS.with(|s| {
            s.borrow()
                .iter()
                .any(|(id, _)| *id == TypeId::of::<Box<T>>())
        })
    }

    /// Runs `f` on this thread's object of kind `T`, if one is installed (and not already
    /// running). The object is taken out while it runs, so it may run tensor ops itself.
    pub fn with<T: ?Sized + 'static, R>(f: impl FnOnce(&mut T) -> R) -> Option<R> {
        let mut value = access::<T, _>(|slot| slot.take()).flatten()?;
        let result = f(value.as_mut());
        access::<T, _>(|slot| *slot = Some(value));
        Some(result)
    }

    fn access<T: ?Sized + 'static, R>(f: impl FnOnce(&mut Option<Box<T>>) -> R) -> Option<R> {
        SLOTS.with(|s| {
            let mut s = s.borrow_mut();
            let (_, slot) = s.iter_mut().find(|(id, _)| *id == TypeId::of::<Box<T>>())?;
            Some(f(slot.downcast_mut::<Option<Box<T>>>()?))
        })
    }
}

/// Keeps a hook installed on this thread; dropping it uninstalls the hook.
pub type HookGuard<B> = registry::Guard<dyn GradientHook<B>>;

/// Installs `hook` for `ZeroBackend<B>` on the calling thread, replacing any earlier one.
pub fn install<B: Backend>(hook: Box<dyn GradientHook<B>>) -> HookGuard<B> {
    registry::install(hook)
}

/// Whether a hook for `ZeroBackend<B>` is installed on this thread.
pub fn is_installed<B: Backend>() -> bool {
    registry::is_installed::<dyn GradientHook<B>>()
}

/// Runs `f` on this thread's hook for `B`, if one is installed.
pub(crate) fn with_hook<B: Backend, R>(f: impl FnOnce(&mut dyn GradientHook<B>) -> R) -> Option<R> {
    registry::with::<dyn GradientHook<B>, _>(|hook| f(hook))
}

/// Marks every float parameter of `module` as distributed, so that autodiff reports its final
/// gradient to the installed hook. The id is the parameter's `ParamId`.
///
/// burn 0.21 registers a mark as a graph root that the next `backward()` consumes. burn's
/// optimizer step re-marks every parameter it updates, so a plain training loop marks once;
/// a second backward on the same parameters without an optimizer step in between (gradient
/// accumulation) needs `mark_distributed` again before its forward pass.
pub fn mark_distributed<B: AutodiffBackend, M: Module<B>>(module: M) -> M {
    module.map(&mut DistributedMarker)
}

struct DistributedMarker;

impl<B: AutodiffBackend> ModuleMapper<B> for DistributedMarker {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = tensor.set_distributed(DistributedParamId::from(id.val()));
        Param::from_mapped_value(id, tensor, mapper)
    }
}
