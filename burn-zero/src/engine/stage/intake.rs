//! The two ways gradients come in, which the strategies compose:
//! - [`Accumulated`] (stages 0 and 1): full gradients add into one flat buffer, all-reduced in
//!   buckets at the end of the accumulation boundary's backward;
//! - [`Scattered`] (stages 2 and 3): buckets of final gradients reduce-scatter straight into
//!   this rank's partition as they arrive; with `overlap_comm` on a device communicator the
//!   collectives run on NCCL's stream while backward goes on, and their results are added in
//!   when backward ends (or when a later bucket needs the room).

use burn::tensor::Tensor;
use burn_backend::Backend;

#[cfg(feature = "zero2")]
use super::super::collective::Ticket;
use super::super::grads::GradCore;
use crate::comm::ReduceOp;
#[cfg(feature = "zero2")]
use crate::partition::{PartitionPlan, Piece, ScatterLayout, ShardPlan, spans};

/// Stages 0 and 1: the full gradient accumulates locally and is all-reduced once per window.
pub(crate) struct Accumulated;

impl Accumulated {
    /// Adds parameter `slot`'s gradient at its offset in the full flat buffer.
    pub(crate) fn accept<I: Backend>(core: &mut GradCore<I>, slot: usize, grad: Tensor<I, 1>) {
        let offset = core.layout().slots()[slot].offset;
        let n = grad.dims()[0];
        core.add_arrived(offset..offset + n, grad);
    }

    /// At the accumulation boundary, all-reduces the buffer (averaged) in buckets.
    pub(crate) fn end_backward<I: Backend>(core: &mut GradCore<I>) {
        if !core.boundary || core.skip_reduce || core.failure.is_some() {
            return;
        }
        let start = std::time::Instant::now();
        let (flat, bucket) = (&mut core.flat, core.bucket_size);
        let reduced = core.buffer.try_map(|piece| {
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
            core.failure = Some(e);
        }
        core.comm_time += start.elapsed();
    }

    /// Bytes of communication buffers at their peak: one bucket.
    pub(crate) fn comm_buffer_bytes<I: Backend>(core: &GradCore<I>) -> usize {
        4 * core.bucket_size.min(core.layout().numel())
    }
}

#[cfg(feature = "zero2")]
/// How a bucket's gradients are cut into every rank's part.
#[derive(Clone, Copy)]
pub(crate) enum ScatterPlan<'a> {
    /// Chunks of the flat buffer (stage 2).
    Flat(&'a PartitionPlan),
    /// Each parameter's own chunks (stage 3).
    Sharded(&'a ShardPlan),
}

#[cfg(feature = "zero2")]
/// A reduce-scatter whose result is added into the partition once it has arrived.
struct Pending<I: Backend> {
    received: Tensor<I, 1>,
    pieces: Vec<Piece>,
    /// Its collective's ticket (`None`: ordered only by a full wait).
    ticket: Option<Ticket>,
}

#[cfg(feature = "zero2")]
/// Reduce-scatters in flight before the older ones are waited for and added in (DeepSpeed
/// double-buffers its buckets the same way).
const MAX_PENDING_BUCKETS: usize = 2;

#[cfg(feature = "zero2")]
/// Stages 2 and 3: buckets of gradients reduce-scattered into this rank's partition.
pub(crate) struct Scattered<I: Backend> {
    /// Gradients waiting for a reduce-scatter: (slot, flattened gradient).
    bucket: Vec<(usize, Tensor<I, 1>)>,
    bucket_elems: usize,
    pending: Vec<Pending<I>>,
}

#[cfg(feature = "zero2")]
impl<I: Backend> Scattered<I> {
    pub(crate) fn new() -> Self {
        Self {
            bucket: Vec::new(),
            bucket_elems: 0,
            pending: Vec::new(),
        }
    }

    /// Reduce-scatters in flight at most.
    fn in_flight(core: &GradCore<I>) -> usize {
        match core.host {
            Some(_) => 1,
            None => MAX_PENDING_BUCKETS,
        }
    }

    /// Bytes of communication buffers at their peak: the bucket being filled and the
    /// send/receive copies of the buckets in flight.
    pub(crate) fn comm_buffer_bytes(core: &GradCore<I>) -> usize {
        let numel = core.layout().numel();
        let bucket = core.bucket_size.min(numel);
        let in_flight = Self::in_flight(core).min(numel.div_ceil(bucket));
        4 * bucket * (1 + 2 * in_flight)
    }

    /// Queues parameter `slot`'s gradient; a full bucket goes out.
    pub(crate) fn accept(
        &mut self,
        core: &mut GradCore<I>,
        slot: usize,
        grad: Tensor<I, 1>,
        plan: ScatterPlan<'_>,
    ) {
        self.bucket_elems += grad.dims()[0];
        self.bucket.push((slot, grad));
        if self.bucket_elems >= core.bucket_size {
            self.flush(core, plan);
        }
    }

    /// Sends what is left, adds in every result and ends the host copies of the pass.
    pub(crate) fn end_backward(&mut self, core: &mut GradCore<I>, plan: ScatterPlan<'_>) {
        self.flush(core, plan);
        self.settle(core, 0);
        if let Some(host) = core.host.as_mut()
            && let Err(e) = host.end_pass(core.boundary)
        {
            core.host_failure = Some(e);
        }
    }

    /// Reduce-scatters the bucket: one send buffer laid out rank-major by [`ScatterLayout`].
    fn flush(&mut self, core: &mut GradCore<I>, plan: ScatterPlan<'_>) {
        let items = std::mem::take(&mut self.bucket);
        self.bucket_elems = 0;
        if items.is_empty() || core.failure.is_some() {
            return;
        }
        // Each bucket in flight holds its send and receive buffers until it is settled: with
        // no bound, a large model's whole gradient would sit there twice by the end of
        // backward. The earlier buckets have had this bucket's backward to finish.
        let in_flight = Self::in_flight(core);
        if self.pending.len() >= in_flight {
            self.settle(core, in_flight - 1);
        }
        let layout = match plan {
            ScatterPlan::Sharded(shards) => {
                let slots: Vec<usize> = items.iter().map(|(slot, _)| *slot).collect();
                ScatterLayout::sharded(shards, &slots)
            }
            ScatterPlan::Flat(plan) => {
                let spans: Vec<_> = items
                    .iter()
                    .map(|(slot, t)| (core.layout().slots()[*slot].offset, t.dims()[0]))
                    .collect();
                ScatterLayout::new(plan, &spans)
            }
        };
        if layout.longest == 0 {
            return;
        }
        // One rank reduces nothing: each gradient goes straight into the partition, without
        // the send buffer's copy.
        if core.flat.comm().world_size() == 1 && core.host.is_none() {
            for piece in &layout.per_rank[0] {
                let part = items[piece.item].1.clone().slice(piece.range.clone());
                core.add_arrived(piece.dst..piece.dst + piece.range.len(), part);
            }
            return;
        }
        let device = core.flat.device().clone();
        // Sent in the accumulation format.
        let items: Vec<Tensor<I, 1>> = items
            .into_iter()
            .map(|(_, grad)| core.arrived_in_accum(grad))
            .collect();
        let mut parts = Vec::new();
        for pieces in &layout.per_rank {
            let mut filled = 0;
            for piece in pieces {
                parts.push(items[piece.item].clone().slice(piece.range.clone()));
                filled += piece.range.len();
            }
            if filled < layout.longest {
                let padding = [layout.longest - filled];
                parts.push(Tensor::zeros(padding, (&device, core.accum().storage())));
            }
        }
        let send = Tensor::cat(parts, 0);
        let start = std::time::Instant::now();
        let reduced = core.flat.reduce_scatter(send, ReduceOp::Avg);
        core.comm_time += start.elapsed();
        match reduced {
            Ok(received) => {
                let rank = core.flat.comm().rank();
                self.pending.push(Pending {
                    received,
                    pieces: layout.per_rank[rank].clone(),
                    ticket: core.flat.last_ticket(),
                });
            }
            Err(e) => core.failure = Some(e),
        }
    }

    /// Adds the results of the reduce-scatters in flight into the partition, all but the
    /// newest `keep`. Burn's stream waits for those reduce-scatters only, not for the newer
    /// ones nor for the gathers prefetched after them.
    fn settle(&mut self, core: &mut GradCore<I>, keep: usize) {
        let due = self.pending.len().saturating_sub(keep);
        if due == 0 {
            return;
        }
        let start = std::time::Instant::now();
        let tickets: Option<Vec<Ticket>> = self.pending[..due].iter().map(|p| p.ticket).collect();
        let last = tickets.and_then(|t| t.into_iter().max());
        if let Err(e) = core.flat.wait_for(last) {
            core.failure.get_or_insert(e);
        }
        core.comm_time += start.elapsed();
        for Pending {
            received, pieces, ..
        } in self.pending.drain(..due)
        {
            if let Some(host) = core.host.as_mut() {
                host.push(received, spans(&pieces), core.boundary);
                continue;
            }
            for (at, dst) in spans(&pieces) {
                let part = received.clone().slice(at..at + dst.len());
                core.add(dst, part);
            }
        }
    }
}
