//! The training engine: `burn_zero::initialize(model, config, comm)`, DeepSpeed style.
//!
//! The user runs their own forward on [`Engine::model`], then [`Engine::backward`] and
//! [`Engine::step`] every micro-step. The engine reduces gradients as autodiff finalizes them
//! (through `ZeroBackend`'s gradient hook), clips by the global norm across all shards, updates
//! this rank's partition of the flattened parameters, and all-gathers the result (stages 1–2).
//!
//! Partitions, gradients and optimizer state are flat tensors of the inner backend, on the
//! model's device; with an NCCL communicator the collectives run on their device memory
//! (see `collective`).

mod checkpoint;
mod collective;
mod construct;
mod device_failure;
mod export;
mod flat_pieces;
mod grad_buffer;
mod grads;
mod host_grads;
#[cfg(feature = "cuda")]
mod host_grads_cuda;
mod init;
mod load_module;
mod memory;
#[cfg(feature = "cuda")]
mod offload_cuda;
mod offload_io;
mod optim_state;
mod params;
mod precision;
mod profile;
mod stage3;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, FloatDType, Shape, Tensor};

pub use checkpoint::{LoadedCheckpoint, inject_save_failure};
pub use construct::{
    ParamValues, construct_full, construct_full_from, construct_sharded, construct_sharded_from,
};
pub use init::initialize;
pub use load_module::load_params;
pub use memory::{Estimate, MemoryReport, estimate_model_states, format_estimates};
pub use params::{FlatLayout, ParamSlot, flatten_params, unflatten_params};
use stage3::Stage3;
pub use stage3::{GatherEvent, GatherStats};

use crate::backend::GathererGuard;
use crate::backend::hooks::{self, HookGuard};
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::config::{ConfigError, ResolvedConfig};
use crate::optim::StepParams;
use crate::partition::PartitionPlan;
use crate::schedule::Scheduler;
use crate::{ZeroBackend, ZeroTensor};
use collective::FlatComm;
use flat_pieces::{Gathered, slice_pieces};
use grads::GradState;
use offload_io::GradSource;
pub use optim_state::OffloadTimings;
use optim_state::Optim;
use params::{rebuild_params, rebuild_params_as};
use precision::{Format, Precision};

/// The autodiff backend the engine trains on.
pub type ZeroAutodiff<I> = Autodiff<ZeroBackend<I>>;

/// Elements every partition is a multiple of (16 bytes of f32).
const PARTITION_ALIGN: usize = 4;

/// Why the engine could not go on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The config is invalid for this run.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A collective failed (a rank diverged, died or timed out).
    #[error("communication failed: {0}")]
    Comm(#[from] CommError),
    /// fp16 cannot go on: gradients overflow at the minimum loss scale.
    #[error(transparent)]
    LossScale(#[from] crate::precision::MinScaleReached),
    /// The NVMe swap of an offloaded optimizer failed.
    #[error(transparent)]
    Swap(#[from] burn_offload::SwapError),
    /// An offloaded optimizer step failed (a transfer, or the swap).
    #[error("offloaded optimizer step: {0}")]
    Offload(#[from] burn_offload::StreamError),
    /// Moving reduced gradients to the host (ZeRO-Offload) failed.
    #[error("{0}")]
    HostGradients(String),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::StoreError),
    /// The engine was used out of order.
    #[error("{0}")]
    Usage(String),
    /// The GPU runtime failed in one of its own threads (see `device_failure`).
    #[error("{0}")]
    Device(String),
}

/// Seconds spent in the engine's phases since the last report (`wall_clock_breakdown`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// Between the end of a `step` (or initialization) and the next `backward`: the user's
    /// forward pass (and whatever else runs there).
    pub forward: Duration,
    /// In `backward`, reduction included.
    pub backward: Duration,
    /// Host time in gradient collectives and waits for them (part of `backward`; with
    /// `overlap_comm` the rest of their time hides behind backward's compute).
    pub reduce: Duration,
    /// In `step` at the boundary: clipping, optimizer, all-gather, parameter rebuild.
    pub step: Duration,
}

/// A model being trained data-parallel with ZeRO stage 0, 1, 2 or 3.
pub struct Engine<I: Backend, M: Module<ZeroAutodiff<I>>> {
    model: Option<M>,
    comm: Arc<dyn Communicator>,
    resolved: ResolvedConfig,
    layout: Arc<FlatLayout>,
    plan: PartitionPlan,
    grads: Arc<Mutex<GradState<I>>>,
    /// This rank's fp32 partition of the parameters (the optimizer's master copy) and the
    /// optimizer state, on the device or offloaded.
    optim: Optim<I>,
    scheduler: Scheduler,
    /// Elements of the frozen parameters (not in `layout`).
    frozen_params: usize,
    micro_steps: usize,
    global_steps: usize,
    last_grad_norm: Option<f64>,
    timings: Timings,
    precision: Precision,
    _hook: HookGuard<I>,
    _gatherer: Option<GathererGuard<I>>,
    /// `flops_profiler`: the profile being taken, and the last one taken.
    profile: Option<profile::ProfileRun>,
    last_profile: Option<crate::profile::Profile>,
    /// When the last `step` (or initialization) returned: forward time is measured from it.
    last_step_end: Instant,
    /// The device of the model's parameters.
    device: I::Device,
}

/// The elements of the flat buffer whose optimizer state `rank` holds (stages 0–2; stage 3
/// partitions per parameter, see [`crate::partition::ShardPlan`]).
fn owned_range(plan: &PartitionPlan, stage: u8, rank: usize) -> core::ops::Range<usize> {
    if stage == 0 {
        0..plan.numel()
    } else {
        plan.owned(rank)
    }
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// The model, for the user's forward pass.
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is present between calls")
    }

    /// The config as resolved for this run.
    pub fn config(&self) -> &ResolvedConfig {
        &self.resolved
    }

    /// Optimizer steps taken.
    pub fn global_step(&self) -> usize {
        self.global_steps
    }

    /// Micro-steps taken (`step` calls).
    pub fn micro_step(&self) -> usize {
        self.micro_steps
    }

    /// Whether the current micro-step ends a gradient-accumulation window.
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        (self.micro_steps + 1).is_multiple_of(self.resolved.batch.gradient_accumulation_steps)
    }

    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.scheduler.lr()
    }

    /// The global gradient norm of the last optimizer step, before clipping.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_grad_norm
    }

    /// Time spent in backward and step since the last call.
    pub fn take_timings(&mut self) -> Timings {
        let reduce = std::mem::take(&mut self.state().comm_time);
        self.timings.reduce = reduce;
        std::mem::take(&mut self.timings)
    }

    /// Bytes this rank holds for parameters (their working copy: 2 per element in bf16/fp16
    /// where the backend has the dtype; none for ZeRO-3 partitions that are chunks of the
    /// master), gradients, optimizer state (fp32 master included) and communication buffers.
    pub fn memory_report(&self) -> MemoryReport {
        let state = self.state();
        let (params, host_params) = match &state.stage3 {
            Some(s3) if s3.master_backed() => (s3.persistent_numel(), 0),
            Some(s3) => s3.param_numel(),
            None => (self.layout.numel(), 0),
        };
        MemoryReport {
            parameters: self.precision.compute.storage().size() * params + 4 * self.frozen_params,
            gradients: state.gradient_bytes(),
            optimizer_state: self.optim.device_bytes(),
            host_optimizer_state: self.optim.host_bytes(),
            host_parameters: self.precision.compute.storage().size() * host_params,
            host_gradients: state.host_gradient_bytes(),
            communication_buffers: state.comm_buffer_bytes(),
        }
    }

    /// The loss scale of the next backward (1 unless fp16).
    pub fn loss_scale(&self) -> f64 {
        self.precision.scaler.scale()
    }

    /// Optimizer steps skipped because gradients overflowed (fp16), on every rank alike.
    pub fn skipped_steps(&self) -> usize {
        self.precision.skipped
    }

    /// What the ZeRO-3 gathers did so far (`None` below stage 3).
    pub fn gather_stats(&self) -> Option<GatherStats> {
        self.state().stage3.as_ref().map(|s3| s3.stats())
    }

    /// Where offloaded optimizer steps spent their time since the last call (`None` unless
    /// `offload_optimizer` is on).
    pub fn take_offload_timings(&mut self) -> Option<OffloadTimings> {
        let mut timings = self.optim.take_timings()?;
        if let Some(host) = &self.state().host {
            timings.backward_d2h = host.take_busy();
        }
        Some(timings)
    }

    /// The swap files of `offload_optimizer {"device": "nvme"}`, one per tensor (master,
    /// optimizer state) of this rank (empty otherwise). They are removed with the engine.
    pub fn swap_files(&self) -> Vec<std::path::PathBuf> {
        self.optim.swap_files()
    }

    /// 1-bit Adam: what the last step's compressed exchange sent, beside what an fp32
    /// all-reduce of the same vector would (`None` before `freeze_step` and for other
    /// optimizers).
    pub fn compressed_volume(&self) -> Option<crate::optim::CommVolume> {
        self.optim.compressed_volume()
    }

    /// Collectives that ran on device memory so far (0 on the host path).
    pub fn device_collectives(&self) -> usize {
        self.state().flat.device_calls
    }

    fn state(&self) -> MutexGuard<'_, GradState<I>> {
        self.grads.lock().expect("gradient state")
    }

    /// Backpropagates `loss` (this rank's micro-batch loss). Gradients are scaled by
    /// 1/`gradient_accumulation_steps` and reduced across ranks as the stage requires.
    pub fn backward(&mut self, loss: Tensor<ZeroAutodiff<I>, 1>) -> Result<(), EngineError> {
        device_failure::check()?;
        self.timings.forward += self.last_step_end.elapsed();
        let profiled = self.profile_backward_start();
        let start = Instant::now();
        let boundary = self.is_gradient_accumulation_boundary();
        let skip_reduce = self.optim.compresses_next_step();
        {
            let mut state = self.state();
            state.boundary = boundary;
            state.skip_reduce = skip_reduce;
        }
        let gas = self.resolved.batch.gradient_accumulation_steps;
        let loss = if gas > 1 {
            loss.div_scalar(gas as f32)
        } else {
            loss
        };
        // fp16: the loss scale keeps small gradients representable; `step` divides it out.
        let loss = if self.precision.scales() {
            loss.mul_scalar(self.precision.scaler.scale())
        } else {
            loss
        };
        // The forward's freed temporaries go back before backward allocates (and backward's
        // before the step): pages cached for one phase's sizes do not hold the next's.
        self.release_cached_memory();
        drop(loss.backward());
        self.release_cached_memory();
        self.profile_backward_end(profiled);
        device_failure::check()?;
        let mut state = self.state();
        if let Some(failure) = state.failure.take() {
            return Err(failure.into());
        }
        if let Some(failure) = state.host_failure.take() {
            return Err(EngineError::HostGradients(failure));
        }
        if state.seen == 0 {
            return Err(EngineError::Usage(
                "no parameter gradient reached the engine: compute the loss from `engine.model()` \
                 (a model cloned before the last `backward`/`step` is not tracked)"
                    .into(),
            ));
        }
        drop(state);
        if !boundary {
            // burn consumes the marks in backward; the next micro-step needs them again.
            let model = self.model.take().expect("model");
            self.model = Some(hooks::mark_distributed(model));
        }
        self.timings.backward += start.elapsed();
        Ok(())
    }

    /// Ends a micro-step; at an accumulation boundary, clips and applies the optimizer.
    pub fn step(&mut self) -> Result<(), EngineError> {
        device_failure::check()?;
        if !self.is_gradient_accumulation_boundary() {
            self.micro_steps += 1;
            self.last_step_end = Instant::now();
            return Ok(());
        }
        let start = Instant::now();
        let stage = self.resolved.config.zero_optimization.stage;
        let owned = owned_range(&self.plan, stage, self.comm.rank());
        let grads = self.grads.clone();
        let mut state = grads.lock().expect("gradient state");
        let range = match stage {
            0 | 2 => 0..owned.len(),
            3 => 0..state.buffer.len(),
            _ => owned.clone(),
        };
        // In the buffer's pieces: a large partition is more than one device buffer may hold.
        let scale = self
            .precision
            .scales()
            .then(|| self.precision.scaler.scale());
        // Offloaded at stage 2 and up, the gradient is in host memory (`None` here).
        let grad: Option<Vec<Tensor<I, 1>>> = state.host.is_none().then(|| {
            state
                .buffer
                .pieces(range)
                .into_iter()
                .map(|g| {
                    let g = g.cast(FloatDType::F32);
                    match scale {
                        Some(s) => g.div_scalar(s),
                        None => g,
                    }
                })
                .collect()
        });
        let norm = match (&grad, &state.host) {
            (Some(grad), _) => global_norm(&mut state.flat, grad, stage)?,
            (None, Some(host)) => {
                let squares = host.grads().sum_of_squares();
                let unscale = scale.map_or(1.0, |s| s * s);
                host_norm(state.flat.comm(), squares / unscale)?
            }
            (None, None) => unreachable!("gradients are on the device or in host memory"),
        };
        self.last_grad_norm = Some(norm);
        // The norm is reduced across ranks: inf or NaN anywhere overflows everywhere.
        let update = self.precision.scaler.update(!norm.is_finite())?;
        if update.skipped() {
            state.clear();
            drop(state);
            self.precision.skipped += 1;
            if self.comm.rank() == 0 {
                crate::log::warn(&format!(
                    "step {}: gradients overflowed (norm {norm}); step skipped ({} so far), {update:?}",
                    self.global_steps + 1,
                    self.precision.skipped
                ));
            }
            // burn consumed the marks in backward; the parameters are unchanged.
            let model = self.model.take().expect("model");
            self.model = Some(hooks::mark_distributed(model));
            self.global_steps += 1;
            self.micro_steps += 1;
            self.timings.step += start.elapsed();
            self.profile_step_end(start);
            self.profile_maybe_start();
            self.last_step_end = Instant::now();
            return Ok(());
        }
        let clip = self.resolved.config.gradient_clipping;
        let factor = (clip > 0.0 && norm + 1e-6 > clip).then(|| (clip / (norm + 1e-6)) as f32);
        let hp = StepParams {
            lr: self.scheduler.lr(),
            betas: self.scheduler.betas().unwrap_or({
                let [b1, b2] = self.resolved.optimizer_params.betas;
                (b1, b2)
            }),
        };
        // ZeRO-3's partitions are chunks of the master: the model's handles and the partitions
        // let go of it so the fused step updates it in place, and the step writes no
        // compute-format copy (each gather narrows its chunk instead).
        let master_backed = Self::master_backed(&state);
        let released = match master_backed {
            true => Some(self.release_partitions(&mut state)?),
            false => None,
        };
        let compute = match master_backed {
            true => Format::F32,
            false => self.precision.compute,
        };
        let working = match grad {
            // Clipped inside the optimizer's update (no pass of its own where it is fused).
            Some(grad) => {
                self.optim
                    .step(GradSource::Device(grad), hp, compute, factor.unwrap_or(1.0))
            }
            None => {
                let mut host = state.host.as_ref().expect("checked above").grads();
                // Multiplying by a power-of-two loss scale's inverse divides exactly.
                let unscale = scale.map_or(1.0, |s| 1.0 / s as f32);
                let source = GradSource::Host {
                    grads: &mut host,
                    scale: [unscale, factor.unwrap_or(1.0)],
                };
                self.optim.step(source, hp, compute, 1.0)
            }
        };
        // A failing swap on one rank must not leave the others waiting in the gathers below.
        let working = match self.optim.offloaded() {
            true => self.agree("step its offloaded optimizer", working)?,
            false => working?,
        };
        state.clear();
        self.publish(&mut state, working, released)?;
        drop(state);

        self.scheduler.step();
        self.global_steps += 1;
        self.micro_steps += 1;
        self.timings.step += start.elapsed();
        self.profile_step_end(start);
        self.profile_maybe_start();
        self.report_progress();
        self.release_cached_memory();
        self.last_step_end = Instant::now();
        Ok(())
    }

    /// `burn_zero.release_cached_memory`: the device's pools hand their free pages back (to
    /// CUDA's stream-ordered allocator, which reuses them for any size); in stream order, no
    /// wait.
    fn release_cached_memory(&self) {
        if self.resolved.config.burn_zero.release_cached_memory {
            I::memory_cleanup(&self.device);
        }
    }

    /// Whether ZeRO-3's partitions are chunks of the fp32 master ([`Stage3::master_backed`]).
    fn master_backed(state: &GradState<I>) -> bool {
        state.stage3.as_ref().is_some_and(Stage3::master_backed)
    }

    /// Drops every reference to the master but the optimizer's (see [`Engine::step`]): the
    /// partitions, the gathers and the model's handles, replaced by placeholders (outside
    /// burn's graph) until [`Engine::publish`]. Returns the parameters' `require_grad` flags.
    fn release_partitions(&mut self, state: &mut GradState<I>) -> Result<Vec<bool>, EngineError> {
        let s3 = state.stage3.as_mut().expect("stage 3 state");
        s3.release_partitions(&mut state.flat)?;
        let stub = Tensor::<I, 1>::zeros([1], &self.device);
        let model = self.model.take().expect("model");
        let mut flags = vec![false; self.layout.slots().len()];
        let model = rebuild_params_as(
            model,
            &self.layout,
            |p| s3.placeholder(p, &stub),
            |p, grad| {
                flags[p] = grad;
                false
            },
        );
        self.model = Some(model);
        Ok(flags)
    }

    /// This rank's fp32 master partition on the device (read back when offloaded).
    fn master_partition(&self) -> Result<Tensor<I, 1>, EngineError> {
        self.optim.master()
    }

    /// Rebuilds the model's parameters from this rank's `working` partition (the master in the
    /// compute format, after a step or a load); `released`: the `require_grad` flags of
    /// parameters the model holds as placeholders ([`Engine::release_partitions`]).
    fn publish(
        &mut self,
        state: &mut GradState<I>,
        working: Vec<Tensor<I, 1>>,
        released: Option<Vec<bool>>,
    ) -> Result<(), EngineError> {
        let model = self.model.take().expect("model");
        let stage = self.resolved.config.zero_optimization.stage;
        let layout = &self.layout;
        // Each parameter from the flat buffer's `range`, in its shape.
        let param = |p: usize, values: Tensor<I, 1>| {
            let shape = Shape::from(layout.slots()[p].shape.clone());
            ZeroTensor::local(I::float_reshape(values.into_primitive().tensor(), shape))
        };
        let range = |p: usize| {
            let slot = &layout.slots()[p];
            slot.offset..slot.offset + slot.numel()
        };
        let model = match stage {
            3 => {
                // No all-gather: the new partitions are the new handles, chunks of the master
                // itself where it is on the device.
                let master_backed = Self::master_backed(state);
                let source = match master_backed {
                    true => vec![self.optim.master()?],
                    false => working,
                };
                let s3 = state.stage3.as_mut().expect("stage 3 state");
                s3.set_partitions(&mut state.flat, &source, self.precision.compute)?;
                let full = s3.gather_persistent(&mut state.flat, &source)?;
                let grad = |p: usize, was: bool| released.as_ref().map_or(was, |f| f[p]);
                rebuild_params_as(model, layout, |p| s3.handle(p, full.get(&p)), grad)
            }
            0 => rebuild_params(model, layout, |p| {
                param(p, slice_pieces(&working, range(p)))
            }),
            _ => {
                let zero = &self.resolved.config.zero_optimization;
                let piece = zero.allgather_bucket_size.get() / self.comm.world_size();
                let chunk = self.plan.chunk();
                let full = Gathered::gather(&mut state.flat, &working, chunk, piece)?;
                rebuild_params(model, layout, |p| param(p, full.slice(range(p))))
            }
        };
        self.model = Some(hooks::mark_distributed(model));
        Ok(())
    }

    /// Stages 1–2: every rank's part of the flat buffer (`owned` elements, padded here to the
    /// plan's chunk), gathered into the padded flat buffer in `allgather_bucket_size` pieces.
    fn gather_chunks(
        &self,
        flat: &mut FlatComm<I>,
        owned: Tensor<I, 1>,
    ) -> Result<Tensor<I, 1>, CommError> {
        let zero = &self.resolved.config.zero_optimization;
        let piece = zero.allgather_bucket_size.get() / self.comm.world_size();
        let chunk = self.plan.chunk();
        let full = Gathered::gather(flat, &[owned], chunk, piece)?;
        Ok(full.slice(0..chunk * self.comm.world_size()))
    }

    fn report_progress(&mut self) {
        let Some(every) = self.resolved.config.steps_per_print else {
            return;
        };
        if self.comm.rank() != 0 || !self.global_steps.is_multiple_of(every.get().max(1)) {
            return;
        }
        let norm = self.last_grad_norm.unwrap_or(f64::NAN);
        let mut line = format!(
            "step {} lr {:.6e} grad norm {norm:.4}",
            self.global_steps,
            self.lr()
        );
        if self.resolved.config.wall_clock_breakdown {
            let t = self.take_timings();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            line += &format!(
                " | last {every} steps: forward {:.1} ms, backward {:.1} ms (reduce {:.1} ms), step {:.1} ms",
                ms(t.forward),
                ms(t.backward),
                ms(t.reduce),
                ms(t.step)
            );
        }
        crate::log::info(&line);
    }
}

/// The L2 norm of the whole gradient: this rank's share summed across ranks for stages that
/// partition (equal to the unsharded norm; padding is zero).
fn global_norm<I: Backend>(
    flat: &mut FlatComm<I>,
    grad: &[Tensor<I, 1>],
    stage: u8,
) -> Result<f64, CommError> {
    // In pieces: `grad · grad` of a whole partition is a second partition-sized buffer, which
    // a large model has no room for.
    const PIECE: usize = 1 << 26;
    let device = flat.device().clone();
    let mut squares = Tensor::<I, 1>::zeros([1], (&device, burn::tensor::DType::F32));
    for g in grad {
        let n = g.dims()[0];
        for start in (0..n).step_by(PIECE) {
            let piece = g.clone().slice(start..(start + PIECE).min(n));
            squares = squares + piece.clone().mul(piece).sum();
        }
    }
    let total = if stage == 0 {
        squares
    } else {
        let total = flat.all_reduce(squares, ReduceOp::Sum)?;
        flat.wait()?;
        total
    };
    Ok(f64::from(total.into_scalar().elem::<f32>()).sqrt())
}

/// The L2 norm of the whole gradient from this rank's Σ g² of its partition in host memory
/// (partitions are disjoint, so the sums add up).
fn host_norm(comm: &dyn Communicator, squares: f64) -> Result<f64, CommError> {
    let mut total = [squares as f32];
    comm.all_reduce((&mut total[..]).into(), ReduceOp::Sum)?;
    Ok(f64::from(total[0]).sqrt())
}

/// `t` followed by zeros (of its dtype) up to `len` elements.
fn zero_padded<I: Backend>(t: Tensor<I, 1>, len: usize) -> Tensor<I, 1> {
    let padding = len - t.dims()[0];
    if padding == 0 {
        return t;
    }
    let zeros = Tensor::zeros([padding], (&t.device(), t.dtype()));
    Tensor::cat(vec![t, zeros], 0)
}
