//! Fused AdamW in CubeCL: one pass reads the fp32 master weights, the gradient and both
//! moments, and writes master and moments back (burn 0.21 runs the same update as ~10
//! separate tensor ops, each a full read and write of the partition).

use burn_offload::{AdamStep, Decay};
use cubecl::prelude::*;

/// The constants of one Adam step, precomputed on the host as the engine's order of
/// operations uses them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConstants {
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// `1 − lr·weight_decay` (AdamW), 1 otherwise.
    pub shrink: f32,
    /// `weight_decay` added as L2 to the gradient (Adam), 0 otherwise.
    pub l2: f32,
    /// `sqrt(1 − β2ᵗ)`.
    pub bias_correction2_sqrt: f32,
    /// `lr / (1 − β1ᵗ)`.
    pub step_size: f32,
    /// What the gradient is multiplied by before the update (the clipping factor; 1 when
    /// none): the engine's clip pass folded into this one.
    pub grad_scale: f32,
}

impl From<&AdamStep> for AdamConstants {
    /// The kernel's constants of the step CPU-Adam would take (the same bias corrections).
    fn from(k: &AdamStep) -> Self {
        Self {
            beta1: k.beta1,
            beta2: k.beta2,
            eps: k.eps,
            shrink: match k.decay {
                Decay::Decoupled => 1.0 - k.lr * k.weight_decay,
                _ => 1.0,
            },
            l2: match k.decay {
                Decay::L2 => k.weight_decay,
                _ => 0.0,
            },
            bias_correction2_sqrt: k.bias_correction2.sqrt(),
            step_size: k.lr / k.bias_correction1,
            grad_scale: 1.0,
        }
    }
}

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// The update of vector `i`: the new `m` and `v` written to `m_out` and `v_out`, the new
    /// master returned for the caller to write. The gradient is multiplied by `grad_scale`
    /// first (the clipping factor).
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn update<N: Size>(
        i: usize,
        master: &Array<Vector<f32, N>>,
        grad: &Array<Vector<f32, N>>,
        m: &Array<Vector<f32, N>>,
        v: &Array<Vector<f32, N>>,
        m_out: &mut Array<Vector<f32, N>>,
        v_out: &mut Array<Vector<f32, N>>,
        beta1: f32,
        beta2: f32,
        eps: f32,
        shrink: f32,
        l2: f32,
        bias_correction2_sqrt: f32,
        step_size: f32,
        grad_scale: f32,
    ) -> Vector<f32, N> {
        let w = master[i];
        let g = grad[i] * Vector::new(grad_scale) + w * Vector::new(l2);
        let one = Vector::<f32, N>::new(1.0);
        let m_new = m[i] * Vector::new(beta1) + g * (one - Vector::new(beta1));
        let v_new = v[i] * Vector::new(beta2) + g * (one - Vector::new(beta2)) * g;
        let denom = Vector::sqrt(v_new) / Vector::new(bias_correction2_sqrt) + Vector::new(eps);
        m_out[i] = m_new;
        v_out[i] = v_new;
        w * Vector::new(shrink) - m_new / denom * Vector::new(step_size)
    }

    /// One vector of the partition per unit: the new `master`, `m`, `v` from the old ones and
    /// `grad`, into `*_out` (which may be the inputs: each unit reads its vector before it
    /// writes it).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn adamw_out_kernel<N: Size>(
        master: &Array<Vector<f32, N>>,
        grad: &Array<Vector<f32, N>>,
        m: &Array<Vector<f32, N>>,
        v: &Array<Vector<f32, N>>,
        master_out: &mut Array<Vector<f32, N>>,
        m_out: &mut Array<Vector<f32, N>>,
        v_out: &mut Array<Vector<f32, N>>,
        beta1: f32,
        beta2: f32,
        eps: f32,
        shrink: f32,
        l2: f32,
        bias_correction2_sqrt: f32,
        step_size: f32,
        grad_scale: f32,
    ) {
        if ABSOLUTE_POS >= master.len() {
            terminate!();
        }
        let i = ABSOLUTE_POS;
        master_out[i] = update::<N>(
            i,
            master,
            grad,
            m,
            v,
            m_out,
            v_out,
            beta1,
            beta2,
            eps,
            shrink,
            l2,
            bias_correction2_sqrt,
            step_size,
            grad_scale,
        );
    }

    /// [`adamw_out_kernel`] that also writes the new master rounded to `P` into `working`
    /// (the model's compute-dtype copy, which would otherwise be a pass of its own).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn adamw_cast_kernel<N: Size, P: Float>(
        master: &Array<Vector<f32, N>>,
        grad: &Array<Vector<f32, N>>,
        m: &Array<Vector<f32, N>>,
        v: &Array<Vector<f32, N>>,
        master_out: &mut Array<Vector<f32, N>>,
        m_out: &mut Array<Vector<f32, N>>,
        v_out: &mut Array<Vector<f32, N>>,
        working: &mut Array<Vector<P, N>>,
        beta1: f32,
        beta2: f32,
        eps: f32,
        shrink: f32,
        l2: f32,
        bias_correction2_sqrt: f32,
        step_size: f32,
        grad_scale: f32,
        #[define(P)] _dtype: StorageType,
    ) {
        if ABSOLUTE_POS >= master.len() {
            terminate!();
        }
        let i = ABSOLUTE_POS;
        let w = update::<N>(
            i,
            master,
            grad,
            m,
            v,
            m_out,
            v_out,
            beta1,
            beta2,
            eps,
            shrink,
            l2,
            bias_correction2_sqrt,
            step_size,
            grad_scale,
        );
        master_out[i] = w;
        working[i] = Vector::<P, N>::cast_from(w);
    }
}
pub use kernel::{adamw_cast_kernel, adamw_out_kernel};

/// Lanes per unit: four when the length allows (every buffer starts 16-byte aligned), one
/// otherwise (any length is correct).
fn vector_size(len: usize) -> usize {
    if len.is_multiple_of(4) { 4 } else { 1 }
}

/// Cubes of 256 units for `len` elements in vectors of `vector`.
fn cubes(len: usize, vector: usize) -> CubeCount {
    let cubes = (len / vector).div_ceil(256) as u32;
    CubeCount::Static(cubes.max(1), 1, 1)
}

/// One fused AdamW step on `client` from `master`, `grad`, `m`, `v` into `out` (new master,
/// m, v), each a device buffer of `len` f32, and, with `working`, the new master rounded to
/// that buffer's `len` elements of its dtype. The outputs may be the inputs' own buffers.
pub fn adamw_into<R: Runtime>(
    client: &ComputeClient<R>,
    k: &AdamConstants,
    len: usize,
    [master, grad, m, v]: [&cubecl::server::Handle; 4],
    [master_out, m_out, v_out]: [&cubecl::server::Handle; 3],
    working: Option<(&cubecl::server::Handle, StorageType)>,
) {
    let vector = vector_size(len);
    let arg = |h: &cubecl::server::Handle| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
    let (count, dim) = (cubes(len, vector), CubeDim::new_1d(256));
    // SAFETY: the handles hold `len` elements each (f32 but `working`), an output is either
    // its own buffer or the input it replaces (each unit reads its vector before writing
    // it), and the kernels check their bounds.
    unsafe {
        match working {
            None => adamw_out_kernel::launch_unchecked::<R>(
                client,
                count,
                dim,
                vector,
                arg(master),
                arg(grad),
                arg(m),
                arg(v),
                arg(master_out),
                arg(m_out),
                arg(v_out),
                k.beta1,
                k.beta2,
                k.eps,
                k.shrink,
                k.l2,
                k.bias_correction2_sqrt,
                k.step_size,
                k.grad_scale,
            ),
            Some((working, dtype)) => adamw_cast_kernel::launch_unchecked::<R>(
                client,
                count,
                dim,
                vector,
                arg(master),
                arg(grad),
                arg(m),
                arg(v),
                arg(master_out),
                arg(m_out),
                arg(v_out),
                arg(working),
                k.beta1,
                k.beta2,
                k.eps,
                k.shrink,
                k.l2,
                k.bias_correction2_sqrt,
                k.step_size,
                k.grad_scale,
                dtype,
            ),
        }
    }
}
