//! A Llama-architecture decoder in burn 0.21: RMSNorm, interleaved-pair RoPE, grouped-query
//! attention, SwiGLU, optionally tied embeddings. Weights load from any [`WeightSource`]
//! (GGUF or Hugging Face safetensors) under Hugging Face names.

use burn::config::Config;
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Int, Tensor};
use burn_zero::nn::{
    RopePairs, RopeTable, VocabAxis, add_rms_norm, checkpoint, linear_cross_entropy, rms_norm,
    rope, swiglu,
};
use burn_zero::profile::scope;

use crate::lora::{Adapters, project};
use crate::weights::{LoadError, WeightSource, linear_weight, matrix, vector};

/// The shape of a Llama model (Hugging Face `config.json` keys in the doc comments).
#[derive(Config, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `vocab_size`
    pub vocab_size: usize,
    /// `hidden_size`
    pub hidden_size: usize,
    /// `intermediate_size`
    pub intermediate_size: usize,
    /// `num_hidden_layers`
    pub num_layers: usize,
    /// `num_attention_heads`
    pub num_heads: usize,
    /// `num_key_value_heads`
    pub num_kv_heads: usize,
    /// `rope_theta`
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// `rms_norm_eps`
    #[config(default = 1e-5)]
    pub rms_norm_eps: f64,
    /// `max_position_embeddings`
    #[config(default = 2048)]
    pub max_seq_len: usize,
    /// `tie_word_embeddings`: the output projection is the embedding's transpose.
    #[config(default = true)]
    pub tie_embeddings: bool,
}

impl LlamaConfig {
    /// Head size (`hidden_size / num_heads`).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Checks that the sizes fit together; the error names the offending fields.
    pub fn validate(&self) -> Result<(), String> {
        let h = self.num_heads.max(1);
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(h) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "head size {} is odd: RoPE rotates pairs",
                self.head_dim()
            ));
        }
        Ok(())
    }

    /// Parameter count.
    pub fn num_params(&self) -> usize {
        let (h, f, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let attn = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads);
        let block = attn + 3 * h * f + 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            h * self.vocab_size
        };
        self.vocab_size * h + self.num_layers * block + h + head
    }

    /// A randomly initialized model.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Llama<B> {
        self.validate().unwrap_or_else(|e| panic!("{e}"));
        let (h, hd) = (self.hidden_size, self.head_dim());
        let linear = |i: usize, o: usize| LinearConfig::new(i, o).with_bias(false).init(device);
        let norm = || {
            RmsNormConfig::new(h)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let blocks = (0..self.num_layers)
            .map(|_| Block {
                attn_norm: norm(),
                q: linear(h, self.num_heads * hd),
                k: linear(h, self.num_kv_heads * hd),
                v: linear(h, self.num_kv_heads * hd),
                o: linear(self.num_heads * hd, h),
                mlp_norm: norm(),
                gate: linear(h, self.intermediate_size),
                up: linear(h, self.intermediate_size),
                down: linear(self.intermediate_size, h),
                lora: None,
            })
            .collect();
        Llama {
            embed: EmbeddingConfig::new(self.vocab_size, h).init(device),
            blocks,
            norm: norm(),
            lm_head: (!self.tie_embeddings).then(|| linear(h, self.vocab_size)),
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            rope_theta: self.rope_theta,
            loss_chunk: 0,
            checkpoint_layers: false,
        }
    }

    /// The model with weights from `source` (Hugging Face names; see [`WeightSource`]).
    pub fn load<B: Backend>(
        &self,
        source: &dyn WeightSource,
        device: &B::Device,
    ) -> Result<Llama<B>, LoadError> {
        let mut model = self.init::<B>(device);
        let (heads, kv) = (self.num_heads, self.num_kv_heads);
        let (h, hd, f, v) = (
            self.hidden_size,
            self.head_dim(),
            self.intermediate_size,
            self.vocab_size,
        );
        model.embed.weight = matrix(source, "model.embed_tokens.weight", [v, h], None, device)?;
        for (i, block) in model.blocks.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            // Stored `[out, in]` (torch's Linear); burn's Linear holds `[in, out]`.
            let lin = |name: &str, out: usize, inp: usize, rope_heads: Option<usize>| {
                let name = format!("{p}.{name}.weight");
                linear_weight::<B>(source, &name, [out, inp], rope_heads, device)
            };
            block.q.weight = lin("self_attn.q_proj", heads * hd, h, Some(heads))?;
            block.k.weight = lin("self_attn.k_proj", kv * hd, h, Some(kv))?;
            block.v.weight = lin("self_attn.v_proj", kv * hd, h, None)?;
            block.o.weight = lin("self_attn.o_proj", h, heads * hd, None)?;
            block.gate.weight = lin("mlp.gate_proj", f, h, None)?;
            block.up.weight = lin("mlp.up_proj", f, h, None)?;
            block.down.weight = lin("mlp.down_proj", h, f, None)?;
            block.attn_norm.gamma =
                vector(source, &format!("{p}.input_layernorm.weight"), h, device)?;
            block.mlp_norm.gamma = vector(
                source,
                &format!("{p}.post_attention_layernorm.weight"),
                h,
                device,
            )?;
        }
        model.norm.gamma = vector(source, "model.norm.weight", h, device)?;
        if let Some(head) = model.lm_head.as_mut() {
            head.weight = linear_weight::<B>(source, "lm_head.weight", [v, h], None, device)?;
        }
        Ok(model)
    }
}

/// One decoder layer.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub(crate) attn_norm: RmsNorm<B>,
    pub(crate) q: Linear<B>,
    pub(crate) k: Linear<B>,
    pub(crate) v: Linear<B>,
    pub(crate) o: Linear<B>,
    pub(crate) mlp_norm: RmsNorm<B>,
    pub(crate) gate: Linear<B>,
    pub(crate) up: Linear<B>,
    pub(crate) down: Linear<B>,
    /// LoRA adapters of this layer's projections ([`Llama::with_lora`]).
    pub(crate) lora: Option<Adapters<B>>,
}

/// The decoder: token ids `[batch, seq]` to logits `[batch, seq, vocab]`.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    pub(crate) embed: Embedding<B>,
    pub(crate) blocks: Vec<Block<B>>,
    pub(crate) norm: RmsNorm<B>,
    pub(crate) lm_head: Option<Linear<B>>,
    num_heads: usize,
    num_kv_heads: usize,
    rope_theta: f64,
    /// Tokens per chunk of the chunked loss ([`Llama::with_chunked_loss`]); 0: the logits
    /// materialized.
    loss_chunk: usize,
    /// Whether each decoder layer's activations are recomputed in backward
    /// ([`Llama::with_activation_checkpointing`]).
    pub(crate) checkpoint_layers: bool,
}

impl<B: Backend> Llama<B> {
    /// The model whose [`Llama::loss`] runs the output projection and the cross-entropy over
    /// chunks of `rows` tokens (`burn_zero::nn::linear_cross_entropy`): the `[tokens, vocab]`
    /// logits never exist whole. 0 materializes them (the default).
    pub fn with_chunked_loss(mut self, rows: usize) -> Self {
        self.loss_chunk = rows;
        self
    }

    /// The model whose decoder layers keep only their input from forward to backward and run
    /// again in backward (`burn_zero::nn::checkpoint`, one checkpoint per layer: DeepSpeed's
    /// `activation_checkpointing` applied to every layer). Off by default.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.checkpoint_layers = on;
        self
    }

    /// Logits for every position of `tokens` (`[batch, seq]`), causal attention.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.forward_kept(tokens, None)
    }

    /// [`Llama::forward`] with only the decoder layers `keep` marks (all when `None`): a
    /// dropped layer passes its input through (progressive layer dropping), so neither its
    /// forward nor its backward runs.
    pub fn forward_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 3> {
        let x = self.hidden_kept(tokens, keep);
        scope("lm_head", || match &self.lm_head {
            Some(head) => head.forward(x),
            None => {
                let w = self.embed.weight.val().transpose().unsqueeze::<3>();
                x.matmul(w)
            }
        })
    }

    /// The final norm's output `[batch, seq, hidden]` for the decoder layers `keep` marks.
    fn hidden_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 3> {
        let [_, seq] = tokens.dims();
        let device = tokens.device();
        // Module scopes for the FLOPs profiler, named as the parameters' paths are.
        let mut x = scope("embed", || self.embed.forward(tokens));
        let head_dim = x.dims()[2] / self.num_heads;
        // Activations follow the parameters' dtype (bf16 under mixed precision).
        let rope = Rope::new(seq, head_dim, self.rope_theta, &device);
        let mask = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &device);
        for (i, block) in self.blocks.iter().enumerate() {
            if keep.is_none_or(|k| k[i]) {
                let (heads, kv) = (self.num_heads, self.num_kv_heads);
                x = scope(&format!("blocks.{i}"), || match self.checkpoint_layers {
                    false => block.forward(x, &rope, &mask, heads, kv),
                    true => {
                        let (rope, mask) = (rope.clone(), mask.clone());
                        checkpoint(block, x, move |block: &Block<B>, x| {
                            block.forward(x, &rope, &mask, heads, kv)
                        })
                    }
                });
            }
        }
        scope("norm", || norm(&self.norm, x))
    }

    /// Mean next-token cross-entropy of `tokens` (`[batch, seq + 1]`: inputs and shifted
    /// targets), in nats.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss_kept(tokens, None)
    }

    /// [`Llama::loss`] with only the decoder layers `keep` marks ([`Llama::forward_kept`]).
    pub fn loss_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 1> {
        let [batch, len] = tokens.dims();
        let inputs = tokens.clone().slice([0..batch, 0..len - 1]);
        let targets = tokens.slice([0..batch, 1..len]);
        if self.loss_chunk == 0 {
            return cross_entropy(self.forward_kept(inputs, keep), targets);
        }
        let x = self.hidden_kept(inputs, keep);
        let [_, seq, hidden] = x.dims();
        let (weight, axis) = match &self.lm_head {
            Some(head) => (head.weight.val(), VocabAxis::Columns),
            None => (self.embed.weight.val(), VocabAxis::Rows),
        };
        scope("lm_head", || {
            linear_cross_entropy(
                x.reshape([batch * seq, hidden]),
                weight,
                axis,
                targets.reshape([batch * seq]),
                self.loss_chunk,
                None,
            )
        })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    /// Query heads per layer.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// Key/value heads per layer.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// RoPE's base.
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
    }
}

/// Mean cross-entropy of `logits` `[batch, seq, vocab]` against `targets` `[batch, seq]`,
/// computed with a max shift (stable in bf16 logits too).
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [batch, seq, vocab] = logits.dims();
    // In f32 whatever the logits' dtype: log-sum-exp over 49k entries loses too much in bf16.
    let logits = logits.cast(FloatDType::F32).reshape([batch * seq, vocab]);
    let max = logits.clone().max_dim(1).detach();
    let shifted = logits - max;
    let log_z = shifted.clone().exp().sum_dim(1).log();
    let picked = shifted.gather(1, targets.reshape([batch * seq, 1]));
    (log_z - picked).mean()
}

/// How a decoder layer applies its linear layers: burn's own `linear` ([`Plain`]), or another
/// way with the same value (a zero-bubble pipeline defers the weights' gradients).
pub trait Projector<B: Backend> {
    /// `x · weight + bias` on `[.., in]` (`weight` is `[in, out]`, as burn's `Linear` holds it).
    fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D>;
}

/// burn's `linear`, as `Linear::forward` runs it.
pub struct Plain;

impl<B: Backend> Projector<B> for Plain {
    fn linear<const D: usize>(
        &mut self,
        x: Tensor<B, D>,
        weight: &Param<Tensor<B, 2>>,
        bias: Option<&Param<Tensor<B, 1>>>,
    ) -> Tensor<B, D> {
        burn::tensor::module::linear(x, weight.val(), bias.map(Param::val))
    }
}

impl<B: Backend> Block<B> {
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        mask: &Tensor<B, 2, Bool>,
        heads: usize,
        kv_heads: usize,
    ) -> Tensor<B, 3> {
        self.forward_with(x, rope, mask, heads, kv_heads, &mut Plain)
    }

    /// [`Block::forward`] with its seven projections applied by `p`.
    pub(crate) fn forward_with(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        mask: &Tensor<B, 2, Bool>,
        heads: usize,
        kv_heads: usize,
        p: &mut impl Projector<B>,
    ) -> Tensor<B, 3> {
        let h = scope("attn_norm", || norm(&self.attn_norm, x.clone()));
        let q = scope("q", || {
            project(p, &self.q, self.adapter(|l| &l.q), h.clone())
        });
        let k = scope("k", || {
            project(p, &self.k, self.adapter(|l| &l.k), h.clone())
        });
        let v = scope("v", || project(p, &self.v, self.adapter(|l| &l.v), h));
        let attn = causal_attention(q, k, v, rope, mask, heads, kv_heads);
        let o = scope("o", || project(p, &self.o, self.adapter(|l| &l.o), attn));
        // The residual add and the norm after it: one kernel on CUDA.
        let (x, h) = scope("mlp_norm", || add_norm(&self.mlp_norm, x, o));
        let gate = scope("gate", || {
            project(p, &self.gate, self.adapter(|l| &l.gate), h.clone())
        });
        let up = scope("up", || project(p, &self.up, self.adapter(|l| &l.up), h));
        // A scope of its own: the profiler's sync at its end runs `silu(gate) · up` here
        // instead of inside the `down` projection that reads it.
        let act = scope("swiglu", || swiglu(gate, up));
        x + scope("down", || {
            project(p, &self.down, self.adapter(|l| &l.down), act)
        })
    }
}

/// `module` with every lazily initialized parameter drawn now (burn draws a parameter at its
/// first use), so clones, slices and stages of it share its values.
pub fn draw_parameters<B: Backend, M: Module<B>>(module: M) -> M {
    struct Draw;
    impl<B: Backend> ModuleMapper<B> for Draw {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Draw)
}

/// Causal grouped-query attention of projected `q` (`[batch, seq, heads·hd]`), `k` and `v`
/// (`[batch, seq, kv_heads·hd]`): RoPE on q and k, each K/V head serving `heads / kv_heads`
/// query heads, softmax in f32 (as transformers does); `[batch, seq, heads·hd]` out. The flash
/// kernels run it where `burn_zero::attention::flash_attention` takes the tensors; `mask` is
/// then not read (it is the causal mask).
pub(crate) fn causal_attention<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    rope: &Rope<B>,
    mask: &Tensor<B, 2, Bool>,
    heads: usize,
    kv_heads: usize,
) -> Tensor<B, 3> {
    let [batch, seq, width] = q.dims();
    let hd = width / heads;
    // RoPE on `[batch, seq, heads, hd]` rows, then the heads move forward.
    let split = |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, hd]);
    let q = rope.apply(split(q, heads)).swap_dims(1, 2);
    let k = rope.apply(split(k, kv_heads)).swap_dims(1, 2);
    let v = split(v, kv_heads).swap_dims(1, 2);
    // On CUDA through ZeroBackend: the flash kernels (no S×S scores, K/V heads not repeated).
    if let Some(attn) = burn_zero::attention::flash_attention(q.clone(), k.clone(), v.clone(), true)
    {
        return attn.swap_dims(1, 2).reshape([batch, seq, width]);
    }
    let repeat = |t: Tensor<B, 4>| {
        let group = heads / kv_heads;
        t.unsqueeze_dim::<5>(2)
            .expand([batch, kv_heads, group, seq, hd])
            .reshape([batch, heads, seq, hd])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
    let scores = scores.mask_fill(mask.clone().unsqueeze::<4>(), f32::NEG_INFINITY);
    let dtype = scores.dtype();
    let attn = softmax(scores.cast(FloatDType::F32), 3)
        .cast(dtype)
        .matmul(v);
    attn.swap_dims(1, 2).reshape([batch, seq, width])
}

/// Rotary position embedding on interleaved pairs `(x[2i], x[2i+1])` — the layout of the q/k
/// weights in GGUF files (llama.cpp permutes them); Hugging Face weights are permuted to it on
/// load. One table per forward, shared by every layer (`burn_zero::nn::rope`: one kernel each
/// way on CUDA).
#[derive(Clone)]
pub(crate) struct Rope<B: Backend> {
    table: RopeTable<B>,
}

impl<B: Backend> Rope<B> {
    pub(crate) fn new(seq: usize, head_dim: usize, theta: f64, device: &B::Device) -> Self {
        Self {
            table: RopeTable::new(seq, head_dim, theta, device),
        }
    }

    /// `x`: `[batch, seq, heads, head_dim]`.
    pub(crate) fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        rope(x, &self.table, RopePairs::Interleaved)
    }
}

/// `norm` (an RMSNorm) applied to `x` through `burn_zero::nn::rms_norm` (one kernel each way
/// on CUDA; the same formula as `RmsNorm::forward` elsewhere).
pub(crate) fn norm<B: Backend, const D: usize>(norm: &RmsNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    rms_norm(x, norm.gamma.val(), norm.epsilon)
}

/// `(x + residual, norm(x + residual))` through `burn_zero::nn::add_rms_norm` (one kernel on
/// CUDA; the add and then [`norm`] elsewhere).
pub(crate) fn add_norm<B: Backend, const D: usize>(
    norm: &RmsNorm<B>,
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
) -> (Tensor<B, D>, Tensor<B, D>) {
    add_rms_norm(x, residual, norm.gamma.val(), norm.epsilon)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use burn::backend::NdArray;
    use burn::tensor::{TensorData, Tolerance};

    use super::*;
    use crate::gguf::tests::{Writer, f32_bytes};
    use crate::gguf::{GgmlType, Gguf};
    use crate::hf::HfDir;

    type B = NdArray;

    fn config() -> LlamaConfig {
        // Odd sizes; 6 query heads share 2 K/V heads.
        LlamaConfig::new(37, 24, 40, 2, 6, 2)
            .with_rope_theta(500.0)
            .with_max_seq_len(64)
    }

    /// Deterministic values in [-0.5, 0.5).
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 1000.0) - 0.5)
            .collect()
    }

    /// Hugging Face tensors (name, row-major shape, values) of [`config`].
    fn hf_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let c = config();
        let (h, hd, f) = (c.hidden_size, c.head_dim(), c.intermediate_size);
        let mut out = vec![("model.embed_tokens.weight".into(), vec![c.vocab_size, h])];
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            for (name, shape) in [
                ("self_attn.q_proj.weight", vec![c.num_heads * hd, h]),
                ("self_attn.k_proj.weight", vec![c.num_kv_heads * hd, h]),
                ("self_attn.v_proj.weight", vec![c.num_kv_heads * hd, h]),
                ("self_attn.o_proj.weight", vec![h, c.num_heads * hd]),
                ("mlp.gate_proj.weight", vec![f, h]),
                ("mlp.up_proj.weight", vec![f, h]),
                ("mlp.down_proj.weight", vec![h, f]),
                ("input_layernorm.weight", vec![h]),
                ("post_attention_layernorm.weight", vec![h]),
            ] {
                out.push((format!("{p}.{name}"), shape));
            }
        }
        out.push(("model.norm.weight".into(), vec![h]));
        out.into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let v = values(shape.iter().product(), i);
                (name, shape, v)
            })
            .collect()
    }

    /// llama.cpp's permutation of q/k rows, written from its formula:
    /// `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)`.
    fn llama_cpp_permute(w: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
        let hd = rows / heads;
        let mut out = vec![0.0; w.len()];
        for head in 0..heads {
            for two in 0..2 {
                for i in 0..hd / 2 {
                    let src = head * hd + two * (hd / 2) + i;
                    let dst = head * hd + i * 2 + two;
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    fn tokens(ids: &[i64]) -> Tensor<B, 2, Int> {
        Tensor::from_data(
            TensorData::new(ids.to_vec(), [1, ids.len()]),
            &Default::default(),
        )
    }

    /// The same weights written as a Hugging Face directory and as a GGUF file (q/k rows
    /// permuted the way llama.cpp's converter does) load to the same logits.
    #[test]
    fn gguf_and_hugging_face_layouts_give_the_same_logits() {
        let c = config();
        let dir = std::env::temp_dir().join(format!("bz-llm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = hf_tensors();
        let views: HashMap<String, safetensors::tensor::TensorView> = tensors
            .iter()
            .map(|(n, s, v)| {
                let bytes: &[u8] = bytemuck_cast(v);
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), bytes)
                        .unwrap();
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
        let json = serde_json::json!({"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "rope_theta": c.rope_theta, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
            "tie_word_embeddings": true});
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();

        let mut w = Writer::new();
        w.kv_str("general.architecture", "llama")
            .kv_u32("llama.embedding_length", c.hidden_size as u32)
            .kv_u32("llama.feed_forward_length", c.intermediate_size as u32)
            .kv_u32("llama.block_count", c.num_layers as u32)
            .kv_u32("llama.attention.head_count", c.num_heads as u32)
            .kv_u32("llama.attention.head_count_kv", c.num_kv_heads as u32)
            .kv_u32("llama.context_length", 64)
            .kv_f32("llama.rope.freq_base", c.rope_theta as f32)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
        for (name, shape, v) in &tensors {
            let gguf = crate::weights::tests::gguf_name_for(name);
            let heads = match name {
                n if n.ends_with("q_proj.weight") => Some(c.num_heads),
                n if n.ends_with("k_proj.weight") => Some(c.num_kv_heads),
                _ => None,
            };
            let v = match heads {
                Some(heads) => llama_cpp_permute(v, heads, shape[0], shape[1]),
                None => v.clone(),
            };
            let dims: Vec<usize> = shape.iter().rev().copied().collect();
            w.tensor(&gguf, &dims, GgmlType::F32, &f32_bytes(&v));
        }
        let gguf = Gguf::parse("tiny.gguf".into(), w.bytes()).unwrap();
        let from_gguf = LlamaConfig::from_gguf(&gguf).unwrap();
        let from_hf = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
        assert_eq!(from_gguf, from_hf);
        assert_eq!(from_gguf.vocab_size, c.vocab_size);

        let device = Default::default();
        let a: Llama<B> = from_gguf.load(&gguf, &device).unwrap();
        let b: Llama<B> = from_hf.load(&HfDir::open(&dir).unwrap(), &device).unwrap();
        let ids = [3i64, 17, 0, 36, 5, 5, 21, 9, 30, 1, 2];
        let (la, lb) = (a.forward(tokens(&ids)), b.forward(tokens(&ids)));
        assert_eq!(la.dims(), [1, ids.len(), c.vocab_size]);
        la.into_data()
            .assert_approx_eq::<f32>(&lb.into_data(), Tolerance::absolute(1e-5));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Position t's logits do not depend on later tokens; RoPE makes them depend on order.
    #[test]
    fn attention_is_causal_and_position_aware() {
        let model: Llama<B> = config().init(&Default::default());
        let full = model.forward(tokens(&[4, 8, 15, 16, 23, 42 % 37]));
        let prefix = model.forward(tokens(&[4, 8, 15]));
        let v = config().vocab_size;
        full.clone()
            .slice([0..1, 0..3, 0..v])
            .into_data()
            .assert_approx_eq::<f32>(&prefix.into_data(), Tolerance::absolute(1e-5));
        let swapped = model.forward(tokens(&[8, 4, 15]));
        let diff = (full.slice([0..1, 2..3, 0..v]) - swapped.slice([0..1, 2..3, 0..v]))
            .abs()
            .max()
            .into_scalar();
        assert!(
            diff > 1e-4,
            "swapping earlier tokens left the logits unchanged"
        );
    }

    fn bytemuck_cast(v: &[f32]) -> &[u8] {
        // SAFETY: f32 has no padding and u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
    }
}
