//! Layers any burn model can call, with memory-saving forms on `ZeroBackend`.

mod cross_entropy;

pub use cross_entropy::{VocabAxis, linear_cross_entropy, materialized_cross_entropy};
