//! burn-pipeline: pipeline and 3D parallelism for burn-zero.
//!
//! Not built yet. It will hold the (pipe, data, model) process topology, pipeline schedules
//! as pure instruction streams (GPipe, 1F1B) with their executor, and tensor-parallel layers.
#![warn(missing_docs)]
