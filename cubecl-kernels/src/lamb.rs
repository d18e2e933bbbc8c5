//! Fused LAMB in CubeCL over a flat partition of many tensors, in two passes around one small
//! read-back. LAMB scales each tensor's Adam update by a trust ratio `‖w‖ / ‖update‖` whose
//! norms span the whole tensor, and under ZeRO a tensor may be split across ranks: the norms
//! must be summed across them before any weight moves. So:
//! 1. [`lamb_moments`]: new moments into new buffers and, per piece of the partition (a
//!    tensor's elements here, or a gap between tensors), the sums of `w²` and `update²`;
//! 2. the caller reads those sums back, adds them across ranks, and makes a step size per
//!    piece (`lr · trust`, 0 for gaps);
//! 3. [`lamb_apply`]: `w − step · update`, the update recomputed from the new moments.
//!
//! burn 0.21's tensor ops take about 20 passes over the partition for the same step (with a
//! slice per tensor); these take 10, and one launch per pass whatever the number of tensors.

use std::ops::Range;

use cubecl::prelude::*;

/// Elements per cube in the elementwise passes; a block never spans two pieces.
pub const BLOCK: usize = 2048;
/// Units per cube.
const UNITS: usize = 256;

/// The constants of one LAMB step, as the engine's tensor ops use them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambConstants {
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// `weight_decay`, added to the update (`update = m̂/(√v̂ + ε) + wd·w`).
    pub weight_decay: f32,
    /// `1 − β1ᵗ` (1 without bias correction).
    pub bias_correction1: f32,
    /// `1 − β2ᵗ` (1 without bias correction).
    pub bias_correction2: f32,
}

/// How the kernels walk a partition: consecutive pieces covering `0..len`, each cut into
/// blocks of at most [`BLOCK`] elements. Pure data; [`LambPlan::upload`] puts it on a device.
#[derive(Clone, Debug, PartialEq)]
pub struct LambPlan {
    len: usize,
    /// `(start, len, piece)` of each block.
    blocks: Vec<u32>,
    /// The first block of each piece, then the number of blocks.
    piece_blocks: Vec<u32>,
}

/// A [`LambPlan`] on a device: its two index arrays.
pub struct LambPlanHandles {
    blocks: cubecl::server::Handle,
    piece_blocks: cubecl::server::Handle,
}

impl LambPlan {
    /// The plan of a partition of `len` elements cut into `pieces`, consecutive ranges that
    /// cover `0..len` (empty ones allowed). Panics otherwise, naming the first bad piece.
    pub fn new(len: usize, pieces: &[Range<usize>]) -> Self {
        assert!(
            len < u32::MAX as usize,
            "a LAMB partition of {len} elements exceeds u32 indexing"
        );
        let (mut blocks, mut piece_blocks, mut at) = (Vec::new(), Vec::new(), 0);
        for (p, piece) in pieces.iter().enumerate() {
            assert_eq!(
                piece.start, at,
                "LAMB piece {p} ({piece:?}) does not start where the last ended"
            );
            piece_blocks.push((blocks.len() / 3) as u32);
            for start in (piece.start..piece.end).step_by(BLOCK) {
                let n = BLOCK.min(piece.end - start);
                blocks.extend([start as u32, n as u32, p as u32]);
            }
            at = piece.end;
        }
        assert_eq!(at, len, "the LAMB pieces cover 0..{at}, not 0..{len}");
        piece_blocks.push((blocks.len() / 3) as u32);
        Self {
            len,
            blocks,
            piece_blocks,
        }
    }

    /// Pieces in the plan.
    pub fn pieces(&self) -> usize {
        self.piece_blocks.len() - 1
    }

    fn block_count(&self) -> usize {
        self.blocks.len() / 3
    }

    /// The plan's index arrays on `client`'s device (once per partition).
    pub fn upload<R: Runtime>(&self, client: &ComputeClient<R>) -> LambPlanHandles {
        // A buffer is never empty: a plan without blocks still uploads one word.
        let words = |v: &[u32]| {
            let v = if v.is_empty() { &[0u32][..] } else { v };
            client.create_from_slice(u32::as_bytes(v))
        };
        LambPlanHandles {
            blocks: words(&self.blocks),
            piece_blocks: words(&self.piece_blocks),
        }
    }
}

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// Adam's update of LAMB from the new moments, in the tensor ops' order.
    #[cube]
    pub fn lamb_update(w: f32, m: f32, v: f32, eps: f32, wd: f32, bc1: f32, bc2: f32) -> f32 {
        let denom = f32::sqrt(v / bc2) + eps;
        m / bc1 / denom + wd * w
    }

    /// This cube's index in a 2-D grid (a 1-D one is limited to 65535 cubes on some APIs).
    #[cube]
    fn cube_index() -> usize {
        (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
    }

    /// The sums of `a` and `b` over the cube's units, into `out[at]` and `out[at + 1]`.
    #[cube]
    fn cube_sums_into(a: f32, b: f32, out: &mut Array<f32>, at: usize, #[comptime] units: usize) {
        let mut sa = SharedMemory::<f32>::new(units);
        let mut sb = SharedMemory::<f32>::new(units);
        let u = UNIT_POS_X as usize;
        sa[u] = a;
        sb[u] = b;
        sync_cube();
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if u < stride {
                sa[u] += sa[u + stride];
                sb[u] += sb[u + stride];
            }
            sync_cube();
            stride /= 2;
        }
        if u == 0 {
            out[at] = sa[0];
            out[at + 1] = sb[0];
        }
    }

    /// One block per cube: new `m`, `v` into `m_out`, `v_out`, and the block's sums of `w²`
    /// and `update²` into `partials[2·block ..]`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn lamb_moments_kernel(
        master: &Array<f32>,
        grad: &Array<f32>,
        m: &Array<f32>,
        v: &Array<f32>,
        m_out: &mut Array<f32>,
        v_out: &mut Array<f32>,
        partials: &mut Array<f32>,
        blocks: &Array<u32>,
        beta1: f32,
        beta2: f32,
        eps: f32,
        wd: f32,
        bc1: f32,
        bc2: f32,
        #[comptime] units: usize,
    ) {
        let block = cube_index();
        if block * 3 >= blocks.len() {
            terminate!();
        }
        let start = blocks[block * 3] as usize;
        let n = blocks[block * 3 + 1] as usize;
        let mut ww = 0.0f32;
        let mut uu = 0.0f32;
        let mut i = UNIT_POS_X as usize;
        while i < n {
            let at = start + i;
            let w = master[at];
            let g = grad[at];
            let m_new = m[at] * beta1 + g * (1.0 - beta1);
            let v_new = v[at] * beta2 + g * (1.0 - beta2) * g;
            m_out[at] = m_new;
            v_out[at] = v_new;
            let u = lamb_update(w, m_new, v_new, eps, wd, bc1, bc2);
            ww += w * w;
            uu += u * u;
            i += units;
        }
        cube_sums_into(ww, uu, partials, block * 2, units);
    }

    /// One piece per cube: the sums of its blocks' partial sums into `sums[2·piece ..]`.
    #[cube(launch_unchecked)]
    pub fn lamb_piece_sums_kernel(
        partials: &Array<f32>,
        piece_blocks: &Array<u32>,
        sums: &mut Array<f32>,
        #[comptime] units: usize,
    ) {
        let piece = cube_index();
        if piece + 1 >= piece_blocks.len() {
            terminate!();
        }
        let end = piece_blocks[piece + 1] as usize;
        let mut ww = 0.0f32;
        let mut uu = 0.0f32;
        let mut b = piece_blocks[piece] as usize + UNIT_POS_X as usize;
        while b < end {
            ww += partials[b * 2];
            uu += partials[b * 2 + 1];
            b += units;
        }
        cube_sums_into(ww, uu, sums, piece * 2, units);
    }

    /// One block per cube: `w_out = w − step[piece] · update`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn lamb_apply_kernel(
        master: &Array<f32>,
        m: &Array<f32>,
        v: &Array<f32>,
        steps: &Array<f32>,
        master_out: &mut Array<f32>,
        blocks: &Array<u32>,
        eps: f32,
        wd: f32,
        bc1: f32,
        bc2: f32,
        #[comptime] units: usize,
    ) {
        let block = cube_index();
        if block * 3 >= blocks.len() {
            terminate!();
        }
        let start = blocks[block * 3] as usize;
        let n = blocks[block * 3 + 1] as usize;
        let step = steps[blocks[block * 3 + 2] as usize];
        let mut i = UNIT_POS_X as usize;
        while i < n {
            let at = start + i;
            let w = master[at];
            master_out[at] = w - lamb_update(w, m[at], v[at], eps, wd, bc1, bc2) * step;
            i += units;
        }
    }
}
pub use kernel::{lamb_apply_kernel, lamb_moments_kernel, lamb_piece_sums_kernel};

/// A 2-D grid of `n` cubes (at most 65535 along x).
fn grid(n: usize) -> CubeCount {
    let x = n.clamp(1, 65535);
    CubeCount::Static(x as u32, n.div_ceil(x).max(1) as u32, 1)
}

/// Pass 1 of a LAMB step on `client`: the new `m`, `v` into `m_out`, `v_out` (each `plan`'s
/// `len` f32; the inputs are only read) and a new buffer of `2 · pieces` f32, the sums of `w²`
/// and `update²` over each piece of this partition (this rank's share of the norms).
pub fn lamb_moments<R: Runtime>(
    client: &ComputeClient<R>,
    k: &LambConstants,
    plan: &LambPlan,
    on_device: &LambPlanHandles,
    [master, grad, m, v]: [&cubecl::server::Handle; 4],
    [m_out, v_out]: [&cubecl::server::Handle; 2],
) -> cubecl::server::Handle {
    let (len, blocks) = (plan.len, plan.block_count());
    let partials = client.empty(4 * 2 * blocks.max(1));
    let sums = client.empty(4 * 2 * plan.pieces().max(1));
    let arg =
        |h: &cubecl::server::Handle, n: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), n) };
    // SAFETY: the buffers hold `len` f32 each, the plan's blocks lie within `0..len` and its
    // pieces' blocks within the partials; the kernels check the grid against the plan.
    unsafe {
        lamb_moments_kernel::launch_unchecked::<R>(
            client,
            grid(blocks),
            CubeDim::new_1d(UNITS as u32),
            arg(master, len),
            arg(grad, len),
            arg(m, len),
            arg(v, len),
            arg(m_out, len),
            arg(v_out, len),
            arg(&partials, 2 * blocks),
            arg(&on_device.blocks, plan.blocks.len()),
            k.beta1,
            k.beta2,
            k.eps,
            k.weight_decay,
            k.bias_correction1,
            k.bias_correction2,
            UNITS,
        );
        lamb_piece_sums_kernel::launch_unchecked::<R>(
            client,
            grid(plan.pieces()),
            CubeDim::new_1d(UNITS as u32),
            arg(&partials, 2 * blocks),
            arg(&on_device.piece_blocks, plan.piece_blocks.len()),
            arg(&sums, 2 * plan.pieces()),
            UNITS,
        );
    }
    sums
}

/// Pass 2: `master_out = master − steps[piece] · update` from the new moments of
/// [`lamb_moments`]; `steps` holds `lr · trust` per piece (`plan.pieces()` f32).
pub fn lamb_apply<R: Runtime>(
    client: &ComputeClient<R>,
    k: &LambConstants,
    plan: &LambPlan,
    on_device: &LambPlanHandles,
    [master, m_new, v_new]: [&cubecl::server::Handle; 3],
    steps: &[f32],
    master_out: &cubecl::server::Handle,
) {
    assert_eq!(steps.len(), plan.pieces(), "one step size per LAMB piece");
    let len = plan.len;
    let steps_handle =
        client.create_from_slice(f32::as_bytes(if steps.is_empty() { &[0.0] } else { steps }));
    let arg =
        |h: &cubecl::server::Handle, n: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), n) };
    // SAFETY: as in `lamb_moments`; every block's piece indexes `steps`.
    unsafe {
        lamb_apply_kernel::launch_unchecked::<R>(
            client,
            grid(plan.block_count()),
            CubeDim::new_1d(UNITS as u32),
            arg(master, len),
            arg(m_new, len),
            arg(v_new, len),
            arg(&steps_handle, steps.len()),
            arg(master_out, len),
            arg(&on_device.blocks, plan.blocks.len()),
            k.eps,
            k.weight_decay,
            k.bias_correction1,
            k.bias_correction2,
            UNITS,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{BLOCK, LambPlan};

    /// Pieces are cut into blocks of at most BLOCK that never span two pieces; an empty piece
    /// has no block; pieces that leave a gap are refused by name.
    #[test]
    fn plans_cut_pieces_into_blocks() {
        let plan = LambPlan::new(
            BLOCK + 10,
            &[0..3, 3..3, 3..BLOCK + 5, BLOCK + 5..BLOCK + 10],
        );
        assert_eq!(plan.pieces(), 4);
        assert_eq!(
            plan.blocks,
            [
                0,
                3,
                0,
                3,
                BLOCK as u32,
                2,
                BLOCK as u32 + 3,
                2,
                2,
                BLOCK as u32 + 5,
                5,
                3
            ]
        );
        assert_eq!(plan.piece_blocks, [0, 1, 1, 3, 4]);
        let gap = std::panic::catch_unwind(|| LambPlan::new(10, &[0..3, 4..10]));
        let message = gap.unwrap_err();
        let text = message.downcast_ref::<String>().unwrap();
        assert!(text.contains("piece 1 (4..10)"), "{text}");
    }
}
