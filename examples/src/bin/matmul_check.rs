//! Device check of `ZeroBackend<Cuda>`'s cuBLASLt matmuls (exits non-zero on any failure):
//! 1. odd, batched, broadcast and transposed products in f32, bf16 and f16 (tensors created in
//!    that dtype) against an f64 host reference, through cuBLASLt and through the inner backend;
//! 2. a chain of dependent matmuls and element-wise ops with no host synchronization between
//!    them (the stream order alone orders them), equal to the inner backend's chain;
//! 3. a training step of a small MLP (3-D input, biases) through `Autodiff<ZeroBackend<Cuda>>`
//!    with cuBLASLt on and off, against an f64 host reference: the cuBLASLt step must match it
//!    to 1e-4 (loss and every gradient), the step without cuBLASLt (burn-cuda's products,
//!    TF32 for f32) to 5e-3 given its own relu mask, with the mask's flips counted.

use burn::backend::{Autodiff, Cuda};
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Element, Tensor, TensorData};
use burn_zero::ZeroBackend;
use burn_zero::backend::matmul::{MatmulPolicy, cublaslt_calls, set_matmul_policy};
use burn_zero_examples::mlp_reference::{self, DIMS, ROWS, Step};

/// lhs batch, rhs batch, m, k, n, transpose lhs, transpose rhs.
type Case = ([usize; 2], [usize; 2], usize, usize, usize, bool, bool);

const CASES: [Case; 9] = [
    ([1, 1], [1, 1], 1, 7, 3, false, false),
    ([1, 1], [1, 1], 257, 129, 65, false, false),
    ([1, 1], [1, 1], 257, 129, 65, true, false),
    ([1, 1], [1, 1], 257, 129, 65, false, true),
    ([2, 3], [2, 3], 33, 17, 9, true, true),
    ([2, 3], [1, 1], 31, 64, 5, false, false),
    ([1, 1], [4, 2], 7, 1, 130, false, true),
    // A linear layer's input gradient `dY·Wᵀ` on a 3-D input: a batched lhs times a broadcast,
    // transposed weight.
    ([1, 3], [1, 1], 11, 65, 129, false, true),
    ([2, 3], [1, 1], 31, 64, 5, false, true),
];

/// The f64 product of host copies, broadcasting batch dims.
fn reference(a: &[f64], b: &[f64], case: Case) -> Vec<f64> {
    let (ab, bb, m, k, n, _, _) = case;
    let out_b = [ab[0].max(bb[0]), ab[1].max(bb[1])];
    let mut out = Vec::new();
    for i in 0..out_b[0] {
        for j in 0..out_b[1] {
            let ai = (i % ab[0]) * ab[1] + j % ab[1];
            let bi = (i % bb[0]) * bb[1] + j % bb[1];
            for r in 0..m {
                for c in 0..n {
                    out.push(
                        (0..k)
                            .map(|p| a[ai * m * k + r * k + p] * b[bi * k * n + p * n + c])
                            .sum(),
                    );
                }
            }
        }
    }
    out
}

/// `tol`: cuBLASLt's error bound; `inner_tol`: the inner backend's (TF32 for f32).
fn check_products<B: Backend>(
    dtype: &str,
    tol: f64,
    inner_tol: f64,
    paths: &[bool],
) -> Result<(), String>
where
    B::FloatElem: Element,
{
    let device = Default::default();
    let dt = <B::FloatElem as Element>::dtype();
    for case in CASES {
        let (ab, bb, m, k, n, ta, tb) = case;
        let dist = Distribution::Uniform(-1.0, 1.0);
        let rand = |shape: [usize; 4]| Tensor::<B, 4>::random(shape, dist, (&device, dt));
        let a = if ta {
            rand([ab[0], ab[1], k, m]).swap_dims(2, 3)
        } else {
            rand([ab[0], ab[1], m, k])
        };
        let b = if tb {
            rand([bb[0], bb[1], n, k]).swap_dims(2, 3)
        } else {
            rand([bb[0], bb[1], k, n])
        };
        if a.dtype() != dt || b.dtype() != dt {
            return Err(format!("inputs are {:?}, wanted {dt:?}", a.dtype()));
        }
        let want = reference(&to_vec(a.clone()), &to_vec(b.clone()), case);
        let scale = want.iter().fold(1.0f64, |s, v| s.max(v.abs()));
        for &cublas in paths {
            set_matmul_policy(MatmulPolicy {
                cublaslt: cublas,
                allow_tf32: false,
                min_macs: 0,
                ..MatmulPolicy::default()
            });
            let before = cublaslt_calls();
            let got = to_vec(a.clone().matmul(b.clone()));
            let used = cublaslt_calls() > before;
            let err = got
                .iter()
                .zip(&want)
                .fold(0.0f64, |e, (g, w)| e.max((g - w).abs() / scale));
            let path = if cublas { "cuBLASLt" } else { "inner" };
            progress(&format!(
                "{dtype} {ab:?}x{bb:?} {m}x{k}x{n} t=({ta},{tb}) {path}: max err {err:.2e} (cuBLASLt used: {used})"
            ));
            let bound = if cublas { tol } else { inner_tol };
            if got.len() != want.len() || err > bound {
                let show = |v: &[f64]| {
                    v.iter()
                        .take(6)
                        .map(|x| format!("{x:.4}"))
                        .collect::<Vec<_>>()
                };
                eprintln!("got  {:?}\nwant {:?}", show(&got), show(&want));
                let at = want.len() / 2;
                eprintln!(
                    "middle got {:?} want {:?}",
                    show(&got[at..]),
                    show(&want[at..])
                );
                return Err(format!(
                    "{dtype} {case:?} via {path}: error {err:.2e} > {tol:.0e}"
                ));
            }
            if used != cublas {
                return Err(format!(
                    "{dtype} {case:?}: cuBLASLt used = {used}, wanted {cublas}"
                ));
            }
        }
    }
    Ok(())
}

/// `steps` rounds of `x = tanh(x·w_i)·0.9 + x` on `[3, 64, 96]` with a `[96, 96]` weight per
/// round, read back once at the end.
fn chain(cublas: bool, steps: usize) -> Vec<f64> {
    set_policy(cublas);
    let device = Default::default();
    let mut x = Tensor::<ZeroBackend<Cuda>, 2>::from_data(fixed_data([3 * 64, 96], 5), &device)
        .reshape([3, 64, 96]);
    for i in 0..steps {
        let w = Tensor::<ZeroBackend<Cuda>, 2>::from_data(fixed_data([96, 96], 10 + i), &device);
        x = x.clone().matmul(w.unsqueeze::<3>()).tanh().mul_scalar(0.9) + x;
    }
    to_vec(x)
}

fn check_chain() -> Result<(), String> {
    let before = cublaslt_calls();
    let got = chain(true, 40);
    let used = cublaslt_calls() - before;
    let want = chain(false, 40);
    let scale = want.iter().fold(1e-12f64, |s, v| s.max(v.abs()));
    let err = got
        .iter()
        .zip(&want)
        .fold(0.0f64, |e, (a, b)| e.max((a - b).abs() / scale));
    progress(&format!(
        "chain of 40 dependent matmuls: {used} through cuBLASLt, max rel diff {err:.2e}"
    ));
    if used != 40 || err > 5e-3 {
        return Err(format!(
            "chain differs: {used} cuBLASLt calls, error {err:.2e}"
        ));
    }
    Ok(())
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
}

type Train = Autodiff<ZeroBackend<Cuda>>;

fn set_policy(cublaslt: bool) {
    set_matmul_policy(MatmulPolicy {
        cublaslt,
        allow_tf32: false,
        min_macs: 0,
        ..MatmulPolicy::default()
    });
}

/// Deterministic values in [-0.2, 0.2).
fn fixed_data(shape: [usize; 2], seed: usize) -> TensorData {
    let values = mlp_reference::values(shape[0] * shape[1], seed);
    TensorData::new(values.iter().map(|v| v * 0.2).collect(), shape)
}

fn to_vec<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The step of [`mlp_reference`] on the device.
fn step(cublas: bool) -> Step {
    set_policy(cublas);
    let device = Default::default();
    let [x, y, w1, b1, w2, b2] = mlp_reference::data();
    let [d_in, d_hid, d_out] = DIMS;
    let tensor = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<Train, 2>::from_data(TensorData::new(v, shape), &device)
    };
    let mut model = Mlp {
        l1: LinearConfig::new(d_in, d_hid).init::<Train>(&device),
        l2: LinearConfig::new(d_hid, d_out).init::<Train>(&device),
    };
    model.l1.weight = Param::from_tensor(tensor(w1, [d_in, d_hid]));
    model.l2.weight = Param::from_tensor(tensor(w2, [d_hid, d_out]));
    model.l1.bias = Some(Param::from_tensor(tensor(b1, [1, d_hid]).reshape([d_hid])));
    model.l2.bias = Some(Param::from_tensor(tensor(b2, [1, d_out]).reshape([d_out])));
    // [batch 3, tokens 11, 257]: the Linear layers fold the batch into one GEMM.
    let x = tensor(x, [ROWS, d_in]).reshape([3, 11, d_in]);
    let y = tensor(y, [ROWS, d_out]).reshape([3, 11, d_out]);
    let pre = model.l1.forward(x);
    let pre_values = to_vec(pre.clone());
    let out = model.l2.forward(burn::tensor::activation::relu(pre));
    let loss = (out - y).powf_scalar(2.0).mean();
    let grads = loss.backward();
    let grad = |p: &Param<Tensor<Train, 2>>| to_vec(p.val().grad(&grads).unwrap());
    let grad_b = |p: &Option<Param<Tensor<Train, 1>>>| {
        to_vec(p.as_ref().unwrap().val().grad(&grads).unwrap())
    };
    Step {
        loss: f64::from(loss.into_scalar()),
        grads: [
            grad(&model.l1.weight),
            grad_b(&model.l1.bias),
            grad(&model.l2.weight),
            grad_b(&model.l2.bias),
        ],
        pre: pre_values,
    }
}

/// Largest error of each gradient relative to the reference's largest magnitude.
fn gradient_errors(got: &[Vec<f64>], want: &[Vec<f64>]) -> Result<Vec<f64>, String> {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.len() != w.len() {
                return Err(format!("gradient sizes {} vs {}", g.len(), w.len()));
            }
            let scale = w.iter().fold(1e-12f64, |s, v| s.max(v.abs()));
            Ok(g.iter()
                .zip(w)
                .fold(0.0f64, |e, (a, b)| e.max((a - b).abs() / scale)))
        })
        .collect()
}

/// `inner_first`: the step without cuBLASLt runs before the one with it (to tell whether the
/// first step's state affects the second).
fn check_training(inner_first: bool) -> Result<(), String> {
    let reference = mlp_reference::step(None);
    let early = inner_first.then(|| step(false));
    let before = cublaslt_calls();
    let lt = step(true);
    let used = cublaslt_calls() - before;
    let inner = early.unwrap_or_else(|| step(false));
    let rel = |l: f64| (l - reference.loss).abs() / reference.loss.abs();
    let show = |e: &[f64]| {
        e.iter()
            .map(|v| format!("{v:.2e}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let worst = |e: &[f64]| e.iter().fold(0.0f64, |m, v| m.max(*v));
    let err_lt = gradient_errors(&lt.grads, &reference.grads)?;
    // Without cuBLASLt the products are burn-cuda's, TF32 for f32: a pre-activation within
    // TF32's rounding of zero changes sign, and every gradient below relu's mask changes by
    // that element's whole term (one of 4,257 here: 1.2e-1 on w1, 5.4e-2 on b1, also on an
    // H200 on 2026-11-21). So that step is held to the reference with its own mask, and the
    // flips are counted.
    let flips = inner
        .pre
        .iter()
        .zip(&reference.pre)
        .filter(|(a, b)| (**a > 0.0) != (**b > 0.0))
        .count();
    let masked = mlp_reference::step(Some(&inner.pre));
    let err_in = gradient_errors(&inner.grads, &masked.grads)?;
    let err_in_own = gradient_errors(&inner.grads, &reference.grads)?;
    progress(&format!(
        "training step vs f64 host reference (loss {:.7}): cuBLASLt ({used} calls) loss rel {:.2e}, gradients w1 b1 w2 b2 {}; without cuBLASLt (TF32) loss rel {:.2e}, gradients {} with the device's relu mask ({flips} of {} flipped; {} with the reference's own)",
        reference.loss,
        rel(lt.loss),
        show(&err_lt),
        rel(inner.loss),
        show(&err_in),
        inner.pre.len(),
        show(&err_in_own),
    ));
    // Forward 2, backward 1 x-gradient (the first layer's input needs none) and 2 weight
    // gradients. cuBLASLt multiplies in full f32 here.
    if used < 5 || rel(lt.loss) > 1e-4 || worst(&err_lt) > 1e-4 {
        return Err(format!(
            "cuBLASLt training step off the reference: {used} calls, loss {:.2e}, gradients {}",
            rel(lt.loss),
            show(&err_lt)
        ));
    }
    if rel(inner.loss) > 2e-3 || worst(&err_in) > 5e-3 || flips > 4 {
        return Err(format!(
            "the training step without cuBLASLt is off the f64 reference: loss {:.2e}, gradients {} with its own relu mask, {flips} flips",
            rel(inner.loss),
            show(&err_in)
        ));
    }
    Ok(())
}

/// Exits with status 3 and the last step reached when no step finishes for `limit`: a wedged
/// stream handshake must fail the check, not hang it.
fn watchdog(limit: std::time::Duration) {
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            let (at, step) = PROGRESS
                .lock()
                .unwrap()
                .clone()
                .expect("progress before watchdog");
            if at.elapsed() > limit {
                eprintln!("matmul-check STUCK for {limit:?} after: {step}");
                std::process::exit(3);
            }
        }
    });
}

static PROGRESS: std::sync::Mutex<Option<(std::time::Instant, String)>> =
    std::sync::Mutex::new(None);

/// Marks a finished step for the watchdog and prints it.
fn progress(step: &str) {
    println!("{step}");
    *PROGRESS.lock().unwrap() = Some((std::time::Instant::now(), step.to_string()));
}

fn main() {
    // Sections to run (default all): f32 bf16 f16 chain train; `--inner-only` never turns
    // cuBLASLt on (to tell the inner backend's own problems from ours); `--inner-first` runs
    // the training step without cuBLASLt before the one with it.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let inner_only = args.iter().any(|a| a == "--inner-only");
    let inner_first = args.iter().any(|a| a == "--inner-first");
    let want = |s: &str| args.iter().all(|a| a.starts_with("--")) || args.iter().any(|a| a == s);
    // The inner backend autotunes every new shape (seconds each): keep its results on disk.
    let cache = burn_zero::kernel_cache::default_dir();
    if let Err(e) = burn_zero::kernel_cache::persist(&cache) {
        eprintln!("kernel cache off: {e}");
    }
    progress("start");
    watchdog(std::time::Duration::from_secs(90));
    let paths: &[bool] = if inner_only { &[false] } else { &[true, false] };
    let mut result = Ok(());
    for (name, run) in [
        (
            "f32",
            (|p| check_products::<ZeroBackend<Cuda<f32>>>("f32", 1e-5, 2e-3, p))
                as fn(&[bool]) -> Result<(), String>,
        ),
        ("bf16", |p| {
            check_products::<ZeroBackend<Cuda<half::bf16>>>("bf16", 2e-2, 2e-2, p)
        }),
        ("f16", |p| {
            check_products::<ZeroBackend<Cuda<half::f16>>>("f16", 4e-3, 4e-3, p)
        }),
        ("chain", |_| check_chain()),
        (
            "train",
            if inner_first {
                |_| check_training(true)
            } else {
                |_| check_training(false)
            },
        ),
    ] {
        if result.is_ok() && want(name) && (!inner_only || !matches!(name, "chain" | "train")) {
            result = run(paths);
        }
    }
    match result {
        Ok(()) => println!("matmul-check: all passed"),
        Err(e) => {
            eprintln!("matmul-check FAILED: {e}");
            std::process::exit(1);
        }
    }
}
