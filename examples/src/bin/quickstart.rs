//! The quickstart: an MLP trained on CPU by 2 thread ranks with ZeRO stage 2, through
//! `Autodiff<ZeroBackend<NdArray>>` and `examples/configs/quickstart.json`.
//!
//! Each rank runs its own forward on its share of every micro-batch; the engine reduces the
//! gradients into each rank's partition as autodiff finalizes them, clips, steps the
//! optimizer on the partition and all-gathers the parameters. The loss printed is the
//! global-batch loss.

use std::sync::Arc;
use std::time::Instant;

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::engine::{ZeroAutodiff, initialize};
use burn_zero::testing::run_ranks;
use burn_zero_examples::{Mlp, batch, materialize};

type B = ZeroAutodiff<NdArray>;

const WORLD: usize = 2;
const STEPS: usize = 60;

fn main() {
    let start = Instant::now();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/quickstart.json");
    let loaded = DeepSpeedConfig::from_file(path).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "training an MLP on {WORLD} thread ranks through {} with {path}",
        B::name(&Default::default())
    );
    // Seeded and initialized here, so runs repeat; the engine broadcasts rank 0's weights.
    B::seed(&Default::default(), 42);
    let initial = materialize(Mlp::<B>::new(32, &Default::default()));
    let finals = run_ranks(WORLD, |ctx| {
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let mut engine = initialize::<NdArray, _>(initial.clone(), &loaded.config, comm.clone())
            .expect("initialize");
        let batch_sizes = engine.config().batch;
        if ctx.rank == 0 {
            println!(
                "stage {}, micro batch {} x accumulation {} x {WORLD} ranks = {} samples per step",
                engine.config().config.zero_optimization.stage,
                batch_sizes.micro_batch_per_gpu,
                batch_sizes.gradient_accumulation_steps,
                batch_sizes.train_batch_size
            );
            println!("memory on rank 0: {}", engine.memory_report());
        }
        let (micro, gas) = (
            batch_sizes.micro_batch_per_gpu,
            batch_sizes.gradient_accumulation_steps,
        );
        let mut last = 0.0;
        for step in 0..STEPS {
            let lr = engine.lr();
            let mut step_loss = 0.0;
            for j in 0..gas {
                let first = (j * WORLD + ctx.rank) * micro;
                let (x, y) = batch::<B>(step, first..first + micro, &Default::default());
                let loss = (engine.model().forward(x) - y).powf_scalar(2.0).mean();
                step_loss += loss.clone().into_scalar() / gas as f32;
                engine.backward(loss).expect("backward");
                engine.step().expect("step");
            }
            let mut global = [step_loss];
            comm.all_reduce(global.as_mut_slice().into(), ReduceOp::Avg)
                .expect("average the loss");
            if ctx.rank == 0 {
                println!(
                    "step {:>3}  loss {:.5}  lr {:.5}  grad norm {:.4}",
                    engine.global_step(),
                    global[0],
                    lr,
                    engine.last_grad_norm().unwrap_or(f64::NAN)
                );
            }
            last = global[0];
        }
        let (x, _) = batch::<B>(0, 0..8, &Default::default());
        (
            last,
            engine
                .model()
                .forward(x)
                .into_data()
                .to_vec::<f32>()
                .expect("f32"),
        )
    });
    let in_sync = finals.iter().all(|(_, out)| out == &finals[0].1);
    println!(
        "done in {:.1}s: final loss {:.5}, ranks hold identical models: {in_sync}",
        start.elapsed().as_secs_f64(),
        finals[0].0
    );
    assert!(in_sync, "data-parallel ranks diverged");
}
