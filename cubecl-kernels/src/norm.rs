//! The sum of squares of f32 vectors (a gradient in pieces) in one read and a fixed order: the
//! gradient norm that clipping divides by. burn 0.21 takes three passes for it (the squares
//! written out, a sum that adds the cubes' shares with atomics, in an order that changes from
//! run to run); here each piece is read once by a fixed grid of cubes, each cube writes its
//! share, and one cube sums the shares in order, so the result has the same bits every run.

use cubecl::prelude::*;

/// Cubes of the first pass per piece at most (a piece with fewer vectors than units in that
/// many cubes takes fewer, an empty one none).
pub const CUBES: usize = 1024;
/// Units per cube.
const UNITS: usize = 256;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `value` summed over the cube's units into `out[at]`, in a fixed order.
    #[cube]
    fn cube_sum_into(value: f32, out: &mut Array<f32>, at: usize, #[comptime] units: usize) {
        let mut shared = SharedMemory::<f32>::new(units);
        let u = UNIT_POS_X as usize;
        shared[u] = value;
        sync_cube();
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if u < stride {
                shared[u] += shared[u + stride];
            }
            sync_cube();
            stride /= 2;
        }
        if u == 0 {
            out[at] = shared[0];
        }
    }

    /// Cube `c` of the grid: the sum of squares of the vectors `c·units + u + k·(cubes·units)`
    /// of `x` (neighbouring units read neighbouring vectors), into `partials[at + c]`.
    #[cube(launch_unchecked)]
    pub fn squares_partials_kernel<N: Size>(
        x: &Array<Vector<f32, N>>,
        partials: &mut Array<f32>,
        at: usize,
        #[comptime] units: usize,
    ) {
        let cube = CUBE_POS_X as usize;
        let stride = CUBE_COUNT_X as usize * units;
        let mut i = cube * units + UNIT_POS_X as usize;
        let mut acc = Vector::<f32, N>::new(0.0);
        while i < x.len() {
            let v = x[i];
            acc += v * v;
            i += stride;
        }
        cube_sum_into(f32::cast_from(acc.vector_sum()), partials, at + cube, units);
    }

    /// One cube: the sum of `partials` into `out[0]`.
    #[cube(launch_unchecked)]
    pub fn sum_partials_kernel(
        partials: &Array<f32>,
        out: &mut Array<f32>,
        #[comptime] units: usize,
    ) {
        let mut sum = 0.0f32;
        let mut i = UNIT_POS_X as usize;
        while i < partials.len() {
            sum += partials[i];
            i += units;
        }
        cube_sum_into(sum, out, 0, units);
    }
}
pub use kernel::{squares_partials_kernel, sum_partials_kernel};

/// One piece of f32 values on the device: its buffer and its length in elements. A buffer
/// that starts 16 bytes aligned with a length divisible by four is read in vectors of four.
pub struct SquaresPiece<'a> {
    /// The values (`len` f32 from the handle's start).
    pub handle: &'a cubecl::server::Handle,
    /// Elements.
    pub len: usize,
}

/// The first pass's cubes for `vectors` vectors: none for an empty piece.
fn cubes_for(vectors: usize) -> usize {
    vectors.div_ceil(UNITS).min(CUBES)
}

/// `Σ x²` over every element of `pieces` as a new device buffer of one f32, summed in a
/// fixed order (the same bits every run for the same pieces). Nothing is read back.
pub fn sum_of_squares<R: Runtime>(
    client: &ComputeClient<R>,
    pieces: &[SquaresPiece<'_>],
) -> cubecl::server::Handle {
    let layout: Vec<(usize, usize)> = pieces
        .iter()
        .map(|p| {
            let vector = crate::vector_of_four(p.len, &[p.handle]);
            (vector, cubes_for(p.len / vector))
        })
        .collect();
    // Every cube writes its share; with no cube at all (no elements), the sum reads one zero.
    let total: usize = layout.iter().map(|(_, c)| c).sum();
    let partials = match total {
        0 => client.create_from_slice(f32::as_bytes(&[0.0f32])),
        _ => client.empty(4 * total),
    };
    let total = total.max(1);
    let out = client.empty(4);
    let arg =
        |h: &cubecl::server::Handle, n: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), n) };
    let mut at = 0;
    // SAFETY: each piece's handle holds `len` f32; each launch writes `partials[at..at +
    // cubes]`, within `total`; the sum reads `total` and writes one f32.
    unsafe {
        for (piece, &(vector, cubes)) in pieces.iter().zip(&layout) {
            if cubes > 0 {
                squares_partials_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(cubes as u32, 1, 1),
                    CubeDim::new_1d(UNITS as u32),
                    vector,
                    arg(piece.handle, piece.len),
                    arg(&partials, total),
                    at,
                    UNITS,
                );
            }
            at += cubes;
        }
        sum_partials_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            arg(&partials, total),
            arg(&out, 1),
            UNITS,
        );
    }
    out
}
