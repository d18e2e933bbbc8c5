//! The ZeRO-3 gather trace: which sharded parameters a step uses, in what order, so later steps
//! can gather them ahead of use (DeepSpeed's recorded prefetch trace). Pure bookkeeping, no
//! burn and no communication: the coordinator in the backend asks [`GatherTracer::on_use`]
//! what to gather and reports releases; tests drive it with plain ids.
//!
//! A step records the sequence of uses. The next step replays it: each use that matches the
//! recorded sequence at the cursor lets the tracer propose the following handles as a batch,
//! about `prefetch_bucket_size` elements in flight and at most `max_live_parameters` alive. A use
//! that does not match invalidates the trace (the proposed handles are returned for eviction)
//! and the step records anew, so a change of control flow costs prefetching, never correctness.

mod tracer;
pub use tracer::*;
