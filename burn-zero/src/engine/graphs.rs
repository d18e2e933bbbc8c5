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
//!
//! On more than one rank the gradient buffer's collectives are ordered by CUDA events
//! (`FlatComm::order_by_events`), which a capture follows into NCCL's stream: the graph holds
//! them, beside the compute as in an eager step.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::engine::{Engine, EngineError, ZeroAutodiff};
use super::grads::BackwardState;
use crate::config::{GemmOrder, ZeroStage};
use crate::graph::{GraphAction, GraphKey, StepError, StepGraphs};

/// The graph stream slot of engines' steps (`crate::graph`).
const ENGINE_SLOT: u8 = 0;

/// What a captured forward and backward returns, and what its replays return again.
#[derive(Clone)]
pub(super) struct Replayed<I: Backend> {
    loss: Tensor<ZeroAutodiff<I>, 1>,
    /// The gradient buffer's host side before the backward (its pieces are what a replay
    /// reads when it adds into them) and after it (what a replay leaves).
    before: BackwardState<I>,
    after: BackwardState<I>,
}

/// An engine's graphs and the model whose parameters they read; `None` in `steps` when graphs
/// are off for the engine (the reason was logged once).
pub(super) struct EngineGraphs<I: Backend, M> {
    steps: Option<StepGraphs<ZeroAutodiff<I>, Replayed<I>>>,
    pinned: Option<M>,
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// Runs one micro-step's forward, `loss_of(model, inputs)`, and its backward, as
    /// [`Engine::backward`] after the caller's forward would; returns the loss (detached, as
    /// `loss_of` computed it). With `burn_zero.cuda_graphs.enabled` on CUDA the two are
    /// captured as a CUDA graph after a warm-up and replayed: `loss_of` then runs only while a
    /// step of a new key is warmed up or captured, and must compute the loss from `inputs` and
    /// the model alone (no host reads, no random numbers; what it captures from its
    /// environment is frozen into the graph; see [`crate::graph`]).
    pub fn forward_backward<const D: usize, F>(
        &mut self,
        inputs: Vec<Tensor<ZeroAutodiff<I>, D, Int>>,
        loss_of: F,
    ) -> Result<Tensor<ZeroAutodiff<I>, 1>, EngineError>
    where
        F: FnOnce(&M, Vec<Tensor<ZeroAutodiff<I>, D, Int>>) -> Tensor<ZeroAutodiff<I>, 1>,
    {
        super::device_failure::check()?;
        let mut graphs = match self.graphs.take() {
            Some(graphs) => graphs,
            None => {
                let graphs = self.start_graphs();
                // A capture follows events into NCCL's stream, not flags; for every step, so
                // warm-ups and captures do the same work.
                if graphs.steps.is_some() {
                    self.strategy().grads_mut().flat.order_by_events(true);
                }
                graphs
            }
        };
        let Some(steps) = graphs.steps.as_mut() else {
            self.graphs = Some(graphs);
            return self.loss_then_backward(loss_of, inputs);
        };
        let key =
            StepGraphs::<ZeroAutodiff<I>, Replayed<I>>::key::<D, F>(&self.graph_variant(), &inputs);
        // A graph that adds into the gradient buffer read the pieces the micro-step before it
        // left at its capture: replayed only where they are the buffer's pieces now.
        if steps.would_replay(&key) && !self.grads_as_captured(steps, &key) {
            steps.forget(&key);
        }
        let start = std::time::Instant::now();
        let ran = steps.run(key, inputs, |inputs| {
            let before = self.strategy().grads().backward_state().reads();
            let loss = self.loss_then_backward(loss_of, inputs)?;
            let after = self.strategy().grads().backward_state();
            Ok(Replayed {
                loss,
                before,
                after,
            })
        });
        let result = match ran {
            Ok((out, action)) => {
                self.after_graph_action(&mut graphs, action, &out, start);
                Ok(match action {
                    // Eager runs return the caller's own tensor.
                    GraphAction::Eager => out.loss,
                    // Others live in the graphs' memory, which a replay rewrites.
                    _ => out.loss.mul_scalar(1.0),
                })
            }
            Err(StepError::Step(e)) => Err(e),
            Err(StepError::Graph(e)) => {
                // The micro-step's work did not run: the accumulation window's gradients are
                // incomplete, so they go (the caller may redo the window or stop).
                self.strategy().grads_mut().clear();
                Err(EngineError::Device(format!(
                    "{e}; the accumulation window's gradients were dropped \
                     (burn_zero.cuda_graphs.enabled false turns graphs off)"
                )))
            }
        };
        self.graphs = Some(graphs);
        result
    }

    /// `loss_of`'s forward and [`Engine::backward`], returning the detached loss.
    fn loss_then_backward<const D: usize, F>(
        &mut self,
        loss_of: F,
        inputs: Vec<Tensor<ZeroAutodiff<I>, D, Int>>,
    ) -> Result<Tensor<ZeroAutodiff<I>, 1>, EngineError>
    where
        F: FnOnce(&M, Vec<Tensor<ZeroAutodiff<I>, D, Int>>) -> Tensor<ZeroAutodiff<I>, 1>,
    {
        let loss = loss_of(self.model(), inputs);
        let out = loss.clone().detach();
        self.backward(loss)?;
        Ok(out)
    }

    /// The engine's graphs: none when they are off, or (saying why, once) when its steps
    /// cannot be captured.
    fn start_graphs(&self) -> EngineGraphs<I, M> {
        let settings = self.resolved.config.burn_zero.cuda_graphs;
        let steps = match (settings.enabled, self.graphs_refused()) {
            (true, None) => Some(StepGraphs::new(
                self.device.clone(),
                ENGINE_SLOT,
                settings.warmup,
                settings.max_graphs,
            )),
            (true, Some(why)) => {
                crate::log::warn(&format!("burn_zero.cuda_graphs: steps run eagerly: {why}"));
                None
            }
            (false, _) => None,
        };
        EngineGraphs {
            steps,
            pinned: None,
        }
    }

    /// Whether the gradient buffer holds what `key`'s graph found at its capture: nothing
    /// written (a first micro-step, whose gradients are copied in), or the same pieces with the
    /// same elements written.
    fn grads_as_captured(
        &self,
        steps: &StepGraphs<ZeroAutodiff<I>, Replayed<I>>,
        key: &GraphKey,
    ) -> bool {
        let Some(captured) = steps.captured_out(key) else {
            return false;
        };
        let strategy = self.strategy();
        let now = strategy.grads().backward_state();
        now.matches(&captured.before)
    }

    /// The host side of what `action` did.
    fn after_graph_action(
        &mut self,
        graphs: &mut EngineGraphs<I, M>,
        action: GraphAction,
        out: &Replayed<I>,
        start: std::time::Instant,
    ) {
        match action {
            GraphAction::Capture if graphs.pinned.is_none() => {
                graphs.pinned = Some(self.model().clone());
            }
            GraphAction::Replay => {
                self.timings.forward += start - self.last_step_end;
                self.timings.backward += start.elapsed();
                let boundary = self.is_gradient_accumulation_boundary();
                let mut strategy = self.strategy();
                let grads = strategy.grads_mut();
                grads.boundary = boundary;
                grads.restore_backward(&out.after);
            }
            _ => {}
        }
    }

    /// Whether captured graphs write into the gradient buffer's pieces: they are then zeroed
    /// where they lie after a step, not replaced.
    pub(super) fn graphs_hold_grads(&self) -> bool {
        self.graphs.as_ref().is_some_and(|g| g.pinned.is_some())
    }

    /// Why this engine's steps cannot be captured, if they cannot.
    fn graphs_refused(&self) -> Option<String> {
        let settings = &self.resolved.config;
        let strategy = self.strategy();
        let reason = if self.comm.world_size() > 1
            && (self.comm.device().is_none() || settings.burn_zero.host_collectives)
        {
            "collectives through host memory (a graph holds only NCCL's device collectives)"
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
        } else if settings.burn_zero.matmul.order == GemmOrder::Handshake {
            "matmul.order \"handshake\" (cuBLASLt's stream is not captured)"
        } else {
            return None;
        };
        Some(reason.into())
    }

    /// What besides the inputs' shapes a step's kernels depend on: its place in the
    /// accumulation window and the loss scale's bits (both folded into the graph).
    fn graph_variant(&self) -> [u64; 2] {
        let gas = self.resolved.batch.gradient_accumulation_steps.max(1);
        let place = (self.micro_steps % gas) as u64;
        let scale = match self.precision.scales() {
            true => self.precision.scaler.scale().to_bits(),
            false => 0,
        };
        [place, scale]
    }

    /// After the optimizer's step: the new parameters' values copied into the memory the
    /// graphs read. Returns the model that holds that memory, or `None` when no graph was
    /// captured (the new model stands).
    pub(super) fn pin_params(&mut self, model: &M) -> Result<Option<M>, EngineError> {
        let start = std::time::Instant::now();
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(None);
        };
        let Some(pinned) = graphs.pinned.as_ref() else {
            return Ok(None);
        };
        let from = primitives(model);
        let into = primitives(pinned);
        if from.len() != into.len() {
            return Err(EngineError::Usage(format!(
                "the model has {} parameters, its captured step {}: the model changed since \
                 its step was captured",
                from.len(),
                into.len()
            )));
        }
        let pairs: Vec<_> = from.iter().zip(&into).map(|(f, i)| (&**f, &**i)).collect();
        crate::graph::copy_values(&pairs).map_err(|e| {
            EngineError::Device(format!("copying the new parameters for the graphs: {e}"))
        })?;
        let pinned = pinned.clone();
        if let Some(steps) = graphs.steps.as_mut() {
            steps.add_pin_time(start.elapsed());
        }
        Ok(Some(pinned))
    }

    /// Drops every graph and the model they read (after a failure that left them unusable).
    pub(super) fn drop_graphs(&mut self) {
        if let Some(graphs) = self.graphs.as_mut() {
            if let Some(steps) = graphs.steps.as_mut() {
                steps.reset();
            }
            graphs.pinned = None;
        }
    }

    /// The graphs' host time since the last call (`None` until a step went through
    /// [`Engine::forward_backward`] with graphs on).
    pub fn take_graph_timings(&mut self) -> Option<crate::graph::GraphTimings> {
        self.graphs
            .as_mut()
            .and_then(|g| g.steps.as_mut())
            .map(|s| s.take_timings())
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
