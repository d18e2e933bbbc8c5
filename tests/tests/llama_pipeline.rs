//! The recipe's Llama split into pipeline stages (embedding first, norm and output projection
//! last, decoder layers by `split` bounds) on thread ranks, 4 micro-batches, against the
//! unsplit model on the whole batch: the loss of 5 Adam steps within fp32 tolerance, for 2
//! and 3 stages, with untied and tied embeddings (the tied table's two copies summing their
//! gradients across the first and last stages). 1F1B; zero-bubble ZB-H1, where every
//! projection's weight gradient waits for its weight half; interleaved 1F1B over 2 ranks × 2
//! chunks (virtual stages: one layer each).

use std::sync::Arc;

use burn::backend::NdArray;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_pipeline::{Replicated, Schedule, StageOptimizer, StageSpec, Zero2, run_chunks};
use burn_zero::comm::Communicator;
use burn_zero::config::{OptimizerKind, OptimizerParams};
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

fn config(tied: bool, layers: usize) -> LlamaConfig {
    LlamaConfig::new(24, 16, 20, layers, 4, 2).with_tie_embeddings(tied)
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
    schedule_matches(bounds, tied, Schedule::OneFOneB, Options::default());
}

/// What a case changes beyond bounds, tying and schedule.
#[derive(Clone, Copy, Default, Debug)]
struct Options {
    /// Step with [`Zero2`] instead of burn's Adam.
    zero2: bool,
    /// Checkpoint every decoder layer (in the reference too).
    checkpointed: bool,
    /// Decoder layers beyond the default 4 (a split over more virtual stages).
    more_layers: usize,
}

/// burn's Adam with PyTorch's ε (what burn-zero's Adam uses).
fn adam() -> AdamConfig {
    AdamConfig::new().with_epsilon(1e-8)
}

/// `bounds` are the virtual stages' layers: `schedule.chunks()` per rank. Each chunk steps with
/// burn's Adam, or with [`Zero2`] (one data rank: the partition is the whole stage, and a tied
/// matrix's gradient stays whole until the pipeline's ends have summed it).
fn schedule_matches(bounds: &[usize], tied: bool, schedule: Schedule, options: Options) {
    let Options {
        zero2,
        checkpointed,
        more_layers,
    } = options;
    let device = Default::default();
    let full = draw_parameters(config(tied, 4 + more_layers).init::<B>(&device))
        .with_activation_checkpointing(checkpointed);
    let mut reference = full.clone();
    let mut optim = adam().init();
    let mut want = Vec::new();
    for step in 0..STEPS {
        let loss = reference.loss(tokens(step, &device));
        want.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }
    let stages = bounds.len() - 1;
    let chunks = schedule.chunks();
    let ranks = stages / chunks;
    let layers = ranges(bounds);
    let results = run_ranks(ranks, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mine: Vec<usize> = (0..chunks).map(|c| c * ranks + ctx.rank).collect();
        let mut parts: Vec<LlamaStage<B>> = mine
            .iter()
            .map(|&stage| LlamaStage::new(&full, &layers, stage, SEQ).unwrap())
            .collect();
        let mut optims: Vec<Box<dyn StageOptimizer<B, LlamaStage<B>>>> = mine
            .iter()
            .map(|_| -> Box<dyn StageOptimizer<B, LlamaStage<B>>> {
                match zero2 {
                    true => Box::new(Zero2::new(
                        OptimizerKind::Adam {
                            decoupled_weight_decay: false,
                        },
                        OptimizerParams::default(),
                    )),
                    false => Box::new(Replicated(adam().init::<B, LlamaStage<B>>())),
                }
            })
            .collect();
        let stream = schedule.stream(ranks, MICRO, ctx.rank);
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
            let specs: Vec<StageSpec<'_, B>> = mine
                .iter()
                .map(|&stage| StageSpec {
                    stage,
                    stages,
                    micro_batches: MICRO,
                    rows: if stage == 0 { BATCH } else { BATCH * SEQ },
                    in_features: if stage == 0 { SEQ } else { 16 },
                    inputs: &inputs,
                    loss: &loss,
                    checkpoint: None,
                })
                .collect();
            let (next, l) =
                run_chunks(parts, &mut optims, LR, &stream, &specs, comm.as_ref(), None).unwrap();
            parts = next;
            losses.extend(l);
        }
        losses
    });
    let got = &results[ranks - 1];
    assert_eq!(got.len(), STEPS);
    for (step, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * b.abs().max(1.0),
            "{schedule:?}, {stages} stages (tied: {tied}, {options:?}), step {step}: \
             {got:?} vs {want:?}"
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

/// ZB-H1: the projections' weight gradients (the untied output projection's too) computed in
/// the weight halves, the rest in the input halves.
#[test]
fn zero_bubble_stages_match_the_unsplit_llama() {
    for tied in [false, true] {
        let zb = Schedule::ZeroBubbleH1;
        schedule_matches(&[0, 1, 3, 4], tied, zb, Options::default());
        schedule_matches(&[0, 2, 4], tied, zb, Options::default());
    }
}

/// Interleaved 1F1B, 2 ranks × 2 chunks of one layer: rank 0 holds the embedding with layer 0
/// and layer 2, rank 1 layer 1 and layer 3 with the norm and output projection.
#[test]
fn interleaved_stages_match_the_unsplit_llama() {
    for tied in [false, true] {
        let interleaved = Schedule::Interleaved { chunks: 2 };
        schedule_matches(&[0, 1, 2, 3, 4], tied, interleaved, Options::default());
    }
}

/// ZeRO-2's stage optimizer, tied and untied, under 1F1B and ZB-H1 (two accumulations per
/// micro-batch, one per half).
#[test]
fn zero2_stages_match_the_unsplit_llama() {
    for tied in [false, true] {
        for schedule in [Schedule::OneFOneB, Schedule::ZeroBubbleH1] {
            let options = Options {
                zero2: true,
                ..Options::default()
            };
            schedule_matches(&[0, 2, 4], tied, schedule, options);
        }
    }
}

/// Every decoder layer checkpointed inside its stage (it runs again in backward, its weights'
/// gradients with its input's, also under ZB-H1), in 1F1B and ZB-H1 and interleaved.
#[test]
fn checkpointed_layers_in_stages_match_the_unsplit_llama() {
    let options = Options {
        checkpointed: true,
        ..Options::default()
    };
    schedule_matches(&[0, 1, 3, 4], true, Schedule::OneFOneB, options);
    schedule_matches(&[0, 2, 4], true, Schedule::OneFOneB, options);
    schedule_matches(&[0, 2, 4], false, Schedule::ZeroBubbleH1, options);
    let interleaved = Schedule::Interleaved { chunks: 2 };
    schedule_matches(&[0, 1, 2, 3, 4], false, interleaved, options);
}

/// Under a split backward a checkpointed decoder layer defers its seven projections' weight
/// gradients, read from its recompute's own backward, as a layer kept whole does (before, its
/// recompute took them, and ZB-H1 deferred nothing on checkpointed stages), and the input
/// half leaves those weights without a gradient.
#[test]
fn checkpointed_layers_defer_their_projections() {
    use burn::module::Module;
    use burn::tensor::backend::AutodiffBackend;
    use burn_pipeline::{PipeStage, WeightSplit};
    let device = Default::default();
    for checkpointed in [false, true] {
        let model = draw_parameters(config(true, 4).init::<B>(&device))
            .with_activation_checkpointing(checkpointed);
        let stage = LlamaStage::new(&model, &ranges(&[0, 3, 4]), 0, SEQ).unwrap();
        let (ids, _) = micro(0, 0, &device);
        let mut split = WeightSplit::new();
        let out = stage.forward_split(ids_as_input(ids), &mut split);
        assert_eq!(split.deferred(), if checkpointed { 0 } else { 21 });
        let grads = out.sum().backward();
        assert_eq!(
            split.deferred(),
            21,
            "checkpointed {checkpointed}: 3 layers × 7"
        );
        let mut with_grads = 0;
        stage.visit(&mut CountGrads(&grads, &mut with_grads));
        // The embedding and each layer's two norms; no projection.
        assert_eq!(with_grads, 1 + 3 * 2, "checkpointed {checkpointed}");
    }
    struct CountGrads<'a>(&'a <B as AutodiffBackend>::Gradients, &'a mut usize);
    impl burn::module::ModuleVisitor<B> for CountGrads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            if param.val().grad(self.0).is_some() {
                *self.1 += 1;
            }
        }
    }
}

#[test]
fn bad_bounds_are_refused() {
    let device = Default::default();
    let model = config(false, 4).init::<B>(&device);
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

/// Interleaved 1F1B over 4 ranks × 2 chunks (the 3B's layout on 4 GPUs: the wrap-around from
/// rank 3 to rank 0 carries both a chunk boundary and the tied table's gradient), tied and
/// checkpointed, 8 layers one per virtual stage.
#[test]
fn interleaved_over_four_ranks_matches_the_unsplit_llama() {
    let options = Options {
        checkpointed: true,
        more_layers: 4,
        ..Options::default()
    };
    let interleaved = Schedule::Interleaved { chunks: 2 };
    schedule_matches(&[0, 1, 2, 3, 4, 5, 6, 7, 8], true, interleaved, options);
}
