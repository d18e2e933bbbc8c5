//! The output projection and the cross-entropy in one op, in chunks of tokens: the
//! `[tokens, vocab]` logits exist one chunk at a time (on CUDA in the dtype of the operands,
//! never in f32), never whole. At a 128,256-token vocabulary a step of 8,192 tokens otherwise
//! holds 4.2 GB of fp32 logits, their bf16 originals and their gradient.
//!
//! Under `Autodiff<ZeroBackend<_>>` (CUDA or NdArray) it is a custom autodiff op that takes its
//! gradients in the forward, as Liger-Kernel's fused linear cross-entropy does: for each chunk
//! the logits `x_c · w`, then each token's loss and the logits' gradient written over the logits
//! (one CubeCL kernel on CUDA, `cubecl_kernels::fused::cross_entropy`; burn ops elsewhere or
//! with `burn_zero.fused_kernels.cross_entropy` off), then that chunk's share of both
//! gradients (`d_c · w` and `x_cᵀ · d_c`). Three products in all, as the materialized loss
//! computes, where recomputing the logits in backward took four. The gradient the forward
//! keeps is that of the summed loss (`softmax − onehot`, entries at most 1): the mean's
//! `1 / tokens` and `dL/dloss` (under fp16, the loss scale) are applied in the backward, in
//! f32, so no entry is rounded to fp16 at `p / tokens` (1e-9 at a 128k vocabulary, below
//! fp16's range); a ZeRO-3 weight is not gathered again for the backward. The
//! weight's gradient is summed over the chunks in the weight's dtype: on CUDA each chunk's
//! product is added by cuBLASLt into the sum (`beta = 1`: no product tensor of the weight's
//! size, one rounding per chunk beyond the first; one chunk when the tokens fit in it). Without a tracked input the forward
//! computes the loss only. Other backends get the same function from burn ops, logits
//! materialized.
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
use burn::tensor::{DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorPrimitive};

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
/// chunks of at most `chunk_rows` tokens (of near-equal sizes). `x` is `[tokens, hidden]`
/// (at least one token), `targets` `[tokens]`; tokens whose target is `ignore_index` are left
/// out of the loss and of the mean (all of them: a NaN loss, as torch's 0/0, and zero
/// gradients). The log-sum-exp is taken in f32 whatever the dtype of `x` and `w`. Returns
/// `[1]` in f32.
pub fn linear_cross_entropy<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    axis: VocabAxis,
    targets: Tensor<B, 1, Int>,
    chunk_rows: usize,
    ignore_index: Option<i64>,
) -> Tensor<B, 1> {
    let chunk_rows = chunk_rows.max(1);
    assert!(
        x.dims()[0] > 0,
        "linear_cross_entropy: x is {:?}: no tokens to take a mean over",
        x.dims()
    );
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
    chunked(&x, &weight, axis, &labels, chunk_rows, [false; 2]).loss
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
    labels.mean(labels.kept(log_z - picked).sum())
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

    /// `per_token` (`[tokens, 1]`) with ignored tokens zeroed.
    fn kept(&self, per_token: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.keep {
            None => per_token,
            Some((keep, _)) => per_token * keep.clone().unsqueeze_dim(1),
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

    /// What [`Labels::mean`] multiplies by, `[1]` f32: 1/tokens, or 1/kept tokens.
    fn scale(&self) -> Tensor<B, 1> {
        match &self.keep {
            None => {
                let n = self.safe.dims()[0];
                let device = self.safe.device();
                Tensor::full([1], 1.0 / n as f64, (&device, DType::F32))
            }
            Some((_, count)) => count.clone().recip(),
        }
    }

    /// What the gradients of the summed loss are multiplied by to be the mean's, `[1]` f32: as
    /// [`Labels::scale`], but 1 when every token is ignored (their gradients are zero, as
    /// torch's are, where 0 · ∞ would be NaN).
    fn grad_scale(&self) -> Tensor<B, 1> {
        match &self.keep {
            None => self.scale(),
            Some((_, count)) => count.clone().clamp_min(1.0).recip(),
        }
    }

    /// `keep` (`[tokens]` f32), ones when no token is ignored.
    fn keep_or_ones(&self) -> Tensor<B, 1> {
        match &self.keep {
            Some((keep, _)) => keep.clone(),
            None => {
                let device = self.safe.device();
                Tensor::ones([self.safe.dims()[0]], (&device, DType::F32))
            }
        }
    }
}

fn logits_of<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 2>, axis: VocabAxis) -> Tensor<B, 2> {
    match axis {
        VocabAxis::Columns => x.matmul(weight),
        VocabAxis::Rows => x.matmul(weight.transpose()),
    }
}

/// The index ranges of `n` items in as few chunks of at most `size` as there can be, of
/// sizes that differ by one at most: no thin last chunk (a product of a few rows runs slowly,
/// and burn 0.21's fused matmul autotune may pick a kernel that is wrong for such a shape,
/// its issue #5122).
fn chunks(n: usize, size: usize) -> impl Iterator<Item = core::ops::Range<usize>> {
    let count = n.div_ceil(size.max(1));
    let (base, extra) = (n / count.max(1), n % count.max(1));
    let start = move |c: usize| c * base + c.min(extra);
    (0..count).map(move |c| start(c)..start(c + 1))
}

/// What the chunks produce: the mean loss (`[1]` f32) and, for the inputs asked for, the
/// gradients of the *summed* loss with respect to `x` and `w`, in their dtypes, with what turns
/// them into the mean's (`grad_scale`, `[1]` f32).
struct Pass<B: Backend> {
    loss: Tensor<B, 1>,
    dx: Option<Tensor<B, 2>>,
    dw: Option<Tensor<B, 2>>,
    grad_scale: Tensor<B, 1>,
}

/// The loss over chunks of `rows` tokens, with the gradients of `x` and `w` where `want` says.
fn chunked<B: Backend>(
    x: &Tensor<B, 2>,
    weight: &Tensor<B, 2>,
    axis: VocabAxis,
    labels: &Labels<B>,
    rows: usize,
    want: [bool; 2],
) -> Pass<B> {
    // Every product of the loss through cuBLASLt on CUDA, however small (a chunk of few
    // tokens, the last one of a short batch): see `chunks`.
    let policy = crate::backend::matmul::MatmulPolicy {
        min_macs: 0,
        ..crate::backend::matmul::matmul_policy()
    };
    crate::backend::settings::with_matmul(policy, || {
        let [n, hidden] = x.dims();
        let grad = want[0] || want[1];
        // The summed loss's gradient: `softmax − onehot` on kept tokens, the mean's factor later.
        let one = Tensor::ones([1], (&x.device(), DType::F32));
        let keep = labels.keep_or_ones();
        let (mut losses, mut dx_parts, mut dw) = (Vec::new(), Vec::new(), None);
        for range in chunks(n, rows) {
            let x_c = x.clone().slice([range.clone(), 0..hidden]);
            let logits = logits_of(x_c.clone(), weight.clone(), axis);
            let targets = labels.safe.clone().slice(range.clone());
            let keep_c = keep.clone().slice(range);
            let (loss, d) = rows_loss(logits, targets, keep_c, &one, grad);
            losses.push(loss);
            let Some(d) = d else { continue };
            if want[0] {
                dx_parts.push(match axis {
                    VocabAxis::Columns => d.clone().matmul(weight.clone().transpose()),
                    VocabAxis::Rows => d.clone().matmul(weight.clone()),
                });
            }
            if want[1] {
                let (a, b) = match axis {
                    VocabAxis::Columns => (x_c.transpose(), d),
                    VocabAxis::Rows => (d.transpose(), x_c),
                };
                dw = Some(match dw {
                    Some(acc) => matmul_add(acc, a, b),
                    None => a.matmul(b),
                });
            }
        }
        let loss = Tensor::cat(losses, 0).sum() * labels.scale();
        let dx = (!dx_parts.is_empty()).then(|| Tensor::cat(dx_parts, 0));
        let grad_scale = labels.grad_scale();
        Pass {
            loss,
            dx,
            dw,
            grad_scale,
        }
    })
}

/// `acc + a · b`: on CUDA the product added into `acc` by cuBLASLt (no tensor of the product,
/// one rounding), elsewhere burn ops.
fn matmul_add<B: Backend>(acc: Tensor<B, 2>, a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    #[cfg(feature = "cuda")]
    let acc = match super::fused::matmul_add(acc, &a, &b) {
        Ok(sum) => return sum,
        Err(acc) => acc,
    };
    acc + a.matmul(b)
}

/// `grad · factor` (`[1]` f32) in f32, rounded once to `grad`'s dtype: on CUDA one kernel in
/// `grad`'s own buffer, elsewhere burn ops.
fn scaled<B: Backend>(grad: Tensor<B, 2>, factor: &Tensor<B, 1>) -> Tensor<B, 2> {
    #[cfg(feature = "cuda")]
    let grad = match super::fused::scale_gradient(grad, factor) {
        Ok(out) => return out,
        Err(grad) => grad,
    };
    let dtype = grad.dtype();
    (grad.cast(FloatDType::F32) * factor.clone().reshape([1, 1])).cast(dtype)
}

/// Each row's loss `keep · (lse − logit[target])` (`[len]` f32) and, when `grad`, the gradient
/// `(softmax − onehot) · keep · scale` of the logits (their dtype): the kernel on CUDA, burn ops
/// elsewhere.
fn rows_loss<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    keep: Tensor<B, 1>,
    scale: &Tensor<B, 1>,
    grad: bool,
) -> (Tensor<B, 1>, Option<Tensor<B, 2>>) {
    #[cfg(feature = "cuda")]
    let logits = match super::fused::cross_entropy_rows(logits, &targets, &keep, scale, grad) {
        Ok(out) => return out,
        Err(logits) => logits,
    };
    let [len, _] = logits.dims();
    let dtype = logits.dtype();
    let l = logits.cast(FloatDType::F32);
    let max = l.clone().max_dim(1);
    let lse = (l.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let index = targets.reshape([len, 1]);
    let picked = l.clone().gather(1, index.clone());
    let keep = keep.reshape([len, 1]);
    let loss = ((lse.clone() - picked) * keep.clone()).reshape([len]);
    let d = grad.then(|| {
        let minus = Tensor::full([len, 1], -1.0, (&l.device(), DType::F32));
        let d = (l - lse)
            .exp()
            .scatter(1, index, minus, IndexingUpdateOp::Add);
        (d * (keep * scale.clone().reshape([1, 1]))).cast(dtype)
    });
    (loss, d)
}

/// What one loss computes beyond its operands.
#[derive(Clone, Copy, Debug)]
struct Loss {
    axis: VocabAxis,
    /// Most tokens per chunk (chunks are of near-equal sizes).
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
    let want = [&x, &weight].map(|t| !t.node.requirement.is_none());
    let (inner_x, inner_w) = (
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone())),
        Tensor::<Z, 2>::from_primitive(TensorPrimitive::Float(weight.primitive.clone())),
    );
    let prep = ChunkedBackward
        .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone()])
        .compute_bound()
        .stateful();
    let out = match prep {
        OpsKind::Tracked(prep) => {
            let pass = chunked(&inner_x, &inner_w, op.axis, &labels, op.rows, want);
            let loss = pass.loss.into_primitive().tensor();
            let state = Taken {
                dx: pass.dx,
                dw: pass.dw,
                grad_scale: pass.grad_scale,
            };
            prep.finish(state, loss)
        }
        OpsKind::UnTracked(prep) => {
            let pass = chunked(&inner_x, &inner_w, op.axis, &labels, op.rows, [false; 2]);
            prep.finish(pass.loss.into_primitive().tensor())
        }
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

#[derive(Debug)]
struct ChunkedBackward;

/// The summed loss's gradients the forward took, and what makes them the mean's.
#[derive(Clone, Debug)]
struct Taken<Z: Backend> {
    dx: Option<Tensor<Z, 2>>,
    dw: Option<Tensor<Z, 2>>,
    grad_scale: Tensor<Z, 1>,
}

impl<Z: Backend> Backward<Z, 2> for ChunkedBackward {
    type State = Taken<Z>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let Taken { dx, dw, grad_scale } = ops.state;
        let d_loss =
            Tensor::<Z, 1>::from_primitive(TensorPrimitive::Float(grads.consume::<Z>(&ops.node)));
        // dL/dloss / tokens, in f32: on CUDA one kernel scales each gradient in its own buffer
        // (burn's cast, product and cast made an f32 copy of the weight's gradient).
        let factor = d_loss.cast(FloatDType::F32) * grad_scale;
        let [x_parent, w_parent] = ops.parents.map(|p| p.map(|node| node.id));
        for (parent, grad) in [(x_parent, dx), (w_parent, dw)] {
            if let (Some(id), Some(grad)) = (parent, grad) {
                let grad = scaled(grad, &factor);
                grads.register::<Z>(id, grad.into_primitive().tensor());
            }
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
        // Every target ignored: 0/0 for the loss, zero gradients (as torch's).
        let x = Tensor::<B, 2>::ones([3, 2], &device).require_grad();
        let w = Tensor::<B, 2>::ones([2, 5], &device).require_grad();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![-1i64; 3], [3]), &device);
        let loss = linear_cross_entropy(x.clone(), w.clone(), VocabAxis::Columns, t, 2, Some(-1));
        let grads = loss.clone().backward();
        assert!(loss.into_scalar().is_nan());
        for g in [x.grad(&grads).unwrap(), w.grad(&grads).unwrap()] {
            let g = g.into_data().to_vec::<f32>().unwrap();
            assert!(g.iter().all(|v| *v == 0.0), "all ignored: gradients {g:?}");
        }
    }
}
