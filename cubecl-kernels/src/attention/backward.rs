//! The backward kernels: the probabilities are recomputed from the saved log-sum-exp, tile by
//! tile, so nothing of size S×S exists. Three launches and no atomics:
//! - `delta`: `Δ_i = dO_i · O_i` per query row;
//! - `dq`: a query row per `lanes` units over the key tiles (as the forward);
//! - `dkdv`: a key row per `lanes` units over the query tiles of every query head that reads
//!   it (grouped-query attention sums there, in registers).
//!
//! With `s_ij = scale·q_i·k_j`, `p_ij = exp(s_ij − lse_i)`, `ds_ij = p_ij (dO_i·v_j − Δ_i)`:
//! `dv_j = Σ_i p_ij dO_i`, `dk_j = scale Σ_i ds_ij q_i`, `dq_i = scale Σ_j ds_ij k_j`.
//! Block-sparse as the forward: tiles without a kept block skipped, other pairs masked.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    use super::super::lanes::{lane_dot, last_of, load_slice, stage_kv, stage_rows, store_slice};
    use super::super::sparse::{block_kept, tile_kept};

    /// `delta[b, h, i] = Σ_d out[b, h, i, d]·d_out[b, h, i, d]` in f32. Cube `y` = `b·heads + h`.
    #[cube(launch_unchecked)]
    pub fn flash_delta_kernel<F: Float>(
        out: &Tensor<F>,
        d_out: &Tensor<F>,
        delta: &mut Tensor<f32>,
        #[comptime] head_dim: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let heads = out.shape(1);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let row = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        if row < out.shape(2) {
            let o_at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
            let g_at = b * d_out.stride(0) + h * d_out.stride(1) + row * d_out.stride(2);
            let mut sum = 0.0f32;
            #[unroll]
            for d in 0..head_dim {
                sum += f32::cast_from(out[o_at + d * out.stride(3)])
                    * f32::cast_from(d_out[g_at + d * d_out.stride(3)]);
            }
            delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)] = sum;
        }
    }

    /// `dq` for `rows` query rows per cube (cube `(x, y)` as the forward's, `rows·lanes`
    /// units), K/V tiles of `keys` rows in shared memory.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn flash_dq_kernel<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        d_out: &Tensor<F>,
        lse: &Tensor<f32>,
        delta: &Tensor<f32>,
        dq: &mut Tensor<F>,
        layout: &Tensor<u32>,
        scale: f32,
        block: u32,
        #[comptime] causal: bool,
        #[comptime] sparse: bool,
        #[comptime] head_dim: usize,
        #[comptime] rows: usize,
        #[comptime] keys: usize,
        #[comptime] lanes: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let width = comptime!(head_dim / lanes);
        let units = comptime!(rows * lanes);
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let lane = UNIT_POS_X as usize % lanes;
        let first_row = CUBE_POS_X as usize * rows;
        let row = first_row + UNIT_POS_X as usize / lanes;
        let live = row < seq_q;
        let block = block as usize;

        let mut k_tile = SharedMemory::<f32>::new(keys * head_dim);
        let mut v_tile = SharedMemory::<f32>::new(keys * head_dim);
        let mut qr = Array::<f32>::new(width);
        let mut gr = Array::<f32>::new(width);
        let mut acc = Array::<f32>::new(width);
        let q_at = b * q.stride(0) + h * q.stride(1) + row * q.stride(2);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1) + row * d_out.stride(2);
        load_slice::<F>(
            q,
            q_at,
            q.stride(3),
            lane,
            live,
            scale,
            &mut qr,
            width,
            head_dim,
        );
        let gd = d_out.stride(3);
        load_slice::<F>(d_out, g_at, gd, lane, live, 1.0, &mut gr, width, head_dim);
        #[unroll]
        for e in 0..width {
            acc[e] = 0.0;
        }
        let mut row_lse = 0.0f32;
        let mut row_delta = 0.0f32;
        if live {
            row_lse = lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)];
            row_delta = delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)];
        }

        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, rows, seq_k) + 1;
        }
        let last_row = last_of(first_row, rows, seq_q);
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        let mut start = 0;
        while start < kv_end {
            let last_key = last_of(start, keys, seq_k);
            if !sparse || tile_kept(layout, h, block, first_row, last_row, start, last_key) {
                let (kt, vt) = (&mut k_tile, &mut v_tile);
                stage_kv::<F>(
                    k, v, k_at, v_at, start, seq_k, kt, vt, keys, head_dim, units,
                );
                sync_cube();
                for j in 0..keys {
                    let key = start + j;
                    let at = j * head_dim + lane * width;
                    let s = lane_dot(&qr, &k_tile, at, width, lanes);
                    let dp = lane_dot(&gr, &v_tile, at, width, lanes);
                    if live
                        && key < seq_k
                        && (!causal || key <= row)
                        && (!sparse || block_kept(layout, h, block, row, key))
                    {
                        let ds = f32::exp(s - row_lse) * (dp - row_delta);
                        #[unroll]
                        for e in 0..width {
                            acc[e] += ds * k_tile[at + e];
                        }
                    }
                }
                sync_cube();
            }
            start += keys;
        }
        let at = b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2);
        store_slice::<F>(
            dq,
            at,
            dq.stride(3),
            lane,
            live,
            scale,
            &acc,
            width,
            head_dim,
        );
    }

    /// `dk`, `dv` for `keys` key rows per cube (`keys·lanes` units): cube `(x, y)` = key rows
    /// `x·keys ..`, K/V head `y = b·kv_heads + hk`; query tiles of `rows` rows in shared
    /// memory, for each of the `heads / kv_heads` query heads that read this K/V head.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn flash_dkdv_kernel<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        d_out: &Tensor<F>,
        lse: &Tensor<f32>,
        delta: &Tensor<f32>,
        dk: &mut Tensor<F>,
        dv: &mut Tensor<F>,
        layout: &Tensor<u32>,
        scale: f32,
        block: u32,
        #[comptime] causal: bool,
        #[comptime] sparse: bool,
        #[comptime] head_dim: usize,
        #[comptime] keys: usize,
        #[comptime] rows: usize,
        #[comptime] lanes: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let width = comptime!(head_dim / lanes);
        let units = comptime!(keys * lanes);
        let heads = q.shape(1);
        let kv_heads = k.shape(1);
        let group = heads / kv_heads;
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / kv_heads;
        let hk = CUBE_POS_Y as usize % kv_heads;
        let lane = UNIT_POS_X as usize % lanes;
        let first_key = CUBE_POS_X as usize * keys;
        let key = first_key + UNIT_POS_X as usize / lanes;
        let live = key < seq_k;
        let block = block as usize;

        let mut q_tile = SharedMemory::<f32>::new(rows * head_dim);
        let mut g_tile = SharedMemory::<f32>::new(rows * head_dim);
        let mut lse_tile = SharedMemory::<f32>::new(rows);
        let mut delta_tile = SharedMemory::<f32>::new(rows);
        let mut kr = Array::<f32>::new(width);
        let mut vr = Array::<f32>::new(width);
        let mut dk_acc = Array::<f32>::new(width);
        let mut dv_acc = Array::<f32>::new(width);
        let k_at = b * k.stride(0) + hk * k.stride(1) + key * k.stride(2);
        let v_at = b * v.stride(0) + hk * v.stride(1) + key * v.stride(2);
        load_slice::<F>(
            k,
            k_at,
            k.stride(3),
            lane,
            live,
            1.0,
            &mut kr,
            width,
            head_dim,
        );
        load_slice::<F>(
            v,
            v_at,
            v.stride(3),
            lane,
            live,
            1.0,
            &mut vr,
            width,
            head_dim,
        );
        #[unroll]
        for e in 0..width {
            dk_acc[e] = 0.0;
            dv_acc[e] = 0.0;
        }

        let last_key = last_of(first_key, keys, seq_k);
        // Causal: query rows before this cube's first key see none of its keys.
        let mut first = 0;
        if causal {
            first = first_key / rows * rows;
        }
        for g in 0..group {
            let h = hk * group + g;
            let q_at = b * q.stride(0) + h * q.stride(1);
            let g_at = b * d_out.stride(0) + h * d_out.stride(1);
            let lse_at = b * lse.stride(0) + h * lse.stride(1);
            let delta_at = b * delta.stride(0) + h * delta.stride(1);
            let mut start = first;
            while start < seq_q {
                let last_row = last_of(start, rows, seq_q);
                if !sparse || tile_kept(layout, h, block, start, last_row, first_key, last_key) {
                    let (qs, qd) = (q.stride(2), q.stride(3));
                    let (gs, gd) = (d_out.stride(2), d_out.stride(3));
                    stage_rows::<F>(
                        q,
                        q_at,
                        qs,
                        qd,
                        start,
                        seq_q,
                        scale,
                        &mut q_tile,
                        rows,
                        head_dim,
                        units,
                    );
                    stage_rows::<F>(
                        d_out,
                        g_at,
                        gs,
                        gd,
                        start,
                        seq_q,
                        1.0,
                        &mut g_tile,
                        rows,
                        head_dim,
                        units,
                    );
                    let mut e = UNIT_POS_X as usize;
                    while e < rows {
                        let qi = start + e;
                        let mut x = 0.0f32;
                        let mut dx = 0.0f32;
                        if qi < seq_q {
                            x = lse[lse_at + qi * lse.stride(2)];
                            dx = delta[delta_at + qi * delta.stride(2)];
                        }
                        lse_tile[e] = x;
                        delta_tile[e] = dx;
                        e += units;
                    }
                    sync_cube();
                    for i in 0..rows {
                        let qi = start + i;
                        let at = i * head_dim + lane * width;
                        // q_tile holds scale·q: s is the scaled score, dk = scale Σ ds q.
                        let s = lane_dot(&kr, &q_tile, at, width, lanes);
                        let dp = lane_dot(&vr, &g_tile, at, width, lanes);
                        if live
                            && qi < seq_q
                            && (!causal || qi >= key)
                            && (!sparse || block_kept(layout, h, block, qi, key))
                        {
                            let p = f32::exp(s - lse_tile[i]);
                            let ds = p * (dp - delta_tile[i]);
                            #[unroll]
                            for e in 0..width {
                                dv_acc[e] += p * g_tile[at + e];
                                dk_acc[e] += ds * q_tile[at + e];
                            }
                        }
                    }
                    sync_cube();
                }
                start += rows;
            }
        }
        let dk_at = b * dk.stride(0) + hk * dk.stride(1) + key * dk.stride(2);
        let dv_at = b * dv.stride(0) + hk * dv.stride(1) + key * dv.stride(2);
        store_slice::<F>(
            dk,
            dk_at,
            dk.stride(3),
            lane,
            live,
            1.0,
            &dk_acc,
            width,
            head_dim,
        );
        store_slice::<F>(
            dv,
            dv_at,
            dv.stride(3),
            lane,
            live,
            1.0,
            &dv_acc,
            width,
            head_dim,
        );
    }
}
pub(crate) use kernel::{flash_delta_kernel, flash_dkdv_kernel, flash_dq_kernel};
