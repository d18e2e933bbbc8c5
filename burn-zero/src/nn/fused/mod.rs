//! Fused transformer ops any burn model can call ([`rms_norm`], [`add_rms_norm`], [`rope`],
//! [`swiglu`]): the CubeCL kernels of `cubecl_kernels::fused` on `ZeroBackend<Cuda>`, one
//! launch each way with a custom backward under `Autodiff`; the same math in burn ops on every
//! other backend.

#[cfg(feature = "cuda")]
mod cuda;
mod dispatch;
mod rms_norm;
mod rope;
mod swiglu;

#[cfg(feature = "cuda")]
pub(super) use cuda::{cross_entropy_rows, matmul_add, scale_gradient};
pub use rms_norm::{add_rms_norm, rms_norm};
pub use rope::{RopePairs, RopeTable, rope};
pub use swiglu::swiglu;

use crate::backend::settings;
use crate::config::FusedKernelsConfig;

/// Whether this thread's engine runs the kernels of the op `pick` selects.
fn enabled(pick: impl FnOnce(&FusedKernelsConfig) -> bool) -> bool {
    settings::with(|s| pick(&s.fused_kernels))
}

#[cfg(all(test, feature = "ndarray"))]
mod tests;
