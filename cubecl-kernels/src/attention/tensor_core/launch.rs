//! The tensor-core attention launches: which shapes they take, shared memory and vector sizes.

use cubecl::ir::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind, StorageType as IrStorage};
use cubecl::prelude::*;

use super::backward::{tc_dkdv_kernel, tc_dq_kernel};
use super::forward::tc_forward_kernel;
use super::mma_backward::{mma_dkdv_kernel, mma_dq_kernel};
use super::mma_forward::{FORWARD_ROWS, mma_forward_kernel};
use super::tiles::{KEYS, PLANE, PS, ROWS, SS, UNITS, padded};
use crate::attention::{AttentionDims, FlashOptions, arg, cubes};

/// Largest head dimension the tensor-core kernels take (their accumulators live in registers).
pub const MAX_TENSOR_CORE_HEAD_DIM: usize = 128;

/// Whether the tensor-core kernels take heads of `head_dim` (in f16/bf16): multiples of 16
/// up to [`MAX_TENSOR_CORE_HEAD_DIM`]. The device's side is [`tensor_cores_apply`].
pub fn tensor_core_head(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && head_dim <= MAX_TENSOR_CORE_HEAD_DIM
}

/// Shared memory of the largest of the three kernels (`dkdv`), in bytes.
fn shared_bytes(head_dim: usize, elem: usize) -> usize {
    let tiles = 4 * ROWS * padded(head_dim) * elem;
    let scores = ROWS * SS * 4;
    let probs = 2 * ROWS * PS * elem;
    tiles + scores + probs + 2 * KEYS * 4
}

/// Whether the tensor-core kernels take a call of `dims` in `dtype` on `client`'s device.
pub fn tensor_cores_apply<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
) -> bool {
    let elem = match dtype {
        IrStorage::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16)) => 2,
        _ => return false,
    };
    let props = client.properties();
    let fragment = MmaConfig {
        a_type: dtype,
        b_type: dtype,
        cd_type: IrStorage::Scalar(ElemType::Float(FloatKind::F32)),
        m: 16,
        n: 16,
        k: 16,
    };
    tensor_core_head(dims.head_dim)
        && props.features.matmul.cmma.contains(&fragment)
        && props.hardware.plane_size_min == PLANE as u32
        && props.hardware.plane_size_max == PLANE as u32
        && props.hardware.max_shared_memory_size >= shared_bytes(dims.head_dim, elem)
}

/// Shared memory of the largest register-resident kernel (`mma_dkdv`: K and V, Q and dO
/// double-buffered, all row-major, and two double-buffered rows of statistics), in bytes.
fn mma_shared_bytes(head_dim: usize, elem: usize) -> usize {
    6 * ROWS * padded(head_dim) * elem + 4 * KEYS * 4
}

/// Whether the device runs the m16n8k16 `mma` on `dtype` with f32 accumulators, which the
/// kernels with the scores in registers are made of, and has their shared memory.
fn mma_applies<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
) -> bool {
    let shape = MmaConfig {
        a_type: dtype,
        b_type: dtype,
        cd_type: IrStorage::Scalar(ElemType::Float(FloatKind::F32)),
        m: 16,
        n: 8,
        k: 16,
    };
    let props = client.properties();
    props.features.matmul.mma.contains(&shape)
        && props.hardware.max_shared_memory_size >= mma_shared_bytes(dims.head_dim, 2)
}

/// Elements per global load of the staged tiles: 8 (16 bytes) where every operand's head
/// dimension is contiguous and each of its rows starts 16-byte aligned, else 1.
fn vector_size<R: Runtime>(dims: &AttentionDims, operands: &[&TensorBinding<R>]) -> usize {
    const VECTOR: usize = 8;
    let aligned = |t: &TensorBinding<R>| {
        let offset = t.handle.offset_start.unwrap_or(0) as usize;
        let strides: &[usize] = &t.strides;
        strides[3] == 1
            && strides[..3].iter().all(|s| s.is_multiple_of(VECTOR))
            && offset.is_multiple_of(VECTOR * 2)
    };
    match dims.head_dim.is_multiple_of(VECTOR) && operands.iter().all(|t| aligned(t)) {
        true => VECTOR,
        false => 1,
    }
}

/// The forward on tensor cores (see [`super::flash_forward`]); `layout` and `block` as the
/// CUDA-core launch takes them.
#[allow(clippy::too_many_arguments)]
pub(in crate::attention) fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
    options: FlashOptions,
    (layout, block, sparse): (&TensorBinding<R>, u32, bool),
    [q, k, v]: [&TensorBinding<R>; 3],
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
) {
    // SAFETY: the shapes were checked by `AttentionDims::of` and `tensor_cores_apply`, the
    // bindings hold them, and every access in the kernels is bounded by the shapes.
    let vector = vector_size(dims, &[q, k, v]);
    if options.register_scores && !sparse && mma_applies(client, dims, dtype) {
        unsafe {
            mma_forward_kernel::launch_unchecked::<R>(
                client,
                cubes(dims.seq_q, FORWARD_ROWS, dims.batch * dims.heads),
                CubeDim::new_1d(UNITS as u32),
                vector,
                arg(q),
                arg(q),
                arg(k),
                arg(k),
                arg(v),
                arg(v),
                arg(out),
                arg(lse),
                options.scale,
                options.causal,
                dims.head_dim,
                dtype,
            )
        }
        return;
    }
    unsafe {
        tc_forward_kernel::launch_unchecked::<R>(
            client,
            cubes(dims.seq_q, ROWS, dims.batch * dims.heads),
            CubeDim::new_1d(UNITS as u32),
            vector,
            arg(q),
            arg(q),
            arg(k),
            arg(k),
            arg(v),
            arg(v),
            arg(out),
            arg(lse),
            arg(layout),
            options.scale,
            block,
            options.causal,
            sparse,
            dims.head_dim,
            dtype,
        )
    }
}

/// The `dq` and `dkdv` launches of the backward on tensor cores (after `delta`).
#[allow(clippy::too_many_arguments)]
pub(in crate::attention) fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    dims: &AttentionDims,
    dtype: StorageType,
    options: FlashOptions,
    (layout, block, sparse): (&TensorBinding<R>, u32, bool),
    [q, k, v]: [&TensorBinding<R>; 3],
    [d_out, lse, delta]: [&TensorBinding<R>; 3],
    [dq, dk, dv]: [&TensorBinding<R>; 3],
) {
    let vector = vector_size(dims, &[q, k, v, d_out]);
    let registers = options.register_scores && !sparse && mma_applies(client, dims, dtype);
    // SAFETY: as in `forward`.
    unsafe {
        if registers {
            mma_dq_kernel::launch_unchecked::<R>(
                client,
                cubes(dims.seq_q, ROWS, dims.batch * dims.heads),
                CubeDim::new_1d(UNITS as u32),
                vector,
                arg(q),
                arg(q),
                arg(k),
                arg(k),
                arg(v),
                arg(v),
                arg(d_out),
                arg(d_out),
                arg(lse),
                arg(delta),
                arg(dq),
                options.scale,
                options.causal,
                dims.head_dim,
                dtype,
            );
        } else {
            tc_dq_kernel::launch_unchecked::<R>(
                client,
                cubes(dims.seq_q, ROWS, dims.batch * dims.heads),
                CubeDim::new_1d(UNITS as u32),
                vector,
                arg(q),
                arg(q),
                arg(k),
                arg(k),
                arg(v),
                arg(v),
                arg(d_out),
                arg(d_out),
                arg(lse),
                arg(delta),
                arg(dq),
                arg(layout),
                options.scale,
                block,
                options.causal,
                sparse,
                dims.head_dim,
                dtype,
            );
        }
    }
    // One `dkdv` cube per query head; under grouped-query attention each writes an f32
    // share, summed per group after.
    let grouped = dims.heads > dims.kv_heads;
    let share_shape = [dims.batch, dims.heads, dims.seq_k, dims.head_dim];
    let shares = grouped.then(|| [0; 2].map(|_| super::group_sum::shares(client, share_shape)));
    let (dk_to, dv_to, out_dtype) = match &shares {
        Some([dk_s, dv_s]) => (
            dk_s,
            dv_s,
            IrStorage::Scalar(ElemType::Float(FloatKind::F32)),
        ),
        None => (dk, dv, dtype),
    };
    // SAFETY: as in `forward`; the shares hold `[batch, heads, seq_k, head_dim]`.
    unsafe {
        if registers {
            mma_dkdv_kernel::launch_unchecked::<R>(
                client,
                cubes(dims.seq_k, ROWS, dims.batch * dims.heads),
                CubeDim::new_1d(UNITS as u32),
                vector,
                arg(q),
                arg(q),
                arg(k),
                arg(k),
                arg(v),
                arg(v),
                arg(d_out),
                arg(d_out),
                arg(lse),
                arg(delta),
                arg(dk_to),
                arg(dv_to),
                options.scale,
                options.causal,
                dims.head_dim,
                [dtype, out_dtype],
            );
        } else {
            tc_dkdv_kernel::launch_unchecked::<R>(
                client,
                cubes(dims.seq_k, ROWS, dims.batch * dims.heads),
                CubeDim::new_1d(UNITS as u32),
                vector,
                arg(q),
                arg(q),
                arg(k),
                arg(k),
                arg(v),
                arg(v),
                arg(d_out),
                arg(d_out),
                arg(lse),
                arg(delta),
                arg(dk_to),
                arg(dv_to),
                arg(layout),
                options.scale,
                block,
                options.causal,
                sparse,
                dims.head_dim,
                [dtype, out_dtype],
            );
        }
    }
    if let Some([dk_s, dv_s]) = &shares {
        super::group_sum::sum_groups(client, dtype, dk_s, dk);
        super::group_sum::sum_groups(client, dtype, dv_s, dv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_kernel_fits_an_h100s_shared_memory() {
        // dkdv at head dim 128 in bf16: four element tiles, a score tile, two probability
        // tiles, two rows of statistics; two cubes of it fit an SM of an H100/H200 (228 KiB,
        // 1 KiB of it reserved per cube).
        assert_eq!(shared_bytes(128, 2), 69_632 + 17_408 + 18_432 + 512);
        assert!(2 * (shared_bytes(128, 2) + 1024) <= 228 * 1024);
    }

    #[test]
    fn two_register_kernel_cubes_fit_an_sm_and_ldmatrix_rows_are_aligned() {
        // dkdv (the largest register kernel) at head dim 128 in bf16: six 64-row tiles (K, V,
        // Q and dO double-buffered) and two double-buffered rows of statistics; two cubes fit
        // an SM of an H100/H200 (228 KiB, 1 KiB of it reserved per cube).
        assert_eq!(mma_shared_bytes(128, 2), 6 * 17_408 + 1_024);
        assert!(2 * (mma_shared_bytes(128, 2) + 1024) <= 228 * 1024);
        // Every `ldmatrix` row (and every asynchronous copy) starts 16 bytes aligned: tiles
        // and rows are multiples of 8 elements, and so are the columns the kernels point at.
        for hd in (16..=MAX_TENSOR_CORE_HEAD_DIM).step_by(16) {
            assert_eq!((padded(hd) * 2) % 16, 0, "{hd}");
            assert_eq!((KEYS * padded(hd) * 2) % 16, 0, "{hd}");
        }
    }

    #[test]
    fn fragments_start_32_byte_aligned() {
        // Fragments start at rows that are multiples of 16 and columns that are multiples of
        // 16: both offsets must be multiples of 32 bytes for the tensor-core loads.
        for hd in (16..=MAX_TENSOR_CORE_HEAD_DIM).step_by(16) {
            assert_eq!((16 * padded(hd) * 2) % 32, 0, "{hd}");
        }
        assert_eq!((16 * SS * 4) % 32, 0);
        assert_eq!((16 * PS * 2) % 32, 0);
        assert_eq!((16 * 4) % 32, 0);
    }
}
