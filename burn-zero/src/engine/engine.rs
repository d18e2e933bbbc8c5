//! The engine: the user runs their own forward on [`Engine::model`], then [`Engine::backward`]
//! and [`Engine::step`] every micro-step. The engine reduces gradients as autodiff finalizes
//! them (through `ZeroBackend`'s gradient hook, handing them to the stage's strategy), clips by
//! the global norm across all shards, updates this rank's partition and publishes the new
//! parameters, the same fixed loop at every stage.
//!
//! Partitions, gradients and optimizer state are flat tensors of the inner backend, on the
//! model's device; with an NCCL communicator the collectives run on their device memory
//! (see `collective`).

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, FloatDType, Tensor};

use super::device_failure;
use super::offload_io::GradSource;
use super::optim_state::Optim;
use super::params::rebuild_params_as;
use super::precision::{Format, Precision};
use super::stage::{GatherStats, Held, ParamSource, Strategy};
use super::step_ahead::StepAheadPlan;
use super::{FlatLayout, MemoryReport, OffloadTimings, ParamSlot};
use crate::ZeroBackend;
#[cfg(feature = "zero3")]
use crate::backend::GathererGuard;
use crate::backend::hooks::{self, HookGuard};
use crate::backend::settings::SettingsGuard;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::config::{ConfigError, ResolvedConfig};
use crate::schedule::Scheduler;

/// The autodiff backend the engine trains on.
pub type ZeroAutodiff<I> = Autodiff<ZeroBackend<I>>;

/// Elements every partition is a multiple of (16 bytes of f32).
pub(crate) const PARTITION_ALIGN: usize = 4;

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
    pub(super) model: Option<M>,
    pub(super) comm: Arc<dyn Communicator>,
    pub(super) resolved: ResolvedConfig,
    pub(super) layout: Arc<FlatLayout>,
    /// The stage's strategy, shared with the gradient hook (and stage 3's gatherer).
    pub(super) strategy: Arc<Mutex<dyn Strategy<I>>>,
    /// This rank's fp32 partition of the parameters (the optimizer's master copy) and the
    /// optimizer state, on the device or offloaded.
    pub(super) optim: Optim<I>,
    pub(super) scheduler: Scheduler,
    /// Elements of the frozen parameters (not in `layout`).
    pub(super) frozen_params: usize,
    pub(super) micro_steps: usize,
    pub(super) global_steps: usize,
    pub(super) last_grad_norm: Option<f64>,
    pub(super) timings: Timings,
    pub(super) precision: Precision,
    pub(super) _hook: HookGuard<I>,
    #[cfg(feature = "zero3")]
    pub(super) _gatherer: Option<GathererGuard<I>>,
    /// This engine's op settings on its thread ([`crate::backend::settings`]).
    pub(super) _op_settings: SettingsGuard,
    /// `flops_profiler`: the profile being taken, and the last one taken.
    pub(super) profile: Option<super::profile::ProfileRun>,
    pub(super) last_profile: Option<crate::profile::Profile>,
    /// When the last `step` (or initialization) returned: forward time is measured from it.
    pub(super) last_step_end: Instant,
    /// The device of the model's parameters.
    pub(super) device: I::Device,
    /// Whether offloaded sub-groups step during backward (`step_ahead`).
    pub(super) step_ahead: StepAheadPlan,
    /// The steps captured as CUDA graphs (`burn_zero.cuda_graphs`), once a step asked.
    pub(super) graphs: Option<super::graphs::EngineGraphs<I, M>>,
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Drop for Engine<I, M> {
    fn drop(&mut self) {
        if self.step_ahead == StepAheadPlan::On {
            self.join_step_ahead();
        }
        // First the graphs: one that captured NCCL's calls holds its communicator, whose
        // destruction waits until every such graph is gone (it would hang on them otherwise).
        self.graphs = None;
    }
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// The format the step writes the new weights in: none but the master where the
    /// parameters are chunks of it (`master_backed`, ZeRO-3), the compute format otherwise.
    pub(super) fn step_format(&self, master_backed: bool) -> Format {
        match master_backed {
            true => Format::F32,
            false => self.precision.compute,
        }
    }

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
        let reduce = std::mem::take(&mut self.strategy().grads_mut().comm_time);
        self.timings.reduce = reduce;
        std::mem::take(&mut self.timings)
    }

    /// Bytes this rank holds for parameters (their working copy: 2 per element in bf16/fp16
    /// where the backend has the dtype; none for ZeRO-3 partitions that are chunks of the
    /// master), gradients, optimizer state (fp32 master included) and communication buffers.
    pub fn memory_report(&self) -> MemoryReport {
        let strategy = self.strategy();
        let (params, host_params) = strategy.param_numel();
        let grads = strategy.grads();
        MemoryReport {
            parameters: self.precision.compute.storage().size() * params + 4 * self.frozen_params,
            gradients: grads.gradient_bytes(),
            optimizer_state: self.optim.device_bytes(),
            host_optimizer_state: self.optim.host_bytes(),
            host_parameters: self.precision.compute.storage().size() * host_params,
            host_gradients: grads.host_gradient_bytes(),
            communication_buffers: strategy.comm_buffer_bytes(),
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
        self.strategy().gather_stats()
    }

    /// Where offloaded optimizer steps spent their time since the last call (`None` unless
    /// `offload_optimizer` is on).
    pub fn take_offload_timings(&mut self) -> Option<OffloadTimings> {
        let mut timings = self.optim.take_timings()?;
        if let Some(host) = &self.strategy().grads().host {
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
        self.strategy().grads().flat.device_calls
    }

    pub(super) fn strategy(&self) -> MutexGuard<'_, dyn Strategy<I> + 'static> {
        self.strategy.lock().expect("strategy")
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
            let mut strategy = self.strategy();
            let grads = strategy.grads_mut();
            grads.boundary = boundary;
            grads.skip_reduce = skip_reduce;
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
        if boundary {
            self.start_step_ahead()?;
        }
        let ran = self.run_backward(loss, profiled);
        if ran.is_err() && boundary {
            self.cancel_step_ahead();
        }
        ran?;
        if !boundary {
            // burn consumes the marks in backward; the next micro-step needs them again.
            let model = self.model.take().expect("model");
            self.model = Some(hooks::mark_distributed(model));
        }
        self.timings.backward += start.elapsed();
        Ok(())
    }

    /// Backpropagates the scaled `loss` and checks that gradients arrived.
    fn run_backward(
        &mut self,
        loss: Tensor<ZeroAutodiff<I>, 1>,
        profiled: Option<Instant>,
    ) -> Result<(), EngineError> {
        // The forward's freed temporaries go back before backward allocates (and backward's
        // before the step): pages cached for one phase's sizes do not hold the next's.
        self.release_cached_memory();
        drop(loss.backward());
        self.release_cached_memory();
        self.profile_backward_end(profiled);
        device_failure::check()?;
        let mut strategy = self.strategy();
        let grads = strategy.grads_mut();
        if let Some(failure) = grads.failure.take() {
            return Err(failure.into());
        }
        if let Some(failure) = grads.host_failure.take() {
            return Err(EngineError::HostGradients(failure));
        }
        if grads.seen == 0 {
            return Err(EngineError::Usage(
                "no parameter gradient reached the engine: compute the loss from `engine.model()` \
                 (a model cloned before the last `backward`/`step` is not tracked)"
                    .into(),
            ));
        }
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
        if self.step_ahead == StepAheadPlan::On {
            let finished = self.finish_step_ahead();
            self.agree("step sub-groups ahead", finished)?;
        }
        let strategy = self.strategy.clone();
        let mut strategy = strategy.lock().expect("strategy");
        // In the buffer's pieces: a large partition is more than one device buffer may hold.
        let scale = self
            .precision
            .scales()
            .then(|| self.precision.scaler.scale());
        // Offloaded at stage 2 and up, the gradient is in host memory (`None` here).
        let range = strategy.step_range();
        let grads = strategy.grads();
        let grad: Option<Vec<Tensor<I, 1>>> = grads.host.is_none().then(|| {
            grads
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
        let norm = match &grad {
            Some(grad) => global_norm(
                &mut *strategy,
                grad,
                self.resolved.config.burn_zero.deterministic,
            )?,
            None => {
                let grads = strategy.grads();
                let host = grads.host.as_ref().expect("gradients are in host memory");
                let squares = host.grads().sum_of_squares();
                let unscale = scale.map_or(1.0, |s| s * s);
                host_norm(grads.flat.comm(), squares / unscale)?
            }
        };
        self.last_grad_norm = Some(norm);
        // The norm is reduced across ranks: inf or NaN anywhere overflows everywhere.
        let update = self.precision.scaler.update(!norm.is_finite())?;
        // Sub-groups stepped ahead of an overflowing step (on any rank) keep their update:
        // every rank's step goes on to send its weights up, stepping nothing more.
        let kept = match update.skipped() {
            true => self.overflow_after_step_ahead()?,
            false => 0,
        };
        if kept > 0 {
            self.precision.skipped += 1;
            crate::log::warn(&format!(
                "step {}: gradients overflowed (norm {norm}); step skipped, but for the \
                 {} sub-groups rank {} had stepped ahead of the overflow (cpu_adam.step_ahead)",
                self.global_steps + 1,
                self.optim.stepped_ahead(),
                self.comm.rank()
            ));
        }
        if update.skipped() && kept == 0 {
            strategy.grads_mut().clear();
            drop(strategy);
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
        let hp = self.step_params();
        self.release_params(&mut *strategy)?;
        let compute = self.step_format(strategy.master_backed());
        let working = match grad {
            // Clipped inside the optimizer's update (no pass of its own where it is fused).
            Some(grad) => {
                self.optim
                    .step(GradSource::Device(grad), hp, compute, factor.unwrap_or(1.0))
            }
            None => {
                // ZeRO-Infinity: the new parameters straight into their host buffer, if any (a
                // failure is agreed on below, with the step's).
                let direct = match self.optim.steps_into_host() {
                    true => strategy.direct_outs(super::offload_io::out_dtype(compute)),
                    false => Ok(None),
                };
                let grads = strategy.grads();
                let mut host = grads.host.as_ref().expect("checked above").grads();
                // Multiplying by a power-of-two loss scale's inverse divides exactly.
                let unscale = scale.map_or(1.0, |s| 1.0 / s as f32);
                let source = GradSource::Host {
                    grads: &mut host,
                    scale: [unscale, factor.unwrap_or(1.0)],
                };
                match direct {
                    Ok(Some(outs)) => self.optim.step_into(source, hp, outs),
                    Ok(None) => self.optim.step(source, hp, compute, 1.0),
                    Err(e) => Err(e),
                }
            }
        };
        // A failing swap on one rank must not leave the others waiting in the gathers below.
        let working = match self.optim.offloaded() {
            true => self.agree("step its offloaded optimizer", working)?,
            false => working?,
        };
        let zeroed = self.graphs_hold_grads() && strategy.grads_mut().zero_in_place();
        if !zeroed {
            strategy.grads_mut().clear();
        }
        self.publish(&mut *strategy, working)?;
        drop(strategy);

        if kept == 0 {
            self.scheduler.step();
        }
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

    /// Before the parameters are replaced ([`Engine::publish`]): where they are chunks of the
    /// master (ZeRO-3), the model's handles and the partitions let go of it so the fused step
    /// updates it in place, and the step writes no compute-format copy (each gather narrows
    /// its chunk instead); where they wait in host memory, of the buffer the new ones are
    /// written into. The model holds placeholders until `publish`; an error in between leaves
    /// it so (the step failed: train no further with it).
    pub(super) fn release_params(
        &mut self,
        strategy: &mut dyn Strategy<I>,
    ) -> Result<(), EngineError> {
        if let Some(mut placeholders) = strategy.release()? {
            let model = self.model.take().expect("model");
            self.model = Some(rebuild_from(model, &self.layout, &mut *placeholders));
        }
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

    /// This rank's fp32 master partition on the device (read back when offloaded).
    pub(super) fn master_partition(&self) -> Result<Tensor<I, 1>, EngineError> {
        self.optim.master()
    }

    /// Rebuilds the model's parameters from this rank's `working` partition (the master in the
    /// compute format, after a step or a load), or from the master itself where the
    /// strategy's parameters are chunks of it.
    pub(super) fn publish(
        &mut self,
        strategy: &mut dyn Strategy<I>,
        working: Vec<Tensor<I, 1>>,
    ) -> Result<(), EngineError> {
        let source = match strategy.master_backed() {
            true => vec![self.optim.master()?],
            false => working,
        };
        let mut params = strategy.publish(source)?;
        let model = self.model.take().expect("model");
        let model = rebuild_from(model, &self.layout, &mut *params);
        drop(params);
        let model = match self.pin_params(&model) {
            Ok(pinned) => pinned.unwrap_or(model),
            Err(e) => {
                // The new model stands; the graphs, which read the old memory, go.
                self.drop_graphs();
                self.model = Some(hooks::mark_distributed(model));
                return Err(e);
            }
        };
        self.model = Some(hooks::mark_distributed(model));
        Ok(())
    }

    /// Calls `f` with each parameter's full values from this rank's `partition` of `held`.
    pub(super) fn for_each_full(
        &self,
        partition: Tensor<I, 1>,
        held: Held,
        mut f: impl FnMut(&ParamSlot, Tensor<I, 1>),
    ) -> Result<(), EngineError> {
        self.strategy().for_each_full(partition, held, &mut f)
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

/// The L2 norm of the whole gradient: this rank's share summed across the ranks as the
/// strategy holds it (equal to the unsharded norm; padding is zero). `deterministic`: the
/// squares summed in a fixed order (burn-cuda's own sum adds with atomics).
fn global_norm<I: Backend>(
    strategy: &mut dyn Strategy<I>,
    grad: &[Tensor<I, 1>],
    deterministic: bool,
) -> Result<f64, CommError> {
    let device = strategy.grads().flat.device().clone();
    let squares = super::norm::sum_of_squares(grad, deterministic, &device);
    let total = strategy.total_squares(squares)?;
    Ok(f64::from(total.into_scalar().elem::<f32>()).sqrt())
}

/// Rebuilds every trainable parameter of `model` from `params`.
fn rebuild_from<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    layout: &FlatLayout,
    params: &mut dyn ParamSource<I>,
) -> M {
    let params = RefCell::new(params);
    rebuild_params_as(
        model,
        layout,
        |p| params.borrow_mut().param(p),
        |p, was| params.borrow_mut().require_grad(p, was),
    )
}

/// The L2 norm of the whole gradient from this rank's Σ g² of its partition in host memory
/// (partitions are disjoint, so the sums add up).
fn host_norm(comm: &dyn Communicator, squares: f64) -> Result<f64, CommError> {
    let mut total = [squares as f32];
    comm.all_reduce((&mut total[..]).into(), ReduceOp::Sum)?;
    Ok(f64::from(total[0]).sqrt())
}

/// `t` followed by zeros (of its dtype) up to `len` elements.
pub(crate) fn zero_padded<I: Backend>(t: Tensor<I, 1>, len: usize) -> Tensor<I, 1> {
    let padding = len - t.dims()[0];
    if padding == 0 {
        return t;
    }
    let zeros = Tensor::zeros([padding], (&t.device(), t.dtype()));
    Tensor::cat(vec![t, zeros], 0)
}
