//! One GPU training a deep residual MLP (`LAYERS` × `WIDTH`² weights) in bf16 at ZeRO-2 (no
//! gradient clipping, DeepSpeed's default, so `cpu_adam.step_ahead` applies) with the fp32
//! master weights and Adam's moments on the device or offloaded to host memory
//! (`offload_optimizer {"device": "cpu"}`, CPU-Adam) or to swap files (`"nvme"`, under
//! `$BURN_ZERO_NVME_PATH`, default /tmp): median step time and, offloaded, its breakdown
//! (gradient down, CPU step, weights up). Start it under the launcher:
//!   burn-zero run --nproc-per-node 1 -- bench-offload LAYERS WIDTH cpu|nvme|none [STEPS [OPTIONS]]
//! OPTIONS, `+`-separated: `huge` (host partitions advised for huge pages), `bf16init` (weights
//! built in bf16), `formula` (weights and inputs from a formula another system can compute:
//! bench/offload_deepspeed.py does, so losses compare step by step; implies bf16 weights),
//! `serial` (`cpu_adam.step_ahead` off: CPU-Adam waits for the whole backward), `atN`
//! (`cpu_adam.ahead_threads` N: sub-groups stepped ahead on N threads), `bf16g` (gradients
//! accumulated and reduced in bf16, `data_types.grad_accum_dtype`: the host gradient partition
//! is then bf16, half the bytes to copy down and for CPU-Adam to read).

use std::time::Instant;

use burn::backend::Cuda;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Int, Tensor};
use burn_zero::DeepSpeedConfig;
use burn_zero::dist::init_nccl;
use burn_zero::engine::{ZeroAutodiff, initialize};

const BATCH: usize = 16;

#[derive(Module, Debug)]
struct DeepMlp<B: Backend> {
    layers: Vec<Linear<B>>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        "bench-offload LAYERS WIDTH cpu|nvme|none [STEPS [huge+bf16init+formula+serial+atN+bf16g]]";
    let layers: usize = args.get(1).and_then(|v| v.parse().ok()).expect(usage);
    let width: usize = args.get(2).and_then(|v| v.parse().ok()).expect(usage);
    let place = args.get(3).cloned().expect(usage);
    let offload = place != "none";
    let steps: usize = args.get(4).and_then(|v| v.parse().ok()).unwrap_or(5);
    // Options, `+`-separated: `huge` advises the host partitions for transparent huge pages;
    // `bf16init` builds the layers' weights in bf16 (what a user does for a model whose fp32
    // weights would not fit beside the engine's buffers).
    let options = args.get(5).cloned().unwrap_or_default();
    let has = |option: &str| options.split('+').any(|o| o == option);
    let huge_pages = has("huge");
    let formula = has("formula");
    let bf16_init = formula || has("bf16init");
    let step_ahead = !has("serial");
    let bf16_grads = has("bf16g");
    let grads_json = match bf16_grads {
        true => r#", "data_types": {"grad_accum_dtype": "bf16"}"#,
        false => "",
    };
    // `atN`: CPU-Adam of the sub-groups stepped ahead on N threads (`cpu_adam.ahead_threads`).
    let ahead_threads: Option<usize> = options
        .split('+')
        .find_map(|o| o.strip_prefix("at").and_then(|n| n.parse().ok()));
    let ahead_json = ahead_threads.map_or(String::new(), |n| format!(r#", "ahead_threads": {n}"#));
    let (_env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let device = burn::backend::cuda::CudaDevice::new(0);
    let nvme_path = std::env::var("BURN_ZERO_NVME_PATH").unwrap_or_else(|_| "/tmp".into());
    let offload_json = match place.as_str() {
        "cpu" => r#", "offload_optimizer": {"device": "cpu"}, "sub_group_size": 100000000"#.into(),
        "nvme" => format!(
            r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{nvme_path}"}}, "sub_group_size": 100000000"#
        ),
        "none" => String::new(),
        other => panic!("{usage}: not `{other}`"),
    };
    // `aio`: deeper queue and larger requests than DeepSpeed's defaults (1 MiB, 8), as the
    // device's disk is virtio, where more in flight pays (used by `nvme` only).
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": {BATCH}, "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.01}}}},
            "bf16": {{"enabled": true}}, "gradient_clipping": 0{grads_json},
            "zero_optimization": {{"stage": 2, "overlap_comm": true{offload_json}}},
            "aio": {{"block_size": 4194304, "queue_depth": 32}},
            "burn_zero": {{"matmul": {{"cublaslt": true}},
                "cpu_adam": {{"huge_pages": {huge_pages}, "step_ahead": {step_ahead}{ahead_json}}}}}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).expect("config").config;
    // The config's pools (fitted by default) before the model is built on the device, as a
    // user does (otherwise the device keeps cubecl's and `initialize` warns).
    burn_zero::backend::configure_memory_pool(0, config.burn_zero.memory_pool)
        .unwrap_or_else(|e| panic!("{e}"));
    type B = ZeroAutodiff<Cuda>;
    // Seeded: runs with and without offload start from the same weights and see the same
    // inputs, so their losses can be compared.
    <Cuda as Backend>::seed(&device, 42);
    let t0 = Instant::now();
    let model = DeepMlp::<B> {
        layers: (0..layers)
            .map(|l| {
                let mut layer = LinearConfig::new(width, width)
                    .with_bias(false)
                    .init(&device);
                if formula {
                    let weight = formula_weight::<B>(l, width, &device).cast(FloatDType::BF16);
                    layer.weight = Param::from_tensor(weight.require_grad());
                } else if bf16_init {
                    let weight = layer.weight.val().cast(FloatDType::BF16);
                    layer.weight = Param::from_tensor(weight.detach().require_grad());
                }
                layer
            })
            .collect(),
    };
    let params = model.num_params();
    eprintln!("{params} parameters; initializing (offload: {offload})");
    let mut engine = initialize::<Cuda, _>(model, &config, std::sync::Arc::new(nccl))
        .unwrap_or_else(|e| panic!("{e}"));
    let init_s = t0.elapsed().as_secs_f64();
    let report = engine.memory_report();
    let mut times = Vec::new();
    let mut losses = Vec::new();
    engine.take_offload_timings();
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let mut window = [0.0f64; 2];
    for step in 0..steps + 1 {
        let x = match formula {
            true => formula_input::<B>(step, width, &device).cast(FloatDType::BF16),
            false => Tensor::<B, 2>::random([BATCH, width], Distribution::Default, &device),
        };
        <Cuda as Backend>::sync(&device).expect("sync");
        let start = Instant::now();
        if step == 1 {
            window[0] = unix();
        }
        let mut h = x;
        // Residual, so activations keep their scale through any depth (a finite loss to compare).
        for layer in &engine.model().layers {
            h = h.clone() + relu(layer.forward(h)).mul_scalar(0.5);
        }
        let loss = h.powf_scalar(2.0).mean();
        engine.backward(loss.clone()).expect("backward");
        engine.step().expect("step");
        // The loss is bf16 on the device: widen it before reading it.
        losses.push(loss.cast(FloatDType::F32).into_scalar());
        <Cuda as Backend>::sync(&device).expect("sync");
        let secs = start.elapsed().as_secs_f64();
        window[1] = unix();
        eprintln!("step {step}: {secs:.3} s");
        if step == 0 {
            engine.take_offload_timings(); // the first step compiles kernels
            engine.take_timings();
        } else {
            times.push(secs);
        }
    }
    let timings = engine.take_timings();
    let per = |d: std::time::Duration| d.as_secs_f64() / steps as f64;
    let offload_breakdown = engine
        .take_offload_timings()
        .map(|t| burn_zero_examples::offload_breakdown(&t, steps));
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({"params": params, "layers": layers, "width": width, "batch": BATCH,
            "offload": place, "huge_pages": huge_pages, "bf16_init": bf16_init, "init_s": init_s,
            "formula": formula, "step_ahead": step_ahead, "ahead_threads": ahead_threads,
            "bf16_grads": bf16_grads,
            "median_step_s": sorted[sorted.len() / 2], "step_times_s": times,
            "rows_per_s": BATCH as f64 / sorted[sorted.len() / 2], "timed_window_unix_s": window,
            "engine_backward_s": per(timings.backward), "engine_step_s": per(timings.step),
            "offload_breakdown": offload_breakdown, "losses": losses,
            "memory_report": report, "memory_report_text": report.to_string()})
    );
    // A failed allocation on burn's fusion thread does not stop this one: the losses show it.
    if let Some(bad) = losses.iter().position(|l| !l.is_finite()) {
        eprintln!("loss of step {bad} is not finite: the run is invalid");
        std::process::exit(3);
    }
}

/// Layer `l`'s weight as burn stores it (`[in, out]`): `w[i][o] = ((o·i + 7·o + 13·i + 101·l)
/// mod 8191 / 8191 − 0.5) / (sqrt(width) / 2)`, the integers exact, then f32 (a full-rank
/// pattern in kaiming-uniform's range: a smooth formula is low-rank and blows the residual
/// stream up). bench/offload_deepspeed.py computes torch's `[out, in]`.
fn formula_weight<B: Backend>(l: usize, width: usize, device: &B::Device) -> Tensor<B, 2> {
    let index = || Tensor::<B, 1, Int>::arange(0..width as i64, device);
    let o = index().reshape([1, width]);
    let i = index().reshape([width, 1]);
    let v = (o.clone() * i.clone() + o.mul_scalar(7) + i.mul_scalar(13))
        .add_scalar(101 * l as i64)
        .remainder_scalar(8191);
    v.float()
        .div_scalar(8191.0)
        .sub_scalar(0.5)
        .div_scalar((width as f32).sqrt() / 2.0)
}

/// Step `s`'s input: `x[b][j] = cos(0.11·(b + 16·s) + 0.23·j)` in f32.
fn formula_input<B: Backend>(s: usize, width: usize, device: &B::Device) -> Tensor<B, 2> {
    let b = Tensor::<B, 1, Int>::arange(0..BATCH as i64, device)
        .float()
        .add_scalar((BATCH * s) as f32)
        .mul_scalar(0.11f32)
        .reshape([BATCH, 1]);
    let j = Tensor::<B, 1, Int>::arange(0..width as i64, device)
        .float()
        .mul_scalar(0.23f32)
        .reshape([1, width]);
    (b + j).cos()
}
