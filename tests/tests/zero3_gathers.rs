//! ZeRO-3's collectives, counted and ordered by a recording communicator (independent of the
//! engine's own bookkeeping): with prefetch off, one all-gather per sharded parameter per
//! forward use and per backward use; with prefetch on, the very same all-gathers in the same
//! order, but issued ahead of their use.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::{Communicator, OpKind};
use burn_zero::engine::{GatherEvent, ZeroAutodiff, initialize};
use burn_zero::testing::{RecordingComm, run_ranks};
use burn_zero_tests::cases::Stack;

type B = ZeroAutodiff<NdArray>;

const LAYERS: usize = 8;
const WIDTH: usize = 7;
const PASSES: usize = 3;

/// Per pass: the labels of the all-gathers the communicator saw (parameter index + 1), and
/// the engine's events.
type Passes = Vec<(Vec<u64>, Vec<GatherEvent>)>;

fn run(world: usize, prefetch_bucket: usize) -> Vec<Passes> {
    let json = format!(
        r#"{{"train_batch_size": {world}, "optimizer": {{"type": "SGD", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
              "stage3_prefetch_bucket_size": {prefetch_bucket}, "stage3_max_live_parameters": 1000,
              "stage3_max_reuse_distance": 0}}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).unwrap().config;
    run_ranks(world, |ctx| {
        let device = Default::default();
        let comm = Arc::new(RecordingComm::new(ctx.comm));
        let mut engine = initialize::<NdArray, _>(
            Stack::<B>::new(LAYERS, WIDTH, &device),
            &config,
            comm.clone() as Arc<dyn Communicator>,
        )
        .unwrap();
        comm.take();
        (0..PASSES)
            .map(|step| {
                let x = Tensor::<B, 2>::ones([2, WIDTH], &device).mul_scalar(0.1 * step as f32);
                let loss = engine
                    .model()
                    .forward(x)
                    .powf_scalar(2.0)
                    .sum()
                    .reshape([1]);
                engine.backward(loss).unwrap();
                engine.step().unwrap();
                let labels = comm
                    .take()
                    .into_iter()
                    .filter(|c| c.kind == OpKind::AllGather && c.label != 0)
                    .map(|c| c.label)
                    .collect();
                (labels, engine.gather_stats().unwrap().last_pass)
            })
            .collect()
    })
}

/// Forward uses layers 1..=8; backward uses 8..=2 (the first layer's weight is not needed:
/// the input has no gradient). A replayed pass keeps layer 8 from its forward use for its
/// backward use right after (no parameter in between), so it is gathered once.
fn expected(replay: bool) -> Vec<u64> {
    let forward = 1..=LAYERS as u64;
    let backward = (2..=LAYERS as u64 - u64::from(replay)).rev();
    forward.chain(backward).collect()
}

#[test]
fn prefetch_off_gathers_once_per_use_on_demand() {
    for world in [1, 3] {
        for (rank, passes) in run(world, 0).into_iter().enumerate() {
            for (pass, (labels, events)) in passes.iter().enumerate() {
                let what = format!("world {world}, rank {rank}, pass {pass}");
                // One rank's gathers return their input: nothing reaches the communicator.
                let sent = if world == 1 {
                    vec![]
                } else {
                    expected(pass > 0)
                };
                assert_eq!(labels, &sent, "{what}");
                let gathers: Vec<_> = events
                    .iter()
                    .filter_map(|e| match e {
                        GatherEvent::Gather { slot, ahead } => Some((*slot as u64 + 1, *ahead)),
                        _ => None,
                    })
                    .collect();
                assert_eq!(
                    gathers,
                    expected(pass > 0)
                        .into_iter()
                        .map(|l| (l, false))
                        .collect::<Vec<_>>(),
                    "{what}: every gather on demand"
                );
            }
        }
    }
}

#[test]
fn prefetch_on_issues_the_same_gathers_ahead_of_use() {
    let world = 3;
    let off = run(world, 0);
    // One layer (49 elements) in flight at a time.
    let on = run(world, WIDTH * WIDTH);
    for (rank, (off, on)) in off.iter().zip(&on).enumerate() {
        for pass in 0..PASSES {
            let what = format!("rank {rank}, pass {pass}");
            let (labels, events) = &on[pass];
            assert_eq!(
                labels, &off[pass].0,
                "{what}: the same gathers in the same order"
            );
            if pass == 0 {
                continue; // recording: nothing to prefetch from
            }
            // Only the very first use waits; every later use finds its parameter gathered.
            let uses: Vec<bool> = events
                .iter()
                .filter_map(|e| match e {
                    GatherEvent::Use { ready, .. } => Some(*ready),
                    _ => None,
                })
                .collect();
            assert_eq!(uses.len(), 2 * LAYERS - 1, "{what}");
            assert!(
                !uses[0] && uses[1..].iter().all(|r| *r),
                "{what}: {events:?}"
            );
            let ahead = events
                .iter()
                .filter(|e| matches!(e, GatherEvent::Gather { ahead: true, .. }))
                .count();
            assert_eq!(ahead, labels.len() - 1, "{what}: all but the first ahead");
            // Each prefetch is issued before the use it serves.
            for (i, e) in events.iter().enumerate() {
                if let GatherEvent::Use { slot, ready: true } = e {
                    let gathered_before = events[..i]
                        .iter()
                        .any(|g| matches!(g, GatherEvent::Gather { slot: s, .. } if s == slot));
                    assert!(gathered_before, "{what}: use of {slot} at event {i}");
                }
            }
        }
    }
}

#[test]
fn ranks_that_gather_different_parameters_are_named_not_hung() {
    let json = r#"{"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}"#;
    let config = DeepSpeedConfig::from_json(json).unwrap().config;
    let timeout = std::time::Duration::from_secs(30);
    let start = std::time::Instant::now();
    let failures = burn_zero::testing::try_run_ranks(2, timeout, |ctx| {
        let device = Default::default();
        let rank = ctx.rank;
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let engine =
            initialize::<NdArray, _>(Stack::<B>::new(LAYERS, WIDTH, &device), &config, comm)
                .unwrap();
        // Rank 1 skips the third layer: at the third gather it asks for the fourth.
        let skip = (rank == 1).then_some(2);
        let x = Tensor::<B, 2>::ones([2, WIDTH], &device);
        let _ = engine.model().forward_skipping(x, skip);
    })
    .expect_err("diverged ranks must fail");
    assert!(
        start.elapsed() < timeout,
        "no rank may wait out its timeout"
    );
    let messages: Vec<String> = failures.iter().map(|f| f.message.clone()).collect();
    let named = messages.iter().any(|m| {
        m.contains("ZeRO-3 ranks diverged")
            && m.contains("`layers.2.weight`")
            && m.contains("`layers.3.weight`")
            && m.contains("rank 0")
            && m.contains("rank 1")
    });
    assert!(named, "{messages:#?}");
}

#[test]
fn full_parameters_stream_one_at_a_time_or_come_as_a_model() {
    use burn_zero_tests::cases::param_data;
    let config = |flag: bool| {
        let json = format!(
            r#"{{"train_batch_size": 3, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
                "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                  "stage3_gather_16bit_weights_on_model_save": {flag}}}}}"#
        );
        DeepSpeedConfig::from_json(&json).unwrap().config
    };
    run_ranks(3, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        for flag in [false, true] {
            let model = Stack::<B>::new(3, WIDTH, &device);
            let mut engine = initialize::<NdArray, _>(model, &config(flag), comm.clone()).unwrap();
            let x = Tensor::<B, 2>::ones([2, WIDTH], &device);
            let loss = engine.model().forward(x).sum().reshape([1]);
            engine.backward(loss).unwrap();
            engine.step().unwrap();
            // What the ops see through the sharded handles...
            let through_handles: Vec<Vec<f32>> = param_data(engine.model())
                .into_iter()
                .map(|d| d.to_vec().unwrap())
                .collect();
            // ...equals the streamed parameters.
            let mut streamed = Vec::new();
            engine
                .for_each_full_param(|slot, values| {
                    assert_eq!(slot.name, format!("layers.{}.weight", streamed.len()));
                    streamed.push(values.into_data().to_vec::<f32>().unwrap());
                })
                .unwrap();
            assert_eq!(streamed, through_handles);
            let full = engine.full_model();
            if !flag {
                let err = full.expect_err("stage 3 needs the flag").to_string();
                assert!(
                    err.contains("stage3_gather_16bit_weights_on_model_save"),
                    "{err}"
                );
                continue;
            }
            let full = full.unwrap();
            let model = engine.into_model().unwrap();
            for m in [full, model] {
                let values: Vec<Vec<f32>> = param_data(&m)
                    .into_iter()
                    .map(|d| d.to_vec().unwrap())
                    .collect();
                assert_eq!(values, streamed);
                let mut local = true;
                struct Locality<'a>(&'a mut bool);
                impl burn::module::ModuleVisitor<B> for Locality<'_> {
                    fn visit_float<const D: usize>(
                        &mut self,
                        param: &burn::module::Param<Tensor<B, D>>,
                    ) {
                        let zero = param.val().inner().into_primitive().tensor();
                        *self.0 &= zero.is_local();
                    }
                }
                burn::module::Module::visit(&m, &mut Locality(&mut local));
                assert!(local, "every parameter is full and local");
            }
        }
    });
}
