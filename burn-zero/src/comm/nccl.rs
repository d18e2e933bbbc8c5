//! `NcclComm`: the communicator of one process per GPU, NCCL through cudarc (dynamic loading).
//!
//! Every collective runs on the communicator's own CUDA stream, on raw device addresses, so the
//! same calls serve cudarc slices (`*_device`), burn-cuda tensor memory ([`DeviceCollectives`],
//! what the engine uses) and host buffers (the [`Communicator`] implementation, which copies
//! in, reduces and copies out on that stream and synchronizes before it returns).
//!
//! NCCL hangs on mismatched calls; so each collective first exchanges its signature over a TCP
//! side channel (when the communicator has one), which turns a mismatch into an error naming
//! both calls.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::result::{self as raw, NcclError, NcclStatus};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use cudarc::nccl::{Id, NcclType};
use half::{bf16, f16};

use super::base::*;
use super::exchange::Exchange;
use super::flight_report::{FlightReport, with_record};
use super::reduce::Payload;
use super::tcp::TcpComm;
use super::watchdog::{Expired, Handler, Probe, Watchdog};
use crate::backend::flag_kernels;

/// One rank's NCCL communicator.
pub struct NcclComm {
    comm: CommCell,
    rank: usize,
    world_size: usize,
    stream: Arc<CudaStream>,
    checker: Option<TcpComm>,
    /// Watches every enqueued collective until its event completes; one that takes longer
    /// than the timeout ends the process with this rank's flight record.
    watchdog: Watchdog,
    /// One-way communicators to and from other ranks ([`NcclComm::open_links`]).
    links: Vec<Link>,
}

/// A one-way communicator of two ranks: this rank and `peer`, messages going `way`.
struct Link {
    peer: usize,
    way: Way,
    comm: NcclComm,
    /// `peer`'s rank in `comm`.
    peer_in_link: usize,
}

/// What `ncclCommSplit` takes from a rank that joins no new communicator.
const NCCL_SPLIT_NOCOLOR: i32 = -1;

/// Exit status of a process the watchdog ended (as `timeout(1)`'s).
pub const WATCHDOG_EXIT: i32 = 124;

/// How often the watchdog looks at the pending collectives.
const WATCHDOG_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// A collective's completion: the event recorded on the stream right after it.
struct EventProbe(CudaEvent);

impl Probe for EventProbe {
    fn done(&self) -> Result<bool, String> {
        self.0
            .context()
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        self.0.try_is_complete().map_err(|e| format!("{e:?}"))
    }
}

/// What the watchdog does with a collective that did not complete: print the rank's flight
/// line (which the launcher reads) and the reason, abort the NCCL communicator so no kernel
/// keeps waiting on peers, and end the process.
fn watchdog_handler(comm: ncclComm_t) -> Handler {
    // The raw handle travels as an address: NCCL allows `ncclCommAbort` from any thread, and
    // it is what ends the other calls that hang on the communicator.
    let handle = comm as usize;
    Box::new(move |expired: Expired| {
        let what = match expired.error {
            Some(_) => "device error",
            None => "watchdog",
        };
        let at = (expired.seq, expired.call.to_string());
        FlightReport::new(expired.rank, what, at, Vec::new(), &expired.recent).print();
        eprintln!("burn-zero: {expired}\nburn-zero: aborting NCCL and exiting");
        // SAFETY: the handle is a live communicator (the watchdog lives no longer than it).
        let _ = unsafe { raw::comm_abort(handle as ncclComm_t) };
        std::process::exit(WATCHDOG_EXIT);
    })
}

/// The raw `ncclComm_t`, behind a mutex: NCCL forbids overlapping calls on one communicator.
struct CommCell(std::sync::Mutex<ncclComm_t>);

// SAFETY: an NCCL communicator is a heap handle usable from any thread as long as no two calls
// on it overlap (NCCL's threading rule); every use goes through the mutex.
unsafe impl Send for CommCell {}
// SAFETY: as above: shared access is serialized by the mutex.
unsafe impl Sync for CommCell {}

impl Drop for CommCell {
    fn drop(&mut self) {
        let comm = *self.0.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle came from `ncclCommInitRank` and is not used after this.
        // Abort rather than destroy: it never waits for peers that may be gone.
        let _ = unsafe { raw::comm_abort(comm) };
    }
}

fn nccl_error(rank: usize, call: OpSignature, what: impl std::fmt::Debug) -> CommError {
    CommError::Aborted(format!("NCCL failed on rank {rank} in {call}: {what:?}"))
}

/// An NCCL result code with NCCL's own words for it and, when `comm` is given, the
/// communicator's last error (cudarc's `NcclError` prints neither).
fn nccl_reason(error: NcclError, comm: Option<ncclComm_t>) -> String {
    let text = |ptr: *const core::ffi::c_char| {
        if ptr.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated strings it owns, valid for this read.
            unsafe { core::ffi::CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        }
    };
    // SAFETY: plain queries of NCCL's message tables; `comm` is a live communicator.
    let (what, last) = unsafe {
        (
            text(cudarc::nccl::sys::ncclGetErrorString(error.0)),
            comm.map(|c| text(cudarc::nccl::sys::ncclGetLastError(c))),
        )
    };
    match last.filter(|l| !l.is_empty()) {
        Some(last) => format!("{:?} ({what}): {last}", error.0),
        None => format!("{:?} ({what})", error.0),
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
    }
}

fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => f32::as_nccl_type(),
        DType::Bf16 => bf16::as_nccl_type(),
        DType::F16 => f16::as_nccl_type(),
    }
}

/// A fresh NCCL unique id (rank 0 makes it and shares it through the rendezvous).
pub fn nccl_unique_id() -> Result<Vec<u8>, String> {
    let id = Id::new()
        .map_err(|e| format!("ncclGetUniqueId failed (is libnccl.so loadable?): {e:?}"))?;
    Ok(id.internal().iter().map(|c| *c as u8).collect())
}

/// The loaded NCCL's version, e.g. 22803 for 2.28.3.
pub fn nccl_version() -> Result<i32, String> {
    cudarc::nccl::result::get_nccl_version().map_err(|e| format!("{e:?}"))
}

/// What one raw collective does; the addresses are the caller's.
#[derive(Clone, Copy)]
enum Raw {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
    /// To a peer.
    Send(usize),
    /// From a peer.
    Recv(usize),
}

impl From<Collective> for Raw {
    fn from(what: Collective) -> Self {
        match what {
            Collective::AllReduce(op) => Raw::AllReduce(op),
            Collective::ReduceScatter(op) => Raw::ReduceScatter(op),
            Collective::AllGather => Raw::AllGather,
            Collective::Broadcast(root) => Raw::Broadcast(root),
        }
    }
}

/// Where a raw collective is enqueued, and whether the watchdog follows it.
#[derive(Clone, Copy)]
enum Launch {
    /// On the communicator's stream, watched.
    Watched,
    /// On the communicator's stream, unwatched (a call inside a group, watched as one; one a
    /// CUDA graph captures, where the watchdog's event query would break the capture).
    Unwatched,
}

impl Raw {
    fn signature(self, dtype: DType, count: usize) -> OpSignature {
        let kind = match self {
            Raw::AllReduce(op) => OpKind::AllReduce(op),
            Raw::ReduceScatter(op) => OpKind::ReduceScatter(op),
            Raw::AllGather => OpKind::AllGather,
            Raw::Broadcast(root) => OpKind::Broadcast { root },
            Raw::Send(_) | Raw::Recv(_) => OpKind::PointToPoint,
        };
        OpSignature::new(kind, dtype, count)
    }
}

impl NcclComm {
    /// Joins the NCCL group `id` as `rank` of `world_size` on GPU `ordinal`. `checker` (a TCP
    /// communicator of the same group) enables signature checks of every collective.
    pub fn new(
        rank: usize,
        world_size: usize,
        ordinal: usize,
        id: &[u8],
        checker: Option<TcpComm>,
    ) -> Result<Self, String> {
        if id.len() != 128 {
            return Err(format!("an NCCL id has 128 bytes, got {}", id.len()));
        }
        let mut raw_id = [0 as core::ffi::c_char; 128];
        raw_id
            .iter_mut()
            .zip(id)
            .for_each(|(r, b)| *r = *b as core::ffi::c_char);
        let context =
            CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
        let stream = context
            .new_stream()
            .map_err(|e| format!("CUDA stream on device {ordinal}: {e:?}"))?;
        context
            .bind_to_thread()
            .map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
        let mut comm = core::mem::MaybeUninit::<ncclComm_t>::uninit();
        let (n, r) = (world_size as i32, rank as i32);
        // SAFETY: `comm` is written by NCCL on success; the id holds 128 bytes from rank 0.
        let comm = unsafe {
            raw::comm_init_rank(comm.as_mut_ptr(), n, ncclUniqueId { internal: raw_id }, r)
                .map_err(|e| format!("ncclCommInitRank (rank {rank} of {world_size}): {e:?}"))?;
            comm.assume_init()
        };
        let timeout = checker.as_ref().map_or(DEFAULT_TIMEOUT, Exchange::timeout);
        let nccl = Self::wrap(comm, rank, world_size, stream, checker, timeout);
        nccl.connect()
            .map_err(|e| format!("connecting NCCL's channels (rank {rank}): {e}"))?;
        Ok(nccl)
    }

    /// A communicator around the raw handle `comm`, watched with `timeout`.
    fn wrap(
        comm: ncclComm_t,
        rank: usize,
        world_size: usize,
        stream: Arc<CudaStream>,
        checker: Option<TcpComm>,
        timeout: std::time::Duration,
    ) -> Self {
        let watchdog = Watchdog::new(rank, timeout, WATCHDOG_POLL, watchdog_handler(comm));
        Self {
            comm: CommCell(std::sync::Mutex::new(comm)),
            rank,
            world_size,
            stream,
            checker,
            watchdog,
            links: Vec::new(),
        }
    }

    /// Splits this communicator (`ncclCommSplit`): the ranks passing the same `color` form a
    /// new one, ranked by `key`, with a stream of its own; `None` joins none and gets `None`.
    /// Every rank of this communicator calls it, in the same order as its other calls. The new
    /// communicator has no side channel: its calls are not checked against each other's
    /// signatures (the watchdog still bounds them), and its host `send`/`recv` go through NCCL.
    pub fn split(&self, color: Option<u32>, key: usize) -> Result<Option<NcclComm>, String> {
        let rank = self.rank;
        let context = self.stream.context();
        let stream = context
            .new_stream()
            .map_err(|e| format!("a CUDA stream for a split of rank {rank}: {e:?}"))?;
        let color_arg = match color {
            Some(c) => i32::try_from(c).map_err(|_| format!("split color {c} is too large"))?,
            None => NCCL_SPLIT_NOCOLOR,
        };
        let mut child = core::mem::MaybeUninit::<ncclComm_t>::uninit();
        {
            let comm = self.comm.0.lock().unwrap_or_else(|e| e.into_inner());
            let _ = context.bind_to_thread();
            // SAFETY: `comm` is live and used by this call alone; NCCL writes `child` (NULL
            // for a rank without a color); a null config inherits the parent's.
            unsafe {
                cudarc::nccl::sys::ncclCommSplit(
                    *comm,
                    color_arg,
                    key as i32,
                    child.as_mut_ptr(),
                    core::ptr::null_mut(),
                )
            }
            .result()
            .map_err(|e| {
                format!(
                    "ncclCommSplit on rank {rank}: {}",
                    nccl_reason(e, Some(*comm))
                )
            })?;
        }
        if color.is_none() {
            return Ok(None);
        }
        // SAFETY: written by a successful split with a color.
        let child = unsafe { child.assume_init() };
        // SAFETY: `child` is a live communicator.
        let (child_rank, child_world) = unsafe {
            let r = raw::comm_user_rank(child);
            let n = raw::comm_count(child);
            (r, n)
        };
        let fail =
            |e: NcclError| format!("a split of rank {rank}: {}", nccl_reason(e, Some(child)));
        let (child_rank, child_world) = (child_rank.map_err(fail)?, child_world.map_err(fail)?);
        Ok(Some(Self::wrap(
            child,
            child_rank as usize,
            child_world as usize,
            stream,
            None,
            self.watchdog.timeout(),
        )))
    }

    /// Opens a one-way communicator, with its own stream, for each pair `(from, to)` of this
    /// communicator's ranks in `pairs` that involves this rank: `from`'s messages to `to` then
    /// queue apart from those going the other way and from the collectives, so a send waiting
    /// for its receiver never holds up a receive (a pipeline's 1F1B sends an activation
    /// downstream while the gradient comes up). Every rank passes the same pairs in the same
    /// order (one `ncclCommSplit` each); each link is connected here with a one-element message.
    /// [`DeviceCollectives::link`] finds them.
    pub fn open_links(&mut self, pairs: &[(usize, usize)]) -> Result<(), String> {
        let (rank, world) = (self.rank, self.world_size);
        for &(from, to) in pairs {
            if from >= world || to >= world || from == to {
                return Err(format!(
                    "a link from rank {from} to rank {to} in a communicator of {world} ranks"
                ));
            }
            let member = rank == from || rank == to;
            let key = usize::from(rank == to);
            let Some(link) = self.split(member.then_some(0), key)? else {
                continue;
            };
            let (way, peer) = if rank == from {
                (Way::To, to)
            } else {
                (Way::From, from)
            };
            let one: CudaSlice<f32> = link.stream.alloc_zeros(1).map_err(|e| format!("{e:?}"))?;
            let buf = link.slice_buf(&one);
            // SAFETY: `one` lives until the synchronization below.
            unsafe {
                match way {
                    Way::To => link.device_p2p(Raw::Send(1), buf),
                    Way::From => link.device_p2p(Raw::Recv(0), buf),
                }
            }
            .map_err(|e| format!("connecting the link from {from} to {to}: {e}"))?;
            link.synchronize()?;
            self.links.push(Link {
                peer,
                way,
                comm: link,
                peer_in_link: 1 - key,
            });
        }
        Ok(())
    }

    /// Runs each collective the engine uses once on small buffers, so NCCL (which connects its
    /// channels at their first use) takes its buffers now, while the device is nearly empty,
    /// rather than in the middle of a step whose memory is full.
    fn connect(&self) -> Result<(), String> {
        let n = 1 << 20;
        let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
        let small: CudaSlice<bf16> = self.stream.alloc_zeros(n).map_err(|e| err(&e))?;
        let mut large: CudaSlice<bf16> = self
            .stream
            .alloc_zeros(n * self.world_size)
            .map_err(|e| err(&e))?;
        let mut out: CudaSlice<bf16> = self.stream.alloc_zeros(n).map_err(|e| err(&e))?;
        self.all_gather_device(&small, &mut large)
            .map_err(|e| e.to_string())?;
        self.reduce_scatter_device(&large, &mut out, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        self.all_reduce_device(&mut out, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        self.synchronize()
    }

    /// The stream collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until every enqueued collective finished.
    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| format!("{e:?}"))
    }

    /// Enqueues one collective on raw addresses of this communicator's device.
    ///
    /// # Safety
    /// `input` and `output` are valid device memory for the lengths the collective reads and
    /// writes, and stay so until the stream has run it.
    unsafe fn launch(
        &self,
        what: Raw,
        input: DeviceBuf,
        output: DeviceBuf,
    ) -> Result<NcclStatus, NcclError> {
        let dtype = nccl_dtype(input.dtype);
        let (send, recv) = (input.ptr as *const _, output.ptr as *mut _);
        let stream = self.stream.cu_stream() as _;
        let _ = self.stream.context().bind_to_thread();
        let comm = self.comm.0.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: as the caller promised; `comm` is a live communicator used by one call at a time.
        unsafe {
            match what {
                Raw::AllReduce(op) => {
                    raw::all_reduce(send, recv, input.len, dtype, nccl_op(op), *comm, stream)
                }
                Raw::ReduceScatter(op) => {
                    let n = output.len;
                    raw::reduce_scatter(send, recv, n, dtype, nccl_op(op), *comm, stream)
                }
                Raw::AllGather => raw::all_gather(send, recv, input.len, dtype, *comm, stream),
                Raw::Broadcast(root) => {
                    raw::broadcast(send, recv, input.len, dtype, root as i32, *comm, stream)
                }
                Raw::Send(peer) => raw::send(send, input.len, dtype, peer as i32, *comm, stream),
                Raw::Recv(peer) => raw::recv(recv, output.len, dtype, peer as i32, *comm, stream),
            }
        }
    }

    /// Checks lengths (and, when `checked`, signatures across ranks), then enqueues `what`.
    ///
    /// # Safety
    /// As for [`NcclComm::launch`].
    unsafe fn device_collective(
        &self,
        what: Raw,
        input: DeviceBuf,
        output: DeviceBuf,
        checked: bool,
        on: Launch,
    ) -> Result<(), CommError> {
        let call = what.signature(input.dtype, input.len);
        let world = self.world_size;
        let expected = match what {
            Raw::AllReduce(_) | Raw::Broadcast(_) => input.len,
            Raw::ReduceScatter(_) => input.len / world,
            Raw::AllGather => input.len * world,
            Raw::Send(_) | Raw::Recv(_) => {
                // SAFETY: forwarded from the caller.
                return unsafe { self.device_p2p(what, input) };
            }
        };
        let divisible = !matches!(what, Raw::ReduceScatter(_)) || input.len.is_multiple_of(world);
        if output.len != expected || !divisible || output.dtype != input.dtype {
            return Err(CommError::Invalid {
                rank: self.rank,
                call,
                reason: format!(
                    "{} {} in, {} {} out (expected {expected} out)",
                    input.len, input.dtype, output.len, output.dtype
                ),
            });
        }
        if checked {
            self.check(call)?;
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.launch(what, input, output) }.map_err(|e| {
            let comm = *self.comm.0.lock().unwrap_or_else(|e| e.into_inner());
            CommError::Aborted(format!(
                "NCCL failed on rank {} in {call}: {}",
                self.rank,
                nccl_reason(e, Some(comm))
            ))
        })?;
        if let Launch::Watched = on {
            self.watch(call);
        }
        Ok(())
    }

    /// Enqueues a send or a receive of `buf` (watched, never checked: a message concerns two
    /// ranks, the signature check all of them).
    ///
    /// # Safety
    /// As for [`NcclComm::launch`].
    unsafe fn device_p2p(&self, what: Raw, buf: DeviceBuf) -> Result<(), CommError> {
        let call = what.signature(buf.dtype, buf.len);
        let peer = match what {
            Raw::Send(p) | Raw::Recv(p) => p,
            _ => unreachable!("a message is a send or a receive"),
        };
        if peer >= self.world_size || peer == self.rank {
            return Err(CommError::Invalid {
                rank: self.rank,
                call,
                reason: format!("peer {peer} of a group of {}", self.world_size),
            });
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.launch(what, buf, buf) }.map_err(|e| {
            let comm = *self.comm.0.lock().unwrap_or_else(|e| e.into_inner());
            CommError::Aborted(format!(
                "NCCL failed on rank {} in {call} with {peer}: {}",
                self.rank,
                nccl_reason(e, Some(comm))
            ))
        })?;
        self.watch(call);
        Ok(())
    }

    /// A host-buffer message through NCCL (a communicator without a side channel): copied in,
    /// sent or received, copied out, synchronized. Blocks until the peer has taken part.
    fn run_p2p<T: NcclType + CommElement + DeviceRepr + ValidAsZeroBits>(
        &self,
        what: Raw,
        input: Option<&[T]>,
        output: Option<&mut [T]>,
    ) -> Result<(), CommError> {
        let len = input.map_or(0, <[T]>::len) + output.as_ref().map_or(0, |o| o.len());
        let (rank, call) = (self.rank, what.signature(T::DTYPE, len));
        let fail = |what: &dyn std::fmt::Debug| nccl_error(rank, call, what);
        let device = match input {
            Some(i) => self.stream.clone_htod(i),
            None => self.stream.alloc_zeros::<T>(len),
        }
        .map_err(|e| fail(&e))?;
        // SAFETY: `device` lives until the synchronization below.
        unsafe { self.device_p2p(what, self.slice_buf(&device))? };
        if let Some(out) = output {
            self.stream
                .memcpy_dtoh(&device, out)
                .map_err(|e| fail(&e))?;
        }
        self.stream.synchronize().map_err(|e| fail(&e))
    }

    /// Hands the collective just enqueued (`call`) to the watchdog, through an event recorded
    /// after it on the stream. An event that cannot be made leaves the call unwatched.
    fn watch(&self, call: OpSignature) {
        if let Ok(event) = self.stream.record_event(None) {
            self.watchdog.watch(call, Box::new(EventProbe(event)));
        }
    }

    fn slice_buf<T: NcclType + CommElement>(&self, slice: &CudaSlice<T>) -> DeviceBuf {
        let (ptr, _sync) = slice.device_ptr(&self.stream);
        DeviceBuf {
            ptr,
            len: slice.len(),
            dtype: T::DTYPE,
        }
    }

    /// In-place all-reduce of a device buffer (enqueued; no signature check: the fast path for
    /// callers that keep their ranks in step themselves).
    pub fn all_reduce_device<T: NcclType + CommElement>(
        &self,
        buf: &mut CudaSlice<T>,
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        let b = self.slice_buf(buf);
        // SAFETY: `buf` is a live allocation on this device, borrowed for the call.
        unsafe { self.device_collective(Raw::AllReduce(reduce), b, b, false, Launch::Watched) }
    }

    /// All-gather of device buffers: `output` holds `world_size × input` elements (enqueued).
    pub fn all_gather_device<T: NcclType + CommElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        let (i, o) = (self.slice_buf(input), self.slice_buf(output));
        // SAFETY: both are live allocations on this device, borrowed for the call.
        unsafe { self.device_collective(Raw::AllGather, i, o, false, Launch::Watched) }
    }

    /// Reduce-scatter of device buffers: `input` holds `world_size × output` (enqueued).
    pub fn reduce_scatter_device<T: NcclType + CommElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        let (i, o) = (self.slice_buf(input), self.slice_buf(output));
        // SAFETY: both are live allocations on this device, borrowed for the call.
        unsafe { self.device_collective(Raw::ReduceScatter(reduce), i, o, false, Launch::Watched) }
    }

    /// Exchanges `call`'s signature with every rank over the side channel. A rank that does
    /// not come in time is named, with this rank's record of its device collectives.
    fn check(&self, call: OpSignature) -> Result<(), CommError> {
        let Some(checker) = &self.checker else {
            return Ok(());
        };
        checker
            .exchange(call, Payload::F32(Vec::new()))
            .map(|_| ())
            .map_err(|e| with_record(e, self.watchdog.record(), true))
    }

    /// A host-buffer collective: copy in, run `what`, copy out, synchronize.
    fn run<T: NcclType + CommElement + DeviceRepr + ValidAsZeroBits>(
        &self,
        what: Raw,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let (rank, call) = (self.rank, what.signature(T::DTYPE, input.len()));
        let fail = |what: &dyn std::fmt::Debug| nccl_error(rank, call, what);
        let send = self.stream.clone_htod(input).map_err(|e| fail(&e))?;
        let recv = self
            .stream
            .alloc_zeros::<T>(output.len())
            .map_err(|e| fail(&e))?;
        let (i, o) = (self.slice_buf(&send), self.slice_buf(&recv));
        // SAFETY: `send` and `recv` live until the synchronization below.
        unsafe { self.device_collective(what, i, o, true, Launch::Watched)? };
        self.stream
            .memcpy_dtoh(&recv, output)
            .map_err(|e| fail(&e))?;
        // `send` and `recv` are dropped only after this: NCCL has finished with them.
        self.stream.synchronize().map_err(|e| fail(&e))
    }
}

impl DeviceCollectives for NcclComm {
    unsafe fn all_reduce(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.device_collective(Raw::AllReduce(op), input, output, true, Launch::Watched) }
    }

    unsafe fn reduce_scatter(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.device_collective(Raw::ReduceScatter(op), input, output, true, Launch::Watched)
        }
    }

    unsafe fn all_gather(&self, input: DeviceBuf, output: DeviceBuf) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.device_collective(Raw::AllGather, input, output, true, Launch::Watched) }
    }

    unsafe fn all_gather_group(&self, pairs: &[(DeviceBuf, DeviceBuf)]) -> Result<(), CommError> {
        let fail = |what: &str, e: NcclError| {
            CommError::Aborted(format!(
                "NCCL failed on rank {} in {what} of a group of {} all-gathers: {}",
                self.rank,
                pairs.len(),
                nccl_reason(e, None)
            ))
        };
        raw::group_start().map_err(|e| fail("ncclGroupStart", e))?;
        let mut outcome = Ok(());
        for &(input, output) in pairs {
            // SAFETY: forwarded from the caller.
            // Inside a group NCCL enqueues nothing until the group ends: the group is watched
            // as one call, after it.
            outcome = unsafe {
                self.device_collective(Raw::AllGather, input, output, true, Launch::Unwatched)
            };
            if outcome.is_err() {
                break;
            }
        }
        // Closed even after a failed call: the group must not stay open on this thread.
        let ended = raw::group_end().map_err(|e| fail("ncclGroupEnd", e));
        let outcome = outcome.and(ended.map(|_| ()));
        if outcome.is_ok()
            && let Some((input, _)) = pairs.last()
        {
            self.watch(Raw::AllGather.signature(input.dtype, input.len));
        }
        outcome
    }

    unsafe fn broadcast(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        root: usize,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.device_collective(Raw::Broadcast(root), input, output, true, Launch::Watched)
        }
    }

    unsafe fn unwatched(
        &self,
        what: Collective,
        input: DeviceBuf,
        output: DeviceBuf,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.device_collective(what.into(), input, output, true, Launch::Unwatched) }
    }

    unsafe fn send(&self, input: DeviceBuf, peer: usize) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.device_p2p(Raw::Send(peer), input) }
    }

    unsafe fn recv(&self, output: DeviceBuf, peer: usize) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.device_p2p(Raw::Recv(peer), output) }
    }

    fn link(&self, peer: usize, way: Way) -> Option<(&dyn DeviceCollectives, usize)> {
        self.links
            .iter()
            .find(|l| l.peer == peer && l.way == way)
            .map(|l| (&l.comm as &dyn DeviceCollectives, l.peer_in_link))
    }

    fn synchronize(&self) -> Result<(), CommError> {
        self.stream
            .synchronize()
            .map_err(|e| CommError::Aborted(format!("NCCL stream of rank {}: {e:?}", self.rank)))
    }

    fn orders_by_flags(&self) -> bool {
        flag_kernels::available(&self.stream).is_ok()
    }

    unsafe fn wait_for_flag(&self, flag: u64, value: u32) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { flag_kernels::wait(&self.stream, flag, value) }
            .map_err(|e| CommError::Aborted(format!("NCCL stream of rank {}: {e}", self.rank)))
    }

    unsafe fn raise_flag(&self, flag: u64, value: u32) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller.
        unsafe { flag_kernels::signal(&self.stream, flag, value) }
            .map_err(|e| CommError::Aborted(format!("NCCL stream of rank {}: {e}", self.rank)))
    }

    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: u64,
        bytes: usize,
    ) -> Result<(), CommError> {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: as the caller promises: `src` holds `bytes` page-locked bytes until the copy
        // has run, and `dst` as many bytes of this device.
        unsafe {
            let src = std::slice::from_raw_parts(src, bytes);
            cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream())
        }
        .map_err(|e| {
            CommError::Aborted(format!(
                "NCCL stream of rank {}: an upload: {e:?}",
                self.rank
            ))
        })
    }

    unsafe fn wait_event(&self, event: u64) -> Result<(), CommError> {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the caller's event, recorded before; the stream is ours.
        unsafe {
            cudarc::driver::result::stream::wait_event(
                self.stream.cu_stream(),
                event as cudarc::driver::sys::CUevent,
                cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| CommError::Aborted(format!("NCCL stream of rank {}: {e:?}", self.rank)))
    }

    unsafe fn record_event(&self, event: u64) -> Result<(), CommError> {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the caller's live event; the stream is ours.
        unsafe {
            cudarc::driver::result::event::record(
                event as cudarc::driver::sys::CUevent,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| CommError::Aborted(format!("NCCL stream of rank {}: {e:?}", self.rank)))
    }
}

/// Runs a host-buffer collective on whichever element type the buffers hold.
macro_rules! typed {
    ($self:ident, $what:expr, $input:expr, $output:expr) => {
        match ($input, $output) {
            (Buf::F32(i), BufMut::F32(o)) => $self.run::<f32>($what, i, o),
            (Buf::Bf16(i), BufMut::Bf16(o)) => $self.run::<bf16>($what, i, o),
            (Buf::F16(i), BufMut::F16(o)) => $self.run::<f16>($what, i, o),
            (i, o) => Err(CommError::Invalid {
                rank: $self.rank,
                call: $what.signature(i.dtype(), i.len()),
                reason: format!("input is {}, output is {}", i.dtype(), o.dtype()),
            }),
        }
    };
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn split_group(
        &self,
        color: Option<u32>,
        key: usize,
    ) -> Option<Result<Option<Box<dyn Communicator>>, String>> {
        let child = NcclComm::split(self, color, key);
        Some(child.map(|c| c.map(|c| Box::new(c) as Box<dyn Communicator>)))
    }

    fn open_links(&mut self, pairs: &[(usize, usize)]) -> Result<(), String> {
        NcclComm::open_links(self, pairs)
    }

    fn set_timeout(&self, timeout: std::time::Duration) {
        if let Some(checker) = &self.checker {
            Exchange::set_timeout(checker, timeout);
        }
        self.watchdog.set_timeout(timeout);
    }

    fn timeout(&self) -> std::time::Duration {
        self.watchdog.timeout()
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, reduce: ReduceOp) -> Result<(), CommError> {
        let input = Payload::copy_of(buf.as_buf());
        typed!(self, Raw::AllReduce(reduce), input.as_buf(), buf)
    }

    fn reduce_scatter(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        typed!(self, Raw::ReduceScatter(reduce), input, output)
    }

    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        typed!(self, Raw::AllGather, input, output)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let input = Payload::copy_of(buf.as_buf());
        typed!(self, Raw::Broadcast(root), input.as_buf(), buf)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0.0f32];
        Communicator::all_reduce(self, one.as_mut_slice().into(), ReduceOp::Sum)
    }

    fn send(&self, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        if let Some(side) = &self.checker {
            return side.send(buf, peer);
        }
        match buf {
            Buf::F32(v) => self.run_p2p::<f32>(Raw::Send(peer), Some(v), None),
            Buf::Bf16(v) => self.run_p2p::<bf16>(Raw::Send(peer), Some(v), None),
            Buf::F16(v) => self.run_p2p::<f16>(Raw::Send(peer), Some(v), None),
        }
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        if let Some(side) = &self.checker {
            return side.recv(buf, peer);
        }
        match buf {
            BufMut::F32(v) => self.run_p2p::<f32>(Raw::Recv(peer), None, Some(v)),
            BufMut::Bf16(v) => self.run_p2p::<bf16>(Raw::Recv(peer), None, Some(v)),
            BufMut::F16(v) => self.run_p2p::<f16>(Raw::Recv(peer), None, Some(v)),
        }
    }

    fn device(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}
