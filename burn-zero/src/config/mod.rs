//! `ds_config.json`: DeepSpeed's keys, aliases and defaults (0.19), validated with errors that
//! name the key and its allowed range, unknown keys warned about by name. Free of burn types.
//!
//! `"auto"` is handled as DeepSpeed does: the key is dropped, so its default applies (for the
//! batch triad: it counts as not given and is derived from the others).

mod base;
mod batch;
mod describe;
mod error;
mod load;
mod overrides;
mod sparse;
mod stage;
mod summary;
mod validate;
mod values;
mod zero;

pub use base::*;
pub use batch::BatchSizes;
pub use describe::describe_config;
pub use error::ConfigError;
pub(crate) use load::parse_value;
pub use overrides::env_overrides;
pub use sparse::SparseAttentionConfig;
pub use stage::ZeroStage;
pub use validate::compiled_stages;
pub use values::Count;
pub use zero::*;

mod resolved;
pub use resolved::*;

#[cfg(test)]
mod tests;
