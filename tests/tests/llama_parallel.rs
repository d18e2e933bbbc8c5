//! The recipe's Llama sliced over 2 and 3 model-parallel thread ranks (heads by whole
//! key/value groups, the MLP's features and the vocabulary, uneven where the sizes are) against
//! the unsliced model: the loss of 5 Adam steps on every rank within fp32 tolerance of the
//! unsliced model's, tied and untied output projections. Adam's per-element steps make any
//! wrong gradient element show in the later losses. Gathering the slices back gives the
//! unsliced model exactly before training, and one whose loss matches the reference after.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_pipeline::ModelGroup;
use burn_zero::comm::Communicator;
use burn_zero::engine::ZeroAutodiff;
use burn_zero::testing::run_ranks;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::draw_parameters;
use burn_zero_llm::parallel::ParallelLlama;
use burn_zero_tests::cases::param_data;

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 5;
const LR: f64 = 3e-3;

fn tokens(step: usize, vocab: usize, device: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
    let ids = synthetic_ids(0x9e37_79b9u64.wrapping_mul(step as u64 + 3), 2 * 7, vocab);
    Tensor::from_data(TensorData::new(ids, [2, 7]), device)
}

fn sliced_llama_matches(config: LlamaConfig, ranks: usize) {
    let device = Default::default();
    let full = draw_parameters(config.init::<B>(&device));
    let vocab = config.vocab_size;
    let mut reference = full.clone();
    let mut optim = AdamConfig::new().init();
    let mut want = Vec::new();
    for step in 0..STEPS {
        let loss = reference.loss(tokens(step % 2, vocab, &device));
        want.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }
    assert!(want[STEPS - 1] < want[0], "the reference trains: {want:?}");
    let probe = tokens(7, vocab, &device);
    let want_after = reference.loss(probe.clone()).into_scalar();
    let results = run_ranks(ranks, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut model = ParallelLlama::slice(&full, ModelGroup::new(comm)).unwrap();
        let untrained = model.gather(full.clone()).unwrap();
        assert!(
            param_data(&untrained) == param_data(&full),
            "slicing and gathering gives the model back"
        );
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let loss = model.loss(tokens(step % 2, vocab, &device));
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(LR, model, grads);
        }
        let gathered = model.gather(full.clone()).unwrap();
        (losses, gathered.loss(probe.clone()).into_scalar())
    });
    for (rank, (got, after)) in results.into_iter().enumerate() {
        assert!(
            (after - want_after).abs() <= 2e-5 * want_after.abs().max(1.0),
            "{ranks} ranks, rank {rank}: the gathered model's loss {after} vs {want_after}"
        );
        for (step, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-5 * b.abs().max(1.0),
                "{ranks} ranks, rank {rank}, step {step}: {a} vs {b} ({got:?} vs {want:?})"
            );
        }
    }
}

#[test]
fn two_way_tied_llama_matches_the_unsliced_one() {
    sliced_llama_matches(LlamaConfig::new(24, 16, 20, 2, 4, 2), 2);
}

#[test]
fn three_way_untied_uneven_llama_matches_the_unsliced_one() {
    let config = LlamaConfig::new(25, 24, 20, 2, 6, 3).with_tie_embeddings(false);
    sliced_llama_matches(config, 3);
}

#[test]
fn too_few_key_value_heads_are_refused_by_name() {
    let device = Default::default();
    let full = LlamaConfig::new(24, 16, 20, 1, 4, 2).init::<B>(&device);
    let errors = run_ranks(3, |ctx| {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        ParallelLlama::slice(&full, ModelGroup::new(comm)).err()
    });
    for e in errors {
        let e = e.expect("refused");
        assert!(
            e.contains("2 key/value heads") && e.contains("3 model-parallel ranks"),
            "{e}"
        );
    }
}
