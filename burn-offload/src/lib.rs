//! burn-offload: ZeRO-Offload and ZeRO-Infinity for burn-zero, free of burn types.
//!
//! - [`cpu_adam`]: the fused, multithreaded, vectorized optimizer step over offloaded fp32
//!   master weights and optimizer state (Adam/AdamW and SGD), which writes the compute-dtype
//!   copy of the weights in the same pass.
//! - [`host`]: a rank's partition and optimizer state off the device, stepped in sub-groups.
//! - [`nvme`]: the swap files of ZeRO-Infinity (io_uring, O_DIRECT, checksummed regions).
#![warn(missing_docs)]

pub mod cpu_adam;
pub mod host;
#[cfg(target_os = "linux")]
pub mod nvme;

pub use cpu_adam::{AdamStep, CpuAdam, Decay, Grad, Out, SgdStep, SimdLevel};
pub use host::{HostOptimizer, HostSettings, OutDtype, Staged, StepConstants};
pub use nvme::{SwapConfig, SwapError};

#[cfg(test)]
mod tests;
