//! What one engine chose for the ops its model runs through `ZeroBackend` (matmuls, attention).
//!
//! Ops read the settings of the thread that dispatches them: `initialize` installs its
//! config's on the engine's thread (the thread that runs its forward and backward) for as long
//! as the engine lives, so two engines in one process keep their own. A thread without an
//! engine gets the defaults, or what [`set`] put there (benchmarks, checks).

use std::cell::RefCell;
use std::sync::Arc;

use cubecl_kernels::sparse::SparseLayout;

use super::matmul::MatmulPolicy;
use crate::config::{FusedKernelsConfig, ResolvedConfig, SparseAttentionConfig};

/// The op settings of one engine.
#[derive(Clone, Debug, PartialEq)]
pub struct OpSettings {
    /// How matmuls run (`burn_zero.matmul`).
    pub matmul: MatmulPolicy,
    /// When the flash-attention kernels run: always, never, or where measured faster (`None`;
    /// `burn_zero.flash_attention`).
    pub flash_attention: Option<bool>,
    /// Whether the tensor-core attention kernels may run where they apply
    /// (`burn_zero.attention_tensor_cores`).
    pub attention_tensor_cores: bool,
    /// Whether the tensor-core kernels keep the scores in registers where they apply
    /// (`burn_zero.attention_register_scores`).
    pub attention_register_scores: bool,
    /// The `sparse_attention` section: flash attention is block-sparse with its layouts.
    pub sparse_attention: Option<SparseAttentionConfig>,
    /// Which fused ops of `burn_zero::nn` run their kernels (`burn_zero.fused_kernels`).
    pub fused_kernels: FusedKernelsConfig,
    /// Whole-tensor sums in an order fixed from run to run (`burn_zero.deterministic`).
    pub deterministic: bool,
}

impl Default for OpSettings {
    fn default() -> Self {
        Self {
            matmul: MatmulPolicy::default(),
            flash_attention: None,
            attention_tensor_cores: true,
            attention_register_scores: true,
            sparse_attention: None,
            fused_kernels: FusedKernelsConfig::default(),
            deterministic: false,
        }
    }
}

impl OpSettings {
    /// The settings a resolved config asks for.
    pub fn of(resolved: &ResolvedConfig) -> Self {
        let c = &resolved.config;
        let m = &c.burn_zero.matmul;
        Self {
            matmul: MatmulPolicy {
                cublaslt: m.cublaslt,
                allow_tf32: m.allow_tf32,
                min_macs: m.min_macs,
                order: m.order,
                sm_margin: m.sm_margin,
                // A tuned algorithm is the one timed fastest in this process: another process
                // may pick another, with other rounding.
                tune: m.tune && !c.burn_zero.deterministic,
                profile: m.profile,
            },
            flash_attention: c.burn_zero.flash_attention,
            attention_tensor_cores: c.burn_zero.attention_tensor_cores,
            attention_register_scores: c.burn_zero.attention_register_scores,
            sparse_attention: c.sparse_attention.clone(),
            fused_kernels: c.burn_zero.fused_kernels,
            deterministic: c.burn_zero.deterministic,
        }
    }
}

/// A thread's settings and what they derived.
#[derive(Default)]
struct State {
    settings: OpSettings,
    /// The sparse layout of the last (heads, seq), made once per shape.
    layout: Option<(usize, usize, Arc<SparseLayout>)>,
    /// Whether the "sparse attention does not apply" warning was given.
    warned: bool,
}

thread_local! {
    static CURRENT: RefCell<State> = RefCell::new(State::default());
}

/// Sets this thread's op settings until the next [`set`] (or the returned guard's drop, which
/// puts back the previous ones).
pub fn set(settings: OpSettings) -> SettingsGuard {
    let previous = CURRENT.with(|c| {
        let mut state = c.borrow_mut();
        let previous = std::mem::take(&mut state.settings);
        *state = State {
            settings,
            ..State::default()
        };
        previous
    });
    SettingsGuard {
        previous: Some(previous),
    }
}

/// Changes this thread's op settings in place, for good.
pub(crate) fn update(f: impl FnOnce(&mut OpSettings)) {
    CURRENT.with(|c| {
        let mut state = c.borrow_mut();
        f(&mut state.settings);
        state.layout = None;
        state.warned = false;
    });
}

/// `f` with this thread's matmul policy replaced by `policy`, put back after (what was derived
/// from the other settings, such as the sparse layout, stays: [`set`] would rebuild it).
pub(crate) fn with_matmul<R>(policy: MatmulPolicy, f: impl FnOnce() -> R) -> R {
    struct Restore(MatmulPolicy);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = CURRENT.try_with(|c| c.borrow_mut().settings.matmul = self.0);
        }
    }
    let previous = CURRENT.with(|c| std::mem::replace(&mut c.borrow_mut().settings.matmul, policy));
    let _restore = Restore(previous);
    f()
}

/// This thread's op settings.
pub fn current() -> OpSettings {
    CURRENT.with(|c| c.borrow().settings.clone())
}

/// Reads this thread's op settings.
pub(crate) fn with<R>(f: impl FnOnce(&OpSettings) -> R) -> R {
    CURRENT.with(|c| f(&c.borrow().settings))
}

/// The configured sparse layout for `heads` heads over `seq` tokens (made once per shape);
/// `None` when attention is dense.
///
/// # Panics
/// When the configuration does not fit the shape (a sequence not a multiple of the block,
/// say), naming the setting.
pub(crate) fn sparse_layout(heads: usize, seq: usize) -> Option<Arc<SparseLayout>> {
    CURRENT.with(|c| {
        let mut state = c.borrow_mut();
        let config = state.settings.sparse_attention.as_ref()?;
        if let Some((h, s, layout)) = &state.layout
            && (*h, *s) == (heads, seq)
        {
            return Some(layout.clone());
        }
        let layout = config
            .sparsity(heads)
            .and_then(|c| SparseLayout::new(&c, seq))
            .map(Arc::new)
            .unwrap_or_else(|e| panic!("sparse_attention: {e}"));
        state.layout = Some((heads, seq, layout.clone()));
        Some(layout)
    })
}

/// Whether sparse attention is configured and its "not applied" warning not yet given (it is
/// given at most once per setting).
pub(crate) fn take_sparse_warning() -> bool {
    CURRENT.with(|c| {
        let mut state = c.borrow_mut();
        let due = state.settings.sparse_attention.is_some() && !state.warned;
        state.warned |= due;
        due
    })
}

/// Puts the previous settings back when dropped.
#[must_use = "the settings are undone when the guard drops"]
pub struct SettingsGuard {
    previous: Option<OpSettings>,
}

impl SettingsGuard {
    /// Keeps the settings after the guard is gone.
    pub fn keep(mut self) {
        self.previous = None;
    }
}

impl Drop for SettingsGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            // A thread being torn down has no settings left to restore.
            let _ = CURRENT.try_with(|c| {
                *c.borrow_mut() = State {
                    settings: previous,
                    ..State::default()
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeepSpeedConfig;

    fn settings(burn_zero: &str) -> OpSettings {
        let json = format!(
            r#"{{"train_batch_size": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
                "burn_zero": {burn_zero}}}"#
        );
        let resolved = DeepSpeedConfig::from_json(&json)
            .unwrap()
            .config
            .resolve(1)
            .unwrap();
        OpSettings::of(&resolved)
    }

    /// Deterministic runs take cuBLASLt's untimed first algorithm even where tuning is asked
    /// for, and sum in a fixed order; the default tunes and takes burn's sum.
    #[test]
    fn deterministic_turns_tuning_off() {
        let det = settings(r#"{"deterministic": true, "matmul": {"tune": true}}"#);
        assert!(det.deterministic && !det.matmul.tune);
        let default = settings("{}");
        assert!(!default.deterministic && default.matmul.tune);
        let untuned = settings(r#"{"matmul": {"tune": false}}"#);
        assert!(!untuned.deterministic && !untuned.matmul.tune);
    }
}
