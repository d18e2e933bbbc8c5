//! Training-step time of the engine on GPUs, one process per GPU (start it with
//! `burn-zero run --nproc-per-node N -- bench-engine STAGE`): a deep MLP (`LAYERS` × `WIDTH`²
//! weights, ~`LAYERS`·`WIDTH`² parameters), AdamW, fp32, one micro-batch per step.
//!
//! Rank 0 prints one JSON line with the median step time; `BURN_ZERO_HOST_COLLECTIVES=1`
//! measures the host-staged path and `BURN_ZERO_CUBLASLT=1` cuBLASLt matmuls for comparison. `bench/engine_torch.py` is the peer.

use std::time::Instant;

use burn::backend::Cuda;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_zero::DeepSpeedConfig;
use burn_zero::dist::init_nccl;
use burn_zero::engine::{ZeroAutodiff, initialize};

const WIDTH: usize = 4096;
const LAYERS: usize = 8;
const BATCH: usize = 64;
const STEPS: usize = 12;
const WARMUP: usize = 4;

#[derive(Module, Debug)]
struct DeepMlp<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> DeepMlp<B> {
    fn new(device: &B::Device) -> Self {
        let layers = (0..LAYERS)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
            .collect();
        Self { layers }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = relu(layer.forward(x));
        }
        x
    }
}

fn main() {
    let stage: u8 = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("STAGE is 0, 1 or 2"))
        .unwrap_or(2);
    let (env, nccl) = init_nccl().unwrap_or_else(|e| panic!("{e}"));
    let world = env.world_size;
    let device = burn::backend::cuda::CudaDevice::new(env.local_rank);
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": {BATCH}, "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "overlap_comm": true,
                "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000}},
            "burn_zero": {{"matmul": {{"allow_tf32": true}}}}}}"#
    );
    let config = DeepSpeedConfig::from_json(&json).expect("config").config;
    type B = ZeroAutodiff<Cuda>;
    let model = DeepMlp::<B>::new(&device);
    let params = model.num_params();
    let mut engine = initialize::<Cuda, _>(model, &config, std::sync::Arc::new(nccl))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut times = Vec::new();
    let mut last_loss = 0.0;
    for step in 0..STEPS {
        let x = Tensor::<B, 2>::random([BATCH, WIDTH], Distribution::Default, &device);
        <Cuda as Backend>::sync(&device).expect("sync");
        let start = Instant::now();
        let loss = engine.model().forward(x).powf_scalar(2.0).mean();
        engine.backward(loss.clone()).expect("backward");
        engine.step().expect("step");
        last_loss = loss.into_scalar();
        <Cuda as Backend>::sync(&device).expect("sync");
        if step >= WARMUP {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    if env.rank == 0 {
        let host = std::env::var("BURN_ZERO_HOST_COLLECTIVES").is_ok_and(|v| v == "1");
        println!(
            "{{\"impl\": \"burn-zero\", \"stage\": {stage}, \"world\": {world}, \"params\": {params}, \
             \"batch\": {BATCH}, \"collectives\": \"{}\", \"device_collectives\": {}, \"cublaslt_calls\": {}, \
             \"median_step_ms\": {:.2}, \"min_step_ms\": {:.2}, \"last_loss\": {last_loss}}}",
            if host { "host" } else { "device" },
            engine.device_collectives(),
            burn_zero::backend::matmul::cublaslt_calls(),
            times[times.len() / 2],
            times[0],
        );
    }
}
