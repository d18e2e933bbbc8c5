//! The output projection and the cross-entropy in one op, over chunks of tokens: the
//! `[tokens, vocab]` logits exist one chunk at a time in forward and again in backward, never
//! whole. At a 128,256-token vocabulary a step of 8,192 tokens otherwise holds 4.2 GB of fp32
//! logits, their bf16 originals and their gradient.
//!
//! Under `Autodiff<ZeroBackend<_>>` (CUDA or NdArray) it is a custom autodiff op whose state is
//! the hidden states, the weight handle (a ZeRO-3 handle stays sharded between the passes), the
//! targets and one log-sum-exp per token; backward recomputes each chunk's logits and produces
//! the hidden states' and the weight's gradients chunk by chunk (the weight's accumulated in
//! f32). Other backends get the same function from burn ops, logits materialized.

use core::any::TypeId;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use super::downcast::{float_as, int_as};
use crate::backend::ZeroBackend;

/// How the projection's weight holds the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabAxis {
    /// `[hidden, vocab]` (burn's `Linear` weight): logits = x · w.
    Columns,
    /// `[vocab, hidden]` (an embedding's table, tied): logits = x · wᵀ.
    Rows,
}

/// Mean cross-entropy of the logits `x · w` (or `x · wᵀ`) against `targets`, computed over
/// chunks of `chunk_rows` tokens. `x` is `[tokens, hidden]`, `targets` `[tokens]`; the
/// log-sum-exp is taken in f32 whatever the dtype of `x` and `w`. Returns `[1]` in f32.
pub fn linear_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    axis: VocabAxis,
    targets: Tensor<B, 1, Int>,
    chunk_rows: usize,
) -> Tensor<B, 1> {
    let chunk_rows = chunk_rows.max(1);
    #[cfg(feature = "cuda")]
    if let Some(out) =
        tracked::<B, ZeroBackend<burn::backend::Cuda>>(&x, &weight, axis, &targets, chunk_rows)
    {
        return out;
    }
    #[cfg(feature = "ndarray")]
    if let Some(out) =
        tracked::<B, ZeroBackend<burn::backend::NdArray>>(&x, &weight, axis, &targets, chunk_rows)
    {
        return out;
    }
    let (sum, _) = chunked_forward(&x, &weight, axis, &targets, chunk_rows);
    sum / x.dims()[0] as f64
}

/// The same value with every logit materialized at once: the reference of the tests.
pub fn materialized_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    axis: VocabAxis,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let n = x.dims()[0];
    let logits = logits_of(x, weight, axis).cast(FloatDType::F32);
    let max = logits.clone().max_dim(1).detach();
    let shifted = logits - max;
    let log_z = shifted.clone().exp().sum_dim(1).log();
    let picked = shifted.gather(1, targets.reshape([n, 1]));
    (log_z - picked).mean()
}

fn logits_of<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 2>, axis: VocabAxis) -> Tensor<B, 2> {
    match axis {
        VocabAxis::Columns => x.matmul(weight),
        VocabAxis::Rows => x.matmul(weight.transpose()),
    }
}

/// The row ranges of `n` tokens in chunks of `rows`.
fn chunks(n: usize, rows: usize) -> impl Iterator<Item = core::ops::Range<usize>> {
    (0..n.div_ceil(rows)).map(move |c| c * rows..((c + 1) * rows).min(n))
}

/// The summed loss `[1]` and each token's log-sum-exp `[tokens]`, both f32.
fn chunked_forward<B: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    axis: VocabAxis,
    targets: &Tensor<B, 1, Int>,
    rows: usize,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [n, hidden] = x.dims();
    let mut sum: Option<Tensor<B, 1>> = None;
    let mut lses = Vec::new();
    for range in chunks(n, rows) {
        let len = range.len();
        let x_c = x.clone().slice([range.clone(), 0..hidden]);
        let logits = logits_of(x_c, weight.clone(), axis).cast(FloatDType::F32);
        let max = logits.clone().max_dim(1);
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        let picked = logits.gather(1, targets.clone().slice(range).reshape([len, 1]));
        let part = (lse.clone() - picked).sum();
        sum = Some(match sum {
            Some(s) => s + part,
            None => part,
        });
        lses.push(lse.reshape([len]));
    }
    let sum = sum.expect("at least one token");
    (sum, Tensor::cat(lses, 0))
}

/// Runs the custom op when `B` is `Autodiff<Z>`.
fn tracked<B: Backend, Z: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    axis: VocabAxis,
    targets: &Tensor<B, 1, Int>,
    rows: usize,
) -> Option<Tensor<B, 1>> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Z>>() {
        return None;
    }
    let x = float_as::<B, Autodiff<Z>, 2>(x.clone())?;
    let weight = float_as::<B, Autodiff<Z>, 2>(weight.clone())?;
    let targets = int_as::<B, Autodiff<Z>, 1>(targets.clone())?;
    let out = autodiff_op::<Z>(x, weight, axis, targets, rows);
    float_as::<Autodiff<Z>, B, 1>(out)
}

fn autodiff_op<Z: Backend>(
    x: Tensor<Autodiff<Z>, 2>,
    weight: Tensor<Autodiff<Z>, 2>,
    axis: VocabAxis,
    targets: Tensor<Autodiff<Z>, 1, Int>,
    rows: usize,
) -> Tensor<Autodiff<Z>, 1> {
    let n = x.dims()[0];
    let x = x.into_primitive().tensor();
    let weight = weight.into_primitive().tensor();
    let (inner_x, inner_w) = (
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone())),
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(weight.primitive.clone())),
    );
    let inner_t = Tensor::<Z, 1, Int>::from_primitive(targets.into_primitive());
    let (sum, lse) = chunked_forward(&inner_x, &inner_w, axis, &inner_t, rows);
    let loss = (sum / n as f64).into_primitive().tensor();
    let prep = ChunkedBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful();
    let out = match prep {
        OpsKind::Tracked(prep) => prep.finish(
            ChunkedState {
                x: inner_x,
                weight: inner_w,
                targets: inner_t,
                lse,
                axis,
                rows,
            },
            loss,
        ),
        OpsKind::UnTracked(prep) => prep.finish(loss),
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

#[derive(Debug)]
struct ChunkedBackward;

#[derive(Clone, Debug)]
struct ChunkedState<Z: Backend> {
    x: Tensor<Z, 2>,
    weight: Tensor<Z, 2>,
    targets: Tensor<Z, 1, Int>,
    lse: Tensor<Z, 1>,
    axis: VocabAxis,
    rows: usize,
}

impl<Z: Backend> Backward<Z, 2> for ChunkedBackward {
    type State = ChunkedState<Z>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ChunkedState {
            x,
            weight,
            targets,
            lse,
            axis,
            rows,
        } = ops.state;
        let [n, hidden] = x.dims();
        let [wa, wb] = weight.dims();
        let d_loss =
            Tensor::<Z, 1>::from_primitive(TensorPrimitive::Float(grads.consume::<Z>(&ops.node)));
        // dL/dlogit = (softmax − onehot) · dL/dloss / n, per chunk.
        let scale = (d_loss.cast(FloatDType::F32) / n as f64).reshape([1, 1]);
        let (dtype, wdtype) = (x.dtype(), weight.dtype());
        let [x_parent, w_parent] = ops.parents.map(|p| p.map(|node| node.id));
        let mut dx = Vec::new();
        let mut dw: Option<Tensor<Z, 2>> = None;
        for range in chunks(n, rows) {
            let len = range.len();
            let x_c = x.clone().slice([range.clone(), 0..hidden]);
            let logits = logits_of(x_c.clone(), weight.clone(), axis).cast(FloatDType::F32);
            let lse_c = lse.clone().slice(range.clone()).reshape([len, 1]);
            let probs = (logits - lse_c).exp();
            let picked = targets.clone().slice(range).reshape([len, 1]);
            let minus_one =
                Tensor::<Z, 2>::full([len, 1], -1.0, &probs.device()).cast(FloatDType::F32);
            let d_logits =
                probs.scatter(1, picked, minus_one, IndexingUpdateOp::Add) * scale.clone();
            let d_logits = d_logits.cast(dtype);
            if x_parent.is_some() {
                dx.push(match axis {
                    VocabAxis::Columns => d_logits.clone().matmul(weight.clone().transpose()),
                    VocabAxis::Rows => d_logits.clone().matmul(weight.clone()),
                });
            }
            if w_parent.is_some() {
                let part = match axis {
                    VocabAxis::Columns => x_c.transpose().matmul(d_logits),
                    VocabAxis::Rows => d_logits.transpose().matmul(x_c),
                }
                .cast(FloatDType::F32);
                dw = Some(match dw {
                    Some(acc) => acc + part,
                    None => part,
                });
            }
        }
        if let Some(id) = x_parent {
            let dx = Tensor::cat(dx, 0);
            grads.register::<Z>(id, dx.into_primitive().tensor());
        }
        if let (Some(id), Some(dw)) = (w_parent, dw) {
            debug_assert_eq!(dw.dims(), [wa, wb]);
            grads.register::<Z>(id, dw.cast(wdtype).into_primitive().tensor());
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, TensorData};

    use super::*;
    use crate::engine::ZeroAutodiff;

    type B = ZeroAutodiff<NdArray>;

    /// The chunked op's loss and gradients against burn's autodiff of the materialized loss,
    /// on shapes no chunk size divides, both weight layouts, one target repeated.
    #[test]
    fn chunked_loss_and_gradients_equal_the_materialized_ones() {
        let device = Default::default();
        let (n, hidden, vocab) = (37, 12, 53);
        for (axis, rows) in [
            (VocabAxis::Columns, 8),
            (VocabAxis::Rows, 5),
            (VocabAxis::Rows, 64),
        ] {
            let x = Tensor::<B, 2>::random([n, hidden], Distribution::Normal(0.0, 1.0), &device);
            let shape = match axis {
                VocabAxis::Columns => [hidden, vocab],
                VocabAxis::Rows => [vocab, hidden],
            };
            let w = Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 0.5), &device);
            let mut ids: Vec<i64> = (0..n as i64).map(|i| (i * 17 + 3) % vocab as i64).collect();
            ids[5] = ids[4];
            let t = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), &device);
            let run = |chunked: bool| {
                let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
                let loss = if chunked {
                    linear_cross_entropy(x.clone(), w.clone(), axis, t.clone(), rows)
                } else {
                    materialized_cross_entropy(x.clone(), w.clone(), axis, t.clone())
                };
                // A factor on the loss: the op's gradient must carry dL/dloss through.
                let grads = (loss.clone() * 3.0).backward();
                let gx = x.grad(&grads).expect("x's gradient").into_data();
                let gw = w.grad(&grads).expect("w's gradient").into_data();
                (loss.into_data(), gx, gw)
            };
            let (want, got) = (run(false), run(true));
            let close = |a: &TensorData, b: &TensorData, what: &str| {
                let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
                assert_eq!(a.len(), b.len(), "{what}");
                let scale = a.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-6);
                for (i, (u, v)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (u - v).abs() <= 1e-5 * scale,
                        "{what}[{i}] {axis:?}/{rows}: {u} vs {v}"
                    );
                }
            };
            close(&want.0, &got.0, "loss");
            close(&want.1, &got.1, "dx");
            close(&want.2, &got.2, "dw");
        }
    }
}
