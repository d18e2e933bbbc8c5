//! Scripted overflow sequences against DeepSpeed's algorithm, worked out by hand (comments
//! give the state before each update: scale, iteration, last overflow, hysteresis credit).

use super::*;
use crate::config::Fp16Config;

/// The scaler of an `fp16` section, with DeepSpeed's defaults for the keys not given.
fn scaler(fp16: &str) -> LossScaler {
    LossScaler::from_config(&serde_json::from_str::<Fp16Config>(fp16).unwrap())
}

/// Runs `overflows` ('x' overflow, '.' clean) and returns (scale, iteration) after each.
fn run(s: &mut LossScaler, overflows: &str) -> Vec<(f64, u64)> {
    overflows
        .chars()
        .map(|c| {
            s.update(c == 'x').unwrap();
            (s.scale(), s.iteration())
        })
        .collect()
}

#[test]
fn dynamic_scale_halves_on_overflow_and_doubles_after_a_clean_window() {
    let mut s = scaler(
        r#"{"enabled": true, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}"#,
    );
    assert_eq!((s.scale(), s.iteration()), (16.0, 0));
    // it0 '.': stable = 0-(-1)-1 = 0, kept. it1 '.': stable 1, kept. it2 '.': stable 2 = window:
    // 32. it3 'x': 16, last 3. it4-5 '.': stable 0, 1. it6 '.': stable 2: 32. it7..11 'x':
    // 16, 8, 4, 2, 1 (min_loss_scale defaults to 1).
    let got = run(&mut s, "...x...xxxxx");
    let scales: Vec<f64> = got.iter().map(|g| g.0).collect();
    assert_eq!(
        scales,
        [16., 16., 32., 16., 16., 16., 32., 16., 8., 4., 2., 1.]
    );
    assert_eq!(got.last().unwrap().1, 12, "one iteration per update");
    // Overflowing at the minimum is an error that suggests bf16.
    let err = s.update(true).unwrap_err();
    assert_eq!(err.iteration, 12);
    assert!(err.to_string().contains("bf16"), "{err}");
    assert!(err.to_string().contains("fp16.min_loss_scale"), "{err}");
}

#[test]
fn hysteresis_delays_the_drop_and_refills_when_the_scale_grows() {
    let mut s = scaler(
        r#"{"enabled": true, "initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2}"#,
    );
    // it0 'x': credit 2 -> 1, scale kept, last 0. it1 'x': credit 1: 512, last 1.
    // it2 '.': stable 0. it3 'x': credit still 1 (not consecutive): 256, last 3.
    // it4, it5, it6 '.': stable 0, 1, 2. it7 '.': stable 3 = window: 512, credit refilled to 2.
    // it8 'x': credit 2 -> 1, scale kept.
    let got = run(&mut s, "xx.x....x");
    let scales: Vec<f64> = got.iter().map(|g| g.0).collect();
    assert_eq!(
        scales,
        [1024., 512., 512., 256., 256., 256., 256., 512., 512.]
    );
    assert_eq!(s.hysteresis(), Some(1));
    assert_eq!(s.iteration(), 9);
}

#[test]
fn consecutive_hysteresis_forgives_isolated_overflows() {
    let mut s = scaler(
        r#"{"enabled": true, "initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": 2, "consecutive_hysteresis": true}"#,
    );
    // Every clean step refills the credit: lone overflows never lower the scale; two in a
    // row do.
    let got = run(&mut s, "x.x.x.xx");
    let scales: Vec<f64> = got.iter().map(|g| g.0).collect();
    assert_eq!(scales, [256., 256., 256., 256., 256., 256., 256., 128.]);
}

#[test]
fn static_scale_never_moves_but_overflowed_steps_are_skipped() {
    let mut s = scaler(r#"{"enabled": true, "loss_scale": 128}"#);
    assert!(!s.is_dynamic());
    assert!(s.update(true).unwrap().skipped());
    assert!(!s.update(false).unwrap().skipped());
    assert_eq!((s.scale(), s.iteration()), (128.0, 2));
    assert_eq!(LossScaler::fixed(1.0).scale(), 1.0);
}

#[test]
fn the_min_scale_clamps_a_drop_before_it_fails() {
    let mut s = scaler(
        r#"{"enabled": true, "initial_scale_power": 2, "min_loss_scale": 3, "hysteresis": 1}"#,
    );
    // 4 / 2 = 2 is below the minimum 3: the scale becomes 3; the next overflow fails.
    assert_eq!(
        s.update(true).unwrap(),
        ScaleUpdate::Lowered {
            attempted: 4.0,
            next: 3.0
        }
    );
    assert!(s.update(true).is_err());
}
