//! RMSNorm in one pass each way: `y = x · r · w` with `r = 1/√(mean(x²) + ε)` per row, the
//! statistics in f32 whatever the element type. The forward keeps `r` (one f32 per row) for the
//! backward, which writes `dx` row by row and the weight's gradient without atomics: each cube
//! sums its rows' share per column in f32 (`partial`, one row per cube), and a last kernel sums
//! the shares in cube order, so the result does not depend on scheduling.

use cubecl::prelude::*;

use super::array;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `value` summed over the cube's `units` units (every unit gets the sum); `scratch` holds
    /// `units` f32. A tree in shared memory: portable to any plane width.
    #[cube]
    pub(super) fn cube_sum(
        value: f32,
        scratch: &mut SharedMemory<f32>,
        #[comptime] units: usize,
    ) -> f32 {
        let u = UNIT_POS as usize;
        scratch[u] = value;
        sync_cube();
        let steps = comptime!(units.trailing_zeros() as usize);
        for s in 0..steps {
            let stride = comptime!(units / 2) >> s;
            if u < stride {
                let sum = scratch[u] + scratch[u + stride];
                scratch[u] = sum;
            }
            sync_cube();
        }
        let total = scratch[0];
        sync_cube();
        total
    }

    /// One cube per row of `x` (`rows × width` vectors): `out = x · r · w`, `rstd[row] = r`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rms_forward_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        out: &mut Array<Vector<F, N>>,
        rstd: &mut Array<f32>,
        width: usize,
        hidden: f32,
        eps: f32,
        #[comptime] units: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut scratch = SharedMemory::<f32>::new(units);
        let row = CUBE_POS_X as usize;
        let at = row * width;
        let mut squares = 0.0f32;
        let mut i = UNIT_POS as usize;
        while i < width {
            let v = Vector::<f32, N>::cast_from(x[at + i]);
            squares += f32::cast_from((v * v).vector_sum());
            i += units;
        }
        let total = cube_sum(squares, &mut scratch, units);
        let r = 1.0f32 / f32::sqrt(total / hidden + eps);
        let mut i = UNIT_POS as usize;
        while i < width {
            let v = Vector::<f32, N>::cast_from(x[at + i]);
            let g = Vector::<f32, N>::cast_from(w[i]);
            out[at + i] = Vector::<F, N>::cast_from(v * Vector::new(r) * g);
            i += units;
        }
        if UNIT_POS == 0 {
            rstd[row] = r;
        }
    }

    /// One cube per `chunk` rows: `dx` of each row, and the cube's share of the weight's
    /// gradient `Σ_rows dy · x · r` per column in `partial[cube]` (f32, `width` vectors).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rms_backward_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        rstd: &Array<f32>,
        dy: &Array<Vector<F, N>>,
        dx: &mut Array<Vector<F, N>>,
        partial: &mut Array<Vector<f32, N>>,
        rows: usize,
        width: usize,
        hidden: f32,
        chunk: usize,
        #[comptime] units: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut scratch = SharedMemory::<f32>::new(units);
        let cube = CUBE_POS_X as usize;
        let first = cube * chunk;
        let mut last = first + chunk;
        if last > rows {
            last = rows;
        }
        // This unit's columns' shares start at zero (each unit owns its columns).
        let mut i = UNIT_POS as usize;
        while i < width {
            partial[cube * width + i] = Vector::<f32, N>::new(0.0);
            i += units;
        }
        for row in first..last {
            let at = row * width;
            let r = rstd[row];
            let mut dot = 0.0f32;
            let mut i = UNIT_POS as usize;
            while i < width {
                let v = Vector::<f32, N>::cast_from(x[at + i]);
                let g = Vector::<f32, N>::cast_from(w[i]);
                let d = Vector::<f32, N>::cast_from(dy[at + i]);
                dot += f32::cast_from((d * g * v).vector_sum());
                i += units;
            }
            let total = cube_sum(dot, &mut scratch, units);
            // dx = r·w·dy − r³·x·Σ(dy·w·x)/hidden
            let c = r * r * r * total / hidden;
            let mut i = UNIT_POS as usize;
            while i < width {
                let v = Vector::<f32, N>::cast_from(x[at + i]);
                let g = Vector::<f32, N>::cast_from(w[i]);
                let d = Vector::<f32, N>::cast_from(dy[at + i]);
                dx[at + i] = Vector::<F, N>::cast_from(d * g * Vector::new(r) - v * Vector::new(c));
                let share = partial[cube * width + i];
                partial[cube * width + i] = share + d * v * Vector::new(r);
                i += units;
            }
        }
    }

    /// `out[c] = Σ_k partial[k, c]` over the `count` shares in order, rounded once to `F`.
    #[cube(launch_unchecked)]
    pub fn column_sum_kernel<F: Float, N: Size>(
        partial: &Array<Vector<f32, N>>,
        out: &mut Array<Vector<F, N>>,
        count: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let width = out.len();
        let c = ABSOLUTE_POS;
        if c < width {
            let mut sum = Vector::<f32, N>::new(0.0);
            for k in 0..count {
                sum += partial[k * width + c];
            }
            out[c] = Vector::<F, N>::cast_from(sum);
        }
    }
}
use kernel::{column_sum_kernel, rms_backward_kernel, rms_forward_kernel};

/// Units per cube of the row kernels.
const UNITS: usize = 128;
/// Units per cube of the column sum.
const SUM_UNITS: usize = 256;
/// Cubes the backward aims for (rows are grouped so that about this many run): enough to
/// fill a large GPU several times over while keeping the f32 shares small (`hidden` each).
const BACKWARD_CUBES: usize = 512;

/// Rows per cube of the backward for `rows` rows.
pub fn backward_chunk(rows: usize) -> usize {
    rows.div_ceil(BACKWARD_CUBES).max(1)
}

/// Bytes of f32 scratch [`rms_norm_backward`] needs for `rows × hidden`.
pub fn backward_scratch_bytes(rows: usize, hidden: usize) -> usize {
    rows.div_ceil(backward_chunk(rows)) * hidden * 4
}

/// The forward of `rows × hidden` contiguous elements of `dtype`: `out` (same shape and dtype)
/// and `rstd` (`rows` f32) from `x` and the weight `w` (`hidden` elements of `dtype`).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, hidden]: [usize; 2],
    eps: f32,
    x: &cubecl::server::Handle,
    w: &cubecl::server::Handle,
    out: &cubecl::server::Handle,
    rstd: &cubecl::server::Handle,
) {
    if rows == 0 || hidden == 0 {
        return;
    }
    let n = rows * hidden;
    let vector = super::vector_of(client, dtype.size(), hidden);
    // SAFETY: every access is bounded by `rows` cubes × `hidden / vector` vectors per row.
    unsafe {
        rms_forward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            vector,
            array(x, n),
            array(w, hidden),
            array(out, n),
            array(rstd, rows),
            hidden / vector,
            hidden as f32,
            eps,
            UNITS,
            dtype,
        )
    }
}

/// The backward: `dx` (`rows × hidden` of `dtype`) and `dw` (`hidden` of `dtype`) from the
/// forward's `x`, `w`, `rstd` and the output's gradient `dy`; `scratch` holds
/// [`backward_scratch_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, hidden]: [usize; 2],
    [x, w, rstd, dy]: [&cubecl::server::Handle; 4],
    [dx, dw]: [&cubecl::server::Handle; 2],
    scratch: &cubecl::server::Handle,
) {
    if rows == 0 || hidden == 0 {
        return;
    }
    let n = rows * hidden;
    let vector = super::vector_of(client, dtype.size(), hidden);
    let chunk = backward_chunk(rows);
    let cubes = rows.div_ceil(chunk);
    // SAFETY: `cubes · chunk ≥ rows`, each cube bounds its rows by `rows`; `scratch` holds
    // `cubes × hidden` f32.
    unsafe {
        rms_backward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            vector,
            array(x, n),
            array(w, hidden),
            array(rstd, rows),
            array(dy, n),
            array(dx, n),
            array(scratch, cubes * hidden),
            rows,
            hidden / vector,
            hidden as f32,
            chunk,
            UNITS,
            dtype,
        );
        let width = hidden / vector;
        column_sum_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(width.div_ceil(SUM_UNITS) as u32, 1, 1),
            CubeDim::new_1d(SUM_UNITS as u32),
            vector,
            array(scratch, cubes * hidden),
            array(dw, hidden),
            cubes,
            dtype,
        );
    }
}
