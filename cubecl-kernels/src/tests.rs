//! The kernels on a real runtime: wgpu on lavapipe (a Vulkan driver running on the CPU) in CI.
//! No adapter is a failure, never a skip.

use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

use burn_offload::AdamStep;

use crate::adam::{AdamConstants, adamw_into};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The engine's order of operations on the host, the gradient multiplied by `grad_scale`
/// first.
fn reference(k: &AdamConstants, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..w.len() {
        let gi = g[i] * k.grad_scale + w[i] * k.l2;
        m[i] = m[i] * k.beta1 + gi * (1.0 - k.beta1);
        v[i] = v[i] * k.beta2 + gi * (1.0 - k.beta2) * gi;
        let denom = v[i].sqrt() / k.bias_correction2_sqrt + k.eps;
        w[i] = w[i] * k.shrink - m[i] / denom * k.step_size;
    }
}

fn assert_close(name: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tolerance * (1.0 + b.abs()),
            "{name}[{i}]: {a} vs {b}"
        );
    }
}

/// The kernel over 10 steps, odd and even lengths, with and without a clipping factor
/// (`grad_scale`), into new buffers and in place: the same values as the host update, and the
/// gradient only read. With a working copy (f32 here, and f16 where the adapter has it) that
/// copy is the new master rounded.
#[test]
fn fused_adamw_matches_the_host_update() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let f16 = StorageType::Scalar(ElemType::Float(FloatKind::F16));
    let f32_type = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let mut working_types = vec![f32_type];
    match client.properties().supports_type(f16) {
        true => working_types.push(f16),
        false => eprintln!("this adapter has no f16: the working copy is checked in f32 only"),
    }
    for n in [1usize, 7, 64, 1_000_003] {
        for (decoupled, in_place) in [(true, false), (false, false), (true, true)] {
            let mut w = values(n, 3);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut h = [&w, &m, &v].map(|x| client.create_from_slice(f32::as_bytes(x)));
            for t in 1..=10u64 {
                // Off the 0.001 grid: on it `g + 0.05·w` cancels exactly for many elements,
                // and Adam's first update of a rounding residue depends on FMA contraction.
                let g: Vec<f32> = values(n, 20 + t as u32)
                    .iter()
                    .map(|x| x * 0.1 + 3e-5)
                    .collect();
                let step = AdamStep::at(t, 1e-2, (0.9, 0.999), 1e-8, 0.05, decoupled, true);
                let k = AdamConstants {
                    grad_scale: if t % 3 == 0 { 0.37 } else { 1.0 },
                    ..AdamConstants::from(&step)
                };
                reference(&k, &mut w, &g, &mut m, &mut v);
                let hg = client.create_from_slice(f32::as_bytes(&g));
                let out = match in_place {
                    true => h.clone(),
                    false => [0; 3].map(|_| client.empty(4 * n)),
                };
                let dtype = working_types[t as usize % working_types.len()];
                let working = client.empty(dtype.size() * n);
                adamw_into(
                    &client,
                    &k,
                    n,
                    [&h[0], &hg, &h[1], &h[2]],
                    [&out[0], &out[1], &out[2]],
                    (t % 2 == 0).then_some((&working, dtype)),
                );
                let kept = client.read_one(hg).expect("the gradient comes back");
                assert_eq!(f32::from_bytes(&kept), &g[..], "the input is only read");
                h = out;
                if t % 2 == 0 {
                    let bytes = client.read_one(working).expect("the copy comes back");
                    let (got, rounded): (Vec<f32>, Vec<f32>) = match dtype == f16 {
                        true => (
                            half::f16::from_bytes(&bytes)
                                .iter()
                                .map(|x| x.to_f32())
                                .collect(),
                            w.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect(),
                        ),
                        false => (f32::from_bytes(&bytes).to_vec(), w.clone()),
                    };
                    let name = format!("n {n}, step {t}, working copy in {dtype:?}");
                    // Within one rounding of the new master's f32 value (ties may differ).
                    assert_close(
                        &name,
                        &got,
                        &rounded,
                        if dtype == f16 { 1e-3 } else { 1e-6 },
                    );
                }
            }
            for (name, handle, want) in [("master", &h[0], &w), ("m", &h[1], &m), ("v", &h[2], &v)]
            {
                let bytes = client
                    .read_one(handle.clone())
                    .expect("the result comes back");
                let name = format!("n {n}, decoupled {decoupled}, in place {in_place}, {name}");
                assert_close(&name, f32::from_bytes(&bytes), want, 1e-6);
            }
        }
    }
}

/// LAMB's trust ratio (the engine's `LambSettings::trust`, min 0.01, max 10).
fn trust(w: f64, u: f64) -> f64 {
    if w > 0.0 && u > 0.0 {
        (w / u).clamp(0.01, 10.0)
    } else {
        1.0
    }
}

/// The fused LAMB passes over 10 steps against the tensor ops' order of operations on the
/// host: partitions of odd lengths cut into tensors with gaps between them (gaps keep their
/// weights), the per-piece norms within f32 summation error of f64 ones, and the weights and
/// moments after 10 steps.
#[test]
fn fused_lamb_matches_the_host_update() {
    use crate::lamb::{LambConstants, LambPlan, lamb_apply, lamb_moments};
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let cases: [(usize, Vec<std::ops::Range<usize>>, Vec<bool>); 3] = [
        (1, std::iter::once(0..1).collect(), vec![true]),
        (7, vec![0..2, 2..3, 3..7], vec![true, false, true]),
        (
            1_000_003,
            vec![0..5, 5..300_001, 300_001..300_004, 300_004..1_000_003],
            vec![true, true, false, true],
        ),
    ];
    for (n, pieces, tensor) in cases {
        let plan = LambPlan::new(n, &pieces);
        let on_device = plan.upload(&client);
        let mut w = values(n, 5);
        for (p, r) in pieces.iter().enumerate() {
            if !tensor[p] {
                w[r.clone()].iter_mut().for_each(|x| *x = 0.0);
            }
        }
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut h = [&w, &m, &v].map(|x| client.create_from_slice(f32::as_bytes(x)));
        let lr = 1e-2f32;
        for t in 1..=10i32 {
            let mut g: Vec<f32> = values(n, 40 + t as u32).iter().map(|x| x * 0.1).collect();
            for (p, r) in pieces.iter().enumerate() {
                if !tensor[p] {
                    g[r.clone()].iter_mut().for_each(|x| *x = 0.0);
                }
            }
            let k = LambConstants {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.01,
                bias_correction1: 1.0 - 0.9f32.powi(t),
                bias_correction2: 1.0 - 0.999f32.powi(t),
            };
            // The host: moments, updates, norms in f64, then each tensor's step.
            let mut update = vec![0.0f32; n];
            for i in 0..n {
                m[i] = m[i] * k.beta1 + g[i] * (1.0 - k.beta1);
                v[i] = v[i] * k.beta2 + g[i] * (1.0 - k.beta2) * g[i];
                let denom = (v[i] / k.bias_correction2).sqrt() + k.eps;
                update[i] = m[i] / k.bias_correction1 / denom + k.weight_decay * w[i];
            }
            let norms: Vec<(f64, f64)> = pieces
                .iter()
                .map(|r| {
                    let sq = |x: &[f32]| x.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
                    (sq(&w[r.clone()]), sq(&update[r.clone()]))
                })
                .collect();
            // The kernels: pass 1, the norms read back, the steps, pass 2.
            let hg = client.create_from_slice(f32::as_bytes(&g));
            let moments = [0; 2].map(|_| client.empty(4 * n));
            let sums = lamb_moments(
                &client,
                &k,
                &plan,
                &on_device,
                [&h[0], &hg, &h[1], &h[2]],
                [&moments[0], &moments[1]],
            );
            let sums = f32::from_bytes(&client.read_one(sums).expect("sums")).to_vec();
            let mut steps = Vec::new();
            for (p, (ww, uu)) in norms.iter().enumerate() {
                for (got, want) in [(sums[2 * p], ww), (sums[2 * p + 1], uu)] {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * want.max(1e-30),
                        "n {n}, step {t}, piece {p}: sum {got} vs {want}"
                    );
                }
                let ratio = trust(
                    f64::from(sums[2 * p]).sqrt(),
                    f64::from(sums[2 * p + 1]).sqrt(),
                );
                steps.push(if tensor[p] { lr * ratio as f32 } else { 0.0 });
                let host_step = if tensor[p] {
                    lr * trust(ww.sqrt(), uu.sqrt()) as f32
                } else {
                    0.0
                };
                for i in pieces[p].clone() {
                    w[i] -= update[i] * host_step;
                }
            }
            let master_out = client.empty(4 * n);
            let [m_new, v_new] = moments;
            lamb_apply(
                &client,
                &k,
                &plan,
                &on_device,
                [&h[0], &m_new, &v_new],
                &steps,
                &master_out,
            );
            h = [master_out, m_new, v_new];
        }
        for (name, handle, want) in [("master", &h[0], &w), ("m", &h[1], &m), ("v", &h[2], &v)] {
            let bytes = client
                .read_one(handle.clone())
                .expect("the result comes back");
            for (i, (a, b)) in f32::from_bytes(&bytes).iter().zip(want.iter()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "n {n}, {name}[{i}]: {a} vs {b}"
                );
            }
        }
    }
}

/// The sum of squares over pieces of odd and even lengths (read in vectors of four or one),
/// one empty, most at an offset into a shared buffer (wgpu binds offsets of 32 bytes): within
/// f32 summation error of an f64 sum, and the same bits on a second run.
#[test]
fn sum_of_squares_matches_f64_in_a_fixed_order() {
    use crate::norm::{SquaresPiece, sum_of_squares};
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let lens = [1usize, 7, 64, 0, 1_000_003, 1_048_576];
    let starts: Vec<usize> = lens
        .iter()
        .scan(8, |at, n| {
            let start = *at;
            *at = (start + n).div_ceil(8) * 8 + 8;
            Some(start)
        })
        .collect();
    let all = values(starts[5] + lens[5], 11);
    let buffer = client.create_from_slice(f32::as_bytes(&all));
    let handles: Vec<_> = starts
        .iter()
        .map(|s| buffer.clone().offset_start(4 * *s as u64))
        .collect();
    let pieces: Vec<SquaresPiece<'_>> = handles
        .iter()
        .zip(lens)
        .map(|(handle, len)| SquaresPiece { handle, len })
        .collect();
    let squares = |range: std::ops::Range<usize>| -> f64 {
        all[range].iter().map(|a| f64::from(*a).powi(2)).sum()
    };
    let want: f64 = starts
        .iter()
        .zip(lens)
        .map(|(s, n)| squares(*s..s + n))
        .sum();
    let read = |h| f32::from_bytes(&client.read_one(h).expect("sum")).to_vec()[0];
    let first = read(sum_of_squares(&client, &pieces));
    assert!(
        (f64::from(first) - want).abs() <= 1e-5 * want,
        "{first} vs {want}"
    );
    let second = read(sum_of_squares(&client, &pieces));
    assert_eq!(first.to_bits(), second.to_bits(), "a fixed order");
    assert_eq!(read(sum_of_squares(&client, &[])), 0.0);
    let one = read(sum_of_squares(&client, &pieces[1..2]));
    let want_one = squares(starts[1]..starts[1] + 7);
    assert!(
        (f64::from(one) - want_one).abs() <= 1e-6 * want_one,
        "{one} vs {want_one}"
    );
}

/// Values written into an f32 buffer at an offset, converted: f32 and, where the adapter has
/// it, f16 sources, lengths read in vectors of four and of one; the elements around the
/// written range keep their values.
#[test]
fn cast_into_writes_converted_values_in_place() {
    use crate::cast::cast_into;
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let f16 = StorageType::Scalar(ElemType::Float(FloatKind::F16));
    let f32_type = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let mut types = vec![f32_type];
    match client.properties().supports_type(f16) {
        true => types.push(f16),
        false => eprintln!("this adapter has no f16: cast_into is checked from f32 only"),
    }
    for dtype in types {
        for (offset, n) in [(0usize, 1usize), (8, 7), (16, 64), (24, 100_003)] {
            let before = values(offset + n + 8, 5);
            let dst = client.create_from_slice(f32::as_bytes(&before));
            let src_values = values(n, 9);
            let (src, want): (_, Vec<f32>) = match dtype == f16 {
                true => {
                    let h: Vec<half::f16> =
                        src_values.iter().map(|x| half::f16::from_f32(*x)).collect();
                    let want = h.iter().map(|x| x.to_f32()).collect();
                    (client.create_from_slice(half::f16::as_bytes(&h)), want)
                }
                false => (
                    client.create_from_slice(f32::as_bytes(&src_values)),
                    src_values.clone(),
                ),
            };
            let at = dst.clone().offset_start(4 * offset as u64);
            cast_into(&client, dtype, n, &src, &at);
            let got = f32::from_bytes(&client.read_one(dst).expect("dst")).to_vec();
            assert_eq!(&got[..offset], &before[..offset], "{dtype:?} n {n}: before");
            assert_eq!(
                &got[offset..offset + n],
                &want[..],
                "{dtype:?} n {n}: written"
            );
            assert_eq!(
                &got[offset + n..],
                &before[offset + n..],
                "{dtype:?} n {n}: after"
            );
        }
    }
}
