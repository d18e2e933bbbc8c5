//! `--pipeline P`: the recipe's Llama split into P stages by burn-pipeline's `split` (decoder
//! layers balanced by their matrix products, the output projection counted on the last), one
//! stage per rank, data parallel over the rest of the ranks (pipe × data, as DeepSpeed lays them
//! out), trained by burn-pipeline's executor under `--schedule` with the config's optimizer and
//! learning-rate schedule: ZeRO-1 over the data axis at `zero_optimization.stage` 0 or 1, ZeRO-2
//! at stage 2. Activations and gradients take NCCL's links between GPUs, the host between CPU
//! thread ranks. At the end every stage comes back to rank 0 as one Llama for the report.

use std::io::Write;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_pipeline::{
    Schedule, SplitMethod, StageOptimizer, StageSpec, Topology, Zero1, Zero2, flatten_params,
    pipeline_links, run_chunks, split, unflatten_params,
};
use burn_zero::ZeroBackend;
use burn_zero::backend::settings::{self, OpSettings};
use burn_zero::comm::{CommError, Communicator, ReduceOp};
use burn_zero::config::{DeepSpeedConfig, ZeroStage};
use burn_zero::engine::ZeroAutodiff;
use burn_zero::progress::Progress;
use burn_zero::schedule::Scheduler;
use burn_zero_llm::data::{DistributedSampler, SamplerState};
use burn_zero_llm::model::cross_entropy;
use burn_zero_llm::pipeline::{LlamaStage, ids_as_input, layer_weights};
use burn_zero_llm::{Llama, LlamaConfig};

use crate::args::Args;
use crate::train::{Job, Trained};

type Stage<I> = LlamaStage<ZeroAutodiff<I>>;

/// Why this run cannot train as a pipeline of `args.pipeline` stages over `world` ranks, if it
/// cannot; else the data-parallel size.
pub fn check(args: &Args, config: &DeepSpeedConfig, world: usize) -> Result<usize, String> {
    let p = args.pipeline;
    let refuse = |why: &str| Err(format!("--pipeline {p}: {why}"));
    if p == 0 || !world.is_multiple_of(p) {
        return refuse(&format!("does not divide the {world} ranks of this run"));
    }
    if args.model_parallel > 1 {
        return refuse("cannot be combined with --model-parallel yet");
    }
    if args.resume.is_some() || args.save_every.is_some() {
        return refuse(
            "engine checkpoints (--resume, --save-every) are not written by pipelines yet",
        );
    }
    if config.bf16.enabled || config.fp16.enabled {
        return refuse(
            "pipeline stages train in fp32: set `bf16.enabled` and `fp16.enabled` to false \
             (examples/configs/finetune-gpu-pipeline.json)",
        );
    }
    if config.gradient_clipping > 0.0 {
        return refuse("pipeline stages do not clip gradients yet: set `gradient_clipping` to 0");
    }
    if config.progressive_layer_drop.enabled {
        return refuse("progressive_layer_drop is not applied to pipeline stages");
    }
    if config.zero_optimization.stage == ZeroStage::Parameters {
        return refuse(
            "ZeRO-3 inside a pipeline is not supported (DeepSpeed refuses it too): \
             use `zero_optimization.stage` 0, 1 or 2",
        );
    }
    Ok(world / p)
}

/// A stage's optimizer from the config: ZeRO-1 over the data axis (stages 0 and 1: every
/// rank of a one-rank data axis holds the whole state), or ZeRO-2.
fn stage_optimizer<I: Backend>(
    config: &burn_zero::config::ResolvedConfig,
) -> Box<dyn StageOptimizer<ZeroAutodiff<I>, Stage<I>>> {
    let (kind, params) = (config.optimizer, config.optimizer_params.clone());
    match config.config.zero_optimization.stage {
        ZeroStage::Gradients => Box::new(Zero2::new(kind, params)),
        _ => Box::new(Zero1::new(kind, params)),
    }
}

/// Trains this rank's stage of `model` for `--steps` steps; rank 0 prints progress, writes
/// `metrics.jsonl` and returns the whole trained model.
pub fn train_pipeline<I: Backend>(
    model: Llama<ZeroAutodiff<I>>,
    world: Arc<dyn Communicator>,
    job: &Job,
    llama: &LlamaConfig,
    device: &I::Device,
) -> Result<Option<Trained<I>>, String> {
    let (args, err) = (job.args, |e: CommError| e.to_string());
    let pipe_size = args.pipeline;
    let copies = world.world_size() / pipe_size;
    let resolved = job.config.resolve(copies).map_err(|e| e.to_string())?;
    // The config's `burn_zero` op settings (matmul, fused kernels) on this thread, as the
    // engine's `initialize` sets them.
    let _settings = settings::set(OpSettings::of(&resolved));
    let topo = Topology::pipe_data_model(pipe_size, copies, 1);
    let mut pipe = topo.axis_comm(world.clone(), "pipe")?;
    let data: Arc<dyn Communicator> = Arc::from(topo.axis_comm(world.clone(), "data")?);
    // Links where the communicator has them (NCCL); thread ranks send through the host.
    if pipe.device().is_some() {
        pipe.open_links(&pipeline_links(pipe_size))?;
    }
    let (rank, shard) = (pipe.rank(), data.rank());
    let schedule: Schedule = args.schedule.parse()?;
    let batch = resolved.batch;
    let micro = batch.gradient_accumulation_steps;
    schedule.check(pipe_size, micro)?;
    let chunks = schedule.chunks();
    let stages = pipe_size * chunks;
    let mine: Vec<usize> = (0..chunks).map(|c| c * pipe_size + rank).collect();
    let ranges = split(
        &layer_weights(llama, job.config.activation_checkpointing.is_some()),
        stages,
        SplitMethod::Balanced,
    );
    let mut parts = mine
        .iter()
        .map(|&s| LlamaStage::new(&model, &ranges, s, args.seq))
        .collect::<Result<Vec<Stage<I>>, String>>()?;
    let mut optims: Vec<_> = mine
        .iter()
        .map(|_| stage_optimizer::<I>(&resolved))
        .collect();
    let mut scheduler = Scheduler::new(resolved.schedule.clone());
    if job.lead {
        println!(
            "pipeline: {pipe_size} stages × {copies} data copies, {schedule:?}, {micro} \
             micro-batches of {} per step; layers per stage {:?}",
            batch.micro_batch_per_gpu,
            ranges.iter().map(|r| r.len()).collect::<Vec<_>>()
        );
    }
    let sampler = DistributedSampler {
        len: job.windows.len(),
        world: copies,
        rank: shard,
        micro_batch: batch.micro_batch_per_gpu,
        seed: args.seed,
    };
    let mut state = SamplerState::default();
    let metrics_path = args.out.join("metrics.jsonl");
    let mut metrics = job
        .lead
        .then(|| std::fs::File::create(&metrics_path))
        .transpose()
        .map_err(|e| format!("{}: {e}", metrics_path.display()))?;
    let mut bar = job
        .lead
        .then(|| Progress::stdout("train", args.steps as u64).max_lines(50));
    let tokens_per_step = batch.train_batch_size * args.seq;
    let stream = schedule.stream(pipe_size, micro, rank);
    let (t0, half) = (Instant::now(), args.steps / 2);
    let (mut half_time, mut last_loss) = (0.0, f32::NAN);
    let data_axis = (copies > 1).then_some(data.as_ref());
    for step in 1..=args.steps {
        // Every rank of a copy draws the same micro-batches: the first stage embeds them, the
        // last scores its logits against them.
        let mut windows = Vec::with_capacity(micro);
        for _ in 0..micro {
            let (ids, next) = sampler.next(state);
            state = next;
            windows.push(ids);
        }
        let tokens: Vec<Tensor<ZeroAutodiff<I>, 2, Int>> = windows
            .iter()
            .map(|ids| {
                let flat: Vec<i64> = ids
                    .iter()
                    .flat_map(|i| job.windows[*i].iter().map(|t| *t as i64))
                    .collect();
                Tensor::from_data(TensorData::new(flat, [ids.len(), args.seq + 1]), device)
            })
            .collect();
        let rows = batch.micro_batch_per_gpu;
        let (seq, vocab) = (args.seq, llama.vocab_size);
        let inputs = |mb: usize| ids_as_input(tokens[mb].clone().slice([0..rows, 0..seq]));
        let loss = |mb: usize, logits: Tensor<ZeroAutodiff<I>, 2>| {
            let targets = tokens[mb].clone().slice([0..rows, 1..seq + 1]);
            cross_entropy(logits.reshape([rows, seq, vocab]), targets)
        };
        let specs: Vec<StageSpec<'_, ZeroAutodiff<I>>> = mine
            .iter()
            .map(|&stage| StageSpec {
                stage,
                stages,
                micro_batches: micro,
                rows: if stage == 0 { rows } else { rows * seq },
                in_features: if stage == 0 { seq } else { llama.hidden_size },
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            })
            .collect();
        let lr = scheduler.lr();
        let (next, l) = run_chunks(
            parts,
            &mut optims,
            lr,
            &stream,
            &specs,
            pipe.as_ref(),
            data_axis,
        )
        .map_err(|e| format!("step {step}: {e}"))?;
        parts = next;
        scheduler.step();
        // The step's loss: the last stage's of each copy, averaged over the copies.
        let mut global = [l.unwrap_or(0.0) / copies as f32];
        world
            .all_reduce(global.as_mut_slice().into(), ReduceOp::Sum)
            .map_err(err)?;
        last_loss = global[0];
        let secs = t0.elapsed().as_secs_f64();
        if step == half {
            half_time = secs;
        }
        let Some(file) = metrics.as_mut() else {
            continue;
        };
        let tps = (step * tokens_per_step) as f64 / secs;
        if let Some(bar) = bar.as_mut() {
            let fields = format!("loss {last_loss:.4}  lr {lr:.2e}  {tps:.0} tokens/s");
            bar.update(step as u64, secs, &fields)
                .map_err(|e| e.to_string())?;
        }
        let record = serde_json::json!({"step": step, "loss": last_loss, "lr": lr,
            "tokens": step * tokens_per_step, "seconds": secs, "epoch": state.epoch});
        writeln!(file, "{record}").map_err(|e| e.to_string())?;
    }
    let total = t0.elapsed().as_secs_f64();
    if let Some(bar) = bar.as_mut() {
        let tps = (args.steps * tokens_per_step) as f64 / total;
        let summary = format!("final loss {last_loss:.4}, {tps:.0} tokens/s");
        bar.finish(total, &summary).map_err(|e| e.to_string())?;
    }
    let whole = gather_stages(model.valid(), parts, &ranges, &topo, shard, world.as_ref())?;
    let Some(model) = whole.filter(|_| job.lead) else {
        return Ok(None);
    };
    let steady = (args.steps - half) * tokens_per_step;
    Ok(Some(Trained {
        model,
        tokens_per_sec: (args.steps * tokens_per_step) as f64 / total,
        steady_tokens_per_sec: steady as f64 / (total - half_time).max(1e-9),
        final_loss: last_loss,
    }))
}

/// The trained stages put back into `template` (the model before training) on world rank 0,
/// which returns it: the first data copy's ranks send their stages' parameters there, in the
/// stages' visiting order; rank 0 reads them into stages of the same shape. Every rank calls it.
fn gather_stages<I: Backend>(
    template: Llama<ZeroBackend<I>>,
    parts: Vec<Stage<I>>,
    ranges: &[Range<usize>],
    topo: &Topology,
    shard: usize,
    world: &dyn Communicator,
) -> Result<Option<Llama<ZeroBackend<I>>>, String> {
    let err = |e: CommError| e.to_string();
    let pipe_size = topo.dim("pipe");
    let lead = world.rank() == 0;
    let parts: Vec<LlamaStage<ZeroBackend<I>>> = parts.into_iter().map(|p| p.valid()).collect();
    if shard == 0 && !lead {
        for part in &parts {
            let values = flatten_params(part, 0);
            world.send(values.as_slice().into(), 0).map_err(err)?;
        }
    }
    if !lead {
        return Ok(None);
    }
    let mut model = template;
    // World rank 0 is pipeline rank 0 of the first data copy: its own stages are `parts`, one
    // per chunk; the others come from the first copy's other pipeline ranks.
    let seq = parts.first().map_or(0, |p| p.seq());
    let chunks = parts.len();
    let mut own = parts.into_iter();
    for chunk in 0..chunks {
        for r in 0..pipe_size {
            let stage = chunk * pipe_size + r;
            let part = if r == 0 {
                own.next().expect("one stage per chunk")
            } else {
                let shape = LlamaStage::new(&model, ranges, stage, seq)?;
                let mut values = vec![0.0f32; shape.num_params()];
                let from = topo.rank(&[r, 0, 0]);
                world
                    .recv(values.as_mut_slice().into(), from)
                    .map_err(err)?;
                unflatten_params(shape, &values)
            };
            model = part.put_back(model, ranges, stage)?;
        }
    }
    Ok(Some(model))
}
