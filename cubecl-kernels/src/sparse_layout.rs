//! Block-sparse attention layouts as DeepSpeed's `sparse_attention` defines them: which
//! `block × block` tiles of the attention matrix each head computes. `Dense` keeps every tile;
//! `BsLongformer` a sliding window plus global blocks in both directions;
//! `Fixed` (Sparse Transformers, as DeepSpeed customizes it) keeps local windows of
//! `num_local_blocks` blocks plus, per window, `num_global_blocks` representative blocks that
//! every row attends to (and that attend to every column, with horizontal global attention).
//! Free of GPU types: the kernel reads these masks.

/// One head's layout: `blocks × blocks`, row-major, `true` where a tile is computed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    /// Blocks per side.
    pub blocks: usize,
    /// Row-major tiles.
    pub tiles: Vec<bool>,
}

impl BlockLayout {
    fn empty(blocks: usize) -> Self {
        Self {
            blocks,
            tiles: vec![false; blocks * blocks],
        }
    }

    fn set(&mut self, row: usize, col: usize) {
        self.tiles[row * self.blocks + col] = true;
    }

    /// Whether tile (`row`, `col`) is computed.
    pub fn get(&self, row: usize, col: usize) -> bool {
        self.tiles[row * self.blocks + col]
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

/// The `bslongformer` layout of `blocks` blocks.
fn bs_longformer(c: &BsLongformerConfig, blocks: usize) -> Result<BlockLayout, String> {
    if c.num_sliding_window_blocks > blocks {
        return Err(format!(
            "num_sliding_window_blocks {} exceeds the {blocks} blocks of a row",
            c.num_sliding_window_blocks
        ));
    }
    let ranges: Vec<(usize, usize)> = match &c.global_block_end_indices {
        None => c.global_block_indices.iter().map(|i| (*i, i + 1)).collect(),
        Some(ends) => {
            if ends.len() != c.global_block_indices.len() {
                return Err(format!(
                    "global_block_indices has {} entries, global_block_end_indices {}",
                    c.global_block_indices.len(),
                    ends.len()
                ));
            }
            let pairs: Vec<(usize, usize)> = c
                .global_block_indices
                .iter()
                .copied()
                .zip(ends.iter().copied())
                .collect();
            if let Some((s, e)) = pairs.iter().find(|(s, e)| s >= e) {
                return Err(format!("global block range {s}..{e} is empty"));
            }
            pairs
        }
    };
    let mut layout = BlockLayout::empty(blocks);
    let w = c.num_sliding_window_blocks / 2;
    for row in 0..blocks {
        for col in row.saturating_sub(w)..(row + w + 1).min(blocks) {
            layout.set(row, col);
        }
    }
    for (start, end) in ranges.into_iter().filter(|(s, _)| *s < blocks) {
        for g in start..end.min(blocks) {
            for other in 0..blocks {
                layout.set(g, other);
                layout.set(other, g);
            }
        }
    }
    if c.attention == Direction::Unidirectional {
        for row in 0..blocks {
            for col in row + 1..blocks {
                layout.tiles[row * blocks + col] = false;
            }
        }
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::{
        BlockLayout, BsLongformerConfig, Direction, FixedConfig, SparsityConfig, SparsityMode,
    };

    /// A layout written as rows of `#` (computed) and `.`.
    fn drawn(rows: &[&str]) -> BlockLayout {
        BlockLayout {
            blocks: rows.len(),
            tiles: rows
                .iter()
                .flat_map(|r| r.chars().map(|c| c == '#'))
                .collect(),
        }
    }

    fn fixed(heads: usize, per_head: bool, f: FixedConfig) -> SparsityConfig {
        SparsityConfig {
            num_heads: heads,
            block: 16,
            different_layout_per_head: per_head,
            mode: SparsityMode::Fixed(f),
        }
    }

    #[test]
    fn dense_keeps_every_tile() {
        let c = SparsityConfig {
            num_heads: 2,
            block: 16,
            different_layout_per_head: false,
            mode: SparsityMode::Dense,
        };
        let l = c.make_layout(64).unwrap();
        assert_eq!(l.len(), 2);
        assert!(l.iter().all(|h| h.count() == 16));
    }

    /// 8 blocks, windows of 4, one global block (the last of each window), bidirectional.
    #[test]
    fn fixed_bidirectional_written_out() {
        let l = fixed(1, false, FixedConfig::default())
            .make_layout(128)
            .unwrap();
        let want = drawn(&[
            "####...#", //
            "####...#", //
            "####...#", //
            "####...#", //
            "...#####", //
            "...#####", //
            "...#####", //
            "...#####",
        ]);
        assert_eq!(l[0], want);
    }

    /// Unidirectional: causal windows, and global columns only from their own row down.
    #[test]
    fn fixed_unidirectional_written_out() {
        let f = FixedConfig {
            attention: Direction::Unidirectional,
            ..FixedConfig::default()
        };
        let l = fixed(1, false, f).make_layout(128).unwrap();
        let want = drawn(&[
            "#.......", //
            "##......", //
            "###.....", //
            "####....", //
            "...##...", //
            "...###..", //
            "...####.", //
            "...#####",
        ]);
        assert_eq!(l[0], want);
    }

    /// Horizontal global attention, a short last window (6 blocks, windows of 4), and a second
    /// head taking the third block of each window as global.
    #[test]
    fn fixed_horizontal_short_window_and_per_head_patterns() {
        let f = FixedConfig {
            horizontal_global_attention: true,
            num_different_global_patterns: 2,
            ..FixedConfig::default()
        };
        let l = fixed(2, true, f).make_layout(96).unwrap();
        let head0 = drawn(&[
            "####.#", //
            "####.#", //
            "####.#", //
            "######", //
            "...###", //
            "######",
        ]);
        // The second head's globals are the third block of each window; the short last
        // window's is clamped to its last block, as DeepSpeed clamps it.
        let head1 = drawn(&[
            "####.#", //
            "####.#", //
            "######", //
            "####.#", //
            "..#.##", //
            "######",
        ]);
        assert_eq!(l[0], head0);
        assert_eq!(l[1], head1);
    }

    fn longformer(c: BsLongformerConfig) -> BlockLayout {
        let config = SparsityConfig {
            num_heads: 1,
            block: 16,
            different_layout_per_head: false,
            mode: SparsityMode::BsLongformer(c),
        };
        config.make_layout(96).unwrap().remove(0)
    }

    /// 6 blocks, a window of 3, block 0 global; then causal; then a global range 1..3.
    #[test]
    fn bslongformer_written_out() {
        let both = longformer(BsLongformerConfig::default());
        let want = drawn(&[
            "######", //
            "###...", //
            "####..", //
            "#.###.", //
            "#..###", //
            "#...##",
        ]);
        assert_eq!(both, want);
        let causal = longformer(BsLongformerConfig {
            attention: Direction::Unidirectional,
            ..BsLongformerConfig::default()
        });
        let want = drawn(&[
            "#.....", //
            "##....", //
            "###...", //
            "#.##..", //
            "#..##.", //
            "#...##",
        ]);
        assert_eq!(causal, want);
        let ranged = longformer(BsLongformerConfig {
            global_block_indices: vec![1],
            global_block_end_indices: Some(vec![3]),
            ..BsLongformerConfig::default()
        });
        let want = drawn(&[
            "###...", //
            "######", //
            "######", //
            ".####.", //
            ".#####", //
            ".##.##",
        ]);
        assert_eq!(ranged, want);
    }

    #[test]
    fn bad_settings_are_named() {
        let bad =
            |f: FixedConfig, per_head: bool| fixed(2, per_head, f).make_layout(128).unwrap_err();
        let e = bad(
            FixedConfig {
                num_local_blocks: 4,
                num_global_blocks: 3,
                ..FixedConfig::default()
            },
            false,
        );
        assert!(e.contains("num_local_blocks 4"), "{e}");
        let e = bad(
            FixedConfig {
                attention: Direction::Unidirectional,
                horizontal_global_attention: true,
                ..FixedConfig::default()
            },
            false,
        );
        assert!(e.contains("bidirectional"), "{e}");
        let e = bad(
            FixedConfig {
                num_different_global_patterns: 2,
                ..FixedConfig::default()
            },
            false,
        );
        assert!(e.contains("different_layout_per_head"), "{e}");
        let e = fixed(1, false, FixedConfig::default())
            .make_layout(100)
            .unwrap_err();
        assert!(e.contains("multiple of the block size 16"), "{e}");
    }
}
