//! Where a rank's fp32 master partition and optimizer state live: on the device, stepped by
//! tensor ops, or in host memory (`offload_optimizer {"device": "cpu"}`, ZeRO-Offload),
//! stepped by burn-offload's CPU-Adam one sub-group at a time while the previous sub-group's
//! new weights are uploaded. Both run the same arithmetic in the same order.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{CpuAdam, Grad, HostOptimizer, HostSettings, Out};
use half::{bf16, f16};

use super::precision::Format;
use crate::config::{OffloadDevice, ResolvedConfig};
use crate::optim::{OptimizerSettings, StepParams, TensorOptimizer};

/// The master partition and the optimizer state of one rank.
pub(crate) enum Optim<I: Backend> {
    /// On the device.
    Device {
        master: Tensor<I, 1>,
        opt: TensorOptimizer<I>,
    },
    /// In host memory; the device holds only the working copy.
    Host {
        opt: HostOptimizer,
        device: I::Device,
        timings: OffloadTimings,
    },
}

/// Where an offloaded optimizer's steps spent their time (sums since the last take).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadTimings {
    /// Steps summed.
    pub steps: usize,
    /// Gradient partition device → host.
    pub d2h: std::time::Duration,
    /// CPU-Adam over every sub-group (on the worker, overlapped with the uploads).
    pub cpu_step: std::time::Duration,
    /// Uploading the new weights host → device (on the engine's thread).
    pub h2d: std::time::Duration,
    /// The whole step, first byte down to last byte up.
    pub total: std::time::Duration,
}

/// An optimizer's partition on the host, for a checkpoint.
pub(crate) struct Exported {
    pub(crate) master: Vec<f32>,
    /// Steps taken (Adam's t).
    pub(crate) step: u64,
    /// Named state partitions (`exp_avg`, ...).
    pub(crate) state: Vec<(&'static str, Vec<f32>)>,
}

/// A sub-group's new weights on the host, in the dtype they travel in.
enum Staged {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

fn host_vec<I: Backend>(t: Tensor<I, 1>) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .into_vec::<f32>()
        .expect("an f32 tensor")
}

fn upload<I: Backend>(values: Vec<f32>, device: &I::Device) -> Tensor<I, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

impl<I: Backend> Optim<I> {
    /// The state for `master` (this rank's fp32 partition) as `config` places it.
    pub(crate) fn new(config: &ResolvedConfig, master: Tensor<I, 1>) -> Self {
        let zero = &config.config.zero_optimization;
        let len = master.dims()[0];
        if zero.optimizer_offload() != OffloadDevice::Cpu {
            let opt = TensorOptimizer::new(
                config.optimizer,
                &config.optimizer_params,
                len,
                &master.device(),
            );
            return Optim::Device { master, opt };
        }
        let settings = match OptimizerSettings::new(config.optimizer, &config.optimizer_params) {
            OptimizerSettings::Adam(a) => HostSettings::Adam {
                eps: a.eps as f32,
                weight_decay: a.weight_decay as f32,
                decoupled: a.decoupled,
                bias_correction: a.bias_correction,
            },
            OptimizerSettings::Sgd(s) => HostSettings::Sgd {
                momentum: s.momentum as f32,
                dampening: s.dampening as f32,
                nesterov: s.nesterov,
                weight_decay: s.weight_decay as f32,
            },
        };
        let cpu = &config.config.burn_zero.cpu_adam;
        let cpu = CpuAdam::new(cpu.threads).with_pinned_cores(cpu.pin_cores);
        let device = master.device();
        let opt = HostOptimizer::new(host_vec(master), settings, cpu, zero.sub_group_size.get());
        Optim::Host {
            opt,
            device,
            timings: OffloadTimings::default(),
        }
    }

    /// The offloaded steps' time so far, reset (`None` on the device).
    pub(crate) fn take_timings(&mut self) -> Option<OffloadTimings> {
        match self {
            Optim::Device { .. } => None,
            Optim::Host { timings, .. } => Some(std::mem::take(timings)),
        }
    }

    /// Device bytes of master and state (0 when offloaded).
    pub(crate) fn device_bytes(&self) -> usize {
        match self {
            Optim::Device { master, opt } => 4 * master.dims()[0] + opt.state_bytes(),
            Optim::Host { .. } => 0,
        }
    }

    /// Host bytes of master and state (0 on the device).
    pub(crate) fn host_bytes(&self) -> usize {
        match self {
            Optim::Device { .. } => 0,
            Optim::Host { opt, .. } => opt.bytes(),
        }
    }

    /// The fp32 master partition on the device (uploaded when offloaded).
    pub(crate) fn master(&self) -> Tensor<I, 1> {
        match self {
            Optim::Device { master, .. } => master.clone(),
            Optim::Host { opt, device, .. } => upload(opt.master().to_vec(), device),
        }
    }

    /// Applies `grad` (fp32, this rank's partition) and returns the new weights in the
    /// compute format, on the device.
    pub(crate) fn step(
        &mut self,
        grad: Tensor<I, 1>,
        hp: StepParams,
        compute: Format,
    ) -> Tensor<I, 1> {
        match self {
            Optim::Device { master, opt } => {
                *master = opt.step(master.clone(), grad, hp);
                compute.convert(master.clone())
            }
            Optim::Host {
                opt,
                device,
                timings,
            } => {
                let start = Instant::now();
                let grad = host_vec(grad);
                timings.d2h += start.elapsed();
                let out = host_step(opt, device, grad, hp, compute, timings);
                timings.total += start.elapsed();
                timings.steps += 1;
                out
            }
        }
    }

    /// Master, step count and named state partitions on the host (for checkpoints).
    pub(crate) fn export(&self) -> Exported {
        match self {
            Optim::Device { master, opt } => {
                let (step, state) = opt.export();
                Exported {
                    master: host_vec(master.clone()),
                    step,
                    state: state.into_iter().map(|(n, t)| (n, host_vec(t))).collect(),
                }
            }
            Optim::Host { opt, .. } => {
                let (step, state) = opt.export();
                Exported {
                    master: opt.master().to_vec(),
                    step,
                    state: state.into_iter().map(|(n, s)| (n, s.to_vec())).collect(),
                }
            }
        }
    }

    /// The state names a load needs.
    pub(crate) fn required(&self) -> &'static [&'static str] {
        match self {
            Optim::Device { opt, .. } => opt.required(),
            Optim::Host { opt, .. } => opt.required(),
        }
    }

    /// Replaces master, step count and state (from a checkpoint).
    pub(crate) fn import(
        &mut self,
        master: Vec<f32>,
        step: u64,
        state: Vec<(String, Vec<f32>)>,
    ) -> Result<(), String> {
        match self {
            Optim::Device { master: m, opt } => {
                let device = m.device();
                let state = state
                    .into_iter()
                    .map(|(n, v)| (n, upload(v, &device)))
                    .collect();
                opt.import(step, state)?;
                *m = upload(master, &device);
                Ok(())
            }
            Optim::Host { opt, .. } => opt.import(master, step, state),
        }
    }
}

/// ZeRO-Offload's step: sub-groups stepped on a worker (CPU-Adam's threads) while this thread
/// uploads the sub-group before, in the compute dtype.
fn host_step<I: Backend>(
    opt: &mut HostOptimizer,
    device: &I::Device,
    grad: Vec<f32>,
    hp: StepParams,
    compute: Format,
    timings: &mut OffloadTimings,
) -> Tensor<I, 1> {
    let (lr, betas) = hp.f32();
    let k = opt.begin_step(lr, betas);
    let groups = opt.groups();
    let count = groups.len();
    let (tx, rx) = mpsc::channel::<(Staged, Duration)>();
    let mut parts = Vec::with_capacity(count);
    std::thread::scope(|s| {
        let grad = &grad;
        s.spawn(move || {
            for range in groups {
                let start = Instant::now();
                let g = Grad::F32(&grad[range.clone()]);
                let n = range.len();
                let staged = match compute.dtype {
                    FloatDType::BF16 => {
                        let mut out = vec![bf16::ZERO; n];
                        opt.step_group(&k, range, g, Out::Bf16(&mut out));
                        Staged::Bf16(out)
                    }
                    FloatDType::F16 => {
                        let mut out = vec![f16::ZERO; n];
                        opt.step_group(&k, range, g, Out::F16(&mut out));
                        Staged::F16(out)
                    }
                    _ => {
                        opt.step_group(&k, range.clone(), g, Out::None);
                        Staged::F32(opt.master()[range].to_vec())
                    }
                };
                if tx.send((staged, start.elapsed())).is_err() {
                    return;
                }
            }
        });
        for (staged, cpu) in rx.iter() {
            timings.cpu_step += cpu;
            let start = Instant::now();
            parts.push(stage_on_device::<I>(staged, device, compute));
            timings.h2d += start.elapsed();
        }
    });
    assert_eq!(
        parts.len(),
        count,
        "CPU-Adam stopped before the last sub-group"
    );
    match parts.len() {
        0 => Tensor::zeros([0], (device, compute.storage())),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    }
}

/// A sub-group's weights on the device, stored as the compute format stores them.
fn stage_on_device<I: Backend>(
    staged: Staged,
    device: &I::Device,
    compute: Format,
) -> Tensor<I, 1> {
    let widened = |v: Vec<f32>| upload::<I>(v, device);
    match staged {
        Staged::F32(v) => widened(v),
        // Emulated formats store the rounded values in f32.
        Staged::Bf16(v) if compute.emulated => widened(v.iter().map(|x| x.to_f32()).collect()),
        Staged::F16(v) if compute.emulated => widened(v.iter().map(|x| x.to_f32()).collect()),
        Staged::Bf16(v) => {
            let n = v.len();
            Tensor::from_data(TensorData::new(v, [n]), (device, DType::BF16))
        }
        Staged::F16(v) => {
            let n = v.len();
            Tensor::from_data(TensorData::new(v, [n]), (device, DType::F16))
        }
    }
}
