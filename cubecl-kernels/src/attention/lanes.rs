//! Rows split over lanes: a row's head dimension is held by `lanes` neighbouring units of a
//! plane, `width` elements each (zero past the head dimension), so that a unit keeps a few
//! short arrays in registers whatever the head dimension. Dot products are summed across the
//! lanes with xor shuffles: every unit of a plane must reach them (no divergent branch
//! around a call).

use cubecl::prelude::*;

/// `Σ_e x[e]·tile[at + e]` over the row's `lanes` units (every lane gets the whole sum).
#[cube]
pub(crate) fn lane_dot(
    x: &Array<f32>,
    tile: &SharedMemory<f32>,
    at: usize,
    #[comptime] width: usize,
    #[comptime] lanes: usize,
) -> f32 {
    let mut s = 0.0f32;
    #[unroll]
    for e in 0..width {
        s += x[e] * tile[at + e];
    }
    lane_sum(s, lanes)
}

/// `s` summed over the `lanes` (a power of two, at most 16) units of a row.
#[cube]
pub(crate) fn lane_sum(s: f32, #[comptime] lanes: usize) -> f32 {
    let mut s = s;
    if comptime!(lanes > 1) {
        s += plane_shuffle_xor(s, 1);
    }
    if comptime!(lanes > 2) {
        s += plane_shuffle_xor(s, 2);
    }
    if comptime!(lanes > 4) {
        s += plane_shuffle_xor(s, 4);
    }
    if comptime!(lanes > 8) {
        s += plane_shuffle_xor(s, 8);
    }
    s
}

/// Loads this lane's slice of row `at` (element stride `stride`) of a tensor, times `scale`,
/// into `x`; zeros past `head_dim` or when the row is not `live`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_slice<F: Float>(
    t: &Tensor<F>,
    at: usize,
    stride: usize,
    lane: usize,
    live: bool,
    scale: f32,
    x: &mut Array<f32>,
    #[comptime] width: usize,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for e in 0..width {
        let d = lane * width + e;
        let mut value = 0.0f32;
        if live && d < head_dim {
            value = f32::cast_from(t[at + d * stride]) * scale;
        }
        x[e] = value;
    }
}

/// Writes this lane's slice of `x` (times `scale`) to row `at` of `t` if the row is `live`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_slice<F: Float>(
    t: &mut Tensor<F>,
    at: usize,
    stride: usize,
    lane: usize,
    live: bool,
    scale: f32,
    x: &Array<f32>,
    #[comptime] width: usize,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for e in 0..width {
        let d = lane * width + e;
        if live && d < head_dim {
            t[at + d * stride] = F::cast_from(x[e] * scale);
        }
    }
}

/// Stages rows `first..first + count` of a `[.., seq, head_dim]` tensor slab (row stride
/// `row_stride`, element stride `stride`, from `at`) in `tile` as f32 times `scale`, zeros
/// past `seq`; all `units` units of the cube take part.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float>(
    t: &Tensor<F>,
    at: usize,
    row_stride: usize,
    stride: usize,
    first: usize,
    seq: usize,
    scale: f32,
    tile: &mut SharedMemory<f32>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
) {
    let mut e = UNIT_POS_X as usize;
    while e < count * head_dim {
        let row = first + e / head_dim;
        let d = e % head_dim;
        let mut value = 0.0f32;
        if row < seq {
            value = f32::cast_from(t[at + row * row_stride + d * stride]) * scale;
        }
        tile[e] = value;
        e += units;
    }
}

/// The last index of `first..first + count` within `0..len` (`first < len`).
#[cube]
pub(crate) fn last_of(first: usize, count: usize, len: usize) -> usize {
    let mut last = len - 1;
    if first + count < len {
        last = first + count - 1;
    }
    last
}

/// Stages rows `start..start + count` of K and V (at `k_at`, `v_at` of their head) in the two
/// tiles, as f32, zeros past `seq`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_kv<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_at: usize,
    v_at: usize,
    start: usize,
    seq: usize,
    k_tile: &mut SharedMemory<f32>,
    v_tile: &mut SharedMemory<f32>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
) {
    let (ks, kd) = (k.stride(2), k.stride(3));
    let (vs, vd) = (v.stride(2), v.stride(3));
    stage_rows::<F>(
        k, k_at, ks, kd, start, seq, 1.0, k_tile, count, head_dim, units,
    );
    stage_rows::<F>(
        v, v_at, vs, vd, start, seq, 1.0, v_tile, count, head_dim, units,
    );
}
