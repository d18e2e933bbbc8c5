//! How an offloaded step's sub-groups travel between the device and the host buffers of
//! burn-offload's pipeline. On CUDA (feature `cuda`) they are copied on side streams through
//! pinned buffers kept across steps ([`super::offload_cuda`]); on any other backend through
//! burn's `slice`/`into_data` and `from_data` into ordinary host buffers, also kept.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{
    AheadSink, Download, GradBuf, GradScale, HostGrads, HostOptimizer, OutDtype, OutSlot,
    OwnedBuffers, SharedSink, StepBuffers, StreamTimings, Weights,
};

use super::EngineError;
use super::grad_buffer::{overlaps, piece_ranges};
use super::precision::Format;

/// Host buffers an offloaded optimizer reuses across steps (made at its first step).
#[derive(Default)]
pub(crate) enum StepRing {
    /// None yet.
    #[default]
    Unset,
    /// Ordinary host memory.
    Owned(OwnedBuffers),
    /// Page-locked memory and the copy streams.
    #[cfg(feature = "cuda")]
    Pinned(super::offload_cuda::PinnedRing),
}

/// Buffers of each kind: two let download, step and upload overlap; a third absorbs jitter.
pub(crate) const RING_DEPTH: usize = 3;

/// The dtype the new weights go up in.
pub(crate) fn out_dtype(compute: Format) -> OutDtype {
    match compute.dtype {
        FloatDType::BF16 => OutDtype::Bf16,
        FloatDType::F16 => OutDtype::F16,
        _ => OutDtype::F32,
    }
}

/// Where an offloaded step reads this rank's fp32 gradient partition.
pub(crate) enum GradSource<'a, I: Backend> {
    /// On the device, in consecutive pieces, unscaled (and clipped by the time it is read).
    Device(Vec<Tensor<I, 1>>),
    /// In host memory: CPU-Adam reads each sub-group where it lies, multiplied by `scale`
    /// (inverse loss scale, clipping factor) as it goes.
    Host {
        grads: &'a mut HostGrads,
        scale: GradScale,
    },
}

impl<'a, I: Backend> GradSource<'a, I> {
    /// The device pieces (none when in host memory) and the host partition with its scale.
    #[allow(clippy::type_complexity)]
    pub(crate) fn split(self) -> (Vec<Tensor<I, 1>>, Option<(&'a mut HostGrads, GradScale)>) {
        match self {
            GradSource::Device(grad) => (grad, None),
            GradSource::Host { grads, scale } => (Vec::new(), Some((grads, scale))),
        }
    }
}

/// With the gradient in host memory (`host`), `lent`'s gradient buffers become the
/// partition's own chunks, in order (nothing to copy: a chunk is a sub-group; those of
/// sub-groups whose weights went out ahead are left out, as the step leaves them), and the
/// download stage only checks that each arrives where it lies; returns the scale CPU-Adam
/// applies and that stage (`None`, and factors of 1, when the gradient is on the device).
#[allow(clippy::type_complexity)]
pub(crate) fn in_place<'b>(
    host: Option<(&'b mut HostGrads, GradScale)>,
    opt: &HostOptimizer,
    lent: &mut StepBuffers<'b>,
) -> (
    GradScale,
    Option<impl Fn(Range<usize>, GradBuf<'_>) -> Result<(), String> + Sync + use<>>,
) {
    let Some((grads, scale)) = host else {
        return ([1.0, 1.0], None);
    };
    let sub_group = opt.sub_group_len().max(1);
    let aligned = grads.chunk_len() == sub_group || grads.chunk_len() >= opt.len();
    let mut chunks: Vec<Option<GradBuf<'b>>> = grads.chunks_mut().into_iter().map(Some).collect();
    chunks.truncate(opt.sub_groups().len());
    let bases: Vec<usize> = chunks.iter().flatten().map(GradBuf::addr).collect();
    let chunks = opt
        .to_hand_out()
        .into_iter()
        .filter_map(|i| chunks.get_mut(i).and_then(Option::take))
        .collect();
    let check = move |range: Range<usize>, buf: GradBuf<'_>| {
        let at = bases.get(range.start / sub_group);
        if aligned && at == Some(&buf.addr()) {
            Ok(())
        } else {
            Err("the host gradient's chunks are not the optimizer's sub-groups, in order".into())
        }
    };
    lent.grads = chunks;
    (scale, Some(check))
}

/// An offloaded step's new weights (one piece per sub-group) and where its time went.
pub(crate) type Stepped<I> = Result<(Vec<Tensor<I, 1>>, StreamTimings), EngineError>;

/// Where an offloaded step writes its new weights instead of sending them to the device: the
/// host buffer of the parameters (ZeRO-3 with `offload_param {"device": "cpu"}`), laid out as
/// the optimizer's partition, so sub-group `[a, b)` writes its elements `[a, b)` and nothing
/// goes up or comes back down (ZeRO-Infinity's step).
pub(crate) struct DirectOuts {
    ptr: *mut u8,
    len: usize,
    dtype: OutDtype,
}

impl DirectOuts {
    /// `len` elements of `dtype` at `ptr`.
    ///
    /// # Safety
    /// `ptr` is aligned for `dtype` and holds `len` elements that nothing else reads or writes
    /// until the step that takes this is done (for the parameters' host buffer: every read of
    /// it happens under the engine's strategy lock, which the step holds until it publishes).
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize, dtype: OutDtype) -> Self {
        Self { ptr, len, dtype }
    }

    /// One slot per range (ascending, disjoint, inside the buffer), in order.
    fn slots<'a>(&'a mut self, ranges: &[Range<usize>]) -> Result<Vec<OutSlot<'a>>, String> {
        let mut end = 0;
        for r in ranges {
            if r.start < end || r.end > self.len {
                return Err(format!(
                    "sub-group {r:?} outside the {}-element parameter buffer or out of order",
                    self.len
                ));
            }
            end = r.end;
        }
        // SAFETY: the ranges are disjoint and inside the buffer, which `new`'s caller lends
        // to this step alone, aligned for the dtype.
        Ok(ranges
            .iter()
            .map(|r| unsafe {
                match self.dtype {
                    OutDtype::F32 => OutSlot::F32(std::slice::from_raw_parts_mut(
                        self.ptr.cast::<f32>().add(r.start),
                        r.len(),
                    )),
                    OutDtype::Bf16 => OutSlot::Bf16(std::slice::from_raw_parts_mut(
                        self.ptr.cast::<half::bf16>().add(r.start),
                        r.len(),
                    )),
                    OutDtype::F16 => OutSlot::F16(std::slice::from_raw_parts_mut(
                        self.ptr.cast::<half::f16>().add(r.start),
                        r.len(),
                    )),
                }
            })
            .collect())
    }
}

/// One offloaded step whose gradient lies in host memory, writing the new weights into
/// `outs` (every sub-group: none was stepped ahead).
pub(crate) fn step_into(
    opt: &mut HostOptimizer,
    grads: &mut HostGrads,
    scale: GradScale,
    lr: f32,
    betas: (f32, f32),
    mut outs: DirectOuts,
) -> Result<StreamTimings, EngineError> {
    // One slot per sub-group: the step must hand every one out (none was stepped ahead).
    let ranges = opt.sub_groups();
    if opt.to_hand_out().len() != ranges.len() {
        return Err(EngineError::Usage(
            "a step into the parameter buffer after sub-groups were stepped ahead".into(),
        ));
    }
    if opt.len() != outs.len {
        return Err(EngineError::Usage(format!(
            "an optimizer partition of {} elements stepped into a parameter buffer of {}",
            opt.len(),
            outs.len
        )));
    }
    let slots = outs.slots(&ranges).map_err(EngineError::Usage)?;
    let mut lent = StepBuffers {
        grads: Vec::new(),
        outs: slots,
    };
    let (scale, check) = in_place(Some((grads, scale)), opt, &mut lent);
    let check = check.expect("a gradient in host memory");
    // The weights are where they belong once stepped: nothing to send.
    Ok(opt.step(lr, betas, scale, lent, &check, &mut |_, _| Ok(()))?)
}

/// One offloaded step: the gradient of this rank's partition in, the new weights in the
/// compute format out, on `device`, one piece per sub-group; `targets[i]`, where given, is
/// sub-group `i`'s output made before the step (holding its weights if they were sent ahead).
#[allow(clippy::too_many_arguments)]
pub(crate) fn step<I: Backend>(
    opt: &mut HostOptimizer,
    ring: &mut StepRing,
    source: GradSource<'_, I>,
    lr: f32,
    betas: (f32, f32),
    device: &I::Device,
    compute: Format,
    targets: Vec<Option<Tensor<I, 1>>>,
) -> Stepped<I> {
    #[cfg(feature = "cuda")]
    let (source, targets) =
        match super::offload_cuda::step(opt, ring, source, lr, betas, device, compute, targets) {
            Ok(done) => return done,
            Err(not_cuda) => not_cuda,
        };
    let out = out_dtype(compute);
    if !matches!(ring, StepRing::Owned(_)) {
        *ring = StepRing::Owned(OwnedBuffers::new(RING_DEPTH, opt.sub_group_len(), out));
    }
    let StepRing::Owned(buffers) = ring else {
        unreachable!("set above")
    };
    let (grad, host) = source.split();
    let grad: Vec<_> = grad.into_iter().map(|g| g.cast(FloatDType::F32)).collect();
    let ranges = piece_ranges(&grad);
    let from_device = |range: Range<usize>, mut buf: GradBuf<'_>| {
        let buf = buf.f32_mut()?;
        for (i, local, at) in overlaps(ranges.iter().cloned(), &range) {
            let n = local.len();
            let part = grad[i].clone().slice(local).into_data();
            let values = part.as_slice::<f32>().map_err(|e| format!("{e:?}"))?;
            buf[at..at + n].copy_from_slice(values);
        }
        Ok(())
    };
    let mut lent = buffers.lend();
    let (scale, check) = in_place(host, opt, &mut lent);
    let download: &Download<'_> = match &check {
        Some(check) => check,
        None => &from_device,
    };
    let sub_group = opt.sub_group_len().max(1);
    let mut parts = targets;
    parts.resize(opt.sub_groups().len(), None);
    let timings = opt.step(lr, betas, scale, lent, download, &mut |range, weights| {
        parts[range.start / sub_group] = Some(tensor_of(weights_data(weights, compute), device));
        Ok(())
    })?;
    let mut parts: Vec<Tensor<I, 1>> = parts
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| EngineError::Usage("a sub-group's new weights went nowhere".into()))?;
    if parts.is_empty() {
        parts.push(Tensor::zeros([0], (device, compute.storage())));
    }
    Ok((parts, timings))
}

/// A sub-group's weights as the compute format stores them (emulated formats hold the
/// rounded values in f32).
fn weights_data(weights: Weights<'_>, compute: Format) -> TensorData {
    let n = weights.len();
    match weights {
        Weights::Bf16(w) if !compute.emulated => TensorData::new(w.to_vec(), [n]),
        Weights::F16(w) if !compute.emulated => TensorData::new(w.to_vec(), [n]),
        other => TensorData::new(other.to_f32(), [n]),
    }
}

/// `data` on `device`, in its own dtype.
pub(crate) fn tensor_of<I: Backend>(data: TensorData, device: &I::Device) -> Tensor<I, 1> {
    let dtype: DType = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

/// Sub-groups' new weights stepped ahead where no page-locked copy reaches the device: kept
/// in host memory until the step makes them tensors.
pub(crate) struct HostSink {
    slot: OwnedBuffers,
    compute: Format,
    sent: Vec<(usize, TensorData)>,
}

impl HostSink {
    fn new(len: usize, compute: Format) -> Self {
        Self {
            slot: OwnedBuffers::new(1, len, out_dtype(compute)),
            compute,
            sent: Vec::new(),
        }
    }
}

impl AheadSink for HostSink {
    fn slot(&mut self, n: usize) -> Result<OutSlot<'_>, String> {
        let slot = self.slot.lend().outs.swap_remove(0);
        match slot.len() >= n {
            true => Ok(slot),
            false => Err(format!("a {}-element slot for {n} weights", slot.len())),
        }
    }

    fn send(&mut self, index: usize, n: usize) -> Result<(), String> {
        let slot = self.slot.lend().outs.swap_remove(0);
        self.sent
            .push((index, weights_data(slot.weights(n), self.compute)));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// Where an offloaded optimizer's sub-groups stepped ahead send their weights (kept across
/// steps), and the outputs made for the step begun ahead.
pub(crate) struct AheadOut<I: Backend> {
    host: Option<Arc<Mutex<HostSink>>>,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<Mutex<super::offload_cuda::CudaSink>>>,
    /// Sub-group `i`'s output on the device (CUDA: every sub-group's, made before backward).
    targets: Vec<Option<Tensor<I, 1>>>,
}

impl<I: Backend> Default for AheadOut<I> {
    fn default() -> Self {
        Self {
            host: None,
            #[cfg(feature = "cuda")]
            cuda: None,
            targets: Vec::new(),
        }
    }
}

impl<I: Backend> AheadOut<I> {
    /// The sink for a step begun ahead of the gradient of an optimizer whose sub-groups are
    /// `ranges`, its outputs made on `device` in `compute`'s format where the copies reach
    /// them (CUDA), in host memory otherwise.
    pub(crate) fn aim(
        &mut self,
        ranges: &[Range<usize>],
        device: &I::Device,
        compute: Format,
    ) -> Result<SharedSink, EngineError> {
        self.targets.clear();
        #[cfg(feature = "cuda")]
        if let Some((sink, targets)) =
            super::offload_cuda::aim::<I>(&mut self.cuda, ranges, device, compute)?
        {
            self.targets = targets.into_iter().map(Some).collect();
            return Ok(sink);
        }
        let _ = device;
        let len = ranges.iter().map(Range::len).max().unwrap_or(0);
        let host = self
            .host
            .get_or_insert_with(|| Arc::new(Mutex::new(HostSink::new(len, compute))));
        {
            let mut h = host.lock().unwrap_or_else(|e| e.into_inner());
            if h.slot.lend().outs[0].len() < len || h.compute != compute {
                *h = HostSink::new(len, compute);
            }
            h.sent.clear();
        }
        let sink: SharedSink = host.clone();
        Ok(sink)
    }

    /// The outputs for the step completing the one begun ahead: those made before it, and
    /// the weights of sub-groups sent ahead that are not `to_hand_out`.
    pub(crate) fn take(
        &mut self,
        to_hand_out: &[usize],
        device: &I::Device,
    ) -> Vec<Option<Tensor<I, 1>>> {
        let mut targets = std::mem::take(&mut self.targets);
        if let Some(host) = &self.host {
            let mut h = host.lock().unwrap_or_else(|e| e.into_inner());
            for (i, data) in h.sent.drain(..) {
                if !to_hand_out.contains(&i) {
                    if targets.len() <= i {
                        targets.resize(i + 1, None);
                    }
                    targets[i] = Some(tensor_of(data, device));
                }
            }
        }
        targets
    }

    /// Forgets the outputs of a step begun ahead that was abandoned.
    pub(crate) fn forget(&mut self) {
        self.targets.clear();
        if let Some(host) = &self.host {
            host.lock().unwrap_or_else(|e| e.into_inner()).sent.clear();
        }
    }
}
