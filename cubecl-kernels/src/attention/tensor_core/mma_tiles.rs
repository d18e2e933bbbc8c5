//! The pieces the register-resident (m16n8k16 `mma`) kernels share: rows copied into a
//! row-major tile (asynchronously where aligned), a plane's 16 × `cols` product of two
//! row-major tiles, the accumulation of a 16 × `cols` register tile times a row-major tile, and
//! the write of an accumulator. Fragments come from shared memory by `ldmatrix` (four 8 × 8
//! matrices per instruction, transposed on the way where the product reads a tile's columns),
//! so no tile is ever stored transposed.
//!
//! Fragment layouts (PTX's, which cubecl passes through in register order), for unit `lane` of
//! a plane, `g = lane / 4`, `t = lane % 4`:
//! - A (16 × 16): `[row g, k 2t..2t+1]`, `[row g+8, k 2t..2t+1]`, `[row g, k 2t+8..]`,
//!   `[row g+8, k 2t+8..]`;
//! - B (16 × 8, k × n): `[k 2t..2t+1, n g]`, `[k 2t+8..2t+9, n g]`;
//! - C (16 × 8): `[row g, n 2t..2t+1]`, `[row g+8, n 2t..2t+1]` (f32).
//!
//! So the C fragments `2j` and `2j + 1` (columns `16j ..`) of a 16 × 64 score tile, rounded to
//! the element type, are exactly the A fragment of the next product's k-step `j`. An
//! `ldmatrix` lane `lane` points at row `lane % 8` of matrix `lane / 8`; thread `(g, t)` receives
//! row `g`, columns `2t, 2t + 1` of each matrix (of its transpose with `.trans`).

use cubecl::cmma::MmaDefinition;
use cubecl::ir::MatrixIdent;
use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

use super::tiles::{KEYS, PLANE, UNITS, load_rows, store_rows, tile_registers};

/// Two elements: a 32-bit register of an A or B fragment, or two f32 of a C fragment.
pub(crate) type Two = Const<2>;

/// `s = A·Bᵀ` for this unit's plane: A is the `16·blocks` rows from element `a_at` of `tile`, B
/// the `cols` rows from element `b_at` (both row-major over `head_dim`, row stride `stride`);
/// `s` holds, for each block of 16 rows, the `cols / 8` C fragments of its 16 × `cols` result
/// (`s[b·cols/4 + 2j]`, `s[b·cols/4 + 2j + 1]` for columns `8j ..` of block `b`). A's fragments
/// of two k-steps are read once for all of B's, and each of B's `ldmatrix.x4` (two k-steps of
/// 8 rows) serves every block: with two blocks, half the B loads per product.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_nt<F: Float>(
    tile: &SharedMemory<F>,
    a_at: usize,
    b_at: usize,
    s: &mut Array<Vector<f32, Two>>,
    #[comptime] blocks: usize,
    #[comptime] cols: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let lane = UNIT_POS as usize % PLANE;
    let m = lane / 8;
    let r = lane % 8;
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let zero = Vector::<f32, Two>::new(0.0);
    let frags = comptime!(cols / 8);
    let per_block = comptime!(cols / 4);
    let dk = comptime!(head_dim / 16);
    #[unroll]
    for i in 0..blocks * per_block {
        s[i] = zero;
    }
    // Both k-steps' A fragments of every block, and the two handed to one product.
    let mut a0s = Array::<Vector<F, Two>>::new(comptime!(4 * blocks));
    let mut a1s = Array::<Vector<F, Two>>::new(comptime!(4 * blocks));
    let mut a0 = Array::<Vector<F, Two>>::new(4usize);
    let mut a1 = Array::<Vector<F, Two>>::new(4usize);
    let mut bf = Array::<Vector<F, Two>>::new(2usize);
    let mut c = Array::<Vector<f32, Two>>::new(2usize);
    // A's matrix `m`: rows `(m % 2)·8 ..`, columns `16kk + (m / 2)·8 ..`; B's: rows `8j ..`,
    // columns `32·pair + 8m ..` (x2: `16kk + (m % 2)·8 ..`).
    let a_lane = a_at + ((m % 2) * 8 + r) * stride + (m / 2) * 8;
    let b_lane = b_at + r * stride + m * 8;
    let b_last = b_at + r * stride + (m % 2) * 8 + comptime!((head_dim / 16 - 1) * 16);
    #[unroll]
    for pair in 0..dk / 2 {
        #[unroll]
        for rb in 0..blocks {
            let at0 = a_lane + rb * 16 * stride + pair * 32;
            let at1 = at0 + 16;
            let r0 =
                mma.load_matrix::<F, Two>(&tile.slice(at0, at0 + 8), MatrixIdent::A, 4usize, false);
            let r1 =
                mma.load_matrix::<F, Two>(&tile.slice(at1, at1 + 8), MatrixIdent::A, 4usize, false);
            #[unroll]
            for i in 0..4usize {
                a0s[rb * 4 + i] = r0[i];
                a1s[rb * 4 + i] = r1[i];
            }
        }
        #[unroll]
        for j in 0..frags {
            let at = b_lane + j * 8 * stride + pair * 32;
            let regs =
                mma.load_matrix::<F, Two>(&tile.slice(at, at + 8), MatrixIdent::B, 4usize, false);
            #[unroll]
            for rb in 0..blocks {
                #[unroll]
                for i in 0..4usize {
                    a0[i] = a0s[rb * 4 + i];
                    a1[i] = a1s[rb * 4 + i];
                }
                let si = rb * per_block + 2 * j;
                c[0usize] = s[si];
                c[1usize] = s[si + 1];
                bf[0usize] = regs[0usize];
                bf[1usize] = regs[1usize];
                let d = mma.execute(&a0, &bf, &c);
                bf[0usize] = regs[2usize];
                bf[1usize] = regs[3usize];
                let e = mma.execute(&a1, &bf, &d);
                s[si] = e[0usize];
                s[si + 1] = e[1usize];
            }
        }
    }
    if comptime!(dk % 2 == 1) {
        #[unroll]
        for rb in 0..blocks {
            let at = a_lane + rb * 16 * stride + comptime!((head_dim / 16 - 1) * 16);
            let r0 =
                mma.load_matrix::<F, Two>(&tile.slice(at, at + 8), MatrixIdent::A, 4usize, false);
            #[unroll]
            for i in 0..4usize {
                a0s[rb * 4 + i] = r0[i];
            }
        }
        #[unroll]
        for j in 0..frags {
            let at = b_last + j * 8 * stride;
            let regs =
                mma.load_matrix::<F, Two>(&tile.slice(at, at + 8), MatrixIdent::B, 2usize, false);
            bf[0usize] = regs[0usize];
            bf[1usize] = regs[1usize];
            #[unroll]
            for rb in 0..blocks {
                #[unroll]
                for i in 0..4usize {
                    a0[i] = a0s[rb * 4 + i];
                }
                let si = rb * per_block + 2 * j;
                c[0usize] = s[si];
                c[1usize] = s[si + 1];
                let d = mma.execute(&a0, &bf, &c);
                s[si] = d[0usize];
                s[si + 1] = d[1usize];
            }
        }
    }
}

/// `acc += P·B` for this unit's plane: `P` the `16·blocks` × `cols` f32 register tile `p` (C
/// fragments as [`product_nt`] leaves them, block by block), rounded to `F`; `B` the `cols` rows
/// from element `b_at` of `tile` (row-major over `head_dim`, row stride `stride`), read
/// transposed by `ldmatrix.x4.trans`, two 8-column blocks per instruction, each serving every
/// block of rows; `acc` the `head_dim / 8` C fragments of each block's 16 × `head_dim` result
/// (`acc[b·head_dim/4 + 2n]`, `acc[b·head_dim/4 + 2n + 1]`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate_pv<F: Float>(
    p: &Array<Vector<f32, Two>>,
    tile: &SharedMemory<F>,
    b_at: usize,
    acc: &mut Array<Vector<f32, Two>>,
    #[comptime] blocks: usize,
    #[comptime] cols: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let lane = UNIT_POS as usize % PLANE;
    let m = lane / 8;
    let r = lane % 8;
    let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let mut held = Array::<Vector<F, Two>>::new(comptime!(4 * blocks));
    let mut a = Array::<Vector<F, Two>>::new(4usize);
    let mut bf = Array::<Vector<F, Two>>::new(2usize);
    let mut c = Array::<Vector<f32, Two>>::new(2usize);
    let dn = comptime!(head_dim / 8);
    let steps = comptime!(cols / 16);
    let p_block = comptime!(cols / 4);
    let acc_block = comptime!(head_dim / 4);
    // Matrix `m`: rows `16kk + (m % 2)·8 ..`, columns `16·pair + (m / 2)·8 ..`.
    let b_lane = b_at + ((m % 2) * 8 + r) * stride + (m / 2) * 8;
    #[unroll]
    for kk in 0..steps {
        #[unroll]
        for rb in 0..blocks {
            #[unroll]
            for i in 0..4usize {
                held[rb * 4 + i] = Vector::<F, Two>::cast_from(p[rb * p_block + 4 * kk + i]);
            }
        }
        #[unroll]
        for pair in 0..dn / 2 {
            let at = b_lane + kk * 16 * stride + pair * 16;
            let regs =
                mma.load_matrix::<F, Two>(&tile.slice(at, at + 8), MatrixIdent::B, 4usize, true);
            #[unroll]
            for half in 0..2usize {
                let n = 2 * pair + half;
                bf[0usize] = regs[2 * half];
                bf[1usize] = regs[2 * half + 1];
                #[unroll]
                for rb in 0..blocks {
                    #[unroll]
                    for i in 0..4usize {
                        a[i] = held[rb * 4 + i];
                    }
                    let ci = rb * acc_block + 2 * n;
                    c[0usize] = acc[ci];
                    c[1usize] = acc[ci + 1];
                    let d = mma.execute(&a, &bf, &c);
                    acc[ci] = d[0usize];
                    acc[ci + 1] = d[1usize];
                }
            }
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
    if comptime!(n == 8) {
        let rs = t.stride(2);
        let per_row = comptime!(head_dim / 8);
        let per_unit = comptime!(KEYS * per_row / UNITS);
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
        let mut held = tile_registers::<F, N>(tv, KEYS, head_dim);
        load_rows::<F, N>(t, tv, at, first, seq, &mut held, KEYS, head_dim);
        store_rows::<F, N>(&held, tile, to, KEYS, head_dim, stride);
    }
}

/// [`copy_rows`] of the same rows `first ..` of K (from `k_at`) and V (from `v_at`) into a
/// K tile at element `to` of `tile` and the V tile right after it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_kv_rows<F: Float, N: Size>(
    k: &Tensor<F>,
    k_vectors: &Tensor<Vector<F, N>>,
    k_at: usize,
    v: &Tensor<F>,
    v_vectors: &Tensor<Vector<F, N>>,
    v_at: usize,
    first: usize,
    seq: usize,
    tile: &mut SharedMemory<F>,
    to: usize,
    #[comptime] len: usize,
    #[comptime] head_dim: usize,
) {
    let stride = comptime!(head_dim + 8);
    let next = comptime!(KEYS * (head_dim + 8));
    copy_rows::<F, N>(
        k, k_vectors, k_at, first, seq, tile, to, len, head_dim, stride,
    );
    copy_rows::<F, N>(
        v,
        v_vectors,
        v_at,
        first,
        seq,
        tile,
        to + next,
        len,
        head_dim,
        stride,
    );
}
