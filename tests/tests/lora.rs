//! LoRA through the engine: only the adapters are reduced, partitioned and optimized; the
//! frozen base takes rank 0's values at initialization and never changes; every rank ends
//! with the same parameters, and the loss falls.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::lora::LoraConfig;

type B = ZeroAutodiff<NdArray>;

/// Every float parameter: (trainable, values), in visiting order.
fn snapshot<M: Module<B>>(model: &M) -> Vec<(bool, Vec<f32>)> {
    struct Collect(Vec<(bool, Vec<f32>)>);
    impl<Bk: Backend> ModuleVisitor<Bk> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Bk, D>>) {
            let value = param.val();
            let grad = value.is_require_grad();
            let data = value.into_data().convert::<f32>();
            self.0.push((grad, data.to_vec::<f32>().unwrap()));
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

#[test]
fn lora_trains_adapters_only_and_ranks_agree() {
    // 3 ranks over an odd adapter count: partitions do not divide evenly.
    let world = 3;
    let config = DeepSpeedConfig::from_json(&format!(
        r#"{{"train_batch_size": {world}, "gradient_clipping": 1.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
            "zero_optimization": {{"stage": 2, "reduce_bucket_size": 50}}}}"#
    ))
    .unwrap()
    .config;
    let llama = LlamaConfig::new(13, 12, 20, 2, 2, 1);
    let lora = LoraConfig::new(3).with_alpha(6.0);
    let results = run_ranks(world, |ctx| {
        let device = Default::default();
        // Each rank draws its own random base and adapters: the engine must align them.
        let model = llama.init::<B>(&device).with_lora(&lora, &device).unwrap();
        let trainable = model.num_trainable();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(model, &config, comm).unwrap();
        let start = snapshot(engine.model());
        let report = engine.memory_report();
        let ids: Vec<i64> = (0..9)
            .map(|i| ((i * 5 + ctx.rank * 3) % 13) as i64)
            .collect();
        let mut losses = Vec::new();
        for _ in 0..8 {
            let tokens =
                Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, 9]), &device);
            let loss = engine.model().loss(tokens);
            losses.push(loss.clone().into_scalar());
            engine.backward(loss).unwrap();
            engine.step().unwrap();
        }
        (start, snapshot(engine.model()), losses, trainable, report)
    });
    let (start0, end0, _, trainable, _) = &results[0];
    let total: usize = start0.iter().map(|(_, v)| v.len()).sum();
    assert!(
        *trainable > 0 && *trainable < total / 2,
        "{trainable} of {total}"
    );
    for (rank, (start, end, losses, _, report)) in results.iter().enumerate() {
        assert_eq!(start, start0, "rank {rank} starts from rank 0's values");
        assert_eq!(end, end0, "rank {rank} ends with rank 0's values");
        for (i, ((grad, before), (_, after))) in start.iter().zip(end).enumerate() {
            if *grad {
                assert_ne!(
                    before, after,
                    "rank {rank}: adapter parameter {i} did not train"
                );
            } else {
                assert_eq!(before, after, "rank {rank}: frozen parameter {i} changed");
            }
        }
        assert!(
            losses.last().unwrap() < &losses[0],
            "rank {rank}: loss did not fall: {losses:?}"
        );
        // All parameters are held; optimizer state (master + 2 moments) only for this rank's
        // share of the adapters (partitions are padded to 4 elements).
        assert_eq!(report.parameters, 4 * total, "rank {rank}");
        let share = trainable.div_ceil(world).div_ceil(4) * 4;
        assert!(
            report.optimizer_state <= 12 * share,
            "rank {rank}: {report}"
        );
    }
}
