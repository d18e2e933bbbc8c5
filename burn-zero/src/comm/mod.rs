//! Communicators: collectives and point-to-point messages on flat buffers, free of burn types.
//!
//! [`LocalComm`] runs N ranks as threads of one process (CPU tests); NCCL over `cudarc`
//! implements the same [`Communicator`] trait for one process per GPU.

mod base;
mod exchange;
mod local;
mod padded;
mod reduce;
mod tcp;

pub use base::*;
pub use local::{LocalComm, LocalGroup};
pub use padded::PaddedCollectives;
pub use tcp::TcpComm;

#[cfg(test)]
mod tests;
