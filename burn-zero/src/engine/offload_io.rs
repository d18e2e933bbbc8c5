//! How an offloaded step's sub-groups travel between the device and the host buffers of
//! burn-offload's pipeline. On CUDA (feature `cuda`) they are copied on side streams through
//! pinned buffers kept across steps ([`super::offload_cuda`]); on any other backend through
//! burn's `slice`/`into_data` and `from_data` into ordinary host buffers, also kept.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{HostGrads, HostOptimizer, OutDtype, OwnedBuffers, StreamTimings, Weights};

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
    /// On the device, in consecutive pieces, unscaled and clipped.
    Device(Vec<Tensor<I, 1>>),
    /// In host memory, still to be divided by `unscale` and then multiplied by `clip`.
    Host {
        grads: &'a HostGrads,
        unscale: Option<f32>,
        clip: Option<f32>,
    },
}

/// The download stage of a step whose gradient is in host memory: a scaled copy.
pub(crate) fn host_download(
    grads: &HostGrads,
    unscale: Option<f32>,
    clip: Option<f32>,
) -> impl Fn(Range<usize>, &mut [f32]) -> Result<(), String> + Sync + '_ {
    move |range, buf| {
        grads.read(range, buf, unscale, clip);
        Ok(())
    }
}

/// One offloaded step: the gradient of this rank's partition in, the new weights in the
/// compute format out, on `device`.
pub(crate) fn step<I: Backend>(
    opt: &mut HostOptimizer,
    ring: &mut StepRing,
    source: GradSource<'_, I>,
    lr: f32,
    betas: (f32, f32),
    device: &I::Device,
    compute: Format,
) -> Result<(Tensor<I, 1>, StreamTimings), EngineError> {
    #[cfg(feature = "cuda")]
    if let Some(done) = super::offload_cuda::step(opt, ring, &source, lr, betas, device, compute) {
        return done;
    }
    let out = out_dtype(compute);
    if !matches!(ring, StepRing::Owned(_)) {
        *ring = StepRing::Owned(OwnedBuffers::new(RING_DEPTH, opt.sub_group_len(), out));
    }
    let StepRing::Owned(buffers) = ring else {
        unreachable!("set above")
    };
    let grad: Vec<Tensor<I, 1>> = match &source {
        GradSource::Device(grad) => grad
            .iter()
            .map(|g| g.clone().cast(FloatDType::F32))
            .collect(),
        GradSource::Host { .. } => Vec::new(),
    };
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
    let from_host;
    let download: &burn_offload::Download<'_> = match source {
        GradSource::Device(_) => &from_device,
        GradSource::Host {
            grads,
            unscale,
            clip,
        } => {
            from_host = host_download(grads, unscale, clip);
            &from_host
        }
    };
    let mut parts = Vec::new();
    let timings = opt.step(lr, betas, buffers.lend(), download, &mut |_, weights| {
        parts.push(weights_on_device::<I>(weights, device, compute));
        Ok(())
    })?;
    let weights = match parts.len() {
        0 => Tensor::zeros([0], (device, compute.storage())),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    };
    Ok((weights, timings))
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
