//! The Llama in 3D: a pipeline stage ([`crate::pipeline`]'s split into contiguous layers)
//! whose layers are sliced over a model-parallel group ([`crate::parallel`]'s slices), for
//! pipe × data × model runs. Between stages the activations are `[batch·seq, hidden]`, the same
//! on every rank of the group; the first stage takes the token ids as floats `[batch, seq]`;
//! the last returns this rank's vocabulary columns of the logits `[batch·seq, local vocab]`,
//! for burn-pipeline's `vocab_parallel_cross_entropy` from [`ParallelLlamaStage::vocab_start`].

use core::ops::Range;

use burn::module::{Module, ParamId};
use burn::nn::RmsNorm;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Tensor};
use burn_pipeline::tensor_parallel::{
    ColumnParallelLinear, ModelGroup, ModelParallelBackend, VocabParallelEmbedding, copy_to_group,
};
use burn_pipeline::{PipeStage, WeightSplit};

use crate::model::{Llama, Plain, Projector, Rope, norm};
use crate::parallel::{ParallelBlock, check};
use crate::pipeline::{TiedOutput, stage_layers};

/// Layers `layers` of a [`Llama`], sliced over a model group, as one pipeline stage.
#[derive(Module, Debug)]
pub struct ParallelLlamaStage<B: Backend> {
    embed: Option<VocabParallelEmbedding<B>>,
    blocks: Vec<ParallelBlock<B>>,
    norm: Option<RmsNorm<B>>,
    /// An untied output projection's vocabulary columns.
    head: Option<ColumnParallelLinear<B>>,
    /// This rank's rows of a tied embedding as the output projection (the last stage's copy is
    /// summed with the first stage's rows of the same model rank).
    tied: TiedOutput<B>,
    /// The first vocabulary id of this rank's slice (of the embedding and of the logits).
    vocab_start: usize,
    head_dim: usize,
    rope_theta: f64,
    /// Positions per sequence (activations are `[batch·seq, hidden]` between stages).
    seq: usize,
    #[module(skip)]
    group: ModelGroup,
}

impl<B: ModelParallelBackend> ParallelLlamaStage<B> {
    /// Stage `stage` of `model` split into `stages` (contiguous, in order, as burn-pipeline's
    /// `split` returns them), this rank's slice over `group`, for sequences of `seq` tokens.
    pub fn new(
        model: &Llama<B>,
        stages: &[Range<usize>],
        stage: usize,
        seq: usize,
        group: ModelGroup,
    ) -> Result<Self, String> {
        check(model, group.size())?;
        let layers = stage_layers(stages, stage, model.blocks.len())?;
        let n = stages.len();
        let (first, last) = (stage == 0, stage + 1 == n);
        let (heads, kv_heads) = (model.num_heads(), model.num_kv_heads());
        // The embedding's rows of this rank: the first stage's lookup table, and on the last
        // stage of a tied model the output projection's columns.
        let rows = VocabParallelEmbedding::from_embedding(&model.embed, &group);
        let tied = TiedOutput::new(model.lm_head.is_none(), stage, n, rows.weight.val());
        Ok(Self {
            vocab_start: rows.vocab_start,
            embed: first.then_some(rows),
            blocks: model.blocks[layers]
                .iter()
                .map(|b| ParallelBlock::slice(b, heads, kv_heads, &group))
                .collect(),
            norm: last.then(|| model.norm.clone()),
            head: match (last, &model.lm_head) {
                (true, Some(head)) => Some(ColumnParallelLinear::from_linear(head, &group)),
                _ => None,
            },
            tied,
            head_dim: model.embed.weight.dims()[1] / heads,
            rope_theta: model.rope_theta(),
            seq,
            group,
        })
    }

    /// The first vocabulary id of this rank's logit columns.
    pub fn vocab_start(&self) -> usize {
        self.vocab_start
    }

    /// This stage's layers on `x` (see the module doc for the shapes).
    pub fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply_with(x, &mut Plain)
    }

    /// [`ParallelLlamaStage::apply`] with the decoder layers' projection slices and an untied
    /// output projection's slice applied by `p`.
    fn apply_with(&self, x: Tensor<B, 2>, p: &mut impl Projector<B>) -> Tensor<B, 2> {
        let (device, group) = (x.device(), &self.group);
        let h = match &self.embed {
            Some(embed) => embed.forward(x.int(), group),
            None => {
                let [rows, hidden] = x.dims();
                x.reshape([rows / self.seq, self.seq, hidden])
            }
        };
        let [batch, seq, _] = h.dims();
        let rope = Rope::new(seq, self.head_dim, self.rope_theta, &device);
        let mask = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &device);
        let mut h = h;
        for block in &self.blocks {
            h = block.forward_with(h, &rope, &mask, group, p);
        }
        if let Some(n) = &self.norm {
            h = norm(n, h);
        }
        let transposed = |w: Tensor<B, 2>| w.transpose().unsqueeze::<3>();
        let h = match (
            &self.head,
            self.tied.weight(self.embed.as_ref().map(|e| &e.weight)),
        ) {
            (Some(head), _) => {
                let bias = head.bias.as_ref();
                p.linear(copy_to_group(h, group), &head.weight, bias)
            }
            (None, Some(w)) => copy_to_group(h, group).matmul(transposed(w)),
            _ => h,
        };
        let width = h.dims()[2];
        h.reshape([batch * seq, width])
    }
}

impl<B: AutodiffBackend + ModelParallelBackend> PipeStage<B> for ParallelLlamaStage<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply(x)
    }

    /// Every projection slice and an untied output projection's slice defer their weights'
    /// gradients; norms, the embedding slice and a tied output projection do not.
    fn forward_split(&self, x: Tensor<B, 2>, split: &mut WeightSplit<B>) -> Tensor<B, 2> {
        self.apply_with(x, split)
    }

    fn tied(&self) -> Option<ParamId> {
        self.tied.shared(self.embed.as_ref().map(|e| &e.weight))
    }
}
