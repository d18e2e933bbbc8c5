//! One rank's training loop and rank 0's report, generic over the backend under the engine
//! (`NdArray` on CPU thread ranks, `Cuda` in one process per GPU) and over what a rank trains:
//! the whole Llama, or its slice over a model-parallel group (`--model-parallel`).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_pipeline::tensor_parallel::ModelParallelBackend;
use burn_zero::ZeroBackend;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::config::DeepSpeedConfig;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::progress::Progress;
use burn_zero::schedule::ProgressiveLayerDrop;
use burn_zero_llm::data::{DistributedSampler, SamplerState};
use burn_zero_llm::generate::Sampling;
use burn_zero_llm::parallel::ParallelLlama;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::{Llama, LlamaConfig};

use crate::args::Args;

/// What every rank trains with.
pub struct Job<'a> {
    pub args: &'a Args,
    pub config: &'a DeepSpeedConfig,
    pub windows: &'a [Vec<u32>],
    /// This rank's place along the data axis and its size: the sampler's shard.
    pub rank: usize,
    pub world: usize,
    /// Rank 0 of the whole run: it prints, writes the metrics and reports.
    pub lead: bool,
    /// With `--model-parallel`: this rank's directory under each checkpoint root
    /// (`mp_rank_XX`, DeepSpeed's name), since every model-parallel rank saves its own slice.
    pub model_dir: Option<String>,
}

/// The engine's communicator (the data axis) and the whole run's (for the logged loss).
pub struct Comms {
    pub data: Arc<dyn Communicator>,
    pub world: Arc<dyn Communicator>,
}

/// What one rank trains: the Llama, or its slice over a model-parallel group.
pub trait Trainable<B: Backend> {
    /// The mean next-token loss of `tokens`, with only the layers `keep` marks (all: `None`).
    fn loss_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 1>;
    /// Decoder layers.
    fn num_layers(&self) -> usize;
}

impl<B: Backend> Trainable<B> for Llama<B> {
    fn loss_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 1> {
        Llama::loss_kept(self, tokens, keep)
    }

    fn num_layers(&self) -> usize {
        Llama::num_layers(self)
    }
}

impl<B: ModelParallelBackend> Trainable<B> for ParallelLlama<B> {
    fn loss_kept(&self, tokens: Tensor<B, 2, Int>, keep: Option<&[bool]>) -> Tensor<B, 1> {
        assert!(
            keep.is_none(),
            "layer dropping is refused with --model-parallel"
        );
        self.loss(tokens)
    }

    fn num_layers(&self) -> usize {
        ParallelLlama::num_layers(self)
    }
}

/// Rank 0's result: the trained model (without autodiff) and its speed.
pub struct Trained<I: Backend> {
    pub model: Llama<ZeroBackend<I>>,
    /// Tokens (all ranks) per second over the whole run.
    pub tokens_per_sec: f64,
    /// Over the second half of the steps: after compilation and autotuning.
    pub steady_tokens_per_sec: f64,
    pub final_loss: f32,
}

/// Trains `model` for `--steps` optimizer steps on this rank's share of the windows; rank 0
/// prints progress, writes `metrics.jsonl` and returns the whole model, which `whole` makes of
/// what this rank trained (every rank calls it: putting slices together is a collective).
pub fn train<I: Backend, M>(
    model: M,
    comms: Comms,
    job: &Job,
    device: &I::Device,
    whole: impl FnOnce(M::InnerModule) -> Result<Llama<ZeroBackend<I>>, String>,
) -> Result<Option<Trained<I>>, String>
where
    M: AutodiffModule<ZeroAutodiff<I>> + Trainable<ZeroAutodiff<I>>,
{
    let args = job.args;
    let comm = comms.world;
    let mut engine =
        initialize::<I, _>(model, job.config, comms.data).map_err(|e| e.to_string())?;
    let batch = engine.config().batch;
    // The whole resolved config beside the metrics (the start of the run printed a summary).
    if job.rank == 0 {
        let path = args.out.join("resolved_config.json");
        let json = serde_json::to_string_pretty(engine.config()).map_err(|e| e.to_string())?;
        std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let sampler = DistributedSampler {
        len: job.windows.len(),
        world: job.world,
        rank: job.rank,
        micro_batch: batch.micro_batch_per_gpu,
        seed: args.seed,
    };
    let mut state = SamplerState::default();
    let in_model_dir = |root: &Path| match &job.model_dir {
        Some(dir) => root.join(dir),
        None => root.to_path_buf(),
    };
    if let Some(root) = &args.resume {
        let root = &in_model_dir(root);
        // The latest checkpoint under a root, or one checkpoint's own directory.
        let (root, tag) = match (
            root.join(burn_zero::checkpoint::MANIFEST).exists(),
            root.parent(),
        ) {
            (true, Some(parent)) => (parent, root.file_name().and_then(|t| t.to_str())),
            _ => (root.as_path(), None),
        };
        let loaded = engine.load_checkpoint(root, tag).map_err(|e| e.to_string());
        if job.model_dir.is_some() {
            // Each model-parallel slice resumes from its own checkpoint: every rank must have
            // loaded the same step, or the model would be put together from different steps.
            let step = loaded.as_ref().ok().map(|_| engine.global_step());
            same_step_everywhere(comm.as_ref(), step)?;
        }
        let loaded = loaded?;
        let client = &loaded.client_state;
        state = serde_json::from_value(client["sampler"].clone())
            .map_err(|e| format!("{}: no sampler state: {e}", loaded.dir.display()))?;
        if client["seed"] != serde_json::json!(args.seed) || client["seq"] != args.seq {
            return Err(format!(
                "{} was trained with --seed {} --seq {}: resume with the same",
                loaded.dir.display(),
                client["seed"],
                client["seq"]
            ));
        }
        if job.lead {
            println!(
                "resumed from {} at step {} (epoch {}, {} samples in)",
                loaded.dir.display(),
                engine.global_step(),
                state.epoch,
                state.consumed
            );
        }
    }
    let first = engine.global_step() + 1;
    if first > args.steps {
        return Err(format!(
            "the checkpoint is at step {}: --steps {} leaves nothing to train",
            first - 1,
            args.steps
        ));
    }
    let metrics_path = args.out.join("metrics.jsonl");
    if args.resume.is_some() && job.lead && metrics_path.exists() {
        let dropped = keep_metrics_before(&metrics_path, first)?;
        if dropped > 0 {
            println!(
                "{}: dropped {dropped} record(s) from after the checkpoint (step {} on)",
                metrics_path.display(),
                first
            );
        }
    }
    let mut metrics = job
        .lead
        .then(|| {
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(args.resume.is_some())
                .truncate(args.resume.is_none())
                .open(&metrics_path)
        })
        .transpose()
        .map_err(|e| format!("{}: {e}", metrics_path.display()))?;
    // A terminal gets one line redrawn; a log (the launcher's pipes) about 50 lines.
    let mut bar = job.lead.then(|| {
        Progress::stdout("train", args.steps as u64)
            .max_lines(50)
            .starting_at(first as u64 - 1)
    });
    let tokens_per_step = batch.train_batch_size * args.seq;
    let t0 = Instant::now();
    let steps = args.steps + 1 - first;
    let half = first - 1 + steps / 2;
    let mut half_time = 0.0;
    let mut last_loss = f32::NAN;
    let checkpoints = in_model_dir(&args.out.join("engine"));
    // Checkpoint writing is not training: kept out of tokens/s.
    let mut save_secs = 0.0;
    // Progressive layer dropping: the layers each step keeps, the same on every rank.
    let pld = ProgressiveLayerDrop::from_config(&job.config.progressive_layer_drop);
    let layers = engine.model().num_layers();
    for step in first..=args.steps {
        let lr = engine.lr();
        let keep = pld.map(|p| p.keep_mask(layers, step as u64, args.seed));
        let mut step_loss = 0.0;
        for _ in 0..batch.gradient_accumulation_steps {
            let (ids, next) = sampler.next(state);
            state = next;
            let flat: Vec<i64> = ids
                .iter()
                .flat_map(|i| job.windows[*i].iter().map(|t| *t as i64))
                .collect();
            let tokens = Tensor::<ZeroAutodiff<I>, 2, Int>::from_data(
                TensorData::new(flat, [ids.len(), args.seq + 1]),
                device,
            );
            let loss = engine.model().loss_kept(tokens, keep.as_deref());
            step_loss +=
                loss.clone().into_scalar().elem::<f64>() / batch.gradient_accumulation_steps as f64;
            engine.backward(loss).map_err(|e| e.to_string())?;
            engine.step().map_err(|e| e.to_string())?;
        }
        let mut global = [step_loss as f32];
        comm.all_reduce(global.as_mut_slice().into(), ReduceOp::Avg)
            .map_err(|e| e.to_string())?;
        last_loss = global[0];
        let secs = t0.elapsed().as_secs_f64() - save_secs;
        if step == half {
            half_time = secs;
        }
        if step == args.steps || args.save_every.is_some_and(|n| step % n == 0) {
            let client = serde_json::json!({"sampler": state, "seed": args.seed, "seq": args.seq});
            let s0 = Instant::now();
            // The engine says where it saved: on a line of its own.
            if let Some(bar) = bar.as_mut() {
                bar.clear().map_err(|e| e.to_string())?;
            }
            let saved = engine.save_checkpoint(&checkpoints, None, client);
            saved.map_err(|e| format!("step {step}: {e}"))?;
            save_secs += s0.elapsed().as_secs_f64();
        }
        let Some(file) = metrics.as_mut() else {
            continue;
        };
        let done = step + 1 - first;
        let tps = (done * tokens_per_step) as f64 / secs;
        if let Some(bar) = bar.as_mut() {
            let fields = format!("loss {:.4}  lr {lr:.2e}  {tps:.0} tokens/s", global[0]);
            bar.update(step as u64, secs, &fields)
                .map_err(|e| e.to_string())?;
        }
        // 1-bit Adam after `freeze_step`: what this rank's compressed exchange sent, beside
        // an fp32 all-reduce of the same vector.
        let exchange = engine.compressed_volume().map(|v| {
            serde_json::json!({"compressed_bytes": v.compressed,
                "fp32_allreduce_bytes": v.fp32_allreduce})
        });
        let record = serde_json::json!({"step": step, "loss": global[0], "lr": lr,
            "tokens": step * tokens_per_step, "seconds": secs,
            "grad_norm": engine.last_grad_norm(), "epoch": state.epoch,
            "onebit_exchange": exchange});
        writeln!(file, "{record}").map_err(|e| e.to_string())?;
    }
    let total = t0.elapsed().as_secs_f64() - save_secs;
    if let Some(bar) = bar.as_mut() {
        let tps = (steps * tokens_per_step) as f64 / total;
        let summary = format!("final loss {last_loss:.4}, {tps:.0} tokens/s");
        bar.finish(total, &summary).map_err(|e| e.to_string())?;
    }
    // Every rank takes part: under ZeRO-3 the full model is gathered, and model-parallel
    // slices are put together.
    let model = whole(engine.into_model().map_err(|e| e.to_string())?.valid())?;
    if !job.lead {
        return Ok(None);
    }
    let steady = (args.steps - half) * tokens_per_step;
    Ok(Some(Trained {
        model,
        tokens_per_sec: (steps * tokens_per_step) as f64 / total,
        steady_tokens_per_sec: steady as f64 / (total - half_time).max(1e-9),
        final_loss: last_loss,
    }))
}

/// Held-out NLL, window by window under a progress bar; the summary line gives the mean.
pub fn evaluate<B: Backend>(
    model: &Llama<B>,
    eval: &[Vec<u32>],
    when: &str,
    device: &B::Device,
) -> f64 {
    let t0 = Instant::now();
    let mut bar = Progress::stdout(format!("eval {when}"), eval.len() as u64);
    let mut total = 0.0;
    for (i, window) in eval.iter().enumerate() {
        // Windows of one length: the mean of the windows' means is the mean over tokens.
        total += model.mean_nll(std::slice::from_ref(window), device);
        let fields = format!("NLL {:.3}", total / (i + 1) as f64);
        let _ = bar.update(i as u64 + 1, t0.elapsed().as_secs_f64(), &fields);
    }
    let nll = total / eval.len() as f64;
    let summary = format!(
        "held-out NLL {when} {nll:.3} nats/token (perplexity {:.1})",
        nll.exp()
    );
    let _ = bar.finish(t0.elapsed().as_secs_f64(), &summary);
    nll
}

/// The recipe's question to the model (a chat turn), answered before and after training.
const PROMPT: &str = "<|im_start|>user\nWho is Mr. Darcy?<|im_end|>\n<|im_start|>assistant\n";

/// The held-out NLL and the greedy answer to [`PROMPT`] before training: what the report
/// compares the trained model against.
pub struct Before {
    pub nll: f64,
    pub greedy: String,
}

/// [`Before`], measured on `model` (rank 0, before training).
pub fn before<B: Backend>(
    model: &Llama<B>,
    tok: &TextTokenizer,
    eval: &[Vec<u32>],
    args: &Args,
    device: &B::Device,
) -> Result<Before, String> {
    let nll = evaluate(model, eval, "before", device);
    let greedy = sample(model, tok, args, Sampling::Greedy, device)?;
    println!("greedy sample before: {greedy:?}");
    Ok(Before { nll, greedy })
}

/// `model`'s answer to [`PROMPT`], at most `args.sample_tokens` tokens.
fn sample<B: Backend>(
    model: &Llama<B>,
    tok: &TextTokenizer,
    args: &Args,
    sampling: Sampling,
    device: &B::Device,
) -> Result<String, String> {
    let prompt_ids = tok.encode(PROMPT).map_err(|e| e.to_string())?;
    let stop = tok.token_id("<|im_end|>");
    let sample = model.generate(&prompt_ids, args.sample_tokens, stop, sampling, device);
    tok.decode(&sample).map_err(|e| e.to_string())
}

/// Rank 0 after training: held-out NLL, samples, checkpoint, summary and loss curve; an error
/// when the held-out NLL did not go down.
pub fn report<I: Backend>(
    trained: Trained<I>,
    before: Before,
    args: &Args,
    config: &LlamaConfig,
    tok: &TextTokenizer,
    eval: &[Vec<u32>],
    world: usize,
    start: Instant,
    device: &I::Device,
) -> Result<(), String> {
    let model = &trained.model;
    let after = evaluate(model, eval, "after", device);
    let top_p = Sampling::TopP {
        p: 0.9,
        seed: args.seed,
    };
    let mut samples = serde_json::Map::new();
    for (label, sampling) in [("greedy", Sampling::Greedy), ("top-p 0.9", top_p)] {
        let text = sample(model, tok, args, sampling, device)?;
        println!("{label} sample: {text:?}");
        samples.insert(label.into(), text.into());
    }
    let checkpoint = args.out.join("checkpoint");
    save_hf(model, config, tok, &checkpoint)?;
    // The held-out windows, for an independent evaluation of the checkpoint.
    let windows_path = args.out.join("eval_windows.json");
    std::fs::write(
        &windows_path,
        serde_json::json!({"windows": eval}).to_string(),
    )
    .map_err(|e| format!("{}: {e}", windows_path.display()))?;
    let png = args.out.join("loss.png");
    draw_curve(&args.out.join("metrics.jsonl"), &png)?;
    let Before {
        nll: before,
        greedy: greedy_before,
    } = before;
    let summary = serde_json::json!({"nll_before": before, "nll_after": after,
        "perplexity_before": before.exp(), "perplexity_after": after.exp(),
        "eval_windows": eval.len(), "eval_len": args.eval_len,
        "layers": config.num_layers, "params": config.num_params(), "steps": args.steps,
        "world": world, "device": format!("{:?}", args.device), "seq": args.seq,
        "final_train_loss": trained.final_loss,
        "tokens_per_sec": trained.tokens_per_sec,
        "steady_tokens_per_sec": trained.steady_tokens_per_sec,
        "samples": samples, "samples_before": {"greedy": greedy_before},
        "seconds": start.elapsed().as_secs_f64(),
        "lora": args.lora.as_ref().map(|l| serde_json::json!({"rank": l.rank, "alpha": l.alpha,
            "targets": l.targets}))});
    let summary_path = args.out.join("summary.json");
    std::fs::write(&summary_path, summary.to_string())
        .map_err(|e| format!("{}: {e}", summary_path.display()))?;
    println!(
        "done in {:.0}s ({:.0} tokens/s, {:.0} after warm-up); metrics, summary and loss curve in {}",
        start.elapsed().as_secs_f64(),
        trained.tokens_per_sec,
        trained.steady_tokens_per_sec,
        args.out.display()
    );
    // NaN counts as no improvement.
    if after.partial_cmp(&before) != Some(std::cmp::Ordering::Less) {
        return Err(format!(
            "held-out NLL did not improve: {before:.3} -> {after:.3}"
        ));
    }
    Ok(())
}

/// Writes `model` as a Hugging Face directory (with the tokenizer) under a progress line.
pub fn save_hf<B: Backend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    tok: &TextTokenizer,
    dir: &Path,
) -> Result<(), String> {
    let t0 = Instant::now();
    let mut bar = Progress::stdout("save checkpoint", 1);
    bar.start().map_err(|e| e.to_string())?;
    model.save_hf(config, dir).map_err(|e| e.to_string())?;
    tok.save(&dir.join("tokenizer.json"))
        .map_err(|e| e.to_string())?;
    let summary = format!(
        "{} (a Hugging Face directory; --hf loads it)",
        dir.display()
    );
    bar.finish(t0.elapsed().as_secs_f64(), &summary)
        .map_err(|e| e.to_string())
}

/// Refuses a resume whose ranks loaded different steps (a model-parallel job whose slices
/// committed their checkpoints apart, e.g. killed between two slices' saves). `step` is what
/// this rank loaded (`None`: its load failed, which it reports itself); every rank calls this
/// and gets the same answer, so none is left waiting in a later collective.
fn same_step_everywhere(comm: &dyn Communicator, step: Option<usize>) -> Result<(), String> {
    // f32 holds step numbers exactly up to 2^24; -1 marks a failed load.
    let mine = [step.map_or(-1.0, |s| s as f32)];
    let mut all = vec![0.0f32; comm.world_size()];
    comm.all_gather(mine.as_slice().into(), all.as_mut_slice().into())
        .map_err(|e| format!("comparing the resumed steps across ranks: {e}"))?;
    let failed: Vec<usize> = (0..all.len()).filter(|r| all[*r] < 0.0).collect();
    if !failed.is_empty() {
        return match step {
            Some(_) => Err(format!("ranks {failed:?} could not load their checkpoints")),
            // This rank's own error says why; the caller returns it.
            None => Ok(()),
        };
    }
    if all.iter().any(|s| *s != all[0]) {
        let steps: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, s)| format!("rank {r} at step {s}"))
            .collect();
        return Err(format!(
            "the model-parallel slices' checkpoints are from different steps ({}): point each \
             slice's `latest` (OUT/engine/mp_rank_XX/latest) at a tag every slice has saved",
            steps.join(", ")
        ));
    }
    Ok(())
}

/// Keeps the records of `metrics` (JSONL) from before step `first`, the first one a resumed
/// run trains: those after the checkpoint would be logged twice, and a line a crash cut short
/// would run into the next one. Rewritten through a temporary file and a rename. Returns how
/// many lines were dropped.
fn keep_metrics_before(metrics: &Path, first: usize) -> Result<usize, String> {
    let fail = |e: std::io::Error| format!("{}: {e}", metrics.display());
    let text = std::fs::read_to_string(metrics).map_err(fail)?;
    let before = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["step"].as_u64())
            .is_some_and(|step| step < first as u64)
    };
    let (mut kept, mut dropped) = (String::new(), 0);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if before(line) {
            kept.push_str(line);
            kept.push('\n');
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        burn_zero::checkpoint::replace_file(metrics, kept.as_bytes()).map_err(fail)?;
    }
    Ok(dropped)
}

/// Draws `metrics` (JSONL with `step` and `loss`) to `png`.
pub fn draw_curve(metrics: &Path, png: &Path) -> Result<(), String> {
    let text =
        std::fs::read_to_string(metrics).map_err(|e| format!("{}: {e}", metrics.display()))?;
    let mut points = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("{} line {}: {e}", metrics.display(), i + 1))?;
        match (v["step"].as_f64(), v["loss"].as_f64()) {
            (Some(s), Some(l)) => points.push((s, l)),
            _ => {
                return Err(format!(
                    "{} line {}: no numeric `step` and `loss`",
                    metrics.display(),
                    i + 1
                ));
            }
        }
    }
    burn_zero_examples::plot::loss_curve(&points, png)?;
    println!("loss curve: {}", png.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each of three thread ranks gets from `same_step_everywhere` for these loads.
    fn agree(steps: [Option<usize>; 3]) -> Vec<Result<(), String>> {
        burn_zero::testing::run_ranks(3, |ctx| same_step_everywhere(&ctx.comm, steps[ctx.rank]))
    }

    #[test]
    fn model_parallel_slices_resumed_at_different_steps_are_refused_on_every_rank() {
        assert!(agree([Some(4); 3]).iter().all(Result::is_ok));
        // Slice 2 committed step 4 after the others' step 5 (killed between the saves).
        for (rank, result) in agree([Some(5), Some(5), Some(4)]).into_iter().enumerate() {
            let err = result.expect_err("refused");
            assert!(
                err.contains(
                    "different steps (rank 0 at step 5, rank 1 at step 5, rank 2 at step 4)"
                ),
                "rank {rank}: {err}"
            );
        }
        // A rank whose load failed reports its own error; the others name it.
        let results = agree([Some(4), None, Some(4)]);
        assert!(results[1].is_ok(), "{:?}", results[1]);
        for rank in [0, 2] {
            let err = results[rank].as_ref().expect_err("refused");
            assert!(
                err.contains("ranks [1] could not load"),
                "rank {rank}: {err}"
            );
        }
    }

    #[test]
    fn a_resume_keeps_only_the_records_before_its_first_step() {
        let path = std::env::temp_dir().join(format!("bz-metrics-{}.jsonl", std::process::id()));
        let lines = [
            r#"{"step":1,"loss":3.0}"#,
            r#"{"step":2,"loss":2.5}"#,
            r#"{"step":3,"loss":2.0}"#,
            r#"{"step":4,"lo"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        // Resumed from the checkpoint of step 2: steps 3 on are trained again.
        assert_eq!(keep_metrics_before(&path, 3).unwrap(), 2);
        let kept = std::fs::read_to_string(&path).unwrap();
        assert_eq!(kept, format!("{}\n{}\n", lines[0], lines[1]));
        // Nothing after the checkpoint: the file is left as it is.
        assert_eq!(keep_metrics_before(&path, 3).unwrap(), 0);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), kept);
        std::fs::remove_file(&path).unwrap();
    }
}
