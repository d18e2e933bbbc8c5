//! The offloaded step's transfers on CUDA: each sub-group's gradient is copied from burn's
//! device buffer into a page-locked host buffer on a download stream, and its new weights
//! from a page-locked buffer straight into the (preallocated) output tensor on an upload
//! stream. Page-locked memory lets the copies run at PCIe speed, without the driver's bounce
//! buffer; the buffers are allocated once and reused by every step.
//!
//! Ordering: burn's stream is synchronized once before the first copy (the gradient is
//! complete, and nothing of burn's still uses the output's memory); each copy is synchronized
//! on its stream before its buffer is reused or the step returns.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use burn_offload::{
    AheadSink, Download, GradBuf, GradScale, HostOptimizer, OutDtype, OutSlot, SharedSink,
    StepBuffers, StreamTimings, Weights,
};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice, result};
use half::{bf16, f16};

use super::EngineError;
use super::grad_buffer::{overlaps, piece_ranges};
use super::offload_io::{GradSource, RING_DEPTH, StepRing, Stepped, in_place, out_dtype};
use super::precision::Format;
use crate::backend::cuda::{CudaBuffer, cuda_buffer};

/// GPU `ordinal`'s context and `N` new streams for copies beside burn's.
pub(crate) fn copy_streams<const N: usize>(
    ordinal: usize,
) -> Result<(Arc<CudaContext>, [Arc<CudaStream>; N]), String> {
    let context = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
    let streams: Vec<Arc<CudaStream>> = (0..N)
        .map(|_| {
            context
                .new_stream()
                .map_err(|e| format!("a copy stream: {e:?}"))
        })
        .collect::<Result<_, _>>()?;
    let streams = streams
        .try_into()
        .unwrap_or_else(|_| unreachable!("N streams made"));
    Ok((context, streams))
}

/// Page-locked buffers for new weights in their dtype (16-bit weights held as their bits).
struct PinnedOuts {
    out: OutDtype,
    f32s: Vec<PinnedHostSlice<f32>>,
    bits: Vec<PinnedHostSlice<u16>>,
}

impl PinnedOuts {
    /// `count` buffers of `len` elements of `out`.
    fn new(
        context: &Arc<CudaContext>,
        count: usize,
        len: usize,
        out: OutDtype,
    ) -> Result<Self, String> {
        let fail = |e| format!("{len} elements of page-locked host memory: {e:?}");
        // Flags 0: cached (not write-combined) memory, as the CPU writes it.
        // SAFETY: a buffer is written by the step before it is read.
        let (f32s, bits) = match out {
            OutDtype::F32 => (
                (0..count)
                    .map(|_| unsafe { context.alloc_pinned_with_flags::<f32>(len, 0) })
                    .collect::<Result<_, _>>()
                    .map_err(fail)?,
                Vec::new(),
            ),
            _ => (
                Vec::new(),
                (0..count)
                    .map(|_| unsafe { context.alloc_pinned_with_flags::<u16>(len, 0) })
                    .collect::<Result<_, _>>()
                    .map_err(fail)?,
            ),
        };
        Ok(Self { out, f32s, bits })
    }

    /// Every buffer as a step's output slot.
    fn slots(&mut self) -> Result<Vec<OutSlot<'_>>, String> {
        let out = self.out;
        let f32s = self.f32s.iter_mut().map(slot_f32);
        f32s.chain(self.bits.iter_mut().map(|b| slot_bits(out, b)))
            .collect()
    }

    /// Buffer `i` as a step's output slot.
    fn slot(&mut self, i: usize) -> Result<OutSlot<'_>, String> {
        match self.out {
            OutDtype::F32 => slot_f32(&mut self.f32s[i]),
            out => slot_bits(out, &mut self.bits[i]),
        }
    }

    /// Copies the first `n` elements of buffer `i` to `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must hold `n` elements of the dtype, and buffer `i` must not be written before
    /// the copy completes.
    unsafe fn copy_up(
        &self,
        i: usize,
        n: usize,
        dst: u64,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let fail = |e| format!("{e:?}");
        // SAFETY: as the caller promises; the source is page-locked.
        unsafe {
            match self.out {
                OutDtype::F32 => {
                    let src = &self.f32s[i].as_slice().map_err(fail)?[..n];
                    result::memcpy_htod_async(dst, src, stream.cu_stream())
                }
                _ => {
                    let src = &self.bits[i].as_slice().map_err(fail)?[..n];
                    result::memcpy_htod_async(dst, src, stream.cu_stream())
                }
            }
        }
        .map_err(fail)
    }
}

fn slot_f32(b: &mut PinnedHostSlice<f32>) -> Result<OutSlot<'_>, String> {
    let values = b
        .as_mut_slice()
        .map_err(|e| format!("a page-locked buffer: {e:?}"))?;
    Ok(OutSlot::F32(values))
}

fn slot_bits(out: OutDtype, b: &mut PinnedHostSlice<u16>) -> Result<OutSlot<'_>, String> {
    let bits = b
        .as_mut_slice()
        .map_err(|e| format!("a page-locked buffer: {e:?}"))?;
    let (ptr, n) = (bits.as_mut_ptr(), bits.len());
    // SAFETY: bf16 and f16 are `repr(transparent)` over u16; the slice replaces `bits`.
    Ok(match out {
        OutDtype::Bf16 => {
            OutSlot::Bf16(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<bf16>(), n) })
        }
        _ => OutSlot::F16(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f16>(), n) }),
    })
}

/// Page-locked buffers and the two copy streams of one offloaded optimizer.
pub(crate) struct PinnedRing {
    ordinal: usize,
    len: usize,
    context: Arc<CudaContext>,
    down: Arc<CudaStream>,
    up: Arc<CudaStream>,
    /// Gradient buffers, for a gradient on the device only: one in host memory is read where
    /// it lies (at the default `sub_group_size` of 1e9 these would hold 12 GB of page-locked
    /// memory a rank for nothing).
    grads: Vec<PinnedHostSlice<f32>>,
    outs: PinnedOuts,
}

impl PinnedRing {
    fn new(ordinal: usize, len: usize, out: OutDtype, grads: bool) -> Result<Self, String> {
        let (context, [down, up]) = copy_streams(ordinal)?;
        let count = if grads { RING_DEPTH } else { 0 };
        // Flags 0: cached (not write-combined) memory, as the CPU reads gradients from it.
        // SAFETY: the buffers are written by a copy before they are read.
        let grads = (0..count)
            .map(|_| unsafe { context.alloc_pinned_with_flags::<f32>(len, 0) })
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{len} elements of page-locked host memory: {e:?}"))?;
        let outs = PinnedOuts::new(&context, RING_DEPTH, len, out)?;
        Ok(Self {
            ordinal,
            len,
            context,
            down,
            up,
            grads,
            outs,
        })
    }

    fn lend(&mut self) -> Result<StepBuffers<'_>, String> {
        let fail = |e| format!("a page-locked buffer: {e:?}");
        let grads = self
            .grads
            .iter_mut()
            .map(|b| b.as_mut_slice().map(GradBuf::F32).map_err(fail))
            .collect::<Result<_, _>>()?;
        let outs = self.outs.slots()?;
        Ok(StepBuffers { grads, outs })
    }
}

/// One output tensor per sub-group (`ranges`: a large partition is more than one buffer may
/// hold) and their CUDA buffers (`None`: not CUDA memory).
fn outputs<I: Backend>(
    ranges: &[Range<usize>],
    device: &I::Device,
    compute: Format,
) -> Option<(Vec<Tensor<I, 1>>, Vec<CudaBuffer>)> {
    let weights: Vec<Tensor<I, 1>> = ranges
        .iter()
        .map(|r| Tensor::empty([r.len()], (device, compute.storage())))
        .collect();
    let dst = buffers_of::<I>(&weights)?;
    Some((weights, dst))
}

fn buffers_of<I: Backend>(tensors: &[Tensor<I, 1>]) -> Option<Vec<CudaBuffer>> {
    tensors
        .iter()
        .map(|w| cuda_buffer::<I>(&w.clone().into_primitive().tensor()))
        .collect()
}

/// What [`step`] hands back when it is not for CUDA: the gradient and the outputs made.
pub(crate) type NotCuda<'a, I> = (GradSource<'a, I>, Vec<Option<Tensor<I, 1>>>);

/// The step on CUDA memory, or `Err` back when the gradient or the weights are not
/// contiguous CUDA tensors in a native format (the host-path fallback takes it). `targets`:
/// every sub-group's output, made before backward for a step begun ahead (some hold the
/// weights sent ahead), or none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step<'a, I: Backend>(
    opt: &mut HostOptimizer,
    ring: &mut StepRing,
    source: GradSource<'a, I>,
    lr: f32,
    betas: (f32, f32),
    device: &I::Device,
    compute: Format,
    targets: Vec<Option<Tensor<I, 1>>>,
) -> Result<Stepped<I>, NotCuda<'a, I>> {
    let grad: &[Tensor<I, 1>] = match &source {
        GradSource::Device(grad) => grad,
        GradSource::Host { .. } => &[],
    };
    if compute.emulated || grad.iter().any(|g| g.dtype() != FloatDType::F32.into()) {
        return Err((source, targets));
    }
    let Some(src) = buffers_of::<I>(grad) else {
        return Err((source, targets));
    };
    let made = match targets.len() == opt.sub_groups().len() {
        true => targets.iter().cloned().collect::<Option<Vec<_>>>(),
        false => None,
    };
    let outputs = match made {
        Some(weights) => buffers_of::<I>(&weights).map(|dst| (weights, dst)),
        None => outputs::<I>(&opt.sub_groups(), device, compute),
    };
    let Some((weights, dst)) = outputs else {
        return Err((source, targets));
    };
    let Some(ordinal) = dst.first().map(|d| d._keep.device.index) else {
        return Err((source, targets));
    };
    let dst: Vec<u64> = dst.iter().map(|d| d.buf.ptr).collect();
    let out = out_dtype(compute);
    let len = opt.sub_group_len();
    let on_device = matches!(source, GradSource::Device(_));
    let reuse = matches!(ring, StepRing::Pinned(r) if r.ordinal == ordinal && r.len == len
        && r.outs.out == out && (!on_device || !r.grads.is_empty()));
    if !reuse {
        // The old buffers go before the new ones are taken.
        *ring = StepRing::Unset;
        match PinnedRing::new(ordinal, len, out, on_device) {
            Ok(r) => *ring = StepRing::Pinned(r),
            Err(e) => return Ok(Err(EngineError::Usage(format!("offload buffers: {e}")))),
        }
    }
    let StepRing::Pinned(ring) = ring else {
        unreachable!("set above")
    };
    let pieces: Vec<(Range<usize>, u64)> = piece_ranges(grad)
        .into_iter()
        .zip(src.iter().map(|b| b.buf.ptr))
        .collect();
    let (context, down) = (ring.context.clone(), ring.down.clone());
    let from_device = |range: Range<usize>, mut buf: GradBuf<'_>| {
        let buf = buf.f32_mut()?;
        context.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let ranges = pieces.iter().map(|(r, _)| r.clone());
        for (i, local, at) in overlaps(ranges, &range) {
            let src = pieces[i].1 + (local.start * 4) as u64;
            let dst = &mut buf[at..at + local.len()];
            // SAFETY: `src` lies in a live, complete gradient piece (held in `src` above);
            // `dst` is page-locked and not touched until the stream is synchronized below.
            unsafe { result::memcpy_dtoh_async(dst, src, down.cu_stream()) }
                .map_err(|e| format!("{e:?}"))?;
        }
        down.synchronize().map_err(|e| format!("{e:?}"))
    };
    let (context, up) = (ring.context.clone(), ring.up.clone());
    let done = (|| {
        I::sync(device)
            .map_err(|e| EngineError::Usage(format!("the compute stream failed: {e:?}")))?;
        let mut lent = ring.lend().map_err(EngineError::Usage)?;
        let (scale, check) = in_place(source.split().1, opt, &mut lent);
        let download: &Download<'_> = match &check {
            Some(check) => check,
            None => &from_device,
        };
        let hp = (lr, betas, scale);
        upload_weights(opt, &context, &up, lent, download, &dst, hp)
    })();
    Ok(done.map(|t| (weights, t)))
}

/// The step over `buffers`, the gradient read by `download`, sub-group `k`'s new weights
/// copied into the output tensor at `weights_ptrs[k]` on the `up` stream.
fn upload_weights(
    opt: &mut HostOptimizer,
    context: &Arc<CudaContext>,
    up: &Arc<CudaStream>,
    buffers: StepBuffers<'_>,
    download: &Download<'_>,
    weights_ptrs: &[u64],
    (lr, betas, scale): (f32, (f32, f32), GradScale),
) -> Result<StreamTimings, EngineError> {
    let sub_group = opt.sub_group_len().max(1);
    let timings = opt.step(
        lr,
        betas,
        scale,
        buffers,
        download,
        &mut |range, weights| {
            context.bind_to_thread().map_err(|e| format!("{e:?}"))?;
            let stream = up.cu_stream();
            let ptr = weights_ptrs[range.start / sub_group];
            // SAFETY: the destination is the sub-group's output tensor, allocated for it and
            // idle on burn's side (synchronized above); the source is page-locked and outlives
            // the copy (synchronized before returning).
            unsafe {
                match weights {
                    Weights::F32(w) => result::memcpy_htod_async(ptr, w, stream),
                    Weights::Bf16(w) => result::memcpy_htod_async(ptr, w, stream),
                    Weights::F16(w) => result::memcpy_htod_async(ptr, w, stream),
                }
            }
            .map_err(|e| format!("{e:?}"))?;
            up.synchronize().map_err(|e| format!("{e:?}"))
        },
    )?;
    Ok(timings)
}

/// Sends each sub-group stepped ahead straight into its output tensor, made before backward:
/// CPU-Adam writes the new weights into one of two page-locked slots, copied up on a stream
/// of its own while the next sub-group steps into the other.
pub(crate) struct CudaSink {
    ordinal: usize,
    len: usize,
    context: Arc<CudaContext>,
    up: Arc<CudaStream>,
    slots: PinnedOuts,
    /// The copy last enqueued from each slot.
    copies: [Option<CudaEvent>; 2],
    /// The slot the next sub-group is written into.
    next: usize,
    /// Each sub-group's output's device address.
    targets: Vec<u64>,
}

impl CudaSink {
    fn new(ordinal: usize, len: usize, out: OutDtype) -> Result<Self, String> {
        let (context, [up]) = copy_streams(ordinal)?;
        let slots = PinnedOuts::new(&context, 2, len, out)?;
        Ok(Self {
            ordinal,
            len,
            context,
            up,
            slots,
            copies: [None, None],
            next: 0,
            targets: Vec::new(),
        })
    }
}

impl AheadSink for CudaSink {
    fn slot(&mut self, n: usize) -> Result<OutSlot<'_>, String> {
        if n > self.len {
            return Err(format!("a {}-element slot for {n} weights", self.len));
        }
        if let Some(copy) = self.copies[self.next].take() {
            copy.synchronize().map_err(|e| format!("{e:?}"))?;
        }
        self.slots.slot(self.next)
    }

    fn send(&mut self, index: usize, n: usize) -> Result<(), String> {
        let dst = *self
            .targets
            .get(index)
            .ok_or_else(|| format!("sub-group {index} has no output tensor"))?;
        self.context
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        let i = self.next;
        // SAFETY: `dst` is the sub-group's output tensor, made for it and synchronized on
        // burn's stream before backward, untouched by burn until the step (after `flush`); the
        // slot is not written again before this copy's event completes (`slot` waits).
        unsafe { self.slots.copy_up(i, n, dst, &self.up)? };
        let event = self.up.record_event(None).map_err(|e| format!("{e:?}"))?;
        self.copies[i] = Some(event);
        self.next = 1 - i;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), String> {
        self.copies = [None, None];
        self.up.synchronize().map_err(|e| format!("{e:?}"))
    }
}

/// The sink for a step begun ahead, aimed at new output tensors (one per sub-group of
/// `ranges`, on `device` in `compute`'s format), made in `cache` or reused from it; `None`
/// when they are not CUDA memory in a native format.
#[allow(clippy::type_complexity)]
pub(crate) fn aim<I: Backend>(
    cache: &mut Option<Arc<Mutex<CudaSink>>>,
    ranges: &[Range<usize>],
    device: &I::Device,
    compute: Format,
) -> Result<Option<(SharedSink, Vec<Tensor<I, 1>>)>, EngineError> {
    if compute.emulated {
        return Ok(None);
    }
    let Some((weights, dst)) = outputs::<I>(ranges, device, compute) else {
        return Ok(None);
    };
    let Some(ordinal) = dst.first().map(|d| d._keep.device.index) else {
        return Ok(None);
    };
    let len = ranges.iter().map(Range::len).max().unwrap_or(0);
    let out = out_dtype(compute);
    let fits = |s: &CudaSink| s.ordinal == ordinal && s.len == len && s.slots.out == out;
    let reuse = cache
        .as_ref()
        .is_some_and(|s| fits(&s.lock().unwrap_or_else(|e| e.into_inner())));
    if !reuse {
        let sink = CudaSink::new(ordinal, len, out)
            .map_err(|e| EngineError::Usage(format!("offload buffers: {e}")))?;
        *cache = Some(Arc::new(Mutex::new(sink)));
    }
    let sink = cache.clone().expect("set above");
    sink.lock().unwrap_or_else(|e| e.into_inner()).targets =
        dst.iter().map(|d| d.buf.ptr).collect();
    // Nothing of burn's still uses the outputs' memory when the copies start.
    I::sync(device).map_err(|e| EngineError::Usage(format!("the compute stream failed: {e:?}")))?;
    let sink: SharedSink = sink;
    Ok(Some((sink, weights)))
}
