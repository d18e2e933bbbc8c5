//! The device optimizer's Adam/AdamW step as one CubeCL kernel on CUDA tensors
//! (cubecl-kernels' fused AdamW): one read of master, gradient and moments and one write of
//! the new ones, where burn's tensor ops would make several passes; and LAMB's step as two
//! fused passes around the read-back of its norms. AdamW runs as an operation of burn's fusion
//! stream and writes master and moments in place when fusion hands them over as its to consume
//! (their last use); otherwise, and for LAMB, the new values go to new buffers: burn tensors are
//! values that other tensors may share.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl_kernels::adam::{AdamConstants, adamw_into};
use cubecl_kernels::lamb::{LambConstants, LambPlan, LambPlanHandles, lamb_apply, lamb_moments};

use super::lamb::{FusedPlan, LambState};
use super::{AdamSettings, StepParams};
use crate::backend::cuda::{cube_tensor, from_cube};
use burn_offload::AdamStep;

use core::any::{Any, TypeId};

use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
type FusedCuda = FusionCubeRuntime<CudaRuntime>;

/// Fused AdamW as an operation of the fusion stream: it runs in stream order on the tensors'
/// own handles. Fusion hands an input over with its memory when this is its last use (the
/// caller passed its only reference); such master and moments are written in place, so a step
/// needs no second copy of the optimizer state. Others get new buffers. A fourth output, when
/// there is one, is the new master in its dtype (the model's compute-dtype copy).
#[derive(Debug)]
struct AdamwOp {
    desc: CustomOpIr,
    k: AdamConstants,
}

impl Operation<FusedCuda> for AdamwOp {
    fn execute(&self, handles: &mut HandleContainer<<FusedCuda as FusionRuntime>::FusionHandle>) {
        // Inputs: master, m, v, then the gradient's pieces in order.
        let mut inputs =
            self.desc.inputs.iter().map(|ir| {
                burn_cubecl::kernel::into_contiguous(handles.get_float_tensor::<Cube>(ir))
            });
        let state: [CubeTensor<CudaRuntime>; 3] =
            core::array::from_fn(|_| inputs.next().expect("master, m and v"));
        let grads: Vec<CubeTensor<CudaRuntime>> = inputs.collect();
        let len = state[0].meta.shape().num_elements();
        let outputs = state.each_ref().map(|t| match t.can_mut() {
            true => t.clone(),
            false => empty_like(t, len, DType::F32),
        });
        let working = self
            .desc
            .outputs
            .get(3)
            .map(|ir| empty_like(&state[0], len, ir.dtype));
        launch_adamw(&state, &grads, &outputs, working.as_ref(), &self.k);
        for (ir, out) in self
            .desc
            .outputs
            .iter()
            .zip(outputs.into_iter().chain(working))
        {
            handles.register_float_tensor::<Cube>(&ir.id, out);
        }
    }
}

/// The new master, m and v of a fused step, and the new master in the working dtype when
/// it was asked for and written.
pub(crate) type AdamwOutputs<B> = ([Tensor<B, 1>; 3], Option<Tensor<B, 1>>);

/// `value` as a `U` when it is one (the same type behind a generic parameter).
fn cast<T: 'static, U: 'static>(value: T) -> Option<U> {
    let boxed: Box<dyn Any> = Box::new(value);
    boxed.downcast::<U>().ok().map(|b| *b)
}

/// Adam's moments, step count and settings of one partition, as [`adam`] updates them.
pub(crate) type AdamState<'a, B> = ([&'a mut Tensor<B, 1>; 2], &'a mut u64, &'a AdamSettings);

/// One Adam/AdamW step of `param` as the fused kernel, the gradient (its consecutive pieces
/// `grads`) multiplied by `grad_scale` inside it, and the new weights in `working` too when
/// asked for; the inputs back, the state untouched, where the kernel does not apply.
#[allow(clippy::type_complexity)]
pub(crate) fn adam<B: Backend>(
    param: Tensor<B, 1>,
    grads: Vec<Tensor<B, 1>>,
    ([m, v], step, settings): AdamState<'_, B>,
    hp: StepParams,
    grad_scale: f32,
    working: Option<DType>,
) -> Result<(Tensor<B, 1>, Option<Tensor<B, 1>>), (Tensor<B, 1>, Vec<Tensor<B, 1>>)> {
    let (lr, betas) = hp.f32();
    let (eps, wd) = (settings.eps as f32, settings.weight_decay as f32);
    let (decoupled, corrected) = (settings.decoupled, settings.bias_correction);
    let next = AdamStep::at(*step + 1, lr, betas, eps, wd, decoupled, corrected);
    let k = AdamConstants {
        grad_scale,
        ..AdamConstants::from(&next)
    };
    // The moments' only references go to the kernel: it may write in place.
    let device = param.device();
    let m_old = core::mem::replace(m, Tensor::empty([1], &device));
    let v_old = core::mem::replace(v, Tensor::empty([1], &device));
    match adamw([param, m_old, v_old], grads, &k, working) {
        Ok(([w, m_new, v_new], working)) => {
            (*m, *v) = (m_new, v_new);
            *step += 1;
            Ok((w, working))
        }
        Err(([param, m_old, v_old], grads)) => {
            (*m, *v) = (m_old, v_old);
            Err((param, grads))
        }
    }
}

/// Elements a gradient piece starts at a multiple of, for the kernel to run on it in place:
/// offsets of 256 bytes in f32 (128 in bf16/f16) keep every binding aligned.
const PIECE_ALIGN: usize = 64;

/// `(master, m, v)` after one step from the gradient in `grads` (its consecutive pieces, read
/// where they lie: no concatenated copy) and the new master in `working`'s dtype when that is
/// bf16 or f16; the inputs back when these are not f32 CUDA tensors whose lengths add up (the
/// tensor ops take them then). burn-cuda's fused tensors go through the fusion stream
/// ([`AdamwOp`], in place where `master`, `m` and `v` are their tensors' only references);
/// plain CUDA tensors get new buffers.
#[allow(clippy::type_complexity)]
fn adamw<B: Backend>(
    [master, m, v]: [Tensor<B, 1>; 3],
    grads: Vec<Tensor<B, 1>>,
    k: &AdamConstants,
    working: Option<DType>,
) -> Result<AdamwOutputs<B>, ([Tensor<B, 1>; 3], Vec<Tensor<B, 1>>)> {
    let len = master.dims()[0];
    let working = working.filter(|d| matches!(d, DType::BF16 | DType::F16));
    let mut at = 0;
    let pieces_fit = grads.iter().all(|g| {
        let aligned = at % PIECE_ALIGN == 0;
        at += g.dims()[0];
        aligned && g.dtype() == DType::F32
    });
    let fits = pieces_fit
        && at == len
        && [&master, &m, &v]
            .iter()
            .all(|t| t.dims()[0] == len && t.dtype() == DType::F32);
    let in_stream =
        TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<FusionTensor<FusedCuda>>();
    if !fits || !in_stream {
        let grad = fits.then(|| super::tensor::joined(grads.clone()));
        let out = grad.and_then(|g| adamw_resolved(&master, &g, &m, &v, k, working));
        return out.ok_or(([master, m, v], grads));
    }
    let fused = |t: Tensor<B, 1>| {
        cast::<_, FusionTensor<FusedCuda>>(t.into_primitive().tensor()).expect("checked type")
    };
    let state = [master, m, v].map(fused);
    let grads: Vec<FusionTensor<FusedCuda>> = grads.into_iter().map(fused).collect();
    let client = state[0].client.clone();
    let streams = OperationStreams::with_inputs(state.iter().chain(&grads));
    let dtypes = [DType::F32; 3].into_iter().chain(working);
    let outputs: Vec<TensorIr> = dtypes
        .map(|d| TensorIr::uninit(client.create_empty_handle(), Shape::new([len]), d))
        .collect();
    let inputs: Vec<TensorIr> = state
        .into_iter()
        .chain(grads)
        .map(|t| t.into_ir())
        .collect();
    let desc = CustomOpIr::new("burn_zero_fused_adamw", &inputs, &outputs);
    let op = AdamwOp {
        desc: desc.clone(),
        k: *k,
    };
    let mut outs = client
        .register(streams, OperationIr::Custom(desc), op)
        .into_iter()
        .map(|t| {
            let primitive = cast::<_, B::FloatTensorPrimitive>(t).expect("checked type");
            Tensor::from_primitive(TensorPrimitive::Float(primitive))
        });
    let mut next = || outs.next().expect("an output per TensorIr");
    Ok(([next(), next(), next()], working.map(|_| next())))
}

/// The fused AdamW launches from `[master, m, v]` and the gradient's consecutive `grads` into
/// `[master, m, v]` (which may be the inputs themselves: the kernel is elementwise) and, with
/// `working`, the new master in its dtype: one launch per piece, on the state's buffers at
/// the piece's offset.
fn launch_adamw(
    state: &[CubeTensor<CudaRuntime>; 3],
    grads: &[CubeTensor<CudaRuntime>],
    outputs: &[CubeTensor<CudaRuntime>; 3],
    working: Option<&CubeTensor<CudaRuntime>>,
    k: &AdamConstants,
) {
    let mut at = 0;
    for grad in grads {
        let n = grad.meta.shape().num_elements();
        let piece = |t: &CubeTensor<CudaRuntime>| match at {
            0 => t.handle.clone(),
            _ => t.handle.clone().offset_start((at * t.dtype.size()) as u64),
        };
        let [w, m, v] = state.each_ref().map(piece);
        let [w_out, m_out, v_out] = outputs.each_ref().map(piece);
        let working = working.map(|t| (piece(t), t.dtype.into()));
        adamw_into::<CudaRuntime>(
            &grad.client,
            k,
            n,
            [&w, &grad.handle, &m, &v],
            [&w_out, &m_out, &v_out],
            working.as_ref().map(|(h, d)| (h, *d)),
        );
        at += n;
    }
}

/// The CUDA tensors of `tensors` (f32, contiguous, `len` elements, one device), or `None`.
fn cuda_inputs<B: Backend, const N: usize>(
    tensors: [&Tensor<B, 1>; N],
) -> Option<[CubeTensor<CudaRuntime>; N]> {
    let len = tensors[0].dims()[0];
    let inputs = tensors.map(|t| cube_tensor::<B>(&t.clone().into_primitive().tensor()));
    let inputs: Vec<CubeTensor<CudaRuntime>> = inputs.into_iter().collect::<Option<_>>()?;
    let usable = |c: &CubeTensor<CudaRuntime>| {
        c.dtype == DType::F32 && c.is_contiguous() && c.meta.shape().num_elements() == len
    };
    if !inputs.iter().all(usable) || inputs.iter().any(|c| c.device != inputs[0].device) {
        return None;
    }
    inputs.try_into().ok()
}

/// A new contiguous CUDA tensor of `len` elements of `dtype` beside `like`.
fn empty_like(like: &CubeTensor<CudaRuntime>, len: usize, dtype: DType) -> CubeTensor<CudaRuntime> {
    let handle = like.client.empty(dtype.size() * len);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        [len].into(),
        handle,
        dtype,
    )
}

/// `outputs` as burn tensors of `like`'s kind (fused or not).
fn as_tensors<B: Backend, const N: usize>(
    like: &Tensor<B, 1>,
    outputs: [CubeTensor<CudaRuntime>; N],
) -> Option<[Tensor<B, 1>; N]> {
    let like = like.clone().into_primitive().tensor();
    let tensors = outputs.map(|o| {
        from_cube::<B>(&like, o).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
    });
    let tensors: Vec<Tensor<B, 1>> = tensors.into_iter().collect::<Option<_>>()?;
    tensors.try_into().ok()
}

/// `(master, m, v)` after one step from `grad` into new buffers (and the new master in
/// `working`'s dtype), or `None` when these are not contiguous f32 CUDA tensors of one device.
fn adamw_resolved<B: Backend>(
    master: &Tensor<B, 1>,
    grad: &Tensor<B, 1>,
    m: &Tensor<B, 1>,
    v: &Tensor<B, 1>,
    k: &AdamConstants,
    working: Option<DType>,
) -> Option<AdamwOutputs<B>> {
    let [w, g, m_in, v_in] = cuda_inputs([master, grad, m, v])?;
    let len = master.dims()[0];
    let outputs = [0; 3].map(|_| empty_like(&w, len, DType::F32));
    let working = working.map(|d| empty_like(&w, len, d));
    launch_adamw(&[w, m_in, v_in], &[g], &outputs, working.as_ref(), k);
    let working = match working {
        Some(w) => Some(as_tensors(master, [w])?.into_iter().next()?),
        None => None,
    };
    Some((as_tensors(master, outputs)?, working))
}

/// The fused LAMB passes' plan of one partition: its pieces (the segments of
/// `TensorBounds` and the gaps between them), which tensor each belongs to, and the plan on
/// the device.
pub(crate) struct LambCache {
    plan: LambPlan,
    /// Each piece's position among the segments, `None` for a gap.
    segment_of_piece: Vec<Option<usize>>,
    on_device: LambPlanHandles,
}

impl LambCache {
    fn new(state: &LambState<'_>, len: usize, client: &ComputeClient<CudaRuntime>) -> Self {
        let (mut pieces, mut segment_of_piece, mut at) = (Vec::new(), Vec::new(), 0);
        for (s, (_, r)) in state.tensors.segments.iter().enumerate() {
            if r.start > at {
                pieces.push(at..r.start);
                segment_of_piece.push(None);
            }
            pieces.push(r.clone());
            segment_of_piece.push(Some(s));
            at = r.end;
        }
        if at < len {
            pieces.push(at..len);
            segment_of_piece.push(None);
        }
        let plan = LambPlan::new(len, &pieces);
        let on_device = plan.upload(client);
        Self {
            plan,
            segment_of_piece,
            on_device,
        }
    }
}

/// `(master, m, v)` after one LAMB step from `grad` as two fused passes (moments and norms,
/// then the weights), or `None` when these are not contiguous f32 CUDA tensors of one device.
/// The norms' sums are read back in between, summed across ranks and turned into trust ratios
/// exactly as the tensor ops do ([`LambState::trusts`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn lamb<B: Backend>(
    master: &Tensor<B, 1>,
    grad: &Tensor<B, 1>,
    m: &Tensor<B, 1>,
    v: &Tensor<B, 1>,
    k: &LambConstants,
    lr: f32,
    state: &LambState<'_>,
    fused: &mut FusedPlan,
) -> Option<[Tensor<B, 1>; 3]> {
    let inputs = cuda_inputs([master, grad, m, v])?;
    let len = master.dims()[0];
    let client = inputs[0].client.clone();
    let cache = fused
        .cuda
        .get_or_insert_with(|| Box::new(LambCache::new(state, len, &client)));
    let [w, g, m_old, v_old] = [0, 1, 2, 3].map(|i| &inputs[i].handle);
    let moments = [0; 2].map(|_| empty_like(&inputs[0], len, DType::F32));
    let sums = lamb_moments(
        &client,
        k,
        &cache.plan,
        &cache.on_device,
        [w, g, m_old, v_old],
        [&moments[0].handle, &moments[1].handle],
    );
    let sums = client.read_one(sums).expect("LAMB's norms come back");
    let sums = f32::from_bytes(&sums);
    let segment_sums: Vec<f32> = cache
        .segment_of_piece
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_some())
        .flat_map(|(piece, _)| [sums[2 * piece], sums[2 * piece + 1]])
        .collect();
    let trust = state.trusts(&segment_sums);
    let steps: Vec<f32> = cache
        .segment_of_piece
        .iter()
        .map(|s| match s {
            Some(s) => lr * trust[state.tensors.segments[*s].0] as f32,
            None => 0.0,
        })
        .collect();
    let weights = empty_like(&inputs[0], len, DType::F32);
    let [m_new, v_new] = &moments;
    lamb_apply(
        &client,
        k,
        &cache.plan,
        &cache.on_device,
        [w, &m_new.handle, &v_new.handle],
        &steps,
        &weights.handle,
    );
    let [m_new, v_new] = moments;
    as_tensors(master, [weights, m_new, v_new])
}
