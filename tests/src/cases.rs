//! Computations run twice: on the backend under test and on plain burn (the reference).
//!
//! This file is compiled into our test crate *and* into `reference/`, a separate workspace
//! that builds plain `Autodiff<NdArray>` without burn's `distributed` feature (which our
//! workspace needs, and which makes plain `Autodiff<NdArray>` unusable). It uses only burn's
//! public API, nothing of burn-zero, so the reference side is independent of the code under test.
// burn's `slice` takes an array with one range per dimension: `[0..3]` slices a 1-D tensor.
#![allow(clippy::single_range_in_vec_init)]

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Distribution, Int, Tensor, TensorData, activation};

/// A named result to compare bit for bit.
pub type Outcome = (String, TensorData);

/// Deterministic, never-zero, irregular values (no RNG: thread ranks share NdArray's seed).
pub fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i * 7919 + salt * 104729) % 1009) as f32 / 1009.0;
            (x - 0.37) * 1.7 + 0.013 * ((i + salt) % 5) as f32 + 1e-3
        })
        .collect()
}

/// A float tensor of `shape` filled with [`values`].
pub fn tensor<B: Backend, const D: usize>(
    shape: [usize; D],
    salt: usize,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, salt), shape), device)
}

/// A linear layer with deterministic weights (scaled by 0.5) and bias (by 0.1) from `salt`.
pub fn seeded_linear<B: Backend>(
    d_in: usize,
    d_out: usize,
    salt: usize,
    device: &B::Device,
) -> Linear<B> {
    let mut l = LinearConfig::new(d_in, d_out).init::<B>(device);
    l.weight = Param::from_tensor(tensor::<B, 2>([d_in, d_out], salt, device).mul_scalar(0.5));
    l.bias = Some(Param::from_tensor(
        tensor::<B, 1>([d_out], salt + 1, device).mul_scalar(0.1),
    ));
    l
}

/// `t`'s values as f32.
pub fn f32_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// `got` equals `want` element by element within fp32 tolerance (1e-5 relative, 1e-6
/// absolute); a failure names `what` and the element.
pub fn assert_close(what: &str, got: impl AsRef<[f32]>, want: impl AsRef<[f32]>) {
    let (got, want) = (got.as_ref(), want.as_ref());
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(b.abs()) + 1e-6,
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

/// Float, int and bool ops through burn's tensor API, on odd shapes.
pub fn op_suite<B: Backend>(device: &B::Device) -> Vec<Outcome> {
    let a = tensor::<B, 2>([7, 15], 1, device);
    let b = tensor::<B, 2>([7, 15], 2, device);
    let w = tensor::<B, 2>([15, 3], 3, device);
    let v = tensor::<B, 1>([17], 4, device);
    let mut out: Vec<Outcome> = Vec::new();
    let mut push = |name: &str, data: TensorData| out.push((name.to_string(), data));

    push("add", (a.clone() + b.clone()).into_data());
    push(
        "sub_mul_div",
        ((a.clone() - b.clone()) * a.clone() / (b.clone().abs() + 0.5)).into_data(),
    );
    push("matmul", a.clone().matmul(w.clone()).into_data());
    push("exp_log", (a.clone().exp() + 1.0).log().into_data());
    push(
        "sqrt_pow",
        b.clone().abs().sqrt().powf_scalar(1.7).into_data(),
    );
    push(
        "tanh_sin_cos",
        (a.clone().tanh() + a.clone().sin() * a.clone().cos()).into_data(),
    );
    push("softmax", activation::softmax(a.clone(), 1).into_data());
    push(
        "log_softmax",
        activation::log_softmax(b.clone(), 0).into_data(),
    );
    push(
        "gelu_relu_sigmoid",
        (activation::gelu(a.clone())
            + activation::relu(b.clone())
            + activation::sigmoid(a.clone()))
        .into_data(),
    );
    push(
        "sum_dim_mean_dim",
        (a.clone().sum_dim(1) + a.clone().mean_dim(1)).into_data(),
    );
    push(
        "sum_mean_var",
        Tensor::cat(
            vec![
                a.clone().sum().reshape([1]),
                a.clone().mean().reshape([1]),
                a.clone().var(1).sum().reshape([1]),
            ],
            0,
        )
        .into_data(),
    );
    push(
        "max_min_dim",
        (a.clone().max_dim(0) - a.clone().min_dim(1).sum_dim(0)).into_data(),
    );
    push(
        "transpose_reshape",
        a.clone().transpose().reshape([5, 21]).into_data(),
    );
    push(
        "slice_cat",
        Tensor::cat(
            vec![a.clone().slice([0..3, 2..9]), b.clone().slice([4..7, 0..7])],
            0,
        )
        .into_data(),
    );
    push(
        "clamp_mask",
        a.clone()
            .clamp(-0.3, 0.4)
            .mask_fill(b.clone().greater_elem(0.2), 9.0)
            .into_data(),
    );
    push("cumsum_flip", v.clone().cumsum(0).flip([0]).into_data());
    push(
        "gather_select",
        a.clone()
            .select(0, Tensor::<B, 1, Int>::from_ints([6, 0, 3, 3], device))
            .into_data(),
    );
    push("argmax_int", a.clone().argmax(1).into_data());
    push(
        "int_ops",
        (a.clone().argmin(0) * 3 + 7).sum_dim(0).into_data(),
    );
    push(
        "int_arange",
        (Tensor::<B, 1, Int>::arange(0..17, device).reshape([17]) % 5).into_data(),
    );
    push(
        "bool_ops",
        a.clone()
            .greater(b.clone())
            .bool_and(b.clone().lower_elem(0.5))
            .bool_not()
            .into_data(),
    );
    push(
        "bool_to_float",
        a.clone()
            .equal_elem(0.0)
            .bool_not()
            .float()
            .mul(v.clone().slice([0..15]).unsqueeze::<2>())
            .into_data(),
    );
    push(
        "bool_any_all",
        Tensor::<B, 1, Bool>::cat(
            vec![
                a.clone().greater_elem(1.0).any(),
                a.clone().lower_elem(2.0).all(),
            ],
            0,
        )
        .int()
        .into_data(),
    );
    push(
        "expand_repeat",
        v.clone()
            .slice([0..3])
            .unsqueeze_dim::<2>(1)
            .expand([3, 4])
            .repeat_dim(0, 2)
            .into_data(),
    );
    push("sort", v.clone().sort(0).into_data());
    push(
        "from_distribution_shape",
        Tensor::<B, 2>::zeros([3, 5], device)
            .add_scalar(2.5)
            .into_data(),
    );
    push(
        "conv1d",
        burn::tensor::module::conv1d(
            a.clone().reshape([1, 7, 15]),
            tensor::<B, 3>([2, 7, 3], 5, device),
            Some(tensor::<B, 1>([2], 6, device)),
            burn::tensor::ops::ConvOptions::new([2], [1], [1], 1),
        )
        .into_data(),
    );
    push(
        "max_pool",
        burn::tensor::module::max_pool1d(a.clone().reshape([1, 7, 15]), 3, 2, 1, 1, false)
            .into_data(),
    );
    let _ = Distribution::Default; // the suite stays deterministic: no random ops
    out
}

/// Gradients of a composite function of several ops.
pub fn autodiff_suite<B: AutodiffBackend>(device: &B::Device) -> Vec<Outcome> {
    let a = tensor::<B, 2>([7, 15], 1, device).require_grad();
    let w = tensor::<B, 2>([15, 3], 3, device).require_grad();
    let v = tensor::<B, 1>([3], 4, device).require_grad();
    let h = activation::gelu(a.clone().matmul(w.clone()) + v.clone().unsqueeze());
    let y = activation::log_softmax(h.clone() * activation::sigmoid(h.clone()), 1)
        .sum_dim(1)
        .exp()
        .mean()
        + a.clone().powf_scalar(2.0).sqrt().sum() * 0.01;
    let grads = y.backward();
    vec![
        ("loss".to_string(), y.into_data()),
        (
            "grad_a".to_string(),
            a.grad(&grads).expect("grad a").into_data(),
        ),
        (
            "grad_w".to_string(),
            w.grad(&grads).expect("grad w").into_data(),
        ),
        (
            "grad_v".to_string(),
            v.grad(&grads).expect("grad v").into_data(),
        ),
    ]
}

/// A 3-layer MLP with odd layer sizes.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
    l3: Linear<B>,
}

/// Layer sizes of [`Mlp`]: in, hidden, hidden, out.
pub const MLP_DIMS: [usize; 4] = [7, 15, 9, 3];

impl<B: Backend> Mlp<B> {
    /// The MLP with deterministic weights (no RNG).
    pub fn new(device: &B::Device) -> Self {
        let layer = |i: usize| {
            let (d_in, d_out) = (MLP_DIMS[i], MLP_DIMS[i + 1]);
            let mut linear = LinearConfig::new(d_in, d_out).init::<B>(device);
            linear.weight =
                Param::from_tensor(tensor::<B, 2>([d_in, d_out], 10 + i, device).mul_scalar(0.5));
            linear.bias = Some(Param::from_tensor(
                tensor::<B, 1>([d_out], 20 + i, device).mul_scalar(0.1),
            ));
            linear
        };
        Self {
            l1: layer(0),
            l2: layer(1),
            l3: layer(2),
        }
    }

    /// The first layer's weight (what tests inspect gradients of).
    pub fn l1_weight(&self) -> Tensor<B, 2> {
        self.l1.weight.val()
    }

    /// Forward pass.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = activation::gelu(self.l1.forward(x));
        let x = activation::relu(self.l2.forward(x));
        self.l3.forward(x)
    }
}

/// `layers` equal square Linear layers without bias, tanh between them: the model of the
/// ZeRO-3 gather, memory and construction tests. Weights are lazy (initialized on first use).
#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Stack<B> {
    /// `layers` layers of `width` × `width`.
    pub fn new(layers: usize, width: usize, device: &B::Device) -> Self {
        Self {
            layers: (0..layers)
                .map(|_| {
                    LinearConfig::new(width, width)
                        .with_bias(false)
                        .init(device)
                })
                .collect(),
        }
    }

    /// Forward pass.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.forward_skipping(x, None)
    }

    /// Forward pass without layer `skip` (control flow that differs between ranks).
    pub fn forward_skipping(&self, x: Tensor<B, 2>, skip: Option<usize>) -> Tensor<B, 2> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != skip)
            .fold(x, |x, (_, layer)| activation::tanh(layer.forward(x)))
    }
}

/// Rows `rows` of a global batch of `total` samples: inputs `[rows, 7]`, targets `[rows, 3]`,
/// drawn from [`values`] with the salts `salt` and `salt + 100`.
pub fn batch_rows<B: Backend>(
    total: usize,
    salt: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x = tensor::<B, 2>([total, MLP_DIMS[0]], salt, device);
    let y = tensor::<B, 2>([total, MLP_DIMS[3]], salt + 100, device);
    (x.slice([rows.clone()]), y.slice([rows]))
}

/// The batch of step `step` of [`train_mlp`].
pub fn batch<B: Backend>(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    batch_rows(BATCH, 100 + step, rows, device)
}

/// Steps the parity tests train.
pub const TRAIN_STEPS: usize = 10;

/// Global batch size of [`train_mlp`].
pub const BATCH: usize = 12;

/// Trains the MLP with Adam on the full batch for `steps`; returns the losses and parameters.
pub fn train_mlp<B: AutodiffBackend>(device: &B::Device, steps: usize) -> Vec<Outcome> {
    let mut model = Mlp::<B>::new(device);
    let mut optim = AdamConfig::new().with_epsilon(1e-6).init::<B, Mlp<B>>();
    let mut out = Vec::new();
    for step in 0..steps {
        let (x, y) = batch::<B>(step, 0..BATCH, device);
        let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
        out.push((format!("loss_{step}"), loss.clone().into_data()));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    for (i, p) in param_data(&model).into_iter().enumerate() {
        out.push((format!("param_{i}"), p));
    }
    out
}

/// Every float parameter's values as f32, in module order.
pub fn param_values<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<f32>> {
    param_data(module)
        .into_iter()
        .map(|d| d.convert::<f32>().to_vec::<f32>().expect("f32 values"))
        .collect()
}

/// The float parameters of a module as data, in visiting order.
pub fn param_data<B: Backend, M: Module<B>>(module: &M) -> Vec<TensorData> {
    struct Collect(Vec<TensorData>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().into_data());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// One line per outcome: `name dtype shape hex-bytes`, the reference file format.
pub fn encode(outcomes: &[Outcome]) -> String {
    let mut s = String::new();
    for (name, data) in outcomes {
        let shape: Vec<String> = data.shape.iter().map(|d| d.to_string()).collect();
        let hex: String = data.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        s.push_str(&format!(
            "{name} {:?} {} {hex}\n",
            data.dtype,
            shape.join("x")
        ));
    }
    s
}

/// The engine parity run: global batch, steps, clipping threshold and AdamW settings that
/// `tests/tests/engine_parity.rs` also writes into its `ds_config.json`.
pub mod engine_run {
    use super::*;
    use burn::module::ModuleVisitor;
    use burn::optim::AdamWConfig;

    /// Samples per optimizer step over all ranks (divides by 1–4 ranks × 1 or 3 micro-steps).
    pub const GLOBAL_BATCH: usize = 36;
    /// Optimizer steps.
    pub const STEPS: usize = 10;
    /// `gradient_clipping`: low enough that early steps clip.
    pub const CLIP: f64 = 0.3;
    /// AdamW `weight_decay`, `eps`, betas.
    pub const WEIGHT_DECAY: f64 = 0.01;
    /// AdamW `eps`.
    pub const EPS: f64 = 1e-6;
    /// WarmupLR (linear): min, max and warmup steps.
    pub const WARMUP: (f64, f64, usize) = (0.002, 0.02, 4);

    /// The learning rate of optimizer step `k` (1-based) under DeepSpeed's WarmupLR, written
    /// from its formula: step 1 uses the construction value (min), step k ≥ 2 the value at
    /// iteration i = k − 2, min + (max − min)·i/N while i < N, then max.
    pub fn lr(k: usize) -> f64 {
        let (min, max, n) = WARMUP;
        if k < 2 {
            return min;
        }
        let i = k - 2;
        if i < n {
            min + (max - min) * i as f64 / n as f64
        } else {
            max
        }
    }

    /// Rows `rows` of the global batch of `step`.
    pub fn batch<B: Backend>(
        step: usize,
        rows: std::ops::Range<usize>,
        device: &B::Device,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        batch_rows(GLOBAL_BATCH, 300 + step, rows, device)
    }

    /// Mean squared error, the loss of the run.
    pub fn loss<B: Backend>(model: &Mlp<B>, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        (model.forward(x) - y).powf_scalar(2.0).mean()
    }

    /// Global-norm clipping as DeepSpeed does it: scale every gradient by clip/(‖g‖ + 1e−6)
    /// when ‖g‖ + 1e−6 > clip. Returns the gradients and ‖g‖ (computed in f64).
    pub fn clip<B: AutodiffBackend, M: Module<B>>(
        mut grads: GradientsParams,
        model: &M,
        max: f64,
    ) -> (GradientsParams, f64) {
        struct Norm<'a>(&'a GradientsParams, f64);
        impl<B: AutodiffBackend> ModuleVisitor<B> for Norm<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                if let Some(g) = self.0.get::<B::InnerBackend, D>(p.id) {
                    let v = g.into_data().convert::<f32>().to_vec::<f32>().unwrap();
                    self.1 += v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>();
                }
            }
        }
        struct Scale<'a>(&'a mut GradientsParams, f32);
        impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                if let Some(g) = self.0.remove::<B::InnerBackend, D>(p.id) {
                    self.0
                        .register::<B::InnerBackend, D>(p.id, g.mul_scalar(self.1));
                }
            }
        }
        let mut norm = Norm(&grads, 0.0);
        model.visit(&mut norm);
        let norm = norm.1.sqrt();
        if norm + 1e-6 > max {
            model.visit(&mut Scale(&mut grads, (max / (norm + 1e-6)) as f32));
        }
        (grads, norm)
    }

    /// The unsharded single-process run: losses, gradient norms, final parameters.
    pub fn train<B: AutodiffBackend>(device: &B::Device) -> Vec<Outcome> {
        let mut model = Mlp::<B>::new(device);
        let mut optim = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.999)
            .with_epsilon(EPS as f32)
            .with_weight_decay(WEIGHT_DECAY as f32)
            .init::<B, Mlp<B>>();
        let mut out = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch::<B>(step, 0..GLOBAL_BATCH, device);
            let loss = loss(&model, x, y);
            out.push((format!("loss_{step}"), loss.clone().into_data()));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let (grads, norm) = clip(grads, &model, CLIP);
            out.push((
                format!("norm_{step}"),
                TensorData::new(vec![norm as f32], [1]),
            ));
            model = optim.step(lr(step + 1), model, grads);
        }
        for (i, p) in param_data(&model).into_iter().enumerate() {
            out.push((format!("param_{i}"), p));
        }
        out
    }
}
