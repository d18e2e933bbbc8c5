//! The `Communicator` trait and the flat buffers it moves.

use core::fmt;
use core::time::Duration;

use half::{bf16, f16};

/// Element types a communicator moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// How values from all ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size.
    Avg,
    /// Element-wise maximum.
    Max,
}

/// A read-only flat buffer of one element type.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Buf<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 values.
    Bf16(&'a [bf16]),
    /// f16 values.
    F16(&'a [f16]),
}

/// A writable flat buffer of one element type.
#[derive(Debug)]
#[non_exhaustive]
pub enum BufMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// bf16 values.
    Bf16(&'a mut [bf16]),
    /// f16 values.
    F16(&'a mut [f16]),
}

/// Element types that travel through a communicator, with f32 as their arithmetic type.
pub trait CommElement: Copy + Send + Sync + PartialOrd + Default + 'static {
    /// The communicator's name for this type.
    const DTYPE: DType;
    /// Views a slice as a buffer.
    fn buf(values: &[Self]) -> Buf<'_>;
    /// Views a mutable slice as a buffer.
    fn buf_mut(values: &mut [Self]) -> BufMut<'_>;
    /// The value in f32, where reductions accumulate.
    fn to_f32(self) -> f32;
    /// The f32 accumulator rounded back to this type.
    fn from_f32(value: f32) -> Self;
}

macro_rules! comm_element {
    ($ty:ty, $variant:ident, $to:expr, $from:expr) => {
        impl CommElement for $ty {
            const DTYPE: DType = DType::$variant;
            fn buf(values: &[Self]) -> Buf<'_> {
                Buf::$variant(values)
            }
            fn buf_mut(values: &mut [Self]) -> BufMut<'_> {
                BufMut::$variant(values)
            }
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn from_f32(value: f32) -> Self {
                $from(value)
            }
        }
        impl<'a> From<&'a [$ty]> for Buf<'a> {
            fn from(values: &'a [$ty]) -> Self {
                Buf::$variant(values)
            }
        }
        impl<'a> From<&'a mut [$ty]> for BufMut<'a> {
            fn from(values: &'a mut [$ty]) -> Self {
                BufMut::$variant(values)
            }
        }
    };
}

comm_element!(f32, F32, |v: f32| v, |v: f32| v);
comm_element!(bf16, Bf16, bf16::to_f32, bf16::from_f32);
comm_element!(f16, F16, f16::to_f32, f16::from_f32);

impl Buf<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::Bf16(_) => DType::Bf16,
            Buf::F16(_) => DType::F16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(v) => v.len(),
            Buf::Bf16(v) => v.len(),
            Buf::F16(v) => v.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BufMut<'_> {
    /// A read-only view of the same elements.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(v) => Buf::F32(v),
            BufMut::Bf16(v) => Buf::Bf16(v),
            BufMut::F16(v) => Buf::F16(v),
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.as_buf().dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_buf().len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The kind of a communicator call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`Communicator::all_reduce`].
    AllReduce(ReduceOp),
    /// [`Communicator::reduce_scatter`].
    ReduceScatter(ReduceOp),
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::broadcast`] from a root rank.
    Broadcast {
        /// The rank whose values everyone receives.
        root: usize,
    },
    /// [`Communicator::barrier`].
    Barrier,
    /// [`Communicator::send`] / [`Communicator::recv`].
    PointToPoint,
}

/// What a rank asked for at one sequence number: all ranks must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpSignature {
    /// Kind of call.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Elements this rank contributes (the input length).
    pub count: usize,
    /// What the caller says the call is for ([`with_label`]; 0 when unlabeled): ranks must
    /// agree on it too, so a call for a different purpose at the same sequence number is a
    /// mismatch even when kind and length agree (ZeRO-3 labels each gather with its parameter).
    pub label: u64,
}

impl OpSignature {
    /// The signature of a call made now on this thread (the current [`with_label`] label).
    pub fn new(kind: OpKind, dtype: DType, count: usize) -> Self {
        Self {
            kind,
            dtype,
            count,
            label: current_label(),
        }
    }
}

std::thread_local! {
    static LABEL: core::cell::Cell<u64> = const { core::cell::Cell::new(0) };
}

/// Runs `f` with every collective this thread starts labeled `label`. Labels travel in the
/// call signatures that communicators already compare across ranks, at no extra round trip.
pub fn with_label<R>(label: u64, f: impl FnOnce() -> R) -> R {
    let previous = LABEL.with(|l| l.replace(label));
    let result = f();
    LABEL.with(|l| l.set(previous));
    result
}

/// The label of collectives started now on this thread.
pub fn current_label() -> u64 {
    LABEL.with(|l| l.get())
}

impl fmt::Display for OpSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            OpKind::AllReduce(op) => write!(f, "all_reduce[{op:?}]")?,
            OpKind::ReduceScatter(op) => write!(f, "reduce_scatter[{op:?}]")?,
            OpKind::AllGather => write!(f, "all_gather")?,
            OpKind::Broadcast { root } => write!(f, "broadcast[root {root}]")?,
            OpKind::Barrier => f.write_str("barrier")?,
            OpKind::PointToPoint => write!(f, "send/recv")?,
        }
        if self.kind != OpKind::Barrier {
            write!(f, "({} x {})", self.dtype, self.count)?;
        }
        if self.label != 0 {
            write!(f, " [label {}]", self.label)?;
        }
        Ok(())
    }
}

/// Why a communicator call failed. Every failure names the ranks and calls involved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Two ranks made different calls at the same sequence number.
    #[error(
        "collective #{seq} mismatch: rank {rank_a} called {call_a} but rank {rank_b} called {call_b}"
    )]
    Mismatch {
        /// Sequence number of the collective on this communicator.
        seq: u64,
        /// One rank.
        rank_a: usize,
        /// Its call.
        call_a: OpSignature,
        /// Another rank.
        rank_b: usize,
        /// Its call.
        call_b: OpSignature,
    },
    /// Not every rank arrived in time.
    #[error(
        "rank {rank} timed out after {timeout:?} in {call} (#{seq}) waiting for rank(s) {missing:?}{recent}"
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// Its call.
        call: OpSignature,
        /// Sequence number of the call.
        seq: u64,
        /// Ranks that never arrived.
        missing: Vec<usize>,
        /// How long it waited.
        timeout: Duration,
        /// This rank's last calls (filled in by the communicator that timed out).
        recent: super::flight::FlightRecord,
    },
    /// The group was shut down because a rank failed.
    #[error("communicator aborted: {0}")]
    Aborted(String),
    /// A call's arguments are wrong on this rank alone.
    #[error("invalid {call} on rank {rank}: {reason}")]
    Invalid {
        /// The rank.
        rank: usize,
        /// Its call.
        call: OpSignature,
        /// What is wrong.
        reason: String,
    },
}

/// Collective and point-to-point communication among the ranks of one group.
///
/// Buffer lengths: `all_reduce` and `broadcast` keep the length; `all_gather` writes
/// `world_size × input` elements in rank order; `reduce_scatter` reads `world_size × output`
/// elements and leaves rank `r` the reduced chunk `r`. Every rank must make the same calls in
/// the same order; implementations detect disagreement and never wait without a timeout.
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Reduces `buf` across ranks in place.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError>;
    /// Reduces `input` across ranks and keeps this rank's chunk in `output`.
    fn reduce_scatter(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Concatenates every rank's `input` into `output`, in rank order.
    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError>;
    /// Copies `root`'s buffer into every rank's buffer.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// Sends `buf` to rank `peer`, which must `recv` the same dtype and length.
    fn send(&self, buf: Buf<'_>, peer: usize) -> Result<(), CommError>;
    /// Receives from rank `peer` what it sent.
    fn recv(&self, buf: BufMut<'_>, peer: usize) -> Result<(), CommError>;
    /// Collectives on device memory, for communicators that have them (NCCL). The engine then
    /// keeps its buffers on the device and hands their addresses here.
    fn device(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
    /// The ranks passing the same `color` as a communicator of their own on this one's
    /// transport, ranked by `key` (NCCL: `ncclCommSplit`, with its own stream); a rank passing
    /// `None` takes part and joins none. Collective: every rank calls it, in the same order as
    /// its other calls. `None`: this kind of communicator does not split, and a caller builds
    /// a [`crate::comm::SubComm`] over it instead.
    #[allow(clippy::type_complexity)]
    fn split_group(
        &self,
        color: Option<u32>,
        key: usize,
    ) -> Option<Result<Option<Box<dyn Communicator>>, String>> {
        let _ = (color, key);
        None
    }
    /// One-way device links between each `(from, to)` pair of ranks, for
    /// [`DeviceCollectives::link`] (NCCL: a two-rank communicator per pair). Collective. A
    /// communicator without device memory keeps its host `send`/`recv` and ignores it.
    fn open_links(&mut self, pairs: &[(usize, usize)]) -> Result<(), String> {
        let _ = pairs;
        Ok(())
    }
    /// How long this rank's calls wait for the others before they fail with a timeout (and,
    /// on a device, before the watchdog ends the process); `burn_zero.comm_timeout_s`.
    fn set_timeout(&self, timeout: Duration);
    /// The timeout this rank's calls are held to.
    fn timeout(&self) -> Duration;
}

/// A timeout that a communicator's owner may change while calls read it.
#[derive(Debug)]
pub struct TimeoutCell(std::sync::atomic::AtomicU64);

impl TimeoutCell {
    /// A cell holding `timeout` (at least a millisecond).
    pub fn new(timeout: Duration) -> Self {
        Self(std::sync::atomic::AtomicU64::new(Self::millis(timeout)))
    }

    fn millis(timeout: Duration) -> u64 {
        timeout.as_millis().clamp(1, u64::MAX as u128) as u64
    }

    /// The timeout now.
    pub fn get(&self) -> Duration {
        Duration::from_millis(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Replaces it.
    pub fn set(&self, timeout: Duration) {
        self.0
            .store(Self::millis(timeout), std::sync::atomic::Ordering::Relaxed);
    }
}

/// A buffer in device memory: its address and element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBuf {
    /// The device address of the first element.
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
}

/// One collective on device buffers, as [`DeviceCollectives::unwatched`] enqueues it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Every rank's input combined, in every rank's output.
    AllReduce(ReduceOp),
    /// The input is `world_size` chunks of the output's length; this rank keeps its chunk.
    ReduceScatter(ReduceOp),
    /// Every rank's input, concatenated in rank order.
    AllGather,
    /// The root's input in every rank's output.
    Broadcast(usize),
}

/// Collectives on device buffers (same length rules as [`Communicator`]), enqueued on the
/// communicator's own stream.
///
/// Ordering contract: the inputs are complete when the collective starts, and both buffers stay
/// alive and untouched until it has finished; only then may anything read the outputs. The
/// caller either synchronizes (the compute stream before the call,
/// [`DeviceCollectives::synchronize`] after it) or orders the streams on the device through
/// flags ([`DeviceCollectives::wait_for_flag`], [`DeviceCollectives::raise_flag`]).
pub trait DeviceCollectives: Send + Sync {
    /// Reduces `input` across ranks into `output` (may be the same buffer).
    ///
    /// # Safety
    /// Both buffers are valid device memory of the communicator's device for their length.
    unsafe fn all_reduce(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Reduces `input` (`world_size × output` elements) and keeps this rank's chunk.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn reduce_scatter(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Concatenates every rank's `input` into `output` in rank order.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn all_gather(&self, input: DeviceBuf, output: DeviceBuf) -> Result<(), CommError>;
    /// Several all-gathers as one: each `(input, output)` pair as in
    /// [`DeviceCollectives::all_gather`]. NCCL fuses them into one launch (a group), so a
    /// layer's parameters travel together; by default they run one after another.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`], for every pair.
    unsafe fn all_gather_group(&self, pairs: &[(DeviceBuf, DeviceBuf)]) -> Result<(), CommError> {
        for &(input, output) in pairs {
            // SAFETY: forwarded from the caller.
            unsafe { self.all_gather(input, output)? };
        }
        Ok(())
    }
    /// Copies `root`'s `input` into every rank's `output`.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn broadcast(
        &self,
        input: DeviceBuf,
        output: DeviceBuf,
        root: usize,
    ) -> Result<(), CommError>;
    /// Enqueues `what` on the communicator's stream, as the methods above do, but with no
    /// watchdog following it: for a collective that a CUDA graph captures (the stream joined
    /// the capture through an event, [`DeviceCollectives::wait_event`]), where the watchdog's
    /// event queries would break the capture.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn unwatched(
        &self,
        what: Collective,
        input: DeviceBuf,
        output: DeviceBuf,
    ) -> Result<(), CommError> {
        let _ = (what, input, output);
        Err(CommError::Aborted(
            "this communicator cannot run an unwatched collective".into(),
        ))
    }
    /// Sends `input` to `peer`, which receives it with [`DeviceCollectives::recv`] of the same
    /// length and dtype. NCCL's send waits on the device until the receive is posted: ranks that
    /// exchange messages both ways use one-way links ([`DeviceCollectives::link`]).
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn send(&self, input: DeviceBuf, peer: usize) -> Result<(), CommError> {
        let _ = (input, peer);
        Err(CommError::Aborted(
            "this communicator has no device point-to-point".into(),
        ))
    }
    /// Receives into `output` what `peer` sent.
    ///
    /// # Safety
    /// As for [`DeviceCollectives::all_reduce`].
    unsafe fn recv(&self, output: DeviceBuf, peer: usize) -> Result<(), CommError> {
        let _ = (output, peer);
        Err(CommError::Aborted(
            "this communicator has no device point-to-point".into(),
        ))
    }
    /// The one-way communicator that carries this rank's messages to `peer` ([`Way::To`]) or
    /// from it ([`Way::From`]), with its own stream and flags, and `peer`'s rank in it; `None`
    /// when none was opened (NCCL: `NcclComm::open_links`).
    fn link(&self, peer: usize, way: Way) -> Option<(&dyn DeviceCollectives, usize)> {
        let _ = (peer, way);
        None
    }
    /// Blocks until every enqueued collective has finished.
    fn synchronize(&self) -> Result<(), CommError>;
    /// Whether [`DeviceCollectives::wait_for_flag`] and [`DeviceCollectives::raise_flag`] work
    /// here (their kernels loaded).
    fn orders_by_flags(&self) -> bool {
        false
    }
    /// Enqueues a wait on the collective stream: what follows starts once the `u32` at `flag`
    /// has reached `value` (serial-number order).
    ///
    /// # Safety
    /// `flag` is a live `u32` of the communicator's device until the wait has run.
    unsafe fn wait_for_flag(&self, flag: u64, value: u32) -> Result<(), CommError> {
        let _ = (flag, value);
        Err(CommError::Aborted(
            "this communicator cannot order its stream by flags".into(),
        ))
    }
    /// Enqueues on the collective stream a store of `value` at `flag`, done once every
    /// collective enqueued before it finished.
    ///
    /// # Safety
    /// `flag` is a live `u32` of the communicator's device until the store has run.
    unsafe fn raise_flag(&self, flag: u64, value: u32) -> Result<(), CommError> {
        let _ = (flag, value);
        Err(CommError::Aborted(
            "this communicator cannot order its stream by flags".into(),
        ))
    }
    /// Enqueues on the collective stream a copy of `bytes` bytes from host memory at `src` into
    /// device memory at `dst`: a parameter partition offloaded to page-locked host memory
    /// uploaded right before the all-gather that reads it, in the same stream order.
    ///
    /// # Safety
    /// `src` is page-locked host memory of `bytes` bytes, neither freed nor written until the
    /// copy has run; `dst` is device memory of the communicator's device of at least `bytes`
    /// bytes, untouched by anything else until then.
    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: u64,
        bytes: usize,
    ) -> Result<(), CommError> {
        let _ = (src, dst, bytes);
        Err(CommError::Aborted(
            "this communicator cannot copy from host memory on its stream".into(),
        ))
    }

    /// Enqueues on the collective stream a wait for the CUDA event `event` (a `CUevent`):
    /// what follows starts once the work recorded before it is done. No kernel waits: a module
    /// that CUDA loads meanwhile cannot stall on it.
    ///
    /// # Safety
    /// `event` is a live event of the communicator's device, recorded before this call.
    unsafe fn wait_event(&self, event: u64) -> Result<(), CommError> {
        let _ = event;
        Err(CommError::Aborted(
            "this communicator cannot order its stream by events".into(),
        ))
    }
    /// Records the CUDA event `event` on the collective stream, after everything enqueued.
    ///
    /// # Safety
    /// `event` is a live event of the communicator's device.
    unsafe fn record_event(&self, event: u64) -> Result<(), CommError> {
        let _ = event;
        Err(CommError::Aborted(
            "this communicator cannot order its stream by events".into(),
        ))
    }
}

/// Which way a one-way link carries messages, seen from this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Way {
    /// From this rank to the peer.
    To,
    /// From the peer to this rank.
    From,
}

/// Default time a rank waits for the others before failing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
