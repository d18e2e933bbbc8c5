//! The CUDA side of captured steps: cubecl's stream capture (`patches/cubecl-cuda`), the
//! ordering of a replay against the caller's stream, and the copies of new inputs into the
//! buffers the graph reads.

use std::sync::Arc;

use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::FusionTensor;
use cubecl::cuda::{CapturedGraph, CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::server::ComputeServer;
use cubecl::stream_id::StreamId;
use cudarc::driver::result::{event, memcpy_dtod_async, stream};
use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream};

use crate::backend::ZeroTensor;
use crate::backend::cuda::{CudaServer, FusionClient};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;

/// The fusion client of `device` (burn-cuda's, whichever thread asks).
fn fusion(device: &CudaDevice) -> FusionClient {
    burn_fusion::get_client::<Cube>(device)
}

/// Runs `task` on cubecl's thread of `device` after everything queued before on the calling
/// thread's stream `on` (fusion's queue of `on` drained first), and returns its answer.
fn in_order<T: Send + 'static>(
    device: &CudaDevice,
    on: StreamId,
    task: impl FnOnce(&mut CudaServer) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let client = fusion(device);
    let id = device.to_id();
    on.executes(|| {
        client.sync(move || {
            DeviceHandle::<CudaServer>::new(id)
                .submit_blocking(task)
                .map_err(|e| format!("cubecl's device thread: {e:?}"))?
        })
    })
}

/// Starts capturing the work queued on stream `graph` of `device`.
pub(crate) fn begin(device: &CudaDevice, graph: StreamId) -> Result<(), String> {
    // The caller's queued work goes first, outside the capture.
    in_order(device, StreamId::current(), |_| Ok(()))?;
    in_order(device, graph, move |server| {
        server
            .begin_capture(graph)
            .map_err(|e| format!("beginning the capture: {e}"))
    })
}

/// Ends the capture begun by [`begin`]: everything queued on `graph` since is in the graph.
pub(crate) fn end(device: &CudaDevice, graph: StreamId) -> Result<Arc<CapturedGraph>, String> {
    in_order(device, graph, move |server| {
        server
            .end_capture(graph)
            .map(Arc::new)
            .map_err(|e| format!("ending the capture: {e}"))
    })
}

/// On stream `graph`, after the calling thread's stream's queued work: each `(from, into)`
/// copied, then `captured` replayed if given; the calling thread's later work is ordered after
/// it all (CUDA events both ways, no host wait).
pub(crate) fn replay(
    device: &CudaDevice,
    graph: StreamId,
    captured: Option<Arc<CapturedGraph>>,
    copies: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
) -> Result<(), String> {
    let caller = StreamId::current();
    in_order(device, caller, move |server| {
        let ours = raw_stream(server, caller)?;
        let theirs = raw_stream(server, graph)?;
        wait_for(theirs, ours)?;
        for (from, into) in &copies {
            let (src, bytes) = address(server, from, caller)?;
            let (dst, room) = address(server, into, graph)?;
            if bytes != room {
                return Err(format!(
                    "an input of {bytes} bytes replaces one of {room}: the shapes differ"
                ));
            }
            // SAFETY: both buffers are live for the call (the copies hold them) and hold
            // `bytes`; the graph's stream runs the copy after the caller's queued work.
            unsafe { memcpy_dtod_async(dst, src, bytes, theirs) }
                .map_err(|e| format!("copying an input: {e:?}"))?;
        }
        if let Some(captured) = &captured {
            server
                .launch_graph(graph, captured)
                .map_err(|e| format!("replaying: {e}"))?;
        }
        // The caller's stream waits for the graph's: memory the copies read may be reused by
        // the caller's later work once they are dropped here.
        wait_for(ours, theirs)?;
        drop(copies);
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
        let ours = raw_stream(server, caller)?;
        for (from, into) in &copies {
            let (src, bytes) = address(server, from, caller)?;
            let (dst, room) = address(server, into, caller)?;
            if bytes != room {
                return Err(format!("{bytes} bytes copied into {room}"));
            }
            // SAFETY: both live (held by `copies` until the copy is queued; their memory is
            // reused only by later work on this stream) and `bytes` long.
            unsafe { memcpy_dtod_async(dst, src, bytes, ours) }
                .map_err(|e| format!("copying: {e:?}"))?;
        }
        Ok(())
    })
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

/// The device address and byte length of a contiguous tensor's elements.
fn address(
    server: &mut CudaServer,
    tensor: &CubeTensor<CudaRuntime>,
    on: StreamId,
) -> Result<(u64, usize), String> {
    if !tensor.is_contiguous() {
        return Err("a graph's input must be contiguous".into());
    }
    let bytes = tensor.meta.shape().num_elements() * tensor.dtype.size();
    let binding = tensor.handle.clone().binding();
    let resource = server
        .get_resource(binding, on)
        .map_err(|e| format!("an input's memory: {e:?}"))?;
    Ok((resource.resource().ptr, bytes))
}

/// burn-cuda's tensor behind `any`: a float or int primitive of `CubeBackend<CudaRuntime>`,
/// of the same behind burn's fusion, or either inside `ZeroTensor`. `None` for other backends.
pub(crate) fn cube_of(any: &dyn core::any::Any) -> Option<CubeTensor<CudaRuntime>> {
    if let Some(zero) = any.downcast_ref::<ZeroTensor<burn_fusion::Fusion<Cube>>>() {
        return zero.is_local().then(|| cube_of(zero.inner())).flatten();
    }
    if let Some(cube) = any.downcast_ref::<CubeTensor<CudaRuntime>>() {
        return Some(cube.clone());
    }
    let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<CudaRuntime>>>()?;
    Some(match fused.dtype.is_float() {
        true => fused.client.resolve_tensor_float::<Cube>(fused.clone()),
        false => fused.client.resolve_tensor_int::<Cube>(fused.clone()),
    })
}
