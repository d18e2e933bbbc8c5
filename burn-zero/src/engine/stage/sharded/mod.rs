//! Stage 3: parameters are partitioned too. The model holds sharded handles; the gatherer
//! installed on the rank's thread all-gathers a parameter when an op reads it (see
//! [`ShardedParams`]); gradients reduce-scatter into each parameter's chunk as backward
//! produces them; after the optimizer step the new partitions are the new handles.
//!
//! Parameters smaller than `param_persistence_threshold` stay replicated (full, local): they
//! are partitioned in the optimizer like the others and all-gathered after each step.

mod param_host;
#[cfg(feature = "cuda")]
mod param_host_cuda;
mod param_swap;
mod params;
mod strategy;

pub(crate) use strategy::Sharded;
