//! Value checks: every error names the key, the value and what is allowed.

use super::{
    ConfigError, DeepSpeedConfig, OffloadDevice, OptimizerConfig, OptimizerKind, ZeroStage,
};

fn invalid(key: &str, value: impl ToString, allowed: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

fn unsupported(key: &str, reason: &str) -> ConfigError {
    ConfigError::Unsupported {
        key: key.into(),
        reason: reason.into(),
    }
}

fn check(ok: bool, key: &str, value: impl ToString, allowed: &str) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(invalid(key, value, allowed))
    }
}

/// The stages this build was compiled with (Cargo features `zero1`, `zero2`, `zero3`).
pub fn compiled_stages() -> Vec<u8> {
    let compiled = ZeroStage::ALL.into_iter().filter(|s| s.compiled());
    compiled.map(ZeroStage::number).collect()
}

pub(super) fn validate(c: &DeepSpeedConfig, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
    let z = &c.zero_optimization;
    if !z.stage.compiled() {
        return Err(unsupported(
            "zero_optimization.stage",
            &format!(
                "stage {0} is not compiled in: enable burn-zero's `zero{0}` Cargo feature",
                z.stage
            ),
        ));
    }
    if z.legacy_stage1 {
        return Err(unsupported(
            "zero_optimization.legacy_stage1",
            "the legacy stage 1 is not supported (as in DeepSpeed >= 0.5.9)",
        ));
    }
    check(
        z.reduce_bucket_size.0 > 0,
        "zero_optimization.reduce_bucket_size",
        z.reduce_bucket_size,
        "> 0 elements",
    )?;
    check(
        z.allgather_bucket_size.0 > 0,
        "zero_optimization.allgather_bucket_size",
        z.allgather_bucket_size,
        "> 0 elements",
    )?;
    if z.cpu_offload.is_some() {
        warnings.push("`zero_optimization.cpu_offload` is deprecated: use offload_optimizer {\"device\": \"cpu\"}".into());
    }
    if z.cpu_offload_param.is_some() {
        warnings.push("`zero_optimization.cpu_offload_param` is deprecated: use offload_param {\"device\": \"cpu\"}".into());
    }
    if let Some(o) = &z.offload_optimizer {
        check(
            (0.0..=1.0).contains(&o.ratio),
            "zero_optimization.offload_optimizer.ratio",
            o.ratio,
            "0 to 1",
        )?;
        check(
            o.ratio == 1.0 || z.stage == ZeroStage::Parameters,
            "zero_optimization.offload_optimizer.ratio",
            o.ratio,
            "1 unless stage is 3",
        )?;
    }
    if z.optimizer_offload() == OffloadDevice::Nvme {
        let path = z
            .offload_optimizer
            .as_ref()
            .and_then(|o| o.nvme_path.as_deref());
        check(
            path.is_some_and(|p| !p.is_empty()),
            "zero_optimization.offload_optimizer.nvme_path",
            "missing",
            "a directory on the NVMe drive (required with \"device\": \"nvme\")",
        )?;
    }
    check(
        c.aio.block_size >= 4096 && c.aio.queue_depth >= 1,
        "aio",
        format!(
            "block_size {}, queue_depth {}",
            c.aio.block_size, c.aio.queue_depth
        ),
        "block_size of at least 4096 bytes and queue_depth of at least 1",
    )?;
    let pld = &c.progressive_layer_drop;
    check(
        (0.0..=1.0).contains(&pld.theta),
        "progressive_layer_drop.theta",
        pld.theta,
        "0 to 1",
    )?;
    check(
        pld.gamma.is_finite() && pld.gamma >= 0.0,
        "progressive_layer_drop.gamma",
        pld.gamma,
        ">= 0",
    )?;
    if let Some(t) = c.burn_zero.comm_timeout_s {
        check(
            t.is_finite() && t > 0.0,
            "burn_zero.comm_timeout_s",
            t,
            "a positive number of seconds",
        )?;
    }
    for (key, threads) in [
        ("burn_zero.cpu_adam.threads", c.burn_zero.cpu_adam.threads),
        (
            "burn_zero.cpu_adam.ahead_threads",
            c.burn_zero.cpu_adam.ahead_threads,
        ),
    ] {
        if let Some(t) = threads {
            check(t >= 1, key, t, "at least 1")?;
        }
    }
    check(
        c.burn_zero.max_buffer_elements >= 1,
        "burn_zero.max_buffer_elements",
        c.burn_zero.max_buffer_elements,
        "at least 1",
    )?;
    match z.param_offload() {
        OffloadDevice::None => {}
        OffloadDevice::Cpu => check(
            z.stage == ZeroStage::Parameters,
            "zero_optimization.offload_param",
            format!("\"device\": \"cpu\" at stage {}", z.stage),
            "stage 3 (parameters are partitioned only there)",
        )?,
        OffloadDevice::Nvme => {
            check(
                z.stage == ZeroStage::Parameters,
                "zero_optimization.offload_param",
                format!("\"device\": \"nvme\" at stage {}", z.stage),
                "stage 3 (parameters are partitioned only there)",
            )?;
            let path = z
                .offload_param
                .as_ref()
                .and_then(|o| o.nvme_path.as_deref());
            check(
                path.is_some_and(|p| !p.is_empty()),
                "zero_optimization.offload_param.nvme_path",
                "missing",
                "a directory on the NVMe drive (required with \"device\": \"nvme\")",
            )?;
        }
    }

    check(
        c.gradient_clipping.is_finite() && c.gradient_clipping >= 0.0,
        "gradient_clipping",
        c.gradient_clipping,
        ">= 0 (0 disables clipping)",
    )?;
    check(
        c.gradient_predivide_factor.is_finite() && c.gradient_predivide_factor > 0.0,
        "gradient_predivide_factor",
        c.gradient_predivide_factor,
        "> 0",
    )?;
    if let Some(steps) = c.steps_per_print {
        check(steps.0 > 0, "steps_per_print", steps, "> 0")?;
    }
    if let Some(t) = &c.communication_data_type {
        check(
            ["fp32", "fp16", "bf16"].contains(&t.as_str()),
            "communication_data_type",
            format!("\"{t}\""),
            "\"fp32\", \"fp16\" or \"bf16\"",
        )?;
    }
    if let Some(t) = &c.data_types.grad_accum_dtype {
        check(
            ["fp32", "fp16", "bf16"].contains(&t.as_str()),
            "data_types.grad_accum_dtype",
            format!("\"{t}\""),
            "\"fp32\", \"fp16\" or \"bf16\"",
        )?;
    }

    if c.fp16.enabled && c.bf16.enabled {
        return Err(invalid(
            "fp16.enabled",
            true,
            "false when bf16.enabled is true: bfloat16 and fp16 modes cannot both be enabled",
        ));
    }
    check(
        c.fp16.loss_scale.is_finite() && c.fp16.loss_scale >= 0.0,
        "fp16.loss_scale",
        c.fp16.loss_scale,
        ">= 0 (0 = dynamic)",
    )?;
    check(
        c.fp16.loss_scale_window.0 > 0,
        "fp16.loss_scale_window",
        c.fp16.loss_scale_window,
        "> 0",
    )?;
    check(
        c.fp16.min_loss_scale > 0.0,
        "fp16.min_loss_scale",
        c.fp16.min_loss_scale,
        "> 0",
    )?;
    check(
        c.fp16.hysteresis.0 > 0,
        "fp16.hysteresis",
        c.fp16.hysteresis,
        "> 0 (overflowing steps tolerated before the scale halves)",
    )?;
    check(
        c.fp16.initial_scale_power <= 127,
        "fp16.initial_scale_power",
        c.fp16.initial_scale_power,
        "<= 127 (the scale 2^n must be a finite f32)",
    )?;
    if let Some(o) = &c.optimizer {
        optimizer_kind(o)?;
        let p = &o.params;
        check(
            p.lr.is_finite() && p.lr >= 0.0,
            "optimizer.params.lr",
            p.lr,
            ">= 0",
        )?;
        check(
            p.weight_decay.is_finite() && p.weight_decay >= 0.0,
            "optimizer.params.weight_decay",
            p.weight_decay,
            ">= 0",
        )?;
        for (i, beta) in p.betas.iter().enumerate() {
            check(
                (0.0..1.0).contains(beta),
                &format!("optimizer.params.betas[{i}]"),
                beta,
                "0 <= beta < 1",
            )?;
        }
        check(
            p.eps.is_finite() && p.eps > 0.0,
            "optimizer.params.eps",
            p.eps,
            "> 0",
        )?;
        check(
            (0.0..=1.0).contains(&p.momentum),
            "optimizer.params.momentum",
            p.momentum,
            "0 to 1",
        )?;
        check(
            p.min_coeff.is_finite()
                && p.max_coeff.is_finite()
                && 0.0 <= p.min_coeff
                && p.min_coeff <= p.max_coeff,
            "optimizer.params.min_coeff",
            p.min_coeff,
            &format!(
                "0 <= min_coeff <= max_coeff ({}): LAMB's trust ratio range",
                p.max_coeff
            ),
        )?;
        check(
            (0.0..=1.0).contains(&p.dampening),
            "optimizer.params.dampening",
            p.dampening,
            "0 to 1",
        )?;
        if p.amsgrad {
            return Err(unsupported(
                "optimizer.params.amsgrad",
                "AMSGrad is not supported (as in DeepSpeed's FusedAdam)",
            ));
        }
        if let Some(norm) = p.max_grad_norm {
            return Err(invalid(
                "optimizer.params.max_grad_norm",
                norm,
                "absent: use the top-level `gradient_clipping` instead",
            ));
        }
    }
    Ok(())
}

/// The optimizer kind of `optimizer.type` (case-insensitive), with DeepSpeed's `adam_w_mode`.
pub(super) fn optimizer_kind(o: &OptimizerConfig) -> Result<OptimizerKind, ConfigError> {
    match o.kind.to_ascii_lowercase().as_str() {
        "adam" => Ok(OptimizerKind::Adam {
            decoupled_weight_decay: o.params.adam_w_mode,
        }),
        "adamw" => Ok(OptimizerKind::Adam {
            decoupled_weight_decay: true,
        }),
        "sgd" => Ok(OptimizerKind::Sgd),
        "lamb" => Ok(OptimizerKind::Lamb),
        "onebitadam" => Ok(OptimizerKind::OneBitAdam),
        _ => Err(invalid(
            "optimizer.type",
            format!("\"{}\"", o.kind),
            "\"Adam\", \"AdamW\", \"Lamb\", \"OneBitAdam\" or \"SGD\"",
        )),
    }
}
