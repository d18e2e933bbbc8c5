//! CPU-Adam step time over N parameters (default 1e9): fp32 gradients with an fp32 master only,
//! and bf16 gradients writing the bf16 weight copy (the offload path), at every SIMD level this
//! CPU runs. Prints one JSON object; `bench/run_cpu_adam.sh` runs it beside
//! `torch.optim.AdamW(fused=True)` on the same machine and thread count.
//!   bench-cpu-adam [--params N] [--threads T] [--steps S] [--pin] [--huge-pages] [--best-only]

use std::time::Instant;

use burn_offload::memory::{advise_huge_pages, zeroed_f32};
use burn_offload::{AdamStep, CpuAdam, Grad, Out, SimdLevel};
use burn_zero_examples::cli::arg;
use half::bf16;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = arg(&args, "--params").map_or(1_000_000_000, |v| {
        v.parse::<f64>().expect("--params: a number") as usize
    });
    let threads = arg(&args, "--threads").map(|v| v.parse::<usize>().expect("--threads"));
    let steps = arg(&args, "--steps").map_or(5, |v| v.parse().expect("--steps"));
    let pin = args.iter().any(|a| a == "--pin");
    let huge = args.iter().any(|a| a == "--huge-pages");
    let best_only = args.iter().any(|a| a == "--best-only");
    eprintln!("allocating {n} parameters (fp32 master, m, v, gradient; bf16 gradient and copy)");
    // Zeroed and (with --huge-pages) advised before the first touch, as burn-offload's own
    // partitions are.
    let zeroed = |n: usize| zeroed_f32(n, huge);
    let mut w = zeroed(n);
    w.iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = ((i % 1013) as f32) * 1e-3 - 0.5);
    let mut g = zeroed(n);
    g.iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = ((i % 997) as f32) * 1e-4 - 0.05);
    let g16: Vec<bf16> = g.iter().map(|x| bf16::from_f32(*x)).collect();
    let (mut m, mut v) = (zeroed(n), zeroed(n));
    let mut out = vec![bf16::ZERO; n];
    if huge {
        advise_huge_pages(&mut out);
    }
    let mut results = Vec::new();
    let levels = if best_only {
        vec![SimdLevel::detect()]
    } else {
        SimdLevel::available()
    };
    for level in levels {
        let adam = CpuAdam::new(threads)
            .with_level(level)
            .with_pinned_cores(pin);
        for (label, bf16_path) in [
            ("fp32 grad, fp32 master", false),
            ("bf16 grad, fp32 master + bf16 copy", true),
        ] {
            let mut times = Vec::new();
            for t in 1..=steps as u64 + 1 {
                let k = AdamStep::at(t, 1e-4, (0.9, 0.999), 1e-8, 0.01, true, true);
                let start = Instant::now();
                if bf16_path {
                    adam.adam(
                        &k,
                        &mut w,
                        Grad::Bf16(&g16),
                        &mut m,
                        &mut v,
                        Out::Bf16(&mut out),
                    );
                } else {
                    adam.adam(&k, &mut w, Grad::F32(&g), &mut m, &mut v, Out::None);
                }
                times.push(start.elapsed().as_secs_f64());
            }
            times.remove(0); // first touch of the pages
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            // Bytes moved per element: read w, m, v and g, write w, m, v (and the 16-bit copy):
            // 28 either way (a bf16 gradient is 2 bytes less, its copy 2 more).
            let bytes = 28.0 * n as f64;
            eprintln!(
                "{level:?} {label}: {:.3} s per step ({:.1} GB/s)",
                median,
                bytes / median / 1e9
            );
            results.push(
                serde_json::json!({"level": format!("{level:?}"), "path": label,
                "median_step_s": median, "s_per_1b_params": median * 1e9 / n as f64,
                "effective_gb_per_s": bytes / median / 1e9, "steps": times.len()}),
            );
        }
    }
    let threads_used = CpuAdam::new(threads).threads();
    println!(
        "{}",
        serde_json::json!({"params": n, "threads": threads_used, "pinned": pin, "huge_pages": huge,
        "detected_level": format!("{:?}", SimdLevel::detect()), "results": results,
        "checksum": w.iter().take(1000).map(|x| *x as f64).sum::<f64>()})
    );
}
