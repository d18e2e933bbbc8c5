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
use burn_pipeline::PipeStage;

use crate::model::{Block, Llama, Rope};

/// Layers `layers` of a [`Llama`] as one pipeline stage.
#[derive(Module, Debug)]
pub struct LlamaStage<B: Backend> {
    embed: Option<Embedding<B>>,
    blocks: Vec<Block<B>>,
    norm: Option<RmsNorm<B>>,
    head: Option<Linear<B>>,
    /// The last stage's copy of a tied embedding (the output projection's weight, transposed);
    /// the executor sums its gradient with the first stage's embedding's.
    tied_head: Option<Param<Tensor<B, 2>>>,
    /// Tied, and one stage only: the output projection is the embedding's own weight.
    tied_here: bool,
    /// Tied, and this is the first of several stages: the embedding is shared with the last.
    shares_embedding: bool,
    num_heads: usize,
    num_kv_heads: usize,
    rope_theta: f64,
    /// Positions per sequence (activations are `[batch·seq, hidden]` between stages).
    seq: usize,
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
            tied_head: (tied && last && stages > 1).then(|| {
                let w = model.embed.weight.val();
                let require_grad = w.is_require_grad();
                Param::from_tensor(w.detach().set_require_grad(require_grad))
            }),
            tied_here: tied && stages == 1,
            shares_embedding: tied && first && stages > 1,
            num_heads: model.num_heads(),
            num_kv_heads: model.num_kv_heads(),
            rope_theta: model.rope_theta(),
            seq,
        })
    }

    /// This stage's layers on `x` (see the module doc for the shapes).
    pub fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
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
        let rope = Rope::new(seq, head_dim, self.rope_theta, &device, h.dtype());
        let mask = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &device);
        let mut h = h;
        for block in &self.blocks {
            h = block.forward(h, &rope, &mask, self.num_heads, self.num_kv_heads);
        }
        if let Some(norm) = &self.norm {
            h = norm.forward(h);
        }
        let transposed = |w: Tensor<B, 2>| w.transpose().unsqueeze::<3>();
        let h = match (&self.head, &self.tied_head, &self.embed) {
            (Some(head), _, _) => head.forward(h),
            (None, Some(w), _) => h.matmul(transposed(w.val())),
            (None, None, Some(embed)) if self.tied_here => h.matmul(transposed(embed.weight.val())),
            _ => h,
        };
        let width = h.dims()[2];
        h.reshape([batch * seq, width])
    }
}

impl<B: AutodiffBackend> PipeStage<B> for LlamaStage<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply(x)
    }

    fn tied(&self) -> Option<ParamId> {
        match (&self.embed, &self.tied_head) {
            (Some(embed), _) if self.shares_embedding => Some(embed.weight.id),
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

/// Token ids `[batch, seq]` as the first stage's float input.
pub fn ids_as_input<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 2> {
    ids.float()
}
