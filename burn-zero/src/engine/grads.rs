//! Gradient collection during backward, per ZeRO stage, into flat buffers on the device.
//!
//! Stages 0 and 1 accumulate full gradients into one flat buffer and all-reduce it, in
//! buckets, at the end of the accumulation boundary's backward. Stage 2 reduce-scatters
//! buckets of final gradients straight into this rank's partition as they arrive; with
//! `overlap_comm` on a device communicator the collectives run on NCCL's stream while backward
//! goes on, and their results are added in when backward ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, TensorMetadata};

use super::collective::FlatComm;
use super::grad_buffer::GradBuffer;
use super::host_grads::{HostGradStream, spans};
use super::params::FlatLayout;
use super::precision::Format;
use super::stage3::Stage3;
use crate::ZeroTensor;
use crate::backend::hooks::GradientHook;
use crate::comm::{CommError, ReduceOp};
use crate::partition::{PartitionPlan, Piece, ScatterLayout};

/// A reduce-scatter whose result is added into the partition once it has arrived.
struct Pending<I: Backend> {
    received: Tensor<I, 1>,
    pieces: Vec<Piece>,
}

/// What the hook accumulates into, shared with the engine.
pub(crate) struct GradState<I: Backend> {
    layout: Arc<FlatLayout>,
    /// Index in `layout` of each parameter.
    slots: HashMap<DistributedParamId, usize>,
    plan: PartitionPlan,
    pub(crate) flat: FlatComm<I>,
    stage: u8,
    bucket_size: usize,
    /// Stage 0/1: the full flat gradient. Stage 2: this rank's chunk. Stage 3: this rank's
    /// partition of the [`ShardPlan`](crate::partition::ShardPlan). In pieces (see
    /// [`GradBuffer`]).
    pub(crate) buffer: GradBuffer<I>,
    /// ZeRO-Offload at stage 2 and up: the partition lives in host memory instead of
    /// `buffer` (empty then), each bucket sent down as it arrives.
    pub(crate) host: Option<HostGradStream<I>>,
    /// Gradients waiting for a reduce-scatter: (slot, flattened gradient).
    bucket: Vec<(usize, Tensor<I, 1>)>,
    bucket_elems: usize,
    pending: Vec<Pending<I>>,
    /// Whether the running backward ends an accumulation window (stage 0/1 reduce then).
    pub(crate) boundary: bool,
    /// 1-bit Adam past its warm-up: gradients stay local (the momentum is exchanged instead).
    pub(crate) skip_reduce: bool,
    /// The first communication failure; the engine reports it after backward.
    pub(crate) failure: Option<CommError>,
    /// A failure moving gradients to the host; reported likewise.
    pub(crate) host_failure: Option<String>,
    /// Host time in collectives and their waits since the engine last took it.
    pub(crate) comm_time: std::time::Duration,
    /// Parameters reported final during the running backward.
    pub(crate) seen: usize,
    /// Stage 3: the sharded parameters and their gathers.
    pub(crate) stage3: Option<Stage3<I>>,
    /// The format gradients arrive in (emulated bf16/fp16 rounds them).
    compute: Format,
    /// The format they accumulate and travel in.
    accum: Format,
}

/// Reduce-scatters in flight before the older ones are waited for and added in (DeepSpeed
/// double-buffers its buckets the same way).
const MAX_PENDING_BUCKETS: usize = 2;

/// With gradients streaming to host memory, buckets hold at most this many elements and each
/// goes down as soon as the next is reduced: a bucket the size of the model would reach the
/// host only after backward, with nothing left to overlap its copy.
const HOST_BUCKET: usize = 1 << 27;

impl<I: Backend> GradState<I> {
    pub(crate) fn new(
        layout: Arc<FlatLayout>,
        plan: PartitionPlan,
        flat: FlatComm<I>,
        stage: u8,
        bucket_size: usize,
        stage3: Option<Stage3<I>>,
        (compute, accum): (Format, Format),
        max_piece: usize,
        host_threads: Option<usize>,
    ) -> Self {
        let len = match &stage3 {
            Some(s3) => s3.plan().len(),
            None if stage >= 2 => plan.chunk(),
            None => layout.numel(),
        };
        let host = host_threads
            .filter(|_| stage >= 2)
            .map(|threads| HostGradStream::new(len, threads));
        let device_len = if host.is_some() { 0 } else { len };
        let bucket_size = match host {
            Some(_) => bucket_size.min(HOST_BUCKET),
            None => bucket_size,
        };
        let slots = layout
            .slots()
            .iter()
            .enumerate()
            .map(|(i, s)| (DistributedParamId::from(s.id.val()), i))
            .collect();
        let buffer = GradBuffer::zeros(device_len, max_piece, flat.device(), accum.storage());
        Self {
            layout,
            slots,
            plan,
            flat,
            stage,
            bucket_size: bucket_size.max(1),
            buffer,
            host,
            bucket: Vec::new(),
            bucket_elems: 0,
            pending: Vec::new(),
            boundary: true,
            skip_reduce: false,
            failure: None,
            host_failure: None,
            comm_time: std::time::Duration::ZERO,
            seen: 0,
            stage3,
            compute,
            accum,
        }
    }

    /// Bytes of gradient storage held.
    pub(crate) fn gradient_bytes(&self) -> usize {
        self.accum.storage().size() * self.buffer.len()
    }

    /// Bytes of gradient storage in host memory (ZeRO-Offload at stage 2 and up).
    pub(crate) fn host_gradient_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.bytes())
    }

    /// This rank's accumulated gradient partition, as stored, on the device.
    pub(crate) fn partition(&self) -> Tensor<I, 1> {
        match &self.host {
            Some(host) => host.upload(0..host.grads().len(), self.flat.device()),
            None => self.buffer.slice(0..self.buffer.len()),
        }
    }

    /// Reduce-scatters in flight at most.
    fn in_flight(&self) -> usize {
        match self.host {
            Some(_) => 1,
            None => MAX_PENDING_BUCKETS,
        }
    }

    /// Bytes of communication buffers at their peak: the bucket being filled and, at stage 2
    /// and up, the send/receive copies of the buckets in flight.
    pub(crate) fn comm_buffer_bytes(&self) -> usize {
        let bucket = self.bucket_size.min(self.layout.numel());
        if self.stage >= 2 {
            let in_flight = self.in_flight().min(self.layout.numel().div_ceil(bucket));
            4 * bucket * (1 + 2 * in_flight)
        } else {
            4 * bucket
        }
    }

    fn accept(&mut self, id: DistributedParamId, grad: Tensor<I, 1>) {
        let Some(&slot) = self.slots.get(&id) else {
            return;
        };
        self.seen += 1;
        let grad = self.accum.convert(self.compute.settle(grad));
        let n = grad.dims()[0];
        if self.stage < 2 {
            let offset = self.layout.slots()[slot].offset;
            let accum = self.accum;
            self.buffer
                .add(offset..offset + n, grad, |t| accum.settle::<I>(t));
            return;
        }
        self.bucket_elems += n;
        self.bucket.push((slot, grad));
        if self.bucket_elems >= self.bucket_size {
            self.flush();
        }
    }

    /// Reduce-scatters the bucket: one send buffer laid out rank-major by [`ScatterLayout`].
    fn flush(&mut self) {
        let items = std::mem::take(&mut self.bucket);
        self.bucket_elems = 0;
        if items.is_empty() || self.failure.is_some() {
            return;
        }
        // Each bucket in flight holds its send and receive buffers until it is settled: with
        // no bound, a large model's whole gradient would sit there twice by the end of
        // backward. The earlier buckets have had this bucket's backward to finish.
        if self.pending.len() >= self.in_flight() {
            self.settle();
        }
        let layout = match &self.stage3 {
            Some(s3) => {
                let slots: Vec<usize> = items.iter().map(|(slot, _)| *slot).collect();
                ScatterLayout::sharded(s3.plan(), &slots)
            }
            None => {
                let spans: Vec<_> = items
                    .iter()
                    .map(|(slot, t)| (self.layout.slots()[*slot].offset, t.dims()[0]))
                    .collect();
                ScatterLayout::new(&self.plan, &spans)
            }
        };
        if layout.longest == 0 {
            return;
        }
        let device = self.flat.device().clone();
        let mut parts = Vec::new();
        for pieces in &layout.per_rank {
            let mut filled = 0;
            for piece in pieces {
                parts.push(items[piece.item].1.clone().slice(piece.range.clone()));
                filled += piece.range.len();
            }
            if filled < layout.longest {
                let padding = [layout.longest - filled];
                parts.push(Tensor::zeros(padding, (&device, self.accum.storage())));
            }
        }
        let send = Tensor::cat(parts, 0);
        let start = std::time::Instant::now();
        let reduced = self.flat.reduce_scatter(send, ReduceOp::Avg);
        self.comm_time += start.elapsed();
        match reduced {
            Ok(received) => {
                let rank = self.flat.comm().rank();
                self.pending.push(Pending {
                    received,
                    pieces: layout.per_rank[rank].clone(),
                });
            }
            Err(e) => self.failure = Some(e),
        }
    }

    /// Adds every arrived reduce-scatter result into the partition.
    fn settle(&mut self) {
        let start = std::time::Instant::now();
        if let Err(e) = self.flat.wait() {
            self.failure.get_or_insert(e);
        }
        self.comm_time += start.elapsed();
        for Pending { received, pieces } in std::mem::take(&mut self.pending) {
            if let Some(host) = self.host.as_mut() {
                host.push(received, spans(&pieces), self.boundary);
                continue;
            }
            let mut at = 0;
            for piece in pieces {
                let len = piece.range.len();
                let accum = self.accum;
                let part = received.clone().slice(at..at + len);
                self.buffer
                    .add(piece.dst..piece.dst + len, part, |t| accum.settle::<I>(t));
                at += len;
            }
        }
    }

    fn finish_backward(&mut self) {
        if self.stage >= 2 {
            self.flush();
            self.settle();
            if let Some(host) = self.host.as_mut()
                && let Err(e) = host.end_pass(self.boundary)
            {
                self.host_failure = Some(e);
            }
        } else if self.boundary && !self.skip_reduce && self.failure.is_none() {
            let start = std::time::Instant::now();
            let (flat, bucket) = (&mut self.flat, self.bucket_size);
            let reduced = self.buffer.try_map(|piece| {
                let n = piece.dims()[0];
                let mut parts = Vec::new();
                for start in (0..n).step_by(bucket) {
                    let part = piece.clone().slice(start..(start + bucket).min(n));
                    parts.push(flat.all_reduce(part, ReduceOp::Avg)?);
                }
                flat.wait()?;
                Ok(match parts.len() {
                    0 => piece,
                    1 => parts.pop().expect("one part"),
                    _ => Tensor::cat(parts, 0),
                })
            });
            if let Err(e) = reduced {
                self.failure = Some(e);
            }
            self.comm_time += start.elapsed();
        }
    }

    /// Zeroes the gradients after an optimizer step.
    pub(crate) fn clear(&mut self) {
        self.buffer.clear();
        if let Some(host) = self.host.as_mut() {
            host.clear();
        }
    }
}

/// The `GradientHook` of the engine: hands each final gradient, flattened, to [`GradState`].
pub(crate) struct EngineHook<I: Backend> {
    pub(crate) state: Arc<Mutex<GradState<I>>>,
}

impl<I: Backend> GradientHook<I> for EngineHook<I> {
    fn on_backward_start(&mut self, _params: &[DistributedParamId]) {
        self.state.lock().expect("gradient state").seen = 0;
    }

    fn on_gradient_final(&mut self, param: DistributedParamId, grad: &mut ZeroTensor<I>) {
        let n = grad.shape().num_elements();
        let flat = I::float_reshape(grad.inner().clone(), [n].into());
        let mut state = self.state.lock().expect("gradient state");
        state.accept(param, Tensor::from_primitive(TensorPrimitive::Float(flat)));
        if state.stage >= 2 {
            // The full gradient is not needed any more: its partition is being reduced. One
            // element, not zero: CUDA backends cannot launch kernels over empty tensors.
            let device = I::float_device(grad.inner());
            let dtype = grad.dtype().into();
            *grad.inner_mut() = I::float_zeros([1].into(), &device, dtype);
        }
    }

    fn on_backward_end(&mut self) {
        let mut state = self.state.lock().expect("gradient state");
        state.finish_backward();
        if let Some(s3) = state.stage3.as_mut() {
            s3.end_pass();
        }
    }
}
