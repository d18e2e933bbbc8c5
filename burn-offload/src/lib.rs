//! burn-offload: ZeRO-Offload and ZeRO-Infinity for burn-zero.
//!
//! Not built yet. It will hold CPU-Adam (SIMD, multithreaded), pinned host buffers and the
//! io_uring NVMe swapper that keep fp32 master weights and optimizer state off the GPU.
#![warn(missing_docs)]
