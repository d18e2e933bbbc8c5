//! Starting weights two programs compute alike: each element a hash of (seed, parameter
//! position in module order, flat index), so `bench-e2e` and its PyTorch peers
//! (`bench/e2e_fsdp2.py`, `bench/e2e_deepspeed.py`) train the same model from step 0 and
//! their per-step losses can be compared. Vectors (the norms' scales) are ones; matrices are
//! uniform in ±[`MATRIX_BOUND`] (standard deviation 0.02). The hash uses only 32-bit products
//! that fit in a signed 64-bit integer, so torch computes it exactly on int64 tensors.

use burn_zero::engine::ParamValues;

/// Half-width of the matrices' uniform values: 0.02·√3, a standard deviation of 0.02.
pub const MATRIX_BOUND: f64 = 0.034_641_016_151_377_54;

/// The shared starting weights of `seed`.
#[derive(Clone, Copy, Debug)]
pub struct SharedInit {
    /// Changes every value.
    pub seed: u32,
}

/// The 32-bit hash of element `index` of the parameter at `position` (low 32 bits kept at
/// each step; mirrored by `shared_hash` in the Python peers).
pub fn shared_hash(seed: u32, position: u64, index: u64) -> u32 {
    const M: u64 = 0xFFFF_FFFF;
    let mut x = (index
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add(position.wrapping_mul(0x85EB_CA77))
        .wrapping_add(u64::from(seed)))
        & M;
    x ^= x >> 16;
    x = (x * 0x7FEB_352D) & M;
    x ^= x >> 15;
    x = (x * 0x2C1B_3C6D) & M;
    x ^= x >> 16;
    x as u32
}

/// The value a hash stands for: uniform in [-bound, bound) in f32, computed as torch does in
/// float32 (every step but the last exact).
pub fn uniform(hash: u32, bound: f32) -> f32 {
    ((hash >> 8) as f32 * (2.0 / 16_777_216.0) - 1.0) * bound
}

impl ParamValues for SharedInit {
    fn values(&self, position: usize, shape: &[usize], range: core::ops::Range<usize>) -> Vec<f32> {
        if shape.len() < 2 {
            return vec![1.0; range.len()];
        }
        let bound = MATRIX_BOUND as f32;
        range
            .map(|i| uniform(shared_hash(self.seed, position as u64, i as u64), bound))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_spread_and_repeat() {
        let init = SharedInit { seed: 42 };
        let v = init.values(3, &[64, 1000], 0..64_000);
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 5e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 5e-4, "std {}", var.sqrt());
        assert!(v.iter().all(|x| x.abs() <= MATRIX_BOUND as f32));
        // A sub-range gives the same elements: ranks computing their chunks agree.
        assert_eq!(init.values(3, &[64, 1000], 500..700), v[500..700].to_vec());
        assert_ne!(init.values(4, &[64, 1000], 0..10), v[0..10].to_vec());
        assert_eq!(init.values(0, &[7], 0..7), vec![1.0; 7]);
    }

    #[test]
    fn hash_matches_the_python_peers() {
        // bench/shared_init.py's shared_hash for these inputs (Python integers here; its
        // torch int64 run on the device prints the same, bench/results logs): a change on
        // either side fails here.
        let got: Vec<u32> = [(0u64, 0u64), (1, 2), (7, 123_456_789), (290, 525_336_575)]
            .iter()
            .map(|&(p, i)| shared_hash(42, p, i))
            .collect();
        assert_eq!(got, PYTHON_HASHES);
    }

    /// `python3 bench/shared_init.py` prints these.
    const PYTHON_HASHES: [u32; 4] = [1540210286, 4038777201, 4145187155, 2771176828];
}
