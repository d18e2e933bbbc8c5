//! Learning-rate schedules: warmup, decay, one-cycle, and the scheduler that steps them.

use core::f64::consts::PI;

use serde::Serialize;

use super::params;
use crate::config::{ConfigError, SchedulerConfig};

/// How warmup rises from the minimum to the maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WarmupType {
    /// `ln(i + 1) / ln(N)`.
    Log,
    /// `i / N`.
    Linear,
}

/// The warmup shared by WarmupLR, WarmupDecayLR and WarmupCosineLR.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Warmup {
    /// Warmup length `N` (at least 2, as DeepSpeed forces).
    pub num_steps: u64,
    /// Shape of the rise.
    pub kind: WarmupType,
}

impl Warmup {
    /// Progress in [0, 1] at `iteration` (≥ 0); 1 once warmup is over.
    fn gamma(&self, iteration: i64) -> f64 {
        let n = self.num_steps as f64;
        if iteration >= self.num_steps as i64 {
            return 1.0;
        }
        match self.kind {
            WarmupType::Log => ((iteration + 1) as f64).ln() / n.ln(),
            WarmupType::Linear => iteration as f64 / n,
        }
    }
}

/// A learning-rate schedule with its parameters resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Schedule {
    /// No scheduler: the optimizer's `lr` throughout.
    Constant {
        /// The learning rate.
        lr: f64,
    },
    /// `WarmupLR`: rise from `min_lr` to `max_lr`, then hold.
    WarmupLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr` (default: the optimizer's lr).
        max_lr: f64,
        /// Warmup shape.
        warmup: Warmup,
    },
    /// `WarmupDecayLR`: WarmupLR, then linear decay back to `min_lr` at `total_num_steps`.
    WarmupDecayLr {
        /// `warmup_min_lr`.
        min_lr: f64,
        /// `warmup_max_lr` (default 0.001).
        max_lr: f64,
        /// Warmup shape.
        warmup: Warmup,
        /// `total_num_steps`.
        total_num_steps: u64,
    },
    /// `WarmupCosineLR`: ratio of the optimizer's lr, warmup then cosine to `cos_min_ratio`.
    WarmupCosineLr {
        /// The optimizer's lr (the peak).
        base_lr: f64,
        /// `warmup_min_ratio`.
        warmup_min_ratio: f64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
        /// Warmup shape.
        warmup: Warmup,
        /// `total_num_steps`.
        total_num_steps: u64,
    },
    /// `OneCycle`: triangular cycle between `cycle_min_lr` and `cycle_max_lr`, then decay.
    OneCycle(OneCycle),
    /// `LRRangeTest`: `min_lr · (1 + rate · interval)`.
    LrRangeTest {
        /// `lr_range_test_min_lr`.
        min_lr: f64,
        /// `lr_range_test_step_size`.
        step_size: u64,
        /// `lr_range_test_step_rate`.
        step_rate: f64,
        /// `lr_range_test_staircase`.
        staircase: bool,
    },
}

/// The resolved parameters of `OneCycle`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OneCycle {
    /// `cycle_min_lr`.
    pub min_lr: f64,
    /// `cycle_max_lr`.
    pub max_lr: f64,
    /// `cycle_first_step_size`.
    pub first: f64,
    /// `cycle_second_step_size` (default: the first).
    pub second: f64,
    /// `cycle_first_stair_count`.
    pub first_stairs: u64,
    /// `cycle_second_stair_count` (default: the first).
    pub second_stairs: u64,
    /// `decay_step_size`.
    pub decay_step_size: f64,
    /// `decay_lr_rate`.
    pub decay_lr_rate: f64,
    /// `cycle_momentum` (Adam's beta1 cycles inversely to the lr; beta2 is 0.99).
    pub cycle_momentum: bool,
    /// `cycle_min_mom`.
    pub min_mom: f64,
    /// `cycle_max_mom`.
    pub max_mom: f64,
    /// `decay_mom_rate`.
    pub decay_mom_rate: f64,
}

impl OneCycle {
    fn total(&self) -> f64 {
        self.first + self.second
    }

    /// Position in the cycle, 0 at `min_lr` and 1 at `max_lr`, for `b = iteration + 1`.
    fn scale(&self, iteration: i64) -> f64 {
        let b = (iteration + 1) as f64;
        let total = self.total();
        let ratio = self.first / total;
        let x = b / total - (b / total).floor();
        let (scale, stairs) = if x <= ratio {
            (x / ratio, self.first_stairs)
        } else {
            ((1.0 - x) / (1.0 - ratio), self.second_stairs)
        };
        if stairs == 0 {
            return scale;
        }
        let s = stairs as f64;
        let within = b % total;
        let position = if within <= self.first {
            within * s / self.first
        } else {
            (total - within) * s / self.second
        };
        position.floor() / s
    }

    /// Decay steps taken after the cycle, if past it.
    fn decay_steps(&self, iteration: i64) -> Option<f64> {
        (iteration as f64 >= self.total()).then(|| iteration as f64 - self.total() + 1.0)
    }

    fn lr(&self, iteration: i64) -> f64 {
        match self.decay_steps(iteration) {
            None => self.min_lr + (self.max_lr - self.min_lr) * self.scale(iteration),
            Some(_) if self.skip_lr_decay() => self.min_lr,
            Some(d) => self.min_lr / (1.0 + self.decay_lr_rate * d / self.decay_step_size),
        }
    }

    fn beta1(&self, iteration: i64) -> f64 {
        if iteration < 0 {
            return self.min_mom; // DeepSpeed's constructor sets the minimum momentum
        }
        match self.decay_steps(iteration) {
            None => self.max_mom - (self.max_mom - self.min_mom) * self.scale(iteration),
            Some(_) if self.skip_mom_decay() => self.max_mom,
            Some(d) => self.max_mom * (1.0 + self.decay_mom_rate * d / self.decay_step_size),
        }
    }

    fn skip_lr_decay(&self) -> bool {
        self.decay_step_size == 0.0 || self.decay_lr_rate == 0.0
    }

    fn skip_mom_decay(&self) -> bool {
        self.decay_step_size == 0.0 || self.decay_mom_rate == 0.0
    }
}

impl Schedule {
    /// The learning rate at `iteration` (−1: as constructed, before any scheduler step).
    pub fn lr(&self, iteration: i64) -> f64 {
        match self {
            Schedule::Constant { lr } => *lr,
            Schedule::WarmupLr {
                min_lr,
                max_lr,
                warmup,
            } => {
                if iteration < 0 {
                    return *min_lr;
                }
                min_lr + (max_lr - min_lr) * warmup.gamma(iteration)
            }
            Schedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup,
                total_num_steps,
            } => {
                if iteration < 0 {
                    return *min_lr;
                }
                let gamma = if iteration < warmup.num_steps as i64 {
                    warmup.gamma(iteration)
                } else {
                    let total = *total_num_steps as f64;
                    let span = (total - warmup.num_steps as f64).max(1.0);
                    ((total - iteration as f64) / span).max(0.0)
                };
                min_lr + (max_lr - min_lr) * gamma
            }
            Schedule::WarmupCosineLr {
                base_lr,
                warmup_min_ratio,
                cos_min_ratio,
                warmup,
                total_num_steps,
            } => {
                if iteration < 0 {
                    return 0.0;
                }
                let ratio = if iteration < warmup.num_steps as i64 {
                    warmup_min_ratio + warmup.gamma(iteration) * (1.0 - warmup_min_ratio)
                } else {
                    let done = (iteration - warmup.num_steps as i64 + 1) as f64;
                    let span = (*total_num_steps as f64 - warmup.num_steps as f64).max(1.0);
                    let progress = (done / span).min(1.0);
                    (cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + (PI * progress).cos()) / 2.0)
                        .max(0.0)
                };
                base_lr * ratio
            }
            Schedule::OneCycle(c) => c.lr(iteration),
            Schedule::LrRangeTest {
                min_lr,
                step_size,
                step_rate,
                staircase,
            } => {
                let interval = (iteration + 1) as f64 / *step_size as f64;
                let interval = if *staircase {
                    interval.floor()
                } else {
                    interval
                };
                min_lr * (1.0 + step_rate * interval)
            }
        }
    }

    /// Adam's `(beta1, beta2)` at `iteration` when the schedule cycles momentum.
    pub fn betas(&self, iteration: i64) -> Option<(f64, f64)> {
        match self {
            Schedule::OneCycle(c) if c.cycle_momentum => Some((c.beta1(iteration), 0.99)),
            _ => None,
        }
    }
}

/// A schedule and DeepSpeed's `last_batch_iteration`.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduler {
    schedule: Schedule,
    iteration: i64,
}

impl Scheduler {
    /// A scheduler as constructed (iteration −1).
    pub fn new(schedule: Schedule) -> Self {
        Self {
            schedule,
            iteration: -1,
        }
    }

    /// The learning rate the next optimizer step uses.
    pub fn lr(&self) -> f64 {
        self.schedule.lr(self.iteration)
    }

    /// Adam's betas for the next optimizer step, when the schedule sets them.
    pub fn betas(&self) -> Option<(f64, f64)> {
        self.schedule.betas(self.iteration)
    }

    /// Advances after an optimizer step.
    pub fn step(&mut self) {
        self.iteration += 1;
    }

    /// DeepSpeed's `last_batch_iteration`.
    pub fn last_batch_iteration(&self) -> i64 {
        self.iteration
    }

    /// Restores `last_batch_iteration` (resuming from a checkpoint).
    pub fn set_last_batch_iteration(&mut self, iteration: i64) {
        self.iteration = iteration;
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

impl Schedule {
    /// Builds the schedule of `config` (`scheduler {type, params}`); `optimizer_lr` is the
    /// optimizer's `lr` (WarmupLR's default peak, WarmupCosineLR's base).
    pub fn from_config(
        config: Option<&SchedulerConfig>,
        optimizer_lr: f64,
        warnings: &mut Vec<String>,
    ) -> Result<Self, ConfigError> {
        params::build(config, optimizer_lr, warnings)
    }
}
