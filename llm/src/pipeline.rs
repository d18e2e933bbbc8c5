//! The Llama as pipeline stages (burn-pipeline's [`PipeStage`]): a contiguous run of decoder
//! layers per stage, the embedding on the first and the final norm and output projection on
//! the last. Activations travel between stages as `[batch·seq, hidden]`; the first stage takes
//! the token ids as floats `[batch, seq]` (exact below 2^24) and the last returns the logits
//! `[batch·seq, vocab]`.

use core::ops::Range;

use burn::module::{Module, Param, ParamId};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor};
use burn_pipeline::{PipeStage, RecomputeSplit, WeightSplit};
use burn_zero::nn::{checkpoint, checkpoint_then};

use crate::model::{Block, Llama, Plain, Projector, Rope, norm};

/// Layers `layers` of a [`Llama`] as one pipeline stage.
#[derive(Module, Debug)]
pub struct LlamaStage<B: Backend> {
    embed: Option<Embedding<B>>,
    blocks: Vec<Block<B>>,
    norm: Option<RmsNorm<B>>,
    head: Option<Linear<B>>,
    tied: TiedOutput<B>,
    num_heads: usize,
    num_kv_heads: usize,
    rope_theta: f64,
    /// Positions per sequence (activations are `[batch·seq, hidden]` between stages).
    seq: usize,
    /// Each decoder layer checkpointed, as the model's ([`Llama::with_activation_checkpointing`]).
    checkpoint_layers: bool,
}

impl<B: Backend> LlamaStage<B> {
    /// Stage `stage` of `model` split into `stages` (each stage's decoder layers, contiguous
    /// and in order, as burn-pipeline's `split` returns them), for sequences of `seq` tokens.
    /// A tied output projection becomes a copy of the embedding on the last stage, kept equal
    /// to the first stage's through [`PipeStage::tied`].
    pub fn new(
        model: &Llama<B>,
        stages: &[Range<usize>],
        stage: usize,
        seq: usize,
    ) -> Result<Self, String> {
        let layers = stage_layers(stages, stage, model.blocks.len())?;
        let stages = stages.len();
        let (first, last) = (stage == 0, stage + 1 == stages);
        let tied = model.lm_head.is_none();
        Ok(Self {
            embed: first.then(|| model.embed.clone()),
            blocks: model.blocks[layers].to_vec(),
            norm: last.then(|| model.norm.clone()),
            head: if last { model.lm_head.clone() } else { None },
            tied: TiedOutput::new(tied, stage, stages, model.embed.weight.val()),
            num_heads: model.num_heads(),
            num_kv_heads: model.num_kv_heads(),
            rope_theta: model.rope_theta(),
            seq,
            checkpoint_layers: model.checkpoint_layers,
        })
    }

    /// Positions per sequence this stage was made for.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// `model` with this stage's parameters in place of its own: stage `stage` of `stages` (as
    /// [`LlamaStage::new`] took them). A tied output projection's copy on the last stage is
    /// left out: the executor keeps it equal to the first stage's embedding.
    pub fn put_back(
        self,
        mut model: Llama<B>,
        stages: &[Range<usize>],
        stage: usize,
    ) -> Result<Llama<B>, String> {
        let layers = stage_layers(stages, stage, model.blocks.len())?;
        if layers.len() != self.blocks.len() {
            return Err(format!(
                "stage {stage} holds {} layers, the split gives it {}",
                self.blocks.len(),
                layers.len()
            ));
        }
        for (i, block) in layers.zip(self.blocks) {
            model.blocks[i] = block;
        }
        if let Some(embed) = self.embed {
            model.embed = embed;
        }
        if let Some(norm) = self.norm {
            model.norm = norm;
        }
        if let Some(head) = self.head {
            model.lm_head = Some(head);
        }
        Ok(model)
    }

    /// This stage's layers on `x` (see the module doc for the shapes).
    pub fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply_with(x, &mut Plain, &plain_checkpoint)
    }

    /// [`LlamaStage::apply`] with the decoder layers' projections and an untied output
    /// projection applied by `p`. A checkpointed layer (per-layer activation checkpointing,
    /// inside a stage as in the whole model) runs again in backward: there its projections go
    /// through `recompute` when given (a split backward: their weights' gradients deferred,
    /// their output gradients read from the recompute's own backward), else burn's `Linear`'s,
    /// their weights' gradients then coming with the input's.
    fn apply_with(
        &self,
        x: Tensor<B, 2>,
        p: &mut impl Projector<B>,
        checkpointed: &CheckpointedLayer<B>,
    ) -> Tensor<B, 2> {
        let device = x.device();
        let h = match &self.embed {
            Some(embed) => embed.forward(x.int()),
            None => {
                let [rows, hidden] = x.dims();
                x.reshape([rows / self.seq, self.seq, hidden])
            }
        };
        let [batch, seq, hidden] = h.dims();
        let head_dim = hidden / self.num_heads;
        let rope = Rope::new(seq, head_dim, self.rope_theta, &device);
        let mask = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &device);
        let mut h = h;
        for block in &self.blocks {
            let (heads, kv) = (self.num_heads, self.num_kv_heads);
            h = match self.checkpoint_layers {
                false => block.forward_with(h, &rope, &mask, heads, kv, p),
                true => checkpointed(block, h, &rope, &mask, (heads, kv)),
            };
        }
        if let Some(n) = &self.norm {
            h = norm(n, h);
        }
        let transposed = |w: Tensor<B, 2>| w.transpose().unsqueeze::<3>();
        let h = match (
            &self.head,
            self.tied.weight(self.embed.as_ref().map(|e| &e.weight)),
        ) {
            (Some(head), _) => p.linear(h, &head.weight, head.bias.as_ref()),
            (None, Some(w)) => h.matmul(transposed(w)),
            _ => h,
        };
        let width = h.dims()[2];
        h.reshape([batch * seq, width])
    }
}

/// A causal mask, `[seq, seq]`.
type Mask<B> = Tensor<B, 2, Bool>;

/// How a stage runs one checkpointed decoder layer on `h`: (block, h, rope, mask, (query
/// heads, key/value heads)).
type CheckpointedLayer<B> =
    dyn Fn(&Block<B>, Tensor<B, 3>, &Rope<B>, &Mask<B>, (usize, usize)) -> Tensor<B, 3>;

/// A checkpointed layer as the whole model runs it: the recompute through burn's `Linear`.
fn plain_checkpoint<B: Backend>(
    block: &Block<B>,
    h: Tensor<B, 3>,
    rope: &Rope<B>,
    mask: &Mask<B>,
    (heads, kv): (usize, usize),
) -> Tensor<B, 3> {
    let (rope, mask) = (rope.clone(), mask.clone());
    checkpoint(block, h, move |block: &Block<B>, x| {
        block.forward(x, &rope, &mask, heads, kv)
    })
}

/// Inside a checkpointed layer's recompute: each projection's weight gradient deferred.
impl<B: AutodiffBackend> Projector<B> for RecomputeSplit<B> {
    fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        RecomputeSplit::linear(self, x, weight, bias)
    }
}

/// A zero-bubble schedule's split backward: each projection's weight gradient deferred.
impl<B: AutodiffBackend> Projector<B> for WeightSplit<B> {
    fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        WeightSplit::linear(self, x, weight, bias)
    }
}

impl<B: AutodiffBackend> PipeStage<B> for LlamaStage<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply(x)
    }

    /// The seven projections of every layer and an untied output projection defer their
    /// weights' gradients; norms, the embedding and a tied output projection do not.
    fn forward_split(&self, x: Tensor<B, 2>, split: &mut WeightSplit<B>) -> Tensor<B, 2> {
        let recompute = split.recompute();
        // Each checkpointed layer's recompute defers its projections' weight gradients too.
        let checkpointed = move |block: &Block<B>, h, rope: &Rope<B>, mask: &Mask<B>, heads| {
            let (rope, mask) = (rope.clone(), mask.clone());
            // One recorder per layer: its recompute and its backward run together.
            let layer = recompute.fresh();
            let resolve = layer.clone();
            checkpoint_then(
                block,
                h,
                move |block: &Block<B>, x| {
                    let (h, kv) = heads;
                    block.forward_with(x, &rope, &mask, h, kv, &mut layer.clone())
                },
                move |grads| resolve.resolve(grads),
            )
        };
        self.apply_with(x, split, &checkpointed)
    }

    fn tied(&self) -> Option<ParamId> {
        self.tied.shared(self.embed.as_ref().map(|e| &e.weight))
    }
}

/// A tied embedding's part in a stage's output projection: on the last of several stages a
/// copy of the embedding's rows (the executor sums its gradient with the first stage's), on a
/// single stage the embedding itself. Shared by [`LlamaStage`] and the sliced stage.
#[derive(Module, Debug)]
pub struct TiedOutput<B: Backend> {
    /// The last stage's copy of the tied rows (the output projection's weight, transposed).
    copy: Option<Param<Tensor<B, 2>>>,
    /// Tied, and one stage only: the output projection is the embedding's own weight.
    here: bool,
    /// Tied, and this is the first of several stages: the embedding is shared with the last.
    shares: bool,
}

impl<B: Backend> TiedOutput<B> {
    /// For stage `stage` of `stages` of a model tied or not; `rows` are the embedding rows
    /// this rank holds (the copy keeps their `require_grad`).
    pub(crate) fn new(tied: bool, stage: usize, stages: usize, rows: Tensor<B, 2>) -> Self {
        let last = stage + 1 == stages;
        Self {
            copy: (tied && last && stages > 1).then(|| {
                let require_grad = rows.is_require_grad();
                Param::from_tensor(rows.detach().set_require_grad(require_grad))
            }),
            here: tied && stages == 1,
            shares: tied && stage == 0 && stages > 1,
        }
    }

    /// The tied output projection's weight on this stage (`[rows, hidden]`), if it has one;
    /// `embed` is the stage's embedding, if it holds one.
    pub(crate) fn weight(&self, embed: Option<&Param<Tensor<B, 2>>>) -> Option<Tensor<B, 2>> {
        match (&self.copy, embed) {
            (Some(w), _) => Some(w.val()),
            (None, Some(e)) if self.here => Some(e.val()),
            _ => None,
        }
    }

    /// The matrix this stage shares with the other end of the pipeline ([`PipeStage::tied`]).
    pub(crate) fn shared(&self, embed: Option<&Param<Tensor<B, 2>>>) -> Option<ParamId> {
        match (embed, &self.copy) {
            (Some(e), _) if self.shares => Some(e.id),
            (_, Some(w)) => Some(w.id),
            _ => None,
        }
    }
}

/// The layers of stage `stage` when `stages` split `layers` decoder layers: an error unless
/// they are contiguous, in order, and cover them all.
pub(crate) fn stage_layers(
    stages: &[Range<usize>],
    stage: usize,
    layers: usize,
) -> Result<Range<usize>, String> {
    let contiguous = stages.first().is_some_and(|r| r.start == 0)
        && stages.last().is_some_and(|r| r.end == layers)
        && stages.windows(2).all(|w| w[0].end == w[1].start)
        && stages.iter().all(|r| r.start <= r.end);
    match stages.get(stage) {
        Some(range) if contiguous => Ok(range.clone()),
        _ => Err(format!(
            "stages {stages:?} do not split {layers} layers (or have no stage {stage})"
        )),
    }
}

/// Each decoder layer's weight for burn-pipeline's `split`: its matrix products per token
/// (forward, backward and, `checkpointed`, the forward again), the output projection's (about
/// as heavy as several layers at a large vocabulary) on the last layer; the embedding lookup
/// costs next to nothing.
pub fn layer_weights(config: &crate::LlamaConfig, checkpointed: bool) -> Vec<usize> {
    let passes = if checkpointed { 8 } else { 6 };
    let (h, f) = (config.hidden_size, config.intermediate_size);
    let kv = config.num_kv_heads * config.head_dim();
    let mut weights = vec![(2 * h * h + 2 * h * kv + 3 * h * f) * passes; config.num_layers];
    if let Some(last) = weights.last_mut() {
        *last += 6 * h * config.vocab_size;
    }
    weights
}

/// Token ids `[batch, seq]` as the first stage's float input.
pub fn ids_as_input<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 2> {
    ids.float()
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;
    use crate::LlamaConfig;

    type B = NdArray;

    fn flat(model: &Llama<B>) -> Vec<f32> {
        burn_pipeline::flatten_params(model, 0)
    }

    /// Stages of one model put back into another (untied and tied, 3 stages over 5 layers, one
    /// of them empty of layers) give back the first model's every parameter; a stage put back
    /// at the wrong place is refused.
    #[test]
    fn stages_put_back_make_the_model_they_came_from() {
        let device = Default::default();
        for tied in [false, true] {
            let config = LlamaConfig::new(37, 24, 40, 5, 6, 2).with_tie_embeddings(tied);
            <B as Backend>::seed(&device, 1);
            let trained: Llama<B> = config.init(&device);
            <B as Backend>::seed(&device, 2);
            let mut other: Llama<B> = config.init(&device);
            assert_ne!(flat(&trained), flat(&other), "two seeds, two models");
            let stages = [0..3, 3..3, 3..5];
            for s in 0..stages.len() {
                let stage = LlamaStage::new(&trained, &stages, s, 8).unwrap();
                other = stage.put_back(other, &stages, s).unwrap();
            }
            assert_eq!(flat(&trained), flat(&other), "tied {tied}");
            let first = LlamaStage::new(&trained, &stages, 0, 8).unwrap();
            let err = first.put_back(other, &stages, 2).unwrap_err();
            assert!(err.contains("holds 3 layers"), "{err}");
        }
    }
}
