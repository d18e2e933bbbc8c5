//! Checkpoints through the engine on thread ranks: exact resume at stages 0–3 with gradient
//! accumulation and a warmup schedule, reshard across world sizes and stages, consolidation
//! equal to the gathered parameters, a failed save that leaves the previous checkpoint, and
//! corrupted files or mismatched models named in the error.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::NdArray;
use burn_zero::DeepSpeedConfig;
use burn_zero::checkpoint::{self, Dtype};
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize, inject_save_failure, load_params};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::engine_run::{self, CLIP, EPS, GLOBAL_BATCH, WARMUP, WEIGHT_DECAY};
use burn_zero_tests::cases::{Mlp, Stack, param_data};
use burn_zero_tests::engine_loop::train_step;
use serde_json::json;

type B = ZeroAutodiff<NdArray>;

/// Steps of the uninterrupted runs; checkpoints are taken after [`SAVE_AT`].
const STEPS: usize = 6;
const SAVE_AT: usize = 3;

fn config(stage: u8, gas: usize) -> DeepSpeedConfig {
    config_with(stage, gas, "")
}

/// The config with more top-level keys (`, "key": value` each).
fn config_with(stage: u8, gas: usize, extra: &str) -> DeepSpeedConfig {
    let (min, max, n) = WARMUP;
    let json = format!(
        r#"{{
        "train_batch_size": {GLOBAL_BATCH},
        "gradient_accumulation_steps": {gas},
        "gradient_clipping": {CLIP},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {max}, "eps": {EPS}, "weight_decay": {WEIGHT_DECAY}}}}},
        "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": {min}, "warmup_max_lr": {max}, "warmup_num_steps": {n}, "warmup_type": "linear"}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50, "allgather_bucket_size": 40,
            "stage3_param_persistence_threshold": 16}}{extra}
    }}"#
    );
    DeepSpeedConfig::from_json(&json).unwrap().config
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bz-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[derive(Clone, Debug, PartialEq)]
struct Trained {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    /// The loss scale after the last step.
    scale: f64,
}

/// What one session of training does around its steps.
#[derive(Clone, Copy, Default)]
struct Session<'a> {
    /// Resume from this root's `latest` first.
    load: Option<&'a Path>,
    /// Save into this root after step [`SAVE_AT`].
    save: Option<&'a Path>,
    /// More config keys (mixed precision).
    extra: &'a str,
}

/// Trains steps `steps` (0-based optimizer steps) on `world` ranks at `stage` with `gas`;
/// returns every rank's losses (averaged across ranks) and final parameters.
fn train(
    world: usize,
    stage: u8,
    gas: usize,
    steps: std::ops::Range<usize>,
    session: Session,
) -> Vec<Trained> {
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(
            Mlp::<B>::new(&device),
            &config_with(stage, gas, session.extra),
            comm.clone(),
        )
        .unwrap();
        if let Some(root) = session.load {
            let loaded = engine.load_checkpoint(root, None).unwrap();
            assert_eq!(loaded.client_state, json!({"next_step": steps.start}));
            assert_eq!(
                (engine.global_step(), engine.micro_step()),
                (steps.start, steps.start * gas)
            );
        }
        let mut losses = Vec::new();
        for step in steps.clone() {
            assert!((engine.lr() - engine_run::lr(step + 1)).abs() < 1e-12);
            losses.push(train_step(
                &mut engine,
                comm.as_ref(),
                step,
                ctx.rank,
                world,
            ));
            if let Some(root) = session.save
                && step + 1 == SAVE_AT
            {
                let dir = engine
                    .save_checkpoint(root, None, json!({"next_step": step + 1}))
                    .unwrap();
                assert_eq!(dir, root.join(format!("global_step{}", step + 1)));
            }
        }
        let params = param_data(engine.model())
            .into_iter()
            .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
            .collect();
        Trained {
            losses,
            params,
            scale: engine.loss_scale(),
        }
    })
}

#[test]
fn resume_is_bitwise_exact_at_every_stage() {
    for (stage, world, gas) in [(0, 2, 2), (1, 3, 2), (2, 3, 3), (3, 3, 2), (3, 2, 1)] {
        let what = format!("stage {stage}, world {world}, gas {gas}");
        let root = scratch(&format!("resume{stage}{world}{gas}"));
        let full = train(world, stage, gas, 0..STEPS, Session::default());
        let first = train(
            world,
            stage,
            gas,
            0..SAVE_AT,
            Session {
                save: Some(&root),
                ..Default::default()
            },
        );
        assert_eq!(first[0].losses, full[0].losses[..SAVE_AT], "{what}");
        let resumed = train(
            world,
            stage,
            gas,
            SAVE_AT..STEPS,
            Session {
                load: Some(&root),
                ..Default::default()
            },
        );
        for (rank, r) in resumed.iter().enumerate() {
            assert_eq!(r.losses, full[rank].losses[SAVE_AT..], "{what}: losses");
            assert!(r.params == full[rank].params, "{what}: final parameters");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn resume_keeps_the_mixed_precision_state() {
    // fp16 with a scale that rises every 2 clean steps (and halves on overflow); bf16.
    let fp16 = r#", "fp16": {"enabled": true, "initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 1}"#;
    let bf16 = r#", "bf16": {"enabled": true}"#;
    for (stage, extra) in [(2, fp16), (3, fp16), (3, bf16)] {
        let what = format!("stage {stage}{extra}");
        let root = scratch(&format!("precision{stage}{}", extra.len()));
        let plain = Session {
            extra,
            ..Default::default()
        };
        let full = train(2, stage, 2, 0..STEPS, plain);
        let save = Session {
            save: Some(&root),
            ..plain
        };
        train(2, stage, 2, 0..SAVE_AT, save);
        let load = Session {
            load: Some(&root),
            ..plain
        };
        let resumed = train(2, stage, 2, SAVE_AT..STEPS, load);
        assert_eq!(resumed[0].losses, full[0].losses[SAVE_AT..], "{what}");
        assert!(resumed[0].params == full[0].params, "{what}");
        assert_eq!(resumed[0].scale, full[0].scale, "{what}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// fp32 agreement of runs whose reductions sum in different orders.
fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) + 1e-6,
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

#[test]
fn checkpoints_reshard_across_world_sizes_and_stages() {
    let reference = train(4, 2, 1, 0..STEPS, Session::default()).remove(0);
    // (saved at world, stage) → [(loaded at world, stage)]
    // (world size, stage)
    type At = (usize, u8);
    let cases: [(At, &[At]); 3] = [
        ((4, 3), &[(2, 2), (3, 1), (1, 0)]),
        ((4, 2), &[(3, 3), (2, 0)]),
        ((2, 1), &[(4, 3), (3, 2)]),
    ];
    for ((saved_world, saved_stage), loads) in cases {
        let root = scratch(&format!("reshard{saved_world}{saved_stage}"));
        let save = Session {
            save: Some(&root),
            ..Default::default()
        };
        train(saved_world, saved_stage, 1, 0..SAVE_AT, save);
        for &(world, stage) in loads {
            let what = format!("saved at {saved_world}@{saved_stage}, loaded at {world}@{stage}");
            let load = Session {
                load: Some(&root),
                ..Default::default()
            };
            let runs = train(world, stage, 1, SAVE_AT..STEPS, load);
            assert_close(&runs[0].losses, &reference.losses[SAVE_AT..], &what);
            for (p, (got, want)) in runs[0].params.iter().zip(&reference.params).enumerate() {
                assert_close(got, want, &format!("{what}: parameter {p}"));
            }
            assert!(runs.iter().all(|r| r.params == runs[0].params), "{what}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[test]
fn consolidation_equals_the_gathered_parameters() {
    let root = scratch("consolidate");
    let gathered = run_ranks(3, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&device), &config(3, 1), comm).unwrap();
        for step in 0..2 {
            let (x, y) = engine_run::batch::<B>(step, ctx.rank * 12..(ctx.rank + 1) * 12, &device);
            let loss = engine_run::loss(engine.model(), x, y);
            engine.backward(loss).unwrap();
            engine.step().unwrap();
        }
        engine
            .save_checkpoint(&root, Some("trained"), json!(null))
            .unwrap();
        let mut full = Vec::new();
        engine
            .for_each_full_param(|slot, t| {
                full.push((slot.name.clone(), t.into_data().to_vec::<f32>().unwrap()))
            })
            .unwrap();
        full
    })
    .remove(0);
    let dir = root.join("trained");
    let out = root.join("model.safetensors");
    let manifest = checkpoint::consolidate(&dir, &out, Dtype::F32, |_, _| {}).unwrap();
    assert_eq!((manifest.stage.number(), manifest.world_size), (3, 3));

    // Read back by the reference implementation of the format.
    let bytes = std::fs::read(&out).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.len(), gathered.len());
    for (name, values) in &gathered {
        let view = file.tensor(name).unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        let stored: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert!(
            stored == *values,
            "`{name}` differs from the gathered value"
        );
    }

    // Into a plain burn module, from the file and from the checkpoint itself.
    let device = Default::default();
    let expected: Vec<Vec<f32>> = gathered.iter().map(|(_, v)| v.clone()).collect();
    for source in [out.as_path(), dir.as_path(), root.as_path()] {
        let (model, missing) = load_params(Mlp::<NdArray>::new(&device), source).unwrap();
        assert!(missing.is_empty());
        let params: Vec<Vec<f32>> = param_data(&model)
            .into_iter()
            .map(|d| d.to_vec::<f32>().unwrap())
            .collect();
        assert!(params == expected, "{}", source.display());
    }

    // bf16: each value rounded to nearest.
    let out16 = root.join("model-bf16.safetensors");
    checkpoint::consolidate(&dir, &out16, Dtype::BF16, |_, _| {}).unwrap();
    let reader = checkpoint::safetensors::Reader::open(&out16).unwrap();
    for (name, values) in &gathered {
        let rounded: Vec<f32> = values
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(reader.read_all(name).unwrap(), rounded, "{name}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_to_resume_from() {
    let root = scratch("crash");
    let full = train(2, 2, 1, 0..STEPS, Session::default());
    let outcomes = run_ranks(2, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Mlp::<B>::new(&device), &config(2, 1), comm).unwrap();
        let mut errors = Vec::new();
        for step in 0..=SAVE_AT {
            let (x, y) = engine_run::batch::<B>(step, ctx.rank * 18..(ctx.rank + 1) * 18, &device);
            let loss = engine_run::loss(engine.model(), x, y);
            engine.backward(loss).unwrap();
            engine.step().unwrap();
            if step + 1 == SAVE_AT {
                engine
                    .save_checkpoint(&root, None, json!({"next_step": SAVE_AT}))
                    .unwrap();
            }
        }
        // The next save dies on rank 1 after writing its file, before the commit.
        if ctx.rank == 1 {
            inject_save_failure();
        }
        let failed = engine.save_checkpoint(&root, None, json!({"next_step": SAVE_AT + 1}));
        errors.push(failed.unwrap_err().to_string());
        errors
    });
    assert!(
        outcomes[1][0].contains("injected failure"),
        "{:?}",
        outcomes[1]
    );
    assert!(
        outcomes[0][0].contains("another rank failed"),
        "{:?}",
        outcomes[0]
    );
    assert!(!root.join(format!("global_step{}", SAVE_AT + 1)).exists());
    assert_eq!(
        checkpoint::resolve(&root, None).unwrap(),
        root.join(format!("global_step{SAVE_AT}"))
    );
    let load = Session {
        load: Some(&root),
        ..Default::default()
    };
    let resumed = train(2, 2, 1, SAVE_AT..STEPS, load);
    assert_eq!(resumed[0].losses, full[0].losses[SAVE_AT..]);
    assert!(resumed[0].params == full[0].params);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Saves a freshly initialized [`Stack`] of `width` on 2 ranks at stage 1 under `root/tag`.
fn save_stack(root: &Path, width: usize) {
    run_ranks(2, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let engine =
            initialize::<NdArray, _>(Stack::<B>::new(2, width, &device), &config(1, 1), comm)
                .unwrap();
        engine.save_checkpoint(root, None, json!(null)).unwrap();
    });
}

/// Loads `root`'s latest checkpoint into a [`Stack`] of `width` on 2 ranks; each rank's error.
fn load_stack(root: &Path, width: usize) -> Vec<String> {
    run_ranks(2, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine =
            initialize::<NdArray, _>(Stack::<B>::new(2, width, &device), &config(1, 1), comm)
                .unwrap();
        engine.load_checkpoint(root, None).unwrap_err().to_string()
    })
}

#[test]
fn corrupted_files_and_mismatched_models_are_named() {
    let root = scratch("named");
    save_stack(&root, 5);
    let dir = root.join("global_step0");

    let errors = load_stack(&root, 6);
    assert!(
        errors.iter().all(|e| e.contains("`layers.0.weight`")
            && e.contains("[5, 5]")
            && e.contains("[6, 6]")),
        "{errors:?}"
    );
    let err = load_params(Stack::<NdArray>::new(2, 6, &Default::default()), &dir)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("`layers.0.weight`"), "{err}");

    let victim = dir.join(checkpoint::partition_file(1));
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x20;
    std::fs::write(&victim, &bytes).unwrap();
    let errors = load_stack(&root, 5);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("zero_rank00001.safetensors") && e.contains("SHA-256")),
        "{errors:?}"
    );
    bytes.truncate(100);
    std::fs::write(&victim, &bytes).unwrap();
    let err = checkpoint::consolidate(&dir, &root.join("x.safetensors"), Dtype::F32, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("zero_rank00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
