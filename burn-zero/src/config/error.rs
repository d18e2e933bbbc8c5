//! Errors and warnings of configuration loading.

/// Why a configuration was rejected. Each names the key(s) at fault.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {reason}")]
    Io {
        /// The path.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// Not JSON, or a value of the wrong type at `key`.
    #[error("ds_config: `{key}`: {reason}")]
    Parse {
        /// Dotted path of the key (`zero_optimization.stage`), or `.` for the document.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A value outside its allowed range.
    #[error("ds_config: `{key}` = {value} is invalid: allowed {allowed}")]
    Invalid {
        /// Dotted path of the key.
        key: String,
        /// The value given.
        value: String,
        /// The allowed values or range.
        allowed: String,
    },
    /// The batch triad does not hold.
    #[error(
        "ds_config: train_batch_size ({train_batch_size}) must equal train_micro_batch_size_per_gpu \
         ({micro_batch}) x gradient_accumulation_steps ({gas}) x world size ({world_size}) = {product}"
    )]
    BatchTriad {
        /// `train_batch_size`.
        train_batch_size: String,
        /// `train_micro_batch_size_per_gpu`.
        micro_batch: String,
        /// `gradient_accumulation_steps`.
        gas: String,
        /// The world size.
        world_size: usize,
        /// What the product would be, or why it cannot be formed.
        product: String,
    },
    /// Any of the above, in the file `path`.
    #[error("{path}: {source}")]
    InFile {
        /// The config file.
        path: String,
        /// What is wrong in it.
        source: Box<ConfigError>,
    },
    /// A feature this build or version does not provide yet.
    #[error("ds_config: `{key}` is not supported yet: {reason}")]
    Unsupported {
        /// Dotted path of the key.
        key: String,
        /// What to do instead.
        reason: String,
    },
}
