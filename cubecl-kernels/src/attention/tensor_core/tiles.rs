//! Shared-memory tiles and 16×16×16 tensor-core fragments of the tensor-core kernels.
//!
//! A cube is four planes of 32 units; each plane owns 16 rows of the cube's 64. Element tiles
//! (`F`) are padded to a row stride of `head_dim + 8` and score tiles (f32) to `KEYS + 4`,
//! which keeps every fragment's first element 32-byte aligned (fragments start at rows that
//! are multiples of 16) and spreads rows over the shared-memory banks.
//!
//! Row-wise work (softmax, masks, scaling) is done by plain units on f32 tiles a fragment was
//! stored to: unit `lane` of a plane takes row `lane / 2`, every other column from `lane % 2`,
//! in the order of [`column`] (so that the plane's 32 units meet 32 banks of shared memory).

use cubecl::prelude::*;

use super::super::lanes::last_of;
use super::super::sparse::tile_kept;

/// Rows (query rows, or key rows in `dkdv`) per cube: 16 per plane.
pub(crate) const ROWS: usize = 64;
/// Keys (or query rows in `dkdv`) per shared tile.
pub(crate) const KEYS: usize = 64;
/// Planes per cube.
pub(crate) const PLANES: usize = 4;
/// Units per plane (CUDA's warp).
pub(crate) const PLANE: usize = 32;
/// Units per cube.
pub(crate) const UNITS: usize = PLANES * PLANE;
/// Row stride of f32 score tiles.
pub(crate) const SS: usize = KEYS + 4;
/// Row stride of element probability tiles.
pub(crate) const PS: usize = KEYS + 8;
/// Alignment of the shared tiles, in bytes (the tensor-core loads' requirement).
pub(crate) const ALIGN: usize = 32;
/// Columns of a score tile one unit takes (half a row).
pub(crate) const HALF: usize = KEYS / 2;
/// Side of a fragment.
pub(crate) const T: usize = 16;

/// Row stride of element tiles of `head_dim` columns.
pub(crate) const fn padded(head_dim: usize) -> usize {
    head_dim + 8
}

/// Stages rows `first..first + count` of the `[.., seq, head_dim]` slab at `at` of `t` in
/// `tile` (row stride `stride`), zeros past `seq`; every unit of the cube takes part: a
/// [`load_rows`] into [`tile_registers`] then a [`store_rows`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage<F: Float, N: Size>(
    t: &Tensor<F>,
    tv: &Tensor<Vector<F, N>>,
    at: usize,
    first: usize,
    seq: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let mut held = tile_registers::<F, N>(tv, count, head_dim);
    load_rows::<F, N>(t, tv, at, first, seq, &mut held, count, head_dim);
    store_rows::<F, N>(&held, tile, 0usize, count, head_dim, stride);
}

/// [`stage`]s the same `count` rows from `first` of two slabs (K and V, or Q and dO: `a` at
/// `a_at`, `b` at `b_at`) in `a_tile` and `b_tile`, then waits for the whole cube.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_pair<F: Float, N: Size>(
    a: &Tensor<F>,
    a_vectors: &Tensor<Vector<F, N>>,
    a_at: usize,
    b: &Tensor<F>,
    b_vectors: &Tensor<Vector<F, N>>,
    b_at: usize,
    first: usize,
    seq: usize,
    a_tile: &mut SharedMemory<F>,
    b_tile: &mut SharedMemory<F>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    stage::<F, N>(
        a, a_vectors, a_at, first, seq, a_tile, count, head_dim, stride,
    );
    stage::<F, N>(
        b, b_vectors, b_at, first, seq, b_tile, count, head_dim, stride,
    );
    sync_cube();
}

/// This unit's registers for its share of a `count × head_dim` tile in vectors of `N`.
#[cube]
pub(crate) fn tile_registers<F: Float, N: Size>(
    tv: &Tensor<Vector<F, N>>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
) -> Array<Vector<F, N>> {
    let n = tv.vector_size();
    let per_unit = comptime!(count * head_dim / UNITS / n);
    Array::<Vector<F, N>>::new(per_unit)
}

/// Loads this unit's share of rows `first..first + count` of the slab at `at` of `t` (zeros
/// past `seq`) into `held` ([`tile_registers`]). The loads go through `tv`, the same memory in
/// vectors of `N` (the launch picks `N > 1` only where the head dimension is contiguous and
/// every row starts on a vector). Nothing waits for them until `held` is read, so a kernel
/// loads its next tile here before working on the current one.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_rows<F: Float, N: Size>(
    t: &Tensor<F>,
    tv: &Tensor<Vector<F, N>>,
    at: usize,
    first: usize,
    seq: usize,
    held: &mut Array<Vector<F, N>>,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
) {
    let (rs, es) = (t.stride(2), t.stride(3));
    let n = tv.vector_size();
    let per_row = comptime!(head_dim / n);
    let per_unit = comptime!(count * per_row / UNITS);
    #[unroll]
    for i in 0..per_unit {
        let e = i * UNITS + UNIT_POS as usize;
        let row = first + e / per_row;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if row < seq {
            value = tv[(at + row * rs + (e % per_row) * n * es) / n];
        }
        held[i] = value;
    }
}

/// Stores what [`load_rows`] put in `held` to `tile` from element `to` (a multiple of the
/// vector size; row stride `stride`).
#[cube]
pub(crate) fn store_rows<F: Float, N: Size>(
    held: &Array<Vector<F, N>>,
    tile: &mut SharedMemory<F>,
    to: usize,
    #[comptime] count: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let n = held.vector_size();
    let per_row = comptime!(head_dim / n);
    let per_unit = comptime!(count * per_row / UNITS);
    // One store per vector: rows start on vectors (`stride` is a multiple of 8, and so is the
    // tile's alignment in elements).
    let mut vectors = tile
        .slice_mut(to, to + count * stride)
        .into_vectorized()
        .with_vector_size::<N>();
    #[unroll]
    for i in 0..per_unit {
        let e = i * UNITS + UNIT_POS as usize;
        let to = (e / per_row) * stride + (e % per_row) * n;
        vectors[to / n] = held[i];
    }
}

/// Where unit `lane`'s walk over its half row starts ([`column`]): its parity `lane % 2`, two
/// columns further in the plane's rows 8..15 (`lane ≥ 16`).
#[cube]
pub(crate) fn column_shift(lane: usize) -> usize {
    lane % 2usize + 2 * (lane / 16usize)
}

/// Column `j` (of [`HALF`]) of a unit's walk over every other column of its row, from `shift`
/// ([`column_shift`]), wrapping. Rows 8 apart of an f32 tile of stride [`SS`] (or an element
/// tile of stride [`PS`]) fall on the same banks; the two-column offset of rows 8..15 puts the
/// plane's 32 units on 32 different banks at every `j` (without it, two units met per bank).
#[cube]
pub(crate) fn column(j: usize, shift: usize) -> usize {
    (2 * j + shift) % KEYS
}

/// Stages `count` per-row f32 values (`lse`, `delta`) of rows `first..` from `at` (row
/// stride `t.stride(2)`) in `tile` from element `to`, zeros past `seq`.
#[cube]
pub(crate) fn stage_stat(
    t: &Tensor<f32>,
    at: usize,
    first: usize,
    seq: usize,
    tile: &mut SharedMemory<f32>,
    to: usize,
    #[comptime] count: usize,
) {
    let e = UNIT_POS as usize;
    if e < count {
        let mut value = 0.0f32;
        if first + e < seq {
            value = t[at + (first + e) * t.stride(2)];
        }
        tile[to + e] = value;
    }
}

/// The 16×16 block at `at` of a row-major tile of row stride `stride`, as fragment `ident`
/// read in `layout` (column-major reads the block transposed).
#[cube]
fn fragment<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] layout: cmma::MatrixLayout,
    #[comptime] stride: usize,
) -> cmma::Matrix<F> {
    let end = at + (T - 1) * stride + T;
    cmma::Matrix::<F>::from_slice(ident, T, T, T, layout, &tile.slice(at, end), stride as u32)
}

/// The 16×16 A fragment at `at` of a row-major tile of row stride `stride`.
#[cube]
pub(crate) fn frag_a<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] stride: usize,
) -> cmma::Matrix<F> {
    fragment::<F>(
        tile,
        at,
        cmma::MatrixIdent::A,
        cmma::MatrixLayout::RowMajor,
        stride,
    )
}

/// The 16×16 B fragment at `at` of a row-major tile (rows are the reduced dimension).
#[cube]
pub(crate) fn frag_b<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] stride: usize,
) -> cmma::Matrix<F> {
    fragment::<F>(
        tile,
        at,
        cmma::MatrixIdent::B,
        cmma::MatrixLayout::RowMajor,
        stride,
    )
}

/// The transpose of the 16×16 block at `at` of a row-major tile, as a B fragment: rows of
/// the tile (keys) become its columns, as `Kᵀ` in `Q·Kᵀ`.
#[cube]
pub(crate) fn frag_b_transposed<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] stride: usize,
) -> cmma::Matrix<F> {
    fragment::<F>(
        tile,
        at,
        cmma::MatrixIdent::B,
        cmma::MatrixLayout::ColMajor,
        stride,
    )
}

/// A zero 16×16 f32 accumulator.
#[cube]
pub(crate) fn zero_acc() -> cmma::Matrix<f32> {
    cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        T,
        T,
        T,
        cmma::MatrixLayout::Undefined,
        0.0,
    )
}

/// `dt` zero accumulators (a 16 × `16·dt` block).
#[cube]
pub(crate) fn zero_accs(#[comptime] dt: usize) -> Sequence<cmma::Matrix<f32>> {
    let mut accs = Sequence::new();
    #[unroll]
    for _ in 0..dt {
        accs.push(zero_acc());
    }
    accs
}

/// The plane's 16 rows of a row-major element tile (`at`, stride `stride`, `16·dt` wide) as
/// `dt` A fragments, to keep in registers.
#[cube]
pub(crate) fn frags_a<F: Float>(
    tile: &SharedMemory<F>,
    at: usize,
    #[comptime] dt: usize,
    #[comptime] stride: usize,
) -> Sequence<cmma::Matrix<F>> {
    let mut frags = Sequence::new();
    #[unroll]
    for kk in 0..dt {
        frags.push(frag_a::<F>(tile, at + kk * T, stride));
    }
    frags
}

/// As [`scores_of`] with `a` already in fragments ([`frags_a`]).
#[cube]
pub(crate) fn scores_of_frags<F: Float>(
    a: &Sequence<cmma::Matrix<F>>,
    b: &SharedMemory<F>,
    scores: &mut SharedMemory<f32>,
    plane: usize,
    #[comptime] dt: usize,
    #[comptime] stride: usize,
) {
    #[unroll]
    for c in 0..KEYS / T {
        let acc = zero_acc();
        #[unroll]
        for kk in 0..dt {
            let bf = frag_b_transposed::<F>(b, c * T * stride + kk * T, stride);
            cmma::execute::<F, F, f32, f32>(a.index(kk), &bf, &acc, &acc);
        }
        store_scores(&acc, scores, plane, c);
    }
}

/// Stores score block `c` (16 × 16) of the plane's rows.
#[cube]
fn store_scores(
    acc: &cmma::Matrix<f32>,
    scores: &mut SharedMemory<f32>,
    plane: usize,
    #[comptime] c: usize,
) {
    let at = plane * T * SS + c * T;
    cmma::store(
        &mut scores.slice_mut(at, at + (T - 1) * SS + T),
        acc,
        SS as u32,
        cmma::MatrixLayout::RowMajor,
    );
}

/// Stores the plane's 16 × `KEYS` product `a·bᵀ` to its rows of `scores` (row stride [`SS`]):
/// `a` is the plane's 16 rows of a row-major element tile (`a_at`, stride `stride`), `b` the
/// `KEYS` rows of another (both `16·dt` wide). This is `Q·Kᵀ`, `dO·Vᵀ`, `K·Qᵀ` or `V·dOᵀ`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn scores_of<F: Float>(
    a: &SharedMemory<F>,
    a_at: usize,
    b: &SharedMemory<F>,
    scores: &mut SharedMemory<f32>,
    plane: usize,
    #[comptime] dt: usize,
    #[comptime] stride: usize,
) {
    #[unroll]
    for c in 0..KEYS / T {
        let acc = zero_acc();
        #[unroll]
        for kk in 0..dt {
            let af = frag_a::<F>(a, a_at + kk * T, stride);
            let bf = frag_b_transposed::<F>(b, c * T * stride + kk * T, stride);
            cmma::execute::<F, F, f32, f32>(&af, &bf, &acc, &acc);
        }
        store_scores(&acc, scores, plane, c);
    }
}

/// `accs += p·m`: `p` the plane's 16 × `KEYS` rows of a probability tile (row stride [`PS`]),
/// `m` a `KEYS × 16·dt` element tile.
#[cube]
pub(crate) fn accumulate<F: Float>(
    accs: &Sequence<cmma::Matrix<f32>>,
    p: &SharedMemory<F>,
    m: &SharedMemory<F>,
    plane: usize,
    #[comptime] dt: usize,
    #[comptime] stride: usize,
) {
    #[unroll]
    for kk in 0..KEYS / T {
        let pf = frag_a::<F>(p, plane * T * PS + kk * T, PS);
        #[unroll]
        for dd in 0..dt {
            let mf = frag_b::<F>(m, kk * T * stride + dd * T, stride);
            cmma::execute::<F, F, f32, f32>(&pf, &mf, accs.index(dd), accs.index(dd));
        }
    }
}

/// Multiplies row `lane / 2` of the plane's accumulators by `factor` (a per-row value each
/// unit holds for its row), through `bounce` (the plane's rows of an f32 tile, stride [`SS`]).
/// Every unit of the plane must call it.
#[cube]
pub(crate) fn scale_rows(
    accs: &Sequence<cmma::Matrix<f32>>,
    bounce: &mut SharedMemory<f32>,
    plane: usize,
    lane: usize,
    factor: f32,
    #[comptime] dt: usize,
) {
    let at = plane * T * SS;
    let mine = at + (lane / 2usize) * SS + (lane % 2usize) * 8usize;
    #[unroll]
    for dd in 0..dt {
        let acc = accs.index(dd);
        cmma::store(
            &mut bounce.slice_mut(at, at + (T - 1) * SS + T),
            acc,
            SS as u32,
            cmma::MatrixLayout::RowMajor,
        );
        sync_plane();
        #[unroll]
        for c in 0..8usize {
            bounce[mine + c] *= factor;
        }
        sync_plane();
        cmma::load_with_layout(
            acc,
            &bounce.slice(at, at + (T - 1) * SS + T),
            SS as u32,
            cmma::MatrixLayout::RowMajor,
        );
        sync_plane();
    }
}

/// Writes row `row` (this unit's, `lane / 2` of the plane) of the accumulators times `factor`
/// to the `[.., seq, head_dim]` slab at `at` of `t` if `live`, through `bounce` as
/// [`scale_rows`]. Every unit of the plane must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_rows<F: Float>(
    accs: &Sequence<cmma::Matrix<f32>>,
    bounce: &mut SharedMemory<f32>,
    t: &mut Tensor<F>,
    row_at: usize,
    live: bool,
    plane: usize,
    lane: usize,
    factor: f32,
    #[comptime] dt: usize,
) {
    let at = plane * T * SS;
    let half = lane % 2usize;
    let mine = at + (lane / 2usize) * SS + half * 8usize;
    let es = t.stride(3);
    #[unroll]
    for dd in 0..dt {
        cmma::store(
            &mut bounce.slice_mut(at, at + (T - 1) * SS + T),
            accs.index(dd),
            SS as u32,
            cmma::MatrixLayout::RowMajor,
        );
        sync_plane();
        if live {
            #[unroll]
            for c in 0..8usize {
                let d = dd * T + half * 8usize + c;
                t[row_at + d * es] = F::cast_from(bounce[mine + c] * factor);
            }
        }
        sync_plane();
    }
}

/// The first tile of `KEYS` rows from `from` (below `end`) that a block-sparse layout keeps
/// (dense: `from` itself). The walked tiles are key tiles against query rows `a..=a_last`, or
/// with `walk_queries` query tiles (of `len` rows) against keys `a..=a_last`. `end` if none.
#[cube]
#[allow(clippy::too_many_arguments, unused_assignments)]
pub(crate) fn next_tile(
    layout: &Tensor<u32>,
    h: usize,
    block: usize,
    a: usize,
    a_last: usize,
    from: usize,
    end: usize,
    len: usize,
    #[comptime] sparse: bool,
    #[comptime] walk_queries: bool,
) -> usize {
    let mut at = from;
    if sparse {
        let mut searching = true;
        while searching {
            if at >= end {
                searching = false;
            } else {
                let last = last_of(at, KEYS, len);
                let mut kept = false;
                if walk_queries {
                    kept = tile_kept(layout, h, block, at, last, a, a_last);
                } else {
                    kept = tile_kept(layout, h, block, a, a_last, at, last);
                }
                if kept {
                    searching = false;
                } else {
                    at += KEYS;
                }
            }
        }
    }
    at
}
