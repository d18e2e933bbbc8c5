//! ZeRO-Offload on CPU thread ranks: `offload_optimizer {"device": "cpu"}` keeps the fp32
//! master and Adam's moments in host memory and steps them with CPU-Adam in sub-groups (at
//! stages 2 and 3 the gradient partition too, written as buckets arrive); the losses and
//! parameters must equal the run whose optimizer state stays on the device, bit for bit where
//! the arithmetic is the same, within fp32 rounding where the clipping norm is summed on the
//! host instead, at stages 0–3, in fp32 and bf16, with Adam and SGD; and checkpoints move
//! between the two.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::engine_run::{self, CLIP, GLOBAL_BATCH, WARMUP};
use burn_zero_tests::cases::{Mlp, param_data};
use burn_zero_tests::engine_loop::train_step;
use serde_json::json;

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 5;

/// Where the optimizer state lives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Device,
    Host,
    /// Swap files under this test's directory in the system temp dir.
    Nvme,
}

fn nvme_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bz-offload-nvme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `place` puts the optimizer on the host or in swap files, in sub-groups of 40 elements
/// (several per rank; the swap's requests are 4 KiB, two in flight).
fn config(stage: u8, place: Place, optimizer: &str, extra: &str) -> DeepSpeedConfig {
    let (min, max, n) = WARMUP;
    let offload = match place {
        Place::Device => String::new(),
        Place::Host => r#", "offload_optimizer": {"device": "cpu"}, "sub_group_size": 40"#.into(),
        Place::Nvme => format!(
            r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 3}}, "sub_group_size": 40"#,
            nvme_dir().display()
        ),
    };
    let aio = match place {
        Place::Nvme => r#", "aio": {"block_size": 4096, "queue_depth": 2}"#,
        _ => "",
    };
    let json = format!(
        r#"{{
        "train_batch_size": {GLOBAL_BATCH},
        "gradient_accumulation_steps": 2,
        "gradient_clipping": {CLIP},
        "optimizer": {optimizer},
        "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": {min}, "warmup_max_lr": {max}, "warmup_num_steps": {n}, "warmup_type": "linear"}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50, "allgather_bucket_size": 40,
            "stage3_param_persistence_threshold": 16{offload}}},
        "burn_zero": {{"cpu_adam": {{"threads": 2}}}}{aio}{extra}
    }}"#
    );
    DeepSpeedConfig::from_json(&json).unwrap().config
}

const ADAMW: &str =
    r#"{"type": "AdamW", "params": {"lr": 0.02, "eps": 1e-6, "weight_decay": 0.01}}"#;
const ADAM_L2: &str =
    r#"{"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.05, "adam_w_mode": false}}"#;
const SGD: &str = r#"{"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": true}}"#;
/// bf16 training with gradients accumulated in bf16: the host gradient partition is bf16.
const BF16_ACCUM: &str =
    r#", "bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}"#;

#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    host_bytes: usize,
    device_optimizer_bytes: usize,
    host_params: usize,
    device_params: usize,
    host_grads: usize,
    device_grads: usize,
    /// Sub-groups CPU-Adam stepped during backward (`cpu_adam.step_ahead`).
    stepped_ahead: usize,
    /// Parameter partitions copied out of the host buffer before a rewrite.
    copied_out: usize,
    /// Steps whose new weights CPU-Adam wrote into the parameters' host buffer.
    into_host: usize,
}

/// Equal within fp32 rounding.
fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-6 * x.abs().max(y.abs()) + 1e-7)
}

/// Losses and parameters within fp32 rounding.
fn runs_close(a: &Run, b: &Run) -> bool {
    close(&a.losses, &b.losses) && a.params.iter().zip(&b.params).all(|(x, y)| close(x, y))
}

/// Trains `steps` on `world` ranks with `cfg`, optionally loading from / saving to `ckpt`.
fn train(
    world: usize,
    cfg: &DeepSpeedConfig,
    steps: std::ops::Range<usize>,
    load: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<Run> {
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&device), cfg, comm.clone()).unwrap();
        if let Some(root) = load {
            engine.load_checkpoint(root, None).unwrap();
        }
        let losses: Vec<f32> = steps
            .clone()
            .map(|step| train_step(&mut engine, comm.as_ref(), step, ctx.rank, world))
            .collect();
        if let Some(root) = save {
            engine.save_checkpoint(root, None, json!(null)).unwrap();
        }
        let report = engine.memory_report();
        let offload = engine.take_offload_timings();
        let stepped_ahead = offload.map_or(0, |t| t.ahead_sub_groups);
        let into_host = offload.map_or(0, |t| t.into_host);
        Run {
            losses,
            params: param_data(engine.model())
                .into_iter()
                .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
                .collect(),
            host_bytes: report.host_optimizer_state,
            device_optimizer_bytes: report.optimizer_state,
            host_params: report.host_parameters,
            device_params: report.parameters,
            host_grads: report.host_gradients,
            device_grads: report.gradients,
            stepped_ahead,
            copied_out: engine.gather_stats().map_or(0, |s| s.copied_out),
            into_host,
        }
    })
}

#[test]
fn offloaded_training_equals_training_on_the_device() {
    let bf16 = r#", "bf16": {"enabled": true}"#;
    let cases = [
        (0, 2, ADAMW, ""),
        (1, 3, ADAMW, ""),
        (2, 3, ADAM_L2, ""),
        (2, 2, SGD, ""),
        (3, 3, ADAMW, ""),
        (2, 2, ADAMW, bf16),
        (3, 2, ADAMW, bf16),
    ];
    for (stage, world, optimizer, extra) in cases {
        let what = format!("stage {stage}, world {world}, {optimizer}{extra}");
        let run = |place| {
            train(
                world,
                &config(stage, place, optimizer, extra),
                0..STEPS,
                None,
                None,
            )
        };
        let (device, host, nvme) = (run(Place::Device), run(Place::Host), run(Place::Nvme));
        for ((d, h), v) in device.iter().zip(&host).zip(&nvme) {
            if stage < 2 {
                assert_eq!(d.losses, h.losses, "{what}: losses (host)");
                assert!(d.params == h.params, "{what}: parameters (host)");
                assert_eq!(d.losses, v.losses, "{what}: losses (NVMe)");
                assert!(d.params == v.params, "{what}: parameters (NVMe)");
            } else {
                // The gradient partition is in host memory; the clipping norm is summed there.
                assert!(runs_close(d, h), "{what}: host\n{d:?}\n{h:?}");
                assert!(runs_close(d, v), "{what}: NVMe\n{d:?}\n{v:?}");
                assert!(d.host_grads == 0 && d.device_grads > 0, "{what}: {d:?}");
                for offloaded in [h, v] {
                    let (host, device) = (offloaded.host_grads, offloaded.device_grads);
                    assert!(
                        host > 0 && device == 0,
                        "{what}: gradients {host} / {device}"
                    );
                }
            }
            assert!(
                d.host_bytes == 0 && d.device_optimizer_bytes > 0,
                "{what}: {d:?}"
            );
            assert!(
                h.host_bytes > 0 && h.device_optimizer_bytes == 0,
                "{what}: offloaded"
            );
            assert!(
                v.host_bytes == 0 && v.device_optimizer_bytes == 0,
                "{what}: swapped"
            );
        }
        if optimizer != SGD {
            assert!(
                device[0].losses.last() < device[0].losses.first(),
                "{what}: it trains"
            );
        }
    }
}

/// The gradient buffer held in pieces of 7 elements (`burn_zero.max_buffer_elements`; a large
/// model's partition exceeds what one CUDA buffer may hold) trains as one buffer does, with the
/// optimizer on the device and offloaded, at every stage: within fp32 rounding, as the global
/// norm (which the clipping uses) is summed piece by piece.
#[test]
fn gradient_buffers_in_pieces_change_nothing() {
    for (stage, world) in [(0, 2), (1, 3), (2, 3), (3, 2)] {
        let whole = train(
            world,
            &config(stage, Place::Device, ADAMW, ""),
            0..STEPS,
            None,
            None,
        );
        for place in [Place::Device, Place::Host] {
            let mut cfg = config(stage, place, ADAMW, "");
            cfg.burn_zero.max_buffer_elements = 7;
            let pieces = train(world, &cfg, 0..STEPS, None, None);
            for (a, b) in whole.iter().zip(&pieces) {
                let what = format!("stage {stage}, {place:?}");
                assert!(
                    close(&a.losses, &b.losses),
                    "{what}: {:?} vs {:?}",
                    a.losses,
                    b.losses
                );
                for (i, (x, y)) in a.params.iter().zip(&b.params).enumerate() {
                    assert!(close(x, y), "{what}: parameter {i}");
                }
            }
        }
    }
}

/// Without clipping, the gradient partition written into host memory bucket by bucket (copied
/// by the first micro-step, added by the next) is the device's buffer bit for bit, and so is
/// training, at stages 2 and 3, in fp32, bf16 and fp16 (whose loss scale CPU-Adam divides out
/// as it reads the gradient). With gradients accumulated in bf16 or fp16 (`grad_accum_dtype`)
/// the host partition is of that dtype, in half the bytes, and each sum is rounded as the
/// device's is.
#[test]
fn gradients_in_host_memory_train_bit_for_bit_without_clipping() {
    let bf16 = r#", "bf16": {"enabled": true}"#;
    let fp16 = r#", "fp16": {"enabled": true, "initial_scale_power": 12}"#;
    let fp16_accum = r#", "fp16": {"enabled": true, "initial_scale_power": 12}, "data_types": {"grad_accum_dtype": "fp16"}"#;
    let cases = [
        (2, 3, ""),
        (3, 2, ""),
        (2, 2, bf16),
        (3, 3, bf16),
        (2, 3, fp16),
        (3, 2, fp16),
        (2, 2, BF16_ACCUM),
        (3, 3, BF16_ACCUM),
        (2, 3, fp16_accum),
        (3, 2, fp16_accum),
    ];
    let mut host_grads = std::collections::HashMap::new();
    for (stage, world, extra) in cases {
        let what = format!("stage {stage}, world {world}{extra}");
        let run = |place| {
            let mut cfg = config(stage, place, ADAMW, extra);
            cfg.gradient_clipping = 0.0;
            train(world, &cfg, 0..STEPS, None, None)
        };
        let (device, host) = (run(Place::Device), run(Place::Host));
        for (d, h) in device.iter().zip(&host) {
            assert_eq!(d.losses, h.losses, "{what}: losses");
            assert!(d.params == h.params, "{what}: parameters");
            assert!(h.host_grads > 0 && h.device_grads == 0, "{what}: {h:?}");
        }
        // The swap files' step reads the bf16 partition too.
        if extra == BF16_ACCUM {
            for (d, n) in device.iter().zip(&run(Place::Nvme)) {
                assert_eq!(d.losses, n.losses, "{what}, swap files: losses");
                assert!(d.params == n.params, "{what}, swap files: parameters");
            }
        }
        host_grads.insert((stage, extra), host[0].host_grads);
    }
    for stage in [2, 3] {
        assert_eq!(
            2 * host_grads[&(stage, BF16_ACCUM)],
            host_grads[&(stage, bf16)],
            "stage {stage}: a bf16 partition holds half the bytes"
        );
        assert_eq!(
            2 * host_grads[&(stage, fp16_accum)],
            host_grads[&(stage, fp16)],
            "stage {stage}: an f16 partition holds half the bytes"
        );
    }
}

#[test]
fn checkpoints_move_between_device_and_host_optimizers() {
    let root = std::env::temp_dir().join(format!("bz-offload-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let full = train(
        2,
        &config(2, Place::Device, ADAMW, ""),
        0..STEPS,
        None,
        None,
    );
    // Saved offloaded at world 2, resumed on the device at world 3 (stage 3), then swapped.
    train(
        2,
        &config(2, Place::Host, ADAMW, ""),
        0..2,
        None,
        Some(&root),
    );
    let device3 = config(3, Place::Device, ADAMW, "");
    let resumed = train(3, &device3, 2..4, Some(&root), Some(&root));
    let finished = train(
        2,
        &config(1, Place::Nvme, ADAMW, ""),
        4..STEPS,
        Some(&root),
        None,
    );
    let close = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) + 1e-6)
    };
    assert!(
        close(&resumed[0].losses, &full[0].losses[2..4]),
        "{:?}",
        resumed[0].losses
    );
    assert!(close(&finished[0].losses, &full[0].losses[4..]));
    for (a, b) in finished[0].params.iter().zip(&full[0].params) {
        assert!(close(a, b));
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_corrupted_swap_file_stops_every_rank_and_is_named() {
    let cfg = config(2, Place::Nvme, ADAMW, "");
    let errors = run_ranks(2, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(Mlp::<B>::new(&device), &cfg, comm).unwrap();
        let files = engine.swap_files();
        assert_eq!(files.len(), 3, "master, exp_avg, exp_avg_sq: {files:?}");
        let mut outcome = Ok(());
        for step in 0..2 {
            if step == 1 && ctx.rank == 1 {
                let victim = files
                    .iter()
                    .find(|f| f.ends_with("exp_avg_sq.swp"))
                    .unwrap();
                let mut bytes = std::fs::read(victim).unwrap();
                bytes[4] ^= 0x01;
                std::fs::write(victim, &bytes).unwrap();
            }
            for j in 0..2 {
                let start = (j * 2 + ctx.rank) * 9;
                let (x, y) = engine_run::batch::<B>(step, start..start + 9, &device);
                let loss = engine_run::loss(engine.model(), x, y);
                engine.backward(loss).unwrap();
                outcome = engine.step().map_err(|e| e.to_string());
            }
        }
        outcome
    });
    let rank1 = errors[1].as_ref().unwrap_err();
    assert!(
        rank1.contains("exp_avg_sq.swp") && rank1.contains("corrupted"),
        "{rank1}"
    );
    let rank0 = errors[0].as_ref().unwrap_err();
    assert!(rank0.contains("another rank failed"), "{rank0}");
}

/// Two steps of one micro-batch each on `rank`'s rows; the second step's outcome (the swap
/// files are read back from the second step on).
fn two_steps(
    engine: &mut burn_zero::Engine<NdArray, Mlp<B>>,
    rank: usize,
    device: &burn::tensor::Device<B>,
) -> Result<(), String> {
    let mut outcome = Ok(());
    for j in 0..2 {
        let start = (j * 2 + rank) * 9;
        let (x, y) = engine_run::batch::<B>(1, start..start + 9, device);
        let loss = engine_run::loss(engine.model(), x, y);
        engine.backward(loss).unwrap();
        outcome = engine.step().map_err(|e| e.to_string());
    }
    outcome
}

/// How a swap goes wrong between two steps (on one rank).
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// A byte of a swap file flipped on disk.
    Corrupt,
    /// A swap file cut short.
    Truncate,
    /// The disk fills up (the swap files are sparse): the step's writes fail.
    FullDisk,
}

/// A corrupted or truncated swap file, or a disk that fills up during a step's writes, stops
/// every rank, with the file and the cause named on the rank that hit it; the checkpoint
/// saved before still loads, and a run resumed from it trains step 1 as an unbroken run does.
#[test]
fn a_damaged_swap_or_a_full_disk_stops_every_rank_and_the_last_checkpoint_loads() {
    let cfg = config(2, Place::Nvme, ADAMW, "");
    let unbroken = train(2, &cfg, 0..2, None, None);
    for fault in [Fault::Corrupt, Fault::Truncate, Fault::FullDisk] {
        let root =
            std::env::temp_dir().join(format!("bz-offload-{fault:?}-{}", std::process::id()));
        let outcomes = run_ranks(2, |ctx| {
            let device = Default::default();
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let mut engine =
                initialize::<NdArray, _>(Mlp::<B>::new(&device), &cfg, comm.clone()).unwrap();
            let files = engine.swap_files();
            assert_eq!(files.len(), 3, "master, exp_avg, exp_avg_sq: {files:?}");
            train_step(&mut engine, comm.as_ref(), 0, ctx.rank, 2);
            engine.save_checkpoint(&root, None, json!(null)).unwrap();
            if ctx.rank == 1 {
                let victim = files
                    .iter()
                    .find(|f| f.ends_with("exp_avg_sq.swp"))
                    .unwrap();
                match fault {
                    Fault::Corrupt => {
                        let mut bytes = std::fs::read(victim).unwrap();
                        bytes[4] ^= 0x01;
                        std::fs::write(victim, &bytes).unwrap();
                    }
                    Fault::Truncate => {
                        let file = std::fs::OpenOptions::new().write(true).open(victim);
                        file.unwrap().set_len(100).unwrap();
                    }
                    Fault::FullDisk => {
                        let dir = victim.parent().unwrap().to_string_lossy();
                        burn_zero::engine::inject_full_disk(&dir, 0);
                    }
                }
            }
            two_steps(&mut engine, ctx.rank, &device)
        });
        let rank1 = outcomes[1].as_ref().unwrap_err();
        // A full disk fails the first file the step writes (the master's).
        let (file, cause) = match fault {
            Fault::Corrupt => ("rank1-optimizer/exp_avg_sq.swp", "corrupted"),
            Fault::Truncate => ("rank1-optimizer/exp_avg_sq.swp", "short read"),
            Fault::FullDisk => ("rank1-optimizer/master.swp", "No space left on device"),
        };
        assert!(
            rank1.contains(file) && rank1.contains(cause),
            "{fault:?}: {rank1}"
        );
        let rank0 = outcomes[0].as_ref().unwrap_err();
        assert!(rank0.contains("another rank failed"), "{fault:?}: {rank0}");
        let resumed = train(2, &cfg, 1..2, Some(&root), None);
        for (r, u) in resumed.iter().zip(&unbroken) {
            assert_eq!(
                r.losses[..],
                u.losses[1..],
                "{fault:?}: step 1 from the checkpoint"
            );
            assert!(r.params == u.params, "{fault:?}: parameters after step 1");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn nvme_offload_without_a_path_is_refused_naming_the_key() {
    let json = r#"{"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}"#;
    let err = DeepSpeedConfig::from_json(json).unwrap_err().to_string();
    assert!(err.contains("nvme_path"), "{err}");
}

/// `offload_param` at stage 3: the sharded parameters' partitions live in host memory
/// (`"cpu"`) or in a swap file (`"nvme"`, read back per partition at each gather); training is
/// bit for bit the same, with the optimizer on the device or offloaded too. With the optimizer
/// offloaded the partitions leave the device's count; with it on the device they cost the
/// device nothing either way (without `offload_param` they are chunks of the fp32 master).
#[test]
fn offloaded_parameters_train_the_same_at_stage_3() {
    let bf16 = r#", "bf16": {"enabled": true}"#;
    let nvme = format!(
        r#"{{"device": "nvme", "nvme_path": "{}"}}"#,
        nvme_dir().display()
    );
    for param_place in [r#"{"device": "cpu"}"#, nvme.as_str()] {
        let params = format!(
            r#", "zero_optimization": {{"stage": 3, "reduce_bucket_size": 50,
            "stage3_param_persistence_threshold": 16, "stage3_prefetch_bucket_size": 150,
            "offload_param": {param_place}}}"#
        );
        let on_host = param_place.contains("cpu");
        for (place, extra) in [
            (Place::Device, ""),
            (Place::Host, ""),
            (Place::Device, bf16),
            (Place::Host, BF16_ACCUM),
        ] {
            let what = format!("parameters {param_place}, optimizer {place:?}{extra}");
            let plain = train(3, &config(3, place, ADAMW, extra), 0..STEPS, None, None);
            // The same config with parameters offloaded.
            let mut cfg = config(3, place, ADAMW, extra);
            let offloaded_zero =
                DeepSpeedConfig::from_json(&format!("{{\"train_batch_size\": 36{params}}}"))
                    .unwrap()
                    .config
                    .zero_optimization;
            cfg.zero_optimization.offload_param = offloaded_zero.offload_param;
            let offloaded = train(3, &cfg, 0..STEPS, None, None);
            for (a, b) in plain.iter().zip(&offloaded) {
                assert_eq!(a.losses, b.losses, "{what}: losses");
                assert!(a.params == b.params, "{what}: parameters");
                match place {
                    Place::Device => assert!(b.device_params <= a.device_params, "{what}: {b:?}"),
                    _ => assert!(b.device_params < a.device_params, "{what}: {b:?}"),
                }
                assert_eq!(b.host_params > 0, on_host, "{what}: {b:?}");
                assert_eq!(a.host_params, 0, "{what}");
                // The engine's model held placeholders while the host buffer was rewritten.
                assert_eq!(b.copied_out, 0, "{what}: {b:?}");
                // CPU-Adam wrote fp32 weights straight into the host buffer of fp32 parameters
                // (emulated bf16 keeps f32 partitions, which bf16 outputs cannot be written
                // into: those go through the device).
                let direct = on_host && matches!(place, Place::Host) && extra.is_empty();
                assert_eq!(b.into_host > 0, direct, "{what}: {b:?}");
                assert_eq!(a.into_host, 0, "{what}");
            }
        }
    }
}

/// `cfg` with `offload_param {"device": "cpu"}`.
fn with_params_on_host(cfg: &mut DeepSpeedConfig) {
    cfg.zero_optimization.offload_param = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 36, "zero_optimization": {"stage": 3,
        "stage3_param_persistence_threshold": 16, "offload_param": {"device": "cpu"}}}"#,
    )
    .unwrap()
    .config
    .zero_optimization
    .offload_param;
}

/// A checkpoint loaded with `offload_param {"device": "cpu"}` resumes bit for bit, and the
/// model lets go of its parameters before the host buffer is rewritten, as in a step: no
/// partition is copied out (a load used to copy out all of them).
#[test]
fn a_resumed_run_with_offloaded_parameters_repeats_the_steps_and_copies_nothing_out() {
    let root = std::env::temp_dir().join(format!("bz-offload-param-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut cfg = config(3, Place::Host, ADAMW, "");
    with_params_on_host(&mut cfg);
    let full = train(2, &cfg, 0..4, None, None);
    train(2, &cfg, 0..2, None, Some(&root));
    let resumed = train(2, &cfg, 2..4, Some(&root), None);
    for (rank, (a, b)) in full.iter().zip(&resumed).enumerate() {
        assert_eq!(a.losses[2..], b.losses[..], "rank {rank}: losses");
        assert!(a.params == b.params, "rank {rank}: parameters");
        assert!(
            b.host_params > 0,
            "rank {rank}: the parameters were not offloaded"
        );
        assert_eq!(b.copied_out, 0, "rank {rank}: partitions copied out");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// With the parameters in host memory and the optimizer in swap files, CPU-Adam writes the new
/// parameters straight into their host buffer, sub-group by sub-group. A step that fails half
/// way (a corrupted swap file) leaves that buffer half written: loading the last checkpoint
/// into the same engine must replace it all, and the run then repeats the unbroken one.
#[test]
fn a_load_after_a_failed_step_into_host_parameters_restores_them() {
    let mut cfg = config(3, Place::Nvme, ADAMW, "");
    cfg.zero_optimization.sub_group_size = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 36, "zero_optimization": {"stage": 3, "sub_group_size": 100}}"#,
    )
    .unwrap()
    .config
    .zero_optimization
    .sub_group_size;
    with_params_on_host(&mut cfg);
    let unbroken = train(2, &cfg, 0..3, None, None);
    assert!(
        unbroken[0].into_host > 0,
        "the step wrote the host buffer directly"
    );
    let root = std::env::temp_dir().join(format!("bz-offload-into-{}", std::process::id()));
    let resumed = run_ranks(2, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&device), &cfg, comm.clone()).unwrap();
        train_step(&mut engine, comm.as_ref(), 0, ctx.rank, 2);
        engine.save_checkpoint(&root, None, json!(null)).unwrap();
        let victim = engine
            .swap_files()
            .into_iter()
            .find(|f| f.ends_with("exp_avg_sq.swp"));
        let victim = victim.unwrap();
        let mut bytes = std::fs::read(&victim).unwrap();
        // Past the first sub-groups: those are stepped into the buffer before the read fails.
        let at = bytes.len() / 2;
        bytes[at] ^= 0x01;
        std::fs::write(&victim, &bytes).unwrap();
        // The swap files are read back from the second step on (as in the test above).
        let failed = two_steps(&mut engine, ctx.rank, &device);
        assert!(
            failed.is_err(),
            "rank {}: the corrupted step went through",
            ctx.rank
        );
        engine.load_checkpoint(&root, None).unwrap();
        let losses: Vec<f32> = (1..3)
            .map(|step| train_step(&mut engine, comm.as_ref(), step, ctx.rank, 2))
            .collect();
        let params: Vec<Vec<f32>> = param_data(engine.model())
            .into_iter()
            .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
            .collect();
        (losses, params)
    });
    for (rank, ((losses, params), u)) in resumed.iter().zip(&unbroken).enumerate() {
        assert_eq!(
            losses[..],
            u.losses[1..],
            "rank {rank}: steps 1 and 2 after the load"
        );
        assert!(*params == u.params, "rank {rank}: parameters");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn parameter_offload_needs_stage_3_and_nvme_a_path() {
    for device in ["cpu", "nvme\", \"nvme_path\": \"/tmp"] {
        let json = format!(
            r#"{{"train_batch_size": 4, "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": 2, "offload_param": {{"device": "{device}"}}}}}}"#
        );
        let err = DeepSpeedConfig::from_json(&json).unwrap_err().to_string();
        assert!(
            err.contains("offload_param") && err.contains("stage 3"),
            "{err}"
        );
    }
    let json = r#"{"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}"#;
    let err = DeepSpeedConfig::from_json(json).unwrap_err().to_string();
    assert!(err.contains("offload_param.nvme_path"), "{err}");
}

/// A model kept from an earlier step keeps that step's values when its parameters are
/// offloaded, as it does on the device: its handles gather their own partitions after the
/// engine has moved on (the host buffer and a swap file hold only the newest, so the kept
/// handles' partitions must be read out before they are rewritten).
#[test]
fn a_model_kept_from_an_earlier_step_keeps_its_values_with_offloaded_parameters() {
    let nvme = format!(
        r#"{{"device": "nvme", "nvme_path": "{}"}}"#,
        nvme_dir().display()
    );
    // With the optimizer offloaded too, CPU-Adam writes the new parameters straight into the
    // host buffer: the kept partitions must be copied out before that step.
    let cases = [
        (r#"{"device": "cpu"}"#, Place::Device),
        (r#"{"device": "cpu"}"#, Place::Host),
        (nvme.as_str(), Place::Device),
    ];
    for (param_place, optimizer) in cases {
        let mut cfg = config(3, optimizer, ADAMW, "");
        let params = format!(
            r#"{{"train_batch_size": 36, "zero_optimization": {{"stage": 3,
            "stage3_param_persistence_threshold": 16, "offload_param": {param_place}}}}}"#
        );
        cfg.zero_optimization.offload_param = DeepSpeedConfig::from_json(&params)
            .unwrap()
            .config
            .zero_optimization
            .offload_param;
        let world = 3;
        let outcome = run_ranks(world, |ctx| {
            let device = Default::default();
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let mut engine =
                initialize::<NdArray, _>(Mlp::<B>::new(&device), &cfg, comm.clone()).unwrap();
            train_step(&mut engine, comm.as_ref(), 0, ctx.rank, world);
            let kept = engine.model().clone();
            let values = |m: &Mlp<B>| -> Vec<Vec<f32>> {
                param_data(m)
                    .into_iter()
                    .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
                    .collect()
            };
            let before = values(&kept);
            for step in 1..3 {
                train_step(&mut engine, comm.as_ref(), step, ctx.rank, world);
            }
            let copied = engine.gather_stats().map_or(0, |s| s.copied_out);
            (before, values(&kept), values(engine.model()), copied)
        });
        for (rank, (before, kept_after, trained, copied)) in outcome.iter().enumerate() {
            if param_place.contains("cpu") {
                assert!(
                    *copied > 0,
                    "rank {rank}: the kept partitions were not copied out"
                );
            }
            assert!(
                before == kept_after,
                "{param_place}, optimizer {optimizer:?}, rank {rank}: the kept model changed"
            );
            assert!(
                before != trained,
                "{param_place}, rank {rank}: training moved nothing"
            );
        }
    }
}

/// `cpu_adam.step_ahead`: sub-groups stepped by CPU-Adam while backward goes on give the
/// serial step's bits (losses and parameters, over 5 steps of 2 micro-steps each), at stages 2
/// and 3, fp32 and bf16, on world sizes that split the 294 parameters unevenly, in sub-groups
/// of 40 with buckets of 50 (so sub-groups finish mid-backward); and some were stepped ahead
/// on some rank.
/// With clipping or in swap files nothing is stepped ahead.
#[test]
fn sub_groups_stepped_during_backward_give_the_serial_steps_bits() {
    let bf16 = r#", "bf16": {"enabled": true}"#;
    for (stage, world, extra) in [
        (3, 3, ""),
        (2, 3, ""),
        (3, 2, bf16),
        (2, 2, bf16),
        (3, 3, BF16_ACCUM),
    ] {
        let what = format!("stage {stage}, world {world}{extra}");
        let run = |ahead: bool| {
            let mut cfg = config(stage, Place::Host, ADAMW, extra);
            cfg.gradient_clipping = 0.0;
            cfg.burn_zero.cpu_adam.step_ahead = ahead;
            // The threads stepping ahead change nothing in the bits (half the cases on one).
            cfg.burn_zero.cpu_adam.ahead_threads = (stage == 3).then_some(1);
            train(world, &cfg, 0..STEPS, None, None)
        };
        let (serial, ahead) = (run(false), run(true));
        for (rank, (s, a)) in serial.iter().zip(&ahead).enumerate() {
            assert_eq!(s.losses, a.losses, "{what}, rank {rank}: losses");
            assert!(s.params == a.params, "{what}, rank {rank}: parameters");
            assert_eq!(s.stepped_ahead, 0, "{what}: switched off");
        }
        // A rank whose one sub-group holds padding (never written) steps it after backward.
        let stepped: Vec<usize> = ahead.iter().map(|a| a.stepped_ahead).collect();
        assert!(
            stepped.iter().sum::<usize>() > 0,
            "{what}: nothing was stepped ahead ({stepped:?})"
        );
    }
    let clipped = train(2, &config(2, Place::Host, ADAMW, ""), 0..2, None, None);
    let swapped = {
        let mut cfg = config(2, Place::Nvme, ADAMW, "");
        cfg.gradient_clipping = 0.0;
        train(2, &cfg, 0..2, None, None)
    };
    for r in clipped.iter().chain(&swapped) {
        assert_eq!(r.stepped_ahead, 0, "clipping or swap files: {r:?}");
    }
}

/// Two layers whose first weight's gradient can be made NaN alone.
#[derive(Module, Debug)]
struct Two<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
}

/// A NaN gradient skips the step. Serially nothing moves; stepping ahead, the sub-groups that
/// finished before the NaN one was seen keep their update (documented), the NaN one does not
/// take it, nothing becomes non-finite, and the next step trains. On 2 ranks the NaN comes from
/// the last rank's micro-batch alone and lands in the other rank's partition: the ranks must
/// still agree (no rank left waiting in a collective, one model everywhere).
#[test]
fn a_nan_gradient_stops_stepping_ahead_and_skips_the_rest() {
    for world in [1, 2] {
        for ahead in [false, true] {
            let ranks = run_two(world, ahead, |engine, rank, stage| {
                let factor = match stage == Stage::Poisoned && rank + 1 == world {
                    true => f32::NAN,
                    false => 0.0,
                };
                two_step(engine, factor).unwrap();
            });
            let what = format!("world {world}, step_ahead {ahead}");
            let (before, after, next, skipped) = &ranks[0];
            for other in &ranks[1..] {
                assert!(other == &ranks[0], "{what}: the ranks disagree");
            }
            assert_eq!(*skipped, 1, "{what}: the NaN step is counted as skipped");
            assert!(
                after.iter().flatten().all(|v| v.is_finite()),
                "{what}: a NaN reached the weights"
            );
            assert_eq!(
                after[0], before[0],
                "{what}: the NaN gradient's weight moved"
            );
            let moved = before.iter().zip(after).filter(|(b, a)| b != a).count();
            match ahead {
                false => assert_eq!(moved, 0, "{what}: serially the skipped step moves nothing"),
                true => assert!(
                    moved > 0,
                    "{what}: no sub-group finished before the NaN one"
                ),
            }
            assert!(next != after, "{what}: the step after trains");
        }
    }
}

/// A boundary backward that fails (no parameter gradient reached the engine) after stepping
/// ahead began leaves no thread waiting: the next backward and step train as usual.
#[test]
fn a_failed_backward_stops_stepping_ahead() {
    for world in [1, 2] {
        let ranks = run_two(world, true, |engine, _, stage| {
            // Only the first backward can see no gradient at all (later ones keep the count).
            if stage == Stage::First {
                let device = Default::default();
                let stray = Tensor::<B, 1>::from_floats([1.0, 2.0], &device).require_grad();
                let err = engine.backward(stray.sum()).unwrap_err();
                assert!(err.to_string().contains("no parameter gradient"), "{err}");
            }
            two_step(engine, 0.0).unwrap();
        });
        let (before, after, next, skipped) = &ranks[0];
        assert_eq!(*skipped, 0, "world {world}");
        assert!(before != after && after != next, "world {world}: it trains");
    }
}

/// A second boundary backward without `step` between is refused before it touches the step
/// begun ahead (whose sub-groups' weights were sent on as they were stepped): the `step`
/// after it completes the first backward's step, and training goes on with the bits of a
/// run that never made the mistake.
#[test]
fn a_second_boundary_backward_is_refused_and_the_step_completes() {
    for world in [1, 2] {
        let mistaken = run_two(world, true, |engine, _, stage| {
            if stage == Stage::Poisoned {
                let m = engine.model();
                let x = ramp(32, 0.1).reshape([4, 8]);
                let loss = m.b.forward(m.a.forward(x)).powf_scalar(2.0).mean();
                engine.backward(loss.clone()).unwrap();
                let err = engine.backward(loss).unwrap_err();
                assert!(
                    err.to_string().contains("second backward"),
                    "world {world}: {err}"
                );
                engine.step().unwrap();
            } else {
                two_step(engine, 0.0).unwrap();
            }
        });
        let plain = run_two(world, true, |engine, _, _| two_step(engine, 0.0).unwrap());
        assert!(mistaken == plain, "world {world}: the same three steps");
        let (before, after, next, _) = &plain[0];
        assert!(before != after && after != next, "world {world}: it trains");
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    First,
    Poisoned,
    After,
}

type TwoEngine = burn_zero::engine::Engine<NdArray, Two<B>>;
type TwoRun = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>, usize);

/// [`Two`] (a's 96 + 12, b's 120 + 10 parameters) at stage 2 offloaded in sub-groups of 40, on
/// `world` ranks; `step` runs each of three steps; the model's values after each, and the
/// skipped steps.
fn run_two(
    world: usize,
    ahead: bool,
    step: impl Fn(&mut TwoEngine, usize, Stage) + Sync,
) -> Vec<TwoRun> {
    use burn::module::Param;
    use burn::nn::LinearConfig;
    let values = |m: &Two<B>| -> Vec<Vec<f32>> {
        param_data::<B, _>(m)
            .into_iter()
            .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
            .collect()
    };
    let json = format!(
        r#"{{"train_batch_size": {}, "optimizer": {ADAMW}, "gradient_clipping": 0,
        "zero_optimization": {{"stage": 2, "reduce_bucket_size": 50,
            "offload_optimizer": {{"device": "cpu"}}, "sub_group_size": 40}},
        "burn_zero": {{"cpu_adam": {{"threads": 2, "step_ahead": {ahead}}}}}}}"#,
        4 * world
    );
    let cfg = DeepSpeedConfig::from_json(&json).unwrap().config;
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut model = Two::<B> {
            a: LinearConfig::new(8, 12).init(&device),
            b: LinearConfig::new(12, 10).init(&device),
        };
        model.a.weight = Param::from_tensor(ramp(96, 0.05).reshape([8, 12]));
        model.a.bias = Some(Param::from_tensor(ramp(12, 0.02)));
        model.b.weight = Param::from_tensor(ramp(120, 0.03).reshape([12, 10]));
        model.b.bias = Some(Param::from_tensor(ramp(10, 0.01)));
        let mut engine = initialize::<NdArray, _>(model, &cfg, comm).unwrap();
        step(&mut engine, ctx.rank, Stage::First);
        let before = values(engine.model());
        step(&mut engine, ctx.rank, Stage::Poisoned);
        let after = values(engine.model());
        step(&mut engine, ctx.rank, Stage::After);
        let next = values(engine.model());
        (before, after, next, engine.skipped_steps())
    })
}

fn ramp(n: usize, s: f32) -> Tensor<B, 1> {
    let values: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * s).collect();
    Tensor::<B, 1>::from_floats(values.as_slice(), &Default::default())
}

/// One step of [`Two`] on a fixed batch, plus a term whose gradient for `a.weight` alone is
/// `factor`·0 (NaN for a NaN factor): d/dw of (w · factor)·0. Every rank adds it, so every
/// rank's graph (and its gradients' order) is the same.
fn two_step(engine: &mut TwoEngine, factor: f32) -> Result<(), burn_zero::engine::EngineError> {
    let m = engine.model();
    let x = ramp(32, 0.1).reshape([4, 8]);
    let out = m.b.forward(m.a.forward(x));
    let term = m.a.weight.val().mul_scalar(factor).sum().mul_scalar(0.0);
    engine.backward(out.powf_scalar(2.0).mean() + term)?;
    engine.step()
}
