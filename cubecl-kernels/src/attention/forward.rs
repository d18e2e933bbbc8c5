//! The forward kernel: one unit per query row, K/V tiles staged in shared memory, an online
//! softmax in f32. It writes the output and the row's log-sum-exp, nothing of size S×S.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `out[b, h, i] = softmax(scale·q_i·Kᵀ) V` over the keys row `i` sees (all, or `j ≤ i`
    /// when `causal`), with K/V head `h / (heads / kv_heads)`; `lse[b, h, i]` the natural
    /// log-sum-exp of the scaled scores. Cube `(x, y)`: query rows `x·rows ..`, head
    /// `y = b·heads + h`; `rows` units per cube, `keys` keys per shared tile.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn flash_forward_kernel<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        out: &mut Tensor<F>,
        lse: &mut Tensor<f32>,
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
        // Each unit's scores of the tile; rows padded by one against bank conflicts.
        let mut scores = SharedMemory::<f32>::new(rows * (keys + 1));
        let score_at = unit * (keys + 1);

        let mut qr = Array::<f32>::new(head_dim);
        let mut acc = Array::<f32>::new(head_dim);
        let q_at = b * q.stride(0) + h * q.stride(1) + row * q.stride(2);
        #[unroll]
        for d in 0..head_dim {
            let mut x = 0.0f32;
            if live {
                x = f32::cast_from(q[q_at + d * q.stride(3)]) * scale;
            }
            qr[d] = x;
            acc[d] = 0.0;
        }
        // Stands for −∞ in a masked score: WGSL has no infinite literal, and any real score
        // is far above it.
        let masked = f32::new(-1.0e30);
        let mut m = masked;
        let mut l = 0.0f32;

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
                let mut tile_max = m;
                for j in 0..keys {
                    let key = start + j;
                    let mut s = 0.0f32;
                    #[unroll]
                    for d in 0..head_dim {
                        s += qr[d] * k_tile[j * head_dim + d];
                    }
                    let valid = key < seq_k && (!causal || key <= row);
                    let mut score = masked;
                    if valid {
                        score = s;
                    }
                    scores[score_at + j] = score;
                    if score > tile_max {
                        tile_max = score;
                    }
                }
                let correction = f32::exp(m - tile_max);
                l *= correction;
                #[unroll]
                for d in 0..head_dim {
                    acc[d] *= correction;
                }
                m = tile_max;
                for j in 0..keys {
                    let key = start + j;
                    // Masked keys add nothing, not even a NaN of a value row never seen.
                    if key < seq_k && (!causal || key <= row) {
                        let p = f32::exp(scores[score_at + j] - m);
                        l += p;
                        #[unroll]
                        for d in 0..head_dim {
                            acc[d] += p * v_tile[j * head_dim + d];
                        }
                    }
                }
            }
            sync_cube();
            start += keys;
        }
        if live {
            let o_at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
            #[unroll]
            for d in 0..head_dim {
                out[o_at + d * out.stride(3)] = F::cast_from(acc[d] / l);
            }
            lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)] = m + f32::ln(l);
        }
    }
}
pub(crate) use kernel::flash_forward_kernel;
