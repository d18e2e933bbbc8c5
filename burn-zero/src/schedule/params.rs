//! `scheduler.params` of each DeepSpeed schedule, with DeepSpeed's names and defaults.

use serde::{Deserialize, Serialize};

use super::{OneCycle, Schedule, Warmup, WarmupType};
use crate::config::{ConfigError, Count, SchedulerConfig, parse_value};

/// The schedule types, as DeepSpeed spells them.
pub const SCHEDULE_TYPES: &str = "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest";

#[derive(Deserialize, Serialize)]
#[serde(default)]
struct WarmupParams {
    warmup_min_lr: f64,
    warmup_max_lr: Option<f64>,
    warmup_num_steps: Count,
    warmup_type: String,
    total_num_steps: Option<Count>,
}

impl Default for WarmupParams {
    fn default() -> Self {
        Self {
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps: Count(1000),
            warmup_type: "log".into(),
            total_num_steps: None,
        }
    }
}

#[derive(Deserialize, Serialize)]
#[serde(default)]
struct CosineParams {
    total_num_steps: Option<Count>,
    warmup_min_ratio: f64,
    warmup_num_steps: Count,
    cos_min_ratio: f64,
    warmup_type: String,
}

impl Default for CosineParams {
    fn default() -> Self {
        Self {
            total_num_steps: None,
            warmup_min_ratio: 0.0,
            warmup_num_steps: Count(1000),
            cos_min_ratio: 0.0001,
            warmup_type: "log".into(),
        }
    }
}

#[derive(Deserialize, Serialize)]
#[serde(default)]
struct OneCycleParams {
    cycle_min_lr: Option<f64>,
    cycle_max_lr: Option<f64>,
    decay_lr_rate: f64,
    cycle_first_step_size: f64,
    cycle_second_step_size: Option<f64>,
    cycle_first_stair_count: Count,
    cycle_second_stair_count: Option<Count>,
    decay_step_size: f64,
    cycle_momentum: bool,
    cycle_min_mom: f64,
    cycle_max_mom: f64,
    decay_mom_rate: f64,
}

impl Default for OneCycleParams {
    fn default() -> Self {
        Self {
            cycle_min_lr: None,
            cycle_max_lr: None,
            decay_lr_rate: 0.0,
            cycle_first_step_size: 2000.0,
            cycle_second_step_size: None,
            cycle_first_stair_count: Count(0),
            cycle_second_stair_count: None,
            decay_step_size: 0.0,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        }
    }
}

#[derive(Deserialize, Serialize)]
#[serde(default)]
struct RangeTestParams {
    lr_range_test_min_lr: f64,
    lr_range_test_step_size: Count,
    lr_range_test_step_rate: f64,
    lr_range_test_staircase: bool,
}

impl Default for RangeTestParams {
    fn default() -> Self {
        Self {
            lr_range_test_min_lr: 1e-3,
            lr_range_test_step_size: Count(2000),
            lr_range_test_step_rate: 1.0,
            lr_range_test_staircase: false,
        }
    }
}

fn invalid(key: &str, value: impl ToString, allowed: &str) -> ConfigError {
    ConfigError::Invalid {
        key: format!("scheduler.params.{key}"),
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

fn warmup(num_steps: Count, kind: &str, warnings: &mut Vec<String>) -> Result<Warmup, ConfigError> {
    if num_steps.0 == 0 {
        return Err(invalid("warmup_num_steps", 0, "a whole number > 0"));
    }
    let kind = match kind {
        "log" => WarmupType::Log,
        "linear" => WarmupType::Linear,
        other => {
            warnings.push(format!(
                "scheduler.params.warmup_type `{other}` is unknown (log or linear): using log, as DeepSpeed does"
            ));
            WarmupType::Log
        }
    };
    Ok(Warmup {
        num_steps: num_steps.0.max(2),
        kind,
    })
}

fn required<T>(value: Option<T>, key: &str, kind: &str) -> Result<T, ConfigError> {
    value.ok_or_else(|| ConfigError::Parse {
        key: format!("scheduler.params.{key}"),
        reason: format!("required by {kind}"),
    })
}

pub(super) fn build(
    config: Option<&SchedulerConfig>,
    optimizer_lr: f64,
    warnings: &mut Vec<String>,
) -> Result<Schedule, ConfigError> {
    let Some(config) = config else {
        return Ok(Schedule::Constant { lr: optimizer_lr });
    };
    let params = config.params.clone();
    let prefix = "scheduler.params";
    let schedule = match config.kind.as_str() {
        "WarmupLR" | "WarmupDecayLR" => {
            let p: WarmupParams = parse_value(params, prefix, warnings)?;
            let warmup = warmup(p.warmup_num_steps, &p.warmup_type, warnings)?;
            if config.kind == "WarmupLR" {
                if p.total_num_steps.is_some() {
                    warnings.push(
                        "unknown key `scheduler.params.total_num_steps`: ignored by WarmupLR"
                            .into(),
                    );
                }
                Schedule::WarmupLr {
                    min_lr: p.warmup_min_lr,
                    max_lr: p.warmup_max_lr.unwrap_or(optimizer_lr),
                    warmup,
                }
            } else {
                let total = required(p.total_num_steps, "total_num_steps", "WarmupDecayLR")?.0;
                if total < warmup.num_steps {
                    warnings.push(format!(
                        "total_num_steps {total} is less than warmup_num_steps {}",
                        warmup.num_steps
                    ));
                }
                Schedule::WarmupDecayLr {
                    min_lr: p.warmup_min_lr,
                    max_lr: p.warmup_max_lr.unwrap_or(0.001),
                    warmup,
                    total_num_steps: total,
                }
            }
        }
        "WarmupCosineLR" => {
            let p: CosineParams = parse_value(params, prefix, warnings)?;
            let warmup = warmup(p.warmup_num_steps, &p.warmup_type, warnings)?;
            let total = required(p.total_num_steps, "total_num_steps", "WarmupCosineLR")?.0;
            Schedule::WarmupCosineLr {
                base_lr: optimizer_lr,
                warmup_min_ratio: p.warmup_min_ratio,
                cos_min_ratio: p.cos_min_ratio,
                warmup,
                total_num_steps: total,
            }
        }
        "OneCycle" => {
            let p: OneCycleParams = parse_value(params, prefix, warnings)?;
            if p.cycle_first_step_size <= 0.0 {
                return Err(invalid(
                    "cycle_first_step_size",
                    p.cycle_first_step_size,
                    "> 0",
                ));
            }
            let second = p.cycle_second_step_size.unwrap_or(p.cycle_first_step_size);
            if second < 0.0 {
                return Err(invalid("cycle_second_step_size", second, ">= 0"));
            }
            Schedule::OneCycle(OneCycle {
                min_lr: required(p.cycle_min_lr, "cycle_min_lr", "OneCycle")?,
                max_lr: required(p.cycle_max_lr, "cycle_max_lr", "OneCycle")?,
                first: p.cycle_first_step_size,
                second,
                first_stairs: p.cycle_first_stair_count.0,
                second_stairs: p
                    .cycle_second_stair_count
                    .unwrap_or(p.cycle_first_stair_count)
                    .0,
                decay_step_size: p.decay_step_size,
                decay_lr_rate: p.decay_lr_rate,
                cycle_momentum: p.cycle_momentum,
                min_mom: p.cycle_min_mom,
                max_mom: p.cycle_max_mom,
                decay_mom_rate: p.decay_mom_rate,
            })
        }
        "LRRangeTest" => {
            let p: RangeTestParams = parse_value(params, prefix, warnings)?;
            if p.lr_range_test_step_size.0 == 0 {
                return Err(invalid("lr_range_test_step_size", 0, "a whole number > 0"));
            }
            Schedule::LrRangeTest {
                min_lr: p.lr_range_test_min_lr,
                step_size: p.lr_range_test_step_size.0,
                step_rate: p.lr_range_test_step_rate,
                staircase: p.lr_range_test_staircase,
            }
        }
        other => {
            return Err(ConfigError::Invalid {
                key: "scheduler.type".into(),
                value: format!("\"{other}\""),
                allowed: SCHEDULE_TYPES.into(),
            });
        }
    };
    Ok(schedule)
}
