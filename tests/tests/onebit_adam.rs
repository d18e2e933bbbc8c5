//! 1-bit Adam (`optimizer.type = "OneBitAdam"`) on 3 thread ranks at ZeRO stage 0: full Adam
//! for `freeze_step` steps, then the variance frozen and the update averaged 1-bit compressed
//! with error feedback instead of the gradients all-reduced. Every rank ends with the same
//! parameters, each compressed exchange sends at least 5× fewer bytes than an fp32 all-reduce
//! of the momentum, and the loss over the last steps is no more than 1% above the
//! same optimizer never compressing.

use std::sync::Arc;

use burn::backend::NdArray;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::engine_run::GLOBAL_BATCH;
use burn_zero_tests::cases::{Mlp, param_values};
use burn_zero_tests::engine_loop::train_step;

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 16;

fn config(freeze_step: usize, stage: u8) -> DeepSpeedConfig {
    let json = format!(
        r#"{{"train_batch_size": {GLOBAL_BATCH}, "gradient_clipping": 0.0,
            "optimizer": {{"type": "OneBitAdam", "params": {{"lr": 0.01, "weight_decay": 0.01,
                "freeze_step": {freeze_step}, "cuda_aware": false, "comm_backend_name": "nccl"}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    DeepSpeedConfig::from_json(&json).unwrap().config
}

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    /// (compressed, fp32 all-reduce) bytes of each step's exchange.
    volumes: Vec<Option<(usize, usize)>>,
}

fn train(freeze_step: usize, world: usize) -> Vec<Run> {
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let model = Mlp::<B>::new(&device);
        let mut engine =
            initialize::<NdArray, _>(model, &config(freeze_step, 0), comm.clone()).unwrap();
        let (mut losses, mut volumes) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            losses.push(train_step(
                &mut engine,
                comm.as_ref(),
                step,
                ctx.rank,
                world,
            ));
            let v = engine.compressed_volume();
            volumes.push(v.map(|v| (v.compressed, v.fp32_allreduce)));
        }
        let params = param_values(engine.model());
        Run {
            losses,
            params,
            volumes,
        }
    })
}

#[test]
fn compressed_momentum_trains_like_adam_on_fewer_bytes() {
    let (world, freeze) = (3, 5);
    let compressed = train(freeze, world);
    let full = train(1_000_000, world);
    for run in &compressed {
        assert!(
            run.params == compressed[0].params,
            "every rank holds the same parameters"
        );
        for (step, v) in run.volumes.iter().enumerate() {
            match (step < freeze, v) {
                (true, None) => {}
                (false, Some((sent, fp32))) => {
                    assert!(
                        5 * sent <= *fp32,
                        "step {step}: {sent} bytes vs {fp32} in fp32"
                    )
                }
                other => panic!("step {step}: {other:?}"),
            }
        }
    }
    assert!(full[0].volumes.iter().all(Option::is_none));
    let (a, b) = (&compressed[0].losses, &full[0].losses);
    assert_eq!(a[..freeze], b[..freeze], "the warm-up is plain Adam");
    assert!(a[STEPS - 1] < a[0], "it trains: {a:?}");
    // Each step draws a new batch: compare the mean of the last 6 steps' losses.
    let tail = |l: &[f32]| l[STEPS - 6..].iter().sum::<f32>() / 6.0;
    let (ours, adam) = (tail(a), tail(b));
    // Compression must not cost more than 1% (on this small noisy problem it may gain).
    let kept = ours <= 1.01 * adam;
    assert!(kept, "mean loss {ours} vs Adam's {adam}\n{a:?}\n{b:?}");
}

#[test]
fn one_bit_adam_needs_stage_0() {
    let err = config(5, 2).resolve(2).unwrap_err().to_string();
    assert!(
        err.contains("OneBitAdam") && err.contains("stage 0"),
        "{err}"
    );
}
