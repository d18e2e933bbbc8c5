//! 3D parallelism on 8 thread ranks: pipe 2 × data 2 × model 2. Each pipeline stage is a
//! residual MLP block sliced over its model group (column- then row-parallel); activations and
//! their gradients travel between stages per (data, model) coordinate, gradients are averaged
//! over the data axis, and 1F1B runs 4 micro-batches per step. Against the unpartitioned two
//! blocks trained in one process on both data shards' rows: losses and every parameter slice
//! of 10 Adam steps within fp32 tolerance, with and without activation checkpointing.

use std::sync::Arc;

use burn::backend::NdArray;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, activation};
use burn_pipeline::tensor_parallel::slice_of;
use burn_pipeline::{
    Checkpointing, ColumnParallelLinear, ModelGroup, PipeStage, Replicated, RowParallelLinear,
    Schedule, StageSpec, Topology, run_step,
};
use burn_zero::DeepSpeedConfig;
use burn_zero::comm::Communicator;
use burn_zero::engine::ZeroAutodiff;
use burn_zero::testing::run_ranks;
use burn_zero_tests::cases::{assert_close, f32_values, seeded_linear, tensor};

type B = ZeroAutodiff<NdArray>;

const WIDTH: usize = 6;
const HIDDEN: usize = 8;
const MICRO: usize = 4;
const ROWS: usize = 3;
const STEPS: usize = 10;
const LR: f64 = 0.01;

/// One residual MLP block, unsliced.
#[derive(Module, Debug)]
struct Block<B: Backend> {
    up: Linear<B>,
    down: Linear<B>,
}

impl Block<B> {
    fn new(i: usize, device: &burn::tensor::Device<B>) -> Self {
        Self {
            up: seeded_linear(WIDTH, HIDDEN, 10 + 10 * i, device),
            down: seeded_linear(HIDDEN, WIDTH, 15 + 10 * i, device),
        }
    }

    fn apply(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        x.clone() + self.down.forward(activation::tanh(self.up.forward(x)))
    }
}

/// The same block sliced over a model group: one pipeline stage.
#[derive(Module, Debug)]
struct SlicedBlock<B: Backend> {
    up: ColumnParallelLinear<B>,
    down: RowParallelLinear<B>,
    #[module(skip)]
    group: ModelGroup,
}

impl PipeStage<B> for SlicedBlock<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let inner = activation::tanh(self.up.forward(x.clone(), &self.group));
        x + self.down.forward(inner, &self.group)
    }
}

/// Step `step`'s rows `rows` of the whole batch (both data shards): inputs and targets.
fn rows(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &burn::tensor::Device<B>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let total = 2 * MICRO * ROWS;
    let x = tensor::<B, 2>([total, WIDTH], 300 + step, device);
    let y = tensor::<B, 2>([total, WIDTH], 400 + step, device);
    (x.slice([rows.clone(), 0..WIDTH]), y.slice([rows, 0..WIDTH]))
}

fn mse(out: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    (out - y).powf_scalar(2.0).mean()
}

#[test]
fn pipe_by_data_by_model_matches_the_unpartitioned_model() {
    three_d(|_| None);
}

/// The same with activation checkpointing from the config: each model rank keeps its slice of
/// a stage input (`partition_activations`) in host memory (`cpu_checkpointing`), all-gathered
/// before the forward is recomputed in backward.
#[test]
fn partitioned_checkpoints_in_host_memory_change_nothing() {
    let config = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 1, "activation_checkpointing":
            {"partition_activations": true, "cpu_checkpointing": true}}"#,
    )
    .unwrap()
    .config;
    let section = config.activation_checkpointing.expect("the section");
    three_d(|group| {
        let c = Checkpointing::from_config(&section, Some(group));
        assert!(c.partition.is_some() && c.on_host);
        Some(c)
    });
}

/// Partitioned checkpoints kept on the device.
#[test]
fn partitioned_checkpoints_on_the_device_change_nothing() {
    three_d(|group| {
        Some(Checkpointing {
            partition: Some(group.clone()),
            on_host: false,
        })
    });
}

/// 2 × 2 × 2 with the checkpointing `checkpoint` makes from a rank's model group.
fn three_d(checkpoint: impl Fn(&ModelGroup) -> Option<Checkpointing> + Sync) {
    let device = Default::default();
    let mut reference = vec![Block::new(0, &device), Block::new(1, &device)];
    let mut optim = AdamConfig::new().init::<B, Vec<Block<B>>>();
    let mut ref_losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = rows(step, 0..2 * MICRO * ROWS, &device);
        let loss = mse(reference.iter().fold(x, |h, b| b.apply(h)), y);
        ref_losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }

    let topo = Topology::pipe_data_model(2, 2, 2);
    let results = run_ranks(8, |ctx| {
        let device = Default::default();
        let at = |axis| topo.coord_along(ctx.rank, axis);
        let (stage, shard, part) = (at("pipe"), at("data"), at("model"));
        // Every axis's communicator is a sub-group of the one world communicator.
        let world: Arc<dyn Communicator> = Arc::new(ctx.comm);
        let axis = |name| topo.axis_comm(world.clone(), name).unwrap();
        let (pipe, data) = (axis("pipe"), axis("data"));
        let model: Arc<dyn Communicator> = Arc::from(axis("model"));
        let group = ModelGroup::new(model);
        let ckpt = checkpoint(&group);
        let full = Block::new(stage, &device);
        let mut block = SlicedBlock::<B> {
            up: ColumnParallelLinear::from_linear(&full.up, &group),
            down: RowParallelLinear::from_linear(&full.down, &group),
            group,
        };
        let mut optim = Replicated(AdamConfig::new().init::<B, SlicedBlock<B>>());
        let stream = Schedule::OneFOneB.stream(2, MICRO, stage);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let shard_rows = |mb: usize| {
                let start = (shard * MICRO + mb) * ROWS;
                rows(step, start..start + ROWS, &device)
            };
            let inputs = |mb: usize| shard_rows(mb).0;
            let loss = |mb: usize, out: Tensor<B, 2>| mse(out, shard_rows(mb).1);
            let spec = StageSpec {
                stage,
                stages: 2,
                micro_batches: MICRO,
                rows: ROWS,
                in_features: WIDTH,
                inputs: &inputs,
                loss: &loss,
                checkpoint: ckpt.as_ref(),
            };
            let (next, l) = run_step(
                block,
                &mut optim,
                LR,
                &stream,
                &spec,
                pipe.as_ref(),
                Some(data.as_ref()),
            )
            .unwrap();
            block = next;
            losses.extend(l);
        }
        (stage, shard, part, losses, block)
    });
    // The last stage's data shards each report the mean over their half of the rows: their
    // mean is the whole batch's loss, on either model rank.
    for part in 0..2 {
        let shard_losses: Vec<&Vec<f32>> = results
            .iter()
            .filter(|r| r.0 == 1 && r.2 == part)
            .map(|r| &r.3)
            .collect();
        let mean: Vec<f32> = (0..STEPS)
            .map(|s| (shard_losses[0][s] + shard_losses[1][s]) / 2.0)
            .collect();
        assert_close(&format!("losses, model rank {part}"), &mean, &ref_losses);
    }
    for (stage, shard, part, _, block) in results {
        let at = format!("stage {stage}, data {shard}, model {part}");
        let r = &reference[stage];
        let hidden = slice_of(HIDDEN, part, 2);
        let checks = [
            (
                "up.weight",
                block.up.weight.val(),
                r.up.weight.val().slice([0..WIDTH, hidden.clone()]),
            ),
            (
                "down.weight",
                block.down.weight.val(),
                r.down.weight.val().slice([hidden.clone(), 0..WIDTH]),
            ),
        ];
        for (name, got, want) in checks {
            assert_close(&format!("{at} {name}"), f32_values(got), f32_values(want));
        }
        let bias = |b: &Option<Param<Tensor<B, 1>>>| f32_values(b.as_ref().unwrap().val());
        assert_close(
            &format!("{at} up.bias"),
            bias(&block.up.bias),
            f32_values(r.up.bias.as_ref().unwrap().val().slice([hidden])),
        );
        assert_close(
            &format!("{at} down.bias"),
            bias(&block.down.bias),
            bias(&r.down.bias),
        );
    }
    assert!(ref_losses[STEPS - 1] < ref_losses[0], "{ref_losses:?}");
}
