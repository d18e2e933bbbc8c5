//! FlashAttention-2's backward on m16n8k16 `mma` with the scores, probabilities, `dP` and
//! `dS` kept in registers: `dq` walks key tiles for 64 query rows, `dkdv` walks query tiles for
//! 64 key rows, both after `Δ`, no atomics. A plane owns 16 rows of its cube's 64; per tile of
//! 64 columns it holds two 16 × 64 f32 register tiles (`S` turned into `P`, and `dP` turned
//! into `dS`), which, rounded to the element type, are the A fragments of the accumulating
//! products (layouts in `mma_tiles`).
//!
//! The walked tiles (K and V in `dq`, Q and dO in `dkdv`) are double-buffered: the next tile's
//! rows go by asynchronous copies while the cube computes, and one barrier per tile waits for
//! them. Every tile is row-major; a product that reads a tile's columns reads it transposed by
//! `ldmatrix.trans`.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::barrier::Barrier;
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::mma_tiles::{
        Two, accumulate_pv, copy_kv_rows, copy_rows, product_nt, write_acc,
    };
    use super::super::tiles::{KEYS, PLANE, ROWS, stage_stat};

    /// Query columns of one `dkdv` register tile (half a query tile).
    const HALF_KEYS: usize = KEYS / 2;

    /// `dq` with the tiles in registers (arguments as `tc_dq_kernel`'s, dense only): elements
    /// of `F` (f16 or bf16), `head_dim` a multiple of 16 up to 128; cube `(x, y)`: query rows
    /// `64·x ..` of head `y = b·heads + h`; 128 units. Shared memory: Q and dO, then K and V of
    /// buffers 0 and 1, each `64 × (head_dim + 8)`.
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
        let ks = comptime!(head_dim + 8);
        let tile = comptime!(KEYS * (head_dim + 8));
        let all = comptime!(6 * KEYS * (head_dim + 8));
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

        // Q at 0, dO at `tile`, buffer `i`'s K at `(2 + 2i)·tile` and V at `(3 + 2i)·tile`.
        let mut kv = SharedMemory::<F>::new_aligned(all, 16usize);
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        copy_rows::<F, N>(
            q, q_vectors, q_at, first_row, seq_q, &mut kv, 0usize, all, head_dim, ks,
        );
        copy_rows::<F, N>(
            d_out,
            d_out_vectors,
            g_at,
            first_row,
            seq_q,
            &mut kv,
            tile,
            all,
            head_dim,
            ks,
        );
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
        let q_plane = plane * 16 * ks;
        let g_plane = tile + q_plane;
        barrier.arrive_and_wait();
        let mut start = 0usize;
        let mut buffer = 0usize;
        while start < kv_end {
            let next = start + KEYS;
            if next < kv_end {
                let to = (4 - 2 * buffer) * tile;
                copy_kv_rows::<F, N>(
                    k, k_vectors, k_at, v, v_vectors, v_at, next, seq_k, &mut kv, to, all, head_dim,
                );
            }
            barrier.commit_copy_async();
            let k_first = (2 + 2 * buffer) * tile;

            // P = exp(S·scale − lse).
            product_nt::<F>(&kv, q_plane, k_first, &mut s, 1usize, KEYS, head_dim, ks);
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
                &kv,
                g_plane,
                k_first + tile,
                &mut dp,
                1usize,
                KEYS,
                head_dim,
                ks,
            );
            #[unroll]
            for j in 0..8usize {
                dp[2 * j] = s[2 * j] * (dp[2 * j] - Vector::new(delta0));
                dp[2 * j + 1] = s[2 * j + 1] * (dp[2 * j + 1] - Vector::new(delta1));
            }
            // dQ += dS·K (K's columns read transposed).
            accumulate_pv::<F>(&dp, &kv, k_first, &mut acc, 1usize, KEYS, head_dim, ks);
            // Every plane is done with this buffer, and the next tile has landed.
            barrier.arrive_and_wait();
            start = next;
            buffer = 1 - buffer;
        }
        let dq_at = b * dq.stride(0) + h * dq.stride(1);
        write_acc::<F>(&acc, dq, dq_at, row0, seq_q, scale, head_dim);
    }

    /// `dk`, `dv` with the tiles in registers (arguments as `tc_dkdv_kernel`'s, dense only):
    /// cube `(x, y)` holds key rows `64·x ..` of the K/V head that query head
    /// `y = b·heads + h` reads, walks that query head's tiles and writes its share to head `h`
    /// of `dk`, `dv` (`[batch, heads, ..]` of element `O`; the launch sums a group's shares
    /// under grouped-query attention). Rows of the register tiles are keys: `Sᵀ = K·Qᵀ`,
    /// `dPᵀ = V·dOᵀ`, then `dV += Pᵀ·dO` and `dK += dSᵀ·Q` (dO's and Q's columns read
    /// transposed). Shared memory: K and V, then Q and dO of buffers 0 and 1, each
    /// `64 × (head_dim + 8)`, and the query tiles' statistics, double-buffered too.
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
        let tile = comptime!(KEYS * (head_dim + 8));
        let all = comptime!(6 * KEYS * (head_dim + 8));
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

        // K at 0, V at `tile`, buffer `i`'s Q at `(2 + 2i)·tile` and dO at `(3 + 2i)·tile`;
        // buffer `i`'s lse and Δ at `i·KEYS` of theirs.
        let mut kv = SharedMemory::<F>::new_aligned(all, 16usize);
        let mut lse_tile = SharedMemory::<f32>::new(comptime!(2 * KEYS));
        let mut delta_tile = SharedMemory::<f32>::new(comptime!(2 * KEYS));
        let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

        // Causal: query rows before this cube's first key see none of its keys (tiles of
        // queries and keys are both 64 long, so this is a tile boundary).
        let mut start = 0usize;
        if causal {
            start = first_key;
        }
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        let lse_at = b * lse.stride(0) + h * lse.stride(1);
        let delta_at = b * delta.stride(0) + h * delta.stride(1);
        copy_kv_rows::<F, N>(
            k, k_vectors, k_at, v, v_vectors, v_at, first_key, seq_k, &mut kv, 0usize, all,
            head_dim,
        );
        if start < seq_q {
            copy_query_tile::<F, N>(
                q,
                q_vectors,
                q_at,
                d_out,
                d_out_vectors,
                g_at,
                lse,
                lse_at,
                delta,
                delta_at,
                start,
                seq_q,
                &mut kv,
                comptime!(2 * tile),
                &mut lse_tile,
                &mut delta_tile,
                0usize,
                all,
                head_dim,
            );
        }
        barrier.commit_copy_async();

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
        let k_plane = plane * 16 * ks;
        let v_plane = tile + k_plane;
        barrier.arrive_and_wait();
        let mut buffer = 0usize;
        while start < seq_q {
            let next = start + KEYS;
            if next < seq_q {
                copy_query_tile::<F, N>(
                    q,
                    q_vectors,
                    q_at,
                    d_out,
                    d_out_vectors,
                    g_at,
                    lse,
                    lse_at,
                    delta,
                    delta_at,
                    next,
                    seq_q,
                    &mut kv,
                    (4 - 2 * buffer) * tile,
                    &mut lse_tile,
                    &mut delta_tile,
                    (1 - buffer) * KEYS,
                    all,
                    head_dim,
                );
            }
            barrier.commit_copy_async();
            let q_first = (2 + 2 * buffer) * tile;
            let g_first = q_first + tile;
            let stats = buffer * KEYS;

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
                    &kv,
                    k_plane,
                    q_first + col0 * ks,
                    &mut s,
                    1usize,
                    HALF_KEYS,
                    head_dim,
                    ks,
                );
                #[unroll]
                for j in 0..4usize {
                    let col = stats + col0 + j * 8 + 2 * t;
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
                accumulate_pv::<F>(
                    &s,
                    &kv,
                    g_first + col0 * ks,
                    &mut dv_acc,
                    1usize,
                    HALF_KEYS,
                    head_dim,
                    ks,
                );
                // dSᵀ = Pᵀ ∘ (dPᵀ − Δ of the column's query), with dPᵀ = V·dOᵀ.
                product_nt::<F>(
                    &kv,
                    v_plane,
                    g_first + col0 * ks,
                    &mut dp,
                    1usize,
                    HALF_KEYS,
                    head_dim,
                    ks,
                );
                #[unroll]
                for j in 0..4usize {
                    let col = stats + col0 + j * 8 + 2 * t;
                    let mut d = Vector::<f32, Two>::new(0.0);
                    d[0usize] = delta_tile[col];
                    d[1usize] = delta_tile[col + 1];
                    dp[2 * j] = s[2 * j] * (dp[2 * j] - d);
                    dp[2 * j + 1] = s[2 * j + 1] * (dp[2 * j + 1] - d);
                }
                // dK += dSᵀ·Q.
                accumulate_pv::<F>(
                    &dp,
                    &kv,
                    q_first + col0 * ks,
                    &mut dk_acc,
                    1usize,
                    HALF_KEYS,
                    head_dim,
                    ks,
                );
            }
            // Every plane is done with this buffer, and the next tile has landed.
            barrier.arrive_and_wait();
            start = next;
            buffer = 1 - buffer;
        }
        let dk_at = b * dk.stride(0) + h * dk.stride(1);
        let dv_at = b * dv.stride(0) + h * dv.stride(1);
        write_acc::<O>(&dk_acc, dk, dk_at, key0, seq_k, scale, head_dim);
        write_acc::<O>(&dv_acc, dv, dv_at, key0, seq_k, 1.0, head_dim);
    }

    /// One query tile of `dkdv`: Q's and dO's rows `first ..` (zeros past `seq`) into `kv`
    /// from element `to` (dO one tile after Q), and their log-sum-exp and Δ (zeros past `seq`)
    /// into `lse_tile` and `delta_tile` from `stat`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn copy_query_tile<F: Float, N: Size>(
        q: &Tensor<F>,
        q_vectors: &Tensor<Vector<F, N>>,
        q_at: usize,
        d_out: &Tensor<F>,
        d_out_vectors: &Tensor<Vector<F, N>>,
        g_at: usize,
        lse: &Tensor<f32>,
        lse_at: usize,
        delta: &Tensor<f32>,
        delta_at: usize,
        first: usize,
        seq: usize,
        kv: &mut SharedMemory<F>,
        to: usize,
        lse_tile: &mut SharedMemory<f32>,
        delta_tile: &mut SharedMemory<f32>,
        stat: usize,
        #[comptime] all: usize,
        #[comptime] head_dim: usize,
    ) {
        let ks = comptime!(head_dim + 8);
        let tile = comptime!(KEYS * (head_dim + 8));
        copy_rows::<F, N>(q, q_vectors, q_at, first, seq, kv, to, all, head_dim, ks);
        copy_rows::<F, N>(
            d_out,
            d_out_vectors,
            g_at,
            first,
            seq,
            kv,
            to + tile,
            all,
            head_dim,
            ks,
        );
        stage_stat(lse, lse_at, first, seq, lse_tile, stat, KEYS);
        stage_stat(delta, delta_at, first, seq, delta_tile, stat, KEYS);
    }
}
pub(super) use kernel::{mma_dkdv_kernel, mma_dq_kernel};
