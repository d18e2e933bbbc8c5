//! Rotary position embedding in one kernel each way, on `[batch, seq, heads, head_dim]`
//! contiguous rows (a projection's output before its heads are moved forward). The angles come
//! from one `[seq, head_dim / 2]` f32 table of cosines and one of sines (made once per
//! sequence length, not per batch or head); the backward is the rotation by the opposite angle.

use cubecl::prelude::*;

use super::array;

/// Which elements of a head form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// `(x[2i], x[2i + 1])`: GGUF's layout, and the recipe's.
    Interleaved,
    /// `(x[i], x[i + head_dim / 2])`: Hugging Face Llama's `rotate_half`.
    HalfSplit,
}

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// Interleaved pairs, `vec / 2` pairs (a vector of `vec` elements, inside one head) per
    /// unit: `pairs` per head row, rows of `heads` heads per position, `seq` positions per
    /// batch. `sign` −1 rotates back.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rope_interleaved_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        cos: &Array<f32>,
        sin: &Array<f32>,
        out: &mut Array<Vector<F, N>>,
        pairs: usize,
        heads: usize,
        seq: usize,
        sign: f32,
        #[comptime] vec: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        if i < out.len() {
            let first = i * comptime!(vec / 2);
            let p = first % pairs;
            let pos = (first / (pairs * heads)) % seq;
            let t = pos * pairs + p;
            let v = x[i];
            let mut o = Vector::<F, N>::empty();
            #[unroll]
            for k in 0..comptime!(vec / 2) {
                let c = cos[t + k];
                let s = sin[t + k] * sign;
                let a = f32::cast_from(v[2 * k]);
                let b = f32::cast_from(v[2 * k + 1]);
                o[2 * k] = F::cast_from(a * c - b * s);
                o[2 * k + 1] = F::cast_from(a * s + b * c);
            }
            out[i] = o;
        }
    }

    /// Half-split pairs, `N` pairs per unit: vector `j` of a head's first half with vector `j`
    /// of its second half (`half` vectors each).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub fn rope_half_kernel<F: Float, N: Size>(
        x: &Array<Vector<F, N>>,
        cos: &Array<Vector<f32, N>>,
        sin: &Array<Vector<f32, N>>,
        out: &mut Array<Vector<F, N>>,
        half: usize,
        heads: usize,
        seq: usize,
        sign: f32,
        #[define(F)] _dtype: StorageType,
    ) {
        let i = ABSOLUTE_POS;
        if i < out.len() / 2 {
            let j = i % half;
            let row = i / half;
            let pos = (row / heads) % seq;
            let c = cos[pos * half + j];
            let s = sin[pos * half + j] * Vector::new(sign);
            let at = row * 2 * half + j;
            let a = Vector::<f32, N>::cast_from(x[at]);
            let b = Vector::<f32, N>::cast_from(x[at + half]);
            out[at] = Vector::<F, N>::cast_from(a * c - b * s);
            out[at + half] = Vector::<F, N>::cast_from(a * s + b * c);
        }
    }
}
use kernel::{rope_half_kernel, rope_interleaved_kernel};

/// Units per cube.
const UNITS: usize = 256;

/// The shape of one RoPE call: `[batch, seq, heads, head_dim]`, `head_dim` even.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// Batch.
    pub batch: usize,
    /// Positions.
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Width of a head (even).
    pub head_dim: usize,
}

impl RopeDims {
    /// Elements of the tensor.
    pub fn len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// Whether the tensor is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `out` = `x` (contiguous `dims`, elements of `dtype`) rotated by the angles whose cosines
/// and sines are `cos`/`sin` (`[table_seq ≥ dims.seq, head_dim / 2]` f32, position `p` at row
/// `p`); `inverse` rotates back (the backward, on the output's gradient).
#[allow(clippy::too_many_arguments)]
pub fn rope<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    dims: RopeDims,
    pairs: RopePairs,
    inverse: bool,
    [x, cos, sin]: [&cubecl::server::Handle; 3],
    out: &cubecl::server::Handle,
) {
    assert!(
        dims.head_dim.is_multiple_of(2),
        "RoPE: head_dim {} is odd",
        dims.head_dim
    );
    if dims.is_empty() {
        return;
    }
    let (len, half) = (dims.len(), dims.head_dim / 2);
    let table = dims.seq * half;
    let sign = if inverse { -1.0 } else { 1.0 };
    let cubes = |units: usize| CubeCount::Static(units.div_ceil(UNITS).max(1) as u32, 1, 1);
    // SAFETY: every unit's accesses are bounded by `len` (and the tables by `seq × half`).
    unsafe {
        match pairs {
            RopePairs::Interleaved => {
                // Whole vectors inside a head: even widths that divide it (2 always does).
                let vector = super::vector_of(client, dtype.size(), dims.head_dim).max(2);
                rope_interleaved_kernel::launch_unchecked::<R>(
                    client,
                    cubes(len / vector),
                    CubeDim::new_1d(UNITS as u32),
                    vector,
                    array(x, len),
                    array(cos, table),
                    array(sin, table),
                    array(out, len),
                    half,
                    dims.heads,
                    dims.seq,
                    sign,
                    vector,
                    dtype,
                )
            }
            RopePairs::HalfSplit => {
                // The f32 tables are read in vectors of the same width.
                let vector = super::vector_of(client, 4, half).min(super::vector_of(
                    client,
                    dtype.size(),
                    half,
                ));
                rope_half_kernel::launch_unchecked::<R>(
                    client,
                    cubes(len / 2 / vector),
                    CubeDim::new_1d(UNITS as u32),
                    vector,
                    array(x, len),
                    array(cos, table),
                    array(sin, table),
                    array(out, len),
                    half / vector,
                    dims.heads,
                    dims.seq,
                    sign,
                    dtype,
                )
            }
        }
    }
}
