//! RMSNorm in one pass each way: `y = x · r · w` with `r = 1/√(mean(x²) + ε)` per row, the
//! statistics in f32 whatever the element type. A row is held by `lanes` neighbouring units
//! (whole planes), each keeping its few vectors of the row in registers, so the row is read
//! from memory once and summed with plane reductions (one shared-memory step across a row's
//! planes). The forward keeps `r` (one f32 per row) for the backward, which writes `dx` row by
//! row and the weight's gradient without atomics: each cube sums its rows' share per column in
//! f32 registers and writes it once (`partial`, one row per cube), and a last kernel sums the
//! shares in a fixed order, so the result does not depend on scheduling.

use cubecl::prelude::*;

use super::array;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `value` summed over the `lanes` units of this unit's row (`UNIT_POS_Y`; every unit of
    /// the row gets the sum): a plane sum, then the row's planes' sums through `scratch`
    /// (`lanes` f32 per row of the cube). Every unit of the cube must reach it.
    // `%` because cube code has no `is_multiple_of`; the plane's first unit is found from the
    // row's lane, not `UNIT_POS_PLANE` (which lavapipe does not number that way).
    #[allow(clippy::manual_is_multiple_of)]
    #[cube]
    pub(super) fn row_sum(
        value: f32,
        scratch: &mut SharedMemory<f32>,
        #[comptime] lanes: usize,
    ) -> f32 {
        let s = plane_sum(value);
        let base = UNIT_POS_Y as usize * lanes;
        let lane = UNIT_POS_X as usize;
        let plane = PLANE_DIM as usize;
        if lane % plane == 0 {
            scratch[base + lane] = s;
        }
        sync_cube();
        let mut total = 0.0f32;
        let mut p = 0usize;
        while p < lanes {
            total += scratch[base + p];
            p += plane;
        }
        sync_cube();
        total
    }

    /// The row this unit helps hold, and whether it is one of the `rows`.
    #[cube]
    fn this_row(rows: usize, #[comptime] units: usize, #[comptime] lanes: usize) -> (usize, bool) {
        let row = CUBE_POS_X as usize * comptime!(units / lanes) + UNIT_POS_Y as usize;
        (row, row < rows)
    }

    /// Both forwards' second half, over the row `v` holds (zeros past the row's end): its sum
    /// of squares, then `out = v · r · w`, `rstd[row] = r`.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn normalize<F: Float, N: Size>(
        v: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        out: &mut Array<Vector<F, N>>,
        rstd: &mut Array<f32>,
        scratch: &mut SharedMemory<f32>,
        row: usize,
        live: bool,
        width: usize,
        hidden: f32,
        eps: f32,
        #[comptime] lanes: usize,
        #[comptime] per_lane: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let at = row * width;
        let mut squares = 0.0f32;
        #[unroll]
        for k in 0..per_lane {
            let f = Vector::<f32, N>::cast_from(v[k]);
            squares += f32::cast_from((f * f).vector_sum());
        }
        let total = row_sum(squares, scratch, lanes);
        let r = 1.0f32 / f32::sqrt(total / hidden + eps);
        #[unroll]
        for k in 0..per_lane {
            let i = lane + k * lanes;
            if live && i < width {
                let f = Vector::<f32, N>::cast_from(v[k]);
                let g = Vector::<f32, N>::cast_from(w[i]);
                out[at + i] = Vector::<F, N>::cast_from(f * Vector::new(r) * g);
            }
        }
        if live && lane == 0 {
            rstd[row] = r;
        }
    }

    /// Rows of `x` (`rows × width` vectors), `units / lanes` per cube, `lanes` units each
    /// holding `per_lane` vectors: `out = x · r · w`, `rstd[row] = r`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rms_forward_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        out: &mut Array<Vector<F, N>>,
        rstd: &mut Array<f32>,
        rows: usize,
        width: usize,
        x_pitch: usize,
        hidden: f32,
        eps: f32,
        #[comptime] units: usize,
        #[comptime] lanes: usize,
        #[comptime] per_lane: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut scratch = SharedMemory::<f32>::new(units);
        let lane = UNIT_POS_X as usize;
        let (row, live) = this_row(rows, units, lanes);
        let at = row * x_pitch;
        let zero = Vector::<F, N>::cast_from(Vector::<f32, N>::new(0.0));
        let mut v = Array::<Vector<F, N>>::new(per_lane);
        #[unroll]
        for k in 0..per_lane {
            let i = lane + k * lanes;
            let mut e = zero;
            if live && i < width {
                e = x[at + i];
            }
            v[k] = e;
        }
        normalize::<F, N>(
            &v,
            w,
            out,
            rstd,
            &mut scratch,
            row,
            live,
            width,
            hidden,
            eps,
            lanes,
            per_lane,
        );
    }

    /// [`rms_forward_kernel`] of `h = x + residual` (the sum in f32, rounded once to `F`, as an
    /// add of two tensors of `F` rounds it), writing `h` to `sum` as well: a transformer
    /// block's residual add and the norm after it in one pass.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rms_add_forward_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        residual: &Array<Vector<F, N>>,
        w: &Array<Vector<F, N>>,
        sum: &mut Array<Vector<F, N>>,
        out: &mut Array<Vector<F, N>>,
        rstd: &mut Array<f32>,
        rows: usize,
        width: usize,
        x_pitch: usize,
        r_pitch: usize,
        hidden: f32,
        eps: f32,
        #[comptime] units: usize,
        #[comptime] lanes: usize,
        #[comptime] per_lane: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut scratch = SharedMemory::<f32>::new(units);
        let lane = UNIT_POS_X as usize;
        let (row, live) = this_row(rows, units, lanes);
        let at = row * width;
        let zero = Vector::<F, N>::cast_from(Vector::<f32, N>::new(0.0));
        let mut v = Array::<Vector<F, N>>::new(per_lane);
        #[unroll]
        for k in 0..per_lane {
            let i = lane + k * lanes;
            let mut e = zero;
            if live && i < width {
                let added = Vector::<f32, N>::cast_from(x[row * x_pitch + i])
                    + Vector::<f32, N>::cast_from(residual[row * r_pitch + i]);
                e = Vector::<F, N>::cast_from(added);
                sum[at + i] = e;
            }
            v[k] = e;
        }
        normalize::<F, N>(
            &v,
            w,
            out,
            rstd,
            &mut scratch,
            row,
            live,
            width,
            hidden,
            eps,
            lanes,
            per_lane,
        );
    }

    /// One cube (`lanes` units, `per_lane` vectors each) per `chunk` rows: `dx` of each row,
    /// and the cube's share of the weight's gradient `Σ_rows dy · x · r` per column, summed in
    /// registers and written once to `partial[cube]` (f32, `width` vectors).
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
        x_pitch: usize,
        dy_pitch: usize,
        hidden: f32,
        chunk: usize,
        #[comptime] lanes: usize,
        #[comptime] per_lane: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut scratch = SharedMemory::<f32>::new(lanes);
        let lane = UNIT_POS_X as usize;
        let cube = CUBE_POS_X as usize;
        let first = cube * chunk;
        let mut last = first + chunk;
        if last > rows {
            last = rows;
        }
        let zero = Vector::<F, N>::cast_from(Vector::<f32, N>::new(0.0));
        // The unit's columns are the same in every row: their weights and gradient shares
        // stay in registers.
        let mut g = Array::<Vector<F, N>>::new(per_lane);
        let mut share = Array::<Vector<f32, N>>::new(per_lane);
        let mut xs = Array::<Vector<F, N>>::new(per_lane);
        let mut ds = Array::<Vector<F, N>>::new(per_lane);
        #[unroll]
        for k in 0..per_lane {
            let i = lane + k * lanes;
            let mut e = zero;
            if i < width {
                e = w[i];
            }
            g[k] = e;
            share[k] = Vector::<f32, N>::new(0.0);
        }
        for row in first..last {
            let at = row * width;
            let r = rstd[row];
            let mut dot = 0.0f32;
            #[unroll]
            for k in 0..per_lane {
                let i = lane + k * lanes;
                let mut a = zero;
                let mut b = zero;
                if i < width {
                    a = x[row * x_pitch + i];
                    b = dy[row * dy_pitch + i];
                }
                xs[k] = a;
                ds[k] = b;
                let v = Vector::<f32, N>::cast_from(a);
                let d = Vector::<f32, N>::cast_from(b);
                let gw = Vector::<f32, N>::cast_from(g[k]);
                dot += f32::cast_from((d * gw * v).vector_sum());
            }
            let total = row_sum(dot, &mut scratch, lanes);
            // dx = r·w·dy − r³·x·Σ(dy·w·x)/hidden
            let c = r * r * r * total / hidden;
            #[unroll]
            for k in 0..per_lane {
                let i = lane + k * lanes;
                if i < width {
                    let v = Vector::<f32, N>::cast_from(xs[k]);
                    let d = Vector::<f32, N>::cast_from(ds[k]);
                    let gw = Vector::<f32, N>::cast_from(g[k]);
                    dx[at + i] =
                        Vector::<F, N>::cast_from(d * gw * Vector::new(r) - v * Vector::new(c));
                    share[k] += d * v * Vector::new(r);
                }
            }
        }
        #[unroll]
        for k in 0..per_lane {
            let i = lane + k * lanes;
            if i < width {
                partial[cube * width + i] = share[k];
            }
        }
    }

    /// `out[c] = Σ_k partial[k, c]` over the `count` shares, rounded once to `F`. A cube takes
    /// `cols` columns; its `slices` rows of units each sum every `slices`-th share of their
    /// column, and the slices' sums are added in slice order: a fixed order, the same bits
    /// every run, with `slices` times the units of one sum per column.
    #[cube(launch_unchecked)]
    pub fn column_sum_kernel<F: Float, N: Size>(
        partial: &Array<Vector<f32, N>>,
        out: &mut Array<Vector<F, N>>,
        count: usize,
        #[comptime] cols: usize,
        #[comptime] slices: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let mut sums = SharedMemory::<Vector<f32, N>>::new(comptime!(cols * slices));
        let width = out.len();
        let x = UNIT_POS_X as usize;
        let y = UNIT_POS_Y as usize;
        let c = CUBE_POS_X as usize * cols + x;
        let mut sum = Vector::<f32, N>::new(0.0);
        if c < width {
            let mut k = y;
            while k < count {
                sum += partial[k * width + c];
                k += slices;
            }
        }
        sums[y * cols + x] = sum;
        sync_cube();
        if y == 0 && c < width {
            let mut total = Vector::<f32, N>::new(0.0);
            for s in 0..slices {
                total += sums[s * cols + x];
            }
            out[c] = Vector::<F, N>::cast_from(total);
        }
    }
}
use kernel::{column_sum_kernel, rms_add_forward_kernel, rms_backward_kernel, rms_forward_kernel};

/// Units per cube of the forward (`units / lanes` rows each).
const FORWARD_UNITS: usize = 256;
/// Vectors a unit of the forward aims to hold (the row's width sets its lanes).
const FORWARD_PER_LANE: usize = 8;
/// Vectors a unit of the backward aims to hold: four arrays of them live in registers.
const BACKWARD_PER_LANE: usize = 4;
/// Most units a row takes; wider rows give each unit more vectors.
const MAX_LANES: usize = 1024;
/// Columns per cube of the column sum, and the units that share each column's sum.
const SUM_COLUMNS: usize = 16;
const SUM_SLICES: usize = 16;
/// Cubes the backward aims for (rows are grouped so that about this many run): enough to
/// fill a large GPU several times over while keeping the f32 shares small (`hidden` each).
const BACKWARD_CUBES: usize = 512;

/// Units per row and vectors per unit for rows of `width` vectors, aiming at `per_lane`
/// vectors per unit: whole planes (so a plane never holds two rows), a power of two.
fn row_layout<R: Runtime>(
    client: &ComputeClient<R>,
    width: usize,
    per_lane: usize,
) -> (usize, usize) {
    let plane = (client.properties().hardware.plane_size_max as usize)
        .max(1)
        .next_power_of_two();
    let lanes = width
        .div_ceil(per_lane)
        .next_power_of_two()
        .clamp(plane, MAX_LANES.max(plane));
    (lanes, width.div_ceil(lanes))
}

/// Rows per cube of the backward for `rows` rows.
pub fn backward_chunk(rows: usize) -> usize {
    rows.div_ceil(BACKWARD_CUBES).max(1)
}

/// Bytes of f32 scratch [`rms_norm_backward`] needs for `rows × hidden`.
pub fn backward_scratch_bytes(rows: usize, hidden: usize) -> usize {
    rows.div_ceil(backward_chunk(rows)) * hidden * 4
}

/// The pitch of rows laid out one after another (the last axis unit-strided, every other axis
/// compact over rows `pitch ≥ hidden` apart; axes of one element ignored); None for any
/// other layout.
pub fn row_pitch(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let (&hidden, leading) = shape.split_last()?;
    if hidden > 1 && strides[shape.len() - 1] != 1 {
        return None;
    }
    let rows: usize = leading.iter().product();
    if rows <= 1 {
        return Some(hidden);
    }
    // The innermost leading axis of more than one element sets the pitch.
    let inner = (0..leading.len()).rev().find(|&i| shape[i] > 1)?;
    let pitch = strides[inner];
    if pitch < hidden {
        return None;
    }
    let mut expect = pitch;
    for i in (0..leading.len()).rev() {
        if shape[i] == 1 {
            continue;
        }
        if strides[i] != expect {
            return None;
        }
        expect *= shape[i];
    }
    Some(pitch)
}

/// Elements from the first row's start to the last row's end, rows `pitch` elements apart.
fn span(rows: usize, hidden: usize, pitch: usize) -> usize {
    (rows - 1) * pitch + hidden
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The forward of `rows × hidden` elements of `dtype`: `out` (contiguous, same dtype) and
/// `rstd` (`rows` f32) from `x` (its rows `x_pitch ≥ hidden` elements apart: contiguous, or
/// cubecl's pitched layout) and the weight `w` (`hidden` elements of `dtype`).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, hidden]: [usize; 2],
    eps: f32,
    (x, x_pitch): (&cubecl::server::Handle, usize),
    w: &cubecl::server::Handle,
    out: &cubecl::server::Handle,
    rstd: &cubecl::server::Handle,
) {
    let Some(grid) = ForwardGrid::of(client, dtype, rows, hidden, &[x_pitch]) else {
        return;
    };
    let (n, v) = (rows * hidden, grid.vector);
    // SAFETY: every access is bounded by `rows` rows × `width` vectors per row, each input row
    // starting a pitch after the one before.
    unsafe {
        rms_forward_kernel::launch_unchecked::<R>(
            client,
            grid.cubes,
            grid.dim,
            v,
            array(x, span(rows, hidden, x_pitch)),
            array(w, hidden),
            array(out, n),
            array(rstd, rows),
            rows,
            grid.width,
            x_pitch / v,
            hidden as f32,
            eps,
            grid.units,
            grid.lanes,
            grid.per_lane,
            dtype,
        )
    }
}

/// [`rms_norm_forward`] of `x + residual` (both `rows × hidden` of `dtype`, each with its row
/// pitch), the sum written (contiguous) to `sum` too: a block's residual add and the norm
/// after it, one launch.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_add_forward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, hidden]: [usize; 2],
    eps: f32,
    [(x, x_pitch), (residual, r_pitch)]: [(&cubecl::server::Handle, usize); 2],
    w: &cubecl::server::Handle,
    [sum, out, rstd]: [&cubecl::server::Handle; 3],
) {
    let Some(grid) = ForwardGrid::of(client, dtype, rows, hidden, &[x_pitch, r_pitch]) else {
        return;
    };
    let (n, v) = (rows * hidden, grid.vector);
    // SAFETY: as for `rms_norm_forward`.
    unsafe {
        rms_add_forward_kernel::launch_unchecked::<R>(
            client,
            grid.cubes,
            grid.dim,
            v,
            array(x, span(rows, hidden, x_pitch)),
            array(residual, span(rows, hidden, r_pitch)),
            array(w, hidden),
            array(sum, n),
            array(out, n),
            array(rstd, rows),
            rows,
            grid.width,
            x_pitch / v,
            r_pitch / v,
            hidden as f32,
            eps,
            grid.units,
            grid.lanes,
            grid.per_lane,
            dtype,
        )
    }
}

/// The widest vector of `dtype` that divides `hidden` and every row pitch (so each row starts
/// on a vector).
fn vector_over<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    hidden: usize,
    pitches: &[usize],
) -> usize {
    let common = pitches.iter().fold(hidden, |g, p| gcd(g, *p));
    super::vector_of(client, dtype.size(), common)
}

/// How a forward lays rows over cubes: `lanes` units a row, `units / lanes` rows a cube.
struct ForwardGrid {
    cubes: CubeCount,
    dim: CubeDim,
    vector: usize,
    width: usize,
    units: usize,
    lanes: usize,
    per_lane: usize,
}

impl ForwardGrid {
    /// None for an empty tensor (nothing to launch).
    fn of<R: Runtime>(
        client: &ComputeClient<R>,
        dtype: StorageType,
        rows: usize,
        hidden: usize,
        pitches: &[usize],
    ) -> Option<Self> {
        if rows == 0 || hidden == 0 {
            return None;
        }
        assert!(
            pitches.iter().all(|p| *p >= hidden),
            "row pitches {pitches:?} shorter than the rows ({hidden})"
        );
        let vector = vector_over(client, dtype, hidden, pitches);
        let width = hidden / vector;
        let (lanes, per_lane) = row_layout(client, width, FORWARD_PER_LANE);
        let units = FORWARD_UNITS.max(lanes);
        let rows_per_cube = units / lanes;
        Some(Self {
            cubes: CubeCount::Static(rows.div_ceil(rows_per_cube) as u32, 1, 1),
            dim: CubeDim::new_2d(lanes as u32, rows_per_cube as u32),
            vector,
            width,
            units,
            lanes,
            per_lane,
        })
    }
}

/// The backward: `dx` (`rows × hidden` of `dtype`, contiguous) and `dw` (`hidden` of `dtype`)
/// from the forward's `x`, `w`, `rstd` and the output's gradient `dy` (`x` and `dy` each with
/// its row pitch); `scratch` holds [`backward_scratch_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    [rows, hidden]: [usize; 2],
    [(x, x_pitch), (dy, dy_pitch)]: [(&cubecl::server::Handle, usize); 2],
    [w, rstd]: [&cubecl::server::Handle; 2],
    [dx, dw]: [&cubecl::server::Handle; 2],
    scratch: &cubecl::server::Handle,
) {
    if rows == 0 || hidden == 0 {
        return;
    }
    assert!(
        x_pitch >= hidden && dy_pitch >= hidden,
        "row pitches {x_pitch}, {dy_pitch} shorter than the rows ({hidden})"
    );
    let n = rows * hidden;
    let vector = vector_over(client, dtype, hidden, &[x_pitch, dy_pitch]);
    let width = hidden / vector;
    let (lanes, per_lane) = row_layout(client, width, BACKWARD_PER_LANE);
    let chunk = backward_chunk(rows);
    let cubes = rows.div_ceil(chunk);
    // SAFETY: `cubes · chunk ≥ rows`, each cube bounds its rows by `rows` and its columns by
    // `width`; `scratch` holds `cubes × hidden` f32.
    unsafe {
        rms_backward_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_2d(lanes as u32, 1),
            vector,
            array(x, span(rows, hidden, x_pitch)),
            array(w, hidden),
            array(rstd, rows),
            array(dy, span(rows, hidden, dy_pitch)),
            array(dx, n),
            array(scratch, cubes * hidden),
            rows,
            width,
            x_pitch / vector,
            dy_pitch / vector,
            hidden as f32,
            chunk,
            lanes,
            per_lane,
            dtype,
        );
        column_sum_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(width.div_ceil(SUM_COLUMNS) as u32, 1, 1),
            CubeDim::new_2d(SUM_COLUMNS as u32, SUM_SLICES as u32),
            vector,
            array(scratch, cubes * hidden),
            array(dw, hidden),
            cubes,
            SUM_COLUMNS,
            SUM_SLICES,
            dtype,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::row_pitch;

    #[test]
    fn rows_are_found_contiguous_pitched_or_not_at_all() {
        // Contiguous, of any rank.
        assert_eq!(row_pitch(&[4, 576], &[576, 1]), Some(576));
        assert_eq!(row_pitch(&[2, 3, 576], &[1728, 576, 1]), Some(576));
        // cubecl's pitched layout: rows 768 apart, the leading axes compact over them.
        assert_eq!(row_pitch(&[2, 3, 576], &[2304, 768, 1]), Some(768));
        // Axes of one element are ignored, whatever their strides.
        assert_eq!(row_pitch(&[1, 3, 576], &[7, 768, 1]), Some(768));
        assert_eq!(row_pitch(&[2, 1, 576], &[768, 5, 1]), Some(768));
        // One row: its pitch does not matter.
        assert_eq!(row_pitch(&[1, 576], &[9999, 1]), Some(576));
        assert_eq!(row_pitch(&[576], &[1]), Some(576));
        // Not rows one after another: a transposed last axis, overlapping rows, leading axes
        // out of order or with a gap between them.
        assert_eq!(row_pitch(&[4, 576], &[1, 4]), None);
        assert_eq!(row_pitch(&[4, 576], &[100, 1]), None);
        assert_eq!(row_pitch(&[2, 3, 576], &[768, 1536, 1]), None);
        assert_eq!(row_pitch(&[2, 3, 576], &[3000, 768, 1]), None);
    }
}
