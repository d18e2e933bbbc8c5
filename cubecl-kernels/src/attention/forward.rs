//! The forward kernel: each query row held by `lanes` units (a slice of the head dimension
//! each), K/V tiles staged in shared memory, an online softmax in f32. It writes the output and
//! the row's log-sum-exp, nothing of size S×S. With a block layout (`sparse`), tiles with no
//! kept block are skipped and pairs outside kept blocks masked.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    use super::super::lanes::{lane_dot, last_of, load_slice, stage_kv, store_slice};
    use super::super::sparse::{block_kept, tile_kept};

    /// `out[b, h, i] = softmax(scale·q_i·Kᵀ) V` over the keys row `i` sees (all, or `j ≤ i`
    /// when `causal`), with K/V head `h / (heads / kv_heads)`; `lse[b, h, i]` the natural
    /// log-sum-exp of the scaled scores. Cube `(x, y)`: query rows `x·rows ..`, head
    /// `y = b·heads + h`; `rows·lanes` units per cube, `keys` keys per shared tile. `sparse`:
    /// only pairs in blocks `layout[h, i / block, j / block] ≠ 0` count.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn flash_forward_kernel<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        out: &mut Tensor<F>,
        lse: &mut Tensor<f32>,
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
        let mut acc = Array::<f32>::new(width);
        let q_at = b * q.stride(0) + h * q.stride(1) + row * q.stride(2);
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
        #[unroll]
        for e in 0..width {
            acc[e] = 0.0;
        }
        // Stands for −∞ before any key is seen: WGSL has no infinite literal.
        let mut m = f32::new(-1.0e30);
        let mut l = 0.0f32;

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
                    // Every lane reaches the shuffle; the rest is per row.
                    let s = lane_dot(&qr, &k_tile, at, width, lanes);
                    let valid = live
                        && key < seq_k
                        && (!causal || key <= row)
                        && (!sparse || block_kept(layout, h, block, row, key));
                    // Masked keys add nothing, not even a NaN of a value row never seen.
                    if valid {
                        if s > m {
                            let correction = f32::exp(m - s);
                            l *= correction;
                            #[unroll]
                            for e in 0..width {
                                acc[e] *= correction;
                            }
                            m = s;
                        }
                        let p = f32::exp(s - m);
                        l += p;
                        #[unroll]
                        for e in 0..width {
                            acc[e] += p * v_tile[at + e];
                        }
                    }
                }
                sync_cube();
            }
            start += keys;
        }
        // A row that keeps no block (block-sparse only) gets zeros and a log-sum-exp of 0.
        let mut norm = l;
        if l == 0.0 {
            norm = 1.0;
            m = 0.0;
        }
        let o_at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
        let inv = 1.0 / norm;
        store_slice::<F>(
            out,
            o_at,
            out.stride(3),
            lane,
            live,
            inv,
            &acc,
            width,
            head_dim,
        );
        if live && lane == 0 {
            lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)] = m + f32::ln(norm);
        }
    }
}
pub(crate) use kernel::flash_forward_kernel;
