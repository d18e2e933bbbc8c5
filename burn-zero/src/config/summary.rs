//! The resolved setup in a few lines, for the start of a run. The whole resolved config is
//! JSON (`serde_json::to_string_pretty(&resolved)`), for a run directory rather than a terminal.

use super::{OffloadDevice, OptimizerKind, ResolvedConfig};
use crate::schedule::Schedule;

impl ResolvedConfig {
    /// What this run does, one fact per line: ranks and ZeRO stage, the batch triad, optimizer
    /// and schedule, precision, offload, clipping and activation checkpointing.
    pub fn summary(&self) -> String {
        let c = &self.config;
        let zero = &c.zero_optimization;
        let partitioned = zero.stage.partitions();
        let b = &self.batch;
        let p = &self.optimizer_params;
        let optimizer = match self.optimizer {
            OptimizerKind::Adam {
                decoupled_weight_decay,
            } => {
                let name = if decoupled_weight_decay {
                    "AdamW"
                } else {
                    "Adam"
                };
                format!(
                    "{name}, lr {}, betas ({}, {}), weight decay {}",
                    p.lr, p.betas[0], p.betas[1], p.weight_decay
                )
            }
            OptimizerKind::Sgd => format!(
                "SGD, lr {}, momentum {}, weight decay {}",
                p.lr, p.momentum, p.weight_decay
            ),
            OptimizerKind::Lamb => format!(
                "LAMB, lr {}, betas ({}, {}), trust ratio in [{}, {}]",
                p.lr, p.betas[0], p.betas[1], p.min_coeff, p.max_coeff
            ),
            OptimizerKind::OneBitAdam => format!(
                "1-bit Adam, lr {}, compressed from step {}",
                p.lr, p.freeze_step
            ),
        };
        let precision = if c.bf16.enabled {
            "bf16 compute, fp32 master weights and optimizer state".to_string()
        } else if c.fp16.enabled {
            let scale = match c.fp16.loss_scale {
                s if s > 0.0 => format!("static loss scale {s}"),
                _ => format!("dynamic loss scale from 2^{}", c.fp16.initial_scale_power),
            };
            format!("fp16 compute ({scale}), fp32 master weights and optimizer state")
        } else {
            "fp32".to_string()
        };
        let place = |device: OffloadDevice| match device {
            OffloadDevice::None => "on the device",
            OffloadDevice::Cpu => "in host memory",
            OffloadDevice::Nvme => "on NVMe",
        };
        let (optimizer_place, param_place) =
            (place(zero.optimizer_offload()), place(zero.param_offload()));
        let placement = match optimizer_place == param_place {
            true => format!("optimizer state and parameters {optimizer_place}"),
            false => format!("optimizer state {optimizer_place}, parameters {param_place}"),
        };
        let clipping = match c.gradient_clipping {
            g if g > 0.0 => format!("global norm clipped at {g}"),
            _ => "no clipping".to_string(),
        };
        let checkpointing = match &c.activation_checkpointing {
            Some(_) => "on",
            None => "off",
        };
        let tuned = changed_keys(
            &serde_json::to_value(&c.burn_zero).unwrap_or_default(),
            &serde_json::to_value(crate::config::BurnZeroConfig::default()).unwrap_or_default(),
            "",
        );
        let tuned = match tuned.is_empty() {
            true => String::new(),
            false => format!("\nburn_zero: {}", tuned.join(", ")),
        };
        format!(
            "{} rank{}, ZeRO stage {}: {partitioned}\n\
             batch: {} samples a step = {} per rank x {} accumulation step{} x {} rank{}\n\
             optimizer: {optimizer}; schedule: {}\n\
             precision: {precision}; {clipping}\n\
             {placement}; activation checkpointing {checkpointing}{tuned}",
            self.world_size,
            plural(self.world_size),
            zero.stage,
            b.train_batch_size,
            b.micro_batch_per_gpu,
            b.gradient_accumulation_steps,
            plural(b.gradient_accumulation_steps),
            self.world_size,
            plural(self.world_size),
            schedule_summary(&self.schedule),
        )
    }
}

/// The leaves of `value` that differ from `default`, as `path=value` (the `burn_zero` keys a
/// run changed, by the config or an environment override).
fn changed_keys(value: &serde_json::Value, default: &serde_json::Value, path: &str) -> Vec<String> {
    match (value, default) {
        (serde_json::Value::Object(v), serde_json::Value::Object(d)) => v
            .iter()
            .flat_map(|(key, item)| {
                let path = match path {
                    "" => key.clone(),
                    _ => format!("{path}.{key}"),
                };
                let default = d.get(key).unwrap_or(&serde_json::Value::Null);
                changed_keys(item, default, &path)
            })
            .collect(),
        _ if value != default => vec![format!("{path}={value}")],
        _ => Vec::new(),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The schedule's name and its defining numbers.
fn schedule_summary(schedule: &Schedule) -> String {
    match schedule {
        Schedule::Constant { lr } => format!("constant lr {lr}"),
        Schedule::WarmupLr { min_lr, max_lr, .. } => {
            format!("WarmupLR {min_lr} -> {max_lr}, then constant")
        }
        Schedule::WarmupDecayLr {
            min_lr,
            max_lr,
            total_num_steps,
            ..
        } => format!("WarmupDecayLR {min_lr} -> {max_lr} -> {min_lr} over {total_num_steps} steps"),
        Schedule::WarmupCosineLr {
            total_num_steps, ..
        } => format!("WarmupCosineLR over {total_num_steps} steps"),
        Schedule::OneCycle(o) => format!("OneCycle {} <-> {}", o.min_lr, o.max_lr),
        Schedule::LrRangeTest { min_lr, .. } => format!("LRRangeTest from {min_lr}"),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::DeepSpeedConfig;

    /// A DeepSpeed config as a user writes it: every line of the summary says what it set.
    #[test]
    fn the_summary_names_what_the_config_chose() {
        let json = r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0005, "betas": [0.9, 0.95],
                "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 30,
                "warmup_max_lr": 0.0005, "warmup_num_steps": 5}},
            "bf16": {"enabled": true}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "activation_checkpointing": {}}"#;
        let resolved = DeepSpeedConfig::from_json(json)
            .unwrap()
            .config
            .resolve(2)
            .unwrap();
        let summary = resolved.summary();
        let lines: Vec<&str> = summary.lines().collect();
        assert_eq!(lines.len(), 5, "{summary}");
        assert_eq!(
            lines[0],
            "2 ranks, ZeRO stage 3: optimizer state, gradients and parameters partitioned"
        );
        assert_eq!(
            lines[1],
            "batch: 24 samples a step = 4 per rank x 3 accumulation steps x 2 ranks"
        );
        assert!(
            lines[2].starts_with("optimizer: AdamW, lr 0.0005, betas (0.9, 0.95), weight decay 0.01; schedule: WarmupDecayLR 0 -> 0.0005 -> 0 over 30 steps"),
            "{summary}"
        );
        assert_eq!(
            lines[3],
            "precision: bf16 compute, fp32 master weights and optimizer state; global norm clipped at 1"
        );
        assert_eq!(
            lines[4],
            "optimizer state in host memory, parameters on the device; activation checkpointing on"
        );
        // Much shorter than the JSON it replaces at the start of a run.
        let json_len = serde_json::to_string(&resolved).unwrap().len();
        assert!(
            summary.len() * 5 < json_len,
            "{} vs {json_len}",
            summary.len()
        );
    }

    #[test]
    fn a_plain_config_reads_plainly() {
        let json = r#"{"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "gradient_clipping": 0}"#;
        let resolved = DeepSpeedConfig::from_json(json)
            .unwrap()
            .config
            .resolve(1)
            .unwrap();
        let summary = resolved.summary();
        assert!(
            summary.starts_with("1 rank, ZeRO stage 0: nothing partitioned"),
            "{summary}"
        );
        assert!(
            summary.contains("batch: 8 samples a step = 8 per rank x 1 accumulation step x 1 rank"),
            "{summary}"
        );
        assert!(summary.contains("schedule: constant lr 0.1"), "{summary}");
        assert!(
            summary.contains("precision: fp32; no clipping"),
            "{summary}"
        );
        assert!(
            summary.contains("activation checkpointing off"),
            "{summary}"
        );
    }

    #[test]
    fn the_burn_zero_keys_a_run_changed_are_listed() {
        let text = r#"{"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "burn_zero": {"fused_adam": false,
            "matmul": {"cublaslt": false, "sm_margin": 1}}}"#;
        let summary = DeepSpeedConfig::parse_json(text)
            .unwrap()
            .config
            .resolve(1)
            .unwrap()
            .summary();
        let last = summary.lines().last().unwrap();
        assert_eq!(last, "burn_zero: fused_adam=false, matmul.cublaslt=false");
        let plain =
            r#"{"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}"#;
        let plain = DeepSpeedConfig::parse_json(plain).unwrap();
        let plain = plain.config.resolve(1).unwrap().summary();
        assert_eq!(plain.lines().count(), 5, "{plain}");
    }
}
