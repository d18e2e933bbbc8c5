//! What the fine-tuning recipe trains: a Llama-architecture decoder in burn 0.21 ([`model`]),
//! its weights from GGUF ([`gguf`], dequantized) or a Hugging Face directory ([`hf`]), its
//! tokenizer ([`tokenizer`]), and text as packed, distributed training data ([`data`]);
//! [`parallel`] slices the model over a model-parallel group; [`pipeline`] splits it into
//! pipeline stages; [`parallel_stage`] does both (pipe × data × model).
//!
//! The readers, the data pipeline and the sampler are free of burn types; only [`model`] and
//! [`weights`] touch burn.
#![warn(missing_docs)]

pub mod data;
pub mod export;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod lora;
pub mod model;
pub mod parallel;
pub mod parallel_stage;
pub mod pipeline;
pub mod shared_init;
pub mod tokenizer;
pub mod weights;

pub use model::{Llama, LlamaConfig};
