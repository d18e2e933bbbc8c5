//! The flash attention launches: shapes, options, tile sizes and the forward and backward kernels'
//! arguments.

use cubecl::prelude::*;

use crate::sparse::SparseLayout;

use super::backward::{flash_delta_kernel, flash_dkdv_kernel, flash_dq_kernel};
use super::forward::flash_forward_kernel;

/// What attention computes beyond its inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashOptions {
    /// Row `i` sees keys `j ≤ i` only.
    pub causal: bool,
    /// Multiplies `q·k` before the softmax (usually `1/√head_dim`).
    pub scale: f32,
    /// Use the tensor-core kernels where they apply ([`super::tensor_core::tensor_cores_apply`]);
    /// `false` keeps the CUDA-core kernels (to compare the two).
    pub tensor_cores: bool,
    /// The tensor-core forward with the scores in registers (FlashAttention-2's) where it
    /// applies (dense, the device's m16n8k16 `mma`); `false` keeps the one that stages them in
    /// shared memory.
    pub register_scores: bool,
}

/// A block layout: `layout` is `[heads, blocks, blocks]` `u32`, nonzero where the
/// `block × block` tile of a head's attention matrix is computed ([`layout_binding`] of a
/// [`SparseLayout`]).
#[derive(Clone, Copy, Debug)]
pub struct BlockSparsity<'a, R: Runtime> {
    /// The layout's memory.
    pub layout: &'a TensorBinding<R>,
    /// Tokens per block side.
    pub block: usize,
}

/// The sizes of one attention call, read from its operands' shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Query rows.
    pub seq_q: usize,
    /// Key rows.
    pub seq_k: usize,
    /// Width of a head.
    pub head_dim: usize,
}

/// Largest head dimension the kernels take (registers hold a few rows of it per unit).
pub const MAX_HEAD_DIM: usize = 256;

impl AttentionDims {
    /// The sizes of `q`, `k`, `v` of the shapes given, or what is wrong with them.
    pub fn of(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self, String> {
        for (name, shape) in [("query", q), ("key", k), ("value", v)] {
            if shape.len() != 4 {
                return Err(format!(
                    "flash attention: {name} has shape {shape:?}; expected [batch, heads, seq, head_dim]"
                ));
            }
            if shape.contains(&0) {
                return Err(format!(
                    "flash attention: {name} has an empty dimension: {shape:?}"
                ));
            }
        }
        if k != v {
            return Err(format!(
                "flash attention: key {k:?} and value {v:?} differ in shape"
            ));
        }
        if q[0] != k[0] || q[3] != k[3] {
            return Err(format!(
                "flash attention: query {q:?} and key {k:?} differ in batch or head_dim"
            ));
        }
        if !q[1].is_multiple_of(k[1]) {
            return Err(format!(
                "flash attention: {} query heads are not a multiple of {} key/value heads",
                q[1], k[1]
            ));
        }
        if q[3] > MAX_HEAD_DIM {
            return Err(format!(
                "flash attention: head_dim {} is above the supported {MAX_HEAD_DIM}",
                q[3]
            ));
        }
        Ok(Self {
            batch: q[0],
            heads: q[1],
            kv_heads: k[1],
            seq_q: q[2],
            seq_k: k[2],
            head_dim: q[3],
        })
    }

    /// Whether a layout of `shape` (`[heads, blocks, blocks]`) in blocks of `block` tokens
    /// covers these sizes, or what is wrong with it.
    pub fn check_layout(&self, shape: &[usize], block: usize) -> Result<(), String> {
        let longest = self.seq_q.max(self.seq_k);
        match shape {
            [h, n, m] if *h == self.heads && n == m && block > 0 && n * block >= longest => Ok(()),
            _ => Err(format!(
                "block-sparse attention: a layout of shape {shape:?} in blocks of {block} does \
                 not cover {} heads × {longest} tokens (expected [{}, ⌈{longest}/{block}⌉, same])",
                self.heads, self.heads
            )),
        }
    }
}

/// Rows (query rows, or key rows in `dkdv`) per cube.
const ROWS: usize = 64;

/// Units holding one row: enough that each keeps at most 32 elements of it (a power of two
/// that divides `head_dim`, so every lane holds the same width).
fn lanes(head_dim: usize) -> usize {
    let mut lanes = 1;
    while lanes * 32 < head_dim && head_dim.is_multiple_of(lanes * 2) {
        lanes *= 2;
    }
    lanes
}

/// Rows of the shared tiles: the most (up to 32) whose two `tile × head_dim` f32 tiles (plus
/// `dkdv`'s two per-row values) fit the device's shared memory (48 KiB at most, the portable
/// limit).
fn tile_rows(client_limit: usize, head_dim: usize) -> usize {
    let budget = client_limit.min(48 * 1024);
    let mut tile = 32;
    while tile > 1 && 4 * (2 * tile * head_dim + 2 * tile) > budget {
        tile /= 2;
    }
    tile
}

fn tile_for<R: Runtime>(client: &ComputeClient<R>, head_dim: usize) -> usize {
    tile_rows(
        client.properties().hardware.max_shared_memory_size,
        head_dim,
    )
}

pub(super) fn cubes(rows: usize, per_cube: usize, heads: usize) -> CubeCount {
    CubeCount::Static(rows.div_ceil(per_cube) as u32, heads as u32, 1)
}

pub(super) fn arg<R: Runtime>(t: &TensorBinding<R>) -> TensorArg<R> {
    t.clone().into_tensor_arg()
}

/// `layout` in device memory, as the kernels read it (`[heads, blocks, blocks]` `u32`).
pub fn layout_binding<R: Runtime>(
    client: &ComputeClient<R>,
    layout: &SparseLayout,
) -> TensorBinding<R> {
    let (heads, blocks) = (layout.heads, layout.blocks);
    TensorBinding {
        handle: client
            .create_from_slice(u32::as_bytes(&layout.kept))
            .binding(),
        strides: cubecl::zspace::Strides::new(&[blocks * blocks, blocks, 1]),
        shape: cubecl::zspace::Shape::new([heads, blocks, blocks]),
        runtime: core::marker::PhantomData,
    }
}

/// The layout argument of a launch: the given one, or a one-block stand-in when dense (the
/// kernels do not read it then).
fn layout_arg<R: Runtime>(
    client: &ComputeClient<R>,
    sparsity: Option<BlockSparsity<'_, R>>,
) -> (TensorBinding<R>, u32, bool) {
    match sparsity {
        Some(s) => (s.layout.clone(), s.block as u32, true),
        None => {
            let dense = SparseLayout {
                heads: 1,
                blocks: 1,
                block: 1,
                kept: vec![1],
            };
            (layout_binding(client, &dense), 1, false)
        }
    }
}

/// The forward: `out` and `lse` written from `q`, `k`, `v` (all of `dims`' shapes, elements
/// of `dtype`; `lse` f32), dense or block-sparse.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
    options: FlashOptions,
    sparsity: Option<BlockSparsity<'_, R>>,
    [q, k, v]: [&TensorBinding<R>; 3],
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
) {
    let (layout, block, sparse) = layout_arg(client, sparsity);
    if options.tensor_cores && super::tensor_core::tensor_cores_apply(client, dims, dtype) {
        let layout = (&layout, block, sparse);
        return super::tensor_core::forward(
            client,
            dims,
            dtype,
            options,
            layout,
            [q, k, v],
            out,
            lse,
        );
    }
    let keys = tile_for(client, dims.head_dim);
    let lanes = lanes(dims.head_dim);
    // SAFETY: the shapes were checked by `AttentionDims::of`, the bindings hold them, and
    // every access in the kernel is bounded by the shapes.
    unsafe {
        flash_forward_kernel::launch_unchecked::<R>(
            client,
            cubes(dims.seq_q, ROWS, dims.batch * dims.heads),
            CubeDim::new_1d((ROWS * lanes) as u32),
            arg(q),
            arg(k),
            arg(v),
            arg(out),
            arg(lse),
            arg(&layout),
            options.scale,
            block,
            options.causal,
            sparse,
            dims.head_dim,
            ROWS,
            keys,
            lanes,
            dtype,
        )
    }
}

/// The backward: `dq`, `dk`, `dv` from the forward's inputs, `out`, `lse` and the output's
/// gradient `d_out`; `delta` is f32 scratch of `lse`'s shape; `sparsity` the forward's.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
    options: FlashOptions,
    sparsity: Option<BlockSparsity<'_, R>>,
    [q, k, v]: [&TensorBinding<R>; 3],
    [out, d_out, lse, delta]: [&TensorBinding<R>; 4],
    [dq, dk, dv]: [&TensorBinding<R>; 3],
) {
    let (layout, block, sparse) = layout_arg(client, sparsity);
    // SAFETY: as in `flash_forward`.
    unsafe {
        flash_delta_kernel::launch_unchecked::<R>(
            client,
            cubes(dims.seq_q, 256, dims.batch * dims.heads),
            CubeDim::new_1d(256),
            arg(out),
            arg(d_out),
            arg(delta),
            dims.head_dim,
            dtype,
        );
    }
    if options.tensor_cores && super::tensor_core::tensor_cores_apply(client, dims, dtype) {
        let layout = (&layout, block, sparse);
        let stats = [d_out, lse, delta];
        super::tensor_core::backward(
            client,
            dims,
            dtype,
            options,
            layout,
            [q, k, v],
            stats,
            [dq, dk, dv],
        );
        return;
    }
    let tile = tile_for(client, dims.head_dim);
    let lanes = lanes(dims.head_dim);
    // SAFETY: as in `flash_forward`.
    unsafe {
        flash_dq_kernel::launch_unchecked::<R>(
            client,
            cubes(dims.seq_q, ROWS, dims.batch * dims.heads),
            CubeDim::new_1d((ROWS * lanes) as u32),
            arg(q),
            arg(k),
            arg(v),
            arg(d_out),
            arg(lse),
            arg(delta),
            arg(dq),
            arg(&layout),
            options.scale,
            block,
            options.causal,
            sparse,
            dims.head_dim,
            ROWS,
            tile,
            lanes,
            dtype,
        );
        flash_dkdv_kernel::launch_unchecked::<R>(
            client,
            cubes(dims.seq_k, ROWS, dims.batch * dims.kv_heads),
            CubeDim::new_1d((ROWS * lanes) as u32),
            arg(q),
            arg(k),
            arg(v),
            arg(d_out),
            arg(lse),
            arg(delta),
            arg(dk),
            arg(dv),
            arg(&layout),
            options.scale,
            block,
            options.causal,
            sparse,
            dims.head_dim,
            ROWS,
            tile,
            lanes,
            dtype,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_by_name() {
        let ok = AttentionDims::of(&[2, 6, 17, 64], &[2, 3, 9, 64], &[2, 3, 9, 64]).unwrap();
        assert_eq!((ok.heads / ok.kv_heads, ok.seq_q, ok.seq_k), (2, 17, 9));
        let bad = |q: &[usize], k: &[usize], v: &[usize]| AttentionDims::of(q, k, v).unwrap_err();
        assert!(bad(&[2, 6, 17], &[2, 3, 9, 64], &[2, 3, 9, 64]).contains("query"));
        assert!(bad(&[2, 5, 17, 64], &[2, 3, 9, 64], &[2, 3, 9, 64]).contains("multiple"));
        assert!(bad(&[2, 6, 17, 64], &[2, 3, 9, 64], &[2, 3, 8, 64]).contains("value"));
        assert!(bad(&[2, 6, 0, 64], &[2, 3, 9, 64], &[2, 3, 9, 64]).contains("empty"));
        assert!(bad(&[2, 6, 1, 512], &[2, 6, 1, 512], &[2, 6, 1, 512]).contains("head_dim"));
    }

    #[test]
    fn tiles_fit_the_shared_memory() {
        for limit in [16 * 1024, 32 * 1024, 48 * 1024, 228 * 1024] {
            for hd in [1, 7, 64, 128, 256] {
                let t = tile_rows(limit, hd);
                let bytes = 4 * (2 * t * hd + 2 * t);
                assert!(t >= 1 && (t == 1 || bytes <= limit), "{limit} {hd} {t}");
            }
        }
        assert_eq!(tile_rows(48 * 1024, 128), 32);
    }

    #[test]
    fn lanes_divide_the_head_dimension() {
        let got: Vec<usize> = [1, 7, 32, 33, 64, 96, 100, 128, 256].map(lanes).to_vec();
        assert_eq!(got, [1, 1, 1, 1, 2, 4, 4, 4, 8]);
        for hd in 1..=MAX_HEAD_DIM {
            let l = lanes(hd);
            assert!(
                hd.is_multiple_of(l) && l.is_power_of_two() && l <= 8,
                "{hd}: {l}"
            );
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
#[path = "gpu_tests.rs"]
mod gpu_tests;
