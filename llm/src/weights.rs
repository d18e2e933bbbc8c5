//! Where model weights come from: a GGUF file (dequantized) or a Hugging Face directory
//! (`config.json` + `model.safetensors`), both read under Hugging Face tensor names.

use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::gguf::{Gguf, GgufError};
use crate::model::LlamaConfig;

/// Why weights could not be loaded; messages name the file and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The GGUF file is unreadable or malformed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A file's content is malformed, or a needed entry is missing.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A tensor's shape is not what the config implies.
    #[error("{path}: tensor `{name}` has shape {found:?}, the config implies {expected:?}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// Hugging Face name.
        name: String,
        /// From the config.
        expected: Vec<usize>,
        /// In the file.
        found: Vec<usize>,
    },
}

/// Model weights by Hugging Face name, as f32 with a row-major shape.
pub trait WeightSource {
    /// Tensor `name` (e.g. `model.layers.0.self_attn.q_proj.weight`).
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), LoadError>;
    /// Whether q/k projection rows are in Hugging Face's `rotate_half` order (they are
    /// permuted to interleaved pairs on load); GGUF files already hold interleaved rows.
    fn half_split_rope(&self) -> bool;
    /// The file, for messages.
    fn path(&self) -> &Path;
}

/// Matrix `name` of row-major shape `expected`, q/k rows permuted to interleaved RoPE pairs
/// when `rope_heads` is given and the source needs it.
pub fn matrix<B: Backend>(
    source: &dyn WeightSource,
    name: &str,
    expected: [usize; 2],
    rope_heads: Option<usize>,
    device: &B::Device,
) -> Result<Param<Tensor<B, 2>>, LoadError> {
    let values = stored(source, name, expected, rope_heads)?;
    let tensor = Tensor::from_data(TensorData::new(values, expected), device);
    Ok(Param::from_tensor(tensor))
}

/// [`matrix`] transposed (on the host: the parameter stays contiguous): a torch Linear's
/// `[out, in]` weight as burn's `[in, out]`.
pub fn linear_weight<B: Backend>(
    source: &dyn WeightSource,
    name: &str,
    expected: [usize; 2],
    rope_heads: Option<usize>,
    device: &B::Device,
) -> Result<Param<Tensor<B, 2>>, LoadError> {
    let [rows, cols] = expected;
    let values = stored(source, name, expected, rope_heads)?;
    let t = transpose(&values, rows, cols);
    let tensor = Tensor::from_data(TensorData::new(t, [cols, rows]), device);
    Ok(Param::from_tensor(tensor))
}

fn stored(
    source: &dyn WeightSource,
    name: &str,
    expected: [usize; 2],
    rope_heads: Option<usize>,
) -> Result<Vec<f32>, LoadError> {
    let (_, mut values) = checked(source, name, &expected)?;
    if let (Some(heads), true) = (rope_heads, source.half_split_rope()) {
        values = interleave_rope_rows(&values, heads, expected[0] / heads, expected[1]);
    }
    Ok(values)
}

/// Vector `name` of length `len`.
pub fn vector<B: Backend>(
    source: &dyn WeightSource,
    name: &str,
    len: usize,
    device: &B::Device,
) -> Result<Param<Tensor<B, 1>>, LoadError> {
    let (_, values) = checked(source, name, &[len])?;
    let tensor = Tensor::from_data(TensorData::new(values, [len]), device);
    Ok(Param::from_tensor(tensor))
}

fn checked(
    source: &dyn WeightSource,
    name: &str,
    expected: &[usize],
) -> Result<(Vec<usize>, Vec<f32>), LoadError> {
    let (shape, values) = source.get(name)?;
    if shape != expected {
        return Err(LoadError::Shape {
            path: source.path().to_path_buf(),
            name: name.into(),
            expected: expected.to_vec(),
            found: shape,
        });
    }
    Ok((shape, values))
}

/// Rows of a q/k projection (`heads` heads of `head_dim` rows, `cols` columns) from
/// `rotate_half` order (row `j` of a head pairs with `j + head_dim/2`) to interleaved order
/// (row `2i` pairs with `2i + 1`): llama.cpp's permutation.
pub fn interleave_rope_rows(
    values: &[f32],
    heads: usize,
    head_dim: usize,
    cols: usize,
) -> Vec<f32> {
    permute_rope_rows(values, heads, head_dim, cols, true)
}

/// The inverse of [`interleave_rope_rows`]: interleaved pairs back to `rotate_half` order.
pub fn deinterleave_rope_rows(
    values: &[f32],
    heads: usize,
    head_dim: usize,
    cols: usize,
) -> Vec<f32> {
    permute_rope_rows(values, heads, head_dim, cols, false)
}

/// Row `h·hd + part·hd/2 + i` (half-split) ↔ row `h·hd + 2i + part` (interleaved).
fn permute_rope_rows(
    values: &[f32],
    heads: usize,
    head_dim: usize,
    cols: usize,
    to_interleaved: bool,
) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for part in 0..2 {
                let split = h * head_dim + part * half + i;
                let paired = h * head_dim + 2 * i + part;
                let (src, dst) = if to_interleaved {
                    (split, paired)
                } else {
                    (paired, split)
                };
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Row-major `rows × cols` values transposed (`cols × rows`), on the host.
pub(crate) fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = values[r * cols + c];
        }
    }
    t
}

/// GGUF tensor name of Hugging Face name `hf`.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let part = match rest.strip_suffix(".weight")? {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{part}.weight"))
}

impl WeightSource for Gguf {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), LoadError> {
        let gguf = gguf_name(name).ok_or_else(|| LoadError::Format {
            path: self.path().to_path_buf(),
            what: format!("no GGUF name for `{name}`"),
        })?;
        Ok(self.tensor_f32(&gguf)?)
    }

    fn half_split_rope(&self) -> bool {
        false
    }

    fn path(&self) -> &Path {
        Gguf::path(self)
    }
}

impl LlamaConfig {
    /// The config of a GGUF file's `llama.*` metadata.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, LoadError> {
        let arch = gguf.get("general.architecture")?.as_str().unwrap_or("");
        let fail = |what: String| LoadError::Format {
            path: gguf.path().to_path_buf(),
            what,
        };
        if arch != "llama" {
            return Err(fail(format!("architecture `{arch}`, not `llama`")));
        }
        let int = |key: &str| -> Result<usize, LoadError> {
            let v = gguf.get(key)?;
            v.as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| fail(format!("`{key}` is {v:?}, not an integer")))
        };
        // GGUF stores f32: take its shortest decimal (1e-5, not 9.99999974e-6).
        let float = |key: &str, default: f64| {
            let v = gguf.metadata.get(key).and_then(|v| v.as_f64());
            v.map_or(default, |v| format!("{}", v as f32).parse().unwrap_or(v))
        };
        let vocab = match gguf.metadata.get("llama.vocab_size") {
            Some(v) => v.as_u64().unwrap_or(0) as usize,
            None => gguf.info("token_embd.weight").map_or(0, |t| t.shape()[0]),
        };
        let config = LlamaConfig::new(
            vocab,
            int("llama.embedding_length")?,
            int("llama.feed_forward_length")?,
            int("llama.block_count")?,
            int("llama.attention.head_count")?,
            int("llama.attention.head_count_kv")?,
        )
        .with_rope_theta(float("llama.rope.freq_base", 10000.0))
        .with_rms_norm_eps(float("llama.attention.layer_norm_rms_epsilon", 1e-5))
        .with_max_seq_len(int("llama.context_length").unwrap_or(2048))
        .with_tie_embeddings(gguf.info("output.weight").is_none());
        config.validate().map_err(fail)?;
        Ok(config)
    }

    /// The config of a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.into(),
            source,
        })?;
        let fail = |what: String| LoadError::Format {
            path: path.into(),
            what,
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
        let int = |key: &str| {
            json.get(key)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| fail(format!("`{key}` is missing or not an integer")))
        };
        let heads = int("num_attention_heads")?;
        let config = LlamaConfig::new(
            int("vocab_size")?,
            int("hidden_size")?,
            int("intermediate_size")?,
            int("num_hidden_layers")?,
            heads,
            int("num_key_value_heads").unwrap_or(heads),
        )
        .with_rope_theta(
            json.get("rope_theta")
                .and_then(|v| v.as_f64())
                .unwrap_or(10000.0),
        )
        .with_rms_norm_eps(
            json.get("rms_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-5),
        )
        .with_max_seq_len(int("max_position_embeddings").unwrap_or(2048))
        .with_tie_embeddings(
            json.get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        );
        config.validate().map_err(fail)?;
        Ok(config)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The GGUF name of a Hugging Face tensor name (for tests writing GGUF files).
    pub(crate) fn gguf_name_for(hf: &str) -> String {
        gguf_name(hf).unwrap_or_else(|| panic!("no GGUF name for {hf}"))
    }

    #[test]
    fn gguf_names_follow_llama_cpp() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.o_proj.weight").as_deref(),
            Some("blk.12.attn_output.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(
            gguf_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(gguf_name("model.layers.0.mlp.nope.weight"), None);
    }

    /// One head of 4 rows `[a0, a1, b0, b1]` (pairs `(a0, b0)`, `(a1, b1)` in `rotate_half`
    /// order) becomes `[a0, b0, a1, b1]`.
    #[test]
    fn rope_rows_interleave_like_llama_cpp() {
        let rows: Vec<f32> = (0..8).map(|i| (i / 2) as f32).collect(); // 4 rows × 2 cols
        let out = interleave_rope_rows(&rows, 1, 4, 2);
        assert_eq!(out, vec![0., 0., 2., 2., 1., 1., 3., 3.]);
    }
}
