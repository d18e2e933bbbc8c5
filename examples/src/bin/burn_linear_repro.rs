//! A minimal program for burn upstream, burn 0.21 alone (no burn-zero code; its f64 reference
//! is plain Rust in `examples/src/mlp_reference.rs`): burn-cuda's f32 matmul is TF32, with no
//! way to ask for full f32 (`docs/UPSTREAM-burn-cuda-tf32.md`). It prints the largest error
//! against an f64 host computation (relative to the largest magnitude) on burn-cuda with
//! fusion (`Cuda`, the default) and without (`CubeBackend`) of:
//! - `dY·Wᵀ` as burn's `linear_x_backward` forms it (a batched `[3, 11, 65]` times the weight
//!   transposed and unsqueezed to `[1, 65, 129]`), with the weight copied contiguous, with a
//!   non-broadcast transposed batch, and folded into one 2-D product;
//! - a `Linear` layer's input gradient through `Autodiff`;
//! - a two-layer MLP's training step: its first layer's gradients are off by 1e-1, and within
//!   TF32's error against f64 given relu's mask from the device. One pre-activation lies
//!   within TF32's rounding of zero and changes sign; every gradient below the mask changes
//!   by that element's whole term. No kernel is wrong.
//!
//! Errors near 1e-4 are TF32's; `OFF` marks an error over 1e-2. Exit status 0 either way:
//! the output is the evidence.

use burn::backend::Autodiff;
use burn::module::Param;
use burn::nn::LinearConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_backend::distributed::DistributedBackend;
use burn_zero_examples::mlp_reference::{self, DIMS, mm, transposed, values};

type CudaFusion = burn::backend::Cuda;
type CudaNoFusion = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const BATCH: usize = 3;
const TOKENS: usize = 11;
const D_IN: usize = 129;
const D_OUT: usize = 65;

/// `g [rows, D_OUT] · wᵀ` for `w [D_IN, D_OUT]`, in f64.
fn reference(g: &[f32], w: &[f32]) -> Vec<f64> {
    let f64s = |v: &[f32]| -> Vec<f64> { v.iter().map(|x| f64::from(*x)).collect() };
    let rows = g.len() / D_OUT;
    mm(
        &f64s(g),
        &transposed(&f64s(w), D_IN, D_OUT),
        (rows, D_OUT, D_IN),
    )
}

/// The largest error relative to the largest reference magnitude.
fn error<B: Backend, const D: usize>(got: Tensor<B, D>, want: &[f64]) -> f64 {
    let got = got.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "sizes");
    let scale = want.iter().fold(1e-12f64, |s, v| s.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f64, |e, (g, w)| e.max((f64::from(*g) - w).abs() / scale))
}

fn report(backend: &str, case: &str, err: f64) {
    let verdict = if err > 1e-2 { "OFF" } else { "ok" };
    println!("{backend:<22} {case:<62} max rel err {err:.2e}  {verdict}");
}

/// Every product and the Linear gradient on backend `B`.
fn cases<B: DistributedBackend>(backend: &str) {
    let device = B::Device::default();
    let (g_host, w_host) = (values(BATCH * TOKENS * D_OUT, 1), values(D_IN * D_OUT, 2));
    let want = reference(&g_host, &w_host);
    let g = Tensor::<B, 3>::from_data(
        TensorData::new(g_host.clone(), [BATCH, TOKENS, D_OUT]),
        &device,
    );
    let w = Tensor::<B, 2>::from_data(TensorData::new(w_host.clone(), [D_IN, D_OUT]), &device);
    // The weight transposed on the host: a contiguous [D_OUT, D_IN].
    let wt_host: Vec<f32> = (0..D_OUT * D_IN)
        .map(|j| w_host[(j % D_IN) * D_OUT + j / D_IN])
        .collect();
    let wt = Tensor::<B, 2>::from_data(TensorData::new(wt_host, [D_OUT, D_IN]), &device);
    // The weight repeated per batch on the host, then viewed transposed: no broadcast.
    let w3_host: Vec<f32> = (0..BATCH).flat_map(|_| w_host.clone()).collect();
    let w3 = Tensor::<B, 3>::from_data(TensorData::new(w3_host, [BATCH, D_IN, D_OUT]), &device);

    let broadcast_transposed = g.clone().matmul(w.clone().transpose().unsqueeze::<3>());
    report(
        backend,
        "[3,11,65] x [1,65,129] broadcast, transposed view",
        error(broadcast_transposed, &want),
    );
    let broadcast_contiguous = g.clone().matmul(wt.clone().unsqueeze::<3>());
    report(
        backend,
        "[3,11,65] x [1,65,129] broadcast, contiguous",
        error(broadcast_contiguous, &want),
    );
    let batched_transposed = g.clone().matmul(w3.swap_dims(1, 2));
    report(
        backend,
        "[3,11,65] x [3,65,129] no broadcast, transposed view",
        error(batched_transposed, &want),
    );
    let folded = g
        .clone()
        .reshape([BATCH * TOKENS, D_OUT])
        .matmul(w.clone().transpose())
        .reshape([BATCH, TOKENS, D_IN]);
    report(
        backend,
        "[33,65] x [65,129] folded 2-D, transposed view",
        error(folded, &want),
    );

    // The symptom: a Linear layer's input gradient on a 3-D input, through Autodiff.
    let mut linear = LinearConfig::new(D_IN, D_OUT)
        .with_bias(false)
        .init::<Autodiff<B>>(&device);
    linear.weight = Param::from_tensor(Tensor::from_data(
        TensorData::new(w_host, [D_IN, D_OUT]),
        &device,
    ));
    let x = Tensor::<Autodiff<B>, 3>::from_data(
        TensorData::new(values(BATCH * TOKENS * D_IN, 3), [BATCH, TOKENS, D_IN]),
        &device,
    )
    .require_grad();
    let dy = Tensor::<Autodiff<B>, 3>::from_data(
        TensorData::new(g_host, [BATCH, TOKENS, D_OUT]),
        &device,
    );
    // d(Σ out ⊙ dY)/dx = dY·Wᵀ.
    let grads = (linear.forward(x.clone()) * dy).sum().backward();
    report(
        backend,
        "Linear(129 -> 65) on [3,11,129]: input gradient (Autodiff)",
        error(x.grad(&grads).expect("x's gradient"), &want),
    );
}

/// A two-layer MLP's training step, `Linear(257→129) → relu → Linear(129→65)`, mean squared
/// error, on a `[3, 11, 257]` input: the gradients of w1, b1, w2, b2 against f64, then again
/// with relu's mask taken from the device's pre-activations (TF32 rounds a value near zero
/// across it; the flips are counted).
fn mlp<B: DistributedBackend>(backend: &str) {
    let device = B::Device::default();
    let [x, y, w1, b1, w2, b2] = mlp_reference::data();
    let [d_in, d_hid, d_out] = DIMS;
    type A<B> = Autodiff<B>;
    let layer = |w: Vec<f32>, b: Vec<f32>, [i, o]: [usize; 2]| {
        let mut l = LinearConfig::new(i, o).init::<A<B>>(&device);
        l.weight = Param::from_tensor(Tensor::from_data(TensorData::new(w, [i, o]), &device));
        l.bias = Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(b, [o]),
            &device,
        )));
        l
    };
    let (l1, l2) = (layer(w1, b1, [d_in, d_hid]), layer(w2, b2, [d_hid, d_out]));
    let xt = Tensor::<A<B>, 3>::from_data(TensorData::new(x, [3, 11, d_in]), &device);
    let yt = Tensor::<A<B>, 3>::from_data(TensorData::new(y, [3, 11, d_out]), &device);
    let pre = l1.forward(xt);
    let pre_device: Vec<f64> = pre
        .clone()
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    let out = l2.forward(burn::tensor::activation::relu(pre));
    let grads = (out - yt).powf_scalar(2.0).mean().backward();
    let bias = |l: &burn::nn::Linear<A<B>>| l.bias.as_ref().unwrap().val().grad(&grads).unwrap();
    let got = [
        l1.weight.val().grad(&grads).unwrap().into_data(),
        bias(&l1).into_data(),
        l2.weight.val().grad(&grads).unwrap().into_data(),
        bias(&l2).into_data(),
    ];
    let (exact, masked) = (
        mlp_reference::step(None),
        mlp_reference::step(Some(&pre_device)),
    );
    let (want, pre_exact, want_masked) = (exact.grads, exact.pre, masked.grads);
    let flips = pre_device
        .iter()
        .zip(&pre_exact)
        .filter(|(a, b)| (**a > 0.0) != (**b > 0.0))
        .count();
    for (i, name) in ["w1", "b1", "w2", "b2"].iter().enumerate() {
        // Flattened: `error` compares element lists.
        let flat = got[i].clone().convert::<f32>().to_vec::<f32>().unwrap();
        let got =
            || Tensor::<B, 1>::from_data(TensorData::new(flat.clone(), [flat.len()]), &device);
        report(
            backend,
            &format!("MLP 257-relu-129-65 on [3,11,257], MSE: gradient of {name}"),
            error(got(), &want[i]),
        );
        report(
            backend,
            &format!("  the same against f64 with the device's relu mask ({flips} flips)"),
            error(got(), &want_masked[i]),
        );
    }
}

fn main() {
    println!("burn 0.21.0, burn-cuda; f64 reference on the host");
    cases::<CudaFusion>("Cuda (fusion)");
    mlp::<CudaFusion>("Cuda (fusion)");
    cases::<CudaNoFusion>("CubeBackend (no fusion)");
    mlp::<CudaNoFusion>("CubeBackend (no fusion)");
}
