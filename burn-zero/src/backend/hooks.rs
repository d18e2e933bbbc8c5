//! Gradient hooks: where `ZeroBackend` hands each final gradient to the ZeRO engine.
//!
//! burn's autodiff (with the `distributed` feature) calls `DistributedBackend` functions of
//! `ZeroBackend` during `backward()`; they are routed to the [`GradientHook`] installed on the
//! calling thread for that inner backend. One thread drives one rank (a thread rank on CPU,
//! the process's main thread on a GPU), so a thread-local registry needs no rank lookup.

use core::any::{Any, TypeId};
use std::cell::RefCell;

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

thread_local! {
    static HOOKS: RefCell<Vec<(TypeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// Keeps a hook installed on this thread; dropping it uninstalls the hook.
#[must_use = "the hook is uninstalled when the guard is dropped"]
pub struct HookGuard<B: Backend> {
    _backend: core::marker::PhantomData<(B, *const ())>,
}

impl<B: Backend> Drop for HookGuard<B> {
    fn drop(&mut self) {
        HOOKS.with(|hooks| {
            hooks
                .borrow_mut()
                .retain(|(id, _)| *id != TypeId::of::<B>())
        });
    }
}

/// Installs `hook` for `ZeroBackend<B>` on the calling thread, replacing any earlier one.
pub fn install<B: Backend>(hook: Box<dyn GradientHook<B>>) -> HookGuard<B> {
    HOOKS.with(|hooks| {
        let mut hooks = hooks.borrow_mut();
        hooks.retain(|(id, _)| *id != TypeId::of::<B>());
        hooks.push((TypeId::of::<B>(), Box::new(Some(hook))));
    });
    HookGuard {
        _backend: core::marker::PhantomData,
    }
}

/// Whether a hook for `ZeroBackend<B>` is installed on this thread.
pub fn is_installed<B: Backend>() -> bool {
    HOOKS.with(|hooks| {
        hooks
            .borrow()
            .iter()
            .any(|(id, _)| *id == TypeId::of::<B>())
    })
}

/// Runs `f` on this thread's hook for `B`, if one is installed. The hook is taken out of the
/// registry while it runs, so it may itself run tensor ops on `ZeroBackend`.
pub(crate) fn with_hook<B: Backend, R>(f: impl FnOnce(&mut dyn GradientHook<B>) -> R) -> Option<R> {
    let mut hook = HOOKS.with(|hooks| {
        let mut hooks = hooks.borrow_mut();
        let (_, slot) = hooks.iter_mut().find(|(id, _)| *id == TypeId::of::<B>())?;
        slot.downcast_mut::<Option<Box<dyn GradientHook<B>>>>()?
            .take()
    })?;
    let result = f(hook.as_mut());
    HOOKS.with(|hooks| {
        let mut hooks = hooks.borrow_mut();
        if let Some((_, slot)) = hooks.iter_mut().find(|(id, _)| *id == TypeId::of::<B>())
            && let Some(empty) = slot.downcast_mut::<Option<Box<dyn GradientHook<B>>>>()
        {
            *empty = Some(hook);
        }
    });
    Some(result)
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
