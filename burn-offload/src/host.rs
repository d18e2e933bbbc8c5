//! An optimizer whose fp32 master weights and state live in host memory (ZeRO-Offload): one
//! rank's flat partition, stepped by [`CpuAdam`] one sub-group at a time so each sub-group's
//! updated weights can travel to the device while the next one steps.

use core::ops::Range;

use crate::cpu_adam::{AdamStep, CpuAdam, Grad, Out, SgdStep};

/// The optimizer's fixed settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostSettings {
    /// Adam / AdamW.
    Adam {
        /// ε.
        eps: f32,
        /// Weight decay.
        weight_decay: f32,
        /// AdamW's decoupled decay.
        decoupled: bool,
        /// Bias correction.
        bias_correction: bool,
    },
    /// SGD (PyTorch semantics).
    Sgd {
        /// Momentum (0: none).
        momentum: f32,
        /// Dampening.
        dampening: f32,
        /// Nesterov.
        nesterov: bool,
        /// L2 weight decay.
        weight_decay: f32,
    },
}

/// The constants of the step in progress, shared by its sub-groups.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepConstants {
    /// Adam's.
    Adam(AdamStep),
    /// SGD's.
    Sgd(SgdStep),
}

/// A partition's master weights and optimizer state in host memory.
#[derive(Debug)]
pub struct HostOptimizer {
    master: Vec<f32>,
    settings: HostSettings,
    /// Adam: m and v. SGD: the momentum buffer (empty without momentum).
    state: Vec<Vec<f32>>,
    /// Steps taken (Adam's t); SGD: whether the buffer holds a value once > 0.
    step: u64,
    cpu: CpuAdam,
    sub_group: usize,
}

impl HostOptimizer {
    /// Zeroed state for `master`, stepped by `cpu` in sub-groups of `sub_group` elements.
    pub fn new(master: Vec<f32>, settings: HostSettings, cpu: CpuAdam, sub_group: usize) -> Self {
        let n = master.len();
        let state = match settings {
            HostSettings::Adam { .. } => vec![vec![0.0; n], vec![0.0; n]],
            HostSettings::Sgd { momentum, .. } if momentum > 0.0 => vec![vec![0.0; n]],
            HostSettings::Sgd { .. } => vec![Vec::new()],
        };
        Self {
            master,
            settings,
            state,
            step: 0,
            cpu,
            sub_group: sub_group.max(1),
        }
    }

    /// The fp32 master weights.
    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// Elements of the partition.
    pub fn len(&self) -> usize {
        self.master.len()
    }

    /// Whether the partition is empty.
    pub fn is_empty(&self) -> bool {
        self.master.is_empty()
    }

    /// Host bytes held: master and state.
    pub fn bytes(&self) -> usize {
        4 * (self.master.len() + self.state.iter().map(Vec::len).sum::<usize>())
    }

    /// The sub-groups a step walks, in order.
    pub fn groups(&self) -> Vec<Range<usize>> {
        (0..self.len())
            .step_by(self.sub_group)
            .map(|s| s..(s + self.sub_group).min(self.len()))
            .collect()
    }

    /// Starts a step with learning rate `lr` and `betas`: its constants.
    pub fn begin_step(&mut self, lr: f32, betas: (f32, f32)) -> StepConstants {
        self.step += 1;
        match self.settings {
            HostSettings::Adam {
                eps,
                weight_decay,
                decoupled,
                bias_correction,
            } => StepConstants::Adam(AdamStep::at(
                self.step,
                lr,
                betas,
                eps,
                weight_decay,
                decoupled,
                bias_correction,
            )),
            HostSettings::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
            } => StepConstants::Sgd(SgdStep {
                lr,
                momentum,
                dampening,
                nesterov,
                weight_decay,
                started: self.step > 1,
            }),
        }
    }

    /// Steps sub-group `range` with its gradient (`range.len()` elements), writing its new
    /// weights to `out` too.
    pub fn step_group(
        &mut self,
        k: &StepConstants,
        range: Range<usize>,
        grad: Grad<'_>,
        out: Out<'_>,
    ) {
        let master = &mut self.master[range.clone()];
        match (k, self.state.as_mut_slice()) {
            (StepConstants::Adam(k), [m, v]) => {
                self.cpu
                    .adam(k, master, grad, &mut m[range.clone()], &mut v[range], out)
            }
            (StepConstants::Sgd(k), [buf]) => {
                let buf = if buf.is_empty() {
                    &mut buf[..]
                } else {
                    &mut buf[range]
                };
                self.cpu.sgd(k, master, grad, buf, out)
            }
            _ => unreachable!("the state matches the settings"),
        }
    }

    /// One whole step on the calling thread (every sub-group in turn, fp32 gradient, no
    /// compute-dtype copy): for callers without a device to overlap with.
    pub fn step_all(&mut self, lr: f32, betas: (f32, f32), grad: &[f32]) {
        let k = self.begin_step(lr, betas);
        for range in self.groups() {
            self.step_group(&k, range.clone(), Grad::F32(&grad[range]), Out::None);
        }
    }

    /// The state names [`HostOptimizer::import`] needs.
    pub fn required(&self) -> &'static [&'static str] {
        match self.settings {
            HostSettings::Adam { .. } => &["exp_avg", "exp_avg_sq"],
            HostSettings::Sgd { .. } => &[],
        }
    }

    /// The step count and the state as named partitions (PyTorch's names), for checkpoints.
    pub fn export(&self) -> (u64, Vec<(&'static str, &[f32])>) {
        let names: &[&'static str] = match self.settings {
            HostSettings::Adam { .. } => &["exp_avg", "exp_avg_sq"],
            HostSettings::Sgd { .. } if self.step > 0 && !self.state[0].is_empty() => {
                &["momentum_buffer"]
            }
            HostSettings::Sgd { .. } => &[],
        };
        let tensors = names
            .iter()
            .zip(&self.state)
            .map(|(n, s)| (*n, s.as_slice()))
            .collect();
        (self.step, tensors)
    }

    /// Replaces the master, step count and state (named as [`HostOptimizer::export`] names
    /// them); an error names what is missing or mis-sized.
    pub fn import(
        &mut self,
        master: Vec<f32>,
        step: u64,
        mut tensors: Vec<(String, Vec<f32>)>,
    ) -> Result<(), String> {
        let n = master.len();
        if let Some((name, t)) = tensors.iter().find(|(_, t)| t.len() != n) {
            return Err(format!(
                "optimizer state `{name}` has {} elements, the partition {n}",
                t.len()
            ));
        }
        let mut take = |name: &str| {
            let i = tensors.iter().position(|(t, _)| t == name)?;
            Some(tensors.swap_remove(i).1)
        };
        let missing = |n: &str| format!("the checkpoint has no `{n}` (Adam's state)");
        self.state = match self.settings {
            HostSettings::Adam { .. } => vec![
                take("exp_avg").ok_or_else(|| missing("exp_avg"))?,
                take("exp_avg_sq").ok_or_else(|| missing("exp_avg_sq"))?,
            ],
            HostSettings::Sgd { momentum, .. } => match take("momentum_buffer") {
                // A buffer holds a value: the next step continues it.
                Some(buffer) => vec![buffer],
                None if momentum > 0.0 => vec![vec![0.0; n]],
                None => vec![Vec::new()],
            },
        };
        let buffered =
            matches!(self.settings, HostSettings::Sgd { .. }) && !self.state[0].is_empty();
        self.master = master;
        self.step = if buffered { step.max(1) } else { step };
        Ok(())
    }
}
