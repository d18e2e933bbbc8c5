//! The two-layer MLP step that `matmul-check` and `burn-linear-repro` run on the device,
//! computed in f64 on the host: `Linear(257→129) → relu → Linear(129→65)`, mean squared error,
//! on 33 rows of fixed data. Plain Rust, so both programs compare against the same truth.

/// Input, hidden and output widths.
pub const DIMS: [usize; 3] = [257, 129, 65];
/// Rows (3 × 11 tokens).
pub const ROWS: usize = 33;

/// `n` deterministic values in [-1, 1), in f32 as the programs upload them.
pub fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0)
        .collect()
}

/// The step's data, values in [-0.2, 0.2), row-major: x `[33, 257]`, y `[33, 65]`,
/// w1 `[257, 129]`, b1 `[129]`, w2 `[129, 65]`, b2 `[65]`.
pub fn data() -> [Vec<f32>; 6] {
    let scaled = |n: usize, seed: usize| values(n, seed).iter().map(|v| v * 0.2).collect();
    let [d_in, d_hid, d_out] = DIMS;
    [
        scaled(ROWS * d_in, 3),
        scaled(ROWS * d_out, 4),
        scaled(d_in * d_hid, 1),
        scaled(d_hid, 6),
        scaled(d_hid * d_out, 2),
        scaled(d_out, 7),
    ]
}

/// Row-major `a [r×k] · b [k×n]` in f64.
pub fn mm(a: &[f64], b: &[f64], (r, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; r * n];
    for i in 0..r {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

/// `a [r×c]` transposed.
pub fn transposed(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..r * c).map(|i| a[(i % r) * c + i / r]).collect()
}

/// One step's loss, the gradients of w1, b1, w2, b2 and the first layer's pre-activations.
pub struct Step {
    /// The mean squared error.
    pub loss: f64,
    /// The gradients of w1, b1, w2, b2.
    pub grads: [Vec<f64>; 4],
    /// The first layer's output before relu, `[33, 129]`.
    pub pre: Vec<f64>,
}

/// The step in f64. `mask`: relu's mask taken from these pre-activations' signs instead of its
/// own (a TF32 forward rounds values within its error of zero across it).
pub fn step(mask: Option<&[f64]>) -> Step {
    let [x, y, w1, b1, w2, b2] =
        data().map(|v| v.iter().map(|x| f64::from(*x)).collect::<Vec<f64>>());
    let [d_in, d_hid, d_out] = DIMS;
    let with_bias = |mut v: Vec<f64>, b: &[f64]| {
        v.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x += b[i % b.len()]);
        v
    };
    let pre = with_bias(mm(&x, &w1, (ROWS, d_in, d_hid)), &b1);
    let keep: Vec<bool> = mask.unwrap_or(&pre).iter().map(|v| *v > 0.0).collect();
    let masked = |v: &[f64]| -> Vec<f64> {
        v.iter()
            .zip(&keep)
            .map(|(v, k)| if *k { *v } else { 0.0 })
            .collect()
    };
    let h = masked(&pre);
    let out = with_bias(mm(&h, &w2, (ROWS, d_hid, d_out)), &b2);
    let count = out.len() as f64;
    let loss = out
        .iter()
        .zip(&y)
        .map(|(o, y)| (o - y).powi(2))
        .sum::<f64>()
        / count;
    let d_o: Vec<f64> = out
        .iter()
        .zip(&y)
        .map(|(o, y)| 2.0 * (o - y) / count)
        .collect();
    let col_sums = |a: &[f64], n: usize| -> Vec<f64> {
        (0..n).map(|j| a.iter().skip(j).step_by(n).sum()).collect()
    };
    let d_pre = masked(&mm(
        &d_o,
        &transposed(&w2, d_hid, d_out),
        (ROWS, d_out, d_hid),
    ));
    let grads = [
        mm(&transposed(&x, ROWS, d_in), &d_pre, (d_in, ROWS, d_hid)),
        col_sums(&d_pre, d_hid),
        mm(&transposed(&h, ROWS, d_hid), &d_o, (d_hid, ROWS, d_out)),
        col_sums(&d_o, d_out),
    ];
    Step { loss, grads, pre }
}
