//! FlashAttention-2's forward on tensor cores with the scores kept in registers: `Q·Kᵀ` and
//! `P·V` on m16n8k16 `mma` instructions (f16/bf16 in, f32 accumulators) whose fragments each
//! unit holds itself. A plane (warp) owns 32 query rows (two blocks of 16, as
//! FlashAttention-2's 128-row cubes of 4 warps), so every K and V fragment read from shared
//! memory serves two products; per tile of 64 keys (in two softmax steps of 32 above head
//! dim 64, which leaves room for two blocks' accumulators) its score fragments (16 × 8
//! each) are scaled, masked (on the tiles that hold a hidden key) and exponentiated where they are, row
//! maxima and sums come from two shuffles among the 4 units of a row, and the accumulators of
//! two neighbouring score fragments are exactly the A fragment of `P` for the next product
//! (rounded to the element type, as FlashAttention-2 does): no score or probability goes
//! through shared memory.
//!
//! K and V tiles are double-buffered: the next tile's rows go by asynchronous copies while
//! the cube computes on the current one, and one barrier per tile waits for them. Fragments
//! come from shared memory by `ldmatrix` (four 8 × 8 matrices per instruction; V's transposed
//! on the way); Q stays in shared memory, its fragments read again per tile (held in registers
//! they would leave too few for two blocks' accumulators at head dim 128). (Fragment layouts
//! in `mma_tiles`.)

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::barrier::Barrier;
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::mma_tiles::{Two, accumulate_pv, copy_kv_rows, copy_rows, product_nt};
    use super::super::tiles::{KEYS, PLANE};
    use super::{FORWARD_ROWS, PLANE_ROWS};

    /// As `tc_forward_kernel` (same arguments and results, dense only) with the scores in
    /// registers: elements of `F` (f16 or bf16), `head_dim` a multiple of 16 up to 128; cube
    /// `(x, y)`: query rows `128·x ..`, head `y = b·heads + h`; 128 units. Shared memory: Q's
    /// 128 rows (two tiles), then K and V of buffers 0 and 1, each `64 × (head_dim + 8)`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn mma_forward_kernel<F: Float, N: Size>(
        q: &Tensor<F>,
        q_vectors: &Tensor<Vector<F, N>>,
        k: &Tensor<F>,
        k_vectors: &Tensor<Vector<F, N>>,
        v: &Tensor<F>,
        v_vectors: &Tensor<Vector<F, N>>,
        out: &mut Tensor<F>,
        lse: &mut Tensor<f32>,
        scale: f32,
        #[comptime] causal: bool,
        #[comptime] head_dim: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        // Output fragments of 8 columns; blocks of 16 rows per plane; the register tiles'
        // entries per block (score: `step / 8` fragments of 8 keys, output: `head_dim / 8`).
        let dn = comptime!(head_dim / 8);
        let blocks = comptime!(PLANE_ROWS / 16);
        // Keys per softmax step: a whole tile up to head dim 64; at larger head dims two
        // steps of 32, so two blocks' output accumulators and scores nearly fit the registers
        // (at head dim 128 ptxas spills 64 bytes, against 12.5M spill requests under ncu with
        // whole tiles).
        let step = comptime!(if head_dim > 64 { KEYS / 2 } else { KEYS });
        let chunks = comptime!(KEYS / step);
        let frags = comptime!(step / 8);
        let s_block = comptime!(step / 4);
        let o_block = comptime!(head_dim / 4);
        // Row stride of the tiles (padded by 16 bytes: the 8 rows of an `ldmatrix` meet 32
        // banks), one tile's length, and the six tiles': Q's two, K and V of buffers 0 and 1.
        let ks = comptime!(head_dim + 8);
        let tile = comptime!(KEYS * (head_dim + 8));
        let all = comptime!(6 * KEYS * (head_dim + 8));
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let plane = UNIT_POS as usize / PLANE;
        let lane = UNIT_POS as usize % PLANE;
        let g = lane / 4;
        let t = lane % 4;
        let first_row = CUBE_POS_X as usize * FORWARD_ROWS;
        // This unit's rows: `row + 16·block + 8·half` for its 4 (block, half) pairs.
        let row = first_row + plane * PLANE_ROWS + g;

        // Q at 0 (128 rows), buffer `i`'s K tile at `(2 + 2i)·tile`, its V tile at
        // `(3 + 2i)·tile`.
        let mut kv = SharedMemory::<F>::new_aligned(all, 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        let q_at = b * q.stride(0) + h * q.stride(1);
        #[unroll]
        for half in 0..2usize {
            copy_rows::<F, N>(
                q,
                q_vectors,
                q_at,
                first_row + half * KEYS,
                seq_q,
                &mut kv,
                half * tile,
                all,
                head_dim,
                ks,
            );
        }
        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, FORWARD_ROWS, seq_k) + 1;
        }
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        copy_kv_rows::<F, N>(
            k,
            k_vectors,
            k_at,
            v,
            v_vectors,
            v_at,
            0usize,
            seq_k,
            &mut kv,
            comptime!(2 * tile),
            all,
            head_dim,
        );
        barrier.commit_copy_async();
        barrier.arrive_and_wait();

        let zero = Vector::<f32, Two>::new(0.0);
        let mut o = Array::<Vector<f32, Two>>::new(comptime!(blocks * head_dim / 4));
        #[unroll]
        for i in 0..blocks * o_block {
            o[i] = zero;
        }
        // Per (block, half) row: the running maximum (−∞ stands as −1e30 before any key;
        // every row sees key 0 in the first tile) and this unit's share of the sum.
        let mut mx = Array::<f32>::new(comptime!(2 * blocks));
        let mut sum = Array::<f32>::new(comptime!(2 * blocks));
        #[unroll]
        for i in 0..2 * blocks {
            mx[i] = -1.0e30;
            sum[i] = 0.0;
        }

        let mut s = Array::<Vector<f32, Two>>::new(comptime!(blocks * step / 4));
        let mut tile_max = Array::<f32>::new(comptime!(2 * blocks));
        let q_plane = plane * PLANE_ROWS * ks;
        let mut start = 0usize;
        let mut buffer = 0usize;
        while start < kv_end {
            // The next tile's copies go out before this one's products.
            let next = start + KEYS;
            if next < kv_end {
                let to = (4 - 2 * buffer) * tile;
                copy_kv_rows::<F, N>(
                    k, k_vectors, k_at, v, v_vectors, v_at, next, seq_k, &mut kv, to, all, head_dim,
                );
            }
            barrier.commit_copy_async();
            let k_first = (2 + 2 * buffer) * tile;

            // The tile in `chunks` steps of `step` keys, each a whole online-softmax step.
            let mut edge = start + KEYS > seq_k;
            if causal {
                edge = edge || start + KEYS > first_row + 1;
            }
            #[unroll]
            for chunk in 0..chunks {
                let first_key = chunk * step;
                // S = Q·Kᵀ for both blocks: `step / 8` fragments of 8 keys each.
                product_nt::<F>(
                    &kv,
                    q_plane,
                    k_first + first_key * ks,
                    &mut s,
                    blocks,
                    step,
                    head_dim,
                    ks,
                );

                // Scale; mask where the tile holds a hidden key (the last tile, the causal
                // diagonal: one branch for the whole cube); the rows' maxima over the step.
                #[unroll]
                for i in 0..blocks * s_block {
                    s[i] = s[i] * Vector::new(scale);
                }
                if edge {
                    #[unroll]
                    for rb in 0..blocks {
                        #[unroll]
                        for j in 0..frags {
                            let mut top = s[rb * s_block + 2 * j];
                            let mut bottom = s[rb * s_block + 2 * j + 1];
                            let row0 = row + rb * 16;
                            #[unroll]
                            for e in 0..2usize {
                                let key = start + first_key + j * 8 + 2 * t + e;
                                let mut hidden0 = key >= seq_k;
                                let mut hidden1 = key >= seq_k;
                                if causal {
                                    hidden0 = hidden0 || key > row0;
                                    hidden1 = hidden1 || key > row0 + 8;
                                }
                                if hidden0 {
                                    top[e] = -1.0e30;
                                }
                                if hidden1 {
                                    bottom[e] = -1.0e30;
                                }
                            }
                            s[rb * s_block + 2 * j] = top;
                            s[rb * s_block + 2 * j + 1] = bottom;
                        }
                    }
                }
                #[unroll]
                for i in 0..2 * blocks {
                    tile_max[i] = -1.0e30;
                }
                #[unroll]
                for rb in 0..blocks {
                    #[unroll]
                    for j in 0..frags {
                        #[unroll]
                        for half in 0..2usize {
                            let x = s[rb * s_block + 2 * j + half];
                            let i = rb * 2 + half;
                            tile_max[i] = f32::max(tile_max[i], f32::max(x[0usize], x[1usize]));
                        }
                    }
                }
                // New maxima over the row's 4 units; the sums and outputs rescaled to them.
                #[unroll]
                for i in 0..2 * blocks {
                    let mut x = tile_max[i];
                    x = f32::max(x, plane_shuffle_xor(x, 1));
                    x = f32::max(x, plane_shuffle_xor(x, 2));
                    let new = f32::max(mx[i], x);
                    let f = f32::exp(mx[i] - new);
                    mx[i] = new;
                    sum[i] = sum[i] * f;
                    let rb = i / 2;
                    let half = i % 2;
                    #[unroll]
                    for n in 0..dn {
                        let at = rb * o_block + 2 * n + half;
                        o[at] = o[at] * Vector::new(f);
                    }
                }

                // P = exp(S − m) in place; O += P·V over steps of 16 keys, P rounded to F as
                // the A fragments and V's B fragments read transposed (`accumulate_pv`).
                #[unroll]
                for rb in 0..blocks {
                    #[unroll]
                    for j in 0..frags {
                        #[unroll]
                        for half in 0..2usize {
                            let i = rb * 2 + half;
                            let at = rb * s_block + 2 * j + half;
                            let e = Vector::exp(s[at] - Vector::new(mx[i]));
                            sum[i] = sum[i] + e[0usize] + e[1usize];
                            s[at] = e;
                        }
                    }
                }
                accumulate_pv::<F>(
                    &s,
                    &kv,
                    k_first + tile + first_key * ks,
                    &mut o,
                    blocks,
                    step,
                    head_dim,
                    ks,
                );
            }
            // Every plane is done with this buffer, and the next tile has landed.
            barrier.arrive_and_wait();
            start = next;
            buffer = 1 - buffer;
        }

        // The rows' sums over their 4 units, the output normalized, the log-sum-exp.
        let o_at = b * out.stride(0) + h * out.stride(1);
        let (rs, es) = (out.stride(2), out.stride(3));
        let l_at = b * lse.stride(0) + h * lse.stride(1);
        #[unroll]
        for i in 0..2 * blocks {
            let mut l = sum[i];
            l += plane_shuffle_xor(l, 1);
            l += plane_shuffle_xor(l, 2);
            let inv = 1.0f32 / l;
            let rb = i / 2;
            let half = i % 2;
            let r = row + rb * 16 + half * 8;
            if r < seq_q {
                #[unroll]
                for n in 0..dn {
                    let at = o_at + r * rs + (n * 8 + 2 * t) * es;
                    let value = o[rb * o_block + 2 * n + half];
                    out[at] = F::cast_from(value[0usize] * inv);
                    out[at + es] = F::cast_from(value[1usize] * inv);
                }
                if t == 0 {
                    lse[l_at + r * lse.stride(2)] = mx[i] + f32::ln(l);
                }
            }
        }
    }
}
pub(super) use kernel::mma_forward_kernel;

/// Query rows per plane of the forward (two blocks of 16).
pub(crate) const PLANE_ROWS: usize = 32;
/// Query rows per cube of the forward: four planes of [`PLANE_ROWS`].
pub(crate) const FORWARD_ROWS: usize = 4 * PLANE_ROWS;
