//! Strided-batched GEMMs on raw device addresses through cuBLASLt (cudarc, dynamic loading).
//! Free of burn types: `matmul.rs` maps burn's row-major tensors onto [`Gemm`].
//!
//! One cuBLASLt handle, stream and 32 MiB workspace per GPU. A call runs where its [`Order`]
//! says: on burn's own stream, issued by cubecl's thread in order with burn's kernels (a
//! workspace per such stream); on our stream between the flags of a [`Handshake`] (no host
//! wait); or on our stream, synchronized before returning.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::result::{event, stream as raw_stream};
use cudarc::driver::sys as driver;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::backend::flag_kernels;
use crate::backend::stream_order::Handshake;
use crate::comm::DType;

/// One column-major operand: `rows × cols` after its transpose, as cuBLASLt sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Operand {
    /// Device address of the first matrix.
    pub(crate) ptr: u64,
    /// Leading dimension (elements between columns of the stored matrix).
    pub(crate) ld: i64,
    /// Whether cuBLASLt reads the stored matrix transposed.
    pub(crate) trans: bool,
    /// Elements between consecutive matrices of the batch (0: one matrix for all).
    pub(crate) batch_stride: i64,
}

/// `D[m×n] = op(A)[m×k] · op(B)[k×n]`, column-major, `batch` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    pub(crate) m: u64,
    pub(crate) n: u64,
    pub(crate) k: u64,
    pub(crate) batch: i32,
    pub(crate) a: Operand,
    pub(crate) b: Operand,
    /// The output: column-major `m × n` matrices (its columns may be pitched: `d_ld ≥ m`).
    pub(crate) d: u64,
    pub(crate) d_ld: i64,
    pub(crate) d_batch_stride: i64,
    pub(crate) dtype: DType,
    /// f32 only: let cuBLASLt use TF32 tensor cores.
    pub(crate) tf32: bool,
    /// Plan for this many SMs fewer than the GPU has (see [`sm_target`]).
    pub(crate) sm_margin: u32,
    /// Time the top heuristic choices on the first call (see [`fastest`]).
    pub(crate) tune: bool,
    /// Record the GEMM's GPU time (see [`take_gpu_ms`]).
    pub(crate) profile: bool,
    /// Add the product to what the output holds (`beta = 1`, one rounding) instead of
    /// overwriting it. Such a call is never timed against other candidates (each run would
    /// add again): it takes the plan a plain GEMM of its shape chose, or the heuristic's first.
    pub(crate) accumulate: bool,
}

/// Where a call runs and how it is ordered against burn's kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Order {
    /// On burn's stream (this raw `CUstream`), issued by cubecl's thread between the kernels
    /// before and after it: ordered by the stream itself.
    OnStream(driver::CUstream),
    /// On our stream, after `ready` and before `done` of the handshake.
    Handshake(Handshake),
    /// On our stream, to completion before returning.
    Synchronized,
}

struct DeviceLt {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    /// The workspace's address, taken once: only our stream uses it, and asking cudarc per
    /// call records an event each time.
    workspace_ptr: u64,
    /// A workspace per foreign stream calls run on ([`Order::OnStream`]), by the stream's
    /// address: two streams of burn's may run GEMMs at once, and calls on one stream follow
    /// each other.
    stream_workspaces: HashMap<usize, (CudaSlice<u8>, u64)>,
    /// Descriptors and algorithm per GEMM, keyed by the GEMM with its addresses cleared:
    /// creating them took ~10 µs of host time per call.
    plans: HashMap<Gemm, Plan>,
    /// Whether our side of the handshake can run (its kernels loaded).
    flags: bool,
    /// The GPU's SMs.
    sms: i32,
    /// With profiling on: events around each call's GEMM, read by [`take_gpu_ms`].
    timings: Vec<(RawEvent, RawEvent)>,
}

/// A CUDA event by its raw handle (recorded on any stream, ours or burn's).
struct RawEvent(driver::CUevent);

impl RawEvent {
    /// A new event recorded on `stream` now.
    fn record(stream: driver::CUstream) -> Result<Self, String> {
        let ev =
            event::create(driver::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("{e:?}"))?;
        // SAFETY: a live event and stream of the current context.
        unsafe { event::record(ev, stream) }.map_err(|e| format!("{e:?}"))?;
        Ok(Self(ev))
    }

    /// Milliseconds from `self` to `end` (both complete).
    fn elapsed_ms(&self, end: &Self) -> Result<f32, String> {
        // SAFETY: two live events.
        unsafe { event::elapsed(self.0, end.0) }.map_err(|e| format!("{e:?}"))
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: a live event; CUDA defers the release while work still uses it.
        let _ = unsafe { event::destroy(self.0) };
    }
}

/// The GPU milliseconds of each GEMM on GPU `ordinal` since the last call (waits for them);
/// empty unless the GEMMs' policy asked for their profile (`burn_zero.matmul.profile`).
pub(crate) fn take_gpu_ms(ordinal: usize) -> Vec<f32> {
    let Ok(device) = device(ordinal) else {
        return Vec::new();
    };
    let mut lt_dev = device.lock().unwrap_or_else(|e| e.into_inner());
    // The events are read on the caller's thread, which CUDA may not have bound yet.
    let _ = lt_dev.stream.context().bind_to_thread();
    std::mem::take(&mut lt_dev.timings)
        .into_iter()
        .filter_map(|(start, end)| {
            // SAFETY: a live event.
            unsafe { event::synchronize(end.0) }.ok()?;
            start.elapsed_ms(&end).ok()
        })
        .collect()
}

// SAFETY: the handle is used under the per-device mutex only; cuBLASLt handles may move
// between threads.
unsafe impl Send for DeviceLt {}

fn devices() -> &'static Mutex<HashMap<usize, Arc<Mutex<DeviceLt>>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Mutex<DeviceLt>>>>> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

fn device(ordinal: usize) -> Result<Arc<Mutex<DeviceLt>>, String> {
    let mut all = devices().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = all.get(&ordinal) {
        return Ok(d.clone());
    }
    let context = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
    let stream = context.new_stream().map_err(|e| format!("{e:?}"))?;
    let handle = lt::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
    // SAFETY: uninitialized bytes are fine for a workspace.
    let workspace = unsafe { stream.alloc::<u8>(32 << 20) }.map_err(|e| format!("{e:?}"))?;
    let flags = flag_kernels::available(&stream)
        .inspect_err(|e| crate::log::warn(&format!("cuBLASLt calls will synchronize: {e}")))
        .is_ok();
    // The event of this one access is recorded when `_sync` drops, right here.
    let (workspace_ptr, _sync) = workspace.device_ptr(&stream);
    drop(_sync);
    let sms = context
        .attribute(driver::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| format!("{e:?}"))?;
    let d = Arc::new(Mutex::new(DeviceLt {
        handle,
        stream,
        workspace,
        workspace_ptr,
        stream_workspaces: HashMap::new(),
        plans: HashMap::new(),
        flags,
        sms,
        timings: Vec::new(),
    }));
    all.insert(ordinal, d.clone());
    Ok(d)
}

impl Gemm {
    /// The GEMM with its addresses cleared: the key of its [`Plan`].
    fn without_addresses(&self) -> Gemm {
        Gemm {
            a: Operand { ptr: 0, ..self.a },
            b: Operand { ptr: 0, ..self.b },
            d: 0,
            accumulate: false,
            ..*self
        }
    }
}

impl DeviceLt {
    /// The workspace of calls on the foreign stream `on`, allocated on first use (on our
    /// stream, which is then synchronized so that the memory is ready for `on`).
    fn workspace_on(&mut self, on: driver::CUstream) -> Result<u64, String> {
        if let Some((_, ptr)) = self.stream_workspaces.get(&(on as usize)) {
            return Ok(*ptr);
        }
        let bytes = self.workspace.len();
        // SAFETY: uninitialized bytes are fine for a workspace.
        let workspace = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| format!("{e:?}"))?;
        let (ptr, sync) = workspace.device_ptr(&self.stream);
        drop(sync);
        self.stream.synchronize().map_err(|e| format!("{e:?}"))?;
        self.stream_workspaces.insert(on as usize, (workspace, ptr));
        Ok(ptr)
    }

    /// The plan of `key` (a GEMM without addresses), made on first use.
    fn plan(&mut self, key: &Gemm) -> Result<&mut Plan, String> {
        let (handle, workspace_bytes) = (self.handle, self.workspace.len());
        // Only a GEMM ordered by a handshake shares the GPU with burn's spinning block (the
        // others carry a margin of 0).
        let sm_target = self
            .flags
            .then(|| sm_target(self.sms, key.sm_margin))
            .flatten();
        Ok(match self.plans.entry(*key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Plan::new(handle, workspace_bytes, sm_target, key)?)
            }
        })
    }
}

/// Makes the plan of `gemm`'s shape on GPU `ordinal` (its addresses are ignored), so that a
/// shape cuBLASLt cannot take is refused here, where the caller can still fall back, and not
/// inside a call queued for later.
pub(crate) fn prepare(ordinal: usize, gemm: &Gemm) -> Result<(), String> {
    let device = device(ordinal)?;
    let mut lt_dev = device.lock().unwrap_or_else(|e| e.into_inner());
    let _ = lt_dev.stream.context().bind_to_thread();
    lt_dev.plan(&gemm.without_addresses()).map(|_| ())
}

/// [`run`] with a handshake that burn's stream will await whatever happens: should the call
/// fail, `done` is still raised (burn's stream goes on, the output is not written) and the
/// error returned.
///
/// # Safety
/// As for [`run`] with a handshake.
pub(crate) unsafe fn run_or_release(
    ordinal: usize,
    gemm: &Gemm,
    handshake: Handshake,
) -> Result<(), String> {
    // SAFETY: as the caller promised.
    let Err(e) = (unsafe { run(ordinal, gemm, Order::Handshake(handshake)) }) else {
        return Ok(());
    };
    // SAFETY: as the caller promised.
    if let Err(e2) = unsafe { release(ordinal, handshake) } {
        panic!(
            "a cuBLASLt call failed ({e}) and burn's stream, which awaits it, cannot go on: {e2}"
        );
    }
    Err(e)
}

/// Raises `done` for `handshake` on our stream of GPU `ordinal` without a call, so that burn's
/// stream, awaiting it, goes on.
///
/// # Safety
/// `handshake.done` is a live u32 of that GPU.
pub(crate) unsafe fn release(ordinal: usize, handshake: Handshake) -> Result<(), String> {
    let device = device(ordinal)?;
    let stream = device
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .stream
        .clone();
    // SAFETY: as the caller promised.
    unsafe { flag_kernels::signal(&stream, handshake.done, handshake.seq) }
}

/// Whether calls on GPU `ordinal` can be ordered by a [`Handshake`] instead of a host wait.
pub(crate) fn supports_handshake(ordinal: usize) -> Result<bool, String> {
    let device = device(ordinal)?;
    let lt_dev = device.lock().unwrap_or_else(|e| e.into_inner());
    Ok(lt_dev.flags)
}

/// A cuBLASLt object destroyed on drop.
struct Owned<T: Copy>(T, unsafe fn(T) -> Result<(), lt::CublasError>);

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: created by the matching create function, destroyed once.
        let _ = unsafe { (self.1)(self.0) };
    }
}

fn cuda_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
    }
}

fn err(what: &str) -> impl Fn(lt::CublasError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

fn layout(
    dtype: DType,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: i32,
    stride: i64,
) -> Result<Owned<sys::cublasLtMatrixLayout_t>, String> {
    let handle = lt::create_matrix_layout(cuda_type(dtype), rows, cols, ld)
        .map_err(err("cublasLtMatrixLayoutCreate"))?;
    let owned = Owned(handle, lt::destroy_matrix_layout as _);
    if batch > 1 {
        use sys::cublasLtMatrixLayoutAttribute_t as A;
        // SAFETY: attributes of a live layout, values of the documented sizes.
        unsafe {
            lt::set_matrix_layout_attribute(
                handle,
                A::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&batch) as *const i32 as *const _,
                4,
            )
            .map_err(err("batch count"))?;
            lt::set_matrix_layout_attribute(
                handle,
                A::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&stride) as *const i64 as *const _,
                8,
            )
            .map_err(err("batch stride"))?;
        }
    }
    Ok(owned)
}

/// What cuBLASLt needs to run one GEMM shape, addresses aside.
struct Plan {
    desc: Owned<sys::cublasLtMatmulDesc_t>,
    a: Owned<sys::cublasLtMatrixLayout_t>,
    b: Owned<sys::cublasLtMatrixLayout_t>,
    d: Owned<sys::cublasLtMatrixLayout_t>,
    /// cuBLASLt's heuristic choices, best guess first.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// The fastest candidate, once timed on the first call.
    chosen: Option<sys::cublasLtMatmulAlgo_t>,
}

impl Plan {
    /// Descriptors for `g` and cuBLASLt's first heuristic choice within the workspace.
    fn new(
        handle: sys::cublasLtHandle_t,
        workspace_bytes: usize,
        sm_target: Option<i32>,
        g: &Gemm,
    ) -> Result<Self, String> {
        let (a_rows, a_cols) = if g.a.trans { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.b.trans { (g.n, g.k) } else { (g.k, g.n) };
        let a = layout(g.dtype, a_rows, a_cols, g.a.ld, g.batch, g.a.batch_stride)?;
        let b = layout(g.dtype, b_rows, b_cols, g.b.ld, g.batch, g.b.batch_stride)?;
        let d = layout(g.dtype, g.m, g.n, g.d_ld, g.batch, g.d_batch_stride)?;
        let compute = match (g.dtype, g.tf32) {
            (DType::F32, true) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(err("cublasLtMatmulDescCreate"))?;
        let desc = Owned(desc, lt::destroy_matmul_desc as _);
        use sys::cublasLtMatmulDescAttributes_t as D;
        for (attr, trans) in [
            (D::CUBLASLT_MATMUL_DESC_TRANSA, g.a.trans),
            (D::CUBLASLT_MATMUL_DESC_TRANSB, g.b.trans),
        ] {
            // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
            let op = i32::from(trans);
            // SAFETY: an attribute of a live descriptor, a value of the documented size.
            unsafe {
                lt::set_matmul_desc_attribute(desc.0, attr, (&op) as *const _ as *const _, 4)
                    .map_err(err("transpose"))?;
            }
        }
        if let Some(sms) = sm_target {
            // SAFETY: an attribute of a live descriptor, an i32 as documented.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc.0,
                    D::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                    (&sms) as *const i32 as *const _,
                    4,
                )
                .map_err(err("SM count target"))?;
            }
        }
        let pref = lt::create_matmul_pref().map_err(err("cublasLtMatmulPreferenceCreate"))?;
        let pref = Owned(pref, lt::destroy_matmul_pref as _);
        let wanted = if g.tune { 8 } else { 1 };
        let mut found = vec![
            // SAFETY: plain old data, filled in by cuBLASLt below.
            unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() };
            wanted
        ];
        let mut count = 0;
        // SAFETY: live objects; the workspace size attribute is a u64/usize; `found` holds
        // `wanted` results.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace_bytes) as *const usize as *const _,
                core::mem::size_of::<usize>(),
            )
            .map_err(err("workspace preference"))?;
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc.0,
                a.0,
                b.0,
                d.0,
                d.0,
                pref.0,
                wanted as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
            .map_err(err("cublasLtMatmulAlgoGetHeuristic"))?;
        }
        let candidates: Vec<_> = found[..count.max(0) as usize]
            .iter()
            .filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|h| h.algo)
            .collect();
        if candidates.is_empty() {
            return Err("no cuBLASLt algorithm for this GEMM".into());
        }
        Ok(Self {
            desc,
            a,
            b,
            d,
            chosen: (candidates.len() == 1).then(|| candidates[0]),
            candidates,
        })
    }
}

/// The SMs a GEMM may plan for on a GPU of `sms`: all but `margin` (`burn_zero.matmul.sm_margin`,
/// default 1), or `None` for all of them.
///
/// While a handshake's GEMM runs, burn's stream holds one block spinning in `await_done`. On
/// Hopper cuBLASLt's persistent kernels launch one block per SM, each needing a whole SM, and
/// assign tiles to blocks up front: the block that finds no room starts only when another one
/// has finished all its tiles, doubling the GEMM's time (measured: a 4096×2048×2048 bf16 GEMM
/// took 98 µs of GPU time, torch's 47). Planned for one SM fewer, every block has room.
fn sm_target(sms: i32, margin: u32) -> Option<i32> {
    let margin = i32::try_from(margin).unwrap_or(i32::MAX);
    (margin > 0 && margin < sms).then_some(sms - margin)
}

/// The candidate whose best of three runs on `stream` (after everything queued there) is
/// fastest. Waits for the stream: paid once per GEMM shape. The output is overwritten by every
/// run, which is harmless (beta = 0, the real run follows).
fn fastest(
    stream: driver::CUstream,
    candidates: &[sys::cublasLtMatmulAlgo_t],
    issue: &dyn Fn(&sys::cublasLtMatmulAlgo_t) -> Result<(), String>,
) -> Result<sys::cublasLtMatmulAlgo_t, String> {
    let mut runs = Vec::new();
    for (i, algo) in candidates.iter().enumerate() {
        for _ in 0..3 {
            let start = RawEvent::record(stream)?;
            // A candidate that fails to launch is skipped.
            if issue(algo).is_ok() {
                runs.push((i, start, RawEvent::record(stream)?));
            }
        }
    }
    // SAFETY: a live stream of the current context.
    unsafe { raw_stream::synchronize(stream) }.map_err(|e| format!("{e:?}"))?;
    let mut best = vec![f32::INFINITY; candidates.len()];
    for (i, start, end) in runs {
        if let Ok(ms) = start.elapsed_ms(&end) {
            best[i] = best[i].min(ms);
        }
    }
    let (i, ms) = best
        .iter()
        .enumerate()
        .min_by(|x, y| x.1.total_cmp(y.1))
        .expect("at least one candidate");
    if !ms.is_finite() {
        return Err("no cuBLASLt candidate ran".into());
    }
    Ok(candidates[i])
}

/// Runs `gemm` on GPU `ordinal` where `order` says.
///
/// # Safety
/// The addresses are valid device memory of that GPU for the extents `gemm` describes.
/// [`Order::Synchronized`]: they are complete (nothing still writes them).
/// [`Order::Handshake`]: `supports_handshake` said yes and burn's stream raises `ready` once
/// they are. [`Order::OnStream`]: the stream is burn's, and the caller is cubecl's thread,
/// after the launches that write the operands and before any that reads the output or reuses
/// the operands' memory.
pub(crate) unsafe fn run(ordinal: usize, gemm: &Gemm, order: Order) -> Result<(), String> {
    let device = device(ordinal)?;
    let mut guard = device.lock().unwrap_or_else(|e| e.into_inner());
    // Disjoint borrows of the fields below (the workspace stays borrowed during the call).
    let lt_dev = &mut *guard;
    let _ = lt_dev.stream.context().bind_to_thread();
    let g = gemm;
    let key = g.without_addresses();
    let workspace_bytes = lt_dev.workspace.len();
    let handle = lt_dev.handle;
    let plan = lt_dev.plan(&key)?;
    let (desc, a, b, d, chosen) = (plan.desc.0, plan.a.0, plan.b.0, plan.d.0, plan.chosen);
    let candidates = if chosen.is_none() {
        plan.candidates.clone()
    } else {
        Vec::new()
    };
    let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
    let stream = lt_dev.stream.clone();
    let (cu_stream, workspace) = match order {
        Order::OnStream(on) => (on, lt_dev.workspace_on(on)?),
        Order::Handshake(_) | Order::Synchronized => (stream.cu_stream(), lt_dev.workspace_ptr),
    };
    let issue = |algo: &sys::cublasLtMatmulAlgo_t| {
        // SAFETY: the caller vouches for the addresses; every descriptor is live; `d` is both
        // C (read only when accumulating) and D.
        unsafe {
            lt::matmul(
                handle,
                desc,
                (&alpha) as *const f32 as *const _,
                (&beta) as *const f32 as *const _,
                g.a.ptr as *const _,
                a,
                g.b.ptr as *const _,
                b,
                g.d as *const _,
                d,
                g.d as *mut _,
                d,
                algo,
                workspace as *mut _,
                workspace_bytes,
                cu_stream as *mut _,
            )
        }
        .map_err(err("cublasLtMatmul"))
    };
    if let Order::Handshake(h) = order {
        if !lt_dev.flags {
            return Err("no flag kernels for the handshake".into());
        }
        // SAFETY: `ready` is a live u32 of this GPU (the caller's flags).
        unsafe { flag_kernels::wait(&stream, h.ready, h.seq)? };
    }
    let algo = match chosen {
        Some(algo) => algo,
        None if g.accumulate => candidates[0],
        None => {
            let best = fastest(cu_stream, &candidates, &issue)?;
            if let Some(plan) = lt_dev.plans.get_mut(&key) {
                plan.chosen = Some(best);
            }
            best
        }
    };
    let start = if g.profile {
        RawEvent::record(cu_stream).ok()
    } else {
        None
    };
    issue(&algo)?;
    if let Some(start) = start
        && let Ok(end) = RawEvent::record(cu_stream)
    {
        lt_dev.timings.push((start, end));
    }
    match order {
        Order::OnStream(_) => Ok(()),
        // SAFETY: `done` is a live u32 of this GPU; the signal runs after the GEMM finished,
        // so its output is visible to whoever sees `done`.
        Order::Handshake(h) => match unsafe { flag_kernels::signal(&stream, h.done, h.seq) } {
            Ok(()) => Ok(()),
            // The GEMM is queued: burn's stream must not go on before it, and no `end` would
            // follow an error. Nothing can undo that but a failure here.
            Err(e) => panic!("after a cuBLASLt call: {e}"),
        },
        Order::Synchronized => stream
            .synchronize()
            .map_err(|e| format!("cuBLASLt stream: {e:?}")),
    }
}
