//! The optimizers on the engine's flat partitions: settings from the config and one step.

use serde::Serialize;

use crate::config::{OptimizerKind, OptimizerParams};

/// Hyperparameters of one step that a schedule may change.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepParams {
    /// Learning rate.
    pub lr: f64,
    /// Adam's betas (a schedule such as OneCycle may cycle beta1).
    pub betas: (f64, f64),
}

/// Adam's settings that stay fixed over a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct AdamSettings {
    /// `eps`.
    pub eps: f64,
    /// `weight_decay`.
    pub weight_decay: f64,
    /// AdamW (decoupled) rather than L2.
    pub decoupled: bool,
    /// `bias_correction`.
    pub bias_correction: bool,
}

impl AdamSettings {
    /// The bias corrections `(1 − β1ᵗ, 1 − β2ᵗ)` of step `t` (ones when switched off).
    pub fn corrections(&self, t: u64, (b1, b2): (f32, f32)) -> (f32, f32) {
        if self.bias_correction {
            (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32))
        } else {
            (1.0, 1.0)
        }
    }
}

/// SGD's settings (PyTorch semantics).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SgdSettings {
    /// `momentum`.
    pub momentum: f64,
    /// `dampening`.
    pub dampening: f64,
    /// `nesterov`.
    pub nesterov: bool,
    /// `weight_decay`.
    pub weight_decay: f64,
}

/// LAMB's settings: Adam's moments, then each parameter tensor's update scaled by its trust
/// ratio (DeepSpeed's `FusedLamb`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LambSettings {
    /// Adam's `eps`, `weight_decay` (added to the update) and `bias_correction`.
    pub adam: AdamSettings,
    /// `max_coeff`: the largest trust ratio.
    pub max_coeff: f64,
    /// `min_coeff`: the smallest trust ratio.
    pub min_coeff: f64,
}

impl LambSettings {
    /// The trust ratio of a tensor with weight norm `w` and update norm `u`: `w / u` clamped
    /// to [`min_coeff`, `max_coeff`], 1 when either norm is 0.
    pub fn trust(&self, w: f64, u: f64) -> f64 {
        if w > 0.0 && u > 0.0 {
            (w / u).clamp(self.min_coeff, self.max_coeff)
        } else {
            1.0
        }
    }
}

/// The fixed settings of one optimizer, from the config.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum OptimizerSettings {
    /// Adam / AdamW.
    Adam(AdamSettings),
    /// SGD with optional momentum.
    Sgd(SgdSettings),
    /// LAMB.
    Lamb(LambSettings),
    /// 1-bit Adam: Adam's settings (weight decay added to the update, no bias correction, as
    /// DeepSpeed's `OneBitAdam`) and the step after which the momentum is compressed.
    OneBitAdam(AdamSettings, u64),
}

impl OptimizerSettings {
    /// The settings of `kind` with `params`.
    pub fn new(kind: OptimizerKind, params: &OptimizerParams) -> Self {
        match kind {
            OptimizerKind::Adam {
                decoupled_weight_decay,
            } => Self::Adam(AdamSettings {
                eps: params.eps,
                weight_decay: params.weight_decay,
                decoupled: decoupled_weight_decay,
                bias_correction: params.bias_correction,
            }),
            OptimizerKind::Lamb => Self::Lamb(LambSettings {
                adam: AdamSettings {
                    eps: params.eps,
                    weight_decay: params.weight_decay,
                    decoupled: true,
                    bias_correction: params.bias_correction,
                },
                max_coeff: params.max_coeff,
                min_coeff: params.min_coeff,
            }),
            OptimizerKind::OneBitAdam => Self::OneBitAdam(
                AdamSettings {
                    eps: params.eps,
                    weight_decay: params.weight_decay,
                    decoupled: true,
                    bias_correction: false,
                },
                params.freeze_step,
            ),
            OptimizerKind::Sgd => Self::Sgd(SgdSettings {
                momentum: params.momentum,
                dampening: params.dampening,
                nesterov: params.nesterov,
                weight_decay: params.weight_decay,
            }),
        }
    }
}

impl StepParams {
    /// (lr, (β1, β2)) in the f32 the update computes in.
    pub(crate) fn f32(&self) -> (f32, (f32, f32)) {
        (self.lr as f32, (self.betas.0 as f32, self.betas.1 as f32))
    }
}

/// Optimizer state for one partition, on the host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum FlatOptimizer {
    /// Adam / AdamW.
    Adam {
        /// First moment.
        m: Vec<f32>,
        /// Second moment.
        v: Vec<f32>,
        /// Steps taken (t of the bias correction).
        step: u64,
        /// Its settings.
        settings: AdamSettings,
    },
    /// SGD with optional momentum (PyTorch semantics).
    Sgd {
        /// Momentum buffer (empty when momentum is 0).
        buffer: Vec<f32>,
        /// Whether `buffer` holds a value yet (PyTorch starts it at the first gradient).
        started: bool,
        /// Its settings.
        settings: SgdSettings,
    },
}

impl FlatOptimizer {
    /// Zeroed state for a partition of `len` elements.
    ///
    /// # Panics
    /// For LAMB: its trust ratios need the parameter tensors' bounds and norms reduced across
    /// ranks, which the engine's device optimizer ([`TensorOptimizer::with_segments`]) has.
    pub fn new(kind: OptimizerKind, params: &OptimizerParams, len: usize) -> Self {
        match OptimizerSettings::new(kind, params) {
            OptimizerSettings::Lamb(_) | OptimizerSettings::OneBitAdam(..) => {
                panic!("optimizer.type {kind:?} runs on the engine's device optimizer only")
            }
            OptimizerSettings::Adam(settings) => FlatOptimizer::Adam {
                m: vec![0.0; len],
                v: vec![0.0; len],
                step: 0,
                settings,
            },
            OptimizerSettings::Sgd(settings) => FlatOptimizer::Sgd {
                buffer: if settings.momentum > 0.0 {
                    vec![0.0; len]
                } else {
                    Vec::new()
                },
                started: false,
                settings,
            },
        }
    }

    /// Bytes of state held.
    pub fn state_bytes(&self) -> usize {
        match self {
            FlatOptimizer::Adam { m, v, .. } => 4 * (m.capacity() + v.capacity()),
            FlatOptimizer::Sgd { buffer, .. } => 4 * buffer.capacity(),
        }
    }

    /// Updates `param` in place from `grad` (same length as the state).
    pub fn step(&mut self, param: &mut [f32], grad: &[f32], hp: StepParams) {
        assert_eq!(
            param.len(),
            grad.len(),
            "parameter and gradient partitions differ in length"
        );
        let (lr, (b1, b2)) = hp.f32();
        match self {
            FlatOptimizer::Adam {
                m,
                v,
                step,
                settings,
            } => {
                assert_eq!(
                    m.len(),
                    param.len(),
                    "optimizer state and partition differ in length"
                );
                *step += 1;
                let (bc1, bc2) = settings.corrections(*step, (b1, b2));
                let (eps, wd) = (settings.eps as f32, settings.weight_decay as f32);
                let step_size = lr / bc1;
                let bc2_sqrt = bc2.sqrt();
                for i in 0..param.len() {
                    let mut g = grad[i];
                    if !settings.decoupled {
                        g += wd * param[i];
                    }
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                    if settings.decoupled {
                        param[i] *= 1.0 - lr * wd;
                    }
                    let denom = v[i].sqrt() / bc2_sqrt + eps;
                    param[i] -= step_size * (m[i] / denom);
                }
            }
            FlatOptimizer::Sgd {
                buffer,
                started,
                settings,
            } => {
                let (mu, damp, wd) = (
                    settings.momentum as f32,
                    settings.dampening as f32,
                    settings.weight_decay as f32,
                );
                for i in 0..param.len() {
                    let mut g = grad[i] + wd * param[i];
                    if mu > 0.0 {
                        buffer[i] = if *started {
                            mu * buffer[i] + (1.0 - damp) * g
                        } else {
                            g
                        };
                        g = if settings.nesterov {
                            g + mu * buffer[i]
                        } else {
                            buffer[i]
                        };
                    }
                    param[i] -= lr * g;
                }
                *started = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(lr: f64) -> StepParams {
        StepParams {
            lr,
            betas: (0.9, 0.999),
        }
    }

    #[test]
    fn adamw_first_steps_by_hand() {
        let params = OptimizerParams {
            weight_decay: 0.1,
            eps: 1e-8,
            ..Default::default()
        };
        let mut opt = FlatOptimizer::new(
            OptimizerKind::Adam {
                decoupled_weight_decay: true,
            },
            &params,
            1,
        );
        let mut p = [1.0f32];
        // Step 1: m = 0.1·g, v = 0.001·g², m̂ = g, v̂ = g²: the update is lr·g/(|g| + eps) = lr·sign(g).
        opt.step(&mut p, &[0.5], hp(0.01));
        let want = 1.0 * (1.0 - 0.01 * 0.1) - 0.01 * 0.5 / (0.5 + 1e-8);
        assert!((p[0] - want as f32).abs() < 1e-7, "{} vs {want}", p[0]);
    }

    #[test]
    fn adam_l2_adds_decay_to_the_gradient() {
        let params = OptimizerParams {
            weight_decay: 0.5,
            ..Default::default()
        };
        let mut opt = FlatOptimizer::new(
            OptimizerKind::Adam {
                decoupled_weight_decay: false,
            },
            &params,
            1,
        );
        let mut p = [2.0f32];
        // g' = g + wd·p = −0.5 + 1.0 = 0.5: the first step moves p by −lr·sign(g').
        opt.step(&mut p, &[-0.5], hp(0.1));
        assert!((p[0] - (2.0 - 0.1 * 0.5 / (0.5 + 1e-8)) as f32).abs() < 1e-6);
    }

    #[test]
    fn sgd_momentum_follows_pytorch() {
        let params = OptimizerParams {
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = FlatOptimizer::new(OptimizerKind::Sgd, &params, 1);
        let mut p = [1.0f32];
        opt.step(&mut p, &[1.0], hp(0.1)); // buf = g = 1
        opt.step(&mut p, &[1.0], hp(0.1)); // buf = 0.9 + 1 = 1.9
        assert!((p[0] - (1.0 - 0.1 - 0.19)).abs() < 1e-6, "{}", p[0]);
    }
}
