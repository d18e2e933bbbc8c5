//! `Engine::forward_backward` (the entry point CUDA graphs capture, issue 37) trains exactly as
//! the caller's own forward followed by `Engine::backward` does: same losses, same parameters,
//! with gradient accumulation and clipping, at stages 0–2 on 2 ranks. On the CPU backend a
//! config asking for CUDA graphs runs its steps eagerly (and says so once).

use std::sync::Arc;

use burn::backend::NdArray;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::engine::{
    FlatLayout, ZeroAutodiff, construct_full_from, flatten_params, initialize,
};
use burn_zero::testing::run_ranks;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::shared_init::SharedInit;

type B = ZeroAutodiff<NdArray>;

const STEPS: usize = 3;
const GAS: usize = 2;

fn config(stage: u8, graphs: bool) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": {GAS},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
            "gradient_clipping": 0.5,
            "zero_optimization": {{"stage": {stage}}},
            "burn_zero": {{"cuda_graphs": {{"enabled": {graphs}, "warmup": 1}}}}}}"#
    );
    DeepSpeedConfig::parse_json(&text).unwrap().config
}

/// Rank `rank`'s tokens of micro-step `micro` (odd vocabulary, 7 tokens a row).
fn tokens(micro: usize, rank: usize) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = (0..2 * 8)
        .map(|i| ((i * 17 + micro * 5 + rank * 11) % 53) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [2, 8]), &Default::default())
}

/// What one rank saw: its losses, and its flat parameters before and after training.
type Run = (Vec<f32>, Vec<f32>, Vec<f32>);

/// `STEPS` steps at `stage`, each micro-step through `forward_backward` or through the
/// caller's forward and `backward`.
fn train(stage: u8, through_forward_backward: bool) -> Vec<Run> {
    let llama = LlamaConfig::new(53, 24, 40, 2, 6, 2).with_max_seq_len(16);
    run_ranks(2, |ctx| {
        let device = Default::default();
        let model = construct_full_from(llama.init::<B>(&device), &SharedInit { seed: 3 });
        let flat = |m: &burn_zero_llm::Llama<B>| {
            let values = flatten_params(m, &FlatLayout::of(m));
            values.into_data().to_vec::<f32>().unwrap()
        };
        let start = flat(&model);
        let cfg = config(stage, through_forward_backward);
        let mut engine = initialize::<NdArray, _>(model, &cfg, Arc::new(ctx.comm)).unwrap();
        let mut losses = Vec::new();
        for micro in 0..STEPS * GAS {
            let batch = tokens(micro, ctx.rank);
            let loss = match through_forward_backward {
                true => engine
                    .forward_backward(vec![batch], |model, mut inputs| {
                        model.loss(inputs.remove(0))
                    })
                    .unwrap(),
                false => {
                    let loss = engine.model().loss(batch);
                    engine.backward(loss.clone()).unwrap();
                    loss
                }
            };
            losses.push(loss.into_scalar());
            engine.step().unwrap();
        }
        (losses, start, flat(engine.model()))
    })
}

#[test]
fn forward_backward_trains_as_forward_then_backward() {
    for stage in [0, 1, 2] {
        let want = train(stage, false);
        let got = train(stage, true);
        for (rank, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.0, g.0, "stage {stage}, rank {rank}: losses");
            assert_eq!(w.2, g.2, "stage {stage}, rank {rank}: parameters");
        }
        // The parameters moved: the comparison above is not of two untouched models.
        assert_ne!(
            want[0].1, want[0].2,
            "stage {stage}: training changed nothing"
        );
    }
}
