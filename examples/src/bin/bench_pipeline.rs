//! A Llama trained in a pipeline over the GPUs: burn-pipeline's executor, fp32, Adam, seeded
//! random weights and token ids (the same on every run), so a 1-GPU and an N-GPU run can be
//! compared step by step. Stage boundaries balance the layers' parameters; activations and
//! gradients travel in device memory over NCCL links between neighbouring GPUs.
//!   burn-zero run --nproc-per-node N -- bench-pipeline [STEPS] [MICRO_BATCHES] [SCHEDULE]
//!       [MODEL] [SEQ] [BATCH] [DATA]
//! MODEL: `smollm2` (default: SmolLM2-135M's shape, 30 layers, hidden 576, vocabulary 49152,
//! sequence 256, batch 4) or `3b` (Llama-3.2-3B's shape: 28 layers, hidden 3072, 24 heads, 8
//! key/value heads, vocabulary 128256, tied embeddings; sequence 2048, batch 1, each decoder
//! layer checkpointed). SEQ and BATCH override the model's defaults. DATA (default 1): data
//! parallel copies of the pipeline (N = pipeline stages × DATA ranks, pipe × data as
//! DeepSpeed lays them out); copy `d` trains micro-batches `d·MICRO..(d+1)·MICRO` of the step,
//! so one GPU with MICRO × DATA micro-batches trains the same. Gradients are averaged over the
//! data axis on its own NCCL communicator.
//! PIPE_LINKS=host sends them through the launcher's host side channel instead (to compare).
//! SCHEDULE: `1f1b` (default), `gpipe`, `interleaved:V` (V chunks per GPU) or `zb-h1`. The
//! rank holding the last stage prints one JSON line: losses, step times, and the bubble the
//! schedule implies for (GPUs, micro-batches), from its streams with a forward, each half of a
//! backward and each of a chunk's parts costing the same (`schedule_bubble_fraction`) and with
//! each stage's costs as measured in one more step after the timed ones, every computation
//! timed alone (`stage_costs_s`: forward, backward, input half, weight half per rank;
//! `bubble_measured_costs`; `idle_from_clock`: 1 − the ranks' computing time with those costs
//! over the median step's). PIPE_CHECKPOINT=0|1 overrides the model's per-layer activation
//! checkpointing.

use std::time::Instant;

use burn::backend::Cuda;
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use std::sync::Arc;

use burn_pipeline::{
    ComputeClock, Replicated, Schedule, SplitMethod, StageCosts, StageSpec, Topology,
    measured_cost, pipeline_links, run_chunks_clocked, simulate_ranked, split,
};
use burn_zero::comm::{Communicator, ReduceOp, Way};
use burn_zero::dist::init_nccl;
use burn_zero::engine::ZeroAutodiff;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::{cross_entropy, draw_parameters};
use burn_zero_llm::pipeline::{LlamaStage, ids_as_input, layer_weights};

type B = ZeroAutodiff<Cuda>;

const LR: f64 = 1e-4;

/// A model's shape and its run's defaults: (config, sequence, batch, checkpointed layers).
fn model(name: &str) -> (LlamaConfig, usize, usize, bool) {
    match name {
        "smollm2" => (
            LlamaConfig::new(49152, 576, 1536, 30, 9, 3)
                .with_rope_theta(100000.0)
                .with_tie_embeddings(true),
            256,
            4,
            false,
        ),
        "3b" => (
            LlamaConfig::new(128256, 3072, 8192, 28, 24, 8)
                .with_rope_theta(500000.0)
                .with_tie_embeddings(true),
            2048,
            1,
            true,
        ),
        other => panic!("MODEL is smollm2 or 3b, not {other:?}"),
    }
}

/// Step `step`'s micro-batch `mb`: token ids `[batch, seq + 1]` from a fixed LCG.
fn tokens(
    (step, mb): (usize, usize),
    (batch, seq): (usize, usize),
    vocab: usize,
    device: &burn::tensor::Device<B>,
) -> Tensor<B, 2, Int> {
    let state = (step as u64 * 1000 + mb as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let ids = synthetic_ids(state, batch * (seq + 1), vocab);
    Tensor::from_data(TensorData::new(ids, [batch, seq + 1]), device)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(8);
    let micro: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(8);
    let schedule: Schedule = args
        .get(3)
        .map_or(Ok(Schedule::OneFOneB), |s| s.parse())
        .unwrap_or_else(|e| panic!("{e}"));
    let name = args.get(4).map_or("smollm2", String::as_str);
    let (config, seq, batch, checkpointed) = model(name);
    // PIPE_CHECKPOINT=0|1 overrides the model's per-layer activation checkpointing.
    let checkpointed = match std::env::var("PIPE_CHECKPOINT").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => checkpointed,
    };
    if std::env::var("PIPE_CHECKPOINT").is_ok() {
        eprintln!("PIPE_CHECKPOINT: each decoder layer checkpointed: {checkpointed}");
    }
    let seq: usize = args.get(5).and_then(|v| v.parse().ok()).unwrap_or(seq);
    let batch: usize = args.get(6).and_then(|v| v.parse().ok()).unwrap_or(batch);
    let copies: usize = args.get(7).and_then(|v| v.parse().ok()).unwrap_or(1);
    let (env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        copies > 0 && env.world_size % copies == 0,
        "DATA = {copies} does not divide {} ranks",
        env.world_size
    );
    let topo = Topology::pipe_data_model(env.world_size / copies, copies, 1);
    let world: Arc<dyn Communicator> = Arc::new(nccl);
    let axis = |name| {
        topo.axis_comm(world.clone(), name)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let (mut pipe, data) = (axis("pipe"), axis("data"));
    let (rank, ranks) = (pipe.rank(), pipe.world_size());
    let shard = data.rank();
    // PIPE_LINKS=host: messages through the host side channel, to compare.
    let host_links = std::env::var("PIPE_LINKS").is_ok_and(|v| v == "host");
    if host_links {
        eprintln!("PIPE_LINKS=host: activations and gradients travel through the host");
    } else {
        pipe.open_links(&pipeline_links(ranks))
            .unwrap_or_else(|e| panic!("opening the pipeline's links: {e}"));
    }
    schedule
        .check(ranks, micro)
        .unwrap_or_else(|e| panic!("{e}"));
    let chunks = schedule.chunks();
    let stages = ranks * chunks;
    // This rank's virtual stages: chunk c is stage c·ranks + rank.
    let mine: Vec<usize> = (0..chunks).map(|c| c * ranks + rank).collect();
    let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
    <Cuda as Backend>::seed(&device, 1234);
    let full =
        draw_parameters(config.init::<B>(&device)).with_activation_checkpointing(checkpointed);
    // The output projection rides on the last layer, so the last stage takes fewer layers.
    let ranges = split(
        &layer_weights(&config, checkpointed),
        stages,
        SplitMethod::Balanced,
    );
    let mut parts: Vec<LlamaStage<B>> = mine
        .iter()
        .map(|&s| LlamaStage::new(&full, &ranges, s, seq).unwrap_or_else(|e| panic!("{e}")))
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
    let links_open = ranks > 1
        && pipe
            .device()
            .and_then(|d| d.link((rank + 1) % ranks, Way::To))
            .is_some();
    let comm: &dyn Communicator = pipe.as_ref();
    let data_axis = (copies > 1).then_some(data.as_ref());
    let client = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(&device);
    let mut reserved = 0u64;
    let vocab = config.vocab_size;
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    // One more step after the timed ones with each computation timed alone: the costs the
    // schedule's bubble is simulated with for these stages (`bubble_measured_costs`).
    let mut clock = ComputeClock::default();
    for step in 0..=steps {
        let clocked = step == steps;
        let shape = (batch, seq);
        let inputs = |mb: usize| {
            let mb = shard * micro + mb;
            ids_as_input(tokens((step, mb), shape, vocab, &device).slice([0..batch, 0..seq]))
        };
        let loss = |mb: usize, logits: Tensor<B, 2>| {
            let mb = shard * micro + mb;
            let targets = tokens((step, mb), shape, vocab, &device).slice([0..batch, 1..seq + 1]);
            cross_entropy(logits.reshape([batch, seq, vocab]), targets)
        };
        let specs: Vec<StageSpec<'_, B>> = mine
            .iter()
            .map(|&stage| StageSpec {
                stage,
                stages,
                micro_batches: micro,
                rows: if stage == 0 { batch } else { batch * seq },
                in_features: if stage == 0 { seq } else { config.hidden_size },
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            })
            .collect();
        <Cuda as Backend>::sync(&device).expect("sync");
        let start = Instant::now();
        let timer = clocked.then_some(&mut clock);
        let (next, l) = run_chunks_clocked(
            parts,
            &mut optims,
            LR,
            &stream,
            &specs,
            comm,
            data_axis,
            timer,
        )
        .unwrap_or_else(|e| panic!("step {step}: {e}"));
        <Cuda as Backend>::sync(&device).expect("sync");
        world.barrier().expect("barrier");
        parts = next;
        if clocked {
            continue;
        }
        times.push(start.elapsed().as_secs_f64());
        reserved = reserved.max(client.memory_usage().map_or(0, |u| u.bytes_reserved));
        if let Some(mut l) = l {
            // The whole step's loss: every copy's micro-batches.
            let mut mean = [l];
            data.all_reduce(mean.as_mut_slice().into(), ReduceOp::Avg)
                .expect("averaging the loss over the data axis");
            l = mean[0];
            eprintln!("step {step}: loss {l:.5}, {:.3} s", times[step]);
            losses.push(l);
        }
    }
    // Each GPU's largest memory pool (cubecl's reserved bytes after a step), in rank order.
    let mut peak = vec![0.0f32; world.world_size()];
    world
        .all_gather(
            [reserved as f32].as_slice().into(),
            peak.as_mut_slice().into(),
        )
        .expect("gathering the pools' sizes");
    // Each pipeline rank's mean seconds per forward, backward and backward half.
    let mut costs = vec![0.0f32; 4 * ranks];
    pipe.all_gather(
        clock.means().map(|c| c as f32).as_slice().into(),
        costs.as_mut_slice().into(),
    )
    .expect("gathering the stages' costs");
    let costs: Vec<StageCosts> = costs
        .chunks(4)
        .map(|c| [c[0], c[1], c[2], c[3]].map(f64::from))
        .collect();
    if rank + 1 == ranks && shard == 0 {
        // Steps after the first two (kernel compilation and autotuning).
        let mut timed: Vec<f64> = times.iter().skip(2).copied().collect();
        timed.sort_by(f64::total_cmp);
        let median = timed.get(timed.len() / 2).copied();
        let bubble = schedule.bubble(ranks, micro);
        // The schedule at those costs: its bubble, each rank's computing time in a step, and
        // the idle fraction of the timed steps that implies (needs no 1-GPU run, which
        // computes more under checkpointing).
        let timeline = simulate_ranked(&schedule.streams(ranks, micro), measured_cost(&costs))
            .expect("the schedule's own streams run");
        let (measured, busy) = (timeline.bubble(), timeline.busy);
        let idle_from_clock = median.map(|m| 1.0 - busy.iter().sum::<f64>() / (ranks as f64 * m));
        println!(
            "{}",
            serde_json::json!({"schedule": format!("{schedule:?}"), "gpus": world.world_size(),
                "pipeline_stages_per_copy": ranks, "data_copies": copies,
                "model": name, "checkpointed_layers": checkpointed,
                "stages": stages, "micro_batches": micro, "batch": batch,
                "seq": seq, "layers_per_stage": ranges.iter().map(|r| r.len()).collect::<Vec<_>>(),
                "device_links": links_open, "peak_gpu_bytes": peak,
                "losses": losses, "step_times_s": times, "median_step_s": median,
                "tokens_per_s": median.map(|m| (copies * micro * batch * seq) as f64 / m),
                "schedule_bubble_fraction": bubble,
                "stage_costs_s": costs, "bubble_measured_costs": measured,
                "busy_s_per_rank": busy, "idle_from_clock": idle_from_clock})
        );
    }
}
