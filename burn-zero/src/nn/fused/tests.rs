//! The fused ops' custom autodiff on `ZeroAutodiff<NdArray>` (their forward and backward in
//! burn ops, the same code path that calls the kernels on CUDA) against burn's autodiff of the
//! reference formulas (the ops switched off by the engine's settings), on shapes no vector
//! width divides; and a `Tensor<NdArray>` (no `ZeroBackend`) taking burn ops directly.

use burn::backend::NdArray;
use burn::tensor::{Distribution, Tensor, TensorData};

use super::*;
use crate::backend::settings::{self, OpSettings};
use crate::config::FusedKernelsConfig;
use crate::engine::ZeroAutodiff;

type B = ZeroAutodiff<NdArray>;

fn off() -> OpSettings {
    OpSettings {
        fused_kernels: FusedKernelsConfig {
            rms_norm: false,
            rope: false,
            swiglu: false,
            cross_entropy: false,
        },
        ..OpSettings::default()
    }
}

fn close(a: TensorData, b: TensorData, what: &str) {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = a.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-6);
    for (i, (u, v)) in a.iter().zip(&b).enumerate() {
        assert!((u - v).abs() <= 2e-6 * scale, "{what}[{i}]: {u} vs {v}");
    }
}

/// Runs `f` on fresh leaves `inputs`, back-propagates `Σ out · probe` and returns the output
/// and every input's gradient, with the fused ops on or off.
fn run<const D: usize, const N: usize>(
    fused: bool,
    inputs: &[Tensor<B, D>; N],
    f: impl Fn(&[Tensor<B, D>; N]) -> Tensor<B, D>,
) -> Vec<TensorData> {
    let _guard = (!fused).then(|| settings::set(off()));
    let leaves = inputs.clone().map(|t| t.require_grad());
    let out = f(&leaves);
    // A fixed probe (not the shared random generator, which other tests' threads draw from).
    let dims = out.dims();
    let n = dims.iter().product::<usize>();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 7 + 3) % 11) as f32 / 5.0 - 1.0)
        .collect();
    let probe = Tensor::<B, D>::from_data(TensorData::new(values, dims), &out.device());
    let grads = (out.clone() * probe).sum().backward();
    let mut all = vec![out.into_data()];
    all.extend(
        leaves
            .iter()
            .map(|l| l.grad(&grads).expect("a gradient").into_data()),
    );
    all
}

fn compare<const D: usize, const N: usize>(
    name: &str,
    inputs: [Tensor<B, D>; N],
    f: impl Fn(&[Tensor<B, D>; N]) -> Tensor<B, D>,
) {
    let want = run(false, &inputs, &f);
    let got = run(true, &inputs, &f);
    for (i, (w, g)) in want.into_iter().zip(got).enumerate() {
        let what = if i == 0 {
            "output".to_string()
        } else {
            format!("grad {}", i - 1)
        };
        close(w, g, &format!("{name} {what}"));
    }
}

fn normal<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

#[test]
fn rms_norm_gradients_equal_burns_autodiff_of_the_formula() {
    // (A width of 1 is left out: its gradient, r·w·dy·ε/(x² + ε), is a cancellation in both
    // formulas, and f32 keeps no digits of it.)
    for (shape, hidden) in [([3, 7, 13], 13), ([1, 1, 3], 3), ([2, 5, 64], 64)] {
        let w = Tensor::<B, 3>::random(
            [1, 1, hidden],
            Distribution::Normal(1.0, 0.3),
            &Default::default(),
        );
        compare(
            &format!("rms_norm {shape:?}"),
            [normal(shape), w],
            |[x, w]| rms_norm(x.clone(), w.clone().reshape([hidden]), 1e-5),
        );
    }
    // The op keeps the caller's rank: rows over every leading axis, the weight's gradient
    // summed over all of them.
    let w = Tensor::<B, 2>::random([1, 9], Distribution::Normal(1.0, 0.3), &Default::default());
    compare("rms_norm [11, 9]", [normal([11, 9]), w], |[x, w]| {
        rms_norm(x.clone(), w.clone().reshape([9]), 1e-5)
    });
    let w = Tensor::<B, 4>::random(
        [1, 1, 1, 10],
        Distribution::Normal(1.0, 0.3),
        &Default::default(),
    );
    compare(
        "rms_norm [2, 3, 5, 10]",
        [normal([2, 3, 5, 10]), w],
        |[x, w]| rms_norm(x.clone(), w.clone().reshape([10]), 1e-5),
    );
}

/// The residual add folded into the norm: the sum and the norm equal `x + r` and then
/// `rms_norm`, and so do the gradients of both addends and the weight, with the sum read
/// downstream as well (as a block's residual stream reads it).
#[test]
fn add_rms_norm_equals_the_add_and_then_the_norm() {
    for (shape, hidden) in [([3, 7, 13], 13), ([1, 1, 3], 3), ([2, 5, 64], 64)] {
        let w = Tensor::<B, 3>::random(
            [1, 1, hidden],
            Distribution::Normal(1.0, 0.3),
            &Default::default(),
        );
        compare(
            &format!("add_rms_norm {shape:?}"),
            [normal(shape), normal(shape), w],
            |[x, r, w]| {
                let (sum, y) =
                    add_rms_norm(x.clone(), r.clone(), w.clone().reshape([hidden]), 1e-5);
                // Both outputs reach the loss, the sum through a product of its own.
                y + sum.clone() * sum
            },
        );
    }
}

#[test]
fn swiglu_gradients_equal_burns_autodiff_of_the_formula() {
    let g = normal([4, 9, 11]) * 4.0;
    compare("swiglu", [g, normal([4, 9, 11])], |[g, u]| {
        swiglu(g.clone(), u.clone())
    });
}

#[test]
fn rope_gradients_equal_burns_autodiff_of_the_formula_in_both_layouts() {
    let device = Default::default();
    for pairs in [RopePairs::Interleaved, RopePairs::HalfSplit] {
        for [b, s, h, d] in [[2, 7, 3, 6], [1, 1, 1, 2], [1, 33, 2, 64]] {
            let table = RopeTable::<B>::new(s, d, 10_000.0, &device);
            compare(
                &format!("rope {pairs:?} {:?}", [b, s, h, d]),
                [normal([b, s, h, d])],
                |[x]| rope(x.clone(), &table, pairs),
            );
        }
    }
}

/// The rotation itself, against positions and angles written out: position 0 unchanged, each
/// pair keeps its norm, and position 1's first pair turned by exactly 1 radian.
#[test]
fn rope_rotates_each_pair_by_its_angle() {
    type P = NdArray;
    let device = Default::default();
    let x = Tensor::<P, 4>::from_data(
        TensorData::new(
            vec![1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
            [1, 2, 1, 4],
        ),
        &device,
    );
    let table = RopeTable::<P>::new(2, 4, 10_000.0, &device);
    let out = rope(x, &table, RopePairs::Interleaved)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(&out[..4], &[1.0, 0.0, 1.0, 0.0]);
    assert!((out[4] - 1f32.cos()).abs() < 1e-6 && (out[5] - 1f32.sin()).abs() < 1e-6);
    let angle = 10_000f64.powf(-0.5);
    assert!((f64::from(out[6]) - angle.cos()).abs() < 1e-6, "{out:?}");
}

#[test]
fn a_table_of_another_length_is_refused_by_name() {
    type P = NdArray;
    let device = Default::default();
    let table = RopeTable::<P>::new(3, 4, 10_000.0, &device);
    let x = Tensor::<P, 4>::zeros([1, 5, 2, 4], &device);
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rope(x, &table, RopePairs::HalfSplit)
    }))
    .unwrap_err();
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("3 positions") && msg.contains("[1, 5, 2, 4]"),
        "{msg}"
    );
}
