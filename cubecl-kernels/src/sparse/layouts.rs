//! The layouts of the modes that are not a method of `SparsityConfig`.

use super::{BlockLayout, BsLongformerConfig, Direction};

/// `sparse_attention {"mode": "bigbird", ...}`: random blocks per row, a sliding window, and
/// global blocks (rows and columns) at the start.
#[derive(Clone, Debug, PartialEq)]
pub struct BigBirdConfig {
    /// `num_random_blocks`: random columns per block row.
    pub num_random_blocks: usize,
    /// `num_sliding_window_blocks`: the window's width (centred on the row's block).
    pub num_sliding_window_blocks: usize,
    /// `num_global_blocks`: the first blocks, attending to and attended by all.
    pub num_global_blocks: usize,
    /// `attention`.
    pub attention: Direction,
}

impl Default for BigBirdConfig {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Self {
            num_random_blocks: 1,
            num_sliding_window_blocks: 3,
            num_global_blocks: 1,
            attention: Direction::Bidirectional,
        }
    }
}

/// `sparse_attention {"mode": "variable", ...}`: random blocks, local windows of the sizes
/// listed (the last size repeating), global blocks or ranges.
#[derive(Clone, Debug, PartialEq)]
pub struct VariableConfig {
    /// `num_random_blocks`.
    pub num_random_blocks: usize,
    /// `local_window_blocks`: window sizes from the start; the last repeats to the end.
    pub local_window_blocks: Vec<usize>,
    /// `global_block_indices`: global blocks, or the starts of global ranges.
    pub global_block_indices: Vec<usize>,
    /// `global_block_end_indices`: the ends (exclusive) of the global ranges, if ranges.
    pub global_block_end_indices: Option<Vec<usize>>,
    /// `attention`.
    pub attention: Direction,
    /// `horizontal_global_attention`: global blocks also attend to every block.
    pub horizontal_global_attention: bool,
}

impl Default for VariableConfig {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Self {
            num_random_blocks: 0,
            local_window_blocks: vec![4],
            global_block_indices: vec![0],
            global_block_end_indices: None,
            attention: Direction::Bidirectional,
            horizontal_global_attention: false,
        }
    }
}

/// A small deterministic generator for the random blocks (DeepSpeed draws them with Python's
/// `random`, so the columns differ from its draw; their number per row is the same).
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }

    /// `count` distinct values of `0..n` (all of them when `count ≥ n`).
    fn sample(&mut self, n: usize, count: usize) -> Vec<usize> {
        let mut pool: Vec<usize> = (0..n).collect();
        for i in 0..count.min(n) {
            let j = i + self.below(n - i);
            pool.swap(i, j);
        }
        pool.truncate(count.min(n));
        pool
    }
}

/// Random columns for each block row of head `h`: from every block (bidirectional or
/// `anywhere`), else from the blocks up to the row.
fn random_blocks(layout: &mut BlockLayout, count: usize, uni: bool, h: usize) {
    if count == 0 {
        return;
    }
    let mut draw = Draw(0x5eed ^ h as u64);
    for row in 0..layout.blocks {
        let range = if uni { row + 1 } else { layout.blocks };
        for col in draw.sample(range, count) {
            layout.set(row, col);
        }
    }
}

/// The `bigbird` layout of head `h` over `blocks` blocks.
pub(super) fn big_bird(c: &BigBirdConfig, h: usize, blocks: usize) -> Result<BlockLayout, String> {
    for (name, n) in [
        ("num_random_blocks", c.num_random_blocks),
        ("num_sliding_window_blocks", c.num_sliding_window_blocks),
        ("num_global_blocks", c.num_global_blocks),
    ] {
        if n > blocks {
            return Err(format!("{name} {n} exceeds the {blocks} blocks of a row"));
        }
    }
    let uni = c.attention == Direction::Unidirectional;
    let mut layout = BlockLayout::empty(blocks);
    random_blocks(&mut layout, c.num_random_blocks, uni, h);
    let w = c.num_sliding_window_blocks / 2;
    for row in 0..blocks {
        for col in row.saturating_sub(w)..(row + w + 1).min(blocks) {
            layout.set(row, col);
        }
    }
    for g in 0..c.num_global_blocks {
        for other in 0..blocks {
            layout.set(g, other);
            layout.set(other, g);
        }
    }
    if uni {
        layout.keep_lower();
    }
    Ok(layout)
}

/// Global block ranges of `indices` (single blocks) or `indices..ends`, checked.
fn global_ranges(indices: &[usize], ends: Option<&[usize]>) -> Result<Vec<(usize, usize)>, String> {
    match ends {
        None => Ok(indices.iter().map(|i| (*i, i + 1)).collect()),
        Some(ends) => {
            if ends.len() != indices.len() {
                return Err(format!(
                    "global_block_indices has {} entries, global_block_end_indices {}",
                    indices.len(),
                    ends.len()
                ));
            }
            let pairs: Vec<(usize, usize)> =
                indices.iter().copied().zip(ends.iter().copied()).collect();
            if let Some((s, e)) = pairs.iter().find(|(s, e)| s >= e) {
                return Err(format!("global block range {s}..{e} is empty"));
            }
            Ok(pairs)
        }
    }
}

/// The `variable` layout of head `h` over `blocks` blocks.
pub(super) fn variable(c: &VariableConfig, h: usize, blocks: usize) -> Result<BlockLayout, String> {
    let uni = c.attention == Direction::Unidirectional;
    if c.horizontal_global_attention && uni {
        return Err("horizontal_global_attention needs bidirectional attention".into());
    }
    if c.local_window_blocks.is_empty() || c.local_window_blocks.contains(&0) {
        return Err(format!(
            "local_window_blocks {:?} needs at least one window, none empty",
            c.local_window_blocks
        ));
    }
    if c.num_random_blocks > blocks {
        return Err(format!(
            "num_random_blocks {} exceeds the {blocks} blocks of a row",
            c.num_random_blocks
        ));
    }
    let ranges = global_ranges(
        &c.global_block_indices,
        c.global_block_end_indices.as_deref(),
    )?;
    let mut layout = BlockLayout::empty(blocks);
    // DeepSpeed samples variable's random blocks from the whole row, whatever the direction.
    random_blocks(&mut layout, c.num_random_blocks, false, h);
    let last = *c.local_window_blocks.last().expect("checked above");
    let mut windows = c
        .local_window_blocks
        .iter()
        .copied()
        .chain(std::iter::repeat(last));
    let mut start = 0;
    while start < blocks {
        let end = (start + windows.next().expect("endless")).min(blocks);
        for row in start..end {
            for col in start..if uni { row + 1 } else { end } {
                layout.set(row, col);
            }
        }
        start = end;
    }
    for (start, end) in ranges.into_iter().filter(|(s, _)| *s < blocks) {
        let end = end.min(blocks);
        for g in start..end {
            if c.horizontal_global_attention {
                for col in 0..blocks {
                    layout.set(g, col);
                }
            }
            for row in if uni { start } else { 0 }..blocks {
                layout.set(row, g);
            }
        }
    }
    Ok(layout)
}

/// The `bslongformer` layout of `blocks` blocks.
pub(super) fn bs_longformer(c: &BsLongformerConfig, blocks: usize) -> Result<BlockLayout, String> {
    if c.num_sliding_window_blocks > blocks {
        return Err(format!(
            "num_sliding_window_blocks {} exceeds the {blocks} blocks of a row",
            c.num_sliding_window_blocks
        ));
    }
    let ranges = global_ranges(
        &c.global_block_indices,
        c.global_block_end_indices.as_deref(),
    )?;
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
        layout.keep_lower();
    }
    Ok(layout)
}
