//! The recipe's model (SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads, 3 key/value heads,
//! vocabulary 49152, tied embeddings) trained in a pipeline over the GPUs: burn-pipeline's
//! executor, fp32, Adam, seeded random weights and token ids (the same on every run), so a
//! 1-GPU and an N-GPU run can be compared step by step. Stage boundaries balance the layers'
//! parameters; activations and gradients travel over the launcher's side channel.
//!   burn-zero run --nproc-per-node N -- bench-pipeline [STEPS] [MICRO_BATCHES] [SCHEDULE]
//! SCHEDULE: `1f1b` (default), `gpipe`, `interleaved:V` (V chunks per GPU) or `zb-h1`. The
//! rank holding the last stage prints one JSON line: losses, step times, and the bubble the
//! schedule implies for (GPUs, micro-batches), from its streams with a forward, each half of a
//! backward and each of a chunk's parts costing the same.

use std::time::Instant;

use burn::backend::Cuda;
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_pipeline::{Replicated, Schedule, SplitMethod, StageSpec, run_chunks, split};
use burn_zero::comm::Communicator;
use burn_zero::dist::init_nccl;
use burn_zero::engine::ZeroAutodiff;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::{cross_entropy, draw_parameters};
use burn_zero_llm::pipeline::{LlamaStage, ids_as_input};

type B = ZeroAutodiff<Cuda>;

const BATCH: usize = 4;
const SEQ: usize = 256;
const LR: f64 = 1e-4;

/// SmolLM2-135M's shape.
fn smollm2() -> LlamaConfig {
    LlamaConfig::new(49152, 576, 1536, 30, 9, 3)
        .with_rope_theta(100000.0)
        .with_tie_embeddings(true)
}

/// Step `step`'s micro-batch `mb`: token ids `[BATCH, SEQ + 1]` from a fixed LCG.
fn tokens(
    step: usize,
    mb: usize,
    vocab: usize,
    device: &burn::tensor::Device<B>,
) -> Tensor<B, 2, Int> {
    let state = (step as u64 * 1000 + mb as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let ids = synthetic_ids(state, BATCH * (SEQ + 1), vocab);
    Tensor::from_data(TensorData::new(ids, [BATCH, SEQ + 1]), device)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(8);
    let micro: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(8);
    let schedule: Schedule = args
        .get(3)
        .map_or(Ok(Schedule::OneFOneB), |s| s.parse())
        .unwrap_or_else(|e| panic!("{e}"));
    let (env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let (rank, ranks) = (env.rank, env.world_size);
    schedule
        .check(ranks, micro)
        .unwrap_or_else(|e| panic!("{e}"));
    let chunks = schedule.chunks();
    let stages = ranks * chunks;
    // This rank's virtual stages: chunk c is stage c·ranks + rank.
    let mine: Vec<usize> = (0..chunks).map(|c| c * ranks + rank).collect();
    let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
    let config = smollm2();
    <Cuda as Backend>::seed(&device, 1234);
    let full = draw_parameters(config.init::<B>(&device));
    // Each layer weighs its parameters; the embedding and head ride on the ends.
    let weights: Vec<usize> = (0..config.num_layers)
        .map(|_| {
            let (h, f) = (config.hidden_size, config.intermediate_size);
            let kv = config.num_kv_heads * config.head_dim();
            2 * h * h + 2 * h * kv + 3 * h * f
        })
        .collect();
    let ranges = split(&weights, stages, SplitMethod::Balanced);
    let mut parts: Vec<LlamaStage<B>> = mine
        .iter()
        .map(|&s| LlamaStage::new(&full, &ranges, s, SEQ).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    drop(full);
    let mut optims: Vec<_> = mine
        .iter()
        .map(|_| {
            Replicated(
                AdamConfig::new()
                    .with_epsilon(1e-8)
                    .init::<B, LlamaStage<B>>(),
            )
        })
        .collect();
    let stream = schedule.stream(ranks, micro, rank);
    let comm: &dyn Communicator = &nccl;
    let vocab = config.vocab_size;
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let inputs =
            |mb: usize| ids_as_input(tokens(step, mb, vocab, &device).slice([0..BATCH, 0..SEQ]));
        let loss = |mb: usize, logits: Tensor<B, 2>| {
            let targets = tokens(step, mb, vocab, &device).slice([0..BATCH, 1..SEQ + 1]);
            cross_entropy(logits.reshape([BATCH, SEQ, vocab]), targets)
        };
        let specs: Vec<StageSpec<'_, B>> = mine
            .iter()
            .map(|&stage| StageSpec {
                stage,
                stages,
                micro_batches: micro,
                rows: if stage == 0 { BATCH } else { BATCH * SEQ },
                in_features: if stage == 0 { SEQ } else { config.hidden_size },
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            })
            .collect();
        <Cuda as Backend>::sync(&device).expect("sync");
        let start = Instant::now();
        let (next, l) = run_chunks(parts, &mut optims, LR, &stream, &specs, comm, None)
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        <Cuda as Backend>::sync(&device).expect("sync");
        comm.barrier().expect("barrier");
        times.push(start.elapsed().as_secs_f64());
        parts = next;
        if let Some(l) = l {
            eprintln!("step {step}: loss {l:.5}, {:.3} s", times[step]);
            losses.push(l);
        }
    }
    if rank + 1 == ranks {
        // Steps after the first two (kernel compilation and autotuning).
        let mut timed: Vec<f64> = times.iter().skip(2).copied().collect();
        timed.sort_by(f64::total_cmp);
        let median = timed.get(timed.len() / 2).copied();
        let bubble = schedule.bubble(ranks, micro);
        println!(
            "{}",
            serde_json::json!({"schedule": format!("{schedule:?}"), "gpus": ranks,
                "stages": stages, "micro_batches": micro, "batch": BATCH,
                "seq": SEQ, "layers_per_stage": ranges.iter().map(|r| r.len()).collect::<Vec<_>>(),
                "losses": losses, "step_times_s": times, "median_step_s": median,
                "tokens_per_s": median.map(|m| (micro * BATCH * SEQ) as f64 / m),
                "schedule_bubble_fraction": bubble})
        );
    }
}
