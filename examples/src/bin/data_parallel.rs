//! The quickstart: an MLP trained on CPU by 2 thread ranks through `ZeroBackend<NdArray>`.
//!
//! Each rank computes the loss on its half of every global batch; `ZeroBackend`'s gradient
//! hook averages each gradient across ranks the moment autodiff finalizes it; every rank then
//! takes the same Adam step. The loss printed is the global-batch loss.

use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn_zero::ZeroBackend;
use burn_zero::backend::hooks;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::testing::run_ranks;
use burn_zero_examples::{AllReduceHook, Mlp, batch, broadcast_parameters, materialize};

type Inner = NdArray;
type B = Autodiff<ZeroBackend<Inner>>;

const WORLD: usize = 2;
const STEPS: usize = 40;
const GLOBAL_BATCH: usize = 256;

fn main() {
    let start = Instant::now();
    println!(
        "training an MLP on {WORLD} thread ranks through {}",
        B::name(&Default::default())
    );
    // Seeded so runs repeat; ranks start from rank 0's weights as data parallelism requires.
    B::seed(&Default::default(), 42);
    let initial = materialize(Mlp::<B>::new(32, &Default::default()));
    let finals = run_ranks(WORLD, |ctx| {
        let device = Default::default();
        let comm = Arc::new(ctx.comm);
        let model = broadcast_parameters(initial.clone(), comm.as_ref(), 0);
        let mut model = hooks::mark_distributed(model);
        let _hook = hooks::install::<Inner>(Box::new(AllReduceHook::new(comm.clone())));
        let mut optim = AdamConfig::new().init::<B, Mlp<B>>();
        let per_rank = GLOBAL_BATCH / WORLD;
        let rows = ctx.rank * per_rank..(ctx.rank + 1) * per_rank;
        let mut last = 0.0;
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, rows.clone(), &device);
            let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
            let mut global = [loss.clone().into_scalar()];
            comm.all_reduce(global.as_mut_slice().into(), ReduceOp::Avg)
                .expect("average the loss");
            if ctx.rank == 0 {
                println!("step {step:>3}  loss {:.5}", global[0]);
            }
            last = global[0];
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(3e-3, model, grads);
        }
        let (x, _) = batch::<B>(0, 0..8, &device);
        (
            last,
            model.forward(x).into_data().to_vec::<f32>().expect("f32"),
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
