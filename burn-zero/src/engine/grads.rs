//! Gradient collection during backward, per ZeRO stage.
//!
//! Stages 0 and 1 accumulate full gradients locally and all-reduce them, bucketed, at the end
//! of the accumulation boundary's backward. Stage 2 reduce-scatters buckets of final gradients
//! straight into this rank's partition as they arrive, on a background thread when
//! `overlap_comm` is on, so communication runs while backward continues.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, TensorMetadata, try_read_sync};

use super::params::FlatLayout;
use crate::ZeroTensor;
use crate::backend::hooks::GradientHook;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::partition::{BucketItem, PartitionPlan, reduce_scatter_bucket};

/// What the hook accumulates into, shared with the engine. Free of burn types.
pub(crate) struct GradState {
    layout: Arc<FlatLayout>,
    offsets: HashMap<DistributedParamId, usize>,
    plan: PartitionPlan,
    comm: Arc<dyn Communicator>,
    stage: u8,
    bucket_size: usize,
    /// Stage 0/1: the full flat gradient. Stage 2: this rank's chunk.
    pub(crate) buffer: Vec<f32>,
    bucket: Vec<BucketItem>,
    bucket_elems: usize,
    worker: Option<ReduceWorker>,
    /// Whether the running backward ends an accumulation window (stage 0/1 reduce then).
    pub(crate) boundary: bool,
    /// The first communication failure; the engine reports it after backward.
    pub(crate) failure: Option<CommError>,
    /// Parameters reported final during the running backward.
    pub(crate) seen: usize,
}

impl GradState {
    pub(crate) fn new(
        layout: Arc<FlatLayout>,
        plan: PartitionPlan,
        comm: Arc<dyn Communicator>,
        stage: u8,
        bucket_size: usize,
        overlap: bool,
    ) -> Self {
        let len = if stage >= 2 {
            plan.chunk()
        } else {
            layout.numel()
        };
        let worker = (stage >= 2 && overlap).then(|| ReduceWorker::spawn(comm.clone(), plan));
        let offsets = layout
            .slots()
            .iter()
            .map(|s| (DistributedParamId::from(s.id.val()), s.offset))
            .collect();
        Self {
            layout,
            offsets,
            plan,
            comm,
            stage,
            bucket_size: bucket_size.max(1),
            buffer: vec![0.0; len],
            bucket: Vec::new(),
            bucket_elems: 0,
            worker,
            boundary: true,
            failure: None,
            seen: 0,
        }
    }

    /// Bytes of gradient storage held.
    pub(crate) fn gradient_bytes(&self) -> usize {
        4 * self.buffer.capacity()
    }

    /// Bytes of communication buffers at their peak: one bucket, and its send/receive copies.
    pub(crate) fn comm_buffer_bytes(&self) -> usize {
        let bucket = self.bucket_size.min(self.layout.numel());
        if self.stage >= 2 {
            4 * 2 * bucket
        } else {
            4 * bucket
        }
    }

    fn accept(&mut self, id: DistributedParamId, values: Vec<f32>) {
        let Some(&offset) = self.offsets.get(&id) else {
            return;
        };
        self.seen += 1;
        if self.stage < 2 {
            for (acc, v) in self.buffer[offset..offset + values.len()]
                .iter_mut()
                .zip(&values)
            {
                *acc += v;
            }
            return;
        }
        self.bucket_elems += values.len();
        self.bucket.push(BucketItem { offset, values });
        if self.bucket_elems >= self.bucket_size {
            self.flush();
        }
    }

    fn flush(&mut self) {
        let items = std::mem::take(&mut self.bucket);
        self.bucket_elems = 0;
        if items.is_empty() || self.failure.is_some() {
            return;
        }
        match &self.worker {
            Some(worker) => worker.submit(items),
            None => {
                if let Err(e) = reduce_scatter_bucket(
                    self.comm.as_ref(),
                    &self.plan,
                    &items,
                    ReduceOp::Avg,
                    &mut self.buffer,
                ) {
                    self.failure = Some(e);
                }
            }
        }
    }

    fn finish_backward(&mut self) {
        if self.stage >= 2 {
            self.flush();
            if let Some(worker) = &self.worker {
                match worker.finish() {
                    Ok(reduced) => self
                        .buffer
                        .iter_mut()
                        .zip(&reduced)
                        .for_each(|(a, r)| *a += r),
                    Err(e) => {
                        self.failure.get_or_insert(e);
                    }
                }
            }
        } else if self.boundary && self.failure.is_none() {
            for piece in self.buffer.chunks_mut(self.bucket_size) {
                if let Err(e) = self.comm.all_reduce(piece.into(), ReduceOp::Avg) {
                    self.failure = Some(e);
                    break;
                }
            }
        }
    }

    /// Zeroes the gradients after an optimizer step.
    pub(crate) fn clear(&mut self) {
        self.buffer.iter_mut().for_each(|v| *v = 0.0);
    }
}

/// The `GradientHook` of the engine: reads each final gradient and hands it to [`GradState`].
pub(crate) struct EngineHook<I: Backend> {
    pub(crate) state: Arc<Mutex<GradState>>,
    pub(crate) _inner: core::marker::PhantomData<fn() -> I>,
}

impl<I: Backend> GradientHook<I> for EngineHook<I> {
    fn on_backward_start(&mut self, _params: &[DistributedParamId]) {
        self.state.lock().expect("gradient state").seen = 0;
    }

    fn on_gradient_final(&mut self, param: DistributedParamId, grad: &mut ZeroTensor<I>) {
        let tensor = grad.inner().clone();
        let data = try_read_sync(I::float_into_data(tensor))
            .expect("a backend that can read synchronously")
            .expect("read a gradient");
        let values = data
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 gradient");
        let mut state = self.state.lock().expect("gradient state");
        state.accept(param, values);
        if state.stage >= 2 {
            // The full gradient is not needed any more: its partition is being reduced. One
            // element, not zero: CUDA backends cannot launch kernels over empty tensors.
            let device = I::float_device(grad.inner());
            let dtype = grad.dtype().into();
            *grad.inner_mut() = I::float_zeros([1].into(), &device, dtype);
        }
    }

    fn on_backward_end(&mut self) {
        self.state.lock().expect("gradient state").finish_backward();
    }
}

enum Job {
    Bucket(Vec<BucketItem>),
    Finish(Sender<Result<Vec<f32>, CommError>>),
}

/// A thread that reduce-scatters buckets while backward goes on (`overlap_comm`).
struct ReduceWorker {
    jobs: Sender<Job>,
}

impl ReduceWorker {
    fn spawn(comm: Arc<dyn Communicator>, plan: PartitionPlan) -> Self {
        let (jobs, inbox) = channel();
        std::thread::Builder::new()
            .name(format!("burn-zero-reduce-{}", comm.rank()))
            .spawn(move || Self::run(comm, plan, inbox))
            .expect("spawn the gradient reduction thread");
        Self { jobs }
    }

    fn run(comm: Arc<dyn Communicator>, plan: PartitionPlan, inbox: Receiver<Job>) {
        let mut reduced = vec![0.0f32; plan.chunk()];
        let mut failure = None;
        for job in inbox {
            match job {
                Job::Bucket(items) if failure.is_none() => {
                    if let Err(e) = reduce_scatter_bucket(
                        comm.as_ref(),
                        &plan,
                        &items,
                        ReduceOp::Avg,
                        &mut reduced,
                    ) {
                        failure = Some(e);
                    }
                }
                Job::Bucket(_) => {}
                Job::Finish(reply) => {
                    let result = match failure.take() {
                        Some(e) => Err(e),
                        None => Ok(std::mem::replace(&mut reduced, vec![0.0; plan.chunk()])),
                    };
                    let _ = reply.send(result);
                }
            }
        }
    }

    fn submit(&self, items: Vec<BucketItem>) {
        self.jobs
            .send(Job::Bucket(items))
            .expect("the reduction thread is alive");
    }

    fn finish(&self) -> Result<Vec<f32>, CommError> {
        let (reply, answer) = channel();
        self.jobs
            .send(Job::Finish(reply))
            .expect("the reduction thread is alive");
        answer.recv().expect("the reduction thread answers")
    }
}
