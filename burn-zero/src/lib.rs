//! burn-zero: DeepSpeed-style ZeRO training for [burn](https://burn.dev) 0.21.
//!
//! Users keep their burn model and write `type B = Autodiff<ZeroBackend<Cuda>>` (or
//! `NdArray` on CPU). Layers, innermost first: [`comm`] (communicators, no burn types),
//! [`partition`] (flat-buffer plans, no burn types), [`backend`] (the `ZeroBackend`
//! decorator and its gradient hook), and [`testing`] (thread-rank harness).
#![warn(missing_docs)]
// A build without every stage (`--no-default-features` with `zero1` or `zero2`) compiles the
// lower stages only: helpers of the buffers and collectives the higher ones share go unused.
#![cfg_attr(
    not(feature = "zero3"),
    allow(dead_code, unused_imports, unused_variables)
)]

pub mod attention;
pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod comm;
pub mod config;
pub mod dist;
pub mod engine;
pub mod graph;
#[cfg(feature = "cuda")]
pub mod kernel_cache;
#[cfg(unix)]
pub mod launch;
mod log;
pub mod nn;
pub mod optim;
pub mod p2p;
pub mod partition;
pub mod precision;
pub mod profile;
pub mod progress;
#[cfg(unix)]
pub mod report;
pub mod schedule;
pub mod testing;
pub mod trace;

pub use backend::{ZeroBackend, ZeroTensor};
pub use comm::{Communicator, LocalComm, LocalGroup};
pub use config::DeepSpeedConfig;
pub use engine::{Engine, EngineError, initialize};
