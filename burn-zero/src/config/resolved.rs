//! The loaded and resolved config: parsed from JSON or a file, then its values worked out for
//! a world size.

use serde::Serialize;

use super::{
    BatchSizes, ConfigError, DeepSpeedConfig, OffloadDevice, OptimizerParams, ZeroStage, load,
    parse_value, validate,
};
use crate::schedule::Schedule;

/// A parsed config and what loading it had to say.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The config.
    pub config: DeepSpeedConfig,
    /// Unknown or ignored keys, deprecated forms and `"auto"` values, one line each.
    pub warnings: Vec<String>,
}

/// The optimizer a config asks for.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum OptimizerKind {
    /// Adam; `decoupled_weight_decay` is AdamW (DeepSpeed's default even for type `Adam`).
    Adam {
        /// Weight decay applied to the parameter (AdamW) rather than added to the gradient.
        decoupled_weight_decay: bool,
    },
    /// SGD with optional momentum.
    Sgd,
    /// LAMB (DeepSpeed's `Lamb`): Adam's update scaled per parameter tensor by the trust
    /// ratio ‖w‖ / ‖update‖, clamped to [`min_coeff`, `max_coeff`].
    Lamb,
    /// 1-bit Adam (DeepSpeed's `OneBitAdam`): Adam for `freeze_step` steps, then the variance
    /// frozen and the update averaged 1-bit compressed with error feedback instead of the
    /// gradients all-reduced (ZeRO stage 0).
    OneBitAdam,
}

/// A validated config resolved for a world size: what the engine runs.
#[derive(Clone, Debug, Serialize)]
pub struct ResolvedConfig {
    /// Ranks in the data-parallel group.
    pub world_size: usize,
    /// The batch triad, all three known.
    pub batch: BatchSizes,
    /// The optimizer kind.
    pub optimizer: OptimizerKind,
    /// The optimizer's parameters.
    pub optimizer_params: OptimizerParams,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// The config as given (defaults filled in).
    pub config: DeepSpeedConfig,
    /// Warnings from loading and resolving.
    pub warnings: Vec<String>,
}

impl DeepSpeedConfig {
    /// Parses `ds_config.json` text; its warnings are logged too.
    pub fn from_json(text: &str) -> Result<Loaded, ConfigError> {
        let loaded = Self::parse_json(text)?;
        loaded.warnings.iter().for_each(|w| crate::log::warn(w));
        Ok(loaded)
    }

    /// [`DeepSpeedConfig::from_json`] without logging the warnings (they are in [`Loaded`]).
    pub fn parse_json(text: &str) -> Result<Loaded, ConfigError> {
        let mut value = serde_json::from_str::<load::UniqueKeys>(text)
            .map_err(|e| ConfigError::Parse {
                key: ".".into(),
                reason: format!("not valid JSON: {e}"),
            })?
            .0;
        if !value.is_object() {
            return Err(ConfigError::Parse {
                key: ".".into(),
                reason: "the config must be a JSON object".into(),
            });
        }
        let mut warnings = Vec::new();
        let mut autos = Vec::new();
        load::drop_auto_values(&mut value, "", &mut autos);
        for key in autos {
            warnings.push(format!(
                "`{key}` is \"auto\": using burn-zero's default (or deriving it)"
            ));
        }
        load::upgrade_legacy_zero(&mut value, &mut warnings);
        let config: DeepSpeedConfig = parse_value(value, "", &mut warnings)?;
        validate::validate(&config, &mut warnings)?;
        Ok(Loaded { config, warnings })
    }

    /// Reads and parses a `ds_config.json` file.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Loaded, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_json(&text).map_err(|e| ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    /// Resolves the config for `world_size` data-parallel ranks: the batch triad, the optimizer
    /// and the schedule. Errors name the keys at fault.
    pub fn resolve(&self, world_size: usize) -> Result<ResolvedConfig, ConfigError> {
        let mut warnings = Vec::new();
        validate::validate(self, &mut warnings)?;
        let batch = BatchSizes::resolve(
            self.train_batch_size.map(|c| c.0),
            self.train_micro_batch_size_per_gpu.map(|c| c.0),
            self.gradient_accumulation_steps.map(|c| c.0),
            world_size,
        )?;
        let optimizer_config = self.optimizer.as_ref().ok_or_else(|| ConfigError::Parse {
            key: "optimizer".into(),
            reason:
                "required: give {\"type\": \"AdamW\", \"params\": {\"lr\": ...}} (or Adam, SGD)"
                    .into(),
        })?;
        let optimizer = validate::optimizer_kind(optimizer_config)?;
        if optimizer == OptimizerKind::OneBitAdam
            && self.zero_optimization.stage != ZeroStage::Disabled
        {
            return Err(ConfigError::Parse {
                key: "zero_optimization.stage".into(),
                reason: format!(
                    "optimizer.type \"OneBitAdam\" needs stage 0 (it exchanges the momentum, \
                     not partitioned gradients), got {}",
                    self.zero_optimization.stage
                ),
            });
        }
        if matches!(optimizer, OptimizerKind::Lamb | OptimizerKind::OneBitAdam)
            && self.zero_optimization.optimizer_offload() != OffloadDevice::None
        {
            return Err(ConfigError::Parse {
                key: "zero_optimization.offload_optimizer".into(),
                reason: format!(
                    "optimizer.type {optimizer:?} runs on the device only: CPU-Adam has no \
                     trust ratios or compressed momentum yet"
                ),
            });
        }
        let schedule = Schedule::from_config(
            self.scheduler.as_ref(),
            optimizer_config.params.lr,
            &mut warnings,
        )?;
        if matches!(schedule, Schedule::OneCycle(ref c) if c.cycle_momentum)
            && optimizer == OptimizerKind::Sgd
        {
            warnings.push(
                "scheduler.params.cycle_momentum is ignored: SGD has no betas (as in DeepSpeed)"
                    .into(),
            );
        }
        Ok(ResolvedConfig {
            world_size,
            batch,
            optimizer,
            optimizer_params: optimizer_config.params.clone(),
            schedule,
            config: self.clone(),
            warnings,
        })
    }
}
