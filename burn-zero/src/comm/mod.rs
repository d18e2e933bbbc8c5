//! Communicators: collectives and point-to-point messages on flat buffers, free of burn types.
//!
//! [`LocalComm`] runs N ranks as threads of one process (CPU tests); NCCL over `cudarc`
//! implements the same [`Communicator`] trait for one process per GPU.

mod base;
mod exchange;
mod flight;
mod flight_report;
mod local;
#[cfg(feature = "nccl")]
mod nccl;
mod padded;
mod reduce;
mod sub;
mod tcp;
mod watchdog;

pub use base::*;
pub use flight::{FLIGHT_RECORD_LEN, FlightEntry, FlightRecord, FlightRecorder};
pub use flight_report::{FLIGHT_LINE, FlightReport, verdict};
pub use local::{LocalComm, LocalGroup};
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, nccl_unique_id, nccl_version};
pub use padded::PaddedCollectives;
pub use sub::SubComm;
pub use tcp::TcpComm;
pub use watchdog::{Expired, Handler, Probe, Watchdog};

#[cfg(test)]
mod tests;
