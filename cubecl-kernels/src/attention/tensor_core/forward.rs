//! The tensor-core forward: per cube 64 query rows (16 per plane) against key tiles of 64;
//! `Q·Kᵀ` and `P·V` on 16×16×16 fragments with f32 accumulators, the online softmax on the
//! scores in shared memory. The output accumulators stay in fragments: their rows are rescaled
//! (through shared memory) only when a row's running maximum grows by more than [`SLACK`], so
//! after the first tiles most tiles need no rescale.

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    use super::super::super::lanes::last_of;
    use super::super::super::sparse::block_kept;
    use super::super::tiles::{
        ALIGN, HALF, KEYS, PLANE, PS, ROWS, SS, T, accumulate, column, column_shift, frags_a,
        next_tile, padded, scale_rows, scores_of_frags, stage, stage_pair, write_rows, zero_accs,
    };
    use super::SLACK;

    /// As `flash_forward_kernel` (same arguments and results) on tensor cores: elements of
    /// `F` (f16 or bf16), `head_dim` a multiple of 16; cube `(x, y)`: query rows
    /// `64·x ..`, head `y = b·heads + h`; 128 units.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn tc_forward_kernel<F: Float, N: Size>(
        q: &Tensor<F>,
        q_vectors: &Tensor<Vector<F, N>>,
        k: &Tensor<F>,
        k_vectors: &Tensor<Vector<F, N>>,
        v: &Tensor<F>,
        v_vectors: &Tensor<Vector<F, N>>,
        out: &mut Tensor<F>,
        lse: &mut Tensor<f32>,
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
        let half = lane % 2usize;
        let first_row = CUBE_POS_X as usize * ROWS;
        let local = plane * T + lane / 2usize;
        let row = first_row + local;
        let live = row < seq_q;
        let block = block as usize;

        let mut k_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut v_tile = SharedMemory::<F>::new_aligned(KEYS * ds, ALIGN);
        let mut s_tile = SharedMemory::<f32>::new_aligned(ROWS * SS, ALIGN);
        let mut p_tile = SharedMemory::<F>::new_aligned(ROWS * PS, ALIGN);

        let q_at = b * q.stride(0) + h * q.stride(1);
        // Q passes through the K tile into fragments held for the whole walk.
        stage::<F, N>(
            q,
            q_vectors,
            q_at,
            first_row,
            seq_q,
            &mut k_tile,
            ROWS,
            head_dim,
            ds,
        );
        sync_cube();
        let qf = frags_a::<F>(&k_tile, plane * T * ds, dt, ds);
        sync_cube();
        let o = zero_accs(dt);
        // Stands for −∞ before any key is seen.
        let mut m = f32::new(-1.0e30);
        // This unit's half of the row's sum.
        let mut l = 0.0f32;

        let mut kv_end = seq_k;
        if causal {
            kv_end = last_of(first_row, ROWS, seq_k) + 1;
        }
        let last_row = last_of(first_row, ROWS, seq_q);
        let hk = h / group;
        let k_at = b * k.stride(0) + hk * k.stride(1);
        let v_at = b * v.stride(0) + hk * v.stride(1);
        // This unit's columns: every other one from `half`, in the order of `column`.
        let s_at = local * SS;
        let p_at = local * PS;
        let shift = column_shift(lane);
        // Keys this unit's row sees: those below `limit`.
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

            // The row's maximum over the keys it sees, both units' columns.
            let mut mx = f32::new(-1.0e30);
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let key = start + c;
                if key < limit && (!sparse || block_kept(layout, h, block, row, key)) {
                    mx = f32::max(mx, s_tile[s_at + c] * scale);
                }
            }
            mx = f32::max(mx, plane_shuffle_xor(mx, 1));
            let mut factor = 1.0f32;
            let grow = mx > m + SLACK;
            if grow {
                factor = f32::exp(m - mx);
                l *= factor;
                m = mx;
            }
            #[unroll]
            for j in 0..HALF {
                let c = column(j, shift);
                let key = start + c;
                let mut p = 0.0f32;
                // A NaN score (not compared against anything) gives a NaN probability.
                if key < limit && (!sparse || block_kept(layout, h, block, row, key)) {
                    p = f32::exp(s_tile[s_at + c] * scale - m);
                }
                l += p;
                p_tile[p_at + c] = F::cast_from(p);
            }
            sync_plane();
            if plane_any(grow) {
                scale_rows(&o, &mut s_tile, plane, lane, factor, dt);
            }
            accumulate::<F>(&o, &p_tile, &v_tile, plane, dt, ds);
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
        let total = l + plane_shuffle_xor(l, 1);
        // A row that keeps no block (block-sparse only) gets zeros and a log-sum-exp of 0.
        let mut norm = total;
        if total == 0.0 {
            norm = 1.0;
            m = 0.0;
        }
        let o_at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
        write_rows::<F>(
            &o,
            &mut s_tile,
            out,
            o_at,
            live,
            plane,
            lane,
            1.0 / norm,
            dt,
        );
        if live && half == 0 {
            lse[b * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)] = m + f32::ln(norm);
        }
    }
}
pub(crate) use kernel::tc_forward_kernel;

/// How far (in natural-log units) a row's maximum may grow before its output is rescaled:
/// probabilities then reach at most e⁸ ≈ 2981 before normalization, far inside f16/bf16 and
/// f32 range, and the rescale, a round trip of the accumulators through shared memory, is
/// rare after a row's first tiles.
const SLACK: f32 = 8.0;
