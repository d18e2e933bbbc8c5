//! Shared code of burn-zero's integration tests: the cases run on both sides of a parity
//! test, and the loader of the independent plain-burn reference.
#![warn(missing_docs)]

pub mod cases;
pub mod engine_loop;
pub mod llama_3d;
pub mod processes;
pub mod reference;
