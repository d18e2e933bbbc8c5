//! burn 0.21's CUDA matmul on the Linear shapes of the recipe (SmolLM2-135M, 2048 tokens) and
//! of the 1B and 8B end-to-end benchmarks (4096 tokens): forward `X·W`, backward `dY·Wᵀ` and
//! `Xᵀ·dY`, bf16 and f32. Prints one JSON line per case with the first call's time (kernel
//! compilation and autotuning included) and the steady TFLOP/s, for `ZeroBackend<Cuda>`
//! (cuBLASLt) and for `Cuda` alone (argument `burn-zero` or `burn-cuda` runs one);
//! `bench/matmul_torch.py` prints the peer's.

use std::time::Instant;

use burn::backend::Cuda;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Element, Tensor};
use burn_zero::ZeroBackend;

/// (name, tokens M, in K, out N).
const LINEARS: [(&str, usize, usize, usize); 8] = [
    ("smollm2.mlp_up", 2048, 576, 1536),
    ("smollm2.lm_head", 2048, 576, 49152),
    ("llama1b.attn_q", 4096, 2048, 2048),
    ("llama1b.mlp_up", 4096, 2048, 8192),
    ("llama1b.mlp_down", 4096, 8192, 2048),
    ("llama8b.attn_o", 4096, 4096, 4096),
    ("llama8b.mlp_up", 4096, 4096, 14336),
    ("llama8b.mlp_down", 4096, 14336, 4096),
];

fn sync<B: Backend>(device: &B::Device) {
    B::sync(device).expect("sync the device");
}

/// Times `lhs·rhs` where `lhs` is `[m, k]` (or its transpose) and `rhs` `[k, n]` (or transposed).
fn case<B: Backend>(
    system: &str,
    dtype: &str,
    name: &str,
    product: &str,
    (m, k, n): (usize, usize, usize),
    transpose: (bool, bool),
    device: &B::Device,
) where
    B::FloatElem: Element,
{
    let dist = Distribution::Uniform(-1.0, 1.0);
    let lhs_shape = if transpose.0 { [k, m] } else { [m, k] };
    let rhs_shape = if transpose.1 { [n, k] } else { [k, n] };
    // In the backend's element type: without one, burn 0.21 creates f32 even on Cuda<bf16>.
    let dt = <B::FloatElem as Element>::dtype();
    let lhs = Tensor::<B, 2>::random(lhs_shape, dist, (device, dt));
    let rhs = Tensor::<B, 2>::random(rhs_shape, dist, (device, dt));
    assert_eq!((lhs.dtype(), rhs.dtype()), (dt, dt), "operand dtype");
    let lhs = if transpose.0 { lhs.transpose() } else { lhs };
    let rhs = if transpose.1 { rhs.transpose() } else { rhs };
    sync::<B>(device);
    let start = Instant::now();
    let out = lhs.clone().matmul(rhs.clone());
    sync::<B>(device);
    let first_ms = start.elapsed().as_secs_f64() * 1e3;
    drop(out);
    for _ in 0..3 {
        let _ = lhs.clone().matmul(rhs.clone());
    }
    sync::<B>(device);
    let _ = burn_zero::backend::matmul::take_matmul_profile(0);
    let iters = 20;
    let start = Instant::now();
    for _ in 0..iters {
        let _ = lhs.clone().matmul(rhs.clone());
    }
    sync::<B>(device);
    let seconds = start.elapsed().as_secs_f64() / iters as f64;
    let tflops = 2.0 * (m * k * n) as f64 / seconds / 1e12;
    // Per cuBLASLt call: host time by phase and the GEMM's own GPU time (when profiled).
    let p = burn_zero::backend::matmul::take_matmul_profile(0);
    let per = |v: f64| {
        if p.calls == 0 {
            0.0
        } else {
            v / p.calls as f64
        }
    };
    let host: Vec<String> = p
        .host_us
        .iter()
        .map(|v| format!("{:.1}", per(*v)))
        .collect();
    println!(
        "{{\"system\": \"{system}\", \"dtype\": \"{dtype}\", \"linear\": \"{name}\", \"product\": \"{product}\", \"m\": {m}, \"k\": {k}, \"n\": {n}, \"first_call_ms\": {first_ms:.1}, \"time_us\": {:.1}, \"tflops\": {tflops:.2}, \"cublaslt_calls\": {}, \"host_us_per_phase\": [{}], \"gemm_gpu_us\": {:.1}}}",
        seconds * 1e6,
        p.calls,
        host.join(", "),
        per(p.gemm_gpu_us)
    );
}

fn run<B: Backend>(system: &str, dtype: &str, forward_only: bool)
where
    B::FloatElem: Element,
{
    let device = Default::default();
    // BENCH_ONLY=substring limits the Linear shapes run.
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    for (name, m, k, n) in LINEARS {
        if !name.contains(&only) {
            continue;
        }
        // Forward Y = X·W: [M,K]·[K,N].
        case::<B>(
            system,
            dtype,
            name,
            "forward",
            (m, k, n),
            (false, false),
            &device,
        );
        if forward_only {
            continue;
        }
        // dX = dY·Wᵀ: [M,N]·[N,K] with W stored [K,N].
        case::<B>(
            system,
            dtype,
            name,
            "grad_input",
            (m, n, k),
            (false, true),
            &device,
        );
        // dW = Xᵀ·dY: [K,M]·[M,N] with X stored [M,K].
        case::<B>(
            system,
            dtype,
            name,
            "grad_weight",
            (k, m, n),
            (true, false),
            &device,
        );
    }
}

fn main() {
    if std::env::var_os("BENCH_PERSIST_KERNELS").is_some() {
        let dir = burn_zero::kernel_cache::default_dir();
        burn_zero::kernel_cache::persist(&dir).expect("kernel cache");
        eprintln!("kernel cache: {}", dir.display());
    }
    // burn-zero: the decorator, whose matmuls go to cuBLASLt (f32 with TF32 allowed, as
    // burn's own CUDA f32 matmul uses TF32); burn-cuda: the inner backend alone.
    burn_zero::backend::matmul::set_matmul_policy(burn_zero::backend::matmul::MatmulPolicy {
        cublaslt: true,
        allow_tf32: true,
        ..Default::default()
    });
    let only = std::env::args().nth(1);
    if only.as_deref() == Some("burn-zero-cube") {
        // The decorator over burn's CUDA backend without fusion (diagnostics).
        type Cube<F> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;
        run::<ZeroBackend<Cube<half::bf16>>>("burn-zero-cube", "bf16", false);
        return;
    }
    if only.as_deref() != Some("burn-cuda") {
        run::<ZeroBackend<Cuda<half::bf16>>>("burn-zero", "bf16", false);
        run::<ZeroBackend<Cuda<f32>>>("burn-zero", "f32", true);
        eprintln!(
            "cuBLASLt calls: {}",
            burn_zero::backend::matmul::cublaslt_calls()
        );
    }
    if only.as_deref() != Some("burn-zero") {
        run::<Cuda<half::bf16>>("burn-cuda", "bf16", false);
        run::<Cuda<f32>>("burn-cuda", "f32", true);
    }
}
