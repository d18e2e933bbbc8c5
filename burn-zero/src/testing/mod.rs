//! A harness that runs one closure on N thread ranks, each with its own [`LocalComm`].
//!
//! A panic on any rank aborts the group (so no other rank waits out its timeout) and is
//! re-raised on the caller's thread naming the rank that failed first.

mod ranks;
pub use ranks::*;
