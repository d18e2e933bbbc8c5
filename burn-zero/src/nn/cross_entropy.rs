//! The output projection and the cross-entropy in one op, in chunks: the `[tokens, vocab]`
//! logits exist one chunk at a time in forward and again in backward, never whole. At a
//! 128,256-token vocabulary a step of 8,192 tokens otherwise holds 4.2 GB of fp32 logits, their
//! bf16 originals and their gradient.
//!
//! Under `Autodiff<ZeroBackend<_>>` (CUDA or NdArray) it is a custom autodiff op whose state is
//! the hidden states, the weight handle (a ZeRO-3 handle stays sharded between the passes), the
//! targets and one log-sum-exp per token. Forward walks chunks of tokens (a token's log-sum-exp
//! needs its whole row of logits); backward walks chunks of the vocabulary, so that each slice
//! of the weight's gradient is produced once, in the weight's dtype, and written in place: no
//! f32 accumulator of the weight's size (2.1 GB at 8B) exists. The hidden states' gradient is
//! summed over the vocabulary chunks in f32 (`[tokens, hidden]`). Other backends get the same
//! function from burn ops, logits materialized.
//!
//! Targets equal to `ignore_index` (torch's `ignore_index`, commonly −100 for padding) count
//! neither in the loss nor in the mean, which is over the other tokens as torch defines it (no
//! such token: 0/0, NaN, as torch).

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
/// chunks of `chunk_rows` tokens (backward: chunks of the vocabulary of the same size in
/// logits). `x` is `[tokens, hidden]`, `targets` `[tokens]`; tokens whose target is
/// `ignore_index` are left out of the loss and of the mean. The log-sum-exp is taken in f32
/// whatever the dtype of `x` and `w`. Returns `[1]` in f32.
pub fn linear_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    axis: VocabAxis,
    targets: Tensor<B, 1, Int>,
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Tensor<B, 1> {
    let chunk_rows = chunk_rows.max(1);
    let op = Loss {
        axis,
        rows: chunk_rows,
        ignore_index,
    };
    #[cfg(feature = "cuda")]
    if let Some(out) = tracked::<B, ZeroBackend<burn::backend::Cuda>>(&x, &weight, &targets, op) {
        return out;
    }
    #[cfg(feature = "ndarray")]
    if let Some(out) = tracked::<B, ZeroBackend<burn::backend::NdArray>>(&x, &weight, &targets, op)
    {
        return out;
    }
    let labels = Labels::new(targets, ignore_index);
    let (sum, _) = chunked_forward(&x, &weight, axis, &labels, chunk_rows);
    labels.mean(sum)
}

/// The same value with every logit materialized at once: the reference of the tests.
pub fn materialized_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    axis: VocabAxis,
    targets: Tensor<B, 1, Int>,
    ignore_index: Option<i64>,
) -> Tensor<B, 1> {
    let n = x.dims()[0];
    let labels = Labels::new(targets, ignore_index);
    let logits = logits_of(x, weight, axis).cast(FloatDType::F32);
    let max = logits.clone().max_dim(1).detach();
    let shifted = logits - max;
    let log_z = shifted.clone().exp().sum_dim(1).log();
    let picked = shifted.gather(1, labels.safe.clone().reshape([n, 1]));
    labels.mean(labels.kept(log_z - picked, 0..n).sum())
}

/// The targets as the loss reads them: `safe` (an ignored target replaced by 0, a valid
/// index) and, with an `ignore_index`, `keep` (f32 1 for a kept token, 0 for an ignored one) and
/// the kept tokens' count (`[1]` f32, on the device: nothing is read back).
#[derive(Clone, Debug)]
struct Labels<B: Backend> {
    safe: Tensor<B, 1, Int>,
    keep: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
}

impl<B: Backend> Labels<B> {
    fn new(targets: Tensor<B, 1, Int>, ignore_index: Option<i64>) -> Self {
        match ignore_index {
            None => Self {
                safe: targets,
                keep: None,
            },
            Some(i) => {
                let kept = targets.clone().not_equal_elem(i);
                let safe = targets.mask_fill(kept.clone().bool_not(), 0);
                let keep = kept.float().cast(FloatDType::F32);
                let count = keep.clone().sum();
                Self {
                    safe,
                    keep: Some((keep, count)),
                }
            }
        }
    }

    /// `per_token` (`[len, 1]`, tokens `range`) with ignored tokens zeroed.
    fn kept(&self, per_token: Tensor<B, 2>, range: core::ops::Range<usize>) -> Tensor<B, 2> {
        match &self.keep {
            None => per_token,
            Some((keep, _)) => {
                let len = range.len();
                per_token * keep.clone().slice(range).reshape([len, 1])
            }
        }
    }

    /// `sum` over kept tokens divided by their count.
    fn mean(&self, sum: Tensor<B, 1>) -> Tensor<B, 1> {
        match &self.keep {
            None => {
                let n = self.safe.dims()[0];
                sum / n as f64
            }
            Some((_, count)) => sum / count.clone(),
        }
    }
}

fn logits_of<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 2>, axis: VocabAxis) -> Tensor<B, 2> {
    match axis {
        VocabAxis::Columns => x.matmul(weight),
        VocabAxis::Rows => x.matmul(weight.transpose()),
    }
}

/// The index ranges of `n` items in chunks of `size`.
fn chunks(n: usize, size: usize) -> impl Iterator<Item = core::ops::Range<usize>> {
    (0..n.div_ceil(size)).map(move |c| c * size..((c + 1) * size).min(n))
}

/// The summed loss `[1]` over kept tokens and each token's log-sum-exp `[tokens]`, both f32.
fn chunked_forward<B: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    axis: VocabAxis,
    labels: &Labels<B>,
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
        let targets = labels.safe.clone().slice(range.clone()).reshape([len, 1]);
        let picked = logits.gather(1, targets);
        let part = labels.kept(lse.clone() - picked, range).sum();
        sum = Some(match sum {
            Some(s) => s + part,
            None => part,
        });
        lses.push(lse.reshape([len]));
    }
    let sum = sum.expect("at least one token");
    (sum, Tensor::cat(lses, 0))
}

/// What one loss computes beyond its operands.
#[derive(Clone, Copy, Debug)]
struct Loss {
    axis: VocabAxis,
    /// Tokens per forward chunk (and logits per backward chunk: `rows × vocab`).
    rows: usize,
    ignore_index: Option<i64>,
}

/// Runs the custom op when `B` is `Autodiff<Z>`.
fn tracked<B: Backend, Z: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    op: Loss,
) -> Option<Tensor<B, 1>> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<Z>>() {
        return None;
    }
    let x = float_as::<B, Autodiff<Z>, 2>(x.clone())?;
    let weight = float_as::<B, Autodiff<Z>, 2>(weight.clone())?;
    let targets = int_as::<B, Autodiff<Z>, 1>(targets.clone())?;
    // Autodiff's int tensors are the inner backend's.
    let targets = Tensor::<Z, 1, Int>::from_primitive(targets.into_primitive());
    let out = autodiff_op::<Z>(x, weight, Labels::new(targets, op.ignore_index), op);
    float_as::<Autodiff<Z>, B, 1>(out)
}

fn autodiff_op<Z: Backend>(
    x: Tensor<Autodiff<Z>, 2>,
    weight: Tensor<Autodiff<Z>, 2>,
    labels: Labels<Z>,
    op: Loss,
) -> Tensor<Autodiff<Z>, 1> {
    let x = x.into_primitive().tensor();
    let weight = weight.into_primitive().tensor();
    let (inner_x, inner_w) = (
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone())),
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(weight.primitive.clone())),
    );
    let (sum, lse) = chunked_forward(&inner_x, &inner_w, op.axis, &labels, op.rows);
    let loss = labels.mean(sum).into_primitive().tensor();
    let prep = ChunkedBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful();
    let out = match prep {
        OpsKind::Tracked(prep) => prep.finish(
            ChunkedState {
                x: inner_x,
                weight: inner_w,
                labels,
                lse,
                op,
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
    labels: Labels<Z>,
    lse: Tensor<Z, 1>,
    op: Loss,
}

impl<Z: Backend> Backward<Z, 2> for ChunkedBackward {
    type State = ChunkedState<Z>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ChunkedState {
            x,
            weight,
            labels,
            lse,
            op,
        } = ops.state;
        let Loss { axis, rows, .. } = op;
        let [n, hidden] = x.dims();
        let vocab = match axis {
            VocabAxis::Columns => weight.dims()[1],
            VocabAxis::Rows => weight.dims()[0],
        };
        let d_loss =
            Tensor::<Z, 1>::from_primitive(TensorPrimitive::Float(grads.consume::<Z>(&ops.node)));
        // dL/dlogit = (softmax − onehot) · dL/dloss / kept, on kept tokens only.
        let ones = Tensor::<Z, 2>::ones([n, 1], (&x.device(), burn::tensor::DType::F32));
        let per_token = labels.kept(ones, 0..n);
        let row_scale = labels.mean(per_token.reshape([n])).reshape([n, 1])
            * d_loss.cast(FloatDType::F32).reshape([1, 1]);
        let (dtype, wdtype) = (x.dtype(), weight.dtype());
        let [x_parent, w_parent] = ops.parents.map(|p| p.map(|node| node.id));
        let device = x.device();
        let lse = lse.reshape([n, 1]);
        // Vocabulary chunks of as many logits as the forward's token chunks.
        let columns = (rows * vocab / n.max(1)).clamp(1, vocab);
        let mut dx: Option<Tensor<Z, 2>> = None;
        let mut dw = w_parent.map(|_| Tensor::<Z, 2>::zeros(weight.dims(), (&device, wdtype)));
        for range in chunks(vocab, columns) {
            let (start, len) = (range.start, range.len());
            let w_c = match axis {
                VocabAxis::Columns => weight.clone().slice([0..hidden, range.clone()]),
                VocabAxis::Rows => weight.clone().slice([range.clone(), 0..hidden]),
            };
            let logits = logits_of(x.clone(), w_c.clone(), axis).cast(FloatDType::F32);
            let probs = (logits - lse.clone()).exp();
            // −1 at each kept token's target when it falls in this chunk.
            let local = labels.safe.clone() - start as i64;
            let here = local
                .clone()
                .greater_equal_elem(0)
                .bool_and(local.clone().lower_elem(len as i64));
            let index = local.mask_fill(here.clone().bool_not(), 0).reshape([n, 1]);
            let minus = here.float().cast(FloatDType::F32).neg().reshape([n, 1]);
            let d_logits =
                probs.scatter(1, index, minus, IndexingUpdateOp::Add) * row_scale.clone();
            let d_logits = d_logits.cast(dtype);
            if x_parent.is_some() {
                let part = match axis {
                    VocabAxis::Columns => d_logits.clone().matmul(w_c.transpose()),
                    VocabAxis::Rows => d_logits.clone().matmul(w_c),
                }
                .cast(FloatDType::F32);
                dx = Some(match dx {
                    Some(acc) => acc + part,
                    None => part,
                });
            }
            if let Some(acc) = dw.take() {
                dw = Some(match axis {
                    VocabAxis::Columns => {
                        let part = x.clone().transpose().matmul(d_logits).cast(wdtype);
                        acc.slice_assign([0..hidden, range], part)
                    }
                    VocabAxis::Rows => {
                        let part = d_logits.transpose().matmul(x.clone()).cast(wdtype);
                        acc.slice_assign([range, 0..hidden], part)
                    }
                });
            }
        }
        if let (Some(id), Some(dx)) = (x_parent, dx) {
            grads.register::<Z>(id, dx.cast(dtype).into_primitive().tensor());
        }
        if let (Some(id), Some(dw)) = (w_parent, dw) {
            grads.register::<Z>(id, dw.into_primitive().tensor());
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
                    linear_cross_entropy(x.clone(), w.clone(), axis, t.clone(), rows, None)
                } else {
                    materialized_cross_entropy(x.clone(), w.clone(), axis, t.clone(), None)
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

    /// Targets equal to `ignore_index` leave the loss, its mean and the gradients: the same
    /// values as the loss of the kept tokens alone (an independent reference: the materialized
    /// loss of those rows), zero gradient on an ignored token's hidden state; both layouts, chunk
    /// sizes that divide neither the tokens nor the vocabulary, and all tokens ignored (NaN,
    /// as torch's 0/0).
    #[test]
    fn ignored_targets_leave_the_loss_and_its_mean() {
        let device = Default::default();
        let (n, hidden, vocab) = (23, 8, 41);
        let ignored = [0usize, 5, 6, 22];
        let kept: Vec<usize> = (0..n).filter(|i| !ignored.contains(i)).collect();
        for (axis, rows) in [(VocabAxis::Columns, 4), (VocabAxis::Rows, 7)] {
            let x = Tensor::<B, 2>::random([n, hidden], Distribution::Normal(0.0, 1.0), &device);
            let shape = match axis {
                VocabAxis::Columns => [hidden, vocab],
                VocabAxis::Rows => [vocab, hidden],
            };
            let w = Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 0.5), &device);
            let mut ids: Vec<i64> = (0..n as i64).map(|i| (i * 13 + 1) % vocab as i64).collect();
            for i in ignored {
                ids[i] = -100;
            }
            let t = Tensor::<B, 1, Int>::from_data(TensorData::new(ids.clone(), [n]), &device);
            let (xg, wg) = (x.clone().require_grad(), w.clone().require_grad());
            let loss = linear_cross_entropy(xg.clone(), wg.clone(), axis, t, rows, Some(-100));
            let grads = loss.clone().backward();
            let gx = xg
                .grad(&grads)
                .unwrap()
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            let gw = wg.grad(&grads).unwrap().into_data();
            // The reference: the kept rows alone, no ignore index.
            let pick = Tensor::<B, 1, Int>::from_data(
                TensorData::new(
                    kept.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                    [kept.len()],
                ),
                &device,
            );
            let (xr, wr) = (x.clone().require_grad(), w.clone().require_grad());
            let kept_ids: Vec<i64> = kept.iter().map(|&i| ids[i]).collect();
            let tr =
                Tensor::<B, 1, Int>::from_data(TensorData::new(kept_ids, [kept.len()]), &device);
            let want =
                materialized_cross_entropy(xr.clone().select(0, pick), wr.clone(), axis, tr, None);
            let want_grads = want.clone().backward();
            let (a, b) = (loss.into_scalar(), want.into_scalar());
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{axis:?}: loss {a} vs {b}");
            let want_gw = wr.grad(&want_grads).unwrap().into_data();
            let want_gx = xr
                .grad(&want_grads)
                .unwrap()
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            let (gw, want_gw) = (
                gw.to_vec::<f32>().unwrap(),
                want_gw.to_vec::<f32>().unwrap(),
            );
            for (i, (u, v)) in gw.iter().zip(&want_gw).enumerate() {
                assert!((u - v).abs() <= 1e-5, "{axis:?}: dw[{i}] {u} vs {v}");
            }
            for r in 0..n {
                for c in 0..hidden {
                    let got = gx[r * hidden + c];
                    let want = if ignored.contains(&r) {
                        0.0
                    } else {
                        want_gx[r * hidden + c]
                    };
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "{axis:?}: dx[{r}, {c}] {got} vs {want}"
                    );
                }
            }
        }
        // Every target ignored: 0/0.
        let x = Tensor::<B, 2>::ones([3, 2], &device);
        let w = Tensor::<B, 2>::ones([2, 5], &device);
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![-1i64; 3], [3]), &device);
        let loss = linear_cross_entropy(x, w, VocabAxis::Columns, t, 2, Some(-1));
        assert!(loss.into_scalar().is_nan());
    }
}
