//! The recipe's Llama split into pipeline stages (embedding first, norm and output projection
//! last, decoder layers by `split` bounds) on thread ranks, 1F1B over 4 micro-batches, against
//! the unsplit model on the whole batch: the loss of 5 Adam steps within fp32 tolerance, for 2
//! and 3 stages, with untied and tied embeddings (the tied table's two copies summing their
//! gradients across the first and last stages).

use std::sync::Arc;

use burn::backend::NdArray;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_pipeline::{Replicated, Schedule, StageSpec, run_step};
use burn_zero::comm::Communicator;
use burn_zero::engine::ZeroAutodiff;
use burn_zero::testing::run_ranks;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::{cross_entropy, draw_parameters};
use burn_zero_llm::pipeline::{LlamaStage, ids_as_input};

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 5;
const MICRO: usize = 4;
const BATCH: usize = 2;
const SEQ: usize = 6;
const LR: f64 = 3e-3;

fn config(tied: bool) -> LlamaConfig {
    LlamaConfig::new(24, 16, 20, 4, 4, 2).with_tie_embeddings(tied)
}

/// Step `step`'s tokens `[MICRO·BATCH, SEQ + 1]`.
fn tokens(step: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let state = 0x51_7cc1u64.wrapping_mul(step as u64 % 2 + 5);
    let ids = synthetic_ids(state, MICRO * BATCH * (SEQ + 1), 24);
    Tensor::from_data(TensorData::new(ids, [MICRO * BATCH, SEQ + 1]), device)
}

/// Micro-batch `mb`'s inputs and targets.
fn micro(
    step: usize,
    mb: usize,
    device: &burn::tensor::Device<B>,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let t = tokens(step, device).slice([mb * BATCH..(mb + 1) * BATCH, 0..SEQ + 1]);
    (
        t.clone().slice([0..BATCH, 0..SEQ]),
        t.slice([0..BATCH, 1..SEQ + 1]),
    )
}

/// `bounds` as stage layer ranges.
fn ranges(bounds: &[usize]) -> Vec<std::ops::Range<usize>> {
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

fn pipeline_matches(bounds: &[usize], tied: bool) {
    let device = Default::default();
    let full = draw_parameters(config(tied).init::<B>(&device));
    let mut reference = full.clone();
    let mut optim = AdamConfig::new().init();
    let mut want = Vec::new();
    for step in 0..STEPS {
        let loss = reference.loss(tokens(step, &device));
        want.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }
    let stages = bounds.len() - 1;
    let layers = ranges(bounds);
    let results = run_ranks(stages, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let stage = ctx.rank;
        let mut part = LlamaStage::new(&full, &layers, stage, SEQ).unwrap();
        let mut optim = Replicated(AdamConfig::new().init::<B, LlamaStage<B>>());
        let stream = Schedule::OneFOneB.stream(stages, MICRO, stage);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let inputs = |mb: usize| ids_as_input(micro(step, mb, &device).0);
            let loss = |mb: usize, logits: Tensor<B, 2>| {
                let vocab = logits.dims()[1];
                cross_entropy(
                    logits.reshape([BATCH, SEQ, vocab]),
                    micro(step, mb, &device).1,
                )
            };
            let spec = StageSpec {
                stage,
                stages,
                micro_batches: MICRO,
                rows: if stage == 0 { BATCH } else { BATCH * SEQ },
                in_features: if stage == 0 { SEQ } else { 16 },
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            };
            let (next, l) =
                run_step(part, &mut optim, LR, &stream, &spec, comm.as_ref(), None).unwrap();
            part = next;
            losses.extend(l);
        }
        losses
    });
    let got = &results[stages - 1];
    assert_eq!(got.len(), STEPS);
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * b.abs().max(1.0),
            "{stages} stages (tied: {tied}), step {step}: {got:?} vs {want:?}"
        );
    }
    assert!(want[STEPS - 1] < want[0], "the reference trains: {want:?}");
}

#[test]
fn two_stages_match_the_unsplit_llama() {
    pipeline_matches(&[0, 2, 4], false);
}

#[test]
fn three_uneven_stages_match_the_unsplit_llama() {
    pipeline_matches(&[0, 1, 3, 4], false);
}

/// Tied embeddings: the last stage's copy and the first stage's table take the summed
/// gradient, so they stay equal and the loss follows the unsplit model's.
#[test]
fn tied_embeddings_across_stages_match_the_unsplit_llama() {
    pipeline_matches(&[0, 2, 4], true);
    pipeline_matches(&[0, 1, 3, 4], true);
    pipeline_matches(&[0, 4], true);
}

#[test]
fn bad_bounds_are_refused() {
    let device = Default::default();
    let model = config(false).init::<B>(&device);
    for stages in [
        ranges(&[0, 3]),
        ranges(&[1, 4]),
        vec![0..3, 2..4],
        vec![0..2, 3..4],
    ] {
        let err = LlamaStage::new(&model, &stages, 0, SEQ).unwrap_err();
        assert!(err.contains("do not split 4 layers"), "{err}");
    }
    let err = LlamaStage::new(&model, &ranges(&[0, 4]), 1, SEQ).unwrap_err();
    assert!(err.contains("no stage 1"), "{err}");
}
