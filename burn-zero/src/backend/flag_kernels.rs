//! Two one-thread kernels that order a stream of ours (cuBLASLt's, NCCL's) against burn's
//! stream through a `u32` flag in device memory, with no host wait. Free of burn types.
//!
//! - `bz_wait` spins until the flag has reached a value, in serial-number order: `flag - value`
//!   read as a signed 32-bit number is not negative. Flags only grow (burn's stream raises a
//!   sequence number per call), so waiting for "reached" rather than "equal" stays right when
//!   the other side has moved on to later calls, and across `u32` wraparound.
//! - `bz_signal` stores a value once everything before it on the stream is done.
//!
//! Kernels, not `cuStreamWaitValue32`/`cuStreamWriteValue32`: with those, on cubecl's
//! (stream-ordered pool) memory, the host was measured waiting about one GEMM per call.
//!
//! Both are loaded and run once per device before anything spins: under CUDA's lazy loading,
//! loading a kernel may wait for the running ones, and a spinner waiting on a kernel that is
//! still being loaded would never finish.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as driver;
use cudarc::driver::{CudaStream, DevicePtr};

const FLAG_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry bz_wait(.param .u64 flag, .param .u32 value)
{
    .reg .pred %p;
    .reg .b32 %v, %want, %ahead;
    .reg .b64 %a;
    ld.param.u64 %a, [flag];
    ld.param.u32 %want, [value];
LOOP:
    ld.volatile.global.u32 %v, [%a];
    sub.u32 %ahead, %v, %want;
    setp.gt.u32 %p, %ahead, 2147483647;
    @%p bra LOOP;
    ret;
}
.visible .entry bz_signal(.param .u64 flag, .param .u32 value)
{
    .reg .b32 %v;
    .reg .b64 %a;
    ld.param.u64 %a, [flag];
    ld.param.u32 %v, [value];
    membar.gl;
    st.volatile.global.u32 [%a], %v;
    ret;
}
"#;

/// The loaded kernels of one device.
#[derive(Clone, Copy)]
struct Loaded {
    wait: driver::CUfunction,
    signal: driver::CUfunction,
}

// SAFETY: CUDA functions are context-wide handles, usable from any thread once loaded.
unsafe impl Send for Loaded {}
// SAFETY: as above; they are never mutated.
unsafe impl Sync for Loaded {}

/// Per GPU ordinal: the kernels, or why they could not be loaded (asked once).
fn loaded(stream: &Arc<CudaStream>) -> Result<Loaded, String> {
    static LOADED: OnceLock<Mutex<HashMap<usize, Result<Loaded, String>>>> = OnceLock::new();
    let mut all = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    all.entry(stream.context().ordinal())
        .or_insert_with(|| load(stream).and_then(|k| warm(k, stream).map(|()| k)))
        .clone()
}

fn load(stream: &Arc<CudaStream>) -> Result<Loaded, String> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("{e:?}"))?;
    let src = std::ffi::CString::new(FLAG_PTX).expect("no NUL in PTX");
    // SAFETY: a NUL-terminated PTX image; the module lives for the process.
    unsafe {
        let module = cudarc::driver::result::module::load_data(src.as_ptr() as *const _)
            .map_err(|e| format!("loading the flag kernels: {e:?}"))?;
        let function = |name: &str| {
            cudarc::driver::result::module::get_function(
                module,
                std::ffi::CString::new(name).expect("no NUL in a kernel name"),
            )
            .map_err(|e| format!("{name}: {e:?}"))
        };
        Ok(Loaded {
            wait: function("bz_wait")?,
            signal: function("bz_signal")?,
        })
    }
}

/// Runs both kernels once (a signal, then a wait it satisfies) and waits for them.
fn warm(k: Loaded, stream: &Arc<CudaStream>) -> Result<(), String> {
    let flag = stream.alloc_zeros::<u32>(1).map_err(|e| format!("{e:?}"))?;
    let (ptr, _sync) = flag.device_ptr(stream);
    // SAFETY: `flag` is a live u32 of this GPU, used by this stream only, until the sync.
    unsafe {
        launch(k.signal, stream, ptr, 0x5eed)?;
        launch(k.wait, stream, ptr, 0x5eed)?;
    }
    stream.synchronize().map_err(|e| format!("{e:?}"))
}

/// Launches one flag kernel on `stream`: one thread, `(flag, value)`.
///
/// # Safety
/// `flag` is a live `u32` of the stream's GPU.
unsafe fn launch(
    kernel: driver::CUfunction,
    stream: &CudaStream,
    mut flag: u64,
    mut value: u32,
) -> Result<(), String> {
    let mut params = [
        (&mut flag) as *mut u64 as *mut std::ffi::c_void,
        (&mut value) as *mut u32 as *mut std::ffi::c_void,
    ];
    // SAFETY: the parameters match the kernels' (u64, u32) signature.
    unsafe {
        cudarc::driver::result::launch_kernel(
            kernel,
            (1, 1, 1),
            (1, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .map_err(|e| format!("flag kernel: {e:?}"))
}

/// Whether the flag kernels run on `stream`'s GPU (loading and running them the first time).
pub(crate) fn available(stream: &Arc<CudaStream>) -> Result<(), String> {
    loaded(stream).map(|_| ())
}

/// Enqueues on `stream`: what follows waits until the `u32` at `flag` has reached `value`.
///
/// # Safety
/// `flag` is a live `u32` of the stream's GPU until the wait has run.
pub(crate) unsafe fn wait(stream: &Arc<CudaStream>, flag: u64, value: u32) -> Result<(), String> {
    let k = loaded(stream)?;
    // SAFETY: as the caller promised.
    unsafe { launch(k.wait, stream, flag, value) }
}

/// Enqueues on `stream`: `value` is stored at `flag` once everything before it is done, so its
/// writes are visible to whoever sees the value.
///
/// # Safety
/// `flag` is a live `u32` of the stream's GPU until the signal has run.
pub(crate) unsafe fn signal(stream: &Arc<CudaStream>, flag: u64, value: u32) -> Result<(), String> {
    let k = loaded(stream)?;
    // SAFETY: as the caller promised.
    unsafe { launch(k.signal, stream, flag, value) }
}
