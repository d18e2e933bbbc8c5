//! Activation checkpointing per decoder layer (`Llama::with_activation_checkpointing`,
//! `burn_zero::nn::checkpoint`) against the same model without it. The reference is burn's own
//! autodiff of the uncheckpointed layers; the checkpoint op recomputes each layer in backward
//! and runs a nested backward of its own.
//! - The loss and every parameter's gradient equal the uncheckpointed ones: tied and untied
//!   output projections, odd widths, and LoRA (frozen base weights, untracked parents).
//! - Through the engine at ZeRO-3 on 3 thread ranks (partitions that do not divide evenly),
//!   the gradient hooks fire for parameters reached only through checkpoints: 4 AdamW steps
//!   give the same losses and the same parameters on every rank as the uncheckpointed run.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, construct_full_from, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_llm::lora::LoraConfig;
use burn_zero_llm::shared_init::SharedInit;
use burn_zero_llm::{Llama, LlamaConfig};

type B = ZeroAutodiff<NdArray>;

/// Every float parameter's gradient (`None` for a frozen one), in module order.
fn gradients(model: &Llama<B>, grads: &<B as AutodiffBackend>::Gradients) -> Vec<Option<Vec<f32>>> {
    struct Collect<'a> {
        grads: &'a <B as AutodiffBackend>::Gradients,
        out: Vec<Option<Vec<f32>>>,
    }
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = param.val().grad(self.grads);
            self.out
                .push(g.map(|g| g.into_data().to_vec::<f32>().unwrap()));
        }
    }
    let mut collect = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    collect.out
}

/// The largest difference between `a` and `b` relative to `a`'s largest magnitude.
fn relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-12);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Float parameters' values in module order.
fn values<M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push(param.val().into_data().convert::<f32>().to_vec().unwrap());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

#[test]
fn checkpointed_layers_give_the_same_loss_and_gradients() {
    let device = Default::default();
    let ids: Vec<i64> = (0..3 * 12).map(|i| (i * 31 + 5) % 53).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [3, 12]), &device);
    for (tied, lora) in [(false, false), (true, false), (false, true)] {
        let config = LlamaConfig::new(53, 24, 40, 3, 6, 2)
            .with_tie_embeddings(tied)
            .with_max_seq_len(64);
        // One model (LoRA draws its adapters at random), run both ways.
        let mut model = construct_full_from(config.init::<B>(&device), &SharedInit { seed: 7 });
        if lora {
            model = model
                .with_lora(&LoraConfig::new(3).with_alpha(6.0), &device)
                .unwrap();
        }
        let run = |checkpointed: bool| {
            let model = model.clone().with_activation_checkpointing(checkpointed);
            let loss = model.loss(tokens.clone());
            // A factor on the loss: the checkpoint must carry dL/dout, not ones.
            let grads = (loss.clone() * 3.0).backward();
            (loss.into_scalar(), gradients(&model, &grads))
        };
        let (want, want_grads) = run(false);
        let (got, got_grads) = run(true);
        let case = format!("tied {tied}, lora {lora}");
        assert!(
            (want - got).abs() <= 1e-6 * want.abs(),
            "{case}: loss {want} vs {got}"
        );
        assert_eq!(want_grads.len(), got_grads.len(), "{case}");
        let mut compared = 0;
        for (p, (a, b)) in want_grads.iter().zip(&got_grads).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => {
                    // Same kernels on the same values; only the order of a few sums differs.
                    let d = relative_difference(a, b);
                    assert!(d <= 1e-5, "{case}, parameter {p}: {d}");
                    compared += 1;
                }
                (None, None) => {}
                _ => panic!("{case}, parameter {p}: a gradient on one side only"),
            }
        }
        assert!(compared >= 3, "{case}: only {compared} gradients compared");
    }
}

#[test]
fn checkpointed_layers_train_the_same_at_stage_3() {
    let world = 3;
    let config = DeepSpeedConfig::from_json(&format!(
        r#"{{"train_batch_size": {world}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
            "zero_optimization": {{"stage": 3, "reduce_bucket_size": 97,
                "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50,
                "stage3_gather_16bit_weights_on_model_save": true}}}}"#
    ))
    .unwrap()
    .config;
    let llama = LlamaConfig::new(29, 20, 26, 4, 5, 1).with_max_seq_len(32);
    let train = |checkpointed: bool| {
        run_ranks(world, |ctx| {
            let device = Default::default();
            let model = construct_full_from(llama.init::<B>(&device), &SharedInit { seed: 3 })
                .with_activation_checkpointing(checkpointed);
            let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
            let mut engine = initialize::<NdArray, _>(model, &config, comm).unwrap();
            let mut losses = Vec::new();
            for step in 0..4 {
                let ids: Vec<i64> = (0..2 * 9)
                    .map(|i| ((i * 7 + ctx.rank * 5 + step * 3) % 29) as i64)
                    .collect();
                let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 9]), &device);
                let loss = engine.model().loss(tokens);
                losses.push(loss.clone().into_scalar());
                engine.backward(loss).unwrap();
                engine.step().unwrap();
            }
            (losses, values(&engine.full_model().unwrap()))
        })
    };
    let plain = train(false);
    let checkpointed = train(true);
    for (rank, ((want_losses, want), (losses, got))) in plain.iter().zip(&checkpointed).enumerate()
    {
        assert!(
            want_losses.last() < want_losses.first(),
            "rank {rank}: the reference trains: {want_losses:?}"
        );
        for (step, (a, b)) in want_losses.iter().zip(losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "rank {rank}, step {step}: loss {a} vs {b}"
            );
        }
        assert_eq!(want.len(), got.len());
        for (p, (a, b)) in want.iter().zip(got).enumerate() {
            let d = relative_difference(a, b);
            assert!(d <= 1e-4, "rank {rank}, parameter {p} after 4 steps: {d}");
        }
    }
}
