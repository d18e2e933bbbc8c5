//! Values of any float dtype written into an f32 buffer, converted on the way: how a bf16 or
//! f16 gradient enters the engine's f32 gradient buffer in one pass (a cast into a new tensor
//! and a copy into the buffer read and write it twice).

use cubecl::prelude::*;

/// Units per cube.
const UNITS: usize = 256;

// The launch items the `cube` macro generates carry no docs of their own.
#[allow(missing_docs)]
mod kernel {
    use cubecl::prelude::*;

    /// `dst[i] = f32(src[i])`, one vector per unit.
    #[cube(launch_unchecked)]
    pub fn cast_into_kernel<F: Float, N: Size>(
        src: &Array<Vector<F, N>>,
        dst: &mut Array<Vector<f32, N>>,
        #[define(F)] _dtype: StorageType,
    ) {
        if ABSOLUTE_POS >= src.len() {
            terminate!();
        }
        dst[ABSOLUTE_POS] = Vector::<f32, N>::cast_from(src[ABSOLUTE_POS]);
    }
}
pub use kernel::cast_into_kernel;

/// Writes `len` values of `dtype` (a float type) from `src` into the f32 buffer `dst`,
/// converted: `dst` and `src` each hold at least `len` elements from their handles' starts.
/// Vectors of four where both starts are 16 bytes aligned and `len` divides by four.
pub fn cast_into<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    len: usize,
    src: &cubecl::server::Handle,
    dst: &cubecl::server::Handle,
) {
    if len == 0 {
        return;
    }
    let vector = crate::vector_of_four(len, &[src, dst]);
    let cubes = (len / vector).div_ceil(UNITS) as u32;
    // SAFETY: both handles hold `len` elements (of `dtype` and f32); the kernel checks its
    // bound against `src`'s length.
    unsafe {
        cast_into_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            vector,
            ArrayArg::from_raw_parts(src.clone(), len),
            ArrayArg::from_raw_parts(dst.clone(), len),
            dtype,
        )
    }
}
