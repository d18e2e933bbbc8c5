//! The fused kernels on `ZeroBackend<burn::backend::Cuda>` tensors, as operations of burn's
//! fusion stream (the caller never waits). Each function answers `None` when its tensors are
//! not that backend's or not of one dtype the kernels take (f32, bf16, f16): the caller then
//! runs the same math in burn ops.

use core::any::TypeId;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, IntDType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::fused::{
    RopeDims, RopePairs, backward_scratch_bytes, cross_entropy, rms_norm_add_forward,
    rms_norm_backward, rms_norm_forward, rope, row_pitch, scale, swiglu_backward, swiglu_forward,
};

use crate::backend::fused_op::{CudaCube, Fused, run_fused, run_fused_taking, writable};
use crate::backend::{ZeroBackend, ZeroTensor};
use crate::nn::downcast::{float_as, int_as};

type Zero = ZeroBackend<burn::backend::Cuda>;

/// The fused tensors of `tensors` (a sharded parameter gathered), when they are CUDA tensors
/// of one dtype the kernels take.
fn fused_all<Z: Backend, const N: usize, const D: usize>(
    tensors: [&Tensor<Z, D>; N],
) -> Option<[Fused; N]> {
    let out: [Option<Fused>; N] = tensors.map(|t| {
        let t = float_as::<Z, Zero, D>(t.clone())?;
        Some(t.into_primitive().tensor().into_inner())
    });
    let out: [Fused; N] = out
        .into_iter()
        .collect::<Option<Vec<_>>>()?
        .try_into()
        .ok()?;
    let dtype = out[0].dtype;
    let takes = matches!(dtype, DType::F32 | DType::BF16 | DType::F16);
    (takes && out.iter().all(|t| t.dtype == dtype)).then_some(out)
}

/// A kernel's output as a tensor of `Z` (which is `Zero` when this runs).
fn back<Z: Backend, const D: usize>(t: Fused) -> Tensor<Z, D> {
    let t = Tensor::<Zero, D>::from_primitive(TensorPrimitive::Float(ZeroTensor::local(t)));
    float_as::<Zero, Z, D>(t).expect("called with Z = ZeroBackend<Cuda>")
}

/// A new uninitialized tensor beside `like`, contiguous: the kernels index it as one array
/// (cubecl's default allocation pads short rows to an aligned pitch).
fn empty(like: &CudaCube, shape: &[usize], dtype: DType) -> CudaCube {
    empty_device_contiguous_dtype::<CudaRuntime>(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        dtype,
    )
}

fn contiguous(t: CudaCube) -> CudaCube {
    if t.is_contiguous() {
        t
    } else {
        into_contiguous(t)
    }
}

/// `t` as rows (every axis but the last) and the elements between their starts: `t` itself
/// when it is contiguous or in cubecl's pitched layout (rows padded to an aligned pitch, as
/// CUDA allocates elementwise outputs of short rows: 576 bf16 become 768 apart), which the
/// RMSNorm kernels read as they are; a contiguous copy otherwise.
fn rows_of(t: CudaCube) -> (CudaCube, usize) {
    match row_pitch(t.meta.shape(), t.meta.strides()) {
        Some(pitch) => (t, pitch),
        None => {
            let hidden = t.meta.shape().last().copied().unwrap_or(1);
            (into_contiguous(t), hidden)
        }
    }
}

fn shape_of(t: &Fused) -> Vec<usize> {
    t.shape.iter().copied().collect()
}

/// `x`'s rows (every axis but the last) and its last axis.
fn rows_hidden(dims: &[usize]) -> [usize; 2] {
    let (hidden, leading) = dims.split_last().expect("a tensor of rank at least 1");
    [leading.iter().product(), *hidden]
}

/// `dims` with its last axis 1 (`rstd`'s shape), or with every other axis 1 (the weight's).
fn keep_last(dims: &[usize], last: bool) -> Shape {
    let n = dims.len();
    let out: Vec<usize> = (0..n)
        .map(|i| match (i + 1 == n, last) {
            (true, true) | (false, false) => 1,
            _ => dims[i],
        })
        .collect();
    Shape::from(out)
}

/// RMSNorm forward of `x` (any rank, `[rows, hidden]` in memory) with weight `w`
/// (`[1, …, 1, hidden]`): `(y, rstd)`, `y` of `x`'s shape and `rstd` f32 of `x`'s shape with 1
/// last. The outputs take the shapes the caller keeps (a reshape is one more op of fusion's
/// stream a call).
pub(super) fn rms_forward<Z: Backend, const D: usize>(
    x: &Tensor<Z, D>,
    w: &Tensor<Z, D>,
    eps: f64,
) -> Option<(Tensor<Z, D>, Tensor<Z, D>)> {
    let dims = x.dims();
    let [rows, hidden] = rows_hidden(&dims);
    let [fx, fw] = fused_all([x, w])?;
    let dtype = fx.dtype;
    let outputs = [
        (Shape::from(dims.to_vec()), dtype),
        (keep_last(&dims, true), DType::F32),
    ];
    let [y, rstd] = run_fused("burn_zero_rms_norm", [&fx, &fw], outputs, move |[x, w]| {
        let ((x, x_pitch), w) = (rows_of(x), contiguous(w));
        let y = empty(&x, &dims, dtype);
        let rstd = empty(&x, &keep_last(&dims, true), DType::F32);
        let client = x.client.clone();
        rms_norm_forward(
            &client,
            dtype.into(),
            [rows, hidden],
            eps as f32,
            (&x.handle, x_pitch),
            &w.handle,
            &y.handle,
            &rstd.handle,
        );
        [y, rstd]
    });
    Some((back(y), back(rstd)))
}

/// [`rms_forward`] of `x + residual` (one shape), the sum written too: `(sum, y, rstd)`.
pub(super) fn rms_add_forward<Z: Backend, const D: usize>(
    x: &Tensor<Z, D>,
    residual: &Tensor<Z, D>,
    w: &Tensor<Z, D>,
    eps: f64,
) -> Option<(Tensor<Z, D>, Tensor<Z, D>, Tensor<Z, D>)> {
    let dims = x.dims();
    let [rows, hidden] = rows_hidden(&dims);
    let [fx, fr, fw] = fused_all([x, residual, w])?;
    if fr.shape != fx.shape {
        return None;
    }
    let dtype = fx.dtype;
    let outputs = [
        (Shape::from(dims.to_vec()), dtype),
        (Shape::from(dims.to_vec()), dtype),
        (keep_last(&dims, true), DType::F32),
    ];
    let [sum, y, rstd] = run_fused(
        "burn_zero_add_rms_norm",
        [&fx, &fr, &fw],
        outputs,
        move |[x, r, w]| {
            let ((x, x_pitch), (r, r_pitch), w) = (rows_of(x), rows_of(r), contiguous(w));
            let sum = empty(&x, &dims, dtype);
            let y = empty(&x, &dims, dtype);
            let rstd = empty(&x, &keep_last(&dims, true), DType::F32);
            let client = x.client.clone();
            rms_norm_add_forward(
                &client,
                dtype.into(),
                [rows, hidden],
                eps as f32,
                [(&x.handle, x_pitch), (&r.handle, r_pitch)],
                &w.handle,
                [&sum.handle, &y.handle, &rstd.handle],
            );
            [sum, y, rstd]
        },
    );
    Some((back(sum), back(y), back(rstd)))
}

/// RMSNorm backward: `(dx, dw)` (`x`'s shape, `[1, …, 1, hidden]`) from the forward's `x`, `w`,
/// `rstd` and `dy`.
pub(super) fn rms_backward<Z: Backend, const D: usize>(
    x: &Tensor<Z, D>,
    w: &Tensor<Z, D>,
    rstd: &Tensor<Z, D>,
    dy: &Tensor<Z, D>,
) -> Option<(Tensor<Z, D>, Tensor<Z, D>)> {
    let dims = x.dims();
    let [rows, hidden] = rows_hidden(&dims);
    let [fx, fw, fdy] = fused_all([x, w, dy])?;
    let [rstd] = fused_all([rstd])?;
    if rstd.dtype != DType::F32 {
        return None;
    }
    let dtype = fx.dtype;
    let outputs = [
        (Shape::from(dims.to_vec()), dtype),
        (keep_last(&dims, false), dtype),
    ];
    let [dx, dw] = run_fused(
        "burn_zero_rms_norm_backward",
        [&fx, &fw, &rstd, &fdy],
        outputs,
        move |[x, w, rstd, dy]| {
            let ((x, x_pitch), (dy, dy_pitch)) = (rows_of(x), rows_of(dy));
            let [w, rstd] = [w, rstd].map(contiguous);
            let dx = empty(&x, &dims, dtype);
            let dw = empty(&x, &keep_last(&dims, false), dtype);
            let scratch = x.client.empty(backward_scratch_bytes(rows, hidden));
            let client = x.client.clone();
            rms_norm_backward(
                &client,
                dtype.into(),
                [rows, hidden],
                [(&x.handle, x_pitch), (&dy.handle, dy_pitch)],
                [&w.handle, &rstd.handle],
                [&dx.handle, &dw.handle],
                &scratch,
            );
            [dx, dw]
        },
    );
    Some((back(dx), back(dw)))
}

/// `silu(gate) · up`.
pub(super) fn swiglu_forward_op<Z: Backend, const D: usize>(
    gate: &Tensor<Z, D>,
    up: &Tensor<Z, D>,
) -> Option<Tensor<Z, D>> {
    let [fg, fu] = fused_all([gate, up])?;
    if fg.shape != fu.shape {
        return None;
    }
    let (dtype, shape) = (fg.dtype, shape_of(&fg));
    let len = shape.iter().product();
    let outputs = [(fg.shape.clone(), dtype)];
    let [out] = run_fused("burn_zero_swiglu", [&fg, &fu], outputs, move |[g, u]| {
        let (g, u) = (contiguous(g), contiguous(u));
        let out = empty(&g, &shape, dtype);
        let client = g.client.clone();
        swiglu_forward(
            &client,
            dtype.into(),
            len,
            [&g.handle, &u.handle],
            &out.handle,
        );
        [out]
    });
    Some(back(out))
}

/// SwiGLU's backward: `(d_gate, d_up)`.
pub(super) fn swiglu_backward_op<Z: Backend, const D: usize>(
    gate: &Tensor<Z, D>,
    up: &Tensor<Z, D>,
    d_out: &Tensor<Z, D>,
) -> Option<(Tensor<Z, D>, Tensor<Z, D>)> {
    let [fg, fu, fd] = fused_all([gate, up, d_out])?;
    let (dtype, shape) = (fg.dtype, shape_of(&fg));
    let len = shape.iter().product();
    let outputs = [(fg.shape.clone(), dtype), (fg.shape.clone(), dtype)];
    let [dg, du] = run_fused(
        "burn_zero_swiglu_backward",
        [&fg, &fu, &fd],
        outputs,
        move |[g, u, d]| {
            let [g, u, d] = [g, u, d].map(contiguous);
            let [dg, du] = [0; 2].map(|_| empty(&g, &shape, dtype));
            let client = g.client.clone();
            swiglu_backward(
                &client,
                dtype.into(),
                len,
                [&g.handle, &u.handle, &d.handle],
                [&dg.handle, &du.handle],
            );
            [dg, du]
        },
    );
    Some((back(dg), back(du)))
}

/// `x` (`[batch, seq, heads, head_dim]`) rotated by the tables' angles (back when `inverse`).
pub(super) fn rope_op<Z: Backend>(
    x: &Tensor<Z, 4>,
    cos: &Tensor<Z, 2>,
    sin: &Tensor<Z, 2>,
    pairs: RopePairs,
    inverse: bool,
) -> Option<Tensor<Z, 4>> {
    let [batch, seq, heads, head_dim] = x.dims();
    let [fx] = fused_all([x])?;
    let [fc, fs] = fused_all([cos, sin])?;
    if fc.dtype != DType::F32 {
        return None;
    }
    let dtype = fx.dtype;
    let dims = RopeDims {
        batch,
        seq,
        heads,
        head_dim,
    };
    let outputs = [(fx.shape.clone(), dtype)];
    let [out] = run_fused(
        "burn_zero_rope",
        [&fx, &fc, &fs],
        outputs,
        move |[x, c, s]| {
            let [x, c, s] = [x, c, s].map(contiguous);
            let out = empty(&x, &[batch, seq, heads, head_dim], dtype);
            let client = x.client.clone();
            rope(
                &client,
                dtype.into(),
                dims,
                pairs,
                inverse,
                [&x.handle, &c.handle, &s.handle],
                &out.handle,
            );
            [out]
        },
    );
    Some(back(out))
}

/// Each row's cross-entropy of `logits` (`[rows, vocab]`) against `targets` (`[rows]`, valid
/// indices), weighted by `keep` (`[rows]` f32): `[rows]` f32, and when `grad` the logits'
/// gradient `(softmax − onehot) · keep · scale` (`scale` `[1]` f32), written over the logits
/// when they were their buffer's last reference. The logits back where the kernel does not
/// take them (another backend or dtype, `burn_zero.fused_kernels.cross_entropy` off).
#[allow(clippy::type_complexity)]
pub(in crate::nn) fn cross_entropy_rows<Z: Backend>(
    logits: Tensor<Z, 2>,
    targets: &Tensor<Z, 1, Int>,
    keep: &Tensor<Z, 1>,
    scale: &Tensor<Z, 1>,
    grad: bool,
) -> Result<(Tensor<Z, 1>, Option<Tensor<Z, 2>>), Tensor<Z, 2>> {
    let takes = TypeId::of::<Z>() == TypeId::of::<Zero>()
        && matches!(logits.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && super::enabled(|f| f.cross_entropy);
    let Some([fk, fs]) = takes.then(|| fused_all([keep, scale])).flatten() else {
        return Err(logits);
    };
    if fk.dtype != DType::F32 {
        return Err(logits);
    }
    let [rows, vocab] = logits.dims();
    let dtype = logits.dtype();
    let targets = int_as::<Z, Zero, 1>(targets.clone().cast(IntDType::I32))
        .expect("Z is ZeroBackend<Cuda>")
        .into_primitive();
    let fl = float_as::<Z, Zero, 2>(logits)
        .expect("Z is ZeroBackend<Cuda>")
        .into_primitive()
        .tensor()
        .into_inner();
    let loss_out = (Shape::from(vec![rows]), DType::F32);
    let run = move |l: &CudaCube, [t, k, s]: [CudaCube; 3], grad: bool| {
        let [t, k, s] = [t, k, s].map(contiguous);
        let loss = empty(l, &[rows], DType::F32);
        let client = l.client.clone();
        cross_entropy(
            &client,
            dtype.into(),
            [rows, vocab],
            &l.handle,
            [&t.handle, &k.handle, &s.handle],
            &loss.handle,
            grad,
        );
        loss
    };
    if !grad {
        let [loss] = run_fused(
            "burn_zero_cross_entropy",
            [&fl, &targets, &fk, &fs],
            [loss_out],
            move |[l, t, k, s]| [run(&contiguous(l), [t, k, s], false)],
        );
        return Ok((back(loss), None));
    }
    let shape = fl.shape.clone();
    let [loss, d] = run_fused_taking(
        "burn_zero_cross_entropy_grad",
        [fl, targets, fk, fs],
        [loss_out, (shape, dtype)],
        move |[l, t, k, s]| {
            // The gradient goes over the logits: in their buffer when nothing else reads it.
            let l = writable(l);
            let loss = run(&l, [t, k, s], true);
            [loss, l]
        },
    );
    Ok((back(loss), Some(back(d))))
}

/// `grad · factor` (`factor`: `[1]` f32) in f32, rounded once, in `grad`'s own buffer when
/// nothing else reads it: the loss's backward scales the gradients its forward kept without an
/// f32 copy of the weight's (2.1 GB at 128,256 × 4,096). `grad` back where the kernel does not
/// take it.
pub(in crate::nn) fn scale_gradient<Z: Backend>(
    grad: Tensor<Z, 2>,
    factor: &Tensor<Z, 1>,
) -> Result<Tensor<Z, 2>, Tensor<Z, 2>> {
    let takes = TypeId::of::<Z>() == TypeId::of::<Zero>()
        && matches!(grad.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && factor.dtype() == DType::F32;
    let Some([ff]) = takes.then(|| fused_all([factor])).flatten() else {
        return Err(grad);
    };
    let (dims, dtype) = (grad.dims(), grad.dtype());
    let fg = float_as::<Z, Zero, 2>(grad)
        .expect("Z is ZeroBackend<Cuda>")
        .into_primitive()
        .tensor()
        .into_inner();
    let [out] = run_fused_taking(
        "burn_zero_scale_gradient",
        [fg, ff],
        [(Shape::from(dims.to_vec()), dtype)],
        move |[g, f]| {
            let g = writable(g);
            let f = contiguous(f);
            let client = g.client.clone();
            scale(
                &client,
                dtype.into(),
                dims.iter().product(),
                &g.handle,
                &f.handle,
            );
            [g]
        },
    );
    Ok(back(out))
}

/// `acc + a · b` (`[m, n]`, `[m, k]`, `[k, n]`, one dtype) with the product added by cuBLASLt
/// into `acc`'s buffer: no product tensor, one rounding. The operands back where it does not
/// take them.
#[allow(clippy::type_complexity)]
pub(in crate::nn) fn matmul_add<Z: Backend>(
    acc: Tensor<Z, 2>,
    a: &Tensor<Z, 2>,
    b: &Tensor<Z, 2>,
) -> Result<Tensor<Z, 2>, Tensor<Z, 2>> {
    if TypeId::of::<Z>() != TypeId::of::<Zero>() {
        return Err(acc);
    }
    let Some([fa, fb]) = fused_all([a, b]) else {
        return Err(acc);
    };
    let inner = |t: Tensor<Z, 2>| -> Fused {
        let t = float_as::<Z, Zero, 2>(t).expect("Z is ZeroBackend<Cuda>");
        t.into_primitive().tensor().into_inner()
    };
    let policy = crate::backend::matmul::matmul_policy();
    match crate::backend::matmul_cuda::try_accumulate(inner(acc), &fa, &fb, policy) {
        Ok(out) => Ok(back(out)),
        Err(acc) => Err(back(acc)),
    }
}
