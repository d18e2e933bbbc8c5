//! The thread's recording: phases, counted MACs and elements, module scopes.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Which pass the ops belong to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The forward pass (module scopes apply).
    Forward,
    /// Backward (attributed to the model as a whole).
    Backward,
}

/// Counts of one module path in one phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counts {
    /// Multiply-accumulates of matrix products.
    pub macs: u64,
    /// All floating-point operations (2 per MAC plus element-wise ones).
    pub flops: u64,
    /// Time inside the scope (forward, timed scopes only).
    pub latency: Duration,
    /// Times the scope was entered.
    pub calls: u64,
}

struct Recording {
    phase: Phase,
    /// The open scopes, outermost first.
    path: Vec<String>,
    /// Per phase and module path (joined by `.`; "" is the model).
    counts: BTreeMap<(Phase, String), Counts>,
    /// Makes the device finish queued work before a scope reads the clock.
    sync: Option<Box<dyn Fn()>>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Whether this thread is recording (one thread-local read: cheap enough for every op).
pub fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// Starts recording the forward pass on this thread; `sync` (if any) is called before each
/// scope's clock reads, so latencies cover the device's work.
pub fn start(sync: Option<Box<dyn Fn()>>) {
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            phase: Phase::Forward,
            path: Vec::new(),
            counts: BTreeMap::new(),
            sync,
        })
    });
}

/// Switches the recording to `phase`.
pub fn set_phase(phase: Phase) {
    RECORDING.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            rec.phase = phase;
        }
    });
}

/// Stops recording and returns the counts per (phase, module path).
pub fn stop() -> BTreeMap<(Phase, String), Counts> {
    RECORDING.with(|r| {
        r.borrow_mut()
            .take()
            .map(|rec| rec.counts)
            .unwrap_or_default()
    })
}

fn add(macs: u64, flops: u64) {
    RECORDING.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            let path = match rec.phase {
                Phase::Forward => rec.path.join("."),
                Phase::Backward => String::new(),
            };
            let c = rec.counts.entry((rec.phase, path)).or_default();
            c.macs += macs;
            c.flops += flops;
        }
    });
}

/// A matrix product of `macs` multiply-accumulates.
pub fn record_macs(macs: u64) {
    if recording() {
        add(macs, 2 * macs);
    }
}

/// Whether an op of burn's op traits, by name, counts one FLOP per output element
/// (element-wise arithmetic and activations; views, copies, casts, comparisons and reductions
/// do not count).
pub fn counted(name: &str) -> bool {
    const COUNTED: &[&str] = &[
        "float_add",
        "float_add_scalar",
        "float_sub",
        "float_sub_scalar",
        "float_mul",
        "float_mul_scalar",
        "float_div",
        "float_div_scalar",
        "float_remainder",
        "float_remainder_scalar",
        "float_recip",
        "float_exp",
        "float_log",
        "float_log1p",
        "float_powf",
        "float_powf_scalar",
        "float_powi",
        "float_powi_scalar",
        "float_sqrt",
        "float_abs",
        "float_cos",
        "float_sin",
        "float_tanh",
        "float_erf",
        "float_clamp",
        "float_clamp_min",
        "float_clamp_max",
        "relu",
        "leaky_relu",
        "gelu",
        "prelu",
        "sigmoid",
        "hard_sigmoid",
        "log_sigmoid",
        "softmax",
        "log_softmax",
        "softmin",
        "relu_backward",
        "gelu_backward",
        "sigmoid_backward",
        "log_sigmoid_backward",
    ];
    COUNTED.contains(&name)
}

/// A counted op (see [`counted`]) with `elements` output elements.
pub fn record_elements(elements: u64) {
    if recording() {
        add(0, elements);
    }
}

/// Runs `f` inside the module path segment `name` (e.g. `blocks.3` or `attn`): ops and time
/// in it count for that module and its parents. Costs a thread-local read when not recording.
pub fn scope<R>(name: &str, f: impl FnOnce() -> R) -> R {
    let entered = RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        let rec = r.as_mut().filter(|rec| rec.phase == Phase::Forward)?;
        if let Some(sync) = &rec.sync {
            sync();
        }
        rec.path.push(name.to_string());
        Some(Instant::now())
    });
    let out = f();
    if let Some(start) = entered {
        RECORDING.with(|r| {
            let mut r = r.borrow_mut();
            if let Some(rec) = r.as_mut() {
                if let Some(sync) = &rec.sync {
                    sync();
                }
                let path = rec.path.join(".");
                rec.path.pop();
                let c = rec.counts.entry((Phase::Forward, path)).or_default();
                c.latency += start.elapsed();
                c.calls += 1;
            }
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_in_the_open_scope_and_backward_in_the_model() {
        assert!(!recording());
        record_macs(5); // not recording: dropped
        start(None);
        record_macs(10);
        scope("blocks", || {
            scope("0", || {
                record_macs(3);
                record_elements(7);
            });
            record_elements(1);
        });
        set_phase(Phase::Backward);
        scope("blocks", || record_macs(100));
        let counts = stop();
        assert!(!recording());
        let get = |phase, path: &str| {
            counts
                .get(&(phase, path.to_string()))
                .copied()
                .unwrap_or_default()
        };
        assert_eq!(
            (get(Phase::Forward, "").macs, get(Phase::Forward, "").flops),
            (10, 20)
        );
        let leaf = get(Phase::Forward, "blocks.0");
        assert_eq!((leaf.macs, leaf.flops, leaf.calls), (3, 13, 1));
        let parent = get(Phase::Forward, "blocks");
        assert_eq!((parent.macs, parent.flops, parent.calls), (0, 1, 1));
        assert!(parent.latency >= leaf.latency);
        assert_eq!(get(Phase::Backward, "").macs, 100);
        assert!(counted("float_add") && counted("softmax"));
        assert!(!counted("float_sum_dim") && !counted("float_reshape"));
    }
}
