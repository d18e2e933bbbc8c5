//! How a fused op reaches its kernels: under `Autodiff<ZeroBackend<_>>` as a custom autodiff
//! op (forward and backward each the op's own, the kernels on CUDA), on `ZeroBackend<_>`
//! alone as its forward, and on any other backend as the op's forward in plain burn ops
//! (differentiable by burn's autodiff). One engine's `burn_zero.fused_kernels` may switch an op
//! off: the model then runs the reference formula.

use core::any::TypeId;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::nn::downcast::float_as;

/// An op of `N` inputs of rank `D` (a rank the caller reshapes to) and one output.
pub(super) trait FusedOp<const N: usize, const D: usize>:
    Clone + core::fmt::Debug + Send + Sync + 'static
{
    /// The output, and what the backward reads besides the inputs (kernels on CUDA tensors
    /// of `ZeroBackend`, burn ops otherwise).
    fn forward<Z: Backend>(&self, inputs: &[Tensor<Z, D>; N]) -> (Tensor<Z, D>, Vec<Tensor<Z, D>>);

    /// Each input's gradient from the output's, `None` for inputs that take none (tables).
    fn backward<Z: Backend>(
        &self,
        inputs: &[Tensor<Z, D>; N],
        saved: &[Tensor<Z, D>],
        d_out: Tensor<Z, D>,
    ) -> [Option<Tensor<Z, D>>; N];
}

/// `op` on `inputs`, through its custom autodiff op where `B` is `Autodiff<ZeroBackend<_>>`.
pub(super) fn apply<B: Backend, O: FusedOp<N, D>, const N: usize, const D: usize>(
    op: O,
    inputs: [Tensor<B, D>; N],
) -> Tensor<B, D> {
    #[cfg(feature = "cuda")]
    let inputs =
        match on::<B, crate::backend::ZeroBackend<burn::backend::Cuda>, O, N, D>(&op, inputs) {
            Ok(out) => return out,
            Err(inputs) => inputs,
        };
    #[cfg(feature = "ndarray")]
    let inputs =
        match on::<B, crate::backend::ZeroBackend<burn::backend::NdArray>, O, N, D>(&op, inputs) {
            Ok(out) => return out,
            Err(inputs) => inputs,
        };
    op.forward(&inputs).0
}

/// The op on `Autodiff<Z>` or `Z` when `B` is one of them; the inputs back otherwise.
fn on<B: Backend, Z: Backend, O: FusedOp<N, D>, const N: usize, const D: usize>(
    op: &O,
    inputs: [Tensor<B, D>; N],
) -> Result<Tensor<B, D>, [Tensor<B, D>; N]> {
    if TypeId::of::<B>() == TypeId::of::<Z>() {
        let inner = inputs.map(|t| float_as::<B, Z, D>(t).expect("B is Z"));
        let out = op.forward(&inner).0;
        return Ok(float_as::<Z, B, D>(out).expect("B is Z"));
    }
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Z>>() {
        return Err(inputs);
    }
    let prims = inputs.map(|t| {
        float_as::<B, Autodiff<Z>, D>(t)
            .expect("B is Autodiff<Z>")
            .into_primitive()
            .tensor()
    });
    let inner: [Tensor<Z, D>; N] = prims
        .each_ref()
        .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p.primitive.clone())));
    let (out, saved) = op.forward(&inner);
    Ok(back_from::<B, Z, D>(tracked(
        op,
        prims.each_ref(),
        inner,
        saved,
        out,
    )))
}

/// `out` of `op` as an autodiff tensor: a node of `op`'s custom backward whose parents are
/// those of `parents` (the inputs as autodiff tensors, where they are tracked), keeping `inputs`
/// and `saved` for it.
fn tracked<Z: Backend, O: FusedOp<N, D>, const N: usize, const D: usize>(
    op: &O,
    parents: [&AutodiffPrimitive<Z>; N],
    inputs: [Tensor<Z, D>; N],
    saved: Vec<Tensor<Z, D>>,
    out: Tensor<Z, D>,
) -> AutodiffPrimitive<Z> {
    let out = out.into_primitive().tensor();
    match FusedBackward::<O, D>(core::marker::PhantomData)
        .prepare::<NoCheckpointing>(parents.map(|p| p.node.clone()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            FusedState {
                op: op.clone(),
                inputs,
                saved,
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// An autodiff primitive of `Autodiff<Z>` as a tensor of `B` (which is `Autodiff<Z>`).
fn back_from<B: Backend, Z: Backend, const D: usize>(p: AutodiffPrimitive<Z>) -> Tensor<B, D> {
    let t = Tensor::<Autodiff<Z>, D>::from_primitive(TensorPrimitive::Float(p));
    float_as::<Autodiff<Z>, B, D>(t).expect("B is Autodiff<Z>")
}

/// An op of two inputs whose first is a sum `x + residual` that its forward can make itself
/// (one kernel writing the sum and the op's output: a block's residual add folded into the
/// norm after it).
/// `(x + residual, op(x + residual, other), saved)`.
pub(super) type AfterAddOut<Z, const D: usize> = (Tensor<Z, D>, Tensor<Z, D>, Vec<Tensor<Z, D>>);

pub(super) trait AfterAdd<const D: usize>: FusedOp<2, D> {
    /// `(x + residual, op(x + residual, other), saved)` from one kernel where the op has one
    /// for these tensors; None sends the caller to the add and then [`FusedOp::forward`].
    fn fused_after_add<Z: Backend>(
        &self,
        x: &Tensor<Z, D>,
        residual: &Tensor<Z, D>,
        other: &Tensor<Z, D>,
    ) -> Option<AfterAddOut<Z, D>>;
}

/// `(x + residual, op(x + residual, other), saved)`: the op's one kernel, or else the add in
/// burn ops and then the op's forward.
fn forward_after_add<Z: Backend, O: AfterAdd<D>, const D: usize>(
    op: &O,
    x: &Tensor<Z, D>,
    residual: &Tensor<Z, D>,
    other: &Tensor<Z, D>,
) -> AfterAddOut<Z, D> {
    op.fused_after_add(x, residual, other).unwrap_or_else(|| {
        let sum = x.clone() + residual.clone();
        let (out, saved) = op.forward(&[sum.clone(), other.clone()]);
        (sum, out, saved)
    })
}

/// `(x + residual, op(x + residual, other))` with the sum made by the op's forward: under
/// `Autodiff<ZeroBackend<_>>` two autodiff ops from one forward, the sum's (its gradient goes
/// to both addends as it is) and the op's (its custom backward, the sum its parent).
/// `x` and `residual` have one shape (no broadcast).
pub(super) fn apply_after_add<B: Backend, O: AfterAdd<D>, const D: usize>(
    op: O,
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    other: Tensor<B, D>,
) -> (Tensor<B, D>, Tensor<B, D>) {
    assert_eq!(
        x.dims(),
        residual.dims(),
        "a sum folded into the op after it takes addends of one shape"
    );
    #[cfg(feature = "cuda")]
    let (x, residual, other) =
        match after_add_on::<B, crate::backend::ZeroBackend<burn::backend::Cuda>, O, D>(
            &op, x, residual, other,
        ) {
            Ok(out) => return out,
            Err(inputs) => inputs,
        };
    #[cfg(feature = "ndarray")]
    let (x, residual, other) =
        match after_add_on::<B, crate::backend::ZeroBackend<burn::backend::NdArray>, O, D>(
            &op, x, residual, other,
        ) {
            Ok(out) => return out,
            Err(inputs) => inputs,
        };
    let (sum, out, _) = forward_after_add(&op, &x, &residual, &other);
    (sum, out)
}

/// The three inputs of [`apply_after_add`].
type Three<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>);

/// [`apply_after_add`] on `Autodiff<Z>` or `Z` when `B` is one of them; the inputs back
/// otherwise.
#[allow(clippy::type_complexity)]
fn after_add_on<B: Backend, Z: Backend, O: AfterAdd<D>, const D: usize>(
    op: &O,
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    other: Tensor<B, D>,
) -> Result<(Tensor<B, D>, Tensor<B, D>), Three<B, D>> {
    if TypeId::of::<B>() == TypeId::of::<Z>() {
        let [x, residual, other] =
            [x, residual, other].map(|t| float_as::<B, Z, D>(t).expect("B is Z"));
        let (sum, out, _) = forward_after_add(op, &x, &residual, &other);
        let back = |t| float_as::<Z, B, D>(t).expect("B is Z");
        return Ok((back(sum), back(out)));
    }
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Z>>() {
        return Err((x, residual, other));
    }
    let [px, pr, po] = [x, residual, other].map(|t| {
        float_as::<B, Autodiff<Z>, D>(t)
            .expect("B is Autodiff<Z>")
            .into_primitive()
            .tensor()
    });
    let inner = |p: &AutodiffPrimitive<Z>| {
        Tensor::<Z, D>::from_primitive(TensorPrimitive::Float(p.primitive.clone()))
    };
    let (w, ix, ir) = (inner(&po), inner(&px), inner(&pr));
    let (sum, out, saved) = forward_after_add(op, &ix, &ir, &w);
    let sum_ad = SumBackward
        .prepare::<NoCheckpointing>([px.node.clone(), pr.node.clone()])
        .compute_bound()
        .stateless(sum.clone().into_primitive().tensor());
    let out = tracked(op, [&sum_ad, &po], [sum, w], saved, out);
    Ok((back_from::<B, Z, D>(sum_ad), back_from::<B, Z, D>(out)))
}

/// An autodiff tensor of `Autodiff<Z>`.
type AutodiffPrimitive<Z> = burn::tensor::ops::FloatTensor<Autodiff<Z>>;

/// The sum's backward: the gradient goes to both addends unchanged.
#[derive(Debug)]
struct SumBackward;

impl<Z: Backend> Backward<Z, 2> for SumBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<Z>(&ops.node);
        match ops.parents {
            [Some(a), Some(b)] => {
                grads.register::<Z>(a.id, grad.clone());
                grads.register::<Z>(b.id, grad);
            }
            [Some(only), None] | [None, Some(only)] => grads.register::<Z>(only.id, grad),
            [None, None] => {}
        }
    }
}

#[derive(Debug)]
struct FusedBackward<O, const D: usize>(core::marker::PhantomData<O>);

/// The op, its inputs (a ZeRO-3 parameter stays a sharded handle until the backward reads it)
/// and what its forward kept.
#[derive(Clone, Debug)]
struct FusedState<Z: Backend, O, const N: usize, const D: usize> {
    op: O,
    inputs: [Tensor<Z, D>; N],
    saved: Vec<Tensor<Z, D>>,
}

impl<Z: Backend, O: FusedOp<N, D>, const N: usize, const D: usize> Backward<Z, N>
    for FusedBackward<O, D>
{
    type State = FusedState<Z, O, N, D>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let FusedState { op, inputs, saved } = ops.state;
        let d_out =
            Tensor::<Z, D>::from_primitive(TensorPrimitive::Float(grads.consume::<Z>(&ops.node)));
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        let grads_in = op.backward(&inputs, &saved, d_out);
        for (parent, grad) in parents.into_iter().zip(grads_in) {
            if let (Some(id), Some(grad)) = (parent, grad) {
                grads.register::<Z>(id, grad.into_primitive().tensor());
            }
        }
    }
}
