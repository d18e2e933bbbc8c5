//! The Llama's chunked loss (`Llama::with_chunked_loss`, `burn_zero::nn::linear_cross_entropy`)
//! against its materialized loss: the same loss and the same gradient for every parameter,
//! tied and untied, with a chunk size that divides neither the batch nor the tokens. The
//! reference is burn's own autodiff of the materialized logits; the chunked op has a backward
//! of its own.

use burn::backend::NdArray;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::engine::{ZeroAutodiff, construct_full_from};
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::shared_init::SharedInit;

type B = ZeroAutodiff<NdArray>;

/// Every parameter's gradient, in module order.
fn gradients(
    model: &burn_zero_llm::Llama<B>,
    grads: &<B as AutodiffBackend>::Gradients,
) -> Vec<Vec<f32>> {
    struct Collect<'a> {
        grads: &'a <B as AutodiffBackend>::Gradients,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = param
                .val()
                .grad(self.grads)
                .expect("every parameter has a gradient");
            self.out.push(g.into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    collect.out
}

#[test]
fn chunked_loss_equals_the_materialized_one_with_its_gradients() {
    let device = Default::default();
    for tied in [false, true] {
        // Odd vocabulary and widths; 3 sequences of 11 tokens (33 rows) in chunks of 7.
        let config = LlamaConfig::new(53, 24, 40, 2, 6, 2)
            .with_tie_embeddings(tied)
            .with_max_seq_len(64);
        let ids: Vec<i64> = (0..3 * 12).map(|i| (i * 31 + 5) % 53).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [3, 12]), &device);
        let run = |chunk: usize| {
            let model = construct_full_from(config.init::<B>(&device), &SharedInit { seed: 7 })
                .with_chunked_loss(chunk);
            let loss = model.loss(tokens.clone());
            let grads = loss.backward();
            let value = loss.into_data().to_vec::<f32>().unwrap()[0];
            (value, gradients(&model, &grads))
        };
        let (want, want_grads) = run(0);
        let (got, got_grads) = run(7);
        assert!(
            (want - got).abs() <= 1e-5 * want.abs(),
            "tied {tied}: loss {want} vs {got}"
        );
        assert_eq!(want_grads.len(), got_grads.len());
        for (p, (a, b)) in want_grads.iter().zip(&got_grads).enumerate() {
            let scale = a.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-6);
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 1e-4 * scale,
                "tied {tied}, parameter {p}: {worst} of {scale}"
            );
        }
    }
}
