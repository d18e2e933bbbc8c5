//! Activation checkpointing of one module (DeepSpeed's `activation_checkpointing`, torch's
//! `torch.utils.checkpoint`): forward keeps only the module's input; backward runs the module's
//! forward again, this time with a graph, and back-propagates through it. One checkpointed
//! module's activations exist at a time in backward, instead of every module's from the end of
//! forward to its backward. At an 8B Llama's width a decoder layer keeps about 0.9 GB of
//! activations per 4,096 tokens; 32 layers of them do not fit beside ZeRO-3's buffers.
//!
//! Under `Autodiff<ZeroBackend<_>>` (CUDA or NdArray) it is a custom autodiff op whose parents
//! are the input and the module's parameters and whose state is the input, the module (a ZeRO-3
//! parameter stays a sharded handle between the passes) and the forward closure. Its backward
//! makes fresh leaves of the same values, runs the closure, seeds the recomputed output with the
//! incoming gradient and calls `backward` on that small graph, then hands the leaves' gradients
//! to the outer pass under the original parameters' nodes, so ZeRO's gradient hooks fire as
//! for any op. The nested `backward` needs the one-line `burn-autodiff` patch in
//! `patches/burn-autodiff` (see patches/README.md). Other backends run the forward as is.

use core::any::TypeId;
use core::marker::PhantomData;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedBackend;

use super::downcast::float_as;
#[cfg(any(feature = "cuda", feature = "ndarray"))]
use crate::backend::ZeroBackend;

/// The most parents (the input and the parameters) one checkpoint op takes.
const MAX_PARENTS: usize = 128;

/// The forward a checkpoint reruns in backward.
type Forward<B, M, const D: usize> = dyn Fn(&M, Tensor<B, D>) -> Tensor<B, D> + Send + Sync;

/// What runs after the recompute's own backward, given its gradients (burn-autodiff's
/// `Gradients`, as `&dyn Any`): a caller reads there the gradients of tensors its forward
/// made itself (a split backward's probes).
type After = Arc<dyn Fn(&dyn core::any::Any) + Send + Sync>;

/// `forward(module, x)`, with only `x` kept for backward (see the module doc).
///
/// `forward` must be a function of `module`'s parameters and `x` alone: a tensor it captures
/// must not require gradients (constants such as RoPE tables and masks are fine), since the
/// recompute builds a graph of its own.
pub fn checkpoint<B, M, F, const D: usize>(module: &M, x: Tensor<B, D>, forward: F) -> Tensor<B, D>
where
    B: Backend,
    M: Module<B> + 'static,
    F: Fn(&M, Tensor<B, D>) -> Tensor<B, D> + Send + Sync + 'static,
{
    checkpoint_inner(module, x, Arc::new(forward), None)
}

/// [`checkpoint`], and `after` called with the recompute's gradients (burn-autodiff's
/// `Gradients`, as `&dyn Any`) right after its backward, before they are dropped: the gradients
/// of tensors `forward` made itself are there, and nowhere else (a zero-bubble schedule's
/// probes, whose gradients are the split layers' output gradients). Where `checkpoint` runs
/// the forward as is (another backend, nothing to differentiate), `after` is never called.
pub fn checkpoint_then<B, M, F, A, const D: usize>(
    module: &M,
    x: Tensor<B, D>,
    forward: F,
    after: A,
) -> Tensor<B, D>
where
    B: Backend,
    M: Module<B> + 'static,
    F: Fn(&M, Tensor<B, D>) -> Tensor<B, D> + Send + Sync + 'static,
    A: Fn(&dyn core::any::Any) + Send + Sync + 'static,
{
    checkpoint_inner(module, x, Arc::new(forward), Some(Arc::new(after)))
}

fn checkpoint_inner<B, M, const D: usize>(
    module: &M,
    x: Tensor<B, D>,
    forward: Arc<Forward<B, M, D>>,
    after: Option<After>,
) -> Tensor<B, D>
where
    B: Backend,
    M: Module<B> + 'static,
{
    #[cfg(feature = "cuda")]
    if let Some(out) =
        tracked::<B, ZeroBackend<burn::backend::Cuda>, M, D>(module, &x, &forward, &after)
    {
        return out;
    }
    #[cfg(feature = "ndarray")]
    if let Some(out) =
        tracked::<B, ZeroBackend<burn::backend::NdArray>, M, D>(module, &x, &forward, &after)
    {
        return out;
    }
    let _ = after;
    forward(module, x)
}

/// Runs the checkpoint op when `B` is `Autodiff<Z>` and something in it needs a gradient.
fn tracked<B, Z, M, const D: usize>(
    module: &M,
    x: &Tensor<B, D>,
    forward: &Arc<Forward<B, M, D>>,
    after: &Option<After>,
) -> Option<Tensor<B, D>>
where
    B: Backend,
    Z: DistributedBackend,
    M: Module<B> + 'static,
{
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Z>>() {
        return None;
    }
    let input = float_as::<B, Autodiff<Z>, D>(x.clone())?
        .into_primitive()
        .tensor();
    let mut params = ParamPrimitives::<B, Z> {
        primitives: Vec::new(),
        _backend: PhantomData,
    };
    module.visit(&mut params);
    // The op's parents: the input, then the parameters in visiting order.
    let mut parents = vec![input.node.clone()];
    parents.extend(params.primitives.iter().map(|p| p.node.clone()));
    if parents.iter().all(|n| n.requirement.is_none()) {
        return None;
    }
    let count = parents.len();
    if count > MAX_PARENTS {
        crate::log::warn(&format!(
            "checkpoint: a module of {} parameters is run without checkpointing \
             ({} at most); checkpoint its parts instead",
            count - 1,
            MAX_PARENTS - 1
        ));
        return None;
    }
    // Forward without a graph: untracked parameters and input.
    let out = forward(
        &module.clone().map(&mut Untracked),
        x.clone().set_require_grad(false),
    );
    let out = float_as::<B, Autodiff<Z>, D>(out)?
        .into_primitive()
        .tensor()
        .primitive;
    let state = State {
        module: module.clone(),
        input: input.primitive,
        forward: Closure(forward.clone()),
        after: after.clone(),
    };
    // burn's ops take a fixed number of parents: pad with the input's node. The pads get no
    // gradient, and the input is never a parameter whose gradient hook counts its consumers.
    // (burn-autodiff does not export the node type, so a macro rather than a function.)
    macro_rules! op_of {
        ($n:literal) => {{
            let pad = parents[0].clone();
            parents.resize($n, pad);
            let parents: [_; $n] = parents.try_into().ok().expect("padded");
            let op = Recompute::<B, Z, M, D> {
                count,
                _types: PhantomData,
            };
            match op
                .prepare::<NoCheckpointing>(parents)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            }
        }};
    }
    let out: FloatTensor<Autodiff<Z>> = match count {
        0..=8 => op_of!(8),
        9..=16 => op_of!(16),
        17..=32 => op_of!(32),
        33..=64 => op_of!(64),
        _ => op_of!(128),
    };
    float_as::<Autodiff<Z>, B, D>(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// A module's float parameters as `Autodiff<Z>` primitives, in visiting order.
struct ParamPrimitives<B, Z: Backend> {
    primitives: Vec<FloatTensor<Autodiff<Z>>>,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend, Z: Backend> ModuleVisitor<B> for ParamPrimitives<B, Z> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = float_as::<B, Autodiff<Z>, D>(param.val()).expect("B is Autodiff<Z>");
        self.primitives.push(t.into_primitive().tensor());
    }
}

/// Every float parameter untracked: the same values on new nodes that need no gradient and
/// carry no gradient hook (burn's `detach` keeps both).
struct Untracked;

impl<B: Backend> ModuleMapper<B> for Untracked {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, mapper) = param.consume();
        Param::from_mapped_value(id, t.set_require_grad(false), mapper)
    }
}

/// Every float parameter a fresh leaf of the same value, requiring a gradient where the
/// original one's node is tracked; keeps how to read each leaf's gradient.
struct Leaves<B, Z: Backend> {
    tracked: Vec<bool>,
    index: usize,
    grads: Vec<(usize, GradOf<Z>)>,
    _backend: PhantomData<fn() -> B>,
}

type GradOf<Z> = Box<dyn FnOnce(&Gradients) -> Option<FloatTensor<Z>>>;

impl<B: Backend, Z: DistributedBackend> ModuleMapper<B> for Leaves<B, Z> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, mapper) = param.consume();
        let index = self.index;
        self.index += 1;
        // A new node without the original's gradient hook: the outer pass fires it.
        let mut t = t.set_require_grad(false);
        if self.tracked[index] {
            t = t.require_grad();
            let leaf = float_as::<B, Autodiff<Z>, D>(t.clone()).expect("B is Autodiff<Z>");
            let read: GradOf<Z> =
                Box::new(move |g| leaf.grad(g).map(|g| g.into_primitive().tensor()));
            self.grads.push((index, read));
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// The forward closure, printable for the op's `Debug` bound.
struct Closure<B: Backend, M, const D: usize>(Arc<Forward<B, M, D>>);

impl<B: Backend, M, const D: usize> Clone for Closure<B, M, D> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: Backend, M, const D: usize> core::fmt::Debug for Closure<B, M, D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("checkpointed forward")
    }
}

/// What backward needs: the input's value, the module and its forward (and what runs after).
struct State<B: Backend, Z: Backend, M, const D: usize> {
    module: M,
    input: Z::FloatTensorPrimitive,
    forward: Closure<B, M, D>,
    after: Option<After>,
}

impl<B: Backend, Z: Backend, M: Clone, const D: usize> Clone for State<B, Z, M, D> {
    fn clone(&self) -> Self {
        Self {
            module: self.module.clone(),
            input: self.input.clone(),
            forward: self.forward.clone(),
            after: self.after.clone(),
        }
    }
}

impl<B: Backend, Z: Backend, M, const D: usize> core::fmt::Debug for State<B, Z, M, D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("checkpoint").finish_non_exhaustive()
    }
}

/// The checkpoint's backward step; `count` parents are real, the rest pads.
struct Recompute<B, Z, M, const D: usize> {
    count: usize,
    _types: Types<B, Z, M>,
}

/// The op's type parameters, held without owning values of them (and `Send`).
type Types<B, Z, M> = PhantomData<fn() -> (B, Z, M)>;

impl<B, Z, M, const D: usize> core::fmt::Debug for Recompute<B, Z, M, D> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Recompute({} parents)", self.count)
    }
}

impl<B, Z, M, const D: usize, const N: usize> Backward<Z, N> for Recompute<B, Z, M, D>
where
    B: Backend,
    Z: DistributedBackend,
    M: Module<B> + 'static,
{
    type State = State<B, Z, M, D>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let State {
            module,
            input,
            forward,
            after,
        } = ops.state;
        let d_out = grads.consume::<Z>(&ops.node);
        let parents: Vec<Option<NodeId>> = ops.parents[..self.count]
            .iter()
            .map(|p| p.as_ref().map(|node| node.id))
            .collect();
        let leaf = |value| {
            Tensor::<Autodiff<Z>, D>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(
                value,
            )))
        };
        let mut x = leaf(input);
        if parents[0].is_some() {
            x = x.require_grad();
        }
        let mut leaves = Leaves::<B, Z> {
            tracked: parents[1..].iter().map(Option::is_some).collect(),
            index: 0,
            grads: Vec::new(),
            _backend: PhantomData,
        };
        let module = module.map(&mut leaves);
        let out = (forward.0)(&module, float_as(x.clone()).expect("B is Autodiff<Z>"));
        let out = float_as::<B, Autodiff<Z>, D>(out).expect("B is Autodiff<Z>");
        // d(sum(out · g))/d(out) = g: the incoming gradient, exactly.
        let inner = (out * leaf(d_out)).sum().backward();
        if let Some(after) = after {
            after(&inner);
        }
        if let (Some(id), Some(dx)) = (parents[0], x.grad(&inner)) {
            grads.register::<Z>(id, dx.into_primitive().tensor());
        }
        for (index, read) in leaves.grads {
            if let (Some(id), Some(g)) = (parents[index + 1], read(&inner)) {
                grads.register::<Z>(id, g);
            }
        }
    }
}
