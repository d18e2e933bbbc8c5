//! The `ZeroBackend` decorator: burn's `Backend` over any inner backend, with a float handle
//! that ZeRO can shard and a gradient hook that ZeRO can reduce from.

mod base;
pub(crate) mod convert;
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod distributed;
#[cfg(feature = "cuda")]
pub(crate) mod flag_kernels;
pub(crate) mod forward;
#[cfg(feature = "cuda")]
pub(crate) mod fused_op;
pub mod hooks;
pub mod matmul;
#[cfg(feature = "cuda")]
pub(crate) mod matmul_cuda;
pub mod memory_pool;
mod ops_list;
pub(crate) mod reduce;
pub mod settings;
#[cfg(feature = "zero3")]
pub mod sharded;
#[cfg(feature = "cuda")]
pub(crate) mod stream_event;
#[cfg(feature = "cuda")]
pub(crate) mod stream_order;
mod tensor;
pub(crate) mod view;

pub use base::ZeroBackend;
#[cfg(feature = "cuda")]
pub use memory_pool::{configure_memory_pool, memory_pool_of};
#[cfg(feature = "zero3")]
pub use sharded::{GathererGuard, ParamGatherer, PartitionSource, ShardedParam, install_gatherer};
pub use tensor::ZeroTensor;
