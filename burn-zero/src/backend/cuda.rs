//! Device addresses of burn-cuda float tensors, for collectives on their memory.
//!
//! The engine is generic over its inner backend; at run time it asks whether a flat buffer is
//! a CUDA tensor (`CubeBackend<CudaRuntime>`, or the same behind burn's fusion, the default
//! `burn::backend::Cuda`). Anything else answers `None` and takes the host path.

use core::any::Any;

use burn_backend::TensorMetadata;
use burn_backend::{Backend, DType as BurnDType};
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::stream::OperationStreams;
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cubecl::server::ComputeServer;
use cubecl::stream_id::StreamId;

use crate::backend::stream_order::{self, Handshake};
use crate::comm::{DType, DeviceBuf};

/// A contiguous CUDA buffer and what keeps its memory from being freed or reused.
pub(crate) struct CudaBuffer {
    /// Where it is.
    pub(crate) buf: DeviceBuf,
    /// Holds a reference to the memory until NCCL is done with it.
    pub(crate) _keep: CubeTensor<CudaRuntime>,
}

/// A CUDA float tensor's memory with its layout (strided views included).
pub(crate) struct CudaView {
    /// Address of the element at index 0.
    pub(crate) ptr: u64,
    pub(crate) shape: Vec<usize>,
    /// In elements.
    pub(crate) strides: Vec<usize>,
    pub(crate) dtype: DType,
    /// Holds a reference to the memory until the caller is done with it.
    pub(crate) keep: CubeTensor<CudaRuntime>,
}

/// The memory of `tensor` if it is a CUDA float tensor of a dtype NCCL moves, materialized
/// (fusion's pending work on it is executed first). `None` for other backends.
pub(crate) fn cuda_buffer<I: Backend>(tensor: &I::FloatTensorPrimitive) -> Option<CudaBuffer> {
    let view = cuda_view::<I>(tensor)?;
    if !view.keep.is_contiguous() {
        return None;
    }
    let len = view.shape.iter().product();
    Some(CudaBuffer {
        buf: DeviceBuf {
            ptr: view.ptr,
            len,
            dtype: view.dtype,
        },
        _keep: view.keep,
    })
}

/// The memory and layout of `tensor` if it is a CUDA float tensor of f32, bf16 or f16,
/// materialized. Getting the address also aligns this thread's stream after the stream that
/// wrote the memory.
pub(crate) fn cuda_view<I: Backend>(tensor: &I::FloatTensorPrimitive) -> Option<CudaView> {
    view_of(cube_tensor::<I>(tensor)?)
}

/// `tensor` as cubecl's CUDA tensor: fusion's pending work on it is executed first (one
/// blocking call into fusion, none when run on fusion's own thread). `None` for other backends.
pub(crate) fn cube_tensor<I: Backend>(
    tensor: &I::FloatTensorPrimitive,
) -> Option<CubeTensor<CudaRuntime>> {
    let any = tensor as &dyn Any;
    match any.downcast_ref::<CubeTensor<CudaRuntime>>() {
        Some(cube) => Some(cube.clone()),
        None => {
            let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()?;
            // Any CubeBackend over CUDA resolves a fused CUDA tensor: same primitives.
            Some(
                fused
                    .client
                    .resolve_tensor_float::<CubeBackend<CudaRuntime, f32, i32, u8>>(fused.clone()),
            )
        }
    }
}

/// `cube` as a primitive of the same backend as `like` (a cubecl CUDA tensor, or one behind
/// burn's fusion, registered there without waiting for fusion's thread).
pub(crate) fn from_cube<I: Backend>(
    like: &I::FloatTensorPrimitive,
    cube: CubeTensor<CudaRuntime>,
) -> Option<I::FloatTensorPrimitive> {
    let any = like as &dyn Any;
    let out: Box<dyn Any> = if any.is::<CubeTensor<CudaRuntime>>() {
        Box::new(cube)
    } else {
        let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()?;
        Box::new(fused_from_cube(&fused.client, cube))
    };
    out.downcast::<I::FloatTensorPrimitive>().ok().map(|b| *b)
}

/// `cube` registered with fusion's `client` as a new tensor (no wait for fusion's thread).
pub(crate) fn fused_from_cube(
    client: &burn_fusion::Client<FusionCubeRuntime<CudaRuntime>>,
    cube: CubeTensor<CudaRuntime>,
) -> FusionTensor<FusionCubeRuntime<CudaRuntime>> {
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    let (shape, dtype) = (cube.shape(), cube.dtype);
    let handle = <Cube as BackendIr>::float_tensor_handle(cube);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    let op = OperationIr::Init(init);
    let registered = client.register(OperationStreams::default(), op, NoOp::<Cube>::new());
    registered
        .into_iter()
        .next()
        .expect("an init operation has one output")
}

/// The layout of a cubecl CUDA tensor of f32, bf16 or f16, its address left 0: what can be
/// decided about a product without a call into cubecl.
pub(crate) fn layout_of(cube: &CubeTensor<CudaRuntime>) -> Option<CudaView> {
    let dtype = match cube.dtype {
        BurnDType::F32 => DType::F32,
        BurnDType::BF16 => DType::Bf16,
        BurnDType::F16 => DType::F16,
        _ => return None,
    };
    Some(CudaView {
        ptr: 0,
        shape: cube.meta.shape().iter().copied().collect(),
        strides: cube.meta.strides().iter().copied().collect(),
        dtype,
        keep: cube.clone(),
    })
}

/// The memory and layout of a cubecl CUDA tensor of f32, bf16 or f16 (one blocking call into
/// cubecl, none when run on cubecl's own thread inside `ComputeClient::exclusive`).
pub(crate) fn view_of(cube: CubeTensor<CudaRuntime>) -> Option<CudaView> {
    let resource = cube.client.get_resource(cube.handle.clone()).ok()?;
    let resource = resource.resource();
    with_address(layout_of(&cube)?, resource.ptr, resource.size)
}

/// [`view_of`] inside a task that holds cubecl's CUDA server on its thread, where a call through
/// the client would re-enter the server and panic.
pub(crate) fn view_on(server: &mut CudaServer, cube: &CubeTensor<CudaRuntime>) -> Option<CudaView> {
    let binding = cube.handle.clone().binding();
    let resource = server.get_resource(binding, StreamId::current()).ok()?;
    let resource = resource.resource();
    with_address(layout_of(cube)?, resource.ptr, resource.size)
}

/// cubecl's CUDA server: the service its device thread runs.
pub(crate) type CudaServer = <CudaRuntime as cubecl::Runtime>::Server;

fn with_address(mut view: CudaView, ptr: u64, size: u64) -> Option<CudaView> {
    let span = view
        .shape
        .iter()
        .zip(&view.strides)
        .map(|(d, s)| d.saturating_sub(1) * s)
        .sum::<usize>()
        + 1;
    let bytes = span * view.keep.dtype.size();
    assert!(
        view.shape.contains(&0) || size as usize >= bytes,
        "a CUDA tensor spanning {span} elements lies in {size} bytes"
    );
    view.ptr = ptr;
    Some(view)
}

/// Makes every later allocation of exactly one of `sizes` bytes on `device` (when it is a CUDA
/// device) an exact-size buffer of cubecl's persistent pool, reused by size, instead of a slice
/// of its dynamic pools; returns whether it did. Those round an allocation above a twelfth of
/// the device's memory up to a page of a quarter of it: on an H200 each of a 3B model's 12.8 GB
/// fp32 buffers (master, moments, gradients) took a share of a 37.5 GB page, the next page did
/// not fit, and the failed allocation panicked in cubecl's device thread. A size stays
/// registered while a buffer of it exists (an explicit memory cleanup forgets sizes with none).
pub(crate) fn exact_size_allocations<I: Backend>(device: &I::Device, sizes: &[usize]) -> bool {
    let Some(device) = (device as &dyn Any).downcast_ref::<cubecl::cuda::CudaDevice>() else {
        return false;
    };
    let client = <CudaRuntime as cubecl::Runtime>::client(device);
    for &bytes in sizes.iter().filter(|b| **b > 0) {
        // Allocated in persistent mode and dropped: its free buffer registers the size.
        let registered = client.memory_persistent_allocation(bytes, |bytes| client.empty(bytes));
        drop(registered);
    }
    true
}

/// What burn's stream waits on for a device collective ordered by flags (see
/// `stream_order.rs`): the last call's handshake covers every earlier one of its channel.
pub(crate) struct Fence {
    client: ComputeClient<CudaRuntime>,
    ordinal: usize,
    /// burn's stream the collective was ordered after.
    stream: StreamId,
    handshake: Handshake,
}

impl Fence {
    /// Where the collective stream waits for burn's stream, and for which number.
    pub(crate) fn ready(&self) -> (u64, u32) {
        (self.handshake.ready, self.handshake.seq)
    }

    /// Where the collective stream signals that it is done, and with which number.
    pub(crate) fn done(&self) -> (u64, u32) {
        (self.handshake.done, self.handshake.seq)
    }

    /// Whether `other` orders against the same stream and channel, later (so it covers this).
    pub(crate) fn covered_by(&self, other: &Fence) -> bool {
        self.ordinal == other.ordinal
            && self.stream == other.stream
            && self.handshake.done == other.handshake.done
    }

    /// Makes burn's stream wait, from now on, until the collective stream signalled `done`
    /// (one blocking visit to cubecl's thread, no device wait).
    pub(crate) fn await_on_compute_stream(self) -> Result<(), String> {
        let Fence {
            client,
            ordinal,
            stream,
            handshake,
        } = self;
        stream
            .executes(|| client.exclusive(|| stream_order::end(&client, ordinal, handshake)))
            .map_err(|e| format!("{e:?}"))
    }
}

/// For a device collective on `input`'s memory ordered by flags, on `channel`: allocates its
/// output of `len` elements on burn's stream and raises `ready` there after everything queued
/// before (one blocking visit to cubecl's thread, no device wait). `None` if it cannot.
pub(crate) fn ordered_output(
    input: &CudaBuffer,
    len: usize,
    channel: u64,
) -> Option<(CudaBuffer, Fence)> {
    let cube = &input._keep;
    let (client, device, dtype) = (cube.client.clone(), cube.device.clone(), cube.dtype);
    let ordinal = device.index;
    let outcome = client.exclusive(|| {
        let handle = client.empty(len * dtype.size());
        let out = CubeTensor::new_contiguous(client.clone(), device, [len].into(), handle, dtype);
        let view = view_of(out)?;
        let handshake = stream_order::begin(&client, ordinal, channel)?;
        let output = CudaBuffer {
            buf: DeviceBuf {
                ptr: view.ptr,
                len,
                dtype: view.dtype,
            },
            _keep: view.keep,
        };
        Some((output, handshake))
    });
    let (output, handshake) = outcome.ok().flatten()?;
    let fence = Fence {
        client,
        ordinal,
        stream: StreamId::current(),
        handshake,
    };
    Some((output, fence))
}
