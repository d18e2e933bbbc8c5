//! `sparse_attention`: DeepSpeed's keys for block-sparse attention, read into the layout
//! settings of `cubecl_kernels::sparse` once the model's head count is known.

use cubecl_kernels::sparse::{
    BigBirdConfig, BsLongformerConfig, Direction, FixedConfig, SparsityConfig, SparsityMode,
    VariableConfig,
};
use serde::{Deserialize, Serialize};

/// `sparse_attention`, every mode's keys (a mode reads its own; DeepSpeed's defaults fill the
/// rest).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SparseAttentionConfig {
    /// `mode`: `dense`, `fixed`, `bigbird`, `bslongformer` or `variable` (default `fixed`).
    pub mode: Option<String>,
    /// `block`: tokens per block side (default 16).
    pub block: Option<usize>,
    /// `different_layout_per_head`.
    pub different_layout_per_head: bool,
    /// `num_local_blocks` (fixed).
    pub num_local_blocks: Option<usize>,
    /// `num_global_blocks` (fixed, bigbird).
    pub num_global_blocks: Option<usize>,
    /// `attention`: `bidirectional` (default) or `unidirectional`.
    pub attention: Option<String>,
    /// `horizontal_global_attention` (fixed, variable).
    pub horizontal_global_attention: bool,
    /// `num_different_global_patterns` (fixed).
    pub num_different_global_patterns: Option<usize>,
    /// `num_random_blocks` (bigbird: default 1; variable: 0).
    pub num_random_blocks: Option<usize>,
    /// `num_sliding_window_blocks` (bigbird, bslongformer; default 3).
    pub num_sliding_window_blocks: Option<usize>,
    /// `local_window_blocks` (variable; default [4]).
    pub local_window_blocks: Option<Vec<usize>>,
    /// `global_block_indices` (bslongformer, variable; default [0]).
    pub global_block_indices: Option<Vec<usize>>,
    /// `global_block_end_indices` (bslongformer, variable).
    pub global_block_end_indices: Option<Vec<usize>>,
}

impl SparseAttentionConfig {
    /// The layout settings for a model of `num_heads` heads, or what is wrong (named).
    pub fn sparsity(&self, num_heads: usize) -> Result<SparsityConfig, String> {
        let attention = match self.attention.as_deref().unwrap_or("bidirectional") {
            "bidirectional" => Direction::Bidirectional,
            "unidirectional" => Direction::Unidirectional,
            other => {
                return Err(format!(
                    "sparse_attention.attention `{other}`: expected bidirectional or unidirectional"
                ));
            }
        };
        let globals = || self.global_block_indices.clone().unwrap_or_else(|| vec![0]);
        let mode = match self.mode.as_deref().unwrap_or("fixed") {
            "dense" => SparsityMode::Dense,
            "fixed" => {
                let d = FixedConfig::default();
                SparsityMode::Fixed(FixedConfig {
                    num_local_blocks: self.num_local_blocks.unwrap_or(d.num_local_blocks),
                    num_global_blocks: self.num_global_blocks.unwrap_or(d.num_global_blocks),
                    attention,
                    horizontal_global_attention: self.horizontal_global_attention,
                    num_different_global_patterns: self
                        .num_different_global_patterns
                        .unwrap_or(d.num_different_global_patterns),
                })
            }
            "bigbird" => {
                let d = BigBirdConfig::default();
                SparsityMode::BigBird(BigBirdConfig {
                    num_random_blocks: self.num_random_blocks.unwrap_or(d.num_random_blocks),
                    num_sliding_window_blocks: self
                        .num_sliding_window_blocks
                        .unwrap_or(d.num_sliding_window_blocks),
                    num_global_blocks: self.num_global_blocks.unwrap_or(d.num_global_blocks),
                    attention,
                })
            }
            "bslongformer" => SparsityMode::BsLongformer(BsLongformerConfig {
                num_sliding_window_blocks: self
                    .num_sliding_window_blocks
                    .unwrap_or(BsLongformerConfig::default().num_sliding_window_blocks),
                global_block_indices: globals(),
                global_block_end_indices: self.global_block_end_indices.clone(),
                attention,
            }),
            "variable" => {
                let d = VariableConfig::default();
                SparsityMode::Variable(VariableConfig {
                    num_random_blocks: self.num_random_blocks.unwrap_or(d.num_random_blocks),
                    local_window_blocks: self
                        .local_window_blocks
                        .clone()
                        .unwrap_or(d.local_window_blocks),
                    global_block_indices: globals(),
                    global_block_end_indices: self.global_block_end_indices.clone(),
                    attention,
                    horizontal_global_attention: self.horizontal_global_attention,
                })
            }
            other => {
                return Err(format!(
                    "sparse_attention.mode `{other}`: expected dense, fixed, bigbird, \
                     bslongformer or variable"
                ));
            }
        };
        Ok(SparsityConfig {
            num_heads,
            block: self.block.unwrap_or(16),
            different_layout_per_head: self.different_layout_per_head,
            mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> SparseAttentionConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn deepspeed_keys_and_defaults_per_mode() {
        let bird = parse(r#"{"mode": "bigbird", "block": 32, "num_random_blocks": 2}"#);
        let s = bird.sparsity(8).unwrap();
        assert_eq!((s.num_heads, s.block), (8, 32));
        assert_eq!(
            s.mode,
            SparsityMode::BigBird(BigBirdConfig {
                num_random_blocks: 2,
                ..BigBirdConfig::default()
            })
        );
        let fixed = parse(r#"{"attention": "unidirectional", "num_local_blocks": 8}"#);
        match fixed.sparsity(2).unwrap().mode {
            SparsityMode::Fixed(f) => {
                assert_eq!((f.num_local_blocks, f.num_global_blocks), (8, 1));
                assert_eq!(f.attention, Direction::Unidirectional);
            }
            other => panic!("fixed is the default mode, got {other:?}"),
        }
        let variable = parse(r#"{"mode": "variable", "local_window_blocks": [2, 4]}"#);
        match variable.sparsity(2).unwrap().mode {
            SparsityMode::Variable(v) => {
                assert_eq!(v.local_window_blocks, vec![2, 4]);
                assert_eq!((v.num_random_blocks, v.global_block_indices), (0, vec![0]));
            }
            other => panic!("{other:?}"),
        }
        let bad = parse(r#"{"mode": "strided"}"#).sparsity(2).unwrap_err();
        assert!(bad.contains("sparse_attention.mode `strided`"), "{bad}");
        let bad = parse(r#"{"attention": "causal"}"#).sparsity(2).unwrap_err();
        assert!(bad.contains("sparse_attention.attention `causal`"), "{bad}");
    }
}
