//! The FLOPs profiler (DeepSpeed's `flops_profiler`): while a profile is recording on a
//! thread, `ZeroBackend` reports every counted op here, attributed to the module path open at
//! the time (models open paths with [`scope`]), and scopes time themselves. Free of burn types:
//! the backend and the engine feed it numbers, [`report`] turns them into DeepSpeed's tables.
//!
//! What is counted:
//! - a matrix product of `batch × m × k` by `k × n` (`matmul`, `Linear`'s products): `batch·m·n·k`
//!   MACs, 2 FLOPs each;
//! - an element-wise op (arithmetic, `exp`/`log`/`sqrt`/…, activations, softmax): 1 FLOP per
//!   output element ([`counted`]);
//! - anything else (views, copies, casts, gathers, comparisons, reductions): nothing. Ops the
//!   inner backend runs inside one of its own (a bias added inside `linear`) are counted by
//!   the op that contains them.

mod report;

pub use report::{ModuleStats, Profile, format_report};

mod counters;
pub use counters::*;
