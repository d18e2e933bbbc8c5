//! burn-offload: ZeRO-Offload and ZeRO-Infinity for burn-zero, free of burn types.
//!
//! [`cpu_adam`]: the fused, multithreaded, vectorized optimizer step over offloaded fp32
//! master weights and optimizer state (Adam/AdamW and SGD), which writes the compute-dtype
//! copy of the weights in the same pass. Pinned buffers and the io_uring NVMe swapper come next.
#![warn(missing_docs)]

pub mod cpu_adam;
pub mod host;

pub use cpu_adam::{AdamStep, CpuAdam, Decay, Grad, Out, SgdStep, SimdLevel};
pub use host::{HostOptimizer, HostSettings, StepConstants};

#[cfg(test)]
mod tests;
