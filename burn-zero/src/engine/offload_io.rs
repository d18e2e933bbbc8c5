//! How an offloaded step's sub-groups travel between the device and the host buffers of
//! burn-offload's pipeline. On CUDA (feature `cuda`) they are copied on side streams through
//! pinned buffers kept across steps ([`super::offload_cuda`]); on any other backend through
//! burn's `slice`/`into_data` and `from_data` into ordinary host buffers, also kept.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{
    Download, GradScale, HostGrads, HostOptimizer, OutDtype, OwnedBuffers, StepBuffers,
    StreamTimings, Weights,
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
/// partition's own chunks, in order (nothing to copy: a chunk is a sub-group), and the
/// download stage only checks that each arrives where it lies; returns the scale CPU-Adam
/// applies and that stage (`None`, and factors of 1, when the gradient is on the device).
#[allow(clippy::type_complexity)]
pub(crate) fn in_place<'b>(
    host: Option<(&'b mut HostGrads, GradScale)>,
    opt: &HostOptimizer,
    lent: &mut StepBuffers<'b>,
) -> (
    GradScale,
    Option<impl Fn(Range<usize>, &mut [f32]) -> Result<(), String> + Sync + use<>>,
) {
    let Some((grads, scale)) = host else {
        return ([1.0, 1.0], None);
    };
    let sub_group = opt.sub_group_len().max(1);
    let aligned = grads.chunk_len() == sub_group || grads.chunk_len() >= opt.len();
    let mut chunks = grads.chunks_mut();
    chunks.truncate(opt.sub_groups().len());
    let bases: Vec<usize> = chunks.iter().map(|c| c.as_ptr() as usize).collect();
    let check = move |range: Range<usize>, buf: &mut [f32]| {
        let at = bases.get(range.start / sub_group);
        if aligned && at == Some(&(buf.as_ptr() as usize)) {
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

/// One offloaded step: the gradient of this rank's partition in, the new weights in the
/// compute format out, on `device`, one piece per sub-group.
pub(crate) fn step<I: Backend>(
    opt: &mut HostOptimizer,
    ring: &mut StepRing,
    source: GradSource<'_, I>,
    lr: f32,
    betas: (f32, f32),
    device: &I::Device,
    compute: Format,
) -> Stepped<I> {
    #[cfg(feature = "cuda")]
    let source = match super::offload_cuda::step(opt, ring, source, lr, betas, device, compute) {
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
    let from_device = |range: Range<usize>, buf: &mut [f32]| {
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
    let mut parts = Vec::new();
    let timings = opt.step(lr, betas, scale, lent, download, &mut |_, weights| {
        parts.push(weights_on_device::<I>(weights, device, compute));
        Ok(())
    })?;
    if parts.is_empty() {
        parts.push(Tensor::zeros([0], (device, compute.storage())));
    }
    Ok((parts, timings))
}

/// A sub-group's weights on the device, stored as the compute format stores them (emulated
/// formats hold the rounded values in f32).
fn weights_on_device<I: Backend>(
    weights: Weights<'_>,
    device: &I::Device,
    compute: Format,
) -> Tensor<I, 1> {
    let n = weights.len();
    let data = match weights {
        Weights::Bf16(w) if !compute.emulated => TensorData::new(w.to_vec(), [n]),
        Weights::F16(w) if !compute.emulated => TensorData::new(w.to_vec(), [n]),
        other => TensorData::new(other.to_f32(), [n]),
    };
    let dtype: DType = data.dtype;
    Tensor::from_data(data, (device, dtype))
}
