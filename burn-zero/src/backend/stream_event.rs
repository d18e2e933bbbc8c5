//! Orders a stream of ours (a pipeline link's NCCL stream) against burn's CUDA stream with CUDA
//! events: an event recorded on burn's stream that our stream waits for, and one recorded on
//! ours that burn's stream waits for. No kernel spins, unlike `stream_order.rs`' flags.
//!
//! Why not flags here: loading a CUDA module (cubecl compiles kernels as a step first meets
//! them) can wait until the running kernels finish while holding back kernels not started yet.
//! A spinner on burn's stream waiting for a receive whose NCCL kernel had not started then
//! never ends: on 4 H100s the 3B Llama's pipe-4 step hung that way, cubecl's thread inside
//! `cuModuleLoadData` for the optimizer's first kernel and `await_done` the one kernel resident
//! (bench/results/pipeline-hang-nvidia-h100-x4.json). A stream waiting for an event holds no
//! kernel. cubecl 0.10 does not give its stream away: `patches/cubecl-cuda` adds
//! `CudaServer::cuda_stream`.

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::stream_id::StreamId;
use cudarc::driver::result::{event, stream};
use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags};

use super::cuda::FusionClient;

type CudaServer = <CudaRuntime as cubecl::Runtime>::Server;

/// A `CUevent`, as the communicator traits carry it.
pub(crate) type RawEvent = u64;

/// Records a new event on burn's stream of the calling thread on `device`, after everything
/// cubecl has been handed (one blocking visit to cubecl's thread, no device wait). Call it on
/// cubecl's thread (inside `ComputeClient::exclusive`) to land it after a task there.
pub(crate) fn record_now(device: &CudaDevice) -> Result<RawEvent, String> {
    DeviceHandle::<CudaServer>::new(device.to_id())
        .submit_blocking(|server| {
            let on = server
                .cuda_stream(StreamId::current())
                .map_err(|e| format!("burn's stream: {e:?}"))?;
            let ev = new_event()? as CUevent;
            // SAFETY: a fresh event and cubecl's live stream of this device.
            unsafe { event::record(ev, on) }.map_err(|e| format!("recording an event: {e:?}"))?;
            Ok(ev as RawEvent)
        })
        .map_err(|e| format!("{e:?}"))?
}

/// [`record_now`] in fusion's order when `fusion` is given (the client of the tensor the work
/// was on, `cuda::fusion_client_of`): after everything registered before.
pub(crate) fn record_in_order(
    fusion: Option<FusionClient>,
    device: &CudaDevice,
) -> Result<RawEvent, String> {
    let device = device.clone();
    match fusion {
        Some(fusion) => fusion.sync(move || record_now(&device)),
        None => record_now(&device),
    }
}

/// Makes burn's stream of the calling thread on `device` wait for `ev` (recorded before this
/// call), in fusion's order when `fusion` is given, and lets the event go.
pub(crate) fn wait_in_order(
    fusion: Option<FusionClient>,
    device: &CudaDevice,
    ev: RawEvent,
) -> Result<(), String> {
    let device = device.clone();
    let wait = move || {
        DeviceHandle::<CudaServer>::new(device.to_id())
            .submit_blocking(move |server| {
                let on = server
                    .cuda_stream(StreamId::current())
                    .map_err(|e| format!("burn's stream: {e:?}"))?;
                // SAFETY: `ev` was recorded before; CUDA keeps a destroyed event a stream still
                // waits for until the wait is over.
                unsafe {
                    stream::wait_event(
                        on,
                        ev as CUevent,
                        CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                    .map_err(|e| format!("waiting for an event: {e:?}"))?;
                    event::destroy(ev as CUevent).map_err(|e| format!("{e:?}"))
                }
            })
            .map_err(|e| format!("{e:?}"))?
    };
    match fusion {
        Some(fusion) => fusion.sync(wait),
        None => wait(),
    }
}

/// A new event for a foreign stream to record (burn's stream waits for it with
/// [`wait_in_order`]).
pub(crate) fn new_event() -> Result<RawEvent, String> {
    event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map(|ev| ev as RawEvent)
        .map_err(|e| format!("creating an event: {e:?}"))
}

/// Lets an event go that nothing will wait for.
pub(crate) fn drop_event(ev: RawEvent) {
    // SAFETY: a live event; CUDA defers the release while work still uses it.
    let _ = unsafe { event::destroy(ev as CUevent) };
}

/// `work` on the communicator's stream after burn's stream reached `ready` (an event recorded
/// there), and an event recorded after it, returned for burn's stream to wait for
/// ([`wait_in_order`]). When `work` failed, its error is returned instead and the event let go.
/// A capture of burn's stream follows `ready` into the communicator's stream, and the returned
/// event back.
///
/// # Safety
/// The buffers `work` reads or writes are live and complete when `ready` is reached, and stay so
/// until burn's stream has waited for the returned event.
pub(crate) unsafe fn between_events(
    comm: &dyn crate::comm::DeviceCollectives,
    ready: RawEvent,
    what: &str,
    work: impl FnOnce() -> Result<(), crate::comm::CommError>,
) -> Result<RawEvent, crate::comm::CommError> {
    // SAFETY: `ready` was recorded on burn's stream before this call.
    let waited = unsafe { comm.wait_event(ready) };
    drop_event(ready);
    waited?;
    let outcome = work();
    crate::log::trace_order(|| format!("{what} issued on the communicator's stream: {outcome:?}"));
    let done = new_event().map_err(crate::comm::CommError::Aborted)?;
    // SAFETY: a live event of this device.
    if let Err(e) = unsafe { comm.record_event(done) } {
        panic!(
            "after a {what}, the communicator's stream could not record an event for burn's: {e}"
        );
    }
    match outcome {
        Ok(()) => Ok(done),
        Err(e) => {
            drop_event(done);
            Err(e)
        }
    }
}
