//! Pieces shared by the example programs: a small MLP and synthetic data, and the f64 step
//! the device checks compare against.
#![warn(missing_docs)]

pub mod cli;
#[cfg(feature = "host-profile")]
pub mod host_profile;
pub mod mlp_reference;
pub mod plot;

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, activation};

/// A two-hidden-layer MLP for 1-D regression.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
    l3: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// A randomly initialized MLP with hidden width `hidden`.
    pub fn new(hidden: usize, device: &B::Device) -> Self {
        Self {
            l1: LinearConfig::new(1, hidden).init(device),
            l2: LinearConfig::new(hidden, hidden).init(device),
            l3: LinearConfig::new(hidden, 1).init(device),
        }
    }

    /// The first layer's weight.
    pub fn first_weight(&self) -> Tensor<B, 2> {
        self.l1.weight.val()
    }

    /// Forward pass on `[batch, 1]` inputs.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = activation::tanh(self.l1.forward(x));
        let x = activation::tanh(self.l2.forward(x));
        self.l3.forward(x)
    }
}

/// Rows `rows` of the global batch of `step`: `x` in [-3, 3] and `y = sin(x) + x/3`.
pub fn batch<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let n = rows.len();
    let xs: Vec<f32> = rows
        .map(|i| {
            // A fixed integer hash: every rank computes the same global batch without an RNG.
            let h = (step as u64 * 1_000_003 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (h as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect();
    let ys: Vec<f32> = xs.iter().map(|x| x.sin() + x / 3.0).collect();
    (
        Tensor::from_data(TensorData::new(xs, [n, 1]), device),
        Tensor::from_data(TensorData::new(ys, [n, 1]), device),
    )
}

/// Initializes every parameter now: burn 0.21 initializes `Param`s lazily on first use, which
/// would draw from the backend's RNG in whatever order rank threads happen to run.
pub fn materialize<B: Backend, M: Module<B>>(module: M) -> M {
    struct Materialize;
    impl<B: Backend> ModuleMapper<B> for Materialize {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Materialize)
}

/// An offloaded optimizer's step, per step over `steps` steps, as the benches report it.
pub fn offload_breakdown(t: &burn_zero::engine::OffloadTimings, steps: usize) -> serde_json::Value {
    let per = |d: std::time::Duration| d.as_secs_f64() / steps.max(1) as f64;
    serde_json::json!({"d2h_s": per(t.d2h), "backward_d2h_s": per(t.backward_d2h),
        "cpu_step_s": per(t.cpu_step), "overlapped_cpu_step_s": per(t.ahead_cpu_step),
        "sub_groups_stepped_ahead": t.ahead_sub_groups, "h2d_s": per(t.h2d),
        "optimizer_total_s": per(t.total), "steps_into_host": t.into_host})
}
