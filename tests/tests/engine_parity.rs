//! The engine at ZeRO stages 0–3 on 1–4 thread ranks, with 1 or 3 accumulation steps,
//! global-norm clipping and a warmup schedule, against the plain single-process burn run on
//! the same global batch (`reference/`, built without burn-zero): the loss of every step,
//! the clip norm of every step, and the final parameters agree within 1e-5 relative.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::{for_world_sizes, run_ranks};
use burn_zero_tests::cases::engine_run::{
    self, CLIP, EPS, GLOBAL_BATCH, STEPS, WARMUP, WEIGHT_DECAY,
};
use burn_zero_tests::cases::{Mlp, param_data};
use burn_zero_tests::reference::assert_close_to_reference;

type B = ZeroAutodiff<NdArray>;

/// fp32 tolerance of the parity: relative 1e-5, plus 1e-6 absolute for values near zero.
const RTOL: f32 = 1e-5;
const ATOL: f32 = 1e-6;

/// The parity config, with `extra` zero_optimization keys (`, "key": value` each).
fn config_with(stage: u8, gas: usize, overlap: bool, extra: &str) -> DeepSpeedConfig {
    let (min, max, n) = WARMUP;
    let json = format!(
        r#"{{
        "train_batch_size": {GLOBAL_BATCH},
        "gradient_accumulation_steps": {gas},
        "gradient_clipping": {CLIP},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {max}, "betas": [0.9, 0.999], "eps": {EPS}, "weight_decay": {WEIGHT_DECAY}}}}},
        "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": {min}, "warmup_max_lr": {max}, "warmup_num_steps": {n}, "warmup_type": "linear"}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 50, "allgather_bucket_size": 40, "overlap_comm": {overlap}{extra}}}
    }}"#
    );
    let loaded = DeepSpeedConfig::from_json(&json).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    loaded.config
}

struct Run {
    /// ZeRO-3 all-gathers of sharded parameters during training.
    gathers: usize,
    losses: Vec<f32>,
    norms: Vec<f32>,
    params: Vec<Vec<f32>>,
}

fn train(world: usize, stage: u8, gas: usize, overlap: bool, extra: &str) -> Vec<Run> {
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(
            Mlp::<B>::new(&device),
            &config_with(stage, gas, overlap, extra),
            comm.clone(),
        )
        .unwrap();
        let micro = GLOBAL_BATCH / (world * gas);
        assert_eq!(engine.config().batch.micro_batch_per_gpu, micro);
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            assert!(
                (engine.lr() - engine_run::lr(step + 1)).abs() < 1e-12,
                "lr of step {}",
                step + 1
            );
            let mut step_loss = 0.0f32;
            for j in 0..gas {
                let start = (j * world + ctx.rank) * micro;
                let (x, y) = engine_run::batch::<B>(step, start..start + micro, &device);
                let loss: Tensor<B, 1> = engine_run::loss(engine.model(), x, y);
                step_loss += loss.clone().into_scalar() / gas as f32;
                assert_eq!(engine.is_gradient_accumulation_boundary(), j == gas - 1);
                engine.backward(loss).unwrap();
                engine.step().unwrap();
            }
            let mut mean = [step_loss];
            comm.all_reduce(mean.as_mut_slice().into(), ReduceOp::Avg)
                .unwrap();
            losses.push(mean[0]);
            norms.push(engine.last_grad_norm().unwrap() as f32);
        }
        assert_eq!(
            (engine.global_step(), engine.micro_step()),
            (STEPS, STEPS * gas)
        );
        let gathers = engine.gather_stats().map_or(0, |s| s.gathers);
        let params = param_data(engine.model())
            .into_iter()
            .map(|d| d.convert::<f32>().to_vec::<f32>().unwrap())
            .collect();
        Run {
            gathers,
            losses,
            norms,
            params,
        }
    })
}

fn check(world: usize, stage: u8, gas: usize, overlap: bool) {
    check_with(world, stage, gas, overlap, "");
}

fn check_with(world: usize, stage: u8, gas: usize, overlap: bool, extra: &str) {
    let runs = train(world, stage, gas, overlap, extra);
    let what = format!("world {world}, stage {stage}, gas {gas}, overlap {overlap}{extra}");
    // The weights are sharded: every micro-step gathers them (the exact counts are the
    // business of `zero3_gathers`).
    let sharded = stage == 3 && extra.contains("threshold\": 16");
    assert!(
        runs.iter().all(|r| (r.gathers >= STEPS * gas) == sharded),
        "{what}: gathers {:?}",
        runs.iter().map(|r| r.gathers).collect::<Vec<_>>()
    );
    for (rank, run) in runs.iter().enumerate() {
        for step in 0..STEPS {
            assert_close_to_reference(
                &format!("engine/loss_{step}"),
                &[run.losses[step]],
                RTOL,
                ATOL,
            );
            assert_close_to_reference(
                &format!("engine/norm_{step}"),
                &[run.norms[step]],
                RTOL,
                ATOL,
            );
        }
        for (i, p) in run.params.iter().enumerate() {
            assert_close_to_reference(&format!("engine/param_{i}"), p, RTOL, ATOL);
        }
        assert!(
            runs[0].params == run.params,
            "{what}: rank {rank} holds different parameters than rank 0"
        );
    }
    let norms = &runs[0].norms;
    assert!(
        norms.iter().any(|n| f64::from(*n) > CLIP),
        "{what}: clipping never triggered: {norms:?}"
    );
    assert!(
        norms.iter().any(|n| f64::from(*n) < CLIP),
        "{what}: every step clipped: {norms:?}"
    );
}

#[test]
fn stage0_matches_plain_burn() {
    for_world_sizes(&[1, 2, 3, 4], |world| {
        check(world, 0, 1, false);
        check(world, 0, 3, false);
    });
}

#[test]
fn stage1_matches_plain_burn() {
    for_world_sizes(&[1, 2, 3, 4], |world| {
        check(world, 1, 1, false);
        check(world, 1, 3, false);
    });
}

#[test]
fn stage2_matches_plain_burn() {
    for_world_sizes(&[1, 2, 3, 4], |world| {
        check(world, 2, 1, false);
        check(world, 2, 3, true);
    });
    check(3, 2, 3, false);
    check(4, 2, 1, true);
}

/// Stage 3 shards every weight (the biases, under the persistence threshold of 16 elements,
/// stay replicated); a tiny prefetch bucket and live budget exercise prefetch and release.
const SHARDED: &str = r#", "stage3_param_persistence_threshold": 16,
    "stage3_prefetch_bucket_size": 150, "stage3_max_live_parameters": 300"#;

#[test]
fn stage3_matches_plain_burn() {
    for_world_sizes(&[1, 2, 3, 4], |world| {
        check_with(world, 3, 1, false, SHARDED);
        check_with(world, 3, 3, true, SHARDED);
    });
    // Prefetch off, and everything persistent (nothing sharded).
    check_with(
        3,
        3,
        1,
        true,
        r#", "stage3_param_persistence_threshold": 16, "stage3_prefetch_bucket_size": 0"#,
    );
    check_with(
        2,
        3,
        3,
        false,
        r#", "stage3_param_persistence_threshold": 1000"#,
    );
}
