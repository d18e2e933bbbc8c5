//! Tensor slicing over the model axis (Megatron-style): column- and row-parallel linear layers,
//! a vocab-parallel embedding and a vocab-parallel cross-entropy.
//!
//! Two autodiff ops carry all the communication, each an all-reduce in one direction only:
//! - [`copy_to_group`] (Megatron's *f*): identity forward, gradient summed over the group in
//!   backward. It sits where a replicated activation enters a sliced layer: each rank's
//!   slice contributes a part of the input's gradient.
//! - [`reduce_from_group`] (*g*): summed over the group forward, identity backward. It sits
//!   where the partial results of a sliced layer leave it.
//!
//! Everything outside the sliced layers is replicated and computes the same values (and
//! gradients) on every rank of the group. A collective failing inside backward panics: burn's
//! backward has no error channel, and the other ranks fail their own collective in turn.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use burn_zero::comm::{CommError, Communicator, ReduceOp};

/// The ranks of one model-parallel group (the model axis of a [`crate::Topology`]).
#[derive(Clone)]
pub struct ModelGroup(Arc<dyn Communicator>);

impl fmt::Debug for ModelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelGroup({} of {})", self.rank(), self.size())
    }
}

impl ModelGroup {
    /// The group `comm` spans.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self(comm)
    }

    /// The group's communicator.
    pub fn comm(&self) -> &dyn Communicator {
        self.0.as_ref()
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.0.world_size()
    }

    /// The part of `n` rows (or columns) this rank holds: contiguous, the first `n % size`
    /// ranks one longer, so any `n` splits.
    pub fn slice_of(&self, n: usize) -> Range<usize> {
        slice_of(n, self.rank(), self.size())
    }
}

/// Rank `rank`'s part of `n` over `size` ranks (see [`ModelGroup::slice_of`]).
pub fn slice_of(n: usize, rank: usize, size: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The whole of a matrix whose consecutive pieces along `dim` the ranks of `group` hold (any
/// lengths, in rank order): what slicing took apart, put back, for evaluation and export.
/// Every rank of the group must call it; it travels through f32 host buffers.
pub fn gather_along<B: Backend>(
    t: Tensor<B, 2>,
    dim: usize,
    group: &ModelGroup,
) -> Result<Tensor<B, 2>, CommError> {
    let (dtype, device) = (t.dtype(), t.device());
    let rows = if dim == 0 { t } else { t.transpose() };
    let [n, width] = rows.dims();
    let size = group.size();
    let mut lens = vec![0.0f32; size];
    let mine = [n as f32];
    group
        .comm()
        .all_gather(mine.as_slice().into(), lens.as_mut_slice().into())?;
    let lens: Vec<usize> = lens.iter().map(|l| *l as usize).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let mut values: Vec<f32> = rows
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 values");
    values.resize(longest * width, 0.0);
    let mut all = vec![0.0f32; longest * width * size];
    group
        .comm()
        .all_gather(values.as_slice().into(), all.as_mut_slice().into())?;
    let whole: Vec<f32> = lens
        .iter()
        .enumerate()
        .flat_map(|(r, len)| &all[r * longest * width..(r * longest + len) * width])
        .copied()
        .collect();
    let total = lens.iter().sum::<usize>();
    let data = TensorData::new(whole, [total, width]).convert_dtype(dtype);
    let full = Tensor::<B, 2>::from_data(data, (&device, dtype));
    Ok(if dim == 0 { full } else { full.transpose() })
}

/// `x` reduced element-wise over the group, in its own dtype (in device memory on NCCL,
/// [`burn_zero::collective`]).
fn reduce_over<B: Backend>(x: FloatTensor<B>, group: &ModelGroup, op: ReduceOp) -> FloatTensor<B> {
    let shape = x.shape();
    let n = shape.num_elements();
    let flat = B::float_reshape(x, Shape::new([n]));
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat));
    match burn_zero::collective::all_reduce(group.0.as_ref(), flat, op) {
        Ok(reduced) => B::float_reshape(reduced.into_primitive().tensor(), shape),
        Err(e) => panic!("model-parallel all-reduce ({op:?}, {n} elements) failed: {e}"),
    }
}

/// Backends that run the two model-parallel ops inside their autodiff graph.
pub trait ModelParallelBackend: Backend {
    /// Megatron's *f*: `x` unchanged; its gradient summed over the group in backward.
    fn copy_to_group(x: FloatTensor<Self>, group: &ModelGroup) -> FloatTensor<Self>;
    /// Megatron's *g*: `x` summed over the group; its gradient passed on unchanged.
    fn reduce_from_group(x: FloatTensor<Self>, group: &ModelGroup) -> FloatTensor<Self>;
}

/// *f*'s backward: the gradient summed over the group.
#[derive(Debug)]
struct SumGradients(ModelGroup);

impl<B: Backend> Backward<B, 1> for SumGradients {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, reduce_over::<B>(grad, &self.0, ReduceOp::Sum));
        }
    }
}

/// *g*'s backward: the gradient as it is.
#[derive(Debug)]
struct PassGradients;

impl<B: Backend> Backward<B, 1> for PassGradients {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, grad);
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> ModelParallelBackend for Autodiff<B, C> {
    fn copy_to_group(x: FloatTensor<Self>, group: &ModelGroup) -> FloatTensor<Self> {
        SumGradients(group.clone())
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(x.primitive)
    }

    fn reduce_from_group(x: FloatTensor<Self>, group: &ModelGroup) -> FloatTensor<Self> {
        let summed = reduce_over::<B>(x.primitive.clone(), group, ReduceOp::Sum);
        PassGradients
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(summed)
    }
}

/// Megatron's *f* on a tensor (see [`ModelParallelBackend::copy_to_group`]).
pub fn copy_to_group<B: ModelParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ModelGroup,
) -> Tensor<B, D> {
    let out = B::copy_to_group(x.into_primitive().tensor(), group);
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Megatron's *g* on a tensor (see [`ModelParallelBackend::reduce_from_group`]).
pub fn reduce_from_group<B: ModelParallelBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ModelGroup,
) -> Tensor<B, D> {
    let out = B::reduce_from_group(x.into_primitive().tensor(), group);
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `x` reduced over the group outside the graph (a constant: no gradient flows through it).
fn reduce_constant<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    group: &ModelGroup,
    op: ReduceOp,
) -> Tensor<B, D> {
    let out = reduce_over::<B>(x.detach().into_primitive().tensor(), group, op);
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// A new trainable leaf holding `t`'s values.
fn leaf<B: Backend, const D: usize>(t: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::from_tensor(t.detach().require_grad())
}

/// A linear layer whose output features are sliced over the group: this rank holds columns
/// [`ModelGroup::slice_of`]`(d_out)` of the weight (burn's `[d_in, d_out]`) and of the bias.
/// The input is replicated; the output is this rank's slice of the features.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// `[d_in, d_out slice]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_out slice]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: ModelParallelBackend> ColumnParallelLinear<B> {
    /// This rank's slice of `full`.
    pub fn from_linear(full: &Linear<B>, group: &ModelGroup) -> Self {
        let [d_in, d_out] = full.weight.dims();
        let cols = group.slice_of(d_out);
        Self::from_parts(
            full.weight.val().slice([0..d_in, cols.clone()]),
            full.bias.as_ref().map(|b| b.val().slice([cols.clone()])),
        )
    }

    /// A layer holding `weight` (`[d_in, d_out slice]`) and `bias` as new trainable leaves.
    pub fn from_parts(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: leaf(weight),
            bias: bias.map(leaf),
        }
    }

    /// `[.., d_in]`, the same on every rank → this rank's `[.., d_out slice]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, group: &ModelGroup) -> Tensor<B, D> {
        let x = copy_to_group(x, group);
        burn::tensor::module::linear(x, self.weight.val(), self.bias.as_ref().map(Param::val))
    }
}

/// A linear layer whose input features are sliced over the group: this rank holds rows
/// [`ModelGroup::slice_of`]`(d_in)` of the weight; the bias is replicated and added once,
/// after the partial products are summed.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// `[d_in slice, d_out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_out]`, the same on every rank.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: ModelParallelBackend> RowParallelLinear<B> {
    /// This rank's slice of `full`.
    pub fn from_linear(full: &Linear<B>, group: &ModelGroup) -> Self {
        let [d_in, d_out] = full.weight.dims();
        let rows = group.slice_of(d_in);
        Self::from_parts(
            full.weight.val().slice([rows, 0..d_out]),
            full.bias.as_ref().map(|b| b.val()),
        )
    }

    /// A layer holding `weight` (`[d_in slice, d_out]`) and `bias` as new trainable leaves.
    pub fn from_parts(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: leaf(weight),
            bias: bias.map(leaf),
        }
    }

    /// This rank's `[.., d_in slice]` → `[.., d_out]`, the same on every rank.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>, group: &ModelGroup) -> Tensor<B, D> {
        let partial = burn::tensor::module::linear(x, self.weight.val(), None);
        self.finish(partial, group)
    }

    /// The output from this rank's partial product `x · weight` (computed by the caller, for
    /// one that applies the weight its own way): summed over the group, plus the bias.
    pub fn finish<const D: usize>(
        &self,
        partial: Tensor<B, D>,
        group: &ModelGroup,
    ) -> Tensor<B, D> {
        let out = reduce_from_group(partial, group);
        match &self.bias {
            Some(b) => out + b.val().unsqueeze(),
            None => out,
        }
    }
}

/// An embedding whose vocabulary is sliced over the group: this rank holds rows
/// `vocab_start..vocab_start + rows` of the table; ids outside them look up zeros, and the
/// lookups are summed over the group.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// `[vocab slice, d_model]`.
    pub weight: Param<Tensor<B, 2>>,
    /// The first id of this rank's slice.
    pub vocab_start: usize,
}

impl<B: ModelParallelBackend> VocabParallelEmbedding<B> {
    /// This rank's slice of `full`.
    pub fn from_embedding(full: &Embedding<B>, group: &ModelGroup) -> Self {
        let [vocab, d] = full.weight.dims();
        let rows = group.slice_of(vocab);
        Self {
            vocab_start: rows.start,
            weight: leaf(full.weight.val().slice([rows, 0..d])),
        }
    }

    /// `[batch, seq]` ids → `[batch, seq, d_model]`, the same on every rank.
    pub fn forward(&self, ids: Tensor<B, 2, Int>, group: &ModelGroup) -> Tensor<B, 3> {
        let rows = self.weight.dims()[0];
        let (start, end) = (self.vocab_start as i64, (self.vocab_start + rows) as i64);
        let mine = ids
            .clone()
            .greater_equal_elem(start)
            .bool_and(ids.clone().lower_elem(end));
        let local = ids.sub_scalar(start).mask_fill(mine.clone().bool_not(), 0);
        let looked_up = burn::tensor::module::embedding(self.weight.val(), local);
        let keep = mine.float().unsqueeze_dim::<3>(2);
        reduce_from_group(looked_up * keep, group)
    }
}

/// Mean cross-entropy of `[n, vocab slice]` logits (this rank's slice of the vocabulary,
/// starting at id `vocab_start`) against `[n]` target ids; the same value on every rank.
/// The softmax's normalizer and the target's logit are summed over the group, so no rank
/// ever holds the full `[n, vocab]` logits.
pub fn vocab_parallel_cross_entropy<B: ModelParallelBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    vocab_start: usize,
    group: &ModelGroup,
) -> Tensor<B, 1> {
    let [_, v] = logits.dims();
    // A shift by the global row maximum keeps exp finite; a constant, so no gradient.
    let max = reduce_constant(logits.clone().max_dim(1), group, ReduceOp::Max);
    let z = logits - max;
    let normalizer = reduce_from_group(z.clone().exp().sum_dim(1), group);
    let (start, end) = (vocab_start as i64, (vocab_start + v) as i64);
    let mine = targets
        .clone()
        .greater_equal_elem(start)
        .bool_and(targets.clone().lower_elem(end));
    let local = targets
        .sub_scalar(start)
        .mask_fill(mine.clone().bool_not(), 0);
    let picked = z.gather(1, local.unsqueeze_dim(1)) * mine.float().unsqueeze_dim(1);
    let target_logit = reduce_from_group(picked, group);
    (normalizer.log() - target_logit).mean()
}

#[cfg(test)]
mod tests {
    use super::slice_of;

    #[test]
    fn slices_cover_every_length_in_order() {
        for n in 0..20 {
            for size in 1..6 {
                let parts: Vec<_> = (0..size).map(|r| slice_of(n, r, size)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[size - 1].end, n);
                assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
                let lens: Vec<_> = parts.iter().map(|p| p.len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
    }
}
