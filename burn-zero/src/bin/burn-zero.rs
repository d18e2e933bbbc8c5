//! The `burn-zero` command. Subcommands:
//!   run       start one process per rank (torchrun-style), see `burn_zero::launch`
//!   report    GPUs, driver, NCCL, NVRTC, io_uring, cores, memory (DeepSpeed's ds_report)
//!   estimate  per-GPU and per-CPU model-state memory, as DeepSpeed's estimators print it.
//!   inspect   a checkpoint's manifest, summarized (and its files verified)
//!   consolidate  a checkpoint's full parameters into one safetensors file (zero_to_fp32).
//!   config    a ds_config.json checked and resolved per world size, before any run.

use std::path::PathBuf;
use std::process::ExitCode;

use std::io::IsTerminal;

use burn_zero::checkpoint;
use burn_zero::progress::Progress;

use burn_zero::engine::{estimate_model_states, format_estimates};

const USAGE: &str = "usage:
  burn-zero report
  burn-zero run --nproc-per-node N [--nnodes K --node-rank R] [--master-addr HOST]
                [--master-port PORT] [--grace SECONDS] -- PROGRAM [ARGS...]
  burn-zero run --hostfile FILE [--include H1:0,1@H2 | --exclude H1:1] [--num-nodes N]
                [--nproc-per-node N] [--launcher-cmd CMD] [--master-addr HOST]
                [--master-port PORT] -- PROGRAM [ARGS...]
  burn-zero estimate --params N [--largest-layer N] [--gpus-per-node G] [--nodes K]
                     [--stage 0|1|2|3] [--offload cpu|none] [--buffer-factor F]

  burn-zero config FILE [--world-size N[,N...]]...
  burn-zero inspect CHECKPOINT [--verify]
  burn-zero consolidate CHECKPOINT OUT.safetensors [--dtype fp32|bf16|fp16]

  estimate prints DeepSpeed-style model-state memory per GPU and per CPU for mixed-precision
  training with Adam. N may be written as 1.3e9 or 1300M. Without --offload every option row
  is shown. CHECKPOINT is a checkpoint directory, or the directory holding `latest`. config
  prints every warning and, per world size (default 1), the resolved setup; it exits non-zero
  on the first error, which names the key.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("estimate") => match estimate(&args[1..]) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("burn-zero estimate: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        #[cfg(unix)]
        Some("run") => match burn_zero::launch::LaunchOptions::parse(&args[1..]) {
            Ok(opts) => ExitCode::from(burn_zero::launch::run(&opts).clamp(0, 255) as u8),
            Err(e) => {
                eprintln!("burn-zero run: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        #[cfg(unix)]
        Some("report") => {
            print!("{}", burn_zero::report::report());
            ExitCode::SUCCESS
        }
        Some(cmd @ ("inspect" | "consolidate")) => {
            let run = if cmd == "inspect" {
                inspect(&args[1..])
            } else {
                consolidate(&args[1..])
            };
            match run {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("burn-zero {cmd}: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Some("config") => match config(&args[1..]) {
            Ok(Ok(text)) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Ok(Err(text)) => {
                print!("{text}");
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("burn-zero config: {e}\n\n{USAGE}");
                ExitCode::from(2)
            }
        },
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("burn-zero: unknown command {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// `config FILE [--world-size N[,N...]]...`: the report on FILE (`Err` for a bad command line;
/// `Ok(Err(report))` when the config does not resolve).
fn config(args: &[String]) -> Result<Result<String, String>, String> {
    let mut file = None;
    let mut worlds = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--world-size" => {
                let list = it.next().ok_or("--world-size needs a value")?;
                for n in list.split(',') {
                    match n.trim().parse::<usize>() {
                        Ok(n) if n >= 1 => worlds.push(n),
                        _ => return Err(format!("--world-size {list:?}: not a list of counts")),
                    }
                }
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            path if file.is_none() => file = Some(PathBuf::from(path)),
            extra => return Err(format!("one FILE only, not also {extra:?}")),
        }
    }
    let file = file.ok_or("which FILE?")?;
    if worlds.is_empty() {
        worlds.push(1);
    }
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(burn_zero::config::describe_config(
        &file.display().to_string(),
        &text,
        &worlds,
    ))
}

/// Parses a count such as `125000000`, `1.3e9`, `350M` or `7B`.
fn count(flag: &str, text: &str) -> Result<u64, String> {
    let (number, scale) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 1e3),
        Some('M' | 'm') => (&text[..text.len() - 1], 1e6),
        Some('B' | 'b' | 'G' | 'g') => (&text[..text.len() - 1], 1e9),
        _ => (text, 1.0),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{flag} {text:?} is not a number"))?;
    let value = value * scale;
    if !(value.is_finite() && value >= 1.0) {
        return Err(format!("{flag} {text:?} must be at least 1"));
    }
    Ok(value.round() as u64)
}

fn estimate(args: &[String]) -> Result<String, String> {
    let mut params = None;
    let mut largest_layer = None;
    let (mut gpus, mut nodes, mut stage, mut factor) = (1u64, 1u64, 2u8, 1.5f64);
    let mut offload: Option<String> = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--params" => params = Some(count(flag, value()?)?),
            "--largest-layer" => largest_layer = Some(count(flag, value()?)?),
            "--gpus-per-node" => gpus = count(flag, value()?)?,
            "--nodes" => nodes = count(flag, value()?)?,
            "--stage" => {
                let v = value()?;
                stage = v
                    .parse()
                    .ok()
                    .filter(|s| *s <= 3)
                    .ok_or_else(|| format!("--stage {v:?}: allowed 0, 1, 2 or 3"))?;
            }
            "--offload" => {
                let v = value()?;
                if v != "cpu" && v != "none" {
                    return Err(format!("--offload {v:?}: allowed cpu or none"));
                }
                offload = Some(v.clone());
            }
            "--buffer-factor" => {
                let v = value()?;
                factor = v
                    .parse()
                    .ok()
                    .filter(|f: &f64| *f >= 1.0)
                    .ok_or_else(|| format!("--buffer-factor {v:?}: a number >= 1"))?;
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let params = params.ok_or("--params is required")?;
    let largest = largest_layer.unwrap_or(params / 10).min(params);
    let mut rows = estimate_model_states(stage, params, largest, gpus, nodes, factor);
    if let Some(choice) = offload {
        rows.retain(|r| {
            !r.options.contains("offload_optimizer")
                || r.options.contains(&format!("offload_optimizer={choice}"))
        });
    }
    Ok(format_estimates(stage, params, largest, gpus, nodes, &rows))
}

/// A checkpoint directory given as itself or as the root holding `latest`.
fn checkpoint_dir(arg: Option<&String>) -> Result<PathBuf, String> {
    let path = PathBuf::from(arg.ok_or("a checkpoint directory is required")?);
    if path.join(checkpoint::MANIFEST).exists() {
        return Ok(path);
    }
    checkpoint::resolve(&path, None).map_err(|e| e.to_string())
}

fn inspect(args: &[String]) -> Result<String, String> {
    let dir = checkpoint_dir(args.first())?;
    let verify = match args.get(1).map(String::as_str) {
        None => false,
        Some("--verify") => true,
        Some(other) => return Err(format!("unknown option {other:?}")),
    };
    let manifest = if verify {
        checkpoint::open_verified(&dir).map_err(|e| e.to_string())?
    } else {
        let path = dir.join(checkpoint::MANIFEST);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        checkpoint::Manifest::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?
    };
    let mut text = checkpoint::describe(&dir, &manifest);
    if verify {
        text += "  every file matches its size and SHA-256\n";
    }
    Ok(text)
}

fn consolidate(args: &[String]) -> Result<String, String> {
    let dir = checkpoint_dir(args.first())?;
    let out = PathBuf::from(
        args.get(1)
            .ok_or("an output .safetensors path is required")?,
    );
    let dtype = match args.get(2).map(String::as_str) {
        None => checkpoint::Dtype::F32,
        Some("--dtype") => match args.get(3).map(String::as_str) {
            Some("fp32" | "f32") => checkpoint::Dtype::F32,
            Some("bf16") => checkpoint::Dtype::BF16,
            Some("fp16" | "f16") => checkpoint::Dtype::F16,
            other => return Err(format!("--dtype {other:?}: allowed fp32, bf16 or fp16")),
        },
        Some(other) => return Err(format!("unknown option {other:?}")),
    };
    // On stderr: stdout carries the result.
    let t0 = std::time::Instant::now();
    let redraw = std::io::stderr().is_terminal();
    let mut bar = None;
    let manifest = checkpoint::consolidate(&dir, &out, dtype, |i, n| {
        let bar = bar.get_or_insert_with(|| {
            Progress::new(std::io::stderr(), "consolidate", n as u64, redraw).max_lines(10)
        });
        let _ = bar.update(i as u64, t0.elapsed().as_secs_f64(), "parameters");
    })
    .map_err(|e| e.to_string())?;
    if let Some(bar) = bar.as_mut() {
        let _ = bar.finish(t0.elapsed().as_secs_f64(), "");
    }
    let elements: usize = manifest.params.iter().filter_map(|p| p.numel()).sum();
    Ok(format!(
        "wrote {} ({} parameters, {elements} elements, {dtype:?}) from {} (stage {}, {} ranks)\n",
        out.display(),
        manifest.params.len(),
        dir.display(),
        manifest.stage,
        manifest.world_size
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &str) -> Result<String, String> {
        estimate(
            &args
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn counts_with_suffixes() {
        assert_eq!(count("--params", "1.3e9"), Ok(1_300_000_000));
        assert_eq!(count("--params", "350M"), Ok(350_000_000));
        assert_eq!(count("--params", "7B"), Ok(7_000_000_000));
        assert!(
            count("--params", "lots")
                .unwrap_err()
                .contains("--params \"lots\"")
        );
    }

    #[test]
    fn estimate_prints_the_chosen_rows() {
        let all = run("--params 2e9 --stage 2").unwrap();
        assert!(
            all.contains("offload_optimizer=cpu") && all.contains("offload_optimizer=none"),
            "{all}"
        );
        let none = run("--params 2e9 --stage 2 --offload none").unwrap();
        assert!(
            none.contains("   11.18GB |  37.25GB | offload_optimizer=none")
                && !none.contains("=cpu"),
            "{none}"
        );
        let z3 = run("--params 2e9 --largest-layer 1e8 --stage 3 --gpus-per-node 8").unwrap();
        assert!(
            z3.contains("1 node, 8 GPUs per node") && z3.contains("zero_init=0"),
            "{z3}"
        );
    }

    #[test]
    fn bad_input_is_named() {
        assert!(
            run("--stage 2")
                .unwrap_err()
                .contains("--params is required")
        );
        assert!(
            run("--params 1e9 --stage 4")
                .unwrap_err()
                .contains("--stage \"4\"")
        );
        assert!(
            run("--params 1e9 --offload disk")
                .unwrap_err()
                .contains("--offload \"disk\"")
        );
        assert!(
            run("--params 1e9 --frobnicate 1")
                .unwrap_err()
                .contains("unknown option \"--frobnicate\"")
        );
    }
}
