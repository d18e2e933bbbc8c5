//! Environment variables that override a `burn_zero` key, for an A/B run without editing the
//! config. `initialize` reads them once into the resolved config, which then holds the run's
//! whole truth (`engine.config()`, the run directory's `resolved_config.json`), and logs each.

use serde_json::Value;

use super::{ConfigError, DeepSpeedConfig, ResolvedConfig};

/// The kind of value a key takes.
#[derive(Clone, Copy)]
enum Kind {
    /// `0`/`1` (or `false`/`true`).
    Bool,
    /// As `Bool`, or `auto` for the key's automatic choice (null).
    AutoBool,
    /// A number.
    Number,
    /// One of these words (an enum key's values).
    Word(&'static [&'static str]),
}

/// Each variable, the key it overrides and its kind.
const OVERRIDES: &[(&str, &str, Kind)] = &[
    (
        "BURN_ZERO_FLASH_ATTENTION",
        "flash_attention",
        Kind::AutoBool,
    ),
    (
        "BURN_ZERO_ATTENTION_TENSOR_CORES",
        "attention_tensor_cores",
        Kind::Bool,
    ),
    (
        "BURN_ZERO_ATTENTION_REGISTER_SCORES",
        "attention_register_scores",
        Kind::Bool,
    ),
    ("BURN_ZERO_FUSED_ADAM", "fused_adam", Kind::Bool),
    ("BURN_ZERO_HOST_COLLECTIVES", "host_collectives", Kind::Bool),
    ("BURN_ZERO_PEAK_TFLOPS", "peak_tflops", Kind::Number),
    ("BURN_ZERO_CUBLASLT", "matmul.cublaslt", Kind::Bool),
    (
        "BURN_ZERO_CUBLASLT_SM_MARGIN",
        "matmul.sm_margin",
        Kind::Number,
    ),
    ("BURN_ZERO_CUBLASLT_TUNE", "matmul.tune", Kind::Bool),
    (
        "BURN_ZERO_CUBLASLT_ORDER",
        "matmul.order",
        Kind::Word(&["stream", "handshake"]),
    ),
    ("BURN_ZERO_MATMUL_PROFILE", "matmul.profile", Kind::Bool),
    (
        "BURN_ZERO_FUSED_RMS_NORM",
        "fused_kernels.rms_norm",
        Kind::Bool,
    ),
    ("BURN_ZERO_FUSED_ROPE", "fused_kernels.rope", Kind::Bool),
    ("BURN_ZERO_FUSED_SWIGLU", "fused_kernels.swiglu", Kind::Bool),
    (
        "BURN_ZERO_FUSED_CROSS_ENTROPY",
        "fused_kernels.cross_entropy",
        Kind::Bool,
    ),
    ("BURN_ZERO_COMM_TIMEOUT_S", "comm_timeout_s", Kind::Number),
    ("BURN_ZERO_DETERMINISTIC", "deterministic", Kind::Bool),
    ("BURN_ZERO_EAGER_HOST_QUEUE", "eager_host_queue", Kind::Bool),
    ("BURN_ZERO_CUDA_GRAPHS", "cuda_graphs.enabled", Kind::Bool),
];

/// The variables that may override a key, with the key they override.
pub fn env_overrides() -> impl Iterator<Item = (&'static str, String)> {
    OVERRIDES
        .iter()
        .map(|(var, key, _)| (*var, format!("burn_zero.{key}")))
}

impl ResolvedConfig {
    /// Applies every override `env` (a variable's value by name) holds; returns one line per
    /// override applied (`BURN_ZERO_CUBLASLT=0 overrides burn_zero.matmul.cublaslt (true → false)`).
    pub fn apply_env_overrides(
        &mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Vec<String>, ConfigError> {
        let mut tree = serde_json::to_value(&self.config.burn_zero).expect("serializes");
        let mut applied = Vec::new();
        for (var, key, kind) in OVERRIDES {
            let Some(raw) = env(var) else {
                continue;
            };
            let value = parse(kind, raw.trim()).ok_or_else(|| ConfigError::Invalid {
                key: format!("{var} (overriding burn_zero.{key})"),
                value: format!("{raw:?}"),
                allowed: match kind {
                    Kind::Bool => "0 or 1".into(),
                    Kind::AutoBool => "0, 1 or auto".into(),
                    Kind::Number => "a number".into(),
                    Kind::Word(words) => words.join(" or "),
                },
            })?;
            let pointer = format!("/{}", key.replace('.', "/"));
            let slot = tree
                .pointer_mut(&pointer)
                .expect("every override names a key");
            applied.push(format!(
                "{var}={raw} overrides burn_zero.{key} ({slot} → {value})"
            ));
            *slot = value;
        }
        if !applied.is_empty() {
            let parsed: DeepSpeedConfig = serde_json::from_value(serde_json::json!({
                "burn_zero": tree
            }))
            .map_err(|e| ConfigError::Parse {
                key: "burn_zero".into(),
                reason: format!("after the environment's overrides: {e}"),
            })?;
            let mut config = self.config.clone();
            config.burn_zero = parsed.burn_zero;
            // An override is held to the key's own rules (its warnings were given already).
            super::validate::validate(&config, &mut Vec::new()).map_err(|e| match e {
                ConfigError::Invalid {
                    key,
                    value,
                    allowed,
                } => ConfigError::Invalid {
                    key: format!("{key} (from the environment)"),
                    value,
                    allowed,
                },
                other => other,
            })?;
            self.config = config;
        }
        Ok(applied)
    }
}

fn parse(kind: &Kind, raw: &str) -> Option<Value> {
    let bool = match raw {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    };
    match kind {
        Kind::Bool => bool.map(Value::Bool),
        Kind::AutoBool if raw == "auto" => Some(Value::Null),
        Kind::AutoBool => bool.map(Value::Bool),
        Kind::Number => raw
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .and_then(|v| serde_json::to_value(v).ok())
            .map(|v| match raw.parse::<i64>() {
                Ok(i) => Value::from(i),
                Err(_) => v,
            }),
        Kind::Word(words) => words.contains(&raw).then(|| Value::String(raw.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved() -> ResolvedConfig {
        let text = r#"{"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "burn_zero": {"matmul": {"cublaslt": true}}}"#;
        DeepSpeedConfig::parse_json(text)
            .unwrap()
            .config
            .resolve(1)
            .unwrap()
    }

    #[test]
    fn a_variable_overrides_its_key_and_says_so() {
        let mut r = resolved();
        let env = |k: &str| match k {
            "BURN_ZERO_CUBLASLT" => Some("0".to_string()),
            "BURN_ZERO_FLASH_ATTENTION" => Some("auto".to_string()),
            "BURN_ZERO_CUBLASLT_SM_MARGIN" => Some("3".to_string()),
            "BURN_ZERO_PEAK_TFLOPS" => Some("989.5".to_string()),
            "BURN_ZERO_CUBLASLT_ORDER" => Some("handshake".to_string()),
            "BURN_ZERO_EAGER_HOST_QUEUE" => Some("0".to_string()),
            _ => None,
        };
        let lines = r.apply_env_overrides(env).unwrap();
        let b = &r.config.burn_zero;
        assert!(!b.matmul.cublaslt);
        assert_eq!(b.flash_attention, None);
        assert_eq!(b.matmul.sm_margin, 3);
        assert_eq!(b.peak_tflops, Some(989.5));
        assert_eq!(b.matmul.order, crate::config::GemmOrder::Handshake);
        assert!(!b.eager_host_queue);
        assert_eq!(lines.len(), 6, "{lines:?}");
        assert!(
            lines.contains(
                &"BURN_ZERO_CUBLASLT=0 overrides burn_zero.matmul.cublaslt (true → false)".into()
            ),
            "{lines:?}"
        );
        // Nothing set: nothing changes.
        let mut untouched = resolved();
        assert!(untouched.apply_env_overrides(|_| None).unwrap().is_empty());
        assert_eq!(untouched.config, resolved().config);
    }

    #[test]
    fn a_bad_value_names_the_variable_and_the_key() {
        let mut r = resolved();
        let err = r
            .apply_env_overrides(|k| (k == "BURN_ZERO_FUSED_ADAM").then(|| "yes".into()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("BURN_ZERO_FUSED_ADAM (overriding burn_zero.fused_adam)")
                && err.contains("\"yes\"")
                && err.contains("0 or 1"),
            "{err}"
        );
        let err = r
            .apply_env_overrides(|k| (k == "BURN_ZERO_CUBLASLT_ORDER").then(|| "flags".into()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("BURN_ZERO_CUBLASLT_ORDER (overriding burn_zero.matmul.order)")
                && err.contains("\"flags\"")
                && err.contains("stream or handshake"),
            "{err}"
        );
    }

    #[test]
    fn an_override_is_held_to_its_keys_rules() {
        let mut r = resolved();
        let set =
            |v: &'static str| move |k: &str| (k == "BURN_ZERO_COMM_TIMEOUT_S").then(|| v.into());
        r.apply_env_overrides(set("2.5")).unwrap();
        assert_eq!(r.config.burn_zero.comm_timeout_s, Some(2.5));
        let mut r = resolved();
        let err = r.apply_env_overrides(set("-1")).unwrap_err().to_string();
        assert!(
            err.contains("burn_zero.comm_timeout_s (from the environment)")
                && err.contains("a positive number of seconds"),
            "{err}"
        );
        assert_eq!(r.config.burn_zero.comm_timeout_s, None, "left as it was");
    }
}
