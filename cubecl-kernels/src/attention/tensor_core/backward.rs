//! The tensor-core backward, as the CUDA-core one (`Δ` first, then `dq` and `dkdv`, no
//! atomics): every product of 16×16×16 fragments with f32 accumulators, the probabilities
//! `p = exp(s − lse)` and `ds = p (dp − Δ)` computed row-wise on scores in shared memory and
//! rounded to the element type for the next product (as FlashAttention-2 does).

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::super::sparse::block_kept;
    use super::super::tiles::{
        ALIGN, HALF, KEYS, PLANE, PS, ROWS, SS, T, accumulate, column, column_shift, frags_a,
        next_tile, padded, scores_of, scores_of_frags, stage_pair, stage_stat, write_rows,
        zero_accs,
    };

    /// `dq` on tensor cores (arguments as `flash_dq_kernel`'s): cube `(x, y)` holds query
    /// rows `64·x ..` of head `y = b·heads + h` and walks the key tiles.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn tc_dq_kernel<F: Float, N: Size>(
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
        layout: &Tensor<u32>,
        scale: f32,
        block: u32,
        #[comptime] causal: bool,
        #[comptime] sparse: bool,
        #[comptime] head_dim: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let dt = comptime!(head_dim / T);
        let ds = comptime!(padded(head_dim));
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let plane = UNIT_POS as usize / PLANE;
        let lane = UNIT_POS as usize % PLANE;
        let first_row = CUBE_POS_X as usize * ROWS;
        let local = plane * T + lane / 2usize;
        let row = first_row + local;
        let live = row < seq_q;
        let block = block as usize;

        let mut k_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut v_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut s_tile = SharedMemory::<f32>::new_aligned(ROWS * SS, ALIGN);
        // This unit's half row of probabilities, kept while dP takes the scores' place.
        let mut probs = Array::<f32>::new(HALF);
        let mut ds_tile = SharedMemory::<F>::new_aligned(ROWS * PS, ALIGN);

        // Q and dO pass through the K/V tiles into fragments held for the whole walk.
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        stage_pair::<F, N>(
            q,
            q_vectors,
            q_at,
            d_out,
            d_out_vectors,
            g_at,
            first_row,
            seq_q,
            &mut k_tile,
            &mut v_tile,
            ROWS,
            head_dim,
            ds,
        );
        let qf = frags_a::<F>(&k_tile, plane * T * ds, dt, ds);
        let gf = frags_a::<F>(&v_tile, plane * T * ds, dt, ds);
        sync_cube();
        let mut row_lse = 0.0f32;
        let mut row_delta = 0.0f32;
        if live {
            row_lse = lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)];
            row_delta = delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)];
        }
        let acc = zero_accs(dt);

        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, ROWS, seq_k) + 1;
        }
        let last_row = last_of(first_row, ROWS, seq_q);
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        // Every other column from `half` as the forward (`column`); keys below `limit` seen.
        let s_at = local * SS;
        let p_at = local * PS;
        let shift = column_shift(lane);
        let mut limit = seq_k;
        if causal && row + 1 < limit {
            limit = row + 1;
        }
        if !live {
            limit = 0;
        }
        // The key tiles (block-sparse: those the layout keeps for these rows).
        let mut start = next_tile(
            layout, h, block, first_row, last_row, 0, kv_end, seq_k, sparse, false,
        );
        while start < kv_end {
            stage_pair::<F, N>(
                k,
                k_vectors,
                k_at,
                v,
                v_vectors,
                v_at,
                start,
                seq_k,
                &mut k_tile,
                &mut v_tile,
                KEYS,
                head_dim,
                ds,
            );
            scores_of_frags::<F>(&qf, &k_tile, &mut s_tile, plane, dt, ds);
            sync_plane();
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let key = start + c;
                let mut p = 0.0f32;
                if key < limit && (!sparse || block_kept(layout, h, block, row, key)) {
                    p = f32::exp(s_tile[s_at + c] * scale - row_lse);
                }
                probs[j] = p;
            }
            // dP goes where S was: this unit's probabilities wait in registers.
            sync_plane();
            scores_of_frags::<F>(&gf, &v_tile, &mut s_tile, plane, dt, ds);
            sync_plane();
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let d = probs[j] * (s_tile[s_at + c] - row_delta);
                ds_tile[p_at + c] = F::cast_from(d);
            }
            sync_plane();
            accumulate::<F>(&acc, &ds_tile, &k_tile, plane, dt, ds);
            sync_cube();
            start = next_tile(
                layout,
                h,
                block,
                first_row,
                last_row,
                start + KEYS,
                kv_end,
                seq_k,
                sparse,
                false,
            );
        }
        let dq_at = b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2);
        write_rows::<F>(&acc, &mut s_tile, dq, dq_at, live, plane, lane, scale, dt);
    }

    /// `dk`, `dv` on tensor cores (arguments as `flash_dkdv_kernel`'s): cube `(x, y)` holds key
    /// rows `64·x ..` of the K/V head that query head `y = b·heads + h` reads, walks that query
    /// head's tiles and writes its share to head `h` of `dk`, `dv` (`[batch, heads, ..]`, of
    /// element `O`). One cube per query head, not per K/V head: under grouped-query attention
    /// the launch sums the group's shares after (a cube walking the whole group was the
    /// backward's longest chain, 4× the forward's at Llama's 32/8 heads).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn tc_dkdv_kernel<F: Float, O: Float, N: Size>(
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
        layout: &Tensor<u32>,
        scale: f32,
        block: u32,
        #[comptime] causal: bool,
        #[comptime] sparse: bool,
        #[comptime] head_dim: usize,
        #[define(F, O)] _dtypes: [StorageType; 2],
    ) {
        let dt = comptime!(head_dim / T);
        let ds = comptime!(padded(head_dim));
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let hk = h / group;
        let plane = UNIT_POS as usize / PLANE;
        let lane = UNIT_POS as usize % PLANE;
        let first_key = CUBE_POS_X as usize * ROWS;
        let local = plane * T + lane / 2usize;
        let key = first_key + local;
        let live = key < seq_k;
        let block = block as usize;

        let mut k_tile = SharedMemory::<F>::new_aligned(ROWS * ds, ALIGN);
        let mut v_tile = SharedMemory::<F>::new_aligned(ROWS * ds, ALIGN);
        let mut q_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut g_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut s_tile = SharedMemory::<f32>::new_aligned(ROWS * SS, ALIGN);
        // This unit's half row of probabilities, kept while dP takes the scores' place.
        let mut probs = Array::<f32>::new(HALF);
        let mut p_tile = SharedMemory::<F>::new_aligned(ROWS * PS, ALIGN);
        let mut ds_tile = SharedMemory::<F>::new_aligned(ROWS * PS, ALIGN);
        let mut lse_tile = SharedMemory::<f32>::new(KEYS);
        let mut delta_tile = SharedMemory::<f32>::new(KEYS);

        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        stage_pair::<F, N>(
            k,
            k_vectors,
            k_at,
            v,
            v_vectors,
            v_at,
            first_key,
            seq_k,
            &mut k_tile,
            &mut v_tile,
            ROWS,
            head_dim,
            ds,
        );
        let dk_acc = zero_accs(dt);
        let dv_acc = zero_accs(dt);

        let last_key = last_of(first_key, ROWS, seq_k);
        // Causal: query rows before this cube's first key see none of its keys.
        let mut first = 0;
        if causal {
            first = first_key;
        }
        // Causal: query rows from this unit's key on see it.
        let mut low = 0;
        if causal {
            low = key;
        }
        // Every other column from `half` as the forward (`column`); query rows `low..high`
        // see this key.
        let s_at = local * SS;
        let p_at = local * PS;
        let shift = column_shift(lane);
        let mut high = seq_q;
        if !live {
            high = 0;
        }
        let a_at = plane * T * ds;
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1);
        let lse_at = b * lse.stride(0) + h * lse.stride(1);
        let delta_at = b * delta.stride(0) + h * delta.stride(1);
        // The query tiles (block-sparse: those the layout keeps for these keys).
        let mut start = next_tile(
            layout, h, block, first_key, last_key, first, seq_q, seq_q, sparse, true,
        );
        while start < seq_q {
            stage_stat(lse, lse_at, start, seq_q, &mut lse_tile, 0usize, KEYS);
            stage_stat(delta, delta_at, start, seq_q, &mut delta_tile, 0usize, KEYS);
            stage_pair::<F, N>(
                q,
                q_vectors,
                q_at,
                d_out,
                d_out_vectors,
                g_at,
                start,
                seq_q,
                &mut q_tile,
                &mut g_tile,
                KEYS,
                head_dim,
                ds,
            );
            // Sᵀ = K·Qᵀ, then dPᵀ = V·dOᵀ in its place: rows are this plane's keys.
            scores_of::<F>(&k_tile, a_at, &q_tile, &mut s_tile, plane, dt, ds);
            sync_plane();
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let qi = start + c;
                let mut p = 0.0f32;
                if qi >= low && qi < high && (!sparse || block_kept(layout, h, block, qi, key)) {
                    p = f32::exp(s_tile[s_at + c] * scale - lse_tile[c]);
                }
                probs[j] = p;
                p_tile[p_at + c] = F::cast_from(p);
            }
            sync_plane();
            scores_of::<F>(&v_tile, a_at, &g_tile, &mut s_tile, plane, dt, ds);
            sync_plane();
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let d = probs[j] * (s_tile[s_at + c] - delta_tile[c]);
                ds_tile[p_at + c] = F::cast_from(d);
            }
            sync_plane();
            accumulate::<F>(&dv_acc, &p_tile, &g_tile, plane, dt, ds);
            accumulate::<F>(&dk_acc, &ds_tile, &q_tile, plane, dt, ds);
            sync_cube();
            start = next_tile(
                layout,
                h,
                block,
                first_key,
                last_key,
                start + KEYS,
                seq_q,
                seq_q,
                sparse,
                true,
            );
        }
        let dk_at = b * dk.stride(0) + h * dk.stride(1) + key * dk.stride(2);
        let dv_at = b * dv.stride(0) + h * dv.stride(1) + key * dv.stride(2);
        write_rows::<O>(
            &dk_acc,
            &mut s_tile,
            dk,
            dk_at,
            live,
            plane,
            lane,
            scale,
            dt,
        );
        write_rows::<O>(&dv_acc, &mut s_tile, dv, dv_at, live, plane, lane, 1.0, dt);
    }
}
pub(crate) use kernel::{tc_dkdv_kernel, tc_dq_kernel};
