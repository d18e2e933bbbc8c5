//! Splitting a model given as a sequence of layers into pipeline stages (DeepSpeed's
//! `partition_method`): `uniform` gives every stage the same number of layers (±1),
//! `parameters` balances the stages' parameter counts, making the heaviest stage as light as
//! any contiguous split can. Free of burn types: the caller passes each layer's weight.

use core::ops::Range;

/// How layers are assigned to stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitMethod {
    /// The same number of layers per stage (the first stages take one more when it does not
    /// divide).
    Uniform,
    /// Contiguous stages whose largest total weight is the smallest possible.
    Balanced,
}

/// The layer ranges of `stages` stages over layers of weights `weights`.
///
/// # Panics
/// If there are fewer layers than stages (a stage would be empty) or no stages.
pub fn split(weights: &[usize], stages: usize, method: SplitMethod) -> Vec<Range<usize>> {
    let n = weights.len();
    assert!(
        stages > 0 && n >= stages,
        "{n} layers cannot fill {stages} stages (each stage needs at least one layer)"
    );
    match method {
        SplitMethod::Uniform => {
            let (per, extra) = (n / stages, n % stages);
            let mut start = 0;
            (0..stages)
                .map(|s| {
                    let len = per + usize::from(s < extra);
                    start += len;
                    start - len..start
                })
                .collect()
        }
        SplitMethod::Balanced => {
            // The smallest bound whose greedy packing needs at most `stages` stages.
            let (mut lo, mut hi) = (
                weights.iter().copied().max().unwrap_or(0),
                weights.iter().sum::<usize>(),
            );
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if pack(weights, mid).len() <= stages {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            let mut ranges = pack(weights, lo);
            // Fewer stages than asked: split the longest ranges (loads only drop).
            while ranges.len() < stages {
                let (i, _) = ranges
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.len() > 1)
                    .max_by_key(|(_, r)| r.len())
                    .expect("more layers than stages");
                let r = ranges.remove(i);
                let mid = r.start + r.len() / 2;
                ranges.insert(i, mid..r.end);
                ranges.insert(i, r.start..mid);
            }
            ranges
        }
    }
}

/// Greedy contiguous packing under `bound`: each stage takes layers while it stays within.
fn pack(weights: &[usize], bound: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut load) = (0, 0);
    for (i, w) in weights.iter().enumerate() {
        if load + w > bound && i > start {
            ranges.push(start..i);
            (start, load) = (i, 0);
        }
        load += w;
    }
    if start < weights.len() {
        ranges.push(start..weights.len());
    }
    ranges
}

/// The heaviest stage's weight.
pub fn max_load(weights: &[usize], ranges: &[Range<usize>]) -> usize {
    ranges
        .iter()
        .map(|r| weights[r.clone()].iter().sum())
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_splits_written_out() {
        assert_eq!(
            split(&[1; 8], 4, SplitMethod::Uniform),
            vec![0..2, 2..4, 4..6, 6..8]
        );
        assert_eq!(
            split(&[1; 7], 3, SplitMethod::Uniform),
            vec![0..3, 3..5, 5..7]
        );
        assert_eq!(
            split(&[5; 3], 3, SplitMethod::Uniform),
            vec![0..1, 1..2, 2..3]
        );
    }

    #[test]
    fn balanced_splits_written_out() {
        // An embedding-heavy first layer: it gets a stage of its own.
        let w = [100, 10, 10, 10, 10, 10, 10, 10, 10, 100];
        assert_eq!(split(&w, 3, SplitMethod::Balanced), vec![0..1, 1..9, 9..10]);
        assert_eq!(
            split(&[3, 1, 1, 1, 1, 3], 2, SplitMethod::Balanced),
            vec![0..3, 3..6]
        );
        // All equal: as uniform.
        assert_eq!(
            split(&[2; 6], 3, SplitMethod::Balanced),
            vec![0..2, 2..4, 4..6]
        );
    }

    /// The smallest heaviest stage over every contiguous split, by brute force.
    fn best(weights: &[usize], stages: usize) -> usize {
        fn go(w: &[usize], stages: usize) -> usize {
            if stages == 1 {
                return w.iter().sum();
            }
            (1..=w.len() - (stages - 1))
                .map(|cut| {
                    w[..cut]
                        .iter()
                        .sum::<usize>()
                        .max(go(&w[cut..], stages - 1))
                })
                .min()
                .unwrap()
        }
        go(weights, stages)
    }

    #[test]
    fn balanced_splits_are_optimal_contiguous_and_complete() {
        let mut seed = 7u64;
        for n in 1..=9 {
            for stages in 1..=n.min(5) {
                for _ in 0..20 {
                    let w: Vec<usize> = (0..n)
                        .map(|_| {
                            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                            1 + (seed >> 33) as usize % 50
                        })
                        .collect();
                    for method in [SplitMethod::Uniform, SplitMethod::Balanced] {
                        let r = split(&w, stages, method);
                        assert_eq!(r.len(), stages, "{w:?} / {stages}");
                        assert_eq!(r[0].start, 0);
                        assert_eq!(r[stages - 1].end, n);
                        assert!(r.windows(2).all(|p| p[0].end == p[1].start));
                        assert!(r.iter().all(|x| !x.is_empty()), "{w:?}: {r:?}");
                    }
                    let r = split(&w, stages, SplitMethod::Balanced);
                    assert_eq!(
                        max_load(&w, &r),
                        best(&w, stages),
                        "{w:?} / {stages}: {r:?}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "3 layers cannot fill 4 stages")]
    fn too_few_layers_are_refused() {
        split(&[1, 2, 3], 4, SplitMethod::Balanced);
    }
}
