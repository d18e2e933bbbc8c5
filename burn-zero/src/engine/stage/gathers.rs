//! What the ZeRO-3 gathers did: public types, compiled with or without stage 3.

/// One event of the gathers of a pass (forward + backward), in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherEvent {
    /// An op read parameter `slot`; `ready` when its full tensor was already live.
    Use {
        /// Index of the parameter in the layout.
        slot: usize,
        /// Gathered before this use (prefetched, or kept from an earlier use).
        ready: bool,
    },
    /// An all-gather of parameter `slot` was issued; `ahead` for a prefetch.
    Gather {
        /// Index of the parameter in the layout.
        slot: usize,
        /// Issued ahead of its use from the recorded trace.
        ahead: bool,
    },
}

/// What the gathers of the engine did so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatherStats {
    /// All-gathers of sharded parameters issued.
    pub gathers: usize,
    /// Of those, issued ahead of use.
    pub prefetched: usize,
    /// The most elements of full sharded parameters alive at once (in use, kept or
    /// prefetched), as the gatherer accounts them.
    pub peak_live_numel: usize,
    /// Times a change of order made the trace be recorded again.
    pub invalidations: usize,
    /// Partitions copied out of the host buffer (`offload_param {"device": "cpu"}`) before it
    /// was rewritten, because something still held them (a model kept from an earlier step);
    /// none in a plain training loop.
    pub copied_out: usize,
    /// The events of the last complete pass.
    pub last_pass: Vec<GatherEvent>,
}
