//! Training parity of `burn_zero::nn`'s fused ops (issue 35): the recipe's Llama trained 10
//! Adam steps with the fused RMSNorm, RoPE and SwiGLU (their custom autodiff ops, here with
//! their burn-op forward and backward on NdArray: the code path that calls the kernels on CUDA)
//! and with them switched off (`burn_zero.fused_kernels`: burn's own autodiff of the reference
//! formulas), with activation checkpointing (the ops run again inside the recompute) and the
//! chunked loss, untied and tied: the same loss at every step and the same parameters after.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::backend::settings::{self, OpSettings};
use burn_zero::config::FusedKernelsConfig;
use burn_zero::engine::{ZeroAutodiff, construct_full_from};
use burn_zero_llm::shared_init::SharedInit;
use burn_zero_llm::{Llama, LlamaConfig};

type B = ZeroAutodiff<burn::backend::NdArray>;

/// Every parameter's values, in module order.
fn parameters(model: &Llama<B>) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push(param.val().into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// 10 Adam steps on fixed batches; the per-step losses and the parameters after.
fn train(config: &LlamaConfig, fused: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    let on = FusedKernelsConfig {
        rms_norm: fused,
        rope: fused,
        swiglu: fused,
        cross_entropy: fused,
    };
    let _settings = settings::set(OpSettings {
        fused_kernels: on,
        ..OpSettings::default()
    });
    let device = Default::default();
    let mut model = construct_full_from(config.init::<B>(&device), &SharedInit { seed: 11 })
        .with_activation_checkpointing(true)
        .with_chunked_loss(5);
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..10i64 {
        let ids: Vec<i64> = (0..2 * 10).map(|i| (i * 17 + step * 7 + 3) % 45).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 10]), &device);
        let loss = model.loss(tokens);
        losses.push(loss.clone().into_data().to_vec::<f32>().unwrap()[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, parameters(&model))
}

#[test]
fn fused_ops_train_as_the_reference_formulas_do() {
    for tied in [false, true] {
        // Odd widths: 6 heads of 4 over 2 K/V heads, an MLP of 36.
        let config = LlamaConfig::new(45, 24, 36, 2, 6, 2)
            .with_tie_embeddings(tied)
            .with_max_seq_len(32);
        let (want_losses, want) = train(&config, false);
        let (got_losses, got) = train(&config, true);
        for (step, (a, b)) in want_losses.iter().zip(&got_losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "tied {tied}, step {step}: loss {a} vs {b}"
            );
        }
        // The training moved the weights: a test of equal, untouched parameters would pass
        // without any op running.
        assert!(want_losses[9] < want_losses[0] - 0.05, "{want_losses:?}");
        for (p, (a, b)) in want.iter().zip(&got).enumerate() {
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
