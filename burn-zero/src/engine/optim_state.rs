//! Where a rank's fp32 master partition and optimizer state live: on the device, stepped by
//! tensor ops, or in host memory (`offload_optimizer {"device": "cpu"}`, ZeRO-Offload),
//! stepped by burn-offload's CPU-Adam one sub-group at a time while the previous sub-group's
//! new weights are uploaded. Both run the same arithmetic in the same order.

use std::sync::{Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{CpuAdam, HostOptimizer, HostSettings, OutDtype, Staged, SwapConfig};

use super::EngineError;
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
        /// Locked so the swap can be read through `&self` (export, checkpoints); boxed,
        /// as the device variant is small.
        opt: Box<Mutex<HostOptimizer>>,
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

/// A number no other engine of this process used (several engines may swap at once).
fn next_swap_id() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn lock(opt: &Mutex<HostOptimizer>) -> MutexGuard<'_, HostOptimizer> {
    opt.lock().unwrap_or_else(|e| e.into_inner())
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
    /// The state for `master` (this rank's fp32 partition) as `config` places it; `rank`
    /// names this rank's swap directory under `nvme_path`.
    pub(crate) fn new(
        config: &ResolvedConfig,
        master: Tensor<I, 1>,
        rank: usize,
    ) -> Result<Self, EngineError> {
        let zero = &config.config.zero_optimization;
        let len = master.dims()[0];
        let place = zero.optimizer_offload();
        if place == OffloadDevice::None {
            let opt = TensorOptimizer::new(
                config.optimizer,
                &config.optimizer_params,
                len,
                &master.device(),
            );
            return Ok(Optim::Device { master, opt });
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
        let (values, sub_group) = (host_vec(master), zero.sub_group_size.get());
        let opt = if place == OffloadDevice::Nvme {
            let offload = zero.offload_optimizer.as_ref().expect("validated");
            let root = offload.nvme_path.as_deref().expect("validated");
            let swap = SwapConfig {
                root: root.into(),
                dir: std::path::Path::new(root)
                    .join("burn-zero-swap")
                    .join(format!(
                        "pid{}-{}-rank{rank}",
                        std::process::id(),
                        next_swap_id()
                    )),
                block_size: config.config.aio.block_size,
                queue_depth: config.config.aio.queue_depth,
                buffer_count: offload.buffer_count.get(),
            };
            HostOptimizer::on_nvme(values, settings, cpu, sub_group, &swap)?
        } else {
            HostOptimizer::new(values, settings, cpu, sub_group)
        };
        Ok(Optim::Host {
            opt: Box::new(Mutex::new(opt)),
            device,
            timings: OffloadTimings::default(),
        })
    }

    /// The offloaded steps' time so far, reset (`None` on the device).
    pub(crate) fn take_timings(&mut self) -> Option<OffloadTimings> {
        match self {
            Optim::Device { .. } => None,
            Optim::Host { timings, .. } => Some(std::mem::take(timings)),
        }
    }

    /// The swap files of an NVMe-offloaded optimizer (empty otherwise).
    pub(crate) fn swap_files(&self) -> Vec<std::path::PathBuf> {
        match self {
            Optim::Device { .. } => Vec::new(),
            Optim::Host { opt, .. } => lock(opt).swap_files(),
        }
    }

    /// Whether master and state live off the device.
    pub(crate) fn offloaded(&self) -> bool {
        matches!(self, Optim::Host { .. })
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
            Optim::Host { opt, .. } => lock(opt).bytes(),
        }
    }

    /// The fp32 master partition on the device (uploaded when offloaded).
    pub(crate) fn master(&self) -> Result<Tensor<I, 1>, EngineError> {
        match self {
            Optim::Device { master, .. } => Ok(master.clone()),
            Optim::Host { opt, device, .. } => Ok(upload(lock(opt).master()?, device)),
        }
    }

    /// Applies `grad` (fp32, this rank's partition) and returns the new weights in the
    /// compute format, on the device.
    pub(crate) fn step(
        &mut self,
        grad: Tensor<I, 1>,
        hp: StepParams,
        compute: Format,
    ) -> Result<Tensor<I, 1>, EngineError> {
        match self {
            Optim::Device { master, opt } => {
                *master = opt.step(master.clone(), grad, hp);
                Ok(compute.convert(master.clone()))
            }
            Optim::Host {
                opt,
                device,
                timings,
            } => {
                let start = Instant::now();
                let grad = host_vec(grad);
                timings.d2h += start.elapsed();
                let opt = opt.get_mut().unwrap_or_else(|e| e.into_inner());
                let out = host_step(opt, device, grad, hp, compute, timings)?;
                timings.total += start.elapsed();
                timings.steps += 1;
                Ok(out)
            }
        }
    }

    /// Master, step count and named state partitions on the host (for checkpoints).
    pub(crate) fn export(&self) -> Result<Exported, EngineError> {
        match self {
            Optim::Device { master, opt } => {
                let (step, state) = opt.export();
                Ok(Exported {
                    master: host_vec(master.clone()),
                    step,
                    state: state.into_iter().map(|(n, t)| (n, host_vec(t))).collect(),
                })
            }
            Optim::Host { opt, .. } => {
                let (master, step, state) = lock(opt).export()?;
                Ok(Exported {
                    master,
                    step,
                    state,
                })
            }
        }
    }

    /// The state names a load needs.
    pub(crate) fn required(&self) -> &'static [&'static str] {
        match self {
            Optim::Device { opt, .. } => opt.required(),
            Optim::Host { opt, .. } => lock(opt).required(),
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
            Optim::Host { opt, .. } => lock(opt).import(master, step, state),
        }
    }
}

/// ZeRO-Offload's step: sub-groups stepped on a worker (CPU-Adam's threads, and the swap's
/// I/O on NVMe) while this thread uploads the sub-group before, in the compute dtype.
fn host_step<I: Backend>(
    opt: &mut HostOptimizer,
    device: &I::Device,
    grad: Vec<f32>,
    hp: StepParams,
    compute: Format,
    timings: &mut OffloadTimings,
) -> Result<Tensor<I, 1>, EngineError> {
    let (lr, betas) = hp.f32();
    let out = match compute.dtype {
        FloatDType::BF16 => OutDtype::Bf16,
        FloatDType::F16 => OutDtype::F16,
        _ => OutDtype::F32,
    };
    let (tx, rx) = mpsc::channel::<(Staged, Duration)>();
    let mut parts = Vec::new();
    let stepped = std::thread::scope(|s| {
        let grad = &grad;
        let worker = s.spawn(move || {
            let mut last = Instant::now();
            opt.step(lr, betas, grad, out, &mut |_, staged| {
                let _ = tx.send((staged, last.elapsed()));
                last = Instant::now();
            })
        });
        for (staged, cpu) in rx.iter() {
            timings.cpu_step += cpu;
            let start = Instant::now();
            parts.push(stage_on_device::<I>(staged, device, compute));
            timings.h2d += start.elapsed();
        }
        worker.join().expect("the CPU optimizer's worker")
    });
    stepped?;
    Ok(match parts.len() {
        0 => Tensor::zeros([0], (device, compute.storage())),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    })
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
