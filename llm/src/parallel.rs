//! The Llama sliced over a model-parallel group (Megatron-style, burn-pipeline's
//! [`tensor_parallel`](burn_pipeline::tensor_parallel) layers): each rank holds a slice of the
//! attention heads (whole key/value groups, so grouped-query attention stays local), of the MLP's
//! intermediate features, and of the vocabulary (embedding rows and output columns); norms are
//! replicated. Attention and the MLP each end in one all-reduce; the loss is the vocab-parallel
//! cross-entropy, so no rank holds full logits.

use burn::module::{Module, Param};
use burn::nn::RmsNorm;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Int, Tensor};
use burn_pipeline::tensor_parallel::{
    ColumnParallelLinear, ModelGroup, ModelParallelBackend, RowParallelLinear,
    VocabParallelEmbedding, copy_to_group, gather_along, slice_of, vocab_parallel_cross_entropy,
};

use burn_zero::nn::swiglu;

use crate::model::{Block, Llama, Plain, Projector, Rope, add_norm, causal_attention, norm};

/// One decoder layer's slice.
#[derive(Module, Debug)]
pub struct ParallelBlock<B: Backend> {
    attn_norm: RmsNorm<B>,
    q: ColumnParallelLinear<B>,
    k: ColumnParallelLinear<B>,
    v: ColumnParallelLinear<B>,
    o: RowParallelLinear<B>,
    mlp_norm: RmsNorm<B>,
    gate: ColumnParallelLinear<B>,
    up: ColumnParallelLinear<B>,
    down: RowParallelLinear<B>,
    /// This rank's query heads and key/value heads.
    heads: usize,
    kv_heads: usize,
}

/// This rank's slice of a [`Llama`].
#[derive(Module, Debug)]
pub struct ParallelLlama<B: Backend> {
    embed: VocabParallelEmbedding<B>,
    blocks: Vec<ParallelBlock<B>>,
    norm: RmsNorm<B>,
    /// An untied output projection's vocabulary columns (`None`: tied to the embedding's rows).
    head: Option<ColumnParallelLinear<B>>,
    rope_theta: f64,
    #[module(skip)]
    group: ModelGroup,
}

/// Why a model cannot be sliced over a group.
pub(crate) fn check<B: Backend>(model: &Llama<B>, ranks: usize) -> Result<(), String> {
    if model.num_kv_heads() < ranks {
        return Err(format!(
            "{} key/value heads cannot be sliced over {ranks} model-parallel ranks (each needs a \
             whole key/value group)",
            model.num_kv_heads()
        ));
    }
    if model.blocks.iter().any(|b| b.lora.is_some()) {
        return Err("a model with LoRA adapters cannot be sliced yet".into());
    }
    Ok(())
}

/// `t` with only the rows or columns of `range` kept along `dim`, as a new trainable leaf.
fn part<B: Backend>(
    t: &Param<Tensor<B, 2>>,
    dim: usize,
    range: std::ops::Range<usize>,
) -> Tensor<B, 2> {
    t.val().slice_dim(dim, range)
}

impl<B: ModelParallelBackend> ParallelBlock<B> {
    pub(crate) fn slice(
        block: &Block<B>,
        heads: usize,
        kv_heads: usize,
        group: &ModelGroup,
    ) -> Self {
        let hd = block.q.weight.dims()[1] / heads;
        let kv = slice_of(kv_heads, group.rank(), group.size());
        let per_group = heads / kv_heads;
        let q = kv.start * per_group * hd..kv.end * per_group * hd;
        let kv_cols = kv.start * hd..kv.end * hd;
        let ffn = group.slice_of(block.gate.weight.dims()[1]);
        Self {
            attn_norm: block.attn_norm.clone(),
            q: ColumnParallelLinear::from_parts(part(&block.q.weight, 1, q.clone()), None),
            k: ColumnParallelLinear::from_parts(part(&block.k.weight, 1, kv_cols.clone()), None),
            v: ColumnParallelLinear::from_parts(part(&block.v.weight, 1, kv_cols), None),
            o: RowParallelLinear::from_parts(part(&block.o.weight, 0, q), None),
            mlp_norm: block.mlp_norm.clone(),
            gate: ColumnParallelLinear::from_parts(part(&block.gate.weight, 1, ffn.clone()), None),
            up: ColumnParallelLinear::from_parts(part(&block.up.weight, 1, ffn.clone()), None),
            down: RowParallelLinear::from_parts(part(&block.down.weight, 0, ffn), None),
            heads: kv.len() * per_group,
            kv_heads: kv.len(),
        }
    }

    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        mask: &Tensor<B, 2, Bool>,
        group: &ModelGroup,
    ) -> Tensor<B, 3> {
        self.forward_with(x, rope, mask, group, &mut Plain)
    }

    /// [`ParallelBlock::forward`] with this rank's slices of the seven projections applied
    /// by `p`.
    pub(crate) fn forward_with(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        mask: &Tensor<B, 2, Bool>,
        group: &ModelGroup,
        p: &mut impl Projector<B>,
    ) -> Tensor<B, 3> {
        // One `f` for the three projections of the same input.
        let h = copy_to_group(norm(&self.attn_norm, x.clone()), group);
        let mut local = |l: &ColumnParallelLinear<B>, h: Tensor<B, 3>| p.linear(h, &l.weight, None);
        let (q, k) = (local(&self.q, h.clone()), local(&self.k, h.clone()));
        let v = local(&self.v, h);
        let attn = causal_attention(q, k, v, rope, mask, self.heads, self.kv_heads);
        let o = self.o.finish(p.linear(attn, &self.o.weight, None), group);
        let (x, h) = add_norm(&self.mlp_norm, x, o);
        let h = copy_to_group(h, group);
        let mut local = |l: &ColumnParallelLinear<B>, h: Tensor<B, 3>| p.linear(h, &l.weight, None);
        let act = swiglu(local(&self.gate, h.clone()), local(&self.up, h));
        x + self
            .down
            .finish(p.linear(act, &self.down.weight, None), group)
    }
}

impl<B: Backend> ParallelLlama<B> {
    /// The whole model, put back together from every rank's slice into `into` (a model of the
    /// same configuration, such as the one sliced; its weights are replaced). Every rank of the
    /// group must call it.
    pub fn gather(&self, mut into: Llama<B>) -> Result<Llama<B>, String> {
        let group = &self.group;
        let whole = |t: &Param<Tensor<B, 2>>, dim: usize| {
            gather_along(t.val(), dim, group)
                .map(Param::from_tensor)
                .map_err(|e| format!("gathering the model-parallel slices: {e}"))
        };
        if into.blocks.len() != self.blocks.len() {
            return Err(format!(
                "a model of {} layers cannot take the {} of the sliced one",
                into.blocks.len(),
                self.blocks.len()
            ));
        }
        into.embed.weight = whole(&self.embed.weight, 0)?;
        for (full, part) in into.blocks.iter_mut().zip(&self.blocks) {
            full.attn_norm = part.attn_norm.clone();
            full.mlp_norm = part.mlp_norm.clone();
            full.q.weight = whole(&part.q.weight, 1)?;
            full.k.weight = whole(&part.k.weight, 1)?;
            full.v.weight = whole(&part.v.weight, 1)?;
            full.o.weight = whole(&part.o.weight, 0)?;
            full.gate.weight = whole(&part.gate.weight, 1)?;
            full.up.weight = whole(&part.up.weight, 1)?;
            full.down.weight = whole(&part.down.weight, 0)?;
        }
        into.norm = self.norm.clone();
        if let (Some(full), Some(part)) = (into.lm_head.as_mut(), &self.head) {
            full.weight = whole(&part.weight, 1)?;
        }
        Ok(into)
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.blocks.len()
    }
}

impl<B: ModelParallelBackend> ParallelLlama<B> {
    /// This rank's slice of `model` over `group`; an error says why it cannot be sliced.
    pub fn slice(model: &Llama<B>, group: ModelGroup) -> Result<Self, String> {
        check(model, group.size())?;
        let (heads, kv_heads) = (model.num_heads(), model.num_kv_heads());
        Ok(Self {
            embed: VocabParallelEmbedding::from_embedding(&model.embed, &group),
            blocks: model
                .blocks
                .iter()
                .map(|b| ParallelBlock::slice(b, heads, kv_heads, &group))
                .collect(),
            norm: model.norm.clone(),
            head: model
                .lm_head
                .as_ref()
                .map(|head| ColumnParallelLinear::from_linear(head, &group)),
            rope_theta: model.rope_theta(),
            group,
        })
    }

    /// Mean next-token cross-entropy of `tokens` (`[batch, seq + 1]`), the same on every rank
    /// of the group ([`Llama::loss`] on the unsliced model).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, len] = tokens.dims();
        let seq = len - 1;
        let inputs = tokens.clone().slice([0..batch, 0..seq]);
        let targets = tokens.slice([0..batch, 1..len]).reshape([batch * seq]);
        let device = inputs.device();
        let group = &self.group;
        let mut x = self.embed.forward(inputs, group);
        let head_dim = {
            let b = &self.blocks[0];
            b.q.weight.dims()[1] / b.heads
        };
        let rope = Rope::new(seq, head_dim, self.rope_theta, &device);
        let mask = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &device);
        for block in &self.blocks {
            x = block.forward(x, &rope, &mask, group);
        }
        let x = norm(&self.norm, x);
        let logits = match &self.head {
            Some(head) => head.forward(x, group),
            None => {
                let w = self.embed.weight.val().transpose().unsqueeze::<3>();
                copy_to_group(x, group).matmul(w)
            }
        };
        let local_vocab = logits.dims()[2];
        let logits = logits
            .cast(FloatDType::F32)
            .reshape([batch * seq, local_vocab]);
        vocab_parallel_cross_entropy(logits, targets, self.embed.vocab_start, group)
    }
}
