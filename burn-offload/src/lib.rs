//! burn-offload: ZeRO-Offload and ZeRO-Infinity for burn-zero, free of burn types.
//!
//! - [`ahead`]: CPU-Adam of each sub-group as soon as backward has finished its gradient.
//! - [`cpu_adam`]: the fused, multithreaded, vectorized optimizer step over offloaded fp32
//!   master weights and optimizer state (Adam/AdamW and SGD), which writes the compute-dtype
//!   copy of the weights in the same pass.
//! - [`grads`]: a rank's gradient partition in host memory (fp32 or bf16), written as buckets
//!   arrive.
//! - [`host`]: a rank's partition and optimizer state off the device, stepped in sub-groups.
//! - [`memory`]: large host buffers advised for transparent huge pages.
//! - [`stream`]: a step as a pipeline over sub-groups (gradient down, CPU-Adam, weights up).
//! - [`nvme`]: the swap files of ZeRO-Infinity (io_uring, O_DIRECT, checksummed regions).
#![warn(missing_docs)]

pub mod ahead;
pub mod cpu_adam;
pub mod grads;
pub mod host;
pub mod memory;
#[cfg(target_os = "linux")]
pub mod nvme;
pub mod stream;

pub use ahead::{AheadReport, AheadSink, SharedSink, StepAhead};
pub use cpu_adam::{AdamStep, CpuAdam, Decay, Grad, GradScale, Out, SgdStep, SimdLevel};
pub use grads::{GradChunk, GradDtype, HostGrads, HostGradsError};
pub use host::{AheadError, HostOptimizer, HostSettings, OutDtype, StepConstants};
pub use nvme::{NvmeStore, SwapConfig, SwapError};
pub use stream::{
    Download, GradBuf, OutSlot, OwnedBuffers, StepBuffers, StreamError, StreamTimings, Upload,
    Weights,
};

#[cfg(test)]
mod tests;
