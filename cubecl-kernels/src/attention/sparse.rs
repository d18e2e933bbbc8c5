//! Block-layout lookups of the block-sparse kernels. `layout` is `[heads, blocks, blocks]`
//! (`u32`, nonzero where a `block × block` tile of the attention matrix is kept).

use cubecl::prelude::*;

/// Whether pair (`row`, `key`) of head `h` lies in a kept block.
#[cube]
pub(crate) fn block_kept(
    layout: &Tensor<u32>,
    h: usize,
    block: usize,
    row: usize,
    key: usize,
) -> bool {
    let blocks = layout.shape(1);
    layout[(h * blocks + row / block) * blocks + key / block] != 0
}

/// Whether any block of head `h` meeting rows `first_row..=last_row` and keys
/// `first_key..=last_key` is kept (the same answer in every unit: a tile is skipped or
/// computed by the whole cube).
#[cube]
pub(crate) fn tile_kept(
    layout: &Tensor<u32>,
    h: usize,
    block: usize,
    first_row: usize,
    last_row: usize,
    first_key: usize,
    last_key: usize,
) -> bool {
    let blocks = layout.shape(1);
    let mut kept = false;
    for rb in first_row / block..last_row / block + 1 {
        for kb in first_key / block..last_key / block + 1 {
            if layout[(h * blocks + rb) * blocks + kb] != 0 {
                kept = true;
            }
        }
    }
    kept
}
