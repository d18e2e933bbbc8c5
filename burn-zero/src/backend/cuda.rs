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

use crate::backend::ZeroTensor;
use crate::backend::stream_order::{self, Handshake};
use crate::comm::{DType, DeviceBuf};

/// A contiguous CUDA buffer and what keeps its memory from being freed or reused.
pub(crate) struct CudaBuffer {
    /// Where it is.
    pub(crate) buf: DeviceBuf,
    /// Holds a reference to the memory until NCCL is done with it.
    pub(crate) _keep: CubeTensor<CudaRuntime>,
}

impl CudaBuffer {
    /// The buffer of a contiguous view, all its elements.
    fn of(view: CudaView) -> Self {
        let len = view.shape.iter().product();
        Self {
            buf: DeviceBuf {
                ptr: view.ptr,
                len,
                dtype: view.dtype,
            },
            _keep: view.keep,
        }
    }
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
    Some(CudaBuffer::of(view))
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
    cube_tensor_of(tensor as &dyn Any)
}

/// [`cube_tensor`] of any backend's float (or int) primitive: a cubecl CUDA tensor, one behind
/// burn's fusion, or either held whole by `ZeroBackend` (a ZeRO-3 shard is not: `None`).
pub(crate) fn cube_tensor_of(any: &dyn Any) -> Option<CubeTensor<CudaRuntime>> {
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    if let Some(zero) = any.downcast_ref::<ZeroTensor<burn_fusion::Fusion<Cube>>>() {
        return zero
            .is_local()
            .then(|| cube_tensor_of(zero.inner()))
            .flatten();
    }
    if let Some(zero) = any.downcast_ref::<ZeroTensor<Cube>>() {
        return zero
            .is_local()
            .then(|| cube_tensor_of(zero.inner()))
            .flatten();
    }
    match any.downcast_ref::<CubeTensor<CudaRuntime>>() {
        Some(cube) => Some(cube.clone()),
        None => {
            let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()?;
            // Any CubeBackend over CUDA resolves a fused CUDA tensor: same primitives.
            Some(match fused.dtype.is_float() {
                true => fused.client.resolve_tensor_float::<Cube>(fused.clone()),
                false => fused.client.resolve_tensor_int::<Cube>(fused.clone()),
            })
        }
    }
}

/// `cube` as a primitive of the same backend as `like` (a cubecl CUDA tensor, or one behind
/// burn's fusion, registered there without waiting for fusion's thread; either inside
/// `ZeroTensor`).
pub(crate) fn from_cube<I: Backend>(
    like: &I::FloatTensorPrimitive,
    cube: CubeTensor<CudaRuntime>,
) -> Option<I::FloatTensorPrimitive> {
    cube_as::<I>(cube, fusion_client_of(like as &dyn Any))
}

/// `cube` as the float primitive `I` holds: cubecl's tensor, fusion's (registered with `fusion`,
/// or the device's fusion client when `None`), or either inside `ZeroTensor`. `None` for other
/// backends.
fn cube_as<I: Backend>(
    cube: CubeTensor<CudaRuntime>,
    fusion: Option<FusionClient>,
) -> Option<I::FloatTensorPrimitive> {
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    type Fused = FusionTensor<FusionCubeRuntime<CudaRuntime>>;
    let want = core::any::TypeId::of::<I::FloatTensorPrimitive>();
    let fused = |cube: CubeTensor<CudaRuntime>| {
        let client = fusion.unwrap_or_else(|| burn_fusion::get_client::<Cube>(&cube.device));
        fused_from_cube(&client, cube)
    };
    let boxed: Box<dyn Any> = if want == core::any::TypeId::of::<CubeTensor<CudaRuntime>>() {
        Box::new(cube)
    } else if want == core::any::TypeId::of::<Fused>() {
        Box::new(fused(cube))
    } else if want == core::any::TypeId::of::<ZeroTensor<Cube>>() {
        Box::new(ZeroTensor::<Cube>::local(cube))
    } else if want == core::any::TypeId::of::<ZeroTensor<burn_fusion::Fusion<Cube>>>() {
        Box::new(ZeroTensor::<burn_fusion::Fusion<Cube>>::local(fused(cube)))
    } else {
        return None;
    };
    boxed.downcast::<I::FloatTensorPrimitive>().ok().map(|b| *b)
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

/// The communicators' element type of a burn float dtype NCCL moves.
pub(crate) fn comm_dtype(dtype: BurnDType) -> Option<DType> {
    match dtype {
        BurnDType::F32 => Some(DType::F32),
        BurnDType::BF16 => Some(DType::Bf16),
        BurnDType::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The layout of a cubecl CUDA tensor of f32, bf16 or f16, its address left 0: what can be
/// decided about a product without a call into cubecl.
pub(crate) fn layout_of(cube: &CubeTensor<CudaRuntime>) -> Option<CudaView> {
    let dtype = comm_dtype(cube.dtype)?;
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

/// burn-cuda's fusion client.
pub(crate) type FusionClient = burn_fusion::Client<FusionCubeRuntime<CudaRuntime>>;

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

/// Makes burn's stream wait for every fence of `fences` (in issue order): per stream and
/// channel only the last one, whose handshake covers the earlier ones.
pub(crate) fn await_fences(fences: impl IntoIterator<Item = Fence>) -> Result<(), String> {
    let mut last: Vec<Fence> = Vec::new();
    for fence in fences {
        match last.iter().position(|f| f.covered_by(&fence)) {
            Some(i) => last[i] = fence,
            None => last.push(fence),
        }
    }
    last.into_iter()
        .try_for_each(Fence::await_on_compute_stream)
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
    ordered_alloc(&cube.device, &[len], cube.dtype, channel)
}

/// A contiguous buffer of `shape` and `dtype` on `device`, allocated on burn's stream and a flag
/// raised there after it, both from cubecl's thread (one blocking visit, no device wait).
fn ordered_alloc(
    device: &cubecl::cuda::CudaDevice,
    shape: &[usize],
    dtype: BurnDType,
    channel: u64,
) -> Option<(CudaBuffer, Fence)> {
    let client = <CudaRuntime as cubecl::Runtime>::client(device);
    let ordinal = device.index;
    let len: usize = shape.iter().product();
    let outcome = client.exclusive(|| {
        let handle = client.empty(len.max(1) * dtype.size());
        let out =
            CubeTensor::new_contiguous(client.clone(), device.clone(), shape.into(), handle, dtype);
        let view = view_of(out)?;
        let handshake = stream_order::begin(&client, ordinal, channel)?;
        Some((CudaBuffer::of(view), handshake))
    });
    let (buffer, handshake) = outcome.ok().flatten()?;
    let fence = Fence {
        client,
        ordinal,
        stream: StreamId::current(),
        handshake,
    };
    Some((buffer, fence))
}

/// A fresh contiguous CUDA float tensor of `shape` and `dtype` on `device` for a foreign stream
/// to write, allocated on burn's stream with an event recorded there after it, in one visit to
/// cubecl's thread (the writer waits for the event: burn's stream is then done with whatever
/// the memory held before). Returns the buffer, the event, the tensor as `I`'s primitive, and
/// the fusion client burn's wait for the writer must go through. `None` for other backends.
pub(crate) fn empty_with_event<I: Backend>(
    device: &I::Device,
    shape: &[usize],
    dtype: BurnDType,
) -> Option<(
    CudaBuffer,
    super::stream_event::RawEvent,
    I::FloatTensorPrimitive,
    Option<FusionClient>,
)> {
    let cuda = (device as &dyn Any).downcast_ref::<cubecl::cuda::CudaDevice>()?;
    let client = <CudaRuntime as cubecl::Runtime>::client(cuda);
    let len: usize = shape.iter().product();
    let (buffer, ready) = client
        .exclusive(|| {
            let handle = client.empty(len.max(1) * dtype.size());
            let out = CubeTensor::new_contiguous(
                client.clone(),
                cuda.clone(),
                shape.into(),
                handle,
                dtype,
            );
            let view = view_of(out)?;
            let ready = super::stream_event::record_now(cuda).ok()?;
            Some((CudaBuffer::of(view), ready))
        })
        .ok()
        .flatten()?;
    let primitive = cube_as::<I>(buffer._keep.clone(), None)?;
    let fusion = fusion_client_of(&primitive as &dyn Any);
    Some((buffer, ready, primitive, fusion))
}

/// The flags' channel of a communicator's stream (a link's, or one borrowed for a few calls),
/// named by its address: it lives as long as its owner, and a later one at the same address
/// continues its numbers.
pub(crate) fn channel_of(comm: &dyn crate::comm::DeviceCollectives) -> u64 {
    comm as *const dyn crate::comm::DeviceCollectives as *const () as u64
}

/// A copy of the CUDA float tensor `any` (any backend's primitive, as [`cube_tensor_of`] takes
/// it) in fresh contiguous memory that only the returned buffer holds, made on burn's stream
/// in fusion's order (the copy is launched on fusion's thread after its queue for this stream
/// has run, as the event that follows it is, `stream_event::record_in_order`). `None` for
/// other backends and dtypes NCCL does not move.
///
/// A pipeline's sends read this copy, not the tensor's own memory: sending the tensor's own
/// memory gave a 3B Llama with checkpointed layers wrong 1F1B updates on 2 H100s while the
/// same run with a copy, or with the host waiting for the device before each send, matched
/// one GPU (the cause inside burn's or cubecl's ordering of that memory is not isolated).
pub(crate) fn staged_copy(any: &dyn Any) -> Option<CudaBuffer> {
    let cube = cube_tensor_of(any)?;
    let copy = move || super::fused_op::contiguous_copy(cube);
    let cube = match fusion_client_of(any) {
        Some(fusion) => fusion.sync(copy),
        None => copy(),
    };
    view_of(cube).map(CudaBuffer::of)
}

/// The fusion client of a burn-cuda tensor behind fusion (also held whole by `ZeroBackend`).
pub(crate) fn fusion_client_of(any: &dyn Any) -> Option<FusionClient> {
    fused_tensor_of(any).map(|fused| fused.client.clone())
}

/// The burn-cuda tensor behind fusion that `any` is (also held whole by `ZeroBackend`).
pub(crate) fn fused_tensor_of(
    any: &dyn Any,
) -> Option<&FusionTensor<FusionCubeRuntime<CudaRuntime>>> {
    type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
    if let Some(zero) = any.downcast_ref::<ZeroTensor<burn_fusion::Fusion<Cube>>>() {
        return zero
            .is_local()
            .then(|| fused_tensor_of(zero.inner()))
            .flatten();
    }
    any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()
}
