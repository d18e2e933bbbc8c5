//! FlashAttention-2's backward on m16n8k16 `mma` with the scores, probabilities, `dP` and
//! `dS` kept in registers (the tensor-core backward stages each of them in shared memory):
//! `dq` walks key tiles for 64 query rows, `dkdv` walks query tiles for 64 key rows, both
//! after `Δ`, no atomics. A plane owns 16 rows of its cube's 64; per tile of 64 columns it
//! holds two 16 × 64 f32 register tiles (`S` turned into `P`, and `dP` turned into `dS`),
//! which, rounded to the element type, are the A fragments of the accumulating products
//! (layouts in `mma_tiles`). Operands read as B fragments along the tile's rows are staged
//! transposed, so every B fragment is two 32-bit loads without bank conflicts.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::mma_tiles::{Two, accumulate_pt, product_nt, stage_transposed, write_acc};
    use super::super::tiles::{KEYS, PLANE, ROWS, stage, stage_stat};

    /// Query columns of one `dkdv` register tile (half a query tile).
    const HALF_KEYS: usize = KEYS / 2;

    /// `dq` with the tiles in registers (arguments as `tc_dq_kernel`'s, dense only): elements
    /// of `F` (f16 or bf16), `head_dim` a multiple of 16 up to 128; cube `(x, y)`: query rows
    /// `64·x ..` of head `y = b·heads + h`; 128 units.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn mma_dq_kernel<F: Float, N: Size>(
        q: &Tensor<F>,
        q_vectors: &Tensor<Vector<F, N>>,
        k: &Tensor<F>,
        k_vectors: &Tensor<Vector<F, N>>,
        v: &Tensor<F>,
        v_vectors: &Tensor<Vector<F, N>>,
        d_out: &Tensor<F>,
        d_out_vectors: &Tensor<Vector<F, N>>,
        lse: &Tensor<f32>,
        delta: &Tensor<f32>,
        dq: &mut Tensor<F>,
        scale: f32,
        #[comptime] causal: bool,
        #[comptime] head_dim: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        // Row strides of the row-major tiles and of the transposed one.
        let ks = comptime!(head_dim + 8);
        let vs = comptime!(KEYS + 8);
        let row_len = comptime!(ROWS * (head_dim + 8));
        let key_len = comptime!(KEYS * (head_dim + 8));
        let t_len = comptime!(head_dim * (KEYS + 8));
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let hk = h / group;
        let plane = UNIT_POS as usize / PLANE;
        let lane = UNIT_POS as usize % PLANE;
        let g = lane / 4;
        let t = lane % 4;
        let first_row = CUBE_POS_X as usize * ROWS;
        let row0 = first_row + plane * 16 + g;
        let row1 = row0 + 8;

        let mut q_tile = SharedMemory::<F>::new_aligned(row_len, 16usize);
        let mut g_tile = SharedMemory::<F>::new_aligned(row_len, 16usize);
        let mut k_tile = SharedMemory::<F>::new_aligned(key_len, 16usize);
        let mut v_tile = SharedMemory::<F>::new_aligned(key_len, 16usize);
        let mut kt_tile = SharedMemory::<F>::new_aligned(t_len, 16usize);

        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        stage::<F, N>(
            q,
            q_vectors,
            q_at,
            first_row,
            seq_q,
            &mut q_tile,
            ROWS,
            head_dim,
            ks,
        );
        stage::<F, N>(
            d_out,
            d_out_vectors,
            g_at,
            first_row,
            seq_q,
            &mut g_tile,
            ROWS,
            head_dim,
            ks,
        );
        // The rows' statistics (rows past the end: zeros, and their Q and dO rows are zeros).
        let lse_at = b * lse.stride(0) + h * lse.stride(1);
        let delta_at = b * delta.stride(0) + h * delta.stride(1);
        let mut lse0 = 0.0f32;
        let mut lse1 = 0.0f32;
        let mut delta0 = 0.0f32;
        let mut delta1 = 0.0f32;
        if row0 < seq_q {
            lse0 = lse[lse_at + row0 * lse.stride(2)];
            delta0 = delta[delta_at + row0 * delta.stride(2)];
        }
        if row1 < seq_q {
            lse1 = lse[lse_at + row1 * lse.stride(2)];
            delta1 = delta[delta_at + row1 * delta.stride(2)];
        }

        let zero = Vector::<f32, Two>::new(0.0);
        let dn = comptime!(head_dim / 8);
        let mut acc = Array::<Vector<f32, Two>>::new(comptime!(dn * 2));
        #[unroll]
        for i in 0..dn * 2 {
            acc[i] = zero;
        }
        let mut s = Array::<Vector<f32, Two>>::new(16usize);
        let mut dp = Array::<Vector<f32, Two>>::new(16usize);

        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, ROWS, seq_k) + 1;
        }
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        let a_row = plane * 16;
        let mut start = 0usize;
        while start < kv_end {
            stage::<F, N>(
                k,
                k_vectors,
                k_at,
                start,
                seq_k,
                &mut k_tile,
                KEYS,
                head_dim,
                ks,
            );
            stage::<F, N>(
                v,
                v_vectors,
                v_at,
                start,
                seq_k,
                &mut v_tile,
                KEYS,
                head_dim,
                ks,
            );
            stage_transposed::<F, N>(k, k_vectors, k_at, start, seq_k, &mut kt_tile, head_dim, vs);
            sync_cube();

            // P = exp(S·scale − lse), zero where the key is hidden.
            product_nt::<F>(
                &q_tile, a_row, &k_tile, 0usize, &mut s, KEYS, row_len, key_len, head_dim, ks,
            );
            #[unroll]
            for j in 0..8usize {
                s[2 * j] = Vector::exp(s[2 * j] * Vector::new(scale) - Vector::new(lse0));
                s[2 * j + 1] = Vector::exp(s[2 * j + 1] * Vector::new(scale) - Vector::new(lse1));
            }
            // Only a tile that holds a hidden key (the last tile, the causal diagonal) is
            // masked: one branch for the whole cube.
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
                            top[e] = 0.0;
                        }
                        if hidden1 {
                            bottom[e] = 0.0;
                        }
                    }
                    s[2 * j] = top;
                    s[2 * j + 1] = bottom;
                }
            }
            // dS = P ∘ (dP − Δ), with dP = dO·Vᵀ.
            product_nt::<F>(
                &g_tile, a_row, &v_tile, 0usize, &mut dp, KEYS, row_len, key_len, head_dim, ks,
            );
            #[unroll]
            for j in 0..8usize {
                dp[2 * j] = s[2 * j] * (dp[2 * j] - Vector::new(delta0));
                dp[2 * j + 1] = s[2 * j + 1] * (dp[2 * j + 1] - Vector::new(delta1));
            }
            // dQ += dS·K.
            accumulate_pt::<F>(&dp, &kt_tile, 0usize, &mut acc, KEYS, t_len, head_dim, vs);
            sync_cube();
            start += KEYS;
        }
        let dq_at = b * dq.stride(0) + h * dq.stride(1);
        write_acc::<F>(&acc, dq, dq_at, row0, seq_q, scale, head_dim);
    }

    /// `dk`, `dv` with the tiles in registers (arguments as `tc_dkdv_kernel`'s, dense only):
    /// cube `(x, y)` holds key rows `64·x ..` of the K/V head that query head
    /// `y = b·heads + h` reads, walks that query head's tiles and writes its share to head `h`
    /// of `dk`, `dv` (`[batch, heads, ..]` of element `O`; the launch sums a group's shares
    /// under grouped-query attention). Rows of the register tiles are keys: `Sᵀ = K·Qᵀ`,
    /// `dPᵀ = V·dOᵀ`, then `dV += Pᵀ·dO` and `dK += dSᵀ·Q` from Q and dO staged transposed.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn mma_dkdv_kernel<F: Float, O: Float, N: Size>(
        q: &Tensor<F>,
        q_vectors: &Tensor<Vector<F, N>>,
        k: &Tensor<F>,
        k_vectors: &Tensor<Vector<F, N>>,
        v: &Tensor<F>,
        v_vectors: &Tensor<Vector<F, N>>,
        d_out: &Tensor<F>,
        d_out_vectors: &Tensor<Vector<F, N>>,
        lse: &Tensor<f32>,
        delta: &Tensor<f32>,
        dk: &mut Tensor<O>,
        dv: &mut Tensor<O>,
        scale: f32,
        #[comptime] causal: bool,
        #[comptime] head_dim: usize,
        #[define(F, O)] _dtypes: [StorageType; 2],
    ) {
        let ks = comptime!(head_dim + 8);
        let vs = comptime!(KEYS + 8);
        let row_len = comptime!(ROWS * (head_dim + 8));
        let key_len = comptime!(KEYS * (head_dim + 8));
        let t_len = comptime!(head_dim * (KEYS + 8));
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let hk = h / group;
        let plane = UNIT_POS as usize / PLANE;
        let lane = UNIT_POS as usize % PLANE;
        let g = lane / 4;
        let t = lane % 4;
        let first_key = CUBE_POS_X as usize * ROWS;
        let key0 = first_key + plane * 16 + g;
        let key1 = key0 + 8;

        let mut k_tile = SharedMemory::<F>::new_aligned(row_len, 16usize);
        let mut v_tile = SharedMemory::<F>::new_aligned(row_len, 16usize);
        let mut q_tile = SharedMemory::<F>::new_aligned(key_len, 16usize);
        let mut g_tile = SharedMemory::<F>::new_aligned(key_len, 16usize);
        let mut qt_tile = SharedMemory::<F>::new_aligned(t_len, 16usize);
        let mut gt_tile = SharedMemory::<F>::new_aligned(t_len, 16usize);
        let mut lse_tile = SharedMemory::<f32>::new(KEYS);
        let mut delta_tile = SharedMemory::<f32>::new(KEYS);

        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        stage::<F, N>(
            k,
            k_vectors,
            k_at,
            first_key,
            seq_k,
            &mut k_tile,
            ROWS,
            head_dim,
            ks,
        );
        stage::<F, N>(
            v,
            v_vectors,
            v_at,
            first_key,
            seq_k,
            &mut v_tile,
            ROWS,
            head_dim,
            ks,
        );

        let zero = Vector::<f32, Two>::new(0.0);
        let dn = comptime!(head_dim / 8);
        let mut dk_acc = Array::<Vector<f32, Two>>::new(comptime!(dn * 2));
        let mut dv_acc = Array::<Vector<f32, Two>>::new(comptime!(dn * 2));
        #[unroll]
        for i in 0..dn * 2 {
            dk_acc[i] = zero;
            dv_acc[i] = zero;
        }
        let mut s = Array::<Vector<f32, Two>>::new(8usize);
        let mut dp = Array::<Vector<f32, Two>>::new(8usize);

        // Causal: query rows before this cube's first key see none of its keys (tiles of
        // queries and keys are both 64 long, so this is a tile boundary).
        let mut start = 0usize;
        if causal {
            start = first_key;
        }
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        let lse_at = b * lse.stride(0) + h * lse.stride(1);
        let delta_at = b * delta.stride(0) + h * delta.stride(1);
        let a_row = plane * 16;
        while start < seq_q {
            stage_stat(lse, lse_at, start, seq_q, &mut lse_tile, KEYS);
            stage_stat(delta, delta_at, start, seq_q, &mut delta_tile, KEYS);
            stage::<F, N>(
                q,
                q_vectors,
                q_at,
                start,
                seq_q,
                &mut q_tile,
                KEYS,
                head_dim,
                ks,
            );
            stage::<F, N>(
                d_out,
                d_out_vectors,
                g_at,
                start,
                seq_q,
                &mut g_tile,
                KEYS,
                head_dim,
                ks,
            );
            stage_transposed::<F, N>(q, q_vectors, q_at, start, seq_q, &mut qt_tile, head_dim, vs);
            stage_transposed::<F, N>(
                d_out,
                d_out_vectors,
                g_at,
                start,
                seq_q,
                &mut gt_tile,
                head_dim,
                vs,
            );
            sync_cube();

            // Only a tile that holds a query past the end or one that does not see a key
            // of this cube (the causal diagonal) is masked: one branch for the whole cube.
            let mut edge = start + KEYS > seq_q;
            if causal {
                edge = edge || start + 1 < first_key + ROWS;
            }
            // The tile's queries in two halves of 32: two 16 × 32 register tiles per half keep
            // the accumulators of dK and dV (64 registers each at head dim 128) from spilling.
            for half in 0..2usize {
                let col0 = half * HALF_KEYS;
                // Pᵀ = exp(Sᵀ·scale − lse of the column's query), zero where the query does not
                // see the key or is past the end.
                product_nt::<F>(
                    &k_tile, a_row, &q_tile, col0, &mut s, HALF_KEYS, row_len, key_len, head_dim,
                    ks,
                );
                #[unroll]
                for j in 0..4usize {
                    let col = col0 + j * 8 + 2 * t;
                    let mut row_lse = Vector::<f32, Two>::new(0.0);
                    row_lse[0usize] = lse_tile[col];
                    row_lse[1usize] = lse_tile[col + 1];
                    s[2 * j] = Vector::exp(s[2 * j] * Vector::new(scale) - row_lse);
                    s[2 * j + 1] = Vector::exp(s[2 * j + 1] * Vector::new(scale) - row_lse);
                }
                if edge {
                    #[unroll]
                    for j in 0..4usize {
                        let mut top = s[2 * j];
                        let mut bottom = s[2 * j + 1];
                        #[unroll]
                        for e in 0..2usize {
                            let query = start + col0 + j * 8 + 2 * t + e;
                            let mut seen0 = query < seq_q;
                            let mut seen1 = query < seq_q;
                            if causal {
                                seen0 = seen0 && query >= key0;
                                seen1 = seen1 && query >= key1;
                            }
                            if !seen0 {
                                top[e] = 0.0;
                            }
                            if !seen1 {
                                bottom[e] = 0.0;
                            }
                        }
                        s[2 * j] = top;
                        s[2 * j + 1] = bottom;
                    }
                }
                // dV += Pᵀ·dO.
                accumulate_pt::<F>(
                    &s,
                    &gt_tile,
                    col0,
                    &mut dv_acc,
                    HALF_KEYS,
                    t_len,
                    head_dim,
                    vs,
                );
                // dSᵀ = Pᵀ ∘ (dPᵀ − Δ of the column's query), with dPᵀ = V·dOᵀ.
                product_nt::<F>(
                    &v_tile, a_row, &g_tile, col0, &mut dp, HALF_KEYS, row_len, key_len, head_dim,
                    ks,
                );
                #[unroll]
                for j in 0..4usize {
                    let col = col0 + j * 8 + 2 * t;
                    let mut d = Vector::<f32, Two>::new(0.0);
                    d[0usize] = delta_tile[col];
                    d[1usize] = delta_tile[col + 1];
                    dp[2 * j] = s[2 * j] * (dp[2 * j] - d);
                    dp[2 * j + 1] = s[2 * j + 1] * (dp[2 * j + 1] - d);
                }
                // dK += dSᵀ·Q.
                accumulate_pt::<F>(
                    &dp,
                    &qt_tile,
                    col0,
                    &mut dk_acc,
                    HALF_KEYS,
                    t_len,
                    head_dim,
                    vs,
                );
            }
            sync_cube();
            start += KEYS;
        }
        let dk_at = b * dk.stride(0) + h * dk.stride(1);
        let dv_at = b * dv.stride(0) + h * dv.stride(1);
        write_acc::<O>(&dk_acc, dk, dk_at, key0, seq_k, scale, head_dim);
        write_acc::<O>(&dv_acc, dv, dv_at, key0, seq_k, 1.0, head_dim);
    }
}
pub(super) use kernel::{mma_dkdv_kernel, mma_dq_kernel};
