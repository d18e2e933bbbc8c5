//! The last launch of the tensor-core backward under grouped-query attention: `dkdv` writes
//! one f32 share of `dk`/`dv` per query head, and this sums each group's shares into its K/V
//! head's gradient, rounded once to the element type.

use cubecl::prelude::*;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `out[b, hk, s, d] = Σ_g shares[b, hk·group + g, s, d]` with `group` =
    /// `shares.shape(1) / out.shape(1)`; one unit per element of `out` (any strides).
    #[cube(launch_unchecked)]
    pub fn group_sum_kernel<F: Float>(
        shares: &Tensor<f32>,
        out: &mut Tensor<F>,
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
                F::cast_from(sum);
        }
    }
}
use kernel::group_sum_kernel;

/// Units per cube of the sum.
const UNITS: usize = 256;

/// Contiguous f32 scratch of `shape` for one gradient's shares.
pub(super) fn shares<R: Runtime>(client: &ComputeClient<R>, shape: [usize; 4]) -> TensorBinding<R> {
    let [_, h, s, d] = shape;
    TensorBinding {
        handle: client.empty(4 * shape.iter().product::<usize>()).binding(),
        strides: cubecl::zspace::Strides::new(&[h * s * d, s * d, d, 1]),
        shape: cubecl::zspace::Shape::new(shape),
        runtime: core::marker::PhantomData,
    }
}

/// `out` (elements of `dtype`) from the group sums of `shares` (see [`group_sum_kernel`]).
pub(super) fn sum_groups<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    shares: &TensorBinding<R>,
    out: &TensorBinding<R>,
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
            dtype,
        )
    }
}
