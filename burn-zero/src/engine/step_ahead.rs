//! ZeRO-Offload's optimizer overlapped with backward (`burn_zero.cpu_adam.step_ahead`): at
//! stages 2 and 3 with the optimizer in host memory, each sub-group is stepped by CPU-Adam as
//! soon as the boundary backward has finished its gradient there (burn-offload's
//! [`burn_offload::StepAhead`]); `step` then steps what never finished early and sends every
//! sub-group's weights up. The arithmetic and its order are the serial step's: same bits.
//!
//! Only where a sub-group's step needs nothing but its own gradient: without
//! `gradient_clipping` (the global norm) and without fp16's loss scale. A non-finite gradient
//! still skips the step, but sub-groups stepped before it was seen keep their update (said in
//! a warning), as the serial step would not.

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::engine::{Engine, EngineError, ZeroAutodiff};
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
        let (lr, betas) = self.step_params().f32();
        let mut strategy = self.strategy();
        let Some(host) = strategy.grads_mut().host.as_mut() else {
            return Ok(());
        };
        // No loss scale, no clipping: the step's gradient scale is [1, 1].
        host.start_ahead(opt, lr, betas, [1.0, 1.0])
            .map_err(|e| EngineError::HostGradients(format!("stepping sub-groups ahead: {e}")))
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
