//! CPU-Adam: one fused pass over a partition's fp32 master weights, gradient (f32, bf16 or
//! f16), Adam moments, and the compute-dtype copy of the weights it writes back, split across
//! threads. The loop is plain scalar Rust compiled three times (AVX-512, AVX2, portable) and
//! picked at run time: Rust never contracts `a * b + c` into an FMA, and division and square
//! root are exact in SIMD, so every path gives the same bits as the scalar order of operations,
//! which is the engine's device optimizer's order (so offloading changes no result).

mod kernel;
pub use kernel::bf16_bits;
pub(crate) use kernel::{GradElem, OutElem};

mod adam;
pub use adam::*;
