//! The pieces the register-resident (m16n8k16 `mma`) kernels share: a tile staged transposed,
//! a plane's 16 × 64 product of two row-major tiles, and the accumulation of a 16 × 64
//! register tile times a transposed one.
//!
//! Fragment layouts (PTX's, which cubecl passes through in register order), for unit `lane` of
//! a plane, `g = lane / 4`, `t = lane % 4`:
//! - A (16 × 16): `[row g, k 2t..2t+1]`, `[row g+8, k 2t..2t+1]`, `[row g, k 2t+8..]`,
//!   `[row g+8, k 2t+8..]`;
//! - B (16 × 8, k × n): `[k 2t..2t+1, n g]`, `[k 2t+8..2t+9, n g]`;
//! - C (16 × 8): `[row g, n 2t..2t+1]`, `[row g+8, n 2t..2t+1]` (f32).
//!
//! So the C fragments `2j` and `2j + 1` (columns `16j ..`) of a 16 × 64 score tile, rounded to
//! the element type, are exactly the A fragment of the next product's k-step `j`.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

use super::tiles::{KEYS, PLANE, UNITS, tile_registers};

/// Two elements: a 32-bit register of an A or B fragment, or two f32 of a C fragment.
pub(crate) type Two = Const<2>;

/// Stages rows `first..first + KEYS` of the slab at `at` of `t` transposed in `tile`
/// (`[head_dim][KEYS + 8]`), zeros past `seq`. Neighbouring units take neighbouring rows of
/// the same columns, so that a plane's stores of one column fill consecutive addresses (one
/// wavefront; taking a row's vectors instead, as `load_rows` does, put 16 units on one bank).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_transposed<F: Float, N: Size>(
    t: &Tensor<F>,
    tv: &Tensor<Vector<F, N>>,
    at: usize,
    first: usize,
    seq: usize,
    tile: &mut SharedMemory<F>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let mut held = tile_registers::<F, N>(tv, KEYS, head_dim);
    let (rs, es) = (t.stride(2), t.stride(3));
    let n = tv.vector_size();
    let per_row = comptime!(head_dim / n);
    let per_unit = comptime!(KEYS * per_row / UNITS);
    #[unroll]
    for i in 0..per_unit {
        let e = i * UNITS + UNIT_POS as usize;
        let row = first + e % KEYS;
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if row < seq {
            value = tv[(at + row * rs + (e / KEYS) * n * es) / n];
        }
        held[i] = value;
    }
    #[unroll]
    for i in 0..per_unit {
        let e = i * UNITS + UNIT_POS as usize;
        let key = e % KEYS;
        let d = (e / KEYS) * n;
        let value = held[i];
        #[unroll]
        for c in 0..n {
            tile[(d + c) * stride + key] = value[c];
        }
    }
}

/// `s = A·Bᵀ` for this unit's plane: A is rows `a_row .. a_row + 16` of `a_tile`, B rows
/// `b_row .. b_row + cols` of `b_tile` (both row-major over `head_dim`, row stride `stride`,
/// `a_len` and `b_len` elements long); `s` holds the `cols / 8` C fragments of the 16 × `cols`
/// result (`s[2j]`, `s[2j + 1]` for columns `8j ..`). Each A fragment is read once and used
/// for all of them.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_nt<F: Float>(
    a_tile: &SharedMemory<F>,
    a_row: usize,
    b_tile: &SharedMemory<F>,
    b_row: usize,
    s: &mut Array<Vector<f32, Two>>,
    #[comptime] cols: usize,
    #[comptime] a_len: usize,
    #[comptime] b_len: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let lane = UNIT_POS as usize % PLANE;
    let g = lane / 4;
    let t = lane % 4;
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let ap = a_tile
        .slice(0usize, a_len)
        .into_vectorized()
        .with_vector_size::<Two>();
    let bp = b_tile
        .slice(0usize, b_len)
        .into_vectorized()
        .with_vector_size::<Two>();
    let zero = Vector::<f32, Two>::new(0.0);
    let frags = comptime!(cols / 8);
    #[unroll]
    for i in 0..frags * 2 {
        s[i] = zero;
    }
    let mut a = Array::<Vector<F, Two>>::new(4usize);
    let mut bf = Array::<Vector<F, Two>>::new(2usize);
    let mut c = Array::<Vector<f32, Two>>::new(2usize);
    // Indices in pairs, from one runtime base per operand plus constants (the rows' stride
    // is even): an index written `(x + c) / 2` costs an add, a shift and an address per load.
    let half = comptime!(stride / 2);
    let top = (a_row + g) * half + t;
    let bottom = top + comptime!(8 * half);
    let b_base = (b_row + g) * half + t;
    let dk = comptime!(head_dim / 16);
    #[unroll]
    for kk in 0..dk {
        a[0usize] = ap[top + kk * 8];
        a[1usize] = ap[bottom + kk * 8];
        a[2usize] = ap[top + kk * 8 + 4];
        a[3usize] = ap[bottom + kk * 8 + 4];
        #[unroll]
        for j in 0..frags {
            let b_at = b_base + j * 8 * half + kk * 8;
            bf[0usize] = bp[b_at];
            bf[1usize] = bp[b_at + 4];
            c[0usize] = s[2 * j];
            c[1usize] = s[2 * j + 1];
            let d = mma.execute(&a, &bf, &c);
            s[2 * j] = d[0usize];
            s[2 * j + 1] = d[1usize];
        }
    }
}

/// `acc += P·B` for this unit's plane: `P` the 16 × `cols` f32 register tile `p` (C
/// fragments as [`product_nt`] leaves them), rounded to `F`; `B` rows `col0 .. col0 + cols` of
/// the `KEYS × head_dim` matrix whose transpose `bt_tile` holds (`[head_dim][stride]`, `bt_len`
/// elements); `acc` the `head_dim / 8` C fragments of the 16 × `head_dim` result (`acc[2n]`,
/// `acc[2n + 1]`).
#[cube]
pub(crate) fn accumulate_pt<F: Float>(
    p: &Array<Vector<f32, Two>>,
    bt_tile: &SharedMemory<F>,
    col0: usize,
    acc: &mut Array<Vector<f32, Two>>,
    #[comptime] cols: usize,
    #[comptime] bt_len: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let lane = UNIT_POS as usize % PLANE;
    let g = lane / 4;
    let t = lane % 4;
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let bp = bt_tile
        .slice(0usize, bt_len)
        .into_vectorized()
        .with_vector_size::<Two>();
    let mut a = Array::<Vector<F, Two>>::new(4usize);
    let mut bf = Array::<Vector<F, Two>>::new(2usize);
    let mut c = Array::<Vector<f32, Two>>::new(2usize);
    let dn = comptime!(head_dim / 8);
    let steps = comptime!(cols / 16);
    // Indices in pairs from one base (see `product_nt`); `col0` is even.
    let half = comptime!(stride / 2);
    let base = g * half + col0 / 2 + t;
    #[unroll]
    for kk in 0..steps {
        a[0usize] = Vector::<F, Two>::cast_from(p[4 * kk]);
        a[1usize] = Vector::<F, Two>::cast_from(p[4 * kk + 1]);
        a[2usize] = Vector::<F, Two>::cast_from(p[4 * kk + 2]);
        a[3usize] = Vector::<F, Two>::cast_from(p[4 * kk + 3]);
        #[unroll]
        for n in 0..dn {
            let b_at = base + n * 8 * half + kk * 8;
            bf[0usize] = bp[b_at];
            bf[1usize] = bp[b_at + 4];
            c[0usize] = acc[2 * n];
            c[1usize] = acc[2 * n + 1];
            let d = mma.execute(&a, &bf, &c);
            acc[2 * n] = d[0usize];
            acc[2 * n + 1] = d[1usize];
        }
    }
}

/// Writes this unit's share of a plane's 16 × `head_dim` accumulator times `scale` to rows
/// `row0` and `row0 + 8` of the slab at `at` of `out` (rows from `seq` on are not written).
#[cube]
pub(crate) fn write_acc<O: Float>(
    acc: &Array<Vector<f32, Two>>,
    out: &mut Tensor<O>,
    at: usize,
    row0: usize,
    seq: usize,
    scale: f32,
    #[comptime] head_dim: usize,
) {
    let lane = UNIT_POS as usize % PLANE;
    let t = lane % 4;
    let (rs, es) = (out.stride(2), out.stride(3));
    let row1 = row0 + 8;
    let dn = comptime!(head_dim / 8);
    #[unroll]
    for n in 0..dn {
        let col = n * 8 + 2 * t;
        if row0 < seq {
            let to = at + row0 * rs + col * es;
            let value = acc[2 * n];
            out[to] = O::cast_from(value[0usize] * scale);
            out[to + es] = O::cast_from(value[1usize] * scale);
        }
        if row1 < seq {
            let to = at + row1 * rs + col * es;
            let value = acc[2 * n + 1];
            out[to] = O::cast_from(value[0usize] * scale);
            out[to + es] = O::cast_from(value[1usize] * scale);
        }
    }
}

/// Copies rows `first..first + KEYS` of the slab at `at` of `t` row-major into `tile` from
/// element `to` (row stride `stride`), zeros past `seq`. Where the launch chose vectors of 8
/// (every row starts 16-byte aligned) each 16 bytes go by one asynchronous copy that lands
/// while the cube computes (the caller's barrier waits for them, `Barrier::commit_copy_async`);
/// otherwise through registers, visible after the caller's next barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_rows<F: Float, N: Size>(
    t: &Tensor<F>,
    tv: &Tensor<Vector<F, N>>,
    at: usize,
    first: usize,
    seq: usize,
    tile: &mut SharedMemory<F>,
    to: usize,
    #[comptime] len: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let n = tv.vector_size();
    let rs = t.stride(2);
    let es = t.stride(3);
    let per_row = comptime!(head_dim / n);
    let per_unit = comptime!(KEYS * per_row / UNITS);
    if comptime!(n == 8) {
        let mut vectors = tile
            .slice_mut(0, len)
            .into_vectorized()
            .with_vector_size::<N>();
        #[unroll]
        for i in 0..per_unit {
            let e = i * UNITS + UNIT_POS as usize;
            let row = e / per_row;
            let col = (e % per_row) * 8;
            let dst = to + row * stride + col;
            if first + row < seq {
                let src = at + (first + row) * rs + col;
                copy_async::<F>(
                    &t.slice(src, src + 8),
                    &mut tile.slice_mut(dst, dst + 8),
                    8u32,
                );
            } else {
                vectors[dst / 8] = Vector::new(F::new(0.0));
            }
        }
    } else {
        #[unroll]
        for i in 0..per_unit {
            let e = i * UNITS + UNIT_POS as usize;
            let row = e / per_row;
            let col = (e % per_row) * n;
            let mut value = Vector::<F, N>::new(F::new(0.0));
            if first + row < seq {
                value = tv[(at + (first + row) * rs + col * es) / n];
            }
            #[unroll]
            for c in 0..n {
                tile[to + row * stride + col + c] = value[c];
            }
        }
    }
}
