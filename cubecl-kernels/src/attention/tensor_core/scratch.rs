//! The f32 scratch of the tensor-core backward: under grouped-query attention `dkdv` writes
//! one share of `dk`/`dv` per query head, and where `dkdv` also produces `dQ` it adds each
//! cube's part into one accumulator by atomics. Two launches finish them: a zero fill before,
//! and the sum of each group's shares (one share for `dQ`) times a scale, rounded once to the
//! element type, after.

use cubecl::prelude::*;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `out[b, hk, s, d] = scale · Σ_g shares[b, hk·group + g, s, d]` with `group` =
    /// `shares.shape(1) / out.shape(1)`; one unit per element of `out` (any strides).
    #[cube(launch_unchecked)]
    pub fn group_sum_kernel<F: Float>(
        shares: &Tensor<f32>,
        out: &mut Tensor<F>,
        scale: f32,
        #[define(F)] _dtype: StorageType,
    ) {
        let (kv, seq, hd) = (out.shape(1), out.shape(2), out.shape(3));
        let i = ABSOLUTE_POS;
        if i < out.shape(0) * kv * seq * hd {
            let d = i % hd;
            let s = (i / hd) % seq;
            let hk = (i / (hd * seq)) % kv;
            let b = i / (hd * seq * kv);
            let group = shares.shape(1) / kv;
            let at = b * shares.stride(0) + s * shares.stride(2) + d * shares.stride(3);
            let mut sum = 0.0f32;
            for g in 0..group {
                sum += shares[at + (hk * group + g) * shares.stride(1)];
            }
            out[b * out.stride(0) + hk * out.stride(1) + s * out.stride(2) + d * out.stride(3)] =
                F::cast_from(sum * scale);
        }
    }

    /// Zeros every element of the contiguous `t`; one unit per element.
    #[cube(launch_unchecked)]
    pub fn zero_kernel(t: &mut Tensor<f32>) {
        if ABSOLUTE_POS < t.len() {
            t[ABSOLUTE_POS] = 0.0;
        }
    }
}
use kernel::{group_sum_kernel, zero_kernel};

/// Units per cube of the sum and the fill.
const UNITS: usize = 256;

/// Contiguous f32 scratch of `shape` (uninitialized).
pub(super) fn shares<R: Runtime>(client: &ComputeClient<R>, shape: [usize; 4]) -> TensorBinding<R> {
    let [_, h, s, d] = shape;
    TensorBinding {
        handle: client.empty(4 * shape.iter().product::<usize>()).binding(),
        strides: cubecl::zspace::Strides::new(&[h * s * d, s * d, d, 1]),
        shape: cubecl::zspace::Shape::new(shape),
        runtime: core::marker::PhantomData,
    }
}

/// Contiguous f32 scratch of `shape`, zeroed on the device (an accumulator for atomics).
pub(super) fn zeros<R: Runtime>(client: &ComputeClient<R>, shape: [usize; 4]) -> TensorBinding<R> {
    let t = shares(client, shape);
    let n: usize = shape.iter().product();
    // SAFETY: `t` is contiguous and holds `n` elements; units past `n` write nothing.
    unsafe {
        zero_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(n.div_ceil(UNITS) as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            t.clone().into_tensor_arg(),
        )
    }
    t
}

/// `out` (elements of `dtype`) from `scale` times the group sums of `shares` (see
/// [`group_sum_kernel`]).
pub(super) fn sum_groups<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    shares: &TensorBinding<R>,
    out: &TensorBinding<R>,
    scale: f32,
) {
    let n: usize = out.shape.iter().product();
    // SAFETY: `shares` is `[batch, heads, seq, head_dim]` and `out` `[batch, kv_heads, seq,
    // head_dim]` with `kv_heads` dividing `heads` (checked by `AttentionDims::of`); every
    // access is bounded by those shapes.
    unsafe {
        group_sum_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(n.div_ceil(UNITS) as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            shares.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            dtype,
        )
    }
}
