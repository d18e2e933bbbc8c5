//! A 4-stage pipeline on thread ranks (activations and gradients over the communicator's
//! send/recv), 8 micro-batches of 3 rows, against the unpartitioned model trained in one
//! process on the same 24 rows: losses and parameters of 10 Adam steps within fp32 tolerance.
//! GPipe, 1F1B and zero-bubble ZB-H1 (each layer's weight gradient split off and deferred) on
//! 4 ranks of one stage each; interleaved 1F1B on 2 ranks of 2 chunks each (rank 0 holds
//! layers 0 and 2, rank 1 layers 1 and 3).

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, activation};
use burn_pipeline::{
    Checkpointing, PipeStage, Replicated, Schedule, StageOptimizer, StageSpec, WeightSplit, Zero1,
    Zero2, run_chunks, run_step,
};
use burn_zero::comm::Communicator;
use burn_zero::config::{OptimizerKind, OptimizerParams};
use burn_zero::engine::ZeroAutodiff;
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::{batch_rows, param_data, tensor};

type B = ZeroAutodiff<NdArray>;

/// Widths: 7 → 11 → 5 → 9 → 3 (odd, all different).
const DIMS: [usize; 5] = [7, 11, 5, 9, 3];
const MICRO: usize = 8;
const ROWS: usize = 3;
const STEPS: usize = 10;

#[derive(Module, Debug)]
struct Layer<B: Backend> {
    linear: Linear<B>,
}

impl<B: Backend> Layer<B> {
    fn new(i: usize, device: &B::Device) -> Self {
        let (d_in, d_out) = (DIMS[i], DIMS[i + 1]);
        let mut linear = LinearConfig::new(d_in, d_out).init::<B>(device);
        linear.weight =
            Param::from_tensor(tensor::<B, 2>([d_in, d_out], 40 + i, device).mul_scalar(0.6));
        linear.bias = Some(Param::from_tensor(
            tensor::<B, 1>([d_out], 50 + i, device).mul_scalar(0.1),
        ));
        Self { linear }
    }

    fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        activation::tanh(self.linear.forward(x))
    }
}

impl<B: AutodiffBackend> PipeStage<B> for Layer<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.apply(x)
    }

    fn forward_split(&self, x: Tensor<B, 2>, split: &mut WeightSplit<B>) -> Tensor<B, 2> {
        let linear = &self.linear;
        activation::tanh(split.linear(x, &linear.weight, linear.bias.as_ref()))
    }
}

/// Rows of micro-batch `mb` of step `step`: inputs and targets.
fn data(step: usize, mb: usize, device: &burn::tensor::Device<B>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    batch_rows(MICRO * ROWS, 700 + step, mb * ROWS..(mb + 1) * ROWS, device)
}

fn mse(out: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    (out - y).powf_scalar(2.0).mean()
}

fn lr(step: usize) -> f64 {
    0.01 + 0.002 * step as f64
}

/// The four layers as one model.
#[derive(Module, Debug)]
struct Whole<B: Backend> {
    layers: Vec<Layer<B>>,
}

/// The unpartitioned model, one process, the whole batch: losses and parameters.
fn reference() -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut model = Whole::<B> {
        layers: (0..4).map(|i| Layer::new(i, &device)).collect(),
    };
    let mut optim = AdamConfig::new().init::<B, Whole<B>>();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch_rows::<B>(MICRO * ROWS, 700 + step, 0..MICRO * ROWS, &device);
        let out = model.layers.iter().fold(x, |h, l| l.apply(h));
        let loss = mse(out, y);
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr(step), model, grads);
    }
    let params = param_data(&model)
        .into_iter()
        .map(|d| d.to_vec::<f32>().unwrap())
        .collect();
    (losses, params)
}

fn pipeline(schedule: Schedule) -> (Vec<f32>, Vec<Vec<f32>>) {
    pipeline_with(schedule, None)
}

fn pipeline_with(
    schedule: Schedule,
    checkpoint: Option<&Checkpointing>,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let chunks = schedule.chunks();
    let ranks = 4 / chunks;
    let results = run_ranks(ranks, |ctx| {
        let device = Default::default();
        let comm: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let rank = ctx.rank;
        // Chunk c of this rank is layer (virtual stage) c·ranks + rank.
        let stages: Vec<usize> = (0..chunks).map(|c| c * ranks + rank).collect();
        let mut layers: Vec<Layer<B>> = stages.iter().map(|&s| Layer::new(s, &device)).collect();
        let mut optims: Vec<_> = stages
            .iter()
            .map(|_| Replicated(AdamConfig::new().init::<B, Layer<B>>()))
            .collect();
        let stream = schedule.stream(ranks, MICRO, rank);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let inputs = |mb: usize| data(step, mb, &device).0;
            let loss = |mb: usize, out: Tensor<B, 2>| mse(out, data(step, mb, &device).1);
            let specs: Vec<StageSpec<'_, B>> = stages
                .iter()
                .map(|&stage| StageSpec {
                    stage,
                    stages: 4,
                    micro_batches: MICRO,
                    rows: ROWS,
                    in_features: DIMS[stage],
                    inputs: &inputs,
                    loss: &loss,
                    checkpoint,
                })
                .collect();
            let (next, step_loss) = run_chunks(
                layers,
                &mut optims,
                lr(step),
                &stream,
                &specs,
                comm.as_ref(),
                None,
            )
            .unwrap();
            layers = next;
            losses.extend(step_loss);
        }
        let params: Vec<(usize, Vec<f32>)> = stages
            .iter()
            .zip(&layers)
            .flat_map(|(&stage, layer)| {
                param_data(layer)
                    .into_iter()
                    .map(move |d| (stage, d.to_vec::<f32>().unwrap()))
            })
            .collect();
        (losses, params)
    });
    let losses = results[ranks - 1].0.clone();
    // Parameters in layer order, as the unpartitioned model lists them.
    let mut params: Vec<(usize, Vec<f32>)> = results.into_iter().flat_map(|(_, p)| p).collect();
    params.sort_by_key(|(stage, _)| *stage);
    (losses, params.into_iter().map(|(_, p)| p).collect())
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) + 1e-6)
}

#[test]
fn four_stages_match_the_unpartitioned_model() {
    let (losses, params) = reference();
    assert!(
        losses[STEPS - 1] < losses[0],
        "the reference trains: {losses:?}"
    );
    for schedule in [
        Schedule::GPipe,
        Schedule::OneFOneB,
        Schedule::Interleaved { chunks: 2 },
        Schedule::ZeroBubbleH1,
    ] {
        let (p_losses, p_params) = pipeline(schedule);
        assert!(
            close(&p_losses, &losses),
            "{schedule:?}: {p_losses:?} vs {losses:?}"
        );
        assert_eq!(p_params.len(), params.len());
        for (i, (a, b)) in p_params.iter().zip(&params).enumerate() {
            assert!(close(a, b), "{schedule:?}: parameter {i}");
        }
    }
}

/// Activation checkpointing (whole inputs on the device, then in host memory) recomputes each
/// stage's forward in backward: the same bits as keeping the graphs, with a whole backward
/// and with a split one.
#[test]
fn checkpointed_stages_give_the_same_bits() {
    for schedule in [Schedule::GPipe, Schedule::ZeroBubbleH1] {
        let kept = pipeline(schedule);
        for on_host in [false, true] {
            let ckpt = Checkpointing {
                partition: None,
                on_host,
            };
            let checkpointed = pipeline_with(schedule, Some(&ckpt));
            assert!(checkpointed == kept, "{schedule:?} on host: {on_host}");
        }
    }
}

/// Two consecutive layers per stage.
#[derive(Module, Debug)]
struct Pair<B: Backend> {
    layers: Vec<Layer<B>>,
}

impl<B: AutodiffBackend> PipeStage<B> for Pair<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.layers.iter().fold(x, |h, l| l.apply(h))
    }

    fn forward_split(&self, x: Tensor<B, 2>, split: &mut WeightSplit<B>) -> Tensor<B, 2> {
        self.layers.iter().fold(x, |h, l| l.forward_split(h, split))
    }
}

/// Pipe 2 × data 2 with burn's Adam on every data rank (gradients averaged at `ReduceGrads`).
#[test]
fn pipe_by_data_matches_the_unpartitioned_model() {
    pipe_by_data(Schedule::OneFOneB, || {
        Replicated(adam().init::<B, Pair<B>>())
    });
}

/// Pipe 2 × data 2 with ZeRO-1 over the data axis: each data rank holds the Adam state of half
/// of its stage (gradients reduce-scattered, parameters all-gathered).
#[test]
fn pipe_by_data_with_zero1_matches_the_unpartitioned_model() {
    pipe_by_data(Schedule::OneFOneB, || {
        Zero1::new(
            OptimizerKind::Adam {
                decoupled_weight_decay: false,
            },
            OptimizerParams::default(),
        )
    });
}

/// Pipe 2 × data 2 with ZeRO-2 over the data axis: each data rank keeps only its half of the
/// stage's gradients, reduce-scattered after every backward; under 1F1B and under ZB-H1 (a
/// reduce-scatter per half: the weight halves' gradients arrive on their own).
#[test]
fn pipe_by_data_with_zero2_matches_the_unpartitioned_model() {
    for schedule in [Schedule::OneFOneB, Schedule::ZeroBubbleH1] {
        pipe_by_data(schedule, || {
            Zero2::new(
                OptimizerKind::Adam {
                    decoupled_weight_decay: false,
                },
                OptimizerParams::default(),
            )
        });
    }
}

/// burn's Adam with PyTorch's ε (what burn-zero's Adam uses).
fn adam() -> AdamConfig {
    AdamConfig::new().with_epsilon(1e-8)
}

/// Pipe 2 × data 2 on 4 thread ranks (the topology's groups as sub-communicators): each data
/// rank runs its own 24 rows through both stages with the optimizer `make` builds; against one
/// process on all 48 rows.
fn pipe_by_data<O: StageOptimizer<B, Pair<B>>>(schedule: Schedule, make: impl Fn() -> O + Sync) {
    use burn_pipeline::Topology;
    let rows = MICRO * ROWS;
    // Reference: the four layers on both data shards' rows at once.
    let device = Default::default();
    let mut model = Whole::<B> {
        layers: (0..4).map(|i| Layer::new(i, &device)).collect(),
    };
    let mut optim = adam().init::<B, Whole<B>>();
    let mut ref_losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch_rows::<B>(2 * rows, 900 + step, 0..2 * rows, &device);
        let loss = mse(model.layers.iter().fold(x, |h, l| l.apply(h)), y);
        ref_losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr(step), model, grads);
    }
    let ref_params: Vec<Vec<f32>> = param_data(&model)
        .into_iter()
        .map(|d| d.to_vec::<f32>().unwrap())
        .collect();

    let topo = Topology::pipe_data_model(2, 2, 1);
    let results = run_ranks(4, |ctx| {
        let device = Default::default();
        let (stage, shard) = (
            topo.coord_along(ctx.rank, "pipe"),
            topo.coord_along(ctx.rank, "data"),
        );
        let world: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let pipe = topo.axis_comm(world.clone(), "pipe").unwrap();
        let data = topo.axis_comm(world, "data").unwrap();
        let mut pair = Pair::<B> {
            layers: (2 * stage..2 * stage + 2)
                .map(|i| Layer::new(i, &device))
                .collect(),
        };
        let mut optim = make();
        let stream = schedule.stream(2, MICRO, stage);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let shard_rows = |mb: usize| {
                let start = shard * rows + mb * ROWS;
                batch_rows::<B>(2 * rows, 900 + step, start..start + ROWS, &device)
            };
            let inputs = |mb: usize| shard_rows(mb).0;
            let loss = |mb: usize, out: Tensor<B, 2>| mse(out, shard_rows(mb).1);
            let spec = StageSpec {
                stage,
                stages: 2,
                micro_batches: MICRO,
                rows: ROWS,
                in_features: DIMS[2 * stage],
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            };
            let (next, l) = run_step(
                pair,
                &mut optim,
                lr(step),
                &stream,
                &spec,
                pipe.as_ref(),
                Some(data.as_ref()),
            )
            .unwrap();
            pair = next;
            losses.extend(l);
        }
        let params: Vec<Vec<f32>> = param_data(&pair)
            .into_iter()
            .map(|d| d.to_vec::<f32>().unwrap())
            .collect();
        (stage, shard, losses, params)
    });
    // The last stage's two data ranks: their mean loss is the whole batch's.
    let last: Vec<_> = results.iter().filter(|r| r.0 == 1).collect();
    let losses: Vec<f32> = (0..STEPS)
        .map(|s| (last[0].2[s] + last[1].2[s]) / 2.0)
        .collect();
    assert!(
        close(&losses, &ref_losses),
        "{schedule:?}: {losses:?} vs {ref_losses:?}"
    );
    for r in &results {
        let (stage, shard, _, params) = r;
        let want = &ref_params[4 * stage..4 * stage + 4];
        for (i, (a, b)) in params.iter().zip(want).enumerate() {
            assert!(
                close(a, b),
                "{schedule:?}: stage {stage}, data shard {shard}: parameter {i}"
            );
        }
    }
}
