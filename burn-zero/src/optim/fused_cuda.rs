//! The device optimizer's Adam/AdamW step as one CubeCL kernel on CUDA tensors
//! (cubecl-kernels' fused AdamW): one read of master, gradient and moments and one write of
//! the new ones, where burn's tensor ops would make several passes; and LAMB's step as two
//! fused passes around the read-back of its norms. The new values go to new buffers: burn
//! tensors are values that other tensors may share.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl_kernels::adam::{AdamConstants, adamw_into};
use cubecl_kernels::lamb::{LambConstants, LambPlan, LambPlanHandles, lamb_apply, lamb_moments};

use super::lamb::{FusedPlan, LambState};
use crate::backend::cuda::{cube_tensor, from_cube};

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

/// A new contiguous f32 CUDA tensor of `len` elements beside `like`.
fn empty_like(like: &CubeTensor<CudaRuntime>, len: usize) -> CubeTensor<CudaRuntime> {
    let handle = like.client.empty(4 * len);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        [len].into(),
        handle,
        DType::F32,
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

/// `(master, m, v)` after one step from `grad`, or `None` when these are not contiguous f32
/// CUDA tensors of one device (the tensor ops take them then).
pub(crate) fn adamw<B: Backend>(
    master: &Tensor<B, 1>,
    grad: &Tensor<B, 1>,
    m: &Tensor<B, 1>,
    v: &Tensor<B, 1>,
    k: &AdamConstants,
) -> Option<[Tensor<B, 1>; 3]> {
    let inputs = cuda_inputs([master, grad, m, v])?;
    let len = master.dims()[0];
    let outputs = [0; 3].map(|_| empty_like(&inputs[0], len));
    let [a, b, c, d] = [0, 1, 2, 3].map(|i| &inputs[i].handle);
    let [e, f, g] = [0, 1, 2].map(|i| &outputs[i].handle);
    adamw_into::<CudaRuntime>(&inputs[0].client, k, len, [a, b, c, d], [e, f, g]);
    as_tensors(master, outputs)
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
    let moments = [0; 2].map(|_| empty_like(&inputs[0], len));
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
    let weights = empty_like(&inputs[0], len);
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
