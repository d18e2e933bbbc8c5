//! The flash kernels on `ZeroBackend<burn::backend::Cuda>` tensors: the forward on the
//! primitives, and the autodiff op whose backward runs the backward kernels.

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

use crate::backend::cuda::{cube_tensor, from_cube};
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
        let [q, k, v] = [Cube::of(&q?)?, Cube::of(&k?)?, Cube::of(&v?)?];
        let (out, _) = forward(&q, &k, &v, &Options::new([&q, &k, &v], causal, layout)?);
        return cast(Tensor::<Zero, 4>::from_primitive(TensorPrimitive::Float(
            out.zero,
        )));
    }
    None
}

fn float<B: Backend>(t: Tensor<B, 4>) -> B::FloatTensorPrimitive {
    t.into_primitive().tensor()
}

/// A `ZeroTensor<Cuda>` with its cubecl CUDA tensor (fusion's pending work on it done).
#[derive(Clone, Debug)]
struct Cube {
    zero: ZeroTensor<Inner>,
    cube: CubeTensor<CudaRuntime>,
}

impl Cube {
    /// `None` for dtypes the kernels do not take.
    fn of(zero: &ZeroTensor<Inner>) -> Option<Self> {
        let cube = cube_tensor::<Inner>(zero.inner())?;
        matches!(cube.dtype, DType::F32 | DType::BF16 | DType::F16).then(|| Self {
            zero: zero.clone(),
            cube,
        })
    }

    fn shape(&self) -> Vec<usize> {
        self.cube.meta.shape().iter().copied().collect()
    }

    /// A new uninitialized tensor on the same device.
    fn empty(&self, shape: &[usize], dtype: DType) -> CubeTensor<CudaRuntime> {
        empty_device_dtype::<CudaRuntime>(
            self.cube.client.clone(),
            self.cube.device.clone(),
            Shape::from(shape.to_vec()),
            dtype,
        )
    }

    /// `cube` as a `ZeroTensor` of the same backend as this one.
    fn wrap(&self, cube: CubeTensor<CudaRuntime>) -> ZeroTensor<Inner> {
        ZeroTensor::local(
            from_cube::<Inner>(self.zero.inner(), cube)
                .expect("a CUDA tensor converts back to its own backend"),
        )
    }
}

/// What one call computes beyond its inputs: its sizes, the mask, and a block layout in
/// device memory (uploaded once, for the forward and the backward).
#[derive(Clone, Debug)]
struct Options {
    dims: AttentionDims,
    causal: bool,
    /// The layout (`[heads, blocks, blocks]` `u32`) and its block.
    layout: Option<(CubeTensor<CudaRuntime>, usize)>,
}

impl Options {
    /// `None` where the kernels do not take the operands (their dtypes differ).
    ///
    /// # Panics
    /// On shapes attention cannot take, or a layout that does not cover them, naming them.
    fn new([q, k, v]: [&Cube; 3], causal: bool, layout: Option<&SparseLayout>) -> Option<Self> {
        if q.cube.dtype != k.cube.dtype || q.cube.dtype != v.cube.dtype {
            return None;
        }
        let dims =
            AttentionDims::of(&q.shape(), &k.shape(), &v.shape()).unwrap_or_else(|e| panic!("{e}"));
        let layout = layout.map(|l| {
            let shape = [l.heads, l.blocks, l.blocks];
            dims.check_layout(&shape, l.block)
                .unwrap_or_else(|e| panic!("{e}"));
            let handle = q.cube.client.create_from_slice(u32::as_bytes(&l.kept));
            let tensor = CubeTensor::new_contiguous(
                q.cube.client.clone(),
                q.cube.device.clone(),
                Shape::from(shape.to_vec()),
                handle,
                DType::U32,
            );
            (tensor, l.block)
        });
        Some(Self {
            dims,
            causal,
            layout,
        })
    }

    fn kernel(&self) -> FlashOptions {
        FlashOptions {
            causal: self.causal,
            scale: 1.0 / (self.dims.head_dim as f32).sqrt(),
            tensor_cores: super::tensor_cores_allowed(),
        }
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
fn forward(q: &Cube, k: &Cube, v: &Cube, options: &Options) -> (Cube, CubeTensor<CudaRuntime>) {
    let dims = &options.dims;
    let out = q.empty(&q.shape(), q.cube.dtype);
    let lse = q.empty(&[dims.batch, dims.heads, dims.seq_q], DType::F32);
    if crate::profile::recording() {
        crate::profile::record_macs(super::forward_macs(&q.shape(), &k.shape()));
    }
    with_sparsity(options, |sparsity| {
        flash_forward(
            &q.cube.client,
            dims,
            q.cube.dtype.into(),
            options.kernel(),
            sparsity,
            [q, k, v].map(|t| t.cube.clone().binding()).each_ref(),
            &out.clone().binding(),
            &lse.clone().binding(),
        )
    });
    let out = Cube {
        zero: q.wrap(out.clone()),
        cube: out,
    };
    (out, lse)
}

/// The autodiff op: forward through the kernel, its state what the backward kernels read.
fn autodiff_attention(
    q: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    k: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    v: <ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    causal: bool,
    layout: Option<&SparseLayout>,
) -> Option<<ZeroAd as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive> {
    let [cq, ck, cv] = [&q, &k, &v].map(|t| Cube::of(&t.primitive));
    let (cq, ck, cv) = (cq?, ck?, cv?);
    let options = Options::new([&cq, &ck, &cv], causal, layout)?;
    let (out, lse) = forward(&cq, &ck, &cv, &options);
    let prep = FlashBackward
        .prepare::<NoCheckpointing>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful();
    Some(match prep {
        OpsKind::Tracked(prep) => {
            let primitive = out.zero.clone();
            let state = FlashState {
                inputs: [cq, ck, cv],
                out,
                lse,
                options,
            };
            prep.finish(state, primitive)
        }
        OpsKind::UnTracked(prep) => prep.finish(out.zero),
    })
}

#[derive(Debug)]
struct FlashBackward;

#[derive(Clone, Debug)]
struct FlashState {
    inputs: [Cube; 3],
    out: Cube,
    lse: CubeTensor<CudaRuntime>,
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
        let d_out = Cube::of(&d_out).expect("the gradient of a CUDA tensor is one");
        let dims = &options.dims;
        if crate::profile::recording() {
            // Scores recomputed, dP, dV, dQ, dK: five products of the forward's size each.
            let macs = super::forward_macs(&q.shape(), &k.shape()) / 2 * 5;
            crate::profile::record_macs(macs);
        }
        let delta = q.empty(&[dims.batch, dims.heads, dims.seq_q], DType::F32);
        let dtype = q.cube.dtype;
        let [dq, dk, dv] = [&q, &k, &v].map(|t| t.empty(&t.shape(), dtype));
        with_sparsity(&options, |sparsity| {
            flash_backward(
                &q.cube.client,
                dims,
                dtype.into(),
                options.kernel(),
                sparsity,
                [&q, &k, &v].map(|t| t.cube.clone().binding()).each_ref(),
                [out.cube.clone(), d_out.cube.clone(), lse, delta]
                    .map(CubeTensor::binding)
                    .each_ref(),
                [dq.clone(), dk.clone(), dv.clone()]
                    .map(CubeTensor::binding)
                    .each_ref(),
            )
        });
        let parents: [Option<NodeId>; 3] = ops.parents.map(|p| p.map(|node| node.id));
        for (parent, grad) in parents.into_iter().zip([dq, dk, dv]) {
            if let Some(id) = parent {
                grads.register::<Zero>(id, q.wrap(grad));
            }
        }
    }
}
