//! SwiGLU's product `silu(gate) · up` in one kernel each way; the backward recomputes the
//! sigmoid from `gate` instead of keeping `silu(gate)` from the forward.

use cubecl::prelude::*;

use super::array;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    #[cube]
    fn sigmoid<N: Size>(g: Vector<f32, N>) -> Vector<f32, N> {
        let one = Vector::<f32, N>::new(1.0);
        // `0 − g`, not `−g`: CUDA's 8-wide f32 vectors have no unary minus.
        one / (one + Vector::exp(Vector::<f32, N>::new(0.0) - g))
    }

    /// `out = silu(gate) · up`, one vector per unit, in f32.
    #[cube(launch_unchecked)]
    pub fn swiglu_forward_kernel<F: Float, N: Size>(
        gate: &Array<Vector<F, N>>,
        up: &Array<Vector<F, N>>,
        out: &mut Array<Vector<F, N>>,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        if i < out.len() {
            let g = Vector::<f32, N>::cast_from(gate[i]);
            let u = Vector::<f32, N>::cast_from(up[i]);
            out[i] = Vector::<F, N>::cast_from(g * sigmoid::<N>(g) * u);
        }
    }

    /// `d_gate = d_out · up · σ(g)(1 + g(1 − σ(g)))`, `d_up = d_out · silu(gate)`.
    #[cube(launch_unchecked)]
    pub fn swiglu_backward_kernel<F: Float, N: Size>(
        gate: &Array<Vector<F, N>>,
        up: &Array<Vector<F, N>>,
        d_out: &Array<Vector<F, N>>,
        d_gate: &mut Array<Vector<F, N>>,
        d_up: &mut Array<Vector<F, N>>,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        if i < d_gate.len() {
            let g = Vector::<f32, N>::cast_from(gate[i]);
            let u = Vector::<f32, N>::cast_from(up[i]);
            let d = Vector::<f32, N>::cast_from(d_out[i]);
            let s = sigmoid::<N>(g);
            let one = Vector::<f32, N>::new(1.0);
            d_gate[i] = Vector::<F, N>::cast_from(d * u * s * (one + g * (one - s)));
            d_up[i] = Vector::<F, N>::cast_from(d * g * s);
        }
    }
}
use kernel::{swiglu_backward_kernel, swiglu_forward_kernel};

/// Units per cube.
const UNITS: usize = 256;

fn layout<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
) -> (usize, CubeCount) {
    let vector = super::vector_of(client, dtype.size(), len);
    let cubes = (len / vector).div_ceil(UNITS).max(1);
    (vector, CubeCount::Static(cubes as u32, 1, 1))
}

/// `out = silu(gate) · up` over `len` contiguous elements of `dtype` each.
pub fn swiglu_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    [gate, up]: [&cubecl::server::Handle; 2],
    out: &cubecl::server::Handle,
) {
    if len == 0 {
        return;
    }
    let (vector, cubes) = layout(client, dtype, len);
    // SAFETY: each unit touches its own vector, bounded by `len`.
    unsafe {
        swiglu_forward_kernel::launch_unchecked::<R>(
            client,
            cubes,
            CubeDim::new_1d(UNITS as u32),
            vector,
            array(gate, len),
            array(up, len),
            array(out, len),
            dtype,
        )
    }
}

/// The gradients of `gate` and `up` from the forward's inputs and the output's gradient.
pub fn swiglu_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    [gate, up, d_out]: [&cubecl::server::Handle; 3],
    [d_gate, d_up]: [&cubecl::server::Handle; 2],
) {
    if len == 0 {
        return;
    }
    let (vector, cubes) = layout(client, dtype, len);
    // SAFETY: each unit touches its own vector, bounded by `len`.
    unsafe {
        swiglu_backward_kernel::launch_unchecked::<R>(
            client,
            cubes,
            CubeDim::new_1d(UNITS as u32),
            vector,
            array(gate, len),
            array(up, len),
            array(d_out, len),
            array(d_gate, len),
            array(d_up, len),
            dtype,
        )
    }
}
