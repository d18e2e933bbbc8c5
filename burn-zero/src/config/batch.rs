//! The batch triad: `train_batch_size = micro batch × accumulation steps × world size`.

use serde::Serialize;

use super::error::ConfigError;

/// The three batch numbers, all known and consistent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BatchSizes {
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: usize,
    /// Samples per rank per micro-step.
    pub micro_batch_per_gpu: usize,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: usize,
}

impl BatchSizes {
    /// Derives the missing numbers from the given ones, as DeepSpeed does: any two determine the
    /// third; `train_batch_size` alone means no accumulation; the micro batch alone likewise.
    /// Unlike DeepSpeed, a derivation that does not divide evenly is an error, not floored.
    pub fn resolve(
        train_batch_size: Option<u64>,
        micro_batch: Option<u64>,
        gas: Option<u64>,
        world_size: usize,
    ) -> Result<Self, ConfigError> {
        let world = world_size as u64;
        for (key, value) in [
            ("train_batch_size", train_batch_size),
            ("train_micro_batch_size_per_gpu", micro_batch),
            ("gradient_accumulation_steps", gas),
        ] {
            if value == Some(0) {
                return Err(ConfigError::Invalid {
                    key: key.into(),
                    value: "0".into(),
                    allowed: "a whole number > 0".into(),
                });
            }
        }
        let show = |v: Option<u64>| v.map_or("not given".to_string(), |v| v.to_string());
        let triad_error = |product: String| ConfigError::BatchTriad {
            train_batch_size: show(train_batch_size),
            micro_batch: show(micro_batch),
            gas: show(gas),
            world_size,
            product,
        };
        let divide = |total: u64, by: u64| {
            if total.is_multiple_of(by) {
                Ok(total / by)
            } else {
                Err(triad_error(format!("{total} / {by} is not a whole number")))
            }
        };
        // Products of given numbers, which may be too large for any batch.
        let times = |factors: &[u64]| {
            factors
                .iter()
                .try_fold(1u64, |acc, f| acc.checked_mul(*f))
                .ok_or_else(|| triad_error(format!("{factors:?} multiply beyond 2^64")))
        };
        let (tb, mb, gas) = match (train_batch_size, micro_batch, gas) {
            (Some(tb), Some(mb), Some(gas)) => (tb, mb, gas),
            (Some(tb), Some(mb), None) => (tb, mb, divide(tb, times(&[mb, world])?)?),
            (Some(tb), None, Some(gas)) => (tb, divide(tb, times(&[gas, world])?)?, gas),
            (None, Some(mb), Some(gas)) => (times(&[mb, gas, world])?, mb, gas),
            (Some(tb), None, None) => (tb, divide(tb, world)?, 1),
            (None, Some(mb), None) => (times(&[mb, world])?, mb, 1),
            (None, None, _) => {
                return Err(triad_error(
                    "unknown: give train_batch_size or train_micro_batch_size_per_gpu".into(),
                ));
            }
        };
        let product = times(&[mb, gas, world])?;
        if tb != product {
            return Err(triad_error(product.to_string()));
        }
        Ok(Self {
            train_batch_size: tb as usize,
            micro_batch_per_gpu: mb as usize,
            gradient_accumulation_steps: gas as usize,
        })
    }
}
