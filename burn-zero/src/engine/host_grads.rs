//! ZeRO-Offload's gradient path at stages 2 and 3: each reduced bucket goes down into this
//! rank's host partition ([`HostGrads`]) as soon as it has arrived, while backward goes on, so
//! the device never holds the fp32 gradient partition. On CUDA a copy thread moves it through
//! page-locked staging buffers on side streams ([`super::host_grads_cuda`]); elsewhere it goes
//! through burn's `into_data` on the calling thread.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_offload::{
    AheadError, AheadReport, GradDtype, GradScale, HostGrads, HostOptimizer, SharedSink, StepAhead,
};

/// Where a received bucket's elements go: (offset in the bucket, range in the partition).
pub(crate) type Span = (usize, Range<usize>);

/// Adds the time since `start` to `busy`.
pub(crate) fn add_busy(busy: &AtomicU64, start: Instant) {
    let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    busy.fetch_add(nanos, Ordering::Relaxed);
}

/// How a rank's host gradient partition is laid out and written.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostGradLayout {
    /// Threads writing buckets into it.
    pub(crate) threads: usize,
    /// Elements per chunk: the offloaded optimizer's sub-group.
    pub(crate) chunk: usize,
    /// The boundary backward's sums of squares are taken on the device, before each bucket
    /// goes down (f32 per piece, summed in f64), where the host would read the whole
    /// partition once more for them; only where the norm decides nothing but overflow (no
    /// clipping) and runs need not repeat it bit for bit. CUDA only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) squares_on_device: bool,
}

/// The host partition and what moves buckets into it.
pub(crate) struct HostGradStream<I: Backend> {
    grads: Arc<Mutex<HostGrads>>,
    /// The boundary backward's sub-groups stepped as they finish, when started.
    ahead: Option<StepAhead>,
    /// What stepping ahead did, once its thread was waited for before the step.
    ahead_report: Option<AheadReport>,
    #[cfg(feature = "cuda")]
    copier: Option<super::host_grads_cuda::Copier>,
    /// The first failure since the last `end_pass`.
    failure: Option<String>,
    /// Nanoseconds spent moving buckets down since the last take.
    busy: Arc<AtomicU64>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    layout: HostGradLayout,
    _backend: PhantomData<I>,
}

impl<I: Backend> HostGradStream<I> {
    /// A partition of `len` elements of `dtype` laid out as `layout` says.
    pub(crate) fn new(len: usize, layout: HostGradLayout, dtype: GradDtype) -> Self {
        let grads = HostGrads::in_chunks_of(len, layout.threads, layout.chunk, dtype);
        Self {
            grads: Arc::new(Mutex::new(grads)),
            ahead: None,
            ahead_report: None,
            #[cfg(feature = "cuda")]
            copier: None,
            failure: None,
            busy: Arc::new(AtomicU64::new(0)),
            layout,
            _backend: PhantomData,
        }
    }

    /// The partition (complete after [`Self::end_pass`]).
    pub(crate) fn grads(&self) -> MutexGuard<'_, HostGrads> {
        self.grads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of host memory held.
    pub(crate) fn bytes(&self) -> usize {
        self.grads().bytes()
    }

    /// Sends `received` (a bucket's reduced elements for this rank) down into `spans`; the
    /// sum of squares is taken when `boundary`.
    pub(crate) fn push(&mut self, received: Tensor<I, 1>, spans: Vec<Span>, boundary: bool) {
        if self.failure.is_some() || spans.is_empty() {
            return;
        }
        #[cfg(feature = "cuda")]
        {
            // A 16-bit partition takes buckets of its dtype as they are (half the bytes down).
            let storage = self.grads().dtype();
            let native = matches!(
                (storage, received.dtype()),
                (GradDtype::Bf16, burn::tensor::DType::BF16)
                    | (GradDtype::F16, burn::tensor::DType::F16)
            );
            let moved = match native {
                true => received.clone(),
                false => received.clone().cast(FloatDType::F32),
            };
            let primitive = moved.clone().into_primitive().tensor();
            if let Some(buf) = crate::backend::cuda::cuda_buffer::<I>(&primitive) {
                // Only a copy straight into the partition (a fresh pass) uses them: an
                // accumulating one's squares are of the sums, taken on the host.
                // Straight into the partition only when the bucket is in its dtype.
                let direct = native || storage == GradDtype::F32;
                let squares =
                    (boundary && direct && self.layout.squares_on_device && self.grads().copies())
                        .then(|| {
                            let wide = received.clone().cast(FloatDType::F32);
                            device_squares(&wide, &spans, self.layout.chunk)
                        })
                        .flatten();
                // The bucket (and its squares) complete before the copy stream reads it.
                if let Err(e) = I::sync(&moved.device()) {
                    self.failure = Some(format!("the compute stream failed: {e:?}"));
                    return;
                }
                // A sum past f32's range (or a non-finite gradient) is taken again on the host,
                // in f64: it decides whether the step overflows.
                let squares = squares.and_then(|(sums, chunks)| {
                    let sums: Vec<f64> = sums.into_data().iter::<f64>().collect();
                    let finite = sums.len() == chunks.len() && sums.iter().all(|s| s.is_finite());
                    finite.then(|| chunks.into_iter().zip(sums).collect())
                });
                let (grads, busy) = (self.grads.clone(), self.busy.clone());
                let copier = self
                    .copier
                    .get_or_insert_with(|| super::host_grads_cuda::Copier::new(grads, busy));
                let src = if native { storage } else { GradDtype::F32 };
                copier.copy(buf, src, spans, boundary, squares);
                return;
            }
        }
        let received = received.cast(FloatDType::F32);
        let start = Instant::now();
        let data: TensorData = received.into_data();
        let done = data
            .as_slice::<f32>()
            .map_err(|e| format!("{e:?}"))
            .and_then(|values| {
                let mut grads = self.grads();
                spans.into_iter().try_for_each(|(at, dst)| {
                    let n = dst.len();
                    grads
                        .write(dst, &values[at..at + n], boundary)
                        .map_err(|e| e.to_string())
                })
            });
        add_busy(&self.busy, start);
        if let Err(e) = done {
            self.failure = Some(e);
        }
    }

    /// Time spent moving buckets down since the last call.
    pub(crate) fn take_busy(&self) -> Duration {
        Duration::from_nanos(self.busy.swap(0, Ordering::Relaxed))
    }

    /// Ends a backward once every bucket is in (see [`HostGrads::end_pass`]).
    pub(crate) fn end_pass(&mut self, boundary: bool) -> Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(copier) = &self.copier
            && let Err(e) = copier.flush()
        {
            self.failure.get_or_insert(e);
        }
        if let Some(e) = self.failure.take() {
            // The pass ends all the same for a watcher (a thread stepping ahead).
            self.grads().unwatch();
            return Err(format!("moving gradients to the host: {e}"));
        }
        self.grads().end_pass(boundary);
        Ok(())
    }

    /// Steps `opt`'s sub-groups as the next boundary backward finishes them (see
    /// [`StepAhead`]), with the values the step after it will be given, their new weights
    /// sent to `sink`.
    pub(crate) fn start_ahead(
        &mut self,
        opt: Arc<Mutex<HostOptimizer>>,
        hp: (f32, (f32, f32), GradScale),
        sink: Option<SharedSink>,
    ) -> Result<(), AheadError> {
        let ahead = StepAhead::start(self.grads.clone(), opt, hp, sink)?;
        self.ahead = Some(ahead);
        Ok(())
    }

    /// Waits for the sub-groups stepped ahead (after the backward ended: every chunk is back
    /// in the partition then); the report is kept for [`Self::finish_ahead`].
    pub(crate) fn settle_ahead(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            self.ahead_report = Some(ahead.finish());
        }
    }

    /// What stepping ahead did in the backward that ended (`None` if it was not started).
    pub(crate) fn finish_ahead(&mut self) -> Option<AheadReport> {
        self.settle_ahead();
        self.ahead_report.take()
    }

    /// Stops stepping ahead of a backward that failed: the thread ends once it has stepped
    /// what it was told of.
    pub(crate) fn cancel_ahead(&mut self) {
        // Dropping it stops the watching and waits for the thread.
        drop(self.ahead.take());
        self.ahead_report = None;
    }

    /// Starts a new accumulation window.
    pub(crate) fn clear(&mut self) {
        self.grads().clear();
    }

    /// Elements `range` of the partition on `device` (for reading gradients back).
    pub(crate) fn upload(&self, range: Range<usize>, device: &I::Device) -> Tensor<I, 1> {
        let values = self.grads().read(range);
        let n = values.len();
        Tensor::from_data(TensorData::new(values, [n]), device)
    }
}

/// Σ g² of each piece of `spans` (in `received`) that lies within one chunk of `chunk`
/// elements, on the device in f32: the sums, and each one's chunk (`None`: no piece).
#[cfg(feature = "cuda")]
fn device_squares<I: Backend>(
    received: &Tensor<I, 1>,
    spans: &[Span],
    chunk: usize,
) -> Option<(Tensor<I, 1>, Vec<usize>)> {
    let chunk = chunk.max(1);
    let mut sums = Vec::new();
    let mut chunks = Vec::new();
    for (at, dst) in spans {
        for r in super::host_grads_cuda::split_at_multiples(dst.clone(), chunk) {
            let from = at + (r.start - dst.start);
            let piece = received.clone().slice(from..from + r.len());
            sums.push(piece.clone().mul(piece).sum());
            chunks.push(r.start / chunk);
        }
    }
    (!sums.is_empty()).then(|| (Tensor::cat(sums, 0), chunks))
}
