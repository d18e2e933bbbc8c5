//! Progressive layer dropping (DeepSpeed's `progressive_layer_drop`, Zhang & He 2020): the
//! fraction of the network kept, θ(t) = (1 − θ̄)·e^(−γt) + θ̄, falls from 1 toward θ̄ as training
//! goes on, and deeper layers are dropped more: layer l of L (counted from 1) is kept with
//! probability p_l(t) = 1 − (l / L)·(1 − θ(t)). A dropped layer is skipped in forward and so in
//! backward. Free of burn types.

use serde::{Deserialize, Serialize};

/// `progressive_layer_drop`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PldConfig {
    /// `enabled`.
    pub enabled: bool,
    /// `theta` (θ̄): the fraction kept in the long run.
    pub theta: f64,
    /// `gamma` (γ): how fast θ(t) falls.
    pub gamma: f64,
}

impl Default for PldConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            theta: 0.5,
            gamma: 0.001,
        }
    }
}

/// The schedule of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProgressiveLayerDrop {
    /// θ̄.
    pub theta: f64,
    /// γ.
    pub gamma: f64,
}

impl ProgressiveLayerDrop {
    /// The schedule `config` enables, if it does.
    pub fn from_config(config: &PldConfig) -> Option<Self> {
        config.enabled.then_some(Self {
            theta: config.theta,
            gamma: config.gamma,
        })
    }

    /// θ(t) at global step `step`.
    pub fn theta_at(&self, step: u64) -> f64 {
        (1.0 - self.theta) * (-self.gamma * step as f64).exp() + self.theta
    }

    /// The probability that layer `layer` (counted from 0) of `layers` is kept at `step`.
    pub fn keep_probability(&self, layer: usize, layers: usize, step: u64) -> f64 {
        1.0 - (layer + 1) as f64 / layers as f64 * (1.0 - self.theta_at(step))
    }

    /// Which of `layers` layers run at `step`: drawn from `seed` and the step only, so every
    /// data-parallel rank drops the same layers (their gradients must reduce together).
    pub fn keep_mask(&self, layers: usize, step: u64, seed: u64) -> Vec<bool> {
        (0..layers)
            .map(|layer| {
                uniform(seed, step, layer as u64) < self.keep_probability(layer, layers, step)
            })
            .collect()
    }
}

/// A uniform draw in [0, 1) from (seed, step, layer) (SplitMix64 over the mixed triple).
fn uniform(seed: u64, step: u64, layer: u64) -> f64 {
    let mut z =
        seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ layer.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::ProgressiveLayerDrop;

    const PLD: ProgressiveLayerDrop = ProgressiveLayerDrop {
        theta: 0.5,
        gamma: 0.001,
    };

    /// θ(t) at chosen steps, written out: 1 at the start, θ̄ + (1 − θ̄)/e at t = 1/γ.
    #[test]
    fn theta_follows_the_formula() {
        assert_eq!(PLD.theta_at(0), 1.0);
        let at = |t: f64| (1.0 - 0.5) * (-0.001 * t).exp() + 0.5;
        for step in [1u64, 10, 100, 1000, 5000] {
            assert_eq!(PLD.theta_at(step), at(step as f64), "step {step}");
        }
        assert!((PLD.theta_at(1000) - (0.5 + 0.5 / std::f64::consts::E)).abs() < 1e-12);
        assert!((PLD.theta_at(1_000_000) - 0.5).abs() < 1e-12);
    }

    /// Every layer runs at step 0; later, deeper layers are kept less, the last with θ(t).
    #[test]
    fn deeper_layers_are_kept_less() {
        assert!((0..12).all(|l| PLD.keep_probability(l, 12, 0) == 1.0));
        let p: Vec<f64> = (0..12).map(|l| PLD.keep_probability(l, 12, 2000)).collect();
        assert!(p.windows(2).all(|w| w[0] > w[1]), "{p:?}");
        assert!((p[11] - PLD.theta_at(2000)).abs() < 1e-12);
        assert!(PLD.keep_mask(12, 0, 7).iter().all(|k| *k));
    }

    /// Masks depend on (seed, step) only, and layers are kept about as often as they should.
    #[test]
    fn masks_are_shared_and_follow_the_probabilities() {
        assert_eq!(PLD.keep_mask(8, 300, 1), PLD.keep_mask(8, 300, 1));
        let steps = 20_000u64;
        let late = ProgressiveLayerDrop {
            theta: 0.3,
            gamma: 1.0,
        };
        for layer in [0usize, 3, 7] {
            let kept = (10..10 + steps)
                .filter(|s| late.keep_mask(8, *s, 11)[layer])
                .count() as f64
                / steps as f64;
            let want = late.keep_probability(layer, 8, 10);
            assert!(
                (kept - want).abs() < 0.015,
                "layer {layer}: {kept} vs {want}"
            );
        }
    }
}
