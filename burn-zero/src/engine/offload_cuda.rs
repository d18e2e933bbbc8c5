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
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use burn_offload::{
    Download, GradScale, HostOptimizer, OutDtype, OutSlot, StepBuffers, StreamTimings, Weights,
};
use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice, result};
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

/// Page-locked buffers and the two copy streams of one offloaded optimizer.
pub(crate) struct PinnedRing {
    ordinal: usize,
    len: usize,
    out: OutDtype,
    context: Arc<CudaContext>,
    down: Arc<CudaStream>,
    up: Arc<CudaStream>,
    grads: Vec<PinnedHostSlice<f32>>,
    /// f32 weights; 16-bit weights are held as their bits.
    outs32: Vec<PinnedHostSlice<f32>>,
    outs16: Vec<PinnedHostSlice<u16>>,
}

impl PinnedRing {
    fn new(ordinal: usize, len: usize, out: OutDtype) -> Result<Self, String> {
        let (context, [down, up]) = copy_streams(ordinal)?;
        // Flags 0: cached (not write-combined) memory, as the CPU reads gradients from it.
        // SAFETY: the buffers are written (by a copy or the step) before they are read.
        let pinned = |_| unsafe { context.alloc_pinned_with_flags::<f32>(len, 0) };
        let pinned16 = |_| unsafe { context.alloc_pinned_with_flags::<u16>(len, 0) };
        let fail = |e| format!("{len} elements of page-locked host memory: {e:?}");
        let grads = (0..RING_DEPTH)
            .map(pinned)
            .collect::<Result<_, _>>()
            .map_err(fail)?;
        let (outs32, outs16) = if out == OutDtype::F32 {
            let outs = (0..RING_DEPTH)
                .map(pinned)
                .collect::<Result<_, _>>()
                .map_err(fail)?;
            (outs, Vec::new())
        } else {
            let outs = (0..RING_DEPTH)
                .map(pinned16)
                .collect::<Result<_, _>>()
                .map_err(fail)?;
            (Vec::new(), outs)
        };
        Ok(Self {
            ordinal,
            len,
            out,
            context,
            down,
            up,
            grads,
            outs32,
            outs16,
        })
    }

    fn lend(&mut self) -> Result<StepBuffers<'_>, String> {
        let fail = |e| format!("a page-locked buffer: {e:?}");
        let grads = self
            .grads
            .iter_mut()
            .map(|b| b.as_mut_slice().map_err(fail))
            .collect::<Result<_, _>>()?;
        let mut outs = Vec::new();
        for b in &mut self.outs32 {
            outs.push(OutSlot::F32(b.as_mut_slice().map_err(fail)?));
        }
        for b in &mut self.outs16 {
            let bits = b.as_mut_slice().map_err(fail)?;
            let (ptr, n) = (bits.as_mut_ptr(), bits.len());
            // SAFETY: bf16 and f16 are `repr(transparent)` over u16; the slice replaces `bits`.
            outs.push(match self.out {
                OutDtype::Bf16 => {
                    OutSlot::Bf16(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<bf16>(), n) })
                }
                _ => OutSlot::F16(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<f16>(), n) }),
            });
        }
        Ok(StepBuffers { grads, outs })
    }
}

/// The step on CUDA memory, or `Err(source)` back when the gradient or the weights are not
/// contiguous CUDA tensors in a native format (the host-path fallback takes it).
pub(crate) fn step<'a, I: Backend>(
    opt: &mut HostOptimizer,
    ring: &mut StepRing,
    source: GradSource<'a, I>,
    lr: f32,
    betas: (f32, f32),
    device: &I::Device,
    compute: Format,
) -> Result<Stepped<I>, GradSource<'a, I>> {
    let grad: &[Tensor<I, 1>] = match &source {
        GradSource::Device(grad) => grad,
        GradSource::Host { .. } => &[],
    };
    if compute.emulated || grad.iter().any(|g| g.dtype() != FloatDType::F32.into()) {
        return Err(source);
    }
    let Some(src) = grad
        .iter()
        .map(|g| cuda_buffer::<I>(&g.clone().into_primitive().tensor()))
        .collect::<Option<Vec<CudaBuffer>>>()
    else {
        return Err(source);
    };
    // One output tensor per sub-group: a large partition is more than one buffer may hold.
    let weights: Vec<Tensor<I, 1>> = opt
        .sub_groups()
        .iter()
        .map(|r| Tensor::empty([r.len()], (device, compute.storage())))
        .collect();
    let Some(dst) = weights
        .iter()
        .map(|w| cuda_buffer::<I>(&w.clone().into_primitive().tensor()))
        .collect::<Option<Vec<CudaBuffer>>>()
    else {
        return Err(source);
    };
    let Some(ordinal) = dst.first().map(|d| d._keep.device.index) else {
        return Err(source);
    };
    let dst: Vec<u64> = dst.iter().map(|d| d.buf.ptr).collect();
    let out = out_dtype(compute);
    let len = opt.sub_group_len();
    let reuse =
        matches!(ring, StepRing::Pinned(r) if r.ordinal == ordinal && r.len == len && r.out == out);
    if !reuse {
        match PinnedRing::new(ordinal, len, out) {
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
    let from_device = |range: Range<usize>, buf: &mut [f32]| {
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
