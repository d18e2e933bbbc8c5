//! Mixed precision's loss scaling, free of burn types: DeepSpeed's static and dynamic loss
//! scalers (`fp16 {loss_scale, initial_scale_power, loss_scale_window, hysteresis,
//! consecutive_hysteresis, min_loss_scale}`), as a state machine the engine drives once per
//! optimizer step with whether any rank's gradients overflowed.
//!
//! The dynamic rule follows DeepSpeed's `DynamicLossScaler.update_scale` (runtime/fp16/
//! loss_scaler.py, 2025): on overflow the step is skipped and, unless hysteresis still has
//! credit, the scale halves (not below `min_loss_scale`; overflowing at the minimum is an
//! error); after a run of `loss_scale_window` clean steps since the last overflow the scale
//! doubles and the hysteresis credit is refilled.

mod scaler;
pub use scaler::*;
