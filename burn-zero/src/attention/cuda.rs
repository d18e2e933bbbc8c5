//! The flash kernels on `ZeroBackend<burn::backend::Cuda>` tensors: the forward on the
//! primitives, and the autodiff op whose backward runs the backward kernels. Both run as
//! operations of burn's fusion stream (`backend::fused_op`): the caller never waits.

use core::any::{Any, TypeId};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::CubeElement;
use cubecl::cuda::CudaRuntime;
use cubecl_kernels::attention::{
    AttentionDims, BlockSparsity, FlashOptions, flash_backward, flash_forward,
};

use super::SparseLayout;

use crate::backend::fused_op::{CudaCube, Fused, run_fused};
use crate::backend::{ZeroBackend, ZeroTensor};

type Inner = burn::backend::Cuda;
type Zero = ZeroBackend<Inner>;
type ZeroAd = Autodiff<Zero>;

/// `x` as a `T` if it is one.
fn cast<T: 'static>(x: impl Any) -> Option<T> {
    (Box::new(x) as Box<dyn Any>)
        .downcast::<T>()
        .ok()
        .map(|b| *b)
}

/// See [`super::flash_attention`].
pub(super) fn flash_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    layout: Option<&SparseLayout>,
) -> Option<Tensor<B, 4>> {
    if TypeId::of::<B>() == TypeId::of::<ZeroAd>() {
        let [q, k, v] = [q, k, v].map(|t| cast::<Tensor<ZeroAd, 4>>(t).map(float));
        let out = autodiff_attention(q?, k?, v?, causal, layout)?;
        return cast(Tensor::<ZeroAd, 4>::from_primitive(TensorPrimitive::Float(
            out,
        )));
    }
    if TypeId::of::<B>() == TypeId::of::<Zero>() {
        let [q, k, v] = [q, k, v].map(|t| cast::<Tensor<Zero, 4>>(t).map(float));
        let [q, k, v] = [fused(&q?)?, fused(&k?)?, fused(&v?)?];
        let (out, _) = forward(&q, &k, &v, &Options::new([&q, &k, &v], causal, layout)?);
        return cast(Tensor::<Zero, 4>::from_primitive(TensorPrimitive::Float(
            ZeroTensor::local(out),
        )));
    }
    None
}

fn float<B: Backend>(t: Tensor<B, 4>) -> B::FloatTensorPrimitive {
    t.into_primitive().tensor()
}

/// The fused tensor of a `ZeroTensor<Cuda>`, `None` for dtypes the kernels do not take.
fn fused(zero: &ZeroTensor<Inner>) -> Option<Fused> {
    let t = zero.inner();
    matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16).then(|| t.clone())
}

fn dims_of(t: &Fused) -> Vec<usize> {
    t.shape.iter().copied().collect()
}

/// A new uninitialized tensor beside `like`.
fn empty(like: &CudaCube, shape: &[usize], dtype: DType) -> CudaCube {
    empty_device_dtype::<CudaRuntime>(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        dtype,
    )
}

/// What one call computes beyond its inputs: its sizes, the mask, and a block layout in
/// device memory (uploaded once, for the forward and the backward).
#[derive(Clone, Debug)]
struct Options {
    dims: AttentionDims,
    /// The kernels' options, read from this thread's settings when the call is made: fusion
    /// may run the kernels on another thread (cubecl's device thread), whose settings are the
    /// defaults, not the engine's.
    kernel: FlashOptions,
    /// The layout (`[heads, blocks, blocks]` `u32`) and its block.
    layout: Option<(CudaCube, usize)>,
}

impl Options {
    /// `None` where the kernels do not take the operands (their dtypes differ).
    ///
    /// # Panics
    /// On shapes attention cannot take, or a layout that does not cover them, naming them.
    fn new([q, k, v]: [&Fused; 3], causal: bool, layout: Option<&SparseLayout>) -> Option<Self> {
        if q.dtype != k.dtype || q.dtype != v.dtype {
            return None;
        }
        let dims = AttentionDims::of(&dims_of(q), &dims_of(k), &dims_of(v))
            .unwrap_or_else(|e| panic!("{e}"));
        let layout = layout.map(|l| {
            let shape = [l.heads, l.blocks, l.blocks];
            dims.check_layout(&shape, l.block)
                .unwrap_or_else(|e| panic!("{e}"));
            // Uploaded on this thread's stream, the one fusion runs the kernels on.
            let device = q.client.device().clone();
            let client = <CudaRuntime as cubecl::Runtime>::client(&device);
            let handle = client.create_from_slice(u32::as_bytes(&l.kept));
            let tensor = CubeTensor::new_contiguous(
                client,
                device,
                Shape::from(shape.to_vec()),
                handle,
                DType::U32,
            );
            (tensor, l.block)
        });
        let kernel = FlashOptions {
            causal,
            scale: 1.0 / (dims.head_dim as f32).sqrt(),
            tensor_cores: super::tensor_cores_allowed(),
            register_scores: super::register_scores_allowed(),
        };
        Some(Self {
            dims,
            kernel,
            layout,
        })
    }
}

/// Runs `launch` with the call's block layout, if any, as the kernels take it.
fn with_sparsity<T>(
    options: &Options,
    launch: impl FnOnce(Option<BlockSparsity<'_, CudaRuntime>>) -> T,
) -> T {
    let binding = options
        .layout
        .as_ref()
        .map(|(t, block)| (t.clone().binding(), *block));
    launch(binding.as_ref().map(|(layout, block)| BlockSparsity {
        layout,
        block: *block,
    }))
}

/// The output and the f32 log-sum-exp of each row (`[b, h, s]`).
fn forward(q: &Fused, k: &Fused, v: &Fused, options: &Options) -> (Fused, Fused) {
    if crate::profile::recording() {
        crate::profile::record_macs(super::forward_macs(&dims_of(q), &dims_of(k)));
    }
    let dims = options.dims;
    let dtype = q.dtype;
    let lse_shape = [dims.batch, dims.heads, dims.seq_q];
    let outputs = [
        (q.shape.clone(), dtype),
        (Shape::from(lse_shape.to_vec()), DType::F32),
    ];
    let options = options.clone();
    let [out, lse] = run_fused(
        "burn_zero_flash_forward",
        [q, k, v],
        outputs,
        move |[q, k, v]| {
            let out = empty(&q, &dims_of_cube(&q), dtype);
            let lse = empty(&q, &lse_shape, DType::F32);
            let client = q.client.clone();
            with_sparsity(&options, |sparsity| {
                flash_forward(
                    &client,
                    &options.dims,
                    dtype.into(),
                    options.kernel,
                    sparsity,
                    [q, k, v].map(CubeTensor::binding).each_ref(),
                    &out.clone().binding(),
                    &lse.clone().binding(),
                )
            });
            [out, lse]
        },
    );
    (out, lse)
}

fn dims_of_cube(t: &CudaCube) -> Vec<usize> {
    t.meta.shape().iter().copied().collect()
}

/// The autodiff op: forward through the kernel, its state what the backward kernels read.
fn autodiff_attention(
    q: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    k: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    v: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    causal: bool,
    layout: Option<&SparseLayout>,
) -> Option<<ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive> {
    let [fq, fk, fv] = [&q, &k, &v].map(|t| fused(&t.primitive));
    let (fq, fk, fv) = (fq?, fk?, fv?);
    let options = Options::new([&fq, &fk, &fv], causal, layout)?;
    let (out, lse) = forward(&fq, &fk, &fv, &options);
    let prep = FlashBackward
        .prepare::<NoCheckpointing>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful();
    let primitive = ZeroTensor::local(out.clone());
    Some(match prep {
        OpsKind::Tracked(prep) => {
            let state = FlashState {
                inputs: [fq, fk, fv],
                out,
                lse,
                options,
            };
            prep.finish(state, primitive)
        }
        OpsKind::UnTracked(prep) => prep.finish(primitive),
    })
}

#[derive(Debug)]
struct FlashBackward;

#[derive(Clone, Debug)]
struct FlashState {
    inputs: [Fused; 3],
    out: Fused,
    lse: Fused,
    options: Options,
}

impl Backward<Zero, 3> for FlashBackward {
    type State = FlashState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let FlashState {
            inputs: [q, k, v],
            out,
            lse,
            options,
        } = ops.state;
        let d_out = grads.consume::<Zero>(&ops.node);
        let d_out = fused(&d_out).expect("the gradient of a CUDA tensor is one");
        if crate::profile::recording() {
            // Scores recomputed, dP, dV, dQ, dK: five products of the forward's size each.
            let macs = super::forward_macs(&dims_of(&q), &dims_of(&k)) / 2 * 5;
            crate::profile::record_macs(macs);
        }
        let dtype = q.dtype;
        let outputs = [&q, &k, &v].map(|t| (t.shape.clone(), dtype));
        let [dq, dk, dv] = run_fused(
            "burn_zero_flash_backward",
            [&q, &k, &v, &out, &d_out, &lse],
            outputs,
            move |[q, k, v, out, d_out, lse]| {
                let dims = &options.dims;
                let delta = empty(&q, &[dims.batch, dims.heads, dims.seq_q], DType::F32);
                let [dq, dk, dv] = [&q, &k, &v].map(|t| empty(t, &dims_of_cube(t), dtype));
                let client = q.client.clone();
                with_sparsity(&options, |sparsity| {
                    flash_backward(
                        &client,
                        dims,
                        dtype.into(),
                        options.kernel,
                        sparsity,
                        [q, k, v].map(CubeTensor::binding).each_ref(),
                        [out, d_out, lse, delta].map(CubeTensor::binding).each_ref(),
                        [dq.clone(), dk.clone(), dv.clone()]
                            .map(CubeTensor::binding)
                            .each_ref(),
                    )
                });
                [dq, dk, dv]
            },
        );
        let parents: [Option<NodeId>; 3] = ops.parents.map(|p| p.map(|node| node.id));
        for (parent, grad) in parents.into_iter().zip([dq, dk, dv]) {
            if let Some(id) = parent {
                grads.register::<Zero>(id, ZeroTensor::local(grad));
            }
        }
    }
}
