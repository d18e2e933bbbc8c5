//! Where a rank's fp32 master partition and optimizer state live: on the device, stepped by
//! tensor ops, or in host memory (`offload_optimizer {"device": "cpu"}`, ZeRO-Offload),
//! stepped by burn-offload's CPU-Adam one sub-group at a time while the next sub-group's
//! gradient comes down and the previous one's new weights go up (`offload_io`). Both run the
//! same arithmetic in the same order.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_offload::{AheadReport, CpuAdam, HostOptimizer, HostSettings, SharedSink, SwapConfig};

use super::EngineError;
use super::offload_io::{self, AheadOut, DirectOuts, GradSource, StepRing};
use super::precision::Format;
use crate::comm::Communicator;
use crate::config::{OffloadDevice, ResolvedConfig};
use crate::optim::{CommVolume, TensorBounds};
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
        /// Locked so the swap can be read through `&self` (export, checkpoints) and
        /// sub-groups stepped ahead on another thread during backward.
        opt: Arc<Mutex<HostOptimizer>>,
        /// The host buffers the steps stream through.
        ring: Box<StepRing>,
        /// Where sub-groups stepped ahead send their weights.
        ahead_out: Box<AheadOut<I>>,
        device: I::Device,
        timings: OffloadTimings,
    },
}

/// Where an offloaded optimizer's steps spent their time (sums since the last take).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadTimings {
    /// Steps summed.
    pub steps: usize,
    /// Gradient sub-groups device → host (on the download thread, overlapped with the rest);
    /// at stages 2 and 3 they are in host memory already, and this is their scaled copy.
    pub d2h: std::time::Duration,
    /// Stages 2 and 3: reduced gradient buckets device → host during backward (busy time of
    /// the copy thread, overlapped with backward).
    pub backward_d2h: std::time::Duration,
    /// CPU-Adam over every sub-group the step itself took (on its own thread, overlapped
    /// with the copies).
    pub cpu_step: std::time::Duration,
    /// CPU-Adam of sub-groups stepped ahead, during backward (`cpu_adam.step_ahead`).
    pub ahead_cpu_step: std::time::Duration,
    /// Sub-groups stepped ahead.
    pub ahead_sub_groups: usize,
    /// New weights host → device (on the engine's thread, overlapped with the rest).
    pub h2d: std::time::Duration,
    /// The whole step, first byte down to last byte up.
    pub total: std::time::Duration,
    /// Steps that wrote the new weights into the parameters' host buffer (ZeRO-3 with
    /// `offload_param` on the CPU): nothing went up.
    pub into_host: usize,
}

/// An optimizer's partition on the host, for a checkpoint.
pub(crate) struct Exported {
    pub(crate) master: Vec<f32>,
    /// Steps taken (Adam's t).
    pub(crate) step: u64,
    /// Named state partitions (`exp_avg`, ...).
    pub(crate) state: Vec<(&'static str, Vec<f32>)>,
}

/// Warns when the swap files under `swap.dir` go through the page cache (the file system
/// refused O_DIRECT, as tmpfs does): host memory then fills with what they hold, and their
/// speed is not the disk's.
pub(crate) fn warn_if_cached(direct: bool, swap: &SwapConfig) {
    if !direct {
        crate::log::warn(&format!(
            "swap files under {} go through the page cache (the file system refused O_DIRECT): \
             host memory fills with what they hold, and their speed is not the disk's",
            swap.dir.display()
        ));
    }
}

/// The swap files of rank `rank`'s `what` (optimizer state, parameters) under `root`, in a
/// directory of their own (several engines of one process may swap at once).
pub(crate) fn swap_config(
    config: &ResolvedConfig,
    root: &str,
    buffer_count: usize,
    rank: usize,
    what: &str,
) -> SwapConfig {
    let name = format!(
        "pid{}-{}-rank{rank}-{what}",
        std::process::id(),
        next_swap_id()
    );
    SwapConfig {
        root: root.into(),
        dir: std::path::Path::new(root).join("burn-zero-swap").join(name),
        block_size: config.config.aio.block_size,
        queue_depth: config.config.aio.queue_depth,
        buffer_count,
    }
}

/// A number no other engine of this process used (several engines may swap at once).
fn next_swap_id() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn lock(opt: &Mutex<HostOptimizer>) -> MutexGuard<'_, HostOptimizer> {
    opt.lock().unwrap_or_else(|e| e.into_inner())
}

/// Elements read back per call by [`host_vec`].
const READ_PIECE: usize = 1 << 26;

/// `t`'s values in host memory, read [`READ_PIECE`] elements at a time: cubecl-cuda stages
/// every read in page-locked memory from a pool that keeps the pages it grew, so one read of a
/// 22.6B model's master partition (5.7B elements a rank on 4 GPUs) held 21 GiB of host memory
/// a rank for the rest of the run (`/proc/PID/smaps`: one mapping of exactly the partition).
fn host_vec<I: Backend>(t: Tensor<I, 1>) -> Vec<f32> {
    host_vec_by(t, READ_PIECE)
}

fn host_vec_by<I: Backend>(t: Tensor<I, 1>, piece: usize) -> Vec<f32> {
    let t = t.cast(FloatDType::F32);
    let n = t.dims()[0];
    let mut values = Vec::with_capacity(n);
    for start in (0..n).step_by(piece) {
        let piece = t.clone().slice(start..(start + piece).min(n)).into_data();
        values.extend_from_slice(piece.as_slice::<f32>().expect("an f32 tensor"));
    }
    values
}

/// `values` on `device`, [`READ_PIECE`] elements at a time, each upload's page-locked staging
/// (see [`host_vec`]) returned to cubecl's pool before the next takes one.
fn upload<I: Backend>(values: Vec<f32>, device: &I::Device) -> Tensor<I, 1> {
    upload_by(values, device, READ_PIECE)
}

fn upload_by<I: Backend>(values: Vec<f32>, device: &I::Device, piece: usize) -> Tensor<I, 1> {
    let n = values.len();
    if n <= piece {
        return Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32));
    }
    // One tensor filled piece by piece: a concatenation would hold every piece beside it.
    let mut out = Tensor::<I, 1>::empty([n], (device, DType::F32));
    for (i, values) in values.chunks(piece).enumerate() {
        let start = i * piece;
        let t = Tensor::from_data(
            TensorData::new(values.to_vec(), [values.len()]),
            (device, DType::F32),
        );
        out = out.slice_assign(start..start + values.len(), t);
        // A failed device fails the first use of the tensor, with its own error.
        let _ = I::sync(device);
    }
    out
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
            )
            .with_fused(config.config.burn_zero.fused_adam);
            return Ok(Optim::Device { master, opt });
        }
        let device = master.device();
        Self::on_host(config, host_vec(master), device, rank)
    }

    /// The state for `master` (this rank's fp32 partition, in host memory) offloaded as
    /// `config` says, the working copy on `device`.
    pub(crate) fn on_host(
        config: &ResolvedConfig,
        values: Vec<f32>,
        device: I::Device,
        rank: usize,
    ) -> Result<Self, EngineError> {
        let zero = &config.config.zero_optimization;
        let place = zero.optimizer_offload();
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
            OptimizerSettings::Lamb(_) | OptimizerSettings::OneBitAdam(..) => {
                return Err(EngineError::Usage(format!(
                    "optimizer.type {:?} cannot be offloaded (offload_optimizer)",
                    config.optimizer
                )));
            }
        };
        let cpu_config = &config.config.burn_zero.cpu_adam;
        let cpu = CpuAdam::new(cpu_config.threads)
            .with_pinned_cores(cpu_config.pin_cores)
            .with_huge_pages(cpu_config.huge_pages);
        let sub_group = zero.sub_group_size.get();
        let opt = if place == OffloadDevice::Nvme {
            let offload = zero.offload_optimizer.as_ref().expect("validated");
            let root = offload.nvme_path.as_deref().expect("validated");
            let swap = swap_config(config, root, offload.buffer_count.get(), rank, "optimizer");
            let opt = HostOptimizer::on_nvme(values, settings, cpu, sub_group, &swap)?;
            warn_if_cached(opt.swap_direct().unwrap_or(true), &swap);
            opt
        } else {
            let opt = HostOptimizer::new(values, settings, cpu, sub_group);
            match cpu_config.ahead_threads {
                Some(threads) => opt.with_ahead_threads(threads),
                None => opt,
            }
        };
        Ok(Optim::Host {
            opt: Arc::new(Mutex::new(opt)),
            ring: Box::default(),
            ahead_out: Box::default(),
            device,
            timings: OffloadTimings::default(),
        })
    }

    /// LAMB's parameter tensors in the partition (see [`TensorBounds`]) and the data-parallel
    /// ranks (1-bit Adam's exchange).
    pub(crate) fn with_segments(self, bounds: TensorBounds, data: Arc<dyn Communicator>) -> Self {
        match self {
            Optim::Device { master, opt } => Optim::Device {
                master,
                opt: opt.with_segments(bounds).with_data_parallel(data),
            },
            host => host,
        }
    }

    /// 1-bit Adam: whether the next step exchanges the compressed update instead of
    /// all-reduced gradients.
    pub(crate) fn compresses_next_step(&self) -> bool {
        matches!(self, Optim::Device { opt, .. } if opt.compresses_next_step())
    }

    /// 1-bit Adam: what the last compressed exchange sent.
    pub(crate) fn compressed_volume(&self) -> Option<CommVolume> {
        match self {
            Optim::Device { opt, .. } => opt.compressed_volume(),
            Optim::Host { .. } => None,
        }
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

    /// The offloaded optimizer, for stepping sub-groups ahead (`None` on the device).
    pub(crate) fn host(&self) -> Option<Arc<Mutex<HostOptimizer>>> {
        match self {
            Optim::Device { .. } => None,
            Optim::Host { opt, .. } => Some(opt.clone()),
        }
    }

    /// Where the sub-groups of a step begun ahead send their new weights: outputs in the
    /// `compute` format made for them (`None` on the device).
    pub(crate) fn aim_ahead(&mut self, compute: Format) -> Result<Option<SharedSink>, EngineError> {
        match self {
            Optim::Device { .. } => Ok(None),
            Optim::Host {
                opt,
                ahead_out,
                device,
                ..
            } => {
                // The optimizer is not held while the sink is (the thread takes them the
                // other way round).
                let ranges = lock(opt).sub_groups();
                ahead_out.aim(&ranges, device, compute).map(Some)
            }
        }
    }

    /// Counts what stepping ahead did in the backward that ended.
    pub(crate) fn add_ahead(&mut self, report: &AheadReport) {
        if let Optim::Host { timings, .. } = self {
            timings.ahead_cpu_step += report.busy;
            timings.ahead_sub_groups += report.stepped;
        }
    }

    /// Sub-groups stepped ahead in the step begun (0 on the device).
    pub(crate) fn stepped_ahead(&self) -> usize {
        match self {
            Optim::Device { .. } => 0,
            Optim::Host { opt, .. } => lock(opt).stepped_ahead(),
        }
    }

    /// Closes a step begun ahead without completing it (see
    /// [`HostOptimizer::abandon_ahead`]); the sub-groups stepped, which keep their update.
    pub(crate) fn abandon_ahead(&mut self) -> usize {
        match self {
            Optim::Device { .. } => 0,
            Optim::Host { opt, ahead_out, .. } => {
                ahead_out.forget();
                lock(opt).abandon_ahead()
            }
        }
    }

    /// The step steps nothing more (see [`HostOptimizer::skip_rest_ahead`]).
    pub(crate) fn skip_rest_ahead(&mut self, hp: StepParams) -> Result<(), EngineError> {
        match self {
            Optim::Device { .. } => Ok(()),
            Optim::Host { opt, .. } => {
                let (lr, betas) = hp.f32();
                lock(opt)
                    .skip_rest_ahead(lr, betas, [1.0, 1.0])
                    .map_err(|e| EngineError::HostGradients(e.to_string()))
            }
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

    /// Applies the gradient of this rank's partition and returns the new weights in the
    /// compute format, on the device, in consecutive pieces. Device gradients are multiplied
    /// by `grad_scale` first (the clipping factor: the fused AdamW kernel does it in its own
    /// pass); host gradients carry their scale with them.
    pub(crate) fn step(
        &mut self,
        source: GradSource<'_, I>,
        hp: StepParams,
        compute: Format,
        grad_scale: f32,
    ) -> Result<Vec<Tensor<I, 1>>, EngineError> {
        match self {
            Optim::Device { master, opt } => {
                let GradSource::Device(grad) = source else {
                    unreachable!("gradients live in host memory only beside an offloaded optimizer")
                };
                // The master's only reference goes to the step, so it may update it in place;
                // the gradient's pieces are read where they lie (no concatenated copy).
                let device = master.device();
                let old = core::mem::replace(master, Tensor::empty([1], &device));
                let (new, working) =
                    opt.step_scaled(old, grad, hp, grad_scale, compute.native_dtype());
                *master = new;
                Ok(vec![
                    working.unwrap_or_else(|| compute.convert(master.clone())),
                ])
            }
            Optim::Host {
                opt,
                ring,
                ahead_out,
                device,
                timings,
            } => {
                let start = Instant::now();
                let source = match source {
                    GradSource::Device(grad) if grad_scale != 1.0 => GradSource::Device(
                        grad.into_iter().map(|g| g.mul_scalar(grad_scale)).collect(),
                    ),
                    source => source,
                };
                let mut opt = lock(opt);
                let (lr, betas) = hp.f32();
                let targets = ahead_out.take(&opt.to_hand_out(), device);
                let (out, t) =
                    offload_io::step(&mut opt, ring, source, lr, betas, device, compute, targets)?;
                timings.d2h += t.download;
                timings.cpu_step += t.compute;
                timings.h2d += t.upload;
                timings.total += start.elapsed();
                timings.steps += 1;
                Ok(out)
            }
        }
    }

    /// Whether a step may write the new weights into a host buffer of the parameters
    /// ([`Optim::step_into`]): offloaded, and no sub-group stepped ahead.
    pub(crate) fn steps_into_host(&self) -> bool {
        match self {
            Optim::Host { opt, .. } => !lock(opt).has_ahead(),
            Optim::Device { .. } => false,
        }
    }

    /// [`Optim::step`] of an offloaded optimizer whose gradient lies in host memory, the new
    /// weights written into `outs` (the parameters' host buffer): none on the device.
    pub(crate) fn step_into(
        &mut self,
        source: GradSource<'_, I>,
        hp: StepParams,
        outs: DirectOuts,
    ) -> Result<Vec<Tensor<I, 1>>, EngineError> {
        let (Optim::Host { opt, timings, .. }, GradSource::Host { grads, scale }) = (self, source)
        else {
            return Err(EngineError::Usage(
                "a step into host memory needs an offloaded optimizer and a host gradient".into(),
            ));
        };
        let start = Instant::now();
        let (lr, betas) = hp.f32();
        let t = offload_io::step_into(&mut lock(opt), grads, scale, lr, betas, outs)?;
        timings.d2h += t.download;
        timings.cpu_step += t.compute;
        timings.total += start.elapsed();
        timings.steps += 1;
        timings.into_host += 1;
        Ok(Vec::new())
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

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};

    /// Read back and uploaded in pieces that do not divide the length, the values come out
    /// whole and in order.
    #[test]
    fn pieces_read_and_upload_every_value_in_order() {
        let device = Default::default();
        let values: Vec<f32> = (0..30).map(|i| i as f32 * 0.5 - 3.0).collect();
        for piece in [1, 7, 29, 30, 31] {
            let t = Tensor::<NdArray, 1>::from_data(TensorData::new(values.clone(), [30]), &device);
            assert_eq!(
                super::host_vec_by(t, piece),
                values,
                "read in pieces of {piece}"
            );
            let up = super::upload_by::<NdArray>(values.clone(), &device, piece);
            assert_eq!(
                up.into_data().to_vec::<f32>().unwrap(),
                values,
                "uploaded in pieces of {piece}"
            );
        }
        let empty =
            Tensor::<NdArray, 1>::from_data(TensorData::new(Vec::<f32>::new(), [0]), &device);
        assert!(super::host_vec_by(empty, 4).is_empty());
    }
}
