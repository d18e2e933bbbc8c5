//! Config loading: DeepSpeed's defaults, aliases and `"auto"`, the batch triad, unknown keys
//! warned by name, and bad values reported with their key and allowed range.

use super::*;

fn load(json: &str) -> Loaded {
    DeepSpeedConfig::from_json(json).unwrap_or_else(|e| panic!("{e}"))
}

fn error(json: &str) -> String {
    match DeepSpeedConfig::from_json(json) {
        Ok(_) => panic!("expected an error for {json}"),
        Err(e) => e.to_string(),
    }
}

const ADAMW: &str = r#""optimizer": {"type": "AdamW", "params": {"lr": 0.01}}"#;

#[test]
fn deepspeed_defaults() {
    let c = load("{}").config;
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(c.steps_per_print, None);
    assert!(!c.wall_clock_breakdown && !c.prescale_gradients);
    let z = &c.zero_optimization;
    assert_eq!(
        (z.stage, z.reduce_bucket_size.0, z.allgather_bucket_size.0),
        (ZeroStage::Disabled, 500_000_000, 500_000_000)
    );
    assert!(z.contiguous_gradients && z.reduce_scatter && !z.overlap_comm());
    assert_eq!(
        (z.prefetch_bucket_size.0, z.param_persistence_threshold.0),
        (50_000_000, 100_000)
    );
    assert_eq!(
        (z.max_live_parameters.0, z.sub_group_size.0),
        (1_000_000_000, 1_000_000_000)
    );
    assert_eq!(c.fp16.initial_scale_power, 16);
    assert_eq!((c.fp16.loss_scale_window.0, c.fp16.hysteresis.0), (1000, 2));
    let p = OptimizerParams::default();
    assert_eq!(
        (p.lr, p.betas, p.eps, p.weight_decay, p.adam_w_mode),
        (1e-3, [0.9, 0.999], 1e-8, 0.0, true)
    );
}

#[test]
fn stage3_aliases_and_float_counts() {
    let c = load(
        r#"{"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e8,
        "stage3_gather_fp16_weights_on_model_save": true, "reduce_bucket_size": 2e8}}"#,
    )
    .config;
    let z = &c.zero_optimization;
    assert_eq!(z.prefetch_bucket_size.0, 50_000_000);
    assert_eq!(z.param_persistence_threshold.0, 10_000);
    assert_eq!(z.max_live_parameters.0, 300_000_000);
    assert_eq!(z.reduce_bucket_size.0, 200_000_000);
    assert!(z.gather_16bit_weights_on_model_save);
    let stage1 = load(r#"{"zero_optimization": {"stage": 1, "overlap_comm": true}}"#).config;
    assert!(
        stage1.zero_optimization.overlap_comm(),
        "given overlap_comm wins"
    );
}

#[test]
fn a_real_hugging_face_config_with_auto_values_loads() {
    let loaded = load(include_str!("../../../examples/configs/hf_zero2_auto.json"));
    let c = &loaded.config;
    assert_eq!(c.zero_optimization.stage, 2);
    assert_eq!(c.zero_optimization.reduce_bucket_size.0, 200_000_000);
    assert!(c.zero_optimization.overlap_comm() && c.zero_optimization.round_robin_gradients);
    assert!(
        !c.fp16.enabled && !c.bf16.enabled,
        "auto leaves mixed precision off"
    );
    assert_eq!(
        c.optimizer.as_ref().unwrap().params,
        OptimizerParams::default()
    );
    assert_eq!(c.gradient_clipping, 1.0);
    for key in [
        "fp16.enabled",
        "optimizer.params.lr",
        "gradient_accumulation_steps",
        "train_batch_size",
    ] {
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains(&format!("`{key}` is \"auto\""))),
            "{key}: {:?}",
            loaded.warnings
        );
    }
    // Every batch key is "auto": nothing to derive the triad from, and the error says so.
    let e = c.resolve(2).unwrap_err().to_string();
    assert!(
        e.contains("train_batch_size (not given)")
            && e.contains("train_micro_batch_size_per_gpu (not given)"),
        "{e}"
    );
}

#[test]
fn a_key_given_twice_is_refused_with_its_line() {
    let e =
        error("{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 1, \"stage\": 3}}");
    assert!(
        e.contains("key `stage` appears twice") && e.contains("line 2"),
        "{e}"
    );
    // Nested values and arrays still read as before.
    let loaded = load(r#"{"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.9]}}}"#);
    assert_eq!(loaded.config.optimizer.unwrap().params.betas, [0.8, 0.9]);
}

#[test]
fn a_file_s_errors_name_the_file() {
    let path = std::env::temp_dir().join(format!("bz-ds-config-{}.json", std::process::id()));
    std::fs::write(&path, r#"{"zero_optimization": {"stage": 5}}"#).unwrap();
    let e = DeepSpeedConfig::from_file(&path).err().unwrap().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        e.starts_with(&path.display().to_string()) && e.contains("`zero_optimization.stage` = 5"),
        "{e}"
    );
}

#[test]
fn likely_typos_name_the_key_they_miss() {
    let loaded = load(
        r#"{"train_batch_size": 8, "zero_optimisation": {"stage": 3},
        "fp16": {"enable": true},
        "optimizer": {"type": "AdamW", "parms": {"lr": 0.1}},
        "zero_optimization": {"stage": 1, "reduce_bucket": 5}, "xyz": 1}"#,
    );
    let w = &loaded.warnings;
    for (key, known) in [
        ("zero_optimisation", "zero_optimization"),
        ("fp16.enable", "enabled"),
        ("optimizer.parms", "params"),
    ] {
        let expected = format!("unknown key `{key}`: ignored (did you mean `{known}`?)");
        assert!(w.contains(&expected), "{expected} not in {w:?}");
    }
    // Nothing close: no guess.
    for key in ["zero_optimization.reduce_bucket", "xyz"] {
        let expected = format!("unknown key `{key}`: ignored");
        assert!(w.contains(&expected), "{expected} not in {w:?}");
    }
}

#[test]
fn unknown_keys_are_warned_by_name() {
    let loaded = load(
        r#"{"train_batch_size": 8, "tran_batch_size": 8, "tensorboard": {"enabled": true},
        "zero_optimization": {"stage": 1, "reduce_bucket": 5},
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "beta": [0.9, 0.9]}}}"#,
    );
    let w = &loaded.warnings;
    assert!(
        w.contains(
            &"unknown key `tran_batch_size`: ignored (did you mean `train_batch_size`?)"
                .to_string()
        ),
        "{w:?}"
    );
    assert!(
        w.contains(&"unknown key `zero_optimization.reduce_bucket`: ignored".to_string()),
        "{w:?}"
    );
    assert!(
        w.contains(
            &"unknown key `optimizer.params.beta`: ignored (did you mean `betas`?)".to_string()
        ),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|m| m
                .contains("`tensorboard` is a DeepSpeed section burn-zero does not implement yet")),
        "{w:?}"
    );
    assert_eq!(w.len(), 4, "{w:?}");
}

#[test]
fn bad_values_name_the_key_and_the_allowed_range() {
    let cases = [
        (
            r#"{"zero_optimization": {"stage": 5}}"#,
            "`zero_optimization.stage` = 5 is invalid: allowed 0, 1, 2 or 3",
        ),
        (
            r#"{"zero_optimization": {"stage": "two"}}"#,
            "`zero_optimization.stage`",
        ),
        (
            r#"{"zero_optimization": {"reduce_bucket_size": 0}}"#,
            "`zero_optimization.reduce_bucket_size` = 0 is invalid: allowed > 0",
        ),
        (
            r#"{"zero_optimization": {"reduce_bucket_size": 2.5}}"#,
            "`zero_optimization.reduce_bucket_size`: expected a non-negative whole number",
        ),
        (
            r#"{"gradient_clipping": -1}"#,
            "`gradient_clipping` = -1 is invalid: allowed >= 0",
        ),
        (
            r#"{"optimizer": {"type": "Lion"}}"#,
            "`optimizer.type` = \"Lion\" is invalid: allowed \"Adam\", \"AdamW\", \"Lamb\", \"OneBitAdam\" or \"SGD\"",
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}"#,
            "`optimizer.params.betas[1]` = 1.5 is invalid: allowed 0 <= beta < 1",
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"eps": 0}}}"#,
            "`optimizer.params.eps` = 0 is invalid",
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}"#,
            "use the top-level `gradient_clipping`",
        ),
        (
            r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
            "cannot both be enabled",
        ),
        (
            r#"{"fp16": {"enabled": true, "hysteresis": 0}}"#,
            "`fp16.hysteresis` = 0 is invalid: allowed > 0",
        ),
        (
            r#"{"fp16": {"enabled": true, "initial_scale_power": 200}}"#,
            "`fp16.initial_scale_power` = 200 is invalid: allowed <= 127",
        ),
        (
            r#"{"optimizer": {"type": "Lamb", "params": {"min_coeff": 2, "max_coeff": 1}}}"#,
            "`optimizer.params.min_coeff` = 2 is invalid: allowed 0 <= min_coeff <= max_coeff (1)",
        ),
        (
            r#"{"communication_data_type": "int8"}"#,
            "`communication_data_type` = \"int8\" is invalid",
        ),
        (
            r#"{"steps_per_print": 0}"#,
            "`steps_per_print` = 0 is invalid: allowed > 0",
        ),
        (r#"[1, 2]"#, "must be a JSON object"),
        (r#"{"train_batch_size": 8,}"#, "not valid JSON"),
    ];
    for (json, want) in cases {
        let e = error(json);
        assert!(e.contains(want), "{json}\n  gave: {e}\n  want: {want}");
    }
}

#[test]
fn unsupported_features_are_refused_clearly() {
    let json = r#"{"zero_optimization": {"stage": 1, "legacy_stage1": true}}"#;
    let e = error(json);
    assert!(
        e.contains("`zero_optimization.legacy_stage1`") && e.contains("not supported"),
        "{json}: {e}"
    );
    // Parameter offload to NVMe is accepted at stage 3 with a path.
    let json = r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}"#;
    load(json);
}

#[test]
fn zero_cpu_adam_threads_are_refused_by_key() {
    for key in ["threads", "ahead_threads"] {
        let json = format!(r#"{{"burn_zero": {{"cpu_adam": {{"{key}": 0}}}}}}"#);
        let e = error(&json);
        assert!(
            e.contains(&format!("burn_zero.cpu_adam.{key}")) && e.contains("at least 1"),
            "{json}: {e}"
        );
    }
    let json = r#"{"train_batch_size": 4, "burn_zero": {"cpu_adam": {"ahead_threads": 3}}}"#;
    assert_eq!(load(json).config.burn_zero.cpu_adam.ahead_threads, Some(3));
}

#[test]
fn legacy_boolean_zero_optimization() {
    let loaded = load(r#"{"zero_optimization": true}"#);
    assert_eq!(loaded.config.zero_optimization.stage, 1);
    assert!(loaded.warnings[0].contains("deprecated"));
}

#[test]
fn batch_triad_any_two_determine_the_third() {
    let r = |tb, mb, gas, w| BatchSizes::resolve(tb, mb, gas, w);
    let b = |tb, mb, gas| BatchSizes {
        train_batch_size: tb,
        micro_batch_per_gpu: mb,
        gradient_accumulation_steps: gas,
    };
    assert_eq!(r(Some(32), Some(4), Some(2), 4).unwrap(), b(32, 4, 2));
    assert_eq!(r(Some(32), Some(4), None, 4).unwrap(), b(32, 4, 2));
    assert_eq!(r(Some(32), None, Some(2), 4).unwrap(), b(32, 4, 2));
    assert_eq!(r(None, Some(4), Some(2), 4).unwrap(), b(32, 4, 2));
    assert_eq!(r(Some(32), None, None, 4).unwrap(), b(32, 8, 1));
    assert_eq!(r(None, Some(4), None, 3).unwrap(), b(12, 4, 1));
}

#[test]
fn batch_triad_errors_name_all_three() {
    let e = BatchSizes::resolve(Some(10), Some(3), Some(3), 1)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "ds_config: train_batch_size (10) must equal train_micro_batch_size_per_gpu (3) x \
         gradient_accumulation_steps (3) x world size (1) = 9"
    );
    let e = BatchSizes::resolve(Some(32), Some(3), None, 4)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train_batch_size (32)")
            && e.contains("(3)")
            && e.contains("gradient_accumulation_steps (not given)")
            && e.contains("32 / 12 is not a whole number"),
        "{e}"
    );
    let e = BatchSizes::resolve(None, None, Some(2), 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("give train_batch_size or train_micro_batch_size_per_gpu"),
        "{e}"
    );
    let e = BatchSizes::resolve(None, Some(u64::MAX / 2), Some(4), 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiply beyond 2^64"), "{e}");
    let e = BatchSizes::resolve(Some(0), Some(1), None, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`train_batch_size` = 0 is invalid"), "{e}");
}

#[test]
fn resolve_optimizer_kinds_like_deepspeed() {
    let kind = |t: &str, extra: &str| {
        let json = format!(
            r#"{{"train_batch_size": 4, "optimizer": {{"type": "{t}", "params": {{"lr": 0.1{extra}}}}}}}"#
        );
        load(&json).config.resolve(2).unwrap().optimizer
    };
    assert_eq!(
        kind("Adam", ""),
        OptimizerKind::Adam {
            decoupled_weight_decay: true
        },
        "adam_w_mode defaults on"
    );
    assert_eq!(
        kind("Adam", r#", "adam_w_mode": false"#),
        OptimizerKind::Adam {
            decoupled_weight_decay: false
        }
    );
    assert_eq!(
        kind("AdamW", r#", "adam_w_mode": false"#),
        OptimizerKind::Adam {
            decoupled_weight_decay: true
        }
    );
    assert_eq!(kind("SGD", r#", "momentum": 0.9"#), OptimizerKind::Sgd);
    let r = load(&format!(r#"{{"train_batch_size": 4, {ADAMW}}}"#))
        .config
        .resolve(2)
        .unwrap();
    assert_eq!(r.schedule, crate::schedule::Schedule::Constant { lr: 0.01 });
    let e = load(r#"{"train_batch_size": 4}"#)
        .config
        .resolve(1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`optimizer`") && e.contains("required"), "{e}");
}

/// `sparse_attention` is read with DeepSpeed's keys (no longer "not implemented yet"), a mode's
/// own keys and defaults reach its layout settings, and a misspelled key is named.
#[test]
fn sparse_attention_is_read_with_deepspeed_keys() {
    let loaded = load(
        r#"{"train_batch_size": 8, "sparse_attention": {"mode": "bslongformer", "block": 32,
        "num_sliding_window_blocks": 5, "global_block_indices": [0, 4],
        "num_slidng_window_blocks": 3}}"#,
    );
    let sparse = loaded
        .config
        .sparse_attention
        .as_ref()
        .expect("the section is read");
    assert_eq!(
        loaded.warnings,
        vec![
            "unknown key `sparse_attention.num_slidng_window_blocks`: ignored (did you mean \
             `num_sliding_window_blocks`?)"
                .to_string()
        ]
    );
    let s = sparse.sparsity(12).unwrap();
    assert_eq!((s.num_heads, s.block), (12, 32));
    match s.mode {
        cubecl_kernels::sparse::SparsityMode::BsLongformer(c) => {
            assert_eq!(c.num_sliding_window_blocks, 5);
            assert_eq!(c.global_block_indices, vec![0, 4]);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        load(r#"{"train_batch_size": 8}"#)
            .config
            .sparse_attention
            .is_none()
    );
}

/// A stage whose Cargo feature is off is refused by name (CI runs this under
/// `--no-default-features` with `zero2`, where stage 3 is not compiled in).
#[test]
fn a_stage_not_compiled_in_is_refused_by_name() {
    for stage in ZeroStage::ALL {
        let json =
            format!(r#"{{"train_batch_size": 1, "zero_optimization": {{"stage": {stage}}}}}"#);
        if stage.compiled() {
            assert_eq!(load(&json).config.zero_optimization.stage, stage);
        } else {
            let e = error(&json);
            let want = format!(
                "stage {stage} is not compiled in: enable burn-zero's `zero{stage}` Cargo feature"
            );
            assert!(e.contains(&want), "{e}");
        }
    }
}
