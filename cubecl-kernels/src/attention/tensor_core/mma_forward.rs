//! FlashAttention-2's forward on tensor cores with the scores kept in registers: `Q·Kᵀ` and
//! `P·V` on m16n8k16 `mma` instructions (f16/bf16 in, f32 accumulators) whose fragments each
//! unit holds itself. A plane (warp) owns 16 query rows; per tile of 64 keys its 8 score
//! fragments (16 × 8 each) are scaled, masked (on the tiles that hold a hidden key) and
//! exponentiated where they are, row maxima and sums come from two shuffles among the 4 units
//! of a row, and the accumulators of two neighbouring score fragments are exactly the A
//! fragment of `P` for the next product (rounded to the element type, as FlashAttention-2
//! does): no score or probability goes through shared memory.
//!
//! K and V tiles are double-buffered: the next tile's rows go by asynchronous copies while
//! the cube computes on the current one, and one barrier per tile waits for them. Fragments
//! come from shared memory by `ldmatrix` (four 8 × 8 matrices per instruction; V's transposed
//! on the way), Q's once. (Fragment layouts in `mma_tiles`.)

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::cmma::MmaDefinition;
    use cubecl::ir::MatrixIdent;
    use cubecl::prelude::barrier::Barrier;
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::mma_tiles::{Two, accumulate_pv, copy_kv_rows, copy_rows};
    use super::super::tiles::{KEYS, PLANE, ROWS};

    /// As `tc_forward_kernel` (same arguments and results, dense only) with the scores in
    /// registers: elements of `F` (f16 or bf16), `head_dim` a multiple of 16 up to 128; cube
    /// `(x, y)`: query rows `64·x ..`, head `y = b·heads + h`; 128 units.
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
        // k-steps of 16 over the head, output fragments of 8 columns.
        let dk = comptime!(head_dim / 16);
        let dn = comptime!(head_dim / 8);
        // Row stride of the tiles (padded by 16 bytes: the 8 rows of an `ldmatrix` meet 32
        // banks), one tile's length, and the four tiles': K and V of buffers 0 and 1.
        let ks = comptime!(head_dim + 8);
        let tile = comptime!(KEYS * (head_dim + 8));
        let all = comptime!(4 * KEYS * (head_dim + 8));
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
        // The row this unit points `ldmatrix` at: row `r` of matrix `m`.
        let m = lane / 8;
        let r = lane % 8;
        let first_row = CUBE_POS_X as usize * ROWS;
        let row0 = first_row + plane * 16 + g;
        let row1 = row0 + 8;
        let mma = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);

        // Buffer `i`'s K tile at `2i·tile`, its V tile at `(2i + 1)·tile`.
        let mut kv = SharedMemory::<F>::new_aligned(all, 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        // Q passes through buffer 1's K tile into A fragments held for the whole walk
        // (`ROWS` = `KEYS` rows): matrix `m` of k-step `kk` is rows `(m % 2)·8 ..`, columns
        // `kk·16 + (m / 2)·8 ..` of the plane's 16.
        let q_at = b * q.stride(0) + h * q.stride(1);
        copy_rows::<F, N>(
            q,
            q_vectors,
            q_at,
            first_row,
            seq_q,
            &mut kv,
            comptime!(2 * tile),
            all,
            head_dim,
            ks,
        );
        barrier.commit_copy_async();
        barrier.arrive_and_wait();
        let mut qf = Array::<Vector<F, Two>>::new(comptime!(dk * 4));
        let q_lane = comptime!(2 * tile) + (plane * 16 + (m % 2) * 8 + r) * ks + (m / 2) * 8;
        #[unroll]
        for kk in 0..dk {
            let at = q_lane + kk * 16;
            let regs =
                mma.load_matrix::<F, Two>(&kv.slice(at, at + 8), MatrixIdent::A, 4usize, false);
            #[unroll]
            for i in 0..4usize {
                qf[kk * 4 + i] = regs[i];
            }
        }

        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, ROWS, seq_k) + 1;
        }
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        // Tile 0 into buffer 0; the barrier also sees every plane's Q fragments read before
        // tile 1 lands in buffer 1.
        copy_kv_rows::<F, N>(
            k, k_vectors, k_at, v, v_vectors, v_at, 0usize, seq_k, &mut kv, 0usize, all, head_dim,
        );
        barrier.commit_copy_async();
        barrier.arrive_and_wait();

        let zero = Vector::<f32, Two>::new(0.0);
        let mut o = Array::<Vector<f32, Two>>::new(comptime!(dn * 2));
        #[unroll]
        for i in 0..dn * 2 {
            o[i] = zero;
        }
        // Stands for −∞ before any key is seen (every row sees key 0 in the first tile).
        let mut m0 = f32::new(-1.0e30);
        let mut m1 = f32::new(-1.0e30);
        // This unit's share of each row's sum.
        let mut l0 = 0.0f32;
        let mut l1 = 0.0f32;

        let mut s = Array::<Vector<f32, Two>>::new(16usize);
        let mut a = Array::<Vector<F, Two>>::new(4usize);
        let mut bf = Array::<Vector<F, Two>>::new(2usize);
        let mut c = Array::<Vector<f32, Two>>::new(2usize);
        let mut start = 0usize;
        let mut buffer = 0usize;
        while start < kv_end {
            // The next tile's copies go out before this one's products.
            let next = start + KEYS;
            if next < kv_end {
                let to = (1 - buffer) * comptime!(2 * tile);
                copy_kv_rows::<F, N>(
                    k, k_vectors, k_at, v, v_vectors, v_at, next, seq_k, &mut kv, to, all, head_dim,
                );
            }
            barrier.commit_copy_async();
            let k_first = buffer * comptime!(2 * tile);

            // S = Q·Kᵀ: 8 fragments of 8 keys. One `ldmatrix.x4` holds the B fragments of two
            // k-steps: matrix `m` is keys `8j ..`, columns `32·pair + 8m ..`.
            let k_lane = k_first + r * ks + m * 8;
            let k_odd = k_first + r * ks + (m % 2) * 8 + comptime!((head_dim / 16 - 1) * 16);
            #[unroll]
            for j in 0..8usize {
                c[0usize] = zero;
                c[1usize] = zero;
                #[unroll]
                for pair in 0..dk / 2 {
                    let at = k_lane + j * 8 * ks + pair * 32;
                    let regs = mma.load_matrix::<F, Two>(
                        &kv.slice(at, at + 8),
                        MatrixIdent::B,
                        4usize,
                        false,
                    );
                    #[unroll]
                    for half in 0..2usize {
                        let kk = 2 * pair + half;
                        #[unroll]
                        for i in 0..4usize {
                            a[i] = qf[kk * 4 + i];
                        }
                        bf[0usize] = regs[2 * half];
                        bf[1usize] = regs[2 * half + 1];
                        let d = mma.execute(&a, &bf, &c);
                        c[0usize] = d[0usize];
                        c[1usize] = d[1usize];
                    }
                }
                if comptime!(dk % 2 == 1) {
                    // The last k-step alone: an `ldmatrix.x2` (lanes 16.. point where 0.. do).
                    let at = k_odd + j * 8 * ks;
                    let regs = mma.load_matrix::<F, Two>(
                        &kv.slice(at, at + 8),
                        MatrixIdent::B,
                        2usize,
                        false,
                    );
                    #[unroll]
                    for i in 0..4usize {
                        a[i] = qf[comptime!((head_dim / 16 - 1) * 4) + i];
                    }
                    bf[0usize] = regs[0usize];
                    bf[1usize] = regs[1usize];
                    let d = mma.execute(&a, &bf, &c);
                    c[0usize] = d[0usize];
                    c[1usize] = d[1usize];
                }
                s[2 * j] = c[0usize];
                s[2 * j + 1] = c[1usize];
            }

            // Scale; mask where the tile holds a hidden key (the last tile, the causal
            // diagonal: one branch for the whole cube); the rows' maxima over the tile.
            #[unroll]
            for j in 0..16usize {
                s[j] = s[j] * Vector::new(scale);
            }
            let mut edge = start + KEYS > seq_k;
            if causal {
                edge = edge || start + KEYS > first_row + 1;
            }
            if edge {
                #[unroll]
                for j in 0..8usize {
                    let mut top = s[2 * j];
                    let mut bottom = s[2 * j + 1];
                    #[unroll]
                    for e in 0..2usize {
                        let key = start + j * 8 + 2 * t + e;
                        let mut hidden0 = key >= seq_k;
                        let mut hidden1 = key >= seq_k;
                        if causal {
                            hidden0 = hidden0 || key > row0;
                            hidden1 = hidden1 || key > row1;
                        }
                        if hidden0 {
                            top[e] = -1.0e30;
                        }
                        if hidden1 {
                            bottom[e] = -1.0e30;
                        }
                    }
                    s[2 * j] = top;
                    s[2 * j + 1] = bottom;
                }
            }
            let mut mx0 = f32::new(-1.0e30);
            let mut mx1 = f32::new(-1.0e30);
            #[unroll]
            for j in 0..8usize {
                let top = s[2 * j];
                let bottom = s[2 * j + 1];
                mx0 = f32::max(mx0, f32::max(top[0usize], top[1usize]));
                mx1 = f32::max(mx1, f32::max(bottom[0usize], bottom[1usize]));
            }
            mx0 = f32::max(mx0, plane_shuffle_xor(mx0, 1));
            mx0 = f32::max(mx0, plane_shuffle_xor(mx0, 2));
            mx1 = f32::max(mx1, plane_shuffle_xor(mx1, 1));
            mx1 = f32::max(mx1, plane_shuffle_xor(mx1, 2));
            let new0 = f32::max(m0, mx0);
            let new1 = f32::max(m1, mx1);
            let f0 = f32::exp(m0 - new0);
            let f1 = f32::exp(m1 - new1);
            m0 = new0;
            m1 = new1;
            l0 *= f0;
            l1 *= f1;
            #[unroll]
            for n in 0..dn {
                o[2 * n] = o[2 * n] * Vector::new(f0);
                o[2 * n + 1] = o[2 * n + 1] * Vector::new(f1);
            }

            // P = exp(S − m) in place; O += P·V over 4 steps of 16 keys, P rounded to F as
            // the A fragments and V's B fragments read transposed (`accumulate_pv`).
            #[unroll]
            for j in 0..8usize {
                let e0 = Vector::exp(s[2 * j] - Vector::new(m0));
                let e1 = Vector::exp(s[2 * j + 1] - Vector::new(m1));
                l0 += e0[0usize] + e0[1usize];
                l1 += e1[0usize] + e1[1usize];
                s[2 * j] = e0;
                s[2 * j + 1] = e1;
            }
            accumulate_pv::<F>(&s, &kv, k_first + tile, &mut o, KEYS, head_dim, ks);
            // Every plane is done with this buffer, and the next tile has landed.
            barrier.arrive_and_wait();
            start = next;
            buffer = 1 - buffer;
        }

        // The rows' sums over their 4 units, the output normalized, the log-sum-exp.
        l0 += plane_shuffle_xor(l0, 1);
        l0 += plane_shuffle_xor(l0, 2);
        l1 += plane_shuffle_xor(l1, 1);
        l1 += plane_shuffle_xor(l1, 2);
        let inv0 = 1.0f32 / l0;
        let inv1 = 1.0f32 / l1;
        let o_at = b * out.stride(0) + h * out.stride(1);
        let (rs, es) = (out.stride(2), out.stride(3));
        #[unroll]
        for n in 0..dn {
            let col = n * 8 + 2 * t;
            if row0 < seq_q {
                let at = o_at + row0 * rs + col * es;
                let value = o[2 * n];
                out[at] = F::cast_from(value[0usize] * inv0);
                out[at + es] = F::cast_from(value[1usize] * inv0);
            }
            if row1 < seq_q {
                let at = o_at + row1 * rs + col * es;
                let value = o[2 * n + 1];
                out[at] = F::cast_from(value[0usize] * inv1);
                out[at + es] = F::cast_from(value[1usize] * inv1);
            }
        }
        if t == 0 {
            let l_at = b * lse.stride(0) + h * lse.stride(1);
            if row0 < seq_q {
                lse[l_at + row0 * lse.stride(2)] = m0 + f32::ln(l0);
            }
            if row1 < seq_q {
                lse[l_at + row1 * lse.stride(2)] = m1 + f32::ln(l1);
            }
        }
    }
}
pub(super) use kernel::mma_forward_kernel;
