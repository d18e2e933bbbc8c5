//! Block-sparse layouts: the sparsity modes' configs and the layout they build.

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

use super::layouts::{BigBirdConfig, VariableConfig, big_bird, bs_longformer, variable};

/// One head's layout: `blocks × blocks`, row-major, `true` where a tile is computed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// Blocks per side.
    pub blocks: usize,
    /// Row-major tiles.
    pub tiles: Vec<bool>,
}

impl BlockLayout {
    pub(crate) fn empty(blocks: usize) -> Self {
        Self {
            blocks,
            tiles: vec![false; blocks * blocks],
        }
    }

    pub(crate) fn set(&mut self, row: usize, col: usize) {
        self.tiles[row * self.blocks + col] = true;
    }

    /// Whether tile (`row`, `col`) is computed.
    pub fn get(&self, row: usize, col: usize) -> bool {
        self.tiles[row * self.blocks + col]
    }

    /// Clears the tiles above the diagonal (unidirectional attention).
    pub(crate) fn keep_lower(&mut self) {
        for row in 0..self.blocks {
            for col in row + 1..self.blocks {
                self.tiles[row * self.blocks + col] = false;
            }
        }
    }

    /// Tiles computed.
    pub fn count(&self) -> usize {
        self.tiles.iter().filter(|t| **t).count()
    }
}

/// Attention direction (`attention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Tokens see only earlier tokens (`unidirectional`).
    Unidirectional,
    /// Tokens see every token (`bidirectional`).
    Bidirectional,
}

/// `sparse_attention {"mode": "fixed", ...}`.
#[derive(Clone, Debug, PartialEq)]
pub struct FixedConfig {
    /// `num_local_blocks`.
    pub num_local_blocks: usize,
    /// `num_global_blocks`.
    pub num_global_blocks: usize,
    /// `attention`.
    pub attention: Direction,
    /// `horizontal_global_attention` (bidirectional only).
    pub horizontal_global_attention: bool,
    /// `num_different_global_patterns` (needs `different_layout_per_head`).
    pub num_different_global_patterns: usize,
}

impl Default for FixedConfig {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Self {
            num_local_blocks: 4,
            num_global_blocks: 1,
            attention: Direction::Bidirectional,
            horizontal_global_attention: false,
            num_different_global_patterns: 1,
        }
    }
}

/// `sparse_attention {"mode": "bslongformer", ...}`: a sliding window plus global blocks that
/// attend to and are attended by every block.
#[derive(Clone, Debug, PartialEq)]
pub struct BsLongformerConfig {
    /// `num_sliding_window_blocks`: the window's width (centred on the row's block).
    pub num_sliding_window_blocks: usize,
    /// `global_block_indices`: global blocks, or the starts of global ranges.
    pub global_block_indices: Vec<usize>,
    /// `global_block_end_indices`: the ends (exclusive) of the global ranges, if ranges.
    pub global_block_end_indices: Option<Vec<usize>>,
    /// `attention`.
    pub attention: Direction,
}

impl Default for BsLongformerConfig {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Self {
            num_sliding_window_blocks: 3,
            global_block_indices: vec![0],
            global_block_end_indices: None,
            attention: Direction::Bidirectional,
        }
    }
}

/// A layout mode (`sparse_attention.mode`).
#[derive(Clone, Debug, PartialEq)]
pub enum SparsityMode {
    /// `dense`: every tile.
    Dense,
    /// `fixed`.
    Fixed(FixedConfig),
    /// `bslongformer`.
    BsLongformer(BsLongformerConfig),
    /// `bigbird`.
    BigBird(BigBirdConfig),
    /// `variable`.
    Variable(VariableConfig),
}

/// The settings every mode shares.
#[derive(Clone, Debug, PartialEq)]
pub struct SparsityConfig {
    /// Attention heads.
    pub num_heads: usize,
    /// `block`: tile side in tokens.
    pub block: usize,
    /// `different_layout_per_head`.
    pub different_layout_per_head: bool,
    /// The mode.
    pub mode: SparsityMode,
}

impl SparsityConfig {
    /// Every head's layout for sequences of `seq_len` tokens; an error names the setting that
    /// does not fit (the checks DeepSpeed makes).
    pub fn make_layout(&self, seq_len: usize) -> Result<Vec<BlockLayout>, String> {
        if self.block == 0 || !seq_len.is_multiple_of(self.block) {
            return Err(format!(
                "sequence length {seq_len} is not a multiple of the block size {}",
                self.block
            ));
        }
        let blocks = seq_len / self.block;
        let distinct = if self.different_layout_per_head {
            self.num_heads
        } else {
            1
        };
        let mut heads = Vec::with_capacity(self.num_heads);
        for h in 0..distinct {
            heads.push(match &self.mode {
                SparsityMode::Dense => BlockLayout {
                    blocks,
                    tiles: vec![true; blocks * blocks],
                },
                SparsityMode::Fixed(f) => self.fixed(f, h, blocks)?,
                SparsityMode::BsLongformer(c) => bs_longformer(c, blocks)?,
                SparsityMode::BigBird(c) => big_bird(c, h, blocks)?,
                SparsityMode::Variable(c) => variable(c, h, blocks)?,
            });
        }
        // One layout for every head unless each has its own.
        while heads.len() < self.num_heads {
            heads.push(heads[0].clone());
        }
        Ok(heads)
    }

    fn fixed(&self, f: &FixedConfig, h: usize, blocks: usize) -> Result<BlockLayout, String> {
        let (local, global) = (f.num_local_blocks, f.num_global_blocks);
        if global == 0 || local == 0 || !local.is_multiple_of(global) {
            return Err(format!(
                "num_local_blocks {local} must be a multiple of num_global_blocks {global}"
            ));
        }
        if f.horizontal_global_attention && f.attention != Direction::Bidirectional {
            return Err("horizontal_global_attention needs bidirectional attention".into());
        }
        if f.num_different_global_patterns > 1 && !self.different_layout_per_head {
            return Err(
                "num_different_global_patterns above 1 needs different_layout_per_head".into(),
            );
        }
        if f.num_different_global_patterns > local / global {
            return Err(format!(
                "num_different_global_patterns {} exceeds num_local_blocks / num_global_blocks \
                 = {}",
                f.num_different_global_patterns,
                local / global
            ));
        }
        let mut layout = BlockLayout::empty(blocks);
        let uni = f.attention == Direction::Unidirectional;
        // Local windows: each block row sees its window (up to itself when unidirectional).
        for start in (0..blocks).step_by(local) {
            let end = (start + local).min(blocks);
            for row in start..end {
                for col in start..if uni { row + 1 } else { end } {
                    layout.set(row, col);
                }
            }
        }
        // Global blocks: from the end of each window backwards, one pattern per head.
        let first = local - (1 + h % f.num_different_global_patterns) * global;
        let full = blocks - blocks % local;
        let mut mark = |start: usize, end: usize| {
            let first_row = if uni { start } else { 0 };
            for row in first_row..blocks {
                for col in start..end {
                    layout.set(row, col);
                }
            }
            if f.horizontal_global_attention {
                for row in start..end {
                    for col in 0..blocks {
                        layout.set(row, col);
                    }
                }
            }
        };
        for start in (first..full).step_by(local) {
            mark(start, start + global);
        }
        if full < blocks {
            // A short last window: its global blocks as far in as it reaches.
            let start = (full + first).min(blocks - global);
            mark(start, start + global);
        }
        Ok(layout)
    }
}

/// Every head's layout of one sequence length as the kernels read it: `[heads, blocks,
/// blocks]`, 1 where a tile is computed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SparseLayout {
    /// Query heads.
    pub heads: usize,
    /// Blocks per side.
    pub blocks: usize,
    /// Tokens per block side.
    pub block: usize,
    /// `[heads, blocks, blocks]`, row-major.
    pub kept: Vec<u32>,
}

impl SparseLayout {
    /// The layout `config` defines for sequences of `seq` tokens (an error names the setting
    /// that does not fit).
    pub fn new(config: &SparsityConfig, seq: usize) -> Result<Self, String> {
        let heads = config.make_layout(seq)?;
        Ok(Self {
            heads: heads.len(),
            blocks: heads.first().map_or(0, |h| h.blocks),
            block: config.block,
            kept: heads
                .iter()
                .flat_map(|h| h.tiles.iter().map(|t| u32::from(*t)))
                .collect(),
        })
    }

    /// Whether head `h` computes the pair (query `row`, key `key`).
    pub fn keeps(&self, h: usize, row: usize, key: usize) -> bool {
        self.kept[(h * self.blocks + row / self.block) * self.blocks + key / self.block] != 0
    }

    /// The share of tiles computed.
    pub fn density(&self) -> f64 {
        self.kept.iter().filter(|k| **k != 0).count() as f64 / self.kept.len().max(1) as f64
    }
}
