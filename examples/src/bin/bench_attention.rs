//! Flash attention on a GPU (issue 10), through `Autodiff<ZeroBackend<Cuda>>` as a model uses it:
//! - `check`: output and dQ/dK/dV of `burn_zero::attention::flash_attention` against an f32
//!   materialized reference (the same inputs, rounded to the dtype, then widened), for seq 1,
//!   17, 257, head dim 64 and 128, grouped-query (4 heads over 2 K/V heads), causal and not,
//!   f32/bf16/f16; gradients finite. Exit status 1 if any case is outside its tolerance.
//! - `time`: forward + backward of causal bf16 attention, seq 1k/4k/8k, head dim 64/128,
//!   16k tokens per call, hidden 2048: milliseconds and TFLOP/s (FLOPs of FlashAttention's
//!   convention: forward `4·b·h·s²·d / 2` causal, backward 2.5× that).
//! - `sparse`: block-sparse attention (DeepSpeed layouts, block 64) against dense flash
//!   attention at seq 4k/8k/16k, forward + backward: milliseconds, and the share of tiles kept;
//!   `check` also compares it with the materialized softmax under the layout's mask.
//! - `memory --seq S --hd D --flash 0|1`: one training step of attention at that size, the
//!   cubecl pool's reserved bytes after it (burn's materialized fallback with `--flash 0`,
//!   block-sparse under a bigbird layout with `--sparse bigbird`).
//!
//! Each mode prints one JSON line; `bench/run_attention.sh` runs them beside torch's SDPA.

use burn::backend::{Autodiff, Cuda};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Tensor, TensorData, activation::softmax};
use burn_zero::attention::{
    SparseLayout, block_sparse_attention, flash_attention, flash_attention_calls,
    set_flash_attention, tensor_cores_allowed,
};
use burn_zero::backend::ZeroBackend;
use burn_zero_examples::cli::{arg, median_seconds, values};
use cubecl_kernels::attention::tensor_core::tensor_cores_apply;
use cubecl_kernels::sparse::{BigBirdConfig, Direction, FixedConfig, SparsityConfig, SparsityMode};
use serde_json::json;

type B = Autodiff<ZeroBackend<Cuda>>;
type Device = burn::tensor::Device<B>;

fn tensor(shape: [usize; 4], seed: u64, dtype: FloatDType, device: &Device) -> Tensor<B, 4> {
    let data = TensorData::new(values(shape.iter().product(), seed), shape);
    Tensor::<B, 4>::from_data(data, device).cast(dtype)
}

/// `[1, heads, s, s]`, true where a pair lies outside the layout's kept blocks.
fn layout_mask(layout: &SparseLayout, s: usize, device: &Device) -> Tensor<B, 4, Bool> {
    let mut masked = Vec::with_capacity(layout.heads * s * s);
    for h in 0..layout.heads {
        for i in 0..s {
            masked.extend((0..s).map(|j| !layout.keeps(h, i, j)));
        }
    }
    Tensor::from_data(TensorData::new(masked, [1, layout.heads, s, s]), device)
}

/// Materialized attention in f32 (K/V heads repeated for their query heads), optionally
/// masked by a block layout.
fn materialized(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    causal: bool,
    layout: Option<&SparseLayout>,
) -> Tensor<B, 4> {
    let [b, h, s, d] = q.dims();
    let [_, hk, sk, _] = k.dims();
    let repeat = |t: Tensor<B, 4>| {
        t.unsqueeze_dim::<5>(2)
            .expand([b, hk, h / hk, sk, d])
            .reshape([b, h, sk, d])
    };
    let [q, k, v] = [q, k, v].map(|t| t.cast(FloatDType::F32));
    let scores = q.matmul(repeat(k).swap_dims(2, 3)) / (d as f64).sqrt();
    let scores = if causal {
        let mask = Tensor::<B, 2, Bool>::tril_mask([s, sk], 0, &scores.device());
        scores.mask_fill(mask.unsqueeze::<4>(), f32::NEG_INFINITY)
    } else {
        scores
    };
    let scores = match layout {
        Some(l) => {
            let mask = layout_mask(l, s, &scores.device()).expand([b, h, s, sk]);
            scores.mask_fill(mask, f32::NEG_INFINITY)
        }
        None => scores,
    };
    softmax(scores, 3).matmul(repeat(v))
}

/// Output and the gradients of `sum(out · g)` w.r.t. q, k, v, as f32 host vectors.
fn run(
    inputs: [Tensor<B, 4>; 3],
    g: &Tensor<B, 4>,
    causal: bool,
    flash: bool,
    layout: Option<&SparseLayout>,
) -> [Vec<f32>; 4] {
    let [q, k, v] = inputs.map(|t| t.require_grad());
    let out = if flash {
        let calls = flash_attention_calls();
        let (qc, kc, vc) = (q.clone(), k.clone(), v.clone());
        let out = match layout {
            Some(l) => block_sparse_attention(qc, kc, vc, l, causal),
            None => flash_attention(qc, kc, vc, causal),
        }
        .expect("the flash kernels take CUDA tensors of ZeroBackend<Cuda>");
        assert_eq!(flash_attention_calls(), calls + 1);
        out
    } else {
        materialized(q.clone(), k.clone(), v.clone(), causal, layout)
    };
    let grads = (out.clone().cast(FloatDType::F32) * g.clone())
        .sum()
        .backward();
    let host = |t: Tensor<burn_zero::backend::ZeroBackend<Cuda>, 4>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec().expect("f32")
    };
    [
        host(out.inner()),
        host(q.grad(&grads).expect("dq")),
        host(k.grad(&grads).expect("dk")),
        host(v.grad(&grads).expect("dv")),
    ]
}

/// Largest |a − b| over the largest |b| (at least 1e-3: at seq 1 the softmax is 1 and dQ, dK
/// are exactly 0, their computed values rounding noise of products of order 1); infinite when
/// `a` holds a non-finite value.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    if a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let scale = b
        .iter()
        .fold(0.0f64, |m, x| m.max(x.abs() as f64))
        .max(1e-3);
    let worst = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    worst / scale
}

/// A NaN in one query element must reach that row's whole output (and no other row).
fn nan_case(dtype: FloatDType, name: &str, hd: usize, device: &Device) -> bool {
    let (seq, row) = (17, 5);
    let shape = [1, 2, seq, hd];
    let mut q = values(shape.iter().product(), 1);
    q[row * hd] = f32::NAN;
    let q = Tensor::<B, 4>::from_data(TensorData::new(q, shape), device).cast(dtype);
    let [k, v] = [2, 3].map(|seed| tensor([1, 1, seq, hd], seed, dtype, device));
    let out = flash_attention(q, k, v, false).expect("flash");
    let out: Vec<f32> = out.cast(FloatDType::F32).into_data().to_vec().expect("f32");
    let nan_rows: Vec<usize> = (0..2 * seq)
        .filter(|r| out[r * hd..(r + 1) * hd].iter().any(|x| x.is_nan()))
        .collect();
    let whole_row = out[row * hd..(row + 1) * hd].iter().all(|x| x.is_nan());
    let pass = nan_rows == [row] && whole_row;
    println!(
        "{}",
        json!({"check_nan": {"dtype": name, "head_dim": hd, "nan_rows": nan_rows,
            "whole_row_nan": whole_row, "pass": pass}})
    );
    pass
}

fn check(device: &Device) -> bool {
    let mut all = true;
    for (dtype, name) in [
        (FloatDType::F32, "f32"),
        (FloatDType::BF16, "bf16"),
        (FloatDType::F16, "f16"),
    ] {
        for hd in [64, 128] {
            all &= nan_case(dtype, name, hd, device);
        }
    }
    for (dtype, name, tolerance) in [
        // The f32 reference's matmuls run on burn's CUDA matmul, which may take TF32 tensor
        // cores (measured differences 2e-4 to 7e-4 on an H200); the kernels' f32 arithmetic is
        // checked against f64 to 2e-4 on lavapipe.
        (FloatDType::F32, "f32", 2e-3),
        (FloatDType::BF16, "bf16", 2e-2),
        (FloatDType::F16, "f16", 4e-3),
    ] {
        for seq in [1usize, 17, 257] {
            for hd in [64usize, 128] {
                for causal in [true, false] {
                    let case = Case {
                        dtype,
                        name,
                        tolerance,
                        seq,
                        hd,
                        causal,
                    };
                    all &= check_case(&case, None, device);
                }
            }
        }
        // The lengths users train at, causal, for the 16-bit types the tensor-core kernels take
        // (the reference materializes `[2, 4, seq, seq]` f32 scores: 2 GiB at 8k).
        if dtype != FloatDType::F32 {
            for seq in [4096usize, 8192] {
                for hd in [64usize, 128] {
                    let case = Case {
                        dtype,
                        name,
                        tolerance,
                        seq,
                        hd,
                        causal: true,
                    };
                    all &= check_case(&case, None, device);
                }
            }
        }
        // Block-sparse: bigbird with per-head random blocks, block 32; fixed causal.
        let bird = SparsityConfig {
            num_heads: 4,
            block: 32,
            different_layout_per_head: true,
            mode: SparsityMode::BigBird(BigBirdConfig::default()),
        };
        let fixed = SparsityConfig {
            num_heads: 4,
            block: 32,
            different_layout_per_head: false,
            mode: SparsityMode::Fixed(FixedConfig {
                num_local_blocks: 2,
                attention: Direction::Unidirectional,
                ..FixedConfig::default()
            }),
        };
        for (config, causal) in [(bird, false), (fixed, true)] {
            let layout = SparseLayout::new(&config, 256).expect("layout");
            let case = Case {
                dtype,
                name,
                tolerance,
                seq: 256,
                hd: 64,
                causal,
            };
            all &= check_case(&case, Some(&layout), device);
        }
    }
    all
}

struct Case {
    dtype: FloatDType,
    name: &'static str,
    tolerance: f64,
    seq: usize,
    hd: usize,
    causal: bool,
}

fn check_case(c: &Case, layout: Option<&SparseLayout>, device: &Device) -> bool {
    let (q_shape, k_shape) = ([2, 4, c.seq, c.hd], [2, 2, c.seq, c.hd]);
    let inputs = || {
        [(q_shape, 1), (k_shape, 2), (k_shape, 3)].map(|(s, seed)| tensor(s, seed, c.dtype, device))
    };
    let g = tensor(q_shape, 4, FloatDType::F32, device);
    let flash = run(inputs(), &g, c.causal, true, layout);
    // The reference sees the same (rounded) inputs, widened to f32.
    let widened = inputs().map(|t| t.cast(FloatDType::F32));
    let reference = run(widened, &g, c.causal, false, layout);
    let errors: Vec<f64> = flash
        .iter()
        .zip(&reference)
        .map(|(a, b)| relative_error(a, b))
        .collect();
    let pass = errors.iter().all(|e| *e <= c.tolerance);
    println!(
        "{}",
        json!({"check": {"dtype": c.name, "seq": c.seq, "head_dim": c.hd,
            "causal": c.causal, "heads": 4, "kv_heads": 2,
            "kernels": kernels(c, q_shape, k_shape, device),
            "block_sparse_density": layout.map(SparseLayout::density),
            "out": errors[0], "dq": errors[1], "dk": errors[2], "dv": errors[3],
            "tolerance": c.tolerance, "pass": pass}})
    );
    pass
}

/// Which kernels the call ran on: tensor cores where they apply (and
/// `BURN_ZERO_ATTENTION_TENSOR_CORES` is not `0`), CUDA cores otherwise.
fn kernels(c: &Case, q: [usize; 4], k: [usize; 4], device: &Device) -> &'static str {
    use cubecl::Runtime;
    use cubecl::ir::{ElemType, FloatKind, StorageType};
    let kind = match c.dtype {
        FloatDType::BF16 => FloatKind::BF16,
        FloatDType::F16 => FloatKind::F16,
        _ => FloatKind::F32,
    };
    let dims = cubecl_kernels::attention::AttentionDims::of(&q, &k, &k).expect("shapes");
    let client = cubecl::cuda::CudaRuntime::client(device);
    let dtype = StorageType::Scalar(ElemType::Float(kind));
    match tensor_cores_allowed() && tensor_cores_apply(&client, &dims, dtype) {
        true => "tensor cores",
        false => "cuda cores",
    }
}

/// FLOPs of one causal forward + backward (FlashAttention's count).
fn causal_flops(b: usize, h: usize, s: usize, d: usize) -> f64 {
    let forward = 4.0 * (b * h * d) as f64 * (s * s) as f64 / 2.0;
    forward * 3.5
}

/// The timed sizes: 16k tokens per call at hidden 2048 (`kv_heads = heads`), then the
/// end-to-end benchmark's 1B call (micro-batch 2 × 1024, 32 query and 8 K/V heads).
fn time_cases() -> Vec<[usize; 5]> {
    let mut cases = Vec::new();
    for seq in [1024usize, 4096, 8192] {
        for hd in [64usize, 128] {
            let (b, h) = (16384 / seq, 2048 / hd);
            cases.push([b, h, h, seq, hd]);
        }
    }
    cases.push([2, 32, 8, 1024, 64]);
    cases
}

fn time(device: &Device, iterations: usize) {
    for [b, h, kv, seq, hd] in time_cases() {
        let median = fwd_bwd_seconds(device, [b, h, seq, hd], kv, iterations, |q, k, v| {
            flash_attention(q, k, v, true).expect("flash")
        });
        let forward = forward_seconds(device, [b, h, seq, hd], kv, iterations);
        let flops = causal_flops(b, h, seq, hd);
        println!(
            "{}",
            json!({"time": {"seq": seq, "head_dim": hd, "batch": b, "heads": h,
                "kv_heads": kv, "causal": true, "dtype": "bf16", "fwd_bwd_ms": median * 1e3,
                "tflops": flops / median / 1e12, "fwd_ms": forward * 1e3,
                "fwd_tflops": flops / 3.5 / forward / 1e12}})
        );
    }
}

/// Median seconds of forward + backward of `attend` over `iterations` (after one warm-up);
/// queries of `shape`, keys and values with `kv_heads` heads.
fn fwd_bwd_seconds(
    device: &Device,
    shape: [usize; 4],
    kv_heads: usize,
    iterations: usize,
    attend: impl Fn(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) -> Tensor<B, 4>,
) -> f64 {
    let inputs = timed_inputs(device, shape, kv_heads);
    let g = tensor(shape, 4, FloatDType::BF16, device);
    median_seconds::<B, _>(device, iterations, || {
        let [q, k, v] = inputs.clone().map(|t| t.require_grad());
        let out = attend(q.clone(), k, v);
        let grads = (out * g.clone()).sum().backward();
        q.grad(&grads).expect("dq")
    })
}

/// Median seconds of the causal forward alone (inputs without gradients: nothing is kept for
/// a backward) over `iterations` (after one warm-up).
fn forward_seconds(device: &Device, shape: [usize; 4], kv_heads: usize, iterations: usize) -> f64 {
    let [q, k, v] = timed_inputs(device, shape, kv_heads);
    median_seconds::<B, _>(device, iterations, || {
        flash_attention(q.clone(), k.clone(), v.clone(), true).expect("flash")
    })
}

/// Q of `shape`, K and V with `kv_heads` heads, bf16.
fn timed_inputs(device: &Device, shape: [usize; 4], kv_heads: usize) -> [Tensor<B, 4>; 3] {
    let [b, _, seq, hd] = shape;
    let kv_shape = [b, kv_heads, seq, hd];
    [(shape, 1), (kv_shape, 2), (kv_shape, 3)]
        .map(|(shape, seed)| tensor(shape, seed, FloatDType::BF16, device))
}

fn sparse(device: &Device, iterations: usize) {
    for seq in [4096usize, 8192, 16384] {
        let shape = [1, 16, seq, 64];
        let layouts = [
            (
                "bigbird",
                false,
                SparsityMode::BigBird(BigBirdConfig::default()),
            ),
            (
                "fixed",
                true,
                SparsityMode::Fixed(FixedConfig {
                    attention: Direction::Unidirectional,
                    ..FixedConfig::default()
                }),
            ),
        ];
        for (name, causal, mode) in layouts {
            let config = SparsityConfig {
                num_heads: 16,
                block: 64,
                different_layout_per_head: false,
                mode,
            };
            let layout = SparseLayout::new(&config, seq).expect("layout");
            let sparse_s = fwd_bwd_seconds(device, shape, 16, iterations, |q, k, v| {
                block_sparse_attention(q, k, v, &layout, causal).expect("flash")
            });
            let dense_s = fwd_bwd_seconds(device, shape, 16, iterations, |q, k, v| {
                flash_attention(q, k, v, causal).expect("flash")
            });
            println!(
                "{}",
                json!({"sparse": {"layout": name, "seq": seq, "heads": 16, "head_dim": 64,
                    "block": 64, "causal": causal, "density": layout.density(),
                    "sparse_ms": sparse_s * 1e3, "dense_flash_ms": dense_s * 1e3,
                    "speedup": dense_s / sparse_s}})
            );
        }
    }
}

/// The memory of one training step of attention: the flash kernels, burn's materialized
/// fallback (`flash` false), or block-sparse with DeepSpeed's bigbird layout (`sparse`).
fn memory(device: &Device, seq: usize, hd: usize, flash: bool, sparse: bool) {
    set_flash_attention(Some(flash));
    let (b, h) = (16384 / seq, 2048 / hd);
    let shape = [b, h, seq, hd];
    let [q, k, v] = [1, 2, 3].map(|seed| tensor(shape, seed, FloatDType::BF16, device));
    let [q, k, v] = [q, k, v].map(|t| t.require_grad());
    let layout = sparse.then(|| {
        let config = SparsityConfig {
            num_heads: h,
            block: 64,
            different_layout_per_head: false,
            mode: SparsityMode::BigBird(BigBirdConfig::default()),
        };
        SparseLayout::new(&config, seq).expect("layout")
    });
    let attention = match &layout {
        Some(l) => block_sparse_attention(q.clone(), k.clone(), v.clone(), l, false),
        None => flash_attention(q.clone(), k.clone(), v.clone(), true),
    };
    let out = match attention {
        Some(out) => out,
        None => {
            // burn's own attention: under Autodiff, its materialized fallback.
            burn::tensor::module::attention(q.clone(), k.clone(), v.clone(), None, None, {
                burn::tensor::ops::AttentionModuleOptions {
                    is_causal: true,
                    ..Default::default()
                }
            })
        }
    };
    let grads = out.sum().backward();
    let dq = q.grad(&grads).expect("dq");
    B::sync(device).expect("sync");
    drop(dq);
    let cuda_device = cubecl::cuda::CudaDevice { index: 0 };
    let usage = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(&cuda_device)
        .memory_usage()
        .expect("memory usage");
    let attention_inputs = 3 * shape.iter().product::<usize>() * 2;
    println!(
        "{}",
        json!({"memory": {"seq": seq, "head_dim": hd, "batch": b, "heads": h, "flash": flash,
            "block_sparse": layout.as_ref().map(|l| json!({"layout": "bigbird", "block": 64,
                "density": l.density()})),
            "reserved_bytes": usage.bytes_reserved, "in_use_bytes": usage.bytes_in_use,
            "qkv_bytes": attention_inputs,
            "score_matrix_bytes_f32": b * h * seq * seq * 4}})
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let device = Device::default();
    // The kernels at every size here, whatever the automatic choice would take; the
    // tensor-core kernels where they apply unless `BURN_ZERO_ATTENTION_TENSOR_CORES=0` (no
    // engine here to read the override into its config).
    set_flash_attention(Some(true));
    let mut settings = burn_zero::backend::settings::current();
    settings.attention_tensor_cores =
        std::env::var("BURN_ZERO_ATTENTION_TENSOR_CORES").map_or(true, |v| v != "0");
    // The kernels with the scores in registers unless `BURN_ZERO_ATTENTION_REGISTER_SCORES=0`
    // (as an engine's default).
    settings.attention_register_scores =
        std::env::var("BURN_ZERO_ATTENTION_REGISTER_SCORES").map_or(true, |v| v != "0");
    burn_zero::backend::settings::set(settings).keep();
    match args.get(1).map(String::as_str) {
        Some("check") => {
            if !check(&device) {
                eprintln!("bench-attention: a case is outside its tolerance");
                std::process::exit(1);
            }
        }
        Some("time") => time(
            &device,
            arg(&args, "--iterations").map_or(5, |s| s.parse().expect("--iterations N")),
        ),
        Some("sparse") => sparse(
            &device,
            arg(&args, "--iterations").map_or(3, |s| s.parse().expect("--iterations N")),
        ),
        Some("memory") => memory(
            &device,
            arg(&args, "--seq").map_or(8192, |s| s.parse().expect("--seq N")),
            arg(&args, "--hd").map_or(128, |s| s.parse().expect("--hd N")),
            arg(&args, "--flash").is_none_or(|s| s != "0"),
            arg(&args, "--sparse").is_some_and(|s| s == "bigbird"),
        ),
        _ => {
            eprintln!(
                "usage: bench-attention check | time [--iterations N] | sparse [--iterations N] | memory [--seq S] [--hd D] [--flash 0|1] [--sparse bigbird]"
            );
            std::process::exit(2);
        }
    }
}
