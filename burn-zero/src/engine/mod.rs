//! The training engine: `burn_zero::initialize(model, config, comm)`, DeepSpeed style.
//!
//! - `engine`: the [`Engine`] and its fixed loop (backward → precision → reduce → optimizer →
//!   publish); `init`: [`initialize`], which picks the stage's strategy once.
//! - `stage`: one strategy per ZeRO stage (gradient intake, norm, publish, checkpoint layout,
//!   memory accounting); `grads`: what every stage's intake shares, and the gradient hook.
//! - `optim_state`, `offload_io`, `offload_cuda`: this rank's master partition and optimizer
//!   state, on the device or offloaded; `host_grads*`: gradients streamed to host memory;
//!   `step_ahead`: offloaded sub-groups stepped during backward.
//! - `collective`, `flat_pieces`, `grad_buffer`: flat buffers and their collectives;
//!   `grad_cuda`: a gradient's first write into the buffer as one kernel on CUDA.
//! - `checkpoint`, `export`, `load_module`: state in and out; `construct`: models built
//!   sharded; `norm`, `norm_cuda`: the gradient's sum of squares; `memory`, `profile`,
//!   `precision`, `params`, `device_failure`: the rest.

mod checkpoint;
pub(crate) mod collective;
mod construct;
mod device_failure;
#[allow(clippy::module_inception)]
mod engine;
mod export;
mod flat_pieces;
mod grad_buffer;
#[cfg(feature = "cuda")]
mod grad_cuda;
mod grads;
mod graphs;
mod host_grads;
#[cfg(feature = "cuda")]
mod host_grads_cuda;
mod init;
mod load_module;
mod memory;
mod norm;
#[cfg(feature = "cuda")]
mod norm_cuda;
#[cfg(feature = "cuda")]
mod offload_cuda;
mod offload_io;
mod optim_state;
mod params;
mod precision;
mod profile;
mod stage;
mod step_ahead;

pub use burn_offload::nvme::inject_full_disk;
pub use checkpoint::{LoadedCheckpoint, inject_save_failure};
pub use construct::{ParamValues, construct_full, construct_full_from};
#[cfg(feature = "zero3")]
pub use construct::{construct_sharded, construct_sharded_from};
pub use engine::{Engine, EngineError, Timings, ZeroAutodiff};
pub(crate) use engine::{PARTITION_ALIGN, zero_padded};
pub use init::initialize;
pub use load_module::load_params;
pub use memory::{Estimate, MemoryReport, estimate_model_states, format_estimates};
pub use optim_state::OffloadTimings;
pub use params::{FlatLayout, ParamSlot, flatten_params, unflatten_params};
pub use stage::{GatherEvent, GatherStats};
