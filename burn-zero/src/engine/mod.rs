//! The training engine: `burn_zero::initialize(model, config, comm)`, DeepSpeed style.
//!
//! The user runs their own forward on [`Engine::model`], then [`Engine::backward`] and
//! [`Engine::step`] every micro-step. The engine reduces gradients as autodiff finalizes them
//! (through `ZeroBackend`'s gradient hook), clips by the global norm across all shards, updates
//! this rank's partition of the flattened parameters, and all-gathers the result (stages 1–2).
//!
//! Partitions, gradients and optimizer state are flat f32 host buffers in this version; the
//! model's parameters stay on the inner backend's device.

mod grads;
mod memory;
mod params;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

pub use memory::{Estimate, MemoryReport, estimate_model_states, format_estimates};
pub use params::{FlatLayout, ParamSlot, host_values, read_params, write_params};

use crate::ZeroBackend;
use crate::backend::hooks::{self, HookGuard};
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::config::{ConfigError, DeepSpeedConfig, ResolvedConfig};
use crate::optim::{FlatOptimizer, StepParams};
use crate::partition::{PartitionPlan, all_gather_in_pieces};
use crate::schedule::Scheduler;
use grads::{EngineHook, GradState};

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
    /// The engine was used out of order.
    #[error("{0}")]
    Usage(String),
}

/// Seconds spent in the engine's phases since the last report (`wall_clock_breakdown`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// In `backward`, reduction included.
    pub backward: Duration,
    /// In `step` at the boundary: clipping, optimizer, all-gather, parameter rebuild.
    pub step: Duration,
}

/// A model being trained data-parallel with ZeRO stage 0, 1 or 2.
pub struct Engine<I: Backend, M: Module<ZeroAutodiff<I>>> {
    model: Option<M>,
    comm: Arc<dyn Communicator>,
    resolved: ResolvedConfig,
    layout: Arc<FlatLayout>,
    plan: PartitionPlan,
    grads: Arc<Mutex<GradState>>,
    optimizer: FlatOptimizer,
    scheduler: Scheduler,
    micro_steps: usize,
    global_steps: usize,
    last_grad_norm: Option<f64>,
    timings: Timings,
    _hook: HookGuard<I>,
}

/// Builds an engine for `model` from `config` over `comm` (DeepSpeed's `deepspeed.initialize`).
///
/// Every rank must call it with the same model structure; rank 0's parameter values are
/// broadcast to all. Must be called on the thread that will run `backward` (the gradient hook
/// is per thread).
pub fn initialize<I: Backend, M: Module<ZeroAutodiff<I>>>(
    model: M,
    config: &DeepSpeedConfig,
    comm: Arc<dyn Communicator>,
) -> Result<Engine<I, M>, EngineError> {
    if hooks::is_installed::<I>() {
        return Err(EngineError::Usage(
            "another engine (or gradient hook) is active on this thread for this backend; \
             drop it before initializing a new one"
                .into(),
        ));
    }
    let resolved = config.resolve(comm.world_size())?;
    if comm.rank() == 0 {
        resolved.warnings.iter().for_each(|w| crate::log::warn(w));
        let json = serde_json::to_string(&resolved).unwrap_or_default();
        crate::log::info(&format!("resolved config: {json}"));
    }
    let zero = &resolved.config.zero_optimization;
    let stage = zero.stage;
    let layout = Arc::new(FlatLayout::of(&model));
    let world = comm.world_size();
    let plan = if stage == 0 {
        PartitionPlan::new(layout.numel(), 1)
    } else {
        PartitionPlan::aligned(layout.numel(), world, PARTITION_ALIGN)
    };

    let mut flat = vec![0.0f32; layout.numel()];
    read_params(&model, &layout, 0, &mut flat);
    comm.broadcast(flat.as_mut_slice().into(), 0)?;
    let model = hooks::mark_distributed(write_params(model, &layout, &flat));

    let owned = owned_range(&plan, stage, comm.rank());
    let optimizer = FlatOptimizer::new(resolved.optimizer, &resolved.optimizer_params, owned.len());
    let grads = Arc::new(Mutex::new(GradState::new(
        layout.clone(),
        plan,
        comm.clone(),
        stage,
        zero.reduce_bucket_size.get(),
        zero.overlap_comm(),
    )));
    let hook = hooks::install::<I>(Box::new(EngineHook {
        state: grads.clone(),
        _inner: core::marker::PhantomData,
    }));
    Ok(Engine {
        model: Some(model),
        scheduler: Scheduler::new(resolved.schedule.clone()),
        comm,
        resolved,
        layout,
        plan,
        grads,
        optimizer,
        micro_steps: 0,
        global_steps: 0,
        last_grad_norm: None,
        timings: Timings::default(),
        _hook: hook,
    })
}

/// The elements of the flat buffer whose optimizer state `rank` holds.
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

    /// The trained model.
    pub fn into_model(mut self) -> M {
        self.model
            .take()
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
        std::mem::take(&mut self.timings)
    }

    /// Bytes this rank holds for parameters, gradients, optimizer state and communication.
    pub fn memory_report(&self) -> MemoryReport {
        let state = self.state();
        MemoryReport {
            parameters: 4 * self.layout.numel(),
            gradients: state.gradient_bytes(),
            optimizer_state: self.optimizer.state_bytes(),
            communication_buffers: state.comm_buffer_bytes(),
        }
    }

    fn state(&self) -> MutexGuard<'_, GradState> {
        self.grads.lock().expect("gradient state")
    }

    /// Backpropagates `loss` (this rank's micro-batch loss). Gradients are scaled by
    /// 1/`gradient_accumulation_steps` and reduced across ranks as the stage requires.
    pub fn backward(&mut self, loss: Tensor<ZeroAutodiff<I>, 1>) -> Result<(), EngineError> {
        let start = Instant::now();
        let boundary = self.is_gradient_accumulation_boundary();
        self.state().boundary = boundary;
        let gas = self.resolved.batch.gradient_accumulation_steps;
        let loss = if gas > 1 {
            loss.div_scalar(gas as f32)
        } else {
            loss
        };
        drop(loss.backward());
        let mut state = self.state();
        if let Some(failure) = state.failure.take() {
            return Err(failure.into());
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
        if !self.is_gradient_accumulation_boundary() {
            self.micro_steps += 1;
            return Ok(());
        }
        let start = Instant::now();
        let stage = self.resolved.config.zero_optimization.stage;
        let rank = self.comm.rank();
        let owned = owned_range(&self.plan, stage, rank);
        let mut params = vec![0.0f32; self.plan.chunk()];
        read_params(
            self.model(),
            &self.layout,
            owned.start,
            &mut params[..owned.len()],
        );

        let grads = self.grads.clone();
        let mut state = grads.lock().expect("gradient state");
        let grad = match stage {
            0 | 2 => &mut state.buffer[..owned.len()],
            _ => &mut state.buffer[owned.clone()],
        };
        let norm = self.global_norm(grad, stage)?;
        self.last_grad_norm = Some(norm);
        let clip = self.resolved.config.gradient_clipping;
        if clip > 0.0 && norm + 1e-6 > clip {
            let coef = (clip / (norm + 1e-6)) as f32;
            grad.iter_mut().for_each(|g| *g *= coef);
        }
        let hp = StepParams {
            lr: self.scheduler.lr(),
            betas: self.scheduler.betas().unwrap_or({
                let [b1, b2] = self.resolved.optimizer_params.betas;
                (b1, b2)
            }),
        };
        self.optimizer.step(&mut params[..owned.len()], grad, hp);
        state.clear();
        drop(state);

        let flat = if stage == 0 {
            params
        } else {
            let mut full = vec![0.0f32; self.plan.padded_numel()];
            let piece = self
                .resolved
                .config
                .zero_optimization
                .allgather_bucket_size
                .get()
                / self.comm.world_size();
            all_gather_in_pieces(self.comm.as_ref(), &params, &mut full, piece)?;
            full.truncate(self.layout.numel());
            full
        };
        let model = self.model.take().expect("model");
        self.model = Some(hooks::mark_distributed(write_params(
            model,
            &self.layout,
            &flat,
        )));

        self.scheduler.step();
        self.global_steps += 1;
        self.micro_steps += 1;
        self.timings.step += start.elapsed();
        self.report_progress();
        Ok(())
    }

    /// The L2 norm of the whole gradient: this rank's share summed across ranks for stages
    /// that partition (equal to the unsharded norm; padding is zero).
    fn global_norm(&self, grad: &[f32], stage: u8) -> Result<f64, EngineError> {
        let local: f64 = grad.iter().map(|g| f64::from(*g) * f64::from(*g)).sum();
        if stage == 0 {
            return Ok(local.sqrt());
        }
        let mut total = [local as f32];
        self.comm
            .all_reduce(total.as_mut_slice().into(), ReduceOp::Sum)?;
        Ok(f64::from(total[0]).sqrt())
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
            line += &format!(
                " | last {every} steps: backward {:.1} ms, step {:.1} ms",
                t.backward.as_secs_f64() * 1e3,
                t.step.as_secs_f64() * 1e3
            );
        }
        crate::log::info(&line);
    }
}
