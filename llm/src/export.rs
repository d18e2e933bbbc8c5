//! Saving a model as a Hugging Face directory (`config.json` + `model.safetensors`, f32,
//! `rotate_half` q/k layout): the recipe's checkpoint, loadable by [`crate::hf::HfDir`] and by
//! `transformers` (the independent reference for logits).

use std::collections::HashMap;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use burn_zero::checkpoint::{commit_file, replace_file};

use crate::lora::{Adapter, merged_weight};
use crate::model::{Llama, LlamaConfig};
use crate::weights::{LoadError, deinterleave_rope_rows, transpose};

/// One tensor under its Hugging Face name: row-major shape and values.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

fn values<B: Backend, const D: usize>(p: &Param<Tensor<B, D>>) -> (Vec<usize>, Vec<f32>) {
    tensor_values(p.val())
}

fn tensor_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> (Vec<usize>, Vec<f32>) {
    let shape = t.dims().to_vec();
    let data = t.into_data().convert::<f32>();
    (shape, data.to_vec::<f32>().expect("f32 after convert"))
}

impl<B: Backend> Llama<B> {
    /// Every parameter under its Hugging Face name, in Hugging Face layout (`[out, in]`
    /// Linear weights, `rotate_half` q/k rows).
    pub fn hf_tensors(&self, config: &LlamaConfig) -> Vec<NamedTensor> {
        let hd = config.head_dim();
        let mut out = Vec::new();
        let (shape, v) = values(&self.embed.weight);
        out.push(("model.embed_tokens.weight".to_string(), shape, v));
        // burn holds `[in, out]`; Hugging Face `[out, in]`.
        // LoRA adapters are folded into their projections: the export is a plain Llama.
        let linear = |l: &Linear<B>, a: Option<&Adapter<B>>, rope_heads: Option<usize>| {
            let (shape, v) = tensor_values(merged_weight(l, a));
            let (inp, outp) = (shape[0], shape[1]);
            let mut t = transpose(&v, inp, outp);
            if let Some(heads) = rope_heads {
                t = deinterleave_rope_rows(&t, heads, hd, inp);
            }
            (vec![outp, inp], t)
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let entries = [
                (
                    "self_attn.q_proj",
                    linear(&b.q, b.adapter(|l| &l.q), Some(config.num_heads)),
                ),
                (
                    "self_attn.k_proj",
                    linear(&b.k, b.adapter(|l| &l.k), Some(config.num_kv_heads)),
                ),
                ("self_attn.v_proj", linear(&b.v, b.adapter(|l| &l.v), None)),
                ("self_attn.o_proj", linear(&b.o, b.adapter(|l| &l.o), None)),
                (
                    "mlp.gate_proj",
                    linear(&b.gate, b.adapter(|l| &l.gate), None),
                ),
                ("mlp.up_proj", linear(&b.up, b.adapter(|l| &l.up), None)),
                (
                    "mlp.down_proj",
                    linear(&b.down, b.adapter(|l| &l.down), None),
                ),
                ("input_layernorm", values(&b.attn_norm.gamma)),
                ("post_attention_layernorm", values(&b.mlp_norm.gamma)),
            ];
            for (name, (shape, v)) in entries {
                out.push((format!("{p}.{name}.weight"), shape, v));
            }
        }
        let (shape, v) = values(&self.norm.gamma);
        out.push(("model.norm.weight".to_string(), shape, v));
        if let Some(head) = &self.lm_head {
            let (shape, v) = linear(head, None, None);
            out.push(("lm_head.weight".to_string(), shape, v));
        }
        out
    }

    /// Writes `dir/model.safetensors` (f32) and `dir/config.json`, each to a temporary name,
    /// flushed and renamed (weights first), so a crash never leaves a torn file.
    pub fn save_hf(&self, config: &LlamaConfig, dir: &Path) -> Result<(), LoadError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LoadError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": self.blocks.len(),
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim(),
            "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_seq_len,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": false, "mlp_bias": false, "torch_dtype": "float32",
        });
        let tensors = self.hf_tensors(config);
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        let fail = |what: String| LoadError::Format {
            path: dir.join("model.safetensors"),
            what,
        };
        let views = bytes
            .iter()
            .map(|(n, s, b)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| fail(e.to_string()))
            })
            .collect::<Result<HashMap<_, _>, _>>()?;
        // Each file goes in whole (written beside, flushed, renamed), the weights before the
        // config: a crash leaves each file either old or new, never cut short.
        let tmp = dir.join("model.safetensors.partial");
        safetensors::serialize_to_file(views, &None, &tmp).map_err(|e| fail(e.to_string()))?;
        let weights = dir.join("model.safetensors");
        commit_file(&tmp, &weights).map_err(io(&weights))?;
        let config_path = dir.join("config.json");
        replace_file(&config_path, format!("{json:#}").as_bytes()).map_err(io(&config_path))
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Int, TensorData, Tolerance};

    use super::*;
    use crate::hf::HfDir;
    use crate::weights::{deinterleave_rope_rows, interleave_rope_rows};

    #[test]
    fn rope_row_permutations_are_inverse() {
        let v: Vec<f32> = (0..2 * 8 * 3).map(|i| i as f32).collect();
        let there = interleave_rope_rows(&v, 2, 8, 3);
        assert_ne!(there, v);
        assert_eq!(deinterleave_rope_rows(&there, 2, 8, 3), v);
    }

    /// A model saved as a Hugging Face directory loads back to the same logits.
    #[test]
    fn saved_directory_loads_to_the_same_model() {
        type B = NdArray;
        let config = LlamaConfig::new(29, 16, 24, 2, 4, 2).with_tie_embeddings(false);
        let device = Default::default();
        let model: Llama<B> = config.init(&device);
        let dir = std::env::temp_dir().join(format!("bz-export-{}", std::process::id()));
        model.save_hf(&config, &dir).unwrap();
        let back_config = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
        assert_eq!(back_config, config);
        let back: Llama<B> = back_config
            .load(&HfDir::open(&dir).unwrap(), &device)
            .unwrap();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(vec![1i64, 7, 28, 3, 3], [1, 5]),
            &device,
        );
        model
            .forward(ids.clone())
            .into_data()
            .assert_approx_eq::<f32>(&back.forward(ids).into_data(), Tolerance::absolute(1e-6));
        std::fs::remove_dir_all(&dir).ok();
    }
}
