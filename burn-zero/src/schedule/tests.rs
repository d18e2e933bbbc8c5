//! Each schedule against DeepSpeed 0.19's formulas. Expected values are worked out by hand from
//! the formulas (closed forms such as ln 3 / ln 4, or plain arithmetic), never from this code.
//! `after(k)` is the learning rate after the k-th scheduler step (iteration k − 1); `init` is
//! the value at construction.

use super::*;
use crate::config::SchedulerConfig;

fn schedule(kind: &str, params: serde_json::Value, optimizer_lr: f64) -> Schedule {
    let config = SchedulerConfig {
        kind: kind.into(),
        params,
    };
    let mut warnings = Vec::new();
    let s = Schedule::from_config(Some(&config), optimizer_lr, &mut warnings).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    s
}

fn after(s: &Schedule, k: i64) -> f64 {
    s.lr(k - 1)
}

fn assert_curve(s: &Schedule, init: f64, expected_after: &[f64]) {
    assert!(
        (s.lr(-1) - init).abs() < 1e-12,
        "init: {} vs {init}",
        s.lr(-1)
    );
    for (i, want) in expected_after.iter().enumerate() {
        let k = i as i64 + 1;
        let got = after(s, k);
        assert!((got - want).abs() < 1e-9, "after step {k}: {got} vs {want}");
    }
}

#[test]
fn warmup_lr_log_and_linear() {
    let p = |t: &str| serde_json::json!({"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": t});
    let log = schedule("WarmupLR", p("log"), 0.5);
    assert_curve(&log, 0.0, &[0.0, 0.5, 3f64.ln() / 4f64.ln(), 1.0, 1.0, 1.0]);
    let linear = schedule("WarmupLR", p("linear"), 0.5);
    assert_curve(&linear, 0.0, &[0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
}

#[test]
fn warmup_lr_defaults_peak_to_the_optimizer_lr_and_shifts_by_min() {
    let s = schedule(
        "WarmupLR",
        serde_json::json!({"warmup_min_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}),
        0.6,
    );
    // min + (max − min)·(k−1)/N with max = the optimizer's lr.
    assert_curve(&s, 0.1, &[0.1, 0.15, 0.2]);
    assert!((after(&s, 11) - 0.6).abs() < 1e-12);
    assert!((after(&s, 500) - 0.6).abs() < 1e-12);
}

#[test]
fn warmup_num_steps_of_one_becomes_two() {
    let s = schedule(
        "WarmupLR",
        serde_json::json!({"warmup_max_lr": 1.0, "warmup_num_steps": 1, "warmup_type": "linear"}),
        1.0,
    );
    assert_curve(&s, 0.0, &[0.0, 0.5, 1.0]);
}

#[test]
fn warmup_decay_lr_decays_to_the_minimum() {
    let s = schedule(
        "WarmupDecayLR",
        serde_json::json!({"total_num_steps": 10, "warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}),
        0.5,
    );
    // Decay at iteration i >= N: (T − i)/(T − N) = (10 − i)/6.
    assert_curve(
        &s,
        0.0,
        &[
            0.0,
            0.25,
            0.5,
            0.75,
            1.0,
            5.0 / 6.0,
            4.0 / 6.0,
            0.5,
            2.0 / 6.0,
            1.0 / 6.0,
            0.0,
            0.0,
        ],
    );
    let with_min = schedule(
        "WarmupDecayLR",
        serde_json::json!({"total_num_steps": 10, "warmup_min_lr": 0.2, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"}),
        0.5,
    );
    assert!(
        (after(&with_min, 12) - 0.2).abs() < 1e-12,
        "ends at warmup_min_lr, not 0"
    );
}

#[test]
fn warmup_cosine_lr_linear_and_default() {
    let s = schedule(
        "WarmupCosineLR",
        serde_json::json!({"total_num_steps": 10, "warmup_num_steps": 4, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0, "warmup_type": "linear"}),
        1.0,
    );
    // After warmup: (1 + cos(π·j/6))/2 for j = 1..6.
    let c = |j: f64| (1.0 + (core::f64::consts::PI * j / 6.0).cos()) / 2.0;
    assert_curve(
        &s,
        0.0,
        &[
            0.0,
            0.25,
            0.5,
            0.75,
            c(1.0),
            c(2.0),
            c(3.0),
            c(4.0),
            c(5.0),
            0.0,
            0.0,
            0.0,
        ],
    );
    assert!((after(&s, 6) - 0.75).abs() < 1e-12 && (after(&s, 5) - 0.9330127019).abs() < 1e-9);

    let d = schedule(
        "WarmupCosineLR",
        serde_json::json!({"total_num_steps": 10, "warmup_num_steps": 4}),
        2.0,
    );
    // Defaults: log warmup, warmup_min_ratio 0, cos_min_ratio 1e−4; lr = 2 · ratio.
    let r = |j: f64| 1e-4 + (1.0 - 1e-4) * c(j);
    let want: Vec<f64> = [
        0.0,
        0.5,
        3f64.ln() / 4f64.ln(),
        1.0,
        r(1.0),
        r(2.0),
        r(3.0),
        r(4.0),
        r(5.0),
        1e-4,
        1e-4,
    ]
    .iter()
    .map(|x| 2.0 * x)
    .collect();
    assert_curve(&d, 0.0, &want);
}

#[test]
fn one_cycle_lr_and_momentum() {
    let s = schedule(
        "OneCycle",
        serde_json::json!({"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                           "decay_step_size": 2, "decay_lr_rate": 1.0, "decay_mom_rate": 0.5}),
        0.5,
    );
    assert_curve(
        &s,
        0.0,
        &[0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0],
    );
    // beta1 = max − (max − min)·scale in the cycle; max·(1 + rate·d/size) in the decay.
    let beta1 = [
        0.875,
        0.85,
        0.825,
        0.8,
        0.825,
        0.85,
        0.875,
        0.9,
        0.9 * 1.25,
        0.9 * 1.5,
        0.9 * 1.75,
        0.9 * 2.0,
    ];
    assert_eq!(
        s.betas(-1),
        Some((0.8, 0.99)),
        "construction sets the minimum momentum"
    );
    for (i, want) in beta1.iter().enumerate() {
        let (b1, b2) = s.betas(i as i64).unwrap();
        assert!(
            (b1 - want).abs() < 1e-12 && b2 == 0.99,
            "after step {}: {b1}",
            i + 1
        );
    }
    let decaying = schedule(
        "OneCycle",
        serde_json::json!({"cycle_min_lr": 0.5, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "decay_step_size": 2, "decay_lr_rate": 1.0}),
        0.5,
    );
    // Hyperbolic decay min/(1 + rate·d/size): d = 1 → 0.5/1.5, d = 2 → 0.5/2.
    assert!((after(&decaying, 9) - 0.5 / 1.5).abs() < 1e-12);
    assert!((after(&decaying, 10) - 0.25).abs() < 1e-12);
}

#[test]
fn one_cycle_stairs() {
    let s = schedule(
        "OneCycle",
        serde_json::json!({"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4, "cycle_first_stair_count": 2}),
        0.5,
    );
    assert_curve(&s, 0.0, &[0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]);
}

#[test]
fn lr_range_test_continuous_and_staircase() {
    let p = |stairs: bool| serde_json::json!({"lr_range_test_min_lr": 1.0, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": stairs});
    assert_curve(
        &schedule("LRRangeTest", p(false), 0.5),
        1.0,
        &[1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
    );
    assert_curve(
        &schedule("LRRangeTest", p(true), 0.5),
        1.0,
        &[1.0, 2.0, 2.0, 3.0, 3.0, 4.0],
    );
}

#[test]
fn scheduler_counts_like_deepspeed() {
    let mut s = Scheduler::new(schedule(
        "LRRangeTest",
        serde_json::json!({"lr_range_test_min_lr": 1.0, "lr_range_test_step_size": 1}),
        0.5,
    ));
    assert_eq!(
        (s.last_batch_iteration(), s.lr()),
        (-1, 1.0),
        "optimizer step 1 uses the construction value"
    );
    s.step();
    assert_eq!((s.last_batch_iteration(), s.lr()), (0, 2.0));
    s.step();
    assert_eq!(s.lr(), 3.0);
}

#[test]
fn bad_schedule_params_are_named() {
    let err = |kind: &str, params: serde_json::Value| {
        let config = SchedulerConfig {
            kind: kind.into(),
            params,
        };
        Schedule::from_config(Some(&config), 0.1, &mut Vec::new())
            .unwrap_err()
            .to_string()
    };
    let e = err("WarmupDecayLR", serde_json::json!({}));
    assert!(
        e.contains("scheduler.params.total_num_steps") && e.contains("required"),
        "{e}"
    );
    let e = err("WarmupLR", serde_json::json!({"warmup_num_steps": 0}));
    assert!(
        e.contains("scheduler.params.warmup_num_steps") && e.contains("> 0"),
        "{e}"
    );
    let e = err("OneCycle", serde_json::json!({"cycle_max_lr": 1.0}));
    assert!(e.contains("scheduler.params.cycle_min_lr"), "{e}");
    let e = err("Cosine", serde_json::json!({}));
    assert!(
        e.contains("scheduler.type") && e.contains("WarmupCosineLR"),
        "{e}"
    );
    let e = err("WarmupLR", serde_json::json!({"warmup_max_lr": "high"}));
    assert!(e.contains("scheduler.params.warmup_max_lr"), "{e}");
    // Unknown keys are warned about; one edit from a known key, named as its likely typo.
    for (key, warning) in [
        (
            "warmup_steps",
            "unknown key `scheduler.params.warmup_steps`: ignored",
        ),
        (
            "warmup_num_step",
            "unknown key `scheduler.params.warmup_num_step`: ignored (did you mean \
             `warmup_num_steps`?)",
        ),
    ] {
        let mut warnings = Vec::new();
        let config = SchedulerConfig {
            kind: "WarmupLR".into(),
            params: serde_json::json!({ key: 5 }),
        };
        Schedule::from_config(Some(&config), 0.1, &mut warnings).unwrap();
        assert_eq!(warnings, vec![warning.to_string()]);
    }
}
