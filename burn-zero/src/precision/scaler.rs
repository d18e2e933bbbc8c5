//! DeepSpeed's loss scaler: static or dynamic, with its hysteresis and minimum.

use serde::{Deserialize, Serialize};

use crate::config::Fp16Config;

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

/// What one update did, for the log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScaleUpdate {
    /// No overflow; the scale stays.
    Kept,
    /// No overflow for a whole window: the scale grew to this.
    Raised(f64),
    /// Overflow: the step is skipped and the scale went from `attempted` to `next`.
    Lowered {
        /// The scale the skipped step used.
        attempted: f64,
        /// The scale of the next step.
        next: f64,
    },
    /// Overflow: the step is skipped; hysteresis kept the scale, with this credit left.
    Hysteresis(u64),
}

impl ScaleUpdate {
    /// Whether the step that produced this update is skipped.
    pub fn skipped(&self) -> bool {
        matches!(
            self,
            ScaleUpdate::Lowered { .. } | ScaleUpdate::Hysteresis(_)
        )
    }
}

/// Gradients overflowed at the smallest allowed scale: fp16 cannot train this model as set.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "fp16 gradients overflow even at the minimum loss scale ({min_scale}, `fp16.min_loss_scale`) \
     at step {iteration}: train in bf16 (`\"bf16\": {{\"enabled\": true}}`), which needs no loss \
     scaling, or lower `fp16.min_loss_scale`"
)]
pub struct MinScaleReached {
    /// The minimum scale.
    pub min_scale: f64,
    /// The scaler's iteration when it happened.
    pub iteration: u64,
}

/// DeepSpeed's loss scaler: static (a fixed scale) or dynamic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    cur_scale: f64,
    cur_iter: u64,
    dynamic: Option<Dynamic>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Dynamic {
    last_overflow_iter: i64,
    scale_factor: f64,
    scale_window: u64,
    min_scale: f64,
    delayed_shift: u64,
    cur_hysteresis: u64,
    consecutive_hysteresis: bool,
}

impl LossScaler {
    /// A scaler that never changes `scale` (bf16 and fp32 use 1).
    pub fn fixed(scale: f64) -> Self {
        Self {
            cur_scale: scale,
            cur_iter: 0,
            dynamic: None,
        }
    }

    /// The scaler of an `fp16` section: static when `loss_scale` > 0, dynamic when it is 0.
    pub fn from_config(c: &Fp16Config) -> Self {
        if c.loss_scale > 0.0 {
            return Self::fixed(c.loss_scale);
        }
        let hysteresis = c.hysteresis.get() as u64;
        Self {
            cur_scale: 2f64.powi(c.initial_scale_power as i32),
            cur_iter: 0,
            dynamic: Some(Dynamic {
                last_overflow_iter: -1,
                scale_factor: 2.0,
                scale_window: c.loss_scale_window.get() as u64,
                min_scale: c.min_loss_scale,
                delayed_shift: hysteresis,
                cur_hysteresis: hysteresis,
                consecutive_hysteresis: c.consecutive_hysteresis,
            }),
        }
    }

    /// The scale the next backward multiplies the loss by.
    pub fn scale(&self) -> f64 {
        self.cur_scale
    }

    /// Updates taken so far (DeepSpeed's `cur_iter`).
    pub fn iteration(&self) -> u64 {
        self.cur_iter
    }

    /// Whether the scale adapts to overflows.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic.is_some()
    }

    /// The hysteresis credit left (overflows tolerated before the scale drops).
    pub fn hysteresis(&self) -> Option<u64> {
        self.dynamic.as_ref().map(|d| d.cur_hysteresis)
    }

    /// Records one optimizer step: `overflow` when any rank's gradients held inf or NaN.
    pub fn update(&mut self, overflow: bool) -> Result<ScaleUpdate, MinScaleReached> {
        let iter = self.cur_iter;
        let Some(d) = self.dynamic.as_mut() else {
            self.cur_iter += 1;
            return Ok(if overflow {
                ScaleUpdate::Lowered {
                    attempted: self.cur_scale,
                    next: self.cur_scale,
                }
            } else {
                ScaleUpdate::Kept
            });
        };
        let update = if overflow {
            let update = if d.delayed_shift == 1 || d.cur_hysteresis == 1 {
                if self.cur_scale == d.min_scale {
                    return Err(MinScaleReached {
                        min_scale: d.min_scale,
                        iteration: iter,
                    });
                }
                let next = (self.cur_scale / d.scale_factor).max(d.min_scale);
                let attempted = std::mem::replace(&mut self.cur_scale, next);
                ScaleUpdate::Lowered { attempted, next }
            } else {
                d.cur_hysteresis -= 1;
                ScaleUpdate::Hysteresis(d.cur_hysteresis)
            };
            d.last_overflow_iter = iter as i64;
            update
        } else {
            if d.consecutive_hysteresis {
                d.cur_hysteresis = d.delayed_shift;
            }
            let stable = iter as i64 - d.last_overflow_iter - 1;
            if stable > 0 && (stable as u64).is_multiple_of(d.scale_window) {
                if !d.consecutive_hysteresis {
                    d.cur_hysteresis = d.delayed_shift;
                }
                self.cur_scale *= d.scale_factor;
                ScaleUpdate::Raised(self.cur_scale)
            } else {
                ScaleUpdate::Kept
            }
        };
        self.cur_iter += 1;
        Ok(update)
    }
}
