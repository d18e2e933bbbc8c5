//! Cross-entropy over rows of logits in one kernel: each row's loss `lse − logit[target]` and,
//! when asked, the logits' gradient `(softmax − onehot) · keep · scale` written over the logits
//! themselves. One cube takes one row: a first pass reads the row once for its running maximum
//! and sum of exponentials (f32, whatever the element type), the cube combines its units' pairs
//! in a fixed order (plane reductions, then the planes in order: the same bits every run), and a
//! second pass reads the row again and writes the gradient in place. Nothing of the row's size
//! is allocated: the linear + cross-entropy loss holds one chunk of logits, in their own dtype.

use cubecl::prelude::*;

use super::array;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// Row `row` of `logits` (`rows × width` vectors) per cube of `units` units. `targets`
    /// (`rows` i32, each a valid index: the caller replaces ignored ones), `keep` (`rows` f32,
    /// 1 for a token that counts, 0 for an ignored one), `scale` (one f32: the mean's divisor,
    /// inverted) and `missing` (the picked logit of a target outside the row: NaN).
    #[allow(clippy::too_many_arguments, clippy::manual_is_multiple_of)]
    #[cube(launch_unchecked)]
    pub fn cross_entropy_kernel<F: Float, N: Size>(
        logits: &mut Array<Vector<F, N>>,
        targets: &Array<i32>,
        keep: &Array<f32>,
        scale: &Array<f32>,
        loss: &mut Array<f32>,
        rows: usize,
        width: usize,
        missing: f32,
        #[comptime] units: usize,
        #[comptime] grad: bool,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut maxima = SharedMemory::<f32>::new(units);
        let mut sums = SharedMemory::<f32>::new(units);
        let mut picked = SharedMemory::<f32>::new(1usize);
        let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
        let live = row < rows;
        let unit = UNIT_POS as usize;
        let plane = PLANE_DIM as usize;
        let n = logits.vector_size();
        let at = row * width;
        let mut target = 0usize;
        let mut kept = 0.0f32;
        if live {
            let t = targets[row];
            kept = keep[row];
            if t >= 0i32 {
                target = usize::cast_from(t);
            } else {
                // No unit holds it: the picked logit stays `missing`.
                target = width * n;
            }
        }
        let (tv, tl) = (target / n, target % n);
        if unit == 0 {
            picked[0] = missing;
        }
        sync_cube();
        // Pass 1: this unit's running maximum and sum of exp(logit − maximum).
        let mut m = f32::new(-1.0e30);
        let mut s = 0.0f32;
        let mut i = unit;
        while live && i < width {
            let v = Vector::<f32, N>::cast_from(logits[at + i]);
            let mut top = v[0usize];
            #[unroll]
            for k in 1..n {
                top = f32::max(top, v[k]);
            }
            // A NaN never raises the maximum; it reaches the sum below.
            if top > m {
                s *= f32::exp(m - top);
                m = top;
            }
            s += f32::cast_from(Vector::exp(v - Vector::new(m)).vector_sum());
            if i == tv {
                #[unroll]
                for k in 0..n {
                    if k == tl {
                        picked[0] = v[k];
                    }
                }
            }
            i += units;
        }
        // The cube's pairs: each plane's, then the planes' in order.
        let pm = plane_max(m);
        let ps = plane_sum(s * f32::exp(m - pm));
        if unit % plane == 0 {
            maxima[unit] = pm;
            sums[unit] = ps;
        }
        sync_cube();
        let mut big = f32::new(-1.0e30);
        let mut p = 0usize;
        while p < units {
            big = f32::max(big, maxima[p]);
            p += plane;
        }
        let mut total = 0.0f32;
        p = 0;
        while p < units {
            total += sums[p] * f32::exp(maxima[p] - big);
            p += plane;
        }
        let lse = big + f32::ln(total);
        if live && unit == 0 {
            loss[row] = kept * (lse - picked[0]);
        }
        if grad {
            // Pass 2: (softmax − onehot) · keep · scale over the logits.
            let c = kept * scale[0];
            i = unit;
            while live && i < width {
                let v = Vector::<f32, N>::cast_from(logits[at + i]);
                let p = Vector::exp(v - Vector::new(lse));
                let mut g = p * Vector::new(c);
                if i == tv {
                    #[unroll]
                    for k in 0..n {
                        if k == tl {
                            g[k] = (p[k] - 1.0) * c;
                        }
                    }
                }
                logits[at + i] = Vector::<F, N>::cast_from(g);
                i += units;
            }
        }
    }

    /// `x[i] = x[i] · factor[0]` in f32, rounded once to `F`: the backward's scaling of the
    /// gradients the forward kept, in their own buffer.
    #[cube(launch_unchecked)]
    pub fn scale_kernel<F: Float, N: Size>(
        x: &mut Array<Vector<F, N>>,
        factor: &Array<f32>,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        if i < x.len() {
            let f = Vector::<f32, N>::new(factor[0]);
            x[i] = Vector::<F, N>::cast_from(Vector::<f32, N>::cast_from(x[i]) * f);
        }
    }
}
use kernel::{cross_entropy_kernel, scale_kernel};

/// Most units a row takes.
const MAX_UNITS: usize = 512;
/// Most cubes along one axis of the grid (wgpu's limit; CUDA's is larger).
const MAX_CUBES_X: usize = 65_535;

/// Cross-entropy of `rows × vocab` contiguous logits of `dtype` against `targets` (`rows` i32
/// in `0..vocab`; ignored tokens' replaced by any valid index), `keep` (`rows` f32: 1 for a
/// token that counts, 0 for one ignored) and `scale` (one f32, e.g. 1 / tokens kept): writes
/// `loss` (`rows` f32, `keep · (lse − logit[target])`) and, when `grad`, the gradient of
/// `scale · Σ loss` with respect to the logits over the logits (`dtype`). A target outside
/// `0..vocab` gives its row a NaN loss and no `−1` in its gradient; a NaN logit makes its row's
/// loss and gradient NaN.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, vocab]: [usize; 2],
    logits: &cubecl::server::Handle,
    [targets, keep, scale]: [&cubecl::server::Handle; 3],
    loss: &cubecl::server::Handle,
    grad: bool,
) {
    if rows == 0 || vocab == 0 {
        return;
    }
    let vector = super::vector_of(client, dtype.size(), vocab);
    let width = vocab / vector;
    let plane = (client.properties().hardware.plane_size_max as usize)
        .max(1)
        .next_power_of_two();
    let units = width.next_power_of_two().clamp(plane, MAX_UNITS.max(plane));
    let x = rows.min(MAX_CUBES_X);
    // SAFETY: a cube reads and writes only row `row < rows` (`width` vectors) of `logits` and
    // element `row` of `targets`, `keep` and `loss`; `scale` holds one f32.
    unsafe {
        cross_entropy_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1),
            CubeDim::new_1d(units as u32),
            vector,
            array(logits, rows * vocab),
            array(targets, rows),
            array(keep, rows),
            array(scale, 1),
            array(loss, rows),
            rows,
            width,
            f32::NAN,
            units,
            grad,
            dtype,
        )
    }
}

/// Units per cube of [`scale`].
const SCALE_UNITS: usize = 256;

/// `x · factor` over `len` contiguous elements of `dtype` in `x`'s own buffer, in f32 and
/// rounded once (`factor`: one f32 on the device, e.g. `dL/dloss / tokens`): the loss's
/// backward scales the gradients its forward kept without an f32 copy of the weight's.
pub fn scale<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    x: &cubecl::server::Handle,
    factor: &cubecl::server::Handle,
) {
    if len == 0 {
        return;
    }
    let vector = super::vector_of(client, dtype.size(), len);
    let cubes = (len / vector).div_ceil(SCALE_UNITS);
    // A grid of at most 65,535 cubes along x (wgpu's limit), the rest along y.
    let x_cubes = cubes.min(MAX_CUBES_X);
    // SAFETY: each unit reads and writes its own vector of `x`, bounded by `len`; `factor`
    // holds one f32.
    unsafe {
        scale_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x_cubes as u32, cubes.div_ceil(x_cubes) as u32, 1),
            CubeDim::new_1d(SCALE_UNITS as u32),
            vector,
            array(x, len),
            array(factor, 1),
            dtype,
        )
    }
}
