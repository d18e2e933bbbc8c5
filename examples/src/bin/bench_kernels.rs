//! The fused AdamW kernel on a GPU (issue 10), checked and timed in one run:
//! 1. check: the engine's device optimizer with the fused kernel against its tensor-op
//!    reference (`burn_zero.fused_adam` off), lengths 1, 7, 64 and 1,000,003, AdamW and Adam
//!    with L2, 10 steps of random (never zero) gradients: master and moments within 1e-6
//!    relative; a NaN in the gradient stays NaN in the weights;
//! 2. time: one step over N parameters (default 2^28) fused and as burn's tensor ops (fused by
//!    burn's fusion where it can), reported per 1e9 parameters with the bytes each moves.
//!
//! `bench-kernels [--params N] [--steps S]` prints one JSON object; `bench/run_kernels.sh`
//! runs it beside `torch.optim.AdamW(fused=True)` and a copy that measures the GPU's
//! bandwidth, on the same GPU.

use std::time::Instant;

use burn::backend::Cuda;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_zero::config::{OptimizerKind, OptimizerParams};
use burn_zero::optim::{StepParams, TensorOptimizer};
use burn_zero_examples::cli::{arg, values};

type B = Cuda;
type Device = burn::tensor::Device<B>;

fn tensor(v: Vec<f32>, device: &Device) -> Tensor<B, 1> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

fn host(t: &Tensor<B, 1>) -> Vec<f32> {
    t.clone().into_data().to_vec().expect("f32")
}

fn optimizer(decoupled: bool, len: usize, fused: bool, device: &Device) -> TensorOptimizer<B> {
    let params = OptimizerParams {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    };
    let kind = OptimizerKind::Adam {
        decoupled_weight_decay: decoupled,
    };
    TensorOptimizer::new(kind, &params, len, device).with_fused(fused)
}

/// The largest relative difference of two equally long vectors (NaN where one is NaN and the
/// other not).
fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (false, false) => f64::from((x - y).abs()) / (1.0 + f64::from(y.abs())),
            _ => f64::NAN,
        })
        .fold(0.0, |m, d| {
            if d.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        })
}

/// Fused against tensor ops: the worst relative difference of master, m and v over 10 steps.
fn check(len: usize, decoupled: bool, device: &Device) -> f64 {
    let hp = StepParams {
        lr: 1e-2,
        betas: (0.9, 0.999),
    };
    let (mut fused, mut reference) = (
        optimizer(decoupled, len, true, device),
        optimizer(decoupled, len, false, device),
    );
    let (mut a, mut b) = (
        tensor(values(len, 1), device),
        tensor(values(len, 1), device),
    );
    for step in 0..10 {
        let g: Vec<f32> = values(len, 100 + step).iter().map(|x| x * 0.1).collect();
        a = fused.step(a, tensor(g.clone(), device), hp);
        b = reference.step(b, tensor(g, device), hp);
    }
    let mut worst = max_rel(&host(&a), &host(&b));
    let (states_a, states_b) = (fused.export().1, reference.export().1);
    for ((_, x), (_, y)) in states_a.iter().zip(&states_b) {
        worst = worst.max(max_rel(&host(x), &host(y)));
    }
    worst
}

/// Seconds per step over `len` parameters (median of `steps` after one warm-up).
fn time(len: usize, fused: bool, steps: usize, device: &Device) -> f64 {
    let hp = StepParams {
        lr: 1e-4,
        betas: (0.9, 0.999),
    };
    let mut opt = optimizer(true, len, fused, device);
    let mut w = Tensor::<B, 1>::random([len], burn::tensor::Distribution::Default, device);
    let g = Tensor::<B, 1>::random([len], burn::tensor::Distribution::Default, device);
    let mut times = Vec::new();
    for i in 0..=steps {
        B::sync(device).expect("sync");
        let start = Instant::now();
        w = opt.step(w, g.clone(), hp);
        B::sync(device).expect("sync");
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n =
        arg(&args, "--params").map_or(1 << 28, |v| v.parse::<f64>().expect("--params") as usize);
    let steps = arg(&args, "--steps").map_or(10, |v| v.parse().expect("--steps"));
    let device = Default::default();
    let mut checks = Vec::new();
    let mut passed = true;
    for len in [1usize, 7, 64, 1_000_003] {
        for decoupled in [true, false] {
            let worst = check(len, decoupled, &device);
            let ok = worst <= 1e-6;
            passed &= ok;
            eprintln!(
                "check len {len}, decoupled {decoupled}: max rel diff {worst:e} {}",
                if ok { "ok" } else { "FAILED" }
            );
            checks.push(serde_json::json!({"len": len, "decoupled": decoupled, "max_rel_diff": worst, "ok": ok}));
        }
    }
    // A NaN gradient element must reach the weights.
    let mut g = values(9, 5);
    g[4] = f32::NAN;
    let mut opt = optimizer(true, 9, true, &device);
    let hp = StepParams {
        lr: 1e-2,
        betas: (0.9, 0.999),
    };
    let w = host(&opt.step(tensor(values(9, 6), &device), tensor(g, &device), hp));
    let nan_kept = w[4].is_nan() && w.iter().enumerate().all(|(i, x)| i == 4 || x.is_finite());
    passed &= nan_kept;
    eprintln!("a NaN gradient element stays NaN in the weights: {nan_kept}");
    let fused = time(n, true, steps, &device);
    let ops = time(n, false, steps, &device);
    let per_billion = 1e9 / n as f64;
    // Fused: reads master, gradient, m, v and writes master, m, v.
    let bytes = 7.0 * 4.0 * n as f64;
    let result = serde_json::json!({
        "params": n, "steps": steps, "checks": checks, "nan_propagates": nan_kept, "passed": passed,
        "fused_s": fused, "tensor_ops_s": ops,
        "fused_s_per_1e9": fused * per_billion, "tensor_ops_s_per_1e9": ops * per_billion,
        "fused_bytes": bytes, "fused_gb_per_s": bytes / fused / 1e9,
    });
    println!("{result}");
    if !passed {
        std::process::exit(1);
    }
}
