//! cubecl-kernels: CubeCL kernels for burn-zero.
//!
//! Not built yet. It will hold fused multi-tensor Adam/AdamW/LAMB and flash attention with
//! its own backward (no S×S tensor), as custom autodiff ops for burn 0.21.
#![warn(missing_docs)]
