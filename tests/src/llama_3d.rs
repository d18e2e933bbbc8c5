//! The Llama in 3D (pipe × data × model, `ParallelLlamaStage`, 1F1B or ZB-H1, Adam) against the unsplit,
//! unsliced model trained on the whole batch: one rank's loop and the reference, for any
//! backend. Run as processes (`dist-worker llama-3d`, on CPU in `tests/llama_3d.rs` and on GPUs
//! with NCCL): burn 0.21's autodiff cleans up every graph of a process after each backward, so
//! thread ranks whose backward blocks in a model-parallel all-reduce can deadlock each other.

use std::sync::Arc;

use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_pipeline::{
    ModelGroup, ModelParallelBackend, Replicated, Schedule, SplitMethod, StageSpec, Topology,
    pipeline_links, run_step, split, vocab_parallel_cross_entropy,
};
use burn_zero::comm::{CommError, Communicator, ReduceOp};
use burn_zero_llm::LlamaConfig;
use burn_zero_llm::data::synthetic_ids;
use burn_zero_llm::model::draw_parameters;
use burn_zero_llm::parallel_stage::ParallelLlamaStage;
use burn_zero_llm::pipeline::ids_as_input;

/// One 3D run: the model, the grid, the batch and the optimizer.
#[derive(Clone, Debug)]
pub struct Run3d {
    /// The model (seeded random weights, drawn the same on every rank).
    pub config: LlamaConfig,
    /// pipe × data × model.
    pub grid: [usize; 3],
    /// Micro-batches per step and data shard.
    pub micro: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Adam's learning rate.
    pub lr: f64,
    /// Seed of the weights.
    pub seed: u64,
    /// The pipeline schedule (one chunk per rank).
    pub schedule: Schedule,
}

impl Run3d {
    /// Sequences per step (every data shard's micro-batches).
    pub fn rows(&self) -> usize {
        self.grid[1] * self.micro * self.batch
    }

    /// Step `step`'s tokens, `[rows, seq + 1]`, the same for every run of this shape: two
    /// batches taken in turn, so that the loss falls as the model learns them.
    pub fn tokens<B: Backend>(&self, step: usize, device: &B::Device) -> Tensor<B, 2, Int> {
        let state = 0x3d_5eedu64.wrapping_mul(step as u64 % 2 + 3);
        let ids = synthetic_ids(state, self.rows() * (self.seq + 1), self.config.vocab_size);
        Tensor::from_data(TensorData::new(ids, [self.rows(), self.seq + 1]), device)
    }

    /// The seeded model. The backend's generator is shared by the whole process: two tests
    /// drawing at once would interleave their draws, so seeding and drawing hold a lock.
    fn model<B: Backend>(&self, device: &B::Device) -> burn_zero_llm::Llama<B> {
        static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _drawing = DRAW.lock().unwrap_or_else(|e| e.into_inner());
        B::seed(device, self.seed);
        draw_parameters(self.config.init::<B>(device))
    }

    /// The reference: the whole model on the whole batch, `steps` Adam steps; the losses.
    pub fn reference<B: AutodiffBackend>(&self, device: &B::Device) -> Vec<f32> {
        let mut model = self.model::<B>(device);
        let mut optim = AdamConfig::new().init();
        let mut losses = Vec::new();
        for step in 0..self.steps {
            let loss = model.loss(self.tokens(step, device));
            losses.push(loss.clone().into_scalar().elem::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(self.lr, model, grads);
        }
        losses
    }

    /// This rank's part of the 3D run over `world` (the grid's size): its coordinates (pipe,
    /// data, model), on the last stage each step's loss over the whole batch (averaged over
    /// the data axis), and each step's time in seconds (to the device's end of it).
    pub fn rank<B: AutodiffBackend + ModelParallelBackend>(
        &self,
        world: Arc<dyn Communicator>,
        device: &B::Device,
    ) -> Result<RankRun, String> {
        let [pipes, shards, parts] = self.grid;
        let topo = Topology::pipe_data_model(pipes, shards, parts);
        let rank = world.rank();
        let at = |axis| topo.coord_along(rank, axis);
        let (stage, shard) = (at("pipe"), at("data"));
        let axis = |name| topo.axis_comm(world.clone(), name);
        let (mut pipe, data) = (axis("pipe")?, axis("data")?);
        pipe.open_links(&pipeline_links(pipes))?;
        let group = ModelGroup::new(Arc::from(axis("model")?));
        // The decoder layers are alike: balanced by parameters is balanced by count.
        let weights = vec![1; self.config.num_layers];
        let layers = split(&weights, pipes, SplitMethod::Balanced);
        let full = self.model::<B>(device);
        let mut module = ParallelLlamaStage::new(&full, &layers, stage, self.seq, group.clone())?;
        drop(full);
        let vocab_start = module.vocab_start();
        let mut optim = Replicated(AdamConfig::new().init::<B, ParallelLlamaStage<B>>());
        let stream = self.schedule.stream(pipes, self.micro, stage);
        let (batch, seq) = (self.batch, self.seq);
        let (mut losses, mut times) = (Vec::new(), Vec::new());
        for step in 0..self.steps {
            let start = std::time::Instant::now();
            let tokens = self.tokens::<B>(step, device);
            let rows = |mb: usize| {
                let start = (shard * self.micro + mb) * batch;
                tokens.clone().slice([start..start + batch, 0..seq + 1])
            };
            let inputs = |mb: usize| ids_as_input(rows(mb).slice([0..batch, 0..seq]));
            let loss = |mb: usize, logits: Tensor<B, 2>| {
                let targets = rows(mb)
                    .slice([0..batch, 1..seq + 1])
                    .reshape([batch * seq]);
                vocab_parallel_cross_entropy(logits, targets, vocab_start, &group)
            };
            let spec = StageSpec {
                stage,
                stages: pipes,
                micro_batches: self.micro,
                rows: if stage == 0 { batch } else { batch * seq },
                in_features: if stage == 0 {
                    seq
                } else {
                    self.config.hidden_size
                },
                inputs: &inputs,
                loss: &loss,
                checkpoint: None,
            };
            let (next, l) = run_step(
                module,
                &mut optim,
                self.lr,
                &stream,
                &spec,
                pipe.as_ref(),
                Some(data.as_ref()),
            )
            .map_err(|e| format!("step {step}: {e}"))?;
            module = next;
            B::sync(device).map_err(|e| format!("step {step}: {e:?}"))?;
            times.push(start.elapsed().as_secs_f64());
            if let Some(l) = l {
                losses.push(mean_over(data.as_ref(), l).map_err(|e| format!("step {step}: {e}"))?);
            }
        }
        Ok(RankRun {
            coords: [stage, shard, at("model")],
            losses,
            step_s: times,
        })
    }
}

/// What one rank of a 3D run reports.
#[derive(Clone, Debug)]
pub struct RankRun {
    /// Its coordinates: pipe, data, model.
    pub coords: [usize; 3],
    /// On the last stage, each step's loss over the whole batch; elsewhere empty.
    pub losses: Vec<f32>,
    /// Each step's time in seconds, to the device's end of it.
    pub step_s: Vec<f64>,
}

/// `value` averaged over `comm`'s ranks.
fn mean_over(comm: &dyn Communicator, value: f32) -> Result<f32, CommError> {
    let mut v = [value];
    comm.all_reduce(v.as_mut_slice().into(), ReduceOp::Avg)?;
    Ok(v[0])
}

/// The CPU case of `tests/llama_3d.rs`: 2 × 2 × 2 on a tiny Llama whose shapes the model axis
/// does not divide evenly (3 key/value heads, 21 MLP features, 25 vocabulary ids over 2 ranks).
pub fn tiny(tied: bool) -> Run3d {
    Run3d {
        config: LlamaConfig::new(25, 12, 21, 4, 3, 3).with_tie_embeddings(tied),
        grid: [2, 2, 2],
        micro: 4,
        batch: 2,
        seq: 6,
        steps: 5,
        lr: 3e-3,
        seed: 7,
        schedule: Schedule::OneFOneB,
    }
}

/// The recipe's model (SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads, 3 key/value
/// heads, vocabulary 49,152, tied embeddings) in `grid` (2 × 2 × 2 on 8 GPUs).
pub fn smollm2(steps: usize, grid: [usize; 3]) -> Run3d {
    Run3d {
        config: LlamaConfig::new(49152, 576, 1536, 30, 9, 3)
            .with_rope_theta(100000.0)
            .with_tie_embeddings(true),
        grid,
        micro: 4,
        batch: 4,
        seq: 256,
        steps,
        lr: 3e-4,
        seed: 1234,
        schedule: Schedule::OneFOneB,
    }
}
