//! The training loop of the engine-run case (`cases::engine_run`) on one thread rank: what
//! the engine tests that resume, reshard or offload repeat around their steps. Uses
//! burn-zero, so it is not shared with the plain-burn reference.

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero::comm::{Communicator, ReduceOp};
use burn_zero::engine::{Engine, ZeroAutodiff};

use crate::cases::{Mlp, engine_run};

type B = ZeroAutodiff<NdArray>;

/// One optimizer step `step` on `rank` of `world`: this rank's micro-batches of the global
/// batch, each through backward and step; returns the step's loss averaged over the
/// micro-batches and every rank.
pub fn train_step(
    engine: &mut Engine<NdArray, Mlp<B>>,
    comm: &dyn Communicator,
    step: usize,
    rank: usize,
    world: usize,
) -> f32 {
    let device = Default::default();
    let gas = engine.config().batch.gradient_accumulation_steps;
    let micro = engine_run::GLOBAL_BATCH / (world * gas);
    let mut step_loss = 0.0f32;
    for j in 0..gas {
        let start = (j * world + rank) * micro;
        let (x, y) = engine_run::batch::<B>(step, start..start + micro, &device);
        let loss: Tensor<B, 1> = engine_run::loss(engine.model(), x, y);
        step_loss += loss.clone().into_scalar() / gas as f32;
        engine.backward(loss).unwrap();
        engine.step().unwrap();
    }
    let mut mean = [step_loss];
    comm.all_reduce(mean.as_mut_slice().into(), ReduceOp::Avg)
        .unwrap();
    mean[0]
}
