//! `NcclComm`: the communicator of one process per GPU, NCCL through cudarc (dynamic loading).
//!
//! Collectives run on the communicator's own CUDA stream. The device-buffer methods
//! (`*_device`) enqueue on that stream and return; call [`NcclComm::synchronize`] (or order
//! other streams after it) before reading the results. The [`Communicator`] implementation on
//! host buffers copies in, reduces and copies out on the same stream and synchronizes before it
//! returns, so it is ordered against everything burn did before handing over the host data.
//!
//! NCCL hangs on mismatched calls; so each host-buffer collective first exchanges its signature
//! over a TCP side channel, which turns a mismatch into an error naming both calls.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};
use half::{bf16, f16};

use super::base::*;
use super::exchange::Exchange;
use super::reduce::Payload;
use super::tcp::TcpComm;

/// One rank's NCCL communicator.
pub struct NcclComm {
    comm: CommCell,
    rank: usize,
    world_size: usize,
    stream: Arc<CudaStream>,
    checker: Option<TcpComm>,
}

/// cudarc's `Comm` holds a raw `ncclComm_t`, so it is neither `Send` nor `Sync`.
struct CommCell(std::sync::Mutex<Comm>);

// SAFETY: an NCCL communicator is a heap handle usable from any thread as long as no two calls
// on it overlap (NCCL's threading rule); every use goes through the mutex, and cudarc binds the
// CUDA context to the calling thread on each stream operation.
unsafe impl Send for CommCell {}
// SAFETY: as above: shared access is serialized by the mutex.
unsafe impl Sync for CommCell {}

impl CommCell {
    fn lock(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn nccl_error(rank: usize, call: OpSignature, what: impl std::fmt::Debug) -> CommError {
    CommError::Aborted(format!("NCCL failed on rank {rank} in {call}: {what:?}"))
}

fn op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
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

impl NcclComm {
    /// Joins the NCCL group `id` as `rank` of `world_size` on GPU `ordinal`. `checker` (a TCP
    /// communicator of the same group) enables signature checks of host-buffer collectives.
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
        let mut raw = [0 as core::ffi::c_char; 128];
        raw.iter_mut()
            .zip(id)
            .for_each(|(r, b)| *r = *b as core::ffi::c_char);
        let context =
            CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
        let stream = context
            .new_stream()
            .map_err(|e| format!("CUDA stream on device {ordinal}: {e:?}"))?;
        let comm = Comm::from_rank(stream.clone(), rank, world_size, Id::uninit(raw))
            .map_err(|e| format!("ncclCommInitRank (rank {rank} of {world_size}): {e:?}"))?;
        Ok(Self {
            comm: CommCell(std::sync::Mutex::new(comm)),
            rank,
            world_size,
            stream,
            checker,
        })
    }

    /// The stream collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until every enqueued collective finished.
    pub fn synchronize(&self) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| format!("{e:?}"))
    }

    /// In-place all-reduce of a device buffer (enqueued).
    pub fn all_reduce_device<T: NcclType>(
        &self,
        buf: &mut CudaSlice<T>,
        reduce: ReduceOp,
    ) -> Result<(), String> {
        self.comm
            .lock()
            .all_reduce_in_place(buf, &op(reduce))
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    /// All-gather of device buffers: `output` holds `world_size × input` elements (enqueued).
    pub fn all_gather_device<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<(), String> {
        self.comm
            .lock()
            .all_gather(input, output)
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    /// Reduce-scatter of device buffers: `input` holds `world_size × output` (enqueued).
    pub fn reduce_scatter_device<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        reduce: ReduceOp,
    ) -> Result<(), String> {
        self.comm
            .lock()
            .reduce_scatter(input, output, &op(reduce))
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
    }

    fn check(&self, call: OpSignature) -> Result<(), CommError> {
        match &self.checker {
            Some(checker) => checker.exchange(call, Payload::F32(Vec::new())).map(|_| ()),
            None => Ok(()),
        }
    }

    fn run<T: NcclType + DeviceRepr + ValidAsZeroBits>(
        &self,
        call: OpSignature,
        input: &[T],
        output: &mut [T],
        collective: impl FnOnce(
            &Comm,
            &CudaSlice<T>,
            &mut CudaSlice<T>,
        ) -> Result<
            cudarc::nccl::result::NcclStatus,
            cudarc::nccl::result::NcclError,
        >,
    ) -> Result<(), CommError> {
        self.check(call)?;
        let rank = self.rank;
        let fail = |what: &dyn std::fmt::Debug| nccl_error(rank, call, what);
        let send = self.stream.clone_htod(input).map_err(|e| fail(&e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<T>(output.len())
            .map_err(|e| fail(&e))?;
        collective(&self.comm.lock(), &send, &mut recv).map_err(|e| fail(&e))?;
        self.stream
            .memcpy_dtoh(&recv, output)
            .map_err(|e| fail(&e))?;
        self.stream.synchronize().map_err(|e| fail(&e))
    }
}

/// Runs a typed host-buffer collective on whichever element type the buffers hold.
macro_rules! typed {
    ($self:ident, $call:ident, $input:expr, $output:expr, |$comm:ident, $send:ident, $recv:ident| $body:expr) => {
        match ($input, $output) {
            (Buf::F32(i), BufMut::F32(o)) => {
                $self.run::<f32>($call, i, o, |$comm, $send, $recv| $body)
            }
            (Buf::Bf16(i), BufMut::Bf16(o)) => {
                $self.run::<bf16>($call, i, o, |$comm, $send, $recv| $body)
            }
            (Buf::F16(i), BufMut::F16(o)) => {
                $self.run::<f16>($call, i, o, |$comm, $send, $recv| $body)
            }
            _ => Err(CommError::Invalid {
                rank: $self.rank,
                call: $call,
                reason: "input and output dtypes differ".into(),
            }),
        }
    };
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, buf: BufMut<'_>, reduce: ReduceOp) -> Result<(), CommError> {
        let call = OpSignature {
            kind: OpKind::AllReduce(reduce),
            dtype: buf.dtype(),
            count: buf.len(),
        };
        let input = Payload::copy_of(buf.as_buf());
        let input = input.as_buf();
        typed!(self, call, input, buf, |comm, send, recv| comm.all_reduce(
            send,
            recv,
            &op(reduce)
        ))
    }

    fn reduce_scatter(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        reduce: ReduceOp,
    ) -> Result<(), CommError> {
        let call = OpSignature {
            kind: OpKind::ReduceScatter(reduce),
            dtype: input.dtype(),
            count: input.len(),
        };
        typed!(self, call, input, output, |comm, send, recv| comm
            .reduce_scatter(send, recv, &op(reduce)))
    }

    fn all_gather(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let call = OpSignature {
            kind: OpKind::AllGather,
            dtype: input.dtype(),
            count: input.len(),
        };
        typed!(self, call, input, output, |comm, send, recv| comm
            .all_gather(send, recv))
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let call = OpSignature {
            kind: OpKind::Broadcast { root },
            dtype: buf.dtype(),
            count: buf.len(),
        };
        let input = Payload::copy_of(buf.as_buf());
        let input = input.as_buf();
        typed!(self, call, input, buf, |comm, send, recv| comm.broadcast(
            Some(send),
            recv,
            root as i32
        ))
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0.0f32];
        self.all_reduce(one.as_mut_slice().into(), ReduceOp::Sum)
    }

    fn send(&self, buf: Buf<'_>, peer: usize) -> Result<(), CommError> {
        match &self.checker {
            Some(checker) => checker.send(buf, peer),
            None => Err(CommError::Aborted(
                "point-to-point over NCCL needs the TCP side channel".into(),
            )),
        }
    }

    fn recv(&self, buf: BufMut<'_>, peer: usize) -> Result<(), CommError> {
        match &self.checker {
            Some(checker) => checker.recv(buf, peer),
            None => Err(CommError::Aborted(
                "point-to-point over NCCL needs the TCP side channel".into(),
            )),
        }
    }
}
