//! End-to-end training throughput of a Llama-style model under the engine (issue 12), the peer
//! of `bench/e2e_fsdp2.py`: the same sizes, sequence length, micro-batch, bf16 with fp32
//! master weights, AdamW (β = 0.9/0.95, weight decay 0.1), clipping at 1.0, seeded random
//! weights and tokens. One process per GPU:
//!   burn-zero run --nproc-per-node N -- bench-e2e SIZE STAGE [STEPS] [MICRO_BATCH] [SEQ]
//! SIZE is `125m`, `smollm2` (SmolLM2-135M's shape), `1b`, `3b` (Llama-3.2 shapes, tied embeddings)
//! or `8b` (Llama-3.1-8B, untied). Options after the positional ones: `--pool
//! fitted|sliced|exclusive` (the CUDA memory pools, `burn_zero.memory_pool`; default fitted) and
//! `--init shared|burn` (shared: the weights `bench/shared_init.py` computes too, so the peers'
//! losses compare step by step; burn: burn's own initializers, seeded) and `--loss chunked|full`
//! (the output projection and cross-entropy over chunks of 2,048 tokens,
//! `burn_zero::nn::linear_cross_entropy`, or the logits materialized) and `--release 1|0`
//! (`burn_zero.release_cached_memory`: the pools' free pages handed back between the phases) and
//! `--ac 0|1` (an `activation_checkpointing` section in the config, and the Llama checkpointing
//! every decoder layer from it: `Llama::with_activation_checkpointing`) and `--bucket N`
//! (`reduce_bucket_size`, default 5e7 elements) and `--prefetch N` (`stage3_prefetch_bucket_size`,
//! default 5e7) and `--loss-rows N` (tokens per chunk of the chunked loss, default 2,048) and
//! `--deterministic 0|1` (`burn_zero.deterministic`) and `--ckpt DIR --save-at N` (an engine
//! checkpoint into DIR after step N) and `--resume DIR` (start from DIR's latest checkpoint, at the
//! step it names) and `--precision bf16|fp32` (default bf16; fp32 drops the config's bf16 section)
//! and `--offload-param cpu|nvme:DIR|none` and `--offload-optimizer cpu|nvme:DIR|none`
//! (`zero_optimization.offload_param` / `offload_optimizer`, default none; parameters only at stage
//! 3) and `--sub-group N` (`sub_group_size`, default the config's 1e9) and `--warmup N` (steps left
//! out of the timing, default 2: the first two compile kernels and tune matmuls; 0 times every
//! step, for a model whose steps are too long to spare) and `--grad-accum-dtype fp32|bf16`
//! (`data_types.grad_accum_dtype`, default fp32: gradients accumulated and reduced in bf16, and an
//! offloaded optimizer's host gradient partition held in bf16). Rank 0 prints one JSON line:
//! tokens/s per GPU, MFU, the step-time breakdown, peak and pool memory, the losses and the
//! gradient norms.
//! `E2E_HOST_PROFILE=FILE` (built with feature `host-profile`) samples rank 0's host CPU time
//! over the timed steps and writes the summary to FILE (see `host_profile`).

use std::time::Instant;

use burn::backend::Cuda;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::backend::configure_memory_pool;
use burn_zero::backend::matmul::take_matmul_profile;
use burn_zero::config::MemoryPoolLayout;
use burn_zero::dist::init_nccl;
use burn_zero::engine::{ZeroAutodiff, construct_full_from, construct_sharded_from, initialize};
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::shared_init::SharedInit;
use burn_zero_llm::{Llama, LlamaConfig};

type B = ZeroAutodiff<Cuda>;

/// The model of `size`: SmolLM2-like 125M, Llama-3.2-1B and -3B shapes (tied embeddings),
/// Llama-3.1-8B and -70B shapes (untied); `SIZE:LAYERS` keeps a shape's widths with `LAYERS`
/// decoder layers (`8b:48`, `70b:28`), for the largest model a machine trains.
fn preset(size: &str) -> LlamaConfig {
    let (base, layers) = match size.split_once(':') {
        Some((base, n)) => match n.parse::<usize>() {
            Ok(n) if n > 0 => (base, Some(n)),
            _ => panic!("SIZE:LAYERS needs a positive layer count, not `{n}`"),
        },
        None => (size, None),
    };
    let mut config = match base {
        "125m" => LlamaConfig::new(49152, 768, 2048, 12, 12, 4),
        // SmolLM2-135M's shape, the fine-tuning recipe's model (deep and narrow: the most
        // launches per FLOP of these).
        "smollm2" => LlamaConfig::new(49152, 576, 1536, 30, 9, 3),
        "1b" => LlamaConfig::new(128256, 2048, 8192, 16, 32, 8),
        "3b" => LlamaConfig::new(128256, 3072, 8192, 28, 24, 8),
        "8b" => LlamaConfig::new(128256, 4096, 14336, 32, 32, 8).with_tie_embeddings(false),
        "70b" => LlamaConfig::new(128256, 8192, 28672, 80, 64, 8).with_tie_embeddings(false),
        other => {
            panic!("SIZE is 125m, smollm2, 1b, 3b, 8b or 70b (optionally :LAYERS), not `{other}`")
        }
    };
    if let Some(n) = layers {
        config.num_layers = n;
    }
    config.with_rope_theta(500000.0).with_max_seq_len(8192)
}

/// The shared starting weights (`bench/shared_init.py` computes the same).
const SHARED: SharedInit = SharedInit { seed: 42 };

/// The positional arguments, and the `--key value` options after them.
fn split_options(args: &[String], usage: &str) -> (Vec<String>, Vec<(String, String)>) {
    let split = args
        .iter()
        .position(|a| a.starts_with("--"))
        .unwrap_or(args.len());
    let mut options = Vec::new();
    let mut rest = args[split..].iter();
    while let Some(key) = rest.next() {
        let value = rest
            .next()
            .unwrap_or_else(|| panic!("{key} needs a value: {usage}"));
        options.push((key.trim_start_matches("--").to_string(), value.clone()));
    }
    (args[..split].to_vec(), options)
}

/// Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
/// `QKᵀ` and `AV`, 12·layers·hidden·seq (counted whole, not halved for the causal mask, as
/// PaLM's MFU does and torchtitan reports).
pub fn flops_per_token(params: usize, config: &LlamaConfig, seq: usize) -> f64 {
    6.0 * params as f64 + 12.0 * (config.num_layers * config.hidden_size * seq) as f64
}

/// Dense bf16 peak of the GPU in FLOP/s: `BURN_ZERO_PEAK_TFLOPS`, else an H100/H200 SXM's
/// 989.4 TFLOP/s.
fn peak_flops() -> f64 {
    std::env::var("BURN_ZERO_PEAK_TFLOPS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(989.4)
        * 1e12
}

/// cubecl's memory pool on `device` after `phase`: GiB reserved from the GPU and GiB in live
/// buffers (their difference is what the pools hold free), also printed by rank 0 as it goes,
/// so a run that dies of memory still shows how far it got.
fn pool_usage(device: &burn::tensor::Device<Cuda>, phase: &str, rank: usize) -> serde_json::Value {
    <Cuda as Backend>::sync(device).expect("sync");
    let usage = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::client(device)
        .memory_usage()
        .expect("memory usage");
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let (reserved, in_use) = (gib(usage.bytes_reserved), gib(usage.bytes_in_use));
    if rank == 0 {
        eprintln!("memory after {phase}: {reserved:.2} GiB reserved, {in_use:.2} GiB in use");
    }
    serde_json::json!({"phase": phase, "reserved_gib": reserved, "in_use_gib": in_use})
}

/// Rank `rank`'s tokens `[micro, seq + 1]` of step `step` (a fixed LCG, the Python peer's too).
fn tokens(
    step: usize,
    rank: usize,
    (micro, seq, vocab): (usize, usize, usize),
    device: &burn::tensor::Device<B>,
) -> Tensor<B, 2, Int> {
    let state = ((step * 1000 + rank) as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let ids = synthetic_ids(state, micro * (seq + 1), vocab);
    Tensor::from_data(TensorData::new(ids, [micro, seq + 1]), device)
}

/// The value of `--key`, if given.
fn option<'a>(options: &'a [(String, String)], key: &str) -> Option<&'a str> {
    options
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The `zero_optimization` entry `section` that `--key` asks for (`cpu`, `nvme:DIR` or `none`),
/// as a JSON fragment that follows another entry (empty for `none`).
fn offload_section(options: &[(String, String)], key: &str, section: &str) -> String {
    match option(options, key) {
        None | Some("none") => String::new(),
        Some("cpu") => format!(r#", "{section}": {{"device": "cpu", "pin_memory": true}}"#),
        Some(v) => match v.strip_prefix("nvme:").filter(|dir| !dir.is_empty()) {
            Some(dir) => format!(
                r#", "{section}": {{"device": "nvme", "nvme_path": "{dir}", "pin_memory": true}}"#
            ),
            None => panic!("--{key} is cpu, nvme:DIR or none, not `{v}`"),
        },
    }
}

/// The count `--key` gives, else `default`.
fn count_option(options: &[(String, String)], key: &str, default: usize) -> usize {
    option(options, key).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("--{key} is a count, not `{v}`"))
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "bench-e2e SIZE STAGE [STEPS] [MICRO_BATCH] [SEQ] [--pool fitted|sliced|exclusive] \
                 [--init shared|burn] [--loss chunked|full] [--release 1|0] [--ac 0|1] [--bucket N] [--sub-group N] [--loss-rows N] \
                 [--deterministic 0|1] [--warmup N] [--grad-accum-dtype fp32|bf16] [--ckpt DIR --save-at N] [--resume DIR] \
                 [--offload-param cpu|nvme:DIR|none] [--offload-optimizer cpu|nvme:DIR|none] \
                 [--graphs 0|1] [--gas N] [--seq-switch STEP:SEQ]";
    let (args, options) = split_options(&args, usage);
    let pool = match option(&options, "pool") {
        None | Some("fitted") => MemoryPoolLayout::Fitted,
        Some("sliced") => MemoryPoolLayout::Sliced,
        Some("exclusive") => MemoryPoolLayout::Exclusive,
        Some(other) => panic!("--pool is fitted, sliced or exclusive, not `{other}`"),
    };
    let shared_init = match option(&options, "init") {
        None | Some("shared") => true,
        Some("burn") => false,
        Some(other) => panic!("--init is shared or burn, not `{other}`"),
    };
    // Tokens per chunk of the loss (0: the logits materialized, as before).
    let rows = count_option(&options, "loss-rows", 2048);
    let loss_chunk: usize = match option(&options, "loss") {
        None | Some("chunked") => rows,
        Some("full") => 0,
        Some(other) => panic!("--loss is chunked or full, not `{other}`"),
    };
    let release_cached = match option(&options, "release") {
        None | Some("1") => true,
        Some("0") => false,
        Some(other) => panic!("--release is 0 or 1, not `{other}`"),
    };
    // Activation checkpointing per decoder layer, asked for by the config's section.
    let checkpointing = match option(&options, "ac") {
        None | Some("0") => false,
        Some("1") => true,
        Some(other) => panic!("--ac is 0 or 1, not `{other}`"),
    };
    // `zero_optimization.reduce_bucket_size` in elements: 5e7 (2e8 until 1f8d105, which kept up
    // to 3.7 GiB of fp32 buckets and ran 0.94x as fast at 3B; DeepSpeed's default is 5e8,
    // Hugging Face's "auto" hidden²).
    let bucket = count_option(&options, "bucket", 50_000_000);
    // `zero_optimization.stage3_prefetch_bucket_size` in elements: DeepSpeed's default 5e7,
    // about half a 3B decoder layer; a layer or two ahead lets each batch of gathers overlap
    // a whole layer's compute.
    let prefetch = count_option(&options, "prefetch", 50_000_000);
    // `--precision fp32` trains without the config's bf16 section (fp32 weights, gradients and
    // activations), as the pipeline bench does, for a side-by-side on the same precision.
    let bf16 = match option(&options, "precision") {
        None | Some("bf16") => true,
        Some("fp32") => false,
        Some(other) => panic!("--precision is bf16 or fp32, not `{other}`"),
    };
    let warmup = count_option(&options, "warmup", 2);
    // `--graphs 0|1`: each micro-step through `Engine::forward_backward` (no host sync between
    // forward and backward), with `burn_zero.cuda_graphs` off or on (issue 37).
    // E2E_GRAPHS=0|1 stands for the option when it is not given (run_host_pace.sh's variants
    // set variables).
    let graphs_env = std::env::var("E2E_GRAPHS").ok();
    let graphs = match option(&options, "graphs").or(graphs_env.as_deref()) {
        None => None,
        Some("0") => Some(false),
        Some("1") => Some(true),
        Some(other) => panic!("--graphs is 0 or 1, not `{other}`"),
    };
    // `--gas N`: micro-steps per optimizer step (`gradient_accumulation_steps`).
    let gas = count_option(&options, "gas", 1).max(1);
    // `--seq-switch STEP:SEQ`: from step STEP on, sequences of SEQ tokens (a new graph).
    let seq_switch = option(&options, "seq-switch").map(|v| {
        let parsed = v
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)));
        parsed.unwrap_or_else(|| panic!("--seq-switch is STEP:SEQ, not `{v}`"))
    });
    let data_types = match option(&options, "grad-accum-dtype") {
        None | Some("fp32") => "",
        Some("bf16") => r#", "data_types": {"grad_accum_dtype": "bf16"}"#,
        Some(other) => panic!("--grad-accum-dtype is fp32 or bf16, not `{other}`"),
    };
    let deterministic = match option(&options, "deterministic") {
        None | Some("0") => false,
        Some("1") => true,
        Some(other) => panic!("--deterministic is 0 or 1, not `{other}`"),
    };
    let save = option(&options, "ckpt").map(|dir| {
        let at = option(&options, "save-at").expect("--ckpt needs --save-at N");
        let at: usize = at
            .parse()
            .unwrap_or_else(|_| panic!("--save-at is a step count, not `{at}`"));
        (std::path::PathBuf::from(dir), at)
    });
    let resume = option(&options, "resume").map(std::path::PathBuf::from);
    let offload_param = offload_section(&options, "offload-param", "offload_param");
    let offload_optimizer = offload_section(&options, "offload-optimizer", "offload_optimizer");
    let sub_group = option(&options, "sub-group").map_or(String::new(), |_| {
        let n = count_option(&options, "sub-group", 0);
        format!(r#", "sub_group_size": {n}"#)
    });
    let size = args.get(1).cloned().expect(usage);
    let stage: u8 = args.get(2).and_then(|v| v.parse().ok()).expect(usage);
    let steps: usize = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(10);
    let micro: usize = args.get(4).and_then(|v| v.parse().ok()).unwrap_or(2);
    let seq: usize = args.get(5).and_then(|v| v.parse().ok()).unwrap_or(1024);
    let (env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let (rank, world) = (env.rank, env.world_size);
    let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
    // The pools are fixed at the device's first use: before the model touches it.
    configure_memory_pool(env.local_rank, pool).unwrap_or_else(|e| panic!("{e}"));
    let config = preset(&size);
    // E2E_PROFILE=FILE: the FLOPs profiler on step 3, its report written to FILE (rank 0).
    let profile = std::env::var("E2E_PROFILE").map_or(String::new(), |file| {
        format!(
            r#", "flops_profiler": {{"enabled": true, "profile_step": 3, "module_depth": -1,
                "top_modules": 3, "detailed": true, "output_file": "{file}"}}"#
        )
    });
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {gas},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "betas": [0.9, 0.95],
                "weight_decay": 0.1}}}},
            "gradient_clipping": 1.0,
            "bf16": {{"enabled": {bf16}}},
            "zero_optimization": {{"stage": {stage}, "overlap_comm": true,
                "reduce_bucket_size": {bucket}, "allgather_bucket_size": 200000000,
                "stage3_prefetch_bucket_size": {prefetch}{offload_param}{offload_optimizer}{sub_group}}},
            "burn_zero": {{"matmul": {{"cublaslt": true}}, "deterministic": {deterministic},
                "memory_pool": "{pool_name}", "release_cached_memory": {release_cached},
                "cuda_graphs": {{"enabled": {cuda_graphs}}}}}
                {ac}{profile}{data_types}}}"#,
        ac = if checkpointing {
            r#", "activation_checkpointing": {"partition_activations": false}"#
        } else {
            ""
        },
        pool_name = format!("{pool:?}").to_lowercase(),
        cuda_graphs = graphs == Some(true),
    );
    let ds = DeepSpeedConfig::from_json(&json).expect("config").config;
    <Cuda as Backend>::seed(&device, 42);
    let model: Llama<B> = match (shared_init, stage) {
        (false, _) => config.init(&device),
        (true, 3) => construct_sharded_from(config.init(&device), &SHARED, rank, world),
        (true, _) => construct_full_from(config.init(&device), &SHARED),
    }
    .with_chunked_loss(loss_chunk)
    .with_activation_checkpointing(ds.activation_checkpointing.is_some());
    let params = config.num_params();
    let mut engine = initialize::<Cuda, _>(model, &ds, std::sync::Arc::new(nccl))
        .unwrap_or_else(|e| panic!("{e}"));
    let report = engine.memory_report();
    let mut pools = vec![pool_usage(&device, "initialize", rank)];
    let shape = (micro, seq, config.vocab_size);
    let (mut times, mut forward, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    let mut norms = Vec::new();
    let first = match &resume {
        Some(dir) => {
            let loaded = engine
                .load_checkpoint(dir, None)
                .unwrap_or_else(|e| panic!("{e}"));
            let next = loaded.client_state["next_step"].as_u64();
            next.expect("the checkpoint's client state names its next step") as usize
        }
        None => 0,
    };
    let mut host_calls: Vec<[f64; 3]> = Vec::new();
    engine.take_timings();
    engine.take_offload_timings();
    let mut host_profile = HostProfileRun::from_env(rank);
    // When training starts: the runner takes the peak GPU memory of the steps from here on.
    let train_start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for step in first..steps {
        let shape = match seq_switch {
            Some((at, seq)) if step >= at => (shape.0, seq, shape.2),
            _ => shape,
        };
        let batches: Vec<_> = (0..gas)
            .map(|m| tokens(step * gas + m, rank, shape, &device))
            .collect();
        <Cuda as Backend>::sync(&device).expect("sync");
        let start = Instant::now();
        let (loss, forward_call, forward_s, backward_call) = match graphs {
            // One call per micro-step, no sync inside: forward and backward are timed as one.
            Some(_) => {
                let mut loss = None;
                for batch in batches {
                    let l = engine
                        .forward_backward(vec![batch], |model, mut inputs| {
                            model.loss(inputs.remove(0))
                        })
                        .unwrap_or_else(|e| panic!("forward_backward: {e}"));
                    loss = Some(l);
                    if gas > 1 && !engine.is_gradient_accumulation_boundary() {
                        engine.step().expect("micro-step");
                    }
                }
                let call = start.elapsed().as_secs_f64();
                (loss.expect("a micro-step"), call, call, 0.0)
            }
            None => {
                let mut loss = None;
                let (mut forward_call, mut forward_s, mut backward_call) = (0.0, 0.0, 0.0);
                for batch in batches {
                    let at = Instant::now();
                    let l = engine.model().loss(batch);
                    // When each call returns, before any sync: how long the host takes to issue
                    // the work. Near the synced time, the host is what the GPU waits for.
                    forward_call += at.elapsed().as_secs_f64();
                    <Cuda as Backend>::sync(&device).expect("sync");
                    forward_s += at.elapsed().as_secs_f64();
                    if step == 0 && loss.is_none() {
                        pools.push(pool_usage(&device, "the first forward", rank));
                    }
                    let issued = Instant::now();
                    engine.backward(l.clone()).expect("backward");
                    backward_call += issued.elapsed().as_secs_f64();
                    loss = Some(l);
                    if gas > 1 && !engine.is_gradient_accumulation_boundary() {
                        engine.step().expect("micro-step");
                    }
                }
                (
                    loss.expect("a micro-step"),
                    forward_call,
                    forward_s,
                    backward_call,
                )
            }
        };
        if step == 0 {
            pools.push(pool_usage(&device, "the first backward", rank));
        }
        let issued = Instant::now();
        engine.step().expect("step");
        let step_call = issued.elapsed().as_secs_f64();
        <Cuda as Backend>::sync(&device).expect("sync");
        let secs = start.elapsed().as_secs_f64();
        if step == 0 {
            pools.push(pool_usage(&device, "the first step", rank));
        }
        let l = loss.cast(burn::tensor::FloatDType::F32).into_scalar();
        if rank == 0 {
            eprintln!("step {step}: loss {l:.4}, {secs:.3} s (forward {forward_s:.3} s)");
        }
        losses.push(l);
        norms.push(engine.last_grad_norm());
        if let Some((dir, _)) = save.as_ref().filter(|(_, at)| *at == step + 1) {
            let state = serde_json::json!({ "next_step": step + 1 });
            engine
                .save_checkpoint(dir, None, state)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        if step >= warmup {
            times.push(secs);
            forward.push(forward_s);
            host_calls.push([forward_call, backward_call, step_call]);
        }
        if step + 1 == warmup {
            engine.take_graph_timings();
            engine.take_timings();
            engine.take_offload_timings();
            let _ = take_matmul_profile(env.local_rank);
            host_profile.start();
        }
    }
    host_profile.finish();
    let timings = engine.take_timings();
    // Host time of the graphs' replays per timed step, in ms.
    let graph_ms = engine.take_graph_timings().map(|g| {
        let per = |d: std::time::Duration| d.as_secs_f64() * 1e3 / times.len().max(1) as f64;
        serde_json::json!({"replays": g.replays, "prepare_ms": per(g.prepare),
            "launch_ms": per(g.launch), "graph_launch_ms": per(g.graph_launch),
            "pin_ms": per(g.pin)})
    });
    let offload = engine
        .take_offload_timings()
        .map(|t| burn_zero_examples::offload_breakdown(&t, times.len()));
    // cuBLASLt per timed step: calls, host µs per phase, GEMM GPU ms (the last only with
    // `burn_zero.matmul.profile`, or BURN_ZERO_MATMUL_PROFILE=1 read by `initialize`).
    let products = take_matmul_profile(env.local_rank);
    pools.push(pool_usage(&device, "the last step", rank));
    let timed = times.len().max(1) as f64;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let seq = seq_switch.map_or(seq, |(_, seq)| seq);
    let tokens_per_gpu = (gas * micro * seq) as f64 / median;
    let per_token = flops_per_token(params, &config, seq);
    if rank == 0 {
        println!(
            "{}",
            serde_json::json!({"system": "burn-zero", "size": size, "params": params,
                "stage": stage, "world": world, "bf16": bf16, "micro_batch": micro, "seq": seq,
                "init": if shared_init { "shared" } else { "burn" },
                "loss_chunk_tokens": loss_chunk, "activation_checkpointing": checkpointing,
                "reduce_bucket_size": bucket, "prefetch_bucket_size": prefetch,
                "release_cached_memory": release_cached,
                "memory_pool": format!("{pool:?}").to_lowercase(),
                "global_batch_tokens": micro * seq * world, "steps": steps, "warmup_steps": warmup,
                "grad_accum_dtype": if data_types.is_empty() { "fp32" } else { "bf16" },
                "median_step_s": median, "step_times_s": times,
                "tokens_per_s_per_gpu": tokens_per_gpu,
                "flops_per_token": per_token, "peak_flops": peak_flops(),
                "mfu": tokens_per_gpu * per_token / peak_flops(),
                "breakdown_s": {"forward": forward.iter().sum::<f64>() / timed,
                    "backward": timings.backward.as_secs_f64() / timed,
                    "step": timings.step.as_secs_f64() / timed},
                "host_call_s": {"forward": mean_of(&host_calls, 0),
                    "backward": mean_of(&host_calls, 1), "step": mean_of(&host_calls, 2)},
                "cublaslt_per_step": {"calls": products.calls as f64 / timed,
                    "host_ms": products.host_us.iter().sum::<f64>() / timed / 1e3,
                    "gemm_gpu_ms": products.gemm_gpu_us / timed / 1e3},
                "offload_breakdown": offload,
                "deterministic": deterministic, "first_step": first,
                "cuda_graphs": graphs, "graph_host_ms_per_step": graph_ms,
                "gradient_accumulation_steps": gas,
                "seq_switch": seq_switch,
                "losses": losses, "grad_norms": norms, "train_start_unix": train_start,
                "memory_report": report.to_string(), "pool_memory": pools})
        );
    }
}

/// `E2E_HOST_PROFILE=FILE` on rank 0: the host profile of the timed steps, written to FILE.
struct HostProfileRun {
    #[cfg(feature = "host-profile")]
    file: Option<String>,
    #[cfg(feature = "host-profile")]
    running: Option<burn_zero_examples::host_profile::HostProfile>,
}

impl HostProfileRun {
    fn from_env(rank: usize) -> Self {
        let file = std::env::var("E2E_HOST_PROFILE").ok().filter(|_| rank == 0);
        if file.is_some() && !cfg!(feature = "host-profile") {
            panic!("E2E_HOST_PROFILE needs bench-e2e built with feature `host-profile`");
        }
        Self {
            #[cfg(feature = "host-profile")]
            file,
            #[cfg(feature = "host-profile")]
            running: None,
        }
    }

    fn start(&mut self) {
        #[cfg(feature = "host-profile")]
        if self.file.is_some() {
            self.running = Some(burn_zero_examples::host_profile::HostProfile::start(1999));
        }
    }

    fn finish(self) {
        #[cfg(feature = "host-profile")]
        if let (Some(file), Some(profile)) = (self.file, self.running) {
            profile
                .write(std::path::Path::new(&file), 40)
                .unwrap_or_else(|e| panic!("cannot write the host profile {file}: {e}"));
            eprintln!("host profile written to {file}");
        }
    }
}

/// The mean of column `i` of `rows` (NaN when empty).
fn mean_of(rows: &[[f64; 3]], i: usize) -> f64 {
    rows.iter().map(|r| r[i]).sum::<f64>() / rows.len() as f64
}
