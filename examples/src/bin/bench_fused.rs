//! The fused ops of `burn_zero::nn` (RMSNorm, RoPE, SwiGLU; issue 35) on one GPU, through
//! `Autodiff<ZeroBackend<Cuda>>` as a model calls them, checked and timed in one run:
//! 1. check: each op's output and input gradients with its kernels, in bf16, f16 and f32, on
//!    shapes no vector width or cube divides, against the same op in burn ops
//!    (`burn_zero.fused_kernels` off) on f32 copies of the same inputs: the largest difference
//!    relative to the largest reference value, within 1e-5 for f32 and two roundings of the
//!    dtype for bf16 (1.6e-2) and f16 (2e-3). Exit status 1 if any case is outside.
//! 2. time: forward, and forward + backward of `Σ out · probe`, at the 8B Llama's shapes for
//!    8,192 tokens in bf16: the kernels against the same op in burn ops (which burn's fusion
//!    fuses where it can); median of `--iterations` after a warm-up, each call synced, and
//!    per call in queues of ten between syncs (the device's time when the host keeps ahead).
//!
//! 3. loss: `burn_zero::nn::linear_cross_entropy` (chunks of 2,048, 1,024, 512 tokens, and 2,048
//!    with the cross-entropy kernel off) against the
//!    materialized loss at 8,192 tokens × 128,256 vocabulary (hidden 4,096, bf16, the tied
//!    `[vocab, hidden]` layout), forward + backward: time, and how far the device pool's
//!    reserved bytes grow over the call from a released pool (cubecl keeps what it reserved
//!    until released, so the growth bounds the call's peak from above; the `fitted` pool
//!    reserves near what is live), with and without the two gradients' own bytes.
//!
//! 4. checks of the loss (after the times): `linear_cross_entropy` with its kernel against the
//!    same chunks in burn ops on inputs of the same dtype (the logits are rounded to it by design),
//!    within the tolerances of 1, and in f32 against the materialized loss in burn ops (which
//!    shares none of the chunks' code). Every check also fails on a value that is not finite.
//!
//! `bench-fused [--iterations N] [--checks all|loss|loss-only|none]` prints one JSON line; `bench/run_fused.sh` runs it beside
//! the torch eager equivalents (`bench/fused_torch.py`) on the same GPU.

use burn::backend::{Autodiff, Cuda};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use burn_zero::backend::ZeroBackend;
use burn_zero::backend::settings::{self, OpSettings};
use burn_zero::config::FusedKernelsConfig;
use burn_zero::config::MemoryPoolLayout;
use burn_zero::nn::{
    RopePairs, RopeTable, VocabAxis, add_rms_norm, linear_cross_entropy,
    materialized_cross_entropy, rms_norm, rope, swiglu,
};
use burn_zero_examples::cli::{arg, median_seconds, queued_seconds, values};
use serde_json::{Value, json};

type B = Autodiff<ZeroBackend<Cuda>>;
type Device = burn::tensor::Device<B>;

fn with_kernels(on: bool) -> settings::SettingsGuard {
    settings::set(OpSettings {
        fused_kernels: FusedKernelsConfig {
            rms_norm: on,
            rope: on,
            swiglu: on,
            cross_entropy: on,
        },
        ..settings::current()
    })
}

fn tensor<const D: usize>(
    shape: [usize; D],
    seed: u64,
    scale: f32,
    dtype: FloatDType,
    device: &Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    let v: Vec<f32> = values(n, seed).iter().map(|x| x * scale).collect();
    Tensor::<B, D>::from_data(TensorData::new(v, shape), device).cast(dtype)
}

/// The output and every input's gradient of `Σ f(inputs) · probe`, as f32 host vectors.
fn run<const D: usize, const N: usize>(
    inputs: &[Tensor<B, D>; N],
    f: &dyn Fn(&[Tensor<B, D>; N]) -> Tensor<B, D>,
) -> Vec<Vec<f32>> {
    let leaves = inputs.clone().map(|t| t.require_grad());
    let out = f(&leaves);
    let probe = tensor(out.dims(), 99, 1.0, FloatDType::F32, &out.device()).cast(out.dtype());
    let grads = (out.clone() * probe).sum().backward();
    let host = |t: Tensor<ZeroBackend<Cuda>, D>| {
        let t = t.cast(FloatDType::F32);
        t.into_data().to_vec::<f32>().expect("f32")
    };
    let mut all = vec![host(out.inner())];
    all.extend(
        leaves
            .iter()
            .map(|l| host(l.grad(&grads).expect("a gradient"))),
    );
    all
}

/// What a check compares the kernels with: burn ops on f32 copies of the inputs, or burn ops
/// on the inputs in their own dtype (for an op whose intermediate values are rounded to the
/// dtype by design: the loss's logits leave the product in bf16, as torch's do).
#[derive(Clone, Copy, PartialEq)]
enum Reference {
    F32Copies,
    SameDtype,
}

/// One check: the kernels on inputs of `dtype` against burn ops (see [`Reference`]).
fn check<const D: usize, const N: usize>(
    name: &str,
    inputs: [Tensor<B, D>; N],
    dtype: FloatDType,
    f: &dyn Fn(&[Tensor<B, D>; N]) -> Tensor<B, D>,
    against: Reference,
) -> Value {
    // Started and finished lines with seconds: a check that stalls is named.
    let start = std::time::Instant::now();
    eprintln!("check {name} {dtype:?}: started");
    let ours = {
        let _on = with_kernels(true);
        run(&inputs.clone().map(|t| t.cast(dtype)), f)
    };
    let reference = {
        let _off = with_kernels(false);
        // The same rounded values, widened (the reference sees what the kernels see), or as
        // they are.
        let widen = |t: Tensor<B, D>| match against {
            Reference::F32Copies => t.cast(dtype).cast(FloatDType::F32),
            Reference::SameDtype => t.cast(dtype),
        };
        run(&inputs.map(widen), f)
    };
    let against_name = match against {
        Reference::F32Copies => "burn ops on f32 copies",
        Reference::SameDtype => "burn ops in the same dtype",
    };
    verdict(name, dtype, &ours, &reference, against_name, start)
}

/// The outputs and gradients `ours` against `reference`: each within the dtype's tolerance of
/// the reference's largest value, and every value finite (the inputs are).
fn verdict(
    name: &str,
    dtype: FloatDType,
    ours: &[Vec<f32>],
    reference: &[Vec<f32>],
    against_name: &str,
    start: std::time::Instant,
) -> Value {
    let tolerance = match dtype {
        FloatDType::F32 => 1e-5,
        FloatDType::BF16 => 1.6e-2,
        _ => 2e-3,
    };
    let mut diffs = Vec::new();
    // Non-finite values per output, ours and the reference's.
    let non_finite: Vec<[usize; 2]> = ours
        .iter()
        .zip(reference)
        .map(|(g, w)| [g, w].map(|v| v.iter().filter(|x| !x.is_finite()).count()))
        .collect();
    let mut ok = non_finite.iter().all(|n| *n == [0, 0]);
    for (got, want) in ours.iter().zip(reference) {
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6);
        let diff = got
            .iter()
            .zip(want)
            .fold(0f32, |a, (g, w)| a.max((g - w).abs()))
            / scale;
        ok &= diff <= tolerance;
        diffs.push(diff);
    }
    eprintln!(
        "check {name} {dtype:?} against {against_name}: relative differences {diffs:?} (tolerance {tolerance}, {:.1} s, non-finite {non_finite:?}) {}",
        start.elapsed().as_secs_f64(),
        if ok { "ok" } else { "FAILED" }
    );
    json!({"op": name, "dtype": format!("{dtype:?}"), "outputs_and_grads": ours.len(),
           "against": against_name, "max_relative_difference": diffs, "non_finite": non_finite,
           "tolerance": tolerance, "ok": ok})
}

/// The chunked loss (the kernel, cuBLASLt's summed products, the backward's scaling) against the
/// materialized loss in burn ops, in f32 on the same inputs: a reference that shares none of
/// the chunks' code.
fn check_loss_materialized(
    name: &str,
    inputs: [Tensor<B, 2>; 2],
    targets: Tensor<B, 1, Int>,
    (axis, chunk, ignore): (VocabAxis, usize, Option<i64>),
) -> Value {
    let start = std::time::Instant::now();
    eprintln!("check {name} F32: started");
    let inputs = inputs.map(|t| t.cast(FloatDType::F32));
    let t = targets.clone();
    let chunked = move |[x, w]: &[Tensor<B, 2>; 2]| {
        linear_cross_entropy(x.clone(), w.clone(), axis, t.clone(), chunk, ignore).reshape([1, 1])
    };
    let materialized = move |[x, w]: &[Tensor<B, 2>; 2]| {
        materialized_cross_entropy(x.clone(), w.clone(), axis, targets.clone(), ignore)
            .reshape([1, 1])
    };
    let ours = {
        let _on = with_kernels(true);
        run(&inputs, &chunked)
    };
    let reference = run(&inputs, &materialized);
    let against = "the materialized loss in burn ops";
    verdict(name, FloatDType::F32, &ours, &reference, against, start)
}

/// Calls between syncs in the queued times.
const QUEUE: usize = 10;

/// A timed op's inputs: tensors of one rank, or an RMSNorm's rows and its 1-D weight (as a
/// model passes them: the weight is not reshaped inside the timed call, as torch's is not).
trait Inputs: Clone {
    /// The same inputs as leaves that take gradients.
    fn leaves(self) -> Self;
    /// The first input's shape (the row's label).
    fn shape(&self) -> Vec<usize>;
}

impl<const D: usize, const N: usize> Inputs for [Tensor<B, D>; N] {
    fn leaves(self) -> Self {
        self.map(|t| t.require_grad())
    }
    fn shape(&self) -> Vec<usize> {
        self[0].dims().to_vec()
    }
}

impl Inputs for (Tensor<B, 2>, Tensor<B, 1>) {
    fn leaves(self) -> Self {
        (self.0.require_grad(), self.1.require_grad())
    }
    fn shape(&self) -> Vec<usize> {
        self.0.dims().to_vec()
    }
}

impl Inputs for (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>) {
    fn leaves(self) -> Self {
        (
            self.0.require_grad(),
            self.1.require_grad(),
            self.2.require_grad(),
        )
    }
    fn shape(&self) -> Vec<usize> {
        self.0.dims().to_vec()
    }
}

/// Forward and forward + backward milliseconds with the kernels and in burn ops: each call
/// from a sync to a sync, and per call in queues of [`QUEUE`] calls.
fn time<I: Inputs, const D: usize>(
    name: &str,
    inputs: I,
    iterations: usize,
    f: &dyn Fn(&I) -> Tensor<B, D>,
) -> Value {
    let out = f(&inputs);
    let device = out.device();
    let probe = tensor(out.dims(), 98, 1.0, FloatDType::BF16, &device);
    let mut row = json!({"op": name, "shape": inputs.shape(), "dtype": "bf16"});
    for (label, on) in [("kernels", true), ("burn_ops", false)] {
        let _guard = with_kernels(on);
        let forward = median_seconds::<B, _>(&device, iterations, || f(&inputs));
        let both = median_seconds::<B, _>(&device, iterations, || {
            (f(&inputs.clone().leaves()) * probe.clone())
                .sum()
                .backward()
        });
        row[format!("{label}_forward_ms")] = json!(forward * 1e3);
        row[format!("{label}_forward_backward_ms")] = json!(both * 1e3);
        let forward = queued_seconds::<B, _>(&device, iterations, QUEUE, || f(&inputs));
        let both = queued_seconds::<B, _>(&device, iterations, QUEUE, || {
            (f(&inputs.clone().leaves()) * probe.clone())
                .sum()
                .backward()
        });
        row[format!("{label}_forward_queued_ms")] = json!(forward * 1e3);
        row[format!("{label}_forward_backward_queued_ms")] = json!(both * 1e3);
    }
    eprintln!("time {row}");
    row
}

/// Bytes the device pool holds reserved now, after the device's work is done.
fn reserved(device: &Device) -> u64 {
    B::sync(device).expect("sync");
    let client =
        <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(&cubecl::cuda::CudaDevice {
            index: 0,
        });
    client.memory_usage().expect("memory usage").bytes_reserved
}

fn release(device: &Device) {
    B::sync(device).expect("sync");
    B::memory_cleanup(device);
}

/// The materialized loss and the chunked one (chunks of 2,048, 1,024 and 512 tokens) at the
/// 8B Llama's output layer.
fn loss_memory_and_time(device: &Device, iterations: usize) -> Value {
    let (tokens, hidden, vocab) = (8_192, 4_096, 128_256);
    let x = tensor([tokens, hidden], 11, 1.0, FloatDType::BF16, device);
    let w = tensor([vocab, hidden], 12, 0.02, FloatDType::BF16, device);
    let ids: Vec<i64> = values(tokens, 13)
        .iter()
        .map(|v| ((v.abs() * vocab as f32) as i64).min(vocab as i64 - 1))
        .collect();
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tokens]), device);
    let gradient_bytes = ((tokens * hidden + vocab * hidden) * 2) as u64;
    let mut runs = Vec::new();
    // The last run A/Bs the cross-entropy kernel (burn ops for each chunk's loss and gradient).
    let cases = [
        (None, true),
        (Some(2048), true),
        (Some(1024), true),
        (Some(512), true),
        (Some(2048), false),
    ];
    for (chunk, kernel) in cases {
        let _guard = with_kernels(kernel);
        let step = || {
            let (xg, wg) = (x.clone().require_grad(), w.clone().require_grad());
            let (axis, targets) = (VocabAxis::Rows, t.clone());
            let loss = match chunk {
                Some(rows) => {
                    linear_cross_entropy(xg.clone(), wg.clone(), axis, targets, rows, None)
                }
                None => materialized_cross_entropy(xg.clone(), wg.clone(), axis, targets, None),
            };
            let grads = loss.clone().backward();
            (loss, xg.grad(&grads), wg.grad(&grads))
        };
        release(device);
        let before = reserved(device);
        let (value, gx, gw) = step();
        let after = reserved(device);
        let value: f32 = value.into_scalar();
        drop((gx, gw));
        let seconds = median_seconds::<B, _>(device, iterations.min(5), step);
        let growth = after.saturating_sub(before);
        runs.push(json!({"chunk_rows": chunk, "cross_entropy_kernel": kernel,
                   "loss": value, "ms": seconds * 1e3,
                         "reserved_growth_bytes": growth,
                         "beyond_gradients_bytes": growth.saturating_sub(gradient_bytes)}));
    }
    let base = runs[0].clone();
    for run in &mut runs[1..] {
        let ratio = |key: &str| run[key].as_f64().unwrap() / base[key].as_f64().unwrap();
        let (growth, beyond, time) = (
            ratio("reserved_growth_bytes"),
            ratio("beyond_gradients_bytes"),
            ratio("ms"),
        );
        let difference = (run["loss"].as_f64().unwrap() - base["loss"].as_f64().unwrap()).abs();
        run["reserved_growth_over_materialized"] = json!(growth);
        run["beyond_gradients_over_materialized"] = json!(beyond);
        run["time_over_materialized"] = json!(time);
        run["loss_difference"] = json!(difference);
    }
    let row = json!({"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": "bf16",
                     "gradient_bytes": gradient_bytes, "runs": runs});
    eprintln!("loss {row}");
    row
}

fn main() {
    // The fitted pool: reserved bytes follow what is live (the loss measurement reads them).
    burn_zero::backend::configure_memory_pool(0, MemoryPoolLayout::Fitted)
        .expect("the pool is configured first");
    let args: Vec<String> = std::env::args().collect();
    let iterations: usize =
        arg(&args, "--iterations").map_or(20, |v| v.parse().expect("--iterations N"));
    // Which checks run: all (the default), the loss's only (after the times), or none;
    // `loss-only`: the loss's checks and nothing else (no times).
    let which = arg(&args, "--checks").unwrap_or_else(|| "all".into());
    assert!(
        ["all", "loss", "loss-only", "none"].contains(&which.as_str()),
        "--checks is all, loss, loss-only or none, not `{which}`"
    );
    let timed = which != "loss-only";
    let device = Device::default();
    let (f32t, bf16, f16) = (FloatDType::F32, FloatDType::BF16, FloatDType::F16);

    let mut checks = Vec::new();
    for dtype in [f32t, bf16, f16] {
        if which != "all" {
            break;
        }
        // 576 (SmolLM2's width): CUDA allocates such rows pitched (768 bf16 apart), and the
        // kernels read them in place.
        for (rows, hidden) in [(37, 20), (1_100, 96), (67, 4_096), (5, 2_049), (37, 576)] {
            let inputs = [
                tensor([rows, hidden], 1, 2.0, f32t, &device),
                tensor([1, hidden], 2, 0.5, f32t, &device) + 1.0,
            ];
            let f = move |[x, w]: &[Tensor<B, 2>; 2]| {
                rms_norm(x.clone(), w.clone().reshape([hidden]), 1e-5)
            };
            checks.push(check(
                &format!("rms_norm {rows}x{hidden}"),
                inputs,
                dtype,
                &f,
                Reference::F32Copies,
            ));
        }
        // The residual add folded into the norm: both outputs reach the probe.
        for (rows, hidden) in [(37, 20), (67, 4_096), (37, 576)] {
            let inputs = [
                tensor([rows, hidden], 1, 2.0, f32t, &device),
                tensor([rows, hidden], 12, 2.0, f32t, &device),
                tensor([1, hidden], 2, 0.5, f32t, &device) + 1.0,
            ];
            let f = move |[x, r, w]: &[Tensor<B, 2>; 3]| {
                let (sum, y) =
                    add_rms_norm(x.clone(), r.clone(), w.clone().reshape([hidden]), 1e-5);
                y + sum * 0.25
            };
            let name = format!("add_rms_norm {rows}x{hidden}");
            checks.push(check(&name, inputs, dtype, &f, Reference::F32Copies));
        }
        // A model's rank (batch, sequence, hidden): the kernels take it without a reshape.
        let inputs = [
            tensor([3, 37, 96], 1, 2.0, f32t, &device),
            tensor([1, 1, 96], 2, 0.5, f32t, &device) + 1.0,
        ];
        let f = |[x, w]: &[Tensor<B, 3>; 2]| rms_norm(x.clone(), w.clone().reshape([96]), 1e-5);
        let name = "rms_norm 3x37x96";
        checks.push(check(name, inputs, dtype, &f, Reference::F32Copies));
        for len in [7usize, 4_099, 65_536] {
            let inputs = [
                tensor([len], 3, 6.0, f32t, &device),
                tensor([len], 4, 1.0, f32t, &device),
            ];
            let f = |[g, u]: &[Tensor<B, 1>; 2]| swiglu(g.clone(), u.clone());
            let name = format!("swiglu {len}");
            checks.push(check(&name, inputs, dtype, &f, Reference::F32Copies));
        }
        for pairs in [RopePairs::Interleaved, RopePairs::HalfSplit] {
            for [b, s, h, d] in [[2, 17, 3, 64], [1, 257, 4, 128], [1, 9, 2, 6]] {
                let table = RopeTable::<B>::new(s, d, 500_000.0, &device);
                let inputs = [tensor([b, s, h, d], 5, 1.0, f32t, &device)];
                let f = move |[x]: &[Tensor<B, 4>; 1]| rope(x.clone(), &table, pairs);
                checks.push(check(
                    &format!("rope {pairs:?} {:?}", [b, s, h, d]),
                    inputs,
                    dtype,
                    &f,
                    Reference::F32Copies,
                ));
            }
        }
    }

    // The 8B Llama's shapes at 8,192 tokens.
    let tokens = 8_192;
    let mut times = Vec::new();
    let mut loss = Value::Null;
    if timed {
        let x = (
            tensor([tokens, 4_096], 6, 2.0, bf16, &device),
            tensor([4_096], 7, 0.5, bf16, &device) + 1.0,
        );
        let f = |(x, w): &(Tensor<B, 2>, Tensor<B, 1>)| rms_norm(x.clone(), w.clone(), 1e-5);
        times.push(time("rms_norm", x, iterations, &f));
        let xrw = (
            tensor([tokens, 4_096], 6, 2.0, bf16, &device),
            tensor([tokens, 4_096], 11, 2.0, bf16, &device),
            tensor([4_096], 7, 0.5, bf16, &device) + 1.0,
        );
        let f = |(x, r, w): &(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>)| {
            add_rms_norm(x.clone(), r.clone(), w.clone(), 1e-5).1
        };
        times.push(time("add_rms_norm", xrw, iterations, &f));
        let gu = [
            tensor([tokens, 14_336], 8, 6.0, bf16, &device),
            tensor([tokens, 14_336], 9, 1.0, bf16, &device),
        ];
        let f = |[g, u]: &[Tensor<B, 2>; 2]| swiglu(g.clone(), u.clone());
        times.push(time("swiglu", gu, iterations, &f));
        for (pairs, heads) in [
            (RopePairs::Interleaved, 32),
            (RopePairs::Interleaved, 8),
            (RopePairs::HalfSplit, 32),
        ] {
            let table = RopeTable::<B>::new(tokens, 128, 500_000.0, &device);
            let q = [tensor([1, tokens, heads, 128], 10, 1.0, bf16, &device)];
            let f = move |[x]: &[Tensor<B, 4>; 1]| rope(x.clone(), &table, pairs);
            times.push(time(&format!("rope {pairs:?}"), q, iterations, &f));
        }
        loss = loss_memory_and_time(&device, iterations);
    }
    // The loss: each chunk's kernel against the same chunks in burn ops in the same dtype (and
    // in f32 against the materialized loss); vocabularies no vector divides (53), 1,000, the
    // recipe's (49,152) and Llama 3's (128,256), both layouts, ignored targets. Every shape in
    // f32; bf16 takes three and f16 one (they share the kernel's code).
    let small = (37, 20, 53, 8, VocabAxis::Columns, Some(-100));
    let middle = (67, 64, 1_000, 32, VocabAxis::Rows, None);
    let large = (130, 96, 49_152, 64, VocabAxis::Rows, Some(-100));
    // Llama 3's vocabulary, the width of the timed loss.
    let llama = (37, 64, 128_256, 16, VocabAxis::Rows, Some(-100));
    let loss_cases = [
        (f32t, vec![small, middle, large, llama]),
        (bf16, vec![small, large, llama]),
        (f16, vec![small]),
    ];
    for (dtype, shapes) in loss_cases {
        if which == "none" {
            break;
        }
        for (tokens, hidden, vocab, chunk, axis, ignore) in shapes {
            let shape = match axis {
                VocabAxis::Columns => [hidden, vocab],
                VocabAxis::Rows => [vocab, hidden],
            };
            let inputs = [
                tensor([tokens, hidden], 14, 2.0, f32t, &device),
                tensor(shape, 15, 0.5, f32t, &device),
            ];
            let ids: Vec<i64> = (0..tokens as i64)
                .map(|i| match i % 9 {
                    4 if ignore.is_some() => -100,
                    _ => (i * 7919 + 3) % vocab as i64,
                })
                .collect();
            let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [tokens]), &device);
            let t = targets.clone();
            let f = move |[x, w]: &[Tensor<B, 2>; 2]| {
                linear_cross_entropy(x.clone(), w.clone(), axis, t.clone(), chunk, ignore)
                    .reshape([1, 1])
            };
            // Against burn ops in the same dtype: the logits leave the product rounded to bf16
            // or f16 on both sides (as torch's do), and the gradient is rounded to it before its
            // products. Against f32 copies the bf16 loss at vocabulary 49,152 differs by 1.2e-2
            // (dx) and 1.63e-2 (dw) of the largest value: logits near 13 carry bf16's 0.03
            // into exp() (H200, calls 2 and 4 at 8041107 and 9ca763f).
            let name = format!("linear_cross_entropy {tokens}x{hidden}x{vocab} {axis:?}");
            if dtype == f32t {
                let spec = (axis, chunk, ignore);
                let named = format!("{name} against the materialized loss");
                checks.push(check_loss_materialized(
                    &named,
                    inputs.clone(),
                    targets.clone(),
                    spec,
                ));
            }
            checks.push(check(&name, inputs, dtype, &f, Reference::SameDtype));
        }
    }
    // No check run (`--checks none`): no verdict either.
    let ok = checks.iter().all(|c| c["ok"] == json!(true));
    let checks_ok = if checks.is_empty() {
        Value::Null
    } else {
        json!(ok)
    };
    println!(
        "{}",
        json!({"checks_ok": checks_ok, "checks": checks, "time": times, "loss": loss,
               "iterations": iterations})
    );
    if !ok {
        std::process::exit(1);
    }
}
