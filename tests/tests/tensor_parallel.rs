//! Tensor slicing on thread ranks against the unsliced model in one process: a vocab-parallel
//! embedding, a column → row-parallel MLP with a residual, a column-parallel head and the
//! vocab-parallel cross-entropy, 2 and 3 ranks (3 splits the vocabulary 10 and the hidden 8
//! unevenly), 10 Adam steps: every rank's loss and every slice of every parameter match the
//! reference (built from burn's own `Embedding`, `Linear` and `log_softmax`) within fp32
//! tolerance.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, activation};
use burn_pipeline::tensor_parallel::slice_of;
use burn_pipeline::{
    ColumnParallelLinear, ModelGroup, RowParallelLinear, VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
};
use burn_zero::comm::Communicator;
use burn_zero::engine::ZeroAutodiff;
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::{assert_close, f32_values, seeded_linear, tensor};

type B = ZeroAutodiff<NdArray>;

const VOCAB: usize = 10;
const MODEL: usize = 6;
const HIDDEN: usize = 8;
const BATCH: usize = 3;
const SEQ: usize = 5;
const STEPS: usize = 10;
const LR: f64 = 0.02;

#[derive(Module, Debug)]
struct Full<B: Backend> {
    embed: Embedding<B>,
    up: Linear<B>,
    down: Linear<B>,
    head: Linear<B>,
}

fn full_model(device: &burn::tensor::Device<B>) -> Full<B> {
    let mut embed = EmbeddingConfig::new(VOCAB, MODEL).init::<B>(device);
    embed.weight = Param::from_tensor(tensor::<B, 2>([VOCAB, MODEL], 3, device));
    Full {
        embed,
        up: seeded_linear(MODEL, HIDDEN, 10, device),
        down: seeded_linear(HIDDEN, MODEL, 20, device),
        head: seeded_linear(MODEL, VOCAB, 30, device),
    }
}

/// Step `step`'s token ids `[BATCH, SEQ]` and targets `[BATCH·SEQ]`: three batches in turn,
/// so steps 0 and 9 see the same one (the reference's loss on it must have dropped).
fn batch(step: usize, device: &burn::tensor::Device<B>) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>) {
    let mut s = 2654435761u64.wrapping_mul((step % 3) as u64 + 7);
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) % VOCAB as u64) as i64
    };
    let ids: Vec<i64> = (0..BATCH * SEQ).map(|_| next()).collect();
    let targets: Vec<i64> = (0..BATCH * SEQ).map(|_| next()).collect();
    (
        Tensor::from_data(TensorData::new(ids, [BATCH, SEQ]), device),
        Tensor::from_data(TensorData::new(targets, [BATCH * SEQ]), device),
    )
}

/// The unsliced model's losses and final parameters.
fn reference() -> (Vec<f32>, Full<B>) {
    let device = Default::default();
    let mut model = full_model(&device);
    let mut optim = AdamConfig::new().init::<B, Full<B>>();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (ids, targets) = batch(step, &device);
        let h = model.embed.forward(ids);
        let h = h.clone() + model.down.forward(activation::tanh(model.up.forward(h)));
        let logits = model.head.forward(h).reshape([BATCH * SEQ, VOCAB]);
        let picked = activation::log_softmax(logits, 1).gather(1, targets.unsqueeze_dim(1));
        let loss = picked.mean().neg();
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, model)
}

#[derive(Module, Debug)]
struct Sliced<B: Backend> {
    embed: VocabParallelEmbedding<B>,
    up: ColumnParallelLinear<B>,
    down: RowParallelLinear<B>,
    head: ColumnParallelLinear<B>,
}

fn sliced_matches_the_reference(ranks: usize) {
    let (ref_losses, reference) = reference();
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0],
        "the reference trains: {ref_losses:?}"
    );
    let results = run_ranks(ranks, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let group = ModelGroup::new(comm);
        let full = full_model(&device);
        let mut model = Sliced::<B> {
            embed: VocabParallelEmbedding::from_embedding(&full.embed, &group),
            up: ColumnParallelLinear::from_linear(&full.up, &group),
            down: RowParallelLinear::from_linear(&full.down, &group),
            head: ColumnParallelLinear::from_linear(&full.head, &group),
        };
        let vocab = group.slice_of(VOCAB);
        let mut optim = AdamConfig::new().init::<B, Sliced<B>>();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (ids, targets) = batch(step, &device);
            let h = model.embed.forward(ids, &group);
            let inner = activation::tanh(model.up.forward(h.clone(), &group));
            let h = h + model.down.forward(inner, &group);
            let logits = model
                .head
                .forward(h, &group)
                .reshape([BATCH * SEQ, vocab.len()]);
            let loss = vocab_parallel_cross_entropy(logits, targets, vocab.start, &group);
            losses.push(loss.clone().into_scalar());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(LR, model, grads);
        }
        (losses, model)
    });
    for (rank, (losses, model)) in results.into_iter().enumerate() {
        assert_close(&format!("rank {rank} losses"), losses, ref_losses.clone());
        let (vocab, hidden) = (slice_of(VOCAB, rank, ranks), slice_of(HIDDEN, rank, ranks));
        let r = &reference;
        let checks = [
            (
                "embed",
                model.embed.weight.val(),
                r.embed.weight.val().slice([vocab.clone(), 0..MODEL]),
            ),
            (
                "up.weight",
                model.up.weight.val(),
                r.up.weight.val().slice([0..MODEL, hidden.clone()]),
            ),
            (
                "down.weight",
                model.down.weight.val(),
                r.down.weight.val().slice([hidden.clone(), 0..MODEL]),
            ),
            (
                "head.weight",
                model.head.weight.val(),
                r.head.weight.val().slice([0..MODEL, vocab.clone()]),
            ),
        ];
        for (name, got, want) in checks {
            assert_close(
                &format!("rank {rank} {name}"),
                f32_values(got),
                f32_values(want),
            );
        }
        let bias = |l: &Option<Param<Tensor<B, 1>>>| f32_values(l.as_ref().unwrap().val());
        assert_close(
            &format!("rank {rank} up.bias"),
            bias(&model.up.bias),
            f32_values(r.up.bias.as_ref().unwrap().val().slice([hidden])),
        );
        assert_close(
            &format!("rank {rank} down.bias"),
            bias(&model.down.bias),
            bias(&r.down.bias),
        );
        assert_close(
            &format!("rank {rank} head.bias"),
            bias(&model.head.bias),
            f32_values(r.head.bias.as_ref().unwrap().val().slice([vocab])),
        );
    }
}

#[test]
fn two_way_slicing_matches_the_unsliced_model() {
    sliced_matches_the_reference(2);
}

#[test]
fn three_way_uneven_slicing_matches_the_unsliced_model() {
    sliced_matches_the_reference(3);
}
