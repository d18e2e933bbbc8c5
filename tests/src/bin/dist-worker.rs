//! A rank of the multi-process tests, started by the launcher:
//!   dist-worker collectives          collectives over TCP, checked against local arithmetic
//!   dist-worker train STAGE GAS      the engine parity run; rank 0 prints `RESULT` lines
//!   dist-worker train-gpu STAGE GAS [PRECISION [STEPS]]
//!                                    the same on `Cuda`, GPU `LOCAL_RANK`, NCCL (feature nccl);
//!                                    PRECISION fp32 (default), bf16 or fp16;
//!                                    OVERLAP_COMM=0/1 overrides overlap_comm;
//!                                    POISON_STEP=S makes rank 1's first loss of step S
//!                                    infinite (an fp16 overflow on one rank); every rank
//!                                    prints `PARAMS <hash>` of its final parameters' bits
//!   dist-worker llama-3d tied|untied [SCHEDULE]
//!                                    the tiny Llama in pipe 2 × data 2 × model 2 (8 ranks),
//!                                    1F1B or SCHEDULE (`zb-h1`, ...); last-stage ranks print
//!                                    `LOSSES [pipe, data, model] [..]`
//!   dist-worker llama-3d-gpu STEPS [PIPE DATA MODEL [SCHEDULE]]
//!                                    the same with the recipe's model on `Cuda`, NCCL (nccl),
//!                                    in PIPE × DATA × MODEL (default 2 2 2), 1F1B or SCHEDULE
//!   dist-worker llama-ref-gpu STEPS [PIPE DATA MODEL]
//!                                    its reference on one GPU: prints `REFERENCE [..]`
//!   dist-worker die RANK HOW         rank RANK dies (`kill`: SIGKILL, `exit`: status 3) after
//!                                    a collective; the others sleep until stopped
//!   dist-worker train-ckpt STAGE DIR STEPS RESUME
//!                                    `train` for STEPS steps saving a checkpoint into DIR after
//!                                    each, first resuming from DIR's `latest` when RESUME is 1
//!   dist-worker stall RANK           rank RANK sleeps before the second collective; the others
//!                                    time out in it (BURN_ZERO_TIMEOUT) and print flight lines
//!   dist-worker faults-gpu CASE RANK on GPUs with NCCL (feature nccl), CASE one of:
//!                                    `stall` (RANK sleeps before a device collective),
//!                                    `hang` (RANK's NCCL stream waits on a flag nobody raises,
//!                                    so its collective never runs: the watchdogs fire),
//!                                    `mismatch` (RANK all-gathers where the others all-reduce),
//!                                    `kill` (RANK kills itself with SIGKILL mid-loop)

use std::sync::Arc;
use std::time::Duration;

use burn::backend::NdArray;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::{Communicator, PaddedCollectives, ReduceOp};
use burn_zero::dist::init_distributed;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::partition::PartitionPlan;
use burn_zero_tests::cases::engine_run::{
    self, CLIP, EPS, GLOBAL_BATCH, STEPS, WARMUP, WEIGHT_DECAY,
};
use burn_zero_tests::cases::{Mlp, param_data};
use burn_zero_tests::llama_3d::{self, Run3d};

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 13 + rank * 7) % 31) as f32 - 15.0)
        .collect()
}

fn collectives(comm: &dyn Communicator) {
    let (rank, world) = (comm.rank(), comm.world_size());
    for n in [1usize, 7, 100003] {
        let mut v = values(rank, n);
        comm.all_reduce(v.as_mut_slice().into(), ReduceOp::Sum)
            .unwrap();
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n)).collect();
        let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        assert!(v == want, "all_reduce n={n}");
        let plan = PartitionPlan::new(n, world);
        let mut owned = vec![0.0f32; plan.owned(rank).len()];
        comm.reduce_scatter_padded(&plan, &values(rank, n), &mut owned, ReduceOp::Sum)
            .unwrap();
        assert!(owned[..] == want[plan.owned(rank)], "reduce_scatter n={n}");
        let mut full = vec![0.0f32; n];
        comm.all_gather_padded(&plan, &owned, &mut full).unwrap();
        assert!(full == want, "all_gather n={n}");
        let mut b = values(rank, n);
        comm.broadcast(b.as_mut_slice().into(), world - 1).unwrap();
        assert!(b == values(world - 1, n), "broadcast n={n}");
    }
    comm.barrier().unwrap();
    println!("collectives ok rank {rank} world {world}");
}

/// Where `train` saves a checkpoint after every step (`global_step{n}`), and whether it first
/// resumes from the root's `latest`.
struct Checkpoints<'a> {
    root: &'a std::path::Path,
    resume: bool,
}

/// `precision`: "fp32", "bf16" or "fp16"; `steps`: optimizer steps.
fn train<I: burn::tensor::backend::Backend>(
    comm: Arc<dyn Communicator>,
    stage: u8,
    gas: usize,
    (precision, steps): (&str, usize),
    device: I::Device,
    checkpoints: Option<Checkpoints>,
) {
    let precision = match precision {
        "bf16" => r#", "bf16": {"enabled": true}"#,
        "fp16" => r#", "fp16": {"enabled": true, "initial_scale_power": 8, "hysteresis": 1}"#,
        _ => "",
    };
    let (min, max, n) = WARMUP;
    // `OVERLAP_COMM=0|1` overrides the stage's default (on at stage 3 only).
    let overlap = match std::env::var("OVERLAP_COMM").as_deref() {
        Ok("1") => r#", "overlap_comm": true"#,
        Ok("0") => r#", "overlap_comm": false"#,
        _ => "",
    };
    let json = format!(
        r#"{{"train_batch_size": {GLOBAL_BATCH}, "gradient_accumulation_steps": {gas}, "gradient_clipping": {CLIP},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {max}, "eps": {EPS}, "weight_decay": {WEIGHT_DECAY}}}}},
        "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": {min}, "warmup_max_lr": {max}, "warmup_num_steps": {n}, "warmup_type": "linear"}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50, "allgather_bucket_size": 40,
          "stage3_param_persistence_threshold": 16{overlap}}}{precision}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).unwrap().config;
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut engine =
        initialize::<I, _>(Mlp::<ZeroAutodiff<I>>::new(&device), &config, comm.clone()).unwrap();
    let micro = GLOBAL_BATCH / (world * gas);
    // Inputs in the parameters' dtype (bf16/fp16 under mixed precision on a GPU).
    let dtype = engine.model().l1_weight().dtype();
    let poison: Option<usize> = std::env::var("POISON_STEP")
        .ok()
        .map(|s| s.parse().expect("POISON_STEP is a step"));
    let mut first = 0;
    if let Some(c) = checkpoints.as_ref().filter(|c| c.resume) {
        let loaded = engine.load_checkpoint(c.root, None).unwrap();
        first = loaded.client_state["next_step"].as_u64().unwrap() as usize;
        if rank == 0 {
            println!("resumed at step {first}");
        }
    }
    for step in first..steps {
        let mut step_loss = 0.0f32;
        let scale = engine.loss_scale();
        for j in 0..gas {
            let start = (j * world + rank) * micro;
            let (x, y) = engine_run::batch::<ZeroAutodiff<I>>(step, start..start + micro, &device);
            let mut loss = engine_run::loss(engine.model(), x.cast(dtype), y.cast(dtype));
            if poison == Some(step) && rank == 1 && j == 0 {
                loss = loss.mul_scalar(f32::INFINITY);
            }
            step_loss += loss
                .clone()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap()[0]
                / gas as f32;
            engine.backward(loss).unwrap();
            engine.step().unwrap();
        }
        let mut mean = [step_loss];
        comm.all_reduce(mean.as_mut_slice().into(), ReduceOp::Avg)
            .unwrap();
        if let Some(c) = &checkpoints {
            let state = serde_json::json!({ "next_step": step + 1 });
            engine.save_checkpoint(c.root, None, state).unwrap();
        }
        if rank == 0 {
            println!("RESULT loss_{step} {:?}", mean[0]);
            println!("STAT scale_{step} {scale:?}");
            println!(
                "RESULT norm_{step} {:?}",
                engine.last_grad_norm().unwrap() as f32
            );
        }
    }
    // Every rank reads the parameters: under ZeRO-3 that gathers them.
    let params = param_data(engine.model());
    // FNV-1a over every parameter's bits: the ranks' copies compared without printing them.
    let hash = params.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, p| {
        let values = p.clone().convert::<f32>().to_vec::<f32>().unwrap();
        values.iter().fold(h, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3)
        })
    });
    println!("PARAMS {hash:016x}");
    if rank == 0 {
        println!("STAT device_collectives {}", engine.device_collectives());
        println!("STAT skipped_steps {}", engine.skipped_steps());
        for (i, p) in params.into_iter().enumerate() {
            println!(
                "RESULT param_{i} {:?}",
                p.convert::<f32>().to_vec::<f32>().unwrap()
            );
        }
    }
}

/// This rank's part of `run`; the last stage prints its losses.
fn run_llama_3d<B>(run: &Run3d, world: Arc<dyn Communicator>, device: B::Device)
where
    B: burn::tensor::backend::AutodiffBackend + burn_pipeline::ModelParallelBackend,
{
    let start = std::time::Instant::now();
    let llama_3d::RankRun {
        coords,
        losses,
        step_s: times,
    } = run
        .rank::<B>(world, &device)
        .unwrap_or_else(|e| panic!("{e}"));
    if !losses.is_empty() {
        println!("LOSSES {coords:?} {losses:?}");
        println!("STEP_S {coords:?} {times:?}");
    }
    eprintln!(
        "{coords:?}: {} steps in {:.1} s",
        run.steps,
        start.elapsed().as_secs_f64()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    #[cfg(feature = "nccl")]
    if let Some(mode @ ("llama-3d-gpu" | "llama-ref-gpu")) = args.first().map(String::as_str) {
        type G = ZeroAutodiff<burn::backend::Cuda>;
        let arg = |i: usize, default: usize| args.get(i).map_or(default, |s| s.parse().unwrap());
        let mut run = llama_3d::smollm2(arg(1, 10), [arg(2, 2), arg(3, 2), arg(4, 2)]);
        if let Some(s) = args.get(5) {
            run.schedule = s.parse().unwrap_or_else(|e| panic!("{e}"));
        }
        if mode == "llama-ref-gpu" {
            let device = burn::backend::cuda::CudaDevice::new(0);
            println!("REFERENCE {:?}", run.reference::<G>(&device));
            return;
        }
        let (env, nccl) = burn_zero::dist::init_nccl().unwrap_or_else(|e| panic!("{e}"));
        let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
        run_llama_3d::<G>(&run, Arc::new(nccl), device);
        return;
    }
    #[cfg(feature = "nccl")]
    if args.first().map(String::as_str) == Some("train-gpu") {
        let (env, nccl) = burn_zero::dist::init_nccl().unwrap_or_else(|e| panic!("{e}"));
        let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
        let precision = args.get(3).map_or("fp32", String::as_str);
        let steps = args.get(4).map_or(STEPS, |s| s.parse().unwrap());
        train::<burn::backend::Cuda>(
            Arc::new(nccl),
            args[1].parse().unwrap(),
            args[2].parse().unwrap(),
            (precision, steps),
            device,
            None,
        );
        return;
    }
    #[cfg(feature = "nccl")]
    if args.first().map(String::as_str) == Some("faults-gpu") {
        faults_gpu(&args[1], args[2].parse().unwrap());
        return;
    }
    let dist = init_distributed().unwrap_or_else(|e| panic!("{e}"));
    match args.first().map(String::as_str) {
        Some("collectives") => collectives(dist.comm.as_ref()),
        Some("train") => train::<NdArray>(
            dist.comm,
            args[1].parse().unwrap(),
            args[2].parse().unwrap(),
            ("fp32", STEPS),
            Default::default(),
            None,
        ),
        Some("train-ckpt") => train::<NdArray>(
            dist.comm,
            args[1].parse().unwrap(),
            1,
            ("fp32", args[3].parse().unwrap()),
            Default::default(),
            Some(Checkpoints {
                root: std::path::Path::new(&args[2]),
                resume: args[4] == "1",
            }),
        ),
        Some("llama-3d") => {
            let mut run = llama_3d::tiny(args[1] == "tied");
            if let Some(s) = args.get(2) {
                run.schedule = s.parse().unwrap_or_else(|e| panic!("{e}"));
            }
            run_llama_3d::<ZeroAutodiff<NdArray>>(&run, dist.comm, Default::default())
        }
        Some("die") => {
            let victim: usize = args[1].parse().unwrap();
            dist.comm.barrier().unwrap();
            if dist.env.rank == victim {
                std::thread::sleep(Duration::from_millis(300));
                if args[2] == "kill" {
                    // SAFETY: signalling this process itself.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                std::process::exit(3);
            }
            println!("rank {} sleeping until stopped", dist.env.rank);
            std::thread::sleep(Duration::from_secs(600));
        }
        Some("stall") => {
            let victim: usize = args[1].parse().unwrap();
            dist.comm.barrier().unwrap();
            if dist.env.rank == victim {
                println!("rank {victim} stalling before the next collective");
                std::thread::sleep(Duration::from_secs(600));
            }
            let mut x = [1.0f32; 4];
            dist.comm
                .all_reduce((&mut x[..]).into(), ReduceOp::Sum)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        other => panic!("unknown mode {other:?}"),
    }
}

/// The device fault cases (see the module's doc): each rank runs a few device all-reduces, then
/// rank `victim` misbehaves as `case` says at the next collective.
#[cfg(feature = "nccl")]
fn faults_gpu(case: &str, victim: usize) {
    use burn_zero::comm::{DType, DeviceBuf, DeviceCollectives};
    use cudarc::driver::{CudaSlice, DevicePtr};
    let (env, nccl) = burn_zero::dist::init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let stream = nccl.stream().clone();
    let n = 1 << 20;
    let data: CudaSlice<f32> = stream.alloc_zeros(n * env.world_size).unwrap();
    let flag: CudaSlice<u32> = stream.alloc_zeros(1).unwrap();
    let (ptr, _sync) = data.device_ptr(&stream);
    let (flag_ptr, _flag_sync) = flag.device_ptr(&stream);
    let whole = DeviceBuf {
        ptr,
        len: n * env.world_size,
        dtype: DType::F32,
    };
    let chunk = DeviceBuf {
        ptr,
        len: n,
        dtype: DType::F32,
    };
    let device: &dyn DeviceCollectives = &nccl;
    for step in 0..20 {
        let me = env.rank == victim && step == 10;
        if me {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            println!(
                "rank {victim}: {case} at step {step} (unix time {:.3})",
                now.as_secs_f64()
            );
        }
        // SAFETY: `data` and `flag` live until the end of this function, after a sync.
        let result = unsafe {
            match (case, me) {
                ("stall", true) => {
                    std::thread::sleep(Duration::from_secs(600));
                    device.all_reduce(whole, whole, ReduceOp::Sum)
                }
                ("hang", true) => {
                    device.wait_for_flag(flag_ptr, 1).unwrap();
                    device.all_reduce(whole, whole, ReduceOp::Sum)
                }
                ("mismatch", true) => device.all_gather(chunk, whole),
                ("kill", true) => {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                    unreachable!()
                }
                _ => device.all_reduce(whole, whole, ReduceOp::Sum),
            }
        };
        result.unwrap_or_else(|e| panic!("rank {}: {e}", env.rank));
        device
            .synchronize()
            .unwrap_or_else(|e| panic!("rank {}: {e}", env.rank));
    }
    println!("rank {} finished", env.rank);
}
