//! The CUDA side of captured steps: cubecl's stream capture (`patches/cubecl-cuda`), the
//! ordering of a replay against the caller's stream, and the copies of new inputs into the
//! buffers the graph reads.

use std::sync::Arc;

use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::FusionRuntime;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use cubecl::cuda::{CapturedGraph, CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::server::ComputeServer;
use cubecl::stream_id::StreamId;
use cudarc::driver::result::{event, memcpy_dtod_async, stream};
use cudarc::driver::sys::{
    CUDA_MEMCPY2D, CUevent, CUevent_flags, CUevent_wait_flags, CUmemorytype, CUstream,
    cuMemcpy2DAsync_v2,
};

use crate::backend::cuda::{CudaServer, FusionClient, cube_tensor_of, fused_tensor_of};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The fusion client of `device` (burn-cuda's, whichever thread asks).
fn fusion(device: &CudaDevice) -> FusionClient {
    burn_fusion::get_client::<Cube>(device)
}

/// Runs `task` on cubecl's device thread of `device` (after the tasks queued there before),
/// and returns its answer.
fn on_device_thread<T: Send + 'static>(
    device: &CudaDevice,
    task: impl FnOnce(&mut CudaServer) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    DeviceHandle::<CudaServer>::new(device.to_id())
        .submit_blocking(task)
        .map_err(|e| format!("cubecl's device thread: {e:?}"))?
}

/// Runs `task` on cubecl's thread of `device` after everything queued before on stream `on`
/// (fusion's queue of `on` drained first), and returns its answer.
fn in_order<T: Send + 'static>(
    device: &CudaDevice,
    on: StreamId,
    task: impl FnOnce(&mut CudaServer) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let client = fusion(device);
    let device = device.clone();
    on.executes(|| client.sync(move || on_device_thread(&device, task)))
}

/// Makes stream `graph` wait for the work queued so far on the calling thread's stream.
pub(crate) fn order_after_caller(device: &CudaDevice, graph: StreamId) -> Result<(), String> {
    copy_inputs(device, graph, Vec::new())
}

/// Makes the calling thread's stream wait for the work queued so far on stream `graph`
/// (fusion's queue of `graph` drained first).
pub(crate) fn order_caller_after(device: &CudaDevice, graph: StreamId) -> Result<(), String> {
    let caller = StreamId::current();
    in_order(device, graph, |_| Ok(()))?;
    in_order(device, caller, move |server| {
        let (ours, theirs) = (raw_stream(server, caller)?, raw_stream(server, graph)?);
        wait_for(ours, theirs)
    })
}

/// Copies each `(from, into)` on stream `graph` after the calling thread's queued work, and
/// orders the caller's later work after the copies.
pub(crate) fn copy_inputs(
    device: &CudaDevice,
    graph: StreamId,
    copies: Vec<CopyPair>,
) -> Result<(), String> {
    replay(device, graph, None, copies).map(|_| ())
}

/// A capture of stream `graph` in progress: [`Capture::end`] returns its graph; dropped before
/// that (the closure failed or panicked), it ends the capture and discards what it held, so
/// the stream is usable again.
pub(crate) struct Capture {
    device: CudaDevice,
    stream: StreamId,
    open: bool,
}

impl Capture {
    /// Starts capturing the work queued on stream `graph` of `device`, after the calling
    /// thread's queued work (which stays outside the graph).
    pub(crate) fn begin(device: &CudaDevice, graph: StreamId) -> Result<Self, String> {
        in_order(device, StreamId::current(), |_| Ok(()))?;
        in_order(device, graph, move |server| {
            server
                .begin_capture(graph)
                .map_err(|e| format!("beginning the capture: {e}"))
        })?;
        Ok(Self {
            device: device.clone(),
            stream: graph,
            open: true,
        })
    }

    /// Ends the capture: everything queued on the stream since [`Capture::begin`] is in the
    /// graph.
    pub(crate) fn end(mut self) -> Result<Graph, String> {
        self.open = false;
        let stream = self.stream;
        let captured = in_order(&self.device, stream, move |server| {
            server
                .end_capture(stream)
                .map(Arc::new)
                .map_err(|e| format!("ending the capture: {e}"))
        })?;
        Ok(Graph {
            captured: Some(captured),
            device: self.device.clone(),
            stream,
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.open {
            let stream = self.stream;
            // Whatever was captured is discarded (the graph drops on cubecl's thread).
            let _ = in_order(&self.device, stream, move |server| {
                server
                    .end_capture(stream)
                    .map(drop)
                    .map_err(|e| e.to_string())
            });
        }
    }
}

/// A captured graph of stream `stream`, replayed by [`Graph::launch`]; dropped on cubecl's
/// device thread, where the CUDA context is current.
pub(crate) struct Graph {
    captured: Option<Arc<CapturedGraph>>,
    device: CudaDevice,
    stream: StreamId,
}

impl Graph {
    /// On the graph's stream, after the calling thread's stream's queued work: each
    /// `(from, into)` copied, then the graph replayed; the calling thread's later work is
    /// ordered after it (CUDA events both ways, no host wait). Returns the time inside
    /// `cuGraphLaunch`.
    pub(crate) fn launch(&self, copies: Vec<CopyPair>) -> Result<std::time::Duration, String> {
        replay(&self.device, self.stream, self.captured.clone(), copies)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Some(captured) = self.captured.take() {
            let _ = on_device_thread(&self.device, move |_| {
                drop(captured);
                Ok(())
            });
        }
    }
}

/// A tensor to copy from and one to copy into.
pub(crate) type CopyPair = (CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>);

/// On stream `graph`, after the calling thread's stream's queued work: each `(from, into)`
/// copied, then `captured` replayed if given; the calling thread's later work is ordered after
/// it all (CUDA events both ways, no host wait). Returns the time inside `cuGraphLaunch`.
fn replay(
    device: &CudaDevice,
    graph: StreamId,
    captured: Option<Arc<CapturedGraph>>,
    copies: Vec<CopyPair>,
) -> Result<std::time::Duration, String> {
    let caller = StreamId::current();
    in_order(device, caller, move |server| {
        let mut launch = std::time::Duration::ZERO;
        let ours = raw_stream(server, caller)?;
        let theirs = raw_stream(server, graph)?;
        wait_for(theirs, ours)?;
        for (i, (from, into)) in copies.iter().enumerate() {
            // The graph's stream runs the copy after the caller's queued work.
            copy_elements(server, (from, caller), (into, graph), theirs)
                .map_err(|e| format!("copying input {i}: {e}"))?;
        }
        if let Some(captured) = &captured {
            let start = std::time::Instant::now();
            server
                .launch_graph(graph, captured)
                .map_err(|e| format!("launching: {e}"))?;
            launch = start.elapsed();
        }
        // The caller's stream waits for the graph's: memory the copies read may be reused by
        // the caller's later work once they are dropped here.
        wait_for(ours, theirs)?;
        drop(copies);
        // The last reference to a graph may be this task's: it then drops here, on this thread.
        drop(captured);
        Ok(launch)
    })
}

/// [`crate::graph::copy_values`] on CUDA: one operation of fusion's stream where every tensor
/// is fusion's, else copies queued from the host after resolving each tensor.
pub(crate) fn copy_values(
    pairs: &[(&dyn core::any::Any, &dyn core::any::Any)],
) -> Result<(), String> {
    if copy_in_stream(pairs) {
        return Ok(());
    }
    let cubes = pairs
        .iter()
        .enumerate()
        .map(
            |(i, (from, into))| match (cube_tensor_of(*from), cube_tensor_of(*into)) {
                (Some(f), Some(t)) => Ok((f, t)),
                _ => Err(format!("tensor pair {i} is not of burn-cuda")),
            },
        )
        .collect::<Result<Vec<_>, String>>()?;
    let Some(device) = cubes.first().map(|(f, _)| f.device.clone()) else {
        return Ok(());
    };
    copy(&device, cubes)
}

/// Whether `a` and `b` are the same fusion tensor (`None` unless both are fusion's CUDA
/// tensors).
pub(crate) fn same_tensor(a: &dyn core::any::Any, b: &dyn core::any::Any) -> Option<bool> {
    Some(fused_tensor_of(a)?.id == fused_tensor_of(b)?.id)
}

/// Whether `any` is burn-cuda's tensor (cubecl's, fusion's, or either in a local `ZeroTensor`),
/// by type alone.
pub(crate) fn is_cuda(any: &dyn core::any::Any) -> bool {
    any.is::<CubeTensor<CudaRuntime>>() || fused_tensor_of(any).is_some()
}

/// Copies each pair's first tensor into the second's memory as one operation of burn's fusion
/// stream (no host round trip per tensor: the handles are looked up where fusion runs it).
/// `false`, queuing nothing, when the tensors are not all fusion's CUDA tensors.
pub(crate) fn copy_in_stream(pairs: &[(&dyn core::any::Any, &dyn core::any::Any)]) -> bool {
    let (from, into): (Vec<_>, Vec<_>) = pairs.iter().copied().unzip();
    in_stream(&[from, into].concat(), RawWork::Copy { pairs: pairs.len() })
}

/// Zeroes each tensor's memory in place as one operation of burn's fusion stream; `false`,
/// queuing nothing, when they are not all fusion's CUDA tensors.
pub(crate) fn zero_in_stream(tensors: &[&dyn core::any::Any]) -> bool {
    in_stream(tensors, RawWork::Zero)
}

/// Registers `work` on `tensors` as one operation of burn's fusion stream.
fn in_stream(tensors: &[&dyn core::any::Any], work: RawWork) -> bool {
    let Some(fused) = tensors
        .iter()
        .map(|t| fused_tensor_of(*t).cloned())
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    let Some(client) = fused.first().map(|t| t.client.clone()) else {
        return true;
    };
    let streams = OperationStreams::with_inputs(fused.iter());
    let inputs: Vec<TensorIr> = fused.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(work.name(), &inputs, &[]);
    let op = RawOp {
        desc: desc.clone(),
        work,
    };
    client.register(streams, OperationIr::Custom(desc), op);
    true
}

/// What a [`RawOp`] does to its inputs' memory.
#[derive(Debug, Clone, Copy)]
enum RawWork {
    /// The first `pairs` inputs copied into the next `pairs`.
    Copy { pairs: usize },
    /// Every input set to zero bytes.
    Zero,
}

impl RawWork {
    fn name(self) -> &'static str {
        match self {
            RawWork::Copy { .. } => "burn_zero_graph_copy",
            RawWork::Zero => "burn_zero_graph_zero",
        }
    }
}

/// Copies or zeroes written into its inputs' memory, in the order of burn's fusion stream.
#[derive(Debug)]
struct RawOp {
    desc: CustomOpIr,
    work: RawWork,
}

impl Operation<FusionCubeRuntime<CudaRuntime>> for RawOp {
    fn execute(
        &self,
        handles: &mut HandleContainer<
            <FusionCubeRuntime<CudaRuntime> as FusionRuntime>::FusionHandle,
        >,
    ) {
        let cubes: Vec<CubeTensor<CudaRuntime>> = self
            .desc
            .inputs
            .iter()
            .map(|ir| handles.get_float_tensor::<Cube>(ir))
            .collect();
        let Some(device) = cubes.first().map(|t| t.device.clone()) else {
            return;
        };
        // Fusion runs this on its thread under the stream the work was queued on; cubecl's
        // thread takes it after the kernels queued before. A panic on fusion's thread is what
        // the engine's device-failure check reports at the next backward or step.
        let done = match self.work {
            RawWork::Copy { pairs } => {
                let copies = cubes[..pairs].iter().cloned().zip(cubes[pairs..].to_vec());
                copy_here(&device, copies.collect())
            }
            RawWork::Zero => zero_here(&device, cubes),
        };
        if let Err(e) = done {
            panic!("{} for CUDA graphs: {e}", self.work.name());
        }
    }
}

/// Zeroes each tensor's elements (their span, rows' padding included) on the calling thread's
/// stream, from a thread with no fusion queue to drain (fusion's own).
fn zero_here(device: &CudaDevice, tensors: Vec<CubeTensor<CudaRuntime>>) -> Result<(), String> {
    let caller = StreamId::current();
    on_device_thread(device, move |server| {
        let ours = raw_stream(server, caller)?;
        for t in &tensors {
            let (count, row, pitch) =
                rows(t).ok_or_else(|| format!("strides {:?}", t.meta.strides()))?;
            if count * row == 0 {
                continue;
            }
            let bytes = ((count - 1) * pitch + row) * t.dtype.size();
            let ptr = resource(server, t, caller)?;
            // SAFETY: the tensor is live (held by `tensors` until the memset is queued) and
            // spans `bytes` from its address (its rows at their pitch).
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, ours) }
                .map_err(|e| format!("zeroing: {e:?}"))?;
        }
        Ok(())
    })
}

/// Copies each `(from, into)` on the calling thread's stream, after its queued work.
pub(crate) fn copy(
    device: &CudaDevice,
    copies: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
) -> Result<(), String> {
    let caller = StreamId::current();
    in_order(device, caller, move |server| {
        copy_on(server, caller, copies)
    })
}

/// [`copy`] from a thread that holds no fusion queue to drain (fusion's own).
fn copy_here(
    device: &CudaDevice,
    copies: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
) -> Result<(), String> {
    let caller = StreamId::current();
    on_device_thread(device, move |server| copy_on(server, caller, copies))
}

/// The copies on `caller`'s stream, on cubecl's thread.
fn copy_on(
    server: &mut CudaServer,
    caller: StreamId,
    copies: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
) -> Result<(), String> {
    let ours = raw_stream(server, caller)?;
    // Unpitched neighbours in both memories (parameters laid end to end) go as one copy, as
    // long as the run stays inside one allocation on each side: a copy may not cross from one
    // allocation into the next, even where their addresses touch (pages cubecl allocated one
    // after the other, as on one rank of a 1B run on 2 GPUs).
    let mut run: Option<Run> = None;
    let flush = |run: Option<Run>| match run {
        // SAFETY: every tensor of the run is live (held by `copies`) and the run spans
        // consecutive elements of one allocation in both memories.
        Some(r) => unsafe { memcpy_dtod_async(r.dst, r.src, r.bytes, ours) }
            .map_err(|e| format!("copying: {e:?}")),
        None => Ok(()),
    };
    for (from, into) in &copies {
        let plain =
            |t: &CubeTensor<CudaRuntime>| rows(t).is_some_and(|(_, row, pitch)| row == pitch);
        if !(plain(from) && plain(into)) || from.meta.shape() != into.meta.shape() {
            flush(run.take())?;
            copy_elements(server, (from, caller), (into, caller), ours)?;
            continue;
        }
        if from.dtype != into.dtype {
            return Err(format!("{:?} copied into {:?}", from.dtype, into.dtype));
        }
        let bytes = from.meta.shape().num_elements() * from.dtype.size();
        if bytes == 0 {
            continue;
        }
        let (src, dst) = (
            resource(server, from, caller)?,
            resource(server, into, caller)?,
        );
        run = match run {
            Some(r) if r.continued_by(src, dst, bytes) => Some(Run {
                bytes: r.bytes + bytes,
                ..r
            }),
            other => {
                flush(other)?;
                Some(Run::start(src, dst, bytes)?)
            }
        };
    }
    flush(run)
}

/// Consecutive bytes copied as one: from `src` into `dst`, each inside one allocation that
/// ends at its `*_end`.
#[derive(Clone, Copy)]
struct Run {
    src: u64,
    dst: u64,
    bytes: usize,
    src_end: u64,
    dst_end: u64,
}

impl Run {
    fn start(src: u64, dst: u64, bytes: usize) -> Result<Self, String> {
        Ok(Self {
            src,
            dst,
            bytes,
            src_end: allocation_end(src)?,
            dst_end: allocation_end(dst)?,
        })
    }

    /// Whether `bytes` from `src` into `dst` follow this run in both memories, inside the same
    /// allocations.
    fn continued_by(&self, src: u64, dst: u64, bytes: usize) -> bool {
        let n = self.bytes as u64;
        self.src + n == src
            && self.dst + n == dst
            && src + bytes as u64 <= self.src_end
            && dst + bytes as u64 <= self.dst_end
    }
}

/// The end of the device allocation that holds `ptr`.
fn allocation_end(ptr: u64) -> Result<u64, String> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: plain out-parameters; the driver checks the address.
    unsafe { cudarc::driver::sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| format!("the allocation of {ptr:#x}: {e:?}"))?;
    Ok(base + size as u64)
}

/// Makes `waiter` wait for the work queued on `on` so far.
fn wait_for(waiter: CUstream, on: CUstream) -> Result<(), String> {
    // SAFETY: two live streams of cubecl's; CUDA keeps an event a stream waits for until the
    // wait is over, so destroying it at once is fine.
    unsafe {
        let ev: CUevent = event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("creating an event: {e:?}"))?;
        event::record(ev, on).map_err(|e| format!("recording an event: {e:?}"))?;
        stream::wait_event(waiter, ev, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            .map_err(|e| format!("waiting for an event: {e:?}"))?;
        event::destroy(ev).map_err(|e| format!("{e:?}"))
    }
}

fn raw_stream(server: &mut CudaServer, id: StreamId) -> Result<CUstream, String> {
    server
        .cuda_stream(id)
        .map_err(|e| format!("cubecl's stream: {e:?}"))
}

/// A tensor's elements as rows: `(rows, row elements, pitch in elements)`, when its strides are
/// row-major with rows perhaps pitched (cubecl pads the rows of tensors it allocates; the
/// layout the RMSNorm kernels read, `cubecl_kernels::fused::row_pitch`).
fn rows(tensor: &CubeTensor<CudaRuntime>) -> Option<(usize, usize, usize)> {
    let shape = tensor.meta.shape();
    let Some((&row, leading)) = shape.split_last() else {
        return Some((1, 1, 1));
    };
    let pitch = cubecl_kernels::fused::row_pitch(shape, tensor.meta.strides())?;
    Some((leading.iter().product(), row, pitch.max(1)))
}

/// Queues on `stream` the copy of `from`'s elements into `into`'s (same shape and dtype; rows
/// pitched alike or not).
fn copy_elements(
    server: &mut CudaServer,
    (from, from_stream): (&CubeTensor<CudaRuntime>, StreamId),
    (into, into_stream): (&CubeTensor<CudaRuntime>, StreamId),
    stream: CUstream,
) -> Result<(), String> {
    if from.meta.shape() != into.meta.shape() || from.dtype != into.dtype {
        return Err(format!(
            "a tensor of shape {:?} ({:?}) cannot be copied into one of shape {:?} ({:?})",
            from.meta.shape(),
            from.dtype,
            into.meta.shape(),
            into.dtype
        ));
    }
    let layout = |t: &CubeTensor<CudaRuntime>| {
        rows(t).ok_or_else(|| format!("strides {:?} are not row-major", t.meta.strides()))
    };
    let ((count, row, src_pitch), (_, _, dst_pitch)) = (layout(from)?, layout(into)?);
    if count * row == 0 {
        return Ok(());
    }
    let size = from.dtype.size();
    let src = resource(server, from, from_stream)?;
    let dst = resource(server, into, into_stream)?;
    if src_pitch == row && dst_pitch == row {
        // SAFETY: both live (their handles are held by the caller until the copy is queued)
        // and hold `count * row` elements from their addresses.
        return unsafe { memcpy_dtod_async(dst, src, count * row * size, stream) }
            .map_err(|e| format!("copying: {e:?}"));
    }
    let copy = CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: core::ptr::null(),
        srcDevice: src,
        srcArray: core::ptr::null_mut(),
        srcPitch: src_pitch * size,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: core::ptr::null_mut(),
        dstDevice: dst,
        dstArray: core::ptr::null_mut(),
        dstPitch: dst_pitch * size,
        WidthInBytes: row * size,
        Height: count,
    };
    // SAFETY: as above, rows of `row` elements at the given pitches.
    unsafe { cuMemcpy2DAsync_v2(&copy, stream) }
        .result()
        .map_err(|e| format!("copying rows: {e:?}"))
}

/// The device address of a tensor's first element.
fn resource(
    server: &mut CudaServer,
    tensor: &CubeTensor<CudaRuntime>,
    on: StreamId,
) -> Result<u64, String> {
    let binding = tensor.handle.clone().binding();
    let resource = server
        .get_resource(binding, on)
        .map_err(|e| format!("a tensor's memory: {e:?}"))?;
    Ok(resource.resource().ptr)
}
