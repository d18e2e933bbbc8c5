//! The fused kernels on wgpu/lavapipe against f64 host references, forward and backward, on
//! shapes no vector or cube size divides, in f32 and (where the adapter has it) f16, and a NaN
//! in one input reaching exactly the outputs that depend on it.

use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

use super::*;

type Client = ComputeClient<WgpuRuntime>;

/// Never-zero values in (−1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1999;
            (x as f32 + 1.0) / 1000.0 - 1.0
        })
        .collect()
}

/// The element types to check: f32, and f16 where the adapter has it (said, not skipped
/// silently).
fn dtypes(client: &Client) -> Vec<StorageType> {
    let f16 = StorageType::Scalar(ElemType::Float(FloatKind::F16));
    let mut types = vec![StorageType::Scalar(ElemType::Float(FloatKind::F32))];
    match client.properties().supports_type(f16) {
        true => types.push(f16),
        false => eprintln!("this adapter has no f16: the fused kernels are checked in f32 only"),
    }
    types
}

fn is_f16(dtype: StorageType) -> bool {
    dtype == StorageType::Scalar(ElemType::Float(FloatKind::F16))
}

/// `data` rounded to `dtype` (what the kernel reads), and its buffer.
fn upload(client: &Client, dtype: StorageType, data: &[f32]) -> (Vec<f32>, Handle) {
    if is_f16(dtype) {
        let h: Vec<half::f16> = data.iter().map(|x| half::f16::from_f32(*x)).collect();
        let rounded = h.iter().map(|x| x.to_f32()).collect();
        (rounded, client.create_from_slice(half::f16::as_bytes(&h)))
    } else {
        (data.to_vec(), client.create_from_slice(f32::as_bytes(data)))
    }
}

fn empty(client: &Client, dtype: StorageType, len: usize) -> Handle {
    client.empty(dtype.size() * len.max(1))
}

fn read(client: &Client, dtype: StorageType, h: &Handle) -> Vec<f32> {
    let bytes = client.read_one(h.clone()).expect("the result comes back");
    if is_f16(dtype) {
        half::f16::from_bytes(&bytes)
            .iter()
            .map(|x| x.to_f32())
            .collect()
    } else {
        f32::from_bytes(&bytes).to_vec()
    }
}

/// Within `tolerance` of the largest reference value (f32 or f16 rounding of the result).
fn assert_close(name: &str, got: &[f32], want: &[f64], tolerance: f64) {
    assert!(
        got.len() >= want.len(),
        "{name}: {} < {}",
        got.len(),
        want.len()
    );
    let scale = want.iter().fold(0.0f64, |a, x| a.max(x.abs())).max(1e-3);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*a) - b).abs() <= tolerance * scale,
            "{name}[{i}]: {a} vs {b} (scale {scale})"
        );
    }
}

fn tolerance(dtype: StorageType) -> f64 {
    if is_f16(dtype) { 4e-3 } else { 2e-5 }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|v| f64::from(*v)).collect()
}

/// RMSNorm forward and backward in f64: `(y, rstd, dx, dw)`.
fn rms_reference(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    hidden: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / hidden;
    let (mut y, mut rstd, mut dx, mut dw) = (
        vec![0.0; x.len()],
        vec![0.0; rows],
        vec![0.0; x.len()],
        vec![0.0; hidden],
    );
    for r in 0..rows {
        let row = &x[r * hidden..(r + 1) * hidden];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
        let s = 1.0 / (ms + eps).sqrt();
        rstd[r] = s;
        let dot: f64 = (0..hidden)
            .map(|j| dy[r * hidden + j] * w[j] * row[j])
            .sum();
        for j in 0..hidden {
            let i = r * hidden + j;
            y[i] = row[j] * s * w[j];
            dx[i] = s * w[j] * dy[i] - s * s * s * row[j] * dot / hidden as f64;
            dw[j] += dy[i] * row[j] * s;
        }
    }
    (y, rstd, dx, dw)
}

/// RMSNorm on rows no cube count divides (1, 37, 1,100 rows: the backward then groups 3
/// rows per cube) and widths no vector divides (7, 20) or all do (96, 4,096), and rows wider
/// than the most units a row takes hold (40,000: more vectors per unit than aimed at).
#[test]
fn rms_norm_matches_f64_forward_and_backward() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let eps = 1e-5;
    for dtype in dtypes(&client) {
        for (rows, hidden) in [(1, 7), (37, 20), (1_100, 96), (5, 4_096), (3, 40_000)] {
            let n = rows * hidden;
            let (x, hx) = upload(&client, dtype, &values(n, 1));
            let w: Vec<f32> = values(hidden, 2).iter().map(|v| 1.0 + v / 2.0).collect();
            let (w, hw) = upload(&client, dtype, &w);
            let (dy, hdy) = upload(&client, dtype, &values(n, 3));
            let (out, rstd) = (empty(&client, dtype, n), client.empty(4 * rows));
            rms_norm_forward(
                &client,
                dtype,
                [rows, hidden],
                eps,
                (&hx, hidden),
                &hw,
                &out,
                &rstd,
            );
            let (dx, dw) = (empty(&client, dtype, n), empty(&client, dtype, hidden));
            let scratch = client.empty(backward_scratch_bytes(rows, hidden));
            rms_norm_backward(
                &client,
                dtype,
                [rows, hidden],
                [(&hx, hidden), (&hdy, hidden)],
                [&hw, &rstd],
                [&dx, &dw],
                &scratch,
            );
            let want = rms_reference(&f64s(&x), &f64s(&w), &f64s(&dy), hidden, eps as f64);
            let name = |what: &str| format!("rms_norm {what} {rows}×{hidden} {dtype:?}");
            let tol = tolerance(dtype);
            assert_close(&name("y"), &read(&client, dtype, &out), &want.0, tol);
            let got_rstd = f32::from_bytes(&client.read_one(rstd).unwrap()).to_vec();
            assert_close(&name("rstd"), &got_rstd, &want.1, 2e-6);
            assert_close(&name("dx"), &read(&client, dtype, &dx), &want.2, tol);
            assert_close(&name("dw"), &read(&client, dtype, &dw), &want.3, tol);
        }
    }
}

/// The residual add folded into the forward: the sum is `x + residual` rounded once to the
/// dtype (bit for bit), and the output and `rstd` are the forward's of that sum (against f64),
/// on the same shapes as the plain forward's.
#[test]
fn rms_norm_of_a_sum_writes_the_sum_and_normalizes_it() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let eps = 1e-5;
    for dtype in dtypes(&client) {
        for (rows, hidden) in [(1, 7), (37, 20), (1_100, 96), (5, 4_096), (3, 40_000)] {
            let n = rows * hidden;
            let (x, hx) = upload(&client, dtype, &values(n, 1));
            let (r, hr) = upload(&client, dtype, &values(n, 9));
            let w: Vec<f32> = values(hidden, 2).iter().map(|v| 1.0 + v / 2.0).collect();
            let (w, hw) = upload(&client, dtype, &w);
            let (sum, out) = (empty(&client, dtype, n), empty(&client, dtype, n));
            let rstd = client.empty(4 * rows);
            rms_norm_add_forward(
                &client,
                dtype,
                [rows, hidden],
                eps,
                [(&hx, hidden), (&hr, hidden)],
                &hw,
                [&sum, &out, &rstd],
            );
            let name = |what: &str| format!("rms_norm of a sum: {what} {rows}×{hidden} {dtype:?}");
            let added: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
            let (h, _) = upload(&client, dtype, &added);
            assert_eq!(read(&client, dtype, &sum), h, "{}", name("sum"));
            let zeros = vec![0.0; n];
            let want = rms_reference(&f64s(&h), &f64s(&w), &zeros, hidden, eps as f64);
            assert_close(
                &name("y"),
                &read(&client, dtype, &out),
                &want.0,
                tolerance(dtype),
            );
            let got_rstd = f32::from_bytes(&client.read_one(rstd).unwrap()).to_vec();
            assert_close(&name("rstd"), &got_rstd, &want.1, 2e-6);
        }
    }
}

/// `rows × hidden` values laid out with rows `pitch` apart, the gaps NaN (a kernel that read
/// them would make its row NaN), rounded to `dtype`: the values and the buffer.
fn upload_pitched(
    client: &Client,
    dtype: StorageType,
    values: &[f32],
    hidden: usize,
    pitch: usize,
) -> (Vec<f32>, Handle) {
    let rows = values.len() / hidden;
    let mut laid = vec![f32::NAN; (rows - 1) * pitch + hidden];
    for r in 0..rows {
        laid[r * pitch..r * pitch + hidden].copy_from_slice(&values[r * hidden..(r + 1) * hidden]);
    }
    let (_, handle) = upload(client, dtype, &laid);
    let (rounded, _) = upload(client, dtype, values);
    (rounded, handle)
}

/// Inputs in cubecl's pitched layout (rows padded to an aligned pitch, as CUDA's elementwise
/// outputs of 576-wide rows are) give the same bits as contiguous ones, and the padding is
/// never read: the forward, the forward of a sum and the backward, on pitches that change the
/// vector width and one that does not.
#[test]
fn rms_norm_reads_pitched_rows_as_contiguous_ones() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let eps = 1e-5;
    for dtype in dtypes(&client) {
        for (rows, hidden, pitch) in [(37, 20, 24), (9, 576, 768), (5, 96, 101)] {
            let n = rows * hidden;
            let (x, hx) = upload(&client, dtype, &values(n, 1));
            let (_, px) = upload_pitched(&client, dtype, &x, hidden, pitch);
            let (r, hr) = upload(&client, dtype, &values(n, 9));
            let (_, pr) = upload_pitched(&client, dtype, &r, hidden, pitch + 8);
            let (dy, hdy) = upload(&client, dtype, &values(n, 3));
            let (_, pdy) = upload_pitched(&client, dtype, &dy, hidden, pitch);
            let w: Vec<f32> = values(hidden, 2).iter().map(|v| 1.0 + v / 2.0).collect();
            let (_, hw) = upload(&client, dtype, &w);
            let name =
                |what: &str| format!("pitched {what} {rows}×{hidden} (pitch {pitch}) {dtype:?}");
            let run = |[x, r, dy]: [(&Handle, usize); 3]| {
                let (out, rstd) = (empty(&client, dtype, n), client.empty(4 * rows));
                rms_norm_forward(&client, dtype, [rows, hidden], eps, x, &hw, &out, &rstd);
                let (sum, out2, rstd2) = (
                    empty(&client, dtype, n),
                    empty(&client, dtype, n),
                    client.empty(4 * rows),
                );
                rms_norm_add_forward(
                    &client,
                    dtype,
                    [rows, hidden],
                    eps,
                    [x, r],
                    &hw,
                    [&sum, &out2, &rstd2],
                );
                let (dx, dw) = (empty(&client, dtype, n), empty(&client, dtype, hidden));
                let scratch = client.empty(backward_scratch_bytes(rows, hidden));
                rms_norm_backward(
                    &client,
                    dtype,
                    [rows, hidden],
                    [x, dy],
                    [&hw, &rstd],
                    [&dx, &dw],
                    &scratch,
                );
                [&out, &sum, &out2, &dx, &dw].map(|h| read(&client, dtype, h))
            };
            let want = run([(&hx, hidden), (&hr, hidden), (&hdy, hidden)]);
            let got = run([(&px, pitch), (&pr, pitch + 8), (&pdy, pitch)]);
            // The same bits where the vector width is the same (the sum always: it is
            // elementwise); within rounding where the pitch narrows it (101: one element), the
            // sums of squares then taken in another order.
            let same_vector = pitch % 4 == 0;
            let outputs = ["y", "sum", "y of the sum", "dx", "dw"];
            for (what, (g, w)) in outputs.iter().zip(got.iter().zip(&want)) {
                assert!(g.iter().all(|v| v.is_finite()), "{}", name(what));
                if same_vector || *what == "sum" {
                    assert_eq!(g, w, "{}", name(what));
                } else {
                    assert_close(&name(what), g, &f64s(w), tolerance(dtype));
                }
            }
        }
    }
}

/// A NaN in one row of `x` makes that row's output, `dx` row and every `dw` column NaN and
/// leaves every other row finite.
#[test]
fn a_nan_in_rms_norm_reaches_its_row_and_the_weight_gradient_only() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let dtype = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let (rows, hidden) = (9, 12);
    let mut x = values(rows * hidden, 4);
    x[4 * hidden + 5] = f32::NAN;
    let (_, hx) = upload(&client, dtype, &x);
    let (_, hw) = upload(&client, dtype, &vec![1.0; hidden]);
    let (_, hdy) = upload(&client, dtype, &values(rows * hidden, 5));
    let (out, rstd) = (empty(&client, dtype, x.len()), client.empty(4 * rows));
    rms_norm_forward(
        &client,
        dtype,
        [rows, hidden],
        1e-5,
        (&hx, hidden),
        &hw,
        &out,
        &rstd,
    );
    let (dx, dw) = (
        empty(&client, dtype, x.len()),
        empty(&client, dtype, hidden),
    );
    let scratch = client.empty(backward_scratch_bytes(rows, hidden));
    rms_norm_backward(
        &client,
        dtype,
        [rows, hidden],
        [(&hx, hidden), (&hdy, hidden)],
        [&hw, &rstd],
        [&dx, &dw],
        &scratch,
    );
    for (name, got) in [
        ("y", read(&client, dtype, &out)),
        ("dx", read(&client, dtype, &dx)),
    ] {
        for (i, v) in got.iter().enumerate() {
            assert_eq!(v.is_nan(), i / hidden == 4, "{name}[{i}] = {v}");
        }
    }
    assert!(read(&client, dtype, &dw).iter().all(|v| v.is_nan()));
}

/// SwiGLU over lengths no vector divides and lengths all do, and a NaN gate reaching its own
/// outputs only.
#[test]
fn swiglu_matches_f64_forward_and_backward() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    for dtype in dtypes(&client) {
        for len in [1usize, 7, 30, 4_099, 65_536] {
            let mut gate: Vec<f32> = values(len, 6).iter().map(|v| v * 6.0).collect();
            if len > 3 {
                gate[3] = f32::NAN;
            }
            let (gate, hg) = upload(&client, dtype, &gate);
            let (up, hu) = upload(&client, dtype, &values(len, 7));
            let (d, hd) = upload(&client, dtype, &values(len, 8));
            let out = empty(&client, dtype, len);
            swiglu_forward(&client, dtype, len, [&hg, &hu], &out);
            let (dg, du) = (empty(&client, dtype, len), empty(&client, dtype, len));
            swiglu_backward(&client, dtype, len, [&hg, &hu, &hd], [&dg, &du]);
            let (mut want_o, mut want_g, mut want_u) = (vec![], vec![], vec![]);
            for i in 0..len {
                let (g, u, d) = (f64::from(gate[i]), f64::from(up[i]), f64::from(d[i]));
                let s = 1.0 / (1.0 + (-g).exp());
                want_o.push(g * s * u);
                want_g.push(d * u * s * (1.0 + g * (1.0 - s)));
                want_u.push(d * g * s);
            }
            let got = [&out, &dg, &du].map(|h| read(&client, dtype, h));
            for ((name, got), want) in ["out", "d_gate", "d_up"]
                .iter()
                .zip(&got)
                .zip([&want_o, &want_g, &want_u])
            {
                for i in 0..len {
                    assert_eq!(
                        got[i].is_nan(),
                        want[i].is_nan(),
                        "swiglu {name}[{i}] {dtype:?}"
                    );
                }
                let finite = |v: &[f32]| {
                    v.iter()
                        .map(|x| if x.is_nan() { 0.0 } else { *x })
                        .collect::<Vec<_>>()
                };
                let want: Vec<f64> = want
                    .iter()
                    .map(|x| if x.is_nan() { 0.0 } else { *x })
                    .collect();
                let name = format!("swiglu {name} len {len} {dtype:?}");
                assert_close(&name, &finite(got), &want, tolerance(dtype));
            }
        }
    }
}

/// RoPE tables for `seq` positions of heads of `head_dim`, base `theta` (f64, rounded).
fn tables(seq: usize, head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in 0..seq {
        for i in 0..half {
            let angle = p as f64 * theta.powf(-2.0 * i as f64 / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// RoPE in both pair layouts against f64 rotation, forward, and back to the input (the
/// backward is the inverse rotation, and the rotation is orthogonal), with head widths 2, 6,
/// 64 and 128, a NaN reaching its own pair only.
#[test]
fn rope_rotates_both_layouts_and_back() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    for dtype in dtypes(&client) {
        for pairs in [RopePairs::Interleaved, RopePairs::HalfSplit] {
            for (batch, seq, heads, head_dim) in
                [(1, 1, 1, 2), (2, 5, 3, 6), (2, 17, 4, 64), (1, 9, 2, 128)]
            {
                let dims = RopeDims {
                    batch,
                    seq,
                    heads,
                    head_dim,
                };
                let len = dims.len();
                let mut x = values(len, 9);
                x[len - 1] = f32::NAN;
                let (x, hx) = upload(&client, dtype, &x);
                let (cos, sin) = tables(seq, head_dim, 10_000.0);
                let (hc, hs) = (
                    client.create_from_slice(f32::as_bytes(&cos)),
                    client.create_from_slice(f32::as_bytes(&sin)),
                );
                let out = empty(&client, dtype, len);
                rope(&client, dtype, dims, pairs, false, [&hx, &hc, &hs], &out);
                let back = empty(&client, dtype, len);
                rope(&client, dtype, dims, pairs, true, [&out, &hc, &hs], &back);
                let half = head_dim / 2;
                let mut want = vec![0.0f64; len];
                for row in 0..batch * seq * heads {
                    let pos = (row / heads) % seq;
                    for i in 0..half {
                        let (a, b) = match pairs {
                            RopePairs::Interleaved => {
                                (row * head_dim + 2 * i, row * head_dim + 2 * i + 1)
                            }
                            RopePairs::HalfSplit => (row * head_dim + i, row * head_dim + i + half),
                        };
                        let angle = pos as f64 * 10_000f64.powf(-2.0 * i as f64 / head_dim as f64);
                        let (c, s) = (angle.cos(), angle.sin());
                        let (xa, xb) = (f64::from(x[a]), f64::from(x[b]));
                        want[a] = xa * c - xb * s;
                        want[b] = xa * s + xb * c;
                    }
                }
                let got = read(&client, dtype, &out);
                let back = read(&client, dtype, &back);
                let name = format!("rope {pairs:?} {dims:?} {dtype:?}");
                for i in 0..len {
                    assert_eq!(got[i].is_nan(), want[i].is_nan(), "{name} out[{i}]");
                    assert_eq!(back[i].is_nan(), want[i].is_nan(), "{name} back[{i}]");
                }
                let clean = |v: &[f32]| {
                    v.iter()
                        .map(|x| if x.is_nan() { 0.0 } else { *x })
                        .collect::<Vec<_>>()
                };
                let clean64 = |v: &[f64]| {
                    v.iter()
                        .map(|x| if x.is_nan() { 0.0 } else { *x })
                        .collect::<Vec<_>>()
                };
                assert_close(
                    &format!("{name} out"),
                    &clean(&got),
                    &clean64(&want),
                    tolerance(dtype),
                );
                // The input where its pair holds no NaN (a NaN's partner turns NaN too).
                let input: Vec<f64> = (0..len)
                    .map(|i| {
                        if want[i].is_nan() {
                            0.0
                        } else {
                            f64::from(x[i])
                        }
                    })
                    .collect();
                assert_close(
                    &format!("{name} back"),
                    &clean(&back),
                    &clean64(&input),
                    2.0 * tolerance(dtype),
                );
            }
        }
    }
}

/// Cross-entropy of `rows × vocab` logits in f64: each row's `keep · (lse − logit[target])`
/// and the gradient `(softmax − onehot) · keep · scale`.
fn cross_entropy_reference(
    logits: &[f64],
    targets: &[i32],
    keep: &[f64],
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let rows = targets.len();
    let vocab = logits.len() / rows;
    let (mut loss, mut grad) = (vec![0.0; rows], vec![0.0; logits.len()]);
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let t = targets[r] as usize;
        loss[r] = keep[r] * (lse - row[t]);
        for j in 0..vocab {
            let onehot = if j == t { 1.0 } else { 0.0 };
            grad[r * vocab + j] = ((row[j] - lse).exp() - onehot) * keep[r] * scale;
        }
    }
    (loss, grad)
}

/// [`cross_entropy`] on `logits`, and each row's loss read back.
fn row_losses(
    client: &Client,
    dtype: StorageType,
    shape: [usize; 2],
    logits: &Handle,
    labels: [&Handle; 3],
    grad: bool,
) -> Vec<f32> {
    let loss = client.empty(4 * shape[0]);
    cross_entropy(client, dtype, shape, logits, labels, &loss, grad);
    f32::from_bytes(&client.read_one(loss).unwrap()).to_vec()
}

/// The loss rows and the in-place gradient against f64, on vocabularies no vector divides
/// (53) or all do (1,000), wider than the most units a row takes (40,000), a target at each
/// end of a row and ignored tokens (keep 0); without `grad` the logits stay as they were.
#[test]
fn cross_entropy_matches_f64_loss_and_gradient() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let i32s = |v: &[i32]| client.create_from_slice(i32::as_bytes(v));
    let f32s = |v: &[f32]| client.create_from_slice(f32::as_bytes(v));
    for dtype in dtypes(&client) {
        for (rows, vocab) in [(1, 53), (7, 53), (9, 1_000), (3, 40_000)] {
            let n = rows * vocab;
            // Logits up to ±8: the softmax is far from uniform.
            let raw: Vec<f32> = values(n, 6).iter().map(|v| v * 8.0).collect();
            let (x, hx) = upload(&client, dtype, &raw);
            let targets: Vec<i32> = (0..rows)
                .map(|r| match r % 3 {
                    0 => 0,
                    1 => vocab as i32 - 1,
                    _ => (r * 37 % vocab) as i32,
                })
                .collect();
            let keep: Vec<f32> = (0..rows)
                .map(|r| if r % 4 == 2 { 0.0 } else { 1.0 })
                .collect();
            let kept = keep.iter().sum::<f32>().max(1.0);
            let scale = 1.0 / kept;
            let (ht, hk, hs) = (i32s(&targets), f32s(&keep), f32s(&[scale]));
            let want = cross_entropy_reference(&f64s(&x), &targets, &f64s(&keep), scale as f64);
            let name = |what: &str| format!("cross_entropy {what} {rows}×{vocab} {dtype:?}");
            for grad in [false, true] {
                let (_, hx) = match grad {
                    true => (x.clone(), hx.clone()),
                    false => upload(&client, dtype, &raw),
                };
                let got = row_losses(&client, dtype, [rows, vocab], &hx, [&ht, &hk, &hs], grad);
                assert_close(&name("loss"), &got, &want.0, 2e-5);
                let after = read(&client, dtype, &hx);
                match grad {
                    true => assert_close(&name("grad"), &after, &want.1, tolerance(dtype)),
                    false => assert_eq!(after, x, "{}", name("logits kept")),
                }
            }
        }
    }
}

/// A NaN logit makes its row's loss and gradient NaN and no other's; a target outside the row
/// gives a NaN loss for that row only.
#[test]
fn a_nan_in_cross_entropy_reaches_its_row_only() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    let dtype = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    let (rows, vocab) = (6, 40);
    let mut x = values(rows * vocab, 7);
    x[2 * vocab + 11] = f32::NAN;
    let (_, hx) = upload(&client, dtype, &x);
    let targets: Vec<i32> = vec![3, 0, 5, 39, 40, 7];
    let ht = client.create_from_slice(i32::as_bytes(&targets));
    let hk = client.create_from_slice(f32::as_bytes(&[1.0; 6]));
    let hs = client.create_from_slice(f32::as_bytes(&[1.0 / 6.0]));
    let loss = row_losses(&client, dtype, [rows, vocab], &hx, [&ht, &hk, &hs], true);
    for (r, v) in loss.iter().enumerate() {
        assert_eq!(v.is_nan(), r == 2 || r == 4, "loss[{r}] = {v}");
    }
    for (i, v) in read(&client, dtype, &hx).iter().enumerate() {
        assert_eq!(v.is_nan(), i / vocab == 2, "grad[{i}] = {v}");
    }
}

/// [`scale`] in place: each element times the device's factor, rounded once from f32 (the
/// f32 product of the values as uploaded, rounded to the dtype, bit for bit), on lengths no
/// vector divides, one of several cubes and (f32) one of more cubes than a grid's row holds;
/// the elements past `len` untouched.
#[test]
fn scale_multiplies_in_place_in_f32_and_rounds_once() {
    let client = WgpuRuntime::client(&WgpuDevice::default());
    for dtype in dtypes(&client) {
        let rows_of_cubes = (!is_f16(dtype)).then_some(65_535 * 256 + 5);
        for len in [1usize, 7, 1_000, 70_001].into_iter().chain(rows_of_cubes) {
            let raw: Vec<f32> = values(len + 3, 8).iter().map(|v| v * 40.0).collect();
            let (x, hx) = upload(&client, dtype, &raw);
            let factor = 0.37f32 / 3.0;
            let hf = client.create_from_slice(f32::as_bytes(&[factor]));
            scale(&client, dtype, len, &hx, &hf);
            let got = read(&client, dtype, &hx);
            // The expected values, rounded to the dtype by the same upload.
            let products: Vec<f32> = x[..len].iter().map(|v| v * factor).collect();
            let (want, _) = upload(&client, dtype, &products);
            assert_eq!(&got[..len], &want[..], "scale {len} {dtype:?}");
            assert_eq!(&got[len..], &x[len..], "past the end {len} {dtype:?}");
        }
    }
}
