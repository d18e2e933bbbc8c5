//! Small helpers of the benchmark programs: flags, deterministic inputs and timing.

/// The value after `flag` in `args`, if any.
pub fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// `n` deterministic values in [-1, 1) from `seed`, never zero (a zero input can hide a
/// kernel that skips work).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32) / (1u64 << 24) as f32 * 2.0 - 1.0;
            if v == 0.0 { 0.5 } else { v }
        })
        .collect()
}

/// Median wall seconds per call of `run` when `queue` calls go between syncs, over
/// `iterations` such queues (after one warm-up call): what a call costs in a stream of them, as
/// in training, where the host issues ahead of the device (no sync latency per call). The
/// queue's results are dropped after its sync.
pub fn queued_seconds<B: burn::tensor::backend::Backend, T>(
    device: &B::Device,
    iterations: usize,
    queue: usize,
    mut run: impl FnMut() -> T,
) -> f64 {
    drop(run());
    let queue = queue.max(1);
    let mut times = Vec::new();
    for _ in 0..iterations.max(1) {
        B::sync(device).expect("sync");
        let start = std::time::Instant::now();
        let results: Vec<T> = (0..queue).map(|_| run()).collect();
        B::sync(device).expect("sync");
        times.push(start.elapsed().as_secs_f64() / queue as f64);
        drop(results);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Median wall seconds of `run` over `iterations` (after one warm-up), each timed from a
/// synced `device` until its work is done (its result is dropped after the sync).
pub fn median_seconds<B: burn::tensor::backend::Backend, T>(
    device: &B::Device,
    iterations: usize,
    run: impl FnMut() -> T,
) -> f64 {
    queued_seconds::<B, T>(device, iterations, 1, run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_values() {
        let args: Vec<String> = ["bin", "--seq", "8"].map(String::from).to_vec();
        assert_eq!(arg(&args, "--seq").as_deref(), Some("8"));
        assert_eq!(arg(&args, "--hd"), None);
        let v = values(1000, 3);
        assert!(v.iter().all(|x| *x != 0.0 && (-1.0..1.0).contains(x)));
        assert_eq!(v, values(1000, 3));
    }
}
