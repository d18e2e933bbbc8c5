//! [`Engine::forward_backward`]: a micro-step's forward and backward in one call, which the
//! engine may capture as a CUDA graph and replay (`burn_zero.cuda_graphs`, [`crate::graph`]).
//!
//! What a replay must find as the capture left it, and how the engine keeps it so:
//! - the parameters' memory: after each optimizer step the new values are copied into the
//!   parameters the graphs read (the model at the first capture, `pinned`), and that model is
//!   the engine's model again;
//! - the gradient buffer's host side (its pieces and written elements, the parameters seen):
//!   taken after the captured backward and put back after each replay;
//! - host values folded into the kernels: the micro-step's place in the accumulation window and
//!   the loss scale are part of the graph's key, so a change captures a new graph.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::engine::{Engine, EngineError, ZeroAutodiff};
use super::grads::BackwardState;
use crate::config::ZeroStage;
use crate::graph::{GraphAction, StepGraphs};

/// The graph stream slot of engines' steps (`crate::graph`).
const ENGINE_SLOT: u8 = 0;

/// What a captured forward and backward returns, and what its replays return again.
#[derive(Clone)]
pub(super) struct Replayed<I: Backend> {
    loss: Tensor<ZeroAutodiff<I>, 1>,
    grads: BackwardState<I>,
}

/// An engine's graphs and the model whose parameters they read.
pub(super) struct EngineGraphs<I: Backend, M> {
    steps: StepGraphs<ZeroAutodiff<I>, Replayed<I>>,
    pinned: Option<M>,
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// Runs one micro-step's forward, `loss_of(model, inputs)`, and its backward, as
    /// [`Engine::backward`] after the caller's forward would; returns the loss (detached, as
    /// `loss_of` computed it). With `burn_zero.cuda_graphs.enabled` on CUDA the two are
    /// captured as a CUDA graph after a warm-up and replayed: `loss_of` then runs only while a
    /// step of a new input shape is captured, and must compute the loss from `inputs` and the
    /// model alone (no host reads, no random numbers; see [`crate::graph`]).
    pub fn forward_backward<const D: usize, F>(
        &mut self,
        inputs: Vec<Tensor<ZeroAutodiff<I>, D, Int>>,
        loss_of: F,
    ) -> Result<Tensor<ZeroAutodiff<I>, 1>, EngineError>
    where
        F: FnOnce(&M, Vec<Tensor<ZeroAutodiff<I>, D, Int>>) -> Tensor<ZeroAutodiff<I>, 1>,
    {
        if let Some(why) = self.graphs_refused() {
            if self.graphs.is_none() {
                if self.resolved.config.burn_zero.cuda_graphs.enabled {
                    crate::log::warn(&format!("burn_zero.cuda_graphs: steps run eagerly: {why}"));
                }
                self.graphs = Some(EngineGraphs {
                    steps: StepGraphs::new(self.device.clone(), ENGINE_SLOT, 1, 1, false),
                    pinned: None,
                });
            }
            let loss = loss_of(self.model(), inputs);
            let out = loss.clone().detach();
            self.backward(loss)?;
            return Ok(out);
        }
        let settings = self.resolved.config.burn_zero.cuda_graphs;
        let mut graphs = self.graphs.take().unwrap_or_else(|| EngineGraphs {
            steps: StepGraphs::new(
                self.device.clone(),
                ENGINE_SLOT,
                settings.warmup,
                settings.max_graphs,
                true,
            ),
            pinned: None,
        });
        let variant = self.graph_variant();
        let mut failure = None;
        let ran = graphs.steps.run(variant, inputs, |inputs| {
            let loss = loss_of(self.model(), inputs);
            let out = loss.clone().detach();
            if let Err(e) = self.backward(loss) {
                failure = Some(e);
            }
            Replayed {
                loss: out,
                grads: self.strategy().grads().backward_state(),
            }
        });
        let result = match ran {
            Err(e) => {
                // The step's work did not run; its key runs eagerly from now on.
                self.strategy().grads_mut().clear();
                Err(EngineError::Device(format!(
                    "capturing the step as a CUDA graph failed ({e}); this micro-step's \
                     gradients are dropped, and steps of its shape run eagerly from now on \
                     (burn_zero.cuda_graphs.enabled false turns graphs off)"
                )))
            }
            Ok((out, action)) => {
                if let Some(e) = failure {
                    Err(e)
                } else {
                    self.after_graph_action(&mut graphs, action, &out);
                    Ok(match action {
                        // Eager runs return the caller's own tensor.
                        GraphAction::Eager => out.loss,
                        // Others live in the graphs' memory, which a replay rewrites.
                        _ => out.loss.mul_scalar(1.0),
                    })
                }
            }
        };
        self.graphs = Some(graphs);
        result
    }

    /// The host side of what `action` did.
    fn after_graph_action(
        &mut self,
        graphs: &mut EngineGraphs<I, M>,
        action: GraphAction,
        out: &Replayed<I>,
    ) {
        match action {
            GraphAction::Capture if graphs.pinned.is_none() => {
                graphs.pinned = Some(self.model().clone());
            }
            GraphAction::Replay => {
                let boundary = self.is_gradient_accumulation_boundary();
                let mut strategy = self.strategy();
                let grads = strategy.grads_mut();
                grads.boundary = boundary;
                grads.restore_backward(&out.grads);
            }
            _ => {}
        }
    }

    /// Why this engine's steps cannot be captured, if they cannot.
    fn graphs_refused(&self) -> Option<String> {
        let settings = &self.resolved.config;
        if !settings.burn_zero.cuda_graphs.enabled {
            return Some("off".into());
        }
        let strategy = self.strategy();
        let reason = if self.comm.world_size() > 1 {
            "more than one rank (collectives are not captured yet)"
        } else if strategy.stage() == ZeroStage::Parameters {
            "ZeRO stage 3 (parameters are gathered during the step)"
        } else if strategy.grads().host.is_some() || self.optim.offloaded() {
            "the optimizer or gradients are offloaded"
        } else if self.optim.compresses_next_step() {
            "1-bit compression (its steps differ)"
        } else if settings.progressive_layer_drop.enabled {
            "progressive layer drop (its layers differ from step to step)"
        } else if settings.flops_profiler.enabled {
            "the FLOPs profiler (it synchronizes inside the step)"
        } else {
            return None;
        };
        Some(reason.into())
    }

    /// What besides the inputs' shapes a step's kernels depend on: its place in the
    /// accumulation window and the loss scale (both folded into the graph as constants).
    fn graph_variant(&self) -> u64 {
        let gas = self.resolved.batch.gradient_accumulation_steps.max(1);
        let place = (self.micro_steps % gas) as u64;
        let scale = match self.precision.scales() {
            true => self.precision.scaler.scale().to_bits(),
            false => 0,
        };
        place ^ scale.rotate_left(20)
    }

    /// After the optimizer's step: the new parameters' values copied into the memory the
    /// graphs read, and the model that holds it back in place. `model` is returned unchanged
    /// when no graph was captured.
    pub(super) fn pin_params(&mut self, model: M) -> Result<M, EngineError> {
        let start = std::time::Instant::now();
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(model);
        };
        let Some(pinned) = graphs.pinned.as_ref() else {
            return Ok(model);
        };
        let from = primitives(&model);
        let into = primitives(pinned);
        if from.len() != into.len() {
            return Err(EngineError::Usage(
                "the model's parameters changed since its step was captured".into(),
            ));
        }
        let pairs: Vec<_> = from.iter().zip(&into).map(|(f, i)| (&**f, &**i)).collect();
        crate::graph::copy_values(&pairs).map_err(|e| {
            EngineError::Device(format!("copying the new parameters for the graphs: {e}"))
        })?;
        let pinned = pinned.clone();
        graphs.steps.add_pin_time(start.elapsed());
        Ok(pinned)
    }

    /// The graphs' host time since the last call (`None` until a step went through
    /// [`Engine::forward_backward`]).
    pub fn take_graph_timings(&mut self) -> Option<crate::graph::GraphTimings> {
        self.graphs.as_mut().map(|g| g.steps.take_timings())
    }
}

/// Each float parameter's inner primitive (the `ZeroBackend` tensor), in visiting order.
fn primitives<I: Backend, M: Module<ZeroAutodiff<I>>>(module: &M) -> Vec<Box<dyn core::any::Any>> {
    struct Collect(Vec<Box<dyn core::any::Any>>);
    impl<I: Backend> ModuleVisitor<ZeroAutodiff<I>> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<ZeroAutodiff<I>, D>>) {
            let inner = param.val().inner().into_primitive().tensor();
            self.0.push(Box::new(inner));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}
