//! ZeRO-Offload's optimizer overlapped with backward (`burn_zero.cpu_adam.step_ahead`): at
//! stages 2 and 3 with the optimizer in host memory, each sub-group is stepped by CPU-Adam as
//! soon as the boundary backward has finished its gradient there (burn-offload's
//! [`burn_offload::StepAhead`]), and on CUDA its new weights go up at once into the step's
//! output tensors, made before backward; `step` then steps what never finished early and
//! sends the rest of the weights up. The arithmetic and its order are the serial step's: same
//! bits.
//!
//! Only where a sub-group's step needs nothing but its own gradient: without
//! `gradient_clipping` (the global norm) and without fp16's loss scale. A non-finite gradient
//! still skips the step, but sub-groups stepped before it was seen keep their update (said in
//! a warning), as the serial step would not.

use burn::module::Module;
use burn::tensor::backend::Backend;

use burn_offload::AheadError;

use super::engine::{Engine, EngineError, ZeroAutodiff};
use crate::comm::ReduceOp;
use crate::config::{OffloadDevice, ResolvedConfig};
use crate::optim::StepParams;

/// Whether an engine steps sub-groups ahead, and why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StepAheadPlan {
    /// Each boundary backward steps its finished sub-groups.
    On,
    /// Never, for this reason (`None`: the optimizer is not offloaded at stage 2 or 3).
    Off(Option<&'static str>),
}

impl StepAheadPlan {
    /// The plan `config` allows.
    pub(crate) fn of(config: &ResolvedConfig) -> Self {
        let c = &config.config;
        let zero = &c.zero_optimization;
        let why = match zero.optimizer_offload() {
            OffloadDevice::None => return Self::Off(None),
            _ if zero.stage.number() < 2 => return Self::Off(None),
            _ if !c.burn_zero.cpu_adam.step_ahead => "burn_zero.cpu_adam.step_ahead is false",
            OffloadDevice::Nvme => "the optimizer state is in swap files, visited in order",
            _ if c.gradient_clipping > 0.0 => "gradient_clipping needs the global norm first",
            _ if c.fp16.enabled => "fp16's loss scale is checked for overflow first",
            OffloadDevice::Cpu => return Self::On,
        };
        Self::Off(Some(why))
    }

    /// The line a user reads at initialization (`None`: nothing to say).
    pub(crate) fn describe(&self) -> Option<String> {
        match self {
            Self::On => Some(
                "offloaded optimizer: each sub-group steps as soon as backward has finished its \
                 gradient (burn_zero.cpu_adam.step_ahead)"
                    .into(),
            ),
            Self::Off(Some(why)) => Some(format!(
                "offloaded optimizer: sub-groups step after backward ({why})"
            )),
            Self::Off(None) => None,
        }
    }
}

impl<I: Backend, M: Module<ZeroAutodiff<I>>> Engine<I, M> {
    /// The learning rate and betas of the step to come.
    pub(super) fn step_params(&self) -> StepParams {
        StepParams {
            lr: self.scheduler.lr(),
            betas: self.scheduler.betas().unwrap_or({
                let [b1, b2] = self.resolved.optimizer_params.betas;
                (b1, b2)
            }),
        }
    }

    /// Before a boundary backward: starts stepping its sub-groups as they finish.
    pub(super) fn start_step_ahead(&mut self) -> Result<(), EngineError> {
        if self.step_ahead != StepAheadPlan::On {
            return Ok(());
        }
        let Some(opt) = self.optim.host() else {
            return Ok(());
        };
        let refuse = |e| match e {
            AheadError::Open => EngineError::Usage(
                "a second backward at an accumulation boundary without `step` between: the \
                 first one's sub-groups were stepped ahead (cpu_adam.step_ahead); call `step`, \
                 or set step_ahead false to accumulate them"
                    .into(),
            ),
            e => EngineError::HostGradients(format!("stepping sub-groups ahead: {e}")),
        };
        // Before anything is aimed: the open step's outputs may still be receiving weights.
        if opt.lock().unwrap_or_else(|e| e.into_inner()).has_ahead() {
            return Err(refuse(AheadError::Open));
        }
        let (lr, betas) = self.step_params().f32();
        let strategy = self.strategy.clone();
        let mut strategy = strategy.lock().expect("strategy");
        if strategy.grads_mut().host.is_none() {
            return Ok(());
        }
        // The step's weights in the format `step` writes them. Offloaded parameters end in
        // host memory: nothing to send up ahead of the step.
        let compute = self.step_format(strategy.master_backed());
        let sink = match self.resolved.config.zero_optimization.param_offload() {
            OffloadDevice::None => self.optim.aim_ahead(compute)?,
            _ => None,
        };
        let host = strategy.grads_mut().host.as_mut().expect("checked above");
        // No loss scale, no clipping: the step's gradient scale is [1, 1].
        host.start_ahead(opt, (lr, betas, [1.0, 1.0]), sink)
            .map_err(refuse)
    }

    /// Stops a thread still stepping ahead and waits for it (also when the engine goes: it
    /// may be sending weights into outputs the optimizer state owns, which are dropped before
    /// the hook that holds the thread).
    pub(super) fn join_step_ahead(&mut self) {
        let strategy = self.strategy.clone();
        let mut strategy = strategy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(host) = strategy.grads_mut().host.as_mut() {
            host.cancel_ahead();
        }
    }

    /// After a boundary backward that failed: stops stepping ahead and closes the step. The
    /// sub-groups already stepped (their gradients were final) keep their update; their
    /// weights go up with the next step's.
    pub(super) fn cancel_step_ahead(&mut self) {
        self.join_step_ahead();
        let kept = self.optim.abandon_ahead();
        if kept > 0 {
            crate::log::warn(&format!(
                "rank {}: backward failed after {kept} sub-groups were stepped ahead from its \
                 finished gradients; they keep that update",
                self.comm.rank()
            ));
        }
    }

    /// At a step whose gradients overflowed (every rank sees it): whether any rank has
    /// stepped sub-groups ahead already. If so (the largest count is returned), every rank's
    /// step goes on stepping nothing more, so the ranks keep one step count and meet in the
    /// same collectives; if not, the step begun ahead never happened.
    pub(super) fn overflow_after_step_ahead(&mut self) -> Result<usize, EngineError> {
        if self.step_ahead != StepAheadPlan::On {
            return Ok(0);
        }
        let mut most = [self.optim.stepped_ahead() as f32];
        self.comm
            .all_reduce(most.as_mut_slice().into(), ReduceOp::Max)?;
        if most[0] > 0.0 {
            self.optim.skip_rest_ahead(self.step_params())?;
        } else {
            self.optim.abandon_ahead();
        }
        Ok(most[0] as usize)
    }

    /// Refuses `what` (reading the master: a checkpoint, full parameters) between a
    /// backward and its step once sub-groups were stepped ahead: the master is half stepped.
    pub(super) fn refuse_while_ahead(&self, what: &str) -> Result<(), EngineError> {
        self.settle_step_ahead();
        match self.optim.stepped_ahead() {
            0 => Ok(()),
            n => Err(EngineError::Usage(format!(
                "{what} between `backward` and `step` after {n} sub-groups were stepped ahead \
                 (cpu_adam.step_ahead): call `step` first"
            ))),
        }
    }

    /// Waits for the sub-groups stepped ahead, so the gradient partition is whole to read.
    pub(super) fn settle_step_ahead(&self) {
        if let Some(host) = self.strategy().grads_mut().host.as_mut() {
            host.settle_ahead();
        }
    }

    /// At the step: waits for the sub-groups stepped ahead and counts them.
    pub(super) fn finish_step_ahead(&mut self) -> Result<(), EngineError> {
        let report = self
            .strategy()
            .grads_mut()
            .host
            .as_mut()
            .and_then(|h| h.finish_ahead());
        let Some(report) = report else {
            return Ok(());
        };
        self.optim.add_ahead(&report);
        match report.failure {
            Some(e) => Err(EngineError::HostGradients(format!(
                "stepping sub-groups ahead: {e}"
            ))),
            None => Ok(()),
        }
    }
}
