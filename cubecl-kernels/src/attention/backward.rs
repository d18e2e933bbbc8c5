//! The backward kernels: the probabilities are recomputed from the saved log-sum-exp, tile by
//! tile, so nothing of size S×S exists. Three launches and no atomics:
//! - `delta`: `Δ_i = dO_i · O_i` per query row;
//! - `dq`: one unit per query row over the key tiles (as the forward);
//! - `dkdv`: one unit per key row over the query tiles of every query head that reads it
//!   (grouped-query attention sums there, in registers).
//!
//! With `s_ij = scale·q_i·k_j`, `p_ij = exp(s_ij − lse_i)`, `ds_ij = p_ij (dO_i·v_j − Δ_i)`:
//! `dv_j = Σ_i p_ij dO_i`, `dk_j = scale Σ_i ds_ij q_i`, `dq_i = scale Σ_j ds_ij k_j`.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

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

    /// `dq` for `rows` query rows per cube (cube `(x, y)` as the forward's), K/V tiles of
    /// `keys` rows in shared memory.
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
        scale: f32,
        #[comptime] causal: bool,
        #[comptime] head_dim: usize,
        #[comptime] rows: usize,
        #[comptime] keys: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let heads = q.shape(1);
        let group = heads / k.shape(1);
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / heads;
        let h = CUBE_POS_Y as usize % heads;
        let unit = UNIT_POS_X as usize;
        let first_row = CUBE_POS_X as usize * rows;
        let row = first_row + unit;
        let live = row < seq_q;

        let mut k_tile = SharedMemory::<f32>::new(keys * head_dim);
        let mut v_tile = SharedMemory::<f32>::new(keys * head_dim);
        let mut qr = Array::<f32>::new(head_dim);
        let mut gr = Array::<f32>::new(head_dim);
        let mut acc = Array::<f32>::new(head_dim);
        let q_at = b * q.stride(0) + h * q.stride(1) + row * q.stride(2);
        let g_at = b * d_out.stride(0) + h * d_out.stride(1) + row * d_out.stride(2);
        let mut row_lse = 0.0f32;
        let mut row_delta = 0.0f32;
        if live {
            row_lse = lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)];
            row_delta = delta[b * delta.stride(0) + h * delta.stride(1) + row * delta.stride(2)];
        }
        #[unroll]
        for d in 0..head_dim {
            let mut x = 0.0f32;
            let mut g = 0.0f32;
            if live {
                x = f32::cast_from(q[q_at + d * q.stride(3)]) * scale;
                g = f32::cast_from(d_out[g_at + d * d_out.stride(3)]);
            }
            qr[d] = x;
            gr[d] = g;
            acc[d] = 0.0;
        }

        let mut kv_end = seq_k;
        if causal && first_row + rows < seq_k {
            kv_end = first_row + rows;
        }
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        let mut start = 0;
        while start < kv_end {
            let mut e = unit;
            while e < keys * head_dim {
                let key = start + e / head_dim;
                let d = e % head_dim;
                let mut kx = 0.0f32;
                let mut vx = 0.0f32;
                if key < seq_k {
                    kx = f32::cast_from(k[k_at + key * k.stride(2) + d * k.stride(3)]);
                    vx = f32::cast_from(v[v_at + key * v.stride(2) + d * v.stride(3)]);
                }
                k_tile[e] = kx;
                v_tile[e] = vx;
                e += rows;
            }
            sync_cube();
            if live {
                for j in 0..keys {
                    let key = start + j;
                    if key < seq_k && (!causal || key <= row) {
                        let mut s = 0.0f32;
                        let mut dp = 0.0f32;
                        #[unroll]
                        for d in 0..head_dim {
                            s += qr[d] * k_tile[j * head_dim + d];
                            dp += gr[d] * v_tile[j * head_dim + d];
                        }
                        let ds = f32::exp(s - row_lse) * (dp - row_delta);
                        #[unroll]
                        for d in 0..head_dim {
                            acc[d] += ds * k_tile[j * head_dim + d];
                        }
                    }
                }
            }
            sync_cube();
            start += keys;
        }
        if live {
            let at = b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2);
            #[unroll]
            for d in 0..head_dim {
                dq[at + d * dq.stride(3)] = F::cast_from(acc[d] * scale);
            }
        }
    }

    /// `dk`, `dv` for `keys` key rows per cube: cube `(x, y)` = key rows `x·keys ..`, K/V head
    /// `y = b·kv_heads + hk`; query tiles of `rows` rows in shared memory, for each of the
    /// `heads / kv_heads` query heads that read this K/V head.
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
        scale: f32,
        #[comptime] causal: bool,
        #[comptime] head_dim: usize,
        #[comptime] keys: usize,
        #[comptime] rows: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let heads = q.shape(1);
        let kv_heads = k.shape(1);
        let group = heads / kv_heads;
        let seq_q = q.shape(2);
        let seq_k = k.shape(2);
        let b = CUBE_POS_Y as usize / kv_heads;
        let hk = CUBE_POS_Y as usize % kv_heads;
        let unit = UNIT_POS_X as usize;
        let first_key = CUBE_POS_X as usize * keys;
        let key = first_key + unit;
        let live = key < seq_k;

        let mut q_tile = SharedMemory::<f32>::new(rows * head_dim);
        let mut g_tile = SharedMemory::<f32>::new(rows * head_dim);
        let mut lse_tile = SharedMemory::<f32>::new(rows);
        let mut delta_tile = SharedMemory::<f32>::new(rows);
        let mut kr = Array::<f32>::new(head_dim);
        let mut vr = Array::<f32>::new(head_dim);
        let mut dk_acc = Array::<f32>::new(head_dim);
        let mut dv_acc = Array::<f32>::new(head_dim);
        let k_at = b * k.stride(0) + hk * k.stride(1) + key * k.stride(2);
        let v_at = b * v.stride(0) + hk * v.stride(1) + key * v.stride(2);
        #[unroll]
        for d in 0..head_dim {
            let mut kx = 0.0f32;
            let mut vx = 0.0f32;
            if live {
                kx = f32::cast_from(k[k_at + d * k.stride(3)]);
                vx = f32::cast_from(v[v_at + d * v.stride(3)]);
            }
            kr[d] = kx;
            vr[d] = vx;
            dk_acc[d] = 0.0;
            dv_acc[d] = 0.0;
        }

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
                let mut e = unit;
                while e < rows * head_dim {
                    let qi = start + e / head_dim;
                    let d = e % head_dim;
                    let mut x = 0.0f32;
                    let mut gx = 0.0f32;
                    if qi < seq_q {
                        x = f32::cast_from(q[q_at + qi * q.stride(2) + d * q.stride(3)]) * scale;
                        gx = f32::cast_from(
                            d_out[g_at + qi * d_out.stride(2) + d * d_out.stride(3)],
                        );
                    }
                    q_tile[e] = x;
                    g_tile[e] = gx;
                    e += keys;
                }
                let mut e = unit;
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
                    e += keys;
                }
                sync_cube();
                if live {
                    for i in 0..rows {
                        let qi = start + i;
                        if qi < seq_q && (!causal || qi >= key) {
                            let mut s = 0.0f32;
                            let mut dp = 0.0f32;
                            #[unroll]
                            for d in 0..head_dim {
                                s += q_tile[i * head_dim + d] * kr[d];
                                dp += g_tile[i * head_dim + d] * vr[d];
                            }
                            let p = f32::exp(s - lse_tile[i]);
                            let ds = p * (dp - delta_tile[i]);
                            #[unroll]
                            for d in 0..head_dim {
                                dv_acc[d] += p * g_tile[i * head_dim + d];
                                // q_tile holds scale·q: dk = scale Σ ds q.
                                dk_acc[d] += ds * q_tile[i * head_dim + d];
                            }
                        }
                    }
                }
                sync_cube();
                start += rows;
            }
        }
        if live {
            let dk_at = b * dk.stride(0) + hk * dk.stride(1) + key * dk.stride(2);
            let dv_at = b * dv.stride(0) + hk * dv.stride(1) + key * dv.stride(2);
            #[unroll]
            for d in 0..head_dim {
                dk[dk_at + d * dk.stride(3)] = F::cast_from(dk_acc[d]);
                dv[dv_at + d * dv.stride(3)] = F::cast_from(dv_acc[d]);
            }
        }
    }
}
pub(crate) use kernel::{flash_delta_kernel, flash_dkdv_kernel, flash_dq_kernel};
