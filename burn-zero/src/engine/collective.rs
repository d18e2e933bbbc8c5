//! Collectives on the engine's flat buffers: 1-D float tensors of the inner backend.
//!
//! With a communicator that has [`DeviceCollectives`] (NCCL) and CUDA tensors, the collective
//! runs on the tensors' device memory. Ordering, made explicit here:
//! 1. the input's address is taken (fusion's pending work is handed to cubecl first);
//! 2. on burn's stream, the output is allocated and a flag raised once everything queued
//!    before is done (one visit to cubecl's thread; the GPU is not waited for);
//! 3. NCCL's stream waits for that flag, runs the collective and raises a flag of its own;
//!    both buffers are held in `in_flight`;
//! 4. before anything reads an output, [`FlatComm::wait`] makes burn's stream wait for NCCL's
//!    flag and releases the buffers (their memory is reused only after that wait). The host
//!    never waits. Without `overlap_comm` that wait follows every collective; with it,
//!    backward keeps computing while the gradients travel.
//!
//! Where the flag kernels are missing, step 2 synchronizes the device and step 4 waits on the
//! host for NCCL's stream. With [`FlatComm::order_by_events`] (CUDA graphs) CUDA events take
//! the flags' place in steps 2–4, which a capture of burn's stream follows into NCCL's stream. Every other case copies through the host and the plain
//! [`Communicator`]; `burn_zero.host_collectives` forces that path (to compare or to rule the
//! device path out).

use std::sync::Arc;

#[cfg(feature = "cuda")]
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::comm::{Collective, CommError, Communicator, ReduceOp};

/// The number of a device collective ordered by flags, in issue order: what
/// [`FlatComm::wait_for`] orders burn's stream after.
pub(crate) type Ticket = u64;

/// How a [`FlatComm`] holds its communicator: owned by the engine, or borrowed for one call
/// ([`crate::collective`]).
pub(crate) trait CommRef {
    fn get(&self) -> &dyn Communicator;
}

impl CommRef for Arc<dyn Communicator> {
    fn get(&self) -> &dyn Communicator {
        self.as_ref()
    }
}

impl CommRef for &dyn Communicator {
    fn get(&self) -> &dyn Communicator {
        *self
    }
}

/// The engine's collectives on flat tensors of `I`.
pub(crate) struct FlatComm<I: Backend, C: CommRef = Arc<dyn Communicator>> {
    comm: C,
    device: I::Device,
    /// Whether device collectives return before NCCL finished (`overlap_comm`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    overlap: bool,
    /// Device collectives are switched off (`burn_zero.host_collectives`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    host_only: bool,
    /// Device buffers NCCL may still be reading or writing, with their collective's ticket.
    #[cfg(feature = "cuda")]
    in_flight: Vec<(Ticket, crate::backend::cuda::CudaBuffer)>,
    /// What burn's stream must wait on before an output in flight is read: each collective
    /// ordered by flags and not yet waited for, in issue order.
    #[cfg(feature = "cuda")]
    fences: Vec<(Ticket, crate::backend::cuda::Fence)>,
    /// The ticket the next ordered collective gets.
    #[cfg(feature = "cuda")]
    next_ticket: Ticket,
    /// The last collective's ticket, if it was ordered by flags.
    last_ticket: Option<Ticket>,
    /// A collective in flight was not ordered by flags: `wait` blocks for NCCL's stream.
    #[cfg(feature = "cuda")]
    host_wait: bool,
    /// This communicator's flags (`stream_order.rs`).
    #[cfg(feature = "cuda")]
    channel: u64,
    /// Device collectives ordered by CUDA events and unwatched ([`FlatComm::order_by_events`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    by_events: bool,
    /// For each collective ordered by events, in issue order: the event recorded on the
    /// communicator's stream after it, with the fusion client and device burn's stream waits
    /// for it through.
    #[cfg(feature = "cuda")]
    events: Vec<(
        Ticket,
        u64,
        Option<crate::backend::cuda::FusionClient>,
        cubecl::cuda::CudaDevice,
    )>,
    /// Collectives that ran on device memory (for reports and tests).
    pub(crate) device_calls: usize,
}

impl<I: Backend, C: CommRef> FlatComm<I, C> {
    /// Collectives of `comm` on `device`'s tensors; `overlap`: a device collective is not
    /// waited for until [`FlatComm::wait`]; `host_only`: through host memory even where
    /// `comm` could use device memory (`burn_zero.host_collectives`).
    pub(crate) fn new(comm: C, device: I::Device, overlap: bool, host_only: bool) -> Self {
        Self {
            comm,
            device,
            overlap,
            host_only,
            #[cfg(feature = "cuda")]
            in_flight: Vec::new(),
            #[cfg(feature = "cuda")]
            fences: Vec::new(),
            #[cfg(feature = "cuda")]
            next_ticket: 0,
            last_ticket: None,
            #[cfg(feature = "cuda")]
            host_wait: false,
            #[cfg(feature = "cuda")]
            channel: crate::backend::stream_order::new_channel(),
            by_events: false,
            #[cfg(feature = "cuda")]
            events: Vec::new(),
            device_calls: 0,
        }
    }

    /// Whether device collectives are ordered against burn's stream by CUDA events instead of
    /// flags, and left unwatched: a capture of burn's stream follows the events into the
    /// communicator's stream, so a CUDA graph holds the collectives, still running beside the
    /// compute, where flags' sequence numbers would be frozen into it (`crate::graph`).
    pub(crate) fn order_by_events(&mut self, on: bool) {
        self.by_events = on;
    }

    pub(crate) fn comm(&self) -> &dyn Communicator {
        self.comm.get()
    }

    /// The flags' channel of this communicator's stream, instead of a new one: a communicator
    /// borrowed for a few calls names its stream by its address, so its numbers continue
    /// ([`crate::backend::cuda::channel_of`]) and no flags are allocated per call.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_channel(mut self, channel: u64) -> Self {
        self.channel = channel;
        self
    }

    pub(crate) fn device(&self) -> &I::Device {
        &self.device
    }

    /// Reduces `t` across ranks.
    pub(crate) fn all_reduce(
        &mut self,
        t: Tensor<I, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Collective::AllReduce(op), t)
    }

    /// Reduces `t` (`world_size × k` elements) and returns this rank's `k`.
    pub(crate) fn reduce_scatter(
        &mut self,
        t: Tensor<I, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Collective::ReduceScatter(op), t)
    }

    /// Every rank's `t`, concatenated in rank order.
    pub(crate) fn all_gather(&mut self, t: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        self.run(Collective::AllGather, t)
    }

    /// Every rank's pieces of `t` (consecutive, of `pieces` elements each), gathered as one
    /// collective: the output holds, for each piece in turn, every rank's copy of it in rank
    /// order (`world_size × piece` elements), as separate all-gathers of the pieces would,
    /// end to end. A layer's parameters go as one call (one NCCL group on the device).
    pub(crate) fn all_gather_group(
        &mut self,
        t: Tensor<I, 1>,
        pieces: &[usize],
    ) -> Result<Tensor<I, 1>, CommError> {
        assert_eq!(
            pieces.iter().sum::<usize>(),
            t.dims()[0],
            "the pieces of a grouped all-gather cover its input"
        );
        self.run_pieces(Collective::AllGather, t, pieces)
    }

    /// [`FlatComm::all_gather_group`] of an input that waits in page-locked host memory: `host`
    /// holds each piece's bytes in `dtype`, uploaded on the communication stream right before
    /// the collective, so burn's stream neither uploads nor waits. `None` where that path is
    /// not open (one rank, no device collectives or flags, not CUDA): the caller uploads the
    /// pieces and calls [`FlatComm::all_gather_group`].
    ///
    /// # Safety
    /// Every slice of `host` is page-locked, and neither freed nor written until the
    /// collective's ticket ([`FlatComm::last_ticket`]) has been waited for.
    #[cfg(feature = "cuda")]
    pub(crate) unsafe fn all_gather_group_from_host(
        &mut self,
        host: &[&[u8]],
        pieces: &[usize],
        dtype: burn::tensor::DType,
    ) -> Result<Option<Tensor<I, 1>>, CommError> {
        self.last_ticket = None;
        let len: usize = pieces.iter().sum();
        assert_eq!(
            host.iter().map(|h| h.len()).sum::<usize>(),
            len * dtype.size(),
            "the host pieces of a grouped all-gather hold its input"
        );
        let open = self.comm.get().world_size() > 1
            && !self.host_only
            && !self.by_events
            && self
                .comm
                .get()
                .device()
                .is_some_and(|d| d.orders_by_flags());
        if !open || len == 0 {
            return Ok(None);
        }
        let input = Tensor::<I, 1>::empty([len], (&self.device, dtype));
        self.run_on_device(Collective::AllGather, &input, pieces, Some(host))
    }

    /// `root`'s `t` on every rank.
    pub(crate) fn broadcast(
        &mut self,
        t: Tensor<I, 1>,
        root: usize,
    ) -> Result<Tensor<I, 1>, CommError> {
        self.run(Collective::Broadcast(root), t)
    }

    /// The ticket of the last collective, when it ran on device memory ordered by flags
    /// (`None`: complete already, or ordered only by [`FlatComm::wait`]).
    pub(crate) fn last_ticket(&self) -> Option<Ticket> {
        self.last_ticket
    }

    /// Orders every device collective before what reads its output: burn's stream waits for
    /// them (the host does not, unless one was not ordered by flags). Their outputs may be used
    /// after this.
    pub(crate) fn wait(&mut self) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        if !self.in_flight.is_empty() {
            self.await_fences(Ticket::MAX)?;
            if std::mem::take(&mut self.host_wait)
                && let Some(device) = self.comm.get().device()
            {
                device.synchronize()?;
            }
            // Released after burn's stream was told to wait: it reuses the memory after that.
            self.in_flight.clear();
        }
        Ok(())
    }

    /// Orders the collective of `ticket` (and every one issued before it) before what reads
    /// its output, and no later one: a prefetch or a reduce-scatter issued after it keeps
    /// running while burn's stream computes with this output. `None`: as [`FlatComm::wait`].
    pub(crate) fn wait_for(&mut self, ticket: Option<Ticket>) -> Result<(), CommError> {
        #[cfg(feature = "cuda")]
        {
            let Some(ticket) = ticket else {
                return self.wait();
            };
            if self.host_wait {
                return self.wait();
            }
            self.await_fences(ticket)?;
            // Ordered now, so their memory may be reused.
            self.in_flight.retain(|(t, _)| *t > ticket);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = ticket;
        Ok(())
    }

    /// Makes burn's stream wait for every fence of a ticket up to `upto`: per stream only the
    /// last one, whose handshake covers the earlier ones.
    #[cfg(feature = "cuda")]
    fn await_fences(&mut self, upto: Ticket) -> Result<(), CommError> {
        use crate::backend::stream_event::{drop_event, wait_in_order};
        let split = self.events.partition_point(|(t, ..)| *t <= upto);
        let mut due: Vec<_> = self.events.drain(..split).collect();
        if let Some((_, last, fusion, device)) = due.pop() {
            // The communicator's stream runs its work in order: its last event covers the
            // earlier ones.
            due.into_iter().for_each(|(_, ev, ..)| drop_event(ev));
            wait_in_order(fusion, &device, last).map_err(|e| {
                CommError::Aborted(format!("ordering burn's stream after NCCL's: {e}"))
            })?;
        }
        let split = self.fences.partition_point(|(t, _)| *t <= upto);
        let fences = self.fences.drain(..split).map(|(_, fence)| fence);
        crate::backend::cuda::await_fences(fences)
            .map_err(|e| CommError::Aborted(format!("ordering burn's stream after NCCL's: {e}")))
    }

    fn output_len(&self, op: Collective, len: usize) -> usize {
        let world = self.comm.get().world_size();
        match op {
            Collective::AllReduce(_) | Collective::Broadcast(_) => len,
            Collective::ReduceScatter(_) => len / world,
            Collective::AllGather => len * world,
        }
    }

    fn run(&mut self, op: Collective, input: Tensor<I, 1>) -> Result<Tensor<I, 1>, CommError> {
        self.run_pieces(op, input, &[])
    }

    /// Runs `op`; an all-gather with `pieces` gathers each piece separately into the output
    /// ([`FlatComm::all_gather_group`]). No pieces: the input as one.
    fn run_pieces(
        &mut self,
        op: Collective,
        input: Tensor<I, 1>,
        pieces: &[usize],
    ) -> Result<Tensor<I, 1>, CommError> {
        self.last_ticket = None;
        // One rank: every collective returns its input (a one-rank NCCL call would still copy
        // the buffer and order two streams around it).
        if self.comm.get().world_size() == 1 {
            return Ok(input);
        }
        #[cfg(feature = "cuda")]
        if let Some(output) = self.run_on_device(op, &input, pieces, None)? {
            return Ok(output);
        }
        self.run_on_host(op, input, pieces)
    }

    fn run_on_host(
        &self,
        op: Collective,
        input: Tensor<I, 1>,
        pieces: &[usize],
    ) -> Result<Tensor<I, 1>, CommError> {
        let dtype = input.dtype();
        let mut values = input
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 values");
        let n = self.output_len(op, values.len());
        let comm = self.comm.get();
        let values = match op {
            Collective::AllReduce(reduce) => {
                comm.all_reduce(values.as_mut_slice().into(), reduce)?;
                values
            }
            Collective::Broadcast(root) => {
                comm.broadcast(values.as_mut_slice().into(), root)?;
                values
            }
            Collective::ReduceScatter(reduce) => {
                let mut out = vec![0.0f32; n];
                comm.reduce_scatter(values.as_slice().into(), out.as_mut_slice().into(), reduce)?;
                out
            }
            Collective::AllGather => {
                let mut out = vec![0.0f32; n];
                comm.all_gather(values.as_slice().into(), out.as_mut_slice().into())?;
                if pieces.len() > 1 {
                    out = by_piece(&out, pieces, comm.world_size());
                }
                out
            }
        };
        let data = TensorData::new(values, [n]).convert_dtype(dtype);
        // The input's dtype: `from_data` would otherwise take the device's default.
        Ok(Tensor::from_data(data, (&self.device, dtype)))
    }

    /// Runs `op` on device memory when the communicator and the tensor allow it (`pieces`: as
    /// in [`FlatComm::run_pieces`]; `upload`: the input's bytes, copied into it from page-locked
    /// host memory on the communication stream first, as
    /// [`FlatComm::all_gather_group_from_host`] promises).
    #[cfg(feature = "cuda")]
    fn run_on_device(
        &mut self,
        op: Collective,
        input: &Tensor<I, 1>,
        pieces: &[usize],
        upload: Option<&[&[u8]]>,
    ) -> Result<Option<Tensor<I, 1>>, CommError> {
        use crate::backend::cuda::{cuda_buffer, from_cube, ordered_output};
        let Some(device) = self.comm.get().device().filter(|_| !self.host_only) else {
            return Ok(None);
        };
        let primitive = input.clone().into_primitive().tensor();
        let Some(src) = cuda_buffer::<I>(&primitive) else {
            return Ok(None);
        };
        let n = self.output_len(op, src.buf.len);
        if self.by_events {
            let fusion = crate::backend::cuda::fusion_client_of(&primitive as &dyn core::any::Any);
            return self
                .run_by_events(op, input, src, n, pieces, fusion)
                .map(Some);
        }
        let ordered = (n > 0 && device.orders_by_flags())
            .then(|| ordered_output(&src, n, self.channel))
            .flatten();
        let (dst, output, fence) = match ordered {
            Some((dst, fence)) => {
                let output = from_cube::<I>(&primitive, dst._keep.clone())
                    .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
                    .expect("a cubecl CUDA tensor converts back to the input's backend");
                (dst, output, Some(fence))
            }
            None => {
                let output = Tensor::<I, 1>::empty([n], (&self.device, input.dtype()));
                let dst = cuda_buffer::<I>(&output.clone().into_primitive().tensor())
                    .expect("a fresh tensor on the same CUDA device has an address");
                I::sync(&self.device)
                    .map_err(|e| CommError::Aborted(format!("the compute stream failed: {e:?}")))?;
                (dst, output, None)
            }
        };
        if let Some(fence) = &fence {
            let (flag, seq) = fence.ready();
            // SAFETY: the flag lives as long as the thread-local flags of cubecl's thread.
            unsafe { device.wait_for_flag(flag, seq)? };
        }
        let uploaded = match upload {
            // SAFETY: the pieces are page-locked and kept by the caller until this collective's
            // ticket is waited for; together they are exactly `src`'s bytes (checked by the
            // caller), which nothing else touches before the collective.
            Some(host) => host.iter().try_fold(src.buf.ptr, |at, piece| unsafe {
                device
                    .copy_from_host(piece.as_ptr(), at, piece.len())
                    .map(|()| at + piece.len() as u64)
            }),
            None => Ok(src.buf.ptr),
        };
        // SAFETY: both buffers are live CUDA allocations of this device, complete when NCCL's
        // stream reaches the call (the flag above, or the sync), and held in `in_flight` until
        // `wait` has ordered burn's stream after NCCL's (or seen NCCL's stream finish).
        let ran = uploaded.and_then(|_| unsafe {
            match op {
                Collective::AllReduce(reduce) => device.all_reduce(src.buf, dst.buf, reduce),
                Collective::ReduceScatter(reduce) => {
                    device.reduce_scatter(src.buf, dst.buf, reduce)
                }
                Collective::AllGather if pieces.len() > 1 => {
                    let world = self.comm.get().world_size();
                    device.all_gather_group(&piece_pairs(src.buf, dst.buf, pieces, world))
                }
                Collective::AllGather => device.all_gather(src.buf, dst.buf),
                Collective::Broadcast(root) => device.broadcast(src.buf, dst.buf, root),
            }
        });
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        match fence {
            Some(fence) => {
                let (flag, seq) = fence.done();
                // Raised even when the call failed: burn's stream may be told to wait for it.
                // SAFETY: as for `ready`.
                if let Err(e) = unsafe { device.raise_flag(flag, seq) } {
                    panic!("after a collective, NCCL's stream could not signal burn's: {e}");
                }
                self.fences.push((ticket, fence));
                self.last_ticket = Some(ticket);
            }
            None => self.host_wait = true,
        }
        // Held even when the call failed: copies enqueued before it may still write them.
        self.in_flight.push((ticket, src));
        self.in_flight.push((ticket, dst));
        ran?;
        self.device_calls += 1;
        if !self.overlap {
            self.wait()?;
        }
        Ok(Some(output))
    }

    /// [`FlatComm::run_on_device`] ordered by CUDA events ([`FlatComm::order_by_events`]): the
    /// communicator's stream waits for an event recorded on burn's stream after the work that
    /// wrote `src`, runs the collective unwatched and records an event that burn's stream waits
    /// for when the output is needed ([`FlatComm::wait_for`]), as a pipeline link's messages do
    /// (`stream_event::between_events`). The host never waits.
    #[cfg(feature = "cuda")]
    fn run_by_events(
        &mut self,
        op: Collective,
        input: &Tensor<I, 1>,
        src: crate::backend::cuda::CudaBuffer,
        n: usize,
        pieces: &[usize],
        fusion: Option<crate::backend::cuda::FusionClient>,
    ) -> Result<Tensor<I, 1>, CommError> {
        use crate::backend::cuda::cuda_buffer;
        use crate::backend::stream_event::{between_events, record_in_order};
        let output = Tensor::<I, 1>::empty([n], (&self.device, input.dtype()));
        let dst = cuda_buffer::<I>(&output.clone().into_primitive().tensor())
            .expect("a fresh tensor on the same CUDA device has an address");
        let cuda = src._keep.device.clone();
        let device = self
            .comm
            .get()
            .device()
            .expect("run_on_device checked for device collectives");
        // The communicator's stream starts after everything queued on burn's stream so far
        // (joining its capture, if it is captured).
        let ready = record_in_order(fusion.clone(), &cuda)
            .map_err(|e| CommError::Aborted(format!("an event on burn's stream: {e}")))?;
        let calls = match op {
            Collective::AllGather if pieces.len() > 1 => {
                let world = self.comm.get().world_size();
                piece_pairs(src.buf, dst.buf, pieces, world)
            }
            _ => vec![(src.buf, dst.buf)],
        };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        // Held even when the call fails: work enqueued before it may still use them.
        self.in_flight.push((ticket, src));
        self.in_flight.push((ticket, dst));
        // SAFETY: both buffers are live allocations of this device, complete once `ready` is
        // reached, and held in `in_flight` until burn's stream has been told to wait for the
        // returned event.
        let done = unsafe {
            between_events(device, ready, "collective", || {
                calls
                    .into_iter()
                    .try_for_each(|(from, into)| device.unwatched(op, from, into))
            })
        };
        match done {
            Ok(done) => self.events.push((ticket, done, fusion, cuda)),
            Err(e) => {
                // Nothing orders burn's stream after this call: `wait` blocks until the
                // communicator's stream is done before the buffers go.
                self.host_wait = true;
                return Err(e);
            }
        }
        self.last_ticket = Some(ticket);
        self.device_calls += 1;
        if !self.overlap {
            self.wait()?;
        }
        Ok(output)
    }
}

/// Events still pending when the communicator goes are let go (CUDA defers their release while
/// a stream still waits for them).
#[cfg(feature = "cuda")]
impl<I: Backend, C: CommRef> Drop for FlatComm<I, C> {
    fn drop(&mut self) {
        for (_, ev, ..) in self.events.drain(..) {
            crate::backend::stream_event::drop_event(ev);
        }
    }
}

/// A rank-major all-gather output (`world` rows of every piece end to end) rearranged piece by
/// piece: for each piece, every rank's copy in rank order.
fn by_piece(rank_major: &[f32], pieces: &[usize], world: usize) -> Vec<f32> {
    let row = rank_major.len() / world;
    let mut out = Vec::with_capacity(rank_major.len());
    let mut at = 0;
    for &len in pieces {
        for rank in 0..world {
            let start = rank * row + at;
            out.extend_from_slice(&rank_major[start..start + len]);
        }
        at += len;
    }
    out
}

/// The input and output buffers of each piece's all-gather within one input and one output
/// (laid out as [`FlatComm::all_gather_group`] says); empty pieces are left out.
#[cfg(feature = "cuda")]
fn piece_pairs(
    input: crate::comm::DeviceBuf,
    output: crate::comm::DeviceBuf,
    pieces: &[usize],
    world: usize,
) -> Vec<(crate::comm::DeviceBuf, crate::comm::DeviceBuf)> {
    use crate::comm::DeviceBuf;
    let size = input.dtype.size() as u64;
    let mut pairs = Vec::with_capacity(pieces.len());
    let mut at = 0u64;
    for &len in pieces.iter() {
        if len > 0 {
            let part = |buf: DeviceBuf, offset: u64, len: usize| DeviceBuf {
                ptr: buf.ptr + offset * size,
                len,
                dtype: buf.dtype,
            };
            pairs.push((
                part(input, at, len),
                part(output, at * world as u64, len * world),
            ));
        }
        at += len as u64;
    }
    pairs
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};

    use super::*;
    use crate::testing::run_ranks;

    /// Three ranks gather pieces of 2, 0, 3 and 1 elements as one group: the output equals the
    /// four all-gathers of the pieces, end to end.
    #[test]
    fn a_grouped_all_gather_equals_the_gathers_of_its_pieces() {
        let pieces = [2usize, 0, 3, 1];
        let results = run_ranks(3, |ctx| {
            let rank = ctx.rank as f32;
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let mut flat = FlatComm::<NdArray>::new(comm, Default::default(), false, false);
            let mine: Vec<f32> = (0..6).map(|i| 10.0 * rank + i as f32).collect();
            let t =
                Tensor::<NdArray, 1>::from_data(TensorData::new(mine, [6]), &Default::default());
            let grouped = flat.all_gather_group(t.clone(), &pieces).unwrap();
            let mut separate = Vec::new();
            let mut at = 0;
            for &len in &pieces {
                if len > 0 {
                    let piece = t.clone().slice(at..at + len);
                    separate.push(flat.all_gather(piece).unwrap());
                }
                at += len;
            }
            let values = |t: Tensor<NdArray, 1>| t.into_data().to_vec::<f32>().unwrap();
            (values(grouped), values(Tensor::cat(separate, 0)))
        });
        for (grouped, separate) in results {
            assert_eq!(grouped.len(), 18);
            assert_eq!(grouped, separate);
            assert_eq!(&grouped[..6], &[0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        }
    }
}
