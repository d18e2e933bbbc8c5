//! ZeRO-Infinity's swap: a partition's fp32 tensors (master and Adam's moments, or stage-3 parameters) live in
//! files under `nvme_path`, one per tensor, each sub-group in its own 4 KiB-aligned region.
//! An I/O thread reads and writes whole sub-groups with io_uring (O_DIRECT where the file
//! system allows it, requests of `block_size` bytes, at most `queue_depth` in flight) while the
//! caller steps another sub-group in memory: reads of the next sub-group and writes of the last
//! overlap the current step. Every region's checksum is taken when it is written and checked
//! when it is read back, so a swap file damaged on disk is named, never trained on.

mod disk;
pub use disk::AlignedBuf;

mod fault;
pub use fault::inject_full_disk;

mod store;
pub use store::*;
